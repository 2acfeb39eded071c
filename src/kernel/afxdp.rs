//! The user-space aggregation path: what the XDP program hands over through
//! AF_XDP (ops 5..10, FLOAT32 payloads, jobs flagged `userspace_only`, new
//! slots while the kernel's slot pool is full or the job is in overload) is
//! aggregated here with the same semantics as the kernel (PROTOCOL.md,
//! "Semantics at the aggregator") and the [`crate::wire::reducer::Accumulator`],
//! and each RESULT is delivered where the kernel would deliver it: a UDP
//! datagram to the node's own address (the contribution's destination) on
//! the job's `result_port`.
//!
//! One worker thread polls one [`XskSocket`] per RX queue of the interface,
//! owns every user-space slot (no locks on the data path), and every
//! [`UserspaceOptions::tick`] also runs the overload watcher (the paper's
//! "transfer to user space" rule) and garbage-collects stale slots.
//!
//! A fragment is served by exactly one path: the XDP program records, with
//! one `BPF_NOEXIST` insert into `slot_owner`, which path serves each new
//! slot of a kernel op; every later contribution of that fragment follows
//! the record (see docs/USERSPACE.md). This path writes the kernel's
//! `completed` marker before it deletes its `slot_owner` record, so a late
//! retransmission is recognised by either path and never starts a new slot.
//!
//! Start it inside the interface's network namespace (sockets and AF_XDP
//! bindings are made in the calling thread's namespace), after the jobs are
//! written into the maps; see [`UserspacePath::start`].
//!
//! The slots themselves live in a [`UserspaceAggregator`], which has no socket, no map
//! and no clock of its own (the worker hands it each datagram and the time),
//! so its rules and its memory bounds can be driven and tested directly.
//! Memory is bounded twice per new slot: by the job's slot count
//! (`userspace_slots`) and by bytes, per job (`[[job]]
//! userspace_slot_bytes`) and per node (`[node] userspace_slot_bytes`); see
//! [`slot_bytes`] for what a slot is charged.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

use crate::wire::abi::{self, DropReason, Round};
use crate::config::Config;
use crate::kernel::xdp::{XdpPlane, KernelMaps};
use crate::wire::abi::Op;
use crate::wire::frame::parse_frame;
use crate::wire::proto;
use crate::wire::slots::{Added, Refused, Slot, SlotKey, SlotTable};
use crate::kernel::xsk::{self, XskConfig, XskSocket, XskStats};

/// Tunables of the user-space path.
#[derive(Debug, Clone, PartialEq)]
pub struct UserspaceOptions {
    /// Overload threshold: fraction of the job's `slots` bound. A job whose
    /// kernel slot pool holds at least `ceil(fraction * slots)` slots for
    /// longer than [`Self::overload_hold`] is put in overload: its NEW slots
    /// go to user space until the pool drains below the threshold.
    pub overload_fraction: f64,
    /// How long the pool must stay above the threshold.
    pub overload_hold: Duration,
    /// Most user-space slots per job (beyond: `slot_pool_full` drops).
    pub max_slots_per_job: usize,
    /// Completed keys remembered per job for retransmission detection.
    pub completed_per_job: usize,
    /// Period of the overload watcher, stale-slot collection and stats
    /// publication. Each tick costs a few syscalls: at 2 ms an idle node's
    /// worker took 2.6 % of a CPU, at 10 ms 1 % (the watcher reacts after
    /// `overload_hold` anyway).
    pub tick: Duration,
    /// Sizes of each AF_XDP socket.
    pub xsk: XskConfig,
}

impl Default for UserspaceOptions {
    fn default() -> Self {
        UserspaceOptions {
            overload_fraction: 0.9,
            overload_hold: Duration::from_millis(50),
            max_slots_per_job: 16384,
            completed_per_job: abi::MAX_COMPLETED as usize,
            tick: Duration::from_millis(10),
            xsk: XskConfig::default(),
        }
    }
}

/// Upper bounds (seconds) of the latency histogram's buckets; a last,
/// implicit bucket holds everything above the largest bound.
pub const LATENCY_BOUNDS_S: [f64; 16] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
    250e-3, 500e-3, 1.0,
];

/// Latency from the arrival of a slot's first contribution to its RESULT.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LatencyHistogram {
    /// Per-bucket counts (not cumulative): `counts[i]` counts latencies
    /// `<= LATENCY_BOUNDS_S[i]` and above the previous bound;
    /// `counts[LATENCY_BOUNDS_S.len()]` the rest.
    pub counts: Vec<u64>,
    /// Sum of all latencies, seconds.
    pub sum_s: f64,
    /// Number of latencies recorded (= RESULTs).
    pub count: u64,
}

impl LatencyHistogram {
    fn record(&mut self, d: Duration) {
        if self.counts.is_empty() {
            self.counts = vec![0; LATENCY_BOUNDS_S.len() + 1];
        }
        let s = d.as_secs_f64();
        let i = LATENCY_BOUNDS_S
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(LATENCY_BOUNDS_S.len());
        self.counts[i] += 1;
        self.sum_s += s;
        self.count += 1;
    }

    /// Cumulative counts per bound (Prometheus `le` buckets), `+Inf` last.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        let mut out = Vec::new();
        for (i, &c) in self.counts.iter().enumerate() {
            acc += c;
            out.push((LATENCY_BOUNDS_S.get(i).copied().unwrap_or(f64::INFINITY), acc));
        }
        out
    }
}

/// Why the user-space path refused a contribution. Counted in
/// [`UserspaceStats::drops`] under [`Refusal::label`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// A rule shared with the kernel; the kernel's label.
    Drop(DropReason),
    /// A new slot would take the job's slot memory past its
    /// `userspace_slot_bytes` ([`DROP_SLOT_BYTES_JOB`]).
    JobSlotBytes,
    /// A new slot would take the slot memory of all jobs past the node's
    /// `userspace_slot_bytes` ([`DROP_SLOT_BYTES_NODE`]).
    NodeSlotBytes,
}

/// Drop label of [`Refusal::JobSlotBytes`] (metrics `reason`).
pub const DROP_SLOT_BYTES_JOB: &str = "slot_bytes_job";
/// Drop label of [`Refusal::NodeSlotBytes`] (metrics `reason`).
pub const DROP_SLOT_BYTES_NODE: &str = "slot_bytes_node";

impl Refusal {
    /// The refusals only this path makes (the kernel bounds its slots by
    /// count: its values have a fixed size).
    pub const OWN: [Refusal; 2] = [Refusal::JobSlotBytes, Refusal::NodeSlotBytes];

    /// Label used in metrics and the stats (snake case).
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Drop(reason) => reason.label(),
            Refusal::JobSlotBytes => DROP_SLOT_BYTES_JOB,
            Refusal::NodeSlotBytes => DROP_SLOT_BYTES_NODE,
        }
    }
}

impl From<DropReason> for Refusal {
    fn from(reason: DropReason) -> Self {
        Refusal::Drop(reason)
    }
}

/// Fixed bytes charged per user-space slot on top of its elements: the
/// slot and its key in the job's hash table, counted twice (a table that
/// grew to hold the job's peak is at worst half full and never shrinks),
/// plus the accumulator's heap allocation header.
pub const SLOT_FIXED_BYTES: usize = 2 * (std::mem::size_of::<(SlotKey, (Slot, Held))>() + 1) + 16;

/// Bytes a new slot is charged against the byte bounds: [`SLOT_FIXED_BYTES`]
/// plus 8 B per element (the widest accumulator a valid config makes: i64
/// for int SUM/AVG, f64 for PROD and float SUM/AVG; the others use 4 B and
/// are charged 8), or 16 B for int SUM/AVG of a job whose Σ|weight| × 2^31
/// does not fit an i64 (the accumulator then widens to i128; config weights
/// of at most 2^23 never get there).
pub fn slot_bytes(op: Op, float: bool, count: usize, weight_abs_sum: u64) -> usize {
    let huge = !float
        && matches!(op, Op::Sum | Op::Avg)
        && u128::from(weight_abs_sum) << 31 > i64::MAX as u128;
    let per_element = if huge { 16 } else { 8 };
    SLOT_FIXED_BYTES.saturating_add(count.saturating_mul(per_element))
}

/// A function returning a snapshot of the user-space path's counters: the
/// metrics endpoint calls it at each scrape, from its own thread.
pub type UserspaceStatsFn = std::sync::Arc<dyn Fn() -> UserspaceStats + Send + Sync>;

/// Counters of the user-space path (a snapshot, for metrics and status).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct UserspaceStats {
    /// Frames received from the AF_XDP sockets.
    pub received: u64,
    /// Their UDP payload bytes (0 for frames that did not parse).
    pub received_bytes: u64,
    /// Contributions added to a slot (including the completing ones).
    pub accepted: u64,
    /// RESULT datagrams sent.
    pub results: u64,
    /// RESULTs that could not be sent (sendto failed).
    pub result_send_errors: u64,
    /// Dropped contributions by [`Refusal::label`] (the kernel's
    /// [`DropReason::label`] or this path's own memory bounds).
    pub drops: BTreeMap<&'static str, u64>,
    /// First contribution → RESULT latency.
    pub latency: LatencyHistogram,
    /// Slots currently held in user space (all jobs).
    pub slots_in_use: usize,
    /// Slots held per job, with the job's bound: (in use, limit).
    pub slots_by_job: BTreeMap<u16, (usize, usize)>,
    /// Bytes of slot memory held (all jobs), as charged by [`slot_bytes`].
    pub slot_bytes: usize,
    /// The node's bound on them (`[node] userspace_slot_bytes`).
    pub slot_bytes_limit: usize,
    /// Bytes of slot memory per job, with the job's bound: (in use, limit).
    pub slot_bytes_by_job: BTreeMap<u16, (usize, usize)>,
    /// Times a job entered overload.
    pub overload_events: u64,
    /// Jobs in overload right now.
    pub jobs_in_overload: Vec<u16>,
    /// Stale user-space slots collected (never completed).
    pub stale_slots_collected: u64,
    /// Kernel counters of each AF_XDP socket, by RX queue.
    pub xsk: BTreeMap<u32, XskStats>,
}

impl UserspaceStats {
    /// Packets dropped for `reason`.
    pub fn drop(&self, reason: DropReason) -> u64 {
        self.drops.get(reason.label()).copied().unwrap_or(0)
    }

    /// Contributions refused for `refusal` (any reason, including this
    /// path's own memory bounds).
    pub fn refused(&self, refusal: Refusal) -> u64 {
        self.drops.get(refusal.label()).copied().unwrap_or(0)
    }

    /// All dropped packets.
    pub fn dropped(&self) -> u64 {
        self.drops.values().sum()
    }

    fn count_drop(&mut self, refusal: Refusal) {
        *self.drops.entry(refusal.label()).or_insert(0) += 1;
    }
}

/// The running user-space path: its worker thread and its sockets.
pub struct UserspacePath {
    stop: Arc<AtomicBool>,
    changes: mpsc::Sender<(Config, Vec<u16>, mpsc::Sender<()>)>,
    /// Wakes the worker from its poll for a change (a reload, a job on
    /// demand), so it is taken at once rather than at the next tick.
    waker: std::os::unix::net::UnixDatagram,
    stats: Arc<Mutex<UserspaceStats>>,
    worker: Option<JoinHandle<()>>,
    queues: Vec<u32>,
    maps: Arc<KernelMaps>,
    jobs: Vec<u16>,
    multi_buffer: bool,
}

impl std::fmt::Debug for UserspacePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserspacePath")
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

/// One configured job as this path needs it.
#[derive(Debug, Clone)]
struct JobInfo {
    /// (address, weight) per rank: a contribution is its rank's only if its
    /// IP version and address are the rank's (docs/PROTOCOL.md "IPv6").
    ranks: Vec<(IpAddr, i32)>,
    /// RESULTs go upstream: numbered by this path's own counter, as the
    /// kernel's (`result_seq_write` in aggbox_xdp.bpf.c).
    has_parent: bool,
    weight_sum: i64,
    /// Σ|weight|: decides the accumulator's width (see [`slot_bytes`]).
    weight_abs_sum: u64,
    result_port: u16,
    vector_len: u32,
    slots: u32,
    userspace_only: bool,
    /// Round window (never 0): the same staleness rule as the kernel's.
    window: u32,
    /// This job's bound on user-space slots (config `userspace_slots`).
    userspace_slots: usize,
    /// This job's bound on user-space slot bytes (`userspace_slot_bytes`).
    slot_bytes: usize,
}

/// What this path keeps with each slot (`wire::slots::SlotTable`).
#[derive(Debug)]
struct Held {
    first_at: Instant,
    /// The kernel recorded this slot in `slot_owner`: completion writes its
    /// `completed` marker and removes the record.
    kernel_owned_record: bool,
    /// What this slot is charged against the byte bounds ([`slot_bytes`]).
    bytes: usize,
}

/// Runtime state of one job on this path.
#[derive(Debug)]
struct JobRt {
    /// No emptied slots are kept: the byte bounds count what open slots hold.
    slots: SlotTable<Held>,
    completed: HashSet<SlotKey>,
    completed_fifo: VecDeque<SlotKey>,
    newest: Option<Round>,
    kernel_newest: Option<Round>,
    result_seq: u32,
    handoff: abi::JobHandoff,
    above_since: Option<Instant>,
    /// Sum of the `bytes` of `slots`.
    bytes: usize,
}

impl Default for JobRt {
    fn default() -> JobRt {
        JobRt {
            slots: SlotTable::new(0),
            completed: HashSet::new(),
            completed_fifo: VecDeque::new(),
            newest: None,
            kernel_newest: None,
            result_seq: 0,
            handoff: abi::JobHandoff::default(),
            above_since: None,
            bytes: 0,
        }
    }
}

/// Whether `round` is stale ([`Round::is_stale`]) behind the newest round
/// completed on either path (`newest`: here, `kernel_newest`: in the kernel).
fn round_is_stale(newest: Option<Round>, kernel_newest: Option<Round>, round: Round, window: u32) -> bool {
    round.is_stale(newest, window) || round.is_stale(kernel_newest, window)
}

impl JobRt {
    fn is_stale(&self, round: Round, window: u32) -> bool {
        round_is_stale(self.newest, self.kernel_newest, round, window)
    }
}

/// The user-space slots of every job, with the kernel's rules and this
/// path's bounds (slot count per job, slot bytes per job and per node). No
/// I/O: [`UserspaceAggregator::contribute`] takes a datagram and its source address
/// and returns the RESULT to send, if it completed a slot; the caller writes
/// the kernel's `completed` marker, deletes the `slot_owner` record and sends.
#[derive(Debug)]
pub struct UserspaceAggregator {
    jobs: HashMap<u16, JobInfo>,
    rt: HashMap<u16, JobRt>,
    /// Overall cap on a job's slot count ([`UserspaceOptions::max_slots_per_job`]).
    max_slots_per_job: usize,
    completed_per_job: usize,
    /// The node's bound on slot bytes (`[node] userspace_slot_bytes`).
    node_slot_bytes: usize,
    /// Sum of the jobs' `bytes`.
    bytes: usize,
    stats: UserspaceStats,
}

/// A slot completed by [`UserspaceAggregator::contribute`]: its RESULT and what the
/// caller still owes the kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The slot's job.
    pub job: u16,
    /// The slot's round.
    pub round: Round,
    /// The slot's fragment offset.
    pub frag_off: u32,
    /// The job's `result_port`: where the RESULT goes on the node.
    pub result_port: u16,
    /// The RESULT datagram (AGG1 header + payload).
    pub result: Vec<u8>,
    /// The kernel recorded this fragment in `slot_owner`: write its
    /// `completed` marker, then delete the record.
    pub kernel_owned_record: bool,
    /// The job's newest completed round advanced: publish this in
    /// `job_handoff` (after the marker).
    pub handoff: Option<abi::JobHandoff>,
}

/// Every job of `config` as this path needs it.
fn job_infos(config: &Config) -> HashMap<u16, JobInfo> {
    let mut jobs = HashMap::new();
    for j in &config.jobs {
        let weights = if j.weights.len() == j.workers.len() {
            j.weights.clone()
        } else {
            vec![1; j.workers.len()]
        };
        jobs.insert(
            j.id,
            JobInfo {
                ranks: j
                    .workers
                    .iter()
                    .zip(&weights)
                    .map(|(&a, &w)| (a, w))
                    .collect(),
                weight_sum: weights.iter().map(|&w| i64::from(w)).sum(),
                weight_abs_sum: weights.iter().map(|&w| u64::from(w.unsigned_abs())).sum(),
                result_port: j.result_port,
                vector_len: j.vector_len.unwrap_or(0),
                slots: j.slots,
                userspace_only: j.userspace_only,
                has_parent: j.kernel_parent().is_some(),
                window: if j.window == 0 { abi::ROUND_WINDOW } else { j.window },
                userspace_slots: j.userspace_slots as usize,
                slot_bytes: usize_of(j.userspace_slot_bytes),
            },
        );
    }
    jobs
}

fn usize_of(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

impl UserspaceAggregator {
    /// An empty table for the jobs of `config`, bounded by their
    /// `userspace_slots` and `userspace_slot_bytes`, the node's
    /// `userspace_slot_bytes`, and `opts.max_slots_per_job`.
    pub fn new(config: &Config, opts: &UserspaceOptions) -> UserspaceAggregator {
        UserspaceAggregator {
            jobs: job_infos(config),
            rt: HashMap::new(),
            max_slots_per_job: opts.max_slots_per_job,
            completed_per_job: opts.completed_per_job,
            node_slot_bytes: usize_of(config.node.userspace_slot_bytes),
            bytes: 0,
            stats: UserspaceStats::default(),
        }
    }

    /// Take the jobs of `config` (a reload): the jobs in `reset` (removed
    /// or changed) lose their slots and completion records, the others
    /// keep theirs. Returns the keys whose `slot_owner` record the caller
    /// deletes (slots the kernel recorded). The node's own bounds stay
    /// those of the attach.
    pub fn reconfigure(&mut self, config: &Config, reset: &[u16]) -> Vec<abi::SlotKey> {
        self.jobs = job_infos(config);
        let mut records = Vec::new();
        let gone: Vec<u16> = self.rt.keys().copied().filter(|id| reset.contains(id) || !self.jobs.contains_key(id)).collect();
        for id in gone {
            let Some(mut rt) = self.rt.remove(&id) else { continue };
            for ((round, frag_off), _, held) in rt.slots.close_where(|_, _| true) {
                self.bytes -= held.bytes;
                if held.kernel_owned_record {
                    records.push(abi::SlotKey { job: id, pad: 0, round: round.0, frag_off });
                }
            }
        }
        records
    }

    /// Slots held (all jobs).
    pub fn slots_in_use(&self) -> usize {
        self.rt.values().map(|r| r.slots.len()).sum()
    }

    /// Bytes of slot memory held (all jobs), as charged by [`slot_bytes`].
    pub fn bytes_in_use(&self) -> usize {
        self.bytes
    }

    /// Bytes of slot memory `job` holds.
    pub fn job_bytes_in_use(&self, job: u16) -> usize {
        self.rt.get(&job).map_or(0, |r| r.bytes)
    }

    /// The counters, with the slot and byte figures of now.
    pub fn stats(&self) -> UserspaceStats {
        let mut s = self.stats.clone();
        s.slots_in_use = self.slots_in_use();
        s.slots_by_job = self
            .jobs
            .iter()
            .map(|(id, job)| {
                let used = self.rt.get(id).map_or(0, |r| r.slots.len());
                (*id, (used, job.userspace_slots.min(self.max_slots_per_job)))
            })
            .collect();
        s.slot_bytes = self.bytes;
        s.slot_bytes_limit = self.node_slot_bytes;
        s.slot_bytes_by_job = self
            .jobs
            .iter()
            .map(|(id, job)| (*id, (self.job_bytes_in_use(*id), job.slot_bytes)))
            .collect();
        s.jobs_in_overload = self
            .rt
            .iter()
            .filter(|(_, r)| r.handoff.flags & abi::HANDOFF_F_OVERLOAD != 0)
            .map(|(&id, _)| id)
            .collect();
        s.jobs_in_overload.sort_unstable();
        s
    }

    /// Add one AGG1 datagram `dgram` that arrived from `saddr` at `now`.
    /// `Ok(Some(_))`: it completed its slot (exactly once per slot);
    /// `Ok(None)`: added, the slot waits for more ranks; `Err`: refused and
    /// counted in the stats under [`Refusal::label`], nothing changed.
    pub fn contribute(
        &mut self,
        saddr: impl Into<IpAddr>,
        dgram: &[u8],
        now: Instant,
    ) -> Result<Option<Completion>, Refusal> {
        let result = self.add(saddr.into(), dgram, now);
        if let Err(refusal) = result {
            self.stats.count_drop(refusal);
        }
        result
    }

    fn add(&mut self, saddr: IpAddr, dgram: &[u8], now: Instant) -> Result<Option<Completion>, Refusal> {
        let (hdr, values) = proto::split_agg(dgram)
            .map_err(|e| e.drop_reason().unwrap_or(DropReason::TruncatedHeader))?;
        let job = self.jobs.get(&hdr.job).ok_or(DropReason::UnknownJob)?;
        let &(addr, weight) = job
            .ranks
            .get(usize::from(hdr.rank))
            .ok_or(DropReason::RankOutOfRange)?;
        if addr != saddr {
            return Err(DropReason::SourceMismatch.into());
        }
        if job.vector_len != 0
            && u64::from(hdr.frag_off) + u64::from(hdr.count) > u64::from(job.vector_len)
        {
            return Err(DropReason::BeyondVector.into());
        }
        let workers = job.ranks.len() as u16;
        let float = hdr.is_float();
        let kernel_record = !job.userspace_only && !float && hdr.op.runs_in_kernel();
        let rt = self.rt.entry(hdr.job).or_default();
        if rt.is_stale(hdr.round, job.window) {
            return Err(DropReason::StaleRound.into());
        }
        let key = (hdr.round, hdr.frag_off);
        if rt.completed.contains(&key) {
            return Err(DropReason::Retransmission.into());
        }
        if !rt.slots.contains(key) {
            // The job's own bound (config), under the path's overall cap.
            if rt.slots.len() >= job.userspace_slots.min(self.max_slots_per_job) {
                return Err(DropReason::SlotPoolFull.into());
            }
            // Then the memory a new slot would take, for the job and for
            // the node, before anything is allocated.
            let bytes = slot_bytes(hdr.op, float, usize::from(hdr.count), job.weight_abs_sum);
            if rt.bytes.saturating_add(bytes) > job.slot_bytes {
                return Err(Refusal::JobSlotBytes);
            }
            if self.bytes.saturating_add(bytes) > self.node_slot_bytes {
                return Err(Refusal::NodeSlotBytes);
            }
            let held = Held {
                first_at: now,
                kernel_owned_record: kernel_record,
                bytes,
            };
            rt.slots
                .open(key, hdr.op, usize::from(hdr.count), float, held)
                .map_err(|_| DropReason::InvalidOp)?;
            rt.bytes += bytes;
            self.bytes += bytes;
        }
        let Some((slot, _)) = rt.slots.get_mut(key) else {
            return Err(DropReason::SlotPoolFull.into());
        };
        match slot.add(&hdr, values, weight, workers) {
            Err(Refused::ShapeMismatch) => return Err(DropReason::SlotMismatch.into()),
            Err(Refused::AlreadyAdded) => return Err(DropReason::Retransmission.into()),
            Ok(Added::Waiting) => {
                self.stats.accepted += 1;
                return Ok(None);
            }
            Ok(Added::Complete) => self.stats.accepted += 1,
        }

        // Complete: exactly once, the slot leaves the map here, and its
        // bytes leave the bounds with it.
        let Some((slot, held)) = rt.slots.close(key) else {
            return Ok(None);
        };
        rt.bytes -= held.bytes;
        self.bytes -= held.bytes;
        let res = match slot.accumulator().finish_with_weight_sum(job.weight_sum) {
            Ok(r) => r,
            Err(_) => return Err(DropReason::SlotMismatch.into()),
        };
        // The kernel's rule (`result_seq_write`): the completing
        // contribution's seq, or this node's own counter for upstream.
        let own = rt.result_seq;
        rt.result_seq = rt.result_seq.wrapping_add(1);
        let seq = if job.has_parent { own } else { hdr.seq };
        let flags = abi::AGG_F_RESULT | res.flags() | slot.carried();
        let out_hdr = proto::AggHeader {
            job: hdr.job,
            rank: abi::RESULT_RANK,
            seq,
            round: hdr.round,
            frag_off: hdr.frag_off,
            op: hdr.op,
            flags,
            count: hdr.count,
        };
        let mut result = Vec::with_capacity(out_hdr.datagram_len());
        proto::write_agg_header(&out_hdr, &mut result);
        res.write_be(&mut result);

        rt.completed.insert(key);
        rt.completed_fifo.push_back(key);
        while rt.completed_fifo.len() > self.completed_per_job {
            if let Some(old) = rt.completed_fifo.pop_front() {
                rt.completed.remove(&old);
            }
        }
        let mut handoff = None;
        if rt.newest.is_none_or(|n| hdr.round.is_after(n)) {
            rt.newest = Some(hdr.round);
            rt.handoff.newest_round = hdr.round.0;
            rt.handoff.completed = rt.handoff.completed.wrapping_add(1).max(1);
            handoff = Some(rt.handoff);
        }
        self.stats.latency.record(now.saturating_duration_since(held.first_at));
        Ok(Some(Completion {
            job: hdr.job,
            round: hdr.round,
            frag_off: hdr.frag_off,
            result_port: job.result_port,
            result,
            kernel_owned_record: held.kernel_owned_record,
            handoff,
        }))
    }

    /// Remove the slots of stale rounds (they can never complete) and give
    /// back their bytes; returns the keys whose `slot_owner` record the
    /// caller deletes (slots the kernel recorded).
    pub fn collect_stale(&mut self) -> Vec<abi::SlotKey> {
        let mut records = Vec::new();
        for (&id, job) in &self.jobs {
            let Some(rt) = self.rt.get_mut(&id) else { continue };
            let (newest, kernel_newest) = (rt.newest, rt.kernel_newest);
            let stale = rt.slots.close_where(|(round, _), _| round_is_stale(newest, kernel_newest, round, job.window));
            for ((round, frag_off), _, held) in stale {
                rt.bytes -= held.bytes;
                self.bytes -= held.bytes;
                if held.kernel_owned_record {
                    records.push(abi::SlotKey { job: id, pad: 0, round: round.0, frag_off });
                }
                self.stats.stale_slots_collected += 1;
            }
        }
        records
    }
}

struct Worker {
    table: UserspaceAggregator,
    /// A reload's jobs and the ids to reset, with whom to tell when done.
    changes: mpsc::Receiver<(Config, Vec<u16>, mpsc::Sender<()>)>,
    woken: std::os::unix::net::UnixDatagram,
    maps: Arc<KernelMaps>,
    sockets: Vec<XskSocket>,
    result_sock: UdpSocket,
    /// The IPv6 results' socket; `None` where the node has no IPv6 (its
    /// RESULTs to IPv6 ranks then count as `result_send_errors`).
    result_sock6: Option<UdpSocket>,
    stats: Arc<Mutex<UserspaceStats>>,
    opts: UserspaceOptions,
}

impl Worker {
    fn handle(&mut self, frame: &[u8]) {
        self.table.stats.received += 1;
        let Some(p) = parse_frame(frame) else {
            self.table.stats.count_drop(DropReason::TruncatedHeader.into());
            return;
        };
        let payload = &frame[p.payload.clone()];
        self.table.stats.received_bytes += payload.len() as u64;
        if let Ok(Some(done)) = self.table.contribute(p.saddr, payload, Instant::now()) {
            self.deliver(p.daddr, &done);
        }
    }

    /// The kernel's maps first ([`KernelMaps::release_completed`]), then
    /// the RESULT to the contribution's destination.
    fn deliver(&mut self, daddr: IpAddr, done: &Completion) {
        let recorded = done
            .kernel_owned_record
            .then_some(abi::SlotKey { job: done.job, pad: 0, round: done.round.0, frag_off: done.frag_off });
        self.maps.release_completed(done.job, recorded.as_ref(), done.handoff.as_ref());
        let dst = SocketAddr::new(daddr, done.result_port);
        let sock = match daddr {
            IpAddr::V4(_) => Some(&self.result_sock),
            IpAddr::V6(_) => self.result_sock6.as_ref(),
        };
        match sock.map(|s| s.send_to(&done.result, dst)) {
            Some(Ok(_)) => self.table.stats.results += 1,
            _ => self.table.stats.result_send_errors += 1,
        }
    }

    /// Overload watcher, kernel newest round, stale-slot collection.
    fn tick(&mut self, now: Instant) {
        let table = &mut self.table;
        for (&id, job) in &table.jobs {
            let rt = table.rt.entry(id).or_default();
            let state = self.maps.job_state(id);
            if let Some(js) = state {
                if js.completed != 0 {
                    rt.kernel_newest = Some(Round(js.newest_round));
                }
            }
            if !job.userspace_only {
                let limit = if job.slots == 0 { abi::MAX_SLOTS } else { job.slots };
                let threshold = ((self.opts.overload_fraction * f64::from(limit)).ceil() as u32).max(1);
                let active = state.map(|s| s.active_slots).unwrap_or(0);
                let overloaded = rt.handoff.flags & abi::HANDOFF_F_OVERLOAD != 0;
                if active >= threshold {
                    let since = *rt.above_since.get_or_insert(now);
                    if !overloaded && now.duration_since(since) >= self.opts.overload_hold {
                        rt.handoff.flags |= abi::HANDOFF_F_OVERLOAD;
                        let _ = self.maps.set_job_handoff(id, &rt.handoff);
                        table.stats.overload_events += 1;
                    }
                } else {
                    rt.above_since = None;
                    if overloaded {
                        rt.handoff.flags &= !abi::HANDOFF_F_OVERLOAD;
                        let _ = self.maps.set_job_handoff(id, &rt.handoff);
                    }
                }
            }
        }
        // Slots of stale rounds can never complete: collect them.
        for key in self.table.collect_stale() {
            self.maps.delete_slot_owner(&key);
        }
        // (Kernel slots of stale rounds are released by the node's upkeep,
        // src/node/upkeep.rs, whether or not this path runs.)
        self.publish();
    }

    fn publish(&mut self) {
        for s in &self.sockets {
            if let Ok(st) = s.stats() {
                self.table.stats.xsk.insert(s.queue(), st);
            }
        }
        let snapshot = self.table.stats();
        if let Ok(mut shared) = self.stats.lock() {
            *shared = snapshot;
        }
    }

    fn run(mut self, stop: Arc<AtomicBool>) {
        let mut pfds: Vec<libc::pollfd> = self
            .sockets
            .iter()
            .map(|s| s.fd())
            .chain([std::os::fd::AsRawFd::as_raw_fd(&self.woken)])
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let timeout_ms = self.opts.tick.as_millis().clamp(1, 1000) as libc::c_int;
        let mut next_tick = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            // SAFETY: pfds is a live array of pollfd of the length passed.
            unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
            let mut sockets = std::mem::take(&mut self.sockets);
            loop {
                let mut got = 0;
                for s in sockets.iter_mut() {
                    got += s.recv(256, |frame| self.handle(frame));
                }
                if got == 0 {
                    break;
                }
            }
            self.sockets = sockets;
            let mut drained = [0u8; 64];
            while self.woken.recv(&mut drained).is_ok() {}
            while let Ok((config, reset, done)) = self.changes.try_recv() {
                for key in self.table.reconfigure(&config, &reset) {
                    self.maps.delete_slot_owner(&key);
                }
                for &id in &reset {
                    self.maps.delete_job_handoff(id);
                }
                let _ = done.send(());
            }
            let now = Instant::now();
            if now >= next_tick {
                self.tick(now);
                next_tick = now + self.opts.tick;
            }
        }
        self.publish();
    }
}

impl UserspacePath {
    /// Start the user-space path on `iface` with default options; see
    /// [`UserspacePath::start_with`].
    pub fn start(iface: &str, dataplane: &XdpPlane, config: &Config) -> Result<UserspacePath> {
        Self::start_with(iface, dataplane, config, UserspaceOptions::default())
    }

    /// Open one AF_XDP socket per RX queue of `iface`, register them in the
    /// `xsks` map and start the worker thread. Call it in the interface's
    /// network namespace, after the jobs of `config` are written into
    /// `dataplane` (before or after the XDP program is attached).
    pub fn start_with(
        iface: &str,
        dataplane: &XdpPlane,
        config: &Config,
        opts: UserspaceOptions,
    ) -> Result<UserspacePath> {
        let cname = std::ffi::CString::new(iface).map_err(|_| anyhow!("bad interface name {iface:?}"))?;
        // SAFETY: NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if ifindex == 0 {
            return Err(anyhow!("user-space path: no interface {iface}"));
        }
        let maps = Arc::new(dataplane.kernel_maps()?);
        let nqueues = xsk::rx_queue_count(iface);
        let mut sockets = Vec::new();
        let mut queues = Vec::new();
        for q in 0..nqueues {
            let sock = XskSocket::open(ifindex, q, opts.xsk)
                .with_context(|| format!("user-space path on {iface} queue {q}"))?;
            sockets.push(sock);
            queues.push(q);
        }
        // A node with IPv6 off still serves its IPv4 jobs.
        let result_sock6 = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).ok();
        let result_sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
            .context("user-space path: result socket")?;

        let table = UserspaceAggregator::new(config, &opts);
        let job_ids: Vec<u16> = table.jobs.keys().copied().collect();
        for &id in &job_ids {
            maps.delete_job_handoff(id);
        }

        let stats = Arc::new(Mutex::new(table.stats()));
        let (changes, queued) = mpsc::channel();
        let (waker, woken) = std::os::unix::net::UnixDatagram::pair().context("user-space path: its wake-up socket")?;
        woken.set_nonblocking(true).context("user-space path: its wake-up socket")?;
        let worker = Worker {
            table,
            changes: queued,
            woken,
            maps: Arc::clone(&maps),
            sockets,
            result_sock,
            result_sock6,
            stats: Arc::clone(&stats),
            opts,
        };
        // Sockets without multi-buffer AF_XDP (kernels before 6.6) lose a
        // frame longer than one UMEM frame inside the redirect: have the
        // XDP program keep such frames on its fallback (xsk_limits).
        let limit = worker.sockets.iter().filter_map(|s| s.max_frame()).min().unwrap_or(0);
        let multi_buffer = limit == 0;
        maps.set_xsk_limit(limit).context("user-space path: writing xsk_limits")?;
        // Register only once the sockets are bound; the worker drains them.
        let fds: Vec<(u32, i32)> = worker.sockets.iter().map(|s| (s.queue(), s.fd())).collect();
        for (q, fd) in &fds {
            if let Err(e) = maps.register_xsk(*q, *fd) {
                for (q, _) in &fds {
                    maps.unregister_xsk(*q);
                }
                return Err(anyhow!("user-space path: registering queue {q}: {e}"));
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name("aggbox-userspace".into())
            .spawn(move || worker.run(stop2))
            .context("user-space path: spawning the worker")?;
        Ok(UserspacePath {
            stop,
            changes,
            waker,
            stats,
            worker: Some(handle),
            queues,
            maps,
            jobs: job_ids,
            multi_buffer,
        })
    }

    /// Serve the jobs of `config` from now on (a reload): the jobs in
    /// `reset` (removed or changed) lose what this path held of them, the
    /// others keep their slots. Returns once the worker has taken it.
    pub fn reconfigure(&mut self, config: &Config, reset: &[u16]) -> Result<()> {
        let (done, applied) = mpsc::channel();
        self.changes
            .send((config.clone(), reset.to_vec(), done))
            .map_err(|_| anyhow!("user-space path: the worker has stopped"))?;
        // A full socket buffer already holds a wake-up.
        let _ = self.waker.send(&[1]);
        applied
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow!("user-space path: the worker did not take the new jobs within 5 s"))?;
        self.jobs = config.jobs.iter().map(|j| j.id).collect();
        Ok(())
    }

    /// Whether every socket is bound with XDP_USE_SG (multi-buffer AF_XDP,
    /// Linux 6.6+). When not, frames longer than one UMEM frame are not
    /// redirected: they keep the kernel's fallback (`userspace_unavailable`).
    pub fn multi_buffer(&self) -> bool {
        self.multi_buffer
    }

    /// RX queues with a socket.
    pub fn queues(&self) -> &[u32] {
        &self.queues
    }

    /// A snapshot of the counters (refreshed every tick).
    pub fn stats(&self) -> UserspaceStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// A `Send + Sync` function returning [`UserspacePath::stats`], for the
    /// metrics endpoint (which runs on its own thread).
    pub fn stats_fn(&self) -> UserspaceStatsFn {
        let stats = Arc::clone(&self.stats);
        Arc::new(move || stats.lock().map(|s| s.clone()).unwrap_or_default())
    }

    /// Stop: unregister the sockets (the kernel falls back to its own
    /// behaviour), join the worker, close the sockets, clear the overload
    /// flags and forget the slots user space owned (their fragments are
    /// lost; a retransmission starts over in the kernel).
    pub fn stop(mut self) -> UserspaceStats {
        self.shutdown();
        self.stats()
    }

    fn shutdown(&mut self) {
        for &q in &self.queues {
            self.maps.unregister_xsk(q);
        }
        let _ = self.maps.set_xsk_limit(0);
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.worker.take() {
            let _ = h.join();
        }
        for &id in &self.jobs {
            self.maps.delete_job_handoff(id);
        }
        for (key, owner) in self.maps.slot_owners() {
            if owner == abi::OWNER_USERSPACE {
                self.maps.delete_slot_owner(&key);
            }
        }
    }
}

impl Drop for UserspacePath {
    fn drop(&mut self) {
        if self.worker.is_some() {
            self.shutdown();
        }
    }
}
