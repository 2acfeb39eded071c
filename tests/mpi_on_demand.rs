//! MPI programs through the PMPI interposition library with jobs on demand
//! (docs/MPI.md, "Jobs on demand"; the bed and the program's runs:
//! tests/mpi_bed/).
//!
//! On a node whose file has no `[[job]]` and serves a key file's tenant,
//! tests/mpi/collectives.c with only the node's control endpoint and the
//! credential (no file on the ranks) is bit-identical to plain MPI and
//! served by AggBox, every communicator by a job of its own, each run by
//! new jobs that end at MPI_Finalize, also under loss and duplication; a
//! refused or unreachable node makes the run fall back to PMPI, saying why
//! (or fail, when asked); a node restarted mid-run fails the next call at
//! once naming it (JobLost); over two nodes each vector is striped over a
//! job at each.
//!
//! Needs root and `make mpi` (the libraries and mpicc of both
//! implementations); fails (never skips) otherwise:
//! `make mpi && sudo -E cargo test --release --test mpi_on_demand`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod live_attach;
mod mpi_bed;
#[path = "../src/testing/impair/mod.rs"]
mod impair;

use std::time::{Duration, Instant};

use mpi_bed::*;

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

/// A ring on demand under MPI (AGGBOX_MPI_RING=demand, docs/MPI.md "Jobs
/// on demand"): every rank's host runs a node with the tenant's key file
/// and ring memory, no `[[ring]]`; MPI_Init joins MPI_COMM_WORLD's run at
/// host 0's node asking for a ring at the ranks' own nodes, which host 0
/// installs there. The program's results stay bit-identical to plain MPI's,
/// the ring serves calls from the threshold on, and when the run ends the
/// ring is gone from every rank's node and the job from host 0's. Without
/// its length the ring fails MPI_Init, naming the variable.
#[test]
fn openmpi_on_demand_world_reaches_a_ring_on_demand_and_results_stay_bit_identical() {
    const RANKS: usize = 4;
    let bed = MpiBed::with_testbed("demand-ring", RANKS, 1, true, |_tb, dir| {
        let keys = dir.join("keys.toml");
        std::fs::write(&keys, format!("[[tenant]]\nname = \"{TENANT}\"\nkey = \"{KEY}\"\njobs = {DEMAND_JOBS}\n")).expect("write keys");
        std::fs::set_permissions(&keys, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod keys");
        format!("[node]\ncontrol = \"0.0.0.0:{CONTROL_PORT}\"\nkeys = \"{}\"\n", keys.display())
    });
    let member_text = format!("{}metrics = \"off\"\nuserspace_path = \"optional\"\nring_pool = 32768\n", bed.text);
    let tag = |r: usize| format!("mpi-demand-ring-member-r{r}");
    let members: Vec<live_attach::LiveAttach> =
        (0..RANKS).map(|r| live_attach::LiveAttach::start(&bed.tb.host(r + 1).netns, &tag(r), &member_text, &[])).collect();
    let pattern = aggbox::node::pin_dir(&members[0].pin_root, "eth0").display().to_string().replace("-r0", "-r{rank}");
    let program = program(Mpi::OpenMpi, &bed.dir);
    let sizes = ["1", "362", "1448", "10000"];
    let plain = bed.mpirun(Mpi::OpenMpi, RANKS, &[], &program, &sizes);
    assert!(plain.status.success(), "plain run failed");

    let ring_env = [
        ("AGGBOX_MPI_RING", "demand".to_string()),
        ("AGGBOX_MPI_PIN_DIR", pattern),
        ("AGGBOX_MPI_RING_LEN", "16384".to_string()),
        ("AGGBOX_MPI_RING_THRESHOLD", "1000".to_string()),
    ];
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &bed.on_demand_env(Mpi::OpenMpi, KEY, &ring_env), &program, &sizes);
    assert!(out.status.success(), "run with a ring on demand failed:\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(result_lines(&out), result_lines(&plain), "results with the ring on demand differ from plain MPI's");
    assert_counters(&out, RANKS, |_| on_demand_counters(sizes.len()), "jobs on demand with a ring");
    for r in 0..RANKS {
        let line = counters_line(&out, r);
        let ring_calls = ring_calls(&line, on_demand_jobs(&line)[0].0);
        // SUM, MAX and MIN (the ring's ops) from the threshold on (1448 and
        // 10000 elements): two allreduces and two reduces each; and the
        // program's SUM of 1000 on a duplicate of MPI_COMM_WORLD (the same
        // processes in the same order share its job and ring).
        assert_eq!(ring_calls, 2 * 3 * 4 + 1, "rank {r}: calls the ring served: {line}");
    }
    let since = Instant::now();
    while members.iter().any(|m| !m.status().rings.is_empty()) {
        assert!(since.elapsed() < Duration::from_secs(3), "the run's ring is left on the ranks' nodes after MPI_Finalize");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_no_jobs_soon(&bed, "after the run with a ring");

    // A ring on demand without its length: MPI_Init fails and says why.
    let short: Vec<(&str, String)> = ring_env.iter().filter(|(k, _)| *k != "AGGBOX_MPI_RING_LEN").cloned().collect();
    let out = bed.mpirun(Mpi::OpenMpi, RANKS, &bed.on_demand_env(Mpi::OpenMpi, KEY, &short), &program, &["1"]);
    assert!(!out.status.success(), "a ring on demand without AGGBOX_MPI_RING_LEN must fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs AGGBOX_MPI_RING_LEN"), "the reason is printed: {stderr}");
    drop(members);
}
