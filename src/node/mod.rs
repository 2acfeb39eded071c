//! The node's control plane: attach AggBox to an interface, pin its state,
//! detach (also after a crash), and read status back from the pins.
//!
//! Pins live under `PIN_ROOT/IFACE/` (default `/sys/fs/bpf/aggbox/IFACE/`):
//! one file per map, `link_xdp` for the XDP link, `link_xdp_lo` for the link
//! on `lo` when a worker runs on this host (see [`attach`]), and `state` saying
//! who attached, when and how. The XDP link pins are what keep the program
//! attached after the attaching process dies, and what `detach` removes.
//!
//! This file attaches and detaches; `preflight.rs` checks the host first,
//! `bpffs.rs` provides the bpffs the pins live on, `record.rs` writes and
//! reads the attach record.

pub mod control;
pub mod desired;
pub use desired::xdp_job;
pub mod metrics;
pub mod ring;
pub mod serve;
mod reload;
pub use reload::{request_reload, ReloadRecord, ReloadSummary};
mod status;
pub use status::{format_rates, format_status, status, GroupStatus, JobStatus, MemberStatus, NextHopStatus, NodeStatus};
pub mod tools;
mod upkeep;
mod bpffs;
pub use bpffs::{ensure_bpffs, hidden_pins_hint, in_private_mount_namespace, private_bpffs_warning};
mod preflight;
pub use preflight::{
    check_kernel_release, check_kernel_version, kernel_version, preflight, FRAGS_CHAIN_FEATURES, KERNEL_FEATURES,
    MIN_KERNEL, MIN_TESTED_KERNEL,
};
mod record;
pub use record::{attacher_alive, process_start_time, stat_start_time, AttachRecord, STATE_FILE};
use record::{read_record, record_is_ours, update_record, write_record};
use upkeep::Upkeep;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::{MapCore, MapFlags};
use serde::Serialize;

use crate::wire::abi;
use crate::config::{Config, UserspacePathMode};
use crate::kernel::tc::{self, TcPlane};
use crate::kernel::xdp::{self, Chain, XdpPlane, XdpLink, XdpMode};
use crate::kernel::afxdp::UserspacePath;
use crate::kernel::maps;

/// Default root of AggBox's pins (INTERFACE.md).
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/aggbox";
/// File name of the pinned XDP link inside an interface's pin directory.
pub const XDP_LINK_PIN: &str = "link_xdp";
/// File name of the pinned XDP link on the loopback interface, present when a
/// configured worker address is local to the node's namespace (see [`attach`]).
pub const LO_LINK_PIN: &str = "link_xdp_lo";
/// Every link pin `detach` removes, in detach order.
const LINK_PINS: [&str; 2] = [XDP_LINK_PIN, LO_LINK_PIN];
/// The loopback interface.
const LOOPBACK: &str = "lo";

/// Interface index of `iface` in the current network namespace.
pub fn ifindex(iface: &str) -> Result<u32> {
    let name = CString::new(iface).map_err(|_| anyhow!("aggbox: bad interface name {iface:?}"))?;
    // SAFETY: a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        bail!("aggbox: no such interface: {iface}");
    }
    Ok(index)
}

/// The directory holding `iface`'s pins.
pub fn pin_dir(pin_root: &Path, iface: &str) -> PathBuf {
    pin_root.join(iface)
}

/// The error that fails `attach` when the user-space path could not start
/// (`error`), or `None` when attach may go on without it: no job is
/// configured, or `[node] userspace_path = "optional"` and no job is
/// `userspace_only` (such a job has no other path at all).
pub fn userspace_path_failure(config: &Config, error: &str) -> Option<String> {
    if config.jobs.is_empty() {
        return None;
    }
    if let Some(job) = config.jobs.iter().find(|j| j.userspace_only) {
        return Some(format!(
            "aggbox: the user-space path (AF_XDP) did not start: {error}; job {} is userspace_only and has no other path",
            job.id
        ));
    }
    match config.node.userspace_path {
        UserspacePathMode::Optional => None,
        UserspacePathMode::Required => Some(format!(
            "aggbox: the user-space path (AF_XDP) did not start: {error}; without it ops 5..8 and FLOAT32 contributions of the {} configured job(s) would reach the stack unaggregated (set [node] userspace_path = \"optional\" to attach without it)",
            config.jobs.len()
        )),
    }
}

/// A live attachment: the loaded programs, the link, and where it is pinned.
/// Dropping it without [`Attachment::detach`] leaves the pinned state behind
/// (as after a crash); `aggbox detach` or the next attach cleans it up.
pub struct Attachment {
    /// The XDP plane: the aggregation programs and their maps (maps can be
    /// updated while attached).
    pub xdp: XdpPlane,
    link: Option<XdpLink>,
    /// The same program on `lo`, for workers on this host.
    lo_link: Option<XdpLink>,
    /// The TC plane (broadcast copies, result routes), when the config has
    /// groups or result routes.
    pub tc: Option<TcPlane>,
    /// The AF_XDP user-space path (ops the kernel does not aggregate).
    pub userspace: Option<UserspacePath>,
    /// What runs while attached: the stale-slot reclaim (src/node/upkeep.rs).
    upkeep: Option<Upkeep>,
    /// The result service of the `consumer = "node"` jobs (running also
    /// with none: a reload may add some).
    pub results: Option<serve::ResultServer>,
    /// The ring service of the `[[ring]]` jobs (src/node/ring.rs), when
    /// there are some.
    pub rings: Option<ring::RingServer>,
    /// The configuration in force (the attach's, or the last reload's).
    config: Config,
    /// What the kernel's maps hold for it (reload moves from this state).
    kernel: desired::KernelState,
    /// The ring memory reserved at attach and where its rings sit in it
    /// (reload places the new rings in it).
    ring_pool: xdp::RingPool,
    dir: PathBuf,
    /// The attach record written to `state.json`.
    pub record: AttachRecord,
    /// Warnings for the operator (e.g. generic XDP fallback).
    pub warnings: Vec<String>,
}

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attachment").field("dir", &self.dir).field("record", &self.record).finish_non_exhaustive()
    }
}

/// Attach AggBox to `iface` with `config`, pinning under `pin_root`.
///
/// Stale state from a process that is gone is replaced; state of a process
/// that is still alive is an error (two attaches on one interface would fight
/// over the maps). On any failure everything made so far is undone, so the
/// interface is left as it was.
pub fn attach(iface: &str, config: &Config, config_path: Option<&Path>, pin_root: &Path, mode: XdpMode) -> Result<Attachment> {
    let chain = Chain::detect().map_err(|e| anyhow!("aggbox: {e}"))?;
    attach_chain(iface, config, config_path, pin_root, mode, chain)
}

/// [`attach`] with the given build of the XDP chain instead of the one
/// [`Chain::detect`] picks (tests run the linear chain on kernels that have
/// both).
pub fn attach_chain(
    iface: &str,
    config: &Config,
    config_path: Option<&Path>,
    pin_root: &Path,
    mode: XdpMode,
    chain: Chain,
) -> Result<Attachment> {
    let index = preflight(iface)?;
    // The result ports of node-served jobs first: one another process holds
    // fails the attach before anything changes.
    let node_addrs = crate::netif::interface_addrs(iface).with_context(|| format!("aggbox: reading the addresses of {iface}"))?;
    // The ring memory: the file's rings and `[node] ring_pool` more, for
    // rings a reload (or a run) adds later.
    let ring_pool = xdp::RingPool::reserve(&config.rings, config.ring_frag_elems(), config.node.ring_pool)
        .map_err(|e| anyhow!("aggbox: {e}"))?;
    let rings = ring_jobs(config, iface, &node_addrs, &ring_pool)?;
    let served = serve::BoundJobs::bind(config, node_addrs).map_err(|e| anyhow!("aggbox: {e:#}"))?;
    let mounted_bpffs = ensure_bpffs(pin_root)?;
    let dir = pin_dir(pin_root, iface);
    let mut warnings = Vec::new();
    if mounted_bpffs && in_private_mount_namespace() == Some(true) {
        warnings.push(private_bpffs_warning(pin_root));
    }
    if dir.exists() {
        if let Some(record) = read_record(&dir) {
            if !record_is_ours(&record) && attacher_alive(&record) {
                bail!("aggbox: {iface} is already attached by pid {} (run `aggbox detach {iface}` to take it over)", record.pid);
            }
        }
        detach_dir(&dir).with_context(|| format!("aggbox: removing stale state in {}", dir.display()))?;
        warnings.push(format!("replaced stale AggBox state in {}", dir.display()));
    }

    let iface_mtu = crate::netif::interface_mtu(iface).with_context(|| format!("aggbox: reading the MTU of {iface}"))?;
    if chain == Chain::Linear {
        let mtu = iface_mtu as u32;
        if mtu > chain.max_mtu() {
            bail!(
                "aggbox: {iface} has MTU {mtu}, but the linear XDP chain (loaded without multi-buffer XDP: {}) aggregates datagrams of at most {} elements, i.e. MTU {}; lower the MTU (ip link set {iface} mtu {}) or use kernel 5.18+",
                FRAGS_CHAIN_FEATURES.iter().map(|(f, (a, b))| format!("{f} {a}.{b}")).collect::<Vec<_>>().join(", "),
                chain.max_elems(),
                chain.max_mtu(),
                chain.max_mtu()
            );
        }
        warnings.push(format!(
            "XDP chain: linear, single-buffer frames (the kernel lacks {}, or {} chose it): datagrams of up to {} elements (MTU {})",
            FRAGS_CHAIN_FEATURES.iter().map(|(f, (a, b))| format!("{f} ({a}.{b})")).collect::<Vec<_>>().join(" or "),
            xdp::CHAIN_ENV,
            chain.max_elems(),
            chain.max_mtu()
        ));
    }
    if ring_pool.usage().reserved > 0 {
        // the ring program's bpf_fib_lookup needs forwarding on IFACE
        tc::check_ip_forward(index).map_err(|e| anyhow!("aggbox: {e}"))?;
    }
    let dataplane = XdpPlane::load_chain_with(chain, ring_pool.sizing()).map_err(|e| anyhow!("aggbox: {e:#}"))?;
    // Broadcast: the TC programs are loaded only when something needs them
    // (a [[group]], or a job whose results leave the node), so a node that
    // only aggregates adds nothing to its egress path. bpf_fib_lookup needs
    // IPv4 forwarding: without it attach stops here with the fix spelled out.
    let mut broadcast = if reload::needs_tc(config) {
        tc::check_ip_forward(index).map_err(|e| anyhow!("aggbox: {e}"))?;
        check_local_members(config)?;
        Some(TcPlane::load().map_err(|e| anyhow!("aggbox: {e:#}"))?)
    } else {
        None
    };
    // Every map entry the config asks for, written into the empty maps
    // before any program is attached.
    let kernel = desired::KernelState::of(config, iface_mtu, &rings).map_err(|e| anyhow!("aggbox: {e:#}"))?;
    let mut planes = desired::Planes {
        xdp: &dataplane,
        tc: broadcast.as_ref(),
    };
    desired::apply(&mut planes, &desired::KernelState::default(), &kernel).map_err(|e| anyhow!("aggbox: {e:#}"))?;
    let (link, warning) = dataplane.attach_xdp(index, mode).map_err(|e| anyhow!("aggbox: {e}"))?;
    warnings.extend(warning);

    // A worker on this host: its datagrams to the node's own address are
    // routed through `lo` and never meet IFACE's XDP program. The one fix is
    // to run the same program (same maps, so the same slots, dedup bitmap and
    // exactly-once completion) on `lo` too; `lo` has no native XDP, so this
    // link is generic mode. Its RESULT is passed up the same way and reaches
    // the result port. If this fails, `link` is dropped unpinned: IFACE is
    // left as it was.
    let local = local_workers(config)?;
    let lo_link = match local.first() {
        Some(&(job, rank, addr)) if iface != LOOPBACK => {
            let lo_index = ifindex(LOOPBACK)?;
            let (lo_link, _) = dataplane.attach_xdp(lo_index, XdpMode::Generic).map_err(|e| {
                anyhow!(
                    "aggbox: attaching to {LOOPBACK} for the worker(s) on this host (job {job} rank {rank} at {addr}{}): {e}{}",
                    if local.len() > 1 { format!(" and {} more", local.len() - 1) } else { String::new() },
                    if matches!(&e, xdp::XdpError::Attach { source, .. } if source.raw_os_error() == Some(libc::EBUSY)) {
                        " (lo already has an XDP program: another AggBox attachment in this namespace?)"
                    } else {
                        ""
                    }
                )
            })?;
            Some(lo_link)
        }
        _ => None,
    };

    // A worker on this host: RESULTs its contributions complete come up lo,
    // where the ingress program must make their group copies too.
    // The copies' other egress interfaces and next hops: a failure here
    // drops `broadcast`, which detaches it (and puts back what it raised).
    if let Some(plane) = &mut broadcast {
        plane.attach(index).map_err(|e| anyhow!("aggbox: {e}"))?;
        if lo_link.is_some() {
            let lo_index = ifindex(LOOPBACK)?;
            plane.attach_lo_ingress(lo_index).map_err(|e| anyhow!("aggbox: {e} (a worker of a job is on this host)"))?;
        }
        warnings.extend(prepare_copy_paths(plane, &kernel.next_hops()).map_err(|e| anyhow!("aggbox: {e:#}"))?);
    }
    let tc_created_qdisc = broadcast.as_ref().and_then(|b| b.attached()).is_some_and(|(_, created)| created);
    let tc_lo = broadcast.as_ref().and_then(|b| b.lo_ingress());

    // The user-space path serves what the kernel does not aggregate (ops
    // 5..8, FLOAT32, overflow of the slot pool, userspace_only jobs). The
    // op is per datagram, not per job, so any configured job may need it:
    // without it those contributions reach the stack unaggregated, which
    // the application would take for results. So its failure fails the
    // attach, unless the config says degraded service is acceptable.
    let (userspace, userspace_error) = match UserspacePath::start(iface, &dataplane, config) {
        Ok(path) => (Some(path), None),
        Err(e) => {
            let error = format!("{e:#}");
            if let Some(message) = userspace_path_failure(config, &error) {
                if let Some(mut b) = broadcast {
                    let _ = b.detach();
                }
                // `link` and `lo_link` are not pinned yet: dropping them detaches.
                return Err(anyhow!(message));
            }
            warnings.push(format!(
                "user-space path (AF_XDP) not started: {error}; ops 5..8, FLOAT32 and what overflows the kernel's slot pool reach the stack unaggregated"
            ));
            (None, Some(error))
        }
    };

    let record = AttachRecord {
        iface: iface.to_string(),
        ifindex: index,
        xdp_mode: match link.mode() {
            XdpMode::Native => "native".into(),
            XdpMode::Generic => "generic".into(),
        },
        xdp_chain: chain.label().into(),
        pid: std::process::id(),
        pid_start: process_start_time(std::process::id()).unwrap_or(0),
        attached_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        config: config_path.map(|p| p.display().to_string()),
        jobs: config.jobs.iter().map(|j| j.id).collect(),
        lo_xdp: lo_link.is_some(),
        tc: broadcast.is_some(),
        tc_created_qdisc,
        tc_lo: tc_lo.is_some(),
        tc_lo_created_qdisc: tc_lo.unwrap_or(false),
        userspace_path: userspace.is_some(),
        userspace_path_error: userspace_error,
        reloads: 0,
        last_reload: None,
    };
    // Stale kernel slots can never complete (the stale-round rule drops
    // what would): the node's upkeep releases them, whatever else runs.
    let upkeep = match dataplane.kernel_maps().map_err(anyhow::Error::from).and_then(|maps| Ok(Upkeep::start(maps)?)) {
        Ok(u) => Some(u),
        Err(e) => {
            warnings.push(format!("stale-slot reclaim not started: {e}"));
            None
        }
    };
    let mut attachment = Attachment {
        xdp: dataplane,
        link: Some(link),
        lo_link,
        tc: broadcast,
        userspace,
        upkeep,
        results: None,
        rings: None,
        config: config.clone(),
        kernel,
        ring_pool,
        dir: dir.clone(),
        record,
        warnings,
    };
    // From here on a failure undoes the whole attach (Attachment::abandon):
    // the links are not pinned yet, or only partly, so dropping them detaches.
    if let Err(err) = attachment.pin() {
        attachment.abandon();
        return Err(err);
    }
    // The result service runs also without served jobs: a reload may add some.
    match attachment.xdp.kernel_maps().map_err(anyhow::Error::from).and_then(|maps| served.start(&dir, maps)) {
        Ok(server) => attachment.results = Some(server),
        Err(e) => {
            attachment.abandon();
            return Err(anyhow!("aggbox: starting the result service: {e:#}"));
        }
    }
    // The ring service maps the pinned ring memory, so it starts after the pins.
    match ring::RingServer::start_for(&attachment.kernel, &dir, &attachment.ring_pool) {
        Ok(server) => attachment.rings = server,
        Err(e) => {
            attachment.abandon();
            return Err(anyhow!("aggbox: starting the ring service: {e:#}"));
        }
    }
    Ok(attachment)
}

/// A ring entry's `self_addr` / `next_addr`: an IPv4 member's address
/// (network order), 0 for an IPv6 one.
fn ring_addr(a: IpAddr) -> u32 {
    match a {
        IpAddr::V4(a) => u32::from(a).to_be(),
        IpAddr::V6(_) => 0,
    }
}

/// Each configured ring's dense index and entry of `ring_jobs`
/// (docs/RING.md), in file order, at the place `pool` gives it
/// ([`xdp::RingPool::place`]): this node's place in the ring is the member
/// whose address is one of `iface`'s. An IPv6 ring's entry has no
/// `self_addr` / `next_addr` (0): the ring program reads its members'
/// `ring_members` entries; its datagrams must fit `iface`'s MTU behind the
/// 40-byte IPv6 header (at MTU 1500 at most 356 elements, a ring
/// fragment's count being even, where IPv4's default is 362).
pub fn ring_jobs(config: &Config, iface: &str, node_addrs: &[IpAddr], pool: &xdp::RingPool) -> Result<Vec<(u32, abi::RingJob)>> {
    let mut out = Vec::with_capacity(config.rings.len());
    for ring in &config.rings {
        let n = ring.members.len();
        let members = &ring.members;
        let v6 = members.first().is_some_and(IpAddr::is_ipv6);
        if v6 {
            let mtu = crate::netif::interface_mtu(iface).with_context(|| format!("aggbox: reading the MTU of {iface}"))?;
            // Ring fragments are whole 8-byte words: an even count.
            let largest = crate::wire::proto::elements_per_fragment_in(mtu, true) as u32 & !1;
            if ring.frag_elems > largest {
                bail!(
                    "aggbox: ring {}: frag_elems {} does not fit {iface}'s MTU {mtu} over IPv6 (at most {largest}): set frag_elems (or [node] ring_frag_elems) to {largest}",
                    ring.id,
                    ring.frag_elems
                );
            }
        }
        let Some(me) = members.iter().position(|a| node_addrs.contains(a)) else {
            bail!(
                "aggbox: ring {}: this node is not a member: none of {iface}'s addresses ({}) is in members ({})",
                ring.id,
                node_addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", "),
                ring.members.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ")
            );
        };
        let place = pool.place_of(ring.id).ok_or_else(|| anyhow!("aggbox: ring {}: no place in the ring pool", ring.id))?;
        let job = abi::RingJob {
            id: ring.id,
            port: ring.port,
            members: n as u16,
            me: me as u16,
            frag_elems: ring.frag_elems,
            frags: ring.frags(),
            vector_len: ring.vector_len,
            base: place.base,
            weight_sum: ring.weight_sum(),
            weight: ring.weights[me],
            self_addr: ring_addr(members[me]),
            next_addr: ring_addr(members[(me + 1) % n]),
        };
        if job.entries() != place.entries {
            bail!("aggbox: ring {}: {} entries placed for its {}", ring.id, place.entries, job.entries());
        }
        out.push((place.dense, job));
    }
    Ok(out)
}

impl Attachment {
    fn pin(&mut self) -> Result<()> {
        fs::create_dir_all(&self.dir).with_context(|| format!("aggbox: creating {}", self.dir.display()))?;
        self.xdp.pin_maps(&self.dir).map_err(|e| anyhow!("aggbox: {e}"))?;
        if let Some(plane) = &self.tc {
            plane.pin_maps(&self.dir).map_err(|e| anyhow!("aggbox: {e}"))?;
        }
        if let Some(link) = &self.link {
            link.pin(&self.dir.join(XDP_LINK_PIN)).map_err(|e| anyhow!("aggbox: {e}"))?;
        }
        if let Some(link) = &self.lo_link {
            link.pin(&self.dir.join(LO_LINK_PIN)).map_err(|e| anyhow!("aggbox: {e}"))?;
        }
        write_record(&self.dir, &self.record)
    }

    /// Undo an attach that failed after its programs were attached: stop
    /// what runs, detach the TC programs and remove the pins. The XDP links
    /// go when `self` is dropped (unpinned, that detaches them).
    fn abandon(&mut self) {
        drop(self.rings.take());
        drop(self.results.take());
        if let Some(u) = self.userspace.take() {
            u.stop();
        }
        if let Some(mut b) = self.tc.take() {
            let _ = b.detach();
        }
        let _ = detach_dir(&self.dir);
    }

    /// Where this attachment's pins are.
    pub fn pin_dir(&self) -> &Path {
        &self.dir
    }

    /// Detach everything and remove the pins.
    pub fn detach(mut self) -> Result<()> {
        // User space first: it unregisters its sockets so the kernel stops
        // redirecting to them before the programs go.
        if let Some(u) = self.userspace.take() {
            u.stop();
        }
        drop(self.rings.take());
        drop(self.upkeep.take());
        let mut result = Ok(());
        if let Some(mut plane) = self.tc.take() {
            if let Err(e) = plane.detach() {
                result = Err(anyhow!("aggbox: detaching the TC programs: {e}"));
            }
        }
        let links = (self.link.take(), self.lo_link.take());
        let result = result.and(detach_dir(&self.dir));
        drop(links);
        result
    }
}

/// Remove what `attach` left for `iface` (after a crash or from another
/// shell). Returns false when nothing was attached.
pub fn detach(iface: &str, pin_root: &Path) -> Result<bool> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!("aggbox: must run as root to detach");
    }
    let dir = pin_dir(pin_root, iface);
    if !dir.exists() {
        return Ok(false);
    }
    detach_dir(&dir)?;
    Ok(true)
}

/// Force-detach the pinned XDP links (even if a live process holds their
/// fds) and delete every pin in `dir`, then `dir` itself.
fn detach_dir(dir: &Path) -> Result<()> {
    // TC filters are not links: a crashed attach leaves them on the
    // interface; the record says whether there are any and whether the
    // clsact qdisc was ours.
    if let Some(record) = read_record(dir) {
        if record.tc && !record_is_ours(&record) {
            tc::detach_stale(record.ifindex).map_err(|e| anyhow!("aggbox: removing stale TC filters: {e}"))?;
            if record.tc_created_qdisc {
                destroy_clsact(record.ifindex).context("aggbox: removing the clsact qdisc")?;
            }
            if record.tc_lo {
                let lo = ifindex(LOOPBACK)?;
                tc::detach_stale(lo).map_err(|e| anyhow!("aggbox: removing stale TC filters from lo: {e}"))?;
                if record.tc_lo_created_qdisc {
                    destroy_clsact(lo).context("aggbox: removing lo's clsact qdisc")?;
                }
            }
        }
    }
    for name in LINK_PINS {
        let link_pin = dir.join(name);
        if !link_pin.exists() {
            continue;
        }
        let fd = obj_get(&link_pin).with_context(|| format!("opening pinned link {}", link_pin.display()))?;
        // SAFETY: fd is a valid BPF link descriptor we own.
        let rc = unsafe { libbpf_sys::bpf_link_detach(fd.as_raw_fd()) };
        // ENOLINK/EINVAL: already detached (its interface vanished); fine.
        if rc < 0 && -rc != libc::ENOLINK && -rc != libc::EINVAL {
            return Err(io::Error::from_raw_os_error(-rc)).with_context(|| format!("detaching the XDP link {}", link_pin.display()));
        }
    }
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))?;
    Ok(())
}

/// IPv4 addresses on any interface of the current network namespace.
pub fn local_ipv4_addrs() -> Result<Vec<Ipv4Addr>> {
    let addrs = nix::ifaddrs::getifaddrs().context("aggbox: listing this host's addresses (getifaddrs)")?;
    let mut out: Vec<Ipv4Addr> = addrs
        .filter_map(|ifa| ifa.address.and_then(|a| a.as_sockaddr_in().map(|sin| sin.ip())))
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// IPv4 and IPv6 addresses on any interface of the current network
/// namespace.
pub fn local_addrs() -> Result<Vec<IpAddr>> {
    let addrs = nix::ifaddrs::getifaddrs().context("aggbox: listing this host's addresses (getifaddrs)")?;
    let mut out: Vec<IpAddr> = addrs
        .filter_map(|ifa| {
            let a = ifa.address?;
            a.as_sockaddr_in()
                .map(|sin| IpAddr::V4(sin.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|sin6| IpAddr::V6(sin6.ip())))
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// The configured workers `(job, rank, address)` whose address is local to
/// this network namespace (IPv4 or IPv6): their datagrams to this node go
/// through `lo`.
pub fn local_workers(config: &Config) -> Result<Vec<(u16, usize, IpAddr)>> {
    let local = local_addrs()?;
    Ok(config
        .jobs
        .iter()
        .flat_map(|job| job.workers.iter().enumerate().map(move |(rank, addr)| (job.id, rank, *addr)))
        .filter(|(_, _, addr)| addr.is_loopback() || local.contains(addr))
        .collect())
}

fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: valid C string.
    let fd = unsafe { libbpf_sys::bpf_obj_get(c.as_ptr()) };
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: the kernel returned a fresh fd that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A group member on this host receives its copy through `lo`, which needs
/// `accept_local` (the copy carries one of this host's addresses as source).
fn check_local_members(config: &Config) -> Result<()> {
    let local = local_addrs()?;
    for group in &config.groups {
        if let Some(member) = group.members.iter().find(|m| local.contains(&m.ip())) {
            tc::check_local_delivery()
                .map_err(|e| anyhow!("aggbox: group {} member {member} is on this host: {e}", group.id))?;
        }
    }
    Ok(())
}

/// Remove the clsact qdisc of `ifindex` (with any filters still on it):
/// only called for a qdisc that AggBox's attach created.
fn destroy_clsact(ifindex: u32) -> io::Result<()> {
    // SAFETY: zeroed hook with sz set, as libbpf expects.
    let mut hook: libbpf_sys::bpf_tc_hook = unsafe { std::mem::zeroed() };
    hook.sz = std::mem::size_of::<libbpf_sys::bpf_tc_hook>() as _;
    hook.ifindex = ifindex as i32;
    hook.attach_point = libbpf_sys::BPF_TC_INGRESS | libbpf_sys::BPF_TC_EGRESS;
    // SAFETY: valid hook.
    let rc = unsafe { libbpf_sys::bpf_tc_hook_destroy(&mut hook) };
    if rc < 0 && -rc != libc::ENOENT && -rc != libc::EINVAL {
        return Err(io::Error::from_raw_os_error(-rc));
    }
    Ok(())
}

#[cfg(test)]
mod job_tests {
    use super::*;

    const JOB: &str = "[[job]]\nid = 7\nport = 7000\nworkers = [\"10.77.0.11\"]\nresult_port = 7001\n";

    fn job(extra: &str) -> crate::config::JobConfig {
        let text = format!("{JOB}{extra}");
        crate::config::Config::parse(&text, "t.toml").expect("config").jobs.remove(0)
    }

    #[test]
    fn a_job_cuts_fragments_for_the_interface_mtu_unless_it_says_otherwise() {
        assert_eq!(xdp_job(&job(""), 1500).frag_elems, 362);
        assert_eq!(xdp_job(&job(""), 9000).frag_elems, 2237);
        assert_eq!(xdp_job(&job("frag_elems = 100\n"), 1500).frag_elems, 100);
    }

    #[test]
    fn the_fast_granule_is_the_fragment_size_where_a_fast_slot_holds_it() {
        let granule = |frag_elems| xdp::fast_granule(frag_elems);
        assert_eq!(granule(362), 362);
        assert_eq!(granule(1), 1);
        assert_eq!(granule(abi::FAST_ELEMS), abi::FAST_ELEMS as u16);
        for unknown_or_too_large in [0, abi::FAST_ELEMS + 1, 2242, abi::MAX_ELEMS] {
            assert_eq!(granule(unknown_or_too_large), abi::FAST_GRANULE as u16, "{unknown_or_too_large}");
        }
        assert_eq!(xdp_job(&job(""), 1500).validate().expect("valid").fast_granule, 362);
    }
}

#[cfg(test)]
mod attacher_tests {
    use super::*;

    fn record(pid: u32, pid_start: u64) -> AttachRecord {
        AttachRecord {
            iface: "eth0".into(),
            ifindex: 2,
            xdp_mode: "native".into(),
            xdp_chain: "frags".into(),
            pid,
            pid_start,
            attached_at: 0,
            config: None,
            jobs: vec![],
            lo_xdp: false,
            tc: false,
            tc_created_qdisc: false,
            tc_lo: false,
            tc_lo_created_qdisc: false,
            userspace_path: true,
            userspace_path_error: None,
            reloads: 0,
            last_reload: None,
        }
    }

    #[test]
    fn start_time_is_field_22_also_with_parentheses_in_the_name() {
        let fields: Vec<String> = (3..=52).map(|i| if i == 22 { "987654".to_string() } else { i.to_string() }).collect();
        let tail = fields.join(" ");
        assert_eq!(stat_start_time(&format!("4242 (aggbox) {tail}")), Some(987654));
        assert_eq!(stat_start_time(&format!("4242 (a) b) 7 (c) {tail}")), Some(987654));
        assert_eq!(stat_start_time("4242 (trunc"), None);
        assert_eq!(stat_start_time("4242 (x) S 1 2"), None);
    }

    /// A live PID with another start time is a reused PID: the attacher is dead.
    #[test]
    fn live_pid_with_another_start_time_is_dead() {
        let pid = std::process::id();
        let start = process_start_time(pid).expect("own start time");
        assert!(attacher_alive(&record(pid, start)));
        assert!(!attacher_alive(&record(pid, start + 1)), "reused PID taken for the attacher");
        assert!(!record_is_ours(&record(pid, start + 1)));
        assert!(record_is_ours(&record(pid, start)));
        // Records of older versions carry no start time: the PID decides.
        assert!(attacher_alive(&record(pid, 0)));
        assert!(!attacher_alive(&record(0, 0)));
    }

    fn config(text: &str) -> Config {
        Config::parse(text, "t.toml").expect("test config")
    }

    const JOB: &str = "[[job]]\nid = 7\nport = 7000\nworkers = [\"10.0.0.1\"]\nresult_port = 7001\n";

    #[test]
    fn userspace_path_failure_fails_attach_unless_optional() {
        assert_eq!(userspace_path_failure(&Config::default(), "EBUSY"), None, "no job needs it");
        let err = userspace_path_failure(&config(JOB), "bind: EBUSY").expect("required by default");
        assert_eq!(
            err,
            "aggbox: the user-space path (AF_XDP) did not start: bind: EBUSY; without it ops 5..8 and FLOAT32 contributions of the 1 configured job(s) would reach the stack unaggregated (set [node] userspace_path = \"optional\" to attach without it)"
        );
        let optional = format!("[node]\nuserspace_path = \"optional\"\n\n{JOB}");
        assert_eq!(userspace_path_failure(&config(&optional), "EBUSY"), None);
        let only = optional.replace("result_port", "userspace_only = true\nresult_port");
        let err = userspace_path_failure(&config(&only), "EBUSY").expect("a userspace_only job has no other path");
        assert!(err.contains("job 7 is userspace_only"), "{err}");
    }

    #[test]
    fn private_bpffs_warning_names_the_fix() {
        let w = private_bpffs_warning(Path::new("/sys/fs/bpf/aggbox"));
        assert!(w.starts_with("mounted a bpffs on /sys/fs/bpf in this process's own mount namespace"), "{w}");
        assert!(w.contains("the pins under /sys/fs/bpf/aggbox are invisible to other processes"), "{w}");
        assert!(w.contains("--pin-root /run/aggbox/bpf/NETNS"), "{w}");
        assert!(!w.contains('\n') && !w.contains("  "), "one line: {w:?}");
        assert_eq!(hidden_pins_hint(Path::new("/tmp/elsewhere")), None, "a pin root outside /sys is never hidden");
    }
}

#[cfg(test)]
mod ring_job_tests {
    use super::*;

    const TEXT: &str = "[[ring]]\nid = 40\nport = 7400\nmembers = [\"10.0.0.1\", \"10.0.0.2\", \"10.0.0.3\"]\nweights = [1, 2, 3]\nvector_len = 1000\n\n[[ring]]\nid = 41\nport = 7401\nmembers = [\"10.0.0.3\", \"10.0.0.1\"]\nvector_len = 10\n";

    fn pool(config: &Config) -> xdp::RingPool {
        xdp::RingPool::reserve(&config.rings, config.ring_frag_elems(), config.node.ring_pool).unwrap()
    }

    #[test]
    fn a_node_takes_its_place_and_its_fragments_by_its_address() {
        let config = Config::parse(TEXT, "rings.toml").unwrap();
        let jobs = ring_jobs(&config, "eth0", &["192.168.1.1".parse().unwrap(), "10.0.0.3".parse().unwrap()], &pool(&config)).unwrap();
        let ((da, a), (db, b)) = (&jobs[0], &jobs[1]);
        assert_eq!((a.me, a.members, a.weight, a.weight_sum, a.frags, a.base), (2, 3, 3, 6, 3, 0));
        assert_eq!(a.next_addr, u32::from(Ipv4Addr::new(10, 0, 0, 1)).to_be(), "after the last member, the first");
        assert_eq!(a.self_addr, u32::from(Ipv4Addr::new(10, 0, 0, 3)).to_be());
        assert_eq!((b.me, b.frags, b.base), (0, 1, 6), "the second ring's entries follow the first's two buffers");
        assert_eq!((*da, *db), (0, 1), "dense indices in file order");
    }

    #[test]
    fn a_node_that_is_no_member_is_refused_naming_the_ring_and_its_addresses() {
        let config = Config::parse(TEXT, "rings.toml").unwrap();
        let e = ring_jobs(&config, "eth0", &["10.0.0.9".parse().unwrap()], &pool(&config)).unwrap_err().to_string();
        assert!(e.contains("ring 40") && e.contains("10.0.0.9") && e.contains("not a member"), "{e}");
    }
}

/// Prepares the paths of the TC programs' copies to `hops` (at attach
/// `KernelState::next_hops`, at a reload the ones it adds), at attach and
/// reload rather than at the first datagram. The kernel routes each
/// destination (`netif::routes`); a copy leaves by the interface its route
/// names, which is not always the attached one (a forwarder whose leaves
/// are on another LAN, behind its second interface). Each such interface
/// is held by the plane (`TcPlane::hold_copy_interface`: its unresolved-
/// neighbour queue raised as the attached interface's is, put back at
/// detach), and the next hop of every destination (the destination
/// itself, or the gateway of a routed one) is resolved now on its
/// interface (`netif::resolve_neighbours`).
///
/// Why resolve ahead: a cold copy waits in the neighbour queue for its ARP
/// reply; when a node's first datagram sends the ARP requests of all its
/// members at once on a large LAN, the flood of those broadcasts fills the
/// receive backlog (`netdev_max_backlog`) the replies and the released
/// copies then meet, and the first copies are lost (issue #42 item 3).
/// Resolved before any datagram, the first copy leaves with its MAC like
/// every later one.
///
/// Returns warnings (a destination without a route, whose copies count
/// `fib_error`; a route lookup or resolution the kernel refused: the copies
/// then take the neighbour path as before). An interface the plane cannot
/// hold is an error.
fn prepare_copy_paths(plane: &mut TcPlane, hops: &[std::net::IpAddr]) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let routes = match crate::netif::routes(hops) {
        Ok(routes) => routes,
        Err(e) => {
            warnings.push(format!("routes of the broadcast copies not looked up: {e}; their next hops are resolved at the first copy"));
            return Ok(warnings);
        }
    };
    // next hops by egress interface, each once, in order
    let mut by_iface: Vec<(u32, Vec<std::net::IpAddr>)> = Vec::new();
    for (dest, route) in routes {
        match route {
            crate::netif::Route::Out { ifindex, next_hop } => {
                plane
                    .hold_copy_interface(ifindex)
                    .map_err(|e| anyhow!("the broadcast copies to {dest} leave by ifindex {ifindex}: {e}"))?;
                match by_iface.iter_mut().find(|(i, _)| *i == ifindex) {
                    Some((_, hops)) if hops.contains(&next_hop) => {}
                    Some((_, hops)) => hops.push(next_hop),
                    None => by_iface.push((ifindex, vec![next_hop])),
                }
            }
            crate::netif::Route::NotOut => {}
            crate::netif::Route::Unreachable(e) => {
                warnings.push(format!("no route to {dest} ({e}): the broadcast copies to it are not sent (fib_error)"));
            }
        }
    }
    for (ifindex, next_hops) in by_iface {
        if let Err(e) = crate::netif::resolve_neighbours(ifindex, &next_hops) {
            let name = tc::ifname(ifindex).unwrap_or_else(|_| format!("ifindex {ifindex}"));
            warnings.push(format!("neighbours of the broadcast copies not resolved ahead on {name}: {e}; the first copies wait for ARP"));
        }
    }
    Ok(warnings)
}
