//! IPv6 end to end (docs/PROTOCOL.md, "IPv6"): nodes that run only `aggbox
//! attach` serve allreduces to ranks that reach them over IPv6, on a
//! dual-stack LAN beside an IPv4 job, and on a LAN whose hosts have no IPv4
//! address at all.
//!
//! - Dual stack: one node serves job 11 of IPv4 workers and job 12 of the
//!   same hosts' IPv6 addresses at once, both node-served
//!   (`consumer = "node"`, RESULTs copied to each job's result group by
//!   TC), under 1 % loss on every switch port: every int32 result exact,
//!   every float32 mean within its bound, on both jobs, with calls of the
//!   two jobs running at the same time; the loss was injected and repaired.
//!   BXOR on the IPv6 job goes through the node's AF_XDP user-space path,
//!   exact.
//! - IPv6 only: the hosts' IPv4 addresses are removed before the node
//!   attaches; the node's control endpoint listens on `[::]`, four ranks
//!   join a run there from their IPv6 addresses and get a job on demand
//!   whose allreduces are exact, and a config job of IPv6 workers is
//!   served beside it.
//!
//! Needs root; fails (never skips) otherwise:
//! `sudo -E cargo test --test netns_dual_stack`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

#[path = "../src/testing/impair/mod.rs"]
mod impair;
mod live_attach;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use aggbox::config::Config;
use aggbox::runtime::control::{Credential, RunCommunicator};
use aggbox::runtime::{BackendKind, Collective, Communicator, CommunicatorBuilder, Participant};
use aggbox::wire::abi::Op;
use live_attach::{KeyFile, LiveAttach};
use testbed::{Testbed, TestbedConfig};

const WORKERS: usize = 4;
const JOB4: u16 = 11;
const JOB6: u16 = 12;
const DATA_PORT4: u16 = 7700;
const DATA_PORT6: u16 = 7701;
const CONTROL_PORT: u16 = 7471;
const KEY: &str = "6ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee1";

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/netns_dual_stack.rs needs root (network namespaces, XDP, TC): `sudo -E cargo test --test netns_dual_stack`"
    );
}

/// Worker host `h`'s IPv6 address.
fn v6(tb: &Testbed, h: usize) -> Ipv6Addr {
    tb.host(h).addr6.expect("a dual-stack testbed")
}

/// A `[[job]]` of `workers`, node-served, with its result group `group` of
/// the workers' sockets at `data_port`.
fn job_text(id: u16, port: u16, workers: &[IpAddr], group: u16, data_port: u16) -> String {
    let quoted = |f: &dyn Fn(&IpAddr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
    format!(
        "[[job]]\nid = {id}\nport = {port}\nworkers = [{}]\nresult_port = {}\nresult_group = {group}\nconsumer = \"node\"\n\n\
         [[group]]\nid = {group}\nmembers = [{}]\n\n",
        quoted(&|w| format!("\"{w}\"")),
        port + 1,
        quoted(&|w| format!("\"{}\"", SocketAddr::new(*w, data_port))),
    )
}

/// The workers of job `job`, each built in its host from the configuration
/// alone (`from_config(...).backend(Kernel)`).
fn workers(tb: &Testbed, config: &Config, job: u16, node: IpAddr, data_port: u16) -> Vec<Communicator> {
    (0..WORKERS)
        .map(|r| {
            let b = CommunicatorBuilder::from_config(config, job, node, data_port, Participant::Worker(r as u16))
                .expect("from_config")
                .backend(BackendKind::Kernel)
                .deadline(Duration::from_secs(20));
            tb.in_host(r + 1, move || b.build()).expect("netns").unwrap_or_else(|e| panic!("job {job}: worker {r}: {e}"))
        })
        .collect()
}

/// Rank `r`'s int32 input of `n` elements, call `k`.
fn ints(r: usize, k: usize, n: usize) -> Vec<i32> {
    (0..n).map(|i| ((i * 7 + r * 1_000_003 + k * 31) % 20_001) as i32 - 10_000).collect()
}

/// Every worker of `comms` makes the same calls: int32 SUM and MAX of 1,
/// 362, 363 and 10,007 elements, exact against the sum and maximum of the
/// inputs, and a float32 mean within its bound.
fn calls(what: &str, comms: &[impl Collective + Sync]) {
    std::thread::scope(|s| {
        for (r, c) in comms.iter().enumerate() {
            s.spawn(move || {
                for (k, n) in [1usize, 362, 363, 10_007].into_iter().cycle().take(12).enumerate() {
                    for op in [Op::Sum, Op::Max] {
                        let inputs: Vec<Vec<i32>> = (0..comms.len()).map(|q| ints(q, k, n)).collect();
                        let want: Vec<i32> = (0..n)
                            .map(|i| match op {
                                Op::Sum => inputs.iter().map(|x| x[i]).sum(),
                                _ => inputs.iter().map(|x| x[i]).max().unwrap(),
                            })
                            .collect();
                        let mut v = ints(r, k, n);
                        c.allreduce(&mut v, op).unwrap_or_else(|e| panic!("{what}: rank {r}: call {k} {op:?} of {n}: {e}"));
                        assert!(v == want, "{what}: rank {r}: call {k} {op:?} of {n} differs from the reference");
                    }
                }
                let n = 5_000;
                let mut f: Vec<f32> = (0..n).map(|i| (i as f32 * 0.25 + r as f32) * 1e-5).collect();
                c.allreduce(&mut f, Op::Avg).unwrap_or_else(|e| panic!("{what}: rank {r}: float mean: {e}"));
                let w = comms.len() as f32;
                for (i, x) in f.iter().enumerate() {
                    let want = (i as f32 * 0.25 + (w - 1.0) / 2.0) * 1e-5;
                    assert!((x - want).abs() <= 1e-8 + want.abs() * 1e-6, "{what}: rank {r}: element {i}: {x} vs {want}");
                }
            });
        }
    });
}

#[test]
fn a_dual_stack_node_serves_an_ipv4_and_an_ipv6_job_at_once_exact_under_loss() {
    require_root();
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ipv6: true, ..Default::default() }).expect("testbed");
    let w4: Vec<IpAddr> = (1..=WORKERS).map(|h| IpAddr::V4(tb.host(h).addr)).collect();
    let w6: Vec<IpAddr> = (1..=WORKERS).map(|h| IpAddr::V6(v6(&tb, h))).collect();
    let text = format!(
        "[node]\nmetrics = \"off\"\n\n{}{}",
        job_text(JOB4, 7600, &w4, 4, DATA_PORT4),
        job_text(JOB6, 7610, &w6, 6, DATA_PORT6)
    );
    let attach = LiveAttach::start(&tb.host(0).netns, "dual-stack", &text, &[]);
    let config = Config::parse(&text, "dual_stack").expect("config");
    let comms4 = workers(&tb, &config, JOB4, IpAddr::V4(tb.host(0).addr), DATA_PORT4);
    let comms6 = workers(&tb, &config, JOB6, IpAddr::V6(v6(&tb, 0)), DATA_PORT6);
    let injector = impair::Injector::new();
    let impair = |loss: f64| {
        for h in 0..=WORKERS {
            let port = tb.switch_port(h);
            let injector = &injector;
            testbed::in_netns(&tb.switch_netns(), move || injector.set(&port, loss, 0.0))
                .expect("switch netns")
                .unwrap_or_else(|e| panic!("{e:#}"));
        }
    };
    impair(0.01);
    std::thread::scope(|s| {
        s.spawn(|| calls("IPv4 job", &comms4));
        s.spawn(|| calls("IPv6 job", &comms6));
    });
    impair(0.0);
    let counts = injector.counts();
    assert!(counts.dropped > 0, "the injector dropped datagrams: {counts:?}");
    let resent: u64 = comms4.iter().chain(&comms6).map(|c| c.stats().retransmitted).sum();
    assert!(resent > 0, "lost contributions were resent ({counts:?})");
    // Each job was reduced by the node's XDP program (not only passed
    // through): its counters took contributions and made RESULTs.
    assert_reduced_in_kernel(&attach, &[JOB4, JOB6]);

    // An op the kernel does not run (BXOR) goes to the node's AF_XDP
    // user-space path, which takes the IPv6 ranks' contributions and sends
    // the IPv6 job's RESULTs back over IPv6: exact, every contribution
    // handed over.
    let handed = |job: u16| {
        attach.status().jobs.iter().find(|j| j.id == job).and_then(|j| j.counters).map_or(0, |c| c.handed_to_userspace)
    };
    let before = handed(JOB6);
    std::thread::scope(|s| {
        for (r, c) in comms6.iter().enumerate() {
            s.spawn(move || {
                for (k, n) in [1usize, 1000].into_iter().cycle().take(6).enumerate() {
                    let want: Vec<i32> = (0..n).map(|i| (0..WORKERS).fold(0, |x, q| x ^ ints(q, k, n)[i])).collect();
                    let mut v = ints(r, k, n);
                    c.allreduce(&mut v, Op::Bxor).unwrap_or_else(|e| panic!("IPv6 job: rank {r}: BXOR {k} of {n}: {e}"));
                    assert!(v == want, "IPv6 job: rank {r}: BXOR {k} of {n} differs from the reference");
                }
            });
        }
    });
    let handed = handed(JOB6) - before;
    assert!(handed >= 6 * WORKERS as u64, "the user-space path took the IPv6 job's contributions: {handed} handed over");
}

/// The node's XDP program accepted contributions of each of `jobs` and
/// completed RESULTs of it.
fn assert_reduced_in_kernel(attach: &LiveAttach, jobs: &[u16]) {
    let status = attach.status();
    for job in jobs {
        let c = status.jobs.iter().find(|j| j.id == *job).and_then(|j| j.counters).unwrap_or_else(|| panic!("job {job}'s counters"));
        assert!(c.accepted > 0 && c.results > 0, "job {job}: XDP accepted {} contributions and made {} RESULTs", c.accepted, c.results);
    }
}

#[test]
fn an_ipv6_only_lan_gets_jobs_on_demand_and_config_jobs_served() {
    require_root();
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ipv6: true, ..Default::default() }).expect("testbed");
    for h in 0..=WORKERS {
        let out = Command::new("ip")
            .args(["-n", &tb.host(h).netns, "-4", "addr", "flush", "dev", "eth0"])
            .output()
            .expect("ip addr flush");
        assert!(out.status.success(), "flushing host {h}'s IPv4 addresses: {}", String::from_utf8_lossy(&out.stderr));
    }
    let keys = KeyFile::new("ipv6-only", &[("training", KEY)]);
    let w6: Vec<IpAddr> = (1..=WORKERS).map(|h| IpAddr::V6(v6(&tb, h))).collect();
    let text = format!(
        "[node]\nmetrics = \"[::1]:9475\"\nkeys = \"{}\"\ncontrol = \"[::]:{CONTROL_PORT}\"\n\n{}",
        keys.dir.join("keys.toml").display(),
        job_text(JOB6, 7610, &w6, 6, DATA_PORT6)
    );
    let attach = LiveAttach::start(&tb.host(0).netns, "ipv6-only", &text, &[]);
    let config = Config::parse(&text, "ipv6_only").expect("config");
    let node6 = IpAddr::V6(v6(&tb, 0));
    let comms = workers(&tb, &config, JOB6, node6, DATA_PORT6);
    calls("config job over IPv6 only", &comms);
    assert_reduced_in_kernel(&attach, &[JOB6]);

    let control = SocketAddr::new(node6, CONTROL_PORT);
    let credential = Credential { tenant: "training".into(), key: hex::decode(KEY).unwrap() };
    let runs: Vec<RunCommunicator> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORKERS)
            .map(|r| {
                let credential = credential.clone();
                let tb = &tb;
                s.spawn(move || {
                    let data = SocketAddr::new(IpAddr::V6(v6(tb, r + 1)), 7800);
                    tb.in_host(r + 1, || {
                        RunCommunicator::join(&[control], credential, "v6-run", WORKERS as u16, r as u16, data, None, Duration::from_secs(20), |b| {
                            b.deadline(Duration::from_secs(20))
                        })
                        .unwrap_or_else(|e| panic!("rank {r}: join over IPv6: {e}"))
                    })
                    .expect("netns")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    calls("job on demand over IPv6 only", &runs);
    let granted: Vec<u16> = runs.iter().map(|c| c.runs()[0].grant().job).collect();
    assert!(granted.iter().all(|j| *j == granted[0]), "every rank has the run's job: {granted:?}");
    assert_reduced_in_kernel(&attach, &granted[..1]);
    let text = format!("{:?}", attach.status());
    assert!(text.contains("v6-run"), "the node's status shows the run: {text}");
    for run in runs {
        run.end().expect("end the run");
    }
}
