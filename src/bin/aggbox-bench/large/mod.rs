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
//!   (`sharded.rs`).
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
//!
//! One file per backend (`star_floor.rs` the floor, `udp_rtt.rs`,
//! `runtime.rs` kernel / kernel-node / socket, `ring.rs`, `sharded.rs`,
//! `gloo.rs`, `openmpi.rs`, with `ranks.rs` what the last two share); this
//! file is the driver and what every backend uses (the gate, the timing,
//! the checks, [`Point`]); `counters.rs` the counters a point records,
//! `setup.rs` the testbed at an MTU, `report.rs` CSV, JSON and REPORT.md.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;

use super::{progress, summarize, thousands, BenchOptions, Context_, Csv, Section, Summary};
use aggbox::wire::abi::{self};
use aggbox::node;
use crate::testbed::{in_netns, Testbed};
use aggbox::wire::proto;

use gloo::{gloo_phase, python, torch_available};
use openmpi::{openmpi_build, openmpi_phase, OpenMpi};
use report::{goal, markdown, Output};
use ring::ring_phase;
use runtime::runtime_phase;
use setup::{largest_testbed, testbed, testbed_queues};
use sharded::sharded_phase;

mod counters;
mod gloo;
mod openmpi;
mod ranks;
mod report;
mod ring;
mod runtime;
mod setup;
mod sharded;
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

/// Element type of a point: int32 (the benchmark) or float32 (what
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

#[cfg(test)]
mod tests;
