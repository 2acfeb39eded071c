//! The ring program (docs/RING.md "XDP") under BPF_PROG_TEST_RUN: one
//! member (member 1 of 4) of a ring, datagrams built as its neighbours would
//! send them. Adds, completion, stores, forwarding rewrite, duplicates,
//! early and stale rounds, forged and malformed datagrams, VLAN tags, the
//! chunked path of multi-buffer frames; every completed value is checked
//! against the star's reference reducer. Each of these runs over a ring of
//! IPv4 members and over one of IPv6 members (`ipv6_*`: the rewritten
//! addresses and the UDP checksum of every forwarded frame checked, the
//! checksum computed here). A ring removed leaves no entry, and a ring
//! added where it was sees none of its results (docs/RING.md
//! "Configuration").

mod bpf_common;
#[path = "../src/testing/bpffs.rs"]
#[allow(dead_code)]
mod bpffs;
mod ring_entries;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aggbox::kernel::xdp::XdpError;
use aggbox::wire::abi::{self, Op, RingStat};
use aggbox::wire::reducer::Accumulator;
use aggbox::wire::ring;
use bpf_common::ring::*;
use bpf_common::{ip6_ext, Family, IP6_DSTOPTS, IP6_FRAGMENT, IP6_HOPOPTS, IP6_ROUTING, XDP_DROP, XDP_PASS};
use libbpf_rs::{MapCore, MapFlags};

fn input(n: u32, seed: i32) -> Vec<i32> {
    (0..n as i32).map(|i| (i * 7919 + seed * 104_729) % 20_011 - 10_005).collect()
}

/// The star's result of `op` over every member's values of one fragment.
fn reference(op: Op, values: &[Vec<i32>], weights: &[i32]) -> Vec<i32> {
    let mut acc = Accumulator::new(op, values[0].len(), false).unwrap();
    for (v, w) in values.iter().zip(weights) {
        acc.add_int(v, *w).unwrap();
    }
    acc.finish().unwrap().ints().unwrap().to_vec()
}

/// The partial a PARTIAL of fragment f carries when it reaches member ME at
/// `hops`: members origin .. ME-1 combined as the ring does.
fn partial(op: Op, f: u32, hops: u16, all: &[Vec<i32>], weights: &[i32], count: usize) -> Vec<i32> {
    let origin = f as usize % 4;
    let start = (f * FRAG) as usize;
    let mut out: Vec<i32> = vec![op.identity(); count];
    for k in 0..hops as usize {
        let m = (origin + k) % 4;
        for (i, o) in out.iter_mut().enumerate() {
            *o = ring::combine(op, weights[m], *o, all[m][start + i]).0;
        }
    }
    out
}

/// A ring of 4 members of `family`, `vector_len` elements, member ME.
fn ring_of(family: Family, vector_len: u32, weights: Vec<i32>) -> Ring {
    Ring::of_family(family, vector_len, weights, FRAG, 0)
}

#[test]
fn every_op_adds_completes_and_stores_like_the_star() {
    every_op_case(Family::V4);
}

#[test]
fn ipv6_every_op_adds_completes_and_stores_like_the_star() {
    every_op_case(Family::V6);
}

fn every_op_case(family: Family) {
    let weights = vec![1, 3, 2, 1];
    for op in Op::ALL.into_iter().filter(|op| op.runs_in_ring()) {
        // 4 fragments: 8, 8, 8, 6 elements
        let ring = ring_of(family, 30, weights.clone());
        let all: Vec<Vec<i32>> = (0..4).map(|m| input(30, m + 1)).collect();
        let round = 5;
        ring.ready(round, op, &all[ME]);

        // fragment 0 (origin 0): member 1 is transmission 1, an adder
        let f = 0;
        let n = ring.count_of(f) as usize;
        let d = Datagram::new(abi::RING_PARTIAL, round, f, 1, op, partial(op, f, 1, &all, &weights, n));
        let (verdict, out) = ring.run_own(&d);
        assert_eq!(verdict, XDP_REDIRECT, "{op:?}: an added PARTIAL goes on");
        let (_, got) = forwarded(&out, abi::RING_PARTIAL, 2);
        assert_eq!(got, partial(op, f, 2, &all, &weights, n), "{op:?}: member 1's elements added");
        assert_eq!(ring.data(f)[..n], all[ME][..n], "{op:?}: an adder's input stays");

        // fragment 2 (origin 2): member 1 completes it (transmission 3)
        let f = 2;
        let n = ring.count_of(f) as usize;
        let d = Datagram::new(abi::RING_PARTIAL, round, f, 3, op, partial(op, f, 3, &all, &weights, n));
        let (verdict, out) = ring.run_own(&d);
        assert_eq!(verdict, XDP_REDIRECT, "{op:?}: a completed fragment goes on as FINAL");
        let (flags, got) = forwarded(&out, abi::RING_FINAL, 4);
        let slices: Vec<Vec<i32>> = all.iter().map(|v| v[(f * FRAG) as usize..(f * FRAG) as usize + n].to_vec()).collect();
        let want = reference(op, &slices, &weights);
        assert_eq!(got, want, "{op:?}: the FINAL is the star's result");
        assert_eq!(flags & abi::RING_F_SATURATED, 0);
        assert_eq!(ring.data(f)[..n], want[..], "{op:?}: the result is stored in place");
        assert_eq!(ring.done(f).round_plus1, round + 1);
        assert_eq!(ring.ctrl().finals, 1, "{op:?}: counted for the runtime");
        // the same datagram again: a duplicate, nothing changes
        let (verdict, _) = ring.run_own(&d);
        assert_eq!(verdict, XDP_DROP, "{op:?}: a second completion is a duplicate");
        assert_eq!(ring.ctrl().finals, 1);
        assert_eq!(ring.data(f)[..n], want[..]);

        // fragment 1 (origin 1): the FINAL reaches member 1 at transmission 4
        let f = 1;
        let n = ring.count_of(f) as usize;
        let result: Vec<i32> = (0..n as i32).map(|i| i * 3 - 7).collect();
        let d = Datagram::new(abi::RING_FINAL, round, f, 4, op, result.clone());
        let (verdict, out) = ring.run_own(&d);
        assert_eq!(verdict, XDP_REDIRECT, "{op:?}: a FINAL that is not the last goes on");
        let (_, got) = forwarded(&out, abi::RING_FINAL, 5);
        assert_eq!(got, result);
        assert_eq!(ring.data(f)[..n], result[..], "{op:?}: stored");
        assert_eq!(ring.ctrl().finals, 2);

        // fragment 3 (origin 3): member 1 is the last (transmission 6)
        let f = 3;
        let n = ring.count_of(f) as usize;
        assert_eq!(n, 6, "the last fragment is short");
        let result: Vec<i32> = (0..n as i32).map(|i| 100 - i).collect();
        let d = Datagram::new(abi::RING_FINAL, round, f, 6, op, result.clone());
        let (verdict, _) = ring.run_own(&d);
        assert_eq!(verdict, XDP_DROP, "{op:?}: the last FINAL ends here");
        assert_eq!(ring.data(f)[..n], result[..]);
        assert_eq!(ring.ctrl().finals, 3);
        assert_eq!(ring.stat(RingStat::Added), 1);
        assert_eq!(ring.stat(RingStat::Completed), 1);
        assert_eq!(ring.stat(RingStat::Stored), 2);
        assert_eq!(ring.stat(RingStat::Duplicate), 1);
    }
}

#[test]
fn a_partial_sum_that_leaves_int32_saturates_and_says_so() {
    saturation_case(Family::V4);
}

#[test]
fn ipv6_a_partial_sum_that_leaves_int32_saturates_and_says_so() {
    saturation_case(Family::V6);
}

fn saturation_case(family: Family) {
    let ring = ring_of(family, 8, vec![1, 1, 1, 1]);
    let mine = vec![i32::MAX; 8];
    ring.ready(0, Op::Sum, &mine);
    let d = Datagram::new(abi::RING_PARTIAL, 0, 0, 1, Op::Sum, vec![10; 8]);
    let (verdict, out) = ring.run_own(&d);
    assert_eq!(verdict, XDP_REDIRECT);
    let (flags, got) = forwarded(&out, abi::RING_PARTIAL, 2);
    assert_eq!(flags & abi::RING_F_SATURATED, abi::RING_F_SATURATED);
    assert_eq!(got, vec![i32::MAX; 8]);
    assert_eq!(ring.stat(RingStat::Saturated), 1);
}

#[test]
fn rounds_not_ready_go_to_the_service_and_older_ones_are_dropped() {
    rounds_case(Family::V4);
}

#[test]
fn ipv6_rounds_not_ready_go_to_the_service_and_older_ones_are_dropped() {
    rounds_case(Family::V6);
}

fn rounds_case(family: Family) {
    let ring = ring_of(family, 16, vec![1, 1, 1, 1]);
    let d = Datagram::new(abi::RING_PARTIAL, 3, 0, 1, Op::Sum, vec![1; 8]);
    // nothing ready yet: the service holds it until the runtime's KICK
    assert_eq!(ring.run_own(&d).0, XDP_PASS);
    ring.ready(3, Op::Sum, &[0; 16]);
    let early = Datagram { round: 4, ..d.clone() };
    assert_eq!(ring.run_own(&early).0, XDP_PASS, "the next round: early");
    let stale = Datagram { round: 2, ..d.clone() };
    assert_eq!(ring.run_own(&stale).0, XDP_DROP, "an older round: stale");
    let final_other = Datagram::new(abi::RING_FINAL, 2, 1, 4, Op::Sum, vec![1; 8]);
    assert_eq!(ring.run_own(&final_other).0, XDP_DROP, "a FINAL of a round not ready: dropped");
    assert_eq!(ring.stat(RingStat::Early), 2);
    assert_eq!(ring.stat(RingStat::Stale), 1);
    assert_eq!(ring.stat(RingStat::Duplicate), 1);
    let other_op = Datagram { op: Op::Max, ..d.clone() };
    assert_eq!(ring.run_own(&other_op).0, XDP_DROP, "an op the runtime did not start: malformed");
    assert_eq!(ring.ctrl().finals, 0);
}

#[test]
fn forged_and_malformed_datagrams_are_dropped_and_change_nothing() {
    forged_case(Family::V4);
}

#[test]
fn ipv6_forged_and_malformed_datagrams_are_dropped_and_change_nothing() {
    forged_case(Family::V6);
}

fn forged_case(family: Family) {
    let ring = ring_of(family, 16, vec![1, 1, 1, 1]);
    ring.ready(0, Op::Sum, &[5; 16]);
    let good = Datagram::new(abi::RING_PARTIAL, 0, 0, 1, Op::Sum, vec![1; 8]).over(family);
    let own = |d: Datagram| d.over(family);
    // member 0's address in the other IP version, and IPv4-mapped
    let sender4 = members()[0];
    let other_version = match family {
        Family::V4 => Family::V6.addr(sender4),
        Family::V6 => IpAddr::V4(sender4),
    };
    let mapped = IpAddr::V6(sender4.to_ipv6_mapped());
    let mut cases = vec![
        ("a source that is not the member it names", own(Datagram { src: Ipv4Addr::new(10, 88, 0, 99).into(), ..good.clone() }), RingStat::Forged),
        ("hops that lead to another member", own(Datagram::new(abi::RING_PARTIAL, 0, 1, 1, Op::Sum, vec![1; 8])), RingStat::Forged),
        ("a sender that is not transmission hops' sender", own(Datagram { sender: 2, src: members()[2].into(), ..good.clone() }), RingStat::Forged),
        ("the member's address in the other IP version", Datagram { src: other_version, ..good.clone() }, RingStat::Forged),
        ("the member's IPv4 address, IPv4-mapped", Datagram { src: mapped, ..good.clone() }, RingStat::Forged),
        ("a count that is not the fragment's", Datagram { values: vec![1; 7], ..good.clone() }, RingStat::Malformed),
        ("a count field beyond the datagram", Datagram { count: Some(9), ..good.clone() }, RingStat::Malformed),
        ("a fragment beyond the vector", Datagram { frag: 4, ..good.clone() }, RingStat::Malformed),
        ("a reserved flag", Datagram { flags: 0x80, ..good.clone() }, RingStat::Malformed),
        ("a PARTIAL with FINAL's hops", Datagram { hops: 5, ..good.clone() }, RingStat::Malformed),
        ("a user-space op", Datagram { op: Op::Prod, ..good.clone() }, RingStat::Malformed),
    ];
    match family {
        Family::V4 => cases.push(("a first fragment (MF)", Datagram { ip_frag: Some(0x2000), ..good.clone() }, RingStat::Malformed)),
        Family::V6 => {
            // docs/RING.md "XDP": no member sends IPv6 extension headers or
            // checksum 0; a first fragment goes the way IPv4's does
            cases.push(("a Fragment header (first fragment)", Datagram { ip6_ext: vec![ip6_ext(IP6_FRAGMENT, 8, 0x0001)], ..good.clone() }, RingStat::Malformed));
            cases.push(("an atomic Fragment header", Datagram { ip6_ext: vec![ip6_ext(IP6_FRAGMENT, 8, 0)], ..good.clone() }, RingStat::Malformed));
            cases.push(("hop-by-hop options", Datagram { ip6_ext: vec![ip6_ext(IP6_HOPOPTS, 8, 0)], ..good.clone() }, RingStat::Malformed));
            cases.push(("a routing header", Datagram { ip6_ext: vec![ip6_ext(IP6_ROUTING, 8, 0)], ..good.clone() }, RingStat::Malformed));
            cases.push(("destination options", Datagram { ip6_ext: vec![ip6_ext(IP6_DSTOPTS, 16, 0)], ..good.clone() }, RingStat::Malformed));
            cases.push(("UDP checksum 0", Datagram { udp_csum: Some(0), ..good.clone() }, RingStat::Malformed));
        }
    }
    for (what, d, stat) in cases {
        let before = ring.stat(stat);
        assert_eq!(ring.run(&d).0, XDP_DROP, "{what}");
        assert_eq!(ring.stat(stat), before + 1, "{what}: counted as {stat:?}");
    }
    assert_eq!(ring.data(0), vec![5; 8], "nothing stored");
    assert_eq!(ring.ctrl().finals, 0);
    assert_eq!(ring.stat(RingStat::Added), 0);
    // and the good one still goes through
    let (verdict, out) = ring.run(&good);
    assert_eq!(verdict, XDP_REDIRECT);
    assert_eq!(forwarded(&out, abi::RING_PARTIAL, 2).1, vec![6; 8]);
}

/// A non-first IPv6 fragment has no UDP header: no ring's, passed to the
/// stack by the entry program untouched (as an IPv4 one).
#[test]
fn ipv6_a_later_fragment_passes_untouched() {
    let ring = ring_of(Family::V6, 16, vec![1, 1, 1, 1]);
    ring.ready(0, Op::Sum, &[5; 16]);
    let d = Datagram { ip6_ext: vec![ip6_ext(IP6_FRAGMENT, 8, 0x0008)], ..Datagram::new(abi::RING_PARTIAL, 0, 0, 1, Op::Sum, vec![1; 8]).over(Family::V6) };
    let frame = d.frame();
    let (verdict, out) = ring.dp.test_runner().unwrap().run(&frame).unwrap();
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(out, frame, "untouched");
    for s in RingStat::ALL {
        assert_eq!(ring.stat(s), 0, "{s:?}: the ring program never saw it");
    }
}

#[test]
fn a_vlan_tagged_datagram_is_added_and_forwarded_with_its_tag() {
    vlan_case(Family::V4);
}

#[test]
fn ipv6_a_vlan_tagged_datagram_is_added_and_forwarded_with_its_tag() {
    vlan_case(Family::V6);
}

fn vlan_case(family: Family) {
    let weights = vec![1, 1, 1, 1];
    let ring = ring_of(family, 30, weights.clone());
    let all: Vec<Vec<i32>> = (0..4).map(|m| input(30, m + 1)).collect();
    ring.ready(2, Op::Sum, &all[ME]);
    let n = ring.count_of(0) as usize;
    let d = Datagram { vlan: Some(0x0064), ..Datagram::new(abi::RING_PARTIAL, 2, 0, 1, Op::Sum, partial(Op::Sum, 0, 1, &all, &weights, n)) };
    let (verdict, out) = ring.run_own(&d);
    assert_eq!(verdict, XDP_REDIRECT);
    assert_eq!(&out[12..16], &[0x81, 0x00, 0x00, 0x64], "the tag stays");
    let (_, got) = forwarded(&out, abi::RING_PARTIAL, 2);
    assert_eq!(got, partial(Op::Sum, 0, 2, &all, &weights, n));
    // the completer's FINAL, tagged
    let f = 2;
    let n = ring.count_of(f) as usize;
    let d = Datagram { vlan: Some(0x0064), ..Datagram::new(abi::RING_PARTIAL, 2, f, 3, Op::Sum, partial(Op::Sum, f, 3, &all, &weights, n)) };
    let (verdict, out) = ring.run_own(&d);
    assert_eq!(verdict, XDP_REDIRECT);
    let (_, got) = forwarded(&out, abi::RING_FINAL, 4);
    assert_eq!(got, ring.data(f)[..n]);
    assert_eq!((ring.stat(RingStat::Added), ring.stat(RingStat::Completed)), (1, 1));
}

#[test]
fn a_fragment_in_a_multi_buffer_frame_is_added_and_stored_in_chunks() {
    // The largest fragment, 16370 elements (a 65535-byte IPv4 datagram),
    // then 3000: datagrams of more than a page, so BPF_PROG_TEST_RUN hands
    // the frags chain multi-buffer frames.
    chunked_case(Family::V4, 16_370);
    chunked_case(Family::V4, 3000);
}

/// The same over IPv6: the UDP checksum of every forwarded frame covers
/// the payload in the frame's fragments.
#[test]
fn ipv6_a_fragment_in_a_multi_buffer_frame_is_added_and_stored_in_chunks() {
    chunked_case(Family::V6, 16_370);
    chunked_case(Family::V6, 3000);
}

fn chunked_case(family: Family, big: u32) {
    let weights = vec![2, 1, 1, 3];
    let ring = Ring::of_family(family, 4 * big, weights.clone(), big, 0);
    let all: Vec<Vec<i32>> = (0..4).map(|m| input(4 * big, m + 5)).collect();
    for (round, op) in [Op::Sum, Op::Max, Op::Avg].into_iter().enumerate() {
        let round = round as u32;
        ring.ready(round, op, &all[ME]);
        let n = big as usize;
        let slice = |f: u32| -> Vec<Vec<i32>> { all.iter().map(|v| v[(f * big) as usize..(f * big) as usize + n].to_vec()).collect() };
        let partial_of = |f: u32, hops: usize| -> Vec<i32> {
            let origin = f as usize % 4;
            let members: Vec<usize> = (0..hops).map(|k| (origin + k) % 4).collect();
            let vals: Vec<Vec<i32>> = members.iter().map(|&m| slice(f)[m].clone()).collect();
            let ws: Vec<i32> = members.iter().map(|&m| weights[m]).collect();
            let mut acc = Accumulator::new(if op == Op::Avg { Op::Sum } else { op }, n, false).unwrap();
            for (v, w) in vals.iter().zip(&ws) {
                acc.add_int(v, *w).unwrap();
            }
            acc.finish().unwrap().ints().unwrap().to_vec()
        };
        // an adder (fragment 0, transmission 1)
        let d = Datagram::new(abi::RING_PARTIAL, round, 0, 1, op, partial_of(0, 1));
        let (verdict, out) = ring.run_own(&d);
        assert_eq!(verdict, XDP_REDIRECT, "{op:?}: chunked add goes on");
        let (_, got) = forwarded(&out, abi::RING_PARTIAL, 2);
        assert_eq!(got, partial_of(0, 2), "{op:?}: every chunk added");
        // the completer (fragment 2, transmission 3)
        let d = Datagram::new(abi::RING_PARTIAL, round, 2, 3, op, partial_of(2, 3));
        let (verdict, out) = ring.run_own(&d);
        assert_eq!(verdict, XDP_REDIRECT);
        let (_, got) = forwarded(&out, abi::RING_FINAL, 4);
        let want = reference(op, &slice(2), &weights);
        assert_eq!(got, want, "{op:?}: the chunked completion is the star's result");
        assert_eq!(ring.data(2), want, "{op:?}: stored in place");
        // a FINAL (fragment 1, transmission 4)
        let result: Vec<i32> = (0..n as i32).map(|i| i - 1500).collect();
        let d = Datagram::new(abi::RING_FINAL, round, 1, 4, op, result.clone());
        assert_eq!(ring.run_own(&d).0, XDP_REDIRECT);
        assert_eq!(ring.data(1), result, "{op:?}: the chunked store");
    }
}

#[test]
fn the_ring_program_verifies_at_every_fragment_size() {
    // The loops are bounded by the load-time fragment size: the smallest,
    // MTU 1500's and the largest must each load (and stay clear of the
    // verifier's 1M-instruction limit).
    for frag in [2u32, 362, abi::RING_MAX_FRAG_ELEMS] {
        let ring = Ring::with_frag(4 * frag, vec![1, 1, 1, 1], frag);
        for p in ring.dp.programs().unwrap().iter().filter(|p| p.name.starts_with("aggbox_ring")) {
            println!("frag_elems {frag}: {} verified {} instructions", p.name, p.verified_insns);
            assert!(p.verified_insns < 1_000_000);
        }
    }
}

#[test]
fn a_removed_ring_leaves_no_entry_and_a_ring_in_its_region_sees_none_of_its_results() {
    // Ring 40: 30 elements, 4 fragments of 8, entries 0..8; room for 64
    // elements (8 fragments, 16 entries) more.
    let mut ring = Ring::with_pool(30, vec![1, 1, 1, 1], FRAG, 64);
    assert_eq!(ring.pool.usage().free, 64);
    let bpffs = bpffs::PrivateBpffs::mount("bpf-ring").expect("mounting a private bpffs");
    let pins = bpffs.path.join("pins");
    std::fs::create_dir_all(&pins).expect("pin dir");
    ring.dp.pin_maps(&pins).expect("pin maps");

    // Round 7 (the odd buffer, from entry 4): fragment 0's FINAL (origin 0,
    // transmission 5) stored at entry 4 and sent on.
    ring.ready(7, Op::Sum, &input(30, 1));
    let final7 = Datagram::new(abi::RING_FINAL, 7, 0, 5, Op::Sum, vec![70; 8]);
    assert_eq!(ring.run(&final7).0, XDP_REDIRECT);
    assert_eq!((ring.index(0), ring.done(0).round_plus1), (4, 8));
    let (dense, id, port) = (ring.dense, RING_ID, PORT);
    let before = ring_entries::ring_entries(&pins, dense, id, port);
    assert_eq!(
        before,
        ring_entries::RingEntries { port: 1, index: 1, job: 1, members: 4, ctrl: 1, nexthop: 1, stats: 1 },
        "ring 40's entries"
    );

    // Ring 40 removed, ring 41 (another id and port, 20 elements: 3
    // fragments, 6 entries) added as a reload does: first fit puts it in
    // ring 40's region, at its dense index.
    ring.replace(41, PORT + 1, 20);
    assert_eq!((ring.dense, ring.job.base), (dense, 0), "ring 40's index and region, reused");
    let old = ring_entries::ring_entries(&pins, dense, id, port);
    assert_eq!((old.port, old.index), (0, 0), "ring 40's port and id point nowhere");
    assert_eq!(ring_entries::live_rings(&pins), [1, 1, 1], "one ring's port, id and job");
    assert_eq!(ring.run(&final7).0, XDP_PASS, "ring 40's datagrams are no ring's: to the stack");
    let [data, done, _] = ring.dp.ring_memory_maps().expect("ring maps");
    for entry in 0..ring.job.entries() {
        let zero = |map: &libbpf_rs::MapHandle| map.lookup(&entry.to_ne_bytes(), MapFlags::ANY).unwrap().unwrap().iter().all(|&b| b == 0);
        assert!(zero(&data) && zero(&done), "entry {entry} of ring 41's region cleared");
    }
    let fresh = ring_entries::ring_entries(&pins, ring.dense, 41, PORT + 1);
    assert_eq!(
        fresh,
        ring_entries::RingEntries { port: 1, index: 1, job: 1, members: 4, ctrl: 0, nexthop: 1, stats: 0 },
        "ring 41 starts with no control block and no counters of ring 40 (its next hop is the test's)"
    );

    // Ring 41's round 1: fragment 1's FINAL (origin 1, transmission 4) is
    // stored at entry 3 + 1 = 4, where ring 40 left round 7's mark.
    ring.ready(1, Op::Sum, &input(20, 2));
    assert_eq!(ring.index(1), 4);
    let final1 = Datagram::new(abi::RING_FINAL, 1, 1, 4, Op::Sum, vec![11; 8]).of(&ring);
    assert_eq!(ring.run(&final1).0, XDP_REDIRECT, "stored and sent on, not taken for a duplicate of round 7");
    assert_eq!(ring.data(1), vec![11; 8]);
    assert_eq!(ring.done(1).round_plus1, 2);
    assert_eq!((ring.ctrl().finals, ring.stat(RingStat::Stored), ring.stat(RingStat::Duplicate)), (1, 1, 0));

    // Removed too: nothing of either ring is left.
    ring.dp.remove_ring(ring.dense, &ring.job).expect("remove ring 41");
    assert_eq!(ring_entries::ring_entries(&pins, ring.dense, 41, PORT + 1).total(), 0, "every entry of ring 41 gone");
    assert_eq!(ring_entries::live_rings(&pins), [0, 0, 0]);
    let _ = std::fs::remove_dir_all(&pins);
    drop(bpffs);
}

/// A ring's members are of one IP version (docs/RING.md "XDP"): over the
/// other version the datagram of a member is forged, whichever the ring's
/// version; over its own it is the ring's.
#[test]
fn a_datagram_in_the_other_ip_version_is_forged() {
    for family in Family::ALL {
        let ring = ring_of(family, 16, vec![1, 1, 1, 1]);
        ring.ready(3, Op::Sum, &[0; 16]);
        let d = Datagram::new(abi::RING_PARTIAL, 3, 0, 1, Op::Sum, vec![1; 8]);
        let other = match family {
            Family::V4 => d.clone().over(Family::V6),
            Family::V6 => d.clone(),
        };
        let before = ring.dp.stats().unwrap();
        assert_eq!(ring.run(&other).0, XDP_DROP, "{family:?} ring");
        let after = ring.dp.stats().unwrap();
        assert_eq!(bpf_common::stat_delta(&before, &after, "not_aggbox"), 0, "{family:?}: the ring's, not the stack's");
        assert_eq!(ring.stat(RingStat::Forged), 1, "{family:?}");
        assert_eq!(ring.run_own(&d).0, XDP_REDIRECT, "{family:?}: over its own version");
        assert_eq!(ring.stat(RingStat::Added), 1);
    }
}

/// `set_ring` takes members of one IP version, none IPv4-mapped; it
/// refuses others before touching a map (the ring written before runs on).
#[test]
fn set_ring_refuses_a_mix_of_ip_versions_and_mapped_addresses() {
    let ring = ring_of(Family::V6, 16, vec![1, 1, 1, 1]);
    ring.ready(0, Op::Sum, &[0; 16]);
    let mut mixed = bpf_common::ring::members_of(Family::V6);
    mixed[2] = IpAddr::V4(members()[2]);
    let mut mapped = bpf_common::ring::members_of(Family::V6);
    mapped[3] = IpAddr::V6(members()[3].to_ipv6_mapped());
    for (what, members, says) in [("mixed", mixed, "all of one IP version"), ("mapped", mapped, "IPv4-mapped")] {
        match ring.dp.set_ring(ring.dense, &ring.job, &members) {
            Err(XdpError::InvalidRing { ring: id, reason }) => {
                assert_eq!(id, RING_ID);
                assert!(reason.contains(says), "{what}: {reason}");
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    let d = Datagram::new(abi::RING_PARTIAL, 0, 0, 1, Op::Sum, vec![1; 8]);
    assert_eq!(ring.run_own(&d).0, XDP_REDIRECT, "the ring's entries are as they were");
    let v6 = Ipv6Addr::from(0xfd00_0077_0000_0000_0000_0000_0a58_000bu128);
    assert_eq!(bpf_common::ring::members_of(Family::V6)[0], IpAddr::V6(v6));
}
