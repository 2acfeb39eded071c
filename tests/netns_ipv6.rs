//! XDP aggregation over IPv6 on a live veth, end to end through the kernel's
//! IPv6 stack (docs/PROTOCOL.md, "IPv6"): two namespaces joined by a veth
//! pair, the XDP program attached (native) on the aggregator's end, a job of
//! two IPv6 ranks, contributions sent from ordinary UDP sockets, and the
//! RESULT taken by an ordinary UDP socket on the result port: the receiving
//! stack delivers it only if its UDP checksum is right (IPv6 allows no 0).
//! Run with the sender's TX checksum offload on (the contributions carry
//! partial checksums) and off (full checksums, so the stack verifies the
//! RESULT's in software). A sender that is no rank is dropped
//! `source_mismatch`.
//!
//! The job is made with the kernel API (`XdpPlane::set_job` with IPv6
//! ranks): the config file's workers are IPv4 until the runtime, TC and the
//! user-space path serve IPv6.
//!
//! Needs root: `sudo -E cargo test --test netns_ipv6`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod bpf_common;

use std::fs::File;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6, UdpSocket};
use std::process::Command;
use std::time::Duration;

use aggbox::kernel::xdp::{XdpJob, XdpMode};
use aggbox::wire::abi::{self, DropReason, Op, Outcome};
use bpf_common::*;
use nix::sched::{setns, CloneFlags};

const AGG: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
const RANKS: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x11),
    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x12),
];
const STRANGER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x13);
const JOB: u16 = 61;

/// The test's namespaces, deleted on drop (a failed test too).
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("run {cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn udp6(addr: Ipv6Addr, port: u16) -> UdpSocket {
    let sock = UdpSocket::bind(SocketAddr::V6(SocketAddrV6::new(addr, port, 0, 0))).expect("bind");
    sock.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    sock
}

#[test]
fn an_ipv6_job_aggregates_on_a_live_veth_and_its_result_reaches_a_socket() {
    require_root();
    let tag = std::process::id();
    let (agg_ns, wk_ns) = (format!("agg6a{tag}"), format!("agg6w{tag}"));
    let _guard = Namespaces(vec![agg_ns.clone(), wk_ns.clone()]);
    run("ip", &["netns", "add", &agg_ns]);
    run("ip", &["netns", "add", &wk_ns]);
    run("ip", &["-n", &agg_ns, "link", "add", "agg0", "type", "veth", "peer", "name", "wk0", "netns", &wk_ns]);
    run("ip", &["-n", &agg_ns, "addr", "add", &format!("{AGG}/64"), "dev", "agg0", "nodad"]);
    for a in RANKS.iter().chain([&STRANGER]) {
        run("ip", &["-n", &wk_ns, "addr", "add", &format!("{a}/64"), "dev", "wk0", "nodad"]);
    }
    for (ns, dev) in [(&agg_ns, "agg0"), (&wk_ns, "wk0")] {
        run("ip", &["-n", ns, "link", "set", dev, "up"]);
        run("ip", &["-n", ns, "link", "set", "lo", "up"]);
    }

    let dp = load();
    let job = XdpJob {
        id: JOB,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: RANKS.iter().map(|&a| IpAddr::V6(a)).collect(),
        weights: vec![1, 3],
        ..XdpJob::default()
    };
    dp.set_job(JOB, &job).expect("a job of IPv6 ranks");

    // The workers' sockets, in their namespace.
    let (senders, stranger) = testbed::in_netns(&wk_ns, || {
        let senders: Vec<UdpSocket> = RANKS.iter().map(|&a| udp6(a, 40000)).collect();
        (senders, udp6(STRANGER, 40000))
    })
    .expect("worker namespace");
    // This thread joins the aggregator's namespace: the result socket and
    // the XDP link live there.
    let f = File::open(format!("/run/netns/{agg_ns}")).expect("netns file");
    setns(f, CloneFlags::CLONE_NEWNET).expect("setns (this thread only)");
    let results = udp6(Ipv6Addr::UNSPECIFIED, RESULT_PORT);
    let ifindex = nix::net::if_::if_nametoindex("agg0").expect("agg0");
    let (link, _) = dp.attach_xdp(ifindex, XdpMode::Native).expect("attach");
    assert_eq!(link.mode(), XdpMode::Native);

    let to = SocketAddr::V6(SocketAddrV6::new(AGG, JOB_PORT, 0, 0));
    for (round, offload) in [(1u32, "on"), (2, "off")] {
        run("ip", &["netns", "exec", &wk_ns, "ethtool", "-K", "wk0", "tx", offload]);
        let values: [Vec<i32>; 2] = [(0..300).map(|i| i * 7 - 1000).collect(), (0..300).map(|i| 5 - i).collect()];
        let datagram = |rank: u16| {
            let mut a = Agg::new(JOB, rank, Op::Sum as u8, values[rank as usize].clone());
            a.round = round;
            a.seq = round * 10 + u32::from(rank);
            a.flags = abi::AGG_F_LAST_FRAGMENT;
            a.bytes()
        };
        let before = dp.stats().unwrap();
        // A stranger claiming rank 0, then the ranks themselves.
        stranger.send_to(&datagram(0), to).expect("send");
        senders[0].send_to(&datagram(0), to).expect("send");
        std::thread::sleep(Duration::from_millis(50));
        senders[1].send_to(&datagram(1), to).expect("send");
        let mut buf = [0u8; 2048];
        let (n, from) = results
            .recv_from(&mut buf)
            .unwrap_or_else(|e| panic!("round {round}, TX offload {offload}: no RESULT on the result port ({e}): {:?}", dp.stats()));
        assert_eq!(from.ip(), IpAddr::V6(RANKS[1]), "the completing contribution's source");
        let r = &buf[..n];
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), abi::RESULT_RANK);
        assert_eq!(r[21], abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT);
        let got: Vec<i32> = r[24..].chunks(4).map(|c| i32::from_be_bytes(c.try_into().unwrap())).collect();
        let want: Vec<i32> = (0..300).map(|i| values[0][i] + 3 * values[1][i]).collect();
        assert_eq!(got, want, "round {round}, TX offload {offload}");
        assert!(results.recv_from(&mut buf).is_err(), "one RESULT, nothing else");
        let after = dp.stats().unwrap();
        assert_eq!(stat_delta(&before, &after, Outcome::Accepted.label()), 1);
        assert_eq!(stat_delta(&before, &after, Outcome::Result.label()), 1);
        assert_eq!(stat_delta(&before, &after, DropReason::SourceMismatch.label()), 1, "the stranger");
        assert_eq!(after.dropped_packets() - before.dropped_packets(), 1);
    }
    link.detach().expect("detach");
}
