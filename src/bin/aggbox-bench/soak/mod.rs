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

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::soak_worker::{unix_ms, JobKind};
use crate::testbed::{self, Testbed, TestbedConfig};
use crate::{impair, percentile, progress, write_json, Csv, PrivateBpffs};

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

/// A node's `aggbox attach` under the driver's supervision.
struct Node {
    name: String,
    host: usize,
    pins: PrivateBpffs,
    config: PathBuf,
    child: Option<Child>,
    started: Instant,
    incarnation: u32,
    /// VmRSS (KiB) and descriptors at the first sample after warm-up.
    rss_base_kib: Option<f64>,
    fd_base: Option<i64>,
    /// Pins seen at the first check (relative paths).
    pins_base: Option<BTreeSet<String>>,
    /// Ephemeral UDP ports held at the first check.
    ephemeral_base: Option<usize>,
    log: PathBuf,
}

impl Node {
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn pin_dir(&self) -> PathBuf {
        aggbox::node::pin_dir(&self.pins.path, "eth0")
    }

    /// Start `aggbox attach eth0` and wait for its "attached" line.
    fn start(&mut self, tb: &Testbed, aggbox: &Path) -> Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut child = tb
            .command_in(
                self.host,
                &[
                    &aggbox.to_string_lossy(),
                    "attach",
                    "eth0",
                    "--config",
                    &self.config.to_string_lossy(),
                    "--pin-root",
                    &self.pins.path.to_string_lossy(),
                ],
            )?
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.try_clone()?)
            .spawn()
            .with_context(|| format!("starting aggbox attach on {}", self.name))?;
        let stdout = child.stdout.take().context("attach stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        // The rest of its stdout goes to the log, so the pipe never fills.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
            let _ = tx.send(first);
            let mut log = log;
            for l in lines.map_while(|l| l.ok()) {
                let _ = writeln!(log, "{l}");
            }
        });
        let pid = child.id();
        started(pid);
        self.child = Some(child);
        self.started = Instant::now();
        self.incarnation += 1;
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) if line.trim() == "aggbox: attached to eth0" => Ok(()),
            Ok(line) => {
                self.kill9();
                bail!("aggbox attach on {} (pid {pid}) said {line:?} instead of attaching (see {})", self.name, self.log.display())
            }
            Err(_) => {
                self.kill9();
                bail!("aggbox attach on {} (pid {pid}) did not attach within 60 s", self.name)
            }
        }
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait (10 s at most); its exit status, or why not.
    fn terminate(&mut self) -> Result<(), String> {
        let Some(mut c) = self.child.take() else { return Ok(()) };
        let pid = nix::unistd::Pid::from_raw(c.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(s)) = c.try_wait() {
                return if s.success() { Ok(()) } else { Err(format!("{} exited {s} after SIGTERM", self.name)) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        Err(format!("{} did not exit within 10 s of SIGTERM", self.name))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.terminate();
        }
    }
}

/// One resource sample of one node.
#[derive(Debug, Clone, Default, Serialize)]
struct Sample {
    t_s: f64,
    node: String,
    incarnation: u32,
    rss_mib: f64,
    fds: i64,
    pins: usize,
    udp_ports: String,
    slots_star: f64,
    slots_served: f64,
    slots_spare: f64,
    blocks: f64,
    dropped: u64,
    duplicated: u64,
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

/// The node h0's configuration with spare state `spare` (0: no spare job,
/// 1: the spare with 64 slots, 2: with 128).
fn node_config(tb: &Testbed, spare: u8) -> String {
    let workers: Vec<String> = WORKER_HOSTS.iter().map(|&h| format!("\"{}\"", tb.host(h).addr)).collect();
    let members = |port: u16| -> String {
        WORKER_HOSTS.iter().map(|&h| format!("\"{}:{port}\"", tb.host(h).addr)).collect::<Vec<_>>().join(", ")
    };
    let mut text = format!(
        "[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\n\n\
         [[job]]\nid = {STAR_JOB}\nport = 7100\nworkers = [{w}]\nresult_port = 7101\nresult_group = {STAR_JOB}\n\n\
         [[group]]\nid = {STAR_JOB}\nmembers = [{sm}]\n\n\
         [[job]]\nid = {SERVED_JOB}\nport = 7200\nworkers = [{w}]\nresult_port = 7201\nresult_group = {SERVED_JOB}\nconsumer = \"node\"\n\n\
         [[group]]\nid = {SERVED_JOB}\nmembers = [{vm}]\n",
        w = workers.join(", "),
        sm = members(STAR_DATA_PORT),
        vm = members(SERVED_DATA_PORT),
    );
    if spare > 0 {
        let slots = if spare == 1 { 64 } else { 128 };
        text += &format!(
            "\n[[job]]\nid = {SPARE_JOB}\nport = 7900\nworkers = [{w}]\nresult_port = {SPARE_RESULT_PORT}\nresult_group = {SPARE_JOB}\nconsumer = \"node\"\nslots = {slots}\n\n\
             [[group]]\nid = {SPARE_JOB}\nmembers = [{m}]\n",
            w = workers.join(", "),
            m = members(7950),
        );
    }
    text
}

fn ring_config(tb: &Testbed) -> String {
    let members: Vec<String> = RING_HOSTS.iter().map(|&h| format!("\"{}\"", tb.host(h).addr)).collect();
    format!(
        "[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nuserspace_path = \"optional\"\n\n\
         [[ring]]\nid = {RING_ID}\nport = 7400\nmembers = [{}]\nvector_len = {RING_LEN}\nfrag_elems = 362\n",
        members.join(", ")
    )
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

fn impair_all(s: &Shared, loss: f64, dup: f64) -> Result<()> {
    for h in 0..s.tb.len() {
        let port = s.tb.switch_port(h);
        let injector = &s.injector;
        testbed::in_netns(&s.tb.switch_netns(), move || injector.set(&port, loss, dup))??;
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

/// Node h0 is attached and has been for 5 s.
fn node_up_steadily(s: &Shared) -> bool {
    let n = s.nodes[0].lock().unwrap();
    n.child.is_some() && n.started.elapsed() > Duration::from_secs(5)
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

/// The schedule: loss bursts, reloads, worker kills, node kills.
fn chaos(s: &Arc<Shared>) -> Result<()> {
    let mut next_burst = BURST_EVERY;
    let mut next_reload = RELOAD_EVERY.min(Duration::from_secs(60));
    let mut next_kill_worker = Duration::from_secs(45);
    let mut next_kill_node = KILL_NODE_EVERY.min(Duration::from_secs(120));
    let mut victim = 0usize;
    while s.running() {
        let now = s.t0.elapsed();
        if now >= next_burst {
            next_burst += BURST_EVERY;
            impair_all(s, BURST_LOSS, BURST_DUP)?;
            s.event("burst", format!("loss {BURST_LOSS} dup {BURST_DUP} for {} s", BURST_LEN.as_secs()));
            std::thread::sleep(BURST_LEN);
            impair_all(s, LOSS, DUP)?;
        }
        if now >= next_reload {
            next_reload += RELOAD_EVERY;
            let spare = (*s.spare.lock().unwrap() + 1) % 3;
            if s.nodes[0].lock().unwrap().child.is_some() {
                if let Err(e) = reload(s, spare) {
                    s.violation(format!("reload: {e:#}"));
                }
            }
        }
        if now >= next_kill_worker {
            // The next kind with a live run that has made calls.
            let live = s.live.lock().unwrap().clone();
            let kind = JobKind::ALL[victim % 3];
            if let Some((k, run, pid, who)) = live.iter().filter(|l| l.0 == kind).nth((victim / 3) % 3).or_else(|| live.iter().find(|l| l.0 == kind)).cloned() {
                next_kill_worker += KILL_WORKER_EVERY;
                victim += 1;
                s.killed_runs.lock().unwrap().insert((k.name(), run));
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
                s.event("kill_worker", format!("{} run {run} rank {who} (pid {pid})", k.name()));
            } else if live.is_empty() {
                next_kill_worker += Duration::from_secs(1);
            } else {
                victim += 1;
            }
        }
        if now >= next_kill_node {
            next_kill_node += KILL_NODE_EVERY;
            kill_and_restart_node(s)?;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// kill -9 node h0's `aggbox attach`; restart it after [`RESTART_AFTER`],
/// again every second until it attaches (systemd's Restart=always).
fn kill_and_restart_node(s: &Arc<Shared>) -> Result<()> {
    let mut n = s.nodes[0].lock().unwrap();
    let pid = n.pid().unwrap_or(0);
    let down_at = unix_ms();
    n.kill9();
    s.event("kill_node", format!("h0 aggbox attach (pid {pid}) killed with -9"));
    for attempt in 1..=5 {
        std::thread::sleep(RESTART_AFTER);
        match n.start(&s.tb, &s.aggbox) {
            Ok(()) => {
                s.node_down.lock().unwrap().push((down_at, unix_ms()));
                let pid = n.pid().unwrap_or(0);
                drop(n);
                s.event("restart_node", format!("h0 attached again on stale state (pid {pid}, attempt {attempt})"));
                return Ok(());
            }
            Err(e) => s.violation(format!("restart of h0 after kill -9, attempt {attempt}: {e:#}")),
        }
    }
    bail!("node h0 did not attach again after kill -9")
}

/// Write node h0's config with spare state `spare` and `aggbox reload`.
fn reload(s: &Shared, spare: u8) -> Result<()> {
    let n = s.nodes[0].lock().unwrap();
    std::fs::write(&n.config, node_config(&s.tb, spare))?;
    let out = s
        .tb
        .run_in(NODE_HOST, &[&s.aggbox.to_string_lossy(), "reload", "eth0", "--pin-root", &n.pins.path.to_string_lossy()])?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)).replace('\n', " | ");
    *s.last_reload_ms.lock().unwrap() = unix_ms();
    if !out.status.success() {
        bail!("aggbox reload (spare state {spare}) exited {}: {text}", out.status);
    }
    *s.spare.lock().unwrap() = spare;
    drop(n);
    s.event("reload", format!("spare job {SPARE_JOB} {}: {text}", ["removed", "added (64 slots)", "changed to 128 slots"][spare as usize]));
    Ok(())
}

/// Every [`SAMPLE_EVERY`]: each node's resources, checked.
fn sampler(s: &Arc<Shared>) {
    while s.running() {
        for i in 0..s.nodes.len() {
            let smp = sample_node(s, i);
            check_sample(s, i, &smp, false);
            s.samples.lock().unwrap().push(smp);
        }
        s.sleep_while_running(SAMPLE_EVERY);
    }
}

fn proc_status_kib(pid: u32, key: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

/// UDP ports of the sockets process `pid` holds (its descriptors' inodes
/// looked up in its namespace's /proc/PID/net/udp).
fn udp_ports(pid: u32) -> BTreeSet<u16> {
    let mut inodes = HashSet::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in dir.flatten() {
            if let Ok(l) = std::fs::read_link(e.path()) {
                let l = l.to_string_lossy();
                if let Some(i) = l.strip_prefix("socket:[").and_then(|x| x.strip_suffix(']')) {
                    inodes.insert(i.to_string());
                }
            }
        }
    }
    let mut ports = BTreeSet::new();
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/udp")).unwrap_or_default();
    for l in text.lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() > 9 && inodes.contains(f[9]) {
            if let Some(p) = f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()) {
                ports.insert(p);
            }
        }
    }
    ports
}

/// Everything pinned under `root` (relative paths), without the files
/// every bpffs has at its root (the kernel's preloaded iterators).
fn list_pins(root: &Path) -> BTreeSet<String> {
    const BPFFS_OWN: [&str; 2] = ["maps.debug", "progs.debug"];
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(rd) = std::fs::read_dir(&d) {
            for e in rd.flatten() {
                let p = e.path();
                if d == root && BPFFS_OWN.iter().any(|n| e.file_name() == *n) {
                    continue;
                }
                out.insert(p.strip_prefix(root).unwrap_or(&p).to_string_lossy().into_owned());
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    stack.push(p);
                }
            }
        }
    }
    out
}

/// Node h0's /metrics (NaN-filled when it does not answer).
fn metrics(s: &Shared) -> Option<String> {
    testbed::in_netns(&s.tb.host(NODE_HOST).netns, || -> Option<String> {
        let mut stream = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], METRICS_PORT).into(), Duration::from_secs(2)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).ok()?;
        Some(text)
    })
    .ok()
    .flatten()
}

fn gauge(text: &str, name: &str, job: Option<u16>) -> f64 {
    let label = job.map(|j| format!("aggbox_job=\"{j}\""));
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter(|l| label.as_ref().map(|lb| l.contains(lb.as_str())).unwrap_or(true))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .fold(0.0, |a, b| a + b)
}

fn sample_node(s: &Shared, i: usize) -> Sample {
    let (pid, name, incarnation, pin_root) = {
        let n = s.nodes[i].lock().unwrap();
        (n.pid(), n.name.clone(), n.incarnation, n.pins.path.clone())
    };
    let counts = s.injector.counts();
    let mut smp = Sample {
        t_s: s.t(),
        node: name,
        incarnation,
        rss_mib: f64::NAN,
        fds: -1,
        pins: list_pins(&pin_root).len(),
        slots_star: f64::NAN,
        slots_served: f64::NAN,
        slots_spare: f64::NAN,
        blocks: f64::NAN,
        dropped: counts.dropped,
        duplicated: counts.duplicated,
        ..Default::default()
    };
    if let Some(pid) = pid {
        smp.rss_mib = proc_status_kib(pid, "VmRSS:").map(|k| k / 1024.0).unwrap_or(f64::NAN);
        smp.fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as i64).unwrap_or(-1);
        smp.udp_ports = udp_ports(pid).iter().map(u16::to_string).collect::<Vec<_>>().join(";");
    }
    if i == 0 {
        if let Some(text) = metrics(s) {
            smp.slots_star = gauge(&text, "aggbox_job_slots_active", Some(STAR_JOB));
            smp.slots_served = gauge(&text, "aggbox_job_slots_active", Some(SERVED_JOB));
            smp.slots_spare = gauge(&text, "aggbox_job_slots_active", Some(SPARE_JOB));
            smp.blocks = gauge(&text, "aggbox_blocks_in_use", None);
        }
    }
    smp
}

/// Check one sample against the bounds (`end`: the final sample, with no
/// run going and the spare job removed).
fn check_sample(s: &Shared, i: usize, smp: &Sample, end: bool) {
    let mut n = s.nodes[i].lock().unwrap();
    if n.child.is_none() || n.started.elapsed() < Duration::from_secs(5) {
        return;
    }
    let name = n.name.clone();
    // Pins: the set of the first check, always (reloads and restarts
    // change map contents, not pins).
    let pins = list_pins(&n.pins.path);
    match &n.pins_base {
        None => n.pins_base = Some(pins),
        Some(base) => {
            let extra: Vec<&String> = pins.difference(base).collect();
            let missing: Vec<&String> = base.difference(&pins).collect();
            if !extra.is_empty() {
                s.violation(format!("node {name}: pins beyond the expected set: {extra:?}"));
            }
            if !missing.is_empty() {
                s.violation(format!("node {name}: expected pins missing: {missing:?}"));
            }
        }
    }
    // UDP ports: node h0 holds its served jobs' result ports, a ring node
    // its ring's port, and each as many ephemeral ports (its unbound
    // sending socket) as at its first check; nothing else.
    let ports: BTreeSet<u16> = smp.udp_ports.split(';').filter_map(|p| p.parse().ok()).collect();
    let quiet = unix_ms().saturating_sub(*s.last_reload_ms.lock().unwrap()) > 3000;
    if quiet && smp.fds >= 0 {
        let mut named: BTreeSet<u16> = BTreeSet::new();
        if i == 0 {
            named.insert(7201);
            if *s.spare.lock().unwrap() != 0 {
                named.insert(SPARE_RESULT_PORT);
            }
        } else {
            named.insert(7400);
        }
        let ephemeral = ports.iter().filter(|p| **p >= EPHEMERAL_FIRST && !named.contains(p)).count();
        let base = *n.ephemeral_base.get_or_insert(ephemeral);
        let other: Vec<&u16> = ports.iter().filter(|p| **p < EPHEMERAL_FIRST && !named.contains(p)).collect();
        let missing: Vec<&u16> = named.difference(&ports).collect();
        if !other.is_empty() || !missing.is_empty() || ephemeral > base {
            s.violation(format!(
                "node {name}: UDP ports {ports:?} where {named:?} and {base} ephemeral port(s) are expected"
            ));
        }
    }
    // Descriptors and memory against the first sample after warm-up.
    let warm = s.t0.elapsed() >= WARMUP && n.started.elapsed() >= Duration::from_secs(20);
    if warm && smp.fds >= 0 && smp.rss_mib.is_finite() {
        let rss_kib = smp.rss_mib * 1024.0;
        let base_rss = *n.rss_base_kib.get_or_insert(rss_kib);
        let base_fds = *n.fd_base.get_or_insert(smp.fds);
        if rss_kib > base_rss + RSS_BOUND_MIB * 1024.0 {
            s.violation(format!(
                "node {name}: resident memory {:.1} MiB grew past its first warmed sample {:.1} MiB + {RSS_BOUND_MIB} MiB",
                smp.rss_mib,
                base_rss / 1024.0
            ));
        }
        let slack = if end { 2 } else { FD_SLACK };
        if smp.fds > base_fds + slack {
            s.violation(format!("node {name}: {} open descriptors, more than the first warmed sample's {base_fds} + {slack}", smp.fds));
        }
    }
}

/// Write calls.csv, runs.csv, events.csv, resources.csv, summary.json and
/// REPORT.md; plot. The number of violations.
fn report(s: &Shared, args: &SoakArgs, facts: &crate::MachineFacts) -> Result<usize> {
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

fn plot(dir: &Path) {
    let script = crate::testbed::script_path().with_file_name("plot.py");
    let python = if Path::new("/usr/bin/python3").exists() { "/usr/bin/python3" } else { "python3" };
    match std::process::Command::new(python).arg(&script).arg(dir).status() {
        Ok(st) if st.success() => {}
        Ok(st) => progress(format!("plots: scripts/plot.py exited {st} (is python3-matplotlib installed?)")),
        Err(e) => progress(format!("plots skipped: python3: {e}")),
    }
}

#[cfg(test)]
mod tests {
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
