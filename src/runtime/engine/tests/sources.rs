//! Who may send what (docs/RUNTIME.md): forged RESULTs and ACKs, and a
//! flood of later-round RESULTs, injected into the simulated network next
//! to a job's own traffic.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use super::{
    agg_addr, builder, expected_sum, worker_addr, Ended, Sim, Src, AGG_IP, JOB, LEN, PER,
    RESULT_PORT, WORKERS,
};
use crate::runtime::backend::BackendKind;
use crate::runtime::engine::{CallOptions, CommConfig, Participant};
use crate::runtime::transport::RefusedStats;
use crate::wire::abi::{self, Op, Round};
use crate::wire::proto::{self, AckKind, AckMessage, AggHeader, MessageKind, SeqBitmap};

const AGG: usize = WORKERS as usize;

/// A host that is in no job.
const STRANGER: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 9));

/// A RESULT of fragment `frag_off` of `round` (contribution seq `seq`).
fn result(round: u32, seq: u32, frag_off: u32, values: &[i32], last: bool) -> Vec<u8> {
    let hdr = AggHeader {
        job: JOB,
        rank: abi::RESULT_RANK,
        seq,
        round: Round(round),
        frag_off,
        op: Op::Sum,
        flags: abi::AGG_F_RESULT | if last { abi::AGG_F_LAST_FRAGMENT } else { 0 },
        count: values.len() as u16,
    };
    let mut d = Vec::new();
    proto::encode_agg_into(&hdr, values, &mut d).expect("a RESULT");
    d
}

/// An in-kernel allreduce (the fake node reduces and copies each RESULT to
/// every worker). Before the genuine copies reach worker 0, forged RESULTs
/// of all three fragments reach it from the aggregator's host on a port
/// that is neither the result port nor a worker's data port, from worker
/// 0's own host on another port, and from a stranger on a worker's data
/// port: all nine are refused and counted, and every participant's value
/// is the genuine sum (taken first, a forgery would have made the genuine
/// RESULT a duplicate).
#[test]
fn a_forged_result_to_a_worker_is_refused_counted_and_not_the_value() {
    let mut sim = Sim::kernel();
    for i in 0..=AGG {
        sim.start_reduce(i, true, LEN, CallOptions::default());
    }
    let forgers = [
        SocketAddr::new(AGG_IP, 6000),
        SocketAddr::new(worker_addr(0).ip(), 6000),
        SocketAddr::new(STRANGER, worker_addr(0).port()),
    ];
    let forged = vec![-5; PER];
    for from in forgers {
        for (i, count) in [(0, PER), (1, PER), (2, LEN - 2 * PER)] {
            let d = result(0, i, i * PER as u32, &forged[..count], i == 2);
            sim.inject(from, worker_addr(0), d);
        }
    }
    sim.run(Duration::from_secs(5));
    for i in 0..=AGG {
        match sim.ended(i) {
            Ended::Values(v) => assert_eq!(v, &expected_sum(LEN), "participant {i}"),
            other => panic!("participant {i}: {other:?}"),
        }
    }
    let refused = sim.nodes[0].counters.refused_snapshot();
    let want = RefusedStats {
        results_from_wrong_source: 9,
        ..RefusedStats::default()
    };
    assert_eq!(refused, want);
    for i in 1..=AGG {
        let refused = sim.nodes[i].counters.refused_snapshot();
        assert_eq!(refused, RefusedStats::default(), "participant {i}");
    }
}

/// A reduce of one fragment per worker. The aggregator's ACKs to worker 0
/// are lost for 30 ms; meanwhile forged ACKs of worker 0's contribution
/// reach it from the aggregator's host on another port and from a stranger
/// on the job port. They are refused and counted, and worker 0 resends its
/// contribution on its own timeouts, 20 ms (the initial RTO: no RTT sample
/// yet) and 40 ms more (doubled) after it was sent, until the genuine ACK
/// of the second resend ends its call.
#[test]
fn a_forged_ack_does_not_stop_a_worker_from_resending_its_contribution() {
    let mut sim = Sim::new();
    let start = sim.now;
    sim.fate = Box::new(move |d| {
        let ack_to_0 = d.to == worker_addr(0) && d.kind() == Some(MessageKind::Ack);
        usize::from(!(ack_to_0 && d.at < start + Duration::from_millis(30)))
    });
    for i in 0..=AGG {
        sim.start_reduce(i, false, 1, CallOptions::default());
    }
    let mut bitmap = SeqBitmap::new(0, 1).expect("a bitmap");
    bitmap.set(0);
    let ack = AckMessage {
        id: JOB,
        rank: 0,
        kind: AckKind::Aggregation,
        flags: 0,
        bitmap,
    };
    let mut forged = Vec::new();
    ack.encode_into(&mut forged).expect("an AGK1");
    for from in [
        SocketAddr::new(AGG_IP, 6000),
        SocketAddr::new(STRANGER, agg_addr().port()),
    ] {
        sim.inject(from, worker_addr(0), forged.clone());
    }
    sim.run(Duration::from_secs(5));
    assert!(
        matches!(sim.ended(0), Ended::Contributed),
        "{:?}",
        sim.ended(0)
    );
    let resent: Vec<(Option<u32>, Duration)> = sim
        .log
        .iter()
        .filter(|d| d.resend)
        .map(|d| {
            assert_eq!((d.from, d.to), (worker_addr(0), agg_addr()));
            (d.seq(), d.at - sim.start)
        })
        .collect();
    let ms = Duration::from_millis;
    assert_eq!(resent, vec![(Some(0), ms(20)), (Some(0), ms(60))]);
    let refused = sim.nodes[0].counters.refused_snapshot();
    let want = RefusedStats {
        acks_from_wrong_source: 2,
        ..RefusedStats::default()
    };
    assert_eq!(refused, want);
    match sim.ended(AGG) {
        Ended::Values(v) => assert_eq!(v, &expected_sum(1), "added once"),
        other => panic!("the aggregator: {other:?}"),
    }
}

/// Later-round RESULTs kept at most (bytes).
const EARLY_LIMIT: usize = 256 << 10;

/// The kernel backend, RESULTs of later rounds kept up to [`EARLY_LIMIT`].
fn early_bound(me: Participant) -> CommConfig {
    builder(me)
        .backend(BackendKind::Kernel)
        .result_port(RESULT_PORT)
        .early_result_bytes(EARLY_LIMIT)
        .config()
        .clone()
}

/// The aggregator application (kernel backend) at round 0 gets, from a
/// worker's socket, a RESULT of round 1, then a flood of 2000 full RESULTs
/// of rounds 2 to 101, then round 0's. What is kept stays within the byte
/// bound (each kept RESULT costs its payload and its entry) and the rest
/// is counted; round 0 gets its value, round 1 the RESULT kept before the
/// flood, round 2 the flood's first 20 fragments.
#[test]
fn a_flood_of_later_round_results_keeps_at_most_the_byte_bound() {
    let mut sim = Sim::with(early_bound);
    let agg = sim.nodes[AGG].addr;
    let from = worker_addr(0);
    sim.inject(from, agg, result(1, 1, 0, &[11], true));
    let flood = 2000u32;
    let values = vec![7; PER];
    for k in 0..flood {
        let (round, frag) = (2 + k / 20, k % 20);
        let d = result(round, 2 + frag, frag * PER as u32, &values, false);
        sim.inject(from, agg, d);
    }
    sim.inject(from, agg, result(0, 0, 0, &[5], true));

    let call = |sim: &mut Sim, len: usize| {
        let opts = CallOptions::default();
        sim.start_reduce_from(AGG, false, Op::Sum, Src::Len(len), None, opts);
        let limit = sim.now - sim.start + Duration::from_secs(5);
        sim.run(limit);
        match sim.ended(AGG) {
            Ended::Values(v) => v.clone(),
            other => panic!("the aggregator, len {len}: {other:?}"),
        }
    };
    assert_eq!(call(&mut sim, 1), vec![5], "round 0");
    let entry = std::mem::size_of::<(AggHeader, Vec<u8>, SocketAddr)>();
    let kept = (EARLY_LIMIT - (4 + entry)) / (4 * PER + entry);
    assert!(kept >= 20, "round 2 fits: {kept}");
    let refused = sim.nodes[AGG].counters.refused_snapshot();
    let want = RefusedStats {
        early_results_over_limit: flood as u64 - kept as u64,
        ..RefusedStats::default()
    };
    assert_eq!(refused, want);
    assert_eq!(
        call(&mut sim, 1),
        vec![11],
        "round 1, kept before the flood"
    );
    assert_eq!(
        call(&mut sim, 20 * PER),
        vec![7; 20 * PER],
        "round 2, from the flood"
    );
}
