//! Concurrency of the in-kernel aggregation: contributions to the same slots
//! run through BPF_PROG_TEST_RUN from several threads pinned to different
//! CPUs at once. Every slot must complete exactly once with the exact result.
//!
//! A contribution that waits for a fast slot's lock past its bound (the
//! holder's vCPU descheduled: common under QEMU's software emulation, rare on
//! hardware) is dropped as `slot_busy` and changes nothing; its sender resends
//! it. The test does what a sender does: after the concurrent pass it resends
//! every contribution of each slot that did not complete, one thread at a
//! time, and checks that exactly the `slot_busy` drops were made up for. So
//! that this path runs on every machine, the test holds the lock of fragment
//! 0's fast slot through the concurrent pass (a holder that never lets go).
//!
//! Needs root: run with `sudo -E cargo test --test bpf_concurrency`.

mod bpf_common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Barrier};

use aggbox::wire::abi::{self, Outcome};
use aggbox::kernel::xdp::XdpJob;
use bpf_common::*;
use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

const JOB: u16 = 33;
const WORKERS: u16 = 16;
const SLOTS: u32 = 300;
const THREADS: usize = 4;
const OPS: [abi::Op; 5] = [
    abi::Op::Sum,
    abi::Op::Count,
    abi::Op::Max,
    abi::Op::Min,
    abi::Op::Avg,
];

fn addr(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 78, (rank >> 8) as u8, rank as u8 + 1)
}

fn weight(rank: u16) -> i32 {
    i32::from(rank % 4) + 1
}

/// Deterministic values, some near the int32 limits so SUM overflows.
fn value(slot: u32, rank: u16, i: usize) -> i32 {
    let mut x = (u64::from(slot) << 40) ^ (u64::from(rank) << 20) ^ i as u64;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    match (x % 7) as u8 {
        0 => 0,
        1 => i32::MAX - (x >> 40) as i32 % 1000,
        _ => ((x >> 16) as i32) % 100_000,
    }
}

fn expected(slot: u32, elems: usize) -> (u8, Vec<u8>) {
    let op = OPS[(slot as usize) % OPS.len()];
    let weight_sum: i64 = (0..WORKERS).map(|r| i64::from(weight(r))).sum();
    let mut overflow = false;
    let mut out = Vec::with_capacity(elems * 4);
    for i in 0..elems {
        let vals: Vec<i64> = (0..WORKERS).map(|r| i64::from(value(slot, r, i))).collect();
        let r: i64 = match op {
            abi::Op::Sum => (0..WORKERS)
                .map(|r| i64::from(weight(r)) * vals[r as usize])
                .sum(),
            abi::Op::Count => vals.iter().filter(|v| **v != 0).count() as i64,
            abi::Op::Max => *vals.iter().max().unwrap(),
            abi::Op::Min => *vals.iter().min().unwrap(),
            abi::Op::Avg => {
                (0..WORKERS)
                    .map(|r| i64::from(weight(r)) * vals[r as usize])
                    .sum::<i64>()
                    / weight_sum
            }
            _ => unreachable!(),
        };
        let c = r.clamp(i64::from(i32::MIN), i64::from(i32::MAX));
        overflow |= c != r;
        out.extend_from_slice(&(c as i32).to_be_bytes());
    }
    let flags = abi::AGG_F_RESULT | if overflow { abi::AGG_F_OVERFLOW } else { 0 };
    (flags, out)
}

/// A full 1500-byte MTU datagram: 2 chunks.
#[test]
fn one_slot_from_many_cpus_completes_exactly_once() {
    slots_from_many_cpus(362);
}

/// A 16 KB multi-buffer frame: 16 chunks, so the contributions of one slot
/// interleave chunk by chunk across CPUs and the last adder of a chunk (which
/// writes that chunk's RESULT values early) is often not the contribution
/// that completes the slot.
#[test]
fn jumbo_slots_from_many_cpus_complete_exactly_once() {
    slots_from_many_cpus(4000);
}

fn slots_from_many_cpus(elems: usize) {
    let dp = load();
    let job = XdpJob {
        id: JOB,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: (0..WORKERS).map(|r| addr(r).into()).collect(),
        weights: (0..WORKERS).map(weight).collect(),
        vector_len: 0,
        slots: SLOTS,
        flags: 0,
        result_group: None,
        window: 0,
        frag_elems: 0,
    };
    dp.set_job(JOB, &job).expect("set_job");
    let frame_of = move |slot: u32, rank: u16| {
        let op = OPS[(slot as usize) % OPS.len()] as u8;
        let mut a = Agg::new(
            JOB,
            rank,
            op,
            (0..elems).map(|i| value(slot, rank, i)).collect(),
        );
        a.round = 7;
        a.frag_off = slot * elems as u32;
        a.seq = slot;
        Frame::udp(addr(rank), a.bytes()).build()
    };
    let ncpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    // No vector length: fragment 0 of the round has the region's first
    // fast slot (and fragments that share its index come there too).
    let maps = dp.kernel_maps().expect("kernel_maps");
    let held = u32::from(dp.job(JOB).unwrap().unwrap().fast_base);
    maps.set_fast_slot_lock(held, 1).expect("hold fragment 0's lock");
    let barrier = Arc::new(Barrier::new(THREADS));
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let runner = dp.test_runner().expect("test_runner");
        let barrier = Arc::clone(&barrier);
        handles.push(std::thread::spawn(move || {
            let mut cpus = CpuSet::new();
            cpus.set(t % ncpu).expect("cpu index");
            sched_setaffinity(Pid::from_raw(0), &cpus).expect("sched_setaffinity");
            // Frames built before the barrier so the threads really overlap.
            let mut frames = Vec::new();
            for slot in 0..SLOTS {
                for rank in (0..WORKERS).filter(|r| *r as usize % THREADS == t) {
                    frames.push(frame_of(slot, rank));
                }
            }
            barrier.wait();
            let mut results = Vec::new();
            let mut absorbed = 0u32;
            for frame in &frames {
                let (verdict, out) = runner.run(frame).expect("test_run");
                match verdict {
                    XDP_PASS => results.push(out),
                    XDP_DROP => absorbed += 1,
                    other => panic!("unexpected verdict {other}"),
                }
            }
            (results, absorbed)
        }));
    }
    let mut by_slot: BTreeMap<u32, Vec<Vec<u8>>> = BTreeMap::new();
    let mut absorbed = 0;
    for h in handles {
        let (results, n) = h.join().expect("thread");
        absorbed += n;
        for out in results {
            let a = &out[PAYLOAD_OFF..];
            let frag_off = u32::from_be_bytes(a[16..20].try_into().unwrap());
            by_slot
                .entry(frag_off / elems as u32)
                .or_default()
                .push(out);
        }
    }
    maps.set_fast_slot_lock(held, 0).expect("release fragment 0's lock");
    let concurrent = dp.stats().unwrap();
    let busy = concurrent.drop(abi::DropReason::SlotBusy).packets;
    assert_eq!(
        concurrent.dropped_packets(),
        busy,
        "the only drops of the concurrent pass are slot_busy: {:?}; fast slots (joined, taken, busy, aborted, evicted) {:?}",
        concurrent.drops,
        dp.fast_stats().unwrap()
    );
    assert_eq!(
        u64::from(absorbed) + by_slot.values().map(|v| v.len() as u64).sum::<u64>(),
        u64::from(SLOTS) * u64::from(WORKERS),
        "every contribution got a verdict"
    );

    // The senders' resend of what slot_busy dropped: every contribution of
    // each incomplete slot again, from one thread. Ranks already added are
    // dropped as retransmissions; the lost ones complete the slot. No lock
    // may still be held, so nothing is busy now.
    let runner = dp.test_runner().expect("test_runner");
    let incomplete: Vec<u32> = (0..SLOTS).filter(|s| !by_slot.contains_key(s)).collect();
    assert!(
        busy >= u64::from(WORKERS),
        "every contribution to fragment 0 met the held lock: {busy}"
    );
    assert!(
        incomplete.contains(&0),
        "fragment 0 cannot complete while its lock is held"
    );
    let mut resent = 0u64;
    for &slot in &incomplete {
        for rank in 0..WORKERS {
            resent += 1;
            let (verdict, out) = runner.run(&frame_of(slot, rank)).expect("test_run");
            match verdict {
                XDP_PASS => by_slot.entry(slot).or_default().push(out),
                XDP_DROP => {}
                other => panic!("unexpected verdict {other}"),
            }
        }
    }
    let stats = dp.stats().unwrap();
    assert_eq!(
        stats.drop(abi::DropReason::SlotBusy).packets,
        busy,
        "the resend met no held lock"
    );
    assert_eq!(
        stats.drop(abi::DropReason::Retransmission).packets,
        resent - busy,
        "exactly the contributions slot_busy dropped were added on the resend"
    );
    assert_eq!(
        stats.dropped_packets(),
        resent,
        "no other drops: {:?}",
        stats.drops
    );
    assert_eq!(stats.outcome(Outcome::Result).packets, u64::from(SLOTS));
    assert_eq!(
        stats.outcome(Outcome::Accepted).packets,
        u64::from(SLOTS) * u64::from(WORKERS - 1)
    );
    assert_eq!(by_slot.len(), SLOTS as usize, "every slot completed");
    for (slot, outs) in &by_slot {
        assert_eq!(outs.len(), 1, "slot {slot}: exactly one RESULT");
        let a = &outs[0][PAYLOAD_OFF..];
        let (flags, payload) = expected(*slot, elems);
        assert_eq!(u16::from_be_bytes([a[6], a[7]]), abi::RESULT_RANK);
        assert_eq!(a[21], flags, "slot {slot}: flags");
        assert!(
            a[24..] == payload[..],
            "slot {slot} ({:?}): payload differs",
            OPS[*slot as usize % OPS.len()]
        );
    }
    assert_eq!(dp.slots_in_use(), 0);
    // Racing creators each take their own blocks and the losers give them
    // back: a leak or a double give-back (the counter would wrap) shows here.
    assert_eq!(
        dp.blocks_in_use().unwrap(),
        0,
        "every block given back exactly once"
    );
    let state = dp.job_state(JOB).unwrap().unwrap();
    assert_eq!(state.active_slots, 0);
    assert_eq!(state.completed, 1, "set by the first completion");
    assert_eq!(state.result_seq, 0, "drawn only for results that go upstream");
    assert_eq!(dp.job_stats(JOB).unwrap().unwrap().results, u64::from(SLOTS), "every slot completed once");
}
