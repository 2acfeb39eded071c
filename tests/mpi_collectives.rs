//! MPI programs through the PMPI interposition library (docs/MPI.md).
//!
//! Host 0 of a netns testbed runs only `aggbox attach eth0` with a
//! node-served job (`consumer = "node"`); hosts 1..=N are the MPI ranks,
//! started across the namespaces by `mpirun` (Open MPI: its rsh agent is
//! scripts/mpi_netns_agent.sh; MPICH: Hydra with the same agent as its ssh
//! launcher). The program tests/mpi/collectives.c runs every call the
//! library serves (every op, MPI_IN_PLACE, roots other than 0, an int32 SUM
//! that wraps) and some it must pass through, each checked on every rank
//! against a locally computed MPI result; it runs once without the library
//! and once with it (`LD_PRELOAD`), and rank 0's result lines of the two
//! runs must be identical. The library's counters (`AGGBOX_MPI_STATS=1`)
//! must show every served call served and every other call passed through,
//! and the node's XDP counters that the contributions reached it. A world
//! size other than the job's worker count fails at `MPI_Init` with the
//! reason, a rank killed mid-call makes the others fail within their
//! deadline rather than hang, and consecutive runs on one running node
//! each start where the last left off (the position query at MPI_Init).
//!
//! Jobs on demand: on a node whose file has no `[[job]]` and serves a key
//! file's tenant, the same program with only the node's control endpoint
//! and the credential (no file on the ranks) is bit-identical to plain MPI
//! and served by AggBox, every communicator by a job of its own, each run
//! by new jobs that end at MPI_Finalize; a refused or unreachable node
//! makes the run fall back to PMPI, saying why (or fail, when asked).
//!
//! Needs root and `make mpi` (the libraries and mpicc of both
//! implementations); fails (never skips) otherwise:
//! `make mpi && sudo -E cargo test --release --test mpi_collectives`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod live_attach;
#[path = "../src/testing/impair/mod.rs"]
mod impair;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

const JOB: u16 = 11;
const JOB_PORT: u16 = 7600;
const RESULT_PORT: u16 = 7601;
const GROUP: u16 = 4;
const DATA_PORT: u16 = 7700;
/// A second job, of the even MPI_COMM_WORLD ranks in reverse order: it
/// serves collectives.c's communicator of those ranks (MPI_Comm_split),
/// each rank's data socket on HALF_DATA_PORT (its own port: a socket per
/// job).
const HALF_JOB: u16 = 12;
const HALF_JOB_PORT: u16 = 7610;
const HALF_RESULT_PORT: u16 = 7611;
const HALF_GROUP: u16 = 5;
const HALF_DATA_PORT: u16 = 7701;
/// Jobs on demand: the node's control endpoint (on another port than the
/// default, so that the library's parsing of IP:PORT is what finds it), its
/// key file's tenant and key, and the tenant's quota of live jobs (a run of
/// collectives.c holds 5: MPI_COMM_WORLD's, and one for each half of the
/// world in either order).
const CONTROL_PORT: u16 = 7481;
const TENANT: &str = "mpi";
const KEY: &str = "3a7f0c1d2e4b5a6978877665544332211000ffeeddccbbaa9988776655443322";
const DEMAND_JOBS: u32 = 8;
/// Per-call deadline of the ranks' communicators: a failure shows well
/// within the test's own limit on each run (RUN_LIMIT).
const DEADLINE_MS: u64 = 10_000;
const RUN_LIMIT: Duration = Duration::from_secs(180);

/// The MPI implementations `make mpi` builds the library for.
#[derive(Clone, Copy, Debug)]
enum Mpi {
    OpenMpi,
    Mpich,
}

impl Mpi {
    fn name(self) -> &'static str {
        match self {
            Mpi::OpenMpi => "openmpi",
            Mpi::Mpich => "mpich",
        }
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `libaggbox_mpi_IMPL.so` of this test's profile, which `make mpi` builds.
fn library(mpi: Mpi) -> PathBuf {
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    let lib = repo().join("target").join(profile).join(format!("libaggbox_mpi_{}.so", mpi.name()));
    assert!(lib.exists(), "{} is missing: run `make mpi` (PROFILE={profile}) first", lib.display());
    lib
}

/// tests/mpi/collectives.c compiled with `mpicc.IMPL` into `dir`.
fn program(mpi: Mpi, dir: &Path) -> PathBuf {
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
struct MpiBed {
    // Field order: the attachments stop before the testbed goes.
    attach: Option<LiveAttach>,
    more_nodes: Vec<LiveAttach>,
    tb: Testbed,
    tag: String,
    text: String,
    dir: PathBuf,
    config: PathBuf,
    hostfile: PathBuf,
    ranks: usize,
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// One bed at a time: each MPI run is many processes and threads, and the
/// deadlines should measure the network, not a 2-CPU machine shared by
/// four jobs of this test.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl MpiBed {
    /// Host 0 serves JOB and HALF_JOB of its file.
    fn up(tag: &str, ranks: usize) -> MpiBed {
        MpiBed::with_nodes(tag, ranks, 1, |tb, _dir| MpiBed::jobs_text(tb, ranks))
    }

    /// Host 0's file has no `[[job]]`: it serves jobs on demand to the
    /// tenant TENANT (key KEY, at most DEMAND_JOBS live jobs) on
    /// CONTROL_PORT.
    fn on_demand(tag: &str, ranks: usize) -> MpiBed {
        MpiBed::on_demand_nodes(tag, ranks, 1)
    }

    /// [`MpiBed::on_demand`] with `nodes` nodes, each serving jobs on
    /// demand alike: host 0, then hosts ranks+1 ..
    fn on_demand_nodes(tag: &str, ranks: usize, nodes: usize) -> MpiBed {
        MpiBed::with_nodes(tag, ranks, nodes, |_tb, dir| {
            let keys = dir.join("keys.toml");
            std::fs::write(&keys, format!("[[tenant]]\nname = \"{TENANT}\"\nkey = \"{KEY}\"\njobs = {DEMAND_JOBS}\n")).expect("write keys");
            std::fs::set_permissions(&keys, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod keys");
            format!("[node]\ncontrol = \"0.0.0.0:{CONTROL_PORT}\"\nkeys = \"{}\"\n", keys.display())
        })
    }

    fn with_nodes(tag: &str, ranks: usize, nodes: usize, text: impl FnOnce(&Testbed, &Path) -> String) -> MpiBed {
        assert!(nix::unistd::geteuid().is_root(), "tests/mpi_collectives.rs needs root (network namespaces, XDP)");
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let tb = Testbed::up(TestbedConfig { hosts: ranks + nodes, ..Default::default() }).expect("testbed");
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
    fn nodes(&self) -> Vec<(usize, &LiveAttach)> {
        let more = self.more_nodes.iter().enumerate().map(|(k, n)| (self.ranks + 1 + k, n));
        std::iter::once((0, self.node())).chain(more).collect()
    }

    /// Every node's control endpoint, `IP:PORT`, in the order of
    /// [`MpiBed::nodes`].
    fn controls(&self) -> Vec<String> {
        self.nodes().iter().map(|(h, _)| format!("{}:{CONTROL_PORT}", self.tb.host(*h).addr)).collect()
    }

    /// The file of [`MpiBed::up`].
    fn jobs_text(tb: &Testbed, ranks: usize) -> String {
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
    fn restart_node(&mut self) {
        drop(self.attach.take());
        self.attach = Some(LiveAttach::start(&self.tb.host(0).netns, &format!("mpi-{}", self.tag), &self.text, &[]));
    }

    fn node(&self) -> &LiveAttach {
        self.attach.as_ref().expect("aggbox attach runs")
    }

    /// The environment of a run with the library: the node's address, the
    /// job's configuration, and `extra`.
    fn aggbox_env(&self, mpi: Mpi, extra: &[(&str, String)]) -> Vec<(String, String)> {
        let mut env = vec![
            ("LD_PRELOAD".to_string(), library(mpi).display().to_string()),
            ("AGGBOX_MPI_CONFIG".to_string(), self.config.display().to_string()),
            ("AGGBOX_MPI_JOB".to_string(), JOB.to_string()),
            ("AGGBOX_MPI_NODE".to_string(), self.tb.host(0).addr.to_string()),
            ("AGGBOX_MPI_DATA_PORT".to_string(), DATA_PORT.to_string()),
            ("AGGBOX_MPI_DEADLINE_MS".to_string(), DEADLINE_MS.to_string()),
            ("AGGBOX_MPI_STATS".to_string(), "1".to_string()),
            // What these tests check is AggBox's serving; the measured
            // choice has its own test.
            ("AGGBOX_MPI_ROUTE".to_string(), "aggbox".to_string()),
        ];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        env
    }

    /// The environment of a run with jobs on demand: the node's control
    /// endpoint and the credential (tenant TENANT, key `key`), no file, no
    /// data port; and `extra`.
    fn on_demand_env(&self, mpi: Mpi, key: &str, extra: &[(&str, String)]) -> Vec<(String, String)> {
        let mut env = vec![
            ("LD_PRELOAD".to_string(), library(mpi).display().to_string()),
            ("AGGBOX_MPI_NODE".to_string(), format!("{}:{CONTROL_PORT}", self.tb.host(0).addr)),
            ("AGGBOX_TENANT".to_string(), TENANT.to_string()),
            ("AGGBOX_KEY".to_string(), key.to_string()),
            ("AGGBOX_MPI_DEADLINE_MS".to_string(), DEADLINE_MS.to_string()),
            ("AGGBOX_MPI_STATS".to_string(), "1".to_string()),
            ("AGGBOX_MPI_ROUTE".to_string(), "aggbox".to_string()),
        ];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        env
    }

    /// Runs `program args` as `np` ranks (rank r on host r+1) with `mpirun`
    /// of `mpi`, started in host 1's namespace, the variables `env` given
    /// to every rank; killed (by the pid of the `timeout` this test
    /// started) after RUN_LIMIT.
    fn mpirun(&self, mpi: Mpi, np: usize, env: &[(String, String)], program: &Path, args: &[&str]) -> Output {
        self.mpirun_with(mpi, np, env, &[], program, args)
    }

    /// [`MpiBed::mpirun`] with `launcher` options of mpirun's own.
    fn mpirun_with(
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
    fn command(
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
fn log_run(mpi: Mpi, np: usize, program: &Path, args: &[&str], out: &Output, started: Instant) {
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
fn result_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("result ")).map(str::to_string).collect()
}

/// Every rank printed its counters (`AGGBOX_MPI_STATS=1`) as `want(r)`
/// (mpirun forwards the ranks' stderr interleaved, so searched for, not
/// split into lines).
fn assert_counters(out: &Output, ranks: usize, want: impl Fn(usize) -> String, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    for r in 0..ranks {
        let line = format!("aggbox-mpi: rank {r}: served {}", want(r));
        assert!(stderr.contains(&line), "{what}: rank {r} printed no \"{line}\" in:\n{stderr}");
    }
}

/// Rank `r`'s counters line (`aggbox-mpi: rank R: served ...`).
fn counters_line(out: &Output, r: usize) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let head = format!("aggbox-mpi: rank {r}: served ");
    stderr
        .lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("rank {r} printed no counters line in:\n{stderr}"))
        .to_string()
}

/// The value of `NAME=` after `section` in a counters line.
fn counter(line: &str, section: &str, name: &str) -> u64 {
    let rest = &line[line.find(section).unwrap_or_else(|| panic!("no {section:?} in {line}")) + section.len()..];
    let at = rest.find(&format!("{name}=")).unwrap_or_else(|| panic!("no {name} after {section:?} in {line}"));
    rest[at + name.len() + 1..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

/// The ops collectives.c runs, every one the shim serves on int32: the
/// rows of include/aggbox/ops.def that name an MPI op (MPI_SUM ...
/// MPI_BXOR, MPI_LAND, MPI_LOR).
const MPI_OPS: usize = 9;

#[test]
fn collectives_c_runs_every_op_the_shim_serves() {
    let served = aggbox::wire::abi::Op::ALL.iter().filter(|op| op.mpi_name().is_some()).count();
    assert_eq!(served, MPI_OPS);
    let program = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mpi/collectives.c")).expect("collectives.c");
    for op in aggbox::wire::abi::Op::ALL {
        if let Some(name) = op.mpi_name() {
            assert!(program.contains(&format!("{name}}}")), "collectives.c runs {name}");
        }
    }
}

/// The counters world rank `r` must print after collectives.c's default
/// program with `served` of its sizes served and `passed` passed through
/// (AGGBOX_MPI_MIN_BYTES). Per served size: MPI_OPS ops × (allreduce +
/// in-place allreduce) and MPI_OPS × 2 reduces served, the SUM that wraps
/// overflowed (rerun with PMPI), one bcast; per passed size the same
/// 2 × MPI_OPS + 1 allreduces, 2 × MPI_OPS reduces and the bcast passed. Then passed_through()'s 2 allreduces
/// (int64, a user op) pass, and of communicators(): the allreduce on the
/// duplicate of MPI_COMM_WORLD is served (its job), the reversed half's
/// allreduce, reduce, bcast and its duplicate's allreduce are served on the
/// even ranks (HALF_JOB) and passed on the odd ones (no job), the
/// world-order half's allreduce passes everywhere (no job in that order).
fn counters(r: usize, served: usize, passed: usize) -> String {
    let even = usize::from(r % 2 == 0);
    let odd = 1 - even;
    format!(
        "MPI_Allreduce={} MPI_Reduce={} MPI_Bcast={}; passed through MPI_Allreduce={} MPI_Reduce={} MPI_Bcast={}; overflowed (rerun with PMPI) MPI_Allreduce={served} MPI_Reduce=0 MPI_Bcast=0",
        2 * MPI_OPS * served + 1 + 2 * even,
        2 * MPI_OPS * served + even,
        served + even,
        (2 * MPI_OPS + 1) * passed + 2 + 1 + 2 * odd,
        2 * MPI_OPS * passed + odd,
        passed + odd,
    )
}

/// Runs the program over `ranks` ranks without and with the library of
/// `mpi`: both succeed with identical results; the counters are exactly
/// what the program's calls must give; the node aggregated them.
fn bit_identical(mpi: Mpi, ranks: usize) {
    let mut bed = MpiBed::up(&format!("{}-{ranks}", mpi.name()), ranks);
    let program = program(mpi, &bed.dir);
    // 1 element, one datagram (362 at MTU 1500), one more, 4 datagrams, and
    // many fragments not a multiple of the datagram.
    let sizes = ["1", "362", "363", "1448", "10000"];

    let plain = bed.mpirun(mpi, ranks, &[], &program, &sizes);
    assert!(plain.status.success(), "plain {} run failed", mpi.name());
    let reference = result_lines(&plain);
    // Per size MPI_OPS ops × 4 calls, the SUM that wraps and the bcast; 2
    // pass-through calls; 6 calls of communicators().
    assert_eq!(reference.len(), sizes.len() * (MPI_OPS * 4 + 2) + 2 + 6, "rank 0's result lines of the plain run");

    let before = bed.node().outcomes();
    let served = bed.mpirun(mpi, ranks, &bed.aggbox_env(mpi, &[]), &program, &sizes);
    assert!(served.status.success(), "{} run with libaggbox_mpi failed", mpi.name());
    assert_eq!(result_lines(&served), reference, "results with the library differ from plain MPI's");
    assert_counters(&served, ranks, |r| counters(r, sizes.len(), 0), "counters");
    // Each rank's line names the sessions it opened: MPI_COMM_WORLD's job,
    // and HALF_JOB on the even ranks only.
    let stderr = String::from_utf8_lossy(&served.stderr);
    for r in 0..ranks {
        let line = stderr
            .lines()
            .find(|l| l.starts_with(&format!("aggbox-mpi: rank {r}: served")))
            .expect("a counters line");
        assert!(line.contains(&format!("; job {JOB} datagrams")), "rank {r}: {line}");
        assert_eq!(line.contains(&format!("; job {HALF_JOB} datagrams")), r % 2 == 0, "rank {r}: {line}");
    }
    let after = bed.node().outcomes();
    let grew = |k: &str| after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0);
    eprintln!("node outcomes during the run: {after:?} (before {before:?})");
    assert!(grew("accepted") > 0 && grew("result") > 0, "the node's XDP program aggregated the contributions");

    // Sizes below AGGBOX_MPI_MIN_BYTES pass through: 1 and 362 elements
    // (1448 bytes) under 1449 bytes, still correct; 363 served.
    let small = ["1", "362", "363"];
    bed.restart_node();
    let out = bed.mpirun(mpi, ranks, &bed.aggbox_env(mpi, &[("AGGBOX_MPI_MIN_BYTES", "1449".into())]), &program, &small);
    assert!(out.status.success(), "run with AGGBOX_MPI_MIN_BYTES failed");
    let plain_small = bed.mpirun(mpi, ranks, &[], &program, &small);
    assert_eq!(result_lines(&out), result_lines(&plain_small), "results under AGGBOX_MPI_MIN_BYTES");
    assert_counters(&out, ranks, |r| counters(r, 1, 2), "counters with AGGBOX_MPI_MIN_BYTES");
}

#[test]
fn openmpi_4_ranks_bit_identical_to_plain_mpi_and_passes_the_rest_through() {
    bit_identical(Mpi::OpenMpi, 4);
}

#[test]
fn openmpi_8_ranks_bit_identical_to_plain_mpi_and_passes_the_rest_through() {
    bit_identical(Mpi::OpenMpi, 8);
}

#[test]
fn mpich_4_ranks_bit_identical_to_plain_mpi_and_passes_the_rest_through() {
    bit_identical(Mpi::Mpich, 4);
}

/// A world of 3 ranks for a job of 4 workers: MPI_Init fails on every rank
/// with the reason, and the job ends (no hang).
/// The default route, `measure`: per kind and size the first calls are
/// trials (a warm-up and AGGBOX_MPI_TRIALS each of AggBox and PMPI,
/// alternating), then
/// every rank takes the route the slowest rank measured faster. The test
/// cannot know which route wins on this machine (that is what is
/// measured), so it checks what must hold whichever wins: the results are
/// plain MPI's; every rank settled the same routes from the same agreed
/// times (the routes text is identical on every rank); the counters add up
/// exactly to the trials plus the settled calls of each route. With
/// `pmpi` every call steps aside.
#[test]
fn openmpi_measured_routes_agree_on_every_rank_and_results_stay_exact() {
    const RANKS: usize = 4;
    const TIMES: u64 = 10;
    const TRIALS: u64 = 2;
    let bed = MpiBed::up("openmpi-route", RANKS);
    let program = program(Mpi::OpenMpi, &bed.dir);
    // One int (a datagram) and 64 Ki ints (256 KiB, 182 datagrams).
    let args = ["repeat", "10", "1", "65536"];
    let plain = bed.mpirun(Mpi::OpenMpi, RANKS, &[], &program, &args);
    assert!(plain.status.success(), "plain run failed");
    let reference = result_lines(&plain);
    assert_eq!(reference.len(), 2 * 2 * TIMES as usize, "rank 0's result lines of the plain run");

    let env = bed.aggbox_env(
        Mpi::OpenMpi,
        &[("AGGBOX_MPI_ROUTE", "measure".into()), ("AGGBOX_MPI_TRIALS", TRIALS.to_string())],
    );
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &env, &program, &args);
    assert!(out.status.success(), "run with measured routes failed");
    assert_eq!(result_lines(&out), reference, "results with measured routes differ from plain MPI's");
    let lines: Vec<String> = (0..RANKS).map(|r| counters_line(&out, r)).collect();
    let routes: Vec<&str> = lines
        .iter()
        .map(|l| &l[l.find("routes ").expect("a routes section") + "routes ".len()..])
        .collect();
    assert!(routes.iter().all(|r| *r == routes[0]), "ranks settled differently:\n{}", lines.join("\n"));
    let settled: Vec<&str> = routes[0].split(", ").collect();
    assert_eq!(settled.len(), 4, "two kinds × two sizes settled: {}", routes[0]);
    for (call, dtype) in [("MPI_Allreduce", "int32"), ("MPI_Bcast", "bytes")] {
        let to_pmpi = ["4 B", "256 KiB"]
            .iter()
            .map(|class| {
                let head = format!("{call} {dtype} from {class}: ");
                let s = settled.iter().find(|s| s.starts_with(&head)).unwrap_or_else(|| panic!("no {head:?} in {}", routes[0]));
                let route = s[head.len()..].split(' ').next().unwrap();
                assert!(route == "aggbox" || route == "pmpi", "route {route:?} in {s}");
                u64::from(route == "pmpi")
            })
            .sum::<u64>();
        // Per class TRIALS + 1 trials on each route, then the rest on the
        // settled one.
        let tried = TRIALS + 1;
        let stepped = 2 * tried + to_pmpi * (TIMES - 2 * tried);
        for line in &lines {
            assert_eq!(counter(line, "stepped aside to PMPI ", call), stepped, "{call} stepped aside: {line}");
            assert_eq!(counter(line, "served ", call), 2 * TIMES - stepped, "{call} served: {line}");
        }
    }

    let env = bed.aggbox_env(Mpi::OpenMpi, &[("AGGBOX_MPI_ROUTE", "pmpi".into())]);
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &env, &program, &args);
    assert!(out.status.success(), "run with AGGBOX_MPI_ROUTE=pmpi failed");
    assert_eq!(result_lines(&out), reference, "results with AGGBOX_MPI_ROUTE=pmpi");
    for r in 0..RANKS {
        let line = counters_line(&out, r);
        for call in ["MPI_Allreduce", "MPI_Bcast"] {
            assert_eq!(counter(&line, "stepped aside to PMPI ", call), 2 * TIMES, "{line}");
            assert_eq!(counter(&line, "served ", call), 0, "{line}");
        }
    }
}

#[test]
fn world_size_other_than_the_workers_fails_at_mpi_init() {
    let bed = MpiBed::up("mismatch", 4);
    let program = program(Mpi::OpenMpi, &bed.dir);
    let started = Instant::now();
    let out = bed.mpirun(Mpi::OpenMpi, 3, &bed.aggbox_env(Mpi::OpenMpi, &[]), &program, &["1"]);
    assert!(!out.status.success(), "a world of 3 for 4 workers must fail");
    assert!(started.elapsed() < Duration::from_secs(60), "it failed at once, not after a hang");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("MPI_COMM_WORLD has 3 ranks but job 11") && stderr.contains("has 4 workers"),
        "the reason is printed: {stderr}"
    );
    assert_eq!(bed.ranks, 4);
}

/// Rank 2 of 4 dies mid-way through back-to-back allreduces. MPICH's
/// `-disable-auto-cleanup` leaves the others running (mpirun would
/// otherwise kill them at once), so what ends them is the library: each
/// survivor's call fails at its deadline with the runtime's reason and the
/// job is aborted — well before the program's own 60 s of calls.
#[test]
fn a_rank_killed_mid_call_fails_the_others_within_the_deadline() {
    let bed = MpiBed::up("kill", 4);
    let program = program(Mpi::Mpich, &bed.dir);
    let started = Instant::now();
    let out = bed.mpirun_with(
        Mpi::Mpich,
        4,
        &bed.aggbox_env(Mpi::Mpich, &[]),
        &["-disable-auto-cleanup"],
        &program,
        &["kill-rank", "2"],
    );
    let took = started.elapsed();
    assert!(!out.status.success(), "the job must fail");
    let limit = Duration::from_millis(DEADLINE_MS) + Duration::from_secs(20);
    assert!(took < limit, "the survivors failed within their deadline ({took:?}, at most {limit:?}), no hang");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("no failure"), "no survivor ran on: {stderr}");
    assert!(
        stderr.lines().any(|l| l.starts_with("aggbox-mpi: rank ") && l.contains(&format!("MPI_Allreduce: job {JOB}: allreduce round")) && l.contains("timed out")),
        "a survivor's call timed out with the runtime's reason: {stderr}"
    );
}

/// MPI_FLOAT MPI_SUM is served only with AGGBOX_MPI_FLOAT=quantized, then
/// within the quantization bound of the exact sum (the program checks),
/// each allreduce counted by the rounds it took; without it every float
/// call passes through.
#[test]
fn openmpi_float_sum_served_only_when_asked() {
    let mut bed = MpiBed::up("float", 4);
    let program = program(Mpi::OpenMpi, &bed.dir);
    let args = ["float", "1", "363", "10000"];
    for (float, want) in [
        ("quantized", "MPI_Allreduce=3 MPI_Reduce=3 MPI_Bcast=0; passed through MPI_Allreduce=0 MPI_Reduce=0 MPI_Bcast=0"),
        ("off", "MPI_Allreduce=0 MPI_Reduce=0 MPI_Bcast=0; passed through MPI_Allreduce=3 MPI_Reduce=3 MPI_Bcast=0"),
    ] {
        bed.restart_node();
        // Without AGGBOX_MPI_DATA_PORT: each rank's port is its member of
        // the job's result group.
        let env: Vec<(String, String)> = bed
            .aggbox_env(Mpi::OpenMpi, &[("AGGBOX_MPI_FLOAT", float.into())])
            .into_iter()
            .filter(|(k, _)| k != "AGGBOX_MPI_DATA_PORT")
            .collect();
        let out = bed.mpirun(Mpi::OpenMpi, 4, &env, &program, &args);
        assert!(out.status.success(), "float run with AGGBOX_MPI_FLOAT={float} failed");
        assert_counters(&out, 4, |_| want.to_string(), &format!("AGGBOX_MPI_FLOAT={float}"));
        // Every served call (a float MPI_Reduce is the runtime's allreduce
        // too; all at most 16 Ki floats) took the one-round path, or
        // guessed and reduced again: counted either way.
        let served = if float == "quantized" { 6 } else { 0 };
        for r in 0..4 {
            let line = counters_line(&out, r);
            let rounds = counter(&line, "datagrams", "float_calls_one_round") + counter(&line, "datagrams", "float_calls_redone");
            assert_eq!(rounds, served, "AGGBOX_MPI_FLOAT={float}: rank {r}'s adaptive allreduces in {line}");
        }
    }
}

/// Consecutive runs on one running node (docs/MPI.md, "Consecutive runs on
/// one node"): three runs, Open MPI, MPICH, Open MPI, on the same `aggbox
/// attach`, never restarted, each start where the last left off (every
/// rank asks the node at MPI_Init) and succeed with results identical to
/// plain MPI's; the node answered each rank's query, refused none, and
/// dropped no contribution as stale or a retransmission of an old round.
/// Without the query (each run from round 0) the second run fails at
/// MPI_Init.
#[test]
fn consecutive_runs_on_one_running_node_all_succeed_with_exact_results() {
    let bed = MpiBed::up("rerun", 4);
    let openmpi = program(Mpi::OpenMpi, &bed.dir);
    let mpich = program(Mpi::Mpich, &bed.dir);
    let sizes = ["1", "363", "1448"];
    let plain = bed.mpirun(Mpi::OpenMpi, 4, &[], &openmpi, &sizes);
    assert!(plain.status.success(), "plain run failed");
    let reference = result_lines(&plain);
    // Per size MPI_OPS ops × 4 calls, the SUM that wraps and the bcast; 2
    // pass-through calls; 6 calls of communicators().
    assert_eq!(reference.len(), sizes.len() * (MPI_OPS * 4 + 2) + 2 + 6, "rank 0's result lines of the plain run");
    let before = bed.node().status();
    let served = |s: &aggbox::node::NodeStatus| s.served.get(&JOB).copied().unwrap_or_default();
    let mut rounds = served(&before).rounds;
    for (run, (mpi, program)) in [(Mpi::OpenMpi, &openmpi), (Mpi::Mpich, &mpich), (Mpi::OpenMpi, &openmpi)].into_iter().enumerate() {
        let out = bed.mpirun(mpi, 4, &bed.aggbox_env(mpi, &[]), program, &sizes);
        assert!(out.status.success(), "run {} ({}) on the running node failed", run + 1, mpi.name());
        assert_eq!(result_lines(&out), reference, "run {}: results differ from plain MPI's", run + 1);
        assert_counters(&out, 4, |r| counters(r, sizes.len(), 0), &format!("run {}", run + 1));
        // The counters are published every 50 ms.
        std::thread::sleep(Duration::from_millis(200));
        let now = served(&bed.node().status());
        assert_eq!(now.position_queries, 4 * (run as u64 + 1), "every rank of every run asked once");
        assert!(now.rounds > rounds, "run {}'s rounds reached the node's service", run + 1);
        rounds = now.rounds;
    }
    let after = bed.node().status();
    assert_eq!(served(&after).refused_queries, 0, "no query of a worker refused");
    let grew = |k: &str| after.drops.get(k).copied().unwrap_or(0) - before.drops.get(k).copied().unwrap_or(0);
    // (A `retransmission` may be a late resend on this loaded machine; a
    // run from an old round shows as both.)
    assert_eq!(grew("stale_round"), 0, "no run's contribution was taken for an old round's: {:?}", after.drops);
}

/// No node serving the job (`aggbox attach` stopped): every rank's
/// position query at MPI_Init goes unanswered, and the run fails at its
/// deadline naming the node's address and the job's result port.
#[test]
fn no_node_fails_at_mpi_init_naming_the_node() {
    let mut bed = MpiBed::up("nonode", 4);
    drop(bed.attach.take());
    let program = program(Mpi::OpenMpi, &bed.dir);
    let env = bed.aggbox_env(Mpi::OpenMpi, &[("AGGBOX_MPI_DEADLINE_MS", "2000".into())]);
    let started = Instant::now();
    let out = bed.mpirun(Mpi::OpenMpi, 4, &env, &program, &["1"]);
    assert!(!out.status.success(), "a run with no node must fail");
    assert!(started.elapsed() < Duration::from_secs(40), "at MPI_Init, within the deadline, not after a hang");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let node = format!("no answer from the node at {}:{RESULT_PORT}", bed.tb.host(0).addr);
    assert!(stderr.contains("MPI_Init: job 11: ") && stderr.contains(&node), "the reason names the node: {stderr}");
}

/// Jobs on demand: the counters of collectives.c's default program over
/// `n` sizes when every communicator got its job: the calls on
/// MPI_COMM_WORLD as with the file's job (the SUM that wraps overflowed),
/// and every call of communicators() served (each half, in either order,
/// gets a job of its own); only passed_through()'s 2 allreduces pass.
fn on_demand_counters(n: usize) -> String {
    format!(
        "MPI_Allreduce={} MPI_Reduce={} MPI_Bcast={}; passed through MPI_Allreduce=2 MPI_Reduce=0 MPI_Bcast=0; overflowed (rerun with PMPI) MPI_Allreduce={n} MPI_Reduce=0 MPI_Bcast=0",
        2 * MPI_OPS * n + 4,
        2 * MPI_OPS * n + 1,
        n + 1,
    )
}

/// The counters of the same program when MPI_COMM_WORLD fell back to PMPI:
/// nothing served, every call passed through.
fn fallback_counters(n: usize) -> String {
    format!(
        "MPI_Allreduce=0 MPI_Reduce=0 MPI_Bcast=0; passed through MPI_Allreduce={} MPI_Reduce={} MPI_Bcast={}; overflowed (rerun with PMPI) MPI_Allreduce=0 MPI_Reduce=0 MPI_Bcast=0",
        (2 * MPI_OPS + 1) * n + 2 + 4,
        2 * MPI_OPS * n + 1,
        n + 1,
    )
}

/// The jobs on demand a counters line names, in the order the rank opened
/// them (MPI_COMM_WORLD's first): `; job J on demand (node N, run R,
/// incarnation I)` as (J, R, I).
fn on_demand_jobs(line: &str) -> Vec<(u16, String, u64)> {
    line.split("; job ")
        .skip(1)
        .filter_map(|part| {
            let (job, rest) = part.split_once(" on demand (node ")?;
            let run = rest.split(", run ").nth(1)?.split(',').next()?;
            let incarnation = rest.split("incarnation ").nth(1)?.split(')').next()?;
            Some((job.parse().ok()?, run.to_string(), incarnation.parse().ok()?))
        })
        .collect()
}

/// The nodes of the jobs on demand a counters line names, in the same
/// order as [`on_demand_jobs`]: `IP:PORT` each.
fn on_demand_nodes(line: &str) -> Vec<String> {
    line.split(" on demand (node ").skip(1).filter_map(|rest| Some(rest.split(',').next()?.to_string())).collect()
}

/// Waits until no node serves a job (the counters are published every
/// 50 ms): a run's jobs end when its ranks' MPI_Finalize ends them, not a
/// lease (10 s) later.
fn assert_no_jobs_soon(bed: &MpiBed, what: &str) {
    let since = Instant::now();
    loop {
        let jobs: Vec<_> = bed.nodes().iter().flat_map(|(_, n)| n.status().jobs).collect();
        if jobs.is_empty() {
            return;
        }
        assert!(since.elapsed() < Duration::from_secs(3), "{what}: the node still serves {jobs:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Jobs on demand (docs/MPI.md, "Jobs on demand"): a node whose file has
/// no `[[job]]`, the ranks given only its control endpoint and a
/// credential. An unmodified program's int32 calls are bit-identical to
/// plain MPI's and every one was served by AggBox (the counters; the node's
/// XDP program aggregated); MPI_COMM_WORLD's job is the same on every rank,
/// each half of the world (either order) has its own; all of them end at
/// MPI_Finalize. A second run on the same node (float32 SUMs, quantized,
/// within the program's bound) gets a new job of its own; a third (MPICH,
/// AGGBOX_MPI_DATA_PORT set) splits the world into halves in world order,
/// the lower one (world ranks 0 and 1) a job of its own, not
/// MPI_COMM_WORLD's. A fourth and fifth run under 1 % loss and
/// duplication on every link: 500 int32 allreduces and broadcasts, and 252
/// float32 SUMs (allreduces and reduces, one round or two), each result
/// checked by the program (int32 exact, float32 within the quantization
/// bound) and every one served by AggBox.
#[test]
fn openmpi_on_demand_runs_exact_each_with_a_new_job_on_a_node_without_jobs() {
    const RANKS: usize = 4;
    const FLOAT_CALLS_PER_SIZE: u64 = 42;
    let bed = MpiBed::on_demand("demand", RANKS);
    let program = program(Mpi::OpenMpi, &bed.dir);
    let sizes = ["1", "363", "1448"];
    let plain = bed.mpirun(Mpi::OpenMpi, RANKS, &[], &program, &sizes);
    assert!(plain.status.success(), "plain run failed");
    let reference = result_lines(&plain);
    assert_eq!(reference.len(), sizes.len() * (MPI_OPS * 4 + 2) + 2 + 6, "rank 0's result lines of the plain run");

    let before = bed.node().outcomes();
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &bed.on_demand_env(Mpi::OpenMpi, KEY, &[]), &program, &sizes);
    assert!(out.status.success(), "run with jobs on demand failed");
    assert_eq!(result_lines(&out), reference, "results with jobs on demand differ from plain MPI's");
    assert_counters(&out, RANKS, |_| on_demand_counters(sizes.len()), "jobs on demand");
    let jobs: Vec<Vec<(u16, String, u64)>> = (0..RANKS).map(|r| on_demand_jobs(&counters_line(&out, r))).collect();
    let world = jobs[0][0].clone();
    assert!(world.1.starts_with("mpi-") && world.2 == 1, "a random run key, its first incarnation: {world:?}");
    for (r, js) in jobs.iter().enumerate() {
        assert_eq!(js.len(), 3, "rank {r}: MPI_COMM_WORLD's job and one per half it is in: {js:?}");
        assert_eq!(js[0], world, "rank {r}: MPI_COMM_WORLD's job is every rank's");
        assert_eq!(js[1..], jobs[r % 2][1..], "rank {r}: the ranks of a half share its jobs");
    }
    let mut ids: Vec<u16> = jobs.iter().flatten().map(|j| j.0).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 5, "MPI_COMM_WORLD's job and 4 halves' (2 halves × 2 orders), all distinct: {jobs:?}");
    let after = bed.node().outcomes();
    let grew = |k: &str| after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0);
    assert!(grew("accepted") > 0 && grew("result") > 0, "the node's XDP program aggregated the contributions");
    assert_no_jobs_soon(&bed, "after the first run");

    // A second run on the same running node: float32 SUMs.
    let env = bed.on_demand_env(Mpi::OpenMpi, KEY, &[("AGGBOX_MPI_FLOAT", "quantized".into())]);
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &env, &program, &["float", "1", "363", "10000"]);
    assert!(out.status.success(), "the second run (float32, quantized) failed");
    assert_counters(
        &out,
        RANKS,
        |_| "MPI_Allreduce=3 MPI_Reduce=3 MPI_Bcast=0; passed through MPI_Allreduce=0 MPI_Reduce=0 MPI_Bcast=0".to_string(),
        "the float run",
    );
    for r in 0..RANKS {
        let line = counters_line(&out, r);
        let js = on_demand_jobs(&line);
        assert_eq!(js.len(), 1, "rank {r}: {line}");
        assert!(js[0].0 != world.0 && js[0].1 != world.1 && js[0].2 == 1, "rank {r}: a new job of a new run: {js:?} after {world:?}");
        assert_eq!(js, on_demand_jobs(&counters_line(&out, 0)), "rank {r}: the same job as rank 0");
        let rounds = counter(&line, "datagrams", "float_calls_one_round") + counter(&line, "datagrams", "float_calls_redone");
        assert_eq!(rounds, 6, "rank {r}: every float call served adaptively: {line}");
    }
    assert_no_jobs_soon(&bed, "after the second run");

    // A third run, of MPICH, MPI_COMM_WORLD's data socket on
    // AGGBOX_MPI_DATA_PORT: MPI_COMM_WORLD, then its lower half (ranks 0
    // and 1: the start of the world's ranks, yet a job of its own) and its
    // upper half, then MPI_COMM_WORLD again, still on its own job.
    let mpich_program = self::program(Mpi::Mpich, &bed.dir);
    let env = bed.on_demand_env(Mpi::Mpich, KEY, &[("AGGBOX_MPI_DATA_PORT", DATA_PORT.to_string())]);
    let out = bed.mpirun(Mpi::Mpich, RANKS, &env, &mpich_program, &["halves", "100"]);
    assert!(out.status.success(), "the third run (halves) failed");
    assert_counters(
        &out,
        RANKS,
        |_| "MPI_Allreduce=3 MPI_Reduce=0 MPI_Bcast=0; passed through MPI_Allreduce=0 MPI_Reduce=0 MPI_Bcast=0".to_string(),
        "the halves run",
    );
    let jobs: Vec<Vec<(u16, String, u64)>> = (0..RANKS).map(|r| on_demand_jobs(&counters_line(&out, r))).collect();
    for (r, js) in jobs.iter().enumerate() {
        assert_eq!(js.len(), 2, "rank {r}: MPI_COMM_WORLD's job and its half's: {js:?}");
        assert_eq!(js[0], jobs[0][0], "rank {r}: MPI_COMM_WORLD's job");
        assert_eq!(js[1], jobs[r / 2 * 2][1], "rank {r}: its half's job");
        assert!(js[1].0 != js[0].0 && js[1].1 != js[0].1, "rank {r}: its half's job is not MPI_COMM_WORLD's: {js:?}");
    }
    assert_ne!(jobs[0][1].0, jobs[2][1].0, "each half its own job");
    assert_no_jobs_soon(&bed, "after the third run");

    // A fourth run under 1 % loss and duplication on every link: 500
    // int32 allreduces (and as many broadcasts) of 1 to 5,000 elements,
    // then 252 float32 SUMs (quantized) of 1 to 20,000 elements, every
    // result checked by the program.
    let injector = impair::Injector::new();
    let impair = |loss: f64, dup: f64| {
        for h in 0..=RANKS {
            let port = bed.tb.switch_port(h);
            let injector = &injector;
            testbed::in_netns(&bed.tb.switch_netns(), move || injector.set(&port, loss, dup))
                .expect("switch netns")
                .unwrap_or_else(|e| panic!("{e:#}"));
        }
    };
    impair(0.01, 0.01);
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &bed.on_demand_env(Mpi::OpenMpi, KEY, &[]), &program, &["repeat", "125", "1", "363", "1448", "5000"]);
    let floats = bed.mpirun(
        Mpi::OpenMpi,
        RANKS,
        &bed.on_demand_env(Mpi::OpenMpi, KEY, &[("AGGBOX_MPI_FLOAT", "quantized".into())]),
        &program,
        &["float-repeat", &FLOAT_CALLS_PER_SIZE.to_string(), "1", "2", "363", "1448", "10000", "20000"],
    );
    impair(0.0, 0.0);
    assert!(out.status.success(), "500 int32 allreduces under loss failed");
    assert!(floats.status.success(), "float32 SUMs under loss failed");
    let served = counter(&counters_line(&out, 0), "served", "MPI_Allreduce");
    assert_eq!(served, 500, "every allreduce of the lossy run served by AggBox: {}", counters_line(&out, 0));
    // Per size FLOAT_CALLS_PER_SIZE calls, allreduces and reduces
    // alternating; those of at most 16 Ki elements (all but 20,000) take
    // the one-round path and are counted by it.
    let half = FLOAT_CALLS_PER_SIZE / 2;
    assert_counters(
        &floats,
        RANKS,
        |_| format!("MPI_Allreduce={} MPI_Reduce={} MPI_Bcast=0; passed through MPI_Allreduce=0 MPI_Reduce=0 MPI_Bcast=0", 6 * half, 6 * half),
        "the lossy float run",
    );
    for r in 0..RANKS {
        let line = counters_line(&floats, r);
        let rounds = counter(&line, "datagrams", "float_calls_one_round") + counter(&line, "datagrams", "float_calls_redone");
        assert_eq!(rounds, 5 * FLOAT_CALLS_PER_SIZE, "rank {r}: the float calls of up to 16 Ki elements: {line}");
    }
    let c = injector.counts();
    assert!(c.dropped > 0 && c.duplicated > 0, "the injector dropped and duplicated: {c:?}");
    assert_no_jobs_soon(&bed, "after the lossy runs");
}

/// Jobs on demand striped over two nodes (docs/MPI.md, "Several nodes"):
/// AGGBOX_MPI_NODE names both control endpoints, and every communicator
/// joins its run at each, in that order, and stripes each vector over the
/// two jobs as `RunCommunicator::join` does. The program is bit-identical
/// to plain MPI, every call but the 2 pass-through ones served; each rank's
/// stats line names, per communicator, a job at each node (the first
/// node's first) of one run, and each of its stripes sent data; each
/// node's XDP program aggregated, and both end their jobs at MPI_Finalize.
/// A second run pauses after its calls (363 elements: a stripe at each
/// node): then each node serves a job of the run, MPI_COMM_WORLD's stripe,
/// whose counters show it reduced.
#[test]
fn openmpi_on_demand_striped_over_two_nodes_is_exact_and_each_node_serves_a_stripe() {
    const RANKS: usize = 4;
    let bed = MpiBed::on_demand_nodes("striped", RANKS, 2);
    let program = program(Mpi::OpenMpi, &bed.dir);
    let sizes = ["1", "363", "1448"];
    let plain = bed.mpirun(Mpi::OpenMpi, RANKS, &[], &program, &sizes);
    assert!(plain.status.success(), "plain run failed");
    let reference = result_lines(&plain);
    let controls = bed.controls();
    let env = bed.on_demand_env(Mpi::OpenMpi, KEY, &[("AGGBOX_MPI_NODE", controls.join(","))]);

    let before: Vec<_> = bed.nodes().iter().map(|(_, n)| n.outcomes()).collect();
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &env, &program, &sizes);
    assert!(out.status.success(), "the run striped over two nodes failed");
    assert_eq!(result_lines(&out), reference, "results striped over two nodes differ from plain MPI's");
    assert_counters(&out, RANKS, |_| on_demand_counters(sizes.len()), "striped over two nodes");
    let jobs: Vec<Vec<(u16, String, u64)>> = (0..RANKS).map(|r| on_demand_jobs(&counters_line(&out, r))).collect();
    for (r, js) in jobs.iter().enumerate() {
        let line = counters_line(&out, r);
        assert_eq!(on_demand_nodes(&line), [&controls[..], &controls[..], &controls[..]].concat(), "rank {r}: a job at each node, in order, per communicator: {line}");
        for pair in js.chunks(2) {
            assert_eq!(pair[0].1, pair[1].1, "rank {r}: one run at both nodes: {js:?}");
            assert_eq!(pair[0].2, 1, "rank {r}: {js:?}");
        }
        assert_eq!(js[..2], jobs[0][..2], "rank {r}: MPI_COMM_WORLD's jobs are every rank's");
        for (job, _, _) in js {
            let sent = counter(&line, &format!("; job {job} datagrams "), "data_sent");
            assert!(sent > 0, "rank {r}: the stripe of job {job} sent nothing: {line}");
        }
    }
    for (k, ((_, node), before)) in bed.nodes().iter().zip(&before).enumerate() {
        let after = node.outcomes();
        let grew = |key: &str| after.get(key).copied().unwrap_or(0) - before.get(key).copied().unwrap_or(0);
        assert!(grew("accepted") > 0 && grew("result") > 0, "node {k} ({}) aggregated its stripes: {after:?}", controls[k]);
    }
    assert_no_jobs_soon(&bed, "after the striped run");

    let run = PausedRun::start(&bed, Mpi::OpenMpi, RANKS, &env, &program, 363);
    let mut runs = Vec::new();
    for (k, (_, node)) in bed.nodes().iter().enumerate() {
        let jobs = node.status().jobs;
        assert_eq!(jobs.len(), 1, "node {k} serves MPI_COMM_WORLD's stripe {k}: {jobs:?}");
        let c = jobs[0].counters.expect("the job's XDP counters");
        assert!(c.accepted > 0 && c.results > 0, "node {k} reduced its stripe: {c:?}");
        runs.push(jobs[0].on_demand.as_ref().map(|d| d.run.clone()).expect("a job on demand"));
    }
    assert_eq!(runs[0], runs[1], "the same run at both nodes");
    let out = run.resume();
    assert!(out.status.success(), "the paused run failed after the pause");
    assert_no_jobs_soon(&bed, "after the paused run");
}

/// A run of `collectives pause DIR N` (tests/mpi/collectives.c) held at
/// its pause: every rank's calls before it completed (DIR/paused), and
/// every rank waits for DIR/resume, which [`PausedRun::resume`] (or drop)
/// creates.
struct PausedRun {
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
    fn start(bed: &MpiBed, mpi: Mpi, np: usize, env: &[(String, String)], program: &Path, n: usize) -> PausedRun {
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
    fn resume(mut self) -> Output {
        self.finish()
    }

    fn finish(&mut self) -> Output {
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
fn scrape(bed: &MpiBed, host: usize) -> String {
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

/// `aggbox_control_refused_total` of `reason` in a `/metrics` text.
fn refused(metrics: &str, reason: &str) -> u64 {
    let label = format!("reason=\"{reason}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("aggbox_control_refused_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Jobs on demand, the node killed (-9) and started again in the middle of
/// a run (docs/MPI.md, "A node that restarts"). The calls before the
/// restart are served (through the node's XDP program) and right; the new
/// node refuses every rank's next renewal (`unknown_job`); then the next
/// served call fails at once, sending nothing, with the JobLost reason
/// naming the node and the job and saying to run the program again, and
/// the job is aborted. The calls' deadline is a minute: a call that had
/// waited for it would end with "timed out" and "the call failed", which
/// no rank's line does.
#[test]
fn openmpi_on_demand_node_restarted_mid_run_fails_the_next_call_at_once_naming_the_node() {
    const RANKS: usize = 4;
    let mut bed = MpiBed::on_demand("restart", RANKS);
    let program = program(Mpi::OpenMpi, &bed.dir);
    let env = bed.on_demand_env(Mpi::OpenMpi, KEY, &[("AGGBOX_MPI_DEADLINE_MS", "60000".into())]);
    let run = PausedRun::start(&bed, Mpi::OpenMpi, RANKS, &env, &program, 363);
    let jobs = bed.node().status().jobs;
    assert_eq!(jobs.len(), 1, "MPI_COMM_WORLD's job on demand: {jobs:?}");
    let job = jobs[0].id;
    assert!(jobs[0].counters.is_some_and(|c| c.accepted > 0 && c.results > 0), "the node served the calls before the pause: {:?}", jobs[0]);

    let node = bed.attach.as_mut().expect("aggbox attach runs");
    node.kill9();
    node.restart();
    assert!(bed.node().status().jobs.is_empty(), "the restarted node serves no job of the old one");
    // Every rank's renewal thread gets the new node's refusal (within a
    // third of the lease), and stores it as soon as it has read it.
    let since = Instant::now();
    while refused(&scrape(&bed, 0), "unknown_job") < RANKS as u64 {
        assert!(since.elapsed() < Duration::from_secs(30), "the node refused fewer than {RANKS} renewals:\n{}", scrape(&bed, 0));
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    let out = run.resume();

    assert!(!out.status.success(), "the run must fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for r in 0..RANKS {
        assert!(stderr.contains(&format!("collectives: rank {r}: before the pause: ok")), "rank {r}'s calls before the restart: {stderr}");
        assert!(!stderr.lines().any(|l| l == format!("collectives: rank {r}: ok")), "rank {r} ran on: {stderr}");
    }
    let control = format!("{}:{CONTROL_PORT}", bed.tb.host(0).addr);
    let reason = format!("MPI_Allreduce: job {job}: node {control} no longer serves job {job} (incarnation 1): renewal refused (unknown_job): ");
    let failed: Vec<&str> = stderr.lines().filter(|l| l.starts_with("aggbox-mpi: rank ") && l.contains(": MPI_")).collect();
    assert!(!failed.is_empty(), "a rank's next call failed with its reason: {stderr}");
    for line in &failed {
        assert!(line.contains(&reason), "the reason names the node and the job: {line}");
        assert!(line.ends_with("join the run again (for this MPI program: run it again; its MPI_Init joins new jobs)"), "says what to do: {line}");
        assert!(!line.contains("the call failed") && !line.contains("timed out"), "failed at once, not at its deadline: {line}");
    }
    assert!(stderr.contains("aggbox-mpi: MPI_Allreduce failed; aborting the job"), "the job was aborted: {stderr}");
}

/// A join the node refuses (a wrong key: `bad_mac`) or cannot take (no
/// control endpoint at the address): by default every rank says why on
/// stderr, MPI_COMM_WORLD falls back to PMPI, the program's results are
/// plain MPI's and the counters show every call passed through, the stats
/// naming the fallback. With AGGBOX_MPI_FALLBACK=abort the run fails at
/// MPI_Init with the reason instead.
#[test]
fn openmpi_on_demand_refused_falls_back_to_pmpi_or_aborts_when_asked() {
    const RANKS: usize = 4;
    let bed = MpiBed::on_demand("refused", RANKS);
    let program = program(Mpi::OpenMpi, &bed.dir);
    let sizes = ["1", "363"];
    let plain = bed.mpirun(Mpi::OpenMpi, RANKS, &[], &program, &sizes);
    assert!(plain.status.success(), "plain run failed");
    let reference = result_lines(&plain);
    let wrong = format!("ff{}", &KEY[2..]);
    let unreachable = format!("{}:{}", bed.tb.host(0).addr, CONTROL_PORT + 1);
    for (what, env, reason) in [
        ("a wrong key", bed.on_demand_env(Mpi::OpenMpi, &wrong, &[]), "(bad_mac)".to_string()),
        (
            "no control endpoint",
            bed.on_demand_env(Mpi::OpenMpi, KEY, &[("AGGBOX_MPI_NODE", unreachable.clone())]),
            format!("control endpoint {unreachable}: connect"),
        ),
    ] {
        let out = bed.mpirun(Mpi::OpenMpi, RANKS, &env, &program, &sizes);
        assert!(out.status.success(), "{what}: the run must fall back to PMPI and succeed");
        assert_eq!(result_lines(&out), reference, "{what}: results differ from plain MPI's");
        assert_counters(&out, RANKS, |_| fallback_counters(sizes.len()), what);
        let stderr = String::from_utf8_lossy(&out.stderr);
        for r in 0..RANKS {
            let head = format!("aggbox-mpi: rank {r}: MPI_Init: ");
            let said = stderr.lines().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("{what}: rank {r} said nothing:\n{stderr}"));
            assert!(said.contains(&reason) && said.contains("MPI_COMM_WORLD falls back to PMPI"), "{what}: rank {r}: {said}");
            let line = counters_line(&out, r);
            assert!(line.contains("; fell back to PMPI: MPI_COMM_WORLD: ") && on_demand_jobs(&line).is_empty(), "{what}: rank {r}: {line}");
        }
        assert_no_jobs_soon(&bed, what);
    }

    let env = bed.on_demand_env(Mpi::OpenMpi, &wrong, &[("AGGBOX_MPI_FALLBACK", "abort".into())]);
    let started = Instant::now();
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &env, &program, &["1"]);
    assert!(!out.status.success(), "AGGBOX_MPI_FALLBACK=abort: a refused join fails the run");
    assert!(started.elapsed() < Duration::from_secs(60), "at MPI_Init, not after a hang");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.lines().any(|l| l.contains("MPI_Init: ") && l.contains("(bad_mac)") && l.contains("(AGGBOX_MPI_FALLBACK=abort)")),
        "the reason is printed: {stderr}"
    );
    assert!(!stderr.contains("collectives: rank 0: ok"), "the program did not run on: {stderr}");
}
