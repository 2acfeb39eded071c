//! What a remote host may not make the XDP program do (PROTOCOL.md,
//! "Semantics at the aggregator"; docs/ROBUSTNESS.md):
//!
//! - a port serves one job: a contribution of job B sent to job A's port is
//!   dropped `port_mismatch` and reaches neither job's slots, counters or
//!   state (job B's own port still serves it);
//! - a RESULT-shaped AGG1 (RESULT flag) from the network to its job's result
//!   port is dropped `forged_result` before TC ingress could route it (copies
//!   to the result group, upstream as this node's contribution), whoever
//!   sends it; RESULT-shaped datagrams to other ports, or of jobs this node
//!   does not have, reach the stack untouched; the node's own RESULTs (the
//!   completing contribution, rewritten in place) still pass;
//! - a rank is an IP version and an address: a job of IPv6 ranks takes
//!   contributions only from those IPv6 addresses (an IPv4 sender whose
//!   address is the first bytes of a rank's, the IPv4-mapped form, another
//!   rank's or a stranger's IPv6 address are `source_mismatch` and change
//!   nothing), and a job of IPv4 ranks takes no IPv6 sender.
//!
//! Needs root (BPF): `sudo -E cargo test --test bpf_trust`.

mod bpf_common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aggbox::wire::abi::{self, DropReason, Op, Outcome};
use aggbox::kernel::xdp::{XdpJob, XdpPlane};
use bpf_common::run_one as run;
use bpf_common::*;

const A: u16 = 41;
const B: u16 = 42;
const PORT_B: u16 = 7100;
const RESULT_PORT_B: u16 = 7101;

fn addr(job: u16, rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 66, job as u8, 1 + rank as u8)
}

fn job(id: u16, port: u16, result_port: u16) -> XdpJob {
    XdpJob {
        id,
        port,
        result_port,
        ranks: (0..2).map(|r| addr(id, r).into()).collect(),
        weights: vec![],
        vector_len: 64,
        slots: 16,
        flags: 0,
        result_group: None,
        window: 4,
        frag_elems: 0,
    }
}

fn setup() -> TestPlane {
    let dp = load();
    dp.set_job(A, &job(A, JOB_PORT, RESULT_PORT)).expect("job A");
    dp.set_job(B, &job(B, PORT_B, RESULT_PORT_B)).expect("job B");
    dp
}

fn contribution(job: u16, rank: u16, dport: u16, values: &[i32]) -> Vec<u8> {
    let a = Agg::new(job, rank, Op::Sum as u8, values.to_vec());
    let mut f = Frame::udp(addr(job, rank), a.bytes());
    f.dport = dport;
    f.build()
}

fn result_shaped(job: u16, src: Ipv4Addr, dport: u16) -> Vec<u8> {
    let mut a = Agg::new(job, abi::RESULT_RANK, Op::Sum as u8, vec![0x0123_4567, 7]);
    a.flags = abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT;
    let mut f = Frame::udp(src, a.bytes());
    f.dport = dport;
    f.build()
}

#[test]
fn a_contribution_sent_to_another_jobs_port_reaches_no_slot() {
    let dp = setup();
    let before = (dp.job_stats(A).unwrap(), dp.job_stats(B).unwrap());
    // Both of B's ranks, from their own addresses, to A's port: a complete
    // fragment of B, if the port did not bind the job.
    for rank in 0..2 {
        let frame = contribution(B, rank, JOB_PORT, &[1, 2, 3]);
        let (label, out) = run(&dp, &frame);
        assert_eq!(label, DropReason::PortMismatch.label(), "rank {rank}");
        assert_eq!(out, frame, "dropped untouched");
    }
    assert_eq!((dp.job_stats(A).unwrap(), dp.job_stats(B).unwrap()), before, "charged to neither job");
    assert_eq!(dp.job_state(B).unwrap().unwrap().completed, 0);
    assert_eq!((dp.slots_in_use(), dp.fast_slots_in_use()), (0, 0), "no slot of either job");
    // B's own port serves B: the same contributions complete there.
    assert_eq!(run(&dp, &contribution(B, 0, PORT_B, &[1, 2, 3])).0, Outcome::Accepted.label());
    let (label, out) = run(&dp, &contribution(B, 1, PORT_B, &[10, 20, 30]));
    assert_eq!(label, Outcome::Result.label());
    let values: Vec<i32> = out[PAYLOAD_OFF + 24..]
        .chunks(4)
        .map(|c| i32::from_be_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(values, [11, 22, 33]);
}

#[test]
fn a_result_from_the_network_to_its_jobs_result_port_is_dropped() {
    let dp = setup();
    let stranger = Ipv4Addr::new(10, 66, 99, 9);
    // From anyone (a stranger, one of the job's own ranks), to the result
    // port of the job it names: forged.
    for (src, job, port) in [(stranger, A, RESULT_PORT), (addr(A, 0), A, RESULT_PORT), (stranger, B, RESULT_PORT_B)] {
        let frame = result_shaped(job, src, port);
        let (label, out) = run(&dp, &frame);
        assert_eq!(label, DropReason::ForgedResult.label(), "job {job} to port {port} from {src}");
        assert_eq!(out, frame);
    }
    // Not a routed RESULT: another job's result port, a port nobody uses, a
    // job this node does not have, no RESULT flag: the stack gets them.
    let mut not_result = Agg::new(A, abi::RESULT_RANK, Op::Sum as u8, vec![1]);
    not_result.flags = 0;
    let mut plain = Frame::udp(stranger, not_result.bytes());
    plain.dport = RESULT_PORT;
    for (what, frame) in [
        ("job A to B's result port", result_shaped(A, stranger, RESULT_PORT_B)),
        ("job A to an unused port", result_shaped(A, stranger, 7999)),
        ("unknown job to A's result port", result_shaped(77, stranger, RESULT_PORT)),
        ("no RESULT flag", plain.build()),
    ] {
        let (label, out) = run(&dp, &frame);
        assert_eq!(label, Outcome::NotAggbox.label(), "{what}");
        assert_eq!(out, frame, "{what}");
    }
    // The node's own RESULTs: the completing contribution leaves as the
    // RESULT on A's result port.
    assert_eq!(run(&dp, &contribution(A, 0, JOB_PORT, &[4])).0, Outcome::Accepted.label());
    let (label, out) = run(&dp, &contribution(A, 1, JOB_PORT, &[5]));
    assert_eq!(label, Outcome::Result.label());
    assert_eq!(u16::from_be_bytes([out[36], out[37]]), RESULT_PORT, "UDP destination: the result port");
    assert_eq!(dp.job_stats(A).unwrap().unwrap().results, 1);
}

/// An IPv6 address whose first four bytes are `a`'s and the rest zero: the
/// bits an IPv4 rank entry holds, as an IPv6 one.
fn same_bits(a: Ipv4Addr) -> Ipv6Addr {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&a.octets());
    Ipv6Addr::from(b)
}

/// A contribution of job `id` rank `rank` from `src` to JOB_PORT; its
/// label and output frame.
fn send_from(dp: &XdpPlane, id: u16, rank: u16, src: IpAddr, values: &[i32]) -> (&'static str, Vec<u8>, Vec<u8>) {
    let mut a = Agg::new(id, rank, Op::Sum as u8, values.to_vec());
    a.round = 3;
    let frame = Frame::udp(src, a.bytes()).build();
    let (label, out) = run(dp, &frame);
    (label, frame, out)
}

/// A job of IPv6 ranks aggregates exactly what its ranks send from their
/// IPv6 addresses, and nothing that comes from anywhere else.
#[test]
fn an_ipv6_job_takes_only_its_ranks_ipv6_addresses() {
    let dp = load();
    // Rank r's IPv6 address holds the bits of the IPv4 address addr(A, r)
    // in its first word, as an IPv4 rank's entry would.
    let rank6 = |r: u16| same_bits(addr(A, r));
    let mut j = job(A, JOB_PORT, RESULT_PORT);
    j.ranks = (0..3).map(|r| IpAddr::V6(rank6(r))).collect();
    dp.set_job(A, &j).expect("a job of IPv6 ranks");
    let before = dp.job_stats(A).unwrap().unwrap();
    let mut stranger = rank6(0).octets();
    stranger[15] ^= 1;
    let refused: Vec<(&str, IpAddr)> = vec![
        ("IPv4 sender with rank 0's address bits", IpAddr::V4(addr(A, 0))),
        ("IPv4-mapped rank 0", IpAddr::V6(addr(A, 0).to_ipv6_mapped())),
        ("rank 1's IPv6 address as rank 0", IpAddr::V6(rank6(1))),
        ("an IPv6 stranger one bit off rank 0", IpAddr::V6(Ipv6Addr::from(stranger))),
    ];
    for (what, src) in &refused {
        let (label, frame, out) = send_from(&dp, A, 0, *src, &[1000, 2000]);
        assert_eq!(label, DropReason::SourceMismatch.label(), "{what}");
        assert_eq!(out, frame, "{what}: dropped untouched");
    }
    assert_eq!((dp.slots_in_use(), dp.fast_slots_in_use()), (0, 0), "no slot from a refused sender");
    let after = dp.job_stats(A).unwrap().unwrap();
    assert_eq!(after.dropped - before.dropped, refused.len() as u64);
    assert_eq!(after.accepted, before.accepted);
    // The ranks themselves: exact, and the RESULT a receiving IPv6 stack
    // takes (right UDP checksum).
    assert_eq!(send_from(&dp, A, 0, IpAddr::V6(rank6(0)), &[1, 5]).0, Outcome::Accepted.label());
    assert_eq!(send_from(&dp, A, 1, IpAddr::V6(rank6(1)), &[10, 5]).0, Outcome::Accepted.label());
    let (label, frame, out) = send_from(&dp, A, 2, IpAddr::V6(rank6(2)), &[100, i32::MAX]);
    assert_eq!(label, Outcome::Result.label());
    let p = check_result_headers(&frame, &out);
    let values: Vec<i32> = out[p + 24..].chunks(4).map(|c| i32::from_be_bytes(c.try_into().unwrap())).collect();
    assert_eq!(values, [111, i32::MAX], "clamped");
    assert_eq!(out[p + 21], abi::AGG_F_RESULT | abi::AGG_F_OVERFLOW);
    assert_eq!(dp.job_stats(A).unwrap().unwrap().results, 1);
}

/// A job of IPv4 ranks takes no IPv6 sender, whatever its address bits.
#[test]
fn an_ipv4_job_takes_no_ipv6_sender() {
    let dp = setup();
    for (what, src) in [
        ("rank 0's bits in the first word", IpAddr::V6(same_bits(addr(A, 0)))),
        ("IPv4-mapped rank 0", IpAddr::V6(addr(A, 0).to_ipv6_mapped())),
        ("rank 0's IPv6 twin", Family::V6.addr(addr(A, 0))),
    ] {
        let (label, frame, out) = send_from(&dp, A, 0, src, &[1]);
        assert_eq!(label, DropReason::SourceMismatch.label(), "{what}");
        assert_eq!(out, frame, "{what}");
    }
    assert_eq!((dp.slots_in_use(), dp.fast_slots_in_use()), (0, 0));
    assert_eq!(send_from(&dp, A, 0, IpAddr::V4(addr(A, 0)), &[1]).0, Outcome::Accepted.label());
}
