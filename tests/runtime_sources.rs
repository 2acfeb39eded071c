//! Who may send a participant RESULTs and ACKs (docs/RUNTIME.md "Who may
//! send what"), through the real I/O driver over loopback (no root needed):
//! the source the driver hands the state machine is the datagram's real one.
//!
//! - a forged RESULT for the call in progress at the aggregator (kernel
//!   backend; the test plays the node and the forgers from the worker's host
//!   127.0.0.1 and a stranger 127.0.0.3, the aggregator being 127.0.0.2) is
//!   refused and counted, the genuine ones are the value;
//! - a socket-backend job's own traffic, reordered and duplicated, is never
//!   refused (the kernel backend's: tests/runtime_kernel_sources.rs).
//!
//! The checks themselves (forged RESULTs at a worker, forged ACKs against a
//! retransmission, the early-result bound) are tested deterministically on
//! the state machine: `runtime::engine::tests::sources`.

mod common_runtime;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use aggbox::runtime::Collective;
use aggbox::wire::abi::{self, Op};
use aggbox::wire::proto::{self, AggHeader};
use aggbox::runtime::{BackendKind, Communicator, Impairment, Participant, RefusedStats};

const JOB: u16 = 7;
const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// The aggregator's host: another loopback address, so that its own
/// address, a worker's and a stranger's differ.
const AGG: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const STRANGER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);

fn bind(ip: Ipv4Addr, port: u16) -> (UdpSocket, SocketAddrV4) {
    let s = UdpSocket::bind((ip, port)).unwrap_or_else(|e| panic!("bind {ip}:{port}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let a = match s.local_addr().unwrap() {
        SocketAddr::V4(a) => a,
        a => panic!("not IPv4: {a}"),
    };
    (s, a)
}

fn result(round: u32, frag_off: u32, values: &[i32], last: bool) -> Vec<u8> {
    let hdr = AggHeader {
        job: JOB,
        rank: abi::RESULT_RANK,
        seq: 0,
        round: aggbox::wire::abi::Round(round),
        frag_off,
        op: Op::Sum,
        flags: abi::AGG_F_RESULT | if last { abi::AGG_F_LAST_FRAGMENT } else { 0 },
        count: values.len() as u16,
    };
    let mut d = Vec::new();
    proto::encode_agg_into(&hdr, values, &mut d).unwrap();
    d
}

/// Sends `d` to `to` from a fresh socket on each of `from`.
fn forge(from: &[Ipv4Addr], to: SocketAddrV4, d: &[u8]) {
    for &ip in from {
        bind(ip, 0).0.send_to(d, to).unwrap();
    }
}

/// Waits (up to 2 s) until `f` holds; whether it does is for the caller to
/// assert (without the checks under test it never does).
fn wait_for(f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The aggregator application (kernel backend) gets forged RESULTs for both
/// fragments of its call from a worker's host on another port and from a
/// stranger; the genuine ones come after them from a worker's socket (what
/// the XDP program's in-place RESULT carries) and from the node's own
/// address (the user-space path).
#[test]
fn forged_result_to_the_aggregator_is_refused_and_counted() {
    let (_, result_port) = {
        let (s, a) = bind(AGG, 0);
        drop(s);
        ((), a)
    };
    let (w0, w0_addr) = bind(LO, 0);
    let (_w1, w1_addr) = bind(LO, 0);
    let agg = Communicator::builder(JOB, vec![w0_addr, w1_addr], AGG, 1, Participant::Aggregator)
        .backend(BackendKind::Kernel)
        .result_port(result_port.port())
        .mtu(1500)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let len = 400;
    let genuine: Vec<i32> = (0..len as i32).map(|i| 1000 - i).collect();
    let forged = vec![-5; len];
    forge(&[LO, STRANGER], result_port, &result(0, 0, &forged[..362], false));
    forge(&[LO, STRANGER], result_port, &result(0, 362, &forged[362..], true));
    wait_for(|| agg.refused().results_from_wrong_source >= 4);
    w0.send_to(&result(0, 0, &genuine[..362], false), result_port).unwrap();
    bind(AGG, 0).0.send_to(&result(0, 362, &genuine[362..], true), result_port).unwrap();
    let mut v = vec![0; len];
    agg.reduce(&mut v, Op::Sum).expect("the reduce completes with the genuine RESULTs");
    assert!(v == genuine, "the value is the genuine RESULTs', not the forged ones");
    let r = agg.refused();
    assert_eq!(r.results_from_wrong_source, 4, "{r:?}");
}

/// Everything a socket-backend job sends itself (contributions and their
/// ACKs, forwarded results, broadcasts and their ACKs from every root),
/// reordered and duplicated, passes the source checks: nothing refused.
#[test]
fn socket_backend_job_refuses_nothing_of_its_own() {
    let (agg_port, peers) = common_runtime::loopback_job_addrs(3);
    let b = |me: Participant, seed: u64| {
        Communicator::builder(JOB, peers.clone(), LO, agg_port, me)
            .impairment(Impairment::new(seed, 16, 0.0, 0.05))
            .deadline(Duration::from_secs(10))
            .build()
            .unwrap()
    };
    let agg = b(Participant::Aggregator, 1);
    let ws: Vec<Communicator> = (0..3).map(|r| b(Participant::Worker(r), 2 + r as u64)).collect();
    let all: Vec<&Communicator> = std::iter::once(&agg).chain(&ws).collect();
    for len in [1usize, 5000, 100_000] {
        common_runtime::int_reduction(&all, 3, Op::Sum, len, true);
        common_runtime::int_reduction(&all, 3, Op::Max, len, false);
        common_runtime::broadcast(&all, len, Participant::Aggregator);
        common_runtime::broadcast(&all, len, Participant::Worker(2));
    }
    for (i, c) in all.iter().enumerate() {
        assert_eq!(c.refused(), RefusedStats::default(), "participant {i}");
    }
    assert!(all.iter().map(|c| c.stats().duplicates_received).sum::<u64>() > 0, "the hook duplicated");
}
