//! Memory bounds of the user-space path, driven through its slot table
//! (`aggbox::kernel::afxdp::UserspaceAggregator`) with no socket and no root: with jumbo
//! frames one slot holds up to 16,370 elements (~128 KiB), so the slot
//! count alone lets a job reach ~2 GiB. The byte bounds (`[[job]]` and
//! `[node]` `userspace_slot_bytes`) refuse a new slot that would pass them,
//! count each refusal under its own reason, and leave the slots already
//! held to complete exactly.
//!
//! `cargo test --test userspace_memory`.

use std::net::Ipv4Addr;
use std::time::Instant;

use aggbox::wire::abi::{self, DropReason, Op};
use aggbox::config::Config;
use aggbox::wire::proto::{self, AggHeader, AggMessage, AggPayload};
use aggbox::kernel::afxdp::{slot_bytes, Refusal, UserspaceAggregator, UserspaceOptions, DROP_SLOT_BYTES_JOB, DROP_SLOT_BYTES_NODE};

/// The most elements one IPv4 datagram carries: (65535 − 20 − 8 − 24) / 4.
const JUMBO: usize = 16370;
const MIB: usize = 1 << 20;

fn rank_addr(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 0, 11 + rank as u8)
}

fn config(text: &str) -> Config {
    Config::parse(text, "test.toml").unwrap_or_else(|e| panic!("{e}"))
}

/// Two jobs of two ranks each, with the given `[node]` and per-job extras.
fn two_jobs(node: &str, job_a: &str, job_b: &str) -> Config {
    config(&format!(
        "[node]\n{node}\n\n\
         [[job]]\nid = 1\nport = 7000\nworkers = [\"10.77.0.11\", \"10.77.0.12\"]\nresult_port = 7001\n{job_a}\n\n\
         [[job]]\nid = 2\nport = 7100\nworkers = [\"10.77.0.11\", \"10.77.0.12\"]\nresult_port = 7101\n{job_b}\n"
    ))
}

/// Rank `rank`'s values for fragment `frag` of `round`: distinct per rank,
/// fragment and element, so a RESULT from the wrong slot or a lost element
/// shows.
fn values(rank: u16, round: u32, frag: u32, n: usize) -> Vec<i32> {
    (0..n)
        .map(|i| (i as i32 % 1000) * 3 + frag as i32 * 7 + round as i32 * 11 + i32::from(rank) * 100_000)
        .collect()
}

fn datagram(job: u16, rank: u16, round: u32, frag: u32, n: usize) -> Vec<u8> {
    let hdr = AggHeader {
        job,
        rank,
        seq: frag,
        round: aggbox::wire::abi::Round(round),
        frag_off: frag * n as u32,
        op: Op::Sum,
        flags: 0,
        count: n as u16,
    };
    let mut out = Vec::new();
    proto::encode_agg_into(&hdr, &values(rank, round, frag, n), &mut out).expect("encode");
    out
}

fn contribute(t: &mut UserspaceAggregator, job: u16, rank: u16, round: u32, frag: u32, n: usize) -> Result<Option<aggbox::kernel::afxdp::Completion>, Refusal> {
    t.contribute(rank_addr(rank), &datagram(job, rank, round, frag, n), Instant::now())
}

/// The RESULT of a completed SUM slot equals the element-wise sum of both
/// ranks' values, with the slot's key.
fn check_result(done: &aggbox::kernel::afxdp::Completion, job: u16, round: u32, frag: u32, n: usize) {
    let msg = AggMessage::decode(&done.result).expect("RESULT decodes");
    assert_eq!((msg.job, msg.rank, msg.round.0, msg.frag_off), (job, abi::RESULT_RANK, round, frag * n as u32));
    assert!(msg.flags & abi::AGG_F_RESULT != 0);
    let want: Vec<i32> = values(0, round, frag, n)
        .iter()
        .zip(values(1, round, frag, n))
        .map(|(a, b)| a + b)
        .collect();
    assert_eq!(msg.payload, AggPayload::Int(want), "job {job} round {round} fragment {frag}");
}

/// A job flooding new jumbo fragments from one rank (fragments that never
/// complete on their own) is stopped by its own byte bound: the job's bytes
/// never pass it, each refused fragment is counted `slot_bytes_job` (and
/// not `slot_pool_full`: its slot count is far below `userspace_slots`),
/// another job still opens slots, every slot held completes exactly once
/// the other rank arrives, and the freed bytes let a refused fragment in.
#[test]
fn job_byte_bound_refuses_new_jumbo_slots_and_held_slots_complete_exactly() {
    let cfg = two_jobs("", "userspace_slot_bytes = 1048576", "");
    let mut t = UserspaceAggregator::new(&cfg, &UserspaceOptions::default());
    let per_slot = slot_bytes(Op::Sum, false, JUMBO, 2);
    assert!(per_slot >= JUMBO * 8, "a slot is charged at least its accumulator: {per_slot}");
    let fit = MIB / per_slot;
    assert!((1..16384).contains(&fit), "1 MiB holds {fit} jumbo slots");

    const FLOOD: u32 = 200;
    let mut accepted = Vec::new();
    for frag in 0..FLOOD {
        let before = t.stats().refused(Refusal::JobSlotBytes);
        match contribute(&mut t, 1, 0, 1, frag, JUMBO) {
            Ok(None) => accepted.push(frag),
            Err(Refusal::JobSlotBytes) => {
                assert_eq!(t.stats().refused(Refusal::JobSlotBytes), before + 1, "each refusal is counted");
            }
            other => panic!("fragment {frag}: {other:?}"),
        }
        assert!(t.job_bytes_in_use(1) <= MIB, "job bytes {} past its bound after fragment {frag}", t.job_bytes_in_use(1));
        // The accounting is not a formality: what is held is charged.
        assert!(t.job_bytes_in_use(1) >= t.slots_in_use() * JUMBO * 8);
    }
    assert_eq!(accepted, (0..fit as u32).collect::<Vec<_>>(), "the first {fit} fragments fit");
    let st = t.stats();
    assert_eq!(st.refused(Refusal::JobSlotBytes), u64::from(FLOOD) - fit as u64);
    assert_eq!(st.drops.get(DROP_SLOT_BYTES_JOB).copied(), Some(u64::from(FLOOD) - fit as u64));
    assert_eq!(st.drop(DropReason::SlotPoolFull), 0, "the slot count bound is not what stopped it");
    assert_eq!(st.refused(Refusal::NodeSlotBytes), 0);
    assert_eq!(st.slot_bytes_by_job.get(&1), Some(&(fit * per_slot, MIB)));
    assert_eq!(st.slot_bytes, fit * per_slot);
    assert_eq!(st.slot_bytes_limit, aggbox::config::DEFAULT_USERSPACE_SLOT_BYTES_NODE as usize);

    // The other job, on its default bound, is not starved by job 1.
    for frag in 0..4 {
        assert_eq!(contribute(&mut t, 2, 0, 1, frag, JUMBO), Ok(None));
        let done = contribute(&mut t, 2, 1, 1, frag, JUMBO).expect("job 2").expect("completes");
        check_result(&done, 2, 1, frag, JUMBO);
    }

    // Every slot job 1 holds completes, exactly, once rank 1 arrives.
    for &frag in &accepted {
        let done = contribute(&mut t, 1, 1, 1, frag, JUMBO).expect("held slot").expect("completes");
        check_result(&done, 1, 1, frag, JUMBO);
        assert_eq!(contribute(&mut t, 1, 1, 1, frag, JUMBO), Err(Refusal::Drop(DropReason::Retransmission)));
    }
    assert_eq!(t.job_bytes_in_use(1), 0, "completed slots give their bytes back");
    assert_eq!(t.bytes_in_use(), 0);
    assert_eq!(t.slots_in_use(), 0);
    assert_eq!(t.stats().latency.count, (accepted.len() + 4) as u64);

    // A refused fragment's retransmission gets in now, and completes.
    let frag = FLOOD - 1;
    assert_eq!(contribute(&mut t, 1, 0, 1, frag, JUMBO), Ok(None));
    let done = contribute(&mut t, 1, 1, 1, frag, JUMBO).expect("retried").expect("completes");
    check_result(&done, 1, 1, frag, JUMBO);
}

/// The node's bound spans jobs: two jobs each allowed 2 MiB under a node
/// bound of 2 MiB. Once job 1 holds what fits, job 2's first new slot is
/// refused `slot_bytes_node`; the node's bytes never pass 2 MiB; job 1's
/// completions make room for job 2.
#[test]
fn node_byte_bound_spans_jobs() {
    let cfg = two_jobs("userspace_slot_bytes = 2097152", "userspace_slot_bytes = 2097152", "userspace_slot_bytes = 2097152");
    let mut t = UserspaceAggregator::new(&cfg, &UserspaceOptions::default());
    let per_slot = slot_bytes(Op::Sum, false, JUMBO, 2);
    let fit = 2 * MIB / per_slot;

    let mut held = Vec::new();
    for frag in 0..100u32 {
        match contribute(&mut t, 1, 0, 1, frag, JUMBO) {
            Ok(None) => held.push(frag),
            Err(Refusal::JobSlotBytes) => {}
            other => panic!("fragment {frag}: {other:?}"),
        }
        assert!(t.bytes_in_use() <= 2 * MIB);
    }
    assert_eq!(held.len(), fit);
    for frag in 0..50u32 {
        assert_eq!(contribute(&mut t, 2, 0, 1, frag, JUMBO), Err(Refusal::NodeSlotBytes), "fragment {frag}");
        assert!(t.bytes_in_use() <= 2 * MIB);
    }
    let st = t.stats();
    assert_eq!(st.refused(Refusal::NodeSlotBytes), 50);
    assert_eq!(st.drops.get(DROP_SLOT_BYTES_NODE).copied(), Some(50));
    assert_eq!(st.refused(Refusal::JobSlotBytes), 100 - fit as u64);
    assert_eq!(st.slot_bytes_by_job.get(&2), Some(&(0, 2 * MIB)));
    assert_eq!(st.slot_bytes_limit, 2 * MIB);

    // Smaller slots still fit in what is left, if anything is.
    let small = slot_bytes(Op::Sum, false, 362, 2);
    let left = 2 * MIB - t.bytes_in_use();
    let r = contribute(&mut t, 2, 0, 1, 1000, 362);
    assert_eq!(r.is_ok(), small <= left, "{r:?} with {left} B left for a {small} B slot");

    // Job 1 completes two fragments: job 2 gets a jumbo slot and completes it.
    for &frag in &held[..2] {
        let done = contribute(&mut t, 1, 1, 1, frag, JUMBO).expect("held").expect("completes");
        check_result(&done, 1, 1, frag, JUMBO);
    }
    assert_eq!(contribute(&mut t, 2, 0, 1, 0, JUMBO), Ok(None));
    let done = contribute(&mut t, 2, 1, 1, 0, JUMBO).expect("job 2").expect("completes");
    check_result(&done, 2, 1, 0, JUMBO);
    for &frag in &held[2..] {
        let done = contribute(&mut t, 1, 1, 1, frag, JUMBO).expect("held").expect("completes");
        check_result(&done, 1, 1, frag, JUMBO);
    }
    assert!(t.bytes_in_use() <= 2 * MIB);
}

/// With the defaults, MTU-1500 fragments (362 elements) are bounded by the
/// slot count, as before the byte bounds: 16,384 slots fit in 64 MiB, the
/// next is `slot_pool_full`, and no byte refusal happens.
#[test]
fn defaults_keep_the_slot_count_bound_at_mtu_1500() {
    let cfg = two_jobs("", "", "");
    let mut t = UserspaceAggregator::new(&cfg, &UserspaceOptions::default());
    let slots = aggbox::config::DEFAULT_USERSPACE_SLOTS;
    assert!(slots as usize * slot_bytes(Op::Sum, false, 362, 2) <= aggbox::config::DEFAULT_USERSPACE_SLOT_BYTES_JOB as usize);
    for frag in 0..slots {
        assert_eq!(contribute(&mut t, 1, 0, 1, frag, 362), Ok(None), "fragment {frag}");
    }
    assert_eq!(contribute(&mut t, 1, 0, 1, slots, 362), Err(Refusal::Drop(DropReason::SlotPoolFull)));
    let st = t.stats();
    assert_eq!(st.refused(Refusal::JobSlotBytes) + st.refused(Refusal::NodeSlotBytes), 0);
    assert_eq!(st.slots_by_job.get(&1), Some(&(slots as usize, slots as usize)));
    // With jumbo fragments the same job stops at 64 MiB, not at ~2 GiB.
    let mut t = UserspaceAggregator::new(&cfg, &UserspaceOptions::default());
    let mut n = 0;
    while contribute(&mut t, 2, 0, 1, n, JUMBO).is_ok() {
        n += 1;
    }
    assert_eq!(n as usize, 64 * MIB / slot_bytes(Op::Sum, false, JUMBO, 2));
    assert!(t.bytes_in_use() <= 64 * MIB);
    assert_eq!(t.stats().refused(Refusal::JobSlotBytes), 1);
}

/// Stale slots give their bytes back when collected.
#[test]
fn collected_stale_slots_give_their_bytes_back() {
    let cfg = two_jobs("", "userspace_slot_bytes = 1048576\nwindow = 1", "");
    let mut t = UserspaceAggregator::new(&cfg, &UserspaceOptions::default());
    let mut held = 0;
    while contribute(&mut t, 1, 0, 1, held, JUMBO).is_ok() {
        held += 1;
    }
    assert!(held > 0);
    assert_eq!(contribute(&mut t, 1, 0, 3, 0, JUMBO), Err(Refusal::JobSlotBytes));
    // Round 3 cannot start while round 1 holds the bytes; a small round-3
    // fragment completes, which makes round 1 stale (window 1).
    assert_eq!(contribute(&mut t, 1, 0, 3, 0, 8), Ok(None));
    assert!(contribute(&mut t, 1, 1, 3, 0, 8).expect("round 3").is_some());
    // userspace_only is false and op SUM: the kernel recorded these slots.
    let records = t.collect_stale();
    assert_eq!(records.len(), held as usize);
    assert_eq!(t.job_bytes_in_use(1), 0);
    assert_eq!(t.stats().stale_slots_collected, u64::from(held));
    assert_eq!(contribute(&mut t, 1, 0, 4, 0, JUMBO), Ok(None));
}

/// A reload (`UserspaceAggregator::reconfigure`): the changed and removed
/// jobs lose their slots and give their bytes back; an unchanged job keeps
/// its half-aggregated slot, which completes exactly; a removed job's
/// datagrams are refused as `unknown_job` from then on.
#[test]
fn reconfigure_resets_only_the_changed_and_removed_jobs() {
    let cfg = two_jobs("", "", "");
    let mut t = UserspaceAggregator::new(&cfg, &UserspaceOptions::default());
    assert_eq!(contribute(&mut t, 1, 0, 1, 0, 362), Ok(None));
    assert_eq!(contribute(&mut t, 2, 0, 1, 0, 362), Ok(None));
    assert_eq!(t.slots_in_use(), 2);
    let held = t.bytes_in_use();

    // Job 2 removed (a config with job 1 only), job 1 unchanged.
    let only_one = config(
        "[[job]]\nid = 1\nport = 7000\nworkers = [\"10.77.0.11\", \"10.77.0.12\"]\nresult_port = 7001\n",
    );
    // A SUM slot in user space is one the kernel handed over (it recorded
    // the owner in `slot_owner`): the caller deletes that record.
    let records = t.reconfigure(&only_one, &[2]);
    assert_eq!(records, vec![abi::SlotKey { job: 2, pad: 0, round: 1, frag_off: 0 }]);
    assert_eq!(t.slots_in_use(), 1, "job 2's slot is gone");
    assert_eq!(t.job_bytes_in_use(2), 0);
    assert_eq!(t.bytes_in_use(), held - slot_bytes(Op::Sum, false, 362, 2));
    let done = contribute(&mut t, 1, 1, 1, 0, 362).expect("accepted").expect("completes");
    check_result(&done, 1, 1, 0, 362);
    assert_eq!(contribute(&mut t, 2, 1, 1, 0, 362), Err(Refusal::Drop(DropReason::UnknownJob)));

    // Job 1 changed (reset): its open slot goes too.
    assert_eq!(contribute(&mut t, 1, 0, 2, 0, 362), Ok(None));
    t.reconfigure(&only_one, &[1]);
    assert_eq!(t.slots_in_use(), 0);
    assert_eq!(t.bytes_in_use(), 0);
}
