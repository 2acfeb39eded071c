//! Who runs a call (docs/RUNTIME.md "Who runs a call"), through the real
//! I/O driver on loopback (no root needed), with loss injected by the
//! runtime's receive-side test hook (`Impairment`): a blocking call issued
//! while nothing else is in flight runs on the caller's thread; `Work` calls
//! and blocking calls issued while another call is in flight run on the
//! progress thread; between calls the progress thread answers
//! retransmissions. Every result is checked against the reference reducer,
//! and the counters say that datagrams were dropped, resent and answered.

mod common_runtime;

use std::net::Ipv4Addr;
use std::sync::Barrier;
use std::time::Duration;

use aggbox::runtime::Collective;
use aggbox::node::tools::pattern_vector;
use aggbox::runtime::{
    CallOptions, CommStats, Communicator, ImpairControl, Impairment, IoStats, Participant,
};
use aggbox::wire::abi::Op;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const WORKERS: usize = 3;

/// A socket-backend loopback job (the aggregator first), every participant
/// receiving through the impairment hook with `loss` and no duplication
/// (so every duplicate received is a retransmission).
fn job(seed: u64, loss: f64) -> (Vec<Communicator>, ImpairControl) {
    job_spinning(seed, loss, Duration::ZERO)
}

/// [`job`] whose callers poll for `spin` before they sleep
/// (`CommunicatorBuilder::caller_spin`).
fn job_spinning(seed: u64, loss: f64, spin: Duration) -> (Vec<Communicator>, ImpairControl) {
    let (agg_port, peers) = common_runtime::loopback_job_addrs(WORKERS);
    let control = ImpairControl::new(loss, 0.0);
    let all = std::iter::once(Participant::Aggregator)
        .chain((0..WORKERS as u16).map(Participant::Worker))
        .enumerate()
        .map(|(i, me)| {
            Communicator::builder(7, peers.clone(), LO, agg_port, me)
                .mtu(1500)
                .deadline(Duration::from_secs(20))
                .caller_spin(spin)
                .impairment(Impairment {
                    seed: seed * 17 + i as u64,
                    reorder_window: 1,
                    control: control.clone(),
                })
                .build()
                .unwrap()
        })
        .collect();
    (all, control)
}

fn input(c: &Communicator, len: usize) -> Vec<i32> {
    match c.participant() {
        Participant::Worker(r) => pattern_vector(r, len as u32),
        Participant::Aggregator => vec![0; len],
    }
}

fn io(all: &[Communicator]) -> Vec<IoStats> {
    all.iter().map(|c| c.io_stats()).collect()
}

fn stats(all: &[Communicator]) -> Vec<CommStats> {
    all.iter().map(|c| c.stats()).collect()
}

/// `calls` blocking allreduces of `len` elements on every participant at
/// once (a thread each), every result checked against the reference.
fn blocking_allreduces(all: &[Communicator], len: usize, calls: u64) {
    let want = common_runtime::expected(Op::Sum, WORKERS, len);
    std::thread::scope(|s| {
        for c in all {
            let want = &want;
            s.spawn(move || {
                for k in 0..calls {
                    let mut v = input(c, len);
                    c.allreduce(&mut v, Op::Sum)
                        .unwrap_or_else(|e| panic!("{:?} call {k}: {e}", c.participant()));
                    assert!(v == *want, "{:?} call {k}: wrong result", c.participant());
                }
            });
        }
    });
}

/// The injected loss happened and the participants resent what it took.
fn assert_loss_was_repaired(all: &[Communicator], control: &ImpairControl) {
    let dropped = control.stats().dropped;
    let retx: u64 = stats(all).iter().map(|s| s.retransmitted).sum();
    assert!(dropped > 0 && retx > 0, "dropped {dropped}, retransmitted {retx}");
}

/// One blocking allreduce at a time per participant: each runs on the
/// caller's thread (none on the progress thread), under 5 % loss, and the
/// lost datagrams were resent.
#[test]
fn blocking_calls_with_nothing_in_flight_run_on_the_callers_thread_under_loss() {
    let (all, control) = job(1, 0.05);
    let len = 20_000;
    let calls = 6;
    blocking_allreduces(&all, len, calls);
    for (c, st) in all.iter().zip(io(&all)) {
        assert_eq!(st.calls_on_caller, calls, "{:?}: {st:?}", c.participant());
        assert_eq!(
            st.calls_on_progress_thread,
            0,
            "{:?}: {st:?}",
            c.participant()
        );
    }
    assert_loss_was_repaired(&all, &control);
}

/// Two threads per participant call at once on one communicator: one
/// blocking allreduces, the other issues `Work` allreduces (same length and
/// inputs, so whichever pairs with whichever across participants, every
/// result is the same sum). The blocking calls take the caller's path when
/// nothing is queued and queue behind the `Work` calls otherwise; both
/// kinds run on one state machine, under 5 % loss.
#[test]
fn a_callers_calls_and_the_progress_threads_calls_interleave_under_loss() {
    let (all, control) = job(2, 0.05);
    let len = 5_000;
    let calls = 12u64;
    let want = common_runtime::expected(Op::Sum, WORKERS, len);
    std::thread::scope(|s| {
        for c in &all {
            let want = &want;
            s.spawn(move || {
                for k in 0..calls {
                    let mut v = input(c, len);
                    c.allreduce(&mut v, Op::Sum)
                        .unwrap_or_else(|e| panic!("{:?} blocking {k}: {e}", c.participant()));
                    assert!(
                        v == *want,
                        "{:?} blocking {k}: wrong result",
                        c.participant()
                    );
                }
            });
            s.spawn(move || {
                for k in 0..calls {
                    let out = c
                        .ireduce_i32(input(c, len), Op::Sum, true, CallOptions::default())
                        .wait()
                        .unwrap_or_else(|e| panic!("{:?} work {k}: {e}", c.participant()));
                    assert!(
                        out.values == *want,
                        "{:?} work {k}: wrong result",
                        c.participant()
                    );
                }
            });
        }
    });
    let st = io(&all);
    for (c, s) in all.iter().zip(&st) {
        assert_eq!(
            s.calls_on_caller + s.calls_on_progress_thread,
            2 * calls,
            "{:?}: {s:?}",
            c.participant()
        );
        assert!(
            s.calls_on_progress_thread >= calls,
            "{:?}: {s:?}",
            c.participant()
        );
    }
    let on_caller: u64 = st.iter().map(|s| s.calls_on_caller).sum();
    assert!(
        on_caller > 0,
        "no blocking call took the caller's path: {st:?}"
    );
    assert_loss_was_repaired(&all, &control);
}

/// The aggregator's allreduce ends only when every worker acknowledged the
/// result. Under 15 % loss some of those ACKs are lost, and the aggregator
/// resends the result while the workers' calls are over and the workers
/// wait (at a barrier, calling nothing): only their progress threads can
/// receive the resend and acknowledge it. The aggregator's calls all
/// complete, and the workers received retransmitted results while idle.
#[test]
fn between_calls_the_progress_thread_answers_retransmissions() {
    let (all, control) = job(3, 0.15);
    let len = 2_000;
    let want = common_runtime::expected(Op::Sum, WORKERS, len);
    let barrier = Barrier::new(all.len());
    let mut idle_dups = 0u64;
    let mut rounds = 0;
    while idle_dups < 3 && rounds < 300 {
        rounds += 1;
        let got: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = all
                .iter()
                .map(|c| {
                    let (want, barrier) = (&want, &barrier);
                    s.spawn(move || {
                        let mut v = input(c, len);
                        c.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| {
                            panic!("{:?} round {rounds}: {e}", c.participant())
                        });
                        assert!(v == *want, "{:?}: wrong result", c.participant());
                        let done = c.stats().duplicates_received;
                        barrier.wait(); // the aggregator's call is over too
                        c.stats().duplicates_received - done
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        idle_dups += got[1..].iter().sum::<u64>();
    }
    assert!(
        idle_dups >= 3,
        "{rounds} rounds, {idle_dups} results resent to idle workers; impairment {:?}",
        control.stats()
    );
    let agg = all[0].stats();
    assert!(agg.retransmitted > 0, "{agg:?}");
    for c in &all {
        assert_eq!(
            c.io_stats().calls_on_progress_thread,
            0,
            "{:?}",
            c.participant()
        );
    }
}

/// A caller that polls before it sleeps (`caller_spin`) gets datagrams
/// while it polls: with a spin of 20 ms on loopback some of every
/// participant's waits are answered so, and its results are the same;
/// without a spin every wait sleeps. Under 5 % loss (a lost datagram's
/// resend comes after the spin: those waits sleep).
#[test]
fn a_caller_that_polls_first_is_answered_while_polling() {
    let len = 3_000;
    let calls = 8u64;
    for (seed, spin) in [(4, Duration::from_millis(20)), (5, Duration::ZERO)] {
        let (all, control) = job_spinning(seed, 0.05, spin);
        blocking_allreduces(&all, len, calls);
        for (c, st) in all.iter().zip(io(&all)) {
            assert_eq!(st.calls_on_caller, calls, "{:?}: {st:?}", c.participant());
            if spin.is_zero() {
                assert_eq!(st.caller_waits_polled, 0, "{:?} without a spin: {st:?}", c.participant());
                assert!(st.caller_waits_slept > 0, "{:?} without a spin: {st:?}", c.participant());
            } else {
                assert!(st.caller_waits_polled > 0, "{:?} with a spin of {spin:?}: {st:?}", c.participant());
            }
        }
        assert!(control.stats().dropped > 0, "the loss was injected: {:?}", control.stats());
    }
}
