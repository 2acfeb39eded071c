//! Every collective through an impaired network, on the fake clock:
//! reordering, duplication and loss (seeded, so each run draws the same
//! fates), per-packet ACKs with a small window, more fragments than the
//! socket aggregator has slots, and lengths around a fragment for every op.
//! Each call is checked exactly: every participant's result equals the
//! reference reducer's (or the root's bytes), each receiver is delivered
//! each byte once, nothing of the job's own traffic is refused, and every
//! data datagram the network lost was resent to whoever lost it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use super::{builder, input, Datagram, Ended, Sim, LATENCY, PER, WORKERS};
use crate::runtime::engine::{CallOptions, CommConfig, Participant};
use crate::runtime::transport::RefusedStats;
use crate::wire::abi::Op;
use crate::wire::proto::{AckMessage, AckMode, MessageKind};
use crate::wire::reducer;
use crate::runtime::transport::Rng;

/// Spread of the reordering delays: a datagram is held up to `window`
/// steps, so it can be overtaken by the ones sent in the next `window`
/// steps (a poll sends its datagrams at one instant).
const REORDER_STEP: Duration = Duration::from_micros(10);

/// An impaired network: each datagram (data and ACKs alike) is lost with
/// `loss` %, else duplicated with `dup` %; each copy is held up to
/// `window` reordering steps (1: none).
fn impair(sim: &mut Sim, seed: u64, loss: u64, dup: u64, window: u64) {
    let mut fates = Rng(seed);
    sim.fate = Box::new(move |_| {
        if fates.chance_ppm(loss * 10_000) {
            0
        } else if fates.chance_ppm(dup * 10_000) {
            2
        } else {
            1
        }
    });
    let mut delays = Rng(!seed);
    sim.delay = Box::new(move |_| REORDER_STEP * delays.below(window) as u32);
}

/// What the reference reducer makes of the workers' [`input`]s.
fn reference(op: Op, len: usize) -> Vec<i32> {
    let inputs: Vec<Vec<i32>> = (0..WORKERS).map(|r| input(r, len)).collect();
    let c: Vec<(&[i32], i32)> = inputs.iter().map(|x| (x.as_slice(), 1)).collect();
    let r = reducer::reduce(op, &c).expect("the reference reduction");
    r.ints().expect("an int result").to_vec()
}

/// A broadcast message of `len` bytes.
fn message(len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// Panics with the first element where `got` differs from `want`.
fn assert_same<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(k) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: element {k} is {:?}, want {:?}", got[k], want[k]);
    }
}

fn participants() -> std::ops::RangeInclusive<usize> {
    0..=WORKERS as usize
}

fn delivered(sim: &Sim) -> Vec<u64> {
    participants()
        .map(|i| sim.stats(i).bytes_delivered)
        .collect()
}

/// Runs the calls just started to their end (each has the communicator's
/// 2 s deadline: a call that does not recover fails, it does not hang).
fn run_calls(sim: &mut Sim) {
    let limit = sim.now - sim.start + Duration::from_secs(10);
    sim.run(limit);
}

/// A broadcast of `len` bytes from `root` on every participant: each
/// receiver ends with the root's bytes, delivered once each.
fn broadcast_everywhere(sim: &mut Sim, root: usize, len: usize) {
    let data = message(len);
    let before = delivered(sim);
    for i in participants() {
        sim.start_broadcast(i, root, &data, CallOptions::default());
    }
    run_calls(sim);
    let after = delivered(sim);
    for i in participants() {
        let what = format!("participant {i}, broadcast of {len} bytes from {root}");
        match sim.ended(i) {
            Ended::Bytes(b) => assert_same(&what, b, &data),
            other => panic!("{what}: {other:?}"),
        }
        let want = if i == root { 0 } else { len as u64 };
        assert_eq!(after[i] - before[i], want, "{what}: bytes delivered");
    }
}

/// A reduction (`all`: allreduce) of `len` elements with `op` on every
/// participant: whoever gets the result gets the reference reducer's,
/// delivered once; a reduce worker ends acknowledged.
fn reduce_everywhere(sim: &mut Sim, all: bool, op: Op, len: usize) {
    let want = reference(op, len);
    let before = delivered(sim);
    for i in participants() {
        sim.start_reduce_op(i, all, op, len, CallOptions::default());
    }
    run_calls(sim);
    let after = delivered(sim);
    for i in participants() {
        let what = format!("participant {i}, {op:?} (all {all}) of {len}");
        let gets_result = all || i == sim.aggregator();
        match sim.ended(i) {
            Ended::Values(v) if gets_result => assert_same(&what, v, &want),
            Ended::Contributed if !gets_result => {}
            other => panic!("{what}: {other:?}"),
        }
        let want_bytes = if gets_result { 4 * len as u64 } else { 0 };
        assert_eq!(after[i] - before[i], want_bytes, "{what}: bytes delivered");
    }
}

/// Lengths (elements) of the calls: one element, one full fragment, a few
/// fragments, and more than a window of the aggregator's slots.
const LENS: [usize; 4] = [1, PER, 5000, 30_000];

/// Broadcasts from a worker and from the aggregator (odd byte counts: the
/// last fragment short), reduce and allreduce, of every length in
/// [`LENS`], then a MAX allreduce; the job's own traffic is never refused.
fn every_collective(sim: &mut Sim) {
    for len in LENS {
        broadcast_everywhere(sim, 1, 4 * len + 3);
        broadcast_everywhere(sim, sim.aggregator(), 4 * len + 1);
        reduce_everywhere(sim, false, Op::Sum, len);
        reduce_everywhere(sim, true, Op::Sum, len);
    }
    reduce_everywhere(sim, true, Op::Max, 20_000);
    for i in participants() {
        let refused = sim.nodes[i].counters.refused_snapshot();
        assert_eq!(refused, RefusedStats::default(), "participant {i}");
    }
}

/// `(from, to, seq)` of a data datagram (`AGG1` or `AGB1`).
fn data_key(d: &Datagram) -> Option<(SocketAddr, SocketAddr, u32)> {
    d.seq().map(|s| (d.from, d.to, s))
}

/// Every data datagram the network lost was resent to the participant
/// that lost it until a copy got through (each datagram on this network
/// goes to one destination: each send is one copy, lost or delivered);
/// returns how many sends were lost.
fn assert_every_lost_datagram_was_resent_until_delivered(sim: &Sim) -> usize {
    let mut sends: HashMap<(SocketAddr, SocketAddr, u32), usize> = HashMap::new();
    for k in sim.log.iter().filter_map(data_key) {
        *sends.entry(k).or_default() += 1;
    }
    let mut lost: HashMap<(SocketAddr, SocketAddr, u32), usize> = HashMap::new();
    for k in sim.lost.iter().filter_map(data_key) {
        *lost.entry(k).or_default() += 1;
    }
    for (k, n) in &lost {
        assert!(
            sends[k] > *n,
            "seq {} from {} to {}: {n} sends lost of {}, none delivered",
            k.2,
            k.0,
            k.1,
            sends[k]
        );
    }
    lost.values().sum()
}

fn data_resent(sim: &Sim) -> usize {
    sim.log.iter().filter(|d| d.resend).count()
}

/// Reordering alone (windows of 8, 16 and 64 steps) loses nothing: every
/// collective is exact, and no broadcast or result datagram is resent (a
/// hole in an ACK is resent once it is older than the smoothed RTT, which
/// no reordering here reaches). Contributions may be: an allreduce
/// worker's contribution is acknowledged by its result, which waits for the
/// slowest rank's contribution to that fragment, so a result held back by
/// the reordering can come later than the RTO the undelayed results taught
/// the worker, and the contribution looks lost (a spurious resend, which
/// the aggregator's slot does not add twice: the sums are exact).
#[test]
fn every_collective_through_reordering_is_exact_and_resends_no_broadcast_or_result() {
    for (seed, window) in [(1, 8), (2, 16), (3, 64)] {
        let mut sim = Sim::new();
        impair(&mut sim, seed, 0, 0, window);
        every_collective(&mut sim);
        assert!(sim.lost.is_empty());
        let resent: Vec<&Datagram> = sim.log.iter().filter(|d| d.resend).collect();
        assert!(
            resent.iter().all(|d| d.is_contribution()),
            "reorder window {window}: {:?}",
            resent.iter().find(|d| !d.is_contribution())
        );
    }
}

/// Every datagram delivered twice (data and ACKs): every collective is
/// exact, each participant counts exactly one duplicate per broadcast or
/// result datagram sent to it (the aggregator's contributions are
/// deduplicated by its slots, not counted there), and nothing is resent.
#[test]
fn every_collective_with_every_datagram_duplicated_is_exact_and_counts_each_duplicate() {
    let mut sim = Sim::new();
    sim.fate = Box::new(|_| 2);
    every_collective(&mut sim);
    assert_eq!(data_resent(&sim), 0);
    for i in participants() {
        let addr = sim.nodes[i].addr;
        let bcast_to_me = sim
            .log
            .iter()
            .filter(|d| d.to == addr && d.kind() == Some(MessageKind::Bcast))
            .count() as u64;
        assert!(bcast_to_me > 0);
        assert_eq!(
            sim.stats(i).duplicates_received,
            bcast_to_me,
            "participant {i}"
        );
    }
}

/// Loss 2 %, duplication 5 % and reordering over 32 steps, on data and
/// ACKs alike: every collective is exact and every lost data datagram was
/// resent to who lost it until a copy got through.
#[test]
fn every_collective_through_loss_duplication_and_reordering_is_exact_and_resends_what_was_lost() {
    let mut sim = Sim::new();
    impair(&mut sim, 5, 2, 5, 32);
    every_collective(&mut sim);
    let lost = assert_every_lost_datagram_was_resent_until_delivered(&sim);
    assert!(lost > 0, "the network lost data datagrams");
    assert!(data_resent(&sim) >= lost);
}

/// Per-packet ACKs, a window of 64, reordering over 64 steps.
fn packet_mode(me: Participant) -> CommConfig {
    builder(me)
        .ack_mode(AckMode::Packet)
        .window(64)
        .config()
        .clone()
}

/// Per-packet ACKs through 5 % loss and reordering: every ACK names one
/// datagram, every collective is exact and every lost data datagram was
/// resent to who lost it until a copy got through.
#[test]
fn packet_mode_through_loss_and_reordering_acks_each_datagram_alone_and_resends_what_was_lost() {
    let mut sim = Sim::with(packet_mode);
    impair(&mut sim, 6, 5, 0, 64);
    every_collective(&mut sim);
    let lost = assert_every_lost_datagram_was_resent_until_delivered(&sim);
    assert!(lost > 0, "the network lost data datagrams");
    let acks: Vec<AckMessage> = sim
        .log
        .iter()
        .filter(|d| d.kind() == Some(MessageKind::Ack))
        .map(|d| AckMessage::decode(&d.bytes).expect("an AGK1"))
        .collect();
    assert!(!acks.is_empty());
    for a in &acks {
        assert_eq!(a.bitmap.nbits(), 1, "{a:?}");
    }
}

/// Per-packet ACKs, groups of 64, a window of 8.
fn packet_mode_small_window(me: Participant) -> CommConfig {
    builder(me)
        .ack_mode(AckMode::Packet)
        .window(8)
        .group_size(64)
        .config()
        .clone()
}

/// With a window of 8 no sender ever has more than 8 datagrams
/// unacknowledged, whatever the length (up to 83 fragments here), and the
/// calls are exact without a resend.
#[test]
fn packet_mode_with_a_window_of_8_keeps_8_in_flight_and_is_exact() {
    let mut sim = Sim::with(packet_mode_small_window);
    for len in [1, 2000, 30_000] {
        for i in participants() {
            sim.start_reduce(i, true, len, CallOptions::default());
        }
        let mut most = 0;
        let limit = sim.now - sim.start + Duration::from_secs(10);
        sim.run_checking(limit, |sim| {
            for n in &sim.nodes {
                let e = &n.engine;
                most = most.max(e.agg_tx.in_flight()).max(e.bc_tx.in_flight());
            }
        });
        let want_most = if len == 30_000 {
            8
        } else {
            len.div_ceil(PER).min(8)
        };
        assert_eq!(most, want_most, "len {len}: the window was used and kept");
        let want = reference(Op::Sum, len);
        for i in participants() {
            match sim.ended(i) {
                Ended::Values(v) => assert_same(&format!("participant {i}"), v, &want),
                other => panic!("participant {i}: {other:?}"),
            }
        }
    }
    assert_eq!(data_resent(&sim), 0);
}

/// The socket aggregator with 8 slots.
fn eight_slots(me: Participant) -> CommConfig {
    builder(me).slots(8).config().clone()
}

/// 200 fragments through 8 aggregator slots (the configured window is
/// 256): a reduce worker keeps at most 8 contributions in flight and an
/// allreduce worker at most 4 fragments past the first result it lacks,
/// so the slots never run out: nothing is dropped unacknowledged, nothing
/// resent, and a window of 8 waits at most for the aggregator's delayed
/// group ACK and a round trip (30 ms for the 25 windows of the reduce).
/// (Without the bound each worker sent its whole window, the aggregator
/// dropped what it had no slot for, and the resends, dropped again, backed
/// off for seconds.)
#[test]
fn more_fragments_than_aggregator_slots_stay_within_the_slots_and_resend_nothing() {
    let len = 200 * PER;
    let mut sim = Sim::with(eight_slots);
    for all in [false, true] {
        let start = sim.now;
        let mut most = 0;
        for i in participants() {
            sim.start_reduce(i, all, len, CallOptions::default());
        }
        let limit = sim.now - sim.start + Duration::from_secs(10);
        sim.run_checking(limit, |sim| {
            for n in &sim.nodes[..WORKERS as usize] {
                most = most.max(n.engine.agg_tx.in_flight());
            }
        });
        let took = sim.ended_at(sim.aggregator()) - (start - sim.start);
        match sim.ended(sim.aggregator()) {
            Ended::Values(v) => assert_same("the aggregator", v, &reference(Op::Sum, len)),
            other => panic!("all {all}: {other:?}"),
        }
        let bound = if all { 4 } else { 8 };
        assert_eq!(most, bound, "all {all}: contributions in flight");
        assert_eq!(data_resent(&sim), 0, "all {all}");
        // At worst each window of 8 waits for its group ACK (the ACK delay)
        // and a round trip.
        let ack_delay = sim.nodes[0].engine.cfg.reliability.ack_delay;
        let windows = 200 / 8;
        assert!(
            took <= windows * (ack_delay + 2 * LATENCY),
            "all {all}: took {took:?}"
        );
    }
}

/// Lengths around a fragment (362 elements) and every int op: each
/// participant's allreduce result and the aggregator's reduce result equal
/// the reference reducer's.
#[test]
fn reductions_of_lengths_around_a_fragment_with_every_op_equal_the_reference() {
    let mut sim = Sim::new();
    for len in [1, PER - 1, PER, PER + 1, 2 * PER, 5000] {
        reduce_everywhere(&mut sim, true, Op::Sum, len);
        reduce_everywhere(&mut sim, false, Op::Sum, len);
    }
    for op in [Op::Max, Op::Min, Op::Count, Op::Bxor, Op::Band, Op::Bor, Op::Land, Op::Lor] {
        reduce_everywhere(&mut sim, true, op, 1000);
    }
    assert_eq!(data_resent(&sim), 0);
}

/// The kernel backend, 8 slots: a reduce worker keeps at most 8
/// contributions in flight.
fn kernel_eight_slots(me: Participant) -> CommConfig {
    builder(me)
        .slots(8)
        .backend(crate::runtime::backend::BackendKind::Kernel)
        .result_port(super::RESULT_PORT)
        .kernel_result_group(true)
        .config()
        .clone()
}

/// The kernel drops a retransmission of a completed fragment without a
/// word, so a reduce worker learns that its contribution arrived only from
/// the aggregator runtime's ACK and the TC copy of the RESULT. A reduce of
/// 20 fragments through 8 slots where, for the first 50 ms, worker 1 gets
/// neither for fragment 0 (every ACK covering its seq and the fragment's
/// RESULT copy are lost): its window of 8 holds that contribution, so it
/// cannot send fragments 8 onwards and the round waits on it. The
/// aggregator runtime repeats the round's ACKs 10 ms after its last RESULT,
/// then 20 and 40 ms later: the first two are lost too, the third releases
/// the worker and the round completes, exact. (Without the repeats it ran
/// into its deadline, as a live run at 5 % loss did.)
#[test]
fn a_reduce_worker_whose_ack_and_result_copy_are_lost_is_released_by_the_repeated_acks() {
    use std::cell::Cell;
    use std::rc::Rc;
    let len = 20 * PER;
    let mut sim = Sim::with(kernel_eight_slots);
    sim.node = Some(super::FakeNode::default());
    let start = sim.now;
    let lost_until = start + Duration::from_millis(50);
    let victim = super::worker_addr(1);
    let seq0 = sim.nodes[1].engine.agg_seq;
    let (acks_lost, copies_lost) = (Rc::new(Cell::new(0)), Rc::new(Cell::new(0)));
    let (a, c) = (acks_lost.clone(), copies_lost.clone());
    sim.fate = Box::new(move |d: &Datagram| {
        if d.to != victim || d.at >= lost_until {
            return 1;
        }
        match d.kind() {
            Some(MessageKind::Ack) => {
                let ack = AckMessage::decode(&d.bytes).expect("an AGK1");
                if ack.bitmap.get(seq0) {
                    a.set(a.get() + 1);
                    return 0;
                }
            }
            Some(MessageKind::Agg) => {
                let (h, _) = crate::wire::proto::split_agg(&d.bytes).expect("an AGG1");
                if h.is_result() && h.frag_off == 0 {
                    c.set(c.get() + 1);
                    return 0;
                }
            }
            _ => {}
        }
        1
    });
    for i in participants() {
        sim.start_reduce(i, false, len, CallOptions::default());
    }
    sim.run(Duration::from_secs(10));
    match sim.ended(sim.aggregator()) {
        Ended::Values(v) => assert_same("the aggregator", v, &reference(Op::Sum, len)),
        other => panic!("the aggregator: {other:?}"),
    }
    for w in 0..WORKERS as usize {
        assert!(matches!(sim.ended(w), Ended::Contributed), "worker {w}: {:?}", sim.ended(w));
    }
    assert_eq!(copies_lost.get(), 1, "fragment 0's RESULT copy to worker 1 was lost");
    // The first ACK and the repeats 10 and 30 ms after the last RESULT.
    assert_eq!(acks_lost.get(), 3, "ACKs of worker 1's fragment 0 lost");
    let released = sim
        .log
        .iter()
        .find(|d| {
            d.to == victim
                && d.at >= lost_until
                && d.kind() == Some(MessageKind::Ack)
                && AckMessage::decode(&d.bytes).is_ok_and(|a| a.bitmap.get(seq0))
        })
        .expect("an ACK of fragment 0 reached worker 1 after the loss");
    assert!(
        released.at - start < Duration::from_millis(100),
        "released {:?} after the start",
        released.at - start
    );
    assert!(sim.ended_at(1) < Duration::from_millis(150), "worker 1 ended at {:?}", sim.ended_at(1));
}
