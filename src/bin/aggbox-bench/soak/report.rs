//! The soak's report: REPORT.md section, JSON and plot.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::soak_worker::JobKind;
use crate::{percentile, progress, write_json, Csv};

use super::{
    CallRecord, Shared, SoakArgs, DEADLINE, FD_SLACK, GRACE, RSS_BOUND_MIB, SAMPLE_EVERY, WARMUP,
};
use super::sample::Sample;

/// Write calls.csv, runs.csv, events.csv, resources.csv, summary.json and
/// REPORT.md; plot. The number of violations.
pub(super) fn report(s: &Shared, args: &SoakArgs, facts: &crate::MachineFacts) -> Result<usize> {
    let out = &s.out;
    let calls = s.calls.lock().unwrap().clone();
    let runs = s.runs.lock().unwrap().clone();
    let events = s.events.lock().unwrap().clone();
    let samples = s.samples.lock().unwrap().clone();
    let violations = s.violations.lock().unwrap().clone();

    let mut csv = Csv::new(&["job", "run", "rank", "call", "t_s", "ms", "outcome", "cause"]);
    for c in &calls {
        csv.row(vec![c.job.into(), c.run.to_string(), c.rank.clone(), c.call.clone(), format!("{:.3}", c.t_s), format!("{:.3}", c.ms), c.outcome.clone(), c.cause.replace(',', ";")]);
    }
    csv.write(&out.join("soak_calls.csv"))?;
    let mut csv = Csv::new(&["job", "run", "t_start_s", "t_end_s", "calls_planned", "ok", "failed", "killed_worker", "slots_after"]);
    for r in &runs {
        csv.row(vec![
            r.job.into(),
            r.run.to_string(),
            format!("{:.1}", r.t_start_s),
            format!("{:.1}", r.t_end_s),
            r.calls_planned.to_string(),
            r.ok.to_string(),
            r.failed.to_string(),
            r.killed_worker.to_string(),
            r.slots_after.map(|v| v.to_string()).unwrap_or_default(),
        ]);
    }
    csv.write(&out.join("soak_runs.csv"))?;
    let mut csv = Csv::new(&["t_s", "kind", "detail"]);
    for e in &events {
        csv.row(vec![format!("{:.1}", e.t_s), e.kind.clone(), format!("\"{}\"", e.detail.replace('"', "'"))]);
    }
    csv.write(&out.join("soak_events.csv"))?;
    let mut csv = Csv::new(&["t_s", "node", "incarnation", "rss_mib", "fds", "pins", "udp_ports", "slots_star", "slots_served", "slots_spare", "blocks", "dropped", "duplicated"]);
    for m in &samples {
        csv.row(vec![
            format!("{:.1}", m.t_s),
            m.node.clone(),
            m.incarnation.to_string(),
            format!("{:.2}", m.rss_mib),
            m.fds.to_string(),
            m.pins.to_string(),
            m.udp_ports.clone(),
            m.slots_star.to_string(),
            m.slots_served.to_string(),
            m.slots_spare.to_string(),
            m.blocks.to_string(),
            m.dropped.to_string(),
            m.duplicated.to_string(),
        ]);
    }
    csv.write(&out.join("soak_resources.csv"))?;

    // Per job: calls, outcomes, times.
    #[derive(Serialize, Default, Clone)]
    struct JobSummary {
        runs: usize,
        collective_calls: usize,
        calls: usize,
        ok: usize,
        wrong: usize,
        failed: usize,
        p50_ms: f64,
        p99_ms: f64,
        max_ms: f64,
        failed_max_ms: f64,
    }
    let mut jobs: BTreeMap<&str, JobSummary> = BTreeMap::new();
    let mut causes: BTreeMap<(String, &str), usize> = BTreeMap::new();
    for k in JobKind::ALL {
        let cs: Vec<&CallRecord> = calls.iter().filter(|c| c.job == k.name() && c.call != "build").collect();
        let mut ok_ms: Vec<f64> = cs.iter().filter(|c| c.outcome == "ok").map(|c| c.ms).collect();
        ok_ms.sort_by(|a, b| a.total_cmp(b));
        let failed_max = calls.iter().filter(|c| c.job == k.name() && c.outcome == "error").map(|c| c.ms).fold(0.0, f64::max);
        jobs.insert(
            k.name(),
            JobSummary {
                runs: runs.iter().filter(|r| r.job == k.name()).count(),
                collective_calls: cs.iter().map(|c| (c.run, c.call.as_str())).collect::<BTreeSet<_>>().len(),
                calls: cs.len(),
                ok: ok_ms.len(),
                wrong: cs.iter().filter(|c| c.outcome == "wrong").count(),
                failed: calls.iter().filter(|c| c.job == k.name() && c.outcome == "error").count(),
                p50_ms: percentile(&ok_ms, 50.0),
                p99_ms: percentile(&ok_ms, 99.0),
                max_ms: ok_ms.last().copied().unwrap_or(f64::NAN),
                failed_max_ms: failed_max,
            },
        );
        for c in calls.iter().filter(|c| c.job == k.name() && c.outcome == "error") {
            let what = if c.call == "build" { format!("{} [build]", c.cause) } else { c.cause.clone() };
            *causes.entry((what, k.name())).or_default() += 1;
        }
    }
    let mut event_counts: BTreeMap<String, usize> = BTreeMap::new();
    for e in &events {
        *event_counts.entry(e.kind.clone()).or_default() += 1;
    }
    let last_counts = samples.last().map(|m| (m.dropped, m.duplicated)).unwrap_or_default();

    #[derive(Serialize)]
    struct Summary<'a> {
        minutes: f64,
        deadline_s: f64,
        grace_s: f64,
        rss_bound_mib: f64,
        fd_slack: i64,
        jobs: &'a BTreeMap<&'a str, JobSummary>,
        failures_by_cause: BTreeMap<String, usize>,
        events: &'a BTreeMap<String, usize>,
        injector_dropped: u64,
        injector_duplicated: u64,
        violations: &'a [String],
        verdict: &'a str,
    }
    let verdict = if violations.is_empty() { "pass" } else { "FAIL" };
    write_json(
        &out.join("soak_summary.json"),
        &Summary {
            minutes: args.minutes,
            deadline_s: DEADLINE.as_secs_f64(),
            grace_s: GRACE.as_secs_f64(),
            rss_bound_mib: RSS_BOUND_MIB,
            fd_slack: FD_SLACK,
            jobs: &jobs,
            failures_by_cause: causes.iter().map(|((c, j), n)| (format!("{j}: {c}"), *n)).collect(),
            events: &event_counts,
            injector_dropped: last_counts.0,
            injector_duplicated: last_counts.1,
            violations: &violations,
            verdict,
        },
    )?;
    if !args.no_plot {
        plot(out);
    }

    let mut md = String::new();
    let _ = writeln!(md, "# AggBox production soak\n");
    let _ = writeln!(
        md,
        "Generated by `aggbox-bench soak --minutes {}` (docs/ROBUSTNESS.md, \"Production soak\"). Raw data: `soak_calls.csv` (every call), `soak_runs.csv`, `soak_events.csv` (the schedule as it happened), `soak_resources.csv` (every {} s), `soak_summary.json`; plot: `soak_resources.png`.\n",
        args.minutes,
        SAMPLE_EVERY.as_secs()
    );
    let date = facts.started.split_whitespace().next().unwrap_or(&facts.started);
    let _ = writeln!(md, "Machine: {} × {}, {:.1} GiB, `{}`, {date}.\n", facts.cpus, facts.cpu_model, facts.mem_gib, facts.kernel);
    let _ = writeln!(md, "**Verdict: {verdict}** ({} invariant violation(s)).\n", violations.len());
    let _ = writeln!(md, "## Calls\n");
    let _ = writeln!(
        md,
        "A call is one collective of a run (all its participants); each participant's part of it is counted apart (star: 3 workers and the aggregator application, served and ring: 3). Times (ms) of the participants' parts that completed; deadline {} s.\n",
        DEADLINE.as_secs()
    );
    let _ = writeln!(md, "| job | runs | calls | participant calls | ok | wrong | failed | p50 | p99 | max | slowest failed |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (k, j) in &jobs {
        let _ = writeln!(
            md,
            "| {k} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.0} |",
            j.runs, j.collective_calls, j.calls, j.ok, j.wrong, j.failed, j.p50_ms, j.p99_ms, j.max_ms, j.failed_max_ms
        );
    }
    let _ = writeln!(md, "\n## Failures by cause\n");
    let _ = writeln!(md, "`worker_killed`: a call of a run one of whose workers the schedule killed; `node_killed`: a call of a star job that overlapped node h0's kill -9 and restart (+ deadline + grace); `unexplained`: anything else (a violation). In parentheses the runtime's error. `[build]`: building the communicator failed.\n");
    let _ = writeln!(md, "| job | cause | calls |\n|---|---|---:|");
    for ((c, j), n) in &causes {
        let _ = writeln!(md, "| {j} | {c} | {n} |");
    }
    if causes.is_empty() {
        let _ = writeln!(md, "| | none | 0 |");
    }
    let _ = writeln!(md, "\n## Chaos applied\n");
    let _ = writeln!(md, "| event | count |\n|---|---:|");
    for (e, n) in &event_counts {
        let _ = writeln!(md, "| {e} | {n} |");
    }
    let _ = writeln!(md, "| datagrams dropped by the injector | {} |", last_counts.0);
    let _ = writeln!(md, "| datagrams duplicated by the injector | {} |", last_counts.1);
    let _ = writeln!(md, "\n## Resources over time\n\n![resources](soak_resources.png)\n");
    let _ = writeln!(md, "| node | samples | RSS first / warmed / max / last (MiB) | fds first / max / last | pins min / max | UDP ports (last) |\n|---|---:|---|---|---|---|");
    let names: BTreeSet<String> = samples.iter().map(|m| m.node.clone()).collect();
    for name in names {
        let ms: Vec<&Sample> = samples.iter().filter(|m| m.node == name && m.rss_mib.is_finite()).collect();
        if ms.is_empty() {
            continue;
        }
        let warmed = ms.iter().find(|m| m.t_s >= WARMUP.as_secs_f64()).map(|m| m.rss_mib).unwrap_or(f64::NAN);
        let _ = writeln!(
            md,
            "| {name} | {} | {:.1} / {:.1} / {:.1} / {:.1} | {} / {} / {} | {} / {} | {} |",
            ms.len(),
            ms[0].rss_mib,
            warmed,
            ms.iter().map(|m| m.rss_mib).fold(0.0, f64::max),
            ms[ms.len() - 1].rss_mib,
            ms[0].fds,
            ms.iter().map(|m| m.fds).max().unwrap_or(0),
            ms[ms.len() - 1].fds,
            ms.iter().map(|m| m.pins).min().unwrap_or(0),
            ms.iter().map(|m| m.pins).max().unwrap_or(0),
            ms[ms.len() - 1].udp_ports,
        );
    }
    let h0: Vec<&Sample> = samples.iter().filter(|m| m.node == "h0" && m.slots_star.is_finite()).collect();
    if !h0.is_empty() {
        let max = |f: fn(&Sample) -> f64| h0.iter().map(|m| f(m)).fold(0.0, f64::max);
        let _ = writeln!(
            md,
            "\nNode h0's kernel slots in use (max over the samples): star {}, served {}, spare {}; accumulator blocks {}; at the end: {} / {} / {} / {}.",
            max(|m| m.slots_star),
            max(|m| m.slots_served),
            max(|m| m.slots_spare),
            max(|m| m.blocks),
            h0[h0.len() - 1].slots_star,
            h0[h0.len() - 1].slots_served,
            h0[h0.len() - 1].slots_spare,
            h0[h0.len() - 1].blocks
        );
    }
    // h0 every 5 minutes (the plot has every sample).
    let h0: Vec<&Sample> = samples.iter().filter(|m| m.node == "h0").collect();
    if !h0.is_empty() {
        let _ = writeln!(md, "\nNode h0 over time (the sample nearest each 5 minutes):\n");
        let _ = writeln!(md, "| minute | incarnation | RSS (MiB) | fds | pins | UDP ports | slots star / served / spare | blocks |\n|---:|---:|---:|---:|---:|---|---|---:|");
        let mut next = 0.0;
        for m in &h0 {
            if m.t_s >= next || std::ptr::eq(*m, *h0.last().expect("non-empty")) {
                let _ = writeln!(
                    md,
                    "| {:.1} | {} | {:.1} | {} | {} | {} | {} / {} / {} | {} |",
                    m.t_s / 60.0, m.incarnation, m.rss_mib, m.fds, m.pins, m.udp_ports, m.slots_star, m.slots_served, m.slots_spare, m.blocks
                );
                next = (m.t_s / 300.0).floor() * 300.0 + 300.0;
            }
        }
    }
    let _ = writeln!(md, "\n## Invariants\n");
    let count = |p: &str| violations.iter().filter(|v| v.contains(p)).count();
    let rows: [(&str, String, usize); 9] = [
        ("no wrong result reported as success", "every element equals the reference reducer".into(), count("WRONG")),
        ("no hang", format!("every call returns within deadline {} s + grace {} s", DEADLINE.as_secs(), GRACE.as_secs()), count("past the deadline") + count("has not returned") + count("never ended")),
        ("no unexplained failure", "every failed call overlaps a kill".into(), count("no injected cause") + count("drain")),
        ("no crashed worker", "exit 0, or 2/3 after a failed call, or killed by the schedule".into(), count("process ended")),
        ("no leaked slots", "0 slots of a job after its clean run, 0 slots and blocks at the end".into(), count("slots")),
        ("no leaked pins", "the set of the first check; none after SIGTERM".into(), count("pins")),
        ("no leaked UDP ports", "h0: 7201 (+ 7901 with the spare job); ring nodes: 7400".into(), count("UDP ports")),
        ("bounded descriptors", format!("≤ first warmed sample + {FD_SLACK} (+ 2 at the end)"), count("descriptors")),
        ("bounded memory", format!("VmRSS ≤ first sample after {} s warm-up + {RSS_BOUND_MIB} MiB", WARMUP.as_secs()), count("resident memory")),
    ];
    let _ = writeln!(md, "| invariant | bound | verdict |\n|---|---|---|");
    for (what, bound, n) in rows {
        let _ = writeln!(md, "| {what} | {bound} | {} |", if n == 0 { "pass".to_string() } else { format!("**FAIL** ({n})") });
    }
    let other = violations.len();
    if other > 0 {
        let _ = writeln!(md, "\n## Violations\n");
        for v in violations.iter().take(100) {
            let _ = writeln!(md, "- {}", v.replace('|', "/"));
        }
        if violations.len() > 100 {
            let _ = writeln!(md, "- … and {} more", violations.len() - 100);
        }
    }
    std::fs::write(out.join("REPORT.md"), md).context("writing REPORT.md")?;
    Ok(violations.len())
}

pub(super) fn plot(dir: &Path) {
    let script = crate::testbed::script_path().with_file_name("plot.py");
    let python = if Path::new("/usr/bin/python3").exists() { "/usr/bin/python3" } else { "python3" };
    match std::process::Command::new(python).arg(&script).arg(dir).status() {
        Ok(st) if st.success() => {}
        Ok(st) => progress(format!("plots: scripts/plot.py exited {st} (is python3-matplotlib installed?)")),
        Err(e) => progress(format!("plots skipped: python3: {e}")),
    }
}
