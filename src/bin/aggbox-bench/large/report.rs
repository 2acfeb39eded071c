//! The run's results: CSV rows and progress lines of each point, the JSON
//! output with the goal, and the REPORT.md section with its tables.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::{progress, thousands, BenchOptions, Csv};
use aggbox::wire::proto;

use super::{backend_name, over_tcp, striped, worker_count, Point, GOAL_RATIO, GOAL_SIZE};
use super::counters::counters_line;

#[allow(clippy::too_many_arguments)]
pub(super) fn csv_row(
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

pub(super) fn report_point(p: &Point) {
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

#[derive(Debug, Serialize)]
pub(super) struct Output<'a> {
    pub(super) workers: usize,
    pub(super) reps: usize,
    pub(super) largest_mtu: Option<u32>,
    pub(super) largest_mtu_note: String,
    pub(super) gloo: String,
    pub(super) openmpi: String,
    pub(super) goal: Option<Goal>,
    pub(super) failures: &'a [String],
    pub(super) points: &'a [Point],
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct Goal {
    pub(super) statement: String,
    pub(super) elements: u64,
    /// Per MTU: Gloo time / kernel time.
    pub(super) ratio_by_mtu: BTreeMap<u32, f64>,
    /// Best Gloo time (any MTU) / best kernel time (any MTU).
    pub(super) ratio_best: f64,
    pub(super) kernel_best_mtu: u32,
    pub(super) gloo_best_mtu: u32,
    pub(super) met: bool,
}

pub(super) fn goal(points: &[Point]) -> Option<Goal> {
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

#[allow(clippy::too_many_arguments)]
pub(super) fn markdown(
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
         checked element by element on every participant; `floor`: the star's floor on this testbed, no runtime: the \
         floor aggregator in XDP (`bench_floor` at MTU 1500, `bench_floor_frags` above), the minimal TC copier cloning each RESULT to the workers, workers that send pre-encoded \
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
pub(super) fn floor_table(points: &[Point]) -> String {
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
pub(super) fn round_trip_table(points: &[Point]) -> String {
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
