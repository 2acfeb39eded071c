//! Experiment 1: aggregation throughput, and the harness the other
//! aggregation experiments reuse.
//!
//! Testbed: host 0 is the aggregator, hosts 1..=S the senders (one rank
//! each). Every sender thread owns a UDP socket in its host's namespace,
//! connected to `host0:JOB_PORT`, and sends its vector as AGG1 contributions
//! (full-MTU fragments of 362 int32) in `sendmmsg` batches of 32.
//!
//! Aggregators compared in the same run (same senders, same pacing):
//! - `kernel`: AggBox (`node::attach` on host 0's eth0, native XDP); the
//!   application is a `recvmmsg` socket on the job's `result_port`.
//! - `plain`: the plain user-space UDP aggregator: one socket, one `recv`
//!   per datagram, `reducer::Accumulator` per fragment.
//! - `tuned`: `recvmmsg` batches of 64 on 2 `SO_REUSEPORT` sockets (steered
//!   by receiving CPU) with one thread each, a sharded slot table.
//! - `drop`: the ceiling, `src/bpf/bench_drop.bpf.c` counting and dropping
//!   every contribution in XDP (no pacing: the senders go flat out).
//! - `floor`: the least an XDP aggregator of this traffic costs,
//!   `src/bpf/bench_floor.bpf.c` ([`Floor`]): an array slot per fragment,
//!   direct packet access, one lock, the adds, the RESULT rewrite, nothing
//!   else; its RESULTs are received and checked like AggBox's.
//!
//! Pacing (slot pool): a sender may be at most `window` fragments ahead of
//! its oldest incomplete fragment (a sliding window), which bounds the
//! fragments in progress (kernel slots) by `window` < the job's 4096 slots
//! even while a lost contribution holds one fragment back. When no
//! fragment completes for 50 ms (a datagram lost in a full queue), every
//! sender resends its oldest incomplete fragments (with back-off); the aggregators deduplicate, and resends are
//! counted. A sender whose window is full sleeps ([`WINDOW_WAIT`]). Every result is checked against the reference values (sums of
//! `tools::pattern_value`), in every mode.
//!
//! This file is experiment 1 and the workload the others reuse;
//! `harness.rs` is the harness (senders, pacing, one run),
//! `aggregators.rs` the aggregators it compares, `runtime.rs` the AggBox
//! runtime as an aggregator.

use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::{progress, summarize, thousands, BenchOptions, Context_, Csv, Section, Summary};
use aggbox::node;
use aggbox::wire::proto;
use aggbox::node::tools;

mod aggregators;
mod harness;
mod runtime;

pub(crate) use aggregators::prog_id;
pub use harness::{Harness, RunResult, RunSpec};
pub use runtime::with_runtime;
use runtime::runtime_reduce;

#[allow(clippy::all, missing_docs, dead_code)]
mod drop_skel {
    include!(concat!(env!("OUT_DIR"), "/bench_drop.skel.rs"));
}

/// Job id of the benchmark job.
pub const JOB: u16 = 1;
/// Contribution port.
pub const JOB_PORT: u16 = 7000;
/// RESULT port of the kernel path.
pub const RESULT_PORT: u16 = 7001;
/// Elements per full-MTU (1500) contribution.
pub const PER: usize = 362;
/// Datagrams per `sendmmsg`.
pub const BATCH: usize = 32;
/// The project's goal for AggBox's XDP time per contribution against the
/// floor aggregator's (docs/BENCHMARKS.md).
const FLOOR_GOAL: f64 = 1.3;
/// Slots of the benchmark's kernel job (`slots` of its `[[job]]`).
pub const JOB_SLOTS: u32 = 4096;
/// `vector_len` of the benchmark's kernel job: the elements of the largest
/// workload (512 MB of int32), as an operator configures a job whose vector
/// length is known (the fast slots then index by round and offset,
/// docs/DATAPLANE.md).
pub const JOB_VECTOR_LEN: u32 = 512 << 18;
/// Repetitions of the full run (docs/BENCHMARKS.md: the floor's own XDP time
/// moves by a third between repetitions; the goals are medians).
pub const AGG_REPS: usize = 7;

/// Fragments a sender may have in flight, counted from its oldest incomplete
/// fragment (a sliding window, as the runtime's send windows are): 8192
/// datagrams over all senders (2048 each for 4), below the job's 4096 slots,
/// so that a fragment whose contribution was lost never shares its fast slot
/// with one sent after it (docs/DATAPLANE.md, "Regions").
pub fn window_for(senders: usize) -> u64 {
    (8192 / senders.max(1) as u64).clamp(64, 2048)
}

/// How long a sender whose window is full sleeps before it looks again.
/// Sleeping, not spinning: on this 2-CPU machine the senders share the
/// CPUs with the work that frees their windows (the slowest sender's sends,
/// whose softirq runs the XDP programs; the RESULT receiver; a user-space
/// aggregator), and 3 senders spinning through `sched_yield` behind the
/// slowest took ~10 % of the machine's samples in the 512 MB runs; in the
/// paced runs a wait behind a lost contribution (up to the 50 ms resend
/// timeout) was charged to that run's busy share. The window spans ~30 ms
/// of sending at the fastest rates measured, so 100 µs keeps it full.
const WINDOW_WAIT: Duration = Duration::from_micros(100);

/// Times a sender found its window full and waited, in this process
/// (`AGGBOX_BENCH_COUNTERS` prints its change per run).
static WINDOW_WAITS: AtomicU64 = AtomicU64::new(0);

/// Distinct payload blocks per rank (fragment k carries block k % NBLK).
const NBLK: u64 = 61;
/// No fragment completed for this long: the oldest incomplete ones are
/// resent (at most RESEND_BUDGET per sender), and the timeout doubles (up to
/// STALL_MAX) until fragments complete again, so a slow aggregator is not
/// buried under resends of datagrams that are only queued.
const STALL: Duration = Duration::from_millis(50);
const STALL_MAX: Duration = Duration::from_millis(800);
const RESEND_BUDGET: u64 = 256;

/// Aggregator under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// AggBox XDP.
    Kernel,
    /// One recv per datagram, reducer::Accumulator.
    Plain,
    /// recvmmsg + SO_REUSEPORT threads.
    Tuned,
    /// XDP count-and-drop ceiling.
    Drop,
    /// The floor aggregator ([`Floor`]).
    Floor,
}

impl Mode {
    /// Name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Kernel => "kernel",
            Mode::Plain => "plain",
            Mode::Tuned => "tuned",
            Mode::Drop => "drop",
            Mode::Floor => "floor",
        }
    }
}

/// What the senders send and what the result must be.
pub trait Workload: Sync {
    /// Elements per sender.
    fn elements(&self) -> u64;
    /// Append rank `rank`'s payload of fragment `frag` (`count` elements) as big-endian int32.
    fn payload(&self, rank: u16, frag: u64, count: usize, out: &mut Vec<u8>);
    /// Whether a reduced fragment is right (big-endian int32); may store it.
    fn check(&self, frag: u64, result_be: &[u8]) -> bool;
}

/// The throughput workload: fragment k of rank r carries block k % 61 of
/// `tools::pattern_vector(r, ..)`; results are checked in full.
pub struct Pattern {
    elements: u64,
    blocks: Vec<Vec<Vec<u8>>>,
    expected: Vec<Vec<u8>>,
}

impl Pattern {
    /// `senders` ranks of `elements` each.
    pub fn new(senders: usize, elements: u64) -> Pattern {
        let blocks: Vec<Vec<Vec<u8>>> = (0..senders)
            .map(|r| {
                (0..NBLK)
                    .map(|b| {
                        let v: Vec<i32> = (0..PER)
                            .map(|i| tools::pattern_value(r as u16, (b as usize * PER + i) as u32))
                            .collect();
                        let mut out = Vec::with_capacity(4 * PER);
                        proto::write_i32_be(&v, &mut out);
                        out
                    })
                    .collect()
            })
            .collect();
        let expected = (0..NBLK)
            .map(|b| {
                let v: Vec<i32> = (0..PER)
                    .map(|i| {
                        (0..senders)
                            .map(|r| tools::pattern_value(r as u16, (b as usize * PER + i) as u32))
                            .sum()
                    })
                    .collect();
                let mut out = Vec::with_capacity(4 * PER);
                proto::write_i32_be(&v, &mut out);
                out
            })
            .collect();
        Pattern {
            elements,
            blocks,
            expected,
        }
    }
}

impl Workload for Pattern {
    fn elements(&self) -> u64 {
        self.elements
    }
    fn payload(&self, rank: u16, frag: u64, count: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.blocks[rank as usize][(frag % NBLK) as usize][..4 * count]);
    }
    fn check(&self, frag: u64, result_be: &[u8]) -> bool {
        let e = &self.expected[(frag % NBLK) as usize];
        result_be.len() <= e.len() && result_be == &e[..result_be.len()]
    }
}

/// One row of the throughput table.
#[derive(Debug, Clone, Serialize)]
struct Point {
    mode: String,
    total_mb: u64,
    runs: Vec<RunResult>,
    elems_per_s: Summary,
    xdp_ns_per_contribution: Option<Summary>,
}

/// Experiment 1.
pub fn run(opts: &BenchOptions, ctx: &mut Context_) -> Result<Section> {
    let senders = 4;
    // AGGBOX_AGG_SIZES / AGGBOX_AGG_MODES narrow a run (to profile one
    // mode; docs/BENCHMARKS.md, experiment 1).
    let env_names = super::env_names;
    let sizes_mb: Vec<u64> = if let Some(list) = env_names("AGGBOX_AGG_SIZES") {
        list.iter()
            .map(|x| x.parse().with_context(|| format!("AGGBOX_AGG_SIZES: {x:?} is not a size in MB")))
            .collect::<Result<_>>()?
    } else if opts.quick {
        vec![1, 8]
    } else {
        vec![8, 32, 128, 512]
    };
    if let Some(mb) = sizes_mb.iter().find(|&&mb| mb << 18 > u64::from(JOB_VECTOR_LEN)) {
        bail!("agg: {mb} MB is beyond the job's vector_len of {JOB_VECTOR_LEN} elements");
    }
    // Short (~10 s a repetition) and the ratio to the floor is a goal that
    // this VM's drift between repetitions exceeds: more repetitions.
    let reps = opts.reps_or(AGG_REPS);
    let all = [Mode::Drop, Mode::Floor, Mode::Kernel, Mode::Plain, Mode::Tuned];
    let modes: Vec<Mode> = match env_names("AGGBOX_AGG_MODES") {
        Some(names) => {
            for n in &names {
                if !all.iter().any(|m| m.name() == n) {
                    bail!("AGGBOX_AGG_MODES: unknown mode {n:?} (drop, floor, kernel, plain, tuned)");
                }
            }
            all.into_iter().filter(|m| names.iter().any(|n| n == m.name())).collect()
        }
        None => all.to_vec(),
    };
    let _stats = aggbox::node::metrics::enable_bpf_stats()?;
    progress(format!(
        "agg: testbed 1 aggregator + {senders} senders; sizes {sizes_mb:?} MB total; {reps} reps; modes {} (order rotated per repetition)",
        modes.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
    ));
    let h = Harness::new(senders)?;
    let mut runs: Vec<(Mode, u64, RunResult)> = Vec::new();
    let mut round = 1u32;
    for rep in 0..reps {
        // Each mode takes each place in the order as often as another: a
        // drift within a repetition favours none.
        for i in 0..modes.len() {
            let mode = modes[(i + rep) % modes.len()];
            let res = h.with_mode(mode, |a| -> Result<Vec<(u64, RunResult)>> {
                let mut out = Vec::new();
                for &mb in &sizes_mb {
                    let elements = mb * (1 << 20) / 4 / senders as u64;
                    let wl = Pattern::new(senders, elements);
                    let spec = RunSpec {
                        round,
                        window: window_for(senders),
                        deadline: Duration::from_secs(60 + mb / 2),
                        rate_per_sender: None,
                    };
                    round += 1;
                    let r = a.run_counted(&wl, spec);
                    progress(format!(
                        "agg rep {}/{reps} {:6} {:4} MB: {:>14} elements/s in {:.3}s{}{}{}",
                        rep + 1,
                        mode.name(),
                        mb,
                        thousands(r.elems_per_s),
                        r.secs,
                        if r.resent > 0 {
                            format!(", {} resent", r.resent)
                        } else {
                            String::new()
                        },
                        if r.xdp_runs > 0 {
                            format!(
                                ", XDP {:.0} ns/run",
                                r.xdp_run_ns as f64 / r.xdp_runs as f64
                            )
                        } else {
                            String::new()
                        },
                        r.error
                            .as_deref()
                            .map(|e| format!(" ERROR {e}"))
                            .unwrap_or_default()
                    ));
                    out.push((mb, r));
                }
                Ok(out)
            })?;
            runs.extend(res.into_iter().map(|(mb, r)| (mode, mb, r)));
        }
    }
    // Section 1b: the same aggregation through aggbox::runtime.
    let rt_elems: usize = if opts.quick { 100_000 } else { 4 << 20 };
    let mut rt: Vec<(&str, std::result::Result<Vec<f64>, String>)> = Vec::new();
    for (name, kernel) in [("socket", false), ("kernel", true)] {
        progress(format!(
            "agg: runtime reduce_i32 of {rt_elems} elements x {senders} workers, {name} backend"
        ));
        let r = runtime_reduce(&h, kernel, rt_elems, reps).map_err(|e| format!("{e:#}"));
        match &r {
            Ok(t) => progress(format!(
                "agg: runtime {name} backend: median {:.3} s per call",
                summarize(t).median
            )),
            Err(e) => progress(format!("agg: runtime {name} backend FAILED: {e}")),
        }
        rt.push((name, r));
    }
    drop(h);
    let failed: Vec<String> = runs
        .iter()
        .filter(|(_, _, r)| !r.ok)
        .map(|(m, mb, r)| {
            format!(
                "{} {mb} MB: {}",
                m.name(),
                r.error.clone().unwrap_or_default()
            )
        })
        .collect();

    // Table.
    let mut points = Vec::new();
    let mut csv = Csv::new(&[
        "mode",
        "total_mb",
        "rep",
        "senders",
        "elements_per_sender",
        "secs",
        "elems_per_s",
        "sent",
        "resent",
        "wrong",
        "ok",
        "xdp_runs",
        "xdp_run_ns",
        "xdp_ns_per_run",
        "agg_thread_cpu_s",
        "sys_busy",
        "sys_busy_ticks",
        "sys_softirq",
    ]);
    for &mode in &modes {
        for &mb in &sizes_mb {
            let rs: Vec<RunResult> = runs
                .iter()
                .filter(|(m, s, _)| *m == mode && *s == mb)
                .map(|(_, _, r)| r.clone())
                .collect();
            for (i, r) in rs.iter().enumerate() {
                csv.row(vec![
                    mode.name().into(),
                    mb.to_string(),
                    i.to_string(),
                    r.senders.to_string(),
                    r.elements_per_sender.to_string(),
                    format!("{:.6}", r.secs),
                    format!("{:.0}", r.elems_per_s),
                    r.sent.to_string(),
                    r.resent.to_string(),
                    r.wrong.to_string(),
                    r.ok.to_string(),
                    r.xdp_runs.to_string(),
                    r.xdp_run_ns.to_string(),
                    format!(
                        "{:.1}",
                        if r.xdp_runs > 0 {
                            r.xdp_run_ns as f64 / r.xdp_runs as f64
                        } else {
                            f64::NAN
                        }
                    ),
                    format!("{:.4}", r.agg_thread_cpu_s),
                    format!("{:.4}", r.sys_busy),
                    format!("{:.4}", r.sys_busy_ticks),
                    format!("{:.4}", r.sys_softirq),
                ]);
            }
            let eps = summarize(
                &rs.iter()
                    .filter(|r| r.ok)
                    .map(|r| r.elems_per_s)
                    .collect::<Vec<_>>(),
            );
            let xdp = if matches!(mode, Mode::Kernel | Mode::Drop | Mode::Floor) {
                Some(summarize(
                    &rs.iter()
                        .filter(|r| r.xdp_runs > 0)
                        .map(|r| r.xdp_run_ns as f64 / r.xdp_runs as f64)
                        .collect::<Vec<_>>(),
                ))
            } else {
                None
            };
            points.push(Point {
                mode: mode.name().into(),
                total_mb: mb,
                runs: rs,
                elems_per_s: eps,
                xdp_ns_per_contribution: xdp,
            });
        }
    }
    csv.write(&opts.out_dir.join("agg_throughput.csv"))?;
    super::write_json(&opts.out_dir.join("agg_throughput.json"), &points)?;

    let get = |mode: Mode, mb: u64| {
        points
            .iter()
            .find(|p| p.mode == mode.name() && p.total_mb == mb)
    };
    let largest = *sizes_mb.last().unwrap_or(&8);
    let mut md = String::new();
    let _ = writeln!(md, "## 1. Aggregation throughput ({senders} senders)\n");
    let _ = writeln!(
        md,
        "Aggregated elements per second (\"ops/s\" = {senders} × elements per sender / time from the start to the last reduced fragment at the application), \
         int32 SUM, full-MTU contributions ({PER} elements), sendmmsg batches of {BATCH}, senders at most {} fragments ahead of their oldest incomplete fragment \
         (the kernel job has {JOB_SLOTS} slots). Every reduced fragment is checked against the reference values in every mode. \
         Median over {reps} runs, [min – max].\n",
        window_for(senders),
    );
    let _ = writeln!(md, "| total data | AggBox XDP | floor (minimal XDP aggregator) | plain UDP (recv/datagram) | tuned UDP (recvmmsg, 2 REUSEPORT threads) | XDP count-and-drop ceiling | AggBox / floor | AggBox / plain | AggBox / tuned | AggBox / ceiling |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    let fmt = |p: Option<&Point>| {
        p.map(|p| {
            format!(
                "{} [{} – {}]",
                thousands(p.elems_per_s.median),
                thousands(p.elems_per_s.min),
                thousands(p.elems_per_s.max)
            )
        })
        .unwrap_or_else(|| "–".into())
    };
    let med = |p: Option<&Point>| p.map(|p| p.elems_per_s.median).unwrap_or(f64::NAN);
    for &mb in &sizes_mb {
        let (k, f, p, t, d) = (
            get(Mode::Kernel, mb),
            get(Mode::Floor, mb),
            get(Mode::Plain, mb),
            get(Mode::Tuned, mb),
            get(Mode::Drop, mb),
        );
        let _ = writeln!(
            md,
            "| {mb} MB | {} | {} | {} | {} | {} | {:.2}× | {:.2}× | {:.2}× | {:.0} % |",
            fmt(k),
            fmt(f),
            fmt(p),
            fmt(t),
            fmt(d),
            med(k) / med(f),
            med(k) / med(p),
            med(k) / med(t),
            100.0 * med(k) / med(d)
        );
    }
    let k = get(Mode::Kernel, largest);
    let p = get(Mode::Plain, largest);
    let ratio = med(k) / med(p);
    let _ = writeln!(
        md,
        "\n**Paper (Fig. 7, 512 MB, 4 senders; quoted):** AggBox 212,288,843 ops/s vs socket baseline 54,025,990 ops/s = **3.9×**. \
         **Ours ({largest} MB, measured):** AggBox {} vs plain {} = **{ratio:.2}×** (tuned: {:.2}×; the floor aggregator: {:.2}× plain).\n",
        thousands(med(k)),
        thousands(med(p)),
        med(k) / med(get(Mode::Tuned, largest)),
        med(get(Mode::Floor, largest)) / med(p)
    );
    let xdp = k.and_then(|p| p.xdp_ns_per_contribution);
    let dropns = get(Mode::Drop, largest).and_then(|p| p.xdp_ns_per_contribution);
    let floorns = get(Mode::Floor, largest).and_then(|p| p.xdp_ns_per_contribution);
    if let Some(x) = xdp {
        let progs: Vec<String> = k
            .and_then(|p| p.runs.first())
            .map(|r| {
                r.xdp_programs
                    .iter()
                    .map(|(n, c, ns)| format!("{n}: {c} runs, {ns} ns"))
                    .collect()
            })
            .unwrap_or_default();
        let f = floorns.map(|f| f.median).unwrap_or(f64::NAN);
        // The same repetition's runs of AggBox and the floor, minutes
        // apart at most: their ratio, of which the median.
        let ns_of = |mode: Mode| -> Vec<f64> {
            get(mode, largest)
                .map(|p| {
                    p.runs
                        .iter()
                        .map(|r| r.xdp_run_ns as f64 / r.xdp_runs.max(1) as f64)
                        .collect()
                })
                .unwrap_or_default()
        };
        let paired: Vec<f64> = ns_of(Mode::Kernel)
            .iter()
            .zip(ns_of(Mode::Floor))
            .map(|(k, f)| k / f)
            .collect();
        let pr = summarize(&paired);
        let _ = writeln!(
            md,
            "**XDP run time per full-MTU contribution under this traffic** (bpf_stats: Δ run time summed over AggBox's programs / Δ runs of \
             the entry program, {largest} MB runs): AggBox median **{:.0} ns** [min {:.0} – max {:.0}], the floor aggregator **{f:.0} ns** \
             [min {:.0} – max {:.0}], count-and-drop {:.0} ns: AggBox is **{:.2}×** the floor; per repetition (AggBox over the floor of the same \
             repetition) median {:.2}× [min {:.2} – max {:.2}] (the project's goal, not a measurement: ≤ {FLOOR_GOAL}×; {}). Tail-called programs run inside the entry program's \
             accounting, so their own counters stay 0 (first run: {}).\n",
            x.median,
            x.min,
            x.max,
            floorns.map(|f| f.min).unwrap_or(f64::NAN),
            floorns.map(|f| f.max).unwrap_or(f64::NAN),
            dropns.map(|d| d.median).unwrap_or(f64::NAN),
            x.median / f,
            pr.median,
            pr.min,
            pr.max,
            if x.median / f <= FLOOR_GOAL { "met" } else { "NOT met" },
            progs.join("; "),
        );
        ctx.xdp_ns_per_contribution = Some(x.median);
    }
    ctx.kernel_elems_per_s = Some(med(k));
    let d = med(get(Mode::Drop, largest));
    // Aggregator CPU per contribution: XDP run time + the application's
    // threads (kernel, floor), the aggregator threads (user space; their
    // softirq receive work is not in this number, so it flatters the
    // baselines).
    let cpu_per = |mode: Mode| -> f64 {
        let rs: Vec<f64> = get(mode, largest)
            .map(|p| {
                p.runs
                    .iter()
                    .filter(|r| r.ok)
                    .map(|r| {
                        let contributions = (r.sent + r.resent).max(1) as f64;
                        (r.xdp_run_ns as f64 / 1e9 + r.agg_thread_cpu_s) / contributions * 1e9
                    })
                    .collect()
            })
            .unwrap_or_default();
        summarize(&rs).median
    };
    let _ = writeln!(md, "Aggregator CPU per contribution ({largest} MB, median): AggBox {:.0} ns, floor {:.0} ns (XDP run time + the application thread receiving RESULTs), \
        plain {:.0} ns, tuned {:.0} ns (aggregator threads only: the kernel's UDP receive work for them runs in softirq and is not included, which flatters the baselines).\n",
        cpu_per(Mode::Kernel), cpu_per(Mode::Floor), cpu_per(Mode::Plain), cpu_per(Mode::Tuned));
    let _ = writeln!(
        md,
        "**Reading the numbers.** Senders, bridge and aggregator share this VM's CPUs: the count-and-drop ceiling (the same senders into an \
         XDP program that only parses and drops) is {} elements/s ({} contributions/s), and AggBox reaches {:.0} % of it, the floor \
         aggregator {:.0} %. The floor (src/bpf/bench_floor.bpf.c) does only the work no XDP aggregator of this traffic can avoid (one array \
         slot per fragment, direct packet access, one lock, the adds, the RESULT rewrite), so AggBox's distance to it is the price of \
         validation, exactly-once completion, bounds, hand-off and counters (docs/DATAPLANE.md, \"Fast slots\"; the per-step profile is \
         `cargo bench --features bench --bench xdp_chain`).\n",
        thousands(d),
        thousands(d / PER as f64),
        100.0 * med(k) / d,
        100.0 * med(get(Mode::Floor, largest)) / d,
    );
    let _ = writeln!(md, "### 1b. The same through `aggbox::runtime` (Communicator::reduce_i32, 4 workers + aggregator application)\n");
    let _ = writeln!(md, "One SUM reduction of {rt_elems} int32 per worker, with the runtime's reliability (seq, ACKs, window 256); median [min – max] over {reps} calls.\n");
    let _ = writeln!(
        md,
        "| backend | s per call | elements/s | status |\n|---|---|---|---|"
    );
    let mut rt_json = Vec::new();
    for (name, r) in &rt {
        match r {
            Ok(t) => {
                let s = summarize(t);
                let _ = writeln!(
                    md,
                    "| {name} | {:.3} [{:.3} – {:.3}] | {} | ok, every element checked |",
                    s.median,
                    s.min,
                    s.max,
                    thousands((senders * rt_elems) as f64 / s.median)
                );
                rt_json.push(serde_json::json!({"backend": name, "secs": t, "elements_per_worker": rt_elems}));
            }
            Err(e) => {
                let _ = writeln!(md, "| {name} | – | – | **FAILED**: `{e}` |");
                rt_json.push(serde_json::json!({"backend": name, "error": e, "elements_per_worker": rt_elems}));
            }
        }
    }
    super::write_json(&opts.out_dir.join("agg_runtime.json"), &rt_json)?;
    let _ = writeln!(md);
    let _ = writeln!(md, "Plot: `agg_throughput.png`. Raw: `agg_throughput.csv`, `agg_throughput.json`, `agg_runtime.json`.\n");
    if !failed.is_empty() {
        let _ = writeln!(md, "**Failed runs:** {}\n", failed.join("; "));
    }
    let headline = vec![
        format!("agg {largest} MB: kernel {} plain {} tuned {} drop {} elements/s; kernel/plain {ratio:.2}x", thousands(med(k)), thousands(med(p)), thousands(med(get(Mode::Tuned, largest))), thousands(d)),
        format!("XDP ns/contribution: {:.0}", xdp.map(|x| x.median).unwrap_or(f64::NAN)),
    ];
    let rt_failed: Vec<String> = rt
        .iter()
        .filter_map(|(n, r)| {
            r.as_ref()
                .err()
                .map(|e| format!("runtime {n} backend: {e}"))
        })
        .collect();
    let _ = std::fs::write(
        opts.out_dir.join("agg_summary.txt"),
        format!("{}\n", headline.join("\n")),
    );
    // A wrong or incomplete reduction fails the experiment in the full run
    // as in --quick (the section keeps its table; `aggbox-bench` exits
    // non-zero at the end).
    if !failed.is_empty() || !rt_failed.is_empty() {
        let summary = format!(
            "correctness: {}",
            failed.iter().chain(&rt_failed).cloned().collect::<Vec<_>>().join("; ")
        );
        return Err(super::large::Failed { markdown: md, summary }.into());
    }
    Ok(Section {
        name: "agg".into(),
        markdown: md,
        headline,
    })
}

/// Non-zero XDP outcome / drop / hand-off counters of an attachment, one line.
pub fn kernel_counters(att: &node::Attachment) -> Option<String> {
    let s = att.xdp.stats().ok()?;
    let mut parts: Vec<String> = s
        .outcomes
        .iter()
        .filter(|(_, c)| c.packets > 0)
        .map(|(k, c)| format!("{k}={}", c.packets))
        .collect();
    parts.extend(
        s.drops
            .iter()
            .filter(|(_, c)| c.packets > 0)
            .map(|(k, c)| format!("drop:{k}={}", c.packets)),
    );
    if let Ok(h) = att.xdp.handoff_stats() {
        parts.extend(
            h.iter()
                .filter(|(_, c)| c.packets > 0)
                .map(|(k, c)| format!("handoff:{k}={}", c.packets)),
        );
    }
    Some(parts.join(" "))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::harness::Shared;
    use super::*;

    #[test]
    fn pattern_expected_is_the_sum_of_the_payloads() {
        let p = Pattern::new(4, 10_000);
        for k in [0u64, 1, 60, 61, 27] {
            let mut sum = vec![0i32; PER];
            for r in 0..4u16 {
                let mut be = Vec::new();
                p.payload(r, k, PER, &mut be);
                let mut v = vec![0i32; PER];
                proto::read_i32_be(&be, &mut v);
                for i in 0..PER {
                    sum[i] += v[i];
                }
            }
            let mut be = Vec::new();
            proto::write_i32_be(&sum[..100], &mut be);
            assert!(p.check(k, &be), "fragment {k} (prefix)");
            be[5] ^= 0x10;
            assert!(!p.check(k, &be));
        }
    }

    #[test]
    fn completion_bitset_counts_once() {
        let s = Shared::new(130);
        assert!(s.mark(0));
        assert!(!s.mark(0));
        assert!(s.mark(129));
        assert!(!s.mark(130), "out of range");
        assert!(s.is_done(129) && !s.is_done(64));
        assert_eq!(s.completed.load(Ordering::Relaxed), 2);
    }
}
