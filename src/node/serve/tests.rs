//! Tests of the result service and of served-job changes.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use super::reload::{carry_positions, JobSocket};
use super::*;
use crate::config::{Config, ParentConfig};
use crate::wire::abi::{self, Op, Round};
use crate::wire::proto::{self, AckKind, AckMessage, AckMode, AggHeader, PositionMessage, SeqBitmap};
use crate::wire::reliability::ReliabilityConfig;

const JOB: u16 = 9;
const NODE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);

fn worker(r: u16) -> SocketAddr {
    v4(Ipv4Addr::new(10, 0, 0, 1 + r as u8), 5000)
}

fn v4(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

fn service(mode: AckMode) -> ResultService {
    let cfg = ReliabilityConfig { ack_mode: mode, ..ReliabilityConfig::default() };
    ResultService::new(JOB, vec![NODE.into()], (0..3).map(worker).collect(), cfg)
}

/// RESULT of fragment `index` (of `per` elements) of `round`, named by
/// contribution seq `seq`.
fn result(round: u32, seq: u32, index: u32, last: bool) -> Vec<u8> {
    let hdr = AggHeader {
        job: JOB,
        rank: abi::RESULT_RANK,
        seq,
        round: Round(round),
        frag_off: index * 4,
        op: Op::Sum,
        flags: abi::AGG_F_RESULT | if last { abi::AGG_F_LAST_FRAGMENT } else { 0 },
        count: 4,
    };
    let mut out = Vec::new();
    proto::encode_agg_into(&hdr, &[1, 2, 3, 4], &mut out).unwrap();
    out
}

fn ack(rank: u16, seqs: &[u32]) -> Vec<u8> {
    let mut bm = SeqBitmap::new(seqs[0], 64).unwrap();
    for &s in seqs {
        bm.set(s);
    }
    let mut out = Vec::new();
    AckMessage { id: JOB, rank, kind: AckKind::Aggregation, flags: 0, bitmap: bm }.encode_into(&mut out).unwrap();
    out
}

fn acks_to(out: &[Transmit]) -> Vec<(SocketAddr, u16, Vec<u32>)> {
    out.iter()
        .filter_map(|t| AckMessage::decode(&t.datagram).ok().map(|a| (t.to, a.rank, a.bitmap.received().collect())))
        .collect()
}

fn resends(out: &[Transmit]) -> Vec<(SocketAddr, u32)> {
    out.iter().filter_map(|t| proto::split_agg(&t.datagram).ok().map(|(h, _)| (t.to, h.seq))).collect()
}

#[test]
fn a_result_is_acknowledged_to_every_worker_under_its_seq() {
    let mut s = service(AckMode::Packet);
    let (now, mut out) = (Instant::now(), Vec::new());
    s.handle(now, worker(1), &result(5, 40, 0, false), &mut out);
    let acks = acks_to(&out);
    assert_eq!(acks, (0..3).map(|r| (worker(r), r, vec![40])).collect::<Vec<_>>());
    assert_eq!((s.stats().results, s.stats().acks_sent, s.held()), (1, 3, 1));
    assert_eq!((s.stats().rounds, s.stats().workers_behind), (1, 3), "every worker owes the ACK of its copy");
    // A copy is acknowledged again, not taken again.
    out.clear();
    s.handle(now, worker(1), &result(5, 40, 0, false), &mut out);
    assert_eq!(acks_to(&out).len(), 3);
    assert_eq!((s.stats().results, s.stats().duplicate_results), (1, 1));
}

#[test]
fn a_result_of_the_userspace_path_is_sent_to_every_worker_and_a_kernel_one_is_not() {
    let mut s = service(AckMode::Packet);
    let (now, mut out) = (Instant::now(), Vec::new());
    // The kernel's RESULT: the completing worker's address as its source,
    // the copies sent by TC.
    s.handle(now, worker(1), &result(5, 40, 0, false), &mut out);
    assert!(resends(&out).is_empty(), "the kernel's copies are TC's: {:?}", resends(&out));
    // The user-space path's: sent from the node's address through a socket.
    out.clear();
    s.handle(now, v4(NODE, 40000), &result(5, 41, 1, false), &mut out);
    assert_eq!(resends(&out), (0..3).map(|r| (worker(r), 41)).collect::<Vec<_>>(), "a copy to every worker");
    assert_eq!(acks_to(&out).len(), 3, "and the ACK on the kernel's behalf as for any RESULT");
    assert_eq!((s.stats().results, s.held()), (2, 2));
}

#[test]
fn only_the_worker_that_misses_a_result_gets_it_again() {
    let mut s = service(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    s.handle(t0, NODE_SOCKET, &result(5, 40, 0, false), &mut out);
    s.handle(t0, worker(0), &result(5, 41, 1, true), &mut out);
    out.clear();
    // Workers 0 and 2 acknowledge both copies; worker 1 only the first.
    s.handle(t0, worker(0), &ack(0, &[40, 41]), &mut out);
    s.handle(t0, worker(2), &ack(2, &[40, 41]), &mut out);
    s.handle(t0, worker(1), &ack(1, &[40]), &mut out);
    assert_eq!(s.stats().acks_received, 3);
    // Until the RTO nothing is resent; then only 41, only to worker 1.
    let at = s.poll(t0, &mut out).expect("a timer for the missing ACK");
    assert!(resends(&out).is_empty());
    let later = at.max(t0) + Duration::from_millis(1);
    s.poll(later, &mut out);
    assert_eq!(resends(&out), vec![(worker(1), 41)]);
    assert_eq!(s.stats().resent, 1);
    out.clear();
    s.handle(later, worker(1), &ack(1, &[40, 41]), &mut out);
    assert_eq!(s.held(), 0, "every copy acknowledged: nothing held");
    s.poll(later + Duration::from_secs(5), &mut out);
    assert!(resends(&out).is_empty());
}

const NODE_SOCKET: SocketAddr = SocketAddr::V4(SocketAddrV4::new(NODE, 40000));

#[test]
fn forged_results_and_acks_are_refused_and_change_nothing() {
    let mut s = service(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    let stranger = v4(Ipv4Addr::new(10, 0, 0, 66), 5000);
    s.handle(t0, stranger, &result(5, 40, 0, true), &mut out);
    // Worker 1's address on another port is not worker 1's socket.
    s.handle(t0, v4(worker(1).ip(), 6000), &result(5, 40, 0, true), &mut out);
    assert!(out.is_empty(), "a forged RESULT acknowledges nothing");
    assert_eq!((s.stats().refused_results, s.stats().results), (2, 0));
    s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
    out.clear();
    // Worker 2's ACK sent from worker 0's socket must not stop its resend.
    s.handle(t0, worker(0), &ack(2, &[40]), &mut out);
    s.handle(t0, worker(0), &ack(0, &[40]), &mut out);
    s.handle(t0, worker(1), &ack(1, &[40]), &mut out);
    assert_eq!(s.stats().refused_acks, 1);
    s.poll(t0 + Duration::from_secs(2), &mut out);
    assert_eq!(resends(&out), vec![(worker(2), 40)]);
}

#[test]
fn an_ack_before_the_result_counts_and_a_newer_round_retires_the_older() {
    let mut s = service(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    // Worker 2's ACK of seq 40 arrives before the node took RESULT 40.
    s.handle(t0, worker(2), &ack(2, &[40]), &mut out);
    s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
    s.handle(t0, worker(0), &ack(0, &[40]), &mut out);
    out.clear();
    s.poll(t0 + Duration::from_secs(2), &mut out);
    assert_eq!(resends(&out), vec![(worker(1), 40)], "worker 2's early ACK counted");
    // Round 6's first RESULT (fragment 1 first): every worker finished
    // round 5, so its RESULT 40 is no longer held or resent.
    out.clear();
    s.handle(t0 + Duration::from_secs(2), worker(0), &result(6, 42, 1, true), &mut out);
    s.handle(t0 + Duration::from_secs(2), worker(0), &result(6, 41, 0, false), &mut out);
    assert_eq!(s.held(), 2, "round 6's two RESULTs, both registered (fragment 0 came second)");
    for r in 0..3 {
        s.handle(t0 + Duration::from_secs(2), worker(r), &ack(r, &[41, 42]), &mut out);
    }
    out.clear();
    s.poll(t0 + Duration::from_secs(10), &mut out);
    assert!(resends(&out).is_empty());
    assert_eq!(s.held(), 0);
}

/// Worker `rank`'s position query of `job`, with nonce `nonce`.
fn query(job: u16, rank: u16, nonce: u32) -> Vec<u8> {
    PositionMessage::query(job, rank, nonce).encode().to_vec()
}

/// The position replies in `out`: (destination, message).
fn replies(out: &[Transmit]) -> Vec<(SocketAddr, PositionMessage)> {
    out.iter().filter_map(|t| PositionMessage::decode(&t.datagram).ok().map(|m| (t.to, m))).collect()
}

#[test]
fn a_workers_position_query_is_answered_with_the_round_after_next_and_the_seq_after_the_newest() {
    let mut s = service(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    // Nothing seen: a new run starts at 0, 0, and the reply says so.
    s.handle(t0, worker(2), &query(JOB, 2, 77), &mut out);
    let r = replies(&out);
    assert_eq!(r.len(), 1, "{out:?}");
    assert_eq!(r[0].0, worker(2), "the reply goes to the asking socket");
    assert!(r[0].1.is_reply() && r[0].1.is_fresh());
    assert_eq!((r[0].1.job, r[0].1.rank, r[0].1.nonce, r[0].1.round, r[0].1.agg_seq), (JOB, 2, 77, Round(0), 0));
    // Before the reply goes out, the node releases what an earlier run
    // left: with no RESULT seen, the job's unfinished slots of any round.
    assert_eq!(s.take_release(), Some(None));
    assert_eq!(s.take_release(), None, "taken once");
    // Round 5 (seqs 40, 41), then a late copy of round 4 (seq 30): the
    // newest round and seq count, in serial order.
    s.handle(t0, worker(0), &result(5, 41, 1, true), &mut out);
    s.handle(t0, worker(0), &result(5, 40, 0, false), &mut out);
    s.handle(t0, worker(1), &result(4, 30, 0, true), &mut out);
    out.clear();
    s.handle(t0, worker(0), &query(JOB, 0, 78), &mut out);
    let r = replies(&out);
    assert_eq!(r.len(), 1);
    assert!(r[0].1.is_reply() && !r[0].1.is_fresh());
    // Round 6 is skipped: a run cut off in it may hold slots of it.
    assert_eq!((r[0].0, r[0].1.nonce, r[0].1.round, r[0].1.agg_seq), (worker(0), 78, Round(7), 42));
    assert_eq!(s.take_release(), Some(Some(Round(5))), "the slots of rounds after the newest RESULT's");
    assert_eq!(s.position(), (Round(7), 42, false));
    assert_eq!((s.stats().position_queries, s.stats().refused_queries), (2, 0));
    // Serial order across the wrap: after u32::MAX, 0 is newer.
    let mut s = service(AckMode::Packet);
    s.handle(t0, worker(0), &result(u32::MAX - 1, u32::MAX - 1, 0, true), &mut out);
    assert_eq!(s.position(), (Round(0), u32::MAX, false));
    s.handle(t0, worker(0), &result(u32::MAX, u32::MAX, 0, true), &mut out);
    s.handle(t0, worker(0), &result(0, 0, 0, true), &mut out);
    assert_eq!(s.position(), (Round(2), 1, false));
}

#[test]
fn a_position_query_of_a_stranger_or_a_malformed_one_is_refused_counted_and_changes_nothing() {
    let mut s = service(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
    let before = (s.position(), s.held());
    out.clear();
    let stranger = v4(Ipv4Addr::new(10, 0, 0, 66), 5000);
    let mut bad_flags = query(JOB, 0, 1);
    bad_flags[20] = 0x80;
    let mut with_position = query(JOB, 0, 1);
    with_position[15] = 9;
    let reply = PositionMessage::reply(&PositionMessage::query(JOB, 0, 1), Round(1), 1, false).encode().to_vec();
    let refused: Vec<(SocketAddr, Vec<u8>)> = vec![
        (stranger, query(JOB, 0, 1)),
        // Worker 1's address on another port is not worker 1's socket.
        (v4(worker(1).ip(), 6000), query(JOB, 1, 1)),
        // Worker 0's socket asking as worker 2.
        (worker(0), query(JOB, 2, 1)),
        (worker(0), query(JOB, 7, 1)),
        (worker(0), query(JOB + 1, 0, 1)),
        (worker(0), query(JOB, 0, 1)[..23].to_vec()),
        (worker(0), [query(JOB, 0, 1), vec![0]].concat()),
        (worker(0), bad_flags),
        (worker(0), with_position),
        (worker(0), reply),
        (worker(0), b"AGP1".to_vec()),
        // From the node's own address: not a worker either.
        (NODE_SOCKET, query(JOB, 0, 1)),
    ];
    for (from, d) in &refused {
        s.handle(t0, *from, d, &mut out);
    }
    assert!(out.is_empty(), "nothing answered: {out:?}");
    assert_eq!((s.stats().refused_queries, s.stats().position_queries), (refused.len() as u64, 0));
    assert_eq!((s.stats().other, s.stats().refused_acks, s.stats().refused_results), (0, 0, 0));
    assert_eq!((s.position(), s.held()), before, "a refused query changes nothing");
    assert_eq!(s.take_release(), None, "a refused query releases nothing");
    s.handle(t0, worker(1), &query(JOB, 1, 5), &mut out);
    assert_eq!(replies(&out).len(), 1);
}

#[test]
fn a_tree_leaf_answers_positions_from_its_own_and_its_parents_results_and_refuses_the_parent() {
    let mut s = leaf(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
    s.handle(t0, v4(PARENT_ADDR, 33333), &parent_result(6, 41, 0, true), &mut out);
    assert_eq!(s.position(), (Round(8), 42, false));
    out.clear();
    s.handle(t0, v4(PARENT_ADDR, 7501), &query(JOB, 0, 1), &mut out);
    assert!(out.is_empty());
    assert_eq!(s.stats().refused_queries, 1);
}

#[test]
fn a_job_replaced_by_a_reload_answers_positions_from_where_its_predecessor_was() {
    let mut old = service(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    old.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
    let other = ResultService::new(JOB + 1, vec![NODE.into()], vec![worker(0)], ReliabilityConfig::default());
    let mut added = vec![(JobSocket::TakeOver(1), service(AckMode::Packet)), (JobSocket::TakeOver(2), other)];
    carry_positions([&old].into_iter(), &mut added);
    assert_eq!(added[0].1.position(), (Round(7), 41, false), "the same job: its kernel state stayed");
    assert_eq!(added[1].1.position(), (Round(0), 0, true), "another job starts fresh");
}

const PARENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 9, 1);
const PARENT: ParentConfig = ParentConfig { addr: std::net::IpAddr::V4(PARENT_ADDR), port: 7500, job: 20, rank: 1, result_port: Some(7501), tree_workers: None };

/// A leaf of a tree: `service(mode)` whose RESULTs go to [`PARENT`].
fn leaf(mode: AckMode) -> ResultService {
    let cfg = ReliabilityConfig { ack_mode: mode, ..ReliabilityConfig::default() };
    service(mode).with_parent(&PARENT, 7501, cfg)
}

/// `result(..)` as the parent's RESULT (its job id).
fn parent_result(round: u32, seq: u32, index: u32, last: bool) -> Vec<u8> {
    let mut d = result(round, seq, index, last);
    d[4..6].copy_from_slice(&PARENT.job.to_be_bytes());
    d
}

fn parent_ack(seqs: &[u32]) -> Vec<u8> {
    let mut d = ack(PARENT.rank, seqs);
    d[4..6].copy_from_slice(&PARENT.job.to_be_bytes());
    d
}

/// The AGG1 datagrams in `out`: (destination, header).
fn aggs(out: &[Transmit]) -> Vec<(SocketAddr, AggHeader)> {
    out.iter().filter_map(|t| proto::split_agg(&t.datagram).ok().map(|(h, _)| (t.to, h))).collect()
}

#[test]
fn a_leaf_sends_its_result_upstream_as_its_contribution_and_resends_it_until_the_parent_acks() {
    let mut s = leaf(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    s.handle(t0, worker(1), &result(5, 40, 0, true), &mut out);
    // The workers' contributions are acknowledged on the kernel's behalf.
    assert_eq!(acks_to(&out).len(), 3);
    // One contribution to the parent's job port: its job, this node's
    // rank, RESULT cleared (LAST_FRAGMENT kept), the RESULT's seq.
    let up = aggs(&out);
    assert_eq!(up.len(), 1, "{up:?}");
    let (to, h) = up[0];
    assert_eq!(to, v4(PARENT_ADDR, 7500));
    assert_eq!((h.job, h.rank, h.seq, h.round, h.flags), (20, 1, 40, Round(5), abi::AGG_F_LAST_FRAGMENT));
    assert_eq!((s.held(), s.stats().upstream_sent, s.stats().upstream_held), (0, 1, 1), "the partial result is not the workers'");
    // Unacknowledged: resent after the RTO, to the parent only.
    out.clear();
    s.poll(t0 + Duration::from_secs(2), &mut out);
    assert_eq!(aggs(&out).iter().map(|(to, h)| (*to, h.job, h.seq)).collect::<Vec<_>>(), vec![(v4(PARENT_ADDR, 7500), 20, 40)]);
    assert_eq!(s.stats().upstream_resent, 1);
    // Another rank's ACK, or one from elsewhere, stops nothing.
    let mut other = ack(0, &[40]);
    other[4..6].copy_from_slice(&20u16.to_be_bytes());
    s.handle(t0, v4(PARENT_ADDR, 7501), &other, &mut out);
    assert_eq!(s.stats().refused_acks, 1);
    s.handle(t0, v4(PARENT_ADDR, 7501), &parent_ack(&[40]), &mut out);
    assert_eq!((s.stats().upstream_acks, s.stats().upstream_held), (1, 0));
    out.clear();
    s.poll(t0 + Duration::from_secs(10), &mut out);
    assert!(aggs(&out).is_empty(), "acknowledged: never resent");
}

#[test]
fn a_leaf_acknowledges_the_parents_result_and_delivers_it_to_every_worker_until_each_acked() {
    let mut s = leaf(AckMode::Packet);
    let (t0, mut out) = (Instant::now(), Vec::new());
    s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
    out.clear();
    let from_parent = v4(PARENT_ADDR, 33333);
    s.handle(t0, from_parent, &parent_result(5, 40, 0, true), &mut out);
    // ACK to the parent's result port, under this node's rank in its job.
    let acks: Vec<_> = out.iter().filter_map(|t| AckMessage::decode(&t.datagram).ok().map(|a| (t.to, a.id, a.rank, a.bitmap.received().collect::<Vec<_>>()))).collect();
    assert_eq!(acks, vec![(v4(PARENT_ADDR, 7501), 20, 1, vec![40])]);
    // A copy to each worker, under this job's id, seq as it came.
    let copies: Vec<_> = aggs(&out).iter().map(|(to, h)| (*to, h.job, h.seq, h.is_result())).collect();
    assert_eq!(copies, (0..3).map(|r| (worker(r), JOB, 40, true)).collect::<Vec<_>>());
    assert_eq!((s.stats().parent_results, s.stats().parent_acks_sent, s.held()), (1, 1, 1));
    assert_eq!(s.stats().upstream_held, 0, "the parent's RESULT acknowledges the contribution to it");
    // A copy of it again (the parent resent: our ACK was lost): acknowledged, not delivered again.
    out.clear();
    s.handle(t0, from_parent, &parent_result(5, 40, 0, true), &mut out);
    assert_eq!((acks_to(&out).len(), aggs(&out).len(), s.stats().duplicate_parent_results), (1, 0, 1));
    // Workers 0 and 2 acknowledge; only worker 1 gets it again.
    s.handle(t0, worker(0), &ack(0, &[40]), &mut out);
    s.handle(t0, worker(2), &ack(2, &[40]), &mut out);
    out.clear();
    s.poll(t0 + Duration::from_secs(2), &mut out);
    assert_eq!(resends(&out), vec![(worker(1), 40)]);
    // Something else from the parent's address never reaches a worker.
    out.clear();
    s.handle(t0, from_parent, &result(5, 41, 1, true), &mut out);
    assert!(out.is_empty() && s.stats().refused_results == 1);
}

#[test]
fn group_mode_acknowledges_on_behalf_once_results_stop_for_the_delay() {
    let mut s = service(AckMode::Group);
    let delay = ReliabilityConfig::default().ack_delay;
    let (t0, mut out) = (Instant::now(), Vec::new());
    s.handle(t0, worker(0), &result(5, 40, 0, false), &mut out);
    assert!(acks_to(&out).is_empty(), "group mode waits");
    // The call's last fragment: its RESULT copies acknowledge the
    // workers' contributions, so the ACK waits too.
    s.handle(t0, worker(0), &result(5, 41, 1, true), &mut out);
    assert!(acks_to(&out).is_empty(), "the last fragment's ACK waits");
    // Next calls (one fragment each) within the delay postpone it.
    let mut at = t0;
    for (round, seq) in [(6, 42), (7, 43), (8, 44)] {
        at += delay / 2;
        s.handle(at, worker(0), &result(round, seq, 0, true), &mut out);
        s.poll(at, &mut out);
        assert!(acks_to(&out).is_empty(), "round {round}: no ACK while calls keep coming");
    }
    assert_eq!(s.poll(at, &mut out), Some(at + delay), "due once idle for the delay");
    // Idle for the delay: one ACK to each worker of everything.
    s.poll(at + delay, &mut out);
    let acks = acks_to(&out);
    assert_eq!(acks.len(), 3, "{acks:?}");
    assert!(acks.iter().all(|(_, _, seqs)| seqs == &vec![40, 41, 42, 43, 44]));
    assert_eq!(s.stats().acks_sent, 3);
}

#[test]
fn a_result_of_the_next_round_retires_the_round_for_every_worker_without_their_acks() {
    let mut s = service(AckMode::Group);
    let (t0, mut out) = (Instant::now(), Vec::new());
    // A stream of one-fragment calls and no worker ACK at all: each
    // call's RESULT retires the one before, nothing is resent.
    for i in 0..50u32 {
        let at = t0 + Duration::from_micros(100) * i;
        s.handle(at, worker(0), &result(5 + i, 40 + i, 0, true), &mut out);
        s.poll(at, &mut out);
        assert_eq!(s.held(), 1, "call {i}: only the newest RESULT is held");
    }
    assert_eq!((s.stats().rounds, s.stats().acks_received), (50, 0));
    assert!(resends(&out).is_empty(), "nothing resent: {:?}", resends(&out));
    // The last call's copies wait for the workers' ACKs, and are resent
    // to a worker whose ACK does not come.
    s.handle(t0 + Duration::from_millis(6), worker(0), &ack(0, &[89]), &mut out);
    s.handle(t0 + Duration::from_millis(6), worker(1), &ack(1, &[89]), &mut out);
    out.clear();
    s.poll(t0 + Duration::from_secs(2), &mut out);
    assert_eq!(resends(&out), vec![(worker(2), 89)]);
}

#[test]
fn a_result_port_another_process_holds_fails_the_bind_and_names_the_job() {
    let taken = UdpSocket::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let text = format!(
        "[[job]]\nid = 12\nport = {}\nworkers = [\"10.0.0.1\"]\nresult_port = {port}\nresult_group = 1\nconsumer = \"node\"\n\n[[group]]\nid = 1\nmembers = [\"10.0.0.1:5000\"]\n",
        if port == 40000 { 40001 } else { 40000 }
    );
    let config = Config::parse(&text, "t.toml").expect("config");
    let err = BoundJobs::bind(&config, vec![NODE.into()]).expect_err("the port is taken");
    let msg = format!("{err:#}");
    assert!(msg.contains("job 12") && msg.contains(&format!("result_port {port}")) && msg.contains("holds it"), "{msg}");
    drop(taken);
    let bound = BoundJobs::bind(&config, vec![NODE.into()]).expect("free again");
    assert!(!bound.is_empty());
}

#[test]
fn a_served_tree_job_is_bound_with_its_parent() {
    let (port, _) = free_ports();
    let text = format!(
        "[[job]]\nid = 12\nport = 7600\nworkers = [\"10.0.0.1\"]\nresult_port = {port}\nresult_group = 1\nconsumer = \"node\"\nparent = {{ addr = \"10.0.9.1\", port = 7500, job = 20, rank = 3, result_port = 7501 }}\n\n{GROUP}"
    );
    let config = Config::parse(&text, "t.toml").expect("config");
    let bound = BoundJobs::bind(&config, vec![NODE.into()]).expect("bound");
    let up = bound.add[0].1.upstream.as_ref().expect("the service sends upstream");
    assert_eq!(
        (up.contributions, up.acks_to, up.job, up.rank),
        ("10.0.9.1:7500".parse().unwrap(), "10.0.9.1:7501".parse().unwrap(), 20, 3)
    );
}

/// Two free UDP ports (bound and released at once).
fn free_ports() -> (u16, u16) {
    let a = UdpSocket::bind("0.0.0.0:0").unwrap();
    let b = UdpSocket::bind("0.0.0.0:0").unwrap();
    (a.local_addr().unwrap().port(), b.local_addr().unwrap().port())
}

fn served_job(id: u16, result_port: u16, window: u32) -> String {
    format!(
        "[[job]]\nid = {id}\nport = {}\nworkers = [\"10.0.0.1\"]\nresult_port = {result_port}\nresult_group = 1\nwindow = {window}\nconsumer = \"node\"\n\n",
        30000 + id
    )
}

const GROUP: &str = "[[group]]\nid = 1\nmembers = [\"10.0.0.1:5000\"]\n";

#[test]
fn a_change_binds_only_new_ports_and_hands_a_removed_jobs_port_to_its_successor() {
    let (p, q) = free_ports();
    let old = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(2, q, 4)), "old.toml").unwrap();
    // Job 1 unchanged; job 2 changed (same port): removed and added,
    // its socket passed on, nothing bound (the old one still holds q).
    let holder = UdpSocket::bind(("0.0.0.0", q)).unwrap();
    let new = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(2, q, 8)), "new.toml").unwrap();
    let change = ServedChange::bind_change(&old, &new, vec![NODE.into()]).expect("q passes on, nothing to bind");
    assert_eq!(change.jobs(), (vec![2], vec![2]));
    assert!(matches!(change.add[0].0, JobSocket::TakeOver(port) if port == q));
    // Job 2 removed, job 3 takes its port: the same hand-over.
    let new = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(3, q, 4)), "new.toml").unwrap();
    let change = ServedChange::bind_change(&old, &new, vec![NODE.into()]).expect("q passes on");
    assert_eq!(change.jobs(), (vec![2], vec![3]));
    // A job on a port nobody of the old config held must bind it.
    drop(holder);
    let holder = UdpSocket::bind(("0.0.0.0", p)).unwrap();
    let new = Config::parse(&format!("{}{GROUP}", served_job(4, p, 4)), "new.toml").unwrap();
    let fresh = Config::default();
    let err = ServedChange::bind_change(&fresh, &new, vec![NODE.into()]).expect_err("p is held");
    assert!(format!("{err:#}").contains("job 4"), "{err:#}");
    drop(holder);
    // Nothing changed: an empty change.
    assert!(ServedChange::bind_change(&old, &old, vec![NODE.into()]).unwrap().is_empty());
}
