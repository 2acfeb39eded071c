//! A ring of four IPv6 members in the kernel (docs/RING.md "IPv6 rings in
//! the kernel"), end to end on a network-namespace testbed: four hosts
//! with IPv6 on (`TestbedConfig::ipv6`: fd00:10:77::11 .. ::14, permanent
//! neighbour entries, forwarding on) behind one switch, each running its
//! own ring program loaded and attached (native XDP on eth0) with the
//! kernel API, the ring written with `XdpPlane::set_ring` and IPv6
//! members. No ring service runs: each origin's application sends its
//! PARTIAL hops 1 from an ordinary UDP socket, and the members' XDP
//! programs make every other hop (add, complete, store, send on with
//! `bpf_fib_lookup` over IPv6 and a `bpf_redirect`). Every member's result
//! equals the reference reducer over the members' inputs and weights.
//!
//! Then a round one member is not ready for: what the others' XDP programs
//! send it goes up its IPv6 stack (`early`) to an ordinary socket, which
//! takes a datagram only if its UDP checksum is right: the checksum the
//! sending member's XDP program wrote over the datagram it rewrote.
//!
//! Needs root; fails (never skips) otherwise. Nothing is created outside
//! the testbed's own namespaces, which are deleted on drop (a failed test
//! too): `sudo -E cargo test --features bench --test netns_ring_ipv6`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod bpf_common;

use std::fs::File;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6, UdpSocket};
use std::time::{Duration, Instant};

use aggbox::config::RingConfig;
use aggbox::kernel::xdp::{Chain, RingPool, XdpLink, XdpMode, XdpPlane};
use aggbox::wire::abi::{self, Op, RingStat};
use aggbox::wire::reducer::Accumulator;
use aggbox::wire::ring;
use libbpf_rs::{MapCore, MapFlags};
use nix::sched::{setns, CloneFlags};
use testbed::{Testbed, TestbedConfig};

const MEMBERS: usize = 4;
const RING_ID: u16 = 46;
const PORT: u16 = 7460;
/// Elements a fragment: an IPv6 datagram of 300 fits MTU 1500 (40 + 8 +
/// 24 + 1200 bytes).
const FRAG: u32 = 300;
/// 12 fragments, the last one short (200 elements).
const VECTOR_LEN: u32 = 3500;
const WEIGHTS: [i32; MEMBERS] = [1, 2, 1, 3];

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/netns_ring_ipv6.rs needs root (network namespaces, XDP): `sudo -E cargo test --features bench --test netns_ring_ipv6`"
    );
}

/// One member: its plane (ring program loaded, the ring written), its XDP
/// link on its host's eth0 and its application's socket on the ring port.
struct Member {
    // Field order: the link goes before the plane.
    link: Option<XdpLink>,
    sock: UdpSocket,
    dp: XdpPlane,
    job: abi::RingJob,
    dense: u32,
    addr: Ipv6Addr,
}

impl Member {
    fn ready(&self, round: u32, op: Op, input: &[i32]) {
        bpf_common::ring::make_ready(&self.dp, self.dense, &self.job, round, op, input);
    }

    fn ctrl(&self) -> abi::RingCtrl {
        bpf_common::ring::ring_ctrl(&self.dp, self.dense)
    }

    /// Fragment `f`'s elements and ring_done entry in round `round`'s buffer.
    fn result(&self, round: u32, f: u32) -> (Vec<i32>, abi::RingDone) {
        let [data, done, _] = self.dp.ring_memory_maps().expect("ring maps");
        let key = self.job.index(abi::Round(round), f).to_ne_bytes();
        let v = data.lookup(&key, MapFlags::ANY).unwrap().unwrap();
        let d = abi::from_bytes(&done.lookup(&key, MapFlags::ANY).unwrap().unwrap()).unwrap();
        (v.chunks(4).map(|c| i32::from_ne_bytes(c.try_into().unwrap())).collect(), d)
    }

    fn stats(&self) -> abi::RingStats {
        self.dp.ring_stats(self.dense).expect("ring stats")
    }
}

/// The testbed and its members; the links and planes go before the
/// testbed's namespaces.
struct Bed {
    members: Vec<Member>,
    tb: Testbed,
}

impl Bed {
    fn up() -> Bed {
        let tb = Testbed::up(TestbedConfig { hosts: MEMBERS, xdp_tx: true, ipv6: true, static_neigh: true, ..Default::default() })
            .expect("testbed");
        let addrs: Vec<Ipv6Addr> = (0..MEMBERS).map(|h| tb.host(h).addr6.expect("IPv6 testbed")).collect();
        let ring_addrs: Vec<IpAddr> = addrs.iter().map(|&a| IpAddr::V6(a)).collect();
        // The ring's sizes and place.
        let cfg = RingConfig {
            id: RING_ID,
            port: PORT,
            members: ring_addrs.clone(),
            weights: WEIGHTS.to_vec(),
            vector_len: VECTOR_LEN,
            frag_elems: FRAG,
        };
        let pool = RingPool::reserve(std::slice::from_ref(&cfg), FRAG, 0).expect("ring memory");
        let place = pool.place_of(RING_ID).expect("placed");
        let chain = Chain::detect().expect("chain");
        let here = File::open("/proc/thread-self/ns/net").expect("this thread's namespace");
        let mut members = Vec::new();
        for (m, &addr) in addrs.iter().enumerate() {
            let dp = XdpPlane::load_chain_with(chain, pool.sizing()).expect("load with a ring");
            let job = abi::RingJob {
                id: RING_ID,
                port: PORT,
                members: MEMBERS as u16,
                me: m as u16,
                frag_elems: FRAG,
                frags: cfg.frags(),
                vector_len: VECTOR_LEN,
                base: place.base,
                weight_sum: cfg.weight_sum(),
                weight: WEIGHTS[m],
                self_addr: 0,
                next_addr: 0,
            };
            dp.set_ring(place.dense, &job, &ring_addrs).expect("set_ring with IPv6 members");
            let host = tb.host(m);
            let sock = testbed::in_netns(&host.netns, || {
                let s = UdpSocket::bind(SocketAddr::V6(SocketAddrV6::new(addr, PORT, 0, 0))).expect("bind the ring port");
                s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
                s
            })
            .expect("host namespace");
            // The link is made in the host's namespace (its eth0's index);
            // this thread goes back to its own right after.
            let ns = File::open(format!("/run/netns/{}", host.netns)).expect("netns file");
            setns(ns, CloneFlags::CLONE_NEWNET).expect("setns");
            let ifindex = nix::net::if_::if_nametoindex(host.ifname.as_str());
            let attached = ifindex.map(|i| dp.attach_xdp(i, XdpMode::Native));
            setns(&here, CloneFlags::CLONE_NEWNET).expect("setns back");
            let (link, warning) = attached.expect("eth0").expect("attach");
            assert_eq!(warning, None, "native XDP on host {m}");
            members.push(Member { link: Some(link), sock, dp, job, dense: place.dense, addr });
        }
        Bed { members, tb }
    }

    /// Member `o`'s application sends the PARTIAL hops 1 of every fragment
    /// it is the origin of, round `round`, its `input` weighted as the ring
    /// does (`ring::combine` from the op's identity).
    fn send_originals(&self, o: usize, round: u32, op: Op, input: &[i32]) -> usize {
        let frags = self.members[o].job.frags;
        let next = self.members[(o + 1) % MEMBERS].addr;
        let mut sent = 0;
        for f in (0..frags).filter(|f| *f as usize % MEMBERS == o) {
            let start = (f * FRAG) as usize;
            let n = (VECTOR_LEN as usize - start).min(FRAG as usize);
            let values: Vec<i32> = input[start..start + n].iter().map(|&x| ring::combine(op, WEIGHTS[o], op.identity(), x).0).collect();
            let d = agr1(abi::RING_PARTIAL, round, f, 1, o as u16, op, &values);
            self.members[o].sock.send_to(&d, SocketAddr::V6(SocketAddrV6::new(next, PORT, 0, 0))).expect("send");
            sent += 1;
        }
        sent
    }

    /// Every member's counters and control block, for a failure message.
    fn state(&self) -> String {
        self.members
            .iter()
            .enumerate()
            .map(|(m, mb)| {
                let st = mb.stats();
                let c: Vec<String> = RingStat::ALL.iter().filter(|s| st.count[**s as usize] != 0).map(|s| format!("{s:?} {}", st.count[*s as usize])).collect();
                format!("member {m}: finals {} of round {}; {}", mb.ctrl().finals, mb.ctrl().finals_round, c.join(", "))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Udp6InCsumErrors of host `h`'s namespace (this thread's: /proc/net is the process's).
    fn udp6_csum_errors(&self, h: usize) -> u64 {
        testbed::in_netns(&self.tb.host(h).netns, || {
            let text = std::fs::read_to_string("/proc/thread-self/net/snmp6").unwrap_or_default();
            text.lines().find_map(|l| l.strip_prefix("Udp6InCsumErrors").map(|v| v.trim().parse().unwrap_or(0))).unwrap_or(0)
        })
        .expect("host namespace")
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(link) = m.link.take() {
                let _ = link.detach();
            }
        }
    }
}

/// An AGR1 datagram (docs/RING.md "The AGR1 datagram").
fn agr1(kind: u8, round: u32, frag: u32, hops: u16, sender: u16, op: Op, values: &[i32]) -> Vec<u8> {
    let mut p = Vec::with_capacity(24 + 4 * values.len());
    p.extend_from_slice(&abi::MAGIC_RING.to_be_bytes());
    p.extend_from_slice(&RING_ID.to_be_bytes());
    p.push(kind);
    p.push(0);
    p.extend_from_slice(&round.to_be_bytes());
    p.extend_from_slice(&frag.to_be_bytes());
    p.extend_from_slice(&hops.to_be_bytes());
    p.extend_from_slice(&(values.len() as u16).to_be_bytes());
    p.extend_from_slice(&sender.to_be_bytes());
    p.push(op as u8);
    p.push(0);
    for v in values {
        p.extend_from_slice(&v.to_be_bytes());
    }
    p
}

fn input(m: usize, round: u32) -> Vec<i32> {
    (0..VECTOR_LEN as i64).map(|i| ((i * 7919 + (m as i64 + 1) * 104_729 + i64::from(round) * 31) % 20_011 - 10_005) as i32).collect()
}

/// The star's result of `op` over every member's input and weight.
fn reference(op: Op, inputs: &[Vec<i32>]) -> Vec<i32> {
    let mut acc = Accumulator::new(op, VECTOR_LEN as usize, false).unwrap();
    for (v, w) in inputs.iter().zip(WEIGHTS) {
        acc.add_int(v, w).unwrap();
    }
    acc.finish().unwrap().ints().unwrap().to_vec()
}

#[test]
fn four_ipv6_members_reduce_in_their_xdp_programs_and_send_checksummed_datagrams() {
    require_root();
    let bed = Bed::up();
    let frags = bed.members[0].job.frags;
    assert_eq!(frags, 12);

    // Rounds every member is ready for: the XDP programs make every hop.
    for (round, op) in [(1u32, Op::Sum), (2, Op::Avg), (3, Op::Max)] {
        let inputs: Vec<Vec<i32>> = (0..MEMBERS).map(|m| input(m, round)).collect();
        for (m, mb) in bed.members.iter().enumerate() {
            mb.ready(round, op, &inputs[m]);
        }
        let sent: usize = (0..MEMBERS).map(|o| bed.send_originals(o, round, op, &inputs[o])).sum();
        assert_eq!(sent, frags as usize);
        let deadline = Instant::now() + Duration::from_secs(10);
        while bed.members.iter().any(|m| m.ctrl().finals < frags) {
            assert!(Instant::now() < deadline, "round {round} ({op:?}) did not complete in the kernel:\n{}", bed.state());
            std::thread::sleep(Duration::from_millis(5));
        }
        let want = reference(op, &inputs);
        for (m, mb) in bed.members.iter().enumerate() {
            for f in 0..frags {
                let start = (f * FRAG) as usize;
                let n = (VECTOR_LEN as usize - start).min(FRAG as usize);
                let (got, done) = mb.result(round, f);
                assert_eq!(done.round_plus1, round + 1, "member {m}, fragment {f}, round {round}");
                assert_eq!(got[..n], want[start..start + n], "member {m}, fragment {f}, round {round} ({op:?})");
            }
            let st = mb.stats();
            for s in [RingStat::Forged, RingStat::Malformed, RingStat::NoRoute, RingStat::ToService, RingStat::Early, RingStat::Duplicate] {
                assert_eq!(st.count[s as usize], 0, "member {m}: {s:?} after round {round}\n{}", bed.state());
            }
        }
    }
    // Every member added to (or completed) the PARTIALs it received and
    // stored every fragment: 3 rounds of 12 fragments.
    for (m, mb) in bed.members.iter().enumerate() {
        let st = mb.stats();
        let completed = st.count[RingStat::Completed as usize];
        assert_eq!(completed, 3 * 3, "member {m} completes the 3 fragments whose origin follows it");
        assert_eq!(completed + st.count[RingStat::Stored as usize], 3 * 12, "member {m} stores every fragment once a round");
        assert_eq!(st.count[RingStat::Added as usize], 3 * 6, "member {m} adds to 2 transmissions of the others' fragments");
    }

    // Round 4: member 3 is not ready. What reaches it is early and goes up
    // its stack: the PARTIALs of origins 0 and 1 that members 1 and 2
    // rewrote and checksummed in XDP (hops 3, hops 2), and origin 2's
    // hops 1 from its socket. The socket takes a datagram only if its UDP
    // checksum is right.
    let round = 4;
    let op = Op::Sum;
    let inputs: Vec<Vec<i32>> = (0..MEMBERS).map(|m| input(m, round)).collect();
    let errors_before = bed.udp6_csum_errors(3);
    for m in 0..3 {
        bed.members[m].ready(round, op, &inputs[m]);
    }
    let mut expected = 0;
    for o in 0..3 {
        expected += bed.send_originals(o, round, op, &inputs[o]);
    }
    assert_eq!(expected, 9);
    let mut buf = [0u8; 2048];
    let mut xdp_made = 0;
    for k in 0..expected {
        let (len, from) = bed.members[3].sock.recv_from(&mut buf).unwrap_or_else(|e| {
            panic!(
                "round {round}: datagram {k} of {expected} did not reach member 3's socket ({e}); Udp6InCsumErrors {} -> {}\n{}",
                errors_before,
                bed.udp6_csum_errors(3),
                bed.state()
            )
        });
        let d = &buf[..len];
        assert_eq!(from.ip(), IpAddr::V6(bed.members[2].addr), "sent on by member 2");
        assert_eq!(from.port(), PORT);
        let frag = u32::from_be_bytes(d[12..16].try_into().unwrap());
        let hops = u16::from_be_bytes([d[16], d[17]]);
        let sender = u16::from_be_bytes([d[20], d[21]]);
        let origin = frag as usize % MEMBERS;
        assert_eq!((d[6], sender, usize::from(hops)), (abi::RING_PARTIAL, 2, 3 - origin), "fragment {frag}");
        if hops > 1 {
            xdp_made += 1;
        }
        // the partial of members origin ..= 2
        let start = (frag * FRAG) as usize;
        let n = usize::from(u16::from_be_bytes([d[18], d[19]]));
        let got: Vec<i32> = d[24..24 + 4 * n].chunks(4).map(|c| i32::from_be_bytes(c.try_into().unwrap())).collect();
        let want: Vec<i32> = (0..n)
            .map(|i| (origin..3).fold(op.identity(), |acc, m| ring::combine(op, WEIGHTS[m], acc, inputs[m][start + i]).0))
            .collect();
        assert_eq!(got, want, "fragment {frag}: the partial of members {origin}..=2");
    }
    assert_eq!(xdp_made, 6, "six of them rewritten and checksummed by XDP (origins 0 and 1)");
    assert_eq!(bed.udp6_csum_errors(3), errors_before, "no checksum error at member 3");
    assert_eq!(bed.members[3].stats().count[RingStat::Early as usize], 9, "{}", bed.state());
}
