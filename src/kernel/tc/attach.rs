//! Attaching the TC programs (clsact egress and ingress, and ingress on
//! `lo`), detaching them and what attach checks and raises on the
//! interface.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;

use libbpf_rs::{TcHook, TC_EGRESS, TC_INGRESS};

use super::{to_io, Result, TcError, TcPlane, TC_HANDLE, TC_PRIORITY};

#[derive(Debug)]
pub(super) struct Attachment {
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
    /// Other interfaces the copies leave by ([`TcPlane::hold_copy_interface`]).
    copy_ifaces: Vec<CopyIface>,
}

/// An interface the copies leave by besides the attached one, and its
/// `unres_qlen_bytes` before it was raised (restored by detach), if it was.
#[derive(Debug)]
struct CopyIface {
    ifindex: u32,
    unres_qlen_before: Option<u64>,
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

/// Put back the unresolved-neighbour queue [`raise_unres_qlen`] raised.
fn restore_unres_qlen(ifindex: u32, before: u64) -> Result<()> {
    let path = unres_qlen_path(ifindex)?;
    std::fs::write(&path, before.to_string()).map_err(|source| TcError::Io { context: format!("writing {path}"), source })
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

/// lo is ifindex 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

impl TcPlane {
    /// Attach the egress (root broadcast) and ingress (tree forwarding)
    /// programs to `ifindex` in the calling thread's network namespace.
    /// Creates the clsact qdisc only if absent and remembers whether it did.
    /// Refuses with [`TcError::ForwardingDisabled`] when IPv4
    /// forwarding is off on the interface. A stale AggBox filter (same
    /// handle and priority) is replaced. Raises the interface's
    /// unresolved-neighbour queue to [`UNRES_QLEN_BYTES`] while attached
    /// (restored by detach), so copies to cold next hops survive a lost ARP
    /// probe. Records the interface in `bcast_config` (`egress_ifindex`):
    /// copies to unresolved next hops are cloned to its egress, whichever
    /// interface they leave by (docs/BROADCAST.md, "Copies that leave by
    /// another interface").
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
        let undo_unres_qlen = || {
            if let Some(before) = unres_qlen_before {
                let _ = restore_unres_qlen(ifindex, before);
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
                undo_unres_qlen();
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
            undo_unres_qlen();
            return Err(TcError::Attach {
                what: "egress program",
                ifindex,
                source: to_io(e),
            });
        }
        if let Err(e) = ingress.attach() {
            let _ = egress.detach();
            undo_qdisc(created_qdisc);
            undo_unres_qlen();
            return Err(TcError::Attach {
                what: "ingress program",
                ifindex,
                source: to_io(e),
            });
        }
        let config = self.config().and_then(|mut cfg| {
            cfg.egress_ifindex = ifindex;
            self.write_config(&cfg)
        });
        if let Err(e) = config {
            let _ = ingress.detach();
            let _ = egress.detach();
            undo_qdisc(created_qdisc);
            undo_unres_qlen();
            return Err(e);
        }
        self.attachment = Some(Attachment {
            ifindex,
            netns_ino,
            created_qdisc,
            egress,
            ingress,
            unres_qlen_before,
            lo_ingress: None,
            copy_ifaces: Vec::new(),
        });
        Ok(())
    }

    /// Take `ifindex` as an interface the copies leave by besides the
    /// attached one (a group member or a parent is routed through it):
    /// raise its unresolved-neighbour queue to [`UNRES_QLEN_BYTES`], as
    /// [`attach`](Self::attach) does on its own interface, until
    /// [`detach`](Self::detach) puts it back. No program is put there, and
    /// none is needed: a resolved copy leaves with its MACs written in, and
    /// an unresolved one takes the neighbour path from the attached
    /// interface's egress, which hands it to the stack for `ifindex`
    /// (docs/BROADCAST.md, "Copies that leave by another interface"); that
    /// path queues the copy in `ifindex`'s neighbour entry. After
    /// [`attach`](Self::attach), in its namespace; the attached interface,
    /// lo and an interface already held are left as they are.
    pub fn hold_copy_interface(&mut self, ifindex: u32) -> Result<()> {
        let Some(a) = self.attachment.as_mut() else {
            return Err(TcError::State("hold_copy_interface before attach".into()));
        };
        if ifindex == a.ifindex || ifindex == LOOPBACK_IFINDEX || a.copy_ifaces.iter().any(|c| c.ifindex == ifindex) {
            return Ok(());
        }
        if current_netns_ino()? != a.netns_ino {
            return Err(TcError::State(format!(
                "hold_copy_interface must run in the network namespace attach ran in (ifindex {})",
                a.ifindex
            )));
        }
        let unres_qlen_before = raise_unres_qlen(ifindex)?;
        a.copy_ifaces.push(CopyIface { ifindex, unres_qlen_before });
        Ok(())
    }

    /// The interfaces [`hold_copy_interface`](Self::hold_copy_interface)
    /// holds, in the order they were taken.
    pub fn copy_interfaces(&self) -> Vec<u32> {
        self.attachment.as_ref().map(|a| a.copy_ifaces.iter().map(|c| c.ifindex).collect()).unwrap_or_default()
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
    /// clsact qdisc if attach created it; put back the unresolved-neighbour
    /// queues attach and [`hold_copy_interface`](Self::hold_copy_interface)
    /// raised. Must run in the network namespace attach ran in. No-op when
    /// not attached.
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
            if let Err(e) = restore_unres_qlen(ifindex, before) {
                first_err.get_or_insert(e);
            }
        }
        for c in std::mem::take(&mut a.copy_ifaces) {
            let Some(before) = c.unres_qlen_before else { continue };
            // an interface that is gone took its setting with it
            if ifname(c.ifindex).is_ok() {
                if let Err(e) = restore_unres_qlen(c.ifindex, before) {
                    first_err.get_or_insert(e);
                }
            }
        }
        let config = self.config().and_then(|mut cfg| {
            cfg.egress_ifindex = 0;
            self.write_config(&cfg)
        });
        if let Err(e) = config {
            first_err.get_or_insert(e);
        }
        self.attachment = None;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
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
