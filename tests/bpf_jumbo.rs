//! Jumbo and multi-buffer contributions through BPF_PROG_TEST_RUN
//! (docs/JUMBO.md): counts from 1 to 16370 (the largest IPv4 datagram),
//! every kernel op, 4 weighted ranks; each RESULT compared byte for byte with
//! `aggbox::reducer`. A frame larger than a page minus XDP head- and tailroom
//! (~3.5 KB) reaches the `xdp.frags` programs as a multi-buffer xdp_buff
//! (bpf_prog_test_run_xdp puts the rest of the data in page fragments), so
//! counts >= 870 exercise bpf_xdp_load_bytes / store_bytes across fragments.
//!
//! Needs root: run with `sudo -E cargo test --test bpf_jumbo`.

mod bpf_common;

use std::net::Ipv4Addr;

use aggbox::abi::{self, Op};
use aggbox::dataplane::{Dataplane, JobConfig};
use aggbox::reducer;
use aggbox::tools::{elements_per_datagram, pattern_vector};
use bpf_common::*;

const JOB: u16 = 31;

fn addr(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 2, rank as u8 + 1)
}

fn job(workers: u16, weights: Vec<i32>) -> JobConfig {
    JobConfig {
        id: JOB,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: (0..workers).map(addr).collect(),
        weights,
        vector_len: 0,
        slots: 0,
        flags: 0,
        result_group: None,
        window: 0,
    }
}

/// Counter delta of one label between two snapshots.
fn delta(before: &aggbox::dataplane::Stats, after: &aggbox::dataplane::Stats, label: &str) -> u64 {
    let get = |s: &aggbox::dataplane::Stats| {
        s.outcomes.get(label).or_else(|| s.drops.get(label)).map(|c| c.packets).unwrap_or(0)
    };
    get(after) - get(before)
}

/// Send one fragment of `vectors` (one per rank) and check the RESULT
/// against the reference reducer, byte for byte.
fn reduce_one(dp: &Dataplane, op: Op, weights: &[i32], vectors: &[Vec<i32>], round: u32, frag_off: u32) {
    let workers = vectors.len() as u16;
    let count = vectors[0].len();
    let before = dp.stats().unwrap();
    let mut last = None;
    for (rank, values) in vectors.iter().enumerate() {
        let mut a = Agg::new(JOB, rank as u16, op as u8, values.clone());
        a.round = round;
        a.frag_off = frag_off;
        a.seq = round * 1000 + rank as u32;
        if rank == 1 {
            a.flags = abi::AGG_F_LAST_FRAGMENT;
        }
        let frame = Frame::udp(addr(rank as u16), a.bytes()).build();
        let (verdict, out) = dp.test_run(&frame).unwrap();
        if rank + 1 < vectors.len() {
            assert_eq!(verdict, XDP_DROP, "{op:?} count {count} rank {rank}: absorbed");
        } else {
            assert_eq!(verdict, XDP_PASS, "{op:?} count {count}: RESULT passes");
            last = Some((frame, out));
        }
    }
    let after = dp.stats().unwrap();
    assert_eq!(delta(&before, &after, "accepted"), workers as u64 - 1, "{op:?} count {count}");
    assert_eq!(delta(&before, &after, "result"), 1, "{op:?} count {count}");
    assert_eq!(after.dropped_packets(), before.dropped_packets(), "{op:?} count {count}: no drops");

    let (input, out) = last.unwrap();
    assert_eq!(out.len(), input.len(), "RESULT rewritten in place");
    assert_eq!(out[..34], input[..34], "Ethernet and IPv4 headers untouched");
    assert_eq!(u16::from_be_bytes([out[36], out[37]]), RESULT_PORT);
    assert_eq!(out[38..40], input[38..40], "UDP length kept");
    assert_eq!(out[40..42], [0, 0], "UDP checksum 0");
    let a = &out[PAYLOAD_OFF..];
    assert_eq!(u16::from_be_bytes([a[6], a[7]]), abi::RESULT_RANK);
    assert_eq!(u32::from_be_bytes(a[12..16].try_into().unwrap()), round);
    assert_eq!(u32::from_be_bytes(a[16..20].try_into().unwrap()), frag_off);
    assert_eq!(a[20], op as u8);
    assert_eq!(u16::from_be_bytes([a[22], a[23]]) as usize, count);

    let contributions: Vec<(&[i32], i32)> =
        vectors.iter().enumerate().map(|(r, v)| (v.as_slice(), weights.get(r).copied().unwrap_or(1))).collect();
    let expected = reducer::reduce(op, &contributions).unwrap();
    let mut want = Vec::new();
    expected.write_be(&mut want);
    assert_eq!(a[21], expected.flags() | abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT, "{op:?} count {count}: flags");
    if a[24..] != want[..] {
        let first = a[24..].chunks(4).zip(want.chunks(4)).position(|(g, w)| g != w).unwrap();
        panic!(
            "{op:?} count {count}: element {first} is {:?}, reducer says {:?}",
            &a[24 + 4 * first..24 + 4 * first + 4],
            &want[4 * first..4 * first + 4]
        );
    }
    assert_eq!(dp.slots_in_use(), 0, "slot released");
    assert_eq!(dp.blocks_in_use().unwrap(), 0, "blocks released");
}

const OPS: [Op; 5] = [Op::Sum, Op::Count, Op::Max, Op::Min, Op::Avg];

#[test]
fn jumbo_and_multibuffer_results_match_the_reducer() {
    let dp = load();
    let weights = vec![1, 3, -1, 2];
    dp.set_job(JOB, &job(4, weights.clone())).unwrap();
    let mtu9000 = elements_per_datagram(9000);
    // (9000 - 20 - 8 - 24) / 4: 2237 elements (the 2242 is an
    // arithmetic slip; both fit in 9 blocks).
    assert_eq!(mtu9000, 2237);
    let largest = elements_per_datagram(65535);
    assert_eq!(largest, 16370);
    let mut round = 1;
    // Chunk edges (255/256/257), MTU 1500, the first multi-buffer sizes,
    // MTU 9000 (2237), 2242, an odd size, the largest IPv4 datagram.
    for count in [1usize, 255, 256, 257, 362, 869, 870, mtu9000, 2242, 5000, largest] {
        for op in OPS {
            let vectors: Vec<Vec<i32>> =
                (0..4u16).map(|r| pattern_vector(r + round as u16, count as u32)).collect();
            reduce_one(&dp, op, &weights, &vectors, round, (round % 7) * 16370);
            round += 1;
        }
    }
}

#[test]
fn largest_datagram_clamps_and_averages_in_every_block() {
    let dp = load();
    let weights = vec![1, 1, 1, 1];
    dp.set_job(JOB, &job(4, weights.clone())).unwrap();
    let count = 16370;
    // Values that overflow int32 when summed, in every block, both signs.
    let vectors: Vec<Vec<i32>> = (0..4)
        .map(|r| {
            (0..count)
                .map(|i| match (i + r) % 5 {
                    0 => i32::MAX - i as i32,
                    1 => i32::MIN + i as i32,
                    2 => 0,
                    3 => -(i as i32),
                    _ => i as i32 * 7,
                })
                .collect()
        })
        .collect();
    for (round, op) in OPS.iter().enumerate() {
        reduce_one(&dp, *op, &weights, &vectors, round as u32 + 1, 0);
    }
}

#[test]
fn jumbo_retransmission_and_slot_accounting() {
    let dp = load();
    dp.set_job(JOB, &job(2, vec![])).unwrap();
    let count = elements_per_datagram(9000) as u32;
    let a = Agg::new(JOB, 0, Op::Sum as u8, pattern_vector(0, count));
    let frame = Frame::udp(addr(0), a.bytes()).build();
    assert_eq!(dp.test_run(&frame).unwrap().0, XDP_DROP);
    // 2237 elements = 9 blocks of 256.
    assert_eq!(dp.slots_in_use(), 1);
    assert_eq!(dp.blocks_in_use().unwrap(), 9);
    let before = dp.stats().unwrap();
    assert_eq!(dp.test_run(&frame).unwrap().0, XDP_DROP);
    assert_eq!(delta(&before, &dp.stats().unwrap(), "retransmission"), 1);
    // Same slot, another count: mismatch, nothing added.
    let b = Agg::new(JOB, 1, Op::Sum as u8, pattern_vector(1, count - 1));
    let before = dp.stats().unwrap();
    dp.test_run(&Frame::udp(addr(1), b.bytes()).build()).unwrap();
    assert_eq!(delta(&before, &dp.stats().unwrap(), "slot_mismatch"), 1);
    // Job removal frees the slot and its blocks.
    dp.remove_job(JOB).unwrap();
    assert_eq!(dp.slots_in_use(), 0);
    assert_eq!(dp.blocks_in_use().unwrap(), 0);
}

/// The block pool (`blocks` array + `free_blocks` queue) is used whole,
/// refuses past its end, gets every block back on completion and on reclaim,
/// and a reused block (never zeroed: it still holds its previous owner's
/// accumulators) gives the reducer's result for every op.
#[test]
fn block_pool_is_used_whole_given_back_and_reused_dirty() {
    let dp = load();
    let weights = vec![1, 3, -1, 2];
    dp.set_job(JOB, &job(4, weights.clone())).unwrap();
    let count = elements_per_datagram(65535) as u32;
    let per_slot = count.div_ceil(abi::CHUNK_ELEMS);
    assert_eq!(per_slot, 64);
    let fragments = abi::MAX_BLOCKS / per_slot;
    let vector = |rank: u16, frag: u32| pattern_vector(rank * 7 + frag as u16, count);
    let frame_of = |round: u32, rank: u16, frag: u32| {
        let mut a = Agg::new(JOB, rank, Op::Sum as u8, vector(rank, frag));
        a.round = round;
        a.frag_off = frag * count;
        Frame::udp(addr(rank), a.bytes()).build()
    };
    let round = 5;
    let frame = |rank: u16, frag: u32| frame_of(round, rank, frag);
    // Rank 0 opens every fragment the pool has blocks for: all of it.
    for frag in 0..fragments {
        assert_eq!(dp.test_run(&frame(0, frag)).unwrap().0, XDP_DROP);
    }
    assert_eq!(dp.slots_in_use(), fragments as usize);
    assert_eq!(dp.blocks_in_use().unwrap(), abi::MAX_BLOCKS as usize, "the whole pool");
    // One more fragment: refused, nothing taken.
    let before = dp.stats().unwrap();
    assert_eq!(dp.test_run(&frame(0, fragments)).unwrap().0, XDP_DROP);
    assert_eq!(delta(&before, &dp.stats().unwrap(), "slot_pool_full"), 1);
    assert_eq!(dp.blocks_in_use().unwrap(), abi::MAX_BLOCKS as usize);
    assert_eq!(dp.slots_in_use(), fragments as usize);
    // Complete all but the last fragment; check one RESULT in full.
    for frag in 0..fragments - 1 {
        for rank in 1..4u16 {
            let (verdict, out) = dp.test_run(&frame(rank, frag)).unwrap();
            assert_eq!(verdict, if rank == 3 { XDP_PASS } else { XDP_DROP }, "fragment {frag} rank {rank}");
            if rank == 3 && frag == fragments / 2 {
                let vs: Vec<Vec<i32>> = (0..4).map(|r| vector(r, frag)).collect();
                let contributions: Vec<(&[i32], i32)> =
                    vs.iter().zip(&weights).map(|(v, w)| (v.as_slice(), *w)).collect();
                let mut want = Vec::new();
                reducer::reduce(Op::Sum, &contributions).unwrap().write_be(&mut want);
                assert!(out[PAYLOAD_OFF + 24..] == want[..], "fragment {frag}: RESULT");
            }
        }
    }
    assert_eq!(dp.slots_in_use(), 1);
    assert_eq!(dp.blocks_in_use().unwrap(), per_slot as usize, "completions gave their blocks back");
    // The last one is reclaimed (as for a stale round): its blocks come back too.
    let key = abi::SlotKey { job: JOB, pad: 0, round, frag_off: (fragments - 1) * count };
    assert_eq!(dp.reclaim_slot(&key).unwrap(), aggbox::dataplane::Reclaim::Reclaimed);
    assert_eq!(dp.slots_in_use(), 0);
    assert_eq!(dp.blocks_in_use().unwrap(), 0, "reclaim gave the blocks back");
    // Every block now holds some earlier owner's values: each op, weighted,
    // must still give the reducer's result (the first adder stores).
    let mut round = 100;
    for pass in 0..3 {
        for op in OPS {
            let vectors: Vec<Vec<i32>> =
                (0..4u16).map(|r| pattern_vector(r + round as u16 + pass, count)).collect();
            reduce_one(&dp, op, &weights, &vectors, round, 0);
            round += 1;
        }
    }
    // Filling the pool again (a round not stale yet) works: nothing leaked.
    for frag in 0..fragments {
        assert_eq!(dp.test_run(&frame_of(round, 0, frag)).unwrap().0, XDP_DROP);
    }
    assert_eq!(dp.blocks_in_use().unwrap(), abi::MAX_BLOCKS as usize);
    assert_eq!(dp.slots_in_use(), fragments as usize, "every fragment got its blocks again");
    dp.remove_job(JOB).unwrap();
    assert_eq!(dp.blocks_in_use().unwrap(), 0, "job removal gave the blocks back");
}

#[test]
fn chain_verifier_cost_and_tail_call_budget() {
    let dp = load();
    for p in dp.programs().unwrap() {
        println!(
            "{:<14} xlated {:>4} insns, verifier processed {:>6} insns",
            p.name, p.xlated_insns, p.verified_insns
        );
    }
    let chunks = abi::MAX_ELEMS.div_ceil(abi::CHUNK_ELEMS);
    let runs = chunks.div_ceil(abi::PROG_CHUNKS);
    // entry -> slot (1) -> adds -> results: at most 33 tail calls.
    assert!(1 + 2 * runs <= 33, "{runs} runs per stage");
}

#[test]
fn stale_accumulators_past_count_never_set_overflow() {
    // The last block of a fragment is processed whole: accumulators past
    // `count` hold whatever earlier datagrams left in the scratch buffer.
    // Fill it with huge values, then reduce a short fragment.
    let dp = load();
    dp.set_job(JOB, &job(2, vec![])).unwrap();
    let big: Vec<Vec<i32>> = (0..2).map(|_| vec![i32::MAX; 256]).collect();
    reduce_one(&dp, Op::Sum, &[], &big, 1, 0); // overflows: flag expected
    let small: Vec<Vec<i32>> = (0..2).map(|r| vec![r + 1; 18]).collect();
    reduce_one(&dp, Op::Sum, &[], &small, 2, 0); // no OVERFLOW
}
