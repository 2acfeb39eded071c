//! MPI programs through the PMPI interposition library (docs/MPI.md), the
//! jobs from the node's file (jobs on demand: tests/mpi_on_demand.rs; the
//! bed and the program's runs: tests/mpi_bed/).
//!
//! Host 0 of a netns testbed runs only `aggbox attach eth0` with a
//! node-served job (`consumer = "node"`); hosts 1..=N are the MPI ranks,
//! started across the namespaces by `mpirun`. The program
//! tests/mpi/collectives.c runs every call the
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
//! Needs root and `make mpi` (the libraries and mpicc of both
//! implementations); fails (never skips) otherwise:
//! `make mpi && sudo -E cargo test --release --test mpi_collectives`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod live_attach;
mod mpi_bed;

use std::time::{Duration, Instant};

use live_attach::LiveAttach;
use mpi_bed::*;

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

/// MPI_COMM_WORLD's allreduces through the star or the ring by size
/// (AGGBOX_MPI_RING, docs/MPI.md "The ring"): each rank's host runs
/// `aggbox attach` with a `[[ring]]` of the four ranks, pinned where
/// AGGBOX_MPI_PIN_DIR says (`{rank}` per rank); the program's results stay
/// bit-identical to plain MPI's, the ring serves the calls from the
/// threshold on, and a ring without its pin directory fails at MPI_Init
/// with the variable named.
#[test]
fn openmpi_world_reaches_the_ring_by_size_and_results_stay_bit_identical() {
    const RING: u16 = 21;
    const RANKS: usize = 4;
    let bed = MpiBed::with_testbed("ring", RANKS, 1, true, |tb, _| MpiBed::jobs_text(tb, RANKS));
    let members: Vec<String> = (1..=RANKS).map(|h| format!("\"{}\"", bed.tb.host(h).addr)).collect();
    let ring = format!("\n[[ring]]\nid = {RING}\nport = 7400\nmembers = [{}]\nvector_len = 16384\nfrag_elems = 362\n", members.join(", "));
    // Host 0's node has no part in the ring; the ranks' file names it.
    std::fs::write(&bed.config, format!("{}{ring}", bed.text)).expect("write the ranks' file");
    let tag = |r: usize| format!("mpi-ring-member-r{r}");
    let members: Vec<LiveAttach> = (0..RANKS)
        .map(|r| LiveAttach::start(&bed.tb.host(r + 1).netns, &tag(r), &format!("[node]\nmetrics = \"off\"\nuserspace_path = \"optional\"\n{ring}"), &[]))
        .collect();
    let pattern = aggbox::node::pin_dir(&members[0].pin_root, "eth0").display().to_string().replace("-r0", "-r{rank}");
    let program = program(Mpi::OpenMpi, &bed.dir);
    let sizes = ["1", "362", "1448", "10000"];
    let plain = bed.mpirun(Mpi::OpenMpi, RANKS, &[], &program, &sizes);
    assert!(plain.status.success(), "plain run failed");

    let ring_env = [
        ("AGGBOX_MPI_RING", RING.to_string()),
        ("AGGBOX_MPI_PIN_DIR", pattern.clone()),
        ("AGGBOX_MPI_RING_THRESHOLD", "1000".to_string()),
    ];
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &bed.aggbox_env(Mpi::OpenMpi, &ring_env), &program, &sizes);
    assert!(out.status.success(), "run with the ring failed");
    assert_eq!(result_lines(&out), result_lines(&plain), "results with the ring differ from plain MPI's");
    assert_counters(&out, RANKS, |r| counters(r, sizes.len(), 0), "counters with the ring");
    for r in 0..RANKS {
        let line = counters_line(&out, r);
        let ring_calls = ring_calls(&line, JOB);
        // SUM, MAX and MIN (the ring's ops) from the threshold on (1448 and
        // 10000 elements): two allreduces and two reduces each; and the
        // program's SUM of 1000 on a duplicate of MPI_COMM_WORLD. The SUM
        // that leaves int32 saturates on the ring and is redone on the star.
        assert_eq!(ring_calls, 2 * 3 * 4 + 1, "rank {r}: calls the ring served: {line}");
    }
    for (r, m) in members.iter().enumerate() {
        let rings = m.status().rings;
        let counted: u64 = rings.get(&RING).map_or(0, |c| c.values().sum());
        assert!(counted > 0, "rank {r}'s node's ring program saw the ring's datagrams: {rings:?}");
    }

    // The ring without its pin directory: MPI_Init fails and says why.
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &bed.aggbox_env(Mpi::OpenMpi, &ring_env[..1]), &program, &["1"]);
    assert!(!out.status.success(), "a ring without AGGBOX_MPI_PIN_DIR must fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs AGGBOX_MPI_PIN_DIR"), "the reason is printed: {stderr}");
    drop(members);
}
