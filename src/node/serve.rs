//! The node's result service: for every job with `consumer = "node"`,
//! `aggbox attach` itself takes the job's RESULTs on its `result_port` and
//! does what an aggregator application does for an in-kernel allreduce, so
//! the workers need nothing but the configuration:
//!
//! - it acknowledges every worker's contribution on the kernel's behalf: a
//!   RESULT proves every rank's contribution to its fragment arrived, and it
//!   names that contribution's seq (docs/PROTOCOL.md, "RESULT seq"), the
//!   same on every rank; the ACKs go per packet or per group as `[node]
//!   ack_mode` says, to every worker's socket;
//! - it keeps each RESULT until every worker acknowledged the copy the TC
//!   program brought it (AGK1 kind aggregation, the worker's rank, that
//!   seq), and resends it by unicast to only the workers that miss it, after
//!   the RTO or for a hole in their ACKs.
//!
//! Both halves are `wire::reliability` (`RecvTracker`, `SendWindow`), the
//! implementation the runtime's aggregator uses; this module adds only what
//! a node without calls must work out itself: where a round starts. A call
//! of round r+1 can only complete a fragment once every worker finished
//! round r, so the first RESULT of a newer round retires what is still held
//! of the older ones (a worker that missed one gave up on that call).
//!
//! [`ResultService`] has no socket and no clock (`handle(now, from,
//! datagram)`, `poll(now)`); [`ResultServer`] is its thread, with one UDP
//! socket per served job bound to the job's `result_port`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use crate::config::{Config, JobConfig, ResultConsumer};
use std::os::fd::AsFd;

use libbpf_rs::MapCore;

use crate::wire::abi::{self, Round};
use crate::wire::proto::{self, AckKind, AckMessage, MessageKind, SeqBitmap};
use crate::wire::reliability::{RecvTracker, ReliabilityConfig, SendWindow, Verdict};

/// One datagram for the driver to send from the job's socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Destination (a worker's socket).
    pub to: SocketAddrV4,
    /// The datagram.
    pub datagram: Vec<u8>,
}

/// Counters of one served job; also the value of the pinned
/// `result_service` map (`aggbox status` reads it from another process),
/// hence the C layout.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServiceStats {
    /// RESULTs taken (each fragment once).
    pub results: u64,
    /// RESULTs that were copies of one taken already.
    pub duplicate_results: u64,
    /// ACK datagrams sent on the kernel's behalf (one per worker each).
    pub acks_sent: u64,
    /// Workers' ACKs of RESULTs taken.
    pub acks_received: u64,
    /// RESULT copies resent to a worker that missed them.
    pub resent: u64,
    /// RESULT-shaped datagrams from a source the node's paths never send
    /// RESULTs from (dropped: taken, they would decide a value and end the
    /// workers' retransmissions).
    pub refused_results: u64,
    /// ACKs from a socket that is not the worker they name, or of another
    /// job or kind.
    pub refused_acks: u64,
    /// Datagrams that were neither (contributions, broadcast data, garbage).
    pub other: u64,
    /// Rounds (calls) the node saw RESULTs of.
    pub rounds: u64,
    /// Workers that owe an ACK of some RESULT held now (a gauge).
    pub workers_behind: u64,
}

// SAFETY: only u64 fields, no padding.
unsafe impl plain::Plain for ServiceStats {}

/// Name of the pinned map of [`ServiceStats`] by job id (`u32` key), a
/// user-space map of the attach process: `aggbox status` shows it.
pub const STATS_MAP: &str = "result_service";

/// Worker ACKs kept for RESULTs not taken yet (the TC copy can reach a
/// worker, and its ACK come back, before the local copy is read).
const EARLY_ACKS_MAX: usize = 4096;

/// The result service of one job (see the module docs).
#[derive(Debug)]
pub struct ResultService {
    job: u16,
    /// Addresses of this node (the user-space path's RESULTs come from one).
    node: Vec<Ipv4Addr>,
    /// Worker r's socket: its member socket in the result group.
    workers: Vec<SocketAddrV4>,
    behalf: RecvTracker,
    results: SendWindow,
    /// Seq → workers (bits) that acknowledged it before it was taken.
    early: HashMap<u32, u64>,
    round: Option<Round>,
    /// Elements per fragment, learnt from a RESULT that is not its call's
    /// last (fragment i starts at `i * per`).
    per: Option<u32>,
    stats: ServiceStats,
}

impl ResultService {
    /// The service of `job` on a node with addresses `node`, whose workers'
    /// sockets are `workers` (rank order; at most 64).
    pub fn new(job: u16, node: Vec<Ipv4Addr>, workers: Vec<SocketAddrV4>, cfg: ReliabilityConfig) -> ResultService {
        let mut results = SendWindow::new(cfg, workers.len(), 0);
        // Workers keep what arrives: one gone quiet is busy, and is asked
        // with the newest of what it misses (as the runtime's aggregator).
        results.set_probe_quiet(true);
        ResultService {
            job,
            node,
            workers,
            behalf: RecvTracker::new(cfg),
            results,
            early: HashMap::new(),
            round: None,
            per: None,
            stats: ServiceStats::default(),
        }
    }

    /// The job's counters.
    pub fn stats(&self) -> ServiceStats {
        ServiceStats { workers_behind: u64::from(self.results.unacked_dests().count_ones()), ..self.stats }
    }

    /// RESULTs held until a worker acknowledges them.
    pub fn held(&self) -> usize {
        self.results.in_flight()
    }

    /// Takes one datagram that arrived on the job's `result_port` from
    /// `from` at `now`; what it makes the node send goes to `out`.
    pub fn handle(&mut self, now: Instant, from: SocketAddrV4, datagram: &[u8], out: &mut Vec<Transmit>) {
        match proto::classify(datagram) {
            Some(MessageKind::Agg) => self.on_result(now, from, datagram, out),
            Some(MessageKind::Ack) => self.on_ack(now, from, datagram, out),
            _ => self.stats.other += 1,
        }
    }

    fn on_result(&mut self, now: Instant, from: SocketAddrV4, datagram: &[u8], out: &mut Vec<Transmit>) {
        let Ok((hdr, _)) = proto::split_agg(datagram) else {
            self.stats.other += 1;
            return;
        };
        if !hdr.is_result() || hdr.job != self.job {
            self.stats.other += 1;
            return;
        }
        // The XDP program rewrites the completing contribution in place (a
        // worker's socket is the source); the user-space path sends from
        // the node's address.
        if !self.node.contains(from.ip()) && !self.workers.contains(&from) {
            self.stats.refused_results += 1;
            return;
        }
        let seq = hdr.seq;
        if !hdr.is_last_fragment() {
            self.per = Some(u32::from(hdr.count));
        }
        match self.round {
            Some(r) if hdr.round.is_before(r) => {
                // A late RESULT of a round every worker left: nothing to keep.
            }
            Some(r) if hdr.round == r => self.keep(now, seq, datagram),
            _ => {
                // The first RESULT of a newer round: every worker finished
                // the older ones, so what is held of them is done with.
                // (ACKs that came before this round's RESULTs stay: they
                // may be of it.)
                self.results.forget_all();
                let index = match (hdr.frag_off, self.per) {
                    (0, _) => Some(0),
                    (f, Some(per)) if per > 0 && f % per == 0 => Some(f / per),
                    _ => None,
                };
                // Start the window at the new round's first seq, so that its
                // fragments that come later are not behind it. Where this
                // one's index is unknown (no full fragment seen yet), a small
                // gap from the old round's end is held as placeholders
                // instead (the earlier fragments fill it); a large one is
                // skipped.
                match index {
                    Some(i) => self.results.set_next_seq(seq.wrapping_sub(i)),
                    None if seq.wrapping_sub(self.results.next_seq()) <= self.results.window() as u32 => {}
                    None => self.results.set_next_seq(seq),
                }
                self.round = Some(hdr.round);
                self.stats.rounds += 1;
                self.keep(now, seq, datagram);
            }
        }
        // Acknowledge every rank's contribution to the fragment (once per
        // fragment; a copy of a RESULT is acknowledged again).
        let workers = &self.workers;
        let (job, stats) = (self.job, &mut self.stats);
        let mut emit = |bm: &SeqBitmap| fan_out(job, workers, bm, out, stats);
        if self.behalf.check(seq) == Verdict::Duplicate {
            self.behalf.reack(seq, &mut emit);
            self.stats.duplicate_results += 1;
            return;
        }
        self.behalf.record(seq, hdr.is_last_fragment(), now, &mut emit);
        self.stats.results += 1;
    }

    /// Hold RESULT `seq` until every worker acknowledged its copy (the
    /// kernel sent the copies; nothing is sent now).
    fn keep(&mut self, now: Instant, seq: u32, datagram: &[u8]) {
        let all = if self.workers.len() >= 64 { u64::MAX } else { (1u64 << self.workers.len()) - 1 };
        let _ = self.results.send_at(
            seq,
            all,
            now,
            |_, buf: &mut Vec<u8>| -> Result<(), ()> {
                buf.extend_from_slice(datagram);
                Ok(())
            },
            &mut |_, _| {},
        );
        if let Some(bits) = self.early.remove(&seq) {
            self.results.ack_early_bits(seq, bits);
        }
    }

    fn on_ack(&mut self, now: Instant, from: SocketAddrV4, datagram: &[u8], out: &mut Vec<Transmit>) {
        let Ok(ack) = AckMessage::decode(datagram) else {
            self.stats.other += 1;
            return;
        };
        let rank = usize::from(ack.rank);
        if ack.kind != AckKind::Aggregation || ack.id != self.job || self.workers.get(rank) != Some(&from) {
            // Only worker r's own socket acknowledges worker r's copies: a
            // forged ACK would stop the resend of a RESULT it missed.
            self.stats.refused_acks += 1;
            return;
        }
        self.stats.acks_received += 1;
        let (workers, stats) = (&self.workers, &mut self.stats);
        self.results.on_ack(rank, &ack.bitmap, now, &mut |d, bytes| {
            stats.resent += 1;
            out.push(Transmit { to: workers[d], datagram: bytes.to_vec() });
        });
        for seq in ack.bitmap.received() {
            if !self.results.is_known(seq) {
                *self.early.entry(seq).or_default() |= 1u64 << rank.min(63);
            }
        }
        if self.early.len() > EARLY_ACKS_MAX {
            // Costs resends only (a worker re-acknowledges a duplicate).
            self.early.clear();
        }
    }

    /// Sends what is due at `now` (delayed ACKs, resends); returns when to
    /// poll again at the latest.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Transmit>) -> Option<Instant> {
        let (job, workers, stats) = (self.job, &self.workers, &mut self.stats);
        let a = self.behalf.poll(now, &mut |bm| fan_out(job, workers, bm, out, stats));
        let stats = &mut self.stats;
        let b = self.results.poll(now, &mut |d, bytes| {
            stats.resent += 1;
            out.push(Transmit { to: workers[d], datagram: bytes.to_vec() });
        });
        match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// One ACK on the kernel's behalf to every worker (each under its rank).
fn fan_out(job: u16, workers: &[SocketAddrV4], bm: &SeqBitmap, out: &mut Vec<Transmit>, stats: &mut ServiceStats) {
    for (rank, &to) in workers.iter().enumerate() {
        let msg = AckMessage { id: job, rank: rank as u16, kind: AckKind::Aggregation, flags: 0, bitmap: *bm };
        let mut datagram = Vec::with_capacity(64);
        if msg.encode_into(&mut datagram).is_ok() {
            stats.acks_sent += 1;
            out.push(Transmit { to, datagram });
        }
    }
}

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
fn worker_sockets(config: &Config, job: &JobConfig) -> Result<Vec<SocketAddrV4>> {
    let g = job.result_group.ok_or_else(|| anyhow!("job {}: consumer = \"node\" without result_group", job.id))?;
    let group = config.group(g).ok_or_else(|| anyhow!("job {}: no [[group]] {g}", job.id))?;
    job.workers
        .iter()
        .map(|w| {
            group
                .members
                .iter()
                .find(|m| m.ip() == w)
                .copied()
                .ok_or_else(|| anyhow!("job {}: worker {w} is not a member of group {g}", job.id))
        })
        .collect()
}

/// The thread that serves every `consumer = "node"` job of a node, one UDP
/// socket each on its `result_port`; stopped and joined on drop. Jobs are
/// added and removed while it runs ([`ResultServer::apply`], a reload).
pub struct ResultServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<Mutex<HashMap<u16, ServiceStats>>>,
    changes: mpsc::Sender<(ServedChange, mpsc::Sender<()>)>,
}

impl std::fmt::Debug for ResultServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResultServer").finish_non_exhaustive()
    }
}

/// The socket of a served job: bound beforehand, or the one a job that
/// the same change removes holds on the same port.
#[derive(Debug)]
enum JobSocket {
    Bound(UdpSocket),
    TakeOver(u16),
}

/// A set of served jobs to remove and to add, with every new port bound
/// before anything changes: a port another process holds fails
/// [`BoundJobs::bind`] / [`BoundJobs::bind_change`], which then change
/// nothing.
#[derive(Debug, Default)]
pub struct ServedChange {
    remove: Vec<u16>,
    add: Vec<(JobSocket, ResultService)>,
}

/// The sockets of a [`ResultServer`] at attach (a [`ServedChange`] that
/// only adds).
pub type BoundJobs = ServedChange;

/// A served job's `result_port`, bound for the result service.
fn bind_result_port(job: &JobConfig) -> Result<UdpSocket> {
    let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, job.result_port)).map_err(|e| {
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
fn is_served(job: &JobConfig) -> bool {
    job.consumer == ResultConsumer::Node
}

/// A served job's settings as the service sees them: the job, and the
/// group its RESULT copies go to (the workers' sockets).
fn served_view<'a>(config: &'a Config, job: &'a JobConfig) -> (&'a JobConfig, Option<&'a crate::config::GroupConfig>) {
    (job, job.result_group.and_then(|g| config.group(g)))
}

impl ServedChange {
    /// Binds `0.0.0.0:result_port` for every node-served job of `config`
    /// (none: an empty set), for a node with addresses `node`.
    pub fn bind(config: &Config, node: Vec<Ipv4Addr>) -> Result<ServedChange> {
        Self::bind_change(&Config::default(), config, node)
    }

    /// What turns the served jobs of `old` into those of `new`: a served
    /// job whose settings (or result group) differ is removed and added
    /// afresh, one that is unchanged is left alone. New ports are bound
    /// now; a port that a removed job holds passes to its successor.
    pub fn bind_change(old: &Config, new: &Config, node: Vec<Ipv4Addr>) -> Result<ServedChange> {
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
                .any(|o| is_served(o) && o.result_port == job.result_port && change.remove.contains(&o.id));
            let socket = if freed { JobSocket::TakeOver(job.result_port) } else { JobSocket::Bound(bind_result_port(job)?) };
            change.add.push((socket, ResultService::new(job.id, node.clone(), workers, reliability_of(new))));
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
    pub fn start(self, pin_dir: &std::path::Path) -> Result<ResultServer> {
        let opts = libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as libbpf_sys::size_t,
            ..Default::default()
        };
        let map = libbpf_rs::MapHandle::create(
            libbpf_rs::MapType::Hash,
            Some(STATS_MAP),
            4,
            std::mem::size_of::<ServiceStats>() as u32,
            abi::MAX_JOBS,
            &opts,
        )
        .map_err(|e| anyhow!("creating the {STATS_MAP} map: {e}"))?;
        crate::kernel::maps::pin(map.as_fd(), &pin_dir.join(STATS_MAP))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(HashMap::new()));
        let (flag, shared) = (stop.clone(), stats.clone());
        let (changes, queued) = mpsc::channel();
        let mut jobs = Vec::new();
        apply_change(&mut jobs, self, &stats, &map);
        let thread = std::thread::Builder::new()
            .name("aggbox-results".into())
            .spawn(move || serve(&mut jobs, &queued, &flag, &shared, &map))?;
        Ok(ResultServer { stop, thread: Some(thread), stats, changes })
    }
}

/// Apply `change` to the serving thread's jobs: the removed ones go (their
/// counters with them), the added ones start from nothing.
fn apply_change(
    jobs: &mut Vec<(UdpSocket, ResultService)>,
    change: ServedChange,
    stats: &Mutex<HashMap<u16, ServiceStats>>,
    pinned: &libbpf_rs::MapHandle,
) {
    let (gone, kept): (Vec<_>, Vec<_>) =
        std::mem::take(jobs).into_iter().partition(|(_, service)| change.remove.contains(&service.job));
    *jobs = kept;
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

/// A function returning the counters of every served job (for the metrics
/// endpoint, which runs on its own thread).
pub type ResultStatsFn = Arc<dyn Fn() -> HashMap<u16, ServiceStats> + Send + Sync>;

impl ResultServer {
    /// The counters of every served job, as of the last poll.
    pub fn stats(&self) -> HashMap<u16, ServiceStats> {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// [`ResultServer::stats`] as a `Send + Sync` function.
    pub fn stats_fn(&self) -> ResultStatsFn {
        let stats = self.stats.clone();
        Arc::new(move || stats.lock().map(|s| s.clone()).unwrap_or_default())
    }

    /// Remove and add served jobs between two polls of the serving thread;
    /// returns once it has. The other jobs' windows are untouched.
    pub fn apply(&self, change: ServedChange) -> Result<()> {
        let (done, applied) = mpsc::channel();
        self.changes.send((change, done)).map_err(|_| anyhow!("the result service has stopped"))?;
        applied
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow!("the result service did not take the change within 5 s"))
    }
}

impl Drop for ResultServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Longest wait in `poll(2)`, so that a stop is seen.
const IDLE_WAIT: Duration = Duration::from_millis(50);

fn serve(
    jobs: &mut Vec<(UdpSocket, ResultService)>,
    changes: &mpsc::Receiver<(ServedChange, mpsc::Sender<()>)>,
    stop: &AtomicBool,
    stats: &Mutex<HashMap<u16, ServiceStats>>,
    pinned: &libbpf_rs::MapHandle,
) {
    let mut buf = vec![0u8; 65536];
    let mut out = Vec::new();
    // Zeros at once, so the counters exist from the start.
    publish(jobs, stats, pinned);
    let mut published = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        while let Ok((change, done)) = changes.try_recv() {
            apply_change(jobs, change, stats, pinned);
            publish(jobs, stats, pinned);
            let _ = done.send(());
        }
        let now = Instant::now();
        let mut wake = now + IDLE_WAIT;
        for (socket, service) in jobs.iter_mut() {
            // Everything queued now, then what is due.
            while let Ok((n, from)) = socket.recv_from(&mut buf) {
                if let std::net::SocketAddr::V4(from) = from {
                    service.handle(Instant::now(), from, &buf[..n], &mut out);
                }
            }
            if let Some(at) = service.poll(Instant::now(), &mut out) {
                wake = wake.min(at);
            }
            for t in out.drain(..) {
                let _ = socket.send_to(&t.datagram, t.to);
            }
        }
        // The counters go out every PUBLISH_EVERY, not at every wake-up (a
        // bpf syscall each, and this thread wakes per burst of RESULTs).
        if published.elapsed() >= PUBLISH_EVERY {
            published = Instant::now();
            publish(jobs, stats, pinned);
        }
        let mut fds: Vec<libc::pollfd> = jobs
            .iter()
            .map(|(s, _)| libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 })
            .collect();
        let timeout = wake.saturating_duration_since(Instant::now()).as_millis().min(IDLE_WAIT.as_millis()) as libc::c_int;
        // SAFETY: fds is a valid array of pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout.max(1)) };
    }
    publish(jobs, stats, pinned);
}

/// How often the serving thread publishes its counters (metrics, status).
const PUBLISH_EVERY: Duration = Duration::from_millis(50);

/// Hand the counters to the metrics endpoint and the pinned map.
fn publish(jobs: &[(UdpSocket, ResultService)], stats: &Mutex<HashMap<u16, ServiceStats>>, pinned: &libbpf_rs::MapHandle) {
    if let Ok(mut s) = stats.lock() {
        for (_, service) in jobs {
            let now = service.stats();
            if s.insert(service.job, now) != Some(now) {
                let key = u32::from(service.job);
                let _ = pinned.update(&key.to_ne_bytes(), abi::as_bytes(&now), libbpf_rs::MapFlags::ANY);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::abi::{self, Op};
    use crate::wire::proto::{AckMode, AggHeader};

    const JOB: u16 = 9;
    const NODE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);

    fn worker(r: u16) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1 + r as u8), 5000)
    }

    fn service(mode: AckMode) -> ResultService {
        let cfg = ReliabilityConfig { ack_mode: mode, ..ReliabilityConfig::default() };
        ResultService::new(JOB, vec![NODE], (0..3).map(worker).collect(), cfg)
    }

    /// RESULT of fragment `index` (of `per` elements) of `round`, named by
    /// contribution seq `seq`.
    fn result(round: u32, seq: u32, index: u32, last: bool) -> Vec<u8> {
        let hdr = AggHeader {
            job: JOB,
            rank: abi::RESULT_RANK,
            seq,
            round: Round(round),
            frag_off: index * 4,
            op: Op::Sum,
            flags: abi::AGG_F_RESULT | if last { abi::AGG_F_LAST_FRAGMENT } else { 0 },
            count: 4,
        };
        let mut out = Vec::new();
        proto::encode_agg_into(&hdr, &[1, 2, 3, 4], &mut out).unwrap();
        out
    }

    fn ack(rank: u16, seqs: &[u32]) -> Vec<u8> {
        let mut bm = SeqBitmap::new(seqs[0], 64).unwrap();
        for &s in seqs {
            bm.set(s);
        }
        let mut out = Vec::new();
        AckMessage { id: JOB, rank, kind: AckKind::Aggregation, flags: 0, bitmap: bm }.encode_into(&mut out).unwrap();
        out
    }

    fn acks_to(out: &[Transmit]) -> Vec<(SocketAddrV4, u16, Vec<u32>)> {
        out.iter()
            .filter_map(|t| AckMessage::decode(&t.datagram).ok().map(|a| (t.to, a.rank, a.bitmap.received().collect())))
            .collect()
    }

    fn resends(out: &[Transmit]) -> Vec<(SocketAddrV4, u32)> {
        out.iter().filter_map(|t| proto::split_agg(&t.datagram).ok().map(|(h, _)| (t.to, h.seq))).collect()
    }

    #[test]
    fn a_result_is_acknowledged_to_every_worker_under_its_seq() {
        let mut s = service(AckMode::Packet);
        let (now, mut out) = (Instant::now(), Vec::new());
        s.handle(now, worker(1), &result(5, 40, 0, false), &mut out);
        let acks = acks_to(&out);
        assert_eq!(acks, (0..3).map(|r| (worker(r), r, vec![40])).collect::<Vec<_>>());
        assert_eq!((s.stats().results, s.stats().acks_sent, s.held()), (1, 3, 1));
        assert_eq!((s.stats().rounds, s.stats().workers_behind), (1, 3), "every worker owes the ACK of its copy");
        // A copy is acknowledged again, not taken again.
        out.clear();
        s.handle(now, worker(1), &result(5, 40, 0, false), &mut out);
        assert_eq!(acks_to(&out).len(), 3);
        assert_eq!((s.stats().results, s.stats().duplicate_results), (1, 1));
    }

    #[test]
    fn only_the_worker_that_misses_a_result_gets_it_again() {
        let mut s = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        s.handle(t0, NODE_SOCKET, &result(5, 40, 0, false), &mut out);
        s.handle(t0, worker(0), &result(5, 41, 1, true), &mut out);
        out.clear();
        // Workers 0 and 2 acknowledge both copies; worker 1 only the first.
        s.handle(t0, worker(0), &ack(0, &[40, 41]), &mut out);
        s.handle(t0, worker(2), &ack(2, &[40, 41]), &mut out);
        s.handle(t0, worker(1), &ack(1, &[40]), &mut out);
        assert_eq!(s.stats().acks_received, 3);
        // Until the RTO nothing is resent; then only 41, only to worker 1.
        let at = s.poll(t0, &mut out).expect("a timer for the missing ACK");
        assert!(resends(&out).is_empty());
        let later = at.max(t0) + Duration::from_millis(1);
        s.poll(later, &mut out);
        assert_eq!(resends(&out), vec![(worker(1), 41)]);
        assert_eq!(s.stats().resent, 1);
        out.clear();
        s.handle(later, worker(1), &ack(1, &[40, 41]), &mut out);
        assert_eq!(s.held(), 0, "every copy acknowledged: nothing held");
        s.poll(later + Duration::from_secs(5), &mut out);
        assert!(resends(&out).is_empty());
    }

    const NODE_SOCKET: SocketAddrV4 = SocketAddrV4::new(NODE, 40000);

    #[test]
    fn forged_results_and_acks_are_refused_and_change_nothing() {
        let mut s = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        let stranger = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 66), 5000);
        s.handle(t0, stranger, &result(5, 40, 0, true), &mut out);
        // Worker 1's address on another port is not worker 1's socket.
        s.handle(t0, SocketAddrV4::new(*worker(1).ip(), 6000), &result(5, 40, 0, true), &mut out);
        assert!(out.is_empty(), "a forged RESULT acknowledges nothing");
        assert_eq!((s.stats().refused_results, s.stats().results), (2, 0));
        s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
        out.clear();
        // Worker 2's ACK sent from worker 0's socket must not stop its resend.
        s.handle(t0, worker(0), &ack(2, &[40]), &mut out);
        s.handle(t0, worker(0), &ack(0, &[40]), &mut out);
        s.handle(t0, worker(1), &ack(1, &[40]), &mut out);
        assert_eq!(s.stats().refused_acks, 1);
        s.poll(t0 + Duration::from_secs(2), &mut out);
        assert_eq!(resends(&out), vec![(worker(2), 40)]);
    }

    #[test]
    fn an_ack_before_the_result_counts_and_a_newer_round_retires_the_older() {
        let mut s = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        // Worker 2's ACK of seq 40 arrives before the node took RESULT 40.
        s.handle(t0, worker(2), &ack(2, &[40]), &mut out);
        s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
        s.handle(t0, worker(0), &ack(0, &[40]), &mut out);
        out.clear();
        s.poll(t0 + Duration::from_secs(2), &mut out);
        assert_eq!(resends(&out), vec![(worker(1), 40)], "worker 2's early ACK counted");
        // Round 6's first RESULT (fragment 1 first): every worker finished
        // round 5, so its RESULT 40 is no longer held or resent.
        out.clear();
        s.handle(t0 + Duration::from_secs(2), worker(0), &result(6, 42, 1, true), &mut out);
        s.handle(t0 + Duration::from_secs(2), worker(0), &result(6, 41, 0, false), &mut out);
        assert_eq!(s.held(), 2, "round 6's two RESULTs, both registered (fragment 0 came second)");
        for r in 0..3 {
            s.handle(t0 + Duration::from_secs(2), worker(r), &ack(r, &[41, 42]), &mut out);
        }
        out.clear();
        s.poll(t0 + Duration::from_secs(10), &mut out);
        assert!(resends(&out).is_empty());
        assert_eq!(s.held(), 0);
    }

    #[test]
    fn group_mode_acknowledges_on_behalf_after_the_delay_or_at_the_last_fragment() {
        let mut s = service(AckMode::Group);
        let (t0, mut out) = (Instant::now(), Vec::new());
        s.handle(t0, worker(0), &result(5, 40, 0, false), &mut out);
        assert!(acks_to(&out).is_empty(), "group mode waits");
        s.handle(t0, worker(0), &result(5, 41, 1, true), &mut out);
        let acks = acks_to(&out);
        assert_eq!(acks.len(), 3, "the last fragment is acknowledged at once: {acks:?}");
        assert!(acks.iter().all(|(_, _, seqs)| seqs == &vec![40, 41]));
    }

    #[test]
    fn a_result_port_another_process_holds_fails_the_bind_and_names_the_job() {
        let taken = UdpSocket::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let text = format!(
            "[[job]]\nid = 12\nport = {}\nworkers = [\"10.0.0.1\"]\nresult_port = {port}\nresult_group = 1\nconsumer = \"node\"\n\n[[group]]\nid = 1\nmembers = [\"10.0.0.1:5000\"]\n",
            if port == 40000 { 40001 } else { 40000 }
        );
        let config = Config::parse(&text, "t.toml").expect("config");
        let err = BoundJobs::bind(&config, vec![NODE]).expect_err("the port is taken");
        let msg = format!("{err:#}");
        assert!(msg.contains("job 12") && msg.contains(&format!("result_port {port}")) && msg.contains("holds it"), "{msg}");
        drop(taken);
        let bound = BoundJobs::bind(&config, vec![NODE]).expect("free again");
        assert!(!bound.is_empty());
    }

    /// Two free UDP ports (bound and released at once).
    fn free_ports() -> (u16, u16) {
        let a = UdpSocket::bind("0.0.0.0:0").unwrap();
        let b = UdpSocket::bind("0.0.0.0:0").unwrap();
        (a.local_addr().unwrap().port(), b.local_addr().unwrap().port())
    }

    fn served_job(id: u16, result_port: u16, window: u32) -> String {
        format!(
            "[[job]]\nid = {id}\nport = {}\nworkers = [\"10.0.0.1\"]\nresult_port = {result_port}\nresult_group = 1\nwindow = {window}\nconsumer = \"node\"\n\n",
            30000 + id
        )
    }

    const GROUP: &str = "[[group]]\nid = 1\nmembers = [\"10.0.0.1:5000\"]\n";

    #[test]
    fn a_change_binds_only_new_ports_and_hands_a_removed_jobs_port_to_its_successor() {
        let (p, q) = free_ports();
        let old = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(2, q, 4)), "old.toml").unwrap();
        // Job 1 unchanged; job 2 changed (same port): removed and added,
        // its socket passed on, nothing bound (the old one still holds q).
        let holder = UdpSocket::bind(("0.0.0.0", q)).unwrap();
        let new = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(2, q, 8)), "new.toml").unwrap();
        let change = ServedChange::bind_change(&old, &new, vec![NODE]).expect("q passes on, nothing to bind");
        assert_eq!(change.jobs(), (vec![2], vec![2]));
        assert!(matches!(change.add[0].0, JobSocket::TakeOver(port) if port == q));
        // Job 2 removed, job 3 takes its port: the same hand-over.
        let new = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(3, q, 4)), "new.toml").unwrap();
        let change = ServedChange::bind_change(&old, &new, vec![NODE]).expect("q passes on");
        assert_eq!(change.jobs(), (vec![2], vec![3]));
        // A job on a port nobody of the old config held must bind it.
        drop(holder);
        let holder = UdpSocket::bind(("0.0.0.0", p)).unwrap();
        let new = Config::parse(&format!("{}{GROUP}", served_job(4, p, 4)), "new.toml").unwrap();
        let fresh = Config::default();
        let err = ServedChange::bind_change(&fresh, &new, vec![NODE]).expect_err("p is held");
        assert!(format!("{err:#}").contains("job 4"), "{err:#}");
        drop(holder);
        // Nothing changed: an empty change.
        assert!(ServedChange::bind_change(&old, &old, vec![NODE]).unwrap().is_empty());
    }
}
