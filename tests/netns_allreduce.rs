//! In-kernel allreduce and trees of aggregators end to end, on
//! network-namespace testbeds (`crate::testbed`): the XDP aggregator of a
//! live `aggbox attach` completes each slot and passes its RESULT up the
//! stack, and the TC ingress program of the broadcast plane
//! (`src/bpf/aggbox_tc.bpf.c`, `result_routes`) copies it to every worker
//! (allreduce) or rewrites it into the node's contribution to its parent
//! (two-level tree). Everything is configured the way an operator does it:
//! `[[group]]`, `result_group` and `parent` in the config of `aggbox attach`,
//! which attaches the TC programs and writes the routes; the counters are
//! read back through `aggbox::node::status` from the pins.
//!
//! Needs root; fails (never skips) otherwise. Run alone:
//! `sudo -E cargo test --test netns_allreduce`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::Duration;

use aggbox::wire::abi::{BcastStat, Op};
use crate::testbed::{in_netns, Testbed, TestbedConfig};
use aggbox::node::tools;

const ELEMENTS: u32 = 800; // 3 fragments of at most 362 elements
const PER_DATAGRAM: usize = 362;
const MEMBER_PORT: u16 = 7200;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/netns_allreduce.rs needs root (network namespaces, BPF, TC); \
         run it with sudo: `sudo -E cargo test --test netns_allreduce`"
    );
}

fn fragments() -> usize {
    (ELEMENTS as usize).div_ceil(PER_DATAGRAM)
}

mod live_attach;
use live_attach::LiveAttach as Attach;

fn count(counts: &BTreeMap<String, u64>, stat: BcastStat) -> u64 {
    counts.get(stat.label()).copied().unwrap_or_else(|| panic!("no counter {} in {counts:?}", stat.label()))
}

fn job_toml(id: u16, port: u16, workers: &[Ipv4Addr], result_port: u16, extra: &str) -> String {
    let workers: Vec<String> = workers.iter().map(|w| format!("\"{w}\"")).collect();
    format!(
        "[[job]]\nid = {id}\nport = {port}\nworkers = [{}]\nresult_port = {result_port}\n{extra}\n",
        workers.join(", ")
    )
}

/// `rank` sends `values` for `job` to `to` from its own namespace.
fn contribute(netns: &str, to: SocketAddrV4, job: u16, rank: u16, round: u32, op: Op, values: Vec<i32>) {
    in_netns(netns, move || {
        let socket = UdpSocket::bind("0.0.0.0:0").expect("bind sender");
        let c = tools::Contribution { job, rank, round: aggbox::wire::abi::Round(round), op, first_seq: round * 16, per_datagram: PER_DATAGRAM };
        tools::contribute(&socket, to, &c, &values).expect("contribute");
    })
    .expect("enter namespace");
}

fn bind_in(netns: &str, port: u16) -> UdpSocket {
    in_netns(netns, || tools::bind_any(port))
        .expect("enter namespace")
        .unwrap_or_else(|e| panic!("bind port {port} in {netns}: {e:#}"))
}

/// Collect one round's RESULTs on `sock`, check them against `expected`
/// and that each fragment came exactly once (nothing more follows).
fn expect_results(who: &str, sock: &UdpSocket, job: u16, expected: &[i32]) {
    let got = tools::collect_results(sock, job, ELEMENTS, Duration::from_secs(5)).expect("collect results");
    assert!(got.missing.is_empty(), "{who}: missing result elements {:?}", got.missing);
    assert_eq!(got.values, expected, "{who}: RESULT differs from the reference reducer");
    assert_eq!(got.datagrams, fragments(), "{who}: one RESULT per fragment");
    assert_eq!(got.ignored, 0, "{who}: nothing else on the port");
    assert!(got.last_fragment_seen, "{who}: LAST_FRAGMENT carried through");
    // exactly once: no duplicate follows
    sock.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
    let mut buf = [0u8; 2048];
    if let Ok((n, from)) = sock.recv_from(&mut buf) {
        panic!("{who}: unexpected extra datagram of {n} bytes from {from}");
    }
}

/// `Udp:` counters of a namespace.
fn udp_snmp(netns: &str) -> BTreeMap<String, u64> {
    let text = in_netns(netns, || std::fs::read_to_string("/proc/thread-self/net/snmp"))
        .expect("enter namespace")
        .expect("read snmp");
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("Udp:")).collect();
    lines[0]
        .split_whitespace()
        .zip(lines[1].split_whitespace())
        .skip(1)
        .map(|(k, v)| (k.to_string(), v.parse().unwrap_or(0)))
        .collect()
}

fn allreduce(tag: &str, tx_csum_off: bool) {
    require_root();
    const JOB: u16 = 7;
    const PORT: u16 = 7000;
    const RESULT_PORT: u16 = 7001;
    const GROUP: u16 = 3;
    // host 0 = aggregator, hosts 1..=4 = workers (ranks 0..=3)
    let tb = Testbed::up(TestbedConfig { hosts: 5, tx_csum_off, ..Default::default() }).expect("testbed");
    let agg = tb.host(0);
    let workers: Vec<Ipv4Addr> = (1..=4).map(|i| tb.host(i).addr).collect();
    let members: Vec<SocketAddrV4> = workers.iter().map(|w| SocketAddrV4::new(*w, MEMBER_PORT)).collect();
    let member_list: Vec<String> = members.iter().map(|m| format!("\"{m}\"")).collect();
    let attach = Attach::start(
        &agg.netns,
        tag,
        &format!(
            "[node]\nmetrics = \"off\"\n\n{}\n[[group]]\nid = {GROUP}\nmembers = [{}]\n",
            job_toml(JOB, PORT, &workers, RESULT_PORT, &format!("result_group = {GROUP}")),
            member_list.join(", ")
        ),
        &[],
    );

    let local = bind_in(&agg.netns, RESULT_PORT);
    let member_socks: Vec<UdpSocket> = (1..=4).map(|i| bind_in(&tb.host(i).netns, MEMBER_PORT)).collect();
    let before: Vec<_> = (1..=4).map(|i| udp_snmp(&tb.host(i).netns)).collect();

    let to = SocketAddrV4::new(agg.addr, PORT);
    for (round, op) in [(1u32, Op::Sum), (2, Op::Max), (3, Op::Sum)] {
        for rank in 0..4u16 {
            contribute(&tb.host(usize::from(rank) + 1).netns, to, JOB, rank, round, op, tools::pattern_vector(rank, ELEMENTS));
        }
        let expected = tools::expected_pattern_result(op, 4, ELEMENTS, &[]).expect("reference");
        let expected = expected.ints().expect("integer result").to_vec();
        expect_results(&format!("round {round}: aggregator's local socket"), &local, JOB, &expected);
        for (i, s) in member_socks.iter().enumerate() {
            expect_results(&format!("round {round}: worker {i} ({})", members[i]), s, JOB, &expected);
        }
    }

    let rounds = 3u64;
    let frags = fragments() as u64;
    let st = attach.broadcast_counts();
    eprintln!("aggregator TC counters: {st:?}");
    assert_eq!(count(&st, BcastStat::ResultBroadcast), rounds * frags, "one routed RESULT per fragment and round");
    assert_eq!(
        count(&st, BcastStat::CopySent) + count(&st, BcastStat::NeighMiss),
        4 * rounds * frags,
        "one copy per worker and RESULT"
    );
    assert_eq!(count(&st, BcastStat::FibError) + count(&st, BcastStat::CloneFailed) + count(&st, BcastStat::RewriteFailed), 0);
    for (i, b) in before.iter().enumerate() {
        let after = udp_snmp(&tb.host(i + 1).netns);
        assert_eq!(after["InCsumErrors"], b["InCsumErrors"], "UdpInCsumErrors on worker {i}");
    }
    drop(attach);
}

#[test]
fn allreduce_every_worker_and_the_aggregator_receive_each_result_once() {
    allreduce("ar", false);
}

#[test]
fn allreduce_with_full_checksums() {
    // TX offload off: contributions carry full checksums (CHECKSUM_NONE at
    // the aggregator), so the receivers verify what the programs wrote
    allreduce("arcsum", true);
}

#[test]
fn two_level_tree_root_result_is_the_reduction_over_all_workers() {
    require_root();
    const LEAF_JOB: u16 = 11;
    const LEAF_PORT: u16 = 7000;
    const LEAF_RESULT_PORT: u16 = 7001;
    const ROOT_JOB: u16 = 20;
    const ROOT_PORT: u16 = 7500;
    const ROOT_RESULT_PORT: u16 = 7501;
    // host 0 = root aggregator; hosts 1, 2 = leaf aggregators (root ranks 0, 1);
    // hosts 3, 4 = workers of leaf 1; hosts 5, 6 = workers of leaf 2
    let tb = Testbed::up(TestbedConfig { hosts: 7, ..Default::default() }).expect("testbed");
    let root = tb.host(0);
    let leaves = [tb.host(1), tb.host(2)];
    let leaf_workers = [[3usize, 4], [5, 6]];

    let _root_attach = Attach::start(
        &root.netns,
        "root",
        &format!(
            "[node]\nmetrics = \"off\"\n\n{}",
            job_toml(ROOT_JOB, ROOT_PORT, &[leaves[0].addr, leaves[1].addr], ROOT_RESULT_PORT, "")
        ),
        &[],
    );
    let mut leaf_attach = Vec::new();
    for (l, leaf) in leaves.iter().enumerate() {
        let workers: Vec<Ipv4Addr> = leaf_workers[l].iter().map(|&h| tb.host(h).addr).collect();
        let parent = format!("parent = {{ addr = \"{}\", port = {ROOT_PORT}, job = {ROOT_JOB}, rank = {l} }}", root.addr);
        leaf_attach.push(Attach::start(
            &leaf.netns,
            &format!("leaf{l}"),
            &format!("[node]\nmetrics = \"off\"\n\n{}", job_toml(LEAF_JOB, LEAF_PORT, &workers, LEAF_RESULT_PORT, &parent)),
            &[],
        ));
    }
    let root_results = bind_in(&root.netns, ROOT_RESULT_PORT);
    // results go upstream, not to the leaves' local ports
    let leaf_locals: Vec<UdpSocket> = leaves.iter().map(|l| bind_in(&l.netns, LEAF_RESULT_PORT)).collect();

    for (round, op) in [(1u32, Op::Sum), (2, Op::Sum), (3, Op::Max)] {
        // global worker g (0..4) sends pattern_vector(g) as rank g % 2 of its leaf
        for (l, hosts) in leaf_workers.iter().enumerate() {
            let to = SocketAddrV4::new(leaves[l].addr, LEAF_PORT);
            for (rank, &h) in hosts.iter().enumerate() {
                let g = (2 * l + rank) as u16;
                contribute(&tb.host(h).netns, to, LEAF_JOB, rank as u16, round, op, tools::pattern_vector(g, ELEMENTS));
            }
        }
        let expected = tools::expected_pattern_result(op, 4, ELEMENTS, &[]).expect("reference");
        let expected = expected.ints().expect("integer result").to_vec();
        expect_results(&format!("round {round} ({op:?}): root's result port"), &root_results, ROOT_JOB, &expected);
    }
    // Round 4: leaf 0's sum leaves int32 (clamped to INT32_MAX, OVERFLOW),
    // leaf 1's is exactly INT32_MIN; the root's sum of the two, −1, fits,
    // but depends on a clamped input: the root's RESULT carries the
    // OVERFLOW of leaf 0's contribution.
    for (l, hosts) in leaf_workers.iter().enumerate() {
        let to = SocketAddrV4::new(leaves[l].addr, LEAF_PORT);
        for (rank, &h) in hosts.iter().enumerate() {
            let v = if l == 0 { i32::MAX } else { -(1 << 30) };
            contribute(&tb.host(h).netns, to, LEAF_JOB, rank as u16, 4, Op::Sum, vec![v; ELEMENTS as usize]);
        }
    }
    let got = tools::collect_results(&root_results, ROOT_JOB, ELEMENTS, Duration::from_secs(5)).expect("collect results");
    assert!(got.missing.is_empty(), "round 4: missing {:?}", got.missing);
    assert_eq!(got.values, vec![-1; ELEMENTS as usize], "round 4: the sum of the clamped inputs");
    assert!(got.overflow, "round 4: a subtree's OVERFLOW reaches the root's RESULT");
    for (l, s) in leaf_locals.iter().enumerate() {
        s.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
        let mut buf = [0u8; 2048];
        assert!(s.recv_from(&mut buf).is_err(), "leaf {l}: a RESULT that went upstream is not delivered locally");
    }
    for (l, attach) in leaf_attach.iter().enumerate() {
        let st = attach.broadcast_counts();
        assert_eq!(count(&st, BcastStat::ResultUpstream), 4 * fragments() as u64, "leaf {l}: {st:?}");
        assert_eq!(count(&st, BcastStat::FibError) + count(&st, BcastStat::RewriteFailed), 0, "leaf {l}: {st:?}");
    }
    drop(leaf_attach);
}

/// A worker on the node's own host (its contributions reach the XDP program
/// through lo) whose contribution completes every fragment: the RESULT
/// comes up lo's stack, and the TC ingress program that `aggbox attach`
/// puts on lo too copies it to every member of the result group, the local
/// one included, each exactly once, as for a RESULT completed on eth0.
#[test]
fn a_result_completed_through_lo_is_copied_to_the_group() {
    require_root();
    const JOB: u16 = 8;
    const PORT: u16 = 7010;
    const RESULT_PORT: u16 = 7011;
    const GROUP: u16 = 4;
    // host 0 = the node and rank 0, hosts 1 and 2 = ranks 1 and 2
    let tb = Testbed::up(TestbedConfig { hosts: 3, ..Default::default() }).expect("testbed");
    let node = tb.host(0);
    // The group's member on this host gets its copy through lo with the
    // node's own source address (docs/BROADCAST.md "Members on this host").
    let out = tb.run_in(0, &["sysctl", "-qw", "net.ipv4.conf.lo.accept_local=1"]).expect("sysctl");
    assert!(out.status.success(), "sysctl accept_local: {out:?}");
    let workers: Vec<Ipv4Addr> = (0..3).map(|i| tb.host(i).addr).collect();
    let members: Vec<SocketAddrV4> = workers.iter().map(|w| SocketAddrV4::new(*w, MEMBER_PORT)).collect();
    let member_list: Vec<String> = members.iter().map(|m| format!("\"{m}\"")).collect();
    let attach = Attach::start(
        &node.netns,
        "lo-result",
        &format!(
            "[node]\nmetrics = \"off\"\n\n{}\n[[group]]\nid = {GROUP}\nmembers = [{}]\n",
            job_toml(JOB, PORT, &workers, RESULT_PORT, &format!("result_group = {GROUP}")),
            member_list.join(", ")
        ),
        &[],
    );
    let lo = tb.run_in(0, &["tc", "filter", "show", "dev", "lo", "ingress"]).expect("tc");
    assert!(String::from_utf8_lossy(&lo.stdout).contains("aggbox_tc_ingre"), "the ingress program is on lo: {lo:?}");

    let local = bind_in(&node.netns, RESULT_PORT);
    let member_socks: Vec<UdpSocket> = (0..3).map(|i| bind_in(&tb.host(i).netns, MEMBER_PORT)).collect();
    let to = SocketAddrV4::new(node.addr, PORT);
    let rounds = [(1u32, Op::Sum), (2, Op::Max)];
    for &(round, op) in &rounds {
        // The remote ranks first, so that rank 0's contribution, through
        // lo, completes every fragment.
        for rank in [1u16, 2, 0] {
            contribute(&tb.host(usize::from(rank)).netns, to, JOB, rank, round, op, tools::pattern_vector(rank, ELEMENTS));
        }
        let expected = tools::expected_pattern_result(op, 3, ELEMENTS, &[]).expect("reference");
        let expected = expected.ints().expect("integer result").to_vec();
        expect_results(&format!("round {round}: the node's local socket"), &local, JOB, &expected);
        for (i, s) in member_socks.iter().enumerate() {
            expect_results(&format!("round {round}: member {i} ({})", members[i]), s, JOB, &expected);
        }
    }
    let frags = fragments() as u64;
    let st = attach.broadcast_counts();
    eprintln!("the node's TC counters: {st:?}");
    assert_eq!(count(&st, BcastStat::ResultBroadcast), rounds.len() as u64 * frags, "every RESULT routed");
    assert_eq!(count(&st, BcastStat::LocalCopy), rounds.len() as u64 * frags, "the local member's copy of each");
    drop(attach);
}
