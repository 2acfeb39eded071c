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

use aggbox::abi::{self, Op};
use aggbox::reducer;
use aggbox::tools::{elements_per_datagram, pattern_vector};
use bpf_common::*;


#[test]
fn jumbo_and_multibuffer_results_match_the_reducer() {
    let dp = load();
    let weights = vec![1, 3, -1, 2];
    dp.set_job(REDUCE_JOB, &reduce_job(4, weights.clone())).unwrap();
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
        for op in KERNEL_OPS {
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
    dp.set_job(REDUCE_JOB, &reduce_job(4, weights.clone())).unwrap();
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
    for (round, op) in KERNEL_OPS.iter().enumerate() {
        reduce_one(&dp, *op, &weights, &vectors, round as u32 + 1, 0);
    }
}

#[test]
fn jumbo_retransmission_and_slot_accounting() {
    let dp = load();
    dp.set_job(REDUCE_JOB, &reduce_job(2, vec![])).unwrap();
    let count = elements_per_datagram(9000) as u32;
    let a = Agg::new(REDUCE_JOB, 0, Op::Sum as u8, pattern_vector(0, count));
    let frame = Frame::udp(reduce_addr(0), a.bytes()).build();
    assert_eq!(dp.test_run(&frame).unwrap().0, XDP_DROP);
    // 2237 elements = 9 blocks of 256.
    assert_eq!(dp.slots_in_use(), 1);
    assert_eq!(dp.blocks_in_use().unwrap(), 9);
    let before = dp.stats().unwrap();
    assert_eq!(dp.test_run(&frame).unwrap().0, XDP_DROP);
    assert_eq!(stat_delta(&before, &dp.stats().unwrap(), "retransmission"), 1);
    // Same slot, another count: mismatch, nothing added.
    let b = Agg::new(REDUCE_JOB, 1, Op::Sum as u8, pattern_vector(1, count - 1));
    let before = dp.stats().unwrap();
    dp.test_run(&Frame::udp(reduce_addr(1), b.bytes()).build()).unwrap();
    assert_eq!(stat_delta(&before, &dp.stats().unwrap(), "slot_mismatch"), 1);
    // Job removal frees the slot and its blocks.
    dp.remove_job(REDUCE_JOB).unwrap();
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
    dp.set_job(REDUCE_JOB, &reduce_job(4, weights.clone())).unwrap();
    let count = elements_per_datagram(65535) as u32;
    let per_slot = count.div_ceil(abi::CHUNK_ELEMS);
    assert_eq!(per_slot, 64);
    let fragments = abi::MAX_BLOCKS / per_slot;
    let vector = |rank: u16, frag: u32| pattern_vector(rank * 7 + frag as u16, count);
    let frame_of = |round: u32, rank: u16, frag: u32| {
        let mut a = Agg::new(REDUCE_JOB, rank, Op::Sum as u8, vector(rank, frag));
        a.round = round;
        a.frag_off = frag * count;
        Frame::udp(reduce_addr(rank), a.bytes()).build()
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
    assert_eq!(stat_delta(&before, &dp.stats().unwrap(), "slot_pool_full"), 1);
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
    let key = abi::SlotKey { job: REDUCE_JOB, pad: 0, round, frag_off: (fragments - 1) * count };
    assert_eq!(dp.reclaim_slot(&key).unwrap(), aggbox::dataplane::Reclaim::Reclaimed);
    assert_eq!(dp.slots_in_use(), 0);
    assert_eq!(dp.blocks_in_use().unwrap(), 0, "reclaim gave the blocks back");
    // Every block now holds some earlier owner's values: each op, weighted,
    // must still give the reducer's result (the first adder stores).
    let mut round = 100;
    for pass in 0..3 {
        for op in KERNEL_OPS {
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
    dp.remove_job(REDUCE_JOB).unwrap();
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
    dp.set_job(REDUCE_JOB, &reduce_job(2, vec![])).unwrap();
    let big: Vec<Vec<i32>> = (0..2).map(|_| vec![i32::MAX; 256]).collect();
    reduce_one(&dp, Op::Sum, &[], &big, 1, 0); // overflows: flag expected
    let small: Vec<Vec<i32>> = (0..2).map(|r| vec![r + 1; 18]).collect();
    reduce_one(&dp, Op::Sum, &[], &small, 2, 0); // no OVERFLOW
}
