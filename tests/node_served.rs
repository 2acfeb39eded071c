//! A node that runs only `aggbox attach` serves an in-kernel allreduce
//! (`consumer = "node"`): the workers build their communicators from the
//! configuration alone, and no aggregator application runs anywhere.
//!
//! Host 0 runs `aggbox attach eth0` with the job, a `[[group]]` of the
//! workers' sockets and `result_group`; hosts 1..=3 are workers
//! (`CommunicatorBuilder::from_config(...).backend(BackendKind::Kernel)`).
//! The RESULT copies the TC program sends to the workers are dropped on the
//! switch ports that lead to the workers: only the node's result service can
//! make those calls complete, and its counters (`/metrics`) must show the
//! resends. Every result equals the reference; broadcast among the workers
//! works beside it; an aggregator application for the job is refused, and
//! the result port is the service's.
//!
//! Needs root; fails (never skips) otherwise:
//! `sudo -E cargo test --test node_served`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

mod impair;
mod live_attach;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::time::Duration;

use aggbox::config::{AckMode, Config};
use aggbox::runtime::fragment::elements_per_fragment;
use aggbox::runtime::{BackendKind, CommError, Communicator, CommunicatorBuilder, Participant};
use aggbox::wire::abi::Op;
use aggbox::wire::reducer;
use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

const WORKERS: usize = 3;
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
    fn up(tag: &str, ack: AckMode) -> Bed {
        let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
        let workers: Vec<Ipv4Addr> = (1..=WORKERS).map(|h| tb.host(h).addr).collect();
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
        let agg_addr = tb.host(0).addr;
        let workers = (0..WORKERS)
            .map(|r| {
                let b = CommunicatorBuilder::from_config(&config, JOB, agg_addr, DATA_PORT, Participant::Worker(r as u16))
                    .expect("from_config")
                    .backend(BackendKind::Kernel)
                    .deadline(Duration::from_secs(20));
                tb.in_host(r + 1, move || b.build()).expect("netns").expect("build")
            })
            .collect();
        Bed { injector: impair::Injector::new(), workers, config, attach, tb }
    }

    /// Loss `loss` on the switch ports that lead to the workers: RESULT
    /// copies, the node's ACKs and resends, broadcast data (none at 0).
    fn impair_workers(&self, loss: f64) {
        for h in 1..=WORKERS {
            let port = self.tb.switch_port(h);
            let injector = &self.injector;
            testbed::in_netns(&self.tb.switch_netns(), move || injector.set(&port, loss, 0.0))
                .expect("switch netns")
                .unwrap_or_else(|e| panic!("{e:#}"));
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
            .find(|l| l.starts_with(&prefix) && l.contains(&format!("job=\"{JOB}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .map(|v| v as u64)
            .unwrap_or_else(|| panic!("no {prefix}..job=\"{JOB}\"}} in /metrics:\n{text}"))
    }
}

fn input(rank: usize, len: usize) -> Vec<i32> {
    (0..len).map(|i| ((i * 7 + rank * 1_000_003) % 20_001) as i32 - 10_000).collect()
}

/// Every worker allreduces its vector at once; each gets the reference.
fn allreduce(bed: &Bed, op: Op, len: usize) {
    let want = {
        let inputs: Vec<Vec<i32>> = (0..WORKERS).map(|r| input(r, len)).collect();
        let c: Vec<(&[i32], i32)> = inputs.iter().map(|v| (v.as_slice(), 1)).collect();
        reducer::reduce(op, &c).expect("reference").ints().expect("ints").to_vec()
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = bed
            .workers
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let mut v = input(r, len);
                    c.allreduce_i32(&mut v, op).unwrap_or_else(|e| panic!("worker {r}: allreduce {op:?} of {len}: {e}"));
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
                    let mut v: Vec<f32> = (0..len).map(|i| (i as f32 * 0.25 + r as f32) * 0.001).collect();
                    c.allreduce_f32(&mut v, true).unwrap_or_else(|e| panic!("worker {r}: allreduce_f32: {e}"));
                    v
                })
            })
            .collect();
        let results: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().expect("worker thread")).collect();
        for (i, x) in results[0].iter().enumerate() {
            let want = (i as f32 * 0.25 + 1.0) * 0.001; // mean of r = 0, 1, 2
            assert!((x - want).abs() < 1e-5, "element {i}: {x} vs {want}");
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

fn served_allreduce_under_result_loss(tag: &str, ack: AckMode) {
    require_root();
    let bed = Bed::up(tag, ack);
    // Without loss first: the node takes every RESULT and resends none.
    allreduce(&bed, Op::Sum, 100_000);
    // Every fragment's RESULT reaches the node too (the workers may finish
    // before it read them all: wait for the counter, 5 s at most).
    let per = elements_per_fragment(bed.workers[0].config().mtu) as u64;
    let fragments = 100_000u64.div_ceil(per);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while bed.service_counter("results") < fragments && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(bed.service_counter("results"), fragments, "the node took each fragment's RESULT once");
    assert!(bed.service_counter("acks_received") > 0, "workers acknowledged their copies");
    broadcast(&bed, 50_000);

    let (c0, resent0) = (bed.injector.counts(), bed.service_counter("resent"));
    bed.impair_workers(0.05);
    for _ in 0..10 {
        allreduce(&bed, Op::Sum, 100_000);
        allreduce(&bed, Op::Max, 1);
        allreduce(&bed, Op::Min, 362 * 3 + 17);
        allreduce_f32(&bed, 20_000);
        if (bed.injector.counts() - c0).dropped > 0 && bed.service_counter("resent") > resent0 {
            break;
        }
    }
    broadcast(&bed, 50_000);
    bed.impair_workers(0.0);
    let dropped = (bed.injector.counts() - c0).dropped;
    let resent = bed.service_counter("resent") - resent0;
    eprintln!("{tag}: injector dropped {dropped}, the node resent {resent} RESULT copies");
    assert!(dropped > 0, "{tag}: the injector dropped nothing");
    assert!(resent > 0, "{tag}: {dropped} dropped toward the workers, the node resent no RESULT");
    assert_eq!(bed.service_counter("refused_results") + bed.service_counter("refused_acks"), 0);
    // Still exact after the loss.
    allreduce(&bed, Op::Sum, 1000);
}

#[test]
fn workers_allreduce_with_only_aggbox_attach_on_the_node_group_acks() {
    served_allreduce_under_result_loss("served-group", AckMode::Group);
}

#[test]
fn workers_allreduce_with_only_aggbox_attach_on_the_node_packet_acks() {
    served_allreduce_under_result_loss("served-packet", AckMode::Packet);
}

#[test]
fn an_aggregator_application_and_a_second_taker_of_the_result_port_are_refused() {
    require_root();
    let bed = Bed::up("served-refuse", AckMode::Group);
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
