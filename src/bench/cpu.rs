//! Experiment 3: CPU usage of the aggregator for 2..30 senders.
//!
//! Each sender sends at a fixed rate (`RATE` full-MTU contributions per
//! second), so the offered load grows with the number of senders as in the
//! paper. Aggregator CPU = (XDP run time from bpf_stats + the CPU time of the
//! application thread that receives the RESULTs) / wall time, for AggBox;
//! the aggregator thread's CPU time for the plain UDP baseline (its softirq
//! receive work is not attributable per thread and is not included, which
//! flatters the baseline). Whole-VM busy and softirq fractions from
//! /proc/stat are reported next to it (they include the senders).

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{bail, Result};
use serde::Serialize;

use super::agg::{Harness, Mode, Pattern, RunResult, RunSpec, PER};
use super::{progress, summarize, BenchOptions, Context_, Csv, Section, Summary};

/// Contributions per second per sender.
pub const RATE: f64 = 1000.0;

#[derive(Debug, Clone, Serialize)]
struct Point {
    mode: String,
    senders: usize,
    agg_cpu_pct: Summary,
    xdp_cpu_pct: Summary,
    sys_busy_pct: Summary,
    sys_softirq_pct: Summary,
    runs: Vec<RunResult>,
}

/// Experiment 3.
pub fn run(opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> {
    let list: Vec<usize> = if opts.quick {
        vec![2, 4]
    } else {
        vec![2, 4, 8, 10, 16, 20, 30]
    };
    let secs = if opts.quick { 0.5 } else { 2.0 };
    let reps = opts.reps();
    let frags = (RATE * secs) as u64;
    let mut points = Vec::new();
    let mut csv = Csv::new(&[
        "mode",
        "senders",
        "rep",
        "secs",
        "agg_cpu_pct",
        "xdp_cpu_pct",
        "sys_busy_pct",
        "sys_softirq_pct",
        "ok",
    ]);
    let mut round = 1u32;
    let mut failures = Vec::new();
    let _stats = crate::metrics::enable_bpf_stats()?;
    for &s in &list {
        progress(format!(
            "cpu: {s} senders at {RATE} contributions/s each, {secs} s per run"
        ));
        let h = Harness::new(s)?;
        let wl = Pattern::new(s, frags * PER as u64);
        let mut by_mode: Vec<(Mode, Vec<RunResult>)> =
            vec![(Mode::Kernel, vec![]), (Mode::Plain, vec![])];
        for _rep in 0..reps {
            for (mode, rs) in by_mode.iter_mut() {
                let r = h.with_mode(*mode, |a| -> Result<RunResult> {
                    let spec = RunSpec {
                        round,
                        window: super::agg::window_for(s),
                        deadline: Duration::from_secs(60),
                        rate_per_sender: Some(RATE),
                    };
                    Ok(a.run(&wl, spec))
                })?;
                round += 1;
                if !r.ok {
                    failures.push(format!(
                        "{} {s} senders: {}",
                        mode.name(),
                        r.error.clone().unwrap_or_default()
                    ));
                }
                rs.push(r);
            }
        }
        for (mode, rs) in by_mode {
            let agg: Vec<f64> = rs
                .iter()
                .map(|r| 100.0 * (r.xdp_run_ns as f64 / 1e9 + r.agg_thread_cpu_s) / r.secs)
                .collect();
            let xdp: Vec<f64> = rs
                .iter()
                .map(|r| 100.0 * (r.xdp_run_ns as f64 / 1e9) / r.secs)
                .collect();
            let busy: Vec<f64> = rs.iter().map(|r| 100.0 * r.sys_busy).collect();
            let soft: Vec<f64> = rs.iter().map(|r| 100.0 * r.sys_softirq).collect();
            for (i, r) in rs.iter().enumerate() {
                csv.row(vec![
                    mode.name().into(),
                    s.to_string(),
                    i.to_string(),
                    format!("{:.4}", r.secs),
                    format!("{:.3}", agg[i]),
                    format!("{:.3}", xdp[i]),
                    format!("{:.3}", busy[i]),
                    format!("{:.3}", soft[i]),
                    r.ok.to_string(),
                ]);
            }
            progress(format!(
                "cpu: {s} senders {}: aggregator {:.2} % of a CPU (median), VM busy {:.1} %",
                mode.name(),
                summarize(&agg).median,
                summarize(&busy).median
            ));
            points.push(Point {
                mode: mode.name().into(),
                senders: s,
                agg_cpu_pct: summarize(&agg),
                xdp_cpu_pct: summarize(&xdp),
                sys_busy_pct: summarize(&busy),
                sys_softirq_pct: summarize(&soft),
                runs: rs,
            });
        }
    }
    csv.write(&opts.out_dir.join("cpu_usage.csv"))?;
    super::write_json(&opts.out_dir.join("cpu_usage.json"), &points)?;
    if opts.quick && !failures.is_empty() {
        bail!("correctness: {}", failures.join("; "));
    }
    let mut md = String::new();
    let _ = writeln!(md, "## 3. Aggregator CPU usage vs senders\n");
    let _ = writeln!(
        md,
        "Each sender sends {RATE} full-MTU contributions/s for {secs} s (offered load grows with the senders). Aggregator CPU in % of one CPU, \
         median [min – max] over {reps} runs. AggBox = XDP run time (bpf_stats) + the RESULT-receiving application thread; plain = its aggregator \
         thread (softirq receive work excluded). VM busy = all CPUs from /proc/stat, senders included.\n"
    );
    let _ = writeln!(md, "| senders | AggBox aggregator CPU % | of which XDP % | plain aggregator CPU % | VM busy % (AggBox / plain) |");
    let _ = writeln!(md, "|---|---|---|---|---|");
    for &s in &list {
        let k = points.iter().find(|p| p.mode == "kernel" && p.senders == s);
        let p = points.iter().find(|p| p.mode == "plain" && p.senders == s);
        if let (Some(k), Some(p)) = (k, p) {
            let _ = writeln!(
                md,
                "| {s} | {:.2} [{:.2} – {:.2}] | {:.2} | {:.2} [{:.2} – {:.2}] | {:.1} / {:.1} |",
                k.agg_cpu_pct.median,
                k.agg_cpu_pct.min,
                k.agg_cpu_pct.max,
                k.xdp_cpu_pct.median,
                p.agg_cpu_pct.median,
                p.agg_cpu_pct.min,
                p.agg_cpu_pct.max,
                k.sys_busy_pct.median,
                p.sys_busy_pct.median
            );
        }
    }
    let _ = writeln!(
        md,
        "\n**Paper (Fig. 11):** 1.38 % (2 senders), 6.70 % (10), 29.92 % (30) on isolated CPUs; the paper does not state the per-sender rate, so \
         only the trend (linear in the offered load) is comparable. Our per-contribution XDP cost (experiment 1) sets the slope: \
         CPU % ≈ senders × {RATE}/s × XDP ns. Plot: `cpu_usage.png`.\n"
    );
    let headline = points
        .iter()
        .filter(|p| p.mode == "kernel")
        .map(|p| {
            format!(
                "cpu {} senders: AggBox aggregator {:.2} %",
                p.senders, p.agg_cpu_pct.median
            )
        })
        .collect();
    Ok(Section {
        name: "cpu".into(),
        markdown: md,
        headline,
    })
}
