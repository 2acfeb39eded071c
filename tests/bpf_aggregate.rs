//! In-kernel aggregation through BPF_PROG_TEST_RUN: every case of
//! shared/spec/vectors/aggregation.json with each RESULT required at the
//! datagram that completes its fragment (and nowhere else) and compared
//! byte for byte, plus retransmission, stale round, slot pool, slot
//! mismatch, too-large and missed-tail-call rows; each over IPv4 and over
//! IPv6 (jobs of IPv6 ranks, the vectors' payloads in IPv6 frames).
//!
//! Needs root: run with `sudo -E cargo test --test bpf_aggregate`.

mod bpf_common;

use std::net::Ipv4Addr;

use aggbox::wire::abi::{self, DropReason, Outcome};
use aggbox::kernel::xdp::{XdpPlane, XdpJob};
use bpf_common::*;

/// A RESULT frame checked for everything but its payload; returns
/// (frag_off, flags, seq, payload).
fn check_result_frame(input: &[u8], out: &[u8], job: u16, round: u32) -> (u32, u8, u32, Vec<u8>) {
    let (fam, ip, _) = frame_offsets(input).expect("an IP frame");
    if fam == Family::V4 {
        assert_eq!(ipv4_checksum(&out[ip..ip + 20]), 0, "valid IPv4 header checksum");
    }
    // Ethernet and IP headers untouched (the destination is the
    // aggregator), UDP rewritten with a checksum each version accepts.
    let p = check_result_headers(input, out);
    let a = &out[p..];
    let inp = &input[p..];
    assert_eq!(
        u32::from_be_bytes(a[0..4].try_into().unwrap()),
        abi::MAGIC_AGG
    );
    assert_eq!(u16::from_be_bytes([a[4], a[5]]), job, "job");
    assert_eq!(
        u16::from_be_bytes([a[6], a[7]]),
        abi::RESULT_RANK,
        "rank 0xFFFF"
    );
    assert_eq!(
        u32::from_be_bytes(a[12..16].try_into().unwrap()),
        round,
        "round"
    );
    assert_eq!(a[16..21], inp[16..21], "frag_off and op kept");
    assert_eq!(a[22..24], inp[22..24], "count kept");
    let seq = u32::from_be_bytes(a[8..12].try_into().unwrap());
    (
        u32::from_be_bytes(a[16..20].try_into().unwrap()),
        a[21],
        seq,
        a[24..].to_vec(),
    )
}

/// One RESULT a spec vector case expects.
#[derive(Debug, Clone)]
struct WantResult {
    frag_off: u32,
    flags: u8,
    payload: Vec<u8>,
}

/// For each datagram of a spec vector case, the RESULT it must produce, if
/// any: the `workers`-th accepted contribution to a fragment completes it
/// (the vectors list the RESULTs by fragment, not by datagram). Every
/// expected RESULT must have its completing datagram.
fn results_by_datagram(name: &str, workers: usize, dgrams: &[serde_json::Value], want: &[serde_json::Value]) -> Vec<Option<WantResult>> {
    let mut by_frag: std::collections::HashMap<u32, WantResult> = want
        .iter()
        .map(|w| {
            let r = WantResult {
                frag_off: w["frag_off"].as_u64().unwrap() as u32,
                flags: w["flags"].as_u64().unwrap() as u8,
                payload: unhex(w["hex"].as_str().unwrap()),
            };
            (r.frag_off, r)
        })
        .collect();
    assert_eq!(by_frag.len(), want.len(), "{name}: one expected RESULT per frag_off");
    let mut accepted: std::collections::HashMap<u32, usize> = Default::default();
    let out: Vec<Option<WantResult>> = dgrams
        .iter()
        .map(|d| {
            if !d["accept"].as_bool().unwrap() {
                return None;
            }
            let payload = unhex(d["hex"].as_str().unwrap());
            let frag_off = u32::from_be_bytes(payload[16..20].try_into().unwrap());
            let n = accepted.entry(frag_off).or_default();
            *n += 1;
            if *n == workers {
                by_frag.remove(&frag_off)
            } else {
                None
            }
        })
        .collect();
    let mut missing: Vec<u32> = by_frag.into_keys().collect();
    missing.sort_unstable();
    assert!(missing.is_empty(), "{name}: expected RESULTs (frag_off {missing:?}) with no completing datagram");
    out
}

#[test]
fn spec_vectors_results_byte_for_byte() {
    spec_vectors_results_in(Family::V4);
}

/// The spec vectors' payloads in IPv6 frames from the IPv6 twins of their
/// sources, to jobs of IPv6 ranks: the same RESULTs byte for byte, each
/// with a right UDP checksum.
#[test]
fn spec_vectors_results_byte_for_byte_over_ipv6() {
    spec_vectors_results_in(Family::V6);
}

fn spec_vectors_results_in(fam: Family) {
    let vectors = spec_vectors("aggregation.json");
    let cases = vectors["cases"].as_array().expect("cases");
    let mut total_results = 0;
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let round = case["round"].as_u64().expect("round") as u32;
        let dp = load();
        let job = job_from_vector_in(fam, &case["job"]);
        dp.set_job(job.id, &job)
            .unwrap_or_else(|e| panic!("{name}: set_job: {e}"));
        let dgrams = case["datagrams"].as_array().expect("datagrams");
        let want = case["results"].as_array().expect("results");
        let expect = results_by_datagram(name, job.ranks.len(), dgrams, want);
        let mut got = Vec::new();
        for (i, dgram) in dgrams.iter().enumerate() {
            let src = fam.addr(dgram["src"].as_str().unwrap().parse().unwrap());
            let payload = unhex(dgram["hex"].as_str().unwrap());
            let frame = Frame::udp(src, payload.clone()).build();
            let before = dp.stats().unwrap();
            let (verdict, out) = dp.test_run(&frame).expect("test_run");
            let d = deltas(&before, &dp.stats().unwrap());
            if let Some(w) = &expect[i] {
                // Here, and only here, the vector expects this RESULT.
                assert_eq!(
                    d,
                    vec![(Outcome::Result.label(), 1, payload.len() as u64)],
                    "{name}[{i}]: completes frag_off {}: a RESULT expected",
                    w.frag_off
                );
                assert_eq!(verdict, XDP_PASS, "{name}[{i}]: RESULT passes to the stack");
                let g = check_result_frame(&frame, &out, job.id, round);
                assert_eq!(g.0, w.frag_off, "{name}[{i}]: RESULT frag_off");
                assert_eq!(g.1, w.flags, "{name}[{i}] frag_off {}: flags", w.frag_off);
                assert_eq!(g.3, w.payload, "{name}[{i}] frag_off {}: payload", w.frag_off);
                assert_eq!(
                    g.2.to_be_bytes(),
                    frame[fam.payload_off() + 8..fam.payload_off() + 12],
                    "{name}[{i}]: the RESULT keeps the completing contribution's seq (no parent)"
                );
                got.push(g);
            } else if dgram["accept"].as_bool().unwrap() {
                assert_eq!(
                    d,
                    vec![(Outcome::Accepted.label(), 1, payload.len() as u64)],
                    "{name}[{i}]: accepted, no RESULT expected here"
                );
                assert_eq!(verdict, XDP_DROP, "{name}[{i}]: absorbed");
            } else {
                let reason = why_to_reason(dgram["why"].as_str().unwrap());
                assert_eq!(
                    d,
                    vec![(reason.label(), 1, payload.len() as u64)],
                    "{name}[{i}]"
                );
                assert_eq!(verdict, XDP_DROP, "{name}[{i}]");
            }
        }
        assert_eq!(got.len(), want.len(), "{name}: number of RESULTs");
        assert_eq!(dp.slots_in_use(), 0, "{name}: every slot released");
        assert_eq!(
            dp.job_state(job.id).unwrap().unwrap().active_slots,
            0,
            "{name}: slot counter back to 0"
        );
        // Every contribution again, after completion: all retransmissions.
        for dgram in case["datagrams"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["accept"].as_bool().unwrap())
        {
            let src = fam.addr(dgram["src"].as_str().unwrap().parse().unwrap());
            let payload = unhex(dgram["hex"].as_str().unwrap());
            let before = dp.stats().unwrap();
            let (verdict, _) = dp
                .test_run(&Frame::udp(src, payload.clone()).build())
                .unwrap();
            assert_eq!(verdict, XDP_DROP);
            assert_eq!(
                deltas(&before, &dp.stats().unwrap()),
                vec![(DropReason::Retransmission.label(), 1, payload.len() as u64)],
                "{name}: late retransmission"
            );
        }
        assert_eq!(
            dp.slots_in_use(),
            0,
            "{name}: a retransmission never starts a slot"
        );
        total_results += got.len();
    }
    assert!(total_results > 0);
}

const JOB: u16 = 21;

fn addr(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 1, rank as u8 + 1)
}

fn job(workers: u16, slots: u32) -> XdpJob {
    job_in(Family::V4, workers, slots)
}

fn job_in(fam: Family, workers: u16, slots: u32) -> XdpJob {
    XdpJob {
        id: JOB,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: (0..workers).map(|r| fam.addr(addr(r))).collect(),
        weights: vec![],
        vector_len: 0,
        slots,
        flags: 0,
        result_group: None,
        window: 0,
        frag_elems: 0,
    }
}

type Deltas = Vec<(&'static str, u64, u64)>;

fn send(dp: &XdpPlane, a: &Agg) -> (u32, Deltas, Vec<u8>) {
    send_in(dp, Family::V4, a)
}

/// `a` from its rank's address of IP version `fam`; a RESULT's headers
/// checked (over IPv6 its UDP checksum).
fn send_in(dp: &XdpPlane, fam: Family, a: &Agg) -> (u32, Deltas, Vec<u8>) {
    let before = dp.stats().unwrap();
    let frame = Frame::udp(fam.addr(addr(a.rank)), a.bytes()).build();
    let (verdict, out) = dp.test_run(&frame).unwrap();
    let d: Deltas = deltas(&before, &dp.stats().unwrap())
        .into_iter()
        .map(|(l, p, _)| (l, p, 0))
        .collect();
    if d == one("result") {
        check_result_headers(&frame, &out);
    }
    (verdict, d, out)
}

fn contrib(rank: u16, round: u32, frag_off: u32, values: Vec<i32>) -> Agg {
    let mut a = Agg::new(JOB, rank, abi::Op::Sum as u8, values);
    a.round = round;
    a.frag_off = frag_off;
    a.seq = round * 100 + rank as u32;
    a
}

fn one(label: &'static str) -> Deltas {
    vec![(label, 1, 0)]
}

#[test]
fn stale_round_is_dropped_and_never_added() {
    stale_round_is_dropped_and_never_added_in(Family::V4);
}

#[test]
fn stale_round_is_dropped_and_never_added_over_ipv6() {
    stale_round_is_dropped_and_never_added_in(Family::V6);
}

fn stale_round_is_dropped_and_never_added_in(fam: Family) {
    let dp = load();
    dp.set_job(JOB, &job_in(fam, 2, 0)).unwrap();
    assert_eq!(send_in(&dp, fam, &contrib(0, 1000, 0, vec![1])).1, one("accepted"));
    let (v, d, out) = send_in(&dp, fam, &contrib(1, 1000, 0, vec![2]));
    assert_eq!((v, d), (XDP_PASS, one("result")));
    assert_eq!(out[fam.payload_off() + 24..], 3i32.to_be_bytes());
    let old = 1000 - abi::ROUND_WINDOW - 1;
    assert_eq!(
        send_in(&dp, fam, &contrib(0, old, 0, vec![5])).1,
        one(DropReason::StaleRound.label())
    );
    assert_eq!(dp.slots_in_use(), 0);
    // inside the window: still aggregated
    assert_eq!(
        send_in(&dp, fam, &contrib(0, old + 1, 0, vec![5])).1,
        one("accepted")
    );
    assert_eq!(dp.job_state(JOB).unwrap().unwrap().newest_round, 1000);
}

#[test]
fn per_job_round_window_from_config() {
    per_job_round_window_from_config_in(Family::V4);
}

#[test]
fn per_job_round_window_from_config_over_ipv6() {
    per_job_round_window_from_config_in(Family::V6);
}

fn per_job_round_window_from_config_in(fam: Family) {
    let dp = load();
    let mut j = job_in(fam, 2, 0);
    j.window = 2;
    dp.set_job(JOB, &j).unwrap();
    assert_eq!(send_in(&dp, fam, &contrib(0, 10, 0, vec![1])).1, one("accepted"));
    assert_eq!(send_in(&dp, fam, &contrib(1, 10, 0, vec![2])).1, one("result"));
    // 10 - 7 = 3 > window 2: stale; 10 - 8 = 2: still live.
    assert_eq!(send_in(&dp, fam, &contrib(0, 7, 0, vec![5])).1, one(DropReason::StaleRound.label()));
    assert_eq!(send_in(&dp, fam, &contrib(0, 8, 0, vec![5])).1, one("accepted"));
    assert_eq!(dp.job(JOB).unwrap().unwrap().window, 2);
}

#[test]
fn slot_pool_bound_per_job() {
    slot_pool_bound_per_job_in(Family::V4);
}

#[test]
fn slot_pool_bound_per_job_over_ipv6() {
    slot_pool_bound_per_job_in(Family::V6);
}

fn slot_pool_bound_per_job_in(fam: Family) {
    let dp = load();
    dp.set_job(JOB, &job_in(fam, 2, 2)).unwrap();
    assert_eq!(send_in(&dp, fam, &contrib(0, 1, 0, vec![1])).1, one("accepted"));
    assert_eq!(send_in(&dp, fam, &contrib(0, 1, 1, vec![1])).1, one("accepted"));
    assert_eq!(
        send_in(&dp, fam, &contrib(0, 1, 2, vec![1])).1,
        one(DropReason::SlotPoolFull.label())
    );
    assert_eq!(dp.slots_in_use(), 2);
    // completing one frees its slot
    assert_eq!(send_in(&dp, fam, &contrib(1, 1, 0, vec![1])).1, one("result"));
    assert_eq!(send_in(&dp, fam, &contrib(0, 1, 2, vec![1])).1, one("accepted"));
    assert_eq!(dp.job_state(JOB).unwrap().unwrap().active_slots, 2);
    dp.remove_job(JOB).unwrap();
    assert_eq!(dp.slots_in_use(), 0, "remove_job frees the job's slots");
}

#[test]
fn slot_mismatch_and_retransmission_before_completion() {
    slot_mismatch_and_retransmission_before_completion_in(Family::V4);
}

#[test]
fn slot_mismatch_and_retransmission_before_completion_over_ipv6() {
    slot_mismatch_and_retransmission_before_completion_in(Family::V6);
}

fn slot_mismatch_and_retransmission_before_completion_in(fam: Family) {
    let dp = load();
    dp.set_job(JOB, &job_in(fam, 3, 0)).unwrap();
    assert_eq!(send_in(&dp, fam, &contrib(0, 5, 0, vec![1, 2])).1, one("accepted"));
    assert_eq!(
        send_in(&dp, fam, &contrib(0, 5, 0, vec![1, 2])).1,
        one(DropReason::Retransmission.label())
    );
    let mut max = contrib(1, 5, 0, vec![1, 2]);
    max.op = abi::Op::Max as u8;
    assert_eq!(send_in(&dp, fam, &max).1, one(DropReason::SlotMismatch.label()));
    assert_eq!(
        send_in(&dp, fam, &contrib(1, 5, 0, vec![1, 2, 3])).1,
        one(DropReason::SlotMismatch.label())
    );
    assert_eq!(
        send_in(&dp, fam, &contrib(1, 5, 0, vec![10, 20])).1,
        one("accepted")
    );
    let mut last = contrib(2, 5, 0, vec![100, 200]);
    last.flags = abi::AGG_F_LAST_FRAGMENT;
    let (v, d, out) = send_in(&dp, fam, &last);
    assert_eq!((v, d), (XDP_PASS, one("result")));
    assert_eq!(
        out[fam.payload_off() + 21],
        abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT
    );
    assert_eq!(
        out[fam.payload_off() + 24..],
        [111i32.to_be_bytes(), 222i32.to_be_bytes()].concat()
    );
}

/// OVERFLOW on a contribution (a clamped input: a subtree's clamped result
/// or a float its sender clamped when quantizing) is carried into the
/// RESULT like LAST_FRAGMENT, whichever rank brings it and although the sum
/// itself fits; a slot without it gets a RESULT without it.
#[test]
fn overflow_on_a_contribution_is_carried_into_the_result() {
    overflow_on_a_contribution_is_carried_into_the_result_in(Family::V4);
}

#[test]
fn overflow_on_a_contribution_is_carried_into_the_result_over_ipv6() {
    overflow_on_a_contribution_is_carried_into_the_result_in(Family::V6);
}

fn overflow_on_a_contribution_is_carried_into_the_result_in(fam: Family) {
    let dp = load();
    dp.set_job(JOB, &job_in(fam, 3, 0)).unwrap();
    for (frag, carrier) in [(0u32, 0u16), (1000, 1), (2000, 2)] {
        // 600 elements: three 256-element blocks, so the early per-block
        // result path and the result stage both run.
        let mut outs = Vec::new();
        for r in 0..3u16 {
            let v = if r == 0 { i32::MAX } else { -1 };
            let mut a = contrib(r, 9, frag, vec![v; 600]);
            if r == carrier {
                a.flags = abi::AGG_F_OVERFLOW;
            }
            outs.push(send_in(&dp, fam, &a));
        }
        let (v, d, out) = outs.pop().unwrap();
        assert_eq!((v, d), (XDP_PASS, one("result")), "carrier {carrier}");
        assert_eq!(out[fam.payload_off() + 21], abi::AGG_F_RESULT | abi::AGG_F_OVERFLOW, "carrier {carrier}");
        assert_eq!(out[fam.payload_off() + 24..fam.payload_off() + 28], (i32::MAX - 2).to_be_bytes());
    }
    // The same sums without the flag: no OVERFLOW.
    for r in 0..3u16 {
        let v = if r == 0 { i32::MAX } else { -1 };
        let (_, _, out) = send_in(&dp, fam, &contrib(r, 9, 3000, vec![v; 600]));
        if r == 2 {
            assert_eq!(out[fam.payload_off() + 21], abi::AGG_F_RESULT);
        }
    }
}

#[test]
fn weighted_avg_truncates_toward_zero_and_clamps() {
    weighted_avg_truncates_toward_zero_and_clamps_in(Family::V4);
}

#[test]
fn weighted_avg_truncates_toward_zero_and_clamps_over_ipv6() {
    weighted_avg_truncates_toward_zero_and_clamps_in(Family::V6);
}

fn weighted_avg_truncates_toward_zero_and_clamps_in(fam: Family) {
    let dp = load();
    let mut j = job_in(fam, 2, 0);
    j.weights = vec![1, 2];
    dp.set_job(JOB, &j).unwrap();
    let mut a = contrib(0, 1, 0, vec![-7, 7, i32::MAX, i32::MIN]);
    a.op = abi::Op::Avg as u8;
    let mut b = contrib(1, 1, 0, vec![0, 0, i32::MAX, i32::MIN]);
    b.op = abi::Op::Avg as u8;
    assert_eq!(send_in(&dp, fam, &a).1, one("accepted"));
    let (_, d, out) = send_in(&dp, fam, &b);
    assert_eq!(d, one("result"));
    let want: Vec<u8> = [-2i32, 2, i32::MAX, i32::MIN]
        .iter()
        .flat_map(|v| v.to_be_bytes())
        .collect();
    assert_eq!(out[fam.payload_off() + 24..], want[..]);
    assert_eq!(
        out[fam.payload_off() + 21] & abi::AGG_F_OVERFLOW,
        0,
        "AVG of int32 values never overflows"
    );
    // SUM of the same clamps with OVERFLOW
    let mut a = contrib(0, 2, 0, vec![i32::MAX, i32::MIN]);
    a.op = abi::Op::Sum as u8;
    let mut b = contrib(1, 2, 0, vec![1, -1]);
    b.op = abi::Op::Sum as u8;
    send_in(&dp, fam, &a);
    let (_, d, out) = send_in(&dp, fam, &b);
    assert_eq!(d, one("result"));
    assert_eq!(
        out[fam.payload_off() + 24..],
        [i32::MAX.to_be_bytes(), i32::MIN.to_be_bytes()].concat()
    );
    assert_ne!(out[fam.payload_off() + 21] & abi::AGG_F_OVERFLOW, 0);
}

#[test]
fn count_above_kernel_limit_is_too_large() {
    count_above_kernel_limit_is_too_large_in(Family::V4);
}

#[test]
fn count_above_kernel_limit_is_too_large_over_ipv6() {
    count_above_kernel_limit_is_too_large_in(Family::V6);
}

fn count_above_kernel_limit_is_too_large_in(fam: Family) {
    // AGGBOX_MAX_ELEMS (16384) covers every IPv4 datagram (at most 16370
    // elements); the largest one, a multi-buffer frame, is aggregated.
    let dp = load();
    dp.set_job(JOB, &job_in(fam, 2, 0)).unwrap();
    let a = contrib(0, 1, 0, vec![1; 16370]);
    assert_eq!(send_in(&dp, fam, &a).1, one("accepted"));
    // A count above the build's limit cannot be a legal datagram: the UDP
    // length cannot hold it, so it is larger than what the datagram holds.
    let mut a = contrib(1, 1, 0, vec![1; 4]);
    a.count = (abi::MAX_ELEMS + 1) as u16;
    assert_eq!(send_in(&dp, fam, &a).1, one(DropReason::CountTooLarge.label()));
}

#[test]
fn missed_tail_call_is_counted() {
    missed_tail_call_is_counted_in(Family::V4);
}

#[test]
fn missed_tail_call_is_counted_over_ipv6() {
    missed_tail_call_is_counted_in(Family::V6);
}

fn missed_tail_call_is_counted_in(fam: Family) {
    for (index, sends) in [
        (abi::CALL_SLOT, 1),
        (abi::CALL_ADD, 1),
        (abi::CALL_RESULT, 2),
    ] {
        let dp = load();
        // The hash-map chain (a fast slot would serve these in the entry
        // program, with no tail call).
        let mut chain_job = job_in(fam, 2, 0);
        chain_job.flags = abi::JOB_F_NO_FAST;
        dp.set_job(JOB, &chain_job).unwrap();
        dp.unset_tail_call(index).unwrap();
        let values = vec![1; 100];
        let mut last = Vec::new();
        for rank in 0..sends {
            last = send_in(&dp, fam, &contrib(rank, 1, 0, values.clone())).1;
        }
        assert_eq!(
            last,
            one(DropReason::MissedTailCall.label()),
            "CALL {index}"
        );
    }
}

/// Prints the verifier cost of every program (recorded in docs/DATAPLANE.md)
/// and checks the chain is far from the verifier's limits.
#[test]
fn program_sizes() {
    let dp = load();
    for p in dp.programs().expect("programs") {
        println!(
            "{:<14} xlated {:>4} insns, verifier processed {:>6} insns",
            p.name, p.xlated_insns, p.verified_insns
        );
        // The entry program's fast-slot loops (docs/DATAPLANE.md, "Fast
        // slots") are the largest walk: ~0.4 M on 6.1, ~0.71 M on 6.12 and
        // 6.18 (docs/MATRIX.md), under the verifier's 1 M budget.
        assert!(p.verified_insns > 0 && p.verified_insns < 800_000, "{p:?}");
    }
}

/// Per-job counters (`job_stats`): each category moves by exactly the
/// datagrams sent to it, one job's traffic never moves another job's
/// counters, drops before the job is known (and a previous packet's job left
/// in the per-CPU scratch) are never attributed, and the entry lives and dies
/// with the job.
#[test]
fn per_job_counters_are_exact_and_isolated() {
    const A: u16 = 31;
    const B: u16 = 32;
    let addr = |r: u8| Ipv4Addr::new(10, 88, 0, 1 + r);
    let job = |id: u16| XdpJob {
        id,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: vec![addr(0).into(), addr(1).into()],
        weights: vec![],
        vector_len: 8,
        slots: 16,
        flags: 0,
        result_group: None,
        window: 1,
        frag_elems: 0,
    };
    let dp = load();
    dp.set_job(A, &job(A)).unwrap();
    dp.set_job(B, &job(B)).unwrap();
    let zero = abi::JobStats::default();
    assert_eq!(dp.job_stats(A).unwrap(), Some(zero), "created zeroed");
    assert_eq!(dp.job_stats(B).unwrap(), Some(zero));

    // (rank whose address sends, datagram) -> verdict; returns payload bytes.
    let send = |src: u8, a: &Agg, verdict: u32| -> u64 {
        let payload = a.bytes();
        let n = payload.len() as u64;
        let (v, _) = dp.test_run(&Frame::udp(addr(src), payload).build()).unwrap();
        assert_eq!(v, verdict, "{a:?}");
        n
    };
    let agg = |job: u16, rank: u16, round: u32, values: Vec<i32>| {
        let mut a = Agg::new(job, rank, abi::Op::Sum as u8, values);
        a.round = round;
        a
    };

    let mut want = abi::JobStats::default();
    // accepted, retransmission of a claimed rank, result, then a
    // retransmission of the completed fragment.
    want.bytes += send(0, &agg(A, 0, 1, vec![1, 2]), XDP_DROP);
    want.accepted += 1;
    want.bytes += send(0, &agg(A, 0, 1, vec![1, 2]), XDP_DROP);
    want.retransmissions += 1;
    want.bytes += send(1, &agg(A, 1, 1, vec![3, 4]), XDP_PASS);
    want.results += 1;
    want.bytes += send(0, &agg(A, 0, 1, vec![1, 2]), XDP_DROP);
    want.retransmissions += 1;
    assert_eq!(dp.job_stats(A).unwrap(), Some(want));
    // A clamped RESULT: result and overflow_result.
    want.bytes += send(0, &agg(A, 0, 2, vec![i32::MAX]), XDP_DROP);
    want.accepted += 1;
    want.bytes += send(1, &agg(A, 1, 2, vec![i32::MAX]), XDP_PASS);
    want.results += 1;
    want.overflow_results += 1;
    // Round 0 is more than window 1 behind round 2: stale.
    want.bytes += send(0, &agg(A, 0, 0, vec![5]), XDP_DROP);
    want.stale += 1;
    assert_eq!(dp.job_stats(A).unwrap(), Some(want));
    // Drops after the job is known: rank out of range, source mismatch,
    // beyond vector_len, slot mismatch.
    want.bytes += send(0, &agg(A, 5, 3, vec![1]), XDP_DROP);
    want.bytes += send(1, &agg(A, 0, 3, vec![1]), XDP_DROP);
    let mut beyond = agg(A, 0, 3, vec![1, 2]);
    beyond.frag_off = 7;
    want.bytes += send(0, &beyond, XDP_DROP);
    want.bytes += send(0, &agg(A, 0, 3, vec![1, 2]), XDP_DROP);
    want.accepted += 1;
    want.bytes += send(1, &agg(A, 1, 3, vec![1]), XDP_DROP);
    want.dropped += 4;
    assert_eq!(dp.job_stats(A).unwrap(), Some(want));

    // Drops before the job is known stay global only, and the previous
    // datagram's job (A, in the per-CPU scratch) is never charged with them.
    let before = dp.stats().unwrap();
    send(0, &agg(99, 0, 1, vec![1]), XDP_DROP); // unknown job
    let mut bad_op = agg(A, 0, 4, vec![1]);
    bad_op.op = 42;
    send(0, &bad_op, XDP_DROP);
    let mut truncated = agg(A, 0, 4, vec![1]).bytes();
    truncated.truncate(20);
    dp.test_run(&Frame::udp(addr(0), truncated).build()).unwrap();
    // An op for user space with no AF_XDP socket is passed: global only.
    let mut prod = agg(A, 0, 5, vec![1]);
    prod.op = abi::Op::Prod as u8;
    send(0, &prod, XDP_PASS);
    let after = dp.stats().unwrap();
    assert_eq!(after.drop(DropReason::UnknownJob).packets, before.drop(DropReason::UnknownJob).packets + 1);
    assert_eq!(after.drop(DropReason::InvalidOp).packets, before.drop(DropReason::InvalidOp).packets + 1);
    assert_eq!(
        after.outcome(Outcome::UserspaceUnavailable).packets,
        before.outcome(Outcome::UserspaceUnavailable).packets + 1
    );
    assert_eq!(dp.job_stats(A).unwrap(), Some(want), "nothing of that charged to A");
    assert_eq!(dp.job_stats(B).unwrap(), Some(zero), "A's traffic never moves B");

    // B's traffic never moves A.
    let mut want_b = abi::JobStats::default();
    want_b.bytes += send(0, &agg(B, 0, 1, vec![7]), XDP_DROP);
    want_b.bytes += send(1, &agg(B, 1, 1, vec![8]), XDP_PASS);
    want_b.accepted += 1;
    want_b.results += 1;
    assert_eq!(dp.job_stats(B).unwrap(), Some(want_b));
    assert_eq!(dp.job_stats(A).unwrap(), Some(want));

    // Reconfiguring keeps the counters; removal deletes them; a re-added
    // job starts from zero.
    dp.set_job(B, &job(B)).unwrap();
    assert_eq!(dp.job_stats(B).unwrap(), Some(want_b));
    dp.remove_job(A).unwrap();
    assert_eq!(dp.job_stats(A).unwrap(), None);
    send(0, &agg(A, 0, 9, vec![1]), XDP_DROP); // unknown job now
    dp.set_job(A, &job(A)).unwrap();
    assert_eq!(dp.job_stats(A).unwrap(), Some(zero));
}

/// The RESULT's seq: the completing contribution's (so a runtime job's
/// fragment keeps the contribution seq every rank gave it, which the node's
/// result service acknowledges), except for a job whose results go upstream,
/// where it is this node's own counter (the RESULT becomes its contribution
/// to the parent and is numbered like one).
#[test]
fn result_seq_is_the_completing_contributions_unless_results_go_upstream() {
    // 8 elements take a fast slot; 400 (more than a fast slot holds) the
    // hash-map chain: both write the RESULT header.
    for (flags, upstream, n) in [(0, false, 8), (abi::JOB_F_HAS_PARENT, true, 8), (0, false, 400), (abi::JOB_F_HAS_PARENT, true, 400)] {
        let dp = load();
        dp.set_job(JOB, &XdpJob { flags, ..job(2, 16) }).expect("set_job");
        for (k, round) in [4u32, 5, 6].into_iter().enumerate() {
            let mut a = contrib(0, round, 0, vec![1; n]);
            a.seq = 1000 + round;
            assert_eq!(send(&dp, &a).0, XDP_DROP);
            let mut b = contrib(1, round, 0, vec![2; n]);
            b.seq = 2000 + round;
            let (verdict, _, out) = send(&dp, &b);
            assert_eq!(verdict, XDP_PASS, "round {round}: RESULT");
            let seq = u32::from_be_bytes(out[PAYLOAD_OFF + 8..PAYLOAD_OFF + 12].try_into().unwrap());
            let want = if upstream { k as u32 } else { 2000 + round };
            assert_eq!(seq, want, "flags {flags:#x}, {n} elements, round {round}");
        }
    }
}

/// `XdpPlane::reset` is what lets the BPF tests share loaded planes
/// (`bpf_common::load`): whatever a test leaves behind, the next one must
/// start from the state of a fresh load.
#[test]
fn a_reset_plane_is_in_the_state_of_a_fresh_load() {
    require_root();
    let dp = XdpPlane::load().expect("load");
    dp.set_job(JOB, &job(2, 0)).unwrap();
    // Round 5 left open (a slot holding rank 0's 1), round 6 completed, the
    // chain's RESULT stage taken out.
    assert_eq!(send(&dp, &contrib(0, 5, 0, vec![1])).1, one("accepted"));
    assert_eq!(send(&dp, &contrib(0, 6, 0, vec![1])).1, one("accepted"));
    assert_eq!(send(&dp, &contrib(1, 6, 0, vec![2])).1, one("result"));
    dp.unset_tail_call(abi::CALL_RESULT).unwrap();
    assert!(dp.slots_in_use() + dp.fast_slots_in_use() > 0, "round 5 holds a slot");
    assert!(dp.stats().unwrap().total_packets() > 0);

    dp.reset().unwrap();
    assert!(dp.jobs().unwrap().is_empty(), "no job survives");
    assert!(dp.job_state(JOB).unwrap().is_none());
    assert_eq!(dp.stats().unwrap().total_packets(), 0, "counters zeroed");
    assert_eq!(dp.slots_in_use(), 0);
    assert_eq!(dp.fast_slots_in_use(), 0);
    assert_eq!(dp.slot_owners_in_use(), 0);
    assert_eq!(dp.blocks_in_use().unwrap(), 0);

    // Configured again, round 5 starts empty (rank 1 alone does not complete
    // it), completes with the RESULT stage back in place, and round 6 is no
    // longer marked completed.
    dp.set_job(JOB, &job(2, 0)).unwrap();
    assert_eq!(send(&dp, &contrib(1, 5, 0, vec![10])).1, one("accepted"));
    let (verdict, deltas, out) = send(&dp, &contrib(0, 5, 0, vec![20]));
    assert_eq!((verdict, deltas), (XDP_PASS, one("result")));
    assert_eq!(out[PAYLOAD_OFF + 24..], 30i32.to_be_bytes());
    assert_eq!(send(&dp, &contrib(0, 6, 0, vec![1])).1, one("accepted"));
}
