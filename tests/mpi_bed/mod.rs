//! The testbed of the MPI tests (tests/mpi_collectives.rs: jobs of the
//! node's file; tests/mpi_on_demand.rs: jobs on demand, docs/MPI.md).
//!
//! Host 0 of a netns testbed runs only `aggbox attach eth0` (with jobs on
//! demand over several nodes, the other nodes are the hosts after the
//! ranks); hosts 1..=N are the MPI ranks, started across the namespaces by
//! `mpirun` (Open MPI: its rsh agent is scripts/mpi_netns_agent.sh; MPICH:
//! Hydra with the same agent as its ssh launcher). Here: the bed, the
//! program tests/mpi/collectives.c and its runs (also one held at a pause,
//! [`PausedRun`]), and the library's counters lines.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::live_attach::LiveAttach;
use crate::testbed::{Testbed, TestbedConfig};

pub const JOB: u16 = 11;
pub const JOB_PORT: u16 = 7600;
pub const RESULT_PORT: u16 = 7601;
pub const GROUP: u16 = 4;
pub const DATA_PORT: u16 = 7700;
/// A second job, of the even MPI_COMM_WORLD ranks in reverse order: it
/// serves collectives.c's communicator of those ranks (MPI_Comm_split),
/// each rank's data socket on HALF_DATA_PORT (its own port: a socket per
/// job).
pub const HALF_JOB: u16 = 12;
pub const HALF_JOB_PORT: u16 = 7610;
pub const HALF_RESULT_PORT: u16 = 7611;
pub const HALF_GROUP: u16 = 5;
pub const HALF_DATA_PORT: u16 = 7701;
/// Jobs on demand: the node's control endpoint (on another port than the
/// default, so that the library's parsing of IP:PORT is what finds it), its
/// key file's tenant and key, and the tenant's quota of live jobs (a run of
/// collectives.c holds 5: MPI_COMM_WORLD's, and one for each half of the
/// world in either order).
pub const CONTROL_PORT: u16 = 7481;
pub const TENANT: &str = "mpi";
pub const KEY: &str = "3a7f0c1d2e4b5a6978877665544332211000ffeeddccbbaa9988776655443322";
pub const DEMAND_JOBS: u32 = 8;
/// Per-call deadline of the ranks' communicators: a failure shows well
/// within the test's own limit on each run (RUN_LIMIT).
pub const DEADLINE_MS: u64 = 10_000;
pub const RUN_LIMIT: Duration = Duration::from_secs(180);

/// The MPI implementations `make mpi` builds the library for.
#[derive(Clone, Copy, Debug)]
pub enum Mpi {
    OpenMpi,
    Mpich,
}

impl Mpi {
    pub fn name(self) -> &'static str {
        match self {
            Mpi::OpenMpi => "openmpi",
            Mpi::Mpich => "mpich",
        }
    }
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A run with the library `mpi`: where its jobs come from (`source`), then
/// what every run here sets (a deadline, the counters at MPI_Finalize, every
/// call AggBox can serve through AggBox: what these tests check is AggBox's
/// serving; the measured choice has its own test), then `extra`.
fn library_env(mpi: Mpi, source: &[(&str, String)], extra: &[(&str, String)]) -> Vec<(String, String)> {
    let mut env = vec![("LD_PRELOAD".to_string(), library(mpi).display().to_string())];
    let common = [
        ("AGGBOX_MPI_DEADLINE_MS", DEADLINE_MS.to_string()),
        ("AGGBOX_MPI_STATS", "1".to_string()),
        ("AGGBOX_MPI_ROUTE", "aggbox".to_string()),
    ];
    env.extend(source.iter().chain(&common).chain(extra).map(|(k, v)| (k.to_string(), v.clone())));
    env
}

/// `libaggbox_mpi_IMPL.so` of this test's profile, which `make mpi` builds.
pub fn library(mpi: Mpi) -> PathBuf {
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    let lib = repo().join("target").join(profile).join(format!("libaggbox_mpi_{}.so", mpi.name()));
    assert!(lib.exists(), "{} is missing: run `make mpi` (PROFILE={profile}) first", lib.display());
    lib
}

/// tests/mpi/collectives.c compiled with `mpicc.IMPL` into `dir`.
pub fn program(mpi: Mpi, dir: &Path) -> PathBuf {
    let out = dir.join(format!("collectives-{}", mpi.name()));
    let cc = format!("mpicc.{}", mpi.name());
    let status = Command::new(&cc)
        .args(["-O2", "-Wall", "-o"])
        .arg(&out)
        .arg(repo().join("tests/mpi/collectives.c"))
        .status()
        .unwrap_or_else(|e| panic!("{cc}: {e} (make deps installs it)"));
    assert!(status.success(), "{cc} tests/mpi/collectives.c failed");
    out
}

/// A testbed whose host 0 serves the job and hosts 1..=ranks are the ranks
/// (jobs on demand over several nodes: the other nodes are the hosts after
/// the ranks).
pub struct MpiBed {
    // Field order: the attachments stop before the testbed goes.
    pub attach: Option<LiveAttach>,
    pub more_nodes: Vec<LiveAttach>,
    pub tb: Testbed,
    pub tag: String,
    pub text: String,
    pub dir: PathBuf,
    pub config: PathBuf,
    pub hostfile: PathBuf,
    pub ranks: usize,
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// One bed at a time: each MPI run is many processes and threads, and the
/// deadlines should measure the network, not a 2-CPU machine shared by
/// four jobs of this test.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl MpiBed {
    /// Host 0 serves JOB and HALF_JOB of its file.
    pub fn up(tag: &str, ranks: usize) -> MpiBed {
        MpiBed::with_nodes(tag, ranks, 1, |tb, _dir| MpiBed::jobs_text(tb, ranks))
    }

    /// Host 0's file has no `[[job]]`: it serves jobs on demand to the
    /// tenant TENANT (key KEY, at most DEMAND_JOBS live jobs) on
    /// CONTROL_PORT.
    pub fn on_demand(tag: &str, ranks: usize) -> MpiBed {
        MpiBed::on_demand_nodes(tag, ranks, 1)
    }

    /// [`MpiBed::on_demand`] with `nodes` nodes, each serving jobs on
    /// demand alike: host 0, then hosts ranks+1 ..
    pub fn on_demand_nodes(tag: &str, ranks: usize, nodes: usize) -> MpiBed {
        MpiBed::with_nodes(tag, ranks, nodes, |_tb, dir| {
            let keys = dir.join("keys.toml");
            std::fs::write(&keys, format!("[[tenant]]\nname = \"{TENANT}\"\nkey = \"{KEY}\"\njobs = {DEMAND_JOBS}\n")).expect("write keys");
            std::fs::set_permissions(&keys, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod keys");
            format!("[node]\ncontrol = \"0.0.0.0:{CONTROL_PORT}\"\nkeys = \"{}\"\n", keys.display())
        })
    }

    pub fn with_nodes(tag: &str, ranks: usize, nodes: usize, text: impl FnOnce(&Testbed, &Path) -> String) -> MpiBed {
        MpiBed::with_testbed(tag, ranks, nodes, false, text)
    }

    /// [`MpiBed::with_nodes`] on a testbed whose veths forward XDP_TX
    /// (`xdp_tx`: a ring's members send on from XDP).
    pub fn with_testbed(tag: &str, ranks: usize, nodes: usize, xdp_tx: bool, text: impl FnOnce(&Testbed, &Path) -> String) -> MpiBed {
        assert!(nix::unistd::geteuid().is_root(), "tests/mpi_collectives.rs needs root (network namespaces, XDP)");
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let tb = Testbed::up(TestbedConfig { hosts: ranks + nodes, xdp_tx, ..Default::default() }).expect("testbed");
        let dir = std::env::temp_dir().join(format!("aggbox-mpi-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test dir");
        let text = text(&tb, &dir);
        let config = dir.join("node.toml");
        std::fs::write(&config, &text).expect("write config");
        let hostfile = dir.join("hosts");
        let hosts: String = (1..=ranks).map(|h| format!("{} slots=1\n", tb.host(h).netns)).collect();
        std::fs::write(&hostfile, hosts).expect("write hostfile");
        let more_nodes = (1..nodes)
            .map(|k| LiveAttach::start(&tb.host(ranks + k).netns, &format!("mpi-{tag}-{k}"), &text, &[]))
            .collect();
        let mut bed = MpiBed {
            attach: None,
            more_nodes,
            tb,
            tag: tag.to_string(),
            text,
            dir,
            config,
            hostfile,
            ranks,
            _serial: serial,
        };
        bed.restart_node();
        bed
    }

    /// Every node, host 0's first, and its testbed host.
    pub fn nodes(&self) -> Vec<(usize, &LiveAttach)> {
        let more = self.more_nodes.iter().enumerate().map(|(k, n)| (self.ranks + 1 + k, n));
        std::iter::once((0, self.node())).chain(more).collect()
    }

    /// Every node's control endpoint, `IP:PORT`, in the order of
    /// [`MpiBed::nodes`].
    pub fn controls(&self) -> Vec<String> {
        self.nodes().iter().map(|(h, _)| format!("{}:{CONTROL_PORT}", self.tb.host(*h).addr)).collect()
    }

    /// The file of [`MpiBed::up`].
    pub fn jobs_text(tb: &Testbed, ranks: usize) -> String {
        let workers: Vec<String> = (1..=ranks).map(|h| tb.host(h).addr.to_string()).collect();
        // World rank r is host r + 1: the even ranks, highest first.
        let half: Vec<String> = workers.iter().step_by(2).rev().cloned().collect();
        let job = |id: u16, port: u16, result_port: u16, group: u16, workers: &[String], data_port: u16| {
            format!(
                "[[job]]\nid = {id}\nport = {port}\nworkers = [{}]\nresult_port = {result_port}\nresult_group = {group}\nconsumer = \"node\"\n\n[[group]]\nid = {group}\nmembers = [{}]\n",
                workers.iter().map(|w| format!("\"{w}\"")).collect::<Vec<_>>().join(", "),
                workers.iter().map(|w| format!("\"{w}:{data_port}\"")).collect::<Vec<_>>().join(", "),
            )
        };
        format!(
            "{}\n{}",
            job(JOB, JOB_PORT, RESULT_PORT, GROUP, &workers, DATA_PORT),
            job(HALF_JOB, HALF_JOB_PORT, HALF_RESULT_PORT, HALF_GROUP, &half, HALF_DATA_PORT)
        )
    }

    /// Starts `aggbox attach` on host 0 afresh (stopping the running one),
    /// so a run starts from a node that has seen nothing of the job (runs
    /// on a running node are tested by
    /// `consecutive_runs_on_one_running_node_all_succeed_with_exact_results`).
    pub fn restart_node(&mut self) {
        drop(self.attach.take());
        self.attach = Some(LiveAttach::start(&self.tb.host(0).netns, &format!("mpi-{}", self.tag), &self.text, &[]));
    }

    pub fn node(&self) -> &LiveAttach {
        self.attach.as_ref().expect("aggbox attach runs")
    }

    /// The environment of a run with the library: the node's address, the
    /// job's configuration, and `extra`.
    pub fn aggbox_env(&self, mpi: Mpi, extra: &[(&str, String)]) -> Vec<(String, String)> {
        let source = [
            ("AGGBOX_MPI_CONFIG", self.config.display().to_string()),
            ("AGGBOX_MPI_JOB", JOB.to_string()),
            ("AGGBOX_MPI_NODE", self.tb.host(0).addr.to_string()),
            ("AGGBOX_MPI_DATA_PORT", DATA_PORT.to_string()),
        ];
        library_env(mpi, &source, extra)
    }

    /// The environment of a run with jobs on demand: the node's control
    /// endpoint and the credential (tenant TENANT, key `key`), no file, no
    /// data port; and `extra`.
    pub fn on_demand_env(&self, mpi: Mpi, key: &str, extra: &[(&str, String)]) -> Vec<(String, String)> {
        let source = [
            ("AGGBOX_MPI_NODE", format!("{}:{CONTROL_PORT}", self.tb.host(0).addr)),
            ("AGGBOX_TENANT", TENANT.to_string()),
            ("AGGBOX_KEY", key.to_string()),
        ];
        library_env(mpi, &source, extra)
    }

    /// Runs `program args` as `np` ranks (rank r on host r+1) with `mpirun`
    /// of `mpi`, started in host 1's namespace, the variables `env` given
    /// to every rank; killed (by the pid of the `timeout` this test
    /// started) after RUN_LIMIT.
    pub fn mpirun(&self, mpi: Mpi, np: usize, env: &[(String, String)], program: &Path, args: &[&str]) -> Output {
        self.mpirun_with(mpi, np, env, &[], program, args)
    }

    /// [`MpiBed::mpirun`] with `launcher` options of mpirun's own.
    pub fn mpirun_with(
        &self,
        mpi: Mpi,
        np: usize,
        env: &[(String, String)],
        launcher: &[&str],
        program: &Path,
        args: &[&str],
    ) -> Output {
        let started = Instant::now();
        let out = self.command(mpi, np, env, launcher, program, args).output().expect("spawn mpirun");
        log_run(mpi, np, program, args, &out, started);
        out
    }

    /// The command of [`MpiBed::mpirun_with`], for a test that does
    /// something while the program runs.
    pub fn command(
        &self,
        mpi: Mpi,
        np: usize,
        env: &[(String, String)],
        launcher: &[&str],
        program: &Path,
        args: &[&str],
    ) -> Command {
        let agent = repo().join("scripts/mpi_netns_agent.sh");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.tb.host(1).netns, "timeout", "--kill-after=5"])
            .arg(RUN_LIMIT.as_secs().to_string());
        match mpi {
            Mpi::OpenMpi => {
                cmd.args(["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()])
                    .arg("--hostfile")
                    .arg(&self.hostfile)
                    .arg("--mca")
                    .arg("plm_rsh_agent")
                    .arg(&agent)
                    .args(["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "eth0"])
                    .args(["--mca", "oob_tcp_if_include", "eth0"]);
                for (k, v) in env {
                    cmd.arg("-x").arg(format!("{k}={v}"));
                }
            }
            Mpi::Mpich => {
                let hosts: Vec<String> = (1..=np).map(|h| self.tb.host(h).netns.clone()).collect();
                cmd.args(["mpiexec.mpich", "-launcher", "ssh", "-launcher-exec"])
                    .arg(&agent)
                    .args(["-iface", "eth0", "-hosts", &hosts.join(","), "-np", &np.to_string()]);
                for (k, v) in env {
                    cmd.args(["-genv", k, v]);
                }
            }
        }
        cmd.args(launcher).arg(program).args(args);
        cmd
    }
}

/// Logs a run of `program` and its stderr (the test's output shows it on
/// failure).
pub fn log_run(mpi: Mpi, np: usize, program: &Path, args: &[&str], out: &Output, started: Instant) {
    eprintln!(
        "{} -np {np} {} {args:?}: {} in {:.1} s\n--- stderr ---\n{}",
        mpi.name(),
        program.display(),
        out.status,
        started.elapsed().as_secs_f64(),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Drop for MpiBed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Rank 0's `result` lines.
pub fn result_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("result ")).map(str::to_string).collect()
}

/// Every rank printed its counters (`AGGBOX_MPI_STATS=1`) as `want(r)`
/// (mpirun forwards the ranks' stderr interleaved, so searched for, not
/// split into lines).
pub fn assert_counters(out: &Output, ranks: usize, want: impl Fn(usize) -> String, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    for r in 0..ranks {
        let line = format!("aggbox-mpi: rank {r}: served {}", want(r));
        assert!(stderr.contains(&line), "{what}: rank {r} printed no \"{line}\" in:\n{stderr}");
    }
}

/// Rank `r`'s counters line (`aggbox-mpi: rank R: served ...`).
pub fn counters_line(out: &Output, r: usize) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let head = format!("aggbox-mpi: rank {r}: served ");
    stderr
        .lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("rank {r} printed no counters line in:\n{stderr}"))
        .to_string()
}

/// The value of `NAME=` after `section` in a counters line.
pub fn counter(line: &str, section: &str, name: &str) -> u64 {
    let rest = &line[line.find(section).unwrap_or_else(|| panic!("no {section:?} in {line}")) + section.len()..];
    let at = rest.find(&format!("{name}=")).unwrap_or_else(|| panic!("no {name} after {section:?} in {line}"));
    rest[at + name.len() + 1..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

/// The calls of job `job` the ring served, from a counters line's `; job J
/// ring served N`.
pub fn ring_calls(line: &str, job: u16) -> u64 {
    line.split(&format!("; job {job} ring served "))
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no ring count of job {job} in {line}"))
}

/// The ops collectives.c runs, every one the shim serves on int32: the
/// rows of include/aggbox/ops.def that name an MPI op (MPI_SUM ...
/// MPI_BXOR, MPI_LAND, MPI_LOR).
pub const MPI_OPS: usize = 9;

/// A run of `collectives pause DIR N` (tests/mpi/collectives.c) held at
/// its pause: every rank's calls before it completed (DIR/paused), and
/// every rank waits for DIR/resume, which [`PausedRun::resume`] (or drop)
/// creates.
pub struct PausedRun {
    child: Option<Child>,
    dir: PathBuf,
    mpi: Mpi,
    np: usize,
    program: PathBuf,
    args: Vec<String>,
    started: Instant,
}

impl PausedRun {
    /// Starts the program over `np` ranks with `env` and returns at its
    /// pause; `n` elements a call.
    pub fn start(bed: &MpiBed, mpi: Mpi, np: usize, env: &[(String, String)], program: &Path, n: usize) -> PausedRun {
        let dir = bed.dir.join("pause");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("pause dir");
        let args = vec!["pause".to_string(), dir.display().to_string(), n.to_string()];
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let started = Instant::now();
        let child = bed
            .command(mpi, np, env, &[], program, &argv)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn mpirun");
        let mut run = PausedRun { child: Some(child), dir, mpi, np, program: program.to_path_buf(), args, started };
        while !run.dir.join("paused").exists() {
            let child = run.child.as_mut().expect("running");
            if let Some(status) = child.try_wait().expect("mpirun's status") {
                let out = run.finish();
                panic!("the run ended ({status}) before its pause:\n{}", String::from_utf8_lossy(&out.stderr));
            }
            assert!(started.elapsed() < Duration::from_secs(120), "no pause within 120 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        run
    }

    /// Lets the ranks go on; the run's output once it ended.
    pub fn resume(mut self) -> Output {
        self.finish()
    }

    pub fn finish(&mut self) -> Output {
        std::fs::write(self.dir.join("resume"), b"").expect("create the resume file");
        let child = self.child.take().expect("a running program");
        let out = child.wait_with_output().expect("mpirun's output");
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        log_run(self.mpi, self.np, &self.program, &args, &out, self.started);
        out
    }
}

impl Drop for PausedRun {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.finish();
        }
    }
}

/// The `/metrics` text of the node on `host` (its default address,
/// 127.0.0.1:9435 in its namespace).
pub fn scrape(bed: &MpiBed, host: usize) -> String {
    use std::io::{Read, Write};
    bed.tb
        .in_host(host, || {
            let mut s = std::net::TcpStream::connect(aggbox::config::DEFAULT_METRICS).expect("connect to /metrics");
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").expect("request /metrics");
            let mut out = String::new();
            s.read_to_string(&mut out).expect("read /metrics");
            out
        })
        .expect("the node's namespace")
}
