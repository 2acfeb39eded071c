//! BPF_PROG_TEST_RUN cases for the broadcast TC programs
//! (`src/bpf/aggbox_tc.bpf.c`), katran-fixture style: {input frame, group
//! table, skb mark} -> {verdict, output frame, counters}.
//!
//! The runs happen inside host 0 of a two-host testbed with static
//! neighbours, with the test skb on host 0's eth0: bpf_fib_lookup resolves
//! host 1 there, and the copies the program clones (which BPF_PROG_TEST_RUN
//! really transmits) stay inside the testbed. With a mask of one destination
//! no clone is made: the original becomes the copy and comes back in
//! `data_out`, so its bytes (addresses, ports, MACs, checksums) are checked
//! here with an independent checksum routine.
//!
//! Needs root; fails (never skips) otherwise.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};

use aggbox::wire::abi::{self, BcastStat};
use aggbox::kernel::tc::{self, plan_tree, TcPlane, TcProgram, TreeNode, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};
use crate::testbed::{in_netns, Testbed, TestbedConfig};

const GROUP: u16 = 9;
const SPORT: u16 = 40000;

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the TC BPF_PROG_TEST_RUN tests need root (CAP_BPF + CAP_NET_ADMIN); run them with sudo: \
         `sudo -E cargo test --test bpf_tc`"
    );
}

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

fn sum16(bytes: &[u8]) -> u32 {
    bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// RFC 768 checksum of a UDP datagram (header with its checksum field as
/// it is + payload) — 0 when the stored checksum is right (or 0xffff/0).
fn udp_verify(src: Ipv4Addr, dst: Ipv4Addr, udp: &[u8]) -> u16 {
    let mut sum = sum16(&src.octets()) + sum16(&dst.octets()) + 17 + udp.len() as u32;
    sum += sum16(udp);
    !fold(sum)
}

/// Checksum to store in a UDP header whose checksum field is zero.
fn udp_checksum(src: Ipv4Addr, dst: Ipv4Addr, udp: &[u8]) -> u16 {
    match udp_verify(src, dst, udp) {
        0 => 0xffff,
        c => c,
    }
}

fn ip_checksum(hdr: &[u8]) -> u16 {
    !fold(sum16(hdr))
}

#[derive(Clone)]
struct Frame {
    dmac: [u8; 6],
    smac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    dport: u16,
    frag: u16,
    payload: Vec<u8>,
    udp_csum: bool,
    /// An 802.1Q tag (TCI) between the MACs and the IPv4 ethertype.
    vlan: Option<u16>,
}

impl Frame {
    fn build(&self) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&self.dmac);
        f.extend_from_slice(&self.smac);
        if let Some(tci) = self.vlan {
            f.extend_from_slice(&0x8100u16.to_be_bytes());
            f.extend_from_slice(&tci.to_be_bytes());
        }
        f.extend_from_slice(&0x0800u16.to_be_bytes());
        let tot = (20 + 8 + self.payload.len()) as u16;
        let mut ip = vec![0x45, 0];
        ip.extend_from_slice(&tot.to_be_bytes());
        ip.extend_from_slice(&0x4242u16.to_be_bytes());
        ip.extend_from_slice(&self.frag.to_be_bytes());
        ip.extend_from_slice(&[64, 17, 0, 0]);
        ip.extend_from_slice(&self.src.octets());
        ip.extend_from_slice(&self.dst.octets());
        let c = ip_checksum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        f.extend_from_slice(&ip);
        let mut udp = Vec::new();
        udp.extend_from_slice(&SPORT.to_be_bytes());
        udp.extend_from_slice(&self.dport.to_be_bytes());
        udp.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(&self.payload);
        if self.udp_csum {
            let c = udp_checksum(self.src, self.dst, &udp);
            udp[6..8].copy_from_slice(&c.to_be_bytes());
        }
        f.extend_from_slice(&udp);
        f
    }
}

fn agb1(mask: u32, seq: u32, group: u16, flags: u8, hops: u8, body: usize) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&abi::MAGIC_BCAST.to_be_bytes());
    d.extend_from_slice(&mask.to_be_bytes());
    d.extend_from_slice(&seq.to_be_bytes());
    d.extend_from_slice(&group.to_be_bytes());
    d.push(flags);
    d.push(hops);
    d.extend((0..body).map(|i| (i * 7 + seq as usize) as u8));
    d
}

/// Parsed view of an output frame (no VLAN, IHL 5).
struct Out<'a>(&'a [u8]);

impl Out<'_> {
    fn dmac(&self) -> [u8; 6] {
        self.0[0..6].try_into().unwrap()
    }
    fn smac(&self) -> [u8; 6] {
        self.0[6..12].try_into().unwrap()
    }
    fn src(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.0[26], self.0[27], self.0[28], self.0[29])
    }
    fn dst(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.0[30], self.0[31], self.0[32], self.0[33])
    }
    fn dport(&self) -> u16 {
        u16::from_be_bytes([self.0[36], self.0[37]])
    }
    fn udp_csum(&self) -> u16 {
        u16::from_be_bytes([self.0[40], self.0[41]])
    }
    fn udp(&self) -> &[u8] {
        &self.0[34..]
    }
    fn payload(&self) -> &[u8] {
        &self.0[42..]
    }
    /// Both checksums right, and the UDP checksum still on (`udp_csum`)
    /// or still disabled.
    fn check_checksums_kept(&self, udp_csum: bool) {
        self.check_checksums();
        if udp_csum {
            assert_ne!(self.udp_csum(), 0);
        } else {
            assert_eq!(self.udp_csum(), 0, "a disabled checksum stays disabled");
        }
    }
    fn check_checksums(&self) {
        assert_eq!(fold(sum16(&self.0[14..34])), 0xffff, "IPv4 header checksum");
        if self.udp_csum() != 0 {
            assert_eq!(udp_verify(self.src(), self.dst(), self.udp()), 0, "UDP checksum (full)");
        }
    }
}

struct Fixture {
    tb: Testbed,
    plane: TcPlane,
    eth0: u32,
    h0_mac: [u8; 6],
    h1: SocketAddrV4,
    h1_mac: [u8; 6],
}

impl Fixture {
    fn new() -> Fixture {
        require_root();
        let tb = Testbed::up(TestbedConfig {
            hosts: 2,
            static_neigh: true,
            ..Default::default()
        })
        .expect("testbed");
        let plane = TcPlane::load().unwrap_or_else(|e| panic!("loading the TC programs failed: {e:#?}"));
        let eth0 = in_netns(&tb.host(0).netns, || tc::ifindex("eth0"))
            .expect("netns")
            .expect("eth0");
        let (h0, h1) = (tb.host(0), tb.host(1));
        Fixture {
            eth0,
            h0_mac: h0.mac,
            h1: SocketAddrV4::new(h1.addr, 7200),
            h1_mac: h1.mac,
            plane,
            tb,
        }
    }

    fn frame(&self, payload: Vec<u8>) -> Frame {
        let (h0, h1) = (self.tb.host(0), self.tb.host(1));
        Frame {
            dmac: h1.mac,
            smac: h0.mac,
            src: h0.addr,
            dst: h1.addr,
            dport: 7999,
            frag: 0x4000,
            payload,
            udp_csum: true,
            vlan: None,
        }
    }

    fn run(&self, prog: TcProgram, frame: &[u8], mark: u32) -> tc::TcRun {
        in_netns(&self.tb.host(0).netns, || self.plane.test_run(prog, frame, self.eth0, mark))
            .expect("netns")
            .expect("test_run")
    }

    fn delta(&self, before: &tc::BroadcastStats, stat: BcastStat) -> u64 {
        self.plane.stats().expect("stats").packets(stat) - before.packets(stat)
    }
}

#[test]
fn egress_rewrites_the_copy_for_one_destination() {
    let fx = Fixture::new();
    let other = SocketAddrV4::new(fx.h1.ip().to_owned(), 7300);
    fx.plane.set_group(GROUP, &[fx.h1, other]).expect("set_group");

    for (mask, want_port) in [(0b01u32, 7200u16), (0b10, 7300)] {
        for udp_csum in [true, false] {
            for body in [0usize, 1, 47, 1456] {
                let payload = agb1(mask, 5, GROUP, 0, 3, body);
                let mut f = fx.frame(payload.clone());
                // the app sent it somewhere else entirely
                f.dst = Ipv4Addr::new(10, 77, 0, 200);
                f.dmac = [0x02, 0, 0, 0, 0, 0x99];
                f.udp_csum = udp_csum;
                let before = fx.plane.stats().expect("stats");
                let run = fx.run(TcProgram::Egress, &f.build(), 0);
                assert_eq!(run.verdict, TC_ACT_OK, "the original leaves as the copy");
                let out = Out(&run.data);
                assert_eq!(out.dst(), *fx.h1.ip());
                assert_eq!(out.dport(), want_port);
                assert_eq!(out.src(), f.src, "source untouched");
                assert_eq!(out.dmac(), fx.h1_mac, "next-hop MAC from bpf_fib_lookup / cache");
                assert_eq!(out.smac(), fx.h0_mac);
                assert_eq!(out.payload(), &payload[..], "AGB1 header and payload unchanged");
                out.check_checksums_kept(udp_csum);
                assert_eq!(fx.delta(&before, BcastStat::Broadcast), 1);
                assert_eq!(fx.delta(&before, BcastStat::CopySent), 1);
                assert_eq!(run.mark, 0);
            }
        }
    }
    // the first lookup went to the FIB, the rest hit the cache
    let st = fx.plane.stats().expect("stats");
    assert_eq!(st.packets(BcastStat::FibLookup), 1);
    assert!(st.packets(BcastStat::CacheHit) >= 15);
    let cache = fx.plane.neigh_cache().expect("cache");
    assert_eq!(cache.len(), 1);
    assert_eq!(cache[0].addr, *fx.h1.ip());
    assert_eq!(cache[0].neigh.dmac, fx.h1_mac);
    assert_eq!(cache[0].neigh.ifindex, fx.eth0);
    let gs = fx.plane.group_stats(GROUP, 0).expect("gstats").expect("exists");
    assert_eq!(gs.datagrams, 16);
    assert_eq!(gs.copies, 16);
}

/// The common copy (next hop cached, the member's port the datagram's):
/// Ethernet header, VLAN tag and the IPv4 header's first 20 bytes are
/// written back in one store, so everything else in them must come back
/// as it was, with or without a VLAN tag and a UDP checksum.
#[test]
fn egress_common_copy_rewrites_addresses_and_checksums_behind_a_vlan_tag_too() {
    let fx = Fixture::new();
    fx.plane.set_group(GROUP, &[fx.h1]).expect("set_group");
    for vlan in [None, Some(0x2005u16)] {
        for udp_csum in [true, false] {
            for body in [0usize, 13, 1400] {
                let payload = agb1(1, 9, GROUP, 0, 0, body);
                let mut f = fx.frame(payload.clone());
                f.dport = fx.h1.port();
                f.dst = Ipv4Addr::new(10, 77, 0, 201);
                f.dmac = [0x02, 0, 0, 0, 0, 0x98];
                f.udp_csum = udp_csum;
                f.vlan = vlan;
                let sent = f.build();
                let run = fx.run(TcProgram::Egress, &sent, 0);
                assert_eq!(run.verdict, TC_ACT_OK, "{vlan:?}: the original leaves as the copy");
                assert_eq!(run.data.len(), sent.len(), "{vlan:?}: length unchanged");
                // Without the tag the output reads as an untagged frame.
                let untagged: Vec<u8> = match vlan {
                    Some(tci) => {
                        assert_eq!(run.data[12..16], [0x81, 0x00, (tci >> 8) as u8, tci as u8], "tag kept");
                        [&run.data[..12], &run.data[16..]].concat()
                    }
                    None => run.data.clone(),
                };
                let ip_in = if vlan.is_some() { &sent[18..38] } else { &sent[14..34] };
                let out = Out(&untagged);
                assert_eq!(out.dmac(), fx.h1_mac, "{vlan:?}: next-hop MAC");
                assert_eq!(out.smac(), fx.h0_mac);
                assert_eq!(out.dst(), *fx.h1.ip(), "{vlan:?}: destination");
                assert_eq!(out.src(), f.src, "source untouched");
                assert_eq!(out.dport(), fx.h1.port());
                assert_eq!(untagged[14..24], ip_in[..10], "{vlan:?}: IPv4 version..protocol untouched");
                assert_eq!(out.payload(), &payload[..], "AGB1 header and payload unchanged");
                out.check_checksums_kept(udp_csum);
            }
        }
    }
    let st = fx.plane.stats().expect("stats");
    assert_eq!(st.packets(BcastStat::CopySent), 12, "every datagram one copy");
    assert_eq!(st.packets(BcastStat::RewriteFailed), 0);
}

#[test]
fn egress_verdicts_for_other_traffic_and_bad_datagrams() {
    let fx = Fixture::new();
    fx.plane.set_group(GROUP, &[fx.h1]).expect("set_group");
    let cases: Vec<(&str, Frame, u32, i32, BcastStat)> = vec![
        ("plain UDP", fx.frame(b"hello world, not aggbox".to_vec()), 0, TC_ACT_OK, BcastStat::NotAggbox),
        ("AGG1", fx.frame({
            let mut p = agb1(1, 1, GROUP, 0, 0, 8);
            p[..4].copy_from_slice(&abi::MAGIC_AGG.to_be_bytes());
            p
        }), 0, TC_ACT_OK, BcastStat::NotAggbox),
        ("unknown group", fx.frame(agb1(1, 1, GROUP + 1, 0, 0, 8)), 0, TC_ACT_OK, BcastStat::UnknownGroup),
        ("truncated AGB1", fx.frame(agb1(1, 1, GROUP, 0, 0, 0)[..10].to_vec()), 0, TC_ACT_OK, BcastStat::Malformed),
        ("reserved flag", fx.frame(agb1(1, 1, GROUP, 0x80, 0, 8)), 0, TC_ACT_OK, BcastStat::Malformed),
        ("IP fragment", Frame { frag: 0x2000, ..fx.frame(agb1(1, 1, GROUP, 0, 0, 8)) }, 0, TC_ACT_OK, BcastStat::IpFragment),
        ("empty mask", fx.frame(agb1(0, 1, GROUP, 0, 0, 8)), 0, TC_ACT_SHOT, BcastStat::EmptyMask),
        ("mask beyond the table", fx.frame(agb1(0xfffe, 1, GROUP, 0, 0, 8)), 0, TC_ACT_SHOT, BcastStat::EmptyMask),
        ("own copy", fx.frame(agb1(1, 1, GROUP, 0, 0, 8)), abi::BCAST_MARK_COPY, TC_ACT_OK, BcastStat::OwnCopy),
        ("own copy, neighbour path done", fx.frame(agb1(1, 1, GROUP, 0, 0, 8)), abi::BCAST_MARK_DONE, TC_ACT_OK, BcastStat::OwnCopy),
    ];
    for (name, frame, mark, verdict, stat) in cases {
        let bytes = frame.build();
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Egress, &bytes, mark);
        assert_eq!(run.verdict, verdict, "{name}: verdict");
        if verdict == TC_ACT_OK {
            assert_eq!(run.data, bytes, "{name}: untouched");
        }
        assert_eq!(fx.delta(&before, stat), 1, "{name}: counted as {stat:?}");
        let after = fx.plane.stats().expect("stats");
        assert_eq!(after.datagrams() - before.datagrams(), 1, "{name}: exactly one outcome");
    }

    // a copy whose neighbour is unresolved re-enters with MARK_NEIGH and is
    // handed to bpf_redirect_neigh, marked DONE
    let run = fx.run(TcProgram::Egress, &fx.frame(agb1(1, 1, GROUP, 0, 0, 8)).build(), abi::BCAST_MARK_NEIGH);
    assert_eq!(run.verdict, TC_ACT_REDIRECT);
    assert_eq!(run.mark, abi::BCAST_MARK_DONE);
}

#[test]
fn egress_unresolved_neighbour_goes_through_the_neighbour_path() {
    let fx = Fixture::new();
    // 10.77.0.77 is on the link but nobody has it: NO_NEIGH
    let ghost = SocketAddrV4::new(Ipv4Addr::new(10, 77, 0, 77), 7200);
    fx.plane.set_group(GROUP, &[ghost]).expect("set_group");
    let payload = agb1(1, 1, GROUP, 0, 0, 100);
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Egress, &fx.frame(payload.clone()).build(), 0);
    assert_eq!(run.verdict, TC_ACT_REDIRECT, "bpf_redirect_neigh");
    assert_eq!(run.mark, abi::BCAST_MARK_DONE, "its next pass through egress is let go");
    let out = Out(&run.data);
    assert_eq!(out.dst(), *ghost.ip());
    assert_eq!(out.dport(), 7200);
    assert_eq!(out.dmac(), [0; 6], "never a stale or multicast MAC");
    assert_eq!(out.payload(), &payload[..]);
    out.check_checksums();
    assert_eq!(fx.delta(&before, BcastStat::NeighMiss), 1);
    assert!(fx.plane.neigh_cache().expect("cache").is_empty(), "unresolved next hops are not cached");

    // a destination on this very host (the datagram's own source address):
    // looped through lo (all-zero MAC), where a local source is no martian
    let here = SocketAddrV4::new(fx.tb.host(0).addr, 7300);
    fx.plane.set_group(GROUP, &[here]).expect("set_group");
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Egress, &fx.frame(payload.clone()).build(), 0);
    assert_eq!(run.verdict, TC_ACT_REDIRECT, "bpf_redirect(lo)");
    assert_eq!(run.mark, abi::BCAST_MARK_COPY);
    let out = Out(&run.data);
    assert_eq!((out.dst(), out.dport()), (*here.ip(), 7300));
    assert_eq!(out.dmac(), [0; 6], "lo's MAC");
    out.check_checksums();
    assert_eq!(fx.delta(&before, BcastStat::LocalCopy), 1);

    // a destination with no route at all: that copy is not sent
    let nowhere = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 7200);
    fx.plane.set_group(GROUP, &[nowhere]).expect("set_group");
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Egress, &fx.frame(payload).build(), 0);
    assert_eq!(run.verdict, TC_ACT_SHOT);
    assert_eq!(fx.delta(&before, BcastStat::FibError), 1);
}

#[test]
fn egress_several_destinations_clone_and_the_original_takes_the_last() {
    let fx = Fixture::new();
    let members: Vec<SocketAddrV4> = (0..32).map(|p| SocketAddrV4::new(*fx.h1.ip(), 7200 + p)).collect();
    fx.plane.set_group(GROUP, &members).expect("set_group");
    let mut gs_sum = (0u64, 0u64, 0u64);
    for mask in [0b11u32, 0x8000_0001, u32::MAX] {
        let payload = agb1(mask, 2, GROUP, 0, 0, 64);
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Egress, &fx.frame(payload.clone()).build(), 0);
        assert_eq!(run.verdict, TC_ACT_OK);
        let last = 31 - mask.leading_zeros() as u16;
        let out = Out(&run.data);
        assert_eq!(out.dport(), 7200 + last, "the original is the copy of the highest mask bit");
        assert_eq!(out.payload(), &payload[..]);
        out.check_checksums();
        assert_eq!(
            fx.delta(&before, BcastStat::CopySent),
            u64::from(mask.count_ones()),
            "mask {mask:#x}: one copy per bit (clones really sent into the testbed)"
        );
        assert_eq!(fx.delta(&before, BcastStat::CloneFailed), 0);
        // the copy loop's per-group counts (kept in the copy state that the
        // global copy functions update)
        let gs = fx.plane.group_stats(GROUP, 0).expect("gstats").expect("exists");
        let gs_before = gs_sum;
        gs_sum = (gs.datagrams, gs.copies, gs.neigh_misses);
        assert_eq!(
            (gs_sum.0 - gs_before.0, gs_sum.1 - gs_before.1, gs_sum.2 - gs_before.2),
            (1, u64::from(mask.count_ones()), 0),
            "mask {mask:#x}: group counters"
        );
    }
}

/// Prints the verifier cost of both TC programs on the running kernel
/// (recorded in docs/BROADCAST.md and, per kernel, by `make matrix`) and
/// checks it stays far from the verifier's 1M-instruction limit. The copy
/// loops exceeded it on Linux 6.1 while 6.12 and 6.18 accepted them in under
/// 80k: a margin measured on one kernel says little about another, so this
/// runs on every kernel of the matrix.
#[test]
fn program_sizes() {
    require_root();
    let plane = TcPlane::load()
        .unwrap_or_else(|e| panic!("loading the TC programs failed: {e:#?}"));
    let progs = [
        ("aggbox_tc_egress", TcProgram::Egress),
        ("aggbox_tc_ingress", TcProgram::Ingress),
    ];
    for (name, prog) in progs {
        use std::os::fd::AsRawFd;
        let fd = plane.prog_fd(prog).as_raw_fd();
        // SAFETY: zeroed info is valid; no output arrays are requested.
        let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
        // SAFETY: a live program fd; info/len describe a live buffer.
        let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd, &mut info, &mut len) };
        assert_eq!(rc, 0, "bpf_prog_get_info_by_fd({name})");
        println!(
            "{name:<18} xlated {:>5} insns, verifier processed {:>6} insns",
            info.xlated_prog_len / 8,
            info.verified_insns
        );
        // verified_insns exists since 5.16; 0 would mean an older kernel
        assert!(
            info.verified_insns > 0 && info.verified_insns < 200_000,
            "{name}: {} insns",
            info.verified_insns
        );
    }
}

#[test]
fn ingress_forwards_with_hops_plus_one_and_delivers_the_original() {
    let fx = Fixture::new();
    let h0 = fx.tb.host(0);
    // host 0 is a tree node receiving the group on port 7400, with three
    // children on host 1 (each gets a clone; the original is delivered here)
    let children = [fx.h1, SocketAddrV4::new(*fx.h1.ip(), 7201), SocketAddrV4::new(*fx.h1.ip(), 7202)];
    fx.plane.set_forwarding(GROUP, 7400, &children).expect("set_forwarding");
    let mk = |flags: u8, hops: u8| {
        let mut f = fx.frame(agb1(0x3, 7, GROUP, flags, hops, 200));
        f.src = Ipv4Addr::new(10, 77, 0, 250); // the root
        f.dst = h0.addr;
        f.dport = 7400;
        f.dmac = h0.mac;
        f.smac = [0x02, 0, 0, 0, 0, 0x42];
        f
    };
    let cases = [
        ("FORWARD", mk(abi::BCAST_F_FORWARD, 0), BcastStat::Forwarded, 3u64),
        ("FORWARD, deep", mk(abi::BCAST_F_FORWARD, abi::BCAST_MAX_HOPS as u8), BcastStat::HopsLimit, 0),
        ("no FORWARD", mk(0, 0), BcastStat::LocalOnly, 0),
        ("other port, no table", Frame { dport: 7401, ..mk(abi::BCAST_F_FORWARD, 0) }, BcastStat::UnknownGroup, 0),
        ("not for this host", Frame { dmac: [0x02, 0, 0, 0, 0, 0x55], ..mk(abi::BCAST_F_FORWARD, 0) }, BcastStat::LocalOnly, 0),
    ];
    for (name, f, stat, copies) in cases {
        let bytes = f.build();
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Ingress, &bytes, 0);
        assert_eq!(run.verdict, TC_ACT_OK, "{name}: delivered locally");
        assert_eq!(run.data, bytes, "{name}: the local copy is the datagram as it arrived");
        assert_eq!(fx.delta(&before, stat), 1, "{name}: {stat:?}");
        assert_eq!(fx.delta(&before, BcastStat::CopySent), copies, "{name}: copies to children");
    }
    let gs = fx.plane.group_stats(GROUP, 7400).expect("gstats").expect("exists");
    assert_eq!((gs.datagrams, gs.copies), (1, 3));
}

#[test]
fn plan_tree_shapes() {
    let members: Vec<SocketAddr> =
        (0..100u16).map(|i| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, (i / 250) as u8, (i % 250) as u8 + 1), 7000 + i))).collect();
    // up to 32: one level
    let p = plan_tree(&members[..32], 32);
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].children, members[..32].to_vec());
    assert_eq!(p[0].full_mask(), u32::MAX);
    // 40 with fanout 8: root -> 8, four forwarders -> 8 each
    let p = plan_tree(&members[..40], 8);
    assert_eq!(p.len(), 5);
    assert_eq!(p[0].children, members[..8].to_vec());
    for (j, plan) in p[1..].iter().enumerate() {
        assert_eq!(plan.node, TreeNode::Member(members[j]));
        assert_eq!(plan.level, 1);
        assert_eq!(plan.table_port(), members[j].port());
        assert_eq!(plan.children, members[8 + 8 * j..16 + 8 * j].to_vec());
    }
    // every member reached exactly once, depth grows logarithmically
    for (n, fanout) in [(1usize, 1usize), (7, 2), (100, 3), (100, 32), (33, 32), (100, 50)] {
        let p = plan_tree(&members[..n], fanout);
        let mut reached: Vec<SocketAddr> = p.iter().flat_map(|x| x.children.clone()).collect();
        reached.sort();
        let mut want = members[..n].to_vec();
        want.sort();
        assert_eq!(reached, want, "n {n} fanout {fanout}");
        assert!(p.iter().all(|x| x.children.len() <= fanout.min(32)));
        assert!(p.iter().all(|x| match x.node {
            TreeNode::Root => x.level == 0,
            TreeNode::Member(m) => !x.children.contains(&m),
        }));
    }
}

// ---------------------------------------------------------------------------
// RESULT routing at TC ingress: in-kernel allreduce and trees of aggregators
// ---------------------------------------------------------------------------

const JOB: u16 = 7;
const RESULT_PORT: u16 = 7001;

/// AGG1 datagram: header + `count` elements derived from `seq`.
fn agg1(job: u16, rank: u16, seq: u32, flags: u8, count: u16) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&abi::MAGIC_AGG.to_be_bytes());
    d.extend_from_slice(&job.to_be_bytes());
    d.extend_from_slice(&rank.to_be_bytes());
    d.extend_from_slice(&seq.to_be_bytes());
    d.extend_from_slice(&42u32.to_be_bytes()); // round
    d.extend_from_slice(&362u32.to_be_bytes()); // frag_off
    d.push(0); // SUM
    d.push(flags);
    d.extend_from_slice(&count.to_be_bytes());
    for i in 0..u32::from(count) {
        d.extend_from_slice(&((i as i32 - 100) * 1_000_003 + seq as i32).to_be_bytes());
    }
    d
}

/// A RESULT as the XDP aggregator passes it up: from the completing
/// contributor (10.77.0.250) to host 0, UDP port RESULT_PORT.
fn result_frame(fx: &Fixture, payload: Vec<u8>, udp_csum: bool) -> Frame {
    let h0 = fx.tb.host(0);
    Frame {
        dmac: h0.mac,
        smac: [0x02, 0, 0, 0, 0, 0x42],
        src: Ipv4Addr::new(10, 77, 0, 250),
        dst: h0.addr,
        dport: RESULT_PORT,
        frag: 0x4000,
        payload,
        udp_csum,
        vlan: None,
    }
}

#[test]
fn ingress_result_is_copied_to_its_group_and_delivered_unchanged() {
    let fx = Fixture::new();
    let h0 = fx.tb.host(0);
    let members = [fx.h1, SocketAddrV4::new(*fx.h1.ip(), 7300)];
    fx.plane.set_group(GROUP, &members).expect("set_group");
    fx.plane.set_result_route(JOB, RESULT_PORT, GROUP).expect("set_result_route");
    let info = fx.plane.result_route(JOB).expect("read").expect("route");
    assert_eq!((info.result_port, info.group, info.parent), (RESULT_PORT, Some(GROUP), None));
    // receivers on host 1: the copies BPF_PROG_TEST_RUN's clones really send
    let rx: Vec<std::net::UdpSocket> = members
        .iter()
        .map(|m| {
            let s = in_netns(&fx.tb.host(1).netns, || std::net::UdpSocket::bind(m)).expect("netns").expect("bind");
            s.set_read_timeout(Some(std::time::Duration::from_millis(300))).expect("timeout");
            s
        })
        .collect();
    let before_snmp = fx.tb.run_in(1, &["cat", "/proc/net/snmp"]).expect("snmp");

    for (k, (udp_csum, count)) in [(false, 1u16), (true, 1), (false, 362), (true, 362), (true, 17)].into_iter().enumerate() {
        let payload = agg1(JOB, abi::RESULT_RANK, k as u32, abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT, count);
        let bytes = result_frame(&fx, payload.clone(), udp_csum).build();
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Ingress, &bytes, 0);
        assert_eq!(run.verdict, TC_ACT_OK, "row {k}: the RESULT is delivered locally");
        assert_eq!(run.data, bytes, "row {k}: the local RESULT is exactly the one that arrived");
        assert_eq!(fx.delta(&before, BcastStat::ResultBroadcast), 1, "row {k}");
        assert_eq!(fx.delta(&before, BcastStat::CopySent), 2, "row {k}: one copy per member");
        let after = fx.plane.stats().expect("stats");
        assert_eq!(after.datagrams() - before.datagrams(), 1, "row {k}: exactly one outcome");
        for (m, s) in members.iter().zip(&rx) {
            let mut buf = vec![0u8; 4096];
            let (n, from) = s.recv_from(&mut buf).unwrap_or_else(|e| panic!("row {k}: member {m} got no copy: {e}"));
            assert_eq!(&buf[..n], &payload[..], "row {k}: {m}: AGG1 header and payload unchanged");
            assert_eq!(from.ip(), std::net::IpAddr::V4(h0.addr), "row {k}: {m}: source = this node");
            assert_eq!(from.port(), SPORT, "row {k}: {m}: source port kept");
        }
    }
    let gs = fx.plane.group_stats(GROUP, 0).expect("gstats").expect("exists");
    assert_eq!((gs.datagrams, gs.copies), (5, 10));
    // the receiving kernel verified the full checksums the copies carry
    let after_snmp = fx.tb.run_in(1, &["cat", "/proc/net/snmp"]).expect("snmp");
    let csum_errors = |o: &std::process::Output| {
        let t = String::from_utf8_lossy(&o.stdout).to_string();
        let l: Vec<&str> = t.lines().filter(|l| l.starts_with("Udp:")).collect();
        let i = l[0].split_whitespace().position(|w| w == "InCsumErrors").expect("field");
        l[1].split_whitespace().nth(i).expect("value").parse::<u64>().expect("number")
    };
    assert_eq!(csum_errors(&after_snmp), csum_errors(&before_snmp), "UdpInCsumErrors on the members' host");

    // not routed: untouched, passed, counted not_aggbox
    let rows: Vec<(&str, Frame)> = vec![
        ("other port", Frame { dport: RESULT_PORT + 1, ..result_frame(&fx, agg1(JOB, abi::RESULT_RANK, 1, abi::AGG_F_RESULT, 4), true) }),
        ("other job", result_frame(&fx, agg1(JOB + 1, abi::RESULT_RANK, 1, abi::AGG_F_RESULT, 4), true)),
        ("a contribution", result_frame(&fx, agg1(JOB, 3, 1, 0, 4), true)),
        ("rank 0xffff without RESULT", result_frame(&fx, agg1(JOB, abi::RESULT_RANK, 1, 0, 4), true)),
        ("not for this host", Frame { dmac: [0x02, 0, 0, 0, 0, 0x55], ..result_frame(&fx, agg1(JOB, abi::RESULT_RANK, 1, abi::AGG_F_RESULT, 4), true) }),
        ("IP fragment", Frame { frag: 0x2000, ..result_frame(&fx, agg1(JOB, abi::RESULT_RANK, 1, abi::AGG_F_RESULT, 4), true) }),
        ("truncated AGG1", result_frame(&fx, agg1(JOB, abi::RESULT_RANK, 1, abi::AGG_F_RESULT, 4)[..20].to_vec(), true)),
    ];
    for (name, f) in rows {
        let bytes = f.build();
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Ingress, &bytes, 0);
        assert_eq!(run.verdict, TC_ACT_OK, "{name}");
        assert_eq!(run.data, bytes, "{name}: untouched");
        assert_eq!(fx.delta(&before, BcastStat::NotAggbox), 1, "{name}: not_aggbox");
        assert_eq!(fx.delta(&before, BcastStat::CopySent), 0, "{name}: no copies");
    }
    for s in &rx {
        let mut buf = [0u8; 64];
        s.set_read_timeout(Some(std::time::Duration::from_millis(50))).expect("timeout");
        assert!(s.recv_from(&mut buf).is_err(), "no copy of an unrouted datagram");
    }

    // route removed: local delivery only
    fx.plane.remove_result_route(JOB).expect("remove");
    assert_eq!(fx.plane.result_route(JOB).expect("read"), None);
    let bytes = result_frame(&fx, agg1(JOB, abi::RESULT_RANK, 9, abi::AGG_F_RESULT, 4), true).build();
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Ingress, &bytes, 0);
    assert_eq!((run.verdict, run.data == bytes), (TC_ACT_OK, true));
    assert_eq!(fx.delta(&before, BcastStat::NotAggbox), 1);
}

#[test]
fn ingress_result_goes_upstream_as_this_nodes_contribution() {
    let fx = Fixture::new();
    let h0 = fx.tb.host(0);
    let parent = tc::ParentRoute { addr: IpAddr::V4(*fx.h1.ip()), port: 7000, job: 9, rank: 2, result_port: RESULT_PORT };
    fx.plane.set_parent_route(JOB, &parent).expect("set_parent_route");
    assert_eq!(fx.plane.result_route(JOB).expect("read").expect("route").parent, Some(parent));

    let flag_rows = [
        (abi::AGG_F_RESULT, 0u8),
        (abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT, abi::AGG_F_LAST_FRAGMENT),
        (abi::AGG_F_RESULT | abi::AGG_F_OVERFLOW | abi::AGG_F_LAST_FRAGMENT, abi::AGG_F_OVERFLOW | abi::AGG_F_LAST_FRAGMENT),
    ];
    for (flags, want_flags) in flag_rows {
        for udp_csum in [false, true] {
            for count in [1u16, 100, 362] {
                let payload = agg1(JOB, abi::RESULT_RANK, 77, flags, count);
                let f = result_frame(&fx, payload.clone(), udp_csum);
                let before = fx.plane.stats().expect("stats");
                let run = fx.run(TcProgram::Ingress, &f.build(), 0);
                let row = format!("flags {flags:#x} csum {udp_csum} count {count}");
                assert_eq!(run.verdict, TC_ACT_REDIRECT, "{row}: redirected out, not delivered locally");
                let out = Out(&run.data);
                assert_eq!(out.src(), h0.addr, "{row}: source = this node");
                assert_eq!(out.dst(), parent.addr, "{row}");
                assert_eq!(out.dport(), parent.port, "{row}");
                assert_eq!(out.dmac(), fx.h1_mac, "{row}: next-hop MAC");
                assert_eq!(out.smac(), fx.h0_mac, "{row}");
                let mut want = payload.clone();
                want[4..6].copy_from_slice(&parent.job.to_be_bytes());
                want[6..8].copy_from_slice(&parent.rank.to_be_bytes());
                want[21] = want_flags;
                assert_eq!(out.payload(), &want[..], "{row}: job, rank, flags rewritten; seq, round, frag_off, op, count, payload kept");
                out.check_checksums();
                assert_eq!(out.udp_csum() != 0, udp_csum, "{row}: a zero checksum stays zero, a full one stays full");
                assert_eq!(fx.delta(&before, BcastStat::ResultUpstream), 1, "{row}");
                assert_eq!(fx.delta(&before, BcastStat::CopySent), 1, "{row}");
                assert_eq!(run.mark, abi::BCAST_MARK_COPY, "{row}: passes our egress hook untouched");
            }
        }
    }

    // group + parent: the group gets copies of the RESULT, the original goes upstream
    let member = SocketAddrV4::new(*fx.h1.ip(), 7300);
    fx.plane.set_group(GROUP, &[member]).expect("set_group");
    fx.plane.set_result_route(JOB, RESULT_PORT, GROUP).expect("set_result_route");
    let info = fx.plane.result_route(JOB).expect("read").expect("route");
    assert_eq!((info.group, info.parent), (Some(GROUP), Some(parent)));
    let rx = in_netns(&fx.tb.host(1).netns, || std::net::UdpSocket::bind(member)).expect("netns").expect("bind");
    rx.set_read_timeout(Some(std::time::Duration::from_millis(300))).expect("timeout");
    let payload = agg1(JOB, abi::RESULT_RANK, 78, abi::AGG_F_RESULT, 50);
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Ingress, &result_frame(&fx, payload.clone(), true).build(), 0);
    assert_eq!(run.verdict, TC_ACT_REDIRECT);
    assert_eq!(Out(&run.data).dport(), parent.port);
    assert_eq!(fx.delta(&before, BcastStat::ResultUpstream), 1);
    assert_eq!(fx.delta(&before, BcastStat::CopySent), 2);
    let mut buf = vec![0u8; 4096];
    let (n, from) = rx.recv_from(&mut buf).expect("the group member got its copy");
    assert_eq!((&buf[..n], from.ip()), (&payload[..], std::net::IpAddr::V4(h0.addr)), "the RESULT itself, from this node");

    // a mismatching result port is refused; bad parents are refused
    assert!(fx.plane.set_result_route(JOB, RESULT_PORT + 1, GROUP).is_err());
    for bad in [
        tc::ParentRoute { port: 0, ..parent },
        tc::ParentRoute { rank: abi::RESULT_RANK, ..parent },
        tc::ParentRoute { addr: IpAddr::V4(Ipv4Addr::UNSPECIFIED), ..parent },
        tc::ParentRoute { result_port: 0, ..parent },
    ] {
        assert!(fx.plane.set_parent_route(JOB + 1, &bad).is_err(), "{bad:?}");
    }
    fx.plane.remove_parent_route(JOB).expect("remove parent");
    let info = fx.plane.result_route(JOB).expect("read").expect("route");
    assert_eq!((info.group, info.parent), (Some(GROUP), None), "the group route stays");

    // parent with an unresolved neighbour: the neighbour path
    fx.plane.remove_result_route(JOB).expect("remove");
    let ghost = tc::ParentRoute { addr: IpAddr::V4(Ipv4Addr::new(10, 77, 0, 77)), ..parent };
    fx.plane.set_parent_route(JOB, &ghost).expect("set_parent_route");
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Ingress, &result_frame(&fx, payload, true).build(), 0);
    assert_eq!(run.verdict, TC_ACT_REDIRECT, "bpf_redirect_neigh");
    assert_eq!(run.mark, abi::BCAST_MARK_DONE);
    let out = Out(&run.data);
    assert_eq!((IpAddr::V4(out.src()), IpAddr::V4(out.dst()), out.dmac()), (IpAddr::V4(h0.addr), ghost.addr, [0; 6]));
    out.check_checksums();
    assert_eq!(fx.delta(&before, BcastStat::NeighMiss), 1);
}

// ---------------------------------------------------------------------------
// IPv6 (docs/BROADCAST.md "IPv6"): the same copies, next hops and RESULT
// routes over IPv6. Host i of the testbed gets fd00:77::(11 + i) with IPv6
// forwarding on (bpf_fib_lookup with AF_INET6 wants it), and both hosts a
// static neighbour entry of the other, so the FIB resolves host 1 at once.
// ---------------------------------------------------------------------------

use std::net::{Ipv6Addr, SocketAddrV6};

/// RFC 8200 section 8.1 checksum of a UDP datagram (header with its
/// checksum field as it is + payload) over IPv6: 0 when the stored one is
/// right.
fn udp6_verify(src: Ipv6Addr, dst: Ipv6Addr, udp: &[u8]) -> u16 {
    let len = udp.len() as u32;
    let mut sum = sum16(&src.octets()) + sum16(&dst.octets()) + (len >> 16) + (len & 0xffff) + 17;
    sum += sum16(udp);
    !fold(sum)
}

#[derive(Clone)]
struct Frame6 {
    dmac: [u8; 6],
    smac: [u8; 6],
    src: Ipv6Addr,
    dst: Ipv6Addr,
    dport: u16,
    payload: Vec<u8>,
    vlan: Option<u16>,
    /// A Fragment header between the IPv6 and UDP headers (not ours).
    frag_hdr: bool,
    hop_limit: u8,
}

impl Frame6 {
    fn build(&self) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&self.dmac);
        f.extend_from_slice(&self.smac);
        if let Some(tci) = self.vlan {
            f.extend_from_slice(&0x8100u16.to_be_bytes());
            f.extend_from_slice(&tci.to_be_bytes());
        }
        f.extend_from_slice(&0x86ddu16.to_be_bytes());
        let mut udp = Vec::new();
        udp.extend_from_slice(&SPORT.to_be_bytes());
        udp.extend_from_slice(&self.dport.to_be_bytes());
        udp.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(&self.payload);
        let c = match udp6_verify(self.src, self.dst, &udp) {
            0 => 0xffff,
            c => c,
        };
        udp[6..8].copy_from_slice(&c.to_be_bytes());
        let ext: &[u8] = if self.frag_hdr { &[17, 0, 0, 0, 0, 0, 0, 42] } else { &[] };
        f.extend_from_slice(&[0x60, 0x01, 0x23, 0x45]); // version, traffic class, flow label
        f.extend_from_slice(&((ext.len() + udp.len()) as u16).to_be_bytes());
        f.push(if self.frag_hdr { 44 } else { 17 });
        f.push(self.hop_limit);
        f.extend_from_slice(&self.src.octets());
        f.extend_from_slice(&self.dst.octets());
        f.extend_from_slice(ext);
        f.extend_from_slice(&udp);
        f
    }
}

/// Parsed view of an IPv6 output frame (no VLAN: strip it first).
struct Out6<'a>(&'a [u8]);

impl Out6<'_> {
    fn dmac(&self) -> [u8; 6] {
        self.0[0..6].try_into().unwrap()
    }
    fn smac(&self) -> [u8; 6] {
        self.0[6..12].try_into().unwrap()
    }
    fn hop_limit(&self) -> u8 {
        self.0[21]
    }
    fn src(&self) -> Ipv6Addr {
        Ipv6Addr::from(<[u8; 16]>::try_from(&self.0[22..38]).unwrap())
    }
    fn dst(&self) -> Ipv6Addr {
        Ipv6Addr::from(<[u8; 16]>::try_from(&self.0[38..54]).unwrap())
    }
    fn dport(&self) -> u16 {
        u16::from_be_bytes([self.0[56], self.0[57]])
    }
    fn udp_csum(&self) -> u16 {
        u16::from_be_bytes([self.0[60], self.0[61]])
    }
    fn payload(&self) -> &[u8] {
        &self.0[62..]
    }
    /// The UDP checksum is full and right (IPv6 has no "no checksum").
    fn check_checksum(&self) {
        assert_ne!(self.udp_csum(), 0, "an IPv6 UDP checksum is never 0");
        assert_eq!(udp6_verify(self.src(), self.dst(), &self.0[54..]), 0, "UDP checksum over IPv6");
    }
}

/// The fixture with IPv6 on both hosts (see above).
struct Fixture6 {
    fx: Fixture,
    h0: Ipv6Addr,
    h1: Ipv6Addr,
}

impl Fixture6 {
    fn new() -> Fixture6 {
        let fx = Fixture::new();
        for h in 0..2 {
            fx.tb.enable_ipv6(h, true).expect("IPv6 on");
        }
        let (h0, h1) = (fx.tb.ipv6_addr(0), fx.tb.ipv6_addr(1));
        for (h, other) in [(0usize, 1usize), (1, 0)] {
            let mac = fx.tb.host(other).mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
            let addr = fx.tb.ipv6_addr(other).to_string();
            let out = fx
                .tb
                .run_in(h, &["ip", "-6", "neigh", "replace", &addr, "lladdr", &mac, "dev", "eth0", "nud", "permanent"])
                .expect("ip neigh");
            assert!(out.status.success(), "static IPv6 neighbour: {}", String::from_utf8_lossy(&out.stderr));
        }
        Fixture6 { fx, h0, h1 }
    }

    fn member(&self, port: u16) -> SocketAddr {
        SocketAddr::V6(SocketAddrV6::new(self.h1, port, 0, 0))
    }

    /// An IPv6 datagram from host 0 to somewhere else (the application's
    /// placeholder destination), as it meets TC egress.
    fn frame(&self, payload: Vec<u8>) -> Frame6 {
        Frame6 {
            dmac: [0x02, 0, 0, 0, 0, 0x99],
            smac: self.fx.h0_mac,
            src: self.h0,
            dst: Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x200),
            dport: 7999,
            payload,
            vlan: None,
            frag_hdr: false,
            hop_limit: 61,
        }
    }

    /// A receiver on host 1.
    fn bind(&self, port: u16) -> std::net::UdpSocket {
        let addr = self.member(port);
        let s = in_netns(&self.fx.tb.host(1).netns, || std::net::UdpSocket::bind(addr)).expect("netns").expect("bind");
        s.set_read_timeout(Some(std::time::Duration::from_millis(300))).expect("timeout");
        s
    }
}

/// `Udp6InCsumErrors` of host `h`.
fn udp6_csum_errors(tb: &Testbed, h: usize) -> u64 {
    let out = tb.run_in(h, &["cat", "/proc/net/snmp6"]).expect("snmp6");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("Udp6InCsumErrors").map(|v| v.trim().parse::<u64>().expect("number")))
        .expect("Udp6InCsumErrors")
}

#[test]
fn egress_ipv6_rewrites_each_copy_with_a_full_checksum_behind_a_vlan_tag_too() {
    let f6 = Fixture6::new();
    let fx = &f6.fx;
    fx.plane.set_group(GROUP, &[f6.member(7200), f6.member(7300)]).expect("set_group");
    let mut rows = 0u64;
    for vlan in [None, Some(0x2005u16)] {
        for (mask, want_port) in [(0b01u32, 7200u16), (0b10, 7300)] {
            for body in [0usize, 1, 47, 1400] {
                for same_port in [false, true] {
                    let payload = agb1(mask, 5, GROUP, 0, 3, body);
                    let mut f = f6.frame(payload.clone());
                    f.vlan = vlan;
                    if same_port {
                        f.dport = want_port;
                    }
                    let sent = f.build();
                    let before = fx.plane.stats().expect("stats");
                    let run = fx.run(TcProgram::Egress, &sent, 0);
                    let row = format!("vlan {vlan:?} mask {mask:#b} body {body} same port {same_port}");
                    assert_eq!(run.verdict, TC_ACT_OK, "{row}: the original leaves as the copy");
                    assert_eq!(run.data.len(), sent.len(), "{row}: length unchanged");
                    let data = match vlan {
                        Some(tci) => {
                            assert_eq!(run.data[12..16], [0x81, 0x00, (tci >> 8) as u8, tci as u8], "{row}: tag kept");
                            [&run.data[..12], &run.data[16..]].concat()
                        }
                        None => run.data.clone(),
                    };
                    let out = Out6(&data);
                    assert_eq!(out.dst(), f6.h1, "{row}: destination");
                    assert_eq!(out.dport(), want_port, "{row}: port");
                    assert_eq!(out.src(), f6.h0, "{row}: source untouched");
                    assert_eq!(out.hop_limit(), 61, "{row}: hop limit untouched (as IPv4's TTL)");
                    assert_eq!(out.dmac(), fx.h1_mac, "{row}: next-hop MAC from bpf_fib_lookup / cache");
                    assert_eq!(out.smac(), fx.h0_mac, "{row}");
                    assert_eq!(out.payload(), &payload[..], "{row}: AGB1 header and payload unchanged");
                    let off = if vlan.is_some() { 18 } else { 14 };
                    assert_eq!(data[14..22], sent[off..off + 8], "{row}: version, flow label, length, next header, hop limit");
                    out.check_checksum();
                    assert_eq!(fx.delta(&before, BcastStat::Broadcast), 1, "{row}");
                    assert_eq!(fx.delta(&before, BcastStat::CopySent), 1, "{row}");
                    assert_eq!(run.mark, 0, "{row}");
                    rows += 1;
                }
            }
        }
    }
    let st = fx.plane.stats().expect("stats");
    assert_eq!(st.packets(BcastStat::FibLookup), 1, "the first lookup went to the FIB, the rest hit the cache");
    assert_eq!(st.packets(BcastStat::CacheHit), rows - 1);
    assert_eq!(st.packets(BcastStat::RewriteFailed) + st.packets(BcastStat::FamilyMismatch), 0);
    let cache = fx.plane.neigh_cache().expect("cache");
    assert_eq!(cache.len(), 1);
    assert_eq!(cache[0].addr, IpAddr::V6(f6.h1), "an IPv6 entry");
    assert_eq!((cache[0].neigh.dmac, cache[0].neigh.ifindex), (fx.h1_mac, fx.eth0));
    let gs = fx.plane.group_stats(GROUP, 0).expect("gstats").expect("exists");
    assert_eq!((gs.datagrams, gs.copies), (rows, rows));
}

#[test]
fn egress_ipv6_clones_reach_real_sockets_and_the_original_takes_the_last() {
    let f6 = Fixture6::new();
    let fx = &f6.fx;
    let ports = [7200u16, 7201, 7202, 7203];
    let members: Vec<SocketAddr> = ports.iter().map(|&p| f6.member(p)).collect();
    fx.plane.set_group(GROUP, &members).expect("set_group");
    assert_eq!(fx.plane.group(GROUP, 0).expect("read"), Some(members.clone()));
    let rx: Vec<std::net::UdpSocket> = ports.iter().map(|&p| f6.bind(p)).collect();
    let csum_before = udp6_csum_errors(&fx.tb, 1);
    for (k, mask) in [0b1111u32, 0b0111, 0b1010].into_iter().enumerate() {
        let payload = agb1(mask, k as u32, GROUP, 0, 0, 300 + k);
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Egress, &f6.frame(payload.clone()).build(), 0);
        assert_eq!(run.verdict, TC_ACT_OK);
        let last = 31 - mask.leading_zeros() as usize;
        let out = Out6(&run.data);
        assert_eq!(out.dport(), ports[last], "mask {mask:#b}: the original is the copy of the highest bit");
        out.check_checksum();
        assert_eq!(fx.delta(&before, BcastStat::CopySent), u64::from(mask.count_ones()), "mask {mask:#b}");
        // the clones really went out: host 1's stack delivers them only
        // with a right checksum
        for (i, s) in rx.iter().enumerate() {
            if mask & (1 << i) == 0 || i == last {
                continue;
            }
            let mut buf = vec![0u8; 2048];
            let (n, from) = s.recv_from(&mut buf).unwrap_or_else(|e| panic!("mask {mask:#b}: member {i} got no clone: {e}"));
            assert_eq!(&buf[..n], &payload[..], "mask {mask:#b}: member {i}");
            assert_eq!(from, SocketAddr::V6(SocketAddrV6::new(f6.h0, SPORT, 0, 0)), "mask {mask:#b}: member {i}: source kept");
        }
    }
    for (i, s) in rx.iter().enumerate() {
        s.set_read_timeout(Some(std::time::Duration::from_millis(50))).expect("timeout");
        assert!(s.recv_from(&mut [0u8; 64]).is_err(), "member {i}: no copy twice");
    }
    assert_eq!(udp6_csum_errors(&fx.tb, 1), csum_before, "Udp6InCsumErrors on the members' host");
}

#[test]
fn egress_ipv6_neighbour_path_local_member_no_route_and_other_traffic() {
    let f6 = Fixture6::new();
    let fx = &f6.fx;
    // on the link, nobody has it: NO_NEIGH, the neighbour path (ND in the stack)
    let ghost = SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x77)), 7200);
    fx.plane.set_group(GROUP, &[ghost]).expect("set_group");
    let payload = agb1(1, 1, GROUP, 0, 0, 100);
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Egress, &f6.frame(payload.clone()).build(), 0);
    assert_eq!(run.verdict, TC_ACT_REDIRECT, "bpf_redirect_neigh");
    assert_eq!(run.mark, abi::BCAST_MARK_DONE);
    let out = Out6(&run.data);
    assert_eq!((IpAddr::V6(out.dst()), out.dport()), (ghost.ip(), 7200));
    assert_eq!(out.dmac(), [0; 6], "never a stale or multicast MAC");
    assert_eq!(out.payload(), &payload[..]);
    out.check_checksum();
    assert_eq!(fx.delta(&before, BcastStat::NeighMiss), 1);
    assert!(fx.plane.neigh_cache().expect("cache").is_empty(), "unresolved next hops are not cached");

    // a copy back at egress with MARK_NEIGH: the IPv6 FIB names the
    // interface, bpf_redirect_neigh, marked DONE
    let run = fx.run(TcProgram::Egress, &run.data, abi::BCAST_MARK_NEIGH);
    assert_eq!((run.verdict, run.mark), (TC_ACT_REDIRECT, abi::BCAST_MARK_DONE));

    // this very host (the datagram's own source): looped through lo
    let here = SocketAddr::new(IpAddr::V6(f6.h0), 7300);
    fx.plane.set_group(GROUP, &[here]).expect("set_group");
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Egress, &f6.frame(payload.clone()).build(), 0);
    assert_eq!((run.verdict, run.mark), (TC_ACT_REDIRECT, abi::BCAST_MARK_COPY), "bpf_redirect(lo)");
    let out = Out6(&run.data);
    assert_eq!((out.dst(), out.dport(), out.dmac()), (f6.h0, 7300, [0; 6]));
    out.check_checksum();
    assert_eq!(fx.delta(&before, BcastStat::LocalCopy), 1);

    // no route at all: not sent
    let nowhere = SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1)), 7200);
    fx.plane.set_group(GROUP, &[nowhere]).expect("set_group");
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Egress, &f6.frame(payload).build(), 0);
    assert_eq!(run.verdict, TC_ACT_SHOT);
    assert_eq!(fx.delta(&before, BcastStat::FibError), 1);

    // every other datagram outcome over IPv6
    fx.plane.set_group(GROUP, &[f6.member(7200)]).expect("set_group");
    let cases: Vec<(&str, Frame6, u32, i32, BcastStat)> = vec![
        ("plain UDP", f6.frame(b"hello, not aggbox".to_vec()), 0, TC_ACT_OK, BcastStat::NotAggbox),
        ("a Fragment header", Frame6 { frag_hdr: true, ..f6.frame(agb1(1, 1, GROUP, 0, 0, 8)) }, 0, TC_ACT_OK, BcastStat::NotAggbox),
        ("unknown group", f6.frame(agb1(1, 1, GROUP + 1, 0, 0, 8)), 0, TC_ACT_OK, BcastStat::UnknownGroup),
        ("truncated AGB1", f6.frame(agb1(1, 1, GROUP, 0, 0, 0)[..10].to_vec()), 0, TC_ACT_OK, BcastStat::Malformed),
        ("reserved flag", f6.frame(agb1(1, 1, GROUP, 0x80, 0, 8)), 0, TC_ACT_OK, BcastStat::Malformed),
        ("empty mask", f6.frame(agb1(0, 1, GROUP, 0, 0, 8)), 0, TC_ACT_SHOT, BcastStat::EmptyMask),
        ("own copy", f6.frame(agb1(1, 1, GROUP, 0, 0, 8)), abi::BCAST_MARK_COPY, TC_ACT_OK, BcastStat::OwnCopy),
    ];
    for (name, frame, mark, verdict, stat) in cases {
        let bytes = frame.build();
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Egress, &bytes, mark);
        assert_eq!(run.verdict, verdict, "{name}: verdict");
        if verdict == TC_ACT_OK {
            assert_eq!(run.data, bytes, "{name}: untouched");
        }
        assert_eq!(fx.delta(&before, stat), 1, "{name}: counted as {stat:?}");
        let after = fx.plane.stats().expect("stats");
        assert_eq!(after.datagrams() - before.datagrams(), 1, "{name}: exactly one outcome");
    }
}

#[test]
fn a_datagram_of_the_other_family_than_its_table_is_dropped_and_counted() {
    let f6 = Fixture6::new();
    let fx = &f6.fx;
    // a table mixes no families
    let mixed: [SocketAddr; 2] = [fx.h1.into(), f6.member(7300)];
    let e = fx.plane.set_group(GROUP, &mixed).expect_err("a mixed table is refused").to_string();
    assert!(e.contains("mix IPv4 and IPv6"), "{e}");
    let mapped = SocketAddr::new(IpAddr::V6(fx.h1.ip().to_ipv6_mapped()), 7200);
    assert!(fx.plane.set_group(GROUP, &[mapped]).is_err(), "an IPv4-mapped address is refused");

    // egress: an IPv6 datagram for an IPv4 table, and the reverse
    for (table, bytes, name) in [
        (vec![SocketAddr::V4(fx.h1)], f6.frame(agb1(1, 1, GROUP, 0, 0, 40)).build(), "IPv6 datagram, IPv4 table"),
        (vec![f6.member(7200)], fx.frame(agb1(1, 1, GROUP, 0, 0, 40)).build(), "IPv4 datagram, IPv6 table"),
    ] {
        fx.plane.set_group(GROUP, &table).expect("set_group");
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Egress, &bytes, 0);
        assert_eq!(run.verdict, TC_ACT_SHOT, "{name}: dropped");
        assert_eq!(fx.delta(&before, BcastStat::FamilyMismatch), 1, "{name}: family_mismatch");
        let after = fx.plane.stats().expect("stats");
        assert_eq!(after.datagrams() - before.datagrams(), 1, "{name}: exactly one outcome");
        assert_eq!(fx.delta(&before, BcastStat::CopySent) + fx.delta(&before, BcastStat::FibLookup), 0, "{name}: no copy");
    }

    // ingress: a FORWARD datagram over IPv6 for an IPv4 forwarding table
    fx.plane.set_forwarding(GROUP, 7400, &[fx.h1]).expect("set_forwarding");
    let mut f = f6.frame(agb1(1, 1, GROUP, abi::BCAST_F_FORWARD, 0, 40));
    f.dst = f6.h0;
    f.dmac = fx.h0_mac;
    f.dport = 7400;
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Ingress, &f.build(), 0);
    assert_eq!(run.verdict, TC_ACT_SHOT);
    assert_eq!(fx.delta(&before, BcastStat::FamilyMismatch), 1);
    assert_eq!(BcastStat::FamilyMismatch.label(), "family_mismatch");
    assert!(BcastStat::FamilyMismatch.is_datagram_outcome());
}

#[test]
fn ingress_ipv6_forwards_with_hops_plus_one_and_delivers_the_original() {
    let f6 = Fixture6::new();
    let fx = &f6.fx;
    let ports = [7200u16, 7201, 7202];
    let children: Vec<SocketAddr> = ports.iter().map(|&p| f6.member(p)).collect();
    fx.plane.set_forwarding(GROUP, 7400, &children).expect("set_forwarding");
    let rx: Vec<std::net::UdpSocket> = ports.iter().map(|&p| f6.bind(p)).collect();
    let root = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x250);
    let mk = |flags: u8, hops: u8, vlan: Option<u16>| Frame6 {
        dmac: fx.h0_mac,
        smac: [0x02, 0, 0, 0, 0, 0x42],
        src: root,
        dst: f6.h0,
        dport: 7400,
        payload: agb1(0x3, 7, GROUP, flags, hops, 200),
        vlan,
        frag_hdr: false,
        hop_limit: 64,
    };
    let cases = [
        ("FORWARD", mk(abi::BCAST_F_FORWARD, 0, None), BcastStat::Forwarded, 3u64),
        ("FORWARD, VLAN-tagged", mk(abi::BCAST_F_FORWARD, 2, Some(0x0007)), BcastStat::Forwarded, 3),
        ("FORWARD, deep", mk(abi::BCAST_F_FORWARD, abi::BCAST_MAX_HOPS as u8, None), BcastStat::HopsLimit, 0),
        ("no FORWARD", mk(0, 0, None), BcastStat::LocalOnly, 0),
        ("other port, no table", Frame6 { dport: 7401, ..mk(abi::BCAST_F_FORWARD, 0, None) }, BcastStat::UnknownGroup, 0),
    ];
    for (name, f, stat, copies) in cases {
        let bytes = f.build();
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Ingress, &bytes, 0);
        assert_eq!(run.verdict, TC_ACT_OK, "{name}: delivered locally");
        assert_eq!(run.data, bytes, "{name}: the local copy is the datagram as it arrived");
        assert_eq!(fx.delta(&before, stat), 1, "{name}: {stat:?}");
        assert_eq!(fx.delta(&before, BcastStat::CopySent), copies, "{name}: copies to children");
        if copies == 0 || f.vlan.is_some() {
            // (the tagged copies keep their tag: host 1 has no VLAN 7)
            continue;
        }
        // each child got its clone, with hops + 1, from the root's address
        let mut want = f.payload.clone();
        want[15] += 1;
        for (p, s) in ports.iter().zip(&rx) {
            let mut buf = vec![0u8; 2048];
            let (n, from) = s.recv_from(&mut buf).unwrap_or_else(|e| panic!("{name}: child {p} got nothing: {e}"));
            assert_eq!(&buf[..n], &want[..], "{name}: child {p}: hops + 1, the rest unchanged");
            assert_eq!(from.ip(), IpAddr::V6(root), "{name}: child {p}: source kept");
        }
    }
}

#[test]
fn ingress_ipv6_result_is_copied_to_its_group_and_goes_upstream() {
    let f6 = Fixture6::new();
    let fx = &f6.fx;
    let contributor = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x250);
    let result = |payload: Vec<u8>| Frame6 {
        dmac: fx.h0_mac,
        smac: [0x02, 0, 0, 0, 0, 0x42],
        src: contributor,
        dst: f6.h0,
        dport: RESULT_PORT,
        payload,
        vlan: None,
        frag_hdr: false,
        hop_limit: 64,
    };
    let ports = [7200u16, 7300];
    let members: Vec<SocketAddr> = ports.iter().map(|&p| f6.member(p)).collect();
    fx.plane.set_group(GROUP, &members).expect("set_group");
    fx.plane.set_result_route(JOB, RESULT_PORT, GROUP).expect("set_result_route");
    let rx: Vec<std::net::UdpSocket> = ports.iter().map(|&p| f6.bind(p)).collect();
    let csum_before = udp6_csum_errors(&fx.tb, 1);
    // 357 elements: 1500 bytes, the MTU, with IPv6's 40-byte header (one
    // more and the FIB says the copy needs fragmenting: fib_error)
    for (k, count) in [1u16, 17, 357].into_iter().enumerate() {
        let payload = agg1(JOB, abi::RESULT_RANK, k as u32, abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT, count);
        let bytes = result(payload.clone()).build();
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Ingress, &bytes, 0);
        assert_eq!(run.verdict, TC_ACT_OK, "row {k}: the RESULT is delivered locally");
        assert_eq!(run.data, bytes, "row {k}: exactly as it arrived");
        assert_eq!(fx.delta(&before, BcastStat::ResultBroadcast), 1, "row {k}");
        assert_eq!(fx.delta(&before, BcastStat::CopySent), 2, "row {k}: one copy per member");
        for (p, s) in ports.iter().zip(&rx) {
            let mut buf = vec![0u8; 4096];
            let (n, from) = s.recv_from(&mut buf).unwrap_or_else(|e| panic!("row {k}: member {p} got no copy: {e}"));
            assert_eq!(&buf[..n], &payload[..], "row {k}: member {p}: AGG1 header and payload unchanged");
            assert_eq!(from, SocketAddr::V6(SocketAddrV6::new(f6.h0, SPORT, 0, 0)), "row {k}: member {p}: source = this node");
        }
    }
    assert_eq!(udp6_csum_errors(&fx.tb, 1), csum_before, "Udp6InCsumErrors on the members' host");

    // an IPv4 RESULT of the job meets an IPv6 group: dropped
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Ingress, &result_frame(fx, agg1(JOB, abi::RESULT_RANK, 9, abi::AGG_F_RESULT, 4), true).build(), 0);
    assert_eq!((run.verdict, fx.delta(&before, BcastStat::FamilyMismatch)), (TC_ACT_SHOT, 1));

    // upstream: the RESULT becomes this node's contribution to an IPv6 parent
    fx.plane.remove_result_route(JOB).expect("remove");
    let parent = tc::ParentRoute { addr: IpAddr::V6(f6.h1), port: 7000, job: 9, rank: 2, result_port: RESULT_PORT };
    fx.plane.set_parent_route(JOB, &parent).expect("set_parent_route");
    assert_eq!(fx.plane.result_route(JOB).expect("read").expect("route").parent, Some(parent));
    for count in [1u16, 100, 357] {
        let payload = agg1(JOB, abi::RESULT_RANK, 77, abi::AGG_F_RESULT | abi::AGG_F_OVERFLOW, count);
        let before = fx.plane.stats().expect("stats");
        let run = fx.run(TcProgram::Ingress, &result(payload.clone()).build(), 0);
        assert_eq!(run.verdict, TC_ACT_REDIRECT, "count {count}: out, not delivered locally");
        assert_eq!(run.mark, abi::BCAST_MARK_COPY);
        let out = Out6(&run.data);
        assert_eq!((out.src(), out.dst(), out.dport()), (f6.h0, f6.h1, 7000), "count {count}");
        assert_eq!((out.dmac(), out.smac()), (fx.h1_mac, fx.h0_mac), "count {count}");
        let mut want = payload.clone();
        want[4..6].copy_from_slice(&parent.job.to_be_bytes());
        want[6..8].copy_from_slice(&parent.rank.to_be_bytes());
        want[21] = abi::AGG_F_OVERFLOW;
        assert_eq!(out.payload(), &want[..], "count {count}: job, rank, flags rewritten");
        out.check_checksum();
        assert_eq!(fx.delta(&before, BcastStat::ResultUpstream), 1);
    }
    // a parent of the other family: dropped, counted
    let v4_parent = tc::ParentRoute { addr: IpAddr::V4(*fx.h1.ip()), ..parent };
    fx.plane.set_parent_route(JOB, &v4_parent).expect("set_parent_route");
    let before = fx.plane.stats().expect("stats");
    let run = fx.run(TcProgram::Ingress, &result(agg1(JOB, abi::RESULT_RANK, 78, abi::AGG_F_RESULT, 4)).build(), 0);
    assert_eq!((run.verdict, fx.delta(&before, BcastStat::FamilyMismatch)), (TC_ACT_SHOT, 1));
}
