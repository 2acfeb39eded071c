//! One op table, one answer. Every row of `include/aggbox/ops.def` runs over
//! seeded random inputs (i32::MIN/MAX, 0, ±1 and sums that leave int32 among
//! them) through the Rust reducer, the XDP aggregation program and the ring
//! program (both under BPF_PROG_TEST_RUN), and each is held to the table's
//! own arithmetic: fold [`Op::combine`] from [`Op::identity`], then
//! [`Op::finish`], then clamp to int32 (the ring saturates each hop, so it is
//! held to the same rows hop by hop, and to the star where nothing
//! saturated). The hand-specialised loops (the reducer's, the XDP fast
//! slots' and blocks') and the generated ones (the ring's) thus cannot
//! drift from the table or from each other. (The Python stubs' op names
//! are checked against the table by tests/abi_layout.rs.) Named `bpf_*` so
//! the kernel matrix runs it on every kernel.
//!
//! The BPF tests need root: `sudo -E cargo test --test bpf_ops_agree`.

mod bpf_common;

use aggbox::wire::abi::{self, Op, Outcome};
use aggbox::wire::reducer;
use aggbox::wire::ring as ring_arith;
use bpf_common::ring::{forwarded, Datagram, Ring, FRAG, ME, XDP_REDIRECT};
use bpf_common::*;

/// splitmix64: a seeded generator, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// An element: an edge value a quarter of the time, else small (zeros
    /// and signs for COUNT, LAND, LOR) or anywhere in int32.
    fn element(&mut self) -> i32 {
        const EDGES: [i32; 9] = [i32::MIN, i32::MIN + 1, -2, -1, 0, 1, 2, i32::MAX - 1, i32::MAX];
        match self.below(8) {
            0 | 1 => EDGES[self.below(EDGES.len() as u64) as usize],
            2..=4 => self.below(9) as i32 - 4,
            _ => self.next() as i32,
        }
    }

    fn vector(&mut self, n: usize) -> Vec<i32> {
        (0..n).map(|_| self.element()).collect()
    }
}

/// The table's answer over `vectors` (one per rank) with `weights`: per
/// element, combine from the identity in rank order, finish with the
/// weight sum, clamp to int32; and whether any element was clamped.
fn table_reduce(op: Op, vectors: &[Vec<i32>], weights: &[i32]) -> (Vec<i32>, bool) {
    let ws: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut clamped = false;
    let out = (0..vectors[0].len())
        .map(|i| {
            let mut acc = i64::from(op.identity());
            for (v, &w) in vectors.iter().zip(weights) {
                acc = op.combine(acc, v[i], w);
            }
            let r = op.finish(acc, ws);
            let c = r.clamp(i64::from(i32::MIN), i64::from(i32::MAX));
            clamped |= c != r;
            c as i32
        })
        .collect();
    (out, clamped)
}

/// The Rust reducer's answer (the user-space path and the socket baseline).
fn reducer_reduce(op: Op, vectors: &[Vec<i32>], weights: &[i32]) -> (Vec<i32>, bool) {
    let c: Vec<(&[i32], i32)> = vectors.iter().map(Vec::as_slice).zip(weights.iter().copied()).collect();
    let r = reducer::reduce(op, &c).unwrap_or_else(|e| panic!("{op:?}: reducer: {e}"));
    (r.ints().expect("an int result").to_vec(), r.overflow)
}

/// Weights of the test jobs: all 1, mixed signs, one large. The sums are
/// positive (AVG divides by them); every product stays far inside int64.
const WEIGHTS: [&[i32]; 4] = [&[1, 1], &[1, 3, -1, 2], &[1000, -7, 3, 1], &[2, 5, 1]];

#[test]
fn the_reducer_is_the_table() {
    let mut rng = Rng(0x0a66_b0c5);
    for op in Op::ALL {
        for weights in WEIGHTS {
            for n in [1, 2, 7, 64, 300] {
                let vectors: Vec<Vec<i32>> = weights.iter().map(|_| rng.vector(n)).collect();
                assert_eq!(
                    reducer_reduce(op, &vectors, weights),
                    table_reduce(op, &vectors, weights),
                    "{op:?} weights {weights:?} n {n}: reducer vs ops.def"
                );
            }
        }
        if !op.valid_on_floats() {
            assert!(reducer::reduce_f32(op, &[(&[1.0], 1)]).is_err(), "{op:?}: refused on floats");
        }
    }
}

/// How the contributions travel: over IP version `fam`, behind the VLAN
/// tag `vlan` if any.
#[derive(Debug, Clone, Copy)]
struct Enc {
    fam: Family,
    vlan: Option<u16>,
}

/// One fragment through the XDP program: every rank's contribution; the
/// last completes it and becomes the RESULT (its headers checked). Its
/// payload and flags.
fn xdp_reduce(dp: &XdpPlaneRef, enc: Enc, op: Op, vectors: &[Vec<i32>], round: u32) -> (Vec<i32>, u8) {
    let mut out = None;
    for (rank, values) in vectors.iter().enumerate() {
        let mut a = Agg::new(REDUCE_JOB, rank as u16, op as u8, values.clone());
        a.round = round;
        a.seq = round * 10 + rank as u32;
        a.flags = abi::AGG_F_LAST_FRAGMENT;
        let mut f = Frame::udp(enc.fam.addr(reduce_addr(rank as u16)), a.bytes());
        f.vlan = enc.vlan;
        let frame = f.build();
        let (verdict, o) = dp.test_run(&frame).unwrap();
        if rank + 1 < vectors.len() {
            assert_eq!(verdict, XDP_DROP, "{op:?} rank {rank}: absorbed");
        } else {
            assert_eq!(verdict, XDP_PASS, "{op:?}: the RESULT passes");
            out = Some((frame, o));
        }
    }
    let (frame, out) = out.expect("a last rank");
    let a = &out[check_result_headers(&frame, &out)..];
    assert_eq!(u16::from_be_bytes([a[6], a[7]]), abi::RESULT_RANK, "{op:?}: a RESULT");
    let values = a[24..].chunks(4).map(|c| i32::from_be_bytes(c.try_into().unwrap())).collect();
    (values, a[21])
}

type XdpPlaneRef = aggbox::kernel::xdp::XdpPlane;

#[test]
fn the_xdp_program_is_the_table() {
    xdp_is_the_table(Enc { fam: Family::V4, vlan: None });
}

/// The same over IPv6, behind a VLAN tag: a job of IPv6 ranks, every
/// RESULT with a right UDP checksum.
#[test]
fn the_xdp_program_is_the_table_over_ipv6() {
    xdp_is_the_table(Enc { fam: Family::V6, vlan: Some(5) });
}

fn xdp_is_the_table(enc: Enc) {
    let dp = load();
    let mut rng = Rng(0x0a66_0001);
    let mut round = 1;
    for weights in WEIGHTS {
        dp.set_job(REDUCE_JOB, &reduce_job_in(enc.fam, weights.len() as u16, weights.to_vec())).unwrap();
        // one element, odd and even counts, MTU 1500's 362, the largest
        // fast slot (384) and past it (the blocks), a multi-block count
        for n in [1, 2, 3, 31, 362, 384, 385, 1000] {
            for op in Op::ALL {
                let vectors: Vec<Vec<i32>> = weights.iter().map(|_| rng.vector(n)).collect();
                let what = format!("{enc:?} {op:?} weights {weights:?} n {n}");
                if !op.runs_in_kernel() {
                    // handed to user space (none here): the reducer serves it
                    let before = dp.stats().unwrap();
                    let a = Agg::new(REDUCE_JOB, 0, op as u8, vectors[0].clone());
                    let mut f = Frame::udp(enc.fam.addr(reduce_addr(0)), a.bytes());
                    f.vlan = enc.vlan;
                    let (verdict, _) = dp.test_run(&f.build()).unwrap();
                    assert_eq!(verdict, XDP_PASS, "{what}: passed on");
                    let after = dp.stats().unwrap();
                    assert_eq!(
                        stat_delta(&before, &after, Outcome::UserspaceUnavailable.label()),
                        1,
                        "{what}: for user space"
                    );
                    continue;
                }
                let (want, clamped) = table_reduce(op, &vectors, weights);
                let (got, flags) = xdp_reduce(&dp, enc, op, &vectors, round);
                round += 1;
                if got != want {
                    let i = got.iter().zip(&want).position(|(g, w)| g != w).unwrap();
                    let column: Vec<(i32, i32)> = vectors.iter().map(|v| v[i]).zip(weights.iter().copied()).collect();
                    panic!("{what}: element {i} of (value, weight) {column:?}: XDP {} but ops.def {}", got[i], want[i]);
                }
                assert_eq!(flags & abi::AGG_F_OVERFLOW != 0, clamped, "{what}: OVERFLOW");
                assert_eq!(reducer_reduce(op, &vectors, weights), (want, clamped), "{what}: reducer");
                assert_eq!(dp.slots_in_use(), 0, "{what}: slot released");
            }
        }
    }
}

#[test]
fn the_ring_program_is_the_table() {
    const FRAGS: u32 = 4;
    let mut rng = Rng(0x0a66_0002);
    for weights in [[1, 1, 1, 1], [1, 3, -2, 5]] {
        let weight_sum = weights.iter().sum::<i32>() as u32;
        for op in Op::ALL.into_iter().filter(|op| op.runs_in_ring()) {
            let ring = Ring::new(FRAGS * FRAG, weights.to_vec());
            for round in 1..=4 {
                let all: Vec<Vec<i32>> = (0..4).map(|_| rng.vector((FRAGS * FRAG) as usize)).collect();
                ring.ready(round, op, &all[ME]);
                for f in 0..FRAGS {
                    // member ME takes transmission `hops` of fragment f;
                    // 0: it is the origin (user space sends that)
                    let origin = f as usize % 4;
                    let hops = (ME + 4 - origin) % 4;
                    if hops == 0 {
                        continue;
                    }
                    let start = (f * FRAG) as usize;
                    let what = format!("{op:?} weights {weights:?} round {round} fragment {f}");
                    // the partial as the members before ME made it (the
                    // origin in user space, the others in their kernels)
                    let mut saturated = false;
                    let mut partial: Vec<i32> = Vec::new();
                    for i in 0..FRAG as usize {
                        let (mut p, mut s) = ring_arith::origin_value(op, weights[origin], all[origin][start + i]);
                        for k in 1..hops {
                            let m = (origin + k) % 4;
                            let (v, sk) = ring_arith::combine(op, weights[m], p, all[m][start + i]);
                            p = v;
                            s |= sk;
                        }
                        partial.push(p);
                        saturated |= s;
                    }
                    let mut d = Datagram::new(abi::RING_PARTIAL, round, f, hops as u16, op, partial.clone());
                    if saturated {
                        d.flags = abi::RING_F_SATURATED;
                    }
                    // what ME must add, by the table's rows hop by hop
                    let complete = hops == 3;
                    let mut want = Vec::new();
                    for (i, &p) in partial.iter().enumerate() {
                        let (v, s) = ring_arith::combine(op, weights[ME], p, all[ME][start + i]);
                        saturated |= s;
                        want.push(if complete { ring_arith::complete(op, weight_sum, v) } else { v });
                    }
                    let (verdict, out) = ring.run(&d);
                    assert_eq!(verdict, XDP_REDIRECT, "{what}: goes on");
                    let (flags, got) = forwarded(&out, if complete { abi::RING_FINAL } else { abi::RING_PARTIAL }, hops as u16 + 1);
                    assert_eq!(got, want, "{what}: ring program vs ops.def");
                    assert_eq!(flags & abi::RING_F_SATURATED != 0, saturated, "{what}: SATURATED");
                    if complete {
                        assert_eq!(ring.data(f)[..FRAG as usize], want[..], "{what}: stored");
                        if !saturated {
                            // nothing saturated on the way: the star's exact
                            // answer (the ring adds in another order)
                            let slices: Vec<Vec<i32>> = all.iter().map(|v| v[start..start + FRAG as usize].to_vec()).collect();
                            assert_eq!((want.clone(), false), table_reduce(op, &slices, &weights), "{what}: ring vs star");
                            assert_eq!((want, false), reducer_reduce(op, &slices, &weights), "{what}: ring vs reducer");
                        }
                    }
                }
            }
        }
    }
}
