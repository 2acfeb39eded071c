//! Kernel run time of the XDP aggregation chain per contribution and per
//! element, by element count and op, measured with BPF_PROG_TEST_RUN's
//! `duration` (the kernel's own clock around the program, tail calls
//! included; no packet copies). 4 ranks per fragment, split by role: the
//! first contribution creates the slot and its accumulator blocks, the
//! middle ones only add, the last one completes the fragment, writes the
//! RESULT and releases the slot.
//!
//! Two ways of timing, both reported:
//! - **one run per contribution** (the tables by role): one
//!   BPF_PROG_TEST_RUN per datagram, so every figure carries the syscall's
//!   cold start (caches and branch predictors after the kernel entry) and
//!   the timer's own reads; the fixed costs' "not IPv4" row shows how much;
//! - **in a loop** (`loops`): one BPF_PROG_TEST_RUN with `repeat` over
//!   a stream of distinct contributions (src/bpf/bench_feed.bpf.c writes
//!   the next one's headers and tail-calls the program), minus the feeder's
//!   own cost measured the same way; warm, as a busy aggregator runs, and
//!   how the floor's ~180 ns in issue #20 was measured (a program run
//!   repeatedly on one contribution).
//!
//! Needs root (loads the programs) and the `bench` feature (the floor
//! program is built only with it): `sudo cargo bench --features bench
//! --bench xdp_chain [-- FRAGMENTS]`. Speed lives here, not in the tests.
//! With `XDP_CHAIN_PROFILE=1` only the 362-element SUM point and the floor
//! run (what `scripts/xdp_line_profile.py` samples). `XDP_CHAIN_FAMILY=6`
//! sends the contributions (tables by role, fixed costs) over IPv6 to a job
//! of IPv6 ranks (default 4: IPv4); the floor and the loops stay IPv4.

#![allow(dead_code)]

#[path = "../src/bin/aggbox-bench/floor.rs"]
mod floor;
#[path = "../tests/bpf_common/mod.rs"]
mod bpf_common;

use std::net::Ipv4Addr;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aggbox::wire::abi::{self, Op};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use aggbox::kernel::object::ObjectSlot;
use libbpf_rs::{MapCore, MapFlags};
use aggbox::kernel::xdp::XdpJob;
use bpf_common::*;


const JOB: u16 = 9;
const WORKERS: u16 = 4;
/// Jobs of the loops (`loops`), one per fragments-a-round setting.
const LOOP_JOB: u16 = 20;

fn addr(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 3, rank as u8 + 1)
}

/// The IP version of the contributions (`XDP_CHAIN_FAMILY`).
fn family() -> Family {
    match std::env::var("XDP_CHAIN_FAMILY").as_deref() {
        Ok("6") => Family::V6,
        _ => Family::V4,
    }
}

fn main() {
    let fragments: u32 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200);
    let fam = family();
    let dp = load();
    dp.set_job(
        JOB,
        &XdpJob {
            id: JOB,
            port: JOB_PORT,
            result_port: RESULT_PORT,
            ranks: (0..WORKERS).map(|r| fam.addr(addr(r))).collect(),
            weights: vec![],
            // A vector length, as the runtime and `aggbox attach` configure
            // it: fast slots index by round and offset (docs/DATAPLANE.md).
            vector_len: fragments * 16370,
            slots: 0,
            flags: 0,
            result_group: None,
            window: 0,
            frag_elems: 0,
        },
    )
    .expect("configure the job");
    let runner = dp.test_runner().expect("test runner");
    if std::env::var("XDP_CHAIN_PROFILE").as_deref() == Ok("loop") {
        // What `scripts/xdp_line_profile.py --loop` samples: the loops only.
        loops(&dp, 1, fragments.max(1));
        return;
    }
    println!("contributions over {fam:?}");
    println!("count  op     creating ns (ns/element)   adding ns (ns/element)   completing ns (ns/element)   mean ns/element  mean ns");
    let mut round = 1u32;
    let profile = std::env::var("XDP_CHAIN_PROFILE").is_ok();
    let counts: &[usize] = if profile { &[362] } else { &[362, 2242, 16370] };
    let ops: &[Op] = if profile { &[Op::Sum] } else { &[Op::Sum, Op::Max] };
    for &count in counts {
        for &op in ops {
            // Values whose sums stay within int32 (overflow is the rare slow path).
            let values: Vec<i32> = (0..count as i32).map(|i| (i * 7919) % 100_000 - 50_000).collect();
            let frames: Vec<Vec<u8>> = (0..WORKERS)
                .map(|rank| {
                    let mut a = Agg::new(JOB, rank, op as u8, values.clone());
                    a.round = round;
                    a.flags = abi::AGG_F_LAST_FRAGMENT;
                    Frame::udp(fam.addr(addr(rank)), a.bytes()).build()
                })
                .collect();
            let mut by_role = [0u64; 3];
            let p = fam.payload_off();
            for frag in 0..fragments {
                for (rank, frame) in frames.iter().enumerate() {
                    // Patch round and frag_off (AGG1 offsets 12 and 16 after
                    // Ethernet 14 + IPv4 20 or IPv6 40 + UDP 8) instead of
                    // rebuilding (the UDP checksum, unverified, goes stale).
                    let mut f = frame.clone();
                    f[p + 12..p + 16].copy_from_slice(&round.to_be_bytes());
                    f[p + 16..p + 20].copy_from_slice(&(frag * count as u32).to_be_bytes());
                    let (verdict, _, ns) = runner.run_timed(&f).expect("test run");
                    let role = if rank + 1 == WORKERS as usize {
                        assert_eq!(verdict, XDP_PASS, "RESULT");
                        2
                    } else {
                        assert_eq!(verdict, XDP_DROP, "absorbed");
                        usize::from(rank > 0)
                    };
                    by_role[role] += ns as u64;
                }
            }
            let per = |role: usize| {
                let contributions = fragments as u64 * if role == 1 { WORKERS as u64 - 2 } else { 1 };
                by_role[role] as f64 / contributions as f64
            };
            let (c, a, l) = (per(0), per(1), per(2));
            let mean = by_role.iter().sum::<u64>() as f64 / (fragments as f64 * WORKERS as f64 * count as f64);
            let mean_ns = by_role.iter().sum::<u64>() as f64 / (fragments as f64 * WORKERS as f64);
            let e = count as f64;
            println!(
                "{count:5}  {:4}  {c:10.0} ({:5.2})         {a:10.0} ({:5.2})       {l:10.0} ({:5.2})            {mean:5.2}  {mean_ns:7.0}",
                format!("{op:?}"),
                c / e,
                a / e,
                l / e
            );
            round += 1;
        }
    }
    if !profile {
        fixed_costs(&runner, fam);
    }
    floor(fragments);
    if !profile {
        loops(&dp, round, 1);
    }
    let fast = dp.fast_stats().expect("fast_stats");
    println!(
        "fast slots: {} contributions joined, {} fragments taken, {} busy (hash-map path), {} aborted",
        fast[abi::FAST_JOINED as usize],
        fast[abi::FAST_TAKEN as usize],
        fast[abi::FAST_BUSY as usize],
        fast[abi::FAST_ABORTED as usize]
    );
}

/// Median run time of `frame` over `runs` test runs (the first warms up).
fn median_ns(runner: &aggbox::kernel::xdp::TestRunner, frame: &[u8], runs: usize) -> u32 {
    let mut t: Vec<u32> = (0..runs)
        .map(|_| runner.run_timed(frame).expect("test run").2)
        .collect();
    t.sort_unstable();
    t[runs / 2]
}

/// Where the fixed work per datagram goes: AGG1 datagrams stopped at
/// successive steps of the entry program (each step adds the lookups
/// named), median of 2000 runs each. A frame with no IPv4 is the harness's
/// own floor (BPF_PROG_TEST_RUN around a parse-and-pass).
fn fixed_costs(runner: &aggbox::kernel::xdp::TestRunner, fam: Family) {
    let values = vec![1, 2, 3, 4];
    let agg = |job: u16, rank: u16| Agg::new(job, rank, Op::Sum as u8, values.clone());
    let addr = |rank: u16| fam.addr(addr(rank));
    let mut not_ip = Frame::udp(addr(0), agg(JOB, 0).bytes());
    not_ip.ethertype = 0x0806;
    let mut other_port = Frame::udp(addr(0), agg(JOB, 0).bytes());
    other_port.dport = JOB_PORT + 1;
    let steps: [(&str, Vec<u8>); 5] = [
        ("not IPv4 (parse, pass)", not_ip.build()),
        ("UDP to another port (+ ports lookup)", other_port.build()),
        ("unknown job (+ jobs lookup)", Frame::udp(addr(0), agg(JOB + 1, 0).bytes()).build()),
        ("source mismatch (+ ranks lookup)", Frame::udp(addr(1), agg(JOB, 0).bytes()).build()),
        ("retransmission of a completed fragment (+ job state, round and hand-off lookups, the fast slot's lock)", {
            // Round 1, fragment 0 completed in the first point above; its
            // fast slot has moved on since, so this finds it a
            // retransmission through the slot's `prev` or the markers.
            let mut a = Agg::new(JOB, 0, Op::Sum as u8, vec![0; 362]);
            a.round = 1;
            Frame::udp(addr(0), a.bytes()).build()
        }),
    ];
    println!("fixed cost per datagram (median of 2000 runs, ns):");
    for (what, frame) in steps {
        println!("  {:>5}  {what}", median_ns(runner, &frame, 2000));
    }
}

/// The floor aggregator (src/bpf/bench_floor.bpf.c, the least an XDP
/// aggregator of full-MTU SUM fragments costs) on the same kind of
/// contributions: 4 ranks, 362 elements, by role.
fn floor(fragments: u32) {
    let floor = floor::Floor::load(JOB_PORT, RESULT_PORT, u32::from(WORKERS)).expect("loading the floor aggregator");
    let runner = aggbox::kernel::xdp::TestRunner::for_program(floor.prog()).expect("test runner");
    let count = 362usize;
    let values: Vec<i32> = (0..count as i32).map(|i| (i * 7919) % 100_000 - 50_000).collect();
    let mut by_role = [0u64; 3];
    for frag in 0..fragments {
        for rank in 0..WORKERS {
            let mut a = Agg::new(JOB, rank, Op::Sum as u8, values.clone());
            a.round = 1;
            a.frag_off = frag * count as u32;
            let (verdict, _, ns) = runner.run_timed(&Frame::udp(addr(rank), a.bytes()).build()).expect("test run");
            let role = if rank + 1 == WORKERS {
                assert_eq!(verdict, XDP_PASS, "RESULT");
                2
            } else {
                assert_eq!(verdict, XDP_DROP, "absorbed");
                usize::from(rank > 0)
            };
            by_role[role] += u64::from(ns);
        }
    }
    let per = |role: usize| by_role[role] as f64 / (fragments as f64 * if role == 1 { f64::from(WORKERS - 2) } else { 1.0 });
    let mean = by_role.iter().sum::<u64>() as f64 / (fragments as f64 * f64::from(WORKERS));
    println!(
        "floor aggregator, 362 Sum: first {:.0} ns, adding {:.0} ns, completing {:.0} ns; mean {mean:.0} ns per contribution",
        per(0),
        per(1),
        per(2)
    );
}

#[allow(clippy::all, missing_docs, dead_code)]
mod feed_skel {
    include!(concat!(env!("OUT_DIR"), "/bench_feed.skel.rs"));
}

/// The feeder (src/bpf/bench_feed.bpf.c): one test run's repeats become a
/// stream of distinct contributions to the program in its target slot.
struct Feed {
    skel: feed_skel::BenchFeedSkel<'static>,
    _object: ObjectSlot,
}

/// What one feeder test run sends: `runs` contributions, rank by rank
/// (one frame per rank, its headers the template), `frags` fragments of
/// `count` elements a round, from round `first_round`.
struct Schedule {
    frames: Vec<Vec<u8>>,
    frags: u32,
    count: u32,
    first_round: u32,
    runs: u32,
}

/// Ethernet + IPv4 + UDP + AGG1 header bytes the feeder writes per run.
const FEED_HDR: usize = 14 + 20 + 8 + 24;

impl Feed {
    fn load() -> Feed {
        let (object, object_ref) = ObjectSlot::new();
        let open = feed_skel::BenchFeedSkelBuilder::default().open(object_ref).expect("opening bench_feed");
        let skel = open.load().expect("loading bench_feed");
        Feed { skel, _object: object }
    }

    /// Mean ns per run of `schedule`'s contributions through `target`
    /// (`frags_flag`: an "xdp.frags" program), feeder included.
    fn run(&self, target: BorrowedFd<'_>, frags_flag: bool, schedule: &Schedule) -> f64 {
        let Schedule { frames, frags, count, first_round, runs } = schedule;
        let (frags, count, first_round, runs) = (*frags, *count, *first_round, *runs);
        let maps = &self.skel.maps;
        for (rank, frame) in frames.iter().enumerate() {
            maps.feed_hdrs
                .update(&(rank as u32).to_ne_bytes(), &frame[..FEED_HDR], MapFlags::ANY)
                .expect("feed_hdrs");
        }
        let mut cfg = Vec::new();
        for v in [frames.len() as u32, frags, count, first_round] {
            cfg.extend_from_slice(&v.to_ne_bytes());
        }
        maps.feed_cfg.update(&0u32.to_ne_bytes(), &cfg, MapFlags::ANY).expect("feed_cfg");
        maps.feed_runs.update(&0u32.to_ne_bytes(), &0u64.to_ne_bytes(), MapFlags::ANY).expect("feed_runs");
        let (slot_map, prog) = if frags_flag {
            (&maps.feed_target_frags, &self.skel.progs.feed_frags)
        } else {
            (&maps.feed_target_linear, &self.skel.progs.feed_linear)
        };
        slot_map
            .update(&0u32.to_ne_bytes(), &(target.as_raw_fd() as u32).to_ne_bytes(), MapFlags::ANY)
            .expect("feed target");
        let runner = aggbox::kernel::xdp::TestRunner::for_fd(prog.as_fd()).expect("feed runner");
        let ns = runner.run_repeated(&frames[frames.len() - 1], runs).expect("feed test run");
        let done = maps.feed_runs.lookup(&0u32.to_ne_bytes(), MapFlags::ANY).expect("feed_runs").expect("feed_runs[0]");
        assert_eq!(u64::from_ne_bytes(done[..8].try_into().unwrap()), u64::from(runs), "every repeat fed");
        f64::from(ns)
    }
}

/// In a loop: 362-element SUM contributions of 4 ranks, `frags` fragments
/// a round, through AggBox's chain and the floor aggregator, each minus the
/// feeder with a target that drops at once; the median of 5 test runs of
/// 40,000 contributions each, interleaved. Checks that every contribution
/// was absorbed or completed its fragment (AggBox's job counters). The floor
/// indexes by (round, fragment) over as many slots as AggBox's region for the
/// point's job. `times`
/// repeats the whole (for a profile).
fn loops(dp: &aggbox::kernel::xdp::XdpPlane, first_round: u32, times: u32) {
    let count = 362u32;
    let runs_per = 40_000u32;
    let feed = Feed::load();
    let floor = floor::Floor::load(JOB_PORT, RESULT_PORT, u32::from(WORKERS)).expect("loading the floor aggregator");
    let sinks = (feed.skel.progs.feed_sink_frags.as_fd(), feed.skel.progs.feed_sink_linear.as_fd());
    println!("in a loop (one test run of {runs_per} distinct 362-element SUM contributions, minus the feeder; median of 5, ns per contribution):");
    println!("  fragments a round   slots   AggBox   floor   AggBox/floor   (feeder alone: frags / linear chain flag)");
    // XDP_CHAIN_LOOP_FRAGS (e.g. "200" or "16,200") picks the points, for a
    // profile of one of them.
    let points: Vec<u32> = match std::env::var("XDP_CHAIN_LOOP_FRAGS") {
        Ok(list) => list
            .split(',')
            .map(|f| f.trim().parse().expect("XDP_CHAIN_LOOP_FRAGS: fragments a round, comma-separated"))
            .collect(),
        Err(_) => vec![1, 16, 200],
    };
    let mut round = first_round;
    for (k, frags) in std::iter::repeat_n(points.iter().copied(), times as usize).flatten().enumerate() {
        // A job of its own whose vector is what the loop sends (as the
        // runtime configures one), so that its fast-slot region and
        // index stride are what such a job gets.
        let job = LOOP_JOB + (k % points.len()) as u16;
        if k < points.len() {
            dp.set_job(
                job,
                &XdpJob {
                    id: job,
                    port: JOB_PORT,
                    result_port: RESULT_PORT,
                    ranks: (0..WORKERS).map(|r| addr(r).into()).collect(),
                    weights: vec![],
                    vector_len: frags * count,
                    slots: 0,
                    flags: 0,
                    result_group: None,
                    window: 0,
                    // Full fragments, as a node at MTU 1500 configures them (the
                    // fast slots' granule: consecutive fragments, consecutive slots).
                    frag_elems: count,
                },
            )
            .expect("configure the loop's job");
        }
        // The floor indexes its slots by (round, fragment) over as many
        // slots as AggBox's region for this job, so that both keep the same
        // memory in use: a floor on warm slots against AggBox's cold ones
        // measures the cache, not the aggregator.
        let region = dp.job(job).expect("job").expect("the loop's job").fast_slots;
        assert!(region > 0, "the loop's job has a fast-slot region");
        floor.set_index(frags, u32::from(region)).expect("floor index");
        let frames: Vec<Vec<u8>> = (0..WORKERS)
            .map(|rank| {
                let mut a = Agg::new(job, rank, Op::Sum as u8, vec![0; count as usize]);
                // One template for every fragment: LAST_FRAGMENT only
                // where each fragment is its round's last.
                a.flags = if frags == 1 { abi::AGG_F_LAST_FRAGMENT } else { 0 };
                Frame::udp(addr(rank), a.bytes()).build()
            })
            .collect();
        let rounds_per = runs_per / (u32::from(WORKERS) * frags);
        let runs = rounds_per * u32::from(WORKERS) * frags;
        let mut schedule = Schedule { frames, frags, count, first_round: round, runs };
        let (mut agg, mut flo, mut sink_f, mut sink_l) = (vec![], vec![], vec![], vec![]);
        for _ in 0..5 {
            let before = dp.job_stats(job).expect("job stats").unwrap_or_default();
            schedule.first_round = round;
            agg.push(feed.run(dp.xdp_prog_fd(), dp.chain() == aggbox::kernel::xdp::Chain::Frags, &schedule));
            let after = dp.job_stats(job).expect("job stats").unwrap_or_default();
            assert_eq!(
                after.results - before.results,
                u64::from(rounds_per * frags),
                "every fragment completed once (rounds {round}.., {frags} a round; job counters before {before:?}, after {after:?}; fast slots {:?})",
                dp.fast_stats().expect("fast_stats")
            );
            assert_eq!(
                after.accepted - before.accepted + after.results - before.results,
                u64::from(runs),
                "every contribution absorbed or completing"
            );
            round += rounds_per;
            schedule.first_round = round;
            flo.push(feed.run(floor.prog().as_fd(), false, &schedule));
            round += rounds_per;
            schedule.first_round = round;
            sink_f.push(feed.run(sinks.0, true, &schedule));
            sink_l.push(feed.run(sinks.1, false, &schedule));
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (sf, sl) = (med(&mut sink_f), med(&mut sink_l));
        let (a, f) = (med(&mut agg) - sf, med(&mut flo) - sl);
        println!("  {frags:17}   {region:5}   {a:6.0}   {f:5.0}   {:12.2}   ({sf:.0} / {sl:.0})", a / f);
    }
}
