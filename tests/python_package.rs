//! The Python package `aggbox` (python/, docs/PYTHON.md), as `make python`
//! built it (the wheel unpacked in target/python/site), run by Debian's
//! /usr/bin/python3 beside its python3-torch and python3-numpy:
//!
//! - python/tests/test_loopback.py (unittest): every API on a socket-backend
//!   job on loopback, in one process: numpy, torch and other buffers equal to
//!   the reference, float32 within the documented bound, bad buffers and bad
//!   arguments as Python exceptions, timeouts that name who is missing,
//!   lengths that differ across ranks failing within the deadline, the GIL
//!   released during a call, the DDP hook's route policies on a one-process
//!   Gloo group; python/tests/test_tuner.py: `aggbox.Tuner` with synthetic
//!   times.
//! - python/tests/netns_collectives.py: 4 worker namespaces against a node
//!   that runs only `aggbox attach` (node-served jobs, kernel backend).
//! - python/tests/netns_rerun.py: consecutive runs of fresh worker
//!   processes on one job of a running node.
//! - python/tests/netns_ddp.py: DDP over the same 4 workers, the default
//!   Gloo allreduce against `aggbox.torch.allreduce_hook` from one seed,
//!   routed by measurement (every rank settles the same routes, the
//!   counters add up), then with the fixed routes "baseline" and "aggbox".
//! - python/tests/netns_on_demand.py, netns_on_demand_killed.py: jobs on
//!   demand from `Communicator.connect`, 500 calls under 1 % loss and
//!   duplication; a run killed with -9 leaves nothing on the node and
//!   starts again with a new job.
//! - python/tests/netns_torch_*.py and plain_ddp_script.py: the
//!   `torch.distributed` backend "aggbox" on 4 ranks (the table and DDP
//!   also on 8) and a node serving jobs on demand: every collective against
//!   numpy with its serving path asserted, DDP against Gloo, DDP with
//!   torch's fp16 compression hook against Gloo, DDP on scikit-learn's
//!   digits to Gloo's test accuracy (float32, float16, bfloat16 gradients),
//!   an unmodified script under the launcher, a rank killed with -9 named
//!   within the timeout.
//!
//! Needs root (namespaces, XDP) and `make python` first; fails (never
//! skips) otherwise: `make python && cargo test --release --test python_package`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

mod live_attach;
#[path = "../src/testing/impair/mod.rs"]
mod impair;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

/// Debian's interpreter, the one python3-torch is installed for (a
/// `python3` earlier on PATH, pyenv's say, may lack torch).
const PYTHON: &str = "/usr/bin/python3";
/// The workers (ranks) of a test, but for the 8-rank runs of the torch
/// backend's tests.
const WORKERS: usize = 4;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The unpacked wheel `make python` built, checked to be there, newer than
/// the package's sources, and importable beside torch and numpy.
fn python_path() -> String {
    let site = repo().join("target/python/site");
    let ext = site.join("aggbox/_aggbox.abi3.so");
    let built = std::fs::metadata(&ext)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}: build the Python package first with `make python`",
                ext.display()
            )
        });
    let newest = newest_source(&repo().join("python"));
    assert!(
        built >= newest.1,
        "{} is older than {}: rebuild it with `make python`",
        ext.display(),
        newest.0.display()
    );
    let out = Command::new(PYTHON)
        .args([
            "-c",
            "import torch, numpy, aggbox, aggbox.torch; print(aggbox.__file__)",
        ])
        .env("PYTHONPATH", &site)
        .output()
        .unwrap_or_else(|e| {
            panic!("{PYTHON}: {e} (Debian's python3 with python3-torch: `make deps`)")
        });
    assert!(
        out.status.success(),
        "importing aggbox beside torch and numpy:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = String::from_utf8_lossy(&out.stdout);
    assert!(
        file.trim().starts_with(site.to_str().unwrap()),
        "aggbox came from {file}, not {}",
        site.display()
    );
    site.to_string_lossy().into_owned()
}

/// The newest file of the package's sources (the Rust crate and the Python
/// package; not its tests or examples) and its time.
fn newest_source(python_dir: &Path) -> (PathBuf, SystemTime) {
    let mut newest = (python_dir.join("Cargo.toml"), SystemTime::UNIX_EPOCH);
    let mut dirs = vec![python_dir.join("src"), python_dir.join("aggbox")];
    for f in ["Cargo.toml", "pyproject.toml"] {
        let t = std::fs::metadata(python_dir.join(f))
            .and_then(|m| m.modified())
            .expect("python/ sources");
        if t > newest.1 {
            newest = (python_dir.join(f), t);
        }
    }
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("python/ sources").flatten() {
            let (p, m) = (e.path(), e.metadata().expect("metadata"));
            if m.is_dir() {
                if p.file_name().is_some_and(|n| n != "__pycache__") {
                    dirs.push(p);
                }
            } else if m.modified().expect("mtime") > newest.1 {
                newest = (p, m.modified().expect("mtime"));
            }
        }
    }
    newest
}

/// Every rank of `script` exited 0, its output ends with "done" and holds
/// each of `markers`.
fn assert_ranks_done(results: &[(ExitStatus, String)], script: &str, markers: &[&str]) {
    for (r, (status, text)) in results.iter().enumerate() {
        assert!(status.success(), "rank {r}: {script} failed ({status}):\n{text}");
        assert!(text.trim_end().ends_with("done"), "rank {r} did not finish:\n{text}");
        for marker in markers {
            assert!(text.contains(marker), "rank {r}: no {marker:?} in:\n{text}");
        }
    }
}

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/python_package.rs needs root (network namespaces, XDP): `make python && sudo -E cargo test --release --test python_package`"
    );
}

#[test]
fn the_package_on_loopback_numpy_torch_errors_and_the_gil() {
    let site = python_path();
    let out = Command::new(PYTHON)
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(repo().join("python/tests"))
        .args(["-p", "test_*.py"])
        .env("PYTHONPATH", &site)
        .stdin(Stdio::null())
        .output()
        .expect("run python3 -m unittest");
    let text = String::from_utf8_lossy(&out.stderr);
    eprintln!("{text}");
    assert!(
        out.status.success(),
        "python/tests/test_*.py failed:\n{text}"
    );
    assert!(
        !text.contains("skipped"),
        "no test may be skipped (torch missing?)"
    );
}

/// The workers' data port of each job (its `result_group`'s members).
const DATA_PORTS: [u16; 5] = [7700, 7710, 7720, 7740, 7741];
/// The jobs of the node: collectives, wrong lengths, DDP, and two stripes
/// (a striped communicator's job t listens on the first one's data port +
/// t); a fresh job for each series of calls from round 0.
const JOBS: [u16; 5] = [11, 12, 13, 14, 15];

/// A node (host 0) that runs only `aggbox attach` with one node-served job
/// per entry of [`JOBS`], and its workers (hosts 1..=workers; [`WORKERS`]
/// unless made with [`Node::with_control_of`]).
struct Node {
    config: PathBuf,
    attach: LiveAttach,
    /// With a ring: each worker host's own `aggbox attach` serving it, and
    /// where it pinned its maps.
    ring_nodes: Vec<LiveAttach>,
    pin_dirs: Vec<PathBuf>,
    /// The key file of [`Node::with_control`], removed on drop.
    keys: Option<PathBuf>,
    workers: usize,
    tb: Testbed,
}

/// What the workers' hosts run besides the workers ([`Node::start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RingNodes {
    /// Nothing.
    None,
    /// `aggbox attach` with ring [`RING`] in its file.
    File,
    /// `aggbox attach` with the key file and ring memory, for a ring on demand.
    OnDemand,
}

/// The credential and port of [`Node::with_control`].
const TENANT: &str = "python";
const TENANT_KEY: &str = "a11ce5a11ce5a11ce5a11ce5a11ce5a11ce5a11ce5a11ce5a11ce5a11ce5a11c";
const CONTROL_PORT: u16 = 7471;

/// The ring of [`Node::with_ring`]: its id, length and the size from which
/// the workers' automatic choice takes it.
const RING: u16 = 40;
const RING_LEN: usize = 3000;
const RING_THRESHOLD: usize = 1000;

impl Node {
    fn up(tag: &str) -> Node {
        Node::start(tag, RingNodes::None, None, WORKERS)
    }

    /// [`Node::up`] with a control endpoint (jobs on demand) whose key
    /// file holds tenant [`TENANT`] with key [`TENANT_KEY`].
    fn with_control(tag: &str) -> Node {
        Node::with_control_of(tag, WORKERS)
    }

    /// [`Node::with_control`] with `workers` workers.
    fn with_control_of(tag: &str, workers: usize) -> Node {
        Node::start(tag, RingNodes::None, Some(Node::key_file(tag)), workers)
    }

    /// The key file of [`Node::with_control`].
    fn key_file(tag: &str) -> PathBuf {
        let keys = std::env::temp_dir().join(format!("aggbox-python-{}-{tag}.keys.toml", std::process::id()));
        // Room for the torch backend's tests: a job per process group.
        std::fs::write(&keys, format!("[[tenant]]\nname = \"{TENANT}\"\nkey = \"{TENANT_KEY}\"\njobs = 16\n")).expect("key file");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).expect("chmod 600");
        keys
    }

    /// [`Node::up`], and the workers' hosts each run `aggbox attach` with
    /// ring [`RING`] of the 4 workers, which the workers' file lists too.
    fn with_ring(tag: &str) -> Node {
        Node::start(tag, RingNodes::File, None, WORKERS)
    }

    /// [`Node::with_control`], and the workers' hosts each run `aggbox
    /// attach` with the same key file and ring memory for a ring on demand
    /// (`[node] ring_pool`), no `[[ring]]`.
    fn with_control_and_ring_nodes(tag: &str) -> Node {
        Node::start(tag, RingNodes::OnDemand, Some(Node::key_file(tag)), WORKERS)
    }

    fn start(tag: &str, ring: RingNodes, keys: Option<PathBuf>, n: usize) -> Node {
        require_root();
        let tb = Testbed::up(TestbedConfig {
            hosts: n + 1,
            xdp_tx: ring != RingNodes::None,
            ..Default::default()
        })
        .expect("testbed");
        let workers: Vec<String> = (1..=n).map(|h| tb.host(h).addr.to_string()).collect();
        let mut text = String::from("[node]\nmetrics = \"127.0.0.1:9472\"\n");
        if let Some(keys) = &keys {
            text += &format!("keys = \"{}\"\ncontrol = \"0.0.0.0:{CONTROL_PORT}\"\n", keys.display());
        }
        for (i, (&job, &data_port)) in JOBS.iter().zip(&DATA_PORTS).enumerate() {
            let group = 4 + i;
            let port = 7600 + 10 * i;
            text += &format!(
                "\n[[job]]\nid = {job}\nport = {port}\nworkers = [{}]\nresult_port = {}\nresult_group = {group}\nconsumer = \"node\"\n\n[[group]]\nid = {group}\nmembers = [{}]\n",
                workers.iter().map(|w| format!("\"{w}\"")).collect::<Vec<_>>().join(", "),
                port + 1,
                workers.iter().map(|w| format!("\"{w}:{data_port}\"")).collect::<Vec<_>>().join(", "),
            );
        }
        let attach = LiveAttach::start(&tb.host(0).netns, tag, &text, &[]);
        let (mut ring_nodes, mut pin_dirs) = (Vec::new(), Vec::new());
        if ring == RingNodes::OnDemand {
            let keys = keys.as_ref().expect("rings on demand need the key file");
            for h in 1..=n {
                let text = format!(
                    "[node]\nmetrics = \"off\"\nuserspace_path = \"optional\"\nkeys = \"{}\"\ncontrol = \"0.0.0.0:{CONTROL_PORT}\"\nring_pool = {}\n",
                    keys.display(),
                    2 * RING_LEN
                );
                let a = LiveAttach::start(&tb.host(h).netns, &format!("{tag}-r{}", h - 1), &text, &[]);
                pin_dirs.push(aggbox::node::pin_dir(&a.pin_root, "eth0"));
                ring_nodes.push(a);
            }
        }
        if ring == RingNodes::File {
            let ring = format!(
                "\n[[ring]]\nid = {RING}\nport = 7400\nmembers = [{}]\nvector_len = {RING_LEN}\nfrag_elems = 362\n",
                workers.iter().map(|w| format!("\"{w}\"")).collect::<Vec<_>>().join(", "),
            );
            for h in 1..=n {
                let node = "[node]\nmetrics = \"off\"\nuserspace_path = \"optional\"\n";
                // Named by rank: a rank finds its pins by `{rank}`.
                let a = LiveAttach::start(&tb.host(h).netns, &format!("{tag}-r{}", h - 1), &format!("{node}{ring}"), &[]);
                pin_dirs.push(aggbox::node::pin_dir(&a.pin_root, "eth0"));
                ring_nodes.push(a);
            }
            text += &ring;
        }
        // The workers read the same file (the namespaces share the file system).
        let config =
            std::env::temp_dir().join(format!("aggbox-python-{}-{tag}.toml", std::process::id()));
        std::fs::write(&config, &text).expect("write the workers' configuration");
        Node { config, attach, ring_nodes, pin_dirs, keys, workers: n, tb }
    }

    /// Runs `script` on every worker (rank r on host r+1) with `args(r)`,
    /// at most `limit`; returns each rank's exit status and output. Each
    /// process is killed (by its pid) if it outlives `limit`.
    fn run_workers(
        &self,
        script: &str,
        args: impl Fn(usize) -> Vec<String>,
        limit: Duration,
    ) -> Vec<(ExitStatus, String)> {
        let script = repo().join("python/tests").join(script);
        let argv = |r: usize| {
            let mut cmd = vec![script.to_string_lossy().into_owned()];
            cmd.extend(["--rank".into(), r.to_string(), "--world".into(), self.workers.to_string()]);
            cmd.extend(["--config".into(), self.config.to_string_lossy().into_owned()]);
            cmd.extend(["--aggregator".into(), self.tb.host(0).addr.to_string()]);
            cmd.extend(args(r));
            cmd
        };
        self.run_ranks(argv, &[], limit)
    }

    /// Runs `/usr/bin/python3 argv(r)...` on every worker (rank r on host
    /// r+1) with the environment `env` added, as [`Node::run_workers`].
    fn run_ranks(
        &self,
        argv: impl Fn(usize) -> Vec<String>,
        env: &[(&str, String)],
        limit: Duration,
    ) -> Vec<(ExitStatus, String)> {
        let (mut children, logs) = self.spawn_ranks(argv, env);
        let deadline = Instant::now() + limit;
        let mut statuses: Vec<Option<ExitStatus>> = vec![None; self.workers];
        while statuses.iter().any(Option::is_none) && Instant::now() < deadline {
            for (s, c) in statuses.iter_mut().zip(&mut children) {
                if s.is_none() {
                    *s = c.try_wait().expect("wait");
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // A worker past the deadline first dumps every thread's stack into
        // its log (the scripts register faulthandler for SIGUSR1), so that
        // a hang says where it was; then it is killed.
        let late: Vec<usize> = (0..self.workers).filter(|&r| statuses[r].is_none()).collect();
        for &r in &late {
            let pid = nix::unistd::Pid::from_raw(children[r].id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGUSR1);
        }
        if !late.is_empty() {
            std::thread::sleep(Duration::from_secs(2));
        }
        let mut out = Vec::new();
        for (r, (s, mut c)) in statuses.into_iter().zip(children).enumerate() {
            let status = s.unwrap_or_else(|| {
                let _ = c.kill();
                c.wait().expect("wait")
            });
            let text = std::fs::read_to_string(&logs[r]).unwrap_or_default();
            let _ = std::fs::remove_file(&logs[r]);
            eprintln!("--- rank {r} ({status}):\n{text}");
            out.push((status, text));
        }
        out
    }

    /// Starts `/usr/bin/python3 argv(r)...` on every worker (rank r on host
    /// r+1) with `env` added; each one's output goes to its log file.
    fn spawn_ranks(&self, argv: impl Fn(usize) -> Vec<String>, env: &[(&str, String)]) -> (Vec<Child>, Vec<PathBuf>) {
        let site = python_path();
        let logs: Vec<PathBuf> = (0..self.workers)
            .map(|r| self.config.with_extension(format!("rank{r}.log")))
            .collect();
        let children: Vec<Child> = (0..self.workers)
            .map(|r| {
                let mut cmd = vec![PYTHON.to_string()];
                cmd.extend(argv(r));
                let argv: Vec<&str> = cmd.iter().map(String::as_str).collect();
                let log = File::create(&logs[r]).expect("log file");
                self.tb
                    .command_in(r + 1, &argv)
                    .expect("command")
                    .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                    .env("PYTHONPATH", &site)
                    .env("OMP_NUM_THREADS", "1")
                    .env("GLOO_SOCKET_IFNAME", "eth0")
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().expect("log"))
                    .stderr(log)
                    .spawn()
                    .expect("start a Python worker")
            })
            .collect();
        (children, logs)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
        if let Some(keys) = &self.keys {
            let _ = std::fs::remove_file(keys);
        }
        let _ = (&self.attach, &self.ring_nodes);
    }
}

/// The arguments of a rank script that joins a job on demand at
/// [`Node::with_control`]'s node: its control port, rank `r`'s data socket
/// and the credential.
fn on_demand_args(node: &Node, r: usize) -> Vec<String> {
    vec![
        "--control".into(),
        CONTROL_PORT.to_string(),
        "--data".into(),
        format!("{}:7790", node.tb.host(r + 1).addr),
        "--tenant".into(),
        TENANT.into(),
        "--key".into(),
        TENANT_KEY.into(),
    ]
}

/// Jobs on demand from Python: `Communicator.connect` with a credential
/// and the node's address only (the job is in no file); a wrong key is
/// refused (bad_mac); under 1 % loss and duplication on every link, 500
/// int32 and float32 allreduces exact (float32 within its bound).
#[test]
fn python_workers_bring_their_own_job_to_the_node() {
    let node = Node::with_control("py-demand");
    let args = |r: usize| on_demand_args(&node, r);
    // 1 % loss and duplication on every link (the node's and the workers'
    // switch ports): joins, contributions, RESULT copies, ACKs.
    let injector = impair::Injector::new();
    let impair = |loss: f64, dup: f64| {
        for h in 0..=WORKERS {
            let port = node.tb.switch_port(h);
            let injector = &injector;
            testbed::in_netns(&node.tb.switch_netns(), move || injector.set(&port, loss, dup))
                .expect("switch netns")
                .unwrap_or_else(|e| panic!("{e:#}"));
        }
    };
    impair(0.01, 0.01);
    let results = node.run_workers("netns_on_demand.py", args, Duration::from_secs(300));
    impair(0.0, 0.0);
    assert_ranks_done(
        &results,
        "netns_on_demand.py",
        &["ok: a wrong key is refused (bad_mac)", "ok: a tree whose root cannot be reached is refused", "ok: 500 allreduces exact"],
    );
    let c = injector.counts();
    assert!(c.dropped > 0 && c.duplicated > 0, "the injector dropped and duplicated: {c:?}");
}

/// What of the node a job on demand can leave behind, counted: its jobs,
/// groups, result-service entries, published on-demand records, the
/// entries of the kernel's slot hash maps, and its open descriptors.
#[derive(Debug, PartialEq, Eq)]
struct NodeFootprint {
    jobs: Vec<u16>,
    groups: Vec<u16>,
    served: Vec<u16>,
    published: usize,
    slot_entries: [usize; 3],
    fds: usize,
}

fn footprint(node: &Node) -> NodeFootprint {
    use aggbox::kernel::maps::{names, open_pinned};
    let status = node.attach.status();
    let dir = aggbox::node::pin_dir(&node.attach.pin_root, "eth0");
    let count = |name: &str| open_pinned(&dir, name).map_or(0, |m| libbpf_rs::MapCore::keys(&m).count());
    NodeFootprint {
        jobs: status.jobs.iter().map(|j| j.id).collect(),
        groups: status.groups.iter().map(|g| g.id).collect(),
        served: status.served.keys().copied().collect(),
        published: aggbox::node::control::published::read(&dir).len(),
        slot_entries: [count(names::SLOTS), count(names::COMPLETED), count(names::SLOT_OWNER)],
        fds: std::fs::read_dir(format!("/proc/{}/fd", node.attach.child.id())).expect("the node's fds").count(),
    }
}

/// kill -9 of every worker of a live run on demand, two of them in an
/// allreduce the other two never join: within a lease (and a lease check)
/// the node is as it was before the run (its jobs, groups, result service,
/// published records, slot entries and descriptors counted, after a first
/// run of the same key ended normally); the run started again with the
/// same key gets a new job, at once, and is exact.
#[test]
fn a_run_on_demand_killed_with_minus_9_leaves_nothing_and_starts_again() {
    let node = Node::with_control("py-killed");
    let script = repo().join("python/tests/netns_on_demand_killed.py");
    let argv = |phase: &'static str| {
        let (node, script) = (&node, &script);
        move |r: usize| -> Vec<String> {
            vec![
                script.to_string_lossy().into_owned(),
                "--phase".into(),
                phase.into(),
                "--rank".into(),
                r.to_string(),
                "--world".into(),
                WORKERS.to_string(),
                "--config".into(),
                node.config.to_string_lossy().into_owned(),
                "--aggregator".into(),
                node.tb.host(0).addr.to_string(),
            ]
            .into_iter()
            .chain(on_demand_args(node, r))
            .collect()
        }
    };
    // A first run of the same key, ended normally: what the node makes
    // once (its result service's counters, the first job's lazily made
    // state) is made before the count.
    let first = node.run_ranks(argv("again"), &[], Duration::from_secs(120));
    assert!(first.iter().all(|(s, t)| s.success() && t.trim_end().ends_with("done")), "the first run failed");
    std::thread::sleep(Duration::from_millis(600));
    let before = footprint(&node);
    let (mut children, logs) = node.spawn_ranks(argv("die"), &[]);
    let read = |r: usize| std::fs::read_to_string(&logs[r]).unwrap_or_default();
    let since = Instant::now();
    while !(0..WORKERS).all(|r| read(r).contains("ready")) {
        assert!(since.elapsed() < Duration::from_secs(120), "the run never got ready: {:?}", (0..WORKERS).map(read).collect::<Vec<_>>());
        assert!(children.iter_mut().all(|c| c.try_wait().expect("wait").is_none()), "a rank exited: {:?}", (0..WORKERS).map(read).collect::<Vec<_>>());
        std::thread::sleep(Duration::from_millis(50));
    }
    // Ranks 0 and 1 are in the allreduce ranks 2 and 3 never join.
    std::thread::sleep(Duration::from_millis(500));
    let job: u16 = read(0).lines().find_map(|l| l.strip_prefix("job ")).and_then(|j| j.trim().parse().ok()).expect("the job");
    let during = footprint(&node);
    assert!(during.jobs.contains(&job) && during.served.contains(&job) && during.published > before.published, "the run's job is live: {during:?}");
    for c in &mut children {
        c.kill().expect("kill -9 a rank");
        c.wait().expect("wait");
    }
    for log in &logs {
        let _ = std::fs::remove_file(log);
    }
    let killed = Instant::now();
    let lease = Duration::from_secs(10);
    while footprint(&node) != before {
        assert!(
            killed.elapsed() < lease + Duration::from_secs(3),
            "a lease after kill -9 the node still holds the run: {:?} (before the run: {before:?})",
            footprint(&node)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("the killed run's job {job} was gone {:?} after kill -9", killed.elapsed());

    let started = Instant::now();
    let again = node.run_ranks(argv("again"), &[], Duration::from_secs(120));
    for (r, (status, text)) in again.iter().enumerate() {
        assert!(status.success() && text.trim_end().ends_with("done"), "rank {r} of the run started again:\n{text}");
        let new: u16 = text.lines().find_map(|l| l.strip_prefix("job ")).and_then(|j| j.trim().parse().ok()).expect("the job");
        assert_ne!(new, job, "rank {r}: the run started again has a new job");
    }
    assert!(started.elapsed() < Duration::from_secs(60), "the run started again at once");
}

/// The Python package reaches every algorithm of the runtime's one
/// interface: `from_config(ring=...)` puts the node-served job beside a
/// ring of the same workers, and each allreduce is served by the star or
/// the ring by its size (counted in `served`), exactly.
#[test]
fn python_workers_choose_star_or_ring_by_size() {
    let node = Node::with_ring("py-ring");
    let args = |r: usize| {
        vec![
            "--job".into(),
            JOBS[0].to_string(),
            "--ring".into(),
            RING.to_string(),
            "--pin-dir".into(),
            node.pin_dirs[r].to_string_lossy().into_owned(),
            "--ring-len".into(),
            RING_LEN.to_string(),
            "--threshold".into(),
            RING_THRESHOLD.to_string(),
        ]
    };
    let results = node.run_workers("netns_ring.py", args, Duration::from_secs(120));
    assert_ranks_done(&results, "netns_ring.py", &["ok: served star 2 ring 5"]);
}

/// A ring on demand from Python: `Communicator.connect(ring=...)` names
/// the rank's own node (which serves rings, `[node] ring_pool`) and the
/// node that serves the run installs the ring there; each allreduce is
/// served by the star or the ring by its size, exactly, and the ring is
/// gone from every worker's node once the run ends.
#[test]
fn python_workers_get_a_ring_on_demand() {
    let node = Node::with_control_and_ring_nodes("py-ring-od");
    let args = |r: usize| {
        let mut a = on_demand_args(&node, r);
        a.extend([
            "--pin-dir".into(),
            node.pin_dirs[r].to_string_lossy().into_owned(),
            "--ring-len".into(),
            RING_LEN.to_string(),
            "--threshold".into(),
            RING_THRESHOLD.to_string(),
        ]);
        a
    };
    let results = node.run_workers("netns_ring.py", args, Duration::from_secs(120));
    assert_ranks_done(&results, "netns_ring.py", &["ok: served star 2 ring 5", "ok: the ring on demand"]);
    let since = Instant::now();
    while node.ring_nodes.iter().any(|a| !a.status().rings.is_empty()) {
        assert!(since.elapsed() < Duration::from_secs(3), "the run's ring is left on the workers' nodes after the run");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn python_workers_allreduce_and_broadcast_through_a_node_served_job() {
    let node = Node::up("py-coll");
    let args = |_r: usize| {
        vec![
            "--job".into(),
            JOBS[0].to_string(),
            "--mismatch-job".into(),
            JOBS[1].to_string(),
            "--striped-jobs".into(),
            format!("{},{}", JOBS[3], JOBS[4]),
        ]
    };
    let results = node.run_workers("netns_collectives.py", args, Duration::from_secs(180));
    for (r, (status, text)) in results.iter().enumerate() {
        assert!(
            status.success(),
            "rank {r}: netns_collectives.py failed ({status}):\n{text}"
        );
        assert!(
            text.trim_end().ends_with("done"),
            "rank {r} did not finish:\n{text}"
        );
        assert!(
            text.contains("ok: float32 numpy allreduce mean"),
            "rank {r}:\n{text}"
        );
        assert!(
            text.contains("ok: striped over jobs [14, 15]: float32"),
            "rank {r}:\n{text}"
        );
        assert!(
            text.contains("ok: wrong length (") && text.contains("CommTimeoutError"),
            "rank {r}:\n{text}"
        );
    }
}

/// An outside client's report (issue #42): four Python workers ran
/// exactly; four fresh worker processes against the same running node then
/// failed every call (CommTimeoutError, round 0). Three consecutive runs of
/// fresh processes on one job, each built with a plain `from_config`, must
/// each complete exactly.
#[test]
fn consecutive_python_runs_on_one_running_node_each_complete() {
    let node = Node::up("py-rerun");
    let args = |_r: usize| vec!["--job".into(), JOBS[0].to_string()];
    for run in 0..3 {
        let results = node.run_workers("netns_rerun.py", args, Duration::from_secs(60));
        for (r, (status, text)) in results.iter().enumerate() {
            assert!(status.success(), "run {run}, rank {r}: netns_rerun.py failed ({status}):\n{text}");
            assert!(text.trim_end().ends_with("done"), "run {run}, rank {r} did not finish:\n{text}");
        }
    }
}

#[test]
fn ddp_with_the_aggbox_hook_trains_like_gloo() {
    let node = Node::up("py-ddp");
    let master = node.tb.host(1).addr.to_string();
    let args = |_r: usize| {
        vec![
            "--job".into(),
            JOBS[2].to_string(),
            "--master-addr".into(),
            master.clone(),
            "--master-port".into(),
            "29600".into(),
            "--steps".into(),
            "40".into(),
        ]
    };
    let results = node.run_workers("netns_ddp.py", args, Duration::from_secs(300));
    for (r, (status, text)) in results.iter().enumerate() {
        assert!(
            status.success(),
            "rank {r}: netns_ddp.py failed ({status}):\n{text}"
        );
        assert!(
            text.trim_end().ends_with("done"),
            "rank {r} did not finish:\n{text}"
        );
        assert!(text.contains("parameters differ by"), "rank {r}:\n{text}");
    }
}

/// What a rank of the torch backend's tests finds in its environment: the
/// node's control endpoint and the credential, nothing of the node's file.
fn backend_env(node: &Node) -> Vec<(&'static str, String)> {
    vec![
        ("AGGBOX_NODE", format!("{}:{CONTROL_PORT}", node.tb.host(0).addr)),
        ("AGGBOX_TENANT", TENANT.into()),
        ("AGGBOX_KEY", TENANT_KEY.into()),
    ]
}

/// `python3 python/tests/SCRIPT --rank R --world W --master-addr A
/// --master-port P` and `extra`, for [`Node::run_ranks`] of `world` ranks.
fn torch_argv(script: &str, master: &str, port: u16, world: usize, extra: &[&str]) -> impl Fn(usize) -> Vec<String> {
    let script = repo().join("python/tests").join(script).to_string_lossy().into_owned();
    let (master, extra): (String, Vec<String>) = (master.into(), extra.iter().map(|s| s.to_string()).collect());
    move |r| {
        let mut v = vec![script.clone(), "--rank".into(), r.to_string(), "--world".into(), world.to_string()];
        v.extend(["--master-addr".into(), master.clone(), "--master-port".into(), port.to_string()]);
        v.extend(extra.iter().cloned());
        v
    }
}

/// The backend "aggbox" (aggbox.torch) on `workers` ranks: every
/// collective × dtype × op × size of netns_torch_backend.py's table against
/// numpy, each call's serving path asserted from the process group's
/// counters (with the route forced to AggBox, AGGBOX_TORCH_ROUTE=aggbox, so
/// that the path is the one the table names whatever Gloo's speed); the
/// route policies "gloo" (calls issued to Gloo at once, in order with the
/// group's queued calls) and "measure" on groups of their own; async
/// works, subgroups, a second init_process_group.
fn torch_backend_table(tag: &str, workers: usize, limit: Duration) {
    let node = Node::with_control_of(tag, workers);
    let master = node.tb.host(1).addr.to_string();
    let mut env = backend_env(&node);
    env.push(("AGGBOX_TORCH_ROUTE", "aggbox".into()));
    let results = node.run_ranks(torch_argv("netns_torch_backend.py", &master, 29610, workers, &[]), &env, limit);
    for (r, (status, text)) in results.iter().enumerate() {
        assert!(status.success(), "rank {r}: netns_torch_backend.py failed ({status}):\n{text}");
        assert!(text.trim_end().ends_with("done"), "rank {r} did not finish:\n{text}");
        assert!(text.contains("ok: allreduce table"), "rank {r}:\n{text}");
        assert!(text.contains("ok: route gloo") && text.contains("ok: route measure"), "rank {r}:\n{text}");
    }
}

#[test]
fn torch_backend_answers_every_collective_like_the_reference() {
    torch_backend_table("py-torch", WORKERS, Duration::from_secs(400));
}

/// The same table on 8 ranks (9 namespaces; the 2-vCPU VM runs it in
/// minutes).
#[test]
fn torch_backend_answers_every_collective_like_the_reference_on_8_ranks() {
    torch_backend_table("py-torch-8", 8, Duration::from_secs(900));
}

/// DDP of a small CNN with a synchronised BatchNorm, 50 steps, backend
/// "aggbox" against "gloo" from the same seeds (netns_torch_ddp.py), on
/// `workers` ranks.
fn torch_ddp(tag: &str, workers: usize, limit: Duration) {
    let node = Node::with_control_of(tag, workers);
    let master = node.tb.host(1).addr.to_string();
    let argv = torch_argv("netns_torch_ddp.py", &master, 29620, workers, &["--steps", "50"]);
    let results = node.run_ranks(argv, &backend_env(&node), limit);
    assert_ranks_done(&results, "netns_torch_ddp.py", &["ok: aggbox and gloo agree"]);
}

#[test]
fn torch_backend_trains_ddp_like_gloo() {
    torch_ddp("py-torch-ddp", WORKERS, Duration::from_secs(400));
}

#[test]
fn torch_backend_trains_ddp_like_gloo_on_8_ranks() {
    torch_ddp("py-torch-ddp-8", 8, Duration::from_secs(900));
}

/// Accuracy, not only agreement step by step: DDP of a small MLP on
/// scikit-learn's digits (Debian's python3-sklearn), 600 steps from the
/// same seeds and data order on "gloo" and on "aggbox" (route "aggbox"),
/// with float32 gradients, torch's fp16 compression hook and bfloat16
/// gradients (torch's bf16 hook on "aggbox", the same cast with Gloo's
/// float32 sum on "gloo"): every run reaches 95 % on the 600 test images,
/// the two backends within 0.5 points of each other for each dtype, every
/// call of the "aggbox" runs served by AggBox (netns_torch_accuracy.py).
#[test]
fn ddp_on_aggbox_reaches_gloos_test_accuracy_on_digits() {
    let node = Node::with_control("py-torch-digits");
    let master = node.tb.host(1).addr.to_string();
    let argv = torch_argv("netns_torch_accuracy.py", &master, 29690, WORKERS, &["--steps", "600"]);
    let results = node.run_ranks(argv, &backend_env(&node), Duration::from_secs(400));
    assert_ranks_done(&results, "netns_torch_accuracy.py", &["ok: every run reached 95.0 %"]);
}

/// torch's own fp16 compression hook (`default_hooks.fp16_compress_hook`)
/// on DDP over "aggbox" (route "aggbox") against the same over "gloo"
/// (netns_torch_fp16_hook.py): every step's gradients within each path's
/// float16 bound of the exact sum, the parameters and losses of the two
/// runs together, every call served by AggBox.
#[test]
fn fp16_compress_hook_on_aggbox_trains_like_gloo() {
    let node = Node::with_control("py-torch-fp16");
    let master = node.tb.host(1).addr.to_string();
    let argv = torch_argv("netns_torch_fp16_hook.py", &master, 29660, WORKERS, &["--steps", "6"]);
    let results = node.run_ranks(argv, &backend_env(&node), Duration::from_secs(300));
    assert_ranks_done(&results, "netns_torch_fp16_hook.py", &["ok: fp16_compress_hook on aggbox agrees with gloo"]);
}

/// The backend on jobs of the node's file, a star striped over two, with a
/// ring beside it (AGGBOX_TORCH_CONFIG, AGGBOX_TORCH_JOB=14,15, AGGBOX_TORCH_RING,
/// AGGBOX_TORCH_PIN_DIR by `{rank}`, AGGBOX_TORCH_RING_THRESHOLD): every
/// rank's host serves the ring; int32 and float32 allreduces below and from
/// the threshold are exact (floats within the bound), four went to the star
/// and four to the ring (the communicator's `served`), all counted
/// "aggbox" (netns_torch_ring.py).
#[test]
fn torch_backend_reaches_the_ring_of_a_node_files_job() {
    let node = Node::with_ring("py-torch-ring");
    let master = node.tb.host(1).addr.to_string();
    let pattern = node.pin_dirs[0].to_string_lossy().replace("-r0/", "-r{rank}/");
    assert!(pattern.contains("{rank}"), "the ranks' pin directories differ by rank: {pattern}");
    let env = vec![
        ("AGGBOX_NODE", node.tb.host(0).addr.to_string()),
        ("AGGBOX_TORCH_CONFIG", node.config.to_string_lossy().into_owned()),
        // The star striped over two jobs, the ring beside it.
        ("AGGBOX_TORCH_JOB", format!("{},{}", JOBS[3], JOBS[4])),
        ("AGGBOX_TORCH_RING", RING.to_string()),
        ("AGGBOX_TORCH_PIN_DIR", pattern),
        ("AGGBOX_TORCH_RING_THRESHOLD", RING_THRESHOLD.to_string()),
        ("AGGBOX_TORCH_ROUTE", "aggbox".into()),
    ];
    let extra = ["--ring-len".to_string(), RING_LEN.to_string(), "--threshold".to_string(), RING_THRESHOLD.to_string()];
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let results = node.run_ranks(torch_argv("netns_torch_ring.py", &master, 29680, WORKERS, &extra), &env, Duration::from_secs(300));
    assert_ranks_done(&results, "netns_torch_ring.py", &["ok: served star 4 ring 4"]);
}

/// A script that knows nothing of AggBox (it imports torch only and takes
/// `--dist-backend`), run through `python -m aggbox.torch.run` with
/// `--dist-backend aggbox` and the default route ("measure"): it trains, its
/// collectives were served by AggBox (each class's first trial is AggBox's)
/// and none fell back to Gloo (a call the route stepped aside is counted as
/// "stepped_aside"), by the counters AGGBOX_TORCH_STATS prints at exit.
#[test]
fn an_unmodified_script_runs_on_aggbox_through_the_launcher() {
    let node = Node::with_control("py-torch-run");
    let master = node.tb.host(1).addr.to_string();
    let script = repo().join("python/tests/plain_ddp_script.py").to_string_lossy().into_owned();
    let argv = |r: usize| {
        vec![
            "-m".into(), "aggbox.torch.run".into(), script.clone(),
            "--dist-backend".into(), "aggbox".into(),
            "--dist-url".into(), format!("tcp://{master}:29630"),
            "--world-size".into(), WORKERS.to_string(), "--rank".into(), r.to_string(),
        ]
    };
    let mut env = backend_env(&node);
    env.push(("AGGBOX_TORCH_STATS", "1".into()));
    let results = node.run_ranks(argv, &env, Duration::from_secs(300));
    for (r, (status, text)) in results.iter().enumerate() {
        assert!(status.success(), "rank {r}: the script under the launcher failed ({status}):\n{text}");
        assert!(text.contains("final loss"), "rank {r} did not finish:\n{text}");
        let stats = text.lines().find(|l| l.starts_with("aggbox.torch: served")).unwrap_or_else(|| panic!("rank {r}: no counters:\n{text}"));
        for served in ["allreduce/aggbox", "broadcast/aggbox", "allgather/aggbox", "barrier/aggbox"] {
            assert!(stats.contains(served), "rank {r}: {served} missing in {stats}");
        }
        assert!(!stats.contains("/gloo"), "rank {r}: a call fell back to Gloo: {stats}");
    }
}

/// kill -9 of rank 3 in the middle of a run: every other rank's next
/// collective raises a RuntimeError naming rank 3 within the process
/// group's timeout (netns_torch_kill.py), and exits.
#[test]
fn a_rank_killed_mid_run_is_named_within_the_timeout() {
    let node = Node::with_control("py-torch-kill");
    let master = node.tb.host(1).addr.to_string();
    let results = node.run_ranks(torch_argv("netns_torch_kill.py", &master, 29640, WORKERS, &["--timeout", "10"]), &backend_env(&node), Duration::from_secs(120));
    for (r, (status, text)) in results.iter().enumerate() {
        if r == 3 {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(9), "rank 3 was to kill itself:\n{text}");
            continue;
        }
        assert!(status.success(), "rank {r}: netns_torch_kill.py failed ({status}):\n{text}");
        assert!(text.contains("ok: RuntimeError naming rank 3"), "rank {r}:\n{text}");
        assert!(text.trim_end().ends_with("done"), "rank {r} did not finish:\n{text}");
    }
}
