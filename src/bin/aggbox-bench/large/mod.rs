//! Experiment 9 (`large`): all-reduce of large vectors at large frames.
//!
//! 4 workers (`AGGBOX_LARGE_WORKERS` sets another count) all-reduce (SUM)
//! a vector of 1 M and 21.8 M int32 elements (21.8 M = ResNet-34's
//! parameters) on the netns testbed at MTU 1500, 9000 and the largest frame
//! that works (veth's 65535, where one AGG1 datagram
//! carries 16370 elements, below the XDP program's `abi::MAX_ELEMS`):
//!
//! - `kernel`: AggBox kernel backend. Host 0 is an attached node
//!   (`node::attach`, native XDP + TC) with a job of the 4 workers whose
//!   RESULTs the TC program copies to every worker in-kernel
//!   (`result_group`); the 4 workers and the aggregator application are
//!   `runtime::Communicator`s built with `CommunicatorBuilder::from_config`.
//! - `socket`: the same API and configuration with the socket backend (the
//!   aggregator application reduces in user space and forwards results).
//! - `gloo`: torch.distributed with the Gloo backend (Debian's
//!   python3-torch), one `scripts/gloo_allreduce.py` process per worker
//!   namespace (`ip netns exec`, `GLOO_SOCKET_IFNAME=eth0`, master = worker
//!   0), `dist.all_reduce` on an int32 tensor.
//! - `openmpi`: plain Open MPI, `MPI_Allreduce` (SUM, `MPI_INT`, in place)
//!   among the same worker namespaces: `mpi/bench/allreduce_points.c`,
//!   compiled with mpicc.openmpi for the run, one rank per worker namespace
//!   under one `mpirun.openmpi` in worker 0's (a hostfile of the namespace
//!   names, daemons started by `scripts/mpi_netns_agent.sh`, `btl tcp,self`
//!   on eth0, as scripts/mpi_bench.sh runs plain MPI).
//! - `sharded`: the sharded star (issue #26): worker t's host runs `aggbox
//!   attach` for job t alone, which reduces stripe t of every vector from
//!   all workers and copies its RESULT to them; each worker is a
//!   `StripedCommunicator` whose stripe t goes to worker t's address
//!   ([`sharded_phase`]).
//! - `kernel-f32`, `gloo-f32`, `openmpi-f32`: the same with float32 vectors
//!   of the same integer values (what a training job all-reduces):
//!   `allreduce_f32` with adaptive quantization through the kernel backend,
//!   a float32 tensor in Gloo, `MPI_FLOAT` in Open MPI. The goal is computed
//!   on the int32 points.
//!
//! Every point: one warm-up call, then `reps` timed calls. All participants
//! meet at a barrier before each call; the time of a call is from the
//! earliest start to the latest return over all participants (for AggBox the
//! aggregator application included, whose call ends when every worker has
//! acknowledged every result). Every call's result is checked element by
//! element against the known sum of the inputs on every participant (the
//! Gloo and Open MPI ranks check in their own process and report the int64
//! sum of their result, which is checked here as well; they time their calls
//! with CLOCK_MONOTONIC after a barrier of their own, `dist.barrier()` /
//! `MPI_Barrier`, and the time of a call is the same latest return − earliest
//! start over the ranks). Output: `DIR/large/large.csv` (one row per call),
//! `DIR/large/large.json` (summaries, node counters, the goal),
//! `DIR/large/large.png` (scripts/plot.py) and a REPORT.md section.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;

use super::{
    progress, summarize, thousands, BenchOptions, Context_, Csv, PrivateBpffs, Section, Summary,
};
use aggbox::wire::abi::{self, Op};
use aggbox::config::Config;
use aggbox::kernel::xdp::XdpMode;
use aggbox::node;
use aggbox::runtime::{
    BackendKind, CallOptions, CommunicatorBuilder, Participant, Quantization, StripedCommunicator,
};
use crate::testbed::{in_netns, Testbed, TestbedConfig};
use aggbox::wire::proto;

mod star_floor;
mod udp_rtt;

/// Workers of the job by default (ranks; hosts 1..=workers of the testbed,
/// host 0 is the aggregator node).
pub const WORKERS: usize = 4;

/// Workers of this run: `AGGBOX_LARGE_WORKERS` (2..=32, to measure the
/// windows with more workers than the default 4), else [`WORKERS`].
pub fn worker_count() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        env_list("AGGBOX_LARGE_WORKERS")
            .and_then(|w| w.first().copied())
            .map_or(WORKERS, |w| (w as usize).clamp(2, 32))
    })
}
/// Stripe t (see [`stripes`]) is job `JOB + t` on port `JOB_PORT + 2t`,
/// results to `RESULT_PORT + 2t`, copied to group `GROUP + t`, whose members
/// are the workers' data sockets on `DATA_PORT + t`.
const JOB: u16 = 9;
const JOB_PORT: u16 = 7900;
const RESULT_PORT: u16 = 7901;
const GROUP: u16 = 9;

/// Stripes per participant of the `kernel` and `socket` points
/// (`runtime::striped`): `AGGBOX_LARGE_STRIPES` (1..=8), else 1.
pub fn stripes() -> usize {
    env_list("AGGBOX_LARGE_STRIPES")
        .and_then(|w| w.first().copied())
        .map_or(1, |w| (w as usize).clamp(1, 8))
}

/// Stripes of the extra striped points (`kernel-xS`, `socket-xS`, full runs,
/// largest MTU, 21.8 M elements): `AGGBOX_LARGE_STRIPED` (2..=8), else 3.
/// On the 2-vCPU VM 3 was the socket backend's best (0.151 s against 0.163
/// at 2 and 0.19 at 1; 29 Nov), where its one-thread user-space aggregator
/// is the limit; the kernel backend was slower striped there (0.21–0.23 s
/// against 0.18–0.20), its two CPUs already busy.
pub fn striped() -> usize {
    env_list("AGGBOX_LARGE_STRIPED")
        .and_then(|w| w.first().copied())
        .map_or(3, |w| (w as usize).clamp(2, 8))
}

/// The name of a point's AggBox backend: `kernel` / `kernel-node` (the job
/// served by `aggbox attach` itself, `consumer = "node"`: no aggregator
/// application) / `socket`, `-xS` with S
/// stripes other than [`stripes`].
fn backend_name(kernel: bool, node_served: bool, stripes: usize) -> String {
    let base = match (kernel, node_served) {
        (true, true) => "kernel-node",
        (true, false) => "kernel",
        (false, _) => "socket",
    };
    if stripes == self::stripes() {
        base.to_string()
    } else {
        format!("{base}-x{stripes}")
    }
}

/// Element type of a point: int32 (the issue's benchmark) or float32 (what
/// a training job all-reduces: the AggBox runtime quantizes it to int32 at
/// the adaptive scale, Gloo sums floats). The inputs are the same integers,
/// so both results are exact and checked the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dtype {
    I32,
    F32,
}

impl Dtype {
    /// The point's backend name: `base` for int32, `base-f32` for float32.
    fn backend(self, base: &str) -> String {
        match self {
            Dtype::I32 => base.to_string(),
            Dtype::F32 => format!("{base}-f32"),
        }
    }
}
const DATA_PORT: u16 = 7950;
const GLOO_PORT: u16 = 29_500;
/// Vector sizes of the full run (elements per worker).
pub const SIZES: [u64; 2] = [1_000_000, 21_800_000];
/// The size the goal is stated for.
const GOAL_SIZE: u64 = 21_800_000;
/// Goal: the kernel backend at least this many times faster than Gloo.
const GOAL_RATIO: f64 = 2.0;
/// veth's (and the IPv4 datagram's) largest MTU.
const ETH_MAX_MTU: u32 = 65_535;
/// Per-call deadline of the runtime calls: 30 s + 4 µs per element (a
/// 21.8 M-element call gets ~2 min, far beyond anything measured).
fn call_deadline(n: u64) -> Duration {
    Duration::from_secs(30) + Duration::from_secs_f64(4e-6 * n as f64)
}

/// The largest frame AggBox's XDP program aggregates in one datagram:
/// `count` ≤ `abi::MAX_ELEMS`, i.e. MTU ≤ IPv4 + UDP + AGG1 header + 4 ×
/// MAX_ELEMS, capped by the largest IPv4 datagram / veth MTU (65535).
pub fn largest_aggbox_mtu() -> u32 {
    let by_elems = (20 + 8 + abi::AGG_HDR_LEN) as u32 + 4 * abi::MAX_ELEMS;
    by_elems.min(ETH_MAX_MTU)
}

/// Job slots that keep the job's fragments in flight within the kernel's
/// block pool: `MAX_BLOCKS / ⌈per datagram / CHUNK_ELEMS⌉` (docs/JUMBO.md),
/// at most `MAX_SLOTS`. The kernel runtime caps a worker's window at it.
pub fn slots_for_mtu(mtu: u32) -> u32 {
    let per = proto::elements_per_datagram(mtu as usize) as u32;
    let blocks = per.div_ceil(abi::CHUNK_ELEMS).max(1);
    (abi::MAX_BLOCKS / blocks).clamp(1, abi::MAX_SLOTS)
}

/// The experiment failed (a wrong result, a failed call, a missing
/// prerequisite) after measuring what it could: `markdown` is its report
/// section, with the table of what was measured and the failures.
#[derive(Debug)]
pub struct Failed {
    /// The REPORT.md section.
    pub markdown: String,
    /// One line: what failed.
    pub summary: String,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary)
    }
}

impl std::error::Error for Failed {}

/// Input of rank `r` in call `k`: `((i + 1000 r) mod 2001) − 1000 + k`
/// (the same formula as scripts/gloo_allreduce.py).
fn fill_input(buf: &mut [i32], rank: usize, k: usize) {
    let mut j = (1000 * rank) % 2001;
    let k = k as i32;
    for x in buf.iter_mut() {
        *x = j as i32 - 1000 + k;
        j += 1;
        if j == 2001 {
            j = 0;
        }
    }
}

/// Σ over the ranks of the inputs of call 0; call k adds `worker_count() × k`.
fn expected_base(n: usize) -> Vec<i32> {
    let mut out = vec![0i32; n];
    let mut tmp = vec![0i32; n];
    for r in 0..worker_count() {
        fill_input(&mut tmp, r, 0);
        for (o, t) in out.iter_mut().zip(&tmp) {
            *o += *t;
        }
    }
    out
}

/// Elements of `got` that differ from `base + worker_count() × k`, and the first.
fn mismatches(got: &[i32], base: &[i32], k: usize) -> (usize, Option<usize>) {
    let add = (worker_count() * k) as i32;
    let mut bad = 0;
    let mut first = None;
    for (i, (g, b)) in got.iter().zip(base).enumerate() {
        if *g != b.wrapping_add(add) {
            bad += 1;
            first.get_or_insert(i);
        }
    }
    if got.len() != base.len() {
        bad += got.len().abs_diff(base.len());
    }
    (bad, first)
}

/// A barrier that a failing participant can break (a `std::sync::Barrier`
/// would leave the others waiting forever).
struct Gate {
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
    parties: usize,
}

impl Gate {
    fn new(parties: usize) -> Gate {
        Gate {
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
            parties,
        }
    }

    /// Wait for every party; false when the gate was broken.
    fn wait(&self) -> bool {
        let mut s = match self.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        if s.2 {
            return false;
        }
        s.0 += 1;
        if s.0 == self.parties {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return true;
        }
        let gen = s.1;
        while s.1 == gen && !s.2 {
            s = match self.cv.wait(s) {
                Ok(s) => s,
                Err(p) => p.into_inner(),
            };
        }
        !s.2 || s.1 != gen
    }

    fn abort(&self) {
        let mut s = match self.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        s.2 = true;
        self.cv.notify_all();
    }
}

/// One timed call (seconds).
#[derive(Debug, Clone, Copy, Serialize)]
struct CallTime {
    /// Earliest start → latest return over all participants.
    all: f64,
    /// Earliest start → latest return over the workers only.
    workers: f64,
}

/// `calls` allreduces of `n` elements (call 0 = warm-up) on every
/// participant at once; every participant's result checked.
fn runtime_calls(
    agg: Option<&StripedCommunicator>,
    workers: &[StripedCommunicator],
    n: usize,
    calls: usize,
    base: &[i32],
    dtype: Dtype,
) -> Result<Vec<CallTime>> {
    let parts: Vec<(&StripedCommunicator, Option<usize>)> = agg.map(|a| (a, None)).into_iter()
        .chain(workers.iter().enumerate().map(|(r, c)| (c, Some(r))))
        .collect();
    let gate = Gate::new(parts.len());
    let gate = &gate;
    let spans: Vec<Vec<(Instant, Instant)>> = std::thread::scope(
        |s| -> Result<Vec<Vec<(Instant, Instant)>>> {
            let hs: Vec<_> = parts
            .iter()
            .map(|&(c, rank)| {
                s.spawn(move || -> Result<Vec<(Instant, Instant)>> {
                    let who = match rank {
                        Some(r) => format!("worker {r}"),
                        None => "aggregator".to_string(),
                    };
                    let mut buf = vec![0i32; n];
                    let mut fbuf = vec![0f32; if dtype == Dtype::F32 { n } else { 0 }];
                    let mut out = Vec::with_capacity(calls);
                    for k in 0..calls {
                        match rank {
                            Some(r) => fill_input(&mut buf, r, k),
                            None => buf.iter_mut().for_each(|x| *x = 0),
                        }
                        // The float input: the same integers (outside the timing).
                        fbuf.iter_mut().zip(&buf).for_each(|(f, &i)| *f = i as f32);
                        if !gate.wait() {
                            bail!("{who}: stopped before call {k}: another participant failed");
                        }
                        let opts = CallOptions::deadline(call_deadline(n as u64));
                        let t0 = Instant::now();
                        let r = match dtype {
                            Dtype::I32 => c.allreduce_i32_with(&mut buf, Op::Sum, opts).map(|_| ()),
                            Dtype::F32 => c.reduce_f32_with(&mut fbuf, true, false, opts),
                        };
                        let t1 = Instant::now();
                        if let Err(e) = r {
                            gate.abort();
                            bail!("{who}: allreduce ({dtype:?}) of {n} elements, call {k}: {e}");
                        }
                        if let Err(e) = check_result(&who, &mut buf, &fbuf, base, k, dtype) {
                            gate.abort();
                            return Err(e);
                        }
                        out.push((t0, t1));
                    }
                    Ok(out)
                })
            })
            .collect();
            join_spans(hs, gate)
        },
    )?;
    // The workers' end: every participant but the aggregator application.
    Ok(call_times(&spans, calls, usize::from(agg.is_some())))
}

/// One participant's calls: (start, return) of each.
type Spans = Vec<(Instant, Instant)>;

/// Each participant's call spans, or every participant's failure (the
/// first to fail says why; the others, listed after it, that they were
/// stopped).
fn join_spans(hs: Vec<std::thread::ScopedJoinHandle<'_, Result<Spans>>>, gate: &Gate) -> Result<Vec<Spans>> {
    let mut all = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    for h in hs {
        match h.join() {
            Ok(Ok(v)) => all.push(v),
            Ok(Err(e)) => errors.push(format!("{e:#}")),
            Err(_) => {
                gate.abort();
                errors.push("a participant thread panicked".into());
            }
        }
    }
    if errors.is_empty() {
        return Ok(all);
    }
    errors.sort_by_key(|e| e.contains("another participant failed"));
    Err(anyhow!("{}", errors.join(" | ")))
}

/// Time of each of `calls` calls from the participants' spans: earliest
/// start to latest return over all, and over the participants from index
/// `workers_from` on (the workers).
fn call_times(spans: &[Vec<(Instant, Instant)>], calls: usize, workers_from: usize) -> Vec<CallTime> {
    (0..calls)
        .map(|k| {
            let start = spans.iter().map(|v| v[k].0).min();
            let end_all = spans.iter().map(|v| v[k].1).max();
            let end_workers = spans.iter().skip(workers_from).map(|v| v[k].1).max();
            match (start, end_all, end_workers) {
                (Some(s), Some(a), Some(w)) => CallTime {
                    all: (a - s).as_secs_f64(),
                    workers: (w - s).as_secs_f64(),
                },
                _ => CallTime {
                    all: f64::NAN,
                    workers: f64::NAN,
                },
            }
        })
        .collect()
}

/// Check call `k`'s result on one participant against the known sums
/// (`buf`: the int32 result, or for float calls overwritten from `fbuf`:
/// exact integer sums come back as exact floats, any other value becomes
/// i32::MIN, which no sum is near).
fn check_result(who: &str, buf: &mut [i32], fbuf: &[f32], base: &[i32], k: usize, dtype: Dtype) -> Result<()> {
    if dtype == Dtype::F32 {
        for (i, &f) in buf.iter_mut().zip(fbuf) {
            *i = if f == f.trunc() && f.abs() < 1e9 { f as i32 } else { i32::MIN };
        }
    }
    check_ints(who, buf, base, k)
}

/// Check call `k`'s int32 result `buf` against the known sums.
fn check_ints(who: &str, buf: &[i32], base: &[i32], k: usize) -> Result<()> {
    let (bad, first) = mismatches(buf, base, k);
    if bad > 0 {
        let i = first.unwrap_or(0);
        bail!(
            "{who}: call {k}: {bad} of {} elements wrong (first at {i}: got {}, expected {})",
            buf.len(),
            buf.get(i).copied().unwrap_or_default(),
            base.get(i).copied().unwrap_or_default().wrapping_add((worker_count() * k) as i32)
        );
    }
    Ok(())
}

/// A backend that is not AggBox's (Gloo, Open MPI): TCP, no datagrams to
/// count elements in, no node counters.
fn over_tcp(backend: &str) -> bool {
    backend.starts_with("gloo") || backend.starts_with("openmpi")
}

/// One measured point (backend × MTU × size).
#[derive(Debug, Clone, Serialize)]
struct Point {
    backend: String,
    mtu: u32,
    elements: u64,
    /// Elements per datagram (AggBox backends; Gloo and Open MPI use TCP).
    elements_per_datagram: Option<usize>,
    /// Time per call (s), timed calls only.
    secs: Summary,
    /// Elements per vector / time per call.
    elems_per_s: Summary,
    /// 4 × elements per vector / time per call (all contributions).
    contributed_per_s: Summary,
    /// The warm-up call (s).
    warmup_secs: f64,
    /// Time per call to the last worker only (s).
    worker_secs: Summary,
    ok: bool,
    error: Option<String>,
    /// Node counters (non-zero deltas) over this point (kernel backend).
    node_counters: BTreeMap<String, u64>,
}

impl Point {
    fn new(
        backend: &str,
        mtu: u32,
        elements: u64,
        times: &[CallTime],
        error: Option<String>,
    ) -> Point {
        let timed: Vec<&CallTime> = times.iter().skip(1).collect();
        let secs: Vec<f64> = timed.iter().map(|t| t.all).collect();
        let worker: Vec<f64> = timed.iter().map(|t| t.workers).collect();
        let eps: Vec<f64> = secs.iter().map(|s| elements as f64 / s).collect();
        let cps: Vec<f64> = eps.iter().map(|e| worker_count() as f64 * e).collect();
        Point {
            backend: backend.into(),
            mtu,
            elements,
            elements_per_datagram: (!over_tcp(backend))
                .then(|| proto::elements_per_datagram(mtu as usize)),
            secs: summarize(&secs),
            elems_per_s: summarize(&eps),
            contributed_per_s: summarize(&cps),
            warmup_secs: times.first().map(|t| t.all).unwrap_or(f64::NAN),
            worker_secs: summarize(&worker),
            ok: error.is_none() && !secs.is_empty(),
            error,
            node_counters: BTreeMap::new(),
        }
    }
}

/// Non-zero counters of the node on host 0 (outcomes, `drop:`, `handoff:`,
/// `tc:`), as `aggbox status` shows them.
fn node_counters(netns: &str, pins: &Path) -> BTreeMap<String, u64> {
    let st = in_netns(netns, || node::status(Some("eth0"), pins))
        .ok()
        .and_then(|r| r.ok());
    let mut out = BTreeMap::new();
    if let Some(s) = st.and_then(|mut v| {
        if v.is_empty() {
            None
        } else {
            Some(v.remove(0))
        }
    }) {
        for (k, v) in s.outcomes {
            out.insert(k, v);
        }
        for (k, v) in s.drops {
            out.insert(format!("drop:{k}"), v);
        }
        for (k, v) in s.handoffs {
            out.insert(format!("handoff:{k}"), v);
        }
        for (k, v) in s.broadcast {
            out.insert(format!("tc:{k}"), v);
        }
        // Rings: the XDP program's and the node service's counters, summed
        // over the rings (a ring point runs one ring at a time).
        for (k, v) in s.rings.into_values().flatten() {
            *out.entry(format!("ring:{k}")).or_default() += v;
        }
        for (k, _, v) in s.ring_service.into_values().flat_map(|st| st.counters()) {
            *out.entry(format!("ring_service:{k}")).or_default() += v;
        }
    }
    out
}

/// UDP counters of a host's namespace (`/proc/net/snmp`, the `Udp:` rows):
/// `RcvbufErrors` says datagrams were dropped because a socket's receive
/// buffer was full.
fn udp_counters(netns: &str) -> BTreeMap<String, u64> {
    let text = in_netns(netns, || {
        std::fs::read_to_string("/proc/thread-self/net/snmp")
    })
    .ok()
    .and_then(|r| r.ok())
    .unwrap_or_default();
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("Udp:")).collect();
    let mut out = BTreeMap::new();
    if let [names, values] = rows[..] {
        for (n, v) in names
            .split_whitespace()
            .zip(values.split_whitespace())
            .skip(1)
        {
            if let Ok(v) = v.parse::<u64>() {
                if matches!(
                    n,
                    "InDatagrams" | "InErrors" | "RcvbufErrors" | "SndbufErrors"
                ) {
                    out.insert(n.to_string(), v);
                }
            }
        }
    }
    out
}

/// Node counters of host 0 plus the UDP counters of host 0 (`h0:udp:`) and
/// of the workers summed (`workers:udp:`).
fn all_counters(tb: &Testbed, pins: &Path, kernel: bool) -> BTreeMap<String, u64> {
    let mut out = if kernel {
        node_counters(&tb.host(0).netns, pins)
    } else {
        BTreeMap::new()
    };
    for (k, v) in udp_counters(&tb.host(0).netns) {
        out.insert(format!("h0:udp:{k}"), v);
    }
    for h in 1..=worker_count() {
        for (k, v) in udp_counters(&tb.host(h).netns) {
            *out.entry(format!("workers:udp:{k}")).or_insert(0) += v;
        }
    }
    out
}

fn counter_delta(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.saturating_sub(before.get(k).copied().unwrap_or(0)),
            )
        })
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// Counters of all participants' runtimes summed (`runtime:`): datagrams
/// they resent, and data datagrams they received a second time (a resend
/// that was not needed, or one whose ACK was lost).
fn runtime_counters(
    agg: Option<&StripedCommunicator>,
    workers: &[StripedCommunicator],
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for c in agg.into_iter().chain(workers) {
        let s = c.stats();
        *out.entry("runtime:retransmitted".to_string()).or_insert(0) += s.retransmitted;
        *out.entry("runtime:duplicates_received".to_string()).or_insert(0) +=
            s.duplicates_received;
        if s.acks_repeated > 0 {
            *out.entry("runtime:acks_repeated".to_string()).or_insert(0) += s.acks_repeated;
        }
    }
    out
}

fn counters_line(c: &BTreeMap<String, u64>) -> String {
    if c.is_empty() {
        return "(none)".into();
    }
    c.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The node configuration: per stripe a job of the workers, its result group
/// (RESULT copied to every worker's data socket by TC) and slots, the block
/// pool's share at this MTU divided between the stripes' jobs.
fn config_text(tb: &Testbed, mtu: u32, stripes: usize, node_served: bool) -> String {
    let workers: Vec<Ipv4Addr> = (1..=worker_count()).map(|h| tb.host(h).addr).collect();
    let list =
        |f: &dyn Fn(&Ipv4Addr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
    let k = stripes;
    let slots = (slots_for_mtu(mtu) / k as u32).max(1);
    let mut text = "[node]\nmetrics = \"off\"\n".to_string();
    for t in 0..k as u16 {
        let (job, port, result, group, data) =
            (JOB + t, JOB_PORT + 2 * t, RESULT_PORT + 2 * t, GROUP + t, DATA_PORT + t);
        let _ = write!(
            text,
            "\n[[job]]\nid = {job}\nport = {port}\nworkers = [{}]\nresult_port = {result}\nresult_group = {group}\nslots = {slots}\nconsumer = \"{}\"\n\n[[group]]\nid = {group}\nmembers = [{}]\n",
            list(&|w| format!("\"{w}\"")),
            if node_served { "node" } else { "application" },
            list(&|w| format!("\"{w}:{data}\"")),
        );
    }
    text
}

/// Every size of `dtypes` × `sizes` on these participants: a warm-up and
/// `reps` calls each, a point per size with the deltas of `counters()`
/// (read before and after), of the runtime's counters and of this
/// process's context switches (and the injector's drops under loss). A
/// failure at one size skips the larger ones of that dtype.
#[allow(clippy::too_many_arguments)]
fn runtime_points(
    backend: &str,
    mtu: u32,
    aggc: Option<&StripedCommunicator>,
    workers: &[StripedCommunicator],
    dtypes: &[Dtype],
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
    injector: &crate::impair::Injector,
    counters: &dyn Fn() -> BTreeMap<String, u64>,
) -> Vec<Point> {
    let mut points = Vec::new();
    for &dtype in dtypes {
        let name = dtype.backend(backend);
        let mut failed_at: Option<u64> = None;
        for &n in sizes {
            if let Some(f) = failed_at {
                points.push(Point::new(
                    &name,
                    mtu,
                    n,
                    &[],
                    Some(format!(
                        "skipped: the {} -element point failed",
                        thousands(f as f64)
                    )),
                ));
                continue;
            }
            let base = &bases[&n];
            let runtime_before = runtime_counters(aggc, workers);
            let before = counters();
            let dropped_before = injector.counts().dropped;
            progress(format!(
                "large: MTU {mtu}, {} elements, {name}: warm-up + {reps} calls",
                thousands(n as f64)
            ));
            let switches_before = process_context_switches();
            let r = runtime_calls(aggc, workers, n as usize, reps + 1, base, dtype);
            let switches = process_context_switches();
            let after = counters();
            let mut p = match r {
                Ok(times) => {
                    for (k, t) in times.iter().enumerate() {
                        csv_row(csv, &name, mtu, n, k, t.all, t.workers, true);
                    }
                    Point::new(&name, mtu, n, &times, None)
                }
                Err(e) => {
                    failed_at = Some(n);
                    Point::new(&name, mtu, n, &[], Some(format!("{e:#}")))
                }
            };
            p.node_counters = counter_delta(&before, &after);
            // This process's context switches over the point's calls
            // (every participant's threads and the bench's barrier).
            p.node_counters.insert("process:voluntary_ctxt_switches".into(), switches.0 - switches_before.0);
            p.node_counters.insert("process:involuntary_ctxt_switches".into(), switches.1 - switches_before.1);
            if loss() > 0.0 {
                p.node_counters.insert("injector:dropped".into(), injector.counts().dropped - dropped_before);
            }
            p.node_counters.extend(counter_delta(&runtime_before, &runtime_counters(aggc, workers)));
            report_point(&p);
            points.push(p);
        }
    }
    points
}

/// The AggBox backends at one MTU: attach (kernel), build the communicators
/// from the configuration, run every size. A failure at one size skips the
/// larger ones of this backend and MTU.
#[allow(clippy::too_many_arguments)]
fn runtime_phase(
    tb: &Testbed,
    mtu: u32,
    kernel: bool,
    node_served: bool,
    stripes: usize,
    dtypes: &[Dtype],
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
) -> Result<Vec<Point>> {
    let backend = backend_name(kernel, node_served, stripes);
    let backend = backend.as_str();
    let text = config_text(tb, mtu, stripes, node_served);
    let config = Config::parse(&text, "large.toml").map_err(|e| anyhow!("bench config: {e}"))?;
    let agg = tb.host(0);
    let bpffs = PrivateBpffs::mount("large")?;
    let pins = bpffs.path.clone();
    let att = if kernel {
        let c = config.clone();
        let p = pins.clone();
        let a = in_netns(&agg.netns, move || {
            node::attach("eth0", &c, None, &p, XdpMode::Native)
        })?
        .with_context(|| format!("attaching AggBox to host 0's eth0 at MTU {mtu}"))?;
        for w in &a.warnings {
            progress(format!("large: attach warning: {w}"));
        }
        Some(a)
    } else {
        None
    };
    let mut points = Vec::new();
    let injector = crate::impair::Injector::new();
    let result = (|| -> Result<()> {
        let jobs: Vec<u16> = (0..stripes as u16).map(|t| JOB + t).collect();
        let tune = |b: CommunicatorBuilder| -> CommunicatorBuilder {
            let b = b
                .backend(if kernel {
                    BackendKind::Kernel
                } else {
                    BackendKind::Socket
                })
                .mtu(mtu as usize)
                // Float calls only: the scale from the agreed max |x|.
                .quantization(Quantization::Adaptive)
                .deadline(call_deadline(sizes.iter().copied().max().unwrap_or(0)));
            // `AGGBOX_LARGE_WINDOW`: the configured window (then bounded as
            // always, docs/RUNTIME.md "Windows"), to compare windows.
            match env_list("AGGBOX_LARGE_WINDOW").and_then(|w| w.first().copied()) {
                Some(w) => b.window(w as u32),
                None => b,
            }
        };
        let build = |host: usize, me: Participant| -> Result<StripedCommunicator> {
            tb.in_host(host, || {
                StripedCommunicator::from_config(&config, &jobs, agg.addr, DATA_PORT, me, tune)
            })?
            .map_err(|e| {
                anyhow!("building the {me:?} communicator ({backend} backend, MTU {mtu}): {e}")
            })
        };
        // A node-served job has no aggregator application: the workers'
        // calls are the whole call.
        let aggc = if node_served { None } else { Some(build(0, Participant::Aggregator)?) };
        let workers: Vec<StripedCommunicator> = (0..worker_count())
            .map(|r| build(r + 1, Participant::Worker(r as u16)))
            .collect::<Result<_>>()?;
        if kernel && workers.iter().flat_map(|w| w.stripes()).any(|c| !c.config().kernel_result_group) {
            bail!("the kernel backend does not use the jobs' result_group");
        }
        if loss() > 0.0 {
            impair_switch(tb, &injector, loss())?;
        }
        points = runtime_points(
            backend,
            mtu,
            aggc.as_ref(),
            &workers,
            dtypes,
            sizes,
            reps,
            bases,
            csv,
            &injector,
            &|| all_counters(tb, &pins, kernel),
        );
        Ok(())
    })();
    if loss() > 0.0 {
        if let Err(e) = impair_switch(tb, &injector, 0.0) {
            progress(format!("large: removing the loss: {e:#}"));
        }
    }
    // The TC detach must run in the namespace the attach ran in.
    let detached = match att {
        Some(att) => in_netns(&agg.netns, move || att.detach())
            .map_err(anyhow::Error::from)
            .and_then(|r| r)
            .context("detaching AggBox from host 0"),
        None => Ok(()),
    };
    drop(bpffs);
    if let Err(e) = result {
        for dtype in dtypes {
            let name = dtype.backend(backend);
            for &n in sizes {
                if !points.iter().any(|p| p.backend == name && p.elements == n) {
                    points.push(Point::new(&name, mtu, n, &[], Some(format!("{e:#}"))));
                }
            }
        }
    }
    if let Err(e) = detached {
        // What was measured stands; the failed detach is reported.
        points.push(Point::new(backend, mtu, 0, &[], Some(format!("{e:#}"))));
    }
    Ok(points)
}

/// First ring id and port of the `ring` points (ring `RING + i` on port
/// `RING_PORT + i` reduces `sizes[i]` elements).
const RING: u16 = 40;
const RING_PORT: u16 = 7400;

/// Elements per ring datagram at `mtu`: a full datagram (the XDP program
/// edits frames larger than a page in 256-element chunks), even.
fn ring_frag_elems(mtu: u32) -> u32 {
    ((mtu.saturating_sub(52) / 4).min(abi::RING_MAX_FRAG_ELEMS) & !1).max(2)
}

/// Configuration of the ring points: one `[[ring]]` per size over the
/// workers' hosts (no aggregator: host 0 is idle).
fn ring_config_text(tb: &Testbed, mtu: u32, sizes: &[u64]) -> String {
    let members: Vec<String> = (1..=worker_count()).map(|h| format!("\"{}\"", tb.host(h).addr)).collect();
    let mut text = "[node]\nmetrics = \"off\"\nuserspace_path = \"optional\"\n".to_string();
    for (i, &n) in sizes.iter().enumerate() {
        let _ = write!(
            text,
            "\n[[ring]]\nid = {}\nport = {}\nmembers = [{}]\nvector_len = {n}\nfrag_elems = {}\n",
            RING + i as u16,
            RING_PORT + i as u16,
            members.join(", "),
            ring_frag_elems(mtu)
        );
    }
    text
}

/// The `ring` backend at one MTU (docs/RING.md): every worker's host
/// attaches as a ring member, each worker calls its RingCommunicator.
fn ring_phase(
    tb: &Testbed,
    mtu: u32,
    dtypes: &[Dtype],
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
) -> Result<Vec<Point>> {
    let text = ring_config_text(tb, mtu, sizes);
    let config = Config::parse(&text, "large-ring.toml").map_err(|e| anyhow!("bench ring config: {e}"))?;
    let bpffs = PrivateBpffs::mount("large-ring")?;
    let mut attachments = Vec::new();
    let mut points = Vec::new();
    let result = (|| -> Result<()> {
        for h in 1..=worker_count() {
            let c = config.clone();
            let pins = bpffs.path.join(format!("h{h}"));
            std::fs::create_dir_all(&pins)?;
            let a = in_netns(&tb.host(h).netns, move || node::attach("eth0", &c, None, &pins, XdpMode::Native))?
                .with_context(|| format!("attaching ring member host {h} at MTU {mtu}"))?;
            attachments.push((h, a));
        }
        for &dtype in dtypes {
            let name = dtype.backend("ring");
            for (i, &n) in sizes.iter().enumerate() {
                let ring_id = RING + i as u16;
                let mut comms = Vec::new();
                for (h, a) in &attachments {
                    let pin_dir = a.pin_dir().to_path_buf();
                    let c = tb
                        .in_host(*h, || aggbox::runtime::RingCommunicator::open(&config, ring_id, &pin_dir))?
                        .map_err(|e| anyhow!("opening ring {ring_id} on host {h}: {e}"))?;
                    comms.push(c);
                }
                for c in &mut comms {
                    c.set_deadline(call_deadline(n));
                    c.set_quantization(Quantization::Adaptive);
                }
                let before: Vec<BTreeMap<String, u64>> =
                    attachments.iter().map(|(h, a)| node_counters(&tb.host(*h).netns, a.pin_dir().parent().unwrap_or(a.pin_dir()))).collect();
                progress(format!("large: MTU {mtu}, {} elements, {name}: warm-up + {reps} calls", thousands(n as f64)));
                let r = ring_calls(&mut comms, n as usize, reps + 1, &bases[&n], dtype);
                let mut p = match r {
                    Ok(times) => {
                        for (k, t) in times.iter().enumerate() {
                            csv_row(csv, &name, mtu, n, k, t.all, t.workers, true);
                        }
                        Point::new(&name, mtu, n, &times, None)
                    }
                    Err(e) => Point::new(&name, mtu, n, &[], Some(format!("{e:#}"))),
                };
                p.elements_per_datagram = Some(ring_frag_elems(mtu) as usize);
                for ((h, a), b) in attachments.iter().zip(&before) {
                    let after = node_counters(&tb.host(*h).netns, a.pin_dir().parent().unwrap_or(a.pin_dir()));
                    for (k, v) in counter_delta(b, &after) {
                        *p.node_counters.entry(k).or_default() += v;
                    }
                }
                report_point(&p);
                points.push(p);
            }
        }
        Ok(())
    })();
    end_phase(tb, attachments, "ring member", result, "ring", dtypes, sizes, mtu, &mut points);
    drop(bpffs);
    Ok(points)
}

/// The `sharded` backend at one MTU, the sharded star (issue #26): worker
/// t's host runs `aggbox attach` for job `JOB + t` alone, which reduces
/// stripe t of every vector (`runtime::striped::stripe_bounds`) from all
/// workers and copies its RESULT to them (TC); every worker's
/// `StripedCommunicator` sends stripe t to worker t's address (its own
/// stripe through its host's lo, where the attach puts the program too).
/// As many datagrams as the ring (n − 1 contributions into and n − 1
/// copies out of each shard's node per fragment), in two steps instead of
/// 2(n − 1).
#[allow(clippy::too_many_arguments)]
fn sharded_phase(
    tb: &Testbed,
    mtu: u32,
    dtypes: &[Dtype],
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
) -> Result<Vec<Point>> {
    let workers_n = worker_count();
    let mut config = Config::parse(&config_text(tb, mtu, workers_n, true), "large-sharded.toml")
        .map_err(|e| anyhow!("bench sharded config: {e}"))?;
    // Each job has a node of its own: the whole slot bound of the MTU.
    for j in &mut config.jobs {
        j.slots = slots_for_mtu(mtu);
    }
    let bpffs = PrivateBpffs::mount("large-sharded")?;
    let mut attachments = Vec::new();
    let mut points = Vec::new();
    let injector = crate::impair::Injector::new();
    let result = (|| -> Result<()> {
        for t in 0..workers_n {
            let h = t + 1;
            let (job, group) = (JOB + t as u16, GROUP + t as u16);
            let mut c = config.clone();
            c.jobs.retain(|j| j.id == job);
            c.groups.retain(|g| g.id == group);
            let pins = bpffs.path.join(format!("h{h}"));
            std::fs::create_dir_all(&pins)?;
            // The node's own worker is a member of its result group: its
            // copy loops through lo with the host's own source address.
            let out = tb.run_in(h, &["sysctl", "-qw", "net.ipv4.conf.lo.accept_local=1"])?;
            if !out.status.success() {
                bail!("host {h}: sysctl net.ipv4.conf.lo.accept_local=1: {}", String::from_utf8_lossy(&out.stderr));
            }
            let a = in_netns(&tb.host(h).netns, move || node::attach("eth0", &c, None, &pins, XdpMode::Native))?
                .with_context(|| format!("attaching shard {t}'s node on host {h} at MTU {mtu}"))?;
            attachments.push((h, a));
        }
        let deadline = call_deadline(sizes.iter().copied().max().unwrap_or(0));
        let workers: Vec<StripedCommunicator> = (0..workers_n)
            .map(|r| {
                tb.in_host(r + 1, || -> std::result::Result<StripedCommunicator, aggbox::runtime::CommError> {
                    let stripes = (0..workers_n)
                        .map(|t| {
                            CommunicatorBuilder::from_config(
                                &config,
                                JOB + t as u16,
                                tb.host(t + 1).addr,
                                DATA_PORT + t as u16,
                                Participant::Worker(r as u16),
                            )?
                            .backend(BackendKind::Kernel)
                            .mtu(mtu as usize)
                            .quantization(Quantization::Adaptive)
                            .deadline(deadline)
                            .build()
                        })
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    StripedCommunicator::new(stripes)
                })?
                .map_err(|e| anyhow!("building worker {r}'s sharded communicator (MTU {mtu}): {e}"))
            })
            .collect::<Result<_>>()?;
        let counters = || {
            let mut sum = BTreeMap::new();
            for (h, a) in &attachments {
                for (k, v) in node_counters(&tb.host(*h).netns, a.pin_dir().parent().unwrap_or(a.pin_dir())) {
                    *sum.entry(k).or_default() += v;
                }
            }
            sum
        };
        points = runtime_points("sharded", mtu, None, &workers, dtypes, sizes, reps, bases, csv, &injector, &counters);
        Ok(())
    })();
    end_phase(tb, attachments, "shard node", result, "sharded", dtypes, sizes, mtu, &mut points);
    drop(bpffs);
    Ok(points)
}

/// The end of a phase that attached on several hosts: detach each (in its
/// namespace; a failure is reported, not fatal) and, when the phase failed,
/// a failed point for every size of `backend` × `dtypes` it did not measure.
#[allow(clippy::too_many_arguments)]
fn end_phase(
    tb: &Testbed,
    attachments: Vec<(usize, node::Attachment)>,
    what: &str,
    result: Result<()>,
    backend: &str,
    dtypes: &[Dtype],
    sizes: &[u64],
    mtu: u32,
    points: &mut Vec<Point>,
) {
    for (h, a) in attachments {
        if let Err(e) = in_netns(&tb.host(h).netns, move || a.detach()).map_err(anyhow::Error::from).and_then(|r| r) {
            progress(format!("large: detaching {what} host {h}: {e:#}"));
        }
    }
    if let Err(e) = result {
        for dtype in dtypes {
            let name = dtype.backend(backend);
            for &n in sizes {
                if !points.iter().any(|p| p.backend == name && p.elements == n) {
                    points.push(Point::new(&name, mtu, n, &[], Some(format!("{e:#}"))));
                }
            }
        }
    }
}

/// `calls` ring allreduces of `n` elements (call 0 = warm-up) on every
/// member at once, every result checked (as [`runtime_calls`]). An int32
/// call is the ring's zero-copy call: the input is written into the ring's
/// memory (`input_mut`) before the call and the result read from it after
/// (`allreduce_in_place`, `result`), as an application that keeps its vector there
/// does, and as Gloo reduces its tensor in place; a float call quantizes
/// from and into the caller's buffer (`allreduce_f32`).
fn ring_calls(
    comms: &mut [aggbox::runtime::RingCommunicator],
    n: usize,
    calls: usize,
    base: &[i32],
    dtype: Dtype,
) -> Result<Vec<CallTime>> {
    let gate = Gate::new(comms.len());
    let gate = &gate;
    let spans: Vec<Vec<(Instant, Instant)>> = std::thread::scope(|s| -> Result<Vec<Vec<(Instant, Instant)>>> {
        let hs: Vec<_> = comms
            .iter_mut()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || -> Result<Vec<(Instant, Instant)>> {
                    if c.len() != n {
                        bail!("ring member {r}: the ring's vector has {} elements, the call {n}", c.len());
                    }
                    let mut buf = vec![0i32; if dtype == Dtype::F32 { n } else { 0 }];
                    let mut fbuf = vec![0f32; if dtype == Dtype::F32 { n } else { 0 }];
                    let mut out = Vec::with_capacity(calls);
                    for k in 0..calls {
                        if dtype == Dtype::F32 {
                            fill_input(&mut buf, r, k);
                            fbuf.iter_mut().zip(&buf).for_each(|(f, &i)| *f = i as f32);
                        } else {
                            fill_input(c.input_mut(), r, k);
                        }
                        if !gate.wait() {
                            bail!("ring member {r}: stopped before call {k}: another participant failed");
                        }
                        let t0 = Instant::now();
                        let res = match dtype {
                            Dtype::I32 => c.allreduce_in_place(Op::Sum).map(|_| ()),
                            Dtype::F32 => c.allreduce_f32(&mut fbuf, false),
                        };
                        let t1 = Instant::now();
                        if let Err(e) = res {
                            gate.abort();
                            bail!("ring member {r}: allreduce ({dtype:?}) of {n} elements, call {k}: {e}");
                        }
                        let who = format!("ring member {r}");
                        let checked = match dtype {
                            Dtype::F32 => check_result(&who, &mut buf, &fbuf, base, k, dtype),
                            Dtype::I32 => check_ints(&who, c.result(), base, k),
                        };
                        if let Err(e) = checked {
                            gate.abort();
                            return Err(e);
                        }
                        out.push((t0, t1));
                    }
                    Ok(out)
                })
            })
            .collect();
        join_spans(hs, gate)
    })?;
    Ok(call_times(&spans, calls, 0))
}

#[allow(clippy::too_many_arguments)]
fn csv_row(
    csv: &mut Csv,
    backend: &str,
    mtu: u32,
    n: u64,
    k: usize,
    all: f64,
    workers: f64,
    ok: bool,
) {
    csv.row(vec![
        backend.into(),
        mtu.to_string(),
        n.to_string(),
        if over_tcp(backend) {
            String::new()
        } else {
            proto::elements_per_datagram(mtu as usize).to_string()
        },
        k.to_string(),
        (k == 0).to_string(),
        format!("{all:.6}"),
        format!("{workers:.6}"),
        format!("{:.0}", n as f64 / all),
        format!("{:.0}", worker_count() as f64 * n as f64 / all),
        ok.to_string(),
    ]);
}

fn report_point(p: &Point) {
    match &p.error {
        None => progress(format!(
            "large: MTU {} {} elements {}: {:.3} s/call [{:.3}–{:.3}] (warm-up {:.3} s), {} elements/s, {} contributed/s{}",
            p.mtu,
            thousands(p.elements as f64),
            p.backend,
            p.secs.median,
            p.secs.min,
            p.secs.max,
            p.warmup_secs,
            thousands(p.elems_per_s.median),
            thousands(p.contributed_per_s.median),
            if p.node_counters.is_empty() { String::new() } else { format!("; node: {}", counters_line(&p.node_counters)) }
        )),
        Some(e) => progress(format!(
            "large: MTU {} {} elements {}: FAILED: {e}{}",
            p.mtu,
            thousands(p.elements as f64),
            p.backend,
            if p.node_counters.is_empty() { String::new() } else { format!("; node counters: {}", counters_line(&p.node_counters)) }
        )),
    }
}

// ------------------------------------------------------------------ Gloo ----

/// The interpreter with torch: `AGGBOX_PYTHON` where torch lives elsewhere
/// (a virtual environment), else the system one, where Debian's
/// python3-torch is (a `python3` earlier on PATH, pyenv's say, lacks it).
fn python() -> String {
    if let Some(p) = std::env::var_os("AGGBOX_PYTHON").filter(|p| !p.is_empty()) {
        return p.to_string_lossy().into_owned();
    }
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3".into()
    } else {
        "python3".into()
    }
}

/// `Ok(version)` when `import torch` works, else why not.
pub fn torch_available() -> std::result::Result<String, String> {
    match std::process::Command::new(python())
        .args(["-c", "import torch, torch.distributed as d; assert d.is_available() and d.is_gloo_available(); print(torch.__version__)"])
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).trim().to_string()),
        Ok(o) => Err(format!(
            "{} -c 'import torch' failed: {}",
            python(),
            String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").trim()
        )),
        Err(e) => Err(format!("{}: {e}", python())),
    }
}

fn gloo_script() -> PathBuf {
    crate::testbed::script_path().with_file_name("gloo_allreduce.py")
}

/// Kill (by pid) and reap the children that still run.
fn kill_children(children: &mut [Child]) {
    for c in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

/// A child's stdout and stderr (piped), read to the end in threads: a full
/// pipe would stop the child.
fn read_output(child: &mut Child) -> std::thread::JoinHandle<(String, String)> {
    let out = child.stdout.take();
    let err = child.stderr.take();
    std::thread::spawn(move || {
        let mut o = String::new();
        let mut e = String::new();
        let eh = err.map(|mut s| {
            std::thread::spawn(move || {
                let mut e = String::new();
                let _ = s.read_to_string(&mut e);
                e
            })
        });
        if let Some(mut s) = out {
            let _ = s.read_to_string(&mut o);
        }
        if let Some(h) = eh {
            e = h.join().unwrap_or_default();
        }
        (o, e)
    })
}

/// Wait until every child has exited (true) or `limit` has passed (false,
/// the children left running; `what` names them in the message).
fn wait_children(children: &mut [Child], limit: Duration, what: &str) -> bool {
    let t0 = Instant::now();
    loop {
        let done = children
            .iter_mut()
            .all(|c| matches!(c.try_wait(), Ok(Some(_))));
        if done {
            return true;
        }
        if t0.elapsed() > limit {
            progress(format!(
                "large: {what} did not finish in {:.0} s; stopping pids {:?}",
                limit.as_secs_f64(),
                children.iter().map(|c| c.id()).collect::<Vec<_>>()
            ));
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A failed point of `name` at `mtu` for every size (the backend could
/// not run: `error` says why), reported.
fn failed_points(name: &str, mtu: u32, sizes: &[u64], error: &str) -> Vec<Point> {
    let pts: Vec<Point> = sizes.iter().map(|&n| Point::new(name, mtu, n, &[], Some(error.to_string()))).collect();
    pts.iter().for_each(report_point);
    pts
}

/// Gloo at one MTU: 4 processes (one per worker namespace) run every size.
fn gloo_phase(
    tb: &Testbed,
    mtu: u32,
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
    dtype: Dtype,
) -> Vec<Point> {
    let name = dtype.backend("gloo");
    let name = name.as_str();
    let fail_all = |e: String| failed_points(name, mtu, sizes, &e);
    let script = gloo_script();
    if !script.exists() {
        return fail_all(format!("{} not found", script.display()));
    }
    let master = tb.host(1).addr;
    let sizes_arg = sizes
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let calls: u64 = (reps + 1) as u64;
    // Generous: start-up (torch import: seconds on this VM) + 2 µs per
    // element and call (Gloo runs at well over 1 M elements/s here).
    let limit = Duration::from_secs(120)
        + Duration::from_secs_f64(2e-6 * sizes.iter().sum::<u64>() as f64 * calls as f64);
    progress(format!(
        "large: MTU {mtu}, Gloo: {} processes ({}), sizes {sizes_arg}, warm-up + {reps} calls each, limit {:.0} s",
        worker_count(),
        script.display(),
        limit.as_secs_f64()
    ));
    let mut children: Vec<Child> = Vec::new();
    let mut readers = Vec::new();
    let world = worker_count().to_string();
    for r in 0..worker_count() {
        let rank = r.to_string();
        // A port per dtype: the previous rendezvous may linger in TIME_WAIT.
        let port = (GLOO_PORT + (dtype == Dtype::F32) as u16).to_string();
        let reps_s = reps.to_string();
        let timeout = format!("{:.0}", limit.as_secs_f64());
        let script_s = script.to_string_lossy().to_string();
        let master_s = master.to_string();
        let python = python();
        let args: Vec<&str> = vec![
            &python,
            &script_s,
            "--rank",
            &rank,
            "--world",
            &world,
            "--master-addr",
            &master_s,
            "--master-port",
            &port,
            "--sizes",
            &sizes_arg,
            "--reps",
            &reps_s,
            "--warmup",
            "1",
            "--timeout",
            &timeout,
            "--dtype",
            match dtype {
                Dtype::I32 => "int32",
                Dtype::F32 => "float32",
            },
        ];
        let spawned = tb
            .command_in(r + 1, &args)
            .map_err(|e| anyhow!("{e}"))
            .and_then(|mut c| {
                c.env("GLOO_SOCKET_IFNAME", "eth0")
                    .env("OMP_NUM_THREADS", "1")
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| anyhow!("starting {args:?} in host {}: {e}", r + 1))
            });
        match spawned {
            Ok(mut child) => {
                readers.push(read_output(&mut child));
                children.push(child);
            }
            Err(e) => {
                kill_children(&mut children);
                return fail_all(format!("{e:#}"));
            }
        }
    }
    let timed_out = !wait_children(&mut children, limit, &format!("Gloo at MTU {mtu}"));
    kill_children(&mut children);
    let statuses: Vec<String> = children
        .iter_mut()
        .map(|c| {
            c.try_wait()
                .ok()
                .flatten()
                .map(|s| s.to_string())
                .unwrap_or_else(|| "?".into())
        })
        .collect();
    let outputs: Vec<(String, String)> = readers
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    let mut calls: RankCalls = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    for (r, (o, e)) in outputs.iter().enumerate() {
        let v = o
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok());
        match v {
            Some(v) => {
                if let Some(err) = v.get("error").and_then(|x| x.as_str()) {
                    problems.push(format!("rank {r}: {err}"));
                }
                calls.push(
                    (0..sizes.len())
                        .map(|si| {
                            v.get("points")
                                .and_then(|p| p.get(si))
                                .and_then(|p| p.get("calls"))
                                .and_then(|c| c.as_array())
                                .cloned()
                                .unwrap_or_default()
                        })
                        .collect(),
                );
            }
            None => {
                let tail: String = e.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
                problems.push(format!(
                    "rank {r} ({}): no JSON result; stderr: {tail}",
                    statuses[r]
                ));
                calls.push(Vec::new());
            }
        }
    }
    if timed_out {
        problems.insert(0, format!("timed out after {:.0} s", limit.as_secs_f64()));
    }
    checked_points(
        name, "Gloo", mtu, sizes, reps, bases, csv, &calls, &problems,
    )
}

/// The calls of an all-reduce run outside this process (Gloo, Open MPI),
/// as each rank reported them: `[rank][size index][call]`, a call being
/// `{"t0", "t1", "wrong", "sum"}` (CLOCK_MONOTONIC seconds around the call,
/// mismatched elements, the int64 sum of the result).
type RankCalls = Vec<Vec<Vec<serde_json::Value>>>;

/// The points of an outside run (`what`: its name in messages) from its
/// ranks' calls: every call's result checked (no wrong element on any rank,
/// every rank's sum the known one; a rank missing is a failure), the time
/// of a call = latest t1 − earliest t0 over the ranks (as for the runtime's
/// calls); the rows go to `csv`. `problems`: what the run itself reported,
/// kept with a point's failure (and shown when every point passed).
#[allow(clippy::too_many_arguments)]
fn checked_points(
    name: &str,
    what: &str,
    mtu: u32,
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
    calls: &RankCalls,
    problems: &[String],
) -> Vec<Point> {
    let mut points = Vec::new();
    for (si, &n) in sizes.iter().enumerate() {
        let base = &bases[&n];
        let base_sum: i64 = base.iter().map(|&x| x as i64).sum();
        let mut times = Vec::new();
        let mut err: Option<String> = None;
        for k in 0..reps + 1 {
            let mut t0s = Vec::new();
            let mut t1s = Vec::new();
            for r in 0..worker_count() {
                let call = calls.get(r).and_then(|c| c.get(si)).and_then(|c| c.get(k));
                let Some(call) = call else {
                    err.get_or_insert_with(|| format!("rank {r}: no result for call {k}"));
                    continue;
                };
                let wrong = call
                    .get("wrong")
                    .and_then(|x| x.as_u64())
                    .unwrap_or(u64::MAX);
                let sum = call.get("sum").and_then(|x| x.as_i64());
                let want = base_sum + (worker_count() * k) as i64 * n as i64;
                if wrong != 0 {
                    err.get_or_insert_with(|| {
                        format!("rank {r} call {k}: {wrong} of {n} elements wrong")
                    });
                }
                if sum != Some(want) {
                    err.get_or_insert_with(|| {
                        format!("rank {r} call {k}: result sums to {sum:?}, expected {want}")
                    });
                }
                match (
                    call.get("t0").and_then(|x| x.as_f64()),
                    call.get("t1").and_then(|x| x.as_f64()),
                ) {
                    (Some(a), Some(b)) => {
                        t0s.push(a);
                        t1s.push(b);
                    }
                    _ => {
                        err.get_or_insert_with(|| format!("rank {r} call {k}: no times"));
                    }
                }
            }
            if err.is_some() {
                break;
            }
            let s = t0s.iter().copied().fold(f64::INFINITY, f64::min);
            let e = t1s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            times.push(CallTime {
                all: e - s,
                workers: e - s,
            });
        }
        if err.is_some() && !problems.is_empty() {
            err = Some(format!(
                "{}; {}",
                problems.join("; "),
                err.unwrap_or_default()
            ));
        }
        let p = match err {
            None => {
                for (k, t) in times.iter().enumerate() {
                    csv_row(csv, name, mtu, n, k, t.all, t.workers, true);
                }
                Point::new(name, mtu, n, &times, None)
            }
            Some(e) => Point::new(name, mtu, n, &[], Some(e)),
        };
        report_point(&p);
        points.push(p);
    }
    if points.iter().all(|p| p.ok) && !problems.is_empty() {
        // Every point measured and checked, but a rank said something went
        // wrong afterwards (e.g. at teardown): keep it visible.
        progress(format!(
            "large: {what} at MTU {mtu}: {}",
            problems.join("; ")
        ));
    }
    points
}

// -------------------------------------------------------------- Open MPI ----

/// The `openmpi` points' program (`mpi/bench/allreduce_points.c`), compiled
/// with mpicc.openmpi for this run into a directory of its own, removed on
/// drop. The directory is also the TMPDIR of mpirun and of its daemons
/// (their session directories, scripts/mpi_netns_agent.sh's per-namespace
/// ones), so that nothing of the run stays in /tmp.
struct OpenMpi {
    dir: PathBuf,
    exe: PathBuf,
    /// Open MPI's version (`mpirun.openmpi --version`).
    version: String,
}

impl Drop for OpenMpi {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn openmpi_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("mpi/bench/allreduce_points.c")
}

/// Compile the `openmpi` points' program, or say why that is not possible.
fn openmpi_build() -> std::result::Result<OpenMpi, String> {
    const INSTALL: &str =
        "install it with `apt-get install -y openmpi-bin libopenmpi-dev` (make deps)";
    let run = |tool: &str, args: &[&str]| -> std::result::Result<String, String> {
        match std::process::Command::new(tool)
            .args(args)
            .stdin(Stdio::null())
            .output()
        {
            Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
            Ok(o) => Err(format!(
                "{tool} {}: {}: {}",
                args.join(" "),
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(format!("{tool} not found; {INSTALL}"))
            }
            Err(e) => Err(format!("{tool}: {e}")),
        }
    };
    let version = run("mpirun.openmpi", &["--version"])?;
    let version = version
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().last())
        .unwrap_or("?")
        .to_string();
    let dir = std::env::temp_dir().join(format!("aggbox-large-openmpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let ompi = OpenMpi {
        exe: dir.join("allreduce_points"),
        dir,
        version,
    };
    let src = openmpi_source();
    run(
        "mpicc.openmpi",
        &[
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            &ompi.exe.to_string_lossy(),
            &src.to_string_lossy(),
        ],
    )?;
    Ok(ompi)
}

/// Open MPI at one MTU: one `mpirun.openmpi` in worker 0's namespace starts
/// a rank in every worker namespace (a hostfile of their names, daemons
/// started by scripts/mpi_netns_agent.sh, as scripts/mpi_bench.sh runs
/// plain MPI) and runs every size.
#[allow(clippy::too_many_arguments)]
fn openmpi_phase(
    tb: &Testbed,
    mtu: u32,
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
    dtype: Dtype,
    ompi: &OpenMpi,
) -> Vec<Point> {
    let name = dtype.backend("openmpi");
    let name = name.as_str();
    let fail_all = |e: String| failed_points(name, mtu, sizes, &e);
    let agent = crate::testbed::script_path().with_file_name("mpi_netns_agent.sh");
    if !agent.exists() {
        return fail_all(format!("{} not found", agent.display()));
    }
    let hostfile = ompi.dir.join("hosts");
    let hosts: String = (1..=worker_count())
        .map(|h| format!("{} slots=1\n", tb.host(h).netns))
        .collect();
    if let Err(e) = std::fs::write(&hostfile, hosts) {
        return fail_all(format!("writing {}: {e}", hostfile.display()));
    }
    let sizes_arg = sizes
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let per_size = reps + 1;
    // As for Gloo: start-up (mpirun and its daemons: about a second here) +
    // 2 µs per element and call. mpirun ends the job itself at the limit;
    // this process stops mpirun only if that fails.
    let limit = Duration::from_secs(120)
        + Duration::from_secs_f64(2e-6 * sizes.iter().sum::<u64>() as f64 * per_size as f64);
    progress(format!(
        "large: MTU {mtu}, Open MPI {}: mpirun.openmpi, {} ranks ({}), sizes {sizes_arg}, warm-up + {reps} calls each, limit {:.0} s",
        ompi.version,
        worker_count(),
        ompi.exe.display(),
        limit.as_secs_f64()
    ));
    let np = worker_count().to_string();
    let timeout = format!("{:.0}", limit.as_secs_f64());
    let hostfile_s = hostfile.to_string_lossy().to_string();
    let agent_s = agent.to_string_lossy().to_string();
    let exe_s = ompi.exe.to_string_lossy().to_string();
    let reps_s = reps.to_string();
    let args: Vec<&str> = vec![
        "mpirun.openmpi",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np,
        "--hostfile",
        &hostfile_s,
        "--mca",
        "plm_rsh_agent",
        &agent_s,
        "--mca",
        "btl",
        "tcp,self",
        // Ranks wait in the kernel rather than spin: the workers share the
        // machine's CPUs (as Gloo's processes, which block).
        "--mca",
        "mpi_yield_when_idle",
        "1",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
        "--mca",
        "oob_tcp_if_include",
        "eth0",
        // Unpinned, as Gloo's processes are: each daemon takes its
        // namespace for a node of its own, where Open MPI's default for
        // ≤ 2 ranks (bind to core) would put every rank on the same core.
        // 4.1.4 with --oversubscribe binds nothing already; this keeps it so.
        "--bind-to",
        "none",
        "--timeout",
        &timeout,
        &exe_s,
        match dtype {
            Dtype::I32 => "int",
            Dtype::F32 => "float",
        },
        &sizes_arg,
        "1",
        &reps_s,
    ];
    let spawned = tb
        .command_in(1, &args)
        .map_err(|e| anyhow!("{e}"))
        .and_then(|mut c| {
            c.env("TMPDIR", &ompi.dir)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| anyhow!("starting {args:?} in host 1: {e}"))
        });
    let mut mpirun = match spawned {
        Ok(c) => c,
        Err(e) => return fail_all(format!("{e:#}")),
    };
    let reader = read_output(&mut mpirun);
    let mut children = [mpirun];
    let what = format!("Open MPI at MTU {mtu}");
    let mut problems: Vec<String> = Vec::new();
    if !wait_children(&mut children, limit + Duration::from_secs(30), &what) {
        problems.push(format!(
            "timed out after {:.0} s",
            limit.as_secs_f64() + 30.0
        ));
        // SIGTERM first: mpirun then stops its daemons and ranks, which a
        // SIGKILL of mpirun alone would leave running.
        // SAFETY: kill(2) on our own child's pid, not yet reaped.
        unsafe { libc::kill(children[0].id() as libc::pid_t, libc::SIGTERM) };
        wait_children(&mut children, Duration::from_secs(10), &what);
    }
    kill_children(&mut children);
    let status = children[0].try_wait().ok().flatten();
    let (out, err) = reader.join().unwrap_or_default();
    if !status.is_some_and(|s| s.success()) {
        let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        problems.push(format!(
            "mpirun: {}; stderr: {tail}",
            status.map_or("?".into(), |s| s.to_string())
        ));
    }
    let calls = openmpi_calls(&out, sizes, reps, &mut problems);
    checked_points(
        name, "Open MPI", mtu, sizes, reps, bases, csv, &calls, &problems,
    )
}

/// Each rank's calls from the output of `allreduce_points` (rank 0's lines:
/// a header, then one per call in order, size by size, warm-up first, each
/// with every rank's (t0, t1, wrong, sum)); what does not fit goes to
/// `problems`.
fn openmpi_calls(out: &str, sizes: &[u64], reps: usize, problems: &mut Vec<String>) -> RankCalls {
    let per_size = reps + 1;
    let mut calls: RankCalls = vec![vec![Vec::new(); sizes.len()]; worker_count()];
    let mut seen = 0usize;
    for v in out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
    {
        if v.get("mpi").is_some() {
            let world = v.get("world").and_then(|w| w.as_u64());
            if world != Some(worker_count() as u64) {
                problems.push(format!("{world:?} ranks, expected {}", worker_count()));
            }
            continue;
        }
        let (si, k) = (seen / per_size, seen % per_size);
        seen += 1;
        if v.get("elements").and_then(|n| n.as_u64()) != sizes.get(si).copied()
            || v.get("k").and_then(|n| n.as_u64()) != Some(k as u64)
        {
            problems.push(format!(
                "unexpected line (expected size {si} call {k}): {v}"
            ));
            break;
        }
        for (r, c) in v
            .get("ranks")
            .and_then(|r| r.as_array())
            .into_iter()
            .flatten()
            .enumerate()
        {
            if let Some(rc) = calls.get_mut(r) {
                rc[si].push(c.clone());
            }
        }
    }
    calls
}

// ------------------------------------------------------------ experiment ----

/// Veth queues of the testbed (`testbed.sh --queues`, each TX queue one
/// CPU's): a queue per CPU on a machine of 4 or more CPUs, the kernel's
/// default (one TX queue) below. With XDP on the aggregator's veth each RX
/// queue is one NAPI context, and the queue a frame takes is the bridge
/// port's TX queue: with one, one CPU at a time runs the aggregator's XDP
/// program for every worker, as on a NIC without RSS. Measured (21.8 M
/// elements, 4 workers, s per call at MTU 1500 / 65535; a 16-core machine
/// confined with taskset): 16 CPUs 2.26 / 0.265 with one queue, 1.65 /
/// 0.212 with 16; 4 CPUs 1.43 / 0.290 and 1.50 / 0.212; 2 CPUs 1.56 /
/// 0.289 and 2.09 / 0.339 (this 2-vCPU VM: 1.49–1.62 / 0.20–0.24 and 2.49–
/// 2.62 / 0.18–0.19): on 2 CPUs, which the workers already keep busy, the
/// second NAPI context only adds cross-CPU wake-ups and contention for the
/// same slots. `AGGBOX_LARGE_QUEUES=N` sets N, 0 the kernel's default.
fn testbed_queues() -> Option<u32> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    match env_list("AGGBOX_LARGE_QUEUES").and_then(|q| q.first().copied()) {
        Some(0) => None,
        Some(q) => Some(q as u32),
        None => (cpus >= 4).then_some(cpus),
    }
}

/// Testbed at `mtu` (the aggregator and the workers' hosts), with the veth MTU
/// read back from host 1.
fn testbed(mtu: u32) -> Result<Testbed> {
    let tb = Testbed::up(TestbedConfig {
        hosts: worker_count() + 1,
        // A prefix unique to this process (the default): two runs at once
        // must not tear down each other's namespaces.
        prefix: None,
        mtu,
        static_neigh: true,
        // the ring's XDP_TX (GRO on the switch's veth ends): for every
        // backend, so that all of them run on the same testbed
        xdp_tx: true,
        queues: testbed_queues(),
        ..Default::default()
    })
    .with_context(|| format!("testbed at MTU {mtu}"))?;
    let o = tb.run_in(1, &["cat", "/sys/class/net/eth0/mtu"])?;
    let got: u32 = String::from_utf8_lossy(&o.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    if got != mtu {
        bail!("testbed at MTU {mtu}: host 1's eth0 has MTU {got}");
    }
    Ok(tb)
}

/// The largest working MTU: the computed limit first, then lower ones, the
/// first testbed that comes up with it wins (and is used for the run).
fn largest_testbed() -> Result<(u32, Testbed, Vec<String>)> {
    let mut tried = Vec::new();
    for mtu in [largest_aggbox_mtu(), 65_000, 32_768, 16_000] {
        match testbed(mtu) {
            Ok(tb) => return Ok((mtu, tb, tried)),
            Err(e) => {
                progress(format!("large: MTU {mtu} does not work here: {e:#}"));
                tried.push(format!("{mtu}: {e:#}"));
            }
        }
    }
    bail!("no large MTU works: {}", tried.join("; "))
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    workers: usize,
    reps: usize,
    largest_mtu: Option<u32>,
    largest_mtu_note: String,
    gloo: String,
    openmpi: String,
    goal: Option<Goal>,
    failures: &'a [String],
    points: &'a [Point],
}

#[derive(Debug, Clone, Serialize)]
struct Goal {
    statement: String,
    elements: u64,
    /// Per MTU: Gloo time / kernel time.
    ratio_by_mtu: BTreeMap<u32, f64>,
    /// Best Gloo time (any MTU) / best kernel time (any MTU).
    ratio_best: f64,
    kernel_best_mtu: u32,
    gloo_best_mtu: u32,
    met: bool,
}

fn goal(points: &[Point]) -> Option<Goal> {
    let ok = |b: &str| -> Vec<&Point> {
        points
            .iter()
            .filter(|p| p.ok && p.backend == b && p.elements == GOAL_SIZE)
            .collect()
    };
    // The kernel backend's best: any MTU, striped or not.
    let mut k = ok("kernel");
    k.extend(ok(&backend_name(true, false, striped())));
    let g = ok("gloo");
    let best = |v: &[&Point]| {
        v.iter()
            .min_by(|a, b| a.secs.median.total_cmp(&b.secs.median))
            .map(|p| (p.mtu, p.secs.median))
    };
    let ((km, kt), (gm, gt)) = (best(&k)?, best(&g)?);
    let mut by_mtu = BTreeMap::new();
    for kp in &k {
        if let Some(gp) = g.iter().find(|g| g.mtu == kp.mtu) {
            let r = gp.secs.median / kp.secs.median;
            let e = by_mtu.entry(kp.mtu).or_insert(r);
            *e = f64::max(*e, r);
        }
    }
    let ratio = gt / kt;
    Some(Goal {
        statement: format!(
            "AggBox kernel backend at least {GOAL_RATIO}× faster than Gloo on {} elements",
            thousands(GOAL_SIZE as f64)
        ),
        elements: GOAL_SIZE,
        ratio_by_mtu: by_mtu,
        ratio_best: ratio,
        kernel_best_mtu: km,
        gloo_best_mtu: gm,
        met: ratio >= GOAL_RATIO,
    })
}

/// This process's (voluntary, involuntary) context switches so far, all
/// threads (`getrusage(RUSAGE_SELF)`).
fn process_context_switches() -> (u64, u64) {
    // SAFETY: zeroed rusage is valid; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    (u.ru_nvcsw as u64, u.ru_nivcsw as u64)
}

/// Experiment 9.
/// A comma-separated list of numbers from environment variable `name`, for
/// running part of the experiment while investigating
/// (`AGGBOX_LARGE_MTUS=65535` (0 = the largest working one),
/// `AGGBOX_LARGE_SIZES=21800000`,
/// `AGGBOX_LARGE_BACKENDS=kernel,socket,gloo,openmpi,kernel-f32,gloo-f32`,
/// `AGGBOX_LARGE_WINDOW=64`: the runtime's configured window,
/// `AGGBOX_LARGE_WORKERS=8`: the number of workers,
/// `AGGBOX_LARGE_QUEUES=0`: veth queues, 0 = the kernel's default,
/// `AGGBOX_LARGE_STRIPES=2`: stripes of every AggBox point,
/// `AGGBOX_LARGE_STRIPED=4`: stripes of the `-xS` points).
/// `AGGBOX_LARGE_LOSS`: loss on every switch port (a fraction, e.g. 0.01)
/// while the AggBox points run, by the tests' injector
/// (`src/testing/impair`); none by default.
fn loss() -> f64 {
    std::env::var("AGGBOX_LARGE_LOSS").ok().and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// Loss `loss` on every switch port of `tb` (none at 0).
fn impair_switch(tb: &Testbed, injector: &crate::impair::Injector, loss: f64) -> Result<()> {
    for h in 0..=worker_count() {
        let port = tb.switch_port(h);
        in_netns(&tb.switch_netns(), || injector.set(&port, loss, 0.0))??;
    }
    Ok(())
}

fn env_list(name: &str) -> Option<Vec<u64>> {
    let v = std::env::var(name).ok()?;
    Some(v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
}

pub fn run(opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> {
    let dir = opts.out_dir.join("large");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let reps = if opts.reps > 0 {
        opts.reps
    } else if opts.quick {
        2
    } else {
        3
    };
    let sizes: Vec<u64> = if let Some(list) = env_list("AGGBOX_LARGE_SIZES") {
        list
    } else if opts.quick {
        vec![SIZES[0]]
    } else {
        SIZES.to_vec()
    };
    let backends = std::env::var("AGGBOX_LARGE_BACKENDS")
        .unwrap_or_else(|_| {
            format!("floor,udp-rtt,kernel,kernel-node,socket,ring,sharded,gloo,openmpi,kernel-f32,ring-f32,gloo-f32,openmpi-f32,kernel-x{0},socket-x{0}", striped())
        });
    progress(match testbed_queues() {
        Some(q) => format!("large: testbed veths with {q} queues, TX queue q used by CPU q mod CPUs"),
        None => "large: testbed veths with the kernel's queues (one TX queue)".to_string(),
    });
    if let Some(w) = env_list("AGGBOX_LARGE_WINDOW") {
        progress(format!("large: configured window {w:?} (AGGBOX_LARGE_WINDOW), not the default"));
    }
    if worker_count() != WORKERS {
        progress(format!("large: {} workers (AGGBOX_LARGE_WORKERS), not the default {WORKERS}", worker_count()));
    }
    let want = |b: &str| backends.split(',').any(|x| x.trim() == b);
    let torch = torch_available();
    let gloo_note = match &torch {
        Ok(v) => format!("torch {v} (Gloo)"),
        Err(e) => format!("torch not importable: {e}"),
    };
    match &torch {
        Ok(v) => progress(format!("large: Gloo baseline with torch {v} ({})", python())),
        Err(e) if opts.quick => progress(format!("large: Gloo baseline SKIPPED (quick mode): {e}; install it with `apt-get install -y python3-torch` (make bench-deps)")),
        Err(e) => bail!("large: the Gloo baseline needs torch.distributed: {e}; install it with `apt-get install -y python3-torch` (make bench-deps)"),
    }
    // Open MPI: only when asked for (it is in the default list), compiled
    // once for the run; a full run without it fails as one without torch.
    let openmpi: Option<std::result::Result<OpenMpi, String>> = [Dtype::I32, Dtype::F32]
        .iter()
        .any(|d| want(&d.backend("openmpi")))
        .then(openmpi_build);
    let openmpi_note: std::result::Result<String, String> = match &openmpi {
        Some(Ok(o)) => Ok(format!("Open MPI {}", o.version)),
        Some(Err(e)) => Err(e.clone()),
        None => Err("not asked for (AGGBOX_LARGE_BACKENDS)".into()),
    };
    match &openmpi {
        Some(Ok(o)) => progress(format!(
            "large: Open MPI baseline with Open MPI {} ({})",
            o.version,
            o.exe.display()
        )),
        Some(Err(e)) if opts.quick => progress(format!(
            "large: Open MPI baseline SKIPPED (quick mode): {e}"
        )),
        Some(Err(e)) => {
            bail!("large: the Open MPI baseline needs mpicc.openmpi and mpirun.openmpi: {e}")
        }
        None => {}
    }
    let mut bases: BTreeMap<u64, Vec<i32>> = BTreeMap::new();
    for &n in &sizes {
        bases.insert(n, expected_base(n as usize));
    }
    let mut csv = Csv::new(&[
        "backend",
        "mtu",
        "elements",
        "elements_per_datagram",
        "call",
        "warmup",
        "secs",
        "worker_secs",
        "elems_per_s",
        "contributed_per_s",
        "ok",
    ]);
    let mut points: Vec<Point> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let mut largest: Option<u32> = None;
    let mut largest_note = String::new();
    let mut mtus: Vec<Option<u32>> = vec![Some(1500), Some(9000)];
    if !opts.quick {
        mtus.push(None); // the largest working one
    }
    if let Some(list) = env_list("AGGBOX_LARGE_MTUS") {
        mtus = list.into_iter().map(|m| if m == 0 { None } else { Some(m as u32) }).collect();
    }
    for m in mtus {
        let (mtu, tb) = match m {
            Some(mtu) => match testbed(mtu) {
                Ok(tb) => (mtu, tb),
                Err(e) => {
                    failures.push(format!("MTU {mtu}: {e:#}"));
                    continue;
                }
            },
            None => match largest_testbed() {
                Ok((mtu, tb, tried)) => {
                    largest = Some(mtu);
                    largest_note = format!(
                        "largest MTU {mtu} = min(veth/IPv4 maximum {ETH_MAX_MTU}, IPv4 + UDP + AGG1 header + 4 × MAX_ELEMS ({}) = {}): {} elements per datagram, {} slots ({} blocks of {} per slot, {} blocks){}",
                        abi::MAX_ELEMS,
                        (20 + 8 + abi::AGG_HDR_LEN) as u32 + 4 * abi::MAX_ELEMS,
                        proto::elements_per_datagram(mtu as usize),
                        slots_for_mtu(mtu),
                        (proto::elements_per_datagram(mtu as usize) as u32).div_ceil(abi::CHUNK_ELEMS),
                        abi::CHUNK_ELEMS,
                        abi::MAX_BLOCKS,
                        if tried.is_empty() { String::new() } else { format!("; tried first: {}", tried.join("; ")) }
                    );
                    progress(format!("large: {largest_note}"));
                    (mtu, tb)
                }
                Err(e) => {
                    failures.push(format!("largest MTU: {e:#}"));
                    continue;
                }
            },
        };
        progress(format!(
            "large: === MTU {mtu}: {} elements/datagram, job slots {} ===",
            proto::elements_per_datagram(mtu as usize),
            slots_for_mtu(mtu)
        ));
        // The star's floor (star_floor.rs): where its aggregator takes the
        // MTU's fragments.
        if want("floor") {
            match star_floor::floor_phase(&tb, mtu, &sizes, reps, &bases, &mut csv) {
                Ok(ps) => points.extend(ps),
                Err(e) => {
                    progress(format!("large: MTU {mtu} floor: FAILED: {e:#}"));
                    for &n in &sizes {
                        points.push(Point::new("floor", mtu, n, &[], Some(format!("{e:#}"))));
                    }
                }
            }
        }
        // The small-message yardstick, at the one-datagram size if measured.
        if want("udp-rtt") {
            if let Some(&n) = sizes.iter().find(|&&n| n as usize <= proto::elements_per_datagram(mtu as usize)) {
                match udp_rtt::rtt_phase(&tb, mtu, n, &mut csv) {
                    Ok(ps) => points.extend(ps),
                    Err(e) => progress(format!("large: MTU {mtu} udp-rtt: FAILED: {e:#}")),
                }
            }
        }
        // The striped points: int32, the goal's size, the largest MTU of a
        // full run (or asked for by name in AGGBOX_LARGE_BACKENDS).
        let striped_sizes: Vec<u64> = sizes.iter().copied().filter(|&n| n == GOAL_SIZE).collect();
        // (kernel, node-served, stripes, sizes)
        let mut phases = vec![
            (true, false, stripes(), sizes.clone()),
            (true, true, stripes(), sizes.clone()),
            (false, false, stripes(), sizes.clone()),
        ];
        let asked = m.is_none() || std::env::var("AGGBOX_LARGE_BACKENDS").is_ok();
        if asked && !striped_sizes.is_empty() && striped() != stripes() {
            phases.push((true, false, striped(), striped_sizes.clone()));
            phases.push((false, false, striped(), striped_sizes));
        }
        for (kernel, node_served, k, sizes) in phases {
            let b = backend_name(kernel, node_served, k);
            // Float calls through the kernel backend only (the socket
            // backend quantizes the same way), unstriped.
            let dtypes: Vec<Dtype> = [Dtype::I32, Dtype::F32]
                .into_iter()
                .filter(|&d| ((kernel && !node_served && k == stripes()) || d == Dtype::I32) && want(&d.backend(&b)))
                .collect();
            if dtypes.is_empty() {
                continue;
            }
            match runtime_phase(&tb, mtu, kernel, node_served, k, &dtypes, &sizes, reps, &bases, &mut csv) {
                Ok(ps) => points.extend(ps),
                Err(e) => {
                    progress(format!("large: MTU {mtu} {b} backend: FAILED: {e:#}"));
                    for d in &dtypes {
                        for &n in &sizes {
                            points.push(Point::new(&d.backend(&b), mtu, n, &[], Some(format!("{e:#}"))));
                        }
                    }
                }
            }
        }
        // The phases that attach on every worker's host.
        type HostsPhase =
            fn(&Testbed, u32, &[Dtype], &[u64], usize, &BTreeMap<u64, Vec<i32>>, &mut Csv) -> Result<Vec<Point>>;
        for (backend, phase) in [("ring", ring_phase as HostsPhase), ("sharded", sharded_phase)] {
            let dtypes: Vec<Dtype> =
                [Dtype::I32, Dtype::F32].into_iter().filter(|d| want(&d.backend(backend))).collect();
            if dtypes.is_empty() {
                continue;
            }
            match phase(&tb, mtu, &dtypes, &sizes, reps, &bases, &mut csv) {
                Ok(ps) => points.extend(ps),
                Err(e) => {
                    progress(format!("large: MTU {mtu} {backend}: FAILED: {e:#}"));
                    for d in &dtypes {
                        for &n in &sizes {
                            points.push(Point::new(&d.backend(backend), mtu, n, &[], Some(format!("{e:#}"))));
                        }
                    }
                }
            }
        }
        // The baselines outside this process: Gloo, then Open MPI.
        for base in ["gloo", "openmpi"] {
            for d in [Dtype::I32, Dtype::F32] {
                let available = match base {
                    "gloo" => torch.is_ok(),
                    _ => matches!(openmpi, Some(Ok(_))),
                };
                if !available || !want(&d.backend(base)) {
                    continue;
                }
                // The same loss as the AggBox points (the injector drops
                // TCP segments as well), so that the two compare.
                let injector = crate::impair::Injector::new();
                if loss() > 0.0 {
                    impair_switch(&tb, &injector, loss())?;
                }
                let mut ps = match &openmpi {
                    Some(Ok(o)) if base == "openmpi" => {
                        openmpi_phase(&tb, mtu, &sizes, reps, &bases, &mut csv, d, o)
                    }
                    _ => gloo_phase(&tb, mtu, &sizes, reps, &bases, &mut csv, d),
                };
                if loss() > 0.0 {
                    // One run of the processes covers every size: the drops are the phase's.
                    let dropped = injector.counts().dropped;
                    progress(format!(
                        "large: MTU {mtu} {}: {dropped} packets dropped by the injector",
                        d.backend(base)
                    ));
                    for p in &mut ps {
                        p.node_counters
                            .insert("injector:dropped (whole phase)".into(), dropped);
                    }
                    impair_switch(&tb, &injector, 0.0)?;
                }
                points.extend(ps);
            }
        }
        if let Err(e) = tb.down() {
            progress(format!("large: testbed teardown at MTU {mtu}: {e}"));
        }
        // Keep what was measured so far on disk.
        csv.write(&dir.join("large.csv"))?;
    }
    for p in points.iter().filter(|p| !p.ok) {
        failures.push(format!(
            "{} MTU {} {} elements: {}",
            p.backend,
            p.mtu,
            p.elements,
            p.error.clone().unwrap_or_default()
        ));
    }
    let goal = goal(&points);
    csv.write(&dir.join("large.csv"))?;
    super::write_json(
        &dir.join("large.json"),
        &Output {
            workers: worker_count(),
            reps,
            largest_mtu: largest,
            largest_mtu_note: largest_note.clone(),
            gloo: gloo_note.clone(),
            openmpi: match &openmpi_note {
                Ok(v) => v.clone(),
                Err(e) => format!("not run: {e}"),
            },
            goal: goal.clone(),
            failures: &failures,
            points: &points,
        },
    )?;
    let md = markdown(
        opts,
        reps,
        &sizes,
        &points,
        &failures,
        goal.as_ref(),
        &largest_note,
        &torch,
        &openmpi_note,
    );
    let mut headline = Vec::new();
    match &goal {
        Some(g) => headline.push(format!(
            "large: kernel vs Gloo on {} elements: {:.2}× (best MTU each: kernel {}, Gloo {}); goal ≥ {GOAL_RATIO}×: {}",
            thousands(g.elements as f64),
            g.ratio_best,
            g.kernel_best_mtu,
            g.gloo_best_mtu,
            if g.met { "met" } else { "NOT met" }
        )),
        None => headline.push("large: goal not evaluated (no 21.8 M-element kernel and Gloo points)".into()),
    }
    for p in points.iter().filter(|p| p.ok) {
        headline.push(format!(
            "large: {} MTU {} {}: {:.3} s/call, {} elements/s",
            p.backend,
            p.mtu,
            thousands(p.elements as f64),
            p.secs.median,
            thousands(p.elems_per_s.median)
        ));
    }
    if !failures.is_empty() {
        return Err(anyhow::Error::new(Failed {
            markdown: md,
            summary: format!("{} failure(s): {}", failures.len(), failures.join("; ")),
        }));
    }
    Ok(Section {
        name: "large".into(),
        markdown: md,
        headline,
    })
}

#[allow(clippy::too_many_arguments)]
fn markdown(
    opts: &BenchOptions,
    reps: usize,
    sizes: &[u64],
    points: &[Point],
    failures: &[String],
    goal: Option<&Goal>,
    largest_note: &str,
    torch: &std::result::Result<String, String>,
    openmpi: &std::result::Result<String, String>,
) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## 9. Large frames: all-reduce of 1 M and 21.8 M int32 elements, {} workers\n",
        worker_count()
    );
    let _ = writeln!(
        md,
        "{w} worker namespaces all-reduce (SUM) an int32 vector per call. `kernel`: AggBox kernel backend, host 0 attached (native XDP \
         aggregates, the TC program copies every RESULT to the {w} workers: `result_group`), communicators from the node configuration \
         (`CommunicatorBuilder::from_config`, `.mtu(MTU)`), job slots = block pool / blocks per datagram; `socket`: the same API and \
         configuration with the user-space aggregator on host 0; `gloo`: torch.distributed Gloo ({}), one process per worker namespace \
         (`scripts/gloo_allreduce.py`, TCP over the same veths); `openmpi`: plain Open MPI ({}) `MPI_Allreduce` (SUM, in place) among \
         the same worker namespaces (`mpi/bench/allreduce_points.c`, compiled for the run; one `mpirun.openmpi` in worker 0's namespace, \
         a hostfile of the worker namespaces, daemons started by `scripts/mpi_netns_agent.sh`, `btl tcp,self` over the same veths); \
         `kernel-f32` / `gloo-f32` / `openmpi-f32`: the same with float32 vectors of the same \
         integer values (AggBox: `allreduce_f32` with adaptive quantization, i.e. a one-element MAX allreduce of max |x|, quantize, \
         dequantize; Gloo: a float32 tensor; Open MPI: `MPI_FLOAT`), so every result is exact and checked the same way; `kernel-xS` / `socket-xS` (largest MTU, \
         21.8 M elements): every participant a `StripedCommunicator` over S jobs (a stripe of the vector and a progress thread each; the \
         node serves S jobs, the block pool shared out between them); the goal takes the kernel backend's best point. One warm-up call, then {reps} timed calls per point; all participants meet \
         at a barrier before each call; time per call = earliest start → latest return over all participants (AggBox: the aggregator \
         application included). elements/s = elements per vector / time per call; contributed/s = {w} × that. Every call's result is \
         checked element by element on every participant; `floor` (MTU 1500): the star's floor on this testbed, no runtime: the \
         floor aggregator in XDP, the minimal TC copier cloning each RESULT to the workers, workers that send pre-encoded \
         contributions with sendmmsg within a window of fragments and take the RESULTs with recvmmsg into their output vector, no \
         reliability (`large/star_floor.rs`). Sizes: {}. Raw data: `large/large.csv`, `large/large.json`; plot: `large/large.png`.\n",
        match torch {
            Ok(v) => format!("torch {v}"),
            Err(e) => format!("**not run**: {e}"),
        },
        match openmpi {
            Ok(v) => v.clone(),
            Err(e) => format!("**not run**: {e}"),
        },
        sizes.iter().map(|n| thousands(*n as f64)).collect::<Vec<_>>().join(", "),
        w = worker_count()
    );
    if !largest_note.is_empty() {
        let _ = writeln!(md, "Largest frame: {largest_note}.\n");
    }
    let _ = writeln!(md, "| elements | MTU | elements/datagram | backend | s per call, median [min–max] | elements/s | contributed elements/s | warm-up s |");
    let _ = writeln!(md, "|---:|---:|---:|---|---|---:|---:|---:|");
    let mut sorted: Vec<&Point> = points.iter().collect();
    let order = |b: &str| match b {
        "kernel" => 0,
        "socket" => 1,
        "gloo" | "openmpi" => 2,
        "kernel-f32" => 3,
        b if b.starts_with("kernel-x") => 4,
        b if b.starts_with("socket-x") => 5,
        _ => 6,
    };
    sorted.sort_by_key(|p| (p.elements, p.mtu, order(&p.backend)));
    for p in &sorted {
        let per = p
            .elements_per_datagram
            .map(|e| e.to_string())
            .unwrap_or_else(|| "TCP".into());
        if p.ok {
            let _ = writeln!(
                md,
                "| {} | {} | {per} | {} | {:.3} [{:.3}–{:.3}] | {} | {} | {:.3} |",
                thousands(p.elements as f64),
                p.mtu,
                p.backend,
                p.secs.median,
                p.secs.min,
                p.secs.max,
                thousands(p.elems_per_s.median),
                thousands(p.contributed_per_s.median),
                p.warmup_secs
            );
        } else {
            let _ = writeln!(
                md,
                "| {} | {} | {per} | {} | **FAILED** | | | |",
                thousands(p.elements as f64),
                p.mtu,
                p.backend
            );
        }
    }
    let _ = writeln!(md);
    md.push_str(&floor_table(points));
    md.push_str(&round_trip_table(points));
    match goal {
        Some(g) => {
            let per_mtu = g
                .ratio_by_mtu
                .iter()
                .map(|(m, r)| format!("MTU {m}: {r:.2}×"))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(
                md,
                "**Goal: {}** — **{}**: Gloo's best time / the kernel backend's best time = **{:.2}×** (kernel at MTU {}, Gloo at MTU {}), measured in this run; at the same MTU: {per_mtu}.\n",
                g.statement,
                if g.met { "met" } else { "not met" },
                g.ratio_best,
                g.kernel_best_mtu,
                g.gloo_best_mtu
            );
        }
        None => {
            let _ = writeln!(
                md,
                "**Goal: AggBox kernel backend at least {GOAL_RATIO}× faster than Gloo on {} elements** — not evaluated in this run{}.\n",
                thousands(GOAL_SIZE as f64),
                if opts.quick { " (--quick has no 21.8 M-element point)" } else { " (a kernel or Gloo 21.8 M-element point is missing)" }
            );
        }
    }
    let counters: Vec<&Point> = sorted
        .iter()
        .copied()
        .filter(|p| !over_tcp(&p.backend) && !p.node_counters.is_empty())
        .collect();
    if !counters.is_empty() {
        let _ = writeln!(
            md,
            "Counters during each AggBox point (warm-up included; non-zero only): the node's XDP outcomes, `drop:` reasons and `tc:` \
             counters on host 0 (kernel backend), and the UDP counters (`/proc/net/snmp`) of host 0 (`h0:udp:`) and of the {} workers \
             summed (`workers:udp:`); `RcvbufErrors` = datagrams dropped on a full socket receive buffer; `runtime:` = the \
             participants' retransmissions and the duplicates they received, summed:\n",
            worker_count()
        );
        for p in counters {
            let _ = writeln!(
                md,
                "- {} {} elements, MTU {}: `{}`",
                p.backend,
                thousands(p.elements as f64),
                p.mtu,
                counters_line(&p.node_counters)
            );
        }
        let _ = writeln!(md);
    }
    if !failures.is_empty() {
        let _ = writeln!(md, "**Failures:**\n");
        for f in failures {
            let _ = writeln!(md, "- `{}`", f.replace('`', "'"));
        }
        let _ = writeln!(md);
    }
    md
}

/// The floor beside AggBox and the baselines, per MTU and size where it
/// was measured: medians, AggBox / floor, and whether the floor itself is
/// above Gloo and Open MPI (then the star cannot beat them there, whatever
/// the runtime does).
fn floor_table(points: &[Point]) -> String {
    let median = |b: &str, mtu: u32, n: u64| {
        points.iter().find(|p| p.backend == b && p.mtu == mtu && p.elements == n && p.ok).map(|p| p.secs.median)
    };
    let mut md = String::new();
    let floors: Vec<&Point> = points.iter().filter(|p| p.backend == "floor" && p.ok).collect();
    if floors.is_empty() {
        return md;
    }
    let _ = writeln!(
        md,
        "**The star's floor** (medians, s per call; a ratio > 1 is slower than the floor; \"floor vs X\" < 1: the floor is faster than X):\n"
    );
    let _ = writeln!(md, "| elements | MTU | floor | kernel | kernel-node | Gloo | Open MPI | kernel / floor | kernel-node / floor | floor vs Gloo | floor vs Open MPI |");
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let cell = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.4}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    };
    for f in floors {
        let (m, n) = (f.mtu, f.elements);
        let floor = Some(f.secs.median);
        let (k, kn, g, o) = (median("kernel", m, n), median("kernel-node", m, n), median("gloo", m, n), median("openmpi", m, n));
        let _ = writeln!(
            md,
            "| {} | {m} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            thousands(n as f64),
            cell(floor),
            cell(k),
            cell(kn),
            cell(g),
            cell(o),
            ratio(k, floor),
            ratio(kn, floor),
            ratio(floor, g),
            ratio(floor, o)
        );
    }
    let _ = writeln!(md);
    md
}

/// One-datagram allreduces beside a UDP round trip on the same testbed
/// (`udp-rtt-poll`, `udp-rtt-sleep`, udp_rtt.rs): medians in µs and the
/// allreduce / polling round trip.
fn round_trip_table(points: &[Point]) -> String {
    let mut md = String::new();
    let rtts: Vec<&Point> = points.iter().filter(|p| p.backend == "udp-rtt-poll" && p.ok).collect();
    if rtts.is_empty() {
        return md;
    }
    let median = |b: &str, mtu: u32, n: u64| {
        points.iter().find(|p| p.backend == b && p.mtu == mtu && p.elements == n && p.ok).map(|p| p.secs.median * 1e6)
    };
    let _ = writeln!(
        md,
        "**One datagram against a UDP round trip** (medians, µs; a round trip of 64 bytes between two workers, both ends \
         polling or both sleeping; the allreduce crosses the network twice too):\n"
    );
    let _ = writeln!(md, "| elements | MTU | UDP RTT, polling | UDP RTT, sleeping | kernel | kernel-node | Gloo | Open MPI | kernel-node / RTT polling | kernel-node / Open MPI |");
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let cell = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    };
    for r in rtts {
        let (m, n) = (r.mtu, r.elements);
        let poll = Some(r.secs.median * 1e6);
        let kn = median("kernel-node", m, n);
        let o = median("openmpi", m, n);
        let _ = writeln!(
            md,
            "| {} | {m} | {} | {} | {} | {} | {} | {} | {} | {} |",
            thousands(n as f64),
            cell(poll),
            cell(median("udp-rtt-sleep", m, n)),
            cell(median("kernel", m, n)),
            cell(kn),
            cell(median("gloo", m, n)),
            cell(o),
            ratio(kn, poll),
            ratio(kn, o)
        );
    }
    let _ = writeln!(md);
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_and_expected_sum_match_the_python_formula() {
        let n = 5000;
        let base = expected_base(n);
        for i in [0usize, 1, 1000, 2000, 2001, 4999] {
            let want: i32 = (0..worker_count())
                .map(|r| ((i + 1000 * r) % 2001) as i32 - 1000)
                .sum();
            assert_eq!(base[i], want, "element {i}");
        }
        let mut v = vec![0; n];
        fill_input(&mut v, 3, 7);
        assert_eq!(v[10], ((10 + 3000) % 2001) - 1000 + 7);
        let mut sum = base.clone();
        sum.iter_mut().for_each(|x| *x += 4 * 2);
        assert_eq!(mismatches(&sum, &base, 2), (0, None));
        sum[17] += 1;
        assert_eq!(mismatches(&sum, &base, 2), (1, Some(17)));
    }

    #[test]
    fn openmpi_output_is_timed_and_checked_as_gloos() {
        let n = 10u64;
        let base = expected_base(n as usize);
        let base_sum: i64 = base.iter().map(|&x| x as i64).sum();
        let w = worker_count();
        let sum = |k: usize| base_sum + (w * k) as i64 * n as i64;
        // Rank r starts call k at 10 + k + r/100 s and returns at 10.5 + k − r/100.
        let line = |k: usize, sum: i64| -> String {
            let ranks: Vec<String> = (0..w)
                .map(|r| {
                    let (t0, t1) = (
                        10.0 + k as f64 + 0.01 * r as f64,
                        10.5 + k as f64 - 0.01 * r as f64,
                    );
                    format!(r#"{{"t0": {t0}, "t1": {t1}, "wrong": 0, "sum": {sum}}}"#)
                })
                .collect();
            format!(
                r#"{{"elements": {n}, "k": {k}, "warmup": {}, "ranks": [{}]}}"#,
                k == 0,
                ranks.join(", ")
            )
        };
        let header = format!(r#"{{"mpi": "Open MPI v4.1.4", "world": {w}, "dtype": "int32"}}"#);
        let bases = BTreeMap::from([(n, base)]);
        let point = |out: &str| {
            let mut problems = Vec::new();
            let calls = openmpi_calls(out, &[n], 2, &mut problems);
            let mut csv = Csv::new(&["unused"]);
            checked_points(
                "openmpi",
                "Open MPI",
                1500,
                &[n],
                2,
                &bases,
                &mut csv,
                &calls,
                &problems,
            )
            .remove(0)
        };
        let good = point(
            &[
                header.clone(),
                "not JSON".into(),
                line(0, sum(0)),
                line(1, sum(1)),
                line(2, sum(2)),
            ]
            .join("\n"),
        );
        assert!(good.ok, "{:?}", good.error);
        assert!((good.secs.median - 0.5).abs() < 1e-9, "{:?}", good.secs);
        let wrong = point(
            &[
                header.clone(),
                line(0, sum(0)),
                line(1, sum(1)),
                line(2, sum(2) + 1),
            ]
            .join("\n"),
        );
        assert!(
            wrong
                .error
                .as_deref()
                .is_some_and(|e| e.contains("sums to")),
            "{:?}",
            wrong.error
        );
        let missing = point(&[header, line(0, sum(0)), line(1, sum(1))].join("\n"));
        assert!(
            missing
                .error
                .as_deref()
                .is_some_and(|e| e.contains("no result for call 2")),
            "{:?}",
            missing.error
        );
    }

    #[test]
    fn largest_mtu_and_slots() {
        assert_eq!(largest_aggbox_mtu(), 65_535);
        assert_eq!(proto::elements_per_datagram(65_535), 16_370);
        assert!(proto::elements_per_datagram(65_535) as u32 <= abi::MAX_ELEMS);
        assert_eq!(slots_for_mtu(1500), 4096);
        assert_eq!(slots_for_mtu(9000), 910);
        assert_eq!(slots_for_mtu(65_535), 128);
    }

    #[test]
    fn gate_breaks() {
        let g = Gate::new(2);
        std::thread::scope(|s| {
            let h = s.spawn(|| g.wait());
            std::thread::sleep(Duration::from_millis(20));
            g.abort();
            assert!(!h.join().unwrap());
        });
        let g = Gate::new(2);
        std::thread::scope(|s| {
            let h = s.spawn(|| g.wait() && g.wait());
            assert!(g.wait() && g.wait());
            assert!(h.join().unwrap());
        });
    }
}
