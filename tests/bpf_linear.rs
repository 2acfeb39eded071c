//! The linear chain (docs/JUMBO.md, "Kernels without multi-buffer XDP"):
//! the MTU-bounded build of the tail-call chain that `XdpPlane::load`
//! picks when the kernel lacks `bpf_loop` / `bpf_xdp_load_bytes` (before
//! 5.18). This kernel has both, so these tests load it explicitly
//! (`XdpPlane::load_chain(Chain::Linear)`) and check that it aggregates
//! like the frags chain, and that it calls no helper newer than 5.15.
//!
//! Needs root: run with `sudo -E cargo test --test bpf_linear`.

mod bpf_common;

use aggbox::wire::abi::{self, Op};
use aggbox::kernel::xdp::Chain;
use aggbox::node::tools::pattern_vector;
use aggbox::wire::proto::elements_per_datagram;
use bpf_common::*;

fn load_linear() -> TestPlane {
    load_chain(Chain::Linear)
}

#[test]
fn linear_chain_loads_alone_and_names_its_programs() {
    let dp = load_linear();
    assert_eq!(dp.chain(), Chain::Linear);
    let names: Vec<&str> = dp.programs().unwrap().iter().map(|p| p.name).collect();
    assert_eq!(
        names,
        ["aggbox_xdp_linear", "aggbox_slot_linear", "aggbox_add_linear", "aggbox_result_linear", "aggbox_ring_linear"]
    );
    for p in dp.programs().unwrap() {
        println!("{:<22} xlated {:>5} insns, verifier processed {:>6} insns", p.name, p.xlated_insns, p.verified_insns);
        assert!(p.verified_insns < 1_000_000, "{}: within the verifier's limit", p.name);
    }
    // 1 + 2 × 15 tail calls: within the 32 of kernels before 5.17.
    assert!(1 + 2 * abi::LINEAR_MAX_CHUNKS <= 32);
    assert_eq!(Chain::Linear.max_elems(), abi::LINEAR_MAX_ELEMS);
    assert_eq!(Chain::Frags.max_elems(), abi::MAX_ELEMS);
}

/// Largest count whose frame BPF_PROG_TEST_RUN hands over in one buffer:
/// a page less XDP headroom (256) and tailroom (320) is 3520 bytes, less
/// Ethernet, IPv4, UDP and AGG1 headers (66): 863 elements. Larger frames
/// get fragments, which a driver without multi-buffer support never makes
/// (the netns tests cover larger datagrams in generic mode).
const ONE_PAGE_ELEMS: usize = (4096 - 256 - 320 - 14 - 20 - 8 - 24) / 4;

#[test]
fn linear_results_match_the_reducer() {
    let dp = load_linear();
    let weights = vec![1, 3, -1, 2];
    dp.set_job(REDUCE_JOB, &reduce_job(4, weights.clone())).unwrap();
    let mut round = 1;
    // Chunk edges, MTU 1500 (362), the largest one-page frame (4 chunks).
    for count in [1usize, 255, 256, 257, elements_per_datagram(1500), 513, ONE_PAGE_ELEMS] {
        for op in kernel_ops() {
            let vectors: Vec<Vec<i32>> = (0..4u16).map(|r| pattern_vector(r + round as u16, count as u32)).collect();
            reduce_one(&dp, op, &weights, &vectors, round, (round % 7) * 4096);
            round += 1;
        }
    }
    // Clamping and AVG in every block.
    for op in [Op::Sum, Op::Avg] {
        let vectors: Vec<Vec<i32>> =
            (0..4).map(|r| vec![if r % 2 == 0 { i32::MAX } else { i32::MIN + 7 }; ONE_PAGE_ELEMS]).collect();
        reduce_one(&dp, op, &weights, &vectors, round, 0);
        round += 1;
    }
}

/// The linear chain over IPv6: the same results, each RESULT's UDP checksum
/// summed straight from the packet (no bpf_xdp_load_bytes there).
#[test]
fn linear_results_match_the_reducer_over_ipv6() {
    let dp = load_linear();
    let weights = vec![1, 3, -1, 2];
    dp.set_job(REDUCE_JOB, &reduce_job_in(Family::V6, 4, weights.clone())).unwrap();
    // The largest one-page frame over IPv6: 20 bytes more of IP header.
    let one_page = ONE_PAGE_ELEMS - 5;
    let mut round = 1;
    // 120: the datagram is exactly one 512-byte checksum piece (32 + 4 * 120).
    for count in [1usize, 2, 119, 120, 121, 248, 255, 256, 257, 354, 513, one_page] {
        for op in kernel_ops() {
            let vectors: Vec<Vec<i32>> = (0..4u16).map(|r| pattern_vector(r + round as u16, count as u32)).collect();
            reduce_one_in(&dp, Family::V6, op, &weights, &vectors, round, (round % 7) * 4096);
            round += 1;
        }
    }
}

#[test]
fn linear_chain_drops_a_frame_it_sees_only_part_of() {
    // A multi-buffer frame reaching a linear (non-frags) program shows it
    // only its first buffer: the datagram is shorter than its UDP length
    // says, so it is dropped as truncated, never aggregated.
    let dp = load_linear();
    dp.set_job(REDUCE_JOB, &reduce_job(2, vec![])).unwrap();
    let before = dp.stats().unwrap();
    let a = Agg::new(REDUCE_JOB, 0, Op::Sum as u8, vec![1; ONE_PAGE_ELEMS + 1]);
    let (verdict, _) = dp.test_run(&Frame::udp(reduce_addr(0), a.bytes()).build()).unwrap();
    assert_eq!(verdict, XDP_DROP);
    let after = dp.stats().unwrap();
    assert_eq!(stat_delta(&before, &after, "truncated_header"), 1);
    assert_eq!(after.dropped_packets() - before.dropped_packets(), 1);
    assert_eq!(dp.slots_in_use(), 0);
    assert_eq!(dp.blocks_in_use().unwrap(), 0);
}

/// Helper ids the kernel's UAPI gives the last helper of 5.15
/// (`BPF_FUNC_task_pt_regs`); 5.16 added `get_branch_snapshot` (176) and on.
const LAST_HELPER_OF_5_15: u32 = libbpf_sys::BPF_FUNC_task_pt_regs;

#[test]
fn linear_chain_calls_only_helpers_of_5_15() {
    // What the loaded programs call (XdpPlane::helper_ids), checked
    // against the helper ids 5.15 has: the linear chain must load there.
    let linear = load_linear().helper_ids();
    let frags = load_chain(Chain::Frags).helper_ids();
    for (name, ids) in &linear {
        println!("{name}: helpers {ids:?}");
        let newer: Vec<u32> = ids.iter().copied().filter(|&id| id > LAST_HELPER_OF_5_15).collect();
        assert!(newer.is_empty(), "{name} calls helpers newer than 5.15: {newer:?}");
        assert!(!ids.is_empty(), "{name}: the scan found its helper calls");
    }
    // The scan sees what the frags chain needs, so it would see it here.
    let all_frags: Vec<u32> = frags.iter().flat_map(|(_, ids)| ids.iter().copied()).collect();
    for id in [libbpf_sys::BPF_FUNC_loop, libbpf_sys::BPF_FUNC_xdp_load_bytes, libbpf_sys::BPF_FUNC_xdp_get_buff_len] {
        assert!(all_frags.contains(&id), "frags chain calls helper {id}");
    }
    assert_eq!(linear.len(), 6, "5 chain programs + aggbox_reclaim");
}

#[test]
fn linear_chain_tail_calls_go_through_its_own_array() {
    // Emptying a stage of the linear chain's array (progs_linear) stops
    // exactly that stage: the chain never jumps into the frags array.
    for (index, ranks) in [(abi::CALL_SLOT, 1u16), (abi::CALL_ADD, 1), (abi::CALL_RESULT, 2)] {
        let dp = load_linear();
        // The hash-map chain (a fast slot would need no tail call).
        let mut chain_job = reduce_job(2, vec![]);
        chain_job.flags = aggbox::wire::abi::JOB_F_NO_FAST;
        dp.set_job(REDUCE_JOB, &chain_job).unwrap();
        dp.unset_tail_call(index).unwrap();
        let before = dp.stats().unwrap();
        for rank in 0..ranks {
            let a = Agg::new(REDUCE_JOB, rank, Op::Sum as u8, vec![1; 300]);
            dp.test_run(&Frame::udp(reduce_addr(rank), a.bytes()).build()).unwrap();
        }
        let after = dp.stats().unwrap();
        assert_eq!(stat_delta(&before, &after, "missed_tail_call"), 1, "CALL {index}");
    }
}
