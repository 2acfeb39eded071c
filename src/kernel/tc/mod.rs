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
//!
//! One file per idea: this one loads the object ([`TcPlane`]) and reads its
//! counters; `attach.rs` attaches and detaches the programs, `groups.rs`
//! writes group tables and reads the next-hop cache, `routes.rs` writes
//! RESULT routes, `tree.rs` plans broadcast trees.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use crate::kernel::object::ObjectSlot;
use libbpf_rs::MapCore;

use crate::wire::abi;
use crate::kernel::maps::{self, names, Counter};

mod attach;
mod groups;
mod routes;
mod tree;

use attach::Attachment;
pub use attach::{check_ip_forward, check_local_delivery, detach_stale, ifindex, ifname, UNRES_QLEN_BYTES};
pub use groups::NeighEntry;
pub use routes::{ParentRoute, ResultRouteInfo};
pub use tree::{plan_tree, NodePlan, TreeNode};

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

/// The loaded broadcast object: TC programs and maps, and where they are
/// attached.
pub struct TcPlane {
    attachment: Option<Attachment>,
    // Field order matters: the skeleton borrows `_object` and must drop first.
    skel: AggboxTcSkel<'static>,
    _object: ObjectSlot,
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
        let (object, object_ref) = ObjectSlot::new();
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

    /// Pin every map of the object as `dir/<map name>` (`dir` must exist on
    /// a bpffs). Internal maps (`.bss`, `.rodata`, ...) are skipped. The
    /// names (`bcast_*`) do not collide with the XDP object's.
    pub fn pin_maps(&self, dir: &Path) -> Result<()> {
        use libbpf_rs::skel::Skel;
        Ok(maps::pin_object_maps(self.skel.object(), dir, &[])?)
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
