//! `aggbox-bench`: the evaluation (docs/BENCHMARKS.md), an executable of
//! its own on the public library, so that the product (`aggbox`, the
//! library) carries none of it. `make bench` runs it.
//!
//! Every experiment compares AggBox with its baseline **in the same run**, on
//! a network-namespace testbed (`src/testing/testbed.rs`, shared with the
//! tests) of this machine, repeats each point and reports the median with its
//! spread. Raw results go to `DIR/<experiment>.csv` and `.json`, plots (by
//! `scripts/plot.py`) to `DIR/*.png`, and `DIR/REPORT.md` puts the numbers
//! next to the paper's.
//!
//! `--quick` shrinks every experiment to a CI smoke run of a few minutes: it
//! asserts correctness (every reduced element checked against the reference
//! reducer, every broadcast copy received), never speed.
//!
//! Experiments (one module each): [`agg`] aggregation throughput (with the
//! XDP count-and-drop ceiling, the [`floor`] aggregator and the XDP run time
//! per contribution), [`bcast`] broadcast latency, [`cpu`] aggregator CPU
//! usage vs senders, [`apps`] computation cost (GEMM), parameter server, word
//! count and broadcast applications, [`model`] the analytical scale model,
//! [`large`] all-reduce of large vectors against Gloo, [`edge`] the runtime's
//! passes over a vector against memcpy, [`ondemand`] jobs on demand: create
//! to first allreduce, the node's create + destroy cost and leaks, and a
//! dynamic job against the static job of the same description.
//!
//! `aggbox-bench soak` ([`soak`], `make soak`) is not an experiment of
//! `all`: the production-shaped soak, star, node-served and ring jobs at
//! once under loss, reloads and kills, with an invariant checker; its
//! worker processes are `aggbox-bench soak-worker` ([`soak_worker`]).

pub mod agg;
pub mod apps;
pub mod bcast;
pub mod cpu;
pub mod edge;
pub mod floor;
pub mod large;
pub mod model;
pub mod net;
pub mod ondemand;
pub mod soak;
pub mod soak_worker;
#[path = "../../testing/testbed.rs"]
pub mod testbed;
#[path = "../../testing/bpffs.rs"]
pub mod bpffs;
#[path = "../../testing/impair/mod.rs"]
pub mod impair;

pub use bpffs::{unmount_all_of_this_process, PrivateBpffs};

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// What to run and where to write.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// CI smoke sizes; correctness is asserted, speed never.
    pub quick: bool,
    /// Output directory (created).
    pub out_dir: PathBuf,
    /// Repetitions of every measured point (0 = the default: 3, quick 2).
    pub reps: usize,
    /// Run `scripts/plot.py` at the end (when python3 + matplotlib exist).
    pub plot: bool,
}

impl BenchOptions {
    /// Repetitions to use.
    pub fn reps(&self) -> usize {
        self.reps_or(3)
    }

    /// Repetitions of an experiment whose full run takes `full` by default
    /// (one that is short and whose ratios this VM's drift moves by more
    /// than the goal they are compared with): `--reps` when given, 2 in
    /// `--quick`.
    pub fn reps_or(&self, full: usize) -> usize {
        if self.reps > 0 {
            self.reps
        } else if self.quick {
            2
        } else {
            full
        }
    }
}

/// Names of the experiments, in the order `all` runs them.
pub const EXPERIMENTS: [&str; 11] = [
    "agg",
    "bcast",
    "cpu",
    "gemm",
    "ps",
    "wordcount",
    "bcast-apps",
    "model",
    "large",
    "edge",
    "ondemand",
];

static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Print a progress line (stderr) with the time since the benchmark started.
pub fn progress(msg: impl AsRef<str>) {
    let t0 = START.get_or_init(Instant::now);
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "[bench {:7.1}s] {}",
        t0.elapsed().as_secs_f64(),
        msg.as_ref()
    );
}

/// Median and spread of repeated measurements.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub median: f64,
    /// 10th percentile.
    pub p10: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

/// Percentile `p` (0..=100) of sorted samples, nearest-rank with linear interpolation.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = (p / 100.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let frac = pos - lo as f64;
    sorted[lo] + (sorted[hi] - sorted[lo]) * frac
}

/// The comma-separated names in environment variable `name` (blanks
/// dropped), or `None` when it is unset: how AGGBOX_AGG_MODES,
/// AGGBOX_AGG_SIZES and AGGBOX_CPU_PARTS narrow a run.
pub fn env_names(name: &str) -> Option<Vec<String>> {
    let v = std::env::var(name).ok()?;
    Some(v.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect())
}

/// Summarize samples (NaNs ignored).
pub fn summarize(samples: &[f64]) -> Summary {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return Summary {
            n: 0,
            median: f64::NAN,
            p10: f64::NAN,
            p90: f64::NAN,
            p99: f64::NAN,
            min: f64::NAN,
            max: f64::NAN,
            mean: f64::NAN,
        };
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Summary {
        n: v.len(),
        median: percentile(&v, 50.0),
        p10: percentile(&v, 10.0),
        p90: percentile(&v, 90.0),
        p99: percentile(&v, 99.0),
        min: v[0],
        max: v[v.len() - 1],
        mean: v.iter().sum::<f64>() / v.len() as f64,
    }
}

/// One experiment's output: its report section and whether it completed.
#[derive(Debug, Clone, Default)]
pub struct Section {
    /// Experiment name (file stem of its CSV/JSON).
    pub name: String,
    /// Markdown for REPORT.md.
    pub markdown: String,
    /// Numbers for the summary file / the final message.
    pub headline: Vec<String>,
}

/// A CSV table written row by row.
#[derive(Debug, Default)]
pub struct Csv {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Csv {
    /// A table with these columns.
    pub fn new(header: &[&str]) -> Csv {
        Csv {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Append a row (values formatted by the caller).
    pub fn row(&mut self, values: Vec<String>) {
        self.rows.push(values);
    }

    /// Write to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut s = self.header.join(",");
        s.push('\n');
        for r in &self.rows {
            s.push_str(&r.join(","));
            s.push('\n');
        }
        std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))
    }
}

/// Write `value` as pretty JSON to `path`.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Facts about the machine, for the report.
#[derive(Debug, Clone, Serialize)]
pub struct MachineFacts {
    /// `uname -srvm`.
    pub kernel: String,
    /// CPU model name.
    pub cpu_model: String,
    /// Online CPUs.
    pub cpus: usize,
    /// MemTotal in GiB.
    pub mem_gib: f64,
    /// 1-minute load average when the run started.
    pub loadavg_at_start: String,
    /// When the run started (UTC, from `date`).
    pub started: String,
    /// Quick mode.
    pub quick: bool,
    /// Repetitions per point.
    pub reps: usize,
}

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Collect [`MachineFacts`].
pub fn machine_facts(opts: &BenchOptions) -> MachineFacts {
    let uname = nix::sys::utsname::uname().ok();
    let kernel = uname
        .map(|u| {
            format!(
                "{} {} {} {}",
                u.sysname().to_string_lossy(),
                u.release().to_string_lossy(),
                u.version().to_string_lossy(),
                u.machine().to_string_lossy()
            )
        })
        .unwrap_or_default();
    let cpuinfo = read_trim("/proc/cpuinfo");
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let mem_kb: f64 = read_trim("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let started = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M:%S UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    MachineFacts {
        kernel,
        cpu_model,
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        mem_gib: mem_kb / 1024.0 / 1024.0,
        loadavg_at_start: read_trim("/proc/loadavg"),
        started,
        quick: opts.quick,
        reps: opts.reps(),
    }
}

/// Run the experiments named in `which` ("all" = every one) and write the
/// report. Returns an error when an experiment failed (the report still
/// says which ran).
pub fn run(which: &[String], opts: &BenchOptions) -> Result<()> {
    START.get_or_init(Instant::now);
    if !nix::unistd::Uid::effective().is_root() {
        bail!("aggbox-bench: needs root (network namespaces, BPF)");
    }
    let mut names: Vec<&str> = Vec::new();
    for w in which {
        if w == "all" {
            names.extend(EXPERIMENTS);
        } else if let Some(n) = EXPERIMENTS.iter().find(|n| **n == w.as_str()) {
            names.push(n);
        } else {
            bail!(
                "unknown experiment {w:?}; one of: all, {}",
                EXPERIMENTS.join(", ")
            );
        }
    }
    if names.is_empty() {
        names.extend(EXPERIMENTS);
    }
    std::fs::create_dir_all(&opts.out_dir)
        .with_context(|| format!("creating {}", opts.out_dir.display()))?;
    let facts = machine_facts(opts);
    write_json(&opts.out_dir.join("machine.json"), &facts)?;
    progress(format!(
        "machine: {} | {} x {} | load {} | quick={} reps={}",
        facts.kernel, facts.cpus, facts.cpu_model, facts.loadavg_at_start, facts.quick, facts.reps
    ));
    let mut sections = Vec::new();
    let mut failures = Vec::new();
    let mut ctx = Context_::default();
    for name in names {
        progress(format!("=== experiment {name} ==="));
        let t = Instant::now();
        let r = match name {
            "agg" => agg::run(opts, &mut ctx),
            "bcast" => bcast::run(opts, &mut ctx),
            "cpu" => cpu::run(opts, &mut ctx),
            "gemm" => apps::run_gemm(opts, &mut ctx),
            "ps" => apps::run_ps(opts, &mut ctx),
            "wordcount" => apps::run_wordcount(opts, &mut ctx),
            "bcast-apps" => apps::run_bcast_apps(opts, &mut ctx),
            "model" => model::run(opts, &mut ctx),
            "large" => large::run(opts, &mut ctx),
            "edge" => edge::run(opts, &mut ctx),
            "ondemand" => ondemand::run(opts, &mut ctx),
            _ => unreachable!("names are checked above"),
        };
        match r {
            Ok(section) => {
                progress(format!(
                    "=== {name} done in {:.1}s ===",
                    t.elapsed().as_secs_f64()
                ));
                for h in &section.headline {
                    progress(format!("  {h}"));
                }
                sections.push(section);
            }
            Err(e) => {
                progress(format!(
                    "=== {name} FAILED after {:.1}s: {e:#} ===",
                    t.elapsed().as_secs_f64()
                ));
                failures.push(format!("{name}: {e:#}"));
                sections.push(Section {
                    name: name.to_string(),
                    // An experiment that measured before failing keeps its table.
                    markdown: match e.downcast_ref::<large::Failed>() {
                        Some(f) => format!(
                            "{}\n**FAILED**: `{}`\n",
                            f.markdown,
                            f.summary.replace('`', "'")
                        ),
                        None => format!("## {name}\n\n**FAILED**: `{e:#}`\n"),
                    },
                    headline: vec![],
                });
            }
        }
        // Write the report after every experiment: a later failure or an
        // interrupted run still leaves what was measured.
        write_report(opts, &facts, &sections, &failures)?;
    }
    if opts.plot {
        plot(&opts.out_dir);
    }
    write_report(opts, &facts, &sections, &failures)?;
    progress(format!(
        "report: {}",
        opts.out_dir.join("REPORT.md").display()
    ));
    if !failures.is_empty() {
        bail!(
            "{} experiment(s) failed: {}",
            failures.len(),
            failures.join("; ")
        );
    }
    Ok(())
}

/// Values measured by one experiment and used by a later one (the scale
/// model is calibrated with the aggregation and broadcast costs).
#[derive(Debug, Clone, Default)]
pub struct Context_ {
    /// XDP run time per full-MTU contribution (ns), from bpf_stats.
    pub xdp_ns_per_contribution: Option<f64>,
    /// Kernel aggregation throughput at the largest size (elements/s).
    pub kernel_elems_per_s: Option<f64>,
    /// Median one-way latency of a 1-receiver broadcast (µs).
    pub bcast_base_us: Option<f64>,
}

fn plot(dir: &Path) {
    let script = crate::testbed::script_path().with_file_name("plot.py");
    if !script.exists() {
        progress(format!("plots skipped: {} not found", script.display()));
        return;
    }
    progress("plotting (scripts/plot.py)");
    // Debian's python3-matplotlib lives in the system interpreter; a python3
    // earlier on PATH (pyenv, venv) may not see it.
    let python = if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    };
    match std::process::Command::new(python).arg(&script).arg(dir).status() {
        Ok(s) if s.success() => {}
        Ok(s) => progress(format!("plots: scripts/plot.py exited {s} (is python3-matplotlib installed? `make bench` installs it)")),
        Err(e) => progress(format!("plots skipped: python3: {e}")),
    }
}

fn write_report(
    opts: &BenchOptions,
    facts: &MachineFacts,
    sections: &[Section],
    failures: &[String],
) -> Result<()> {
    let mut md = String::new();
    let _ = writeln!(md, "# AggBox evaluation report\n");
    let _ = writeln!(
        md,
        "Generated by `aggbox-bench{}` (docs/BENCHMARKS.md). Raw data: the `*.csv` / `*.json` files next to this report; plots: `*.png` (scripts/plot.py).\n",
        if opts.quick { " --quick" } else { "" }
    );
    let _ = writeln!(md, "## Machine\n");
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(md, "| kernel | `{}` |", facts.kernel);
    let _ = writeln!(md, "| CPU | {} × {} |", facts.cpus, facts.cpu_model);
    let _ = writeln!(md, "| memory | {:.1} GiB |", facts.mem_gib);
    // The date only: the report is a reference table of one run; the
    // exact start time stays in machine.json with the raw data.
    let date = facts.started.split_whitespace().next().unwrap_or(&facts.started);
    let _ = writeln!(md, "| date | {date} |");
    let _ = writeln!(md, "| load average at start | {} |", facts.loadavg_at_start);
    let _ = writeln!(
        md,
        "| mode | {} , {} repetitions per point |",
        if facts.quick {
            "--quick (CI smoke sizes: correctness only, numbers not meaningful)"
        } else {
            "full"
        },
        facts.reps
    );
    let _ = writeln!(
        md,
        "\nEverything runs on this one VM: senders, aggregator and receivers are network namespaces joined by veth pairs to a bridge, \
         sharing its {} vCPUs. The paper used separate machines with 10 Gbps NICs. Absolute numbers are therefore bounded by this VM's \
         packet rate (see the XDP count-and-drop ceiling below); the comparisons that matter are the ratios against the baseline measured in the same run. \
         Spread: median with p10/p90 (or min/max) over the repetitions, as stated in each table.\n",
        facts.cpus
    );
    if !failures.is_empty() {
        let _ = writeln!(md, "**Failed experiments:** {}\n", failures.join("; "));
    }
    for s in sections {
        md.push_str(&s.markdown);
        md.push('\n');
    }
    let done: Vec<&str> = sections.iter().map(|s| s.name.as_str()).collect();
    let missing: Vec<&str> = EXPERIMENTS
        .iter()
        .copied()
        .filter(|e| !done.contains(e))
        .collect();
    if !missing.is_empty() {
        let _ = writeln!(md, "## Not run in this report\n\n{}\n", missing.join(", "));
    }
    std::fs::write(opts.out_dir.join("REPORT.md"), md).context("writing REPORT.md")
}

/// Format a number with thousands separators.
pub fn thousands(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let n = x.round() as i128;
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Command line of `aggbox-bench`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "aggbox-bench",
    about = "Run the evaluation benchmarks (docs/BENCHMARKS.md) on a netns testbed and write raw results, plots and REPORT.md (needs root)"
)]
struct Cli {
    /// Experiments: all, agg, bcast, cpu, gemm, ps, wordcount, bcast-apps, model, large, edge, ondemand.
    #[arg(default_value = "all")]
    experiments: Vec<String>,
    /// CI smoke sizes (a few minutes; asserts correctness, never speed).
    #[arg(long)]
    quick: bool,
    /// Output directory.
    #[arg(long, default_value = "results")]
    out: PathBuf,
    /// Repetitions per point (default 3, quick 2).
    #[arg(long, default_value_t = 0)]
    reps: usize,
    /// Do not run scripts/plot.py.
    #[arg(long)]
    no_plot: bool,
}

fn main() {
    // The error chain is the last thing printed, without a backtrace: CI
    // keeps only the tail of a run's output, and an error returned from
    // main under RUST_BACKTRACE=1 would end with the backtrace instead of
    // which experiment failed and why.
    if let Err(e) = run_cli() {
        eprintln!("aggbox-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run_cli() -> Result<()> {
    // The soak (docs/ROBUSTNESS.md "Production soak") and its worker
    // processes have command lines of their own.
    let mode = std::env::args().nth(1).unwrap_or_default();
    if mode == "soak-worker" {
        let args = <soak_worker::WorkerArgs as clap::Parser>::parse_from(std::env::args().skip(1));
        return soak_worker::run(args);
    }
    let soak_args = (mode == "soak").then(|| <soak::SoakArgs as clap::Parser>::parse_from(std::env::args().skip(1)));
    let cli = if soak_args.is_some() { None } else { Some(<Cli as clap::Parser>::parse()) };
    // Ctrl-C: the testbeds' and pin mounts' destructors would not run; take
    // down what this process made before leaving.
    ctrlc::set_handler(|| {
        eprintln!("aggbox-bench: interrupted; removing this run's testbeds and bpffs mounts");
        soak::kill_started_processes();
        ondemand::kill_started();
        if let Err(e) = testbed::down_all_of_this_process() {
            eprintln!("aggbox-bench: {e}");
        }
        unmount_all_of_this_process();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;
    if let Some(args) = soak_args {
        return soak::run(&args);
    }
    let Some(cli) = cli else { unreachable!("parsed above") };
    run(
        &cli.experiments,
        &BenchOptions {
            quick: cli.quick,
            out_dir: cli.out,
            reps: cli.reps,
            plot: !cli.no_plot,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_and_percentiles() {
        let s = summarize(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!(s.n, 5);
        assert_eq!(s.median, 3.0);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 5.0);
        assert!((s.p10 - 1.4).abs() < 1e-9);
        assert_eq!(thousands(212288843.0), "212,288,843");
        assert_eq!(thousands(-1000.0), "-1,000");
        assert_eq!(thousands(999.0), "999");
    }
}
