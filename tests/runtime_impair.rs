//! Loss recovery through the real I/O driver (no root needed): every
//! participant of a loopback job receives through the runtime's test hook
//! (`Impairment`: a seeded receive-side wrapper that drops, duplicates and
//! releases datagrams in random order within a window), under the same
//! driver, timers, reliability module and reassembly as production. Data and
//! ACKs are both impaired. One pass of broadcast (worker and aggregator
//! roots), reduce and allreduce must equal the reference, each receiver gets
//! every byte exactly once (counted by `Communicator::stats`), the hook
//! really reordered, duplicated and dropped (its counters), and the runtime
//! really retransmitted.
//!
//! What the protocol does under loss, reordering and duplication, datagram
//! by datagram and for every collective, length and ACK mode, is tested
//! deterministically on the state machine with a fake clock:
//! `runtime::engine::tests::network`.

mod common_runtime;

use std::net::Ipv4Addr;
use std::time::Duration;

use aggbox::wire::abi::Op;
use aggbox::runtime::{
    CommStats, Communicator, ImpairControl, Impairment, Participant,
};

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const WORKERS: usize = 3;

struct Job {
    all: Vec<Communicator>,
    control: ImpairControl,
}

fn job(seed: u64, window: usize, loss: f64, dup: f64) -> Job {
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
        // MTU 1500, not loopback's discovered 65535: a call of 100k
        // elements is 277 datagrams per sender, enough for the hook's
        // probabilities to drop and duplicate some.
        let b = Communicator::builder(9, peers.clone(), LO, agg_port, me)
            .mtu(1500)
            .deadline(Duration::from_secs(20))
            .impairment(imp);
        all.push(b.build().unwrap());
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

/// Reordering over 32, duplication 5 % and loss 2 %: what arrives late,
/// twice or not at all is put right by the driver's timers and the
/// reliability module.
#[test]
fn runtime_impaired_job_recovers_through_the_socket_driver() {
    let j = job(5, 32, 0.02, 0.05);
    for len in [1usize, 100_000] {
        broadcast(&j, len * 4, 1);
        broadcast(&j, len * 4, 0);
        reduce(&j, Op::Sum, len, false);
        reduce(&j, Op::Sum, len, true);
    }
    let h = j.control.stats();
    assert!(
        h.reordered > 0 && h.duplicated > 0 && h.dropped > 0,
        "{h:?}"
    );
    let st = stats(&j);
    let retx: u64 = st.iter().map(|s| s.retransmitted).sum();
    assert!(retx > 0, "{} dropped, nothing retransmitted", h.dropped);
    let dups: u64 = st.iter().map(|s| s.duplicates_received).sum();
    assert!(dups > 0, "{} duplicated, none reached the dedup", h.duplicated);
}
