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
//! Then the same with TC: the RESULT copied to every member of the job's
//! IPv6 result group. The jobs and groups are made with the kernel API
//! (`XdpPlane::set_job` with IPv6 ranks, `TcPlane::set_group` with IPv6
//! members); tests/netns_dual_stack.rs drives them from a config file.
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

use aggbox::kernel::tc::TcPlane;
use aggbox::kernel::xdp::{XdpJob, XdpMode};
use aggbox::wire::abi::{self, BcastStat, DropReason, Op, Outcome};
use bpf_common::*;
use nix::sched::{setns, CloneFlags};

const AGG: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
const RANKS: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x11),
    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x12),
];
const STRANGER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x13);
const JOB: u16 = 61;

// The result-group test's addresses and ports (a network of its own).
const COPY_AGG: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 0, 1);
const COPY_RANKS: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 0, 0x11),
    Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 0, 0x12),
];
const COPY_JOB: u16 = 62;
const COPY_GROUP: u16 = 62;
const COPY_MEMBER_PORT: u16 = 7700;

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

/// In-kernel allreduce over IPv6 on a live veth (docs/BROADCAST.md, "IPv6"):
/// the XDP aggregator completes an IPv6 job's RESULT and passes it up the
/// stack, where the TC ingress program on the same interface copies it to
/// every member of the job's IPv6 result group (`set_result_route`). Two
/// namespaces joined by a veth pair, the programs attached on the
/// aggregator's end, a job of two IPv6 ranks, contributions and copies
/// through ordinary UDP sockets: the members' stack delivers a copy only if
/// its UDP checksum is right (IPv6 allows no 0). With the workers' TX
/// checksum offload on and off, and the aggregator's neighbour table
/// flushed before each round (the copies' first next hops are cold: the
/// neighbour path, neighbour discovery, runs).
#[test]
fn an_ipv6_result_is_copied_to_every_member_of_its_ipv6_result_group() {
    require_root();
    let tag = std::process::id();
    let (agg_ns, wk_ns) = (format!("agr6a{tag}"), format!("agr6w{tag}"));
    let _guard = Namespaces(vec![agg_ns.clone(), wk_ns.clone()]);
    run("ip", &["netns", "add", &agg_ns]);
    run("ip", &["netns", "add", &wk_ns]);
    run("ip", &["-n", &agg_ns, "link", "add", "agg0", "type", "veth", "peer", "name", "wk0", "netns", &wk_ns]);
    run("ip", &["-n", &agg_ns, "addr", "add", &format!("{COPY_AGG}/64"), "dev", "agg0", "nodad"]);
    for a in COPY_RANKS {
        run("ip", &["-n", &wk_ns, "addr", "add", &format!("{a}/64"), "dev", "wk0", "nodad"]);
    }
    for (ns, dev) in [(&agg_ns, "agg0"), (&wk_ns, "wk0")] {
        run("ip", &["-n", ns, "link", "set", dev, "up"]);
        run("ip", &["-n", ns, "link", "set", "lo", "up"]);
    }
    // TcPlane::attach wants IPv4 forwarding; bpf_fib_lookup(AF_INET6) IPv6's
    run("ip", &["netns", "exec", &agg_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"]);

    let dp = load();
    let job = XdpJob {
        id: COPY_JOB,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: COPY_RANKS.iter().map(|&a| IpAddr::V6(a)).collect(),
        weights: vec![1, 1],
        ..XdpJob::default()
    };
    dp.set_job(COPY_JOB, &job).expect("a job of IPv6 ranks");
    let mut plane = TcPlane::load().expect("load the TC programs");
    let members: Vec<SocketAddr> = COPY_RANKS.iter().map(|&a| SocketAddr::V6(SocketAddrV6::new(a, COPY_MEMBER_PORT, 0, 0))).collect();
    plane.set_group(COPY_GROUP, &members).expect("an IPv6 result group");
    plane.set_result_route(COPY_JOB, RESULT_PORT, COPY_GROUP).expect("set_result_route");

    // The workers' sockets (contributions, and the group copies on
    // COPY_MEMBER_PORT), in their namespace.
    let (senders, copies) = testbed::in_netns(&wk_ns, || {
        let senders: Vec<UdpSocket> = COPY_RANKS.iter().map(|&a| udp6(a, 40000)).collect();
        let copies: Vec<UdpSocket> = COPY_RANKS.iter().map(|&a| udp6(a, COPY_MEMBER_PORT)).collect();
        (senders, copies)
    })
    .expect("worker namespace");
    // This thread joins the aggregator's namespace: the local result
    // socket, the XDP link and the TC filters live there (and the plane
    // detaches there when dropped).
    let f = File::open(format!("/run/netns/{agg_ns}")).expect("netns file");
    setns(f, CloneFlags::CLONE_NEWNET).expect("setns (this thread only)");
    let results = udp6(Ipv6Addr::UNSPECIFIED, RESULT_PORT);
    let ifindex = nix::net::if_::if_nametoindex("agg0").expect("agg0");
    let (link, _) = dp.attach_xdp(ifindex, XdpMode::Native).expect("attach XDP");
    plane.attach(ifindex).expect("attach TC");

    let to = SocketAddr::V6(SocketAddrV6::new(COPY_AGG, JOB_PORT, 0, 0));
    for (round, offload) in [(1u32, "on"), (2, "off")] {
        run("ip", &["netns", "exec", &wk_ns, "ethtool", "-K", "wk0", "tx", offload]);
        // cold next hops: no neighbour entry, nothing in the program's cache
        run("ip", &["netns", "exec", &agg_ns, "ip", "-6", "neigh", "flush", "all"]);
        plane.flush_neigh_cache().expect("flush cache");
        let values: [Vec<i32>; 2] = [(0..300).map(|i| i * 7 - 1000).collect(), (0..300).map(|i| 5 - i).collect()];
        let datagram = |rank: u16| {
            let mut a = Agg::new(COPY_JOB, rank, Op::Sum as u8, values[rank as usize].clone());
            a.round = round;
            a.seq = round * 10 + u32::from(rank);
            a.flags = abi::AGG_F_LAST_FRAGMENT;
            a.bytes()
        };
        let before = plane.stats().expect("stats");
        let xdp_before = dp.stats().unwrap();
        senders[0].send_to(&datagram(0), to).expect("send");
        std::thread::sleep(Duration::from_millis(50));
        senders[1].send_to(&datagram(1), to).expect("send");
        let row = format!("round {round}, TX offload {offload}");

        // the local application's RESULT, unchanged
        let mut buf = [0u8; 2048];
        let (n, from) = results.recv_from(&mut buf).unwrap_or_else(|e| panic!("{row}: no RESULT on the result port ({e})"));
        assert_eq!(from.ip(), IpAddr::V6(COPY_RANKS[1]), "{row}: the completing contribution's source");
        let result = buf[..n].to_vec();
        assert_eq!(u16::from_be_bytes([result[6], result[7]]), abi::RESULT_RANK);
        let got: Vec<i32> = result[24..].chunks(4).map(|c| i32::from_be_bytes(c.try_into().unwrap())).collect();
        let want: Vec<i32> = (0..300).map(|i| values[0][i] + values[1][i]).collect();
        assert_eq!(got, want, "{row}: the sum");
        // every member's copy: the same RESULT, from this node
        for (m, s) in members.iter().zip(&copies) {
            let (n, from) = s.recv_from(&mut buf).unwrap_or_else(|e| panic!("{row}: member {m} got no copy ({e}): {:?}", plane.stats()));
            assert_eq!(&buf[..n], &result[..], "{row}: member {m}: the RESULT itself");
            assert_eq!(from.ip(), IpAddr::V6(COPY_AGG), "{row}: member {m}: source = the aggregator");
            assert!(s.recv_from(&mut buf).is_err(), "{row}: member {m}: one copy");
        }
        let st = plane.stats().expect("stats");
        let d = |s: BcastStat| st.packets(s) - before.packets(s);
        assert_eq!(d(BcastStat::ResultBroadcast), 1, "{row}");
        assert_eq!(d(BcastStat::CopySent) + d(BcastStat::NeighMiss), 2, "{row}: a copy per member");
        assert!(d(BcastStat::NeighMiss) >= 1, "{row}: cold next hops: the neighbour path ran");
        assert_eq!(d(BcastStat::FamilyMismatch) + d(BcastStat::FibError) + d(BcastStat::RewriteFailed), 0, "{row}");
        assert_eq!(stat_delta(&xdp_before, &dp.stats().unwrap(), Outcome::Result.label()), 1, "{row}");
    }
    let csum_errors = Command::new("sh")
        .args(["-c", &format!("ip netns exec {wk_ns} cat /proc/net/snmp6")])
        .output()
        .expect("snmp6");
    let text = String::from_utf8_lossy(&csum_errors.stdout);
    let errors = text.lines().find_map(|l| l.strip_prefix("Udp6InCsumErrors")).map(|v| v.trim().to_string());
    assert_eq!(errors.as_deref(), Some("0"), "Udp6InCsumErrors on the members' side");
    plane.detach().expect("detach TC");
    link.detach().expect("detach XDP");
}
