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
//!   completing contribution, rewritten in place) still pass.
//!
//! Needs root (BPF): `sudo -E cargo test --test bpf_trust`.

mod bpf_common;

use std::net::Ipv4Addr;

use aggbox::wire::abi::{self, DropReason, Op, Outcome};
use aggbox::kernel::xdp::XdpJob;
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
