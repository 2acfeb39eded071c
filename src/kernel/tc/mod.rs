//! The broadcast data plane: loads the TC skeleton (`src/bpf/aggbox_tc.bpf.c`),
//! attaches its egress and ingress programs to an interface (clsact), writes
//! group tables, reads counters, and plans broadcast trees for groups larger
//! than one table. See `docs/BROADCAST.md`.
//!
//! Map layout:
//!
//! | map            | type             | key                    | value                         | written by |
//! |----------------|------------------|------------------------|-------------------------------|------------|
//! | `bcast_groups` | hash             | [`abi::GroupKey`]      | [`abi::Group`]                | control plane |
//! | `bcast_neigh`  | LRU hash         | [`abi::NeighKey`]      | [`abi::Neigh`] + `bpf_timer`  | TC programs (timer marks stale) |
//! | `bcast_config` | array (1)        | `u32` 0                | [`abi::BcastConfig`]          | loader |
//! | `bcast_stats`  | per-CPU array    | `u32` [`abi::BcastStat`] | [`abi::Stat`]               | TC programs |
//! | `bcast_gstats` | per-CPU hash     | [`abi::GroupKey`]      | [`abi::BcastGroupStat`]       | control plane creates, TC adds |
//! | `result_routes`| hash             | [`abi::JobKey`]        | [`abi::ResultRoute`]          | control plane |
//!
//! The ingress program also routes the RESULT datagrams of the XDP
//! aggregator (`result_routes`): copies to a broadcast group (in-kernel
//! allreduce, [`TcPlane::set_result_route`]) and the upstream
//! contribution of an intermediate aggregator
//! ([`TcPlane::set_parent_route`]).
//!
//! Errors inside this module are typed ([`TcError`]).

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject, TcHook, TC_EGRESS, TC_INGRESS};

use crate::wire::abi;
use crate::kernel::maps::{self, names, Counter};

#[allow(clippy::all, missing_docs, dead_code)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/aggbox_tc.skel.rs"));
}
use skel::{AggboxTcSkel, AggboxTcSkelBuilder};

/// TC filter handle of both AggBox programs (fixed, so that a later
/// `aggbox detach` can find and remove them: [`detach_stale`]).
pub const TC_HANDLE: u32 = 0xa6b1;
/// TC filter priority of both AggBox programs.
pub const TC_PRIORITY: u32 = 0xa6b1;

/// TC verdicts (uapi `pkt_cls.h`).
pub const TC_ACT_OK: i32 = 0;
/// TC_ACT_SHOT.
pub const TC_ACT_SHOT: i32 = 2;
/// TC_ACT_REDIRECT.
pub const TC_ACT_REDIRECT: i32 = 7;

/// Errors of the broadcast loader.
#[derive(Debug, thiserror::Error)]
pub enum TcError {
    /// Opening, loading or verifying the BPF object failed.
    #[error("loading the TC broadcast programs: {0}")]
    Load(#[source] libbpf_rs::Error),
    /// A map operation failed.
    #[error("map `{map}`: {source}")]
    Map {
        /// Name of the map.
        map: &'static str,
        /// The libbpf error.
        #[source]
        source: libbpf_rs::Error,
    },
    /// Creating the clsact qdisc or attaching a filter failed.
    #[error("attaching TC {what} to ifindex {ifindex}: {source}")]
    Attach {
        /// What was being attached.
        what: &'static str,
        /// Interface index.
        ifindex: u32,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// IPv4 forwarding is off on the interface: bpf_fib_lookup() would
    /// return FWD_DISABLED for every destination.
    #[error(
        "IPv4 forwarding is off on {ifname} in this network namespace \
         (net.ipv4.conf.{ifname}.forwarding = 0): the broadcast program resolves next hops \
         with bpf_fib_lookup, which fails with FWD_DISABLED then; enable it with \
         `sysctl -w net.ipv4.ip_forward=1` (or net.ipv4.conf.{ifname}.forwarding=1)"
    )]
    ForwardingDisabled {
        /// Interface name.
        ifname: String,
    },
    /// Already attached / not attached / wrong namespace.
    #[error("{0}")]
    State(String),
    /// A RESULT route was rejected before touching any map.
    #[error("result route of job {job}: {reason}")]
    InvalidRoute {
        /// Job id.
        job: u16,
        /// What is wrong.
        reason: String,
    },
    /// A group table was rejected before touching any map.
    #[error("group {group}: {reason}")]
    InvalidGroup {
        /// Group id.
        group: u16,
        /// What is wrong.
        reason: String,
    },
    /// BPF_PROG_TEST_RUN failed.
    #[error("BPF_PROG_TEST_RUN: {0}")]
    TestRun(#[source] std::io::Error),
    /// Pinning failed.
    #[error(transparent)]
    Pin(#[from] maps::PinError),
    /// Some other OS error (reading sysctls, interface names).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Result type of this module.
pub type Result<T, E = TcError> = std::result::Result<T, E>;

fn map_err(map: &'static str) -> impl FnOnce(libbpf_rs::Error) -> TcError {
    move |source| TcError::Map { map, source }
}

/// Load-time options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BroadcastOptions {
    /// Lifetime of a next-hop cache entry: a bpf_timer marks it stale after
    /// this, and the next datagram re-resolves it. `Duration::ZERO` = never.
    pub neigh_ttl: Duration,
}

impl Default for BroadcastOptions {
    fn default() -> Self {
        BroadcastOptions {
            neigh_ttl: Duration::from_secs(u64::from(abi::BCAST_DEFAULT_NEIGH_TTL_S)),
        }
    }
}

/// Snapshot of `bcast_stats`, summed over CPUs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BroadcastStats {
    /// Every counter by its label ([`abi::BcastStat::label`]).
    pub counters: BTreeMap<&'static str, Counter>,
}

impl BroadcastStats {
    /// One counter.
    pub fn get(&self, stat: abi::BcastStat) -> Counter {
        self.counters.get(stat.label()).copied().unwrap_or_default()
    }

    /// Packets of one counter.
    pub fn packets(&self, stat: abi::BcastStat) -> u64 {
        self.get(stat).packets
    }

    /// Packets of every per-datagram outcome together (= packets the
    /// programs saw).
    pub fn datagrams(&self) -> u64 {
        abi::BcastStat::ALL
            .iter()
            .filter(|s| s.is_datagram_outcome())
            .map(|s| self.packets(*s))
            .sum()
    }
}

/// One entry of the next-hop cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeighEntry {
    /// Destination.
    pub addr: Ipv4Addr,
    /// Interface the lookup was made for.
    pub lookup_ifindex: u32,
    /// What the FIB said (MACs, egress interface, stale flag, time).
    pub neigh: abi::Neigh,
}

impl NeighEntry {
    /// Marked stale by its timer (re-resolved on next use).
    pub fn is_stale(&self) -> bool {
        self.neigh.flags & abi::NEIGH_F_STALE != 0
    }
}

/// Where an intermediate aggregator sends each RESULT of a job: upstream,
/// as its own contribution to the parent's job (config
/// `parent = { addr, port, job, rank }` plus the job's `result_port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParentRoute {
    /// The parent aggregator's IPv4 address.
    pub addr: Ipv4Addr,
    /// The parent job's contribution port (non-zero).
    pub port: u16,
    /// The job id at the parent.
    pub job: u16,
    /// This node's rank in the parent job (not 0xffff, the RESULT rank).
    pub rank: u16,
    /// The local job's `result_port`: the UDP port its RESULTs arrive on
    /// (where the XDP aggregator addresses them), non-zero.
    pub result_port: u16,
}

impl ParentRoute {
    /// The route of a configured job's `parent` (its `result_port` included).
    pub fn from_config(job: &crate::config::JobConfig, parent: &crate::config::ParentConfig) -> Self {
        ParentRoute {
            addr: parent.addr,
            port: parent.port,
            job: parent.job,
            rank: parent.rank,
            result_port: job.result_port,
        }
    }
}

/// Where the RESULTs of one job go besides the local result port, as
/// written in `result_routes` (see [`TcPlane::result_route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResultRouteInfo {
    /// UDP port the job's RESULTs arrive on.
    pub result_port: u16,
    /// Broadcast group whose members get a copy (allreduce), if any.
    pub group: Option<u16>,
    /// Parent aggregator (tree), if any.
    pub parent: Option<ParentRoute>,
}

/// Result of one BPF_PROG_TEST_RUN of a TC program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcRun {
    /// The TC verdict (`TC_ACT_*`).
    pub verdict: i32,
    /// The packet as the program left it.
    pub data: Vec<u8>,
    /// `skb->mark` after the run.
    pub mark: u32,
}

/// Which TC program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcProgram {
    /// `aggbox_tc_egress`: root broadcast.
    Egress,
    /// `aggbox_tc_ingress`: tree forwarding.
    Ingress,
}

#[derive(Debug)]
struct Attachment {
    ifindex: u32,
    netns_ino: u64,
    created_qdisc: bool,
    egress: TcHook,
    ingress: TcHook,
    /// `unres_qlen_bytes` of the interface before attach raised it (restored
    /// by detach), if attach changed it.
    unres_qlen_before: Option<u64>,
    /// The ingress program on `lo` as well ([`TcPlane::attach_lo_ingress`]).
    lo_ingress: Option<LoIngress>,
}

/// The ingress program's filter on `lo`, and whether its attach created
/// lo's clsact qdisc.
#[derive(Debug)]
struct LoIngress {
    ifindex: u32,
    created_qdisc: bool,
    ingress: TcHook,
}

/// Bytes the kernel may queue per unresolved next hop while attach holds the
/// interface (`net.ipv4.neigh.<iface>.unres_qlen_bytes`; the kernel's default
/// is 212,992). Cold next hops take the neighbour path (docs/BROADCAST.md
/// "Cold next hops"): copies wait in that queue until ARP answers, which
/// takes `retrans_time_ms` (1 s) more when a probe is lost, as a cold tree's
/// burst of ARP requests can make happen; the queue drops the oldest past its
/// limit, i.e. the first datagrams. 4 MiB holds 64 copies of 64 KiB datagrams
/// per next hop.
pub const UNRES_QLEN_BYTES: u64 = 4 << 20;

fn unres_qlen_path(ifindex: u32) -> Result<String> {
    Ok(format!("/proc/sys/net/ipv4/neigh/{}/unres_qlen_bytes", ifname(ifindex)?))
}

/// Raise the interface's unresolved-neighbour queue to [`UNRES_QLEN_BYTES`]
/// when it is smaller; returns the value it had if it was changed.
fn raise_unres_qlen(ifindex: u32) -> Result<Option<u64>> {
    let path = unres_qlen_path(ifindex)?;
    let io = |context: String| move |source| TcError::Io { context, source };
    let text = std::fs::read_to_string(&path).map_err(io(format!("reading {path}")))?;
    let before: u64 = text.trim().parse().map_err(|_| TcError::Io {
        context: format!("reading {path}"),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not a number: {:?}", text.trim())),
    })?;
    if before >= UNRES_QLEN_BYTES {
        return Ok(None);
    }
    std::fs::write(&path, UNRES_QLEN_BYTES.to_string()).map_err(io(format!("writing {path}")))?;
    Ok(Some(before))
}

/// The loaded broadcast object: TC programs and maps, and where they are
/// attached.
pub struct TcPlane {
    attachment: Option<Attachment>,
    // Field order matters: the skeleton borrows `_object` and must drop first.
    skel: AggboxTcSkel<'static>,
    _object: Box<MaybeUninit<OpenObject>>,
}

// SAFETY: the skeleton holds a libbpf object (heap memory and file
// descriptors) with no thread affinity; libbpf-rs marks `Object` and
// `OpenObject` Send likewise. Mutation goes through `&mut self`.
unsafe impl Send for TcPlane {}
// SAFETY: every `&self` method only reads the skeleton's program/map
// descriptors and makes syscalls on them (map lookups/updates, test runs),
// which the kernel serialises; nothing is mutated through `&self`.
unsafe impl Sync for TcPlane {}

impl std::fmt::Debug for TcPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcPlane")
            .field("attachment", &self.attachment)
            .finish_non_exhaustive()
    }
}

impl TcPlane {
    /// Open and load (verify) the TC skeleton with default options (next-hop
    /// cache lifetime 3600 s). Needs root (CAP_BPF + CAP_NET_ADMIN).
    pub fn load() -> Result<Self> {
        Self::load_with(&BroadcastOptions::default())
    }

    /// Open and load with `options`.
    pub fn load_with(options: &BroadcastOptions) -> Result<Self> {
        let mut object: Box<MaybeUninit<OpenObject>> = Box::new(MaybeUninit::uninit());
        // SAFETY: the box's heap allocation never moves and lives as long as
        // `TcPlane`, whose field order drops the skeleton before the
        // box; no other reference to the allocation is ever created.
        let object_ref: &'static mut MaybeUninit<OpenObject> =
            unsafe { &mut *(object.as_mut() as *mut MaybeUninit<OpenObject>) };
        let open = AggboxTcSkelBuilder::default()
            .open(object_ref)
            .map_err(TcError::Load)?;
        let skel = open.load().map_err(TcError::Load)?;
        let plane = TcPlane {
            attachment: None,
            skel,
            _object: object,
        };
        plane.set_neigh_ttl(options.neigh_ttl)?;
        Ok(plane)
    }

    /// Change the next-hop cache lifetime. Applies to entries resolved from
    /// now on (an entry's timer is armed when it is resolved).
    pub fn set_neigh_ttl(&self, ttl: Duration) -> Result<()> {
        let cfg = abi::BcastConfig {
            neigh_ttl_ns: u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX),
        };
        self.skel
            .maps
            .bcast_config
            .update(&0u32.to_ne_bytes(), abi::as_bytes(&cfg), MapFlags::ANY)
            .map_err(map_err(names::BCAST_CONFIG))
    }

    /// Drop every next-hop cache entry (the next datagrams re-resolve).
    pub fn flush_neigh_cache(&self) -> Result<()> {
        maps::delete_where::<abi::NeighKey>(&self.skel.maps.bcast_neigh, |_| true).map_err(map_err(names::BCAST_NEIGH))
    }

    /// The next-hop cache.
    pub fn neigh_cache(&self) -> Result<Vec<NeighEntry>> {
        let entries = maps::entries::<abi::NeighKey, abi::Neigh>(&self.skel.maps.bcast_neigh).map_err(map_err(names::BCAST_NEIGH))?;
        Ok(entries
            .into_iter()
            .map(|(key, neigh)| NeighEntry {
                addr: Ipv4Addr::from(u32::from_be(key.addr)),
                lookup_ifindex: key.ifindex,
                neigh,
            })
            .collect())
    }

    /// Attach the egress (root broadcast) and ingress (tree forwarding)
    /// programs to `ifindex` in the calling thread's network namespace.
    /// Creates the clsact qdisc only if absent and remembers whether it did.
    /// Refuses with [`TcError::ForwardingDisabled`] when IPv4
    /// forwarding is off on the interface. A stale AggBox filter (same
    /// handle and priority) is replaced. Raises the interface's
    /// unresolved-neighbour queue to [`UNRES_QLEN_BYTES`] while attached
    /// (restored by detach), so copies to cold next hops survive a lost ARP
    /// probe.
    pub fn attach(&mut self, ifindex: u32) -> Result<()> {
        if let Some(a) = &self.attachment {
            return Err(TcError::State(format!(
                "already attached to ifindex {}",
                a.ifindex
            )));
        }
        check_ip_forward(ifindex)?;
        let netns_ino = current_netns_ino()?;
        let unres_qlen_before = raise_unres_qlen(ifindex)?;
        let restore_unres_qlen = || {
            if let (Some(before), Ok(path)) = (unres_qlen_before, unres_qlen_path(ifindex)) {
                let _ = std::fs::write(path, before.to_string());
            }
        };

        // clsact: create it only if absent, and remember.
        // SAFETY: zeroed bpf_tc_hook with sz set is what libbpf expects.
        let mut raw: libbpf_sys::bpf_tc_hook = unsafe { std::mem::zeroed() };
        raw.sz = std::mem::size_of::<libbpf_sys::bpf_tc_hook>() as _;
        raw.ifindex = ifindex as i32;
        raw.attach_point = libbpf_sys::BPF_TC_INGRESS | libbpf_sys::BPF_TC_EGRESS;
        // SAFETY: valid hook struct.
        let rc = unsafe { libbpf_sys::bpf_tc_hook_create(&mut raw) };
        let created_qdisc = match rc {
            0 => true,
            rc if -rc == libc::EEXIST => false,
            rc => {
                restore_unres_qlen();
                return Err(TcError::Attach {
                    what: "clsact qdisc",
                    ifindex,
                    source: std::io::Error::from_raw_os_error(-rc),
                });
            }
        };

        let hook = |fd: BorrowedFd<'_>, point| {
            let mut h = TcHook::new(fd);
            h.ifindex(ifindex as i32)
                .attach_point(point)
                .handle(TC_HANDLE)
                .priority(TC_PRIORITY)
                .replace(true);
            h
        };
        let mut egress = hook(self.skel.progs.aggbox_tc_egress.as_fd(), TC_EGRESS);
        let mut ingress = hook(self.skel.progs.aggbox_tc_ingress.as_fd(), TC_INGRESS);
        let undo_qdisc = |created: bool| {
            if created {
                let mut all = TcHook::new(self.skel.progs.aggbox_tc_egress.as_fd());
                all.ifindex(ifindex as i32)
                    .attach_point(libbpf_sys::BPF_TC_INGRESS | libbpf_sys::BPF_TC_EGRESS);
                let _ = all.destroy();
            }
        };
        if let Err(e) = egress.attach() {
            undo_qdisc(created_qdisc);
            restore_unres_qlen();
            return Err(TcError::Attach {
                what: "egress program",
                ifindex,
                source: to_io(e),
            });
        }
        if let Err(e) = ingress.attach() {
            let _ = egress.detach();
            undo_qdisc(created_qdisc);
            restore_unres_qlen();
            return Err(TcError::Attach {
                what: "ingress program",
                ifindex,
                source: to_io(e),
            });
        }
        self.attachment = Some(Attachment {
            ifindex,
            netns_ino,
            created_qdisc,
            egress,
            ingress,
            unres_qlen_before,
            lo_ingress: None,
        });
        Ok(())
    }

    /// Attach the ingress program to `lo` (`lo_ifindex`) too, after
    /// [`attach`](Self::attach) and in its namespace. A worker on this host
    /// sends its contributions to the node's own address, through lo, where
    /// `aggbox attach` runs the XDP program as well; when its contribution
    /// is a fragment's last, the RESULT passes up lo's stack and the ingress
    /// program on the interface never sees it, so without this one its
    /// result-group copies are not made. The copies it makes for members on
    /// this host go into lo's ingress again carrying the copy mark, which it
    /// passes. Creates lo's clsact qdisc only if absent; [`detach`](Self::detach)
    /// removes both. Refuses with [`TcError::ForwardingDisabled`] when IPv4
    /// forwarding is off on lo (the next-hop lookups name lo as the input
    /// interface).
    pub fn attach_lo_ingress(&mut self, lo_ifindex: u32) -> Result<()> {
        let ingress_fd = self.skel.progs.aggbox_tc_ingress.as_fd();
        let Some(a) = self.attachment.as_mut() else {
            return Err(TcError::State("attach_lo_ingress before attach".into()));
        };
        if a.lo_ingress.is_some() {
            return Ok(());
        }
        check_ip_forward(lo_ifindex)?;
        // SAFETY: zeroed bpf_tc_hook with sz set is what libbpf expects.
        let mut raw: libbpf_sys::bpf_tc_hook = unsafe { std::mem::zeroed() };
        raw.sz = std::mem::size_of::<libbpf_sys::bpf_tc_hook>() as _;
        raw.ifindex = lo_ifindex as i32;
        raw.attach_point = libbpf_sys::BPF_TC_INGRESS | libbpf_sys::BPF_TC_EGRESS;
        // SAFETY: valid hook struct.
        let created_qdisc = match unsafe { libbpf_sys::bpf_tc_hook_create(&mut raw) } {
            0 => true,
            rc if -rc == libc::EEXIST => false,
            rc => {
                return Err(TcError::Attach {
                    what: "clsact qdisc on lo",
                    ifindex: lo_ifindex,
                    source: std::io::Error::from_raw_os_error(-rc),
                })
            }
        };
        let mut ingress = TcHook::new(ingress_fd);
        ingress
            .ifindex(lo_ifindex as i32)
            .attach_point(TC_INGRESS)
            .handle(TC_HANDLE)
            .priority(TC_PRIORITY)
            .replace(true);
        if let Err(e) = ingress.attach() {
            if created_qdisc {
                let _ = destroy_clsact(ingress_fd, lo_ifindex);
            }
            return Err(TcError::Attach {
                what: "ingress program on lo",
                ifindex: lo_ifindex,
                source: to_io(e),
            });
        }
        a.lo_ingress = Some(LoIngress {
            ifindex: lo_ifindex,
            created_qdisc,
            ingress,
        });
        Ok(())
    }

    /// Whether the ingress program is on lo too, and whether its attach
    /// created lo's clsact qdisc.
    pub fn lo_ingress(&self) -> Option<bool> {
        self.attachment.as_ref()?.lo_ingress.as_ref().map(|l| l.created_qdisc)
    }

    /// Where the programs are attached: `(ifindex, created the clsact qdisc)`.
    pub fn attached(&self) -> Option<(u32, bool)> {
        self.attachment.as_ref().map(|a| (a.ifindex, a.created_qdisc))
    }

    /// Remove what [`attach`](Self::attach) created: both filters, and the
    /// clsact qdisc if attach created it. Must run in the network namespace
    /// attach ran in. No-op when not attached.
    pub fn detach(&mut self) -> Result<()> {
        let Some(a) = self.attachment.as_mut() else {
            return Ok(());
        };
        if current_netns_ino()? != a.netns_ino {
            return Err(TcError::State(format!(
                "detach must run in the network namespace attach ran in (ifindex {})",
                a.ifindex
            )));
        }
        let ifindex = a.ifindex;
        let mut first_err = None;
        if let Some(mut lo) = a.lo_ingress.take() {
            if let Err(e) = lo.ingress.detach() {
                let e = to_io(e);
                if e.raw_os_error() != Some(libc::ENOENT) {
                    first_err.get_or_insert(TcError::Attach {
                        what: "ingress program on lo",
                        ifindex: lo.ifindex,
                        source: e,
                    });
                }
            }
            if lo.created_qdisc {
                if let Err(e) = destroy_clsact(self.skel.progs.aggbox_tc_ingress.as_fd(), lo.ifindex) {
                    first_err.get_or_insert(e);
                }
            }
        }
        for (what, hook) in [("egress program", &mut a.egress), ("ingress program", &mut a.ingress)] {
            if let Err(e) = hook.detach() {
                let e = to_io(e);
                if e.raw_os_error() != Some(libc::ENOENT) {
                    first_err.get_or_insert(TcError::Attach {
                        what,
                        ifindex,
                        source: e,
                    });
                }
            }
        }
        if a.created_qdisc {
            if let Err(e) = destroy_clsact(self.skel.progs.aggbox_tc_egress.as_fd(), ifindex) {
                first_err.get_or_insert(e);
            }
        }
        if let Some(before) = a.unres_qlen_before {
            let restored = unres_qlen_path(ifindex).and_then(|path| {
                std::fs::write(&path, before.to_string())
                    .map_err(|source| TcError::Io { context: format!("writing {path}"), source })
            });
            if let Err(e) = restored {
                first_err.get_or_insert(e);
            }
        }
        self.attachment = None;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Write the root table of group `id`: mask bit i goes to `members[i]`
    /// (1..=32 members). Also the table a tree node uses for FORWARD
    /// datagrams of `id` arriving on any port.
    pub fn set_group(&self, id: u16, members: &[SocketAddrV4]) -> Result<()> {
        self.write_group(id, abi::BCAST_PORT_ANY, members)
    }

    /// Write a tree node's table: FORWARD datagrams of group `id` arriving
    /// on UDP port `receive_port` (this node's own member port, non-zero)
    /// are re-broadcast to `children` with hops + 1.
    pub fn set_forwarding(&self, id: u16, receive_port: u16, children: &[SocketAddrV4]) -> Result<()> {
        if receive_port == 0 {
            return Err(TcError::InvalidGroup {
                group: id,
                reason: "forwarding table for port 0: use set_group".into(),
            });
        }
        self.write_group(id, receive_port, children)
    }

    fn write_group(&self, id: u16, port: u16, members: &[SocketAddrV4]) -> Result<()> {
        let bad = |reason: String| TcError::InvalidGroup { group: id, reason };
        if members.is_empty() || members.len() > abi::BCAST_MAX_DESTS as usize {
            return Err(bad(format!(
                "{} destinations; a table has 1..={}",
                members.len(),
                abi::BCAST_MAX_DESTS
            )));
        }
        if let Some(m) = members.iter().find(|m| m.port() == 0 || m.ip().is_unspecified()) {
            return Err(bad(format!("destination {m} has no address or port")));
        }
        let mut value = abi::Group {
            count: members.len() as u32,
            ..Default::default()
        };
        for (d, m) in value.dests.iter_mut().zip(members) {
            d.addr = u32::from_ne_bytes(m.ip().octets());
            d.port = m.port().to_be();
        }
        let key = abi::GroupKey { group: id, port };
        // counters first, so the programs find them with the table
        let zeros = vec![vec![0u8; std::mem::size_of::<abi::BcastGroupStat>()]; num_possible_cpus()?];
        match self
            .skel
            .maps
            .bcast_gstats
            .update_percpu(abi::as_bytes(&key), &zeros, MapFlags::NO_EXIST)
        {
            Ok(()) => {}
            Err(e) if e.kind() == libbpf_rs::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(map_err(names::BCAST_GSTATS)(e)),
        }
        self.skel
            .maps
            .bcast_groups
            .update(abi::as_bytes(&key), abi::as_bytes(&value), MapFlags::ANY)
            .map_err(map_err(names::BCAST_GROUPS))
    }

    /// Remove every table of group `id` (root and forwarding) and its
    /// counters. No-op if unknown.
    pub fn remove_group(&self, id: u16) -> Result<()> {
        for (map, name) in [
            (&self.skel.maps.bcast_groups, names::BCAST_GROUPS),
            (&self.skel.maps.bcast_gstats, names::BCAST_GSTATS),
        ] {
            maps::delete_where::<abi::GroupKey>(map, |k| k.group == id).map_err(map_err(name))?;
        }
        Ok(())
    }

    /// The table of `(id, port)` as written (port 0 = root table).
    pub fn group(&self, id: u16, port: u16) -> Result<Option<Vec<SocketAddrV4>>> {
        let key = abi::GroupKey { group: id, port };
        let raw = self
            .skel
            .maps
            .bcast_groups
            .lookup(abi::as_bytes(&key), MapFlags::ANY)
            .map_err(map_err(names::BCAST_GROUPS))?;
        Ok(raw.and_then(|b| abi::from_bytes::<abi::Group>(&b)).map(|g| {
            g.dests
                .iter()
                .take(g.count.min(abi::BCAST_MAX_DESTS) as usize)
                .map(|d| SocketAddrV4::new(Ipv4Addr::from(d.addr.to_ne_bytes()), u16::from_be(d.port)))
                .collect()
        }))
    }

    /// In-kernel allreduce: each RESULT of `job` that arrives (from the XDP
    /// aggregator) at this interface, addressed to this host, UDP port
    /// `result_port`, is also copied to every member of broadcast group
    /// `group` (its root table, written with [`set_group`](Self::set_group);
    /// the mask covers all members): destination address, port and next-hop
    /// MAC written in, IPv4 source = this host's address (the RESULT's
    /// destination), AGG1 header and payload unchanged, checksums valid (a
    /// UDP checksum of 0 stays 0). The RESULT itself is still delivered to
    /// the local stack unchanged. Keeps a parent route of the job (then the
    /// RESULT goes upstream instead of to the local stack).
    pub fn set_result_route(&self, job: u16, result_port: u16, group: u16) -> Result<()> {
        let mut route = self.route_for_update(job, result_port)?;
        route.group = group;
        route.flags |= abi::ROUTE_F_GROUP;
        self.write_route(job, &route)
    }

    /// Multi-level aggregation: each RESULT of `job` arriving at
    /// `parent.result_port` is rewritten into this node's contribution to
    /// the parent's job (job = `parent.job`, rank = `parent.rank`, RESULT
    /// flag cleared, LAST_FRAGMENT and OVERFLOW kept, seq/round/frag_off/op/
    /// count/payload unchanged; IPv4 source = this host's address,
    /// destination = `parent.addr`, UDP port `parent.port`, next-hop MACs from
    /// the FIB) and sent out; it is not delivered locally. A result group
    /// of the job ([`set_result_route`](Self::set_result_route)) still gets
    /// its copies (of the RESULT, before the rewrite).
    pub fn set_parent_route(&self, job: u16, parent: &ParentRoute) -> Result<()> {
        let bad = |reason: String| TcError::InvalidRoute { job, reason };
        if parent.port == 0 {
            return Err(bad("the parent's port is 0".into()));
        }
        if parent.rank == abi::RESULT_RANK {
            return Err(bad(format!("rank {} is the RESULT rank, not a contributor's", parent.rank)));
        }
        if parent.addr.is_unspecified() || parent.addr.is_broadcast() || parent.addr.is_multicast() {
            return Err(bad(format!("parent address {} is not unicast", parent.addr)));
        }
        let mut route = self.route_for_update(job, parent.result_port)?;
        route.parent_addr = u32::from_ne_bytes(parent.addr.octets());
        route.parent_port = parent.port.to_be();
        route.parent_job = parent.job;
        route.parent_rank = parent.rank;
        route.flags |= abi::ROUTE_F_PARENT;
        self.write_route(job, &route)
    }

    /// Remove every route of `job` (result group and parent): its RESULTs
    /// only go to the local result port again. No-op if none.
    pub fn remove_result_route(&self, job: u16) -> Result<()> {
        let key = abi::JobKey { job, pad: 0 };
        delete_ignore_missing(&self.skel.maps.result_routes, names::RESULT_ROUTES, abi::as_bytes(&key))
    }

    /// Remove only the parent route of `job` (its result group stays).
    pub fn remove_parent_route(&self, job: u16) -> Result<()> {
        let Some(mut route) = self.raw_route(job)? else {
            return Ok(());
        };
        route.flags &= !abi::ROUTE_F_PARENT;
        route.parent_addr = 0;
        route.parent_port = 0;
        route.parent_job = 0;
        route.parent_rank = 0;
        if route.flags & abi::ROUTE_F_KNOWN == 0 {
            return self.remove_result_route(job);
        }
        self.write_route(job, &route)
    }

    /// The routes of `job` as written, `None` if it has none.
    pub fn result_route(&self, job: u16) -> Result<Option<ResultRouteInfo>> {
        Ok(self.raw_route(job)?.map(|r| ResultRouteInfo {
            result_port: r.result_port,
            group: (r.flags & abi::ROUTE_F_GROUP != 0).then_some(r.group),
            parent: (r.flags & abi::ROUTE_F_PARENT != 0).then(|| ParentRoute {
                addr: Ipv4Addr::from(r.parent_addr.to_ne_bytes()),
                port: u16::from_be(r.parent_port),
                job: r.parent_job,
                rank: r.parent_rank,
                result_port: r.result_port,
            }),
        }))
    }

    fn raw_route(&self, job: u16) -> Result<Option<abi::ResultRoute>> {
        let key = abi::JobKey { job, pad: 0 };
        let raw = self
            .skel
            .maps
            .result_routes
            .lookup(abi::as_bytes(&key), MapFlags::ANY)
            .map_err(map_err(names::RESULT_ROUTES))?;
        Ok(raw.and_then(|b| abi::from_bytes::<abi::ResultRoute>(&b)))
    }

    /// The job's current route (or a fresh one) for an update naming
    /// `result_port`, which must agree with a route already there.
    fn route_for_update(&self, job: u16, result_port: u16) -> Result<abi::ResultRoute> {
        if result_port == 0 {
            return Err(TcError::InvalidRoute {
                job,
                reason: "result port 0".into(),
            });
        }
        match self.raw_route(job)? {
            Some(r) if r.result_port != result_port => Err(TcError::InvalidRoute {
                job,
                reason: format!(
                    "result port {result_port} differs from the route's {} (remove_result_route first)",
                    r.result_port
                ),
            }),
            Some(r) => Ok(r),
            None => Ok(abi::ResultRoute {
                result_port,
                ..Default::default()
            }),
        }
    }

    fn write_route(&self, job: u16, route: &abi::ResultRoute) -> Result<()> {
        let key = abi::JobKey { job, pad: 0 };
        self.skel
            .maps
            .result_routes
            .update(abi::as_bytes(&key), abi::as_bytes(route), MapFlags::ANY)
            .map_err(map_err(names::RESULT_ROUTES))
    }

    /// Read `bcast_stats`, every counter summed over CPUs.
    pub fn stats(&self) -> Result<BroadcastStats> {
        let map = &self.skel.maps.bcast_stats;
        let mut stats = BroadcastStats::default();
        for stat in abi::BcastStat::ALL {
            let sum: abi::Stat = maps::percpu_array_sum(map, stat as u32).map_err(map_err(names::BCAST_STATS))?;
            stats.counters.insert(stat.label(), Counter::from(sum));
        }
        Ok(stats)
    }

    /// Per-group counters of table `(id, port)`, summed over CPUs.
    pub fn group_stats(&self, id: u16, port: u16) -> Result<Option<abi::BcastGroupStat>> {
        let key = abi::GroupKey { group: id, port };
        maps::lookup_percpu_sum(&self.skel.maps.bcast_gstats, abi::as_bytes(&key)).map_err(map_err(names::BCAST_GSTATS))
    }

    /// Pin every map of the object as `dir/<map name>` (`dir` must exist on
    /// a bpffs). Internal maps (`.bss`, `.rodata`, ...) are skipped. The
    /// names (`bcast_*`) do not collide with the XDP object's.
    pub fn pin_maps(&self, dir: &Path) -> Result<()> {
        use libbpf_rs::skel::Skel;
        Ok(maps::pin_object_maps(self.skel.object(), dir)?)
    }

    /// File descriptor of one of the programs.
    pub fn prog_fd(&self, prog: TcProgram) -> BorrowedFd<'_> {
        match prog {
            TcProgram::Egress => self.skel.progs.aggbox_tc_egress.as_fd(),
            TcProgram::Ingress => self.skel.progs.aggbox_tc_ingress.as_fd(),
        }
    }

    /// Run one program once on `frame` with BPF_PROG_TEST_RUN. `ifindex`
    /// (> 1) makes the test skb belong to that device (else loopback);
    /// `mark` is its `skb->mark`. Copies the program clones are really sent
    /// (to the device the next hop says): run this only inside a namespace
    /// that contains them (the tests use a testbed host).
    pub fn test_run(&self, prog: TcProgram, frame: &[u8], ifindex: u32, mark: u32) -> Result<TcRun> {
        let fd = self.prog_fd(prog).as_raw_fd();
        let mut out = vec![0u8; frame.len() + 256];
        // __sk_buff prefix: mark at byte 8, ifindex at byte 40 (uapi bpf.h).
        let mut ctx_in = [0u32; 12];
        ctx_in[2] = mark;
        ctx_in[10] = ifindex;
        let mut ctx_out = [0u32; 64];
        // SAFETY: zeroed opts are valid; sz set; buffers outlive the call.
        let mut opts: libbpf_sys::bpf_test_run_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _;
        opts.data_in = frame.as_ptr().cast();
        opts.data_size_in = frame.len() as u32;
        opts.data_out = out.as_mut_ptr().cast();
        opts.data_size_out = out.len() as u32;
        opts.ctx_in = ctx_in.as_ptr().cast();
        opts.ctx_size_in = std::mem::size_of_val(&ctx_in) as u32;
        opts.ctx_out = ctx_out.as_mut_ptr().cast();
        opts.ctx_size_out = std::mem::size_of_val(&ctx_out) as u32;
        opts.repeat = 1;
        // SAFETY: valid program fd and opts pointing at live buffers.
        let rc = unsafe { libbpf_sys::bpf_prog_test_run_opts(fd, &mut opts) };
        if rc < 0 {
            return Err(TcError::TestRun(std::io::Error::from_raw_os_error(-rc)));
        }
        out.truncate(opts.data_size_out as usize);
        Ok(TcRun {
            verdict: opts.retval as i32,
            data: out,
            mark: ctx_out[2],
        })
    }
}

impl Drop for TcPlane {
    /// Detaches when still attached and dropped in the namespace it was
    /// attached in; elsewhere the filters stay (use [`detach_stale`] or let
    /// the namespace go).
    fn drop(&mut self) {
        if let Some(a) = &self.attachment {
            if current_netns_ino().ok() == Some(a.netns_ino) {
                let _ = self.detach();
            }
        }
    }
}

/// Remove the clsact qdisc of `ifindex` (with whatever filters it holds);
/// gone already is fine. `fd`: any of the plane's programs (libbpf's hook
/// wants one).
fn destroy_clsact(fd: BorrowedFd<'_>, ifindex: u32) -> Result<()> {
    let mut all = TcHook::new(fd);
    all.ifindex(ifindex as i32)
        .attach_point(libbpf_sys::BPF_TC_INGRESS | libbpf_sys::BPF_TC_EGRESS);
    match all.destroy() {
        Ok(()) => Ok(()),
        Err(e) => {
            let e = to_io(e);
            if e.raw_os_error() == Some(libc::ENOENT) || e.raw_os_error() == Some(libc::EINVAL) {
                Ok(())
            } else {
                Err(TcError::Attach {
                    what: "clsact qdisc (removing)",
                    ifindex,
                    source: e,
                })
            }
        }
    }
}

/// Remove AggBox TC filters (handle [`TC_HANDLE`], priority
/// [`TC_PRIORITY`]) from `ifindex` in the calling thread's namespace, e.g.
/// after `kill -9`. Leaves the clsact qdisc (another process's state may
/// use it). Returns how many filters were removed.
pub fn detach_stale(ifindex: u32) -> Result<usize> {
    let mut removed = 0;
    for point in [libbpf_sys::BPF_TC_EGRESS, libbpf_sys::BPF_TC_INGRESS] {
        // SAFETY: zeroed structs with sz set, as libbpf expects.
        let mut hook: libbpf_sys::bpf_tc_hook = unsafe { std::mem::zeroed() };
        hook.sz = std::mem::size_of::<libbpf_sys::bpf_tc_hook>() as _;
        hook.ifindex = ifindex as i32;
        hook.attach_point = point;
        let mut opts: libbpf_sys::bpf_tc_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_tc_opts>() as _;
        opts.handle = TC_HANDLE;
        opts.priority = TC_PRIORITY;
        // SAFETY: valid structs.
        let rc = unsafe { libbpf_sys::bpf_tc_detach(&hook, &opts) };
        match rc {
            0 => removed += 1,
            rc if -rc == libc::ENOENT || -rc == libc::EINVAL => {}
            rc => {
                return Err(TcError::Attach {
                    what: "stale filter (removing)",
                    ifindex,
                    source: std::io::Error::from_raw_os_error(-rc),
                })
            }
        }
    }
    Ok(removed)
}

/// Fail with [`TcError::ForwardingDisabled`] unless IPv4 forwarding
/// is on for `ifindex` in the calling thread's network namespace.
pub fn check_ip_forward(ifindex: u32) -> Result<()> {
    let ifname = ifname(ifindex)?;
    let path = format!("/proc/sys/net/ipv4/conf/{ifname}/forwarding");
    let text = std::fs::read_to_string(&path).map_err(|source| TcError::Io {
        context: format!("reading {path}"),
        source,
    })?;
    if text.trim() == "1" {
        Ok(())
    } else {
        Err(TcError::ForwardingDisabled { ifname })
    }
}

/// Whether copies for a member on this very host can be delivered at the
/// root: such a copy is looped into lo's ingress carrying this host's own
/// source address, which the stack drops as martian unless
/// `net.ipv4.conf.lo.accept_local=1` (calling thread's namespace). Forwarding
/// nodes do not need it (their copies keep the root's source). The error
/// says how to fix it; call this when a root table lists a local address.
pub fn check_local_delivery() -> Result<()> {
    let path = "/proc/sys/net/ipv4/conf/lo/accept_local";
    let text = std::fs::read_to_string(path).map_err(|source| TcError::Io {
        context: format!("reading {path}"),
        source,
    })?;
    if text.trim() == "1" {
        Ok(())
    } else {
        Err(TcError::State(
            "a broadcast group lists a member on this host, but net.ipv4.conf.lo.accept_local = 0: \
             its copies (looped through lo with this host's own source address) would be dropped \
             as martian; enable it with `sysctl -w net.ipv4.conf.lo.accept_local=1`"
                .into(),
        ))
    }
}

/// Name of interface `ifindex` in the calling thread's namespace.
pub fn ifname(ifindex: u32) -> Result<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return Err(TcError::Io {
            context: format!("no interface with index {ifindex} in this network namespace"),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into buf.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

/// Index of interface `name` in the calling thread's namespace.
pub fn ifindex(name: &str) -> Result<u32> {
    let cname = std::ffi::CString::new(name).map_err(|_| TcError::Io {
        context: format!("interface name {name:?}"),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in name"),
    })?;
    // SAFETY: NUL-terminated name.
    let idx = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if idx == 0 {
        return Err(TcError::Io {
            context: format!("no interface {name} in this network namespace"),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(idx)
}

fn current_netns_ino() -> Result<u64> {
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| m.ino())
        .map_err(|source| TcError::Io {
            context: "reading /proc/thread-self/ns/net".into(),
            source,
        })
}

fn num_possible_cpus() -> Result<usize> {
    libbpf_rs::num_possible_cpus().map_err(|e| TcError::Io {
        context: "counting possible CPUs".into(),
        source: to_io(e),
    })
}

fn to_io(e: libbpf_rs::Error) -> std::io::Error {
    let kind = e.kind();
    let text = e.to_string();
    // libbpf-rs keeps the errno in its message; recover the common ones.
    let errno = match kind {
        libbpf_rs::ErrorKind::NotFound => Some(libc::ENOENT),
        libbpf_rs::ErrorKind::AlreadyExists => Some(libc::EEXIST),
        libbpf_rs::ErrorKind::PermissionDenied => Some(libc::EPERM),
        libbpf_rs::ErrorKind::InvalidInput => Some(libc::EINVAL),
        _ => None,
    };
    match errno {
        Some(n) => std::io::Error::from_raw_os_error(n),
        None => std::io::Error::other(text),
    }
}

fn delete_ignore_missing<M: MapCore>(map: &M, name: &'static str, key: &[u8]) -> Result<()> {
    maps::delete_if_present(map, key).map_err(|source| TcError::Map { map: name, source })
}

// ---------------------------------------------------------------------------
// Tree planner
// ---------------------------------------------------------------------------

/// A node of a broadcast tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TreeNode {
    /// The sender: its table is the group's root table (port 0).
    Root,
    /// A member that forwards: its table is keyed by its own port.
    Member(SocketAddrV4),
}

/// What one node of a broadcast tree does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlan {
    /// The node.
    pub node: TreeNode,
    /// Depth: 0 for the root, 1 for its children, ...
    pub level: usize,
    /// Who it sends (root) or forwards (member) to: mask bit i = `children[i]`.
    pub children: Vec<SocketAddrV4>,
}

impl NodePlan {
    /// Port of this node's `bcast_groups` key: 0 for the root, the member's
    /// own port for a forwarding member.
    pub fn table_port(&self) -> u16 {
        match self.node {
            TreeNode::Root => abi::BCAST_PORT_ANY,
            TreeNode::Member(m) => m.port(),
        }
    }

    /// The AGB1 mask that reaches every child (what the root sends with).
    pub fn full_mask(&self) -> u32 {
        match self.children.len() {
            0 => 0,
            n if n >= 32 => u32::MAX,
            n => (1u32 << n) - 1,
        }
    }

    /// Write this node's table into `plane` (the plane of the node's host).
    pub fn apply(&self, plane: &TcPlane, group: u16) -> Result<()> {
        match self.node {
            TreeNode::Root => plane.set_group(group, &self.children),
            TreeNode::Member(m) => plane.set_forwarding(group, m.port(), &self.children),
        }
    }
}

/// Plan a broadcast tree over `members` with at most `fanout` children per
/// node (clamped to 1..=32): the root sends to the first `fanout` members,
/// member j forwards to members `fanout + j·fanout ..`, breadth first, so
/// the depth is the least possible, ⌈log_fanout⌉-ish. Returns the root's
/// plan first, then every member that has children, in member order.
/// Leaves need no table. The root sends with FORWARD set when the tree has
/// more than one level.
pub fn plan_tree(members: &[SocketAddrV4], fanout: usize) -> Vec<NodePlan> {
    let fanout = fanout.clamp(1, abi::BCAST_MAX_DESTS as usize);
    let n = members.len();
    let mut plans = vec![NodePlan {
        node: TreeNode::Root,
        level: 0,
        children: members[..fanout.min(n)].to_vec(),
    }];
    // level of member j: root's children are level 1
    let mut level = vec![1usize; n];
    for j in 0..n {
        let start = fanout + j * fanout;
        if start >= n {
            break;
        }
        let end = (start + fanout).min(n);
        for k in start..end {
            level[k] = level[j] + 1;
        }
        plans.push(NodePlan {
            node: TreeNode::Member(members[j]),
            level: level[j],
            children: members[start..end].to_vec(),
        });
    }
    plans
}
