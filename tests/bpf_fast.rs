//! Fast slots (docs/DATAPLANE.md, "Fast slots"): the array-indexed slots the
//! entry program aggregates in, and their handshake with the hash-map chain.
//!
//! - a fragment whose fast slot is free is served there (no hash-map slot,
//!   no slot_owner record), exactly;
//! - a job's full fragments take consecutive fast slots (the granule is the
//!   job's fragment size), kept across a reconfiguration; fragments smaller
//!   than the granule share a slot and stay exact on the chain;
//! - a fragment whose fast slot is busy with another live fragment takes the
//!   hash-map chain, exactly, and a later take-over of that fast slot for it
//!   gives up (the chain keeps serving it: one fragment, one path, one RESULT);
//! - after a spill to the chain every take of the job looks for that
//!   chain's records first, and the `checked` counter shows it;
//! - late retransmissions of a completed fragment are recognised after its
//!   slot moved on to the next fragment, and after that one too; for a job
//!   with a vector length, by the slots alone over the whole window, and the
//!   history ring holds exactly its length;
//! - every kernel op, weighted, odd and even counts, clamped values: the
//!   RESULT equals the reference reducer's;
//! - a contribution that does not fit a fast slot (count > 384) to a fragment
//!   a fast slot holds is answered as that slot answers (slot_mismatch);
//! - an unfinished fast slot of a stale round is released by the periodic
//!   reclaim, and its share of the job's slot bound comes back;
//! - a fast slot whose lock stays held past the kernel's bounded wait drops
//!   the contribution as slot_busy and changes nothing (on both paths, and
//!   the control plane's discard reports it); once free, the fragment
//!   completes exactly, and no path leaves the lock held.
//!
//! Needs root (BPF): `sudo -E cargo test --test bpf_fast`.

mod bpf_common;

use std::net::Ipv4Addr;

use aggbox::wire::abi::{self, DropReason, Op, Outcome, SlotKey};
use aggbox::kernel::xdp::{XdpPlane, XdpJob};
use aggbox::wire::reducer;
use bpf_common::run_one as run;
use bpf_common::*;

const ID: u16 = 12;

fn addr(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 0, 11 + rank as u8)
}

fn job(workers: u16, slots: u32, window: u32) -> XdpJob {
    job_in(Family::V4, workers, slots, window)
}

fn job_in(fam: Family, workers: u16, slots: u32, window: u32) -> XdpJob {
    XdpJob {
        id: ID,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: (0..workers).map(|r| fam.addr(addr(r))).collect(),
        weights: vec![],
        vector_len: 0,
        slots,
        flags: 0,
        result_group: None,
        window,
        frag_elems: 0,
    }
}

fn contribution(rank: u16, round: u32, frag_off: u32, values: &[i32]) -> Vec<u8> {
    contribution_in(Family::V4, rank, round, frag_off, values)
}

fn contribution_in(fam: Family, rank: u16, round: u32, frag_off: u32, values: &[i32]) -> Vec<u8> {
    let mut a = Agg::new(ID, rank, Op::Sum as u8, values.to_vec());
    a.round = round;
    a.frag_off = frag_off;
    a.seq = round.wrapping_mul(1000).wrapping_add(frag_off);
    Frame::udp(fam.addr(addr(rank)), a.bytes()).build()
}

fn sum_be(parts: &[&[i32]]) -> Vec<u8> {
    let c: Vec<(&[i32], i32)> = parts.iter().map(|v| (*v, 1)).collect();
    let mut out = Vec::new();
    reducer::reduce(Op::Sum, &c).expect("reduce").write_be(&mut out);
    out
}

fn fast(dp: &XdpPlane, what: u32) -> u64 {
    dp.fast_stats().expect("fast_stats")[what as usize]
}

fn key(round: u32, frag_off: u32) -> SlotKey {
    SlotKey {
        job: ID,
        pad: 0,
        round,
        frag_off,
    }
}

fn active(dp: &XdpPlane) -> u32 {
    dp.job_state(ID).expect("job_state").expect("state").active_slots
}

#[test]
fn free_fast_slots_serve_fragments_without_hash_map_state() {
    free_fast_slots_serve_fragments_without_hash_map_state_in(Family::V4);
}

#[test]
fn free_fast_slots_serve_fragments_without_hash_map_state_over_ipv6() {
    free_fast_slots_serve_fragments_without_hash_map_state_in(Family::V6);
}

fn free_fast_slots_serve_fragments_without_hash_map_state_in(fam: Family) {
    let dp = load();
    dp.set_job(ID, &job_in(fam, 3, 64, 4)).expect("set_job");
    let job = dp.job(ID).unwrap().unwrap();
    assert!(job.fast_slots >= 64, "a region for the bound: {job:?}");
    let maps = dp.kernel_maps().unwrap();
    let vals: Vec<Vec<i32>> = (0..3).map(|r| (0..362).map(|i| i * 3 - 500 + r * 7).collect()).collect();
    // Two rounds of 4 full-MTU fragments: the second round takes the slots
    // the first one left DONE.
    for round in 1..=2u32 {
        for f in 0..4u32 {
            for rank in 0..3u16 {
                let (l, out) = run(&dp, &contribution_in(fam, rank, round, f * 362, &vals[rank as usize]));
                if rank < 2 {
                    assert_eq!(l, Outcome::Accepted.label());
                    assert_eq!(maps.slot_owner(&key(round, f * 362)), None, "no ownership record on the fast path");
                } else {
                    assert_eq!(l, Outcome::Result.label(), "round {round} fragment {f}");
                    assert_eq!(&out[fam.payload_off() + 24..], &sum_be(&[&vals[0], &vals[1], &vals[2]])[..]);
                    assert!(fam == Family::V4 || udp6_checksum_ok(&out), "round {round} fragment {f}: UDP checksum");
                }
            }
        }
    }
    assert_eq!(fast(&dp, abi::FAST_TAKEN), 8, "every fragment took its fast slot");
    assert_eq!(fast(&dp, abi::FAST_JOINED), 24, "every contribution was added there");
    assert_eq!(fast(&dp, abi::FAST_BUSY), 0);
    assert_eq!((dp.slots_in_use(), active(&dp), dp.blocks_in_use().unwrap()), (0, 0, 0));
    let st = dp.job_state(ID).unwrap().unwrap();
    assert_eq!((st.completed, st.result_seq, st.newest_round), (1, 0, 2));
    assert_eq!(dp.job_stats(ID).unwrap().unwrap().results, 8);
}

#[test]
fn a_busy_fast_slot_sends_its_fragment_to_the_chain_and_a_later_take_over_gives_up() {
    let dp = load();
    dp.set_job(ID, &job(2, 64, 4)).expect("set_job");
    let maps = dp.kernel_maps().unwrap();
    // Fragments at 0 and 8 (8 elements each) share a fast slot: 256
    // elements of a round share an index.
    let a = [1, 2, 3, 4, 5, 6, 7, 8];
    let b = [10, 20, 30, 40, 50, 60, 70, 80];
    assert_eq!(run(&dp, &contribution(0, 1, 0, &a)).0, Outcome::Accepted.label());
    assert_eq!(run(&dp, &contribution(0, 1, 8, &b)).0, Outcome::Accepted.label());
    assert_eq!(fast(&dp, abi::FAST_BUSY), 1, "fragment 8 found its slot busy");
    assert_eq!(maps.slot_owner(&key(1, 8)), Some(abi::OWNER_KERNEL), "fragment 8 lives in the hash-map slots");
    assert_eq!(maps.slot_owner(&key(1, 0)), None, "fragment 0 in the fast slot");
    assert_eq!((dp.slots_in_use(), active(&dp)), (2, 2));
    // Fragment 0 completes: its fast slot is DONE, free for a newer fragment.
    let (l, out) = run(&dp, &contribution(1, 1, 0, &b));
    assert_eq!(l, Outcome::Result.label());
    assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&a, &b])[..]);
    // Fragment 8's other rank: the fast slot looks takeable, but fragment 8
    // has a hash-map slot; the take-over gives up and the chain completes it.
    let (l, out) = run(&dp, &contribution(1, 1, 8, &a));
    assert_eq!(l, Outcome::Result.label());
    assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&b, &a])[..]);
    assert_eq!(fast(&dp, abi::FAST_ABORTED), 1, "the take-over found the ownership record");
    assert_eq!(fast(&dp, abi::FAST_TAKEN), 1, "only fragment 0 ever took the fast slot");
    // Both fragments are complete exactly once, on one path each.
    for (f, rank) in [(0u32, 0u16), (8, 1)] {
        assert_eq!(run(&dp, &contribution(rank, 1, f, &a)).0, DropReason::Retransmission.label(), "fragment {f}");
    }
    assert_eq!((dp.slots_in_use(), dp.slot_owners_in_use(), active(&dp)), (0, 0, 0));
    assert_eq!(dp.job_stats(ID).unwrap().unwrap().results, 2);
}

/// A job whose senders cut 362-element fragments (MTU 1500) indexes its
/// fast slots in steps of 362: the fragments of a round, and the rounds
/// after each other, fill consecutive slots (with the default granule of
/// 256 they would land 1.41 slots apart, touching ~1.6x the pages).
#[test]
fn full_fragments_take_consecutive_fast_slots() {
    const FRAGS: u32 = 4;
    let dp = load();
    let cfg = XdpJob { vector_len: FRAGS * 362, frag_elems: 362, ..job(2, 64, 4) };
    dp.set_job(ID, &cfg).expect("set_job");
    let j = dp.job(ID).unwrap().unwrap();
    assert_eq!((j.fast_granule, j.fast_stride), (362, FRAGS), "{j:?}");
    let maps = dp.kernel_maps().unwrap();
    let vals: Vec<Vec<i32>> = (0..2).map(|r| (0..362).map(|i| i * 5 - 900 + r).collect()).collect();
    for round in 0..3u32 {
        for f in 0..FRAGS {
            assert_eq!(run(&dp, &contribution(0, round, f * 362, &vals[0])).0, Outcome::Accepted.label());
            let (l, out) = run(&dp, &contribution(1, round, f * 362, &vals[1]));
            assert_eq!(l, Outcome::Result.label(), "round {round} fragment {f}");
            assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&vals[0], &vals[1]])[..]);
            let index = u32::from(j.fast_base) + (round * FRAGS + f) % u32::from(j.fast_slots);
            assert_eq!(maps.fast_slot_fragment(index), Some((ID, round, f * 362)), "round {round} fragment {f}");
        }
    }
    assert_eq!(fast(&dp, abi::FAST_TAKEN), 3 * u64::from(FRAGS), "every fragment took its own slot");
    assert_eq!(fast(&dp, abi::FAST_BUSY), 0);
    // Reconfigured, the job keeps its index function: fragments in flight
    // keep their slots.
    dp.set_job(ID, &XdpJob { frag_elems: 100, ..cfg.clone() }).expect("set_job");
    let again = dp.job(ID).unwrap().unwrap();
    assert_eq!((again.fast_base, again.fast_granule, again.fast_stride), (j.fast_base, 362, FRAGS));
    // A fragment size a fast slot cannot hold leaves the default granule.
    dp.set_job(ID + 1, &XdpJob { id: ID + 1, vector_len: 1 << 20, frag_elems: 2237, ..cfg.clone() }).expect("set_job");
    let jumbo = dp.job(ID + 1).unwrap().unwrap();
    assert_eq!((jumbo.fast_granule, jumbo.fast_stride), (abi::FAST_GRANULE as u16, (1 << 20) / abi::FAST_GRANULE));
}

/// Fragments smaller than the job's granule share a fast slot; the second
/// takes the hash-map chain and both complete exactly, once.
#[test]
fn fragments_smaller_than_the_granule_share_a_fast_slot_and_stay_exact() {
    let dp = load();
    dp.set_job(ID, &XdpJob { frag_elems: 16, ..job(2, 64, 4) }).expect("set_job");
    let a = [1, 2, 3, 4, 5, 6, 7, 8];
    let b = [10, 20, 30, 40, 50, 60, 70, 80];
    for f in [0u32, 8, 16] {
        assert_eq!(run(&dp, &contribution(0, 1, f, &a)).0, Outcome::Accepted.label(), "fragment {f}");
    }
    assert_eq!(fast(&dp, abi::FAST_BUSY), 1, "fragment 8 shares fragment 0's slot; 16 has its own");
    assert_eq!(fast(&dp, abi::FAST_TAKEN), 2);
    for f in [0u32, 8, 16] {
        let (l, out) = run(&dp, &contribution(1, 1, f, &b));
        assert_eq!(l, Outcome::Result.label(), "fragment {f}");
        assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&a, &b])[..]);
        assert_eq!(run(&dp, &contribution(0, 1, f, &a)).0, DropReason::Retransmission.label(), "fragment {f}");
    }
    assert_eq!((dp.slots_in_use(), dp.slot_owners_in_use(), active(&dp)), (0, 0, 0));
    assert_eq!(dp.job_stats(ID).unwrap().unwrap().results, 3);
}

#[test]
fn after_a_spill_to_the_chain_every_take_looks_for_its_records_and_counts_it() {
    let dp = load();
    dp.set_job(ID, &XdpJob { vector_len: 1024, ..job(2, 64, 4) }).expect("set_job");
    let maps = dp.kernel_maps().unwrap();
    let a = [1, 2, 3, 4, 5, 6, 7, 8];
    let b = [10, 20, 30, 40, 50, 60, 70, 80];
    // Round 1: fragment 8 shares fragment 0's fast slot while 0 is live,
    // so it spills to the hash-map chain. The takes before it had nothing
    // to look for.
    assert_eq!(run(&dp, &contribution(0, 1, 0, &a)).0, Outcome::Accepted.label());
    assert_eq!(fast(&dp, abi::FAST_CHECKED), 0, "no record can exist before a spill");
    assert_eq!(run(&dp, &contribution(0, 1, 8, &b)).0, Outcome::Accepted.label());
    assert_eq!(fast(&dp, abi::FAST_BUSY), 1, "fragment 8 spilled");
    assert_eq!(maps.slot_owner(&key(1, 8)), Some(abi::OWNER_KERNEL));
    assert_eq!(run(&dp, &contribution(1, 1, 0, &b)).0, Outcome::Result.label());
    // Every later take, in this round and the next, looks for a record or
    // marker of its fragment first (job_paths is per job: records and
    // markers outlive the rounds they belong to, and a round number from
    // the network gives no order to rely on), and says so in `checked`.
    assert_eq!(run(&dp, &contribution(0, 1, 512, &a)).0, Outcome::Accepted.label());
    assert_eq!(fast(&dp, abi::FAST_CHECKED), 1, "the take after the spill looked");
    assert_eq!(maps.slot_owner(&key(1, 512)), None, "fragment 512 in its fast slot");
    let (l, out) = run(&dp, &contribution(1, 1, 512, &b));
    assert_eq!(l, Outcome::Result.label());
    assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&a, &b])[..]);
    // Fragment 8's other rank: a take-over of the slot fragment 0 left DONE
    // looks, finds fragment 8's record and gives up; the chain completes it.
    let (l, out) = run(&dp, &contribution(1, 1, 8, &a));
    assert_eq!(l, Outcome::Result.label());
    assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&b, &a])[..]);
    assert_eq!((fast(&dp, abi::FAST_CHECKED), fast(&dp, abi::FAST_ABORTED)), (2, 1));
    for f in [0u32, 512] {
        assert_eq!(run(&dp, &contribution(0, 2, f, &a)).0, Outcome::Accepted.label(), "fragment {f}");
        let (l, out) = run(&dp, &contribution(1, 2, f, &b));
        assert_eq!(l, Outcome::Result.label(), "fragment {f}");
        assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&a, &b])[..]);
    }
    assert_eq!(fast(&dp, abi::FAST_CHECKED), 4, "round 2's takes looked too");
    assert_eq!(fast(&dp, abi::FAST_TAKEN), 4, "fragments 0 and 512 of both rounds");
    // A late retransmission of the spilled fragment is dropped, once.
    assert_eq!(run(&dp, &contribution(0, 1, 8, &b)).0, DropReason::Retransmission.label());
    assert_eq!((dp.slots_in_use(), dp.slot_owners_in_use(), active(&dp)), (0, 0, 0));
    assert_eq!(dp.job_stats(ID).unwrap().unwrap().results, 5);
}

#[test]
fn late_retransmissions_are_recognised_after_the_slot_moves_on() {
    let dp = load();
    dp.set_job(ID, &job(2, 64, 64)).expect("set_job");
    let v = [3; 16];
    for round in 1..=3u32 {
        assert_eq!(run(&dp, &contribution(0, round, 0, &v)).0, Outcome::Accepted.label());
        assert_eq!(run(&dp, &contribution(1, round, 0, &v)).0, Outcome::Result.label());
        // Every earlier round of this fragment (in its slot, in the slot's
        // `prev`, or in the completed markers) is a retransmission, from
        // either rank.
        for old in 1..=round {
            for rank in 0..2 {
                assert_eq!(
                    run(&dp, &contribution(rank, old, 0, &v)).0,
                    DropReason::Retransmission.label(),
                    "round {old} after round {round} completed"
                );
            }
        }
    }
    assert_eq!(dp.job_stats(ID).unwrap().unwrap().results, 3);
    assert_eq!((dp.slots_in_use(), active(&dp)), (0, 0));
}

/// Job ID (2 ranks, one 16-element fragment a round, window 64, its fast
/// region already assigned) completes rounds 1..=last on the fast path, then
/// every contribution of every one of those rounds again: each is a
/// retransmission inside the window (newest - 64 ..= newest) and stale
/// before it; none is added again and no `completed` marker is written.
fn assert_the_window_is_remembered(dp: &XdpPlane, last: u32) {
    let maps = dp.kernel_maps().unwrap();
    let v = [5; 16];
    for round in 1..=last {
        assert_eq!(run(dp, &contribution(0, round, 0, &v)).0, Outcome::Accepted.label(), "round {round}");
        assert_eq!(run(dp, &contribution(1, round, 0, &v)).0, Outcome::Result.label(), "round {round}");
    }
    let (mut retransmissions, mut stale) = (0, 0);
    for old in 1..=last {
        for rank in 0..2 {
            let l = run(dp, &contribution(rank, old, 0, &v)).0;
            if l == DropReason::Retransmission.label() {
                retransmissions += 1;
            } else {
                assert_eq!(l, DropReason::StaleRound.label(), "round {old} after round {last}");
                assert!(last - old > 64, "round {old} is inside the window: remembered");
                stale += 1;
            }
        }
        assert!(!maps.is_completed(&key(old, 0)), "round {old}: no completed marker");
    }
    assert_eq!(retransmissions, 2 * 65, "the window's rounds (newest - 64 ..= newest)");
    assert_eq!(stale, 2 * (last - 65));
    assert_eq!(dp.job_stats(ID).unwrap().unwrap().results, u64::from(last));
    assert_eq!(fast(dp, abi::FAST_TAKEN), u64::from(last), "every round on the fast path");
    assert_eq!(fast(dp, abi::FAST_BUSY), 0, "no fragment sent to the chain");
}

/// A job with a vector length: a fragment's slot index follows its round, so
/// the slot (its key, `prev` and the history ring) remembers the last
/// (2 + AGGBOX_FAST_HISTORY) x region fragments of that index; with the
/// window inside that, every late retransmission is a retransmission or
/// stale, none is added again, and no `completed` marker is written.
#[test]
fn a_job_with_a_vector_length_remembers_its_window_in_the_slots() {
    const HISTORY: u32 = 16; // AGGBOX_FAST_HISTORY (src/bpf/slot.h)
    let dp = load();
    let mut cfg = job(2, 4, 64);
    cfg.vector_len = 16; // one fragment per round: stride 1
    dp.set_job(ID, &cfg).expect("set_job");
    let region = u32::from(dp.job(ID).unwrap().unwrap().fast_slots);
    assert_eq!(region, 4, "the bound's power of two");
    let remembered = (2 + HISTORY) * region; // rounds, one fragment each
    assert!(remembered > 64, "the window fits what the slots remember");
    assert_the_window_is_remembered(&dp, remembered + 8);
    assert_eq!((dp.slots_in_use(), active(&dp)), (0, 0));
}

/// A job with a vector length gets a region sized from its vector and
/// window, not from its slot bound alone: FAST_ROUNDS_IN_FLIGHT (8) rounds of
/// its index sequence, or more where its window needs them (a slot remembers
/// 18 fragments: 18 x region >= (window + 1) x stride), at most the bound's
/// power of two and 4096. Small vectors then cycle over a few slots (hot in
/// cache) and leave the pool to other jobs: with the bound's 4096 each,
/// only two jobs of a node had fast slots. The window guarantee holds in
/// such a region as in the test above.
#[test]
fn a_job_of_small_vectors_gets_a_region_from_its_window() {
    const HISTORY: u32 = 16; // AGGBOX_FAST_HISTORY (src/bpf/slot.h)
    let dp = load();
    let region = |id: u16| u32::from(dp.job(id).unwrap().unwrap().fast_slots);
    let with = |id: u16, vector_len: u32, window: u32| {
        let mut cfg = job(2, 0, window);
        cfg.id = id;
        cfg.vector_len = vector_len;
        dp.set_job(id, &cfg).expect("set_job");
        region(id)
    };
    // Default bound (0: 4096 slots) everywhere.
    assert_eq!(with(ID + 1, 1 << 20, 0), 4096, "stride 4096: the largest region");
    assert_eq!(with(ID + 2, 3000, 0), 128, "stride 12: 8 rounds = 96 -> 128");
    assert_eq!(with(ID + 3, 16, 1000), 64, "stride 1, window 1000: 56 rounds -> 64");
    assert_eq!(with(ID, 16, 0), 8, "stride 1, window 64: 8 rounds");
    assert_eq!(with(ID + 4, 2000, 0), 64, "a fifth job still gets one");
    for id in ID + 1..=ID + 4 {
        dp.remove_job(id).expect("remove_job");
    }
    // The window guarantee in the 8-slot region (the default window, 64).
    let remembered = (2 + HISTORY) * region(ID);
    assert!(remembered > 65, "the window fits what the slots remember");
    assert_the_window_is_remembered(&dp, remembered + 8);
    assert_eq!((dp.slots_in_use(), active(&dp)), (0, 0));
}

/// Past the window the ring forgets: a job whose window is wider than what
/// its slots remember relies on the stale-round rule only up to the window,
/// so an older fragment than the ring holds is not known there. (The limit
/// docs/DATAPLANE.md states; without a vector length the `completed` LRU
/// covers it instead, see late_retransmissions_are_recognised_after_the_slot_moves_on.)
#[test]
fn the_history_ring_holds_exactly_its_length() {
    const HISTORY: u32 = 16;
    let dp = load();
    let mut cfg = job(2, 1, 100_000);
    cfg.vector_len = 16;
    dp.set_job(ID, &cfg).expect("set_job");
    assert_eq!(dp.job(ID).unwrap().unwrap().fast_slots, 1);
    let v = [7; 16];
    for round in 1..=HISTORY + 3 {
        assert_eq!(run(&dp, &contribution(0, round, 0, &v)).0, Outcome::Accepted.label());
        assert_eq!(run(&dp, &contribution(1, round, 0, &v)).0, Outcome::Result.label());
    }
    // One slot: the current key (round HISTORY + 3), `prev` and HISTORY
    // before it, down to round 2.
    for old in 2..=HISTORY + 3 {
        assert_eq!(run(&dp, &contribution(0, old, 0, &v)).0, DropReason::Retransmission.label(), "round {old}");
    }
    // Round 1 left the ring: a contribution there is not known as complete;
    // it finds the slot holding a newer fragment and takes the hash-map
    // chain, which has no record of it either.
    assert_eq!(run(&dp, &contribution(0, 1, 0, &v)).0, Outcome::Accepted.label());
    assert_eq!(fast(&dp, abi::FAST_BUSY), 1, "round 1 went to the chain");
}

/// Every kernel op through a fast slot, against the reference reducer: the
/// first contribution stores (no identity fill), a SUM's last one adds and
/// writes the RESULT in one pass (then the exact pass only when a sum left
/// int32), the others write it from the accumulators; odd and even counts,
/// weights, values that clamp.
#[test]
fn every_op_matches_the_reference_reducer_in_a_fast_slot() {
    let dp = load();
    let mut cfg = job(3, 64, 1000);
    cfg.weights = vec![1, 3, 2];
    dp.set_job(ID, &cfg).expect("set_job");
    let weights = [1, 3, 2];
    let mut round = 0u32;
    for op in [Op::Sum, Op::Count, Op::Max, Op::Min, Op::Avg] {
        for count in [1usize, 2, 7, 16, 17, 361, 362, 384] {
            for extreme in [false, true] {
                round += 1;
                let vals: Vec<Vec<i32>> = (0..3)
                    .map(|r| {
                        (0..count as i32)
                            .map(|i| match (extreme, (i + r) % 3) {
                                (true, 0) => i32::MAX - i,
                                (true, 1) => i32::MIN + i,
                                _ => (i * 7919 + r * 104_729) % 200_001 - 100_000,
                            })
                            .collect()
                    })
                    .collect();
                let parts: Vec<(&[i32], i32)> = (0..3).map(|r| (&vals[r][..], weights[r])).collect();
                let want = reducer::reduce(op, &parts).expect("reduce");
                let mut want_be = Vec::new();
                want.write_be(&mut want_be);
                for rank in 0..3u16 {
                    let mut a = Agg::new(ID, rank, op as u8, vals[rank as usize].clone());
                    a.round = round;
                    let (l, out) = run(&dp, &Frame::udp(addr(rank), a.bytes()).build());
                    let what = format!("{op:?} count {count} extreme {extreme} rank {rank}");
                    if rank < 2 {
                        assert_eq!(l, Outcome::Accepted.label(), "{what}");
                    } else {
                        assert_eq!(l, Outcome::Result.label(), "{what}");
                        assert_eq!(&out[PAYLOAD_OFF + 24..], &want_be[..], "{what}: payload");
                        assert_eq!(out[PAYLOAD_OFF + 21], abi::AGG_F_RESULT | want.flags(), "{what}: flags");
                    }
                }
            }
        }
    }
    assert_eq!(fast(&dp, abi::FAST_TAKEN), u64::from(round), "every fragment in a fast slot");
    assert_eq!(dp.slots_in_use(), 0);
}

#[test]
fn a_contribution_too_large_for_a_fast_slot_is_answered_by_the_fragments_fast_slot() {
    let dp = load();
    dp.set_job(ID, &job(2, 64, 4)).expect("set_job");
    assert_eq!(run(&dp, &contribution(0, 1, 0, &[1; 100])).0, Outcome::Accepted.label());
    // Same fragment, a count no fast slot holds: the hash-map path looks at
    // the fast slot first, and the fragment's slot says mismatch.
    assert_eq!(run(&dp, &contribution(1, 1, 0, &[1; 400])).0, DropReason::SlotMismatch.label());
    assert_eq!(dp.kernel_maps().unwrap().slot_owner(&key(1, 0)), None, "no second home for the fragment");
    assert_eq!(run(&dp, &contribution(1, 1, 0, &[2; 100])).0, Outcome::Result.label());
    assert_eq!(run(&dp, &contribution(1, 1, 0, &[1; 400])).0, DropReason::Retransmission.label());
    assert_eq!((dp.slots_in_use(), active(&dp)), (0, 0));
}

#[test]
fn a_stale_rounds_unfinished_fast_slot_is_reclaimed() {
    let dp = load();
    dp.set_job(ID, &job(2, 4, 2)).expect("set_job");
    // Round 1, fragment 0: one rank only (a straggler), in its fast slot.
    assert_eq!(run(&dp, &contribution(0, 1, 0, &[1; 8])).0, Outcome::Accepted.label());
    assert_eq!((dp.fast_slots_in_use(), active(&dp)), (1, 1));
    assert_eq!(dp.reclaim_stale_slots().unwrap(), 0, "not stale: nothing completed yet");
    // Rounds 2..=4 complete at another fragment (another fast slot).
    for round in 2..=4u32 {
        assert_eq!(run(&dp, &contribution(0, round, 256, &[round as i32; 8])).0, Outcome::Accepted.label());
        assert_eq!(run(&dp, &contribution(1, round, 256, &[1; 8])).0, Outcome::Result.label());
    }
    // newest = 4, window 2: round 1 is stale and its slot never completes.
    assert_eq!(dp.reclaim_stale_slots().unwrap(), 1);
    assert_eq!(fast(&dp, abi::FAST_RELEASED), 1);
    assert_eq!((dp.fast_slots_in_use(), active(&dp)), (0, 0), "its share of the bound is back");
    assert_eq!(dp.reclaim_stale_slots().unwrap(), 0, "idempotent");
    assert_eq!(run(&dp, &contribution(1, 1, 0, &[1; 8])).0, DropReason::StaleRound.label());
    // The slot is free for a live round.
    assert_eq!(run(&dp, &contribution(0, 5, 0, &[4; 8])).0, Outcome::Accepted.label());
    let (l, out) = run(&dp, &contribution(1, 5, 0, &[5; 8]));
    assert_eq!(l, Outcome::Result.label());
    assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&[4; 8], &[5; 8]])[..]);
}

#[test]
fn removing_a_job_clears_its_region_and_a_new_job_starts_empty() {
    let dp = load();
    dp.set_job(ID, &job(2, 16, 4)).expect("set_job");
    assert_eq!(run(&dp, &contribution(0, 1, 0, &[1; 8])).0, Outcome::Accepted.label());
    assert_eq!(dp.fast_slots_in_use(), 1);
    dp.remove_job(ID).expect("remove_job");
    assert_eq!(dp.fast_slots_in_use(), 0);
    dp.set_job(ID, &job(2, 16, 4)).expect("set_job again");
    // The same fragment is new for the new job: nothing of the old one.
    assert_eq!(run(&dp, &contribution(0, 1, 0, &[2; 8])).0, Outcome::Accepted.label());
    let (l, out) = run(&dp, &contribution(1, 1, 0, &[3; 8]));
    assert_eq!(l, Outcome::Result.label());
    assert_eq!(&out[PAYLOAD_OFF + 24..], &sum_be(&[&[2; 8], &[3; 8]])[..]);
}

#[test]
fn a_fast_slot_locked_past_the_bound_drops_the_contribution_unchanged() {
    a_fast_slot_locked_past_the_bound_drops_the_contribution_unchanged_in(Family::V4);
}

#[test]
fn a_fast_slot_locked_past_the_bound_drops_the_contribution_unchanged_over_ipv6() {
    a_fast_slot_locked_past_the_bound_drops_the_contribution_unchanged_in(Family::V6);
}

fn a_fast_slot_locked_past_the_bound_drops_the_contribution_unchanged_in(fam: Family) {
    let dp = load();
    dp.set_job(ID, &job_in(fam, 2, 64, 4)).expect("set_job");
    let maps = dp.kernel_maps().unwrap();
    // No vector length: fragment 0 of every round has the region's first slot.
    let index = u32::from(dp.job(ID).unwrap().unwrap().fast_base);
    assert_eq!(maps.fast_slot_lock(index), Some(0));
    // A holder that never lets go (as one whose vCPU stalls would).
    maps.set_fast_slot_lock(index, 1).expect("hold the lock");
    let before = dp.job_stats(ID).unwrap().unwrap();
    assert_eq!(run(&dp, &contribution_in(fam, 0, 1, 0, &[1; 8])).0, DropReason::SlotBusy.label());
    // A contribution too large for a fast slot takes the hash-map path,
    // whose handshake with the fragment's fast slot finds it locked too.
    let big: Vec<i32> = vec![2; 400];
    assert_eq!(run(&dp, &contribution_in(fam, 0, 1, 0, &big)).0, DropReason::SlotBusy.label());
    let after = dp.job_stats(ID).unwrap().unwrap();
    assert_eq!(after.dropped - before.dropped, 2, "counted under the job");
    assert_eq!((dp.fast_slots_in_use(), dp.slots_in_use(), dp.slot_owners_in_use(), active(&dp)), (0, 0, 0, 0), "nothing changed");
    assert_eq!(fast(&dp, abi::FAST_JOINED) + fast(&dp, abi::FAST_TAKEN), 0);
    match dp.discard_fast_slots(ID, index as u16, 1) {
        Err(aggbox::kernel::xdp::XdpError::FastSlotBusy { index: i }) => assert_eq!(i, index),
        other => panic!("discard of a locked slot: {other:?}"),
    }
    // Let go: the same contributions (the senders' resends) complete it.
    maps.set_fast_slot_lock(index, 0).expect("release the lock");
    assert_eq!(run(&dp, &contribution_in(fam, 0, 1, 0, &[1; 8])).0, Outcome::Accepted.label());
    let (l, out) = run(&dp, &contribution_in(fam, 1, 1, 0, &[5; 8]));
    assert_eq!(l, Outcome::Result.label());
    assert_eq!(&out[fam.payload_off() + 24..], &sum_be(&[&[1; 8], &[5; 8]])[..]);
    assert_eq!(run(&dp, &contribution_in(fam, 1, 1, 0, &[5; 8])).0, DropReason::Retransmission.label());
    assert_eq!(maps.fast_slot_lock(index), Some(0), "every path gave the lock back");
    assert_eq!((dp.fast_slots_in_use(), active(&dp)), (0, 0));
}
