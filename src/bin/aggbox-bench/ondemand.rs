//! Experiment 11: jobs on demand (issue #45, "Benchmark";
//! docs/INTERFACE.md, "Jobs on demand") against the static job of the same
//! description, on one real `aggbox attach eth0` process.
//!
//! The node (testbed host 0) is attached with `--bpf-stats`, a `[node]
//! keys` key file of one tenant, metrics on in its namespace, and one
//! static node-served `[[job]]` (`consumer = "node"`, a `result_group` of
//! the workers' data sockets) of the workers of hosts 1..=4. Three parts:
//!
//! 1. **Create → first allreduce.** W ranks (W = 4 and 16; quick 4) in
//!    hosts 1..=W start together (a barrier); each joins a fresh run key
//!    ([`RunJob::join`]), builds its communicator (`run.communicator`) and
//!    runs a one-element int32 SUM, checked. Time: earliest rank's join
//!    start → latest rank's allreduce return. One untimed warm-up run per W.
//! 2. **Node-side create + destroy.** 2-rank runs joined and ended with
//!    bare AGC1 requests (a client as docs/PROTOCOL.md describes it, one
//!    TCP connection a request, as `RunJob` makes them): the node's own
//!    time per change from its `aggbox_control_apply_seconds` histogram
//!    (scraped before and after), the clients' round trips timed exactly,
//!    and the node's live jobs, groups, published records, descriptors and
//!    VmRSS before and after: a leak fails the experiment.
//! 3. **Dynamic vs static.** 4 ranks hold a communicator of the static job
//!    and one of a job on demand at once and run one-element and
//!    65,536-element int32 SUMs on each, interleaved in blocks (the order
//!    of the two jobs alternating per block), every result checked; per
//!    call latency, and the XDP run time per contribution of each phase
//!    from the node's `aggbox_program_run*_total` counters (bpf_stats).
//!
//! A run's correctness (every result exact, every run created and ended,
//! no leak) is asserted, full or `--quick`; its speed never (the goals are
//! reported met or missed).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write as _};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;

use aggbox::config::Config;
use aggbox::runtime::control::{Credential, JobShape, RunCommunicator, RunJob};
use aggbox::runtime::{BackendKind, Collective, CommunicatorBuilder, Participant};
use aggbox::wire::abi::Op;
use aggbox::wire::control::{read_frame, write_frame, Envelope, Reply, Request, NONCE_BYTES};

use super::large::Failed;
use super::testbed::{Testbed, TestbedConfig};
use super::{progress, summarize, BenchOptions, Context_, Csv, PrivateBpffs, Section, Summary};

/// The node's control endpoint (the documented default port).
const CONTROL_PORT: u16 = 7471;
/// The node's /metrics, on its namespace's loopback.
const METRICS_PORT: u16 = 9481;
/// The workers' data sockets of the runs on demand.
const RUN_DATA_PORT: u16 = 7700;
/// The workers' data sockets of the static job (its result group).
const STATIC_DATA_PORT: u16 = 7800;
/// The static job, its contribution port (RESULT port + 1) and group.
const STATIC_JOB: u16 = 100;
const STATIC_PORT: u16 = 7300;
/// The tenant of the key file.
const TENANT: &str = "bench";
/// Ranks of part 3, and the static job's workers.
const WORKERS: usize = 4;
/// Elements of part 3's large call.
const BIG: usize = 65_536;
/// Part 3's inputs: this many different vectors per rank and size, used in
/// turn, so that consecutive calls never have the same result.
const VARIANTS: usize = 8;
/// Goals (issue #45).
const GOAL_CREATE_MS: f64 = 50.0;
const GOAL_APPLY_P99_MS: f64 = 5.0;
/// The node's resident memory may grow by this much over part 2 (the
/// bound of tests/node_on_demand.rs's 500 runs; the registry keeps one
/// incarnation counter per run key, a few dozen bytes each).
const RSS_BOUND_KIB: i64 = 16 * 1024;
/// A call's deadline.
const DEADLINE: Duration = Duration::from_secs(10);

/// The sizes of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Ranks of part 1's runs.
    pub worlds: Vec<usize>,
    /// Timed runs per world size (part 1).
    pub trials: usize,
    /// Create/destroy cycles (part 2).
    pub cycles: usize,
    /// Calls per size and job (part 3).
    pub calls: usize,
    /// Calls per block (part 3).
    pub block: usize,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        if quick {
            Plan { worlds: vec![4], trials: 3, cycles: 50, calls: 20, block: 10 }
        } else {
            Plan { worlds: vec![4, 16], trials: 50, cycles: 1000, calls: 200, block: 20 }
        }
    }
}

// ---------------------------------------------------------------- the node

/// Pids of the attach processes this run started, for the Ctrl-C handler.
static STARTED: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Kills (SIGKILL, by pid) the `aggbox attach` this experiment started and
/// has not stopped yet: for the Ctrl-C handler, where destructors do not run.
pub fn kill_started() {
    for pid in STARTED.lock().map(|v| v.clone()).unwrap_or_default() {
        if Path::new(&format!("/proc/{pid}")).exists() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// `aggbox attach eth0 --bpf-stats` in host 0, stopped (SIGTERM by its pid,
/// then SIGKILL) and its pins unmounted when dropped.
struct NodeProcess {
    child: Option<Child>,
    pid: u32,
    /// Dropped after the process is gone (field order).
    pins: PrivateBpffs,
}

impl NodeProcess {
    fn start(tb: &Testbed, aggbox: &Path, config: &Path, log: &Path) -> Result<NodeProcess> {
        NodeProcess::start_in(tb, 0, aggbox, config, log)
    }

    /// `aggbox attach eth0` in host `host`.
    fn start_in(tb: &Testbed, host: usize, aggbox: &Path, config: &Path, log: &Path) -> Result<NodeProcess> {
        let pins = PrivateBpffs::mount("ondemand")?;
        let log_file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut child = tb
            .command_in(
                host,
                &[
                    &aggbox.to_string_lossy(),
                    "attach",
                    "eth0",
                    "--config",
                    &config.to_string_lossy(),
                    "--pin-root",
                    &pins.path.to_string_lossy(),
                    "--bpf-stats",
                ],
            )?
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file.try_clone()?)
            .spawn()
            .context("starting aggbox attach")?;
        // `ip netns exec` execs the binary: this is the node's pid.
        let pid = child.id();
        if let Ok(mut v) = STARTED.lock() {
            v.push(pid);
        }
        let stdout = child.stdout.take().context("attach stdout")?;
        let node = NodeProcess { child: Some(child), pid, pins };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next().and_then(|l| l.ok()).unwrap_or_default());
            let mut log = log_file;
            for l in lines.map_while(|l| l.ok()) {
                let _ = writeln!(log, "{l}");
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) if line.trim() == "aggbox: attached to eth0" => Ok(node),
            Ok(line) => bail!("aggbox attach (pid {pid}) said {line:?} instead of attaching (see {})", log.display()),
            Err(_) => bail!("aggbox attach (pid {pid}) did not attach within 60 s (see {})", log.display()),
        }
    }

    fn status(&self) -> Result<aggbox::node::NodeStatus> {
        aggbox::node::status(Some("eth0"), &self.pins.path)
            .map_err(|e| anyhow!("aggbox status: {e}"))?
            .into_iter()
            .next()
            .context("aggbox status: no node on eth0")
    }

    /// What part 2 holds against leaks: the process's descriptors and
    /// memory first, then its /metrics (whose connection would count).
    fn footprint(&self, tb: &Testbed) -> Result<Footprint> {
        let proc_status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))
            .with_context(|| format!("the node (pid {}) is gone", self.pid))?;
        let rss_kib = proc_status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("VmRSS")?;
        let fds = std::fs::read_dir(format!("/proc/{}/fd", self.pid))?.count() as i64;
        let metrics = scrape(tb)?;
        let st = self.status()?;
        let published = aggbox::node::control::published::read(&aggbox::node::pin_dir(&self.pins.path, "eth0")).len();
        Ok(Footprint {
            jobs: st.jobs.len(),
            dynamic_jobs: st.jobs.iter().filter(|j| j.id != STATIC_JOB).count(),
            groups: st.groups.len(),
            published,
            live_gauge: metric(&metrics, "aggbox_control_live_jobs").unwrap_or(f64::NAN),
            fds,
            rss_kib,
        })
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let Some(mut c) = self.child.take() else { return };
        let pid = nix::unistd::Pid::from_raw(self.pid as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        if let Ok(mut v) = STARTED.lock() {
            v.retain(|p| *p != self.pid);
        }
    }
}

/// The node's state that must come back to where it was.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Footprint {
    /// Jobs in the node's maps (`aggbox status`), the static one included.
    pub jobs: usize,
    /// Of them, jobs on demand.
    pub dynamic_jobs: usize,
    /// Broadcast groups.
    pub groups: usize,
    /// Records of jobs on demand in the pinned `control_jobs` map.
    pub published: usize,
    /// `aggbox_control_live_jobs`.
    pub live_gauge: f64,
    /// Open descriptors of the attach process.
    pub fds: i64,
    /// Its VmRSS, KiB.
    pub rss_kib: i64,
}

// ------------------------------------------------------------- /metrics

/// GET /metrics of the node, from its namespace.
fn scrape(tb: &Testbed) -> Result<String> {
    tb.in_host(0, || -> Result<String> {
        let mut s = TcpStream::connect(("127.0.0.1", METRICS_PORT)).context("connect to the node's /metrics")?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })?
}

/// Samples `(labels, value)` of the family member `name` in a scrape.
fn samples<'a>(text: &'a str, name: &str) -> Vec<(&'a str, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            let (n, labels) = match key.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (key, ""),
            };
            (n == name).then(|| value.parse().ok().map(|v| (labels, v)))?
        })
        .collect()
}

/// The sum of `name`'s samples, `None` when it has none.
fn metric(text: &str, name: &str) -> Option<f64> {
    let s = samples(text, name);
    (!s.is_empty()).then(|| s.iter().map(|(_, v)| v).sum())
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| kv.strip_prefix(key)?.strip_prefix("=\"")?.strip_suffix('"'))
}

/// `aggbox_control_apply_seconds`: cumulative buckets `(le, count)`, the
/// sum and the count.
#[derive(Debug, Clone, Default)]
struct Histogram {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

fn apply_histogram(text: &str) -> Histogram {
    let mut buckets: Vec<(f64, f64)> = samples(text, "aggbox_control_apply_seconds_bucket")
        .into_iter()
        .filter_map(|(l, v)| {
            let le = label(l, "le")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, v))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    Histogram {
        buckets,
        sum: metric(text, "aggbox_control_apply_seconds_sum").unwrap_or(0.0),
        count: metric(text, "aggbox_control_apply_seconds_count").unwrap_or(0.0),
    }
}

/// The bucket `(lower, upper]` (seconds) holding quantile `q` of the
/// observations between two scrapes.
fn bucket_of(before: &Histogram, after: &Histogram, q: f64) -> (f64, f64) {
    let total = after.count - before.count;
    let mut lower = 0.0;
    for (le, n) in &after.buckets {
        let was = before.buckets.iter().find(|(b, _)| b == le).map_or(0.0, |(_, c)| *c);
        if n - was >= (q * total).ceil().max(1.0) {
            return (lower, *le);
        }
        lower = *le;
    }
    (lower, f64::INFINITY)
}

/// Per XDP program: runs and run time (ns), from a scrape.
fn program_stats(text: &str) -> BTreeMap<String, (f64, f64)> {
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (l, v) in samples(text, "aggbox_program_runs_total") {
        if let Some(p) = label(l, "program") {
            out.entry(p.to_string()).or_default().0 = v;
        }
    }
    for (l, v) in samples(text, "aggbox_program_run_seconds_total") {
        if let Some(p) = label(l, "program") {
            out.entry(p.to_string()).or_default().1 = v * 1e9;
        }
    }
    out
}

/// Runs of the entry program (the tail-called ones count none of their
/// own) and run time over every program between two scrapes.
fn xdp_delta(before: &BTreeMap<String, (f64, f64)>, after: &BTreeMap<String, (f64, f64)>) -> (f64, f64) {
    let mut runs: f64 = 0.0;
    let mut ns = 0.0;
    for (p, (r, t)) in after {
        let (r0, t0) = before.get(p).copied().unwrap_or_default();
        runs = runs.max(r - r0);
        ns += t - t0;
    }
    (runs, ns)
}

// ------------------------------------------------------- control requests

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A nonce used once: the clock (ns), this process, a counter.
fn nonce() -> [u8; NONCE_BYTES] {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let mut n = [0u8; NONCE_BYTES];
    let ns = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    n[..8].copy_from_slice(&ns.to_be_bytes());
    n[8..12].copy_from_slice(&std::process::id().to_be_bytes());
    n[12..].copy_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    n
}

/// One AGC1 request on a connection of its own (as `RunJob` makes them),
/// from the calling thread's namespace: the reply and its round trip (ms,
/// connect to reply; the request is signed before).
fn request(node: SocketAddr, credential: &Credential, req: &Request) -> Result<(Reply, f64)> {
    let envelope = Envelope::sign(&credential.tenant, &credential.key, nonce(), now_ms(), req);
    let t = Instant::now();
    let mut s = TcpStream::connect_timeout(&node, Duration::from_secs(20)).with_context(|| format!("connect to {node}"))?;
    let _ = s.set_nodelay(true);
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    write_frame(&mut s, &envelope).map_err(|e| anyhow!("sending to {node}: {e}"))?;
    let body = read_frame(&mut s).map_err(|e| anyhow!("no reply from {node}: {e}"))?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let reply = serde_json::from_slice(&body).map_err(|e| anyhow!("reply from {node}: {e}"))?;
    Ok((reply, ms))
}

// ------------------------------------------------- part 1: create → first

/// One run of part 1 (ms from the earliest rank's join start).
#[derive(Debug, Clone, Serialize)]
pub struct CreateTrial {
    pub workers: usize,
    pub trial: usize,
    /// The job granted.
    pub job: u16,
    /// → the latest rank's join returned (the job served).
    pub joined_ms: f64,
    /// → the latest rank's communicator built.
    pub built_ms: f64,
    /// → the latest rank's first allreduce returned.
    pub total_ms: f64,
}

/// Part 1's summary of one world size.
#[derive(Debug, Clone, Serialize)]
pub struct CreateSummary {
    pub workers: usize,
    pub total_ms: Summary,
    pub joined_ms: Summary,
    pub built_ms: Summary,
    /// p99 ≤ the goal.
    pub met: bool,
}

/// A rank of part 1: its join start, join return, communicator built,
/// allreduce return, and the job granted.
type RankTimes = (Instant, Instant, Instant, Instant, u16);

/// W ranks join run `run` together, build, allreduce one element, check it,
/// and end once all are done.
fn create_trial(tb: &Testbed, control: SocketAddr, credential: &Credential, w: usize, run: &str) -> Result<(u16, f64, f64, f64)> {
    let start = Barrier::new(w);
    let done = Barrier::new(w);
    let ranks: Vec<Result<RankTimes>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..w)
            .map(|r| {
                let (start, done) = (&start, &done);
                s.spawn(move || -> Result<RankTimes> {
                    let data = SocketAddrV4::new(tb.host(r + 1).addr, RUN_DATA_PORT);
                    tb.in_host(r + 1, || {
                        start.wait();
                        let t0 = Instant::now();
                        let out = (|| -> Result<_> {
                            let joined = RunJob::join(control, credential.clone(), run, w as u16, r as u16, data, None, Duration::from_secs(20))
                                .map_err(|e| anyhow!("rank {r}: join: {e}"))?;
                            let t_joined = Instant::now();
                            let job = joined.grant().job;
                            let comm = joined.communicator(|b| b.deadline(DEADLINE)).map_err(|e| anyhow!("rank {r}: build: {e}"))?;
                            let t_built = Instant::now();
                            let mut v = [r as i32 + 1];
                            comm.allreduce(&mut v, Op::Sum).map_err(|e| anyhow!("rank {r}: allreduce: {e}"))?;
                            let t_done = Instant::now();
                            let want = (w * (w + 1) / 2) as i32;
                            if v[0] != want {
                                bail!("rank {r}: the first allreduce gave {} instead of {want}", v[0]);
                            }
                            Ok((comm, t_joined, t_built, t_done, job))
                        })();
                        // Every rank is done before any ends.
                        done.wait();
                        let (comm, t_joined, t_built, t_done, job) = out?;
                        comm.end().map_err(|e| anyhow!("rank {r}: end: {e}"))?;
                        Ok((t0, t_joined, t_built, t_done, job))
                    })?
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a rank panicked")))).collect()
    });
    let ranks: Vec<_> = ranks.into_iter().collect::<Result<_>>().with_context(|| format!("run {run} of {w} ranks"))?;
    let first = ranks.iter().map(|r| r.0).min().context("no rank")?;
    let ms = |f: fn(&RankTimes) -> Instant| {
        ranks.iter().map(|r| f(r).duration_since(first).as_secs_f64() * 1e3).fold(0.0, f64::max)
    };
    let job = ranks[0].4;
    if ranks.iter().any(|r| r.4 != job) {
        bail!("run {run}: the ranks got different jobs");
    }
    Ok((job, ms(|r| r.1), ms(|r| r.2), ms(|r| r.3)))
}

// ------------------------------------------------ part 2: create + destroy

/// One cycle of part 2: the clients' round trips (ms).
#[derive(Debug, Clone, Serialize)]
pub struct Cycle {
    pub cycle: usize,
    pub job: u16,
    /// The join of the rank that completed the run (sent last): the node's
    /// create and its reply.
    pub join_last_ms: f64,
    /// The other rank's join (it waited for the first).
    pub join_first_ms: f64,
    /// The end that removed the job (the node answered `remaining: 0`).
    pub end_last_ms: f64,
    /// The other rank's end.
    pub end_first_ms: f64,
}

/// Part 2's results.
#[derive(Debug, Clone, Serialize)]
pub struct CreateDestroy {
    pub cycles: usize,
    /// Changes the node applied over the cycles (histogram count).
    pub changes: f64,
    /// Node-side time per change: the histogram bucket `(lower, upper]`
    /// (ms) holding p50 and p99, and the exact mean (sum / count).
    pub apply_p50_ms: (f64, f64),
    pub apply_p99_ms: (f64, f64),
    pub apply_mean_ms: f64,
    /// Observations per bucket over the cycles: `(upper bound ms, count)`.
    pub apply_buckets: Vec<(f64, f64)>,
    pub join_last_ms: Summary,
    pub join_first_ms: Summary,
    pub end_last_ms: Summary,
    pub end_first_ms: Summary,
    pub before: Footprint,
    pub after: Footprint,
    /// Why the node did not come back to where it was (empty: no leak).
    pub leaks: Vec<String>,
    pub met: bool,
    pub raw: Vec<Cycle>,
}

/// `cycles` 2-rank runs (keys `{tag}-{k}`) joined and ended by bare
/// requests from hosts 1 and 2.
fn cycles(tb: &Testbed, control: SocketAddr, credential: &Credential, tag: &str, first: usize, n: usize) -> Result<Vec<Cycle>> {
    let step = Barrier::new(2);
    let failed = AtomicBool::new(false);
    // Per cycle: (job, sent, round trip ms, the end that removed the job).
    type Times = Vec<Option<(u16, Instant, f64, bool)>>;
    let per_rank: Vec<Result<(Times, Times)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2usize)
            .map(|r| {
                let (step, failed) = (&step, &failed);
                s.spawn(move || -> Result<(Times, Times)> {
                    let data = SocketAddrV4::new(tb.host(r + 1).addr, RUN_DATA_PORT);
                    tb.in_host(r + 1, || {
                        let (mut joins, mut ends): (Times, Times) = (Vec::new(), Vec::new());
                        let mut error = None;
                        for k in first..first + n {
                            // Both ranks pass both barriers of every cycle,
                            // a failed one too, so neither waits forever.
                            step.wait();
                            let mut grant = None;
                            if !failed.load(Ordering::Relaxed) {
                                let join = Request::Join { run: format!("{tag}-{k}"), world: 2, rank: r as u16, data: data.into(), vector_len: None, window: None, frag_elems: None, parent: None, ring: None };
                                let sent = Instant::now();
                                match request(control, credential, &join) {
                                    Ok((Reply::Joined(g), ms)) => {
                                        joins.push(Some((g.job, sent, ms, false)));
                                        grant = Some(g);
                                    }
                                    Ok((other, _)) => error = Some(anyhow!("cycle {k} rank {r}: join: {other:?}")),
                                    Err(e) => error = Some(e.context(format!("cycle {k} rank {r}: join"))),
                                }
                            }
                            if error.is_some() {
                                failed.store(true, Ordering::Relaxed);
                            }
                            step.wait();
                            if let (Some(g), false) = (grant, failed.load(Ordering::Relaxed)) {
                                let end = Request::End { job: g.job, incarnation: g.incarnation, rank: r as u16 };
                                let sent = Instant::now();
                                match request(control, credential, &end) {
                                    Ok((Reply::Ended { remaining }, ms)) => ends.push(Some((g.job, sent, ms, remaining == 0))),
                                    Ok((other, _)) => error = Some(anyhow!("cycle {k} rank {r}: end: {other:?}")),
                                    Err(e) => error = Some(e.context(format!("cycle {k} rank {r}: end"))),
                                }
                                if error.is_some() {
                                    failed.store(true, Ordering::Relaxed);
                                }
                            }
                        }
                        match error {
                            Some(e) => Err(e),
                            None => Ok((joins, ends)),
                        }
                    })?
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a rank panicked")))).collect()
    });
    let mut per_rank = per_rank.into_iter();
    let (j0, e0) = per_rank.next().context("rank 0")??;
    let (j1, e1) = per_rank.next().context("rank 1")??;
    if [j0.len(), j1.len(), e0.len(), e1.len()].iter().any(|&l| l != n) {
        bail!("{n} cycles: some ranks did not join or end every run");
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (Some(a), Some(b), Some(ea), Some(eb)) = (&j0[i], &j1[i], &e0[i], &e1[i]) else { bail!("cycle {}: missing", first + i) };
        if a.0 != b.0 {
            bail!("cycle {}: the two ranks got jobs {} and {}", first + i, a.0, b.0);
        }
        if ea.3 == eb.3 {
            bail!("cycle {}: not exactly one end removed the job", first + i);
        }
        let (join_last, join_first) = if a.1 >= b.1 { (a.2, b.2) } else { (b.2, a.2) };
        let (end_last, end_first) = if ea.3 { (ea.2, eb.2) } else { (eb.2, ea.2) };
        out.push(Cycle { cycle: first + i, job: a.0, join_last_ms: join_last, join_first_ms: join_first, end_last_ms: end_last, end_first_ms: end_first });
    }
    Ok(out)
}

/// The node's footprint once the ended jobs' published records are gone
/// (the next lease tick) and the descriptors of the closed connections
/// with them: polled every 200 ms until two readings in a row agree and
/// no job on demand is left, 5 s at most.
fn settled(node: &NodeProcess, tb: &Testbed) -> Result<Footprint> {
    std::thread::sleep(Duration::from_millis(600));
    let since = Instant::now();
    let mut last = node.footprint(tb)?;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let f = node.footprint(tb)?;
        let done = f.fds == last.fds && f.published == 0 && f.dynamic_jobs == 0;
        if done || since.elapsed() > Duration::from_secs(5) {
            return Ok(f);
        }
        last = f;
    }
}

fn create_destroy(tb: &Testbed, node: &NodeProcess, control: SocketAddr, credential: &Credential, n: usize) -> Result<CreateDestroy> {
    // A few cycles first warm the node's allocator and threads.
    cycles(tb, control, credential, "warm", 0, 5)?;
    let before = settled(node, tb)?;
    let h0 = apply_histogram(&scrape(tb)?);
    let t = Instant::now();
    let raw = cycles(tb, control, credential, "cycle", 0, n)?;
    let elapsed = t.elapsed().as_secs_f64();
    let after = settled(node, tb)?;
    let h1 = apply_histogram(&scrape(tb)?);
    progress(format!("ondemand: {n} create/destroy cycles in {elapsed:.1} s"));
    let changes = h1.count - h0.count;
    if h1.buckets.is_empty() {
        bail!("the node's /metrics has no aggbox_control_apply_seconds histogram");
    }
    let ms = |(a, b): (f64, f64)| (a * 1e3, b * 1e3);
    let mut apply_buckets = Vec::new();
    let mut below = 0.0;
    for (le, c) in &h1.buckets {
        let was = h0.buckets.iter().find(|(b, _)| b == le).map_or(0.0, |(_, c)| *c);
        apply_buckets.push((le * 1e3, (c - was) - below));
        below = c - was;
    }
    let mut leaks = Vec::new();
    if changes != 2.0 * n as f64 {
        leaks.push(format!("the node applied {changes} changes for {n} runs created and ended, not {}", 2 * n));
    }
    if after.dynamic_jobs != 0 || after.live_gauge != 0.0 {
        leaks.push(format!("{} jobs on demand in the maps, aggbox_control_live_jobs {}", after.dynamic_jobs, after.live_gauge));
    }
    if (after.jobs, after.groups, after.published) != (before.jobs, before.groups, before.published) {
        leaks.push(format!(
            "jobs/groups/published records {}/{}/{} before, {}/{}/{} after",
            before.jobs, before.groups, before.published, after.jobs, after.groups, after.published
        ));
    }
    if after.fds > before.fds {
        leaks.push(format!("descriptors {} before, {} after", before.fds, after.fds));
    }
    if after.rss_kib > before.rss_kib + RSS_BOUND_KIB {
        leaks.push(format!("VmRSS {} KiB before, {} KiB after (bound +{} KiB)", before.rss_kib, after.rss_kib, RSS_BOUND_KIB));
    }
    let p99 = ms(bucket_of(&h0, &h1, 0.99));
    let col = |f: fn(&Cycle) -> f64| summarize(&raw.iter().map(f).collect::<Vec<_>>());
    Ok(CreateDestroy {
        cycles: n,
        changes,
        apply_p50_ms: ms(bucket_of(&h0, &h1, 0.50)),
        apply_p99_ms: p99,
        apply_mean_ms: if changes > 0.0 { (h1.sum - h0.sum) / changes * 1e3 } else { f64::NAN },
        apply_buckets,
        join_last_ms: col(|c| c.join_last_ms),
        join_first_ms: col(|c| c.join_first_ms),
        end_last_ms: col(|c| c.end_last_ms),
        end_first_ms: col(|c| c.end_first_ms),
        before,
        after,
        met: p99.1 <= GOAL_APPLY_P99_MS,
        leaks,
        raw,
    })
}

// ------------------------------------------------ part 3: dynamic vs static

/// Which job a phase of part 3 runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Static,
    Dynamic,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Static => "static",
            Kind::Dynamic => "dynamic",
        }
    }
}

/// One phase of part 3: `block` calls of one size on one job.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub block: usize,
    pub elements: usize,
    pub job: Kind,
    /// Median per-call latency over the ranks' calls (µs).
    pub median_us: f64,
    /// Contributions the ranks sent (datagrams of AGG1).
    pub contributions: f64,
    /// Δ runs of the XDP entry program (every datagram reaching the
    /// node's eth0) and Δ XDP run time (ns).
    pub xdp_runs: f64,
    pub xdp_ns: f64,
}

/// Part 3's summary of one size and job.
#[derive(Debug, Clone, Serialize)]
pub struct Compared {
    pub elements: usize,
    pub job: Kind,
    /// Per-call latency over every rank's calls (µs).
    pub latency_us: Summary,
    /// XDP run time per contribution (ns) and XDP runs per contribution,
    /// over the job's phases.
    pub xdp_ns_per_contribution: f64,
    pub xdp_runs_per_contribution: f64,
}

/// Dynamic over static of one size: of the medians, and per block (the two
/// jobs' phases of one block ran back to back), median with p10–p90.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub elements: usize,
    pub latency: f64,
    pub latency_per_block: Summary,
    pub xdp_ns: f64,
    pub xdp_ns_per_block: Summary,
    /// 1.0 within the per-block ratios' p10–p90, for latency and XDP time.
    pub within_noise: bool,
}

/// Part 3's results.
#[derive(Debug, Clone, Serialize)]
pub struct StaticVsDynamic {
    pub workers: usize,
    pub calls: usize,
    pub block: usize,
    pub static_job: u16,
    pub dynamic_job: u16,
    pub compared: Vec<Compared>,
    pub ratios: Vec<Ratio>,
    pub phases: Vec<Phase>,
    /// (rank, elements, job, call, µs) of every call.
    #[serde(skip)]
    pub calls_us: Vec<(usize, usize, Kind, usize, f64)>,
}

/// Rank `r`'s input `variant` of `n` elements.
fn input(r: usize, variant: usize, n: usize) -> Vec<i32> {
    (0..n).map(|i| ((i * 7 + variant * 131 + r * 1_000_003) % 20_001) as i32 - 10_000).collect()
}

/// One call of part 3 on `comm`: its latency (µs), the result checked.
fn timed_call<C: Collective>(comm: &C, buf: &mut [i32], input: &[i32], want: &[i32]) -> Result<f64> {
    buf.copy_from_slice(input);
    let t = Instant::now();
    comm.allreduce(buf, Op::Sum).map_err(|e| anyhow!("{e}"))?;
    let us = t.elapsed().as_secs_f64() * 1e6;
    if buf != want {
        let at = buf.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
        bail!("element {at} of {} is {} instead of {}", buf.len(), buf[at], want[at]);
    }
    Ok(us)
}

#[allow(clippy::too_many_arguments)]
fn static_vs_dynamic(
    tb: &Testbed,
    control: SocketAddr,
    credential: &Credential,
    config: &Config,
    calls: usize,
    block: usize,
) -> Result<StaticVsDynamic> {
    let sizes = [1usize, BIG];
    let blocks = calls.div_ceil(block);
    // The schedule every rank and the coordinator walk: per block, per
    // size, the two jobs back to back, the first of them alternating.
    let mut schedule: Vec<(usize, usize, Kind)> = Vec::new();
    for b in 0..blocks {
        let order = if b % 2 == 0 { [Kind::Static, Kind::Dynamic] } else { [Kind::Dynamic, Kind::Static] };
        for n in sizes {
            schedule.extend(order.map(|k| (b, n, k)));
        }
    }
    let inputs: Vec<Vec<Vec<Vec<i32>>>> = sizes
        .iter()
        .map(|&n| (0..VARIANTS).map(|v| (0..WORKERS).map(|r| input(r, v, n)).collect()).collect())
        .collect();
    let wants: Vec<Vec<Vec<i32>>> = inputs
        .iter()
        .map(|per_variant| {
            per_variant
                .iter()
                .map(|ranks| (0..ranks[0].len()).map(|i| ranks.iter().map(|x| x[i]).sum()).collect())
                .collect()
        })
        .collect();
    let node_addr = tb.host(0).addr;
    let sync = Barrier::new(WORKERS + 1);
    let failed = AtomicBool::new(false);
    let frags = |n: usize| n.div_ceil(aggbox::runtime::fragment::elements_per_fragment(tb.config().mtu as usize)) as f64;

    type RankOut = (Vec<(usize, usize, Kind, usize, f64)>, u16);
    let (ranks, phases): (Vec<Result<RankOut>>, Result<Vec<Phase>>) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|r| {
                let (sync, failed, schedule, inputs, wants) = (&sync, &failed, &schedule, &inputs, &wants);
                s.spawn(move || -> Result<RankOut> {
                    let data = SocketAddrV4::new(tb.host(r + 1).addr, RUN_DATA_PORT);
                    tb.in_host(r + 1, || {
                        let comms = (|| -> Result<_> {
                            let stat = CommunicatorBuilder::from_config(config, STATIC_JOB, node_addr, STATIC_DATA_PORT, Participant::Worker(r as u16))
                                .map_err(|e| anyhow!("rank {r}: the static job: {e}"))?
                                .backend(BackendKind::Kernel)
                                .deadline(DEADLINE)
                                .build()
                                .map_err(|e| anyhow!("rank {r}: the static job's communicator: {e}"))?;
                            let dynm = RunJob::join(control, credential.clone(), "static-vs-dynamic", WORKERS as u16, r as u16, data, None, Duration::from_secs(20))
                                .map_err(|e| anyhow!("rank {r}: join: {e}"))?
                                .communicator(|b| b.deadline(DEADLINE))
                                .map_err(|e| anyhow!("rank {r}: the job on demand's communicator: {e}"))?;
                            Ok((stat, dynm))
                        })();
                        if comms.is_err() {
                            failed.store(true, Ordering::Relaxed);
                        }
                        sync.wait();
                        let mut out = Vec::new();
                        let mut error = None;
                        let mut buf = vec![0i32; BIG];
                        let mut k = 0usize;
                        for &(b, n, kind) in schedule {
                            sync.wait();
                            for c in (b * block)..((b + 1) * block).min(calls) {
                                let Ok((stat, dynm)) = &comms else { break };
                                if failed.load(Ordering::Relaxed) {
                                    break;
                                }
                                let si = if n == 1 { 0 } else { 1 };
                                let v = k % VARIANTS;
                                k += 1;
                                let (inp, want) = (&inputs[si][v][r], &wants[si][v]);
                                let call = match kind {
                                    Kind::Static => timed_call(stat, &mut buf[..n], inp, want),
                                    Kind::Dynamic => timed_call(dynm, &mut buf[..n], inp, want),
                                };
                                match call {
                                    Ok(us) => out.push((r, n, kind, c, us)),
                                    Err(e) => {
                                        error = Some(e.context(format!("rank {r}: {} job, call {c} of {n} elements", kind.name())));
                                        failed.store(true, Ordering::Relaxed);
                                    }
                                }
                            }
                            sync.wait();
                        }
                        let (stat, dynm) = comms?;
                        let job = dynm.run().grant().job;
                        drop(stat);
                        dynm.end().map_err(|e| anyhow!("rank {r}: end: {e}"))?;
                        match error {
                            Some(e) => Err(e),
                            None => Ok((out, job)),
                        }
                    })?
                })
            })
            .collect();
        // The coordinator: /metrics around every phase.
        let coordinate = || -> Result<Vec<Phase>> {
            sync.wait();
            let mut phases = Vec::new();
            let mut error = None;
            for &(b, n, kind) in &schedule {
                let before = scrape(tb).map(|t| program_stats(&t));
                sync.wait();
                sync.wait();
                let after = scrape(tb).map(|t| program_stats(&t));
                match (before, after) {
                    (Ok(x), Ok(y)) => {
                        let (runs, ns) = xdp_delta(&x, &y);
                        let done = ((b + 1) * block).min(calls) - b * block;
                        phases.push(Phase {
                            block: b,
                            elements: n,
                            job: kind,
                            median_us: f64::NAN,
                            contributions: (WORKERS * done) as f64 * frags(n),
                            xdp_runs: runs,
                            xdp_ns: ns,
                        });
                    }
                    (Err(e), _) | (_, Err(e)) => error = Some(e),
                }
            }
            match error {
                Some(e) => Err(e),
                None => Ok(phases),
            }
        };
        let phases = coordinate();
        let ranks = hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a rank panicked")))).collect();
        (ranks, phases)
    });
    let mut calls_us = Vec::new();
    let mut dynamic_job = 0;
    for r in ranks {
        let (c, job) = r?;
        calls_us.extend(c);
        dynamic_job = job;
    }
    let mut phases = phases?;
    for p in &mut phases {
        let v: Vec<f64> = calls_us
            .iter()
            .filter(|c| c.1 == p.elements && c.2 == p.job && c.3 / block == p.block)
            .map(|c| c.4)
            .collect();
        p.median_us = summarize(&v).median;
    }
    let expected = WORKERS * calls * sizes.len() * 2;
    if calls_us.len() != expected {
        bail!("{} of {expected} calls were made", calls_us.len());
    }
    let mut compared = Vec::new();
    let mut ratios = Vec::new();
    for &n in &sizes {
        let mut per_kind = BTreeMap::new();
        for kind in [Kind::Static, Kind::Dynamic] {
            let lat: Vec<f64> = calls_us.iter().filter(|c| c.1 == n && c.2 == kind).map(|c| c.4).collect();
            let ps: Vec<&Phase> = phases.iter().filter(|p| p.elements == n && p.job == kind).collect();
            let contributions: f64 = ps.iter().map(|p| p.contributions).sum();
            let c = Compared {
                elements: n,
                job: kind,
                latency_us: summarize(&lat),
                xdp_ns_per_contribution: ps.iter().map(|p| p.xdp_ns).sum::<f64>() / contributions,
                xdp_runs_per_contribution: ps.iter().map(|p| p.xdp_runs).sum::<f64>() / contributions,
            };
            per_kind.insert(kind, c.clone());
            compared.push(c);
        }
        let per_block = |f: fn(&Phase) -> f64| -> Summary {
            let v: Vec<f64> = (0..blocks)
                .filter_map(|b| {
                    let get = |k: Kind| phases.iter().find(|p| p.block == b && p.elements == n && p.job == k);
                    Some(f(get(Kind::Dynamic)?) / f(get(Kind::Static)?))
                })
                .collect();
            summarize(&v)
        };
        let latency_per_block = per_block(|p| p.median_us);
        let xdp_ns_per_block = per_block(|p| p.xdp_ns / p.contributions);
        let inside = |s: &Summary| s.p10 <= 1.0 && 1.0 <= s.p90;
        ratios.push(Ratio {
            elements: n,
            latency: per_kind[&Kind::Dynamic].latency_us.median / per_kind[&Kind::Static].latency_us.median,
            xdp_ns: per_kind[&Kind::Dynamic].xdp_ns_per_contribution / per_kind[&Kind::Static].xdp_ns_per_contribution,
            within_noise: inside(&latency_per_block) && inside(&xdp_ns_per_block),
            latency_per_block,
            xdp_ns_per_block,
        });
    }
    Ok(StaticVsDynamic {
        workers: WORKERS,
        calls,
        block,
        static_job: STATIC_JOB,
        dynamic_job,
        compared,
        ratios,
        phases,
        calls_us,
    })
}

// ---------------------------------------------------------------- the run

/// Everything measured (`ondemand.json`).
#[derive(Debug, Clone, Serialize)]
pub struct OnDemand {
    pub plan: Plan,
    pub create: Vec<CreateSummary>,
    pub create_trials: Vec<CreateTrial>,
    pub create_destroy: CreateDestroy,
    pub static_vs_dynamic: StaticVsDynamic,
    pub ring: RingCreate,
}

// ------------------------------------------------ part 4: rings on demand

/// Elements of part 4's rings: 20 fragments of 362.
const RING_LEN: u32 = 362 * 20;

/// Part 4: runs of [`WORKERS`] ranks that ask for a ring at their own nodes,
/// interleaved with the same runs without one, on the same nodes.
#[derive(Debug, Clone, Serialize)]
pub struct RingCreate {
    pub workers: usize,
    /// Runs of each kind.
    pub trials: usize,
    /// Earliest join start → latest rank's join return (the job, and the
    /// ring installed at every member, granted).
    pub joined_ms: Summary,
    /// → the latest rank's first call returned (one element, on the ring).
    pub total_ms: Summary,
    /// The same of the runs without a ring (the call on the star).
    pub plain_joined_ms: Summary,
    pub plain_total_ms: Summary,
    /// Per run: trial, with a ring, joined ms, total ms.
    pub raw: Vec<(usize, bool, f64, f64)>,
}

/// One run of part 4: W ranks join (with a ring or not), build, make one
/// checked one-element SUM (forced on the ring when there is one) and end.
fn ring_trial(tb: &Testbed, control: SocketAddr, credential: &Credential, pins: &[PathBuf], ring: bool, run: &str) -> Result<(f64, f64)> {
    let w = pins.len();
    let start = Barrier::new(w);
    let done = Barrier::new(w);
    let ranks: Vec<Result<(Instant, Instant, Instant)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..w)
            .map(|r| {
                let (start, done) = (&start, &done);
                s.spawn(move || -> Result<(Instant, Instant, Instant)> {
                    let data = SocketAddrV4::new(tb.host(r + 1).addr, RUN_DATA_PORT);
                    let own = SocketAddrV4::new(tb.host(r + 1).addr, CONTROL_PORT);
                    let shape = JobShape { vector_len: Some(RING_LEN), ring: ring.then_some(own.into()), ..JobShape::default() };
                    tb.in_host(r + 1, || {
                        start.wait();
                        let t0 = Instant::now();
                        let out = (|| -> Result<_> {
                            let joined = RunJob::join_shaped(control, credential.clone(), run, w as u16, r as u16, data, shape, Duration::from_secs(20))
                                .map_err(|e| anyhow!("rank {r}: join: {e}"))?;
                            let t_joined = Instant::now();
                            let comm = RunCommunicator::from_runs(vec![joined], |b| b.deadline(DEADLINE)).map_err(|e| anyhow!("rank {r}: build: {e}"))?;
                            let comm = if ring {
                                comm.with_ring(&pins[r]).map_err(|e| anyhow!("rank {r}: the ring: {e}"))?.with_algorithm(aggbox::runtime::Algorithm::Ring)
                            } else {
                                aggbox::runtime::StarOrRing::of(Some(comm), None, None).map_err(|e| anyhow!("{e}"))?
                            };
                            let mut v = [r as i32 + 1];
                            let served = comm.allreduce_with(&mut v, Op::Sum, Default::default()).map_err(|e| anyhow!("rank {r}: allreduce: {e}"))?;
                            let t_done = Instant::now();
                            let want = (w * (w + 1) / 2) as i32;
                            if v[0] != want || (served.algorithm == aggbox::runtime::Algorithm::Ring) != ring {
                                bail!("rank {r}: the first allreduce gave {} on {:?}, not {want} on the {}", v[0], served.algorithm, if ring { "ring" } else { "star" });
                            }
                            Ok((comm, t_joined, t_done))
                        })();
                        done.wait();
                        let (comm, t_joined, t_done) = out?;
                        drop(comm);
                        Ok((t0, t_joined, t_done))
                    })?
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a rank panicked")))).collect()
    });
    let ranks: Vec<_> = ranks.into_iter().collect::<Result<_>>().with_context(|| format!("run {run}"))?;
    let first = ranks.iter().map(|r| r.0).min().context("no rank")?;
    let ms = |f: fn(&(Instant, Instant, Instant)) -> Instant| ranks.iter().map(|r| f(r).duration_since(first).as_secs_f64() * 1e3).fold(0.0, f64::max);
    Ok((ms(|r| r.1), ms(|r| r.2)))
}

/// Part 4 on a testbed of its own: the star's node in host 0 and a node
/// with ring memory in each rank's host, all serving the tenant.
fn ring_create(opts: &BenchOptions, plan: &Plan, aggbox: &Path, dir: &TempDir, keys: &Path, credential: &Credential) -> Result<RingCreate> {
    let tb = Testbed::up(TestbedConfig { hosts: 1 + WORKERS, xdp_tx: true, ..Default::default() }).context("the ring's testbed")?;
    let node = format!("[node]\nmetrics = \"off\"\nuserspace_path = \"optional\"\ncontrol = \"0.0.0.0:{CONTROL_PORT}\"\nkeys = \"{}\"\n", keys.display());
    let (star_path, member_path) = (dir.0.join("ring_star.toml"), dir.0.join("ring_member.toml"));
    std::fs::write(&star_path, &node)?;
    std::fs::write(&member_path, format!("{node}ring_pool = {}\n", 2 * RING_LEN))?;
    let star = NodeProcess::start_in(&tb, 0, aggbox, &star_path, &opts.out_dir.join("ondemand_ring_node0.log"))?;
    let members = (1..=WORKERS)
        .map(|h| NodeProcess::start_in(&tb, h, aggbox, &member_path, &opts.out_dir.join(format!("ondemand_ring_node{h}.log"))))
        .collect::<Result<Vec<_>>>()?;
    let pins: Vec<PathBuf> = members.iter().map(|m| aggbox::node::pin_dir(&m.pins.path, "eth0")).collect();
    let control = SocketAddr::from(SocketAddrV4::new(tb.host(0).addr, CONTROL_PORT));
    for ring in [false, true] {
        ring_trial(&tb, control, credential, &pins, ring, &format!("ring-warm-{ring}"))?;
    }
    let mut raw = Vec::new();
    for t in 0..plan.trials {
        for ring in [false, true] {
            let (joined, total) = ring_trial(&tb, control, credential, &pins, ring, &format!("ring-{t}-{ring}"))?;
            raw.push((t, ring, joined, total));
        }
    }
    // Every ring leaves its members with its run (within a lease tick).
    let since = Instant::now();
    while members.iter().map(|m| m.status().map(|s| s.rings_on_demand.len())).sum::<Result<usize>>()? > 0 {
        if since.elapsed() > Duration::from_secs(3) {
            bail!("rings on demand left at the members 3 s after their runs ended");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(members);
    drop(star);
    let col = |ring: bool, f: fn(&(usize, bool, f64, f64)) -> f64| summarize(&raw.iter().filter(|r| r.1 == ring).map(f).collect::<Vec<_>>());
    let r = RingCreate {
        workers: WORKERS,
        trials: plan.trials,
        joined_ms: col(true, |r| r.2),
        total_ms: col(true, |r| r.3),
        plain_joined_ms: col(false, |r| r.2),
        plain_total_ms: col(false, |r| r.3),
        raw,
    };
    progress(format!(
        "ondemand: {} workers with a ring: joined p50 {:.1} ms (without {:.1}), first ring call p50 {:.1} ms (star {:.1})",
        r.workers, r.joined_ms.median, r.plain_joined_ms.median, r.total_ms.median, r.plain_total_ms.median
    ));
    Ok(r)
}

fn random_key() -> Result<String> {
    let mut k = [0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut k)).context("/dev/urandom")?;
    Ok(hex::encode(k))
}

/// The node's file: the control endpoint, its key file, /metrics, and the
/// static node-served job of hosts 1..=4.
fn node_config(tb: &Testbed, keys: &Path) -> String {
    let workers: Vec<String> = (1..=WORKERS).map(|h| format!("\"{}\"", tb.host(h).addr)).collect();
    let members: Vec<String> = (1..=WORKERS).map(|h| format!("\"{}:{STATIC_DATA_PORT}\"", tb.host(h).addr)).collect();
    format!(
        "[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nuserspace_path = \"optional\"\ncontrol = \"0.0.0.0:{CONTROL_PORT}\"\nkeys = \"{}\"\n\n\
         [[job]]\nid = {STATIC_JOB}\nport = {STATIC_PORT}\nworkers = [{}]\nresult_port = {}\nresult_group = {STATIC_JOB}\nconsumer = \"node\"\n\n\
         [[group]]\nid = {STATIC_JOB}\nmembers = [{}]\n",
        keys.display(),
        workers.join(", "),
        STATIC_PORT + 1,
        members.join(", "),
    )
}

fn f1(x: f64) -> String {
    format!("{x:.1}")
}

fn f2(x: f64) -> String {
    format!("{x:.2}")
}

fn bound(b: (f64, f64)) -> String {
    if b.1.is_infinite() {
        format!("> {} ms", b.0)
    } else {
        format!("({} – {}] ms", b.0, b.1)
    }
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "missed"
    }
}

/// Experiment 11.
pub fn run(opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> {
    let plan = Plan::new(opts.quick);
    let aggbox = std::env::current_exe().context("the bench's own executable")?.with_file_name("aggbox");
    if !aggbox.exists() {
        bail!("{} not found: build it first (`cargo build --release --features bench`; `make bench` does)", aggbox.display());
    }
    let hosts = 1 + plan.worlds.iter().copied().max().unwrap_or(WORKERS).max(WORKERS);
    let tb = Testbed::up(TestbedConfig { hosts, ..Default::default() }).context("testbed")?;
    let dir = tempdir()?;
    let keys = dir.0.join("keys.toml");
    let key = random_key()?;
    std::fs::write(&keys, format!("[[tenant]]\nname = \"{TENANT}\"\nkey = \"{key}\"\njobs = 8\nworkers = 64\n"))?;
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600))?;
    let config_text = node_config(&tb, &keys);
    let config_path = dir.0.join("node.toml");
    std::fs::write(&config_path, &config_text)?;
    let config = Config::parse(&config_text, "ondemand node").map_err(|e| anyhow!("the node's file: {e}"))?;
    let log = opts.out_dir.join("ondemand_node.log");
    let node = NodeProcess::start(&tb, &aggbox, &config_path, &log)?;
    progress(format!("ondemand: aggbox attach (pid {}) in {}, {hosts} hosts; log {}", node.pid, tb.host(0).netns, log.display()));
    let control = SocketAddr::from(SocketAddrV4::new(tb.host(0).addr, CONTROL_PORT));
    let credential = Credential::from_hex(TENANT, &key).map_err(|e| anyhow!("{e}"))?;

    // 1. Create → first allreduce.
    let mut create_trials = Vec::new();
    let mut create = Vec::new();
    for &w in &plan.worlds {
        create_trial(&tb, control, &credential, w, &format!("warm-w{w}"))?;
        for t in 0..plan.trials {
            let (job, joined_ms, built_ms, total_ms) = create_trial(&tb, control, &credential, w, &format!("first-w{w}-t{t}"))?;
            create_trials.push(CreateTrial { workers: w, trial: t, job, joined_ms, built_ms, total_ms });
        }
        let col = |f: fn(&CreateTrial) -> f64| summarize(&create_trials.iter().filter(|c| c.workers == w).map(f).collect::<Vec<_>>());
        let s = CreateSummary { workers: w, total_ms: col(|c| c.total_ms), joined_ms: col(|c| c.joined_ms), built_ms: col(|c| c.built_ms), met: false };
        let s = CreateSummary { met: s.total_ms.p99 <= GOAL_CREATE_MS, ..s };
        progress(format!(
            "ondemand: {w} workers, create → first allreduce p50 {:.1} ms, p99 {:.1} ms ({} trials)",
            s.total_ms.median, s.total_ms.p99, plan.trials
        ));
        create.push(s);
    }

    // 2. Node-side create + destroy.
    let create_destroy = create_destroy(&tb, &node, control, &credential, plan.cycles)?;
    progress(format!(
        "ondemand: node-side apply p50 in {}, p99 in {}; join {:.2}/{:.2} ms, end {:.2}/{:.2} ms (p50/p99); {}",
        bound(create_destroy.apply_p50_ms),
        bound(create_destroy.apply_p99_ms),
        create_destroy.join_last_ms.median,
        create_destroy.join_last_ms.p99,
        create_destroy.end_last_ms.median,
        create_destroy.end_last_ms.p99,
        if create_destroy.leaks.is_empty() { "no leak".to_string() } else { create_destroy.leaks.join("; ") }
    ));

    // 3. Dynamic vs static.
    let compared = static_vs_dynamic(&tb, control, &credential, &config, plan.calls, plan.block)?;
    for r in &compared.ratios {
        progress(format!(
            "ondemand: {}-element calls, dynamic / static latency {:.3}, XDP ns per contribution {:.3}",
            r.elements, r.latency, r.xdp_ns
        ));
    }
    let status = node.status()?;
    drop(node);
    drop(tb);

    // 4. Create with a ring → first ring allreduce (a testbed of its own:
    // the ring needs veths that forward XDP_TX).
    let ring = ring_create(opts, &plan, &aggbox, &dir, &keys, &credential)?;
    let result = OnDemand { plan, create, create_trials, create_destroy, static_vs_dynamic: compared, ring };
    write_outputs(opts, &result)?;
    let (markdown, headline) = report(opts, &result);
    if !result.create_destroy.leaks.is_empty() {
        return Err(Failed { markdown, summary: format!("the node leaked: {}", result.create_destroy.leaks.join("; ")) }.into());
    }
    if status.jobs.iter().any(|j| j.id != STATIC_JOB) {
        let summary = format!("jobs on demand left after every run ended: {:?}", status.jobs.iter().map(|j| j.id).collect::<Vec<_>>());
        return Err(Failed { markdown, summary }.into());
    }
    Ok(Section { name: "ondemand".into(), markdown, headline })
}

/// A private directory for the key file and the node's file, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> Result<TempDir> {
    let d = std::env::temp_dir().join(format!("aggbox-bench-ondemand-{}", std::process::id()));
    std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))?;
    Ok(TempDir(d))
}

fn write_outputs(opts: &BenchOptions, r: &OnDemand) -> Result<()> {
    let mut csv = Csv::new(&["part", "workers", "index", "rank", "job", "elements", "metric", "value"]);
    let mut row = |part: &str, w: usize, index: usize, rank: &str, job: &str, n: &str, metric: &str, value: f64| {
        csv.row(vec![part.into(), w.to_string(), index.to_string(), rank.into(), job.into(), n.into(), metric.into(), format!("{value:.6}")]);
    };
    for t in &r.create_trials {
        for (m, v) in [("joined_ms", t.joined_ms), ("built_ms", t.built_ms), ("total_ms", t.total_ms)] {
            row("create_first", t.workers, t.trial, "", &t.job.to_string(), "1", m, v);
        }
    }
    let cd = &r.create_destroy;
    for c in &cd.raw {
        for (m, v) in [("join_last_ms", c.join_last_ms), ("join_first_ms", c.join_first_ms), ("end_last_ms", c.end_last_ms), ("end_first_ms", c.end_first_ms)] {
            row("create_destroy", 2, c.cycle, "", &c.job.to_string(), "", m, v);
        }
    }
    for (i, (le, n)) in cd.apply_buckets.iter().enumerate() {
        row("apply_histogram", 2, i, "", "", "", &format!("le_{le}_ms"), *n);
    }
    let sd = &r.static_vs_dynamic;
    for p in &sd.phases {
        for (m, v) in [("median_us", p.median_us), ("contributions", p.contributions), ("xdp_runs", p.xdp_runs), ("xdp_ns", p.xdp_ns)] {
            row("phase", sd.workers, p.block, "", p.job.name(), &p.elements.to_string(), m, v);
        }
    }
    for (rank, n, kind, call, us) in &sd.calls_us {
        row("call", sd.workers, *call, &rank.to_string(), kind.name(), &n.to_string(), "latency_us", *us);
    }
    for &(t, ring, joined, total) in &r.ring.raw {
        let part = if ring { "ring_create" } else { "ring_create_without" };
        row(part, r.ring.workers, t, "", "", "1", "joined_ms", joined);
        row(part, r.ring.workers, t, "", "", "1", "total_ms", total);
    }
    csv.write(&opts.out_dir.join("ondemand.csv"))?;
    super::write_json(&opts.out_dir.join("ondemand.json"), r)
}

fn report(opts: &BenchOptions, r: &OnDemand) -> (String, Vec<String>) {
    let mut md = String::new();
    let mut headline = Vec::new();
    let _ = writeln!(md, "## 11. Jobs on demand (issue #45)\n");
    let _ = writeln!(
        md,
        "One `aggbox attach eth0 --bpf-stats` process with a key file, its control endpoint and a static node-served `[[job]]` \
         of the 4 workers of hosts 1–4, serving every part; workers in the testbed's hosts. Code: `src/bin/aggbox-bench/ondemand.rs`; \
         raw numbers: `ondemand.csv`, `ondemand.json`; the node's log: `ondemand_node.log`.{}\n",
        if opts.quick { " **--quick: correctness only, the numbers are not meaningful.**" } else { "" }
    );
    let _ = writeln!(md, "### Create → first allreduce\n");
    let _ = writeln!(
        md,
        "All ranks start together; each joins a fresh run key, builds its communicator and runs a one-element int32 SUM (checked). \
         Time from the earliest rank's join start to the latest rank's allreduce return, over {} runs per size after one warm-up run; \
         \"joined\" and \"built\": the same start to the latest rank's join return (the job served) and communicator built. \
         Goal: ≤ {GOAL_CREATE_MS} ms, judged on p99.\n",
        r.plan.trials
    );
    let _ = writeln!(md, "| workers | p50 ms | p90 ms | p99 ms | max ms | joined p50 / p99 ms | built p50 / p99 ms | goal ≤ {GOAL_CREATE_MS} ms |");
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---:|---|");
    for c in &r.create {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} / {} | {} / {} | {} |",
            c.workers,
            f1(c.total_ms.median),
            f1(c.total_ms.p90),
            f1(c.total_ms.p99),
            f1(c.total_ms.max),
            f1(c.joined_ms.median),
            f1(c.joined_ms.p99),
            f1(c.built_ms.median),
            f1(c.built_ms.p99),
            met(c.met)
        );
        headline.push(format!(
            "ondemand: create → first allreduce, {} workers: p50 {:.1} ms, p99 {:.1} ms (goal ≤ {GOAL_CREATE_MS} ms: {})",
            c.workers,
            c.total_ms.median,
            c.total_ms.p99,
            met(c.met)
        ));
    }
    let cd = &r.create_destroy;
    let _ = writeln!(md, "\n### Node-side create + destroy\n");
    let _ = writeln!(
        md,
        "{} runs of 2 ranks joined and ended with bare AGC1 requests (one connection each, as `RunJob` makes them), one after the other, \
         after 5 warm-up runs. Node side: the node's own `aggbox_control_apply_seconds` histogram, scraped before and after \
         ({} changes: one create and one destroy per run); p50 and p99 are the **bucket bounds** they fall in, the mean is exact (sum / count). \
         Client side: round trips (connect to reply) timed exactly; the join that completed the run (sent last: its reply waits for the node's \
         create) and the end that removed the job (its reply waits for the destroy). Goal: node-side p99 ≤ {GOAL_APPLY_P99_MS} ms, no leak.\n",
        cd.cycles, cd.changes
    );
    let _ = writeln!(md, "| | p50 | p99 | mean / max |");
    let _ = writeln!(md, "|---|---:|---:|---:|");
    let _ = writeln!(md, "| node: apply one change (histogram buckets) | {} | {} | {} ms (mean) |", bound(cd.apply_p50_ms), bound(cd.apply_p99_ms), f2(cd.apply_mean_ms));
    for (what, s) in [
        ("client: join that completed the run", &cd.join_last_ms),
        ("client: the other rank's join", &cd.join_first_ms),
        ("client: end that removed the job", &cd.end_last_ms),
        ("client: the other rank's end", &cd.end_first_ms),
    ] {
        let _ = writeln!(md, "| {what} | {} ms | {} ms | {} ms (max) |", f2(s.median), f2(s.p99), f2(s.max));
    }
    let _ = writeln!(md, "\nGoal node-side p99 ≤ {GOAL_APPLY_P99_MS} ms: **{}**.\n", met(cd.met));
    let _ = writeln!(
        md,
        "Leak check, before (after the warm-up) and after the {} runs, each once the ended jobs' records were gone (the next lease tick). \
         Bounds: no job on demand, the same jobs, groups and published records, no more descriptors, VmRSS at most +{} MiB.\n",
        cd.cycles,
        RSS_BOUND_KIB / 1024
    );
    let _ = writeln!(md, "| | jobs (dynamic) | groups | published | live gauge | descriptors | VmRSS KiB |");
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|");
    for (what, f) in [("before", &cd.before), ("after", &cd.after)] {
        let _ = writeln!(md, "| {what} | {} ({}) | {} | {} | {} | {} | {} |", f.jobs, f.dynamic_jobs, f.groups, f.published, f.live_gauge, f.fds, f.rss_kib);
    }
    let _ = writeln!(
        md,
        "\n{}\n",
        if cd.leaks.is_empty() { "**No leak.**".to_string() } else { format!("**LEAK**: {}", cd.leaks.join("; ")) }
    );
    headline.push(format!(
        "ondemand: node-side create/destroy over {} runs: p50 in {}, p99 in {} (mean {:.2} ms; goal p99 ≤ {GOAL_APPLY_P99_MS} ms: {}); \
         join {:.2} / {:.2} ms, end {:.2} / {:.2} ms p50 / p99; {}",
        cd.cycles,
        bound(cd.apply_p50_ms),
        bound(cd.apply_p99_ms),
        cd.apply_mean_ms,
        met(cd.met),
        cd.join_last_ms.median,
        cd.join_last_ms.p99,
        cd.end_last_ms.median,
        cd.end_last_ms.p99,
        if cd.leaks.is_empty() { format!("no leak (fds {} → {}, VmRSS {} → {} KiB)", cd.before.fds, cd.after.fds, cd.before.rss_kib, cd.after.rss_kib) } else { "LEAK".into() }
    ));
    let sd = &r.static_vs_dynamic;
    let _ = writeln!(md, "### Dynamic vs static job\n");
    let _ = writeln!(
        md,
        "{} ranks hold a communicator of the static job {} (from the node's file, `CommunicatorBuilder::from_config`) and one of job on demand {} \
         (`RunJob::communicator`) at once, and run {} int32 SUMs of each size on each, in blocks of {} calls, the two jobs back to back in each \
         block, which runs first alternating; every result checked. Latency: every rank's calls. XDP: the node's `aggbox_program_run_seconds_total` \
         summed over its programs / the contributions sent (ranks × calls × fragments), per job; runs per contribution counts every datagram \
         that reached the XDP program (contributions, ACKs, control traffic) per contribution. Ratio per block: dynamic / static of the same block \
         (median, p10–p90). Goal: within noise, i.e. 1.0 within the per-block ratios' p10–p90 for latency and for XDP time.\n",
        sd.workers, sd.static_job, sd.dynamic_job, sd.calls, sd.block
    );
    let _ = writeln!(md, "| elements | job | median µs | p10–p90 µs | XDP ns / contribution | XDP runs / contribution |");
    let _ = writeln!(md, "|---:|---|---:|---:|---:|---:|");
    for c in &sd.compared {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {}–{} | {} | {} |",
            c.elements,
            c.job.name(),
            f1(c.latency_us.median),
            f1(c.latency_us.p10),
            f1(c.latency_us.p90),
            f1(c.xdp_ns_per_contribution),
            f2(c.xdp_runs_per_contribution)
        );
    }
    let _ = writeln!(md, "\n| elements | latency dynamic / static | per block | XDP ns dynamic / static | per block | within noise |");
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---|");
    for x in &sd.ratios {
        let _ = writeln!(
            md,
            "| {} | {:.3} | {:.3} [{:.3}–{:.3}] | {:.3} | {:.3} [{:.3}–{:.3}] | {} |",
            x.elements,
            x.latency,
            x.latency_per_block.median,
            x.latency_per_block.p10,
            x.latency_per_block.p90,
            x.xdp_ns,
            x.xdp_ns_per_block.median,
            x.xdp_ns_per_block.p10,
            x.xdp_ns_per_block.p90,
            if x.within_noise { "yes (met)" } else { "no (missed)" }
        );
        headline.push(format!(
            "ondemand: {}-element calls, dynamic / static: latency {:.3} (per block {:.3} [{:.3}–{:.3}]), XDP ns per contribution {:.3} (goal within noise: {})",
            x.elements,
            x.latency,
            x.latency_per_block.median,
            x.latency_per_block.p10,
            x.latency_per_block.p90,
            x.xdp_ns,
            met(x.within_noise)
        ));
    }
    let g = &r.ring;
    let _ = writeln!(md, "\n### Create with a ring → first ring call\n");
    let _ = writeln!(
        md,
        "A testbed of its own (veths that forward XDP_TX): the star's node in host 0 and in each of the {} ranks' hosts a node with ring memory, \
         all serving the tenant. {} runs that ask for a ring at the ranks' own nodes (docs/INTERFACE.md, \"Rings on demand\"; {} elements) \
         interleaved with {} runs that do not, after one warm-up run of each: earliest join start → latest rank's join return (the job granted, \
         and with a ring the ring installed at every member) and → latest rank's first one-element SUM (checked; forced on the ring, else on the star). \
         Every ring is gone from its members once its run ended (checked).\n",
        g.workers, g.trials, RING_LEN, g.trials
    );
    let _ = writeln!(md, "| runs | joined p50 / p90 / p99 ms | first call p50 / p90 / p99 ms |");
    let _ = writeln!(md, "|---|---:|---:|");
    for (what, j, t) in [("with a ring", &g.joined_ms, &g.total_ms), ("without", &g.plain_joined_ms, &g.plain_total_ms)] {
        let _ = writeln!(md, "| {what} | {} / {} / {} | {} / {} / {} |", f1(j.median), f1(j.p90), f1(j.p99), f1(t.median), f1(t.p90), f1(t.p99));
    }
    headline.push(format!(
        "ondemand: {} workers with a ring on demand: joined p50 {:.1} ms (without a ring {:.1}), first ring call p50 {:.1} ms",
        g.workers, g.joined_ms.median, g.plain_joined_ms.median, g.total_ms.median
    ));
    let _ = writeln!(md, "\nPlot: `ondemand.png`.\n");
    (md, headline)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = "# HELP aggbox_control_apply_seconds x\n\
        aggbox_control_apply_seconds_bucket{le=\"0.001\"} 3\n\
        aggbox_control_apply_seconds_bucket{le=\"0.002\"} 9\n\
        aggbox_control_apply_seconds_bucket{le=\"+Inf\"} 10\n\
        aggbox_control_apply_seconds_sum 0.015\n\
        aggbox_control_apply_seconds_count 10\n\
        aggbox_program_runs_total{iface=\"eth0\",program=\"entry\"} 100\n\
        aggbox_program_runs_total{iface=\"eth0\",program=\"tail\"} 0\n\
        aggbox_program_run_seconds_total{iface=\"eth0\",program=\"entry\"} 0.00005\n\
        aggbox_control_live_jobs{iface=\"eth0\"} 0\n";

    /// The histogram's quantiles are read as the buckets that hold them,
    /// between two scrapes; the XDP deltas take the entry program's runs.
    #[test]
    fn histogram_buckets_and_program_deltas() {
        let h1 = apply_histogram(SCRAPE);
        assert_eq!(h1.buckets.len(), 3);
        assert_eq!((h1.count, h1.sum), (10.0, 0.015));
        let h0 = Histogram::default();
        assert_eq!(bucket_of(&h0, &h1, 0.5), (0.001, 0.002));
        assert_eq!(bucket_of(&h0, &h1, 0.3), (0.0, 0.001));
        assert_eq!(bucket_of(&h0, &h1, 0.99).1, f64::INFINITY);
        let before = apply_histogram(
            "aggbox_control_apply_seconds_bucket{le=\"0.001\"} 2\n\
             aggbox_control_apply_seconds_bucket{le=\"0.002\"} 2\n\
             aggbox_control_apply_seconds_bucket{le=\"+Inf\"} 2\n\
             aggbox_control_apply_seconds_count 2\n",
        );
        // Of the 8 new observations, 1 ≤ 1 ms and 6 more ≤ 2 ms.
        assert_eq!(bucket_of(&before, &h1, 0.5), (0.001, 0.002));
        assert_eq!(bucket_of(&before, &h1, 0.1), (0.0, 0.001));
        assert_eq!(metric(SCRAPE, "aggbox_control_live_jobs"), Some(0.0));
        let p = program_stats(SCRAPE);
        let mut later = p.clone();
        later.insert("entry".into(), (150.0, 75_000.0));
        assert_eq!(xdp_delta(&p, &later), (50.0, 25_000.0));
    }
}
