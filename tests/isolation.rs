//! Isolation, spoofing and quotas (docs/ROBUSTNESS.md), through
//! BPF_PROG_TEST_RUN of the XDP program (and, for broadcast, of the TC
//! programs inside a testbed host):
//!
//! - a datagram whose IPv4 source is not its rank's address, a rank of job A
//!   sending as job B, a job that does not exist, replayed contributions of
//!   an old (stale) and of a completed round: each dropped and counted under
//!   its reason, and nothing else changes (slots, every job's `job_state`),
//!   while job B's interleaved round still completes with the exact result;
//! - a broadcast datagram of a group not configured on this node passes the
//!   TC programs untouched and is counted `unknown_group`;
//! - quotas: job A floods new fragments far past its `slots` bound; its
//!   excess is counted `slot_pool_full`, job B keeps aggregating exactly,
//!   and the bound and the active count are visible in the metrics
//!   (`aggbox_job_slots_limit`, `aggbox_job_slots_active`).
//!
//! Needs root: `sudo -E cargo test --test isolation`.

#[path = "../src/testing/bpffs.rs"]
#[allow(dead_code)]
mod bpffs;
#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod bpf_common;

use std::net::{IpAddr, Ipv4Addr};

use aggbox::wire::abi::{self, DropReason, Op, Outcome};
use aggbox::kernel::xdp::{XdpPlane, XdpJob};
use aggbox::wire::reducer;
use bpf_common::*;

fn addr(job: u16, rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, job as u8, 11 + rank as u8)
}

fn job(id: u16, workers: u16, slots: u32) -> XdpJob {
    XdpJob {
        id,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: (0..workers).map(|r| addr(id, r).into()).collect(),
        weights: vec![],
        vector_len: 4096,
        slots,
        flags: 0,
        result_group: None,
        window: 4,
        frag_elems: 0,
    }
}

/// Everything a rejected datagram must not change.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    slots: usize,
    owners: usize,
    states: Vec<(u16, Option<abi::JobState>)>,
}

fn snapshot(dp: &XdpPlane, ids: &[u16]) -> Snapshot {
    Snapshot {
        slots: dp.slots_in_use(),
        owners: dp.slot_owners_in_use(),
        states: ids.iter().map(|&id| (id, dp.job_state(id).expect("job_state"))).collect(),
    }
}

fn contribution(job: u16, rank: u16, round: u32, frag_off: u32, values: &[i32]) -> Agg {
    let mut a = Agg::new(job, rank, Op::Sum as u8, values.to_vec());
    a.round = round;
    a.frag_off = frag_off;
    a.seq = round * 100 + u32::from(rank);
    a
}

/// Run one frame; returns (verdict, output, single (label, packets) delta).
fn run(dp: &XdpPlane, src: IpAddr, a: &Agg) -> (u32, Vec<u8>, &'static str) {
    let frame = Frame::udp(src, a.bytes()).build();
    let before = dp.stats().expect("stats");
    let (verdict, out) = dp.test_run(&frame).expect("test_run");
    let d = deltas(&before, &dp.stats().expect("stats"));
    assert_eq!(d.len(), 1, "exactly one counter moves per datagram: {d:?}");
    assert_eq!(d[0].1, 1);
    (verdict, out, d[0].0)
}

/// A rejected datagram: dropped, counted under `reason`, nothing else changed.
fn expect_rejected(dp: &XdpPlane, ids: &[u16], src: IpAddr, a: &Agg, reason: DropReason, what: &str) {
    let before = snapshot(dp, ids);
    let frame = Frame::udp(src, a.bytes()).build();
    let (verdict, out, label) = run(dp, src, a);
    assert_eq!(label, reason.label(), "{what}");
    assert_eq!(verdict, XDP_DROP, "{what}: dropped");
    assert_eq!(out, frame, "{what}: frame untouched");
    assert_eq!(snapshot(dp, ids), before, "{what}: no slot or job state changed");
}

/// Contribute a whole round of `job` (all ranks); returns the RESULT payload.
fn full_round(dp: &XdpPlane, cfg: &XdpJob, round: u32, values: &dyn Fn(u16) -> Vec<i32>) -> Vec<u8> {
    let workers = cfg.ranks.len() as u16;
    let mut result = None;
    for rank in 0..workers {
        let (verdict, out, label) = run(dp, cfg.ranks[rank as usize], &contribution(cfg.id, rank, round, 0, &values(rank)));
        if rank + 1 < workers {
            assert_eq!(label, Outcome::Accepted.label(), "job {} round {round} rank {rank}", cfg.id);
        } else {
            assert_eq!(label, Outcome::Result.label(), "job {} round {round} completes", cfg.id);
            assert_eq!(verdict, XDP_PASS);
            result = Some(out[PAYLOAD_OFF + 24..].to_vec());
        }
    }
    result.expect("RESULT")
}

fn expected_sum(workers: u16, values: &dyn Fn(u16) -> Vec<i32>) -> Vec<u8> {
    let vals: Vec<Vec<i32>> = (0..workers).map(values).collect();
    let contribs: Vec<(&[i32], i32)> = vals.iter().map(|v| (v.as_slice(), 1)).collect();
    let r = reducer::reduce(Op::Sum, &contribs).expect("reduce");
    let mut out = Vec::new();
    r.write_be(&mut out);
    out
}

#[test]
fn spoofed_foreign_unknown_and_replayed_datagrams_change_nothing() {
    let dp = load();
    let a = job(1, 3, 64);
    let b = job(2, 2, 64);
    dp.set_job(1, &a).expect("job A");
    dp.set_job(2, &b).expect("job B");
    let ids = [1u16, 2, 3];
    let vals_a = |r: u16| vec![i32::from(r) + 1; 8];
    let vals_b = |r: u16| vec![(i32::from(r) + 1) * 1000; 8];

    // Complete rounds 1..=6 of job A: its newest completed round is 6.
    for round in 1..=6 {
        assert_eq!(full_round(&dp, &a, round, &vals_a), expected_sum(3, &vals_a));
    }

    // Job B's round 1 is half done: rank 0 has contributed.
    let (_, _, l) = run(&dp, b.ranks[0], &contribution(2, 0, 1, 0, &vals_b(0)));
    assert_eq!(l, Outcome::Accepted.label());

    // Job A's round 7 is half done too (a live slot the spoofs must not touch).
    let (_, _, l) = run(&dp, a.ranks[0], &contribution(1, 0, 7, 0, &vals_a(0)));
    assert_eq!(l, Outcome::Accepted.label());

    // 1. Source address not its rank's (rank 1's address claiming rank 2,
    //    an outsider claiming rank 1), into the live slot.
    expect_rejected(&dp, &ids, a.ranks[1], &contribution(1, 2, 7, 0, &[9; 8]), DropReason::SourceMismatch, "rank 2 from rank 1's address");
    expect_rejected(&dp, &ids, Ipv4Addr::new(10, 77, 9, 9).into(), &contribution(1, 1, 7, 0, &[9; 8]), DropReason::SourceMismatch, "outsider as rank 1");
    // 2. Job A's rank address sending as job B (same rank number, B's live slot).
    expect_rejected(&dp, &ids, a.ranks[1], &contribution(2, 1, 1, 0, &[9; 8]), DropReason::SourceMismatch, "job A rank 1 as job B rank 1");
    expect_rejected(&dp, &ids, a.ranks[0], &contribution(2, 0, 1, 0, &[9; 8]), DropReason::SourceMismatch, "job A rank 0 as job B rank 0");
    // ... and as a rank job B does not have.
    expect_rejected(&dp, &ids, a.ranks[2], &contribution(2, 2, 1, 0, &[9; 8]), DropReason::RankOutOfRange, "job A rank 2 as job B rank 2");
    // 3. A job that does not exist (from a valid rank address of A).
    expect_rejected(&dp, &ids, a.ranks[0], &contribution(3, 0, 1, 0, &[9; 8]), DropReason::UnknownJob, "job 3 does not exist");
    // 4. Replays: a contribution of round 1 (stale: 6 - 1 > window 4) and
    //    of the completed round 6 (late retransmission), byte for byte.
    expect_rejected(&dp, &ids, a.ranks[1], &contribution(1, 1, 1, 0, &vals_a(1)), DropReason::StaleRound, "replay of round 1");
    expect_rejected(&dp, &ids, a.ranks[1], &contribution(1, 1, 6, 0, &vals_a(1)), DropReason::Retransmission, "replay of completed round 6");
    // A replay of the live round 7's rank 0: retransmission, not added twice.
    expect_rejected(&dp, &ids, a.ranks[0], &contribution(1, 0, 7, 0, &vals_a(0)), DropReason::Retransmission, "replay into live round 7");
    // A RESULT datagram replayed at the aggregator (rank 0xFFFF).
    let mut res = contribution(1, abi::RESULT_RANK, 6, 0, &[6; 8]);
    res.flags = abi::AGG_F_RESULT;
    expect_rejected(&dp, &ids, a.ranks[0], &res, DropReason::RankOutOfRange, "replayed RESULT");

    // The live rounds complete with exactly the genuine values.
    let (_, out, l) = run(&dp, b.ranks[1], &contribution(2, 1, 1, 0, &vals_b(1)));
    assert_eq!(l, Outcome::Result.label(), "job B round 1 completes");
    assert_eq!(out[PAYLOAD_OFF + 24..], expected_sum(2, &vals_b)[..], "job B result exact");
    for rank in 1..3 {
        let (_, out, l) = run(&dp, a.ranks[rank as usize], &contribution(1, rank, 7, 0, &vals_a(rank)));
        if rank == 2 {
            assert_eq!(l, Outcome::Result.label());
            assert_eq!(out[PAYLOAD_OFF + 24..], expected_sum(3, &vals_a)[..], "job A result exact");
        }
    }
    assert_eq!(dp.slots_in_use(), 0);
    let st = dp.job_state(1).unwrap().unwrap();
    assert_eq!((st.active_slots, st.completed, st.newest_round), (0, 1, 7));
    assert_eq!(dp.job_stats(1).unwrap().unwrap().results, 7, "job A: 7 completions");
    let st = dp.job_state(2).unwrap().unwrap();
    assert_eq!((st.active_slots, st.completed, st.newest_round), (0, 1, 1));
    assert_eq!(dp.job_stats(2).unwrap().unwrap().results, 1, "job B: 1 completion");
    assert!(dp.job_state(3).unwrap().is_none(), "an unknown job gets no state");
}

#[test]
fn one_job_cannot_exhaust_another_jobs_slots() {
    let dp = load();
    let a = job(1, 2, 8);
    let b = job(2, 2, 8);
    dp.set_job(1, &a).expect("job A");
    dp.set_job(2, &b).expect("job B");
    let vals_b = |r: u16| vec![i32::from(r) * 7 - 3; 32];

    // Job A's rank 0 floods 200 new fragments (its rank 1 never answers).
    let mut accepted = 0;
    let mut full = 0;
    for i in 0..200u32 {
        let (_, _, l) = run(&dp, a.ranks[0], &contribution(1, 0, 1, i * 8, &[1; 8]));
        match l {
            l if l == Outcome::Accepted.label() => accepted += 1,
            l if l == DropReason::SlotPoolFull.label() => full += 1,
            other => panic!("flood datagram {i}: {other}"),
        }
        // Job B keeps aggregating exactly while A floods.
        if i % 20 == 0 {
            let round = 1 + i / 20;
            assert_eq!(full_round(&dp, &b, round, &vals_b), expected_sum(2, &vals_b), "job B round {round}");
        }
    }
    assert_eq!((accepted, full), (8, 192), "A gets exactly its bound, the excess is counted slot_pool_full");
    assert_eq!(dp.job_state(1).unwrap().unwrap().active_slots, 8);
    assert_eq!(dp.job_state(2).unwrap().unwrap().active_slots, 0);
    assert_eq!(dp.stats().unwrap().drop(DropReason::SlotPoolFull).packets, 192);

    // B can hold 8 open slots of its own at the same time.
    for i in 0..8u32 {
        let (_, _, l) = run(&dp, b.ranks[0], &contribution(2, 0, 100, i * 32, &vals_b(0)));
        assert_eq!(l, Outcome::Accepted.label(), "job B slot {i} while A is at its bound");
    }
    let (_, _, l) = run(&dp, b.ranks[0], &contribution(2, 0, 100, 8 * 32, &vals_b(0)));
    assert_eq!(l, DropReason::SlotPoolFull.label(), "B's own bound applies to B");

    // Limits and active counts are visible in the metrics.
    // The pins go to a bpffs of the test's own (none need be mounted at
    // /sys/fs/bpf), unmounted and removed when it drops.
    let bpffs = crate::bpffs::PrivateBpffs::mount("isolation").expect("mounting a private bpffs");
    let dir = bpffs.path.join("pins");
    std::fs::create_dir_all(&dir).expect("pin dir");
    dp.pin_maps(&dir).expect("pin maps");
    // Open fragments in the hash-map slots hold one pool block each (at most
    // 256 elements); fast slots (docs/DATAPLANE.md) hold none.
    let hash_slots = (dp.slots_in_use() - dp.fast_slots_in_use()) as f64;
    let text = aggbox::node::metrics::render(&[aggbox::node::metrics::source_for("fuzz0", &dir, vec![], None)]).expect("render");
    for (name, want) in [
        ("aggbox_job_slots_limit{iface=\"fuzz0\",aggbox_job=\"1\"}", 8.0),
        ("aggbox_job_slots_active{iface=\"fuzz0\",aggbox_job=\"1\"}", 8.0),
        ("aggbox_job_slots_limit{iface=\"fuzz0\",aggbox_job=\"2\"}", 8.0),
        ("aggbox_job_slots_active{iface=\"fuzz0\",aggbox_job=\"2\"}", 8.0),
        ("aggbox_blocks_in_use{iface=\"fuzz0\"}", hash_slots),
        ("aggbox_blocks_capacity{iface=\"fuzz0\"}", abi::MAX_BLOCKS as f64),
    ] {
        let got = text
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing from the metrics:\n{text}"));
        assert_eq!(got, want, "{name}");
    }
    assert!(text.contains("aggbox_dropped_total{iface=\"fuzz0\",reason=\"slot_pool_full\"} 193"), "pool-full drops counted:\n{}", text.lines().filter(|l| l.contains("slot_pool_full")).collect::<Vec<_>>().join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
    drop(bpffs);
}

#[test]
fn broadcast_for_a_group_not_configured_here_passes_untouched() {
    use aggbox::kernel::tc::{self, TcPlane, TcProgram, TC_ACT_OK};
    use crate::testbed::{in_netns, Testbed, TestbedConfig};
    use std::net::SocketAddrV4;

    require_root();
    let tb = Testbed::up(TestbedConfig {
        hosts: 2,
        static_neigh: true,
        ..Default::default()
    })
    .expect("testbed");
    let plane = TcPlane::load().expect("load TC");
    let (h0, h1) = (tb.host(0), tb.host(1));
    plane.set_group(9, &[SocketAddrV4::new(h1.addr, 7200)]).expect("group 9");
    let mut payload = Vec::new();
    payload.extend_from_slice(&abi::MAGIC_BCAST.to_be_bytes());
    payload.extend_from_slice(&1u32.to_be_bytes()); // mask
    payload.extend_from_slice(&5u32.to_be_bytes()); // seq
    payload.extend_from_slice(&10u16.to_be_bytes()); // group 10: not configured
    payload.push(abi::BCAST_F_FORWARD);
    payload.push(0);
    payload.extend_from_slice(b"not for us");
    let mut f = Frame::udp(h0.addr, payload);
    f.dst = h1.addr.into();
    f.dport = 7200;
    let frame = f.build();
    let results = in_netns(&h0.netns, || {
        let eth0 = tc::ifindex("eth0").expect("eth0");
        let mut out = Vec::new();
        for prog in [TcProgram::Egress, TcProgram::Ingress] {
            let before = plane.stats().expect("stats");
            let run = plane.test_run(prog, &frame, eth0, 0).expect("test_run");
            let after = plane.stats().expect("stats");
            out.push((prog, run, before, after));
        }
        out
    })
    .expect("netns");
    for (prog, run, before, after) in results {
        assert_eq!(run.verdict, TC_ACT_OK, "{prog:?}: passes");
        assert_eq!(run.data, frame, "{prog:?}: untouched");
        assert_eq!(after.datagrams() - before.datagrams(), 1, "{prog:?}: one datagram counted");
        let unknown = after.packets(abi::BcastStat::UnknownGroup) - before.packets(abi::BcastStat::UnknownGroup);
        let not_aggbox = after.packets(abi::BcastStat::NotAggbox) - before.packets(abi::BcastStat::NotAggbox);
        assert_eq!(unknown + not_aggbox, 1, "{prog:?}: counted as unknown_group (or not for a forwarding port)");
        if prog == TcProgram::Egress {
            assert_eq!(unknown, 1, "egress counts unknown_group");
        }
        assert_eq!(after.packets(abi::BcastStat::CopySent), before.packets(abi::BcastStat::CopySent), "{prog:?}: no copy sent");
    }
    drop(plane);
    tb.down().expect("testbed down");
}
