//! Jumbo and multi-buffer contributions through BPF_PROG_TEST_RUN
//! (docs/JUMBO.md): counts from 1 to 16370 (the largest IPv4 datagram),
//! every kernel op, 4 weighted ranks; each RESULT compared byte for byte with
//! `aggbox::wire::reducer`. A frame larger than a page minus XDP head- and tailroom
//! (~3.5 KB) reaches the `xdp.frags` programs as a multi-buffer xdp_buff
//! (bpf_prog_test_run_xdp puts the rest of the data in page fragments), so
//! counts >= 870 exercise bpf_xdp_load_bytes / store_bytes across fragments.
//! The tail-call depth per contribution size, and the kernel's budget, are
//! measured on the loaded programs with a hand-assembled probe that spends
//! tail calls before entering the chain (`Probe`).
//!
//! Needs root: run with `sudo -E cargo test --test bpf_jumbo`.

mod bpf_common;
#[path = "../src/testing/impair/asm.rs"]
mod asm;

use aggbox::wire::abi::{self, Op};
use aggbox::kernel::xdp::XdpPlane;
use aggbox::wire::reducer;
use aggbox::node::tools::pattern_vector;
use aggbox::wire::proto::elements_per_datagram;
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
        for op in kernel_ops() {
            let vectors: Vec<Vec<i32>> =
                (0..4u16).map(|r| pattern_vector(r + round as u16, count as u32)).collect();
            reduce_one(&dp, op, &weights, &vectors, round, (round % 7) * 16370);
            round += 1;
        }
    }
}

/// The same over IPv6 (a job of IPv6 ranks): multi-buffer frames up to the
/// largest IPv6 datagram without a jumbogram option, 16375 elements
/// ((65535 - 8 - 24) / 4: the IPv6 payload length covers UDP, no IP
/// header), each RESULT with a right UDP checksum summed across the
/// frame's fragments.
#[test]
fn jumbo_and_multibuffer_results_match_the_reducer_over_ipv6() {
    let dp = load();
    let weights = vec![1, 3, -1, 2];
    dp.set_job(REDUCE_JOB, &reduce_job_in(Family::V6, 4, weights.clone())).unwrap();
    // (9000 - 40 - 8 - 24) / 4 at MTU 9000.
    let mtu9000 = 2232;
    let largest = (65535 - 8 - 24) / 4;
    assert!(largest <= abi::MAX_ELEMS as usize);
    let mut round = 1;
    // Checksum piece edges (120: 512 bytes of datagram), MTU 1500 (1440 / 4
    // - 6 = 354 over IPv6), the first sizes past a page,
    // MTU 9000, an odd size, the largest.
    for count in [1usize, 120, 121, 248, 257, 354, 864, 865, mtu9000, 5001, largest] {
        for op in kernel_ops() {
            let vectors: Vec<Vec<i32>> =
                (0..4u16).map(|r| pattern_vector(r + round as u16, count as u32)).collect();
            reduce_one_in(&dp, Family::V6, op, &weights, &vectors, round, (round % 7) * 16375);
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
    for (round, op) in kernel_ops().iter().enumerate() {
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
    assert_eq!(dp.reclaim_slot(&key).unwrap(), aggbox::kernel::xdp::Reclaim::Reclaimed);
    assert_eq!(dp.slots_in_use(), 0);
    assert_eq!(dp.blocks_in_use().unwrap(), 0, "reclaim gave the blocks back");
    // Every block now holds some earlier owner's values: each op, weighted,
    // must still give the reducer's result (the first adder stores).
    let mut round = 100;
    for pass in 0..3 {
        for op in kernel_ops() {
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
fn chain_verifier_cost() {
    let dp = load();
    for p in dp.programs().unwrap() {
        println!(
            "{:<14} xlated {:>4} insns, verifier processed {:>6} insns",
            p.name, p.xlated_insns, p.verified_insns
        );
        assert!(p.verified_insns > 0 && p.xlated_insns > 0, "{p:?}");
    }
}

/// The tail-call budget probe: a hand-assembled XDP program that tail-calls
/// itself `hops` times (a counter in an array map), then tail-calls
/// `target`. Every tail call counts against the kernel's per-packet limit
/// (MAX_TAIL_CALL_CNT), so the largest `hops` with which a packet still gets
/// through `target` is that limit minus 1 minus the tail calls `target`
/// takes for that packet: a measurement of the chain's depth from the
/// loaded programs, with no constant of this repository in it.
struct Probe {
    prog: std::os::fd::OwnedFd,
    hops: libbpf_rs::MapHandle,
    _array: libbpf_rs::MapHandle,
}

impl Probe {
    fn new(target: std::os::fd::BorrowedFd<'_>, frags: bool) -> Probe {
        use asm::{Asm, JEQ_IMM, MAP_LOOKUP_ELEM, TAIL_CALL};
        use libbpf_rs::MapCore;
        use std::os::fd::{AsFd, AsRawFd};
        // SAFETY: zeroed opts with sz set are libbpf's defaults.
        let mut opts: libbpf_sys::bpf_map_create_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _;
        let hops = libbpf_rs::MapHandle::create(libbpf_rs::MapType::Array, Some("probe_hops"), 4, 8, 1, &opts).expect("hops map");
        let array = libbpf_rs::MapHandle::create(libbpf_rs::MapType::ProgArray, Some("probe_progs"), 4, 4, 2, &opts).expect("prog array");
        let mut a = Asm::new();
        a.mov(6, 1)
            .store_imm_u32(10, -4, 0)
            .mov(2, 10)
            .add_imm(2, -4)
            .load_map_fd(1, hops.as_fd().as_raw_fd())
            .call(MAP_LOOKUP_ELEM)
            .jump_if(JEQ_IMM, 0, 0, "out")
            .load_u64(1, 0, 0)
            .mov_imm(3, 1) // index 1: the target
            .jump_if(JEQ_IMM, 1, 0, "tail")
            .add_imm(1, -1)
            .store_u64(0, 0, 1)
            .mov_imm(3, 0); // index 0: this program again
        a.label("tail").mov(1, 6).load_map_fd(2, array.as_fd().as_raw_fd()).call(TAIL_CALL);
        // A failed tail call (the budget is spent): XDP_ABORTED.
        a.label("out").mov_imm(0, 0).exit();
        let flags = if frags { libbpf_sys::BPF_F_XDP_HAS_FRAGS } else { 0 };
        let prog = asm::load("tail_probe", libbpf_sys::BPF_PROG_TYPE_XDP, libbpf_sys::BPF_XDP, flags, &a.finish())
            .unwrap_or_else(|e| panic!("{e:#}"));
        for (index, fd) in [(0u32, prog.as_raw_fd()), (1, target.as_raw_fd())] {
            array
                .update(&index.to_ne_bytes(), &(fd as u32).to_ne_bytes(), libbpf_rs::MapFlags::ANY)
                .unwrap_or_else(|e| panic!("probe prog array [{index}]: {e}"));
        }
        Probe { prog, hops, _array: array }
    }

    /// Run `frame` through `hops` self tail calls, then the target.
    fn run(&self, hops: u64, frame: &[u8]) -> (u32, Vec<u8>) {
        use libbpf_rs::MapCore;
        use std::os::fd::AsFd;
        self.hops.update(&0u32.to_ne_bytes(), &hops.to_ne_bytes(), libbpf_rs::MapFlags::ANY).expect("set hops");
        aggbox::kernel::xdp::TestRunner::for_fd(self.prog.as_fd())
            .and_then(|runner| runner.run(frame))
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of the probe: {e}"))
    }

    /// The largest `hops` for which `gets_through(self, hops)` holds, scanning
    /// up from 0 (which must get through) to the first that does not.
    fn max_hops(&self, mut gets_through: impl FnMut(&Probe, u64) -> bool) -> u64 {
        assert!(gets_through(self, 0), "the probe with no extra tail call failed");
        (1..=64).take_while(|&h| gets_through(self, h)).last().unwrap_or(0)
    }
}

/// Tail calls one contribution of `count` elements takes through the loaded
/// chain, measured with [`Probe`]: (for a contribution the slot absorbs,
/// for the one that completes it and becomes the RESULT).
fn measured_depth(dp: &XdpPlane, frags: bool, budget_hops: u64, count: u32, fast: bool, round: u32) -> (u64, u64) {
    let mut job = reduce_job(2, vec![]);
    if !fast {
        job.flags = abi::JOB_F_NO_FAST;
    }
    dp.set_job(REDUCE_JOB, &job).unwrap();
    let probe = Probe::new(dp.xdp_prog_fd(), frags);
    let mut frag = 0u32;
    // Each attempt on a fragment of its own: a failed one leaves its slot
    // half-processed (job removal below frees it).
    let frame = |rank: u16, frag: u32| {
        let mut a = Agg::new(REDUCE_JOB, rank, Op::Sum as u8, pattern_vector(rank, count));
        a.round = round;
        a.frag_off = frag * count;
        Frame::udp(reduce_addr(rank), a.bytes()).build()
    };
    // What a probe run did: got through (the expected outcome), or ran out
    // of tail calls (missed_tail_call from the chain, XDP_ABORTED from the
    // probe itself); anything else is a failure of the test.
    let outcome = |dp: &XdpPlane, run: &dyn Fn() -> (u32, Vec<u8>), want: &str| -> bool {
        let before = dp.stats().unwrap();
        let (verdict, _) = run();
        let after = dp.stats().unwrap();
        if verdict == 0 {
            assert_eq!(after.total_packets(), before.total_packets(), "the probe's own tail call failed: the chain never ran");
            return false;
        }
        let d = deltas(&before, &after);
        assert_eq!(d.len(), 1, "count {count}: {d:?}");
        match d[0].0 {
            l if l == want => true,
            "missed_tail_call" => false,
            other => panic!("count {count}: {other} (wanted {want})"),
        }
    };
    let absorbed = probe.max_hops(|p, h| {
        frag += 1;
        let f = frame(0, frag);
        let ok = outcome(dp, &|| p.run(h, &f), "accepted");
        if ok {
            assert_eq!(dp.test_run(&frame(1, frag)).unwrap().0, XDP_PASS, "count {count}: completing the probed slot");
        }
        ok
    });
    let completing = probe.max_hops(|p, h| {
        frag += 1;
        assert_eq!(dp.test_run(&frame(0, frag)).unwrap().0, XDP_DROP);
        let f = frame(1, frag);
        outcome(dp, &|| p.run(h, &f), "result")
    });
    dp.remove_job(REDUCE_JOB).unwrap();
    (budget_hops - absorbed, budget_hops - completing)
}

/// The tail-call depth of the chain, measured per contribution size with
/// the probe, on both builds of the chain: a contribution that completes
/// its slot takes entry → slot → add runs → result runs, 1 + 2 × runs tail
/// calls (runs = chunks / chunks per program run, rounded up), one it
/// only adds to takes 1 + runs, a fast-slot contribution none; and the
/// largest datagram fits in the kernel's budget, which is measured too.
#[test]
fn tail_call_depth_is_measured_within_the_kernel_budget() {
    use aggbox::kernel::xdp::Chain;
    let runs = |count: u32, per_run: u32| count.div_ceil(abi::CHUNK_ELEMS).div_ceil(per_run) as u64;
    for chain in [Chain::Frags, Chain::Linear] {
        // The linear chain loads everywhere the frags one does.
        let dp = load_chain(chain);
        let frags = chain == Chain::Frags;
        // The budget: hops with which a packet still reaches a program that
        // only passes (no tail call of its own).
        let pass = asm::load(
            "tail_pass",
            libbpf_sys::BPF_PROG_TYPE_XDP,
            libbpf_sys::BPF_XDP,
            if frags { libbpf_sys::BPF_F_XDP_HAS_FRAGS } else { 0 },
            &asm::Asm::new().mov_imm(0, XDP_PASS as i32).exit().finish(),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        let budget_hops = {
            use std::os::fd::AsFd;
            let frame = Frame::udp(reduce_addr(0), vec![0; 64]).build();
            Probe::new(pass.as_fd(), frags).max_hops(|p, h| p.run(h, &frame).0 == XDP_PASS)
        };
        let budget = budget_hops + 1;
        println!("{chain:?}: the kernel allows {budget} tail calls per packet (measured)");
        assert!(budget >= 32, "a kernel budget of {budget} tail calls");
        let (per_run, counts): (u32, Vec<u32>) = if frags {
            (abi::PROG_CHUNKS, vec![385, 2048, 2049, elements_per_datagram(9000) as u32, 4097, elements_per_datagram(65535) as u32])
        } else {
            // One chunk per run; BPF_PROG_TEST_RUN gives a single-buffer
            // program at most a page minus head- and tailroom (3520 bytes:
            // 863 elements), so at most 4 chunks here.
            (1, vec![257, 513, 769])
        };
        let mut round = 1;
        for &count in &counts {
            let (absorbed, completing) = measured_depth(&dp, frags, budget_hops, count, false, round);
            round += 1;
            let r = runs(count, per_run);
            println!("{chain:?} count {count:>5}: {absorbed} tail calls to add, {completing} to complete ({r} runs per stage)");
            assert_eq!(absorbed, 1 + r, "{chain:?} count {count}: entry -> slot -> {r} add runs");
            assert_eq!(completing, 1 + 2 * r, "{chain:?} count {count}: entry -> slot -> {r} add runs -> {r} result runs");
            assert!(completing < budget, "{chain:?} count {count}: {completing} tail calls, budget {budget}");
        }
        if frags {
            // A fast-slot contribution is served in the entry program.
            for count in [1u32, abi::FAST_ELEMS] {
                let (absorbed, completing) = measured_depth(&dp, frags, budget_hops, count, true, round);
                round += 1;
                println!("{chain:?} count {count:>5}, fast slot: {absorbed} / {completing} tail calls");
                assert_eq!((absorbed, completing), (0, 0), "count {count}: the fast path takes no tail call");
            }
        } else {
            // The largest linear datagram cannot be test-run (more than a
            // page); its depth from the per-run step measured above.
            let deepest = 1 + 2 * abi::LINEAR_MAX_CHUNKS as u64;
            assert!(deepest < budget, "linear chain at {} chunks: {deepest} tail calls, budget {budget}", abi::LINEAR_MAX_CHUNKS);
        }
    }
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
