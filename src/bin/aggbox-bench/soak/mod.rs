//! `aggbox-bench soak`: the production-shaped soak (docs/ROBUSTNESS.md
//! "Production soak"; `make soak`). For `--minutes` (default 30) three jobs
//! run at once on one network-namespace testbed, each as a sequence of runs
//! of separate worker processes (`aggbox-bench soak-worker`,
//! [`crate::soak_worker`]):
//!
//! - `star`: job 21 on node h0 with an aggregator application (on h0) and
//!   3 workers (h1..h3), in-kernel allreduce through `result_group`;
//! - `served`: job 22 on node h0, `consumer = "node"`, the same 3 worker
//!   hosts, the workers built from the configuration alone;
//! - `ring`: ring 40 of 3 members (h4..h6), each host running its own
//!   `aggbox attach` with the `[[ring]]` table.
//!
//! Under 1 % loss and 1 % duplication on every switch port with bursts
//! (`src/testing/impair`, its counters sampled), while a schedule reloads
//! node h0 with a real change (a spare node-served job added, its slots
//! changed, removed), kills -9 one worker of a run, and kills -9 node h0's
//! `aggbox attach`, restarting it a second later as systemd's
//! `Restart=always` would. An invariant checker fails the soak (non-zero
//! exit, the violations named in REPORT.md) on a wrong result, a call that
//! returned later than its deadline + [`GRACE`], a call that failed for no
//! injected cause, a worker that crashed, and on leaked node state: slots
//! or accumulator blocks held after a clean run, pins or UDP ports of the
//! node beyond the expected set, file descriptors past a bound, resident
//! memory past [`RSS_BOUND_MIB`] over its first sample after warm-up,
//! namespaces, mounts or processes left at the end.
//!
//! This file runs the soak; `node.rs` holds the node processes,
//! `chaos.rs` what is done to them, `sample.rs` their samples and bounds,
//! `report.rs` the report.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::soak_worker::{unix_ms, JobKind};
use crate::testbed::{self, Testbed, TestbedConfig};
use crate::{impair, progress, write_json, PrivateBpffs};

mod chaos;
mod node;
mod report;
mod sample;

use chaos::{chaos, impair_all, reload};
use node::{node_config, node_up_steadily, ring_config, Node};
use report::report;
use sample::{check_sample, list_pins, sample_node, sampler, Sample};

/// Every call's deadline.
pub const DEADLINE: Duration = Duration::from_secs(8);
/// A call that returns later than its deadline by more than this hung.
pub const GRACE: Duration = Duration::from_secs(2);
/// Bound on the growth of a node's resident memory over its first sample
/// after [`WARMUP`] (any incarnation of it): the node's steady state is
/// maps it pins and sockets it holds, none of which grows with calls.
pub const RSS_BOUND_MIB: f64 = 16.0;
/// Bound on a node's open descriptors over its first sample after warm-up:
/// the spare job's result socket and what a reload opens for a moment.
pub const FD_SLACK: i64 = 8;
/// Time after the first attach before resource baselines are taken.
pub const WARMUP: Duration = Duration::from_secs(60);
/// Resource sampling period.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Background impairment on every switch port, and the bursts'.
pub const LOSS: f64 = 0.01;
pub const DUP: f64 = 0.01;
pub const BURST_LOSS: f64 = 0.10;
pub const BURST_DUP: f64 = 0.03;
pub const BURST_LEN: Duration = Duration::from_secs(2);
/// The chaos schedule (from the soak's start; each repeats).
pub const BURST_EVERY: Duration = Duration::from_secs(60);
pub const RELOAD_EVERY: Duration = Duration::from_secs(150);
pub const KILL_WORKER_EVERY: Duration = Duration::from_secs(100);
pub const KILL_NODE_EVERY: Duration = Duration::from_secs(300);
/// systemd's RestartSec of the supervised node.
pub const RESTART_AFTER: Duration = Duration::from_secs(1);

const NODE_HOST: usize = 0;
const WORKER_HOSTS: [usize; 3] = [1, 2, 3];
const RING_HOSTS: [usize; 3] = [4, 5, 6];
const STAR_JOB: u16 = 21;
const STAR_DATA_PORT: u16 = 7700;
const SERVED_JOB: u16 = 22;
const SERVED_DATA_PORT: u16 = 7800;
const SPARE_JOB: u16 = 29;
const SPARE_RESULT_PORT: u16 = 7901;
const RING_ID: u16 = 40;
const RING_LEN: u32 = 4096;
const METRICS_PORT: u16 = 9491;
/// Linux's default ip_local_port_range starts here.
const EPHEMERAL_FIRST: u16 = 32768;
/// Rounds and contribution seqs a star run may use: each run of the job
/// with an aggregator application starts this far past the previous one,
/// so it never meets an earlier run's rounds (a run makes at most 120
/// calls of at most 56 fragments; a node restart starts the kernel afresh).
const STAR_ROUND_STRIDE: u32 = 1024;
const STAR_SEQ_STRIDE: u32 = 1 << 16;

/// Every process the soak started (nodes, workers), for the Ctrl-C
/// handler, where the destructors that stop them do not run.
static STARTED: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Kill (-9, by pid) every process this soak started that may still run.
pub fn kill_started_processes() {
    for pid in STARTED.lock().map(|v| v.clone()).unwrap_or_default() {
        if Path::new(&format!("/proc/{pid}")).exists() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn started(pid: u32) {
    if let Ok(mut v) = STARTED.lock() {
        v.retain(|p| Path::new(&format!("/proc/{p}")).exists());
        v.push(pid);
    }
}

/// What to run and where to write.
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "aggbox-bench soak", about = "Production-shaped soak: star, node-served and ring jobs at once under loss, reloads and kills, with an invariant checker (docs/ROBUSTNESS.md)")]
pub struct SoakArgs {
    /// Length of the soak.
    #[arg(long, default_value_t = 30.0)]
    pub minutes: f64,
    /// Output directory (REPORT.md, CSV, JSON, the plot, logs/).
    #[arg(long, default_value = "results/soak")]
    pub out: PathBuf,
    /// Do not run scripts/plot.py.
    #[arg(long)]
    pub no_plot: bool,
}

/// One call as a worker logged it, with the driver's verdict.
#[derive(Debug, Clone, Serialize)]
struct CallRecord {
    job: &'static str,
    run: u64,
    rank: String,
    call: String,
    t_s: f64,
    ms: f64,
    outcome: String,
    cause: String,
    detail: String,
}

#[derive(Debug, Clone, Serialize)]
struct Event {
    t_s: f64,
    kind: String,
    detail: String,
}

#[derive(Debug, Clone, Serialize)]
struct RunRecord {
    job: &'static str,
    run: u64,
    t_start_s: f64,
    t_end_s: f64,
    calls_planned: u64,
    ok: u64,
    failed: u64,
    killed_worker: bool,
    slots_after: Option<f64>,
}

/// State shared by the lanes, the chaos schedule and the sampler.
struct Shared {
    t0: Instant,
    end: Instant,
    stop: AtomicBool,
    out: PathBuf,
    exe: PathBuf,
    aggbox: PathBuf,
    tb: Testbed,
    injector: impair::Injector,
    /// h0 first, then the ring members'.
    nodes: Vec<Mutex<Node>>,
    spare: Mutex<u8>,
    calls: Mutex<Vec<CallRecord>>,
    runs: Mutex<Vec<RunRecord>>,
    events: Mutex<Vec<Event>>,
    samples: Mutex<Vec<Sample>>,
    violations: Mutex<Vec<String>>,
    /// (job, run, pid, rank) of every live worker process.
    live: Mutex<Vec<(JobKind, u64, u32, String)>>,
    /// Runs that lost a worker to the schedule's kill.
    killed_runs: Mutex<HashSet<(&'static str, u64)>>,
    /// Unix-ms windows in which node h0 was down (kill to attached again).
    node_down: Mutex<Vec<(u64, u64)>>,
    /// Unix ms of h0's last reload (ports move then).
    last_reload_ms: Mutex<u64>,
}

impl Shared {
    fn t(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    fn event(&self, kind: &str, detail: impl Into<String>) {
        let detail = detail.into();
        progress(format!("soak: {kind}: {detail}"));
        self.events.lock().unwrap().push(Event { t_s: self.t(), kind: kind.into(), detail });
    }

    fn violation(&self, v: impl Into<String>) {
        let v = v.into();
        let mut all = self.violations.lock().unwrap();
        // One line per distinct violation (a leak seen at every sample is one).
        if !all.contains(&v) {
            progress(format!("soak: VIOLATION: {v}"));
            all.push(v);
        }
    }

    fn running(&self) -> bool {
        !self.stop.load(Ordering::Relaxed) && Instant::now() < self.end
    }

    fn sleep_while_running(&self, d: Duration) {
        let until = Instant::now() + d;
        while self.running() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Run the soak; an error when an invariant was violated (REPORT.md names it).
pub fn run(args: &SoakArgs) -> Result<()> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!("aggbox-bench soak: needs root (network namespaces, BPF)");
    }
    raise_fd_limit();
    let out = args.out.clone();
    std::fs::create_dir_all(out.join("logs")).with_context(|| format!("creating {}", out.display()))?;
    let built = std::env::current_exe().context("the soak's own executable")?;
    if !built.with_file_name("aggbox").exists() {
        bail!("{} not found: build it first (`cargo build --release --features bench`; `make soak` does)", built.with_file_name("aggbox").display());
    }
    // Workers and node restarts run copies taken now: a rebuild in the
    // target directory during the soak must not change what they run.
    let bin = out.join("logs/bin");
    std::fs::create_dir_all(&bin)?;
    let exe = bin.join("aggbox-bench");
    let aggbox = bin.join("aggbox");
    for (from, to) in [(built.clone(), &exe), (built.with_file_name("aggbox"), &aggbox)] {
        let _ = std::fs::remove_file(to);
        std::fs::copy(&from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    let facts = crate::machine_facts(&crate::BenchOptions { quick: false, out_dir: out.clone(), reps: 1, plot: false });
    write_json(&out.join("machine.json"), &facts)?;
    let duration = Duration::from_secs_f64(args.minutes * 60.0);
    progress(format!("soak: {} minutes, output {}", args.minutes, out.display()));

    let tb = Testbed::up(TestbedConfig { hosts: 7, xdp_tx: true, ..Default::default() }).context("testbed")?;
    let ring_text = ring_config(&tb);
    let mut nodes = Vec::new();
    for (i, host) in std::iter::once(NODE_HOST).chain(RING_HOSTS).enumerate() {
        let pins = PrivateBpffs::mount(&format!("soak{i}"))?;
        let config = out.join(format!("logs/node-h{host}.toml"));
        std::fs::write(&config, if i == 0 { node_config(&tb, 0) } else { ring_text.clone() })?;
        nodes.push(Mutex::new(Node {
            name: format!("h{host}"),
            host,
            pins,
            config,
            child: None,
            started: Instant::now(),
            incarnation: 0,
            rss_base_kib: None,
            fd_base: None,
            pins_base: None,
            ephemeral_base: None,
            log: out.join(format!("logs/node-h{host}.log")),
        }));
    }
    let t0 = Instant::now();
    let shared = Arc::new(Shared {
        t0,
        end: t0 + duration,
        stop: AtomicBool::new(false),
        out: out.clone(),
        exe,
        aggbox,
        tb,
        injector: impair::Injector::new(),
        nodes,
        spare: Mutex::new(0),
        calls: Mutex::new(Vec::new()),
        runs: Mutex::new(Vec::new()),
        events: Mutex::new(Vec::new()),
        samples: Mutex::new(Vec::new()),
        violations: Mutex::new(Vec::new()),
        live: Mutex::new(Vec::new()),
        killed_runs: Mutex::new(HashSet::new()),
        node_down: Mutex::new(Vec::new()),
        last_reload_ms: Mutex::new(0),
    });
    let result = soak(&shared);
    let stopped = shutdown(&shared);
    let report = report(&shared, args, &facts);
    let Ok(shared) = Arc::try_unwrap(shared) else { bail!("soak: a thread still holds the testbed") };
    let prefix = shared.tb.prefix().to_string();
    drop(shared);
    let live: Vec<u32> = STARTED.lock().map(|v| v.clone()).unwrap_or_default();
    // Left at the end: namespaces of the testbed, worker processes.
    let mut left = Vec::new();
    if !testbed::list_namespaces(&prefix).map(|l| l.is_empty()).unwrap_or(false) {
        left.push(format!("network namespaces of testbed {prefix} left"));
    }
    for pid in live {
        if Path::new(&format!("/proc/{pid}")).exists() {
            left.push(format!("process {pid} (a node or worker) left running"));
        }
    }
    result?;
    stopped?;
    let violations = report?;
    if !left.is_empty() || violations > 0 {
        bail!(
            "soak: {violations} invariant violation(s){}; see {}",
            if left.is_empty() { String::new() } else { format!(" and: {}", left.join("; ")) },
            out.join("REPORT.md").display()
        );
    }
    progress(format!("soak: passed; report {}", out.join("REPORT.md").display()));
    Ok(())
}

fn raise_fd_limit() {
    // The injector keeps one counter map (a descriptor) per impairment it set.
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a stack value.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn soak(s: &Arc<Shared>) -> Result<()> {
    for n in &s.nodes {
        n.lock().unwrap().start(&s.tb, &s.aggbox)?;
    }
    s.event("attach", "h0 (star, served), h4..h6 (ring)");
    impair_all(s, LOSS, DUP)?;
    s.event("impair", format!("loss {LOSS} dup {DUP} on every switch port"));
    std::thread::scope(|scope| -> Result<()> {
        let lanes: Vec<_> = JobKind::ALL.iter().map(|&k| scope.spawn(move || lane(s, k))).collect();
        let chaos = scope.spawn(|| chaos(s));
        let sampler = scope.spawn(|| sampler(s));
        for l in lanes {
            if let Err(e) = l.join().expect("lane thread") {
                s.violation(format!("driver: {e:#}"));
            }
        }
        s.stop.store(true, Ordering::Relaxed);
        chaos.join().expect("chaos thread")?;
        sampler.join().expect("sampler thread");
        Ok(())
    })?;
    // The end: no impairment, no spare, one clean run of each job; then
    // the node must hold nothing for any job.
    impair_all(s, 0.0, 0.0)?;
    if *s.spare.lock().unwrap() != 0 {
        reload(s, 0)?;
    }
    s.event("drain", "one clean run of each job, no impairment");
    std::thread::scope(|scope| {
        let hs: Vec<_> = JobKind::ALL
            .iter()
            .map(|&k| scope.spawn(move || -> Result<u64> {
                let run = 1_000_000 + k as u64;
                let failed = one_run(s, k, run, 20)?;
                Ok(failed)
            }))
            .collect();
        for (k, h) in JobKind::ALL.iter().zip(hs) {
            match h.join().expect("drain thread") {
                Ok(0) => {}
                Ok(n) => s.violation(format!("drain: {n} calls of the final clean {} run failed", k.name())),
                Err(e) => s.violation(format!("drain {}: {e:#}", k.name())),
            }
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let sample = sample_node(s, 0);
    for (job, v) in [("star", sample.slots_star), ("served", sample.slots_served), ("spare", sample.slots_spare), ("all (blocks)", sample.blocks)] {
        if v != 0.0 {
            s.violation(format!("end: node h0 holds {v} slots/blocks of {job} with no run going"));
        }
    }
    for i in 0..s.nodes.len() {
        let smp = sample_node(s, i);
        check_sample(s, i, &smp, true);
        s.samples.lock().unwrap().push(smp);
    }
    Ok(())
}

/// Stop the nodes (SIGTERM: each must detach and exit 0, leaving no pin).
fn shutdown(s: &Arc<Shared>) -> Result<()> {
    s.stop.store(true, Ordering::Relaxed);
    for n in &s.nodes {
        let mut n = n.lock().unwrap();
        if let Err(e) = n.terminate() {
            s.violation(format!("shutdown: {e}"));
        }
        let left = list_pins(&n.pins.path);
        if !left.is_empty() {
            s.violation(format!("shutdown: {} pins left under {} after SIGTERM: {:?}", left.len(), n.name, left.iter().take(5).collect::<Vec<_>>()));
        }
    }
    Ok(())
}

/// Runs of job `kind`, one after another, until the end.
fn lane(s: &Arc<Shared>, kind: JobKind) -> Result<()> {
    let mut run = 0u64;
    while s.running() {
        run += 1;
        // 30 to 120 calls a run: runs end and start throughout.
        let calls = 30 + (run * 37) % 91;
        let failed = one_run(s, kind, run, calls)?;
        if kind == JobKind::Ring && failed > 0 {
            ring_reset(s)?;
        }
        std::thread::sleep(Duration::from_millis(500 + (run % 4) * 250));
    }
    Ok(())
}

/// After a failed ring call "the ring is then in an unknown state"
/// (docs/RING.md): the members' nodes may stand at different rounds and
/// no API aligns them, so the supervisor restarts every member's node
/// (they attach together and start at round 1 alike).
fn ring_reset(s: &Arc<Shared>) -> Result<()> {
    for i in 1..s.nodes.len() {
        let mut n = s.nodes[i].lock().unwrap();
        if let Err(e) = n.terminate() {
            s.violation(format!("ring reset: {e}"));
        }
        n.start(&s.tb, &s.aggbox)?;
    }
    s.event("ring_reset", "restarted h4..h6 (SIGTERM, attach) after a failed ring run");
    Ok(())
}

/// Start one run of `calls` calls of job `kind`, wait for its processes,
/// judge its calls; the number of calls that failed.
fn one_run(s: &Arc<Shared>, kind: JobKind, run: u64, calls: u64) -> Result<u64> {
    let t_start = s.t();
    let log = s.out.join(format!("logs/{}-run{run}.log", kind.name()));
    let err = std::fs::OpenOptions::new().create(true).append(true).open(s.out.join(format!("logs/{}-run{run}.stderr", kind.name())))?;
    let config_h0 = s.nodes[0].lock().unwrap().config.clone();
    let config_ring = s.nodes[1].lock().unwrap().config.clone();
    let ring_pin_dirs: Vec<PathBuf> = (1..s.nodes.len()).map(|i| s.nodes[i].lock().unwrap().pin_dir()).collect();
    let node_addr = s.tb.host(NODE_HOST).addr.to_string();
    // (host, rank or None for the aggregator application)
    let parts: Vec<(usize, Option<u16>)> = match kind {
        JobKind::Star => std::iter::once((NODE_HOST, None)).chain(WORKER_HOSTS.iter().enumerate().map(|(r, &h)| (h, Some(r as u16)))).collect(),
        JobKind::Served => WORKER_HOSTS.iter().enumerate().map(|(r, &h)| (h, Some(r as u16))).collect(),
        JobKind::Ring => RING_HOSTS.iter().enumerate().map(|(r, &h)| (h, Some(r as u16))).collect(),
    };
    let mut children: Vec<(Child, String)> = Vec::new();
    for (host, rank) in &parts {
        let mut a: Vec<String> = vec![
            s.exe.to_string_lossy().into(),
            "soak-worker".into(),
            "--kind".into(),
            kind.name().into(),
            "--ranks".into(),
            "3".into(),
            "--run".into(),
            run.to_string(),
            "--calls".into(),
            calls.to_string(),
            "--deadline-ms".into(),
            DEADLINE.as_millis().to_string(),
            "--log".into(),
            log.to_string_lossy().into(),
        ];
        if let Some(r) = rank {
            a.extend(["--rank".into(), r.to_string()]);
        }
        match kind {
            JobKind::Star | JobKind::Served => {
                let (job, port) = if kind == JobKind::Star { (STAR_JOB, STAR_DATA_PORT) } else { (SERVED_JOB, SERVED_DATA_PORT) };
                a.extend([
                    "--job".into(),
                    job.to_string(),
                    "--config".into(),
                    config_h0.to_string_lossy().into(),
                    "--node".into(),
                    node_addr.clone(),
                    "--data-port".into(),
                    port.to_string(),
                ]);
                if kind == JobKind::Star {
                    a.extend([
                        "--start-round".into(),
                        (run as u32).wrapping_mul(STAR_ROUND_STRIDE).to_string(),
                        "--start-seq".into(),
                        (run as u32).wrapping_mul(STAR_SEQ_STRIDE).to_string(),
                    ]);
                }
            }
            JobKind::Ring => {
                a.extend([
                    "--job".into(),
                    RING_ID.to_string(),
                    "--config".into(),
                    config_ring.to_string_lossy().into(),
                    "--pin-dir".into(),
                    ring_pin_dirs[rank.unwrap_or(0) as usize].to_string_lossy().into(),
                ]);
            }
        }
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let child = s
            .tb
            .command_in(*host, &refs)?
            .stdin(Stdio::null())
            .stdout(err.try_clone()?)
            .stderr(err.try_clone()?)
            .spawn()
            .context("starting a soak worker")?;
        started(child.id());
        let who = rank.map(|r| r.to_string()).unwrap_or_else(|| "agg".into());
        s.live.lock().unwrap().push((kind, run, child.id(), who.clone()));
        children.push((child, who));
        if rank.is_none() {
            // The aggregator application binds the job's result port before
            // any worker starts: the kernel sends each RESULT once, and one
            // that finds the port closed (the workers' first call completed
            // before the application was up) is never resent, so that run
            // would fail (seen in development runs; docs/ROBUSTNESS.md).
            let ready = format!("{},{run},agg,", kind.name());
            let until = Instant::now() + DEADLINE + GRACE;
            while Instant::now() < until {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if text.lines().any(|l| l.starts_with(&ready)) {
                    break;
                }
                if matches!(children.last_mut().map(|c| c.0.try_wait()), Some(Ok(Some(_)))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    // Wait, watching for calls that outlive their deadline + grace.
    let mut statuses: Vec<Option<std::process::ExitStatus>> = vec![None; children.len()];
    let mut hung_killed: HashSet<String> = HashSet::new();
    let started = Instant::now();
    while statuses.iter().any(Option::is_none) {
        for (i, (c, _)) in children.iter_mut().enumerate() {
            if statuses[i].is_none() {
                if let Ok(Some(st)) = c.try_wait() {
                    statuses[i] = Some(st);
                }
            }
        }
        if started.elapsed() > Duration::from_secs(1) {
            let now = unix_ms();
            for (who, since) in open_calls(&log) {
                let limit = (DEADLINE + GRACE + Duration::from_secs(1)).as_millis() as u64;
                if now.saturating_sub(since) > limit && !hung_killed.contains(&who) {
                    s.violation(format!("{} run {run} rank {who}: a call (or the build) has not returned {} s after it began (deadline {} s + grace {} s)", kind.name(), now.saturating_sub(since) / 1000, DEADLINE.as_secs(), GRACE.as_secs()));
                    hung_killed.insert(who.clone());
                    if let Some((c, _)) = children.iter_mut().find(|(_, w)| *w == who) {
                        let _ = c.kill();
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    s.live.lock().unwrap().retain(|l| !(l.0 == kind && l.1 == run));
    let killed = s.killed_runs.lock().unwrap().contains(&(kind.name(), run));
    for ((_, who), st) in children.iter().zip(&statuses) {
        let st = st.expect("waited");
        use std::os::unix::process::ExitStatusExt;
        let ok = matches!(st.code(), Some(0 | 2 | 3)) || (st.signal() == Some(9) && (killed || hung_killed.contains(who)));
        if !ok {
            s.violation(format!("{} run {run} rank {who}: the worker process ended with {st} (see logs/{}-run{run}.stderr)", kind.name(), kind.name()));
        }
    }
    // Judge the calls.
    let records = parse_log(s, kind, run, &log);
    let down = s.node_down.lock().unwrap().clone();
    let mut ok = 0;
    let mut failed = 0;
    let mut judged = Vec::new();
    // Calls every worker completed exactly (the star's aggregator
    // application may still fail them: see below).
    let workers_ok: BTreeSet<String> = {
        let mut by_call: BTreeMap<&str, usize> = BTreeMap::new();
        for r in records.iter().filter(|r| r.rank != "agg" && r.outcome == "ok") {
            *by_call.entry(r.call.as_str()).or_default() += 1;
        }
        by_call.into_iter().filter(|(_, n)| *n == WORKER_HOSTS.len()).map(|(c, _)| c.to_string()).collect()
    };
    let last_call = calls.saturating_sub(1).to_string();
    for mut r in records {
        let t_begin_ms = (s.t0_unix_ms() as f64 + r.t_s * 1e3) as u64;
        let t_end_ms = t_begin_ms + r.ms as u64;
        match r.outcome.as_str() {
            "ok" => ok += 1,
            "wrong" => s.violation(format!("{} run {run} rank {} call {}: WRONG result reported as success: {}", kind.name(), r.rank, r.call, r.detail)),
            "error" => {
                failed += 1;
                let slack = (DEADLINE + GRACE).as_millis() as u64;
                let node_killed = kind != JobKind::Ring && down.iter().any(|&(a, b)| t_end_ms >= a && t_begin_ms <= b + slack);
                let raw = r.cause.clone();
                r.cause = if killed {
                    format!("worker_killed ({raw})")
                } else if node_killed {
                    format!("node_killed ({raw})")
                } else if r.rank == "agg" && r.call == last_call && workers_ok.contains(&r.call) {
                    // Not injected, and not hidden: the workers exit right
                    // after their last call, and one whose closing ACK of
                    // the last RESULT is lost is never asked again.
                    s.violation(format!(
                        "{} run {run} call {}: the aggregator application's last call failed although every worker completed it exactly (no injected cause): {raw}: {}",
                        kind.name(), r.call, r.detail
                    ));
                    format!("unexplained: aggregator's last call, workers done ({raw})")
                } else {
                    s.violation(format!("{} run {run} rank {} call {}: failed with no injected cause: {raw}: {}", kind.name(), r.rank, r.call, r.detail));
                    format!("unexplained ({raw})")
                };
            }
            _ => {}
        }
        if r.ms > (DEADLINE + GRACE).as_millis() as f64 {
            s.violation(format!("{} run {run} rank {} call {}: returned after {:.0} ms, past the deadline {} s + grace {} s", kind.name(), r.rank, r.call, r.ms, DEADLINE.as_secs(), GRACE.as_secs()));
        }
        judged.push(r);
    }
    // A call that began and never ended in a process the schedule did not kill.
    for (who, _) in open_calls(&log) {
        if !killed && !hung_killed.contains(&who) {
            s.violation(format!("{} run {run} rank {who}: a call began and never ended (the process exited)", kind.name()));
        }
    }
    s.calls.lock().unwrap().extend(judged);
    // A clean run leaves no slot of its job on the node.
    let mut slots_after = None;
    if kind != JobKind::Ring && failed == 0 && !killed && node_up_steadily(s) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let smp = sample_node(s, 0);
            let v = if kind == JobKind::Star { smp.slots_star } else { smp.slots_served };
            slots_after = Some(v);
            if v == 0.0 || Instant::now() > deadline || !v.is_finite() {
                if v.is_finite() && v != 0.0 && node_up_steadily(s) {
                    s.violation(format!("{} run {run}: node h0 still holds {v} slots of the job 5 s after a clean run ended", kind.name()));
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    s.runs.lock().unwrap().push(RunRecord {
        job: kind.name(),
        run,
        t_start_s: t_start,
        t_end_s: s.t(),
        calls_planned: calls,
        ok,
        failed,
        killed_worker: killed,
        slots_after,
    });
    Ok(failed)
}

impl Shared {
    fn t0_unix_ms(&self) -> u64 {
        unix_ms() - self.t0.elapsed().as_millis() as u64
    }
}

/// (rank, begin unix ms) of every call or build in `log` without its end line.
fn open_calls(log: &Path) -> Vec<(String, u64)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut open: BTreeMap<String, u64> = BTreeMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.splitn(10, ',').collect();
        if f.len() < 4 {
            continue;
        }
        let who = f[2].to_string();
        match f[3] {
            "begin" if f.len() > 5 => {
                open.insert(who, f[5].parse().unwrap_or(0));
            }
            "end" => {
                open.remove(&who);
            }
            _ => {}
        }
    }
    open.into_iter().collect()
}

/// The call records of one run's log.
fn parse_log(s: &Shared, kind: JobKind, run: u64, log: &Path) -> Vec<CallRecord> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let t0 = s.t0_unix_ms() as f64;
    let mut out = Vec::new();
    for l in text.lines() {
        // job,run,rank,end,call,t0,ms,deadline,outcome,cause,detail
        let f: Vec<&str> = l.splitn(11, ',').collect();
        if f.len() < 10 || f[3] != "end" {
            continue;
        }
        out.push(CallRecord {
            job: kind.name(),
            run,
            rank: f[2].into(),
            call: f[4].into(),
            t_s: (f[5].parse::<f64>().unwrap_or(0.0) - t0) / 1e3,
            ms: f[6].parse().unwrap_or(f64::NAN),
            outcome: f[8].into(),
            cause: f[9].into(),
            detail: f.get(10).unwrap_or(&"").to_string(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::sample::gauge;
    use super::*;

    #[test]
    fn gauges_are_read_by_name_and_job() {
        let text = "# HELP aggbox_job_slots_active x\n\
                    aggbox_job_slots_active{iface=\"eth0\",aggbox_job=\"21\"} 3\n\
                    aggbox_job_slots_active{iface=\"eth0\",aggbox_job=\"22\"} 4\n\
                    aggbox_job_slots_active_more{iface=\"eth0\",aggbox_job=\"21\"} 100\n\
                    aggbox_blocks_in_use{iface=\"eth0\"} 2\n";
        assert_eq!(gauge(text, "aggbox_job_slots_active", Some(21)), 3.0);
        assert_eq!(gauge(text, "aggbox_job_slots_active", Some(29)), 0.0);
        assert!(gauge(text, "aggbox_job_slots_active", Some(29)).is_sign_positive());
        assert_eq!(gauge(text, "aggbox_blocks_in_use", None), 2.0);
    }

    #[test]
    fn a_call_that_began_and_did_not_end_is_open() {
        let dir = std::env::temp_dir().join(format!("aggbox-soak-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("run.log");
        std::fs::write(
            &log,
            "star,1,0,built,100,0.2,0\nstar,1,0,begin,0,100,1,Sum\nstar,1,0,end,0,100,0.3,8000,ok,,\n\
             star,1,agg,begin,0,101,1,Sum\nstar,1,1,begin,0,102,1,Sum\nstar,1,1,end,0,102,8000.1,8000,error,timeout,x; y\n",
        )
        .unwrap();
        assert_eq!(open_calls(&log), vec![("agg".to_string(), 101)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
