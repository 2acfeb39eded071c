//! Who may send a participant RESULTs and ACKs (docs/RUNTIME.md "Who may
//! send what"), over loopback (no root needed). The test plays the
//! aggregator's node: its sockets send RESULTs from the addresses the node's
//! paths use, and forgers send from others, on the aggregator's host
//! (127.0.0.2), a worker's host (127.0.0.1) and a third one (127.0.0.3).
//!
//! - a forged RESULT for the call in progress, at a worker and at the
//!   aggregator, is refused and counted; the genuine one is the value;
//! - a forged AGK1 does not stop the retransmission of a contribution;
//! - a flood of later-round RESULTs keeps at most the byte bound, and a
//!   later-round RESULT that came before it is still taken in its round;
//! - a socket-backend job's own traffic, reordered and duplicated, is never
//!   refused (the kernel backend's: tests/runtime_kernel_sources.rs).

mod common_runtime;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use aggbox::wire::abi::{self, Op};
use aggbox::wire::proto::{self, AckKind, AckMessage, AggHeader, SeqBitmap};
use aggbox::runtime::{BackendKind, Communicator, Impairment, Participant, RefusedStats, ReliabilityConfig};

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
        round,
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

/// A worker (kernel backend, in-kernel allreduce) gets forged RESULTs for
/// both fragments of its call from the aggregator's host on a port that is
/// neither the result port nor a worker's data port, from its own host and
/// from a stranger. They must not become the value: the genuine RESULTs come
/// after them, one as the node's TC copy (the aggregator's address, a
/// worker's data port), one as the aggregator runtime's resend (its result
/// port).
#[test]
fn forged_result_to_a_worker_is_refused_and_counted() {
    let (node, node_addr) = bind(AGG, 0); // the job port: gets the contributions
    let (runtime, runtime_addr) = bind(AGG, 0); // the aggregator runtime's result port
    let (_, peers) = common_runtime::loopback_job_addrs(1);
    let (copies, _) = bind(AGG, peers[0].port()); // the node's TC copies leave from here
    let w = Communicator::builder(JOB, peers.clone(), AGG, node_addr.port(), Participant::Worker(0))
        .backend(BackendKind::Kernel)
        .result_port(runtime_addr.port())
        .kernel_result_group(true)
        .mtu(1500)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let len = 400; // 2 fragments of 362 at MTU 1500
    let genuine: Vec<i32> = (0..len as i32).map(|i| i * 3 + 1).collect();
    let got = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let mut v: Vec<i32> = (0..len as i32).collect();
            w.allreduce_i32(&mut v, Op::Sum).map(|_| v)
        });
        // Both contributions out: the call is in progress.
        let mut seen = [false; 2];
        let mut d = [0u8; 2048];
        while !(seen[0] && seen[1]) {
            let n = node.recv(&mut d).expect("the worker's contributions");
            let (hdr, _) = proto::split_agg(&d[..n]).unwrap();
            seen[(hdr.frag_off / 362) as usize] = true;
        }
        let forged = vec![-5; len];
        forge(&[AGG, LO, STRANGER], peers[0], &result(0, 0, &forged[..362], false));
        forge(&[AGG, LO, STRANGER], peers[0], &result(0, 362, &forged[362..], true));
        wait_for(|| w.refused().results_from_wrong_source >= 6);
        copies.send_to(&result(0, 0, &genuine[..362], false), peers[0]).unwrap();
        runtime.send_to(&result(0, 362, &genuine[362..], true), peers[0]).unwrap();
        h.join().unwrap()
    });
    let got = got.expect("the allreduce completes with the genuine RESULTs");
    assert!(got == genuine, "the value is the genuine RESULTs', not the forged ones");
    let r = w.refused();
    assert_eq!(r.results_from_wrong_source, 6, "{r:?}");
    assert_eq!(r.acks_from_wrong_source, 0, "{r:?}");
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
    agg.reduce_i32(&mut v, Op::Sum).expect("the reduce completes with the genuine RESULTs");
    assert!(v == genuine, "the value is the genuine RESULTs', not the forged ones");
    let r = agg.refused();
    assert_eq!(r.results_from_wrong_source, 4, "{r:?}");
}

/// A forged AGK1 for a worker's contribution, from the aggregator's host on
/// another port and from a stranger, arrives long before the retransmission
/// timeout: the worker must still resend (only the aggregator's socket
/// acknowledges contributions).
#[test]
fn forged_ack_does_not_stop_a_retransmission() {
    let (agg, agg_addr) = bind(AGG, 0); // the socket aggregator, played by the test
    let (_, peers) = common_runtime::loopback_job_addrs(1);
    let rto = Duration::from_millis(300);
    let w = Communicator::builder(JOB, peers, AGG, agg_addr.port(), Participant::Worker(0))
        .reliability(ReliabilityConfig { initial_rto: rto, min_rto: rto, ..ReliabilityConfig::default() })
        .mtu(1500)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let res = std::thread::scope(|s| {
        let h = s.spawn(|| w.reduce_i32(&mut [42], Op::Sum));
        let mut d = [0u8; 2048];
        let (n, from) = agg.recv_from(&mut d).expect("the contribution");
        let (first, _) = proto::split_agg(&d[..n]).unwrap();
        let from = match from {
            SocketAddr::V4(a) => a,
            a => panic!("{a}"),
        };
        let mut bitmap = SeqBitmap::new(first.seq, 1).unwrap();
        bitmap.set(first.seq);
        let ack = AckMessage { id: JOB, rank: 0, kind: AckKind::Aggregation, flags: 0, bitmap };
        let mut a = Vec::new();
        ack.encode_into(&mut a).unwrap();
        let t0 = Instant::now();
        forge(&[AGG, STRANGER], from, &a);
        agg.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let again = agg.recv(&mut d).ok().map(|n| proto::split_agg(&d[..n]).unwrap().0);
        assert!(
            again.is_some_and(|h| h.seq == first.seq && h.round == first.round),
            "the contribution was resent after the forged ACKs (got {again:?} after {:?})",
            t0.elapsed()
        );
        agg.send_to(&a, from).unwrap(); // the genuine ACK ends the call
        h.join().unwrap()
    });
    res.expect("the reduce completes once the aggregator acknowledges");
    let r = w.refused();
    assert_eq!(r.acks_from_wrong_source, 2, "{r:?}");
    assert!(w.stats().retransmitted >= 1);
}

/// A worker's socket floods the aggregator with RESULTs of later rounds
/// (8948 payload bytes each at MTU 9000): no more than the bound (256 KiB
/// here) is kept, the rest is counted; a later-round RESULT that came before
/// the flood is still taken when its round is called, and the call in
/// progress is unaffected.
#[test]
fn flood_of_later_round_results_stays_within_the_byte_bound() {
    let (_, result_port) = {
        let (s, a) = bind(AGG, 0);
        drop(s);
        ((), a)
    };
    let (w0, w0_addr) = bind(LO, 0);
    let limit = 256 << 10;
    let agg = Communicator::builder(JOB, vec![w0_addr], AGG, 1, Participant::Aggregator)
        .backend(BackendKind::Kernel)
        .result_port(result_port.port())
        .mtu(9000)
        .early_result_bytes(limit)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let per = 2237; // elements per fragment at MTU 9000
    w0.send_to(&result(1, 0, &[11], true), result_port).unwrap(); // round 1, before its call
    let flood = 2000u32;
    let values = vec![7; per as usize];
    for k in 0..flood {
        w0.send_to(&result(2 + k / 20, (k % 20) * per, &values, false), result_port).unwrap();
        if k % 16 == 15 {
            // Paced: the socket's buffer is small without CAP_NET_ADMIN,
            // and every flooded RESULT is to reach the runtime.
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    w0.send_to(&result(0, 0, &[5], true), result_port).unwrap();
    let mut v = [0];
    agg.reduce_i32(&mut v, Op::Sum).expect("round 0");
    assert_eq!(v, [5]);
    // Nothing else reached it but the RESULTs of rounds 0 and 1.
    let received = agg.stats().data_received - 2;
    let r = agg.refused();
    let kept = received - r.early_results_over_limit;
    eprintln!("{received} of {flood} flooded RESULTs reached the runtime, {kept} kept, {r:?}");
    assert!(received > 100, "the flood reached the runtime ({received})");
    // Each kept RESULT costs its 8948 payload bytes and its entry.
    assert!(kept * 8948 <= limit as u64, "{kept} RESULTs of 8948 bytes kept, bound {limit}");
    assert_eq!(r.results_from_wrong_source, 0);
    agg.reduce_i32(&mut v, Op::Sum).expect("round 1, from the RESULT kept before the flood");
    assert_eq!(v, [11]);
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
