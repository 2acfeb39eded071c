//! End-to-end aggregation over real UDP in a network-namespace testbed.
//!
//! Host 0 is the aggregator: AggBox is attached to its `eth0` with
//! `node::attach` (pins on a private bpffs), and a plain UDP socket bound to
//! the job's `result_port` in host 0 plays the application. The other hosts
//! send contributions through the bridge; ranks beyond one per host send from
//! the hosts' extra addresses (each rank's socket is bound to its address), so
//! 64 ranks need only 4 sender namespaces. Every RESULT is compared with the
//! reference reducer as it arrives (`common_netns::run_round`); duplicates are
//! injected, and lost datagrams are recovered by resending (deduplicated by
//! the aggregator), so the checks are exact without any timing assumption.
//!
//! Needs root: `sudo -E cargo test --test netns_aggregate`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod common_netns;

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::Duration;

use aggbox::wire::abi::{DropReason, Op, Outcome};
use aggbox::config::Config;
use aggbox::kernel::xdp::{Stats, XdpMode};
use aggbox::node::{self, Attachment};
use aggbox::wire::proto::{self, AggHeader};
use crate::testbed::{Testbed, TestbedConfig};
use common_netns::*;

const ROUND_TIMEOUT: Duration = Duration::from_secs(30);

fn testbed(hosts: usize, extra_addrs: u32) -> Testbed {
    require_root();
    Testbed::up(TestbedConfig {
        hosts,
        extra_addrs,
        static_neigh: true,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("building the testbed: {e}"))
}

/// Run `f` on a thread inside host 0 with AggBox attached to its eth0
/// (config `jobs`, pins under `pins`), then detach and check that nothing is
/// left: no XDP on eth0 or lo, no pins.
fn with_aggregator<T: Send>(
    tb: &Testbed,
    pins: &Bpffs,
    jobs: &[JobSpec],
    f: impl FnOnce(&Attachment) -> T + Send,
) -> T {
    let text = config_text(jobs);
    let netns = tb.host(0).netns;
    let out = tb
        .in_host(0, || {
            let config = Config::parse(&text, "test.toml")
                .unwrap_or_else(|e| panic!("test config: {e}\n{text}"));
            let att = node::attach("eth0", &config, None, &pins.path, XdpMode::Native)
                .unwrap_or_else(|e| panic!("node::attach eth0: {e:#}"));
            assert!(
                has_xdp(&netns, "eth0"),
                "eth0 has the XDP program:\n{}",
                link_show(&netns, "eth0")
            );
            let out = f(&att);
            att.detach().unwrap_or_else(|e| panic!("detach: {e:#}"));
            out
        })
        .unwrap_or_else(|e| panic!("entering host 0: {e}"));
    assert!(
        !has_xdp(&netns, "eth0"),
        "detach removed XDP from eth0:\n{}",
        link_show(&netns, "eth0")
    );
    assert!(
        !has_xdp(&netns, "lo"),
        "detach removed XDP from lo:\n{}",
        link_show(&netns, "lo")
    );
    assert_eq!(
        dir_entries(&pins.path),
        Vec::<String>::new(),
        "detach removed every pin"
    );
    out
}

fn stats(att: &Attachment) -> Stats {
    att.xdp
        .stats()
        .unwrap_or_else(|e| panic!("reading stats: {e}"))
}

fn drops(s: &Stats, reason: DropReason) -> u64 {
    s.drop(reason).packets
}

/// Check the counters after `reports` (the test's only traffic on the
/// XDP program's job ports, apart from `allowed` drop reasons): exactly one
/// RESULT per fragment, every distinct contribution accepted exactly once,
/// the retransmission counter moved and is bounded by what was sent twice,
/// no other drops, no slot left behind.
fn check_counters(att: &Attachment, reports: &[RoundReport], allowed: &[DropReason]) {
    let t = total(reports);
    let expect_min = t.contributions + t.injected_duplicates;
    // The late duplicates are processed asynchronously: let the counters settle.
    wait_until(Duration::from_secs(3), || {
        let s = stats(att);
        s.outcome(Outcome::Accepted).packets
            + s.outcome(Outcome::Result).packets
            + drops(&s, DropReason::Retransmission)
            >= expect_min
    });
    let s = stats(att);
    let accepted = s.outcome(Outcome::Accepted).packets;
    let results = s.outcome(Outcome::Result).packets;
    let retrans = drops(&s, DropReason::Retransmission);
    eprintln!(
        "counters: accepted {accepted}, result {results}, retransmission {retrans}; sent: {} contributions, {} injected duplicates, {} resent, {} fragments",
        t.contributions, t.injected_duplicates, t.resent, t.fragments
    );
    assert_eq!(
        results, t.fragments as u64,
        "exactly one RESULT per fragment: {s:?}"
    );
    assert_eq!(
        accepted + results,
        t.contributions,
        "every contribution counted exactly once: {s:?}"
    );
    if t.injected_duplicates > 0 {
        assert!(
            retrans > 0,
            "the retransmission counter moves with injected duplicates: {s:?}"
        );
    }
    assert!(
        retrans <= t.injected_duplicates + t.resent,
        "more retransmissions counted than sent twice: {s:?}"
    );
    for reason in DropReason::ALL {
        if reason != DropReason::Retransmission && !allowed.contains(&reason) {
            assert_eq!(drops(&s, reason), 0, "no {} drops: {s:?}", reason.label());
        }
    }
    assert_eq!(att.xdp.slots_in_use(), 0, "every slot released");
}

/// Rounds of every kernel op on one job: `rounds_per_op` rounds of mixed
/// values per op, then SUM and AVG of large values (overflow clamping).
#[allow(clippy::too_many_arguments)]
fn ops_rounds(
    senders: &[UdpSocket],
    rx: &UdpSocket,
    job: &JobSpec,
    to: SocketAddrV4,
    elements: usize,
    rounds_per_op: u32,
    first_round: u32,
    seqs: &mut [u32],
) -> Vec<RoundReport> {
    let weights = job.effective_weights();
    let ranks = job.workers.len();
    let mut plan: Vec<(Op, Values)> = Vec::new();
    for op in kernel_ops() {
        for _ in 0..rounds_per_op {
            plan.push((op, Values::Mixed));
        }
    }
    plan.push((Op::Sum, Values::Large));
    plan.push((Op::Avg, Values::Large));
    plan.iter()
        .enumerate()
        .map(|(i, &(op, kind))| {
            let round = first_round + i as u32;
            let vecs = vectors(
                u64::from(job.id) << 32 | u64::from(round),
                ranks,
                elements,
                kind,
            );
            let r = Round {
                job: job.id,
                round,
                op,
                to,
                vectors: &vecs,
                weights: &weights,
                window: 2,
                duplicates: true,
            };
            run_round(senders, rx, &r, seqs, ROUND_TIMEOUT)
        })
        .collect()
}

#[test]
fn kernel_ops_64_ranks_many_fragments_and_rounds() {
    let tb = testbed(5, 15);
    let pins = Bpffs::mount("netns-agg").expect("mounting a private bpffs");
    let placement = spread_ranks(&tb, &[1, 2, 3, 4], 64);
    let job = JobSpec {
        id: 1,
        port: 7000,
        result_port: 7001,
        workers: placement.iter().map(|p| p.1).collect(),
        weights: (0..64).map(|r| (r % 4) + 1).collect(),
        vector_len: Some(4000),
    };
    let agg = tb.host(0);
    with_aggregator(&tb, &pins, &[job.clone()], |att| {
        assert!(
            !att.record.lo_xdp,
            "no worker on the aggregator host: nothing attached to lo"
        );
        assert!(
            !has_xdp(&agg.netns, "lo"),
            "lo untouched without a local worker"
        );
        let rx = result_socket_in(&agg.netns, job.result_port);
        let senders = rank_sockets(&tb, &placement);
        let mut seqs = vec![0u32; 64];
        // 4000 elements: 12 fragments (11 × 362 + 18).
        let reports = ops_rounds(
            &senders,
            &rx,
            &job,
            SocketAddrV4::new(agg.addr, job.port),
            4000,
            2,
            1,
            &mut seqs,
        );
        check_counters(att, &reports, &[]);
        let state = att
            .xdp
            .job_state(job.id)
            .expect("job_state")
            .expect("job 1 has state");
        assert_eq!(state.active_slots, 0, "{state:?}");
        assert_eq!(state.newest_round, reports.len() as u32, "{state:?}");
        assert_no_more_results(&rx, Duration::from_millis(200));
    });
}

#[test]
fn one_to_many_senders_every_op() {
    let tb = testbed(4, 10);
    let pins = Bpffs::mount("netns-few").expect("mounting a private bpffs");
    let agg = tb.host(0);
    let sizes = [1usize, 2, 3, 33];
    let jobs: Vec<(JobSpec, Vec<(usize, Ipv4Addr)>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let placement = spread_ranks(&tb, &[1, 2, 3], n);
            let spec = JobSpec {
                id: 10 + i as u16,
                port: 7100 + i as u16,
                result_port: 7200 + i as u16,
                workers: placement.iter().map(|p| p.1).collect(),
                weights: if i % 2 == 1 {
                    (0..n as i32).map(|r| 3 - r % 3).collect()
                } else {
                    Vec::new()
                },
                vector_len: None,
            };
            (spec, placement)
        })
        .collect();
    let specs: Vec<JobSpec> = jobs.iter().map(|j| j.0.clone()).collect();
    with_aggregator(&tb, &pins, &specs, |att| {
        let mut reports = Vec::new();
        for (i, (job, placement)) in jobs.iter().enumerate() {
            let rx = result_socket_in(&agg.netns, job.result_port);
            let senders = rank_sockets(&tb, placement);
            let mut seqs = vec![1000u32; placement.len()];
            // 1500, 2900, 4300, 5700 elements: 5 to 16 fragments.
            let elements = 1500 + 1400 * i;
            let r = ops_rounds(
                &senders,
                &rx,
                job,
                SocketAddrV4::new(agg.addr, job.port),
                elements,
                1,
                1,
                &mut seqs,
            );
            reports.extend(r);
            drop(senders);
            assert_no_more_results(&rx, Duration::from_millis(50));
        }
        check_counters(att, &reports, &[]);
    });
}

/// AGG1 datagram of `values` with the given header fields.
fn agg_datagram(job: u16, rank: u16, round: u32, frag_off: u32, op: Op, values: &[i32]) -> Vec<u8> {
    let hdr = AggHeader {
        job,
        rank,
        seq: 0,
        round: aggbox::wire::abi::Round(round),
        frag_off,
        op,
        flags: 0,
        count: values.len() as u16,
    };
    let mut buf = Vec::new();
    proto::encode_agg_into(&hdr, values, &mut buf).expect("encode");
    buf
}

#[test]
fn spoofed_unknown_job_and_stale_round_are_dropped_counted_and_harmless() {
    let tb = testbed(3, 2);
    let pins = Bpffs::mount("netns-bad").expect("mounting a private bpffs");
    let agg = tb.host(0);
    let (h1, h2) = (tb.host(1), tb.host(2));
    let placement = vec![
        (1, h1.addr),
        (2, h2.addr),
        (1, h1.extra_addrs[0]),
        (2, h2.extra_addrs[0]),
    ];
    let outsider = (1usize, h1.extra_addrs[1]); // on a sender host, but no rank's address
    let job = JobSpec {
        id: 21,
        port: 7300,
        result_port: 7301,
        workers: placement.iter().map(|p| p.1).collect(),
        weights: vec![],
        vector_len: Some(2000),
    };
    let to = SocketAddrV4::new(agg.addr, job.port);
    with_aggregator(&tb, &pins, &[job.clone()], |att| {
        let rx = result_socket_in(&agg.netns, job.result_port);
        let senders = rank_sockets(&tb, &placement);
        let intruder = bind_in(&tb, outsider.0, outsider.1);
        let weights = job.effective_weights();
        let mut seqs = vec![0u32; 4];
        let mut reports = Vec::new();
        let round = |round: u32, op: Op, seqs: &mut Vec<u32>| {
            let vecs = vectors(u64::from(round), 4, 2000, Values::Mixed);
            let r = Round {
                job: job.id,
                round,
                op,
                to,
                vectors: &vecs,
                weights: &weights,
                window: 2,
                duplicates: false,
            };
            run_round(&senders, &rx, &r, seqs, ROUND_TIMEOUT)
        };
        reports.push(round(1, Op::Sum, &mut seqs));
        reports.push(round(100, Op::Max, &mut seqs)); // newest completed round: 100
        let before = stats(att);
        let slots_before = att.xdp.slots_in_use();

        // 2000 elements: 6 fragments. Every bad datagram would change the
        // result of round 101 (or make a RESULT of its own) if it counted.
        let frags: Vec<(u32, usize)> = (0..2000)
            .step_by(PER_DATAGRAM)
            .map(|o| (o as u32, PER_DATAGRAM.min(2000 - o)))
            .collect();
        let junk = |n: usize| vec![777_777i32; n];
        for &(off, n) in &frags {
            // Rank 0's header from rank 1's address, and rank 2's from an address of no rank.
            senders[1]
                .send_to(&agg_datagram(job.id, 0, 101, off, Op::Sum, &junk(n)), to)
                .expect("send");
            intruder
                .send_to(&agg_datagram(job.id, 2, 101, off, Op::Sum, &junk(n)), to)
                .expect("send");
            // A job nobody configured, on the job's port, from a real rank.
            senders[0]
                .send_to(&agg_datagram(999, 0, 101, off, Op::Sum, &junk(n)), to)
                .expect("send");
            // Round 30 from the right rank: 70 rounds behind the newest completed.
            senders[0]
                .send_to(&agg_datagram(job.id, 0, 30, off, Op::Sum, &junk(n)), to)
                .expect("send");
            // A rank the job does not have.
            senders[3]
                .send_to(&agg_datagram(job.id, 4, 101, off, Op::Sum, &junk(n)), to)
                .expect("send");
        }
        let nf = frags.len() as u64;
        let want = [
            (DropReason::SourceMismatch, 2 * nf),
            (DropReason::UnknownJob, nf),
            (DropReason::StaleRound, nf),
            (DropReason::RankOutOfRange, nf),
        ];
        let settled = wait_until(Duration::from_secs(5), || {
            let s = stats(att);
            want.iter()
                .all(|&(r, n)| drops(&s, r) >= drops(&before, r) + n)
        });
        let after = stats(att);
        assert!(
            settled,
            "bad datagrams counted by reason: want {want:?} more than {before:?}, got {after:?}"
        );
        for (reason, n) in want {
            assert_eq!(
                drops(&after, reason) - drops(&before, reason),
                n,
                "{} drops: {after:?}",
                reason.label()
            );
        }
        for outcome in [Outcome::Accepted, Outcome::Result] {
            assert_eq!(
                after.outcome(outcome),
                before.outcome(outcome),
                "bad datagrams changed no slot ({})",
                outcome.label()
            );
        }
        assert_eq!(
            att.xdp.slots_in_use(),
            slots_before,
            "bad datagrams made no slot"
        );

        // The rounds after are exact: nothing of the junk got in.
        reports.push(round(101, Op::Sum, &mut seqs));
        reports.push(round(102, Op::Avg, &mut seqs));
        check_counters(
            att,
            &reports,
            &[
                DropReason::SourceMismatch,
                DropReason::UnknownJob,
                DropReason::StaleRound,
                DropReason::RankOutOfRange,
            ],
        );
        assert_no_more_results(&rx, Duration::from_millis(200));
    });
}

#[test]
fn worker_on_the_aggregator_host_counts_through_lo() {
    let tb = testbed(3, 1);
    let pins = Bpffs::mount("netns-lo").expect("mounting a private bpffs");
    let agg = tb.host(0);
    let (h1, h2) = (tb.host(1), tb.host(2));
    // Job 31: rank 0 runs on the aggregator host itself (its datagrams to the
    // node's own address go through lo), ranks 1..3 are remote.
    let mixed = vec![
        (0usize, agg.addr),
        (1, h1.addr),
        (2, h2.addr),
        (1, h1.extra_addrs[0]),
    ];
    // Job 32: its only worker is on the aggregator host: every datagram goes through lo.
    let local_only = vec![(0usize, agg.addr)];
    let job_mixed = JobSpec {
        id: 31,
        port: 7400,
        result_port: 7401,
        workers: mixed.iter().map(|p| p.1).collect(),
        weights: vec![2, 1, 1, 3],
        vector_len: None,
    };
    let job_local = JobSpec {
        id: 32,
        port: 7410,
        result_port: 7411,
        workers: vec![agg.addr],
        weights: vec![],
        vector_len: None,
    };
    with_aggregator(&tb, &pins, &[job_mixed.clone(), job_local.clone()], |att| {
        assert!(
            att.record.lo_xdp,
            "a worker on this host: the program is attached to lo too"
        );
        let lo = link_show(&agg.netns, "lo");
        assert!(
            lo.contains("xdpgeneric"),
            "lo has the program in generic mode:\n{lo}"
        );
        let pinned = dir_entries(att.pin_dir());
        assert!(
            pinned.contains(&node::LO_LINK_PIN.to_string()),
            "the lo link is pinned: {pinned:?}"
        );
        let st = node::status(Some("eth0"), &pins.path).expect("status");
        assert!(
            st[0].attach.lo_xdp && node::format_status(&st[0]).contains("also on lo"),
            "status shows the lo link"
        );

        let mut reports = Vec::new();
        for (job, placement, elements) in
            [(&job_mixed, &mixed, 3000), (&job_local, &local_only, 1000)]
        {
            let rx = result_socket_in(&agg.netns, job.result_port);
            let senders = rank_sockets(&tb, placement);
            let mut seqs = vec![0u32; placement.len()];
            reports.extend(ops_rounds(
                &senders,
                &rx,
                job,
                SocketAddrV4::new(agg.addr, job.port),
                elements,
                2,
                1,
                &mut seqs,
            ));
            assert_no_more_results(&rx, Duration::from_millis(50));
        }
        check_counters(att, &reports, &[]);
    });
}
