//! A node that runs only `aggbox attach` serves an in-kernel allreduce
//! (`consumer = "node"`): the workers build their communicators from the
//! configuration alone, and no aggregator application runs anywhere.
//!
//! Host 0 runs `aggbox attach eth0` with the job, a `[[group]]` of the
//! workers' sockets and `result_group`; hosts 1..=W are workers (4, and 16)
//! (`CommunicatorBuilder::from_config(...).backend(BackendKind::Kernel)`).
//! Datagrams are dropped and duplicated on every switch port, the ones that
//! lead to the workers included: a RESULT copy lost there can only come
//! from the node's result service, whose counters (`/metrics`) must show the
//! resends, and the injector's counters the loss. Every int result equals
//! the reference, every float result is within the quantization bound;
//! broadcast among the workers works beside it; an aggregator application
//! for the job is refused, and the result port is the service's. Killing
//! the daemon (kill -9) mid-call makes a call either complete exactly or
//! fail naming the aggregator, within its deadline; after `aggbox attach`
//! starts again the next calls complete. A new set of communicators (a
//! second program) resumes where the node is, from its answer to the
//! position query, which only the workers' own sockets get.
//!
//! Needs root; fails (never skips) otherwise:
//! `sudo -E cargo test --test node_served`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

#[path = "../src/testing/impair/mod.rs"]
mod impair;
mod live_attach;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::time::Duration;

use aggbox::runtime::Collective;
use aggbox::config::{AckMode, Config};
use aggbox::runtime::fragment::elements_per_fragment;
use aggbox::runtime::{BackendKind, CallOptions, CommError, Communicator, CommunicatorBuilder, Participant};
use aggbox::wire::abi::Op;
use aggbox::wire::proto::PositionMessage;
use aggbox::wire::reducer;
use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

const JOB: u16 = 11;
const JOB_PORT: u16 = 7600;
const RESULT_PORT: u16 = 7601;
const GROUP: u16 = 4;
const DATA_PORT: u16 = 7700;
const METRICS_PORT: u16 = 9471;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/node_served.rs needs root (network namespaces, XDP, TC): `sudo -E cargo test --test node_served`"
    );
}

struct Bed {
    // Field order: communicators first, then the attachment, then the testbed.
    injector: impair::Injector,
    workers: Vec<Communicator>,
    config: Config,
    attach: LiveAttach,
    tb: Testbed,
}

impl Bed {
    fn up(tag: &str, ack: AckMode, nworkers: usize, deadline: Duration) -> Bed {
        let tb = Testbed::up(TestbedConfig { hosts: nworkers + 1, ..Default::default() }).expect("testbed");
        let workers: Vec<Ipv4Addr> = (1..=nworkers).map(|h| tb.host(h).addr).collect();
        let list = |f: &dyn Fn(&Ipv4Addr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
        let mode = match ack {
            AckMode::Packet => "packet",
            AckMode::Group => "group",
        };
        let text = format!(
            "[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nack_mode = \"{mode}\"\n\n[[job]]\nid = {JOB}\nport = {JOB_PORT}\nworkers = [{}]\nresult_port = {RESULT_PORT}\nresult_group = {GROUP}\nconsumer = \"node\"\n\n[[group]]\nid = {GROUP}\nmembers = [{}]\n",
            list(&|w| format!("\"{w}\"")),
            list(&|w| format!("\"{w}:{DATA_PORT}\"")),
        );
        let attach = LiveAttach::start(&tb.host(0).netns, tag, &text, &[]);
        let config = Config::parse(&text, "node_served").expect("config");
        let workers = build_workers(&tb, &config, nworkers, deadline)
            .into_iter()
            .map(|w| w.expect("build"))
            .collect();
        Bed { injector: impair::Injector::new(), workers, config, attach, tb }
    }

    /// Loss `loss` and duplication `dup` on every switch port (the node's
    /// and the workers'): contributions, RESULT copies, ACKs, resends,
    /// broadcast data (none at 0).
    fn impair(&self, loss: f64, dup: f64) {
        for h in 0..=self.workers.len() {
            let port = self.tb.switch_port(h);
            let injector = &self.injector;
            testbed::in_netns(&self.tb.switch_netns(), move || injector.set(&port, loss, dup))
                .expect("switch netns")
                .unwrap_or_else(|e| panic!("{e:#}"));
        }
    }

    /// The node's result-service counter `name` once it is at least `min`
    /// (the service publishes its counters every 50 ms), 5 s at most; what
    /// it is then.
    fn counter_at_least(&self, name: &str, min: u64) -> u64 {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let v = self.service_counter(name);
            if v >= min || std::time::Instant::now() > deadline {
                return v;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The node's result-service counter `name` for the job.
    fn service_counter(&self, name: &str) -> u64 {
        let text = testbed::in_netns(&self.tb.host(0).netns, || {
            let mut stream = TcpStream::connect(("127.0.0.1", METRICS_PORT)).expect("connect to /metrics");
            stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").expect("request");
            let mut text = String::new();
            stream.read_to_string(&mut text).expect("read /metrics");
            text
        })
        .expect("node netns");
        let prefix = format!("aggbox_result_service_{name}_total{{");
        text.lines()
            .find(|l| l.starts_with(&prefix) && l.contains(&format!("aggbox_job=\"{JOB}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .map(|v| v as u64)
            .unwrap_or_else(|| panic!("no {prefix}..aggbox_job=\"{JOB}\"}} in /metrics:\n{text}"))
    }
}

/// `nworkers` workers of the job, each built in its host the plain way
/// (`from_config(...).backend(Kernel).deadline(..).build()`), as a new
/// program would: nothing told about earlier runs.
fn build_workers(tb: &Testbed, config: &Config, nworkers: usize, deadline: Duration) -> Vec<Result<Communicator, CommError>> {
    let agg_addr = tb.host(0).addr;
    (0..nworkers)
        .map(|r| {
            let b = CommunicatorBuilder::from_config(config, JOB, agg_addr, DATA_PORT, Participant::Worker(r as u16))
                .expect("from_config")
                .backend(BackendKind::Kernel)
                .deadline(deadline);
            tb.in_host(r + 1, move || b.build()).expect("netns")
        })
        .collect()
}

fn input(rank: usize, len: usize) -> Vec<i32> {
    (0..len).map(|i| ((i * 7 + rank * 1_000_003) % 20_001) as i32 - 10_000).collect()
}

/// What the reference reducer makes of `workers` ranks' [`input`]s.
fn reference(op: Op, workers: usize, len: usize) -> Vec<i32> {
    let inputs: Vec<Vec<i32>> = (0..workers).map(|r| input(r, len)).collect();
    let c: Vec<(&[i32], i32)> = inputs.iter().map(|v| (v.as_slice(), 1)).collect();
    reducer::reduce(op, &c).expect("reference").ints().expect("ints").to_vec()
}

/// Every worker allreduces its vector at once; each gets the reference.
fn allreduce(bed: &Bed, op: Op, len: usize) {
    let want = reference(op, bed.workers.len(), len);
    std::thread::scope(|s| {
        let handles: Vec<_> = bed
            .workers
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let mut v = input(r, len);
                    c.allreduce(&mut v, op).unwrap_or_else(|e| panic!("worker {r}: allreduce {op:?} of {len}: {e}"));
                    v
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let got = h.join().expect("worker thread");
            assert!(got == want, "worker {r}: allreduce {op:?} of {len} differs from the reference");
        }
    });
}

/// Every worker allreduces floats (mean); each gets the same, close result.
fn allreduce_f32(bed: &Bed, len: usize) {
    std::thread::scope(|s| {
        let handles: Vec<_> = bed
            .workers
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let mut v: Vec<f32> = (0..len).map(|i| (i as f32 * 0.25 + r as f32) * 1e-5).collect();
                    c.allreduce(&mut v, Op::Avg).unwrap_or_else(|e| panic!("worker {r}: allreduce_f32: {e}"));
                    v
                })
            })
            .collect();
        let results: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().expect("worker thread")).collect();
        let w = bed.workers.len() as f32;
        for (i, x) in results[0].iter().enumerate() {
            // The mean of (i/4 + r)·1e-5 over r = 0..W (at most 0.05, so 16
            // workers' sum fits int32 at the default fixed scale 1e8, which
            // errs by 0.5e-8 a value); f32 keeps ~7 digits.
            let want = (i as f32 * 0.25 + (w - 1.0) / 2.0) * 1e-5;
            assert!((x - want).abs() <= 1e-8 + want.abs() * 1e-6, "element {i}: {x} vs {want}");
        }
        assert!(results.iter().all(|r| r == &results[0]), "every worker has the same floats");
    });
}

/// Worker 0 broadcasts to the others (socket path among the workers).
fn broadcast(bed: &Bed, len: usize) {
    let msg: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    std::thread::scope(|s| {
        for (r, c) in bed.workers.iter().enumerate() {
            let msg = &msg;
            s.spawn(move || {
                let mut buf = if r == 0 { msg.clone() } else { vec![0u8; len] };
                c.broadcast(&mut buf, Participant::Worker(0)).unwrap_or_else(|e| panic!("worker {r}: broadcast: {e}"));
                assert!(&buf == msg, "worker {r}: broadcast differs");
            });
        }
    });
}

/// Every collective under `loss` and `dup` on every link, repeated (at
/// most 10 times) until the injector dropped and duplicated datagrams and
/// the node resent RESULT copies; then all must have happened.
fn under_loss(bed: &Bed, label: &str, loss: f64, dup: f64, len: usize) {
    let (c0, resent0) = (bed.injector.counts(), bed.service_counter("resent"));
    bed.impair(loss, dup);
    for _ in 0..10 {
        allreduce(bed, Op::Sum, len);
        allreduce(bed, Op::Max, 1);
        allreduce(bed, Op::Min, 362 * 3 + 17);
        allreduce_f32(bed, 20_000);
        broadcast(bed, 20_000);
        let c = bed.injector.counts() - c0;
        if c.dropped > 0 && (dup == 0.0 || c.duplicated > 0) && bed.service_counter("resent") > resent0 {
            break;
        }
    }
    bed.impair(0.0, 0.0);
    let c = bed.injector.counts() - c0;
    let resent = bed.counter_at_least("resent", resent0 + 1) - resent0;
    eprintln!("{label}: injector {c:?}, the node resent {resent} RESULT copies");
    assert!(c.dropped > 0, "{label}: the injector dropped nothing ({c:?})");
    assert!(dup == 0.0 || c.duplicated > 0, "{label}: the injector duplicated nothing ({c:?})");
    assert!(resent > 0, "{label}: {} dropped, the node resent no RESULT", c.dropped);
}

fn served(tag: &str, ack: AckMode, nworkers: usize) {
    require_root();
    let bed = Bed::up(tag, ack, nworkers, Duration::from_secs(30));
    // Without loss first: the node takes every RESULT once and resends none.
    allreduce(&bed, Op::Sum, 100_000);
    // Every fragment's RESULT reaches the node too (the workers may finish
    // before it read them all: wait for the counter, 5 s at most).
    let per = elements_per_fragment(bed.workers[0].config().mtu) as u64;
    let fragments = 100_000u64.div_ceil(per);
    assert_eq!(bed.counter_at_least("results", fragments), fragments, "the node took each fragment's RESULT once");
    assert!(bed.counter_at_least("acks_received", 1) > 0, "workers acknowledged their copies");
    assert_eq!(bed.service_counter("rounds"), 1, "one call");
    broadcast(&bed, 50_000);
    for (loss, dup) in [(0.01, 0.0), (0.05, 0.01)] {
        under_loss(&bed, &format!("{tag} {loss} loss {dup} dup"), loss, dup, 100_000);
    }
    assert_eq!(bed.service_counter("refused_results") + bed.service_counter("refused_acks"), 0);
    // Still exact after the loss.
    allreduce(&bed, Op::Sum, 1000);
    // `aggbox status` (another process, from the pins) shows the service:
    // once the last RESULTs are read (the counters stop moving), the same
    // numbers as /metrics.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut last = u64::MAX;
    let served = loop {
        let metrics = bed.service_counter("results");
        let st = bed.attach.status();
        let served = *st.served.get(&JOB).expect("aggbox status shows the node-served job");
        if served.results == metrics && metrics == last {
            break served;
        }
        assert!(std::time::Instant::now() < deadline, "status {served:?} vs /metrics results {metrics}");
        last = metrics;
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(served.resent > 0 && served.rounds >= 6, "{served:?}");
    let text = aggbox::node::format_status(&bed.attach.status());
    assert!(text.contains(&format!("job {JOB} served by the node")), "{text}");
}

#[test]
fn four_workers_and_only_aggbox_attach_on_the_node_group_acks() {
    served("served-group", AckMode::Group, 4);
}

#[test]
fn four_workers_and_only_aggbox_attach_on_the_node_packet_acks() {
    served("served-packet", AckMode::Packet, 4);
}

#[test]
fn sixteen_workers_and_only_aggbox_attach_on_the_node() {
    served("served-16", AckMode::Group, 16);
}

/// kill -9 of the daemon mid-call: each worker's call either completes
/// with the exact vector (the pinned XDP and TC programs go on without the
/// process) or fails, within its deadline, naming the aggregator; never a
/// wrong vector, never a hang. After `aggbox attach` starts again (it
/// replaces the dead process's state), the next calls complete exactly.
#[test]
fn the_daemon_killed_mid_call_fails_calls_cleanly_and_a_restart_serves_again() {
    require_root();
    let deadline = Duration::from_secs(3);
    let mut bed = Bed::up("served-kill", AckMode::Group, 4, deadline);
    allreduce(&bed, Op::Sum, 10_000);
    let len = 400_000;
    let want = reference(Op::Sum, bed.workers.len(), len);
    // Loss toward the workers, so that some calls need the node's resends.
    bed.impair(0.05, 0.0);
    let outcomes: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = bed
            .workers
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let want = &want;
                s.spawn(move || {
                    let mut v = input(r, len);
                    let start = std::time::Instant::now();
                    let out = c.allreduce(&mut v, Op::Sum);
                    assert!(start.elapsed() < deadline + Duration::from_secs(2), "worker {r}: the call outlived its deadline");
                    match out {
                        Ok(_) => {
                            assert!(&v == want, "worker {r}: a completed call returned a wrong vector");
                            Ok(())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        bed.attach.kill9();
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    });
    for (r, o) in outcomes.iter().enumerate() {
        if let Err(e) = o {
            assert!(e.contains("aggregator"), "worker {r}: the error names the aggregator: {e}");
        }
    }
    eprintln!("calls at the kill: {outcomes:?}");
    bed.impair(0.0, 0.0);
    bed.attach.restart();
    for _ in 0..3 {
        allreduce(&bed, Op::Sum, 10_000);
        allreduce_f32(&bed, 5_000);
    }
}

#[test]
fn an_aggregator_application_and_a_second_taker_of_the_result_port_are_refused() {
    require_root();
    let bed = Bed::up("served-refuse", AckMode::Group, 2, Duration::from_secs(10));
    let agg_addr = bed.tb.host(0).addr;
    match CommunicatorBuilder::from_config(&bed.config, JOB, agg_addr, DATA_PORT, Participant::Aggregator) {
        Err(CommError::Config(msg)) => assert!(msg.contains("served by the node"), "{msg}"),
        other => panic!("an aggregator application for a node-served job: {other:?}"),
    }
    // The result port is the service's: a socket on it in the node's
    // namespace cannot be bound.
    let taken = testbed::in_netns(&bed.tb.host(0).netns, || std::net::UdpSocket::bind(("0.0.0.0", RESULT_PORT)).is_err())
        .expect("node netns");
    assert!(taken, "the node's result service holds port {RESULT_PORT}");
    allreduce(&bed, Op::Sum, 10);
    let _ = &bed.attach;
}

/// Worker `rank`'s `AGP1` query sent from `from` (in the namespace of host
/// `host`) to the node's result port; the reply, if one comes within 300 ms.
fn ask_from(bed: &Bed, host: usize, from: std::net::SocketAddrV4, datagram: &[u8]) -> Option<PositionMessage> {
    let node = std::net::SocketAddrV4::new(bed.tb.host(0).addr, RESULT_PORT);
    bed.tb
        .in_host(host, || {
            let s = std::net::UdpSocket::bind(from).expect("bind the asking socket");
            s.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
            s.send_to(datagram, node).expect("send the query");
            let mut buf = [0u8; 64];
            s.recv_from(&mut buf).ok().and_then(|(n, _)| PositionMessage::decode(&buf[..n]).ok())
        })
        .expect("netns")
}

/// A new set of communicators of a job the node has served (a second
/// program, after the first one's ended) asks the node where to start
/// (`CommunicatorBuilder::node_position`), resumes there, and its calls
/// complete exactly, with no contribution dropped as `stale_round`. Only a
/// worker's own socket is answered: a query from another port of a
/// worker's address, from a worker's socket in another rank's name, or a
/// malformed one, gets no reply and is counted.
#[test]
fn a_new_run_resumes_where_the_node_is_and_only_the_workers_own_sockets_are_answered() {
    require_root();
    let mut bed = Bed::up("served-resume", AckMode::Group, 4, Duration::from_secs(10));
    for _ in 0..3 {
        allreduce(&bed, Op::Sum, 1_000);
    }
    let stale_before = bed.attach.status().drops.get("stale_round").copied().unwrap_or(0);
    let per = elements_per_fragment(bed.workers[0].config().mtu) as u32;
    // The first run ends: its sockets are free for the next one.
    bed.workers.clear();
    let addr = |r: usize| bed.tb.host(r + 1).addr;
    let sock = |r: usize, port: u16| std::net::SocketAddrV4::new(addr(r), port);
    let query = |rank: u16| PositionMessage::query(JOB, rank, 7).encode();
    assert_eq!(ask_from(&bed, 1, sock(0, DATA_PORT + 1), &query(0)), None, "another port of worker 0's address");
    assert_eq!(ask_from(&bed, 1, sock(0, DATA_PORT), &query(1)), None, "worker 0's socket in worker 1's name");
    assert_eq!(ask_from(&bed, 1, sock(0, DATA_PORT), &query(0)[..20]), None, "a short query");
    assert_eq!(bed.counter_at_least("refused_queries", 3), 3);
    let answer = ask_from(&bed, 1, sock(0, DATA_PORT), &query(0)).expect("worker 0's own socket is answered");
    assert!(answer.is_reply() && !answer.is_fresh() && answer.nonce == 7, "{answer:?}");

    // The next run: every worker asks, they agree, and resume there.
    let agg_addr = bed.tb.host(0).addr;
    let builders: Vec<CommunicatorBuilder> = (0..4)
        .map(|r| {
            CommunicatorBuilder::from_config(&bed.config, JOB, agg_addr, DATA_PORT, Participant::Worker(r as u16))
                .expect("from_config")
                .backend(BackendKind::Kernel)
                .deadline(Duration::from_secs(10))
        })
        .collect();
    let positions: Vec<_> = builders
        .iter()
        .enumerate()
        .map(|(r, b)| bed.tb.in_host(r + 1, || b.node_position(Duration::from_secs(5))).expect("netns").expect("position"))
        .collect();
    assert!(positions.iter().all(|p| *p == positions[0]), "one answer for all: {positions:?}");
    assert_eq!((positions[0].round, positions[0].agg_seq), (answer.round, answer.agg_seq));
    assert!(!positions[0].fresh);
    // Three calls (rounds 0, 1, 2) of ⌈1000 / per⌉ fragments each: the
    // round after next of the newest, the seq after the newest.
    assert_eq!(positions[0].round.0, 2 + 2, "{positions:?}");
    assert_eq!(positions[0].agg_seq, 3 * 1_000u32.div_ceil(per), "{positions:?}");
    bed.workers = builders
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            let b = b.resume(positions[0].round, positions[0].agg_seq);
            bed.tb.in_host(r + 1, move || b.build()).expect("netns").expect("build")
        })
        .collect();
    for _ in 0..3 {
        allreduce(&bed, Op::Sum, 1_000);
        allreduce(&bed, Op::Max, 10);
    }
    let stale = bed.attach.status().drops.get("stale_round").copied().unwrap_or(0);
    assert_eq!(stale, stale_before, "no contribution of the new run taken for an old round");
    assert!(bed.counter_at_least("position_queries", 5) >= 5);
}

/// An outside client's report (issue #42): workers built the plain way
/// (`from_config(...).build()`, as the Python package and a Rust program
/// do) ran exactly; when they exited and fresh ones started against the
/// same node, every call timed out, the new run starting at round 0 where
/// the node still held the old run's rounds. A worker of a node-served job
/// now asks the node where to start when it is built: the second and third
/// runs complete exactly, with no contribution taken for an old round. A
/// worker whose node does not answer is not built, and its error names the
/// node and says what to check, within the deadline, instead of every call
/// timing out.
#[test]
fn a_second_run_of_plainly_built_workers_resumes_by_itself() {
    require_root();
    let deadline = Duration::from_secs(5);
    let mut bed = Bed::up("served-rerun", AckMode::Group, 4, deadline);
    for _ in 0..3 {
        allreduce(&bed, Op::Sum, 1_000);
    }
    let stale_before = bed.attach.status().drops.get("stale_round").copied().unwrap_or(0);
    let queries_before = bed.service_counter("position_queries");
    for run in 1..=2 {
        // The previous run ends (its sockets closed), a new one starts.
        bed.workers.clear();
        bed.workers = build_workers(&bed.tb, &bed.config, 4, deadline)
            .into_iter()
            .enumerate()
            .map(|(r, w)| w.unwrap_or_else(|e| panic!("run {run}, worker {r}: build: {e}")))
            .collect();
        let first = bed.workers[0].position();
        assert!(first.0 .0 >= 2, "run {run} starts past the rounds the node has seen: {first:?}");
        assert!(bed.workers.iter().all(|w| w.position() == first), "run {run}: every worker starts at one position");
        for _ in 0..3 {
            allreduce(&bed, Op::Sum, 1_000);
            allreduce(&bed, Op::Max, 10);
        }
    }
    let stale = bed.attach.status().drops.get("stale_round").copied().unwrap_or(0);
    assert_eq!(stale, stale_before, "no contribution of a new run taken for an old round");
    assert!(
        bed.counter_at_least("position_queries", queries_before + 8) >= queries_before + 8,
        "each worker of the two new runs asked the node"
    );

    // No node: the build fails within the deadline, naming the node.
    bed.workers.clear();
    bed.attach.terminate();
    let start = std::time::Instant::now();
    let built = build_workers(&bed.tb, &bed.config, 1, Duration::from_secs(1));
    let waited = start.elapsed();
    let err = match built.into_iter().next().expect("one worker") {
        Ok(_) => panic!("a worker was built with no node to answer it"),
        Err(e) => e,
    };
    assert!(matches!(err, CommError::Position(_)), "{err:?}");
    let msg = err.to_string();
    let node = format!("{}:{RESULT_PORT}", bed.tb.host(0).addr);
    assert!(msg.contains(&node) && msg.contains("aggbox attach"), "the error names the node and what to check: {msg}");
    assert!(waited < Duration::from_secs(3), "the build gave up at its deadline: {waited:?}");
}

/// A run that went on past calls that failed (a worker gone, the others
/// calling on: each timed-out call leaves their contributions in its
/// round, and the runtime goes on with the next round) must not hand its
/// values to the next run, which starts in those rounds: the kernel would
/// take the new run's contributions of those ranks for retransmissions and
/// complete each fragment with the old values, a wrong vector reported as
/// a success. The node releases a job's unfinished slots of rounds after
/// its newest RESULT when a worker asks where a new run starts.
#[test]
fn a_run_that_went_on_past_failed_calls_leaves_nothing_in_the_next_runs_results() {
    require_root();
    let deadline = Duration::from_secs(5);
    let mut bed = Bed::up("served-leftover", AckMode::Group, 4, deadline);
    allreduce(&bed, Op::Sum, 1_000);
    // Worker 3 is gone; the others call three more times, with other
    // values than the next run's, and each call times out.
    drop(bed.workers.pop());
    std::thread::scope(|s| {
        for (r, c) in bed.workers.iter().enumerate() {
            s.spawn(move || {
                for call in 0..3 {
                    let mut v = input(100 + 10 * r + call, 1_000);
                    let e = c
                        .allreduce_with(&mut v, Op::Sum, CallOptions::deadline(Duration::from_millis(300)))
                        .expect_err("worker 3 is missing");
                    assert!(e.timeout().is_some(), "worker {r}, call {call}: {e}");
                }
            });
        }
    });
    let released_before = bed.service_counter("released_slots");
    bed.workers.clear();
    bed.workers = build_workers(&bed.tb, &bed.config, 4, deadline)
        .into_iter()
        .map(|w| w.expect("build"))
        .collect();
    for _ in 0..3 {
        allreduce(&bed, Op::Sum, 1_000);
    }
    let released = bed.counter_at_least("released_slots", released_before + 1);
    assert!(released > released_before, "the new run's queries released the old run's slots ({released})");
}

/// Implicit acknowledgement (docs/PROTOCOL.md "Implicit acknowledgement
/// of RESULTs"): a stream of one-datagram allreduces costs each worker its
/// contribution and its RESULT copy, not also an ACK each way (16
/// datagrams a call for 4 workers before, 8 now), asserted from the
/// workers' and the node's counters; once the calls stop, the workers'
/// deferred ACKs reach the node, which then holds nothing for any worker.
#[test]
fn a_stream_of_one_datagram_calls_sends_no_acks_and_the_last_call_is_acknowledged_once_idle() {
    require_root();
    const CALLS: u64 = 400;
    let bed = Bed::up("served-implicit", AckMode::Group, 4, Duration::from_secs(30));
    allreduce(&bed, Op::Sum, 1);
    // The first call's ACKs (it is followed by none for a while).
    std::thread::sleep(Duration::from_millis(50));
    let before: Vec<_> = bed.workers.iter().map(|c| c.stats()).collect();
    let (acks0, behalf0, results0) =
        (bed.service_counter("acks_received"), bed.service_counter("acks_sent"), bed.counter_at_least("results", 1));
    let n = bed.workers.len();
    std::thread::scope(|s| {
        for (r, c) in bed.workers.iter().enumerate() {
            s.spawn(move || {
                for i in 0..CALLS as usize {
                    let mut v = vec![(r * 1000 + i) as i32];
                    c.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("worker {r}: call {i}: {e}"));
                    let want: usize = (0..n).map(|w| w * 1000 + i).sum();
                    assert_eq!(v[0], want as i32, "worker {r}: call {i}");
                }
            });
        }
    });
    // Calls that took longer than the ACK delay (a loaded machine) send an
    // ACK each; one a call before.
    let most = CALLS / 4;
    for (r, (c, b)) in bed.workers.iter().zip(&before).enumerate() {
        let a = c.stats();
        let (sent, acks_sent, acks_received) =
            (a.data_sent - b.data_sent, a.acks_sent - b.acks_sent, a.acks_received - b.acks_received);
        eprintln!("worker {r}: {CALLS} calls: {sent} contributions, {acks_sent} ACKs sent, {acks_received} received");
        assert!(sent >= CALLS, "worker {r}: {sent} contributions");
        assert!(acks_sent <= most, "worker {r}: {acks_sent} ACKs of RESULTs for {CALLS} calls");
        assert!(acks_received <= most, "worker {r}: {acks_received} ACKs on the kernel's behalf for {CALLS} calls");
    }
    assert_eq!(bed.counter_at_least("results", results0 + CALLS) - results0, CALLS);
    // Idle: the last call's ACKs come, nothing is held for any worker.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let served = loop {
        let served = *bed.attach.status().served.get(&JOB).expect("the node-served job");
        if served.workers_behind == 0 || std::time::Instant::now() > deadline {
            break served;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(served.workers_behind, 0, "every worker acknowledged the last call: {served:?}");
    let (acks, behalf) = (bed.service_counter("acks_received") - acks0, bed.service_counter("acks_sent") - behalf0);
    eprintln!("node: {CALLS} calls: {acks} ACKs received, {behalf} sent on the kernel's behalf");
    assert!(acks >= n as u64 && acks <= n as u64 * most, "{acks} workers' ACKs at the node");
    assert!(behalf <= n as u64 * most, "{behalf} ACKs on the kernel's behalf");
}

/// An op the kernel does not run (BXOR) is aggregated on the node's
/// user-space path, whose RESULTs reach the result service through a
/// socket, past the TC program that copies the kernel's to the workers: the
/// service must send the copies itself. Without that, every call waited
/// for a retransmission (a worker's, or the service's resend when its
/// copy went unacknowledged), the timers backing off further call by call
/// (1 s a call under the MPI library): nearly every copy was a resend.
#[test]
fn an_op_of_the_userspace_path_reaches_every_worker_without_a_resend() {
    require_root();
    const CALLS: u64 = 60;
    let bed = Bed::up("served-userspace-op", AckMode::Group, 4, Duration::from_secs(30));
    let handed = |bed: &Bed| {
        bed.attach.status().jobs.iter().find(|j| j.id == JOB).and_then(|j| j.counters).map_or(0, |c| c.handed_to_userspace)
    };
    let before: Vec<_> = bed.workers.iter().map(|c| c.stats()).collect();
    let (handed0, resent0) = (handed(&bed), bed.service_counter("resent"));
    for i in 0..CALLS {
        // One datagram, then three.
        allreduce(&bed, Op::Bxor, if i % 2 == 0 { 1 } else { 1000 });
    }
    let handed = handed(&bed) - handed0;
    assert!(handed >= CALLS * 4, "the user-space path took every contribution: {handed} handed over for {CALLS} calls");
    let retransmitted: u64 = bed.workers.iter().zip(&before).map(|(c, b)| c.stats().retransmitted - b.retransmitted).sum();
    let resent = bed.service_counter("resent") - resent0;
    eprintln!("{CALLS} BXOR calls: {handed} contributions handed over, {retransmitted} retransmitted by workers, {resent} RESULTs resent");
    // Without the service's copies every worker got each RESULT of the
    // user-space path only as a resend (480 for these 120 fragments × 4
    // workers). With them a resend is a timer a loaded machine fired (the
    // other tests of this file run beside this one): a few; the workers'
    // retransmissions, which load alone brings (21 seen), are not the
    // measure.
    assert!(resent < CALLS, "{resent} RESULTs resent for {CALLS} calls ({retransmitted} contributions retransmitted)");
}
