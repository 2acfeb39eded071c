//! Reordering, duplication and loss without netem (no root needed): every
//! participant of a loopback job receives through the runtime's test hook
//! (`Impairment`: a seeded receive-side wrapper that drops, duplicates and
//! releases datagrams in random order within a window), under the same
//! progress engine, reliability module and reassembly as production. Data
//! and ACKs are both impaired. Socket backend: broadcast (worker and
//! aggregator roots), reduce and allreduce of several sizes must equal the
//! reference, each receiver gets every byte exactly once (counted by
//! `Communicator::stats`), and the hook really reordered / duplicated /
//! dropped (its counters), and where it dropped the runtime really
//! retransmitted.

mod common_runtime;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use aggbox::wire::abi::Op;
use aggbox::config::AckMode;
use aggbox::runtime::{
    CommStats, Communicator, CommunicatorBuilder, ImpairControl, Impairment, Participant,
};

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const WORKERS: usize = 3;

struct Job {
    all: Vec<Communicator>,
    control: ImpairControl,
}

fn job(
    seed: u64,
    window: usize,
    loss: f64,
    dup: f64,
    tweak: impl Fn(CommunicatorBuilder) -> CommunicatorBuilder,
) -> Job {
    let (agg_port, peers) = common_runtime::loopback_job_addrs(WORKERS);
    let control = ImpairControl::new(loss, dup);
    let mut all = Vec::new();
    for (i, me) in std::iter::once(Participant::Aggregator)
        .chain((0..WORKERS as u16).map(Participant::Worker))
        .enumerate()
    {
        let imp = Impairment {
            seed: seed * 31 + i as u64,
            reorder_window: window,
            control: control.clone(),
        };
        // MTU 1500, not loopback's discovered 65535: the impairment counts
        // below assume datagrams of 362 elements.
        let b = Communicator::builder(9, peers.clone(), LO, agg_port, me)
            .mtu(1500)
            .deadline(Duration::from_secs(20))
            .impairment(imp);
        all.push(tweak(b).build().unwrap());
    }
    Job { all, control }
}

fn stats(j: &Job) -> Vec<CommStats> {
    j.all.iter().map(|c| c.stats()).collect()
}

fn reduce(j: &Job, op: Op, len: usize, all: bool) {
    let before = stats(j);
    let comms: Vec<&Communicator> = j.all.iter().collect();
    common_runtime::int_reduction(&comms, WORKERS, op, len, all);
    for (i, (a, b)) in stats(j).iter().zip(before).enumerate() {
        if all || i == 0 {
            assert_eq!(
                a.bytes_delivered - b.bytes_delivered,
                4 * len as u64,
                "participant {i}: result bytes delivered once"
            );
        }
    }
}

fn broadcast(j: &Job, len: usize, root: usize) {
    let before = stats(j);
    let comms: Vec<&Communicator> = j.all.iter().collect();
    common_runtime::broadcast(&comms, len, j.all[root].participant());
    for (i, (a, b)) in stats(j).iter().zip(before).enumerate() {
        if i != root {
            assert_eq!(
                a.bytes_delivered - b.bytes_delivered,
                len as u64,
                "participant {i}: every byte exactly once"
            );
        }
    }
}

fn scenario(j: &Job, label: &str) {
    let t0 = Instant::now();
    for len in [1usize, 362, 5000, 100_000] {
        broadcast(j, len * 4, 1);
        broadcast(j, len * 4, 0);
        reduce(j, Op::Sum, len, false);
        reduce(j, Op::Sum, len, true);
    }
    reduce(j, Op::Max, 20_000, true);
    let st = stats(j);
    let retx: u64 = st.iter().map(|s| s.retransmitted).sum();
    let dups: u64 = st.iter().map(|s| s.duplicates_received).sum();
    eprintln!(
        "{label}: {:?}, hook {:?}, retransmitted {retx}, duplicates seen {dups}",
        t0.elapsed(),
        j.control.stats()
    );
}

#[test]
fn runtime_reordering_windows() {
    for (seed, window) in [(1u64, 8usize), (2, 16), (3, 64)] {
        let j = job(seed, window, 0.0, 0.0, |b| b);
        scenario(&j, &format!("reorder window {window}"));
        let h = j.control.stats();
        assert!(
            h.reordered > 1000,
            "window {window}: the hook reordered ({h:?})"
        );
        assert_eq!(h.dropped + h.duplicated, 0);
    }
}

#[test]
fn runtime_duplication() {
    let j = job(4, 1, 0.0, 0.10, |b| b);
    scenario(&j, "duplicate 10%");
    let h = j.control.stats();
    assert!(h.duplicated > 500, "{h:?}");
    let dups: u64 = stats(&j).iter().map(|s| s.duplicates_received).sum();
    assert!(dups > 100, "duplicates reached the dedup ({dups})");
}

#[test]
fn runtime_reordering_duplication_and_loss() {
    let j = job(5, 32, 0.02, 0.05, |b| b);
    scenario(&j, "reorder 32 + duplicate 5% + loss 2%");
    let h = j.control.stats();
    assert!(
        h.reordered > 0 && h.duplicated > 0 && h.dropped > 0,
        "{h:?}"
    );
    let retx: u64 = stats(&j).iter().map(|s| s.retransmitted).sum();
    assert!(retx > 0, "{} dropped, nothing retransmitted", h.dropped);
    let dups: u64 = stats(&j).iter().map(|s| s.duplicates_received).sum();
    assert!(dups > 0, "{} duplicated, none reached the dedup", h.duplicated);
}

#[test]
fn runtime_reordering_and_loss_packet_mode() {
    let j = job(6, 64, 0.05, 0.0, |b| b.ack_mode(AckMode::Packet).window(64));
    scenario(&j, "packet mode, reorder 64 + loss 5%");
    let h = j.control.stats();
    assert!(h.dropped > 0 && h.reordered > 0, "{h:?}");
    assert_eq!(h.duplicated, 0, "{h:?}");
    let retx: u64 = stats(&j).iter().map(|s| s.retransmitted).sum();
    assert!(retx > 0, "{} dropped, nothing retransmitted", h.dropped);
}
