//! Jobs on demand (docs/INTERFACE.md, "Jobs on demand"): a node whose file
//! has no `[[job]]` serves the runs that bring their own job through its
//! control endpoint. Four workers in namespaces join a run with a
//! credential of the node's key file, get the job, run int32 and float32
//! allreduces exactly, and end it; the same run key then gets a new
//! incarnation (another job id). A wrong key and an unknown tenant are
//! refused with their reasons and create nothing. Two runs of two tenants
//! at once are both exact, and neither may end the other's job; a run
//! whose workers die (they never renew nor end) loses its job within a
//! lease.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod live_attach;
#[path = "../src/testing/impair/mod.rs"]
mod impair;

use std::net::SocketAddr;
use std::time::Duration;

use aggbox::runtime::control::{Credential, RunJob};
use aggbox::wire::control::{read_frame, write_frame, Envelope, Refusal, Reply, Request};
use aggbox::runtime::Collective;
use aggbox::wire::abi::Op;
use live_attach::{KeyFile, LiveAttach};
use testbed::{Testbed, TestbedConfig};

const WORKERS: usize = 4;
const CONTROL_PORT: u16 = 7471;
const DATA_PORT: u16 = 7700;
const KEY: &str = "5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0";

fn credential(key: &str) -> Credential {
    Credential { tenant: "training".into(), key: hex::decode(key).unwrap() }
}

/// Rank `r`'s int32 input of `n` elements.
fn ints(r: usize, n: usize) -> Vec<i32> {
    (0..n).map(|i| ((i * 7 + r * 1_000_003) % 20_001) as i32 - 10_000).collect()
}

/// The SUM of the inputs `ints(first + q, n)` of ranks q = 0..WORKERS.
fn sum_of_ranks(first: usize, n: usize) -> Vec<i32> {
    let inputs: Vec<Vec<i32>> = (0..WORKERS).map(|q| ints(first + q, n)).collect();
    (0..n).map(|i| inputs.iter().map(|x| x[i]).sum()).collect()
}

#[test]
fn a_node_without_jobs_serves_a_run_that_brings_its_own() {
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
    let keys = KeyFile::new("on-demand", &[("training", KEY)]);
    let config = keys.node_config("off") + &format!("control = \"0.0.0.0:{CONTROL_PORT}\"\n");
    let _node = LiveAttach::start(&tb.host(0).netns, "on-demand", &config, &[]);
    let control = SocketAddr::from(SocketAddr::new(tb.host(0).addr.into(), CONTROL_PORT));

    // Refusals first: they create nothing.
    let data = |h: usize| SocketAddr::new(tb.host(h).addr.into(), DATA_PORT);
    let bad = tb
        .in_host(1, || RunJob::join(control, credential(&KEY.replace("5", "6")), "run", 4, 0, data(1), None, Duration::from_secs(5)))
        .unwrap()
        .expect_err("a wrong key");
    assert!(bad.to_string().contains("bad_mac"), "{bad}");
    let stranger = Credential { tenant: "nobody".into(), key: vec![1; 32] };
    let unknown = tb
        .in_host(1, || RunJob::join(control, stranger, "run", 4, 0, data(1), None, Duration::from_secs(5)))
        .unwrap()
        .expect_err("an unknown tenant");
    assert!(unknown.to_string().contains("unknown_tenant"), "{unknown}");

    let mut jobs = Vec::new();
    for incarnation in 1..=2u64 {
        let results: Vec<(u16, u64)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..WORKERS)
                .map(|r| {
                    let tb = &tb;
                    s.spawn(move || {
                        let (run, comm) = tb
                            .in_host(r + 1, || {
                                let run = RunJob::join(control, credential(KEY), "run", WORKERS as u16, r as u16, data(r + 1), None, Duration::from_secs(20))
                                    .unwrap_or_else(|e| panic!("rank {r}: join: {e}"));
                                let comm = run.builder().deadline(Duration::from_secs(10)).build().unwrap_or_else(|e| panic!("rank {r}: build: {e}"));
                                (run, comm)
                            })
                            .unwrap();
                        for n in [1usize, 362, 10_007] {
                            let want = sum_of_ranks(0, n);
                            let mut v = ints(r, n);
                            comm.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("rank {r}: int32 SUM of {n}: {e}"));
                            assert_eq!(v, want, "rank {r}: int32 SUM of {n}");
                            let mut x = vec![r as f32 + 1.0; n];
                            comm.allreduce(&mut x, Op::Avg).unwrap_or_else(|e| panic!("rank {r}: float32 AVG of {n}: {e}"));
                            assert!(x.iter().all(|y| (y - 2.5).abs() < 1e-5), "rank {r}: float32 AVG of {n}: {:?}", &x[..1]);
                        }
                        let g = (run.grant().job, run.grant().incarnation);
                        drop(comm);
                        run.end().unwrap_or_else(|e| panic!("rank {r}: end: {e}"));
                        g
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        assert!(results.iter().all(|g| *g == results[0]), "every rank got the same job: {results:?}");
        assert_eq!(results[0].1, incarnation);
        jobs.push(results[0].0);
    }
    assert_ne!(jobs[0], jobs[1], "a new incarnation is a new job");
}

/// One AGC1 request as a bare client sends it (from the calling thread's
/// network namespace), and the node's reply.
fn raw(control: SocketAddr, tenant: &str, key: &str, nonce: u8, request: &Request) -> Reply {
    let mut s = std::net::TcpStream::connect(control).expect("connect to the control endpoint");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let mut n = [0u8; 16];
    n[0] = nonce;
    n[1..9].copy_from_slice(&now.to_be_bytes());
    write_frame(&mut s, &Envelope::sign(tenant, &hex::decode(key).unwrap(), n, now, request)).unwrap();
    serde_json::from_slice(&read_frame(&mut s).expect("a reply")).expect("a reply frame")
}

const KEY_B: &str = "b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0";

#[test]
fn two_runs_at_once_stay_apart_and_a_dead_run_loses_its_job_within_a_lease() {
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
    let keys = KeyFile::new("on-demand2", &[("training", KEY), ("other", KEY_B)]);
    let config = keys.node_config("127.0.0.1:9473");
    let node = LiveAttach::start(&tb.host(0).netns, "on-demand2", &config, &[]);
    let control = SocketAddr::from(SocketAddr::new(tb.host(0).addr.into(), CONTROL_PORT));
    let data = |h: usize| SocketAddr::new(tb.host(h).addr.into(), DATA_PORT);

    // Two runs of two ranks each, of two tenants, at once.
    let runs = [("training", KEY, [1usize, 2]), ("other", KEY_B, [3, 4])];
    let grants: Vec<(u16, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = runs
            .iter()
            .flat_map(|(tenant, key, hosts)| hosts.iter().enumerate().map(move |(r, &h)| (*tenant, *key, r, h, *hosts)))
            .map(|(tenant, key, r, h, hosts)| {
                let tb = &tb;
                s.spawn(move || {
                    let cred = Credential { tenant: tenant.into(), key: hex::decode(key).unwrap() };
                    let (run, comm) = tb
                        .in_host(h, || {
                            let run = RunJob::join(control, cred, "run", 2, r as u16, data(h), None, Duration::from_secs(20))
                                .unwrap_or_else(|e| panic!("{tenant} rank {r}: join: {e}"));
                            let comm = run.builder().deadline(Duration::from_secs(10)).build().expect("build");
                            (run, comm)
                        })
                        .unwrap();
                    for k in 0..50 {
                        let n = 1000 + k;
                        let mut v = ints(h, n);
                        let (a, b) = (ints(hosts[0], n), ints(hosts[1], n));
                        let want: Vec<i32> = (0..n).map(|i| a[i] + b[i]).collect();
                        comm.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("{tenant} rank {r}: call {k}: {e}"));
                        assert_eq!(v, want, "{tenant} rank {r}: call {k}");
                    }
                    let g = (run.grant().job, run.grant().incarnation);
                    // Keep the job until every rank of both runs is done.
                    std::thread::sleep(Duration::from_millis(200));
                    drop(comm);
                    drop(run);
                    g
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    assert_eq!(grants[0], grants[1]);
    assert_eq!(grants[2], grants[3]);
    assert_ne!(grants[0].0, grants[2].0, "each run its own job");

    // A run whose workers die: joined by bare clients that never renew nor
    // end. The job is live, another tenant cannot end it, and it is gone
    // within a lease (10 s) and a lease check.
    let joined: Vec<Reply> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2usize)
            .map(|r| {
                let tb = &tb;
                s.spawn(move || {
                    tb.in_host(r + 1, || {
                        raw(control, "training", KEY, r as u8, &Request::Join { run: "dead".into(), world: 2, rank: r as u16, data: data(r + 1), vector_len: None, window: Some(16), frag_elems: Some(362), parent: None, ring: None })
                    })
                    .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let Reply::Joined(g) = &joined[0] else { panic!("{joined:?}") };
    assert!(node.status().jobs.iter().any(|j| j.id == g.job), "the dead run's job is served");
    // `aggbox status` names its owner, run, incarnation and lease (published
    // at the node's next lease tick).
    let since = std::time::Instant::now();
    let shown = loop {
        if let Some(d) = node.status().jobs.iter().find(|j| j.id == g.job).and_then(|j| j.on_demand.clone()) {
            break d;
        }
        assert!(since.elapsed() < Duration::from_secs(3), "status never showed the owner of job {}", g.job);
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!((shown.tenant.as_str(), shown.run.as_str(), shown.incarnation, shown.workers), ("training", "dead", 1, 2), "{shown:?}");
    assert_eq!(shown.expires_ms - shown.renewed_ms, g.lease_ms, "{shown:?}");
    let text = aggbox::node::format_status(&node.status());
    assert!(text.contains("on demand: tenant training run \"dead\" incarnation 1"), "{text}");
    assert!(
        node.status().jobs.iter().filter(|j| j.id != g.job).all(|j| j.on_demand.is_none()),
        "only live jobs on demand are listed as such"
    );
    let other = tb
        .in_host(3, || raw(control, "other", KEY_B, 9, &Request::End { job: g.job, incarnation: g.incarnation, rank: 0 }))
        .unwrap();
    assert!(matches!(other, Reply::Refused { reason: Refusal::UnknownJob, .. }), "{other:?}");
    let since = std::time::Instant::now();
    while node.status().jobs.iter().any(|j| j.id == g.job) {
        assert!(since.elapsed() < Duration::from_millis(g.lease_ms + 2000), "job {} outlived its lease", g.job);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(node.status().jobs.is_empty(), "every job of the runs is gone: {:?}", node.status().jobs);
    // The operator sees it: created 3 (two runs and the dead one), ended 2,
    // expired 1, the other tenant's end refused, none live.
    let metrics = tb.in_host(0, scrape).unwrap();
    for line in [
        "aggbox_control_jobs_created_total{iface=\"eth0\"} 3",
        "aggbox_control_jobs_ended_total{iface=\"eth0\"} 2",
        "aggbox_control_jobs_expired_total{iface=\"eth0\"} 1",
        "aggbox_control_refused_total{iface=\"eth0\",reason=\"unknown_job\"} 1",
        "aggbox_control_refused_total{iface=\"eth0\",reason=\"bad_mac\"} 0",
        "aggbox_control_live_jobs{iface=\"eth0\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} not in /metrics:\n{}", metrics.lines().filter(|l| l.contains("control")).collect::<Vec<_>>().join("\n"));
    }
}

/// The node's /metrics text (from its namespace).
fn scrape() -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect("127.0.0.1:9473").expect("connect to /metrics");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The node killed with -9 and started again while a run is live: the new
/// node knows nothing of the run's job, so every call of the run fails
/// within its deadline, and once a renewal is refused the calls fail with
/// `CommError::JobLost` naming the node and telling the rank to join again;
/// the run joined again gets a job of the new node and is exact.
#[test]
fn a_run_whose_node_restarted_fails_naming_the_node_and_joins_again() {
    use aggbox::runtime::CommError;
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
    let keys = KeyFile::new("on-demand3", &[("training", KEY)]);
    let config = keys.node_config("off");
    let mut node = LiveAttach::start(&tb.host(0).netns, "on-demand3", &config, &[]);
    let control = SocketAddr::from(SocketAddr::new(tb.host(0).addr.into(), CONTROL_PORT));
    let data = |h: usize| SocketAddr::new(tb.host(h).addr.into(), DATA_PORT);
    let deadline = Duration::from_secs(2);
    let join = |r: usize| {
        tb.in_host(r + 1, || {
            RunJob::join(control, credential(KEY), "restart", WORKERS as u16, r as u16, data(r + 1), None, Duration::from_secs(20))
                .unwrap_or_else(|e| panic!("rank {r}: join: {e}"))
                .communicator(|b| b.deadline(deadline))
                .unwrap_or_else(|e| panic!("rank {r}: build: {e}"))
        })
        .unwrap()
    };
    let exact = |comm: &aggbox::runtime::control::RunCommunicator, r: usize, what: &str| {
        let n = 1000;
        let want = sum_of_ranks(0, n);
        let mut v = ints(r, n);
        comm.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("rank {r}: {what}: {e}"));
        assert_eq!(v, want, "rank {r}: {what}");
    };

    // The run, live: one exact call, then the node dies and comes back.
    let comms: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS).map(|r| s.spawn(move || join(r))).collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let old_job = comms[0].run().grant().job;
    std::thread::scope(|s| {
        for (r, c) in comms.iter().enumerate() {
            s.spawn(move || exact(c, r, "before the restart"));
        }
    });
    node.kill9();
    node.restart();
    assert!(node.status().jobs.is_empty(), "the restarted node serves no job of the old one");

    // Every call fails within its deadline; within a renewal period (a
    // third of the lease) and a deadline the failure names the node.
    let lease = Duration::from_millis(comms[0].run().grant().lease_ms);
    std::thread::scope(|s| {
        for (r, c) in comms.iter().enumerate() {
            s.spawn(move || {
                let since = std::time::Instant::now();
                loop {
                    let call = std::time::Instant::now();
                    let mut v = ints(r, 1000);
                    let err = c.allreduce(&mut v, Op::Sum).expect_err("a call to a job the node no longer serves");
                    assert!(call.elapsed() < deadline + Duration::from_secs(1), "rank {r}: the call took {:?}", call.elapsed());
                    if let CommError::JobLost(why) = &err {
                        assert!(why.contains(&control.to_string()) && why.contains("join the run again"), "rank {r}: {why}");
                        break;
                    }
                    assert!(since.elapsed() < lease / 3 + deadline * 2, "rank {r}: no JobLost after {:?}: {err}", since.elapsed());
                }
                // From then on at once.
                let call = std::time::Instant::now();
                let mut v = ints(r, 10);
                assert!(matches!(c.allreduce(&mut v, Op::Sum), Err(CommError::JobLost(_))));
                assert!(call.elapsed() < Duration::from_millis(100), "rank {r}: a lost job's call fails at once");
            });
        }
    });
    drop(comms);

    // Joined again: a job of the new node, exact.
    let comms: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS).map(|r| s.spawn(move || join(r))).collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    assert!(node.status().jobs.iter().any(|j| j.id == comms[0].run().grant().job), "the new node serves the new job");
    std::thread::scope(|s| {
        for (r, c) in comms.iter().enumerate() {
            s.spawn(move || exact(c, r, "after joining again"));
        }
    });
    eprintln!("job {old_job} before the restart, {} after", comms[0].run().grant().job);
    drop(comms);
}

/// A job on demand under 1 % loss and 1 % duplication on every link (the
/// node's and the workers' switch ports: joins, contributions, RESULT
/// copies, ACKs, renewals): 4 ranks run 250 int32 and 250 float32
/// allreduces, every one exact (float32 within far less than its
/// documented bound), and the loss was really injected and recovered from.
#[test]
fn a_job_on_demand_is_exact_over_500_allreduces_under_loss_and_duplication() {
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
    let keys = KeyFile::new("on-demand4", &[("training", KEY)]);
    let config = keys.node_config("off");
    let node = LiveAttach::start(&tb.host(0).netns, "on-demand4", &config, &[]);
    let control = SocketAddr::from(SocketAddr::new(tb.host(0).addr.into(), CONTROL_PORT));
    let data = |h: usize| SocketAddr::new(tb.host(h).addr.into(), DATA_PORT);
    let injector = impair::Injector::new();
    let impair = |loss: f64, dup: f64| {
        for h in 0..=WORKERS {
            let port = tb.switch_port(h);
            let injector = &injector;
            testbed::in_netns(&tb.switch_netns(), move || injector.set(&port, loss, dup))
                .expect("switch netns")
                .unwrap_or_else(|e| panic!("{e:#}"));
        }
    };
    impair(0.01, 0.01);
    const CALLS: usize = 250;
    let sizes = [1usize, 362, 363, 5_000];
    let retransmitted: u64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|r| {
                let tb = &tb;
                s.spawn(move || {
                    let comm = tb
                        .in_host(r + 1, || {
                            RunJob::join(control, credential(KEY), "lossy", WORKERS as u16, r as u16, data(r + 1), None, Duration::from_secs(20))
                                .unwrap_or_else(|e| panic!("rank {r}: join: {e}"))
                                .communicator(|b| b.deadline(Duration::from_secs(20)))
                                .unwrap_or_else(|e| panic!("rank {r}: build: {e}"))
                        })
                        .unwrap();
                    for k in 0..CALLS {
                        let n = sizes[k % sizes.len()];
                        let inputs: Vec<Vec<i32>> = (0..WORKERS).map(|q| ints(q + k, n)).collect();
                        let input = |q: usize| -> Vec<i32> { inputs[q].clone() };
                        let want = sum_of_ranks(k, n);
                        let mut v = input(r);
                        comm.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("rank {r}: int32 call {k}: {e}"));
                        assert_eq!(v, want, "rank {r}: int32 call {k} of {n}");
                        // |x| <= 1: the adaptive scale's bound is 0.5 * 4 /
                        // scale, some 1e-8; the float32 sum adds half an ulp.
                        let xs = |q: usize| -> Vec<f32> { input(q).iter().map(|&x| x as f32 / 10_000.0).collect() };
                        let floats: Vec<Vec<f32>> = (0..WORKERS).map(xs).collect();
                        let want: Vec<f32> = (0..n).map(|i| floats.iter().map(|x| x[i]).sum()).collect();
                        let mut x = xs(r);
                        comm.allreduce(&mut x, Op::Sum).unwrap_or_else(|e| panic!("rank {r}: float32 call {k}: {e}"));
                        let worst = x.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                        assert!(worst <= 2e-6, "rank {r}: float32 call {k} of {n}: off by {worst}");
                    }
                    comm.stats().retransmitted
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).sum()
    });
    impair(0.0, 0.0);
    let c = injector.counts();
    let resent: u64 = node.status().served.values().map(|s| s.resent).sum();
    eprintln!("{} calls a rank: injector {c:?}; workers retransmitted {retransmitted}, the node resent {resent} RESULT copies", 2 * CALLS);
    assert!(c.dropped > 0 && c.duplicated > 0, "the injector dropped and duplicated: {c:?}");
    assert!(retransmitted + resent > 0, "{} datagrams dropped and nothing was sent again", c.dropped);
}

/// The node's resident memory (kB) and open descriptors, from /proc.
fn node_resources(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the node's /proc status");
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    (rss, std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the node's fds").count())
}

/// 500 runs created and ended one after the other: the node's jobs,
/// groups, published records, descriptors and resident memory are back
/// where they started (memory within 16 MiB: the allocator keeps what
/// the busiest moment used).
#[test]
fn five_hundred_runs_created_and_ended_leave_the_node_as_it_was() {
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    let tb = Testbed::up(TestbedConfig { hosts: 3, ..Default::default() }).expect("testbed");
    let keys = KeyFile::new("on-demand5", &[("training", KEY)]);
    let config = keys.node_config("127.0.0.1:9473");
    let node = LiveAttach::start(&tb.host(0).netns, "on-demand5", &config, &[]);
    // The node's pid: `ip netns exec` execs the binary.
    let pid = node.child.id();
    let control = SocketAddr::from(SocketAddr::new(tb.host(0).addr.into(), CONTROL_PORT));
    let data = |h: usize| SocketAddr::new(tb.host(h).addr.into(), DATA_PORT);
    let cycle = |k: usize| {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2usize)
                .map(|r| {
                    let tb = &tb;
                    s.spawn(move || {
                        tb.in_host(r + 1, || {
                            let run = RunJob::join(control, credential(KEY), &format!("cycle-{k}"), 2, r as u16, data(r + 1), None, Duration::from_secs(20))
                                .unwrap_or_else(|e| panic!("cycle {k} rank {r}: join: {e}"));
                            let job = run.grant().job;
                            run.end().unwrap_or_else(|e| panic!("cycle {k} rank {r}: end: {e}"));
                            job
                        })
                        .unwrap()
                    })
                })
                .collect();
            let jobs: Vec<u16> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
            assert_eq!(jobs[0], jobs[1], "cycle {k}");
        })
    };
    let settle = || {
        // Ended jobs leave at once; the published records at the next tick.
        std::thread::sleep(Duration::from_millis(600));
        let st = node.status();
        (st.jobs.len(), st.groups.len(), aggbox::node::control::published::read(&node.pin_root.join("eth0")).len())
    };
    // A first few cycles warm the allocator and the node's threads.
    for k in 0..5 {
        cycle(k);
    }
    let (before, resources_before) = (settle(), node_resources(pid));
    let started = std::time::Instant::now();
    for k in 5..505 {
        cycle(k);
    }
    let elapsed = started.elapsed();
    let (after, resources_after) = (settle(), node_resources(pid));
    let metrics = tb.in_host(0, scrape).unwrap();
    let applied: Vec<&str> = metrics.lines().filter(|l| l.starts_with("aggbox_control_apply_seconds_")).collect();
    eprintln!(
        "500 runs in {elapsed:?}: jobs/groups/published {before:?} -> {after:?}, node RSS kB / fds {resources_before:?} -> {resources_after:?}\n{}",
        applied.join("\n")
    );
    assert!(
        applied.iter().any(|l| l.starts_with("aggbox_control_apply_seconds_count") && l.ends_with(" 1010")),
        "each of the 505 runs applied twice (created, ended): {applied:?}"
    );
    assert_eq!(before, (0, 0, 0), "no job on demand left after the warm-up");
    assert_eq!(after, before, "jobs, groups and published records back where they started");
    assert_eq!(resources_after.1, resources_before.1, "the node's descriptors back where they started");
    assert!(resources_after.0 <= resources_before.0 + 16 * 1024, "the node's memory grew from {} to {} kB", resources_before.0, resources_after.0);
}

/// One run over two aggregator nodes: every rank joins the run at both
/// (`RunCommunicator::join`), each vector is striped over the two jobs,
/// and the results are exact under 1 % loss on every link; each node
/// served its stripe (its XDP program accepted contributions of its job).
#[test]
fn a_run_striped_over_two_nodes_is_exact_under_loss() {
    use aggbox::runtime::control::RunCommunicator;
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 2, ..Default::default() }).expect("testbed");
    let keys = KeyFile::new("on-demand6", &[("training", KEY)]);
    let config = keys.node_config("off");
    let nodes = [
        LiveAttach::start(&tb.host(0).netns, "on-demand6a", &config, &[]),
        LiveAttach::start(&tb.host(1).netns, "on-demand6b", &config, &[]),
    ];
    let controls: Vec<SocketAddr> = (0..2).map(|h| SocketAddr::from(SocketAddr::new(tb.host(h).addr.into(), CONTROL_PORT))).collect();
    let injector = impair::Injector::new();
    let impair = |loss: f64| {
        for h in 0..WORKERS + 2 {
            let port = tb.switch_port(h);
            let injector = &injector;
            testbed::in_netns(&tb.switch_netns(), move || injector.set(&port, loss, 0.0))
                .expect("switch netns")
                .unwrap_or_else(|e| panic!("{e:#}"));
        }
    };
    impair(0.01);
    let started = std::time::Instant::now();
    let comms: Vec<RunCommunicator> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|r| {
                let (tb, controls) = (&tb, &controls);
                s.spawn(move || {
                    let data = SocketAddr::new(tb.host(r + 2).addr.into(), DATA_PORT);
                    let comm = tb
                        .in_host(r + 2, || {
                            RunCommunicator::join(controls, credential(KEY), "striped", WORKERS as u16, r as u16, data, None, Duration::from_secs(20), |b| {
                                b.deadline(Duration::from_secs(20))
                            })
                            .unwrap_or_else(|e| panic!("rank {r}: join: {e}"))
                        })
                        .unwrap();
                    for (k, n) in [1usize, 2, 363, 100_003].into_iter().cycle().take(40).enumerate() {
                        let want = sum_of_ranks(k, n);
                        let mut v = ints(r + k, n);
                        comm.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("rank {r}: call {k} of {n}: {e}"));
                        assert_eq!(v, want, "rank {r}: call {k} of {n}");
                    }
                    comm
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    impair(0.0);
    eprintln!("40 striped calls a rank in {:?}; injector {:?}", started.elapsed(), injector.counts());
    let jobs: Vec<Vec<u16>> = comms.iter().map(|c| c.runs().iter().map(|run| run.grant().job).collect()).collect();
    assert!(jobs.iter().all(|j| *j == jobs[0] && j.len() == 2), "every rank has a job at each node: {jobs:?}");
    assert!(injector.counts().dropped > 0, "the injector dropped: {:?}", injector.counts());
    for (node, job) in nodes.iter().zip(&jobs[0]) {
        let accepted = node
            .status()
            .jobs
            .iter()
            .find(|j| j.id == *job)
            .and_then(|j| j.counters)
            .map_or(0, |c| c.accepted + c.results);
        assert!(accepted > 0, "node {} aggregated none of job {job}'s stripe", node.pin_root.display());
    }
    drop(comms);
    drop(nodes);
}

/// Trees on demand (docs/INTERFACE.md, "Trees on demand"): a root node and
/// two leaf nodes, none with a `[[job]]`, each with the run's tenant in its
/// key file. Two workers per leaf join their leaf with the tree's root as
/// `parent`; each leaf joins the root for them, and every worker gets the
/// SUM over all four (a leaf alone has half of it) and the float mean over
/// the tree's workers. Ended, the leaves' jobs go and take the root's with
/// them; a run whose workers die (joined by bare clients that never renew)
/// leaves nothing on any node within a lease; a root that cannot be reached
/// refuses every rank at once, naming it, and creates nothing.
#[test]
fn a_tree_of_nodes_on_demand_is_exact_and_leaves_nothing_behind() {
    use aggbox::runtime::control::{JobShape, TreeParent};
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    const LEAVES: usize = 2;
    const PER_LEAF: usize = WORKERS / LEAVES;
    let tb = Testbed::up(TestbedConfig { hosts: 1 + LEAVES + WORKERS, ..Default::default() }).expect("testbed");
    let keys = KeyFile::new("on-demand-tree", &[("training", KEY)]);
    let config = keys.node_config("off");
    let nodes: Vec<LiveAttach> = (0..=LEAVES).map(|h| LiveAttach::start(&tb.host(h).netns, &format!("od-tree{h}"), &config, &[])).collect();
    let control = |h: usize| SocketAddr::from(SocketAddr::new(tb.host(h).addr.into(), CONTROL_PORT));
    let root = SocketAddr::new(tb.host(0).addr.into(), CONTROL_PORT);
    let data = |h: usize| SocketAddr::new(tb.host(h).addr.into(), DATA_PORT);
    // Worker w (global rank) is host 1 + LEAVES + w, rank w % PER_LEAF of leaf w / PER_LEAF.
    let shape = |leaf: usize, root: SocketAddr| JobShape {
        parent: Some(TreeParent { node: root, leaf: leaf as u16, leaves: LEAVES as u16, tree_workers: WORKERS as u16 }),
        ..JobShape::default()
    };
    let live = |h: usize| nodes[h].status().jobs.len();

    let grants: Vec<(u16, Option<u16>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|w| {
                let (tb, shape) = (&tb, &shape);
                s.spawn(move || {
                    let (leaf, r, h) = (w / PER_LEAF, w % PER_LEAF, 1 + LEAVES + w);
                    let comm = tb
                        .in_host(h, || {
                            RunJob::join_shaped(control(1 + leaf), credential(KEY), "tree", PER_LEAF as u16, r as u16, data(h), shape(leaf, root), Duration::from_secs(20))
                                .unwrap_or_else(|e| panic!("worker {w}: join: {e}"))
                                .communicator(|b| b.deadline(Duration::from_secs(10)))
                                .unwrap_or_else(|e| panic!("worker {w}: build: {e}"))
                        })
                        .unwrap();
                    for n in [1usize, 362, 10_007] {
                        let want = sum_of_ranks(0, n);
                        let mut v = ints(w, n);
                        comm.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("worker {w}: int32 SUM of {n}: {e}"));
                        assert_eq!(v, want, "worker {w}: int32 SUM of {n} over the tree");
                        let mut x = vec![w as f32 + 1.0; n];
                        comm.allreduce(&mut x, Op::Avg).unwrap_or_else(|e| panic!("worker {w}: float32 AVG of {n}: {e}"));
                        assert!(x.iter().all(|y| (y - 2.5).abs() < 1e-5), "worker {w}: float32 mean of {n} over the tree's 4 workers: {:?}", &x[..1]);
                    }
                    let g = comm.run().grant();
                    let got = (g.job, g.tree_workers);
                    std::thread::sleep(Duration::from_millis(200)); // every worker done before any ends
                    comm.end().unwrap_or_else(|e| panic!("worker {w}: end: {e}"));
                    got
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("worker")).collect()
    });
    assert!(grants.iter().all(|g| g.1 == Some(WORKERS as u16)), "each leaf's grant carries the tree's workers: {grants:?}");
    let wait_empty = |what: &str, most: Duration| {
        let since = std::time::Instant::now();
        while (0..=LEAVES).any(|h| live(h) > 0) {
            assert!(since.elapsed() < most, "{what}: jobs left after {most:?}: {:?}", (0..=LEAVES).map(|h| nodes[h].status().jobs).collect::<Vec<_>>());
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_empty("the run ended", Duration::from_secs(2));

    // Workers that die: bare joins that never renew nor end. The tree is
    // built (the root's job over the leaves, a job at each leaf), then every
    // node is empty within a lease and the leaves' last look.
    let joined: Vec<Reply> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|w| {
                let tb = &tb;
                s.spawn(move || {
                    let (leaf, r, h) = (w / PER_LEAF, w % PER_LEAF, 1 + LEAVES + w);
                    let parent = Some(TreeParent { node: root, leaf: leaf as u16, leaves: LEAVES as u16, tree_workers: WORKERS as u16 });
                    tb.in_host(h, || {
                        raw(control(1 + leaf), "training", KEY, w as u8, &Request::Join { run: "dead".into(), world: PER_LEAF as u16, rank: r as u16, data: data(h), vector_len: None, window: None, frag_elems: None, parent, ring: None })
                    })
                    .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let Reply::Joined(g) = &joined[0] else { panic!("{joined:?}") };
    let root_jobs = nodes[0].status().jobs;
    assert_eq!(root_jobs.len(), 1, "the root serves the tree's job: {root_jobs:?}");
    let leaf_addrs: Vec<std::net::Ipv4Addr> = (1..=LEAVES).map(|h| tb.host(h).addr).collect();
    assert_eq!(root_jobs[0].ranks, leaf_addrs, "the root's workers are the leaves, in leaf order");
    assert!((1..=LEAVES).all(|h| live(h) == 1));
    // `aggbox status` shows each leaf's place and its root's job.
    for l in 0..LEAVES {
        let status = nodes[1 + l].status();
        let tree = status.jobs[0].on_demand.as_ref().and_then(|d| d.tree.clone()).expect("a leaf's job shows its tree");
        assert_eq!((tree.root.as_str(), tree.leaf, tree.leaves, tree.root_job), (root.to_string().as_str(), l as u16, LEAVES as u16, Some(root_jobs[0].id)));
        let text = aggbox::node::format_status(&status);
        assert!(text.contains(&format!("tree: leaf {l} of {LEAVES} under root {root} job {}", root_jobs[0].id)), "{text}");
    }
    wait_empty("the dead run", Duration::from_millis(g.lease_ms + 3000));

    // A root nobody serves: every rank refused at once, naming it.
    let nowhere = SocketAddr::new(tb.host(0).addr.into(), CONTROL_PORT + 1);
    let refused: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..PER_LEAF)
            .map(|r| {
                let (tb, shape) = (&tb, &shape);
                s.spawn(move || {
                    tb.in_host(1 + LEAVES + r, || {
                        RunJob::join_shaped(control(1), credential(KEY), "nowhere", PER_LEAF as u16, r as u16, data(1 + LEAVES + r), shape(0, nowhere), Duration::from_secs(20))
                            .expect_err("a root that cannot be reached")
                            .to_string()
                    })
                    .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &refused {
        assert!(e.contains("unavailable") && e.contains(&nowhere.to_string()), "{e}");
    }
    assert_eq!((0..=LEAVES).map(live).sum::<usize>(), 0, "a refused tree leaves nothing");
}

/// Rings on demand (docs/INTERFACE.md, "Rings on demand"): four workers,
/// each on a host whose own node serves rings (`[node] ring_pool`), join a
/// run at a fifth node naming their own nodes. The fifth node installs the
/// run's ring at the four and grants it with the star's job; each worker
/// opens the ring on its node's pins and allreduces over the ring and over
/// the star, exactly. Ended, the ring leaves every member node; a run whose
/// workers die (bare joins that never renew) leaves nothing on any node
/// within a lease; a member node that cannot be reached refuses every rank,
/// naming it, and leaves no ring at the others.
#[test]
fn a_ring_on_demand_is_installed_at_the_ranks_nodes_exact_and_removed_with_its_run() {
    use aggbox::runtime::control::{JobShape, RunCommunicator};
    use aggbox::runtime::{Algorithm, CallOptions};
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    const LEN: u32 = 20_000;
    let tb = Testbed::up(TestbedConfig { hosts: 1 + WORKERS, xdp_tx: true, ..Default::default() }).expect("testbed");
    let keys = KeyFile::new("on-demand-ring", &[("training", KEY)]);
    let star = LiveAttach::start(&tb.host(0).netns, "od-ring0", &keys.node_config("off"), &[]);
    let member_config = keys.node_config("127.0.0.1:9473") + "ring_pool = 40000\n";
    // Behind locks: the ranks' threads read their status, one is restarted.
    let members: Vec<std::sync::Mutex<LiveAttach>> = (1..=WORKERS)
        .map(|h| std::sync::Mutex::new(LiveAttach::start(&tb.host(h).netns, &format!("od-ring{h}"), &member_config, &["--xdp-mode", "native"])))
        .collect();
    let member = |m: usize| members[m].lock().unwrap_or_else(|p| p.into_inner());
    let control = |h: usize| SocketAddr::new(tb.host(h).addr.into(), CONTROL_PORT);
    let data = |h: usize| SocketAddr::new(tb.host(h).addr.into(), DATA_PORT);
    let shape = |r: usize| JobShape { vector_len: Some(LEN), ring: Some(control(r + 1)), ..JobShape::default() };
    let rings_at = |m: usize| member(m).status().rings.keys().copied().collect::<Vec<u16>>();
    let pin_dir = |m: usize| aggbox::node::pin_dir(&member(m).pin_root, "eth0");

    let grants: Vec<aggbox::runtime::control::RingGrant> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|r| {
                let (tb, shape, pin_dir, rings_at, member, star) = (&tb, &shape, &pin_dir, &rings_at, &member, &star);
                s.spawn(move || {
                    let comm = tb
                        .in_host(r + 1, || {
                            let run = RunJob::join_shaped(control(0), credential(KEY), "ring", WORKERS as u16, r as u16, data(r + 1), shape(r), Duration::from_secs(20))
                                .unwrap_or_else(|e| panic!("rank {r}: join: {e}"));
                            RunCommunicator::from_runs(vec![run], |b| b.deadline(Duration::from_secs(10)))
                                .unwrap_or_else(|e| panic!("rank {r}: build: {e}"))
                                .with_ring(&pin_dir(r))
                                .unwrap_or_else(|e| panic!("rank {r}: opening the run's ring: {e}"))
                                .with_ring_threshold(1000)
                        })
                        .unwrap();
                    let ring = comm.star().unwrap().run().grant().ring.clone().expect("the grant carries the ring");
                    assert!(rings_at(r).contains(&ring.id), "rank {r}: its node serves ring {}", ring.id);
                    // `aggbox status` names the ring's owner at the member
                    // and the ring beside the job at the star's node.
                    let status = member(r).status();
                    let owner = status.rings_on_demand.get(&ring.id).unwrap_or_else(|| panic!("rank {r}: no ring on demand in {:?}", status.rings_on_demand));
                    assert_eq!((owner.tenant.as_str(), owner.run.as_str(), owner.members), ("training", "ring", WORKERS as u16));
                    let text = aggbox::node::format_status(&status);
                    assert!(text.contains(&format!("ring {} on demand: tenant training run \"ring\"  4 members", ring.id)), "{text}");
                    let job = star.status().jobs.into_iter().find(|j| j.on_demand.as_ref().is_some_and(|d| d.run == "ring")).expect("the star's job");
                    assert_eq!(job.on_demand.and_then(|d| d.ring), Some(ring.id));
                    let metrics = tb.in_host(r + 1, scrape).unwrap();
                    assert!(metrics.contains("aggbox_control_live_rings{iface=\"eth0\"} 1"), "rank {r}'s node counts the ring:\n{metrics}");
                    // Calls of 1000 elements and more take the ring, smaller ones the star.
                    for (algorithm, n) in [(Algorithm::Ring, LEN as usize), (Algorithm::Ring, 10_007), (Algorithm::Star, 7), (Algorithm::Star, 1)] {
                        let want = sum_of_ranks(0, n);
                        let mut v = ints(r, n);
                        let served = comm
                            .allreduce_with(&mut v, Op::Sum, CallOptions::default())
                            .unwrap_or_else(|e| panic!("rank {r}: int32 SUM of {n}: {e}"));
                        assert_eq!(v, want, "rank {r}: int32 SUM of {n} ({algorithm:?})");
                        assert_eq!(served.algorithm, algorithm, "rank {r}: SUM of {n}");
                    }
                    let mut x = vec![r as f32 + 1.0; 10_007];
                    let served = comm.allreduce_with(&mut x, Op::Avg, CallOptions::default()).unwrap_or_else(|e| panic!("rank {r}: float32 AVG on the ring: {e}"));
                    assert_eq!(served.algorithm, Algorithm::Ring);
                    assert!(x.iter().all(|y| (y - 2.5).abs() < 1e-3), "rank {r}: float32 AVG on the ring: {:?}", &x[..1]);
                    std::thread::sleep(Duration::from_millis(200)); // every rank done before any ends
                    drop(comm);
                    ring
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    assert!(grants.iter().all(|g| *g == grants[0]), "every rank got the same ring: {grants:?}");
    let members_ips: Vec<std::net::Ipv4Addr> = (1..=WORKERS).map(|h| tb.host(h).addr).collect();
    assert_eq!((grants[0].members.clone(), grants[0].vector_len, grants[0].frag_elems), (members_ips, LEN, 362));
    let wait_empty = |what: &str, most: Duration| {
        let since = std::time::Instant::now();
        while star.status().jobs.len() + (0..WORKERS).map(|m| rings_at(m).len() + member(m).status().jobs.len()).sum::<usize>() > 0 {
            assert!(since.elapsed() < most, "{what}: left after {most:?}: star jobs {:?}, member rings {:?}", star.status().jobs, (0..WORKERS).map(rings_at).collect::<Vec<_>>());
            std::thread::sleep(Duration::from_millis(50));
        }
        for m in 0..WORKERS {
            assert_eq!(member(m).status().ring_pool.used, 0, "{what}: member {m}'s ring memory is free again");
        }
    };
    wait_empty("the run ended", Duration::from_secs(3));

    // Workers that die: bare joins that never renew nor end. The ring is
    // installed at every member, then every node is empty within a lease.
    let joined: Vec<Reply> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|r| {
                let tb = &tb;
                s.spawn(move || {
                    tb.in_host(r + 1, || {
                        let request = Request::Join { run: "dead-ring".into(), world: WORKERS as u16, rank: r as u16, data: data(r + 1), vector_len: Some(LEN), window: None, frag_elems: None, parent: None, ring: Some(control(r + 1)) };
                        raw(control(0), "training", KEY, 40 + r as u8, &request)
                    })
                    .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let Reply::Joined(g) = &joined[0] else { panic!("{joined:?}") };
    let ring = g.ring.clone().expect("a ring");
    assert!((0..WORKERS).all(|m| rings_at(m) == vec![ring.id]), "every member serves the dead run's ring: {:?}", (0..WORKERS).map(rings_at).collect::<Vec<_>>());
    wait_empty("the dead run", Duration::from_millis(2 * g.lease_ms + 3000));

    // A member node restarted mid-run (it knows nothing of the ring): the
    // node that granted the ring learns it at its next renewal and removes
    // the job, so every rank's ring calls fail with JobLost, within a
    // renewal and a call's deadline, not a hang.
    let comms: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|r| {
                let (tb, shape, pin_dir) = (&tb, &shape, &pin_dir);
                s.spawn(move || {
                    tb.in_host(r + 1, || {
                        let run = RunJob::join_shaped(control(0), credential(KEY), "lost", WORKERS as u16, r as u16, data(r + 1), shape(r), Duration::from_secs(20))
                            .unwrap_or_else(|e| panic!("rank {r}: join: {e}"));
                        let comm = RunCommunicator::from_runs(vec![run], |b| b.deadline(Duration::from_secs(5)))
                            .and_then(|c| c.with_ring(&pin_dir(r)))
                            .unwrap_or_else(|e| panic!("rank {r}: build: {e}"))
                            .with_algorithm(Algorithm::Ring);
                        let mut v = ints(r, 100);
                        comm.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("rank {r}: a ring call before the restart: {e}"));
                        assert_eq!(v, sum_of_ranks(0, 100));
                        comm
                    })
                    .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    {
        let mut restarted = member(WORKERS - 1);
        restarted.kill9();
        restarted.restart();
    }
    let since = std::time::Instant::now();
    let errors: Vec<aggbox::runtime::CommError> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, comm)| {
                // Calls fail within their deadline (the member's ring is
                // gone), then, once the job is lost, with JobLost.
                s.spawn(move || loop {
                    let mut v = ints(r, 100);
                    match comm.allreduce(&mut v, Op::Sum) {
                        Err(e @ aggbox::runtime::CommError::JobLost(_)) => break e,
                        other => assert!(since.elapsed() < Duration::from_secs(40), "rank {r}: no JobLost 40 s after a member restarted: {other:?}"),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    for (r, e) in errors.iter().enumerate() {
        assert!(matches!(e, aggbox::runtime::CommError::JobLost(_)), "rank {r}: a ring call after a member restarted fails with JobLost, not {e}");
    }
    assert!(since.elapsed() < Duration::from_secs(30), "the ring calls failed {:?} after the restart", since.elapsed());
    drop(comms);

    // A member node nobody serves: every rank refused, naming it; nothing left.
    let nowhere = SocketAddr::new(tb.host(WORKERS).addr.into(), CONTROL_PORT + 1);
    let refused: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|r| {
                let (tb, shape) = (&tb, &shape);
                s.spawn(move || {
                    let shape = if r == WORKERS - 1 { JobShape { ring: Some(nowhere), ..shape(r) } } else { shape(r) };
                    tb.in_host(r + 1, || {
                        RunJob::join_shaped(control(0), credential(KEY), "nowhere", WORKERS as u16, r as u16, data(r + 1), shape, Duration::from_secs(30))
                            .expect_err("a member node that cannot be reached")
                            .to_string()
                    })
                    .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &refused {
        assert!(e.contains("unavailable") && e.contains(&nowhere.to_string()), "{e}");
    }
    wait_empty("a refused ring", Duration::from_secs(1));
}
