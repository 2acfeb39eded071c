//! Who may send what (docs/RUNTIME.md), on the real paths: the kernel
//! backend against a live `aggbox attach` on a netns testbed (the job and
//! result group of tests/runtime_kernel.rs), with one more host that is not
//! in the job.
//!
//! - Every legitimate source passes: the XDP program's RESULTs (the
//!   completing contributor's address), the TC copies of the result group
//!   (the node's address, a worker's data port), the aggregator runtime's
//!   resends and ACKs, the workers' result and broadcast ACKs: no participant
//!   refuses anything in broadcasts, reduces and allreduces.
//! - A RESULT for the aggregator's next call, forged from a worker's host on
//!   another port and from the stranger, is dropped by the node's XDP
//!   program (`forged_result`: a RESULT from the network to its job's result
//!   port), so neither the runtime nor the TC program's result group ever
//!   sees it, and the call's value is the genuine one. (The runtime's own
//!   source check, for RESULTs that do not cross XDP, is tests/runtime_sources.rs.)
//!
//! Needs root; fails (never skips) otherwise:
//! `sudo -E cargo test --release --test runtime_kernel_sources`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod common_runtime;

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use aggbox::wire::abi::{self, Op};
use aggbox::config::Config;
use aggbox::wire::proto::{self, AggHeader};
use aggbox::runtime::{BackendKind, Communicator, CommunicatorBuilder, Participant, RefusedStats};
use crate::testbed::{Testbed, TestbedConfig};

const WORKERS: usize = 3;
/// Host index of the host outside the job.
const STRANGER: usize = WORKERS + 1;
const JOB: u16 = 7;
const JOB_PORT: u16 = 7400;
const RESULT_PORT: u16 = 7401;
const GROUP: u16 = 3;
const DATA_PORT: u16 = 7500;

mod live_attach;
use live_attach::LiveAttach as Attach;

#[test]
fn kernel_backend_refuses_forged_results_and_nothing_legitimate() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/runtime_kernel_sources.rs needs root (network namespaces, XDP, TC)"
    );
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 2, ..Default::default() }).expect("testbed");
    let workers: Vec<Ipv4Addr> = (1..=WORKERS).map(|h| tb.host(h).addr).collect();
    let list = |f: &dyn Fn(&Ipv4Addr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
    let text = format!(
        "[node]\nmetrics = \"off\"\n\n[[job]]\nid = {JOB}\nport = {JOB_PORT}\nworkers = [{}]\nresult_port = {RESULT_PORT}\nresult_group = {GROUP}\n\n[[group]]\nid = {GROUP}\nmembers = [{}]\n",
        list(&|w| format!("\"{w}\"")),
        list(&|w| format!("\"{w}:{DATA_PORT}\"")),
    );
    let attach = Attach::start(&tb.host(0).netns, "sources", &text, &[]);
    let config = Config::parse(&text, "runtime_kernel_sources").expect("config");
    let agg_addr = tb.host(0).addr;
    let build = |host: usize, me: Participant| {
        let b = CommunicatorBuilder::from_config(&config, JOB, agg_addr, DATA_PORT, me)
            .expect("from_config")
            .backend(BackendKind::Kernel)
            .deadline(Duration::from_secs(20));
        tb.in_host(host, move || b.build()).expect("netns").expect("build")
    };
    let agg = build(0, Participant::Aggregator);
    let ws: Vec<Communicator> = (0..WORKERS).map(|r| build(r + 1, Participant::Worker(r as u16))).collect();
    let all: Vec<&Communicator> = std::iter::once(&agg).chain(&ws).collect();

    // Legitimate traffic only: nothing refused anywhere.
    for len in [1usize, 362, 20_000] {
        common_runtime::broadcast(&all, len * 4, Participant::Aggregator);
        common_runtime::broadcast(&all, len * 4, Participant::Worker(1));
        common_runtime::int_reduction(&all, WORKERS, Op::Sum, len, false);
        common_runtime::int_reduction(&all, WORKERS, Op::Sum, len, true);
    }
    common_runtime::int_reduction(&all, WORKERS, Op::Sum, 100_000, true);
    let out = attach.outcomes();
    assert!(out["result"] > 0, "the XDP program reduced: {out:?}");
    assert!(
        attach.broadcast_counts()[aggbox::wire::abi::BcastStat::ResultBroadcast.label()] > 0,
        "RESULTs were copied to the workers by the result group"
    );
    for (i, c) in all.iter().enumerate() {
        assert_eq!(c.refused(), RefusedStats::default(), "participant {i} refused legitimate datagrams");
    }

    // Forged RESULTs for the aggregator's next call (fragment 0 of a
    // 1-element reduce), from a worker's host on another port and from the
    // stranger, before the genuine one exists.
    let (round, _) = agg.position();
    let hdr = AggHeader {
        job: JOB,
        rank: abi::RESULT_RANK,
        seq: 0,
        round,
        frag_off: 0,
        op: Op::Sum,
        flags: abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT,
        count: 1,
    };
    let mut forged = Vec::new();
    proto::encode_agg_into(&hdr, &[0x0123_4567], &mut forged).unwrap();
    let to = SocketAddrV4::new(agg_addr, RESULT_PORT);
    for host in [1, STRANGER] {
        let d = forged.clone();
        let from = tb.host(host).addr;
        tb.in_host(host, move || UdpSocket::bind((from, 0)).and_then(|s| s.send_to(&d, to)))
            .expect("netns")
            .expect("send the forged RESULT");
    }
    let t0 = Instant::now();
    let forged_drops = || attach.status().drops.get("forged_result").copied().unwrap_or(0);
    while forged_drops() < 2 && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(forged_drops(), 2, "the node's XDP program dropped both forged RESULTs");
    // Fails without the check: the forged value was taken, the genuine
    // RESULT dropped as a duplicate.
    common_runtime::int_reduction(&all, WORKERS, Op::Sum, 1, false);
    common_runtime::int_reduction(&all, WORKERS, Op::Sum, 1000, true);
    let refused: Vec<RefusedStats> = all.iter().map(|c| c.refused()).collect();
    for (i, r) in refused.iter().enumerate() {
        // Neither the runtime nor (through the TC copies) the workers saw them.
        assert_eq!(*r, RefusedStats::default(), "participant {i}: nothing reached the runtime");
    }
    drop(all);
    drop(ws);
    drop(agg);
    drop(attach);
    tb.down().expect("testbed down");
}
