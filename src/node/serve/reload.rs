//! Which served jobs a configuration implies, and the difference between
//! two ([`ServedChange`]): the sockets bound before anything changes, the
//! serving thread's jobs changed in one step.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex};

use anyhow::{anyhow, Result};
use libbpf_rs::MapCore;

use crate::config::{Config, JobConfig, ResultConsumer};
use crate::kernel::xdp::KernelMaps;
use crate::wire::abi;
use crate::wire::reliability::ReliabilityConfig;

use super::server::{serve, ResultServer};
use super::service::{ResultService, Seen, ServiceStats, STATS_MAP};

/// Reliability settings of a served job: the node's ACK mode and group.
fn reliability_of(config: &Config) -> ReliabilityConfig {
    let mut cfg = ReliabilityConfig {
        ack_mode: config.node.ack_mode,
        group_size: config.node.ack_group as u32,
        ..ReliabilityConfig::default()
    };
    cfg.window = cfg.window.min(cfg.group_size);
    cfg
}

/// Worker r's socket of a node-served job: its member of the result group.
pub(super) fn worker_sockets(config: &Config, job: &JobConfig) -> Result<Vec<SocketAddr>> {
    let g = job.result_group.ok_or_else(|| anyhow!("job {}: consumer = \"node\" without result_group", job.id))?;
    let group = config.group(g).ok_or_else(|| anyhow!("job {}: no [[group]] {g}", job.id))?;
    job.workers
        .iter()
        .map(|w| {
            group
                .members
                .iter()
                .find(|m| m.ip() == *w)
                .copied()
                .ok_or_else(|| anyhow!("job {}: worker {w} is not a member of group {g}", job.id))
        })
        .collect()
}

/// The socket of a served job: bound beforehand, or the one a job that
/// the same change removes holds on the same port.
#[derive(Debug)]
pub(super) enum JobSocket {
    Bound(UdpSocket),
    TakeOver(u16),
}

/// A set of served jobs to remove and to add, with every new port bound
/// before anything changes: a port another process holds fails
/// [`BoundJobs::bind`] / [`BoundJobs::bind_change`], which then change
/// nothing.
#[derive(Debug, Default)]
pub struct ServedChange {
    pub(super) remove: Vec<u16>,
    pub(super) add: Vec<(JobSocket, ResultService)>,
}

/// The sockets of a [`ResultServer`] at attach (a [`ServedChange`] that
/// only adds).
pub type BoundJobs = ServedChange;

/// A served job's `result_port`, bound for the result service.
pub(super) fn bind_result_port(job: &JobConfig) -> Result<UdpSocket> {
    let any = if job.is_ipv6() { IpAddr::V6(Ipv6Addr::UNSPECIFIED) } else { IpAddr::V4(Ipv4Addr::UNSPECIFIED) };
    let socket = crate::netif::bind_udp(SocketAddr::new(any, job.result_port)).map_err(|e| {
        anyhow!(
            "job {}: result_port {} (consumer = \"node\"): {e}; another process (an aggregator application?) holds it",
            job.id,
            job.result_port
        )
    })?;
    socket.set_nonblocking(true)?;
    // A call's RESULTs arrive in a burst (the kernel completes fragments as
    // fast as contributions come): as the runtime's aggregator, 64 MiB, or
    // what rmem_max allows without CAP_NET_ADMIN.
    crate::netif::set_socket_buffers(&socket, 64 << 20);
    Ok(socket)
}

/// Whether `job` of `config` is node-served.
pub(super) fn is_served(job: &JobConfig) -> bool {
    job.consumer == ResultConsumer::Node
}

/// A served job's settings as the service sees them: the job, and the
/// group its RESULT copies go to (the workers' sockets).
pub(super) fn served_view<'a>(config: &'a Config, job: &'a JobConfig) -> (&'a JobConfig, Option<&'a crate::config::GroupConfig>) {
    (job, job.result_group.and_then(|g| config.group(g)))
}

impl ServedChange {
    /// Binds `0.0.0.0:result_port` (`[::]:result_port` for a job of IPv6
    /// workers) for every node-served job of `config` (none: an empty
    /// set), for a node with addresses `node`.
    pub fn bind(config: &Config, node: Vec<IpAddr>) -> Result<ServedChange> {
        Self::bind_change(&Config::default(), config, node)
    }

    /// What turns the served jobs of `old` into those of `new`: a served
    /// job whose settings (or result group) differ is removed and added
    /// afresh, one that is unchanged is left alone. New ports are bound
    /// now; a port that a removed job holds passes to its successor.
    pub fn bind_change(old: &Config, new: &Config, node: Vec<IpAddr>) -> Result<ServedChange> {
        let kept = |j: &JobConfig| {
            old.job(j.id).is_some_and(|o| is_served(o) && served_view(old, o) == served_view(new, j))
        };
        let mut change = ServedChange::default();
        for o in old.jobs.iter().filter(|o| is_served(o)) {
            if !new.job(o.id).is_some_and(|j| is_served(j) && kept(j)) {
                change.remove.push(o.id);
            }
        }
        for job in new.jobs.iter().filter(|j| is_served(j) && !kept(j)) {
            let workers = worker_sockets(new, job)?;
            let freed = old
                .jobs
                .iter()
                .any(|o| is_served(o) && o.result_port == job.result_port && o.is_ipv6() == job.is_ipv6() && change.remove.contains(&o.id));
            let socket = if freed { JobSocket::TakeOver(job.result_port) } else { JobSocket::Bound(bind_result_port(job)?) };
            let mut service = ResultService::new(job.id, node.clone(), workers, reliability_of(new));
            if let Some(parent) = &job.parent {
                let results = parent.result_port.ok_or_else(|| {
                    anyhow!("job {}: consumer = \"node\" with a parent needs parent.result_port", job.id)
                })?;
                service = service.with_parent(parent, results, reliability_of(new));
            }
            change.add.push((socket, service));
        }
        Ok(change)
    }

    /// Whether the change neither removes nor adds a job.
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.add.is_empty()
    }

    /// Jobs it removes, and jobs it adds.
    pub fn jobs(&self) -> (Vec<u16>, Vec<u16>) {
        (self.remove.clone(), self.add.iter().map(|(_, s)| s.job).collect())
    }

    /// Serve the jobs on a thread of their own (also with none: a reload
    /// may add some); their counters also go to a map pinned as
    /// `pin_dir/result_service` ([`STATS_MAP`]).
    pub fn start(self, pin_dir: &std::path::Path, maps: KernelMaps) -> Result<ResultServer> {
        let map = crate::kernel::maps::create_pinned_counters(
            pin_dir,
            STATS_MAP,
            std::mem::size_of::<ServiceStats>() as u32,
            abi::MAX_JOBS,
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(HashMap::new()));
        let (flag, shared) = (stop.clone(), stats.clone());
        let (changes, queued) = mpsc::channel();
        let (waker, woken) = std::os::unix::net::UnixDatagram::pair()?;
        woken.set_nonblocking(true)?;
        let mut jobs = Vec::new();
        apply_change(&mut jobs, self, &stats, &map);
        let thread = std::thread::Builder::new()
            .name("aggbox-results".into())
            .spawn(move || serve(&mut jobs, &queued, &woken, &flag, &shared, &map, &maps))?;
        Ok(ResultServer { stop, thread: Some(thread), stats, changes, waker })
    }
}

/// A job removed and added again by the same change (its settings
/// changed) keeps its kernel state (`XdpPlane::set_job` zeroes only a new
/// job's), so its new service answers positions from where the old one's
/// RESULTs reached.
pub(super) fn carry_positions<'a>(gone: impl Iterator<Item = &'a ResultService>, added: &mut [(JobSocket, ResultService)]) {
    let seen: HashMap<u16, Option<Seen>> = gone.map(|service| (service.job, service.seen)).collect();
    for (_, service) in added.iter_mut() {
        if let Some(&s) = seen.get(&service.job) {
            service.seen = s;
        }
    }
}

/// Apply `change` to the serving thread's jobs: the removed ones go (their
/// counters with them), the added ones start from nothing (but where a
/// job's RESULTs reached: [`carry_positions`]).
pub(super) fn apply_change(
    jobs: &mut Vec<(UdpSocket, ResultService)>,
    change: ServedChange,
    stats: &Mutex<HashMap<u16, ServiceStats>>,
    pinned: &libbpf_rs::MapHandle,
) {
    let (gone, kept): (Vec<_>, Vec<_>) =
        std::mem::take(jobs).into_iter().partition(|(_, service)| change.remove.contains(&service.job));
    *jobs = kept;
    let mut change = change;
    carry_positions(gone.iter().map(|(_, service)| service), &mut change.add);
    let mut freed: HashMap<u16, UdpSocket> = gone
        .into_iter()
        .filter_map(|(socket, _)| Some((socket.local_addr().ok()?.port(), socket)))
        .collect();
    for &job in &change.remove {
        if let Ok(mut s) = stats.lock() {
            s.remove(&job);
        }
        let _ = pinned.delete(&u32::from(job).to_ne_bytes());
    }
    for (socket, service) in change.add {
        let socket = match socket {
            JobSocket::Bound(s) => s,
            // bind_change saw the port held by a job this change removes.
            JobSocket::TakeOver(port) => match freed.remove(&port) {
                Some(s) => s,
                None => continue,
            },
        };
        jobs.push((socket, service));
    }
}
