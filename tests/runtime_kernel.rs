//! The kernel backend against a live `aggbox attach` (XDP aggregator + TC
//! broadcast plane) on a netns testbed: host 0 runs `aggbox attach eth0
//! --config` with the job, a `[[group]]` of the workers and `result_group`;
//! the aggregator application and the workers are communicators built with
//! `CommunicatorBuilder::from_config(...).backend(BackendKind::Kernel)`.
//!
//! - reduce: the XDP program reduces, the aggregator runtime gets the RESULTs
//!   and acknowledges the contributions on the kernel's behalf;
//! - allreduce: the TC ingress program copies every RESULT to every worker
//!   (in-kernel allreduce); the workers acknowledge results to the aggregator
//!   runtime, which resends (unicast) only what a worker misses;
//! - broadcast from the aggregator: one `AGB1` per fragment with the full
//!   mask, copied by the TC egress program; resends are masked `AGB1`s;
//!   broadcast from a worker uses the socket path (its host has no TC).
//!
//! Loss: the random-drop cls_bpf program of tests/runtime_netns.rs on the
//! switch ports (0, 1 %, 5 %, and a 10 % burst). Every result equals the
//! reference reducer's, every receiver gets every byte exactly once; every
//! phase under loss asserts that the injector really dropped datagrams (its
//! counters) and that the runtime really retransmitted
//! (`CommStats::retransmitted`); an injector that fails to attach fails the
//! test.
//!
//! Needs root; fails (never skips) otherwise:
//! `sudo -E cargo test --release --test runtime_kernel`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod common_runtime;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use aggbox::runtime::Collective;
use aggbox::wire::abi::{BcastStat, Op};
use aggbox::config::Config;
use aggbox::runtime::{BackendKind, CommError, CommStats, Communicator, CommunicatorBuilder, Participant, StripedCommunicator};
use crate::testbed::{Testbed, TestbedConfig};

const WORKERS: usize = 3;
const JOB: u16 = 7;
const JOB_PORT: u16 = 7400;
const RESULT_PORT: u16 = 7401;
const GROUP: u16 = 3;
const DATA_PORT: u16 = 7500;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/runtime_kernel.rs needs root (network namespaces, XDP, TC): \
         `sudo -E cargo test --release --test runtime_kernel`"
    );
}

mod live_attach;
use live_attach::LiveAttach as Attach;

struct Bed {
    // Field order: communicators first, then the attachment, then the testbed.
    injector: impair::Injector,
    agg: Communicator,
    workers: Vec<Communicator>,
    attach: Attach,
    tb: Testbed,
}

impl Bed {
    fn up(tag: &str, tweak: fn(CommunicatorBuilder) -> CommunicatorBuilder) -> Bed {
        Bed::up_with(tag, "", tweak)
    }

    /// `job_keys`: more `[[job]]` lines of the node config (e.g. `slots`).
    fn up_with(tag: &str, job_keys: &str, tweak: fn(CommunicatorBuilder) -> CommunicatorBuilder) -> Bed {
        let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
        let workers: Vec<Ipv4Addr> = (1..=WORKERS).map(|h| tb.host(h).addr).collect();
        let list = |f: &dyn Fn(&Ipv4Addr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
        let text = format!(
            "[node]\nmetrics = \"off\"\n\n[[job]]\nid = {JOB}\nport = {JOB_PORT}\nworkers = [{}]\nresult_port = {RESULT_PORT}\nresult_group = {GROUP}\n{job_keys}\n[[group]]\nid = {GROUP}\nmembers = [{}]\n",
            list(&|w| format!("\"{w}\"")),
            list(&|w| format!("\"{w}:{DATA_PORT}\"")),
        );
        let attach = Attach::start(&tb.host(0).netns, tag, &text, &[]);
        let config = Config::parse(&text, "runtime_kernel").expect("config");
        let agg_addr = tb.host(0).addr;
        let build = |host: usize, me: Participant| {
            let b = CommunicatorBuilder::from_config(&config, JOB, agg_addr, DATA_PORT, me)
                .expect("from_config")
                .backend(BackendKind::Kernel)
                .deadline(Duration::from_secs(20));
            let b = tweak(b);
            tb.in_host(host, move || b.build()).expect("netns").expect("build")
        };
        let agg = build(0, Participant::Aggregator);
        assert!(agg.config().tc_group.is_some(), "the aggregator broadcasts through the TC group");
        assert!(agg.config().kernel_result_group);
        let workers = (0..WORKERS).map(|r| build(r + 1, Participant::Worker(r as u16))).collect();
        Bed { injector: impair::Injector::new(), agg, workers, attach, tb }
    }

    fn all(&self) -> Vec<&Communicator> {
        std::iter::once(&self.agg).chain(self.workers.iter()).collect()
    }

    fn impair(&self, loss: f64) {
        impair_ports(&self.tb, &self.injector, loss);
    }

    fn stats(&self) -> Vec<CommStats> {
        self.all().iter().map(|c| c.stats()).collect()
    }

    /// Runs `f` under the injector's loss and asserts that it really dropped
    /// datagrams and the runtime really retransmitted; `f` runs again (at
    /// most 10 times) while either is still 0 (a few hundred skbs at 1 %
    /// may lose nothing).
    fn under_loss(&self, label: &str, f: impl Fn()) {
        let retx = |s: Vec<CommStats>| s.iter().map(|s| s.retransmitted).sum::<u64>();
        let (c0, r0) = (self.injector.counts(), retx(self.stats()));
        for _ in 0..10 {
            f();
            if (self.injector.counts() - c0).dropped > 0 && retx(self.stats()) > r0 {
                break;
            }
        }
        let (c, r) = (self.injector.counts() - c0, retx(self.stats()) - r0);
        assert_lost_and_resent(label, c, r);
    }
}

/// Loss `loss` on every switch port's egress (none at 0).
fn impair_ports(tb: &Testbed, injector: &impair::Injector, loss: f64) {
    for i in 0..=WORKERS {
        let port = tb.switch_port(i);
        crate::testbed::in_netns(&tb.switch_netns(), move || injector.set(&port, loss, 0.0))
            .expect("switch netns")
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
}

fn assert_lost_and_resent(label: &str, c: impair::Counts, retransmitted: u64) {
    eprintln!("{label}: injector {c:?}, retransmitted {retransmitted}");
    assert!(c.dropped > 0, "{label}: the injector dropped nothing ({c:?})");
    assert!(retransmitted > 0, "{label}: {} dropped, nothing retransmitted", c.dropped);
}

#[path = "../src/testing/impair/mod.rs"]
mod impair;

/// Runs `f`; when it panics, prints the node's XDP outcome and drop
/// counters and every communicator's statistics first (which datagrams the
/// kernel refused, and why, is what a failed call's own error cannot say).
fn with_node_counters<T>(bed: &Bed, what: &str, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(e) => {
            let status = bed.attach.status();
            eprintln!(
                "{what} failed; XDP outcomes {:?}\nXDP drops {:?}\nhand-offs {:?}\nTC {:?}\ncommunicators {:?}",
                status.outcomes, status.drops, status.handoffs, status.broadcast, bed.stats()
            );
            std::panic::resume_unwind(e)
        }
    }
}

fn reduce(bed: &Bed, op: Op, len: usize, all: bool) {
    let before = bed.stats();
    with_node_counters(bed, &format!("{op:?} of {len} (all {all})"), || {
        common_runtime::int_reduction(&bed.all(), WORKERS, op, len, all)
    });
    // Each participant that gets the result got each of its bytes once.
    for (i, (a, b)) in bed.stats().iter().zip(before).enumerate() {
        if all || i == 0 {
            assert_eq!(a.bytes_delivered - b.bytes_delivered, len as u64 * 4, "participant {i}: delivered bytes");
        }
    }
}

fn broadcast(bed: &Bed, len: usize, root: Participant) {
    let before = bed.stats();
    with_node_counters(bed, &format!("broadcast of {len} from {root:?}"), || {
        common_runtime::broadcast(&bed.all(), len, root)
    });
    for (i, (a, b)) in bed.stats().iter().zip(before).enumerate() {
        let is_root = match root {
            Participant::Aggregator => i == 0,
            Participant::Worker(r) => i == r as usize + 1,
        };
        if !is_root {
            assert_eq!(a.bytes_delivered - b.bytes_delivered, len as u64, "participant {i}: every byte exactly once");
        }
    }
}

fn scenario(bed: &Bed, label: &str) {
    let t0 = Instant::now();
    let before = bed.stats();
    for len in [1usize, 362, 20_000] {
        broadcast(bed, len * 4, Participant::Aggregator);
        broadcast(bed, len * 4, Participant::Worker(1));
        reduce(bed, Op::Sum, len, false);
        reduce(bed, Op::Sum, len, true);
        reduce(bed, Op::Max, len, true);
    }
    broadcast(bed, 400_000, Participant::Aggregator);
    reduce(bed, Op::Sum, 100_000, true);
    reduce(bed, Op::Sum, 100_000, false);
    let after = bed.stats();
    let d = |i: usize, f: fn(&CommStats) -> u64| f(&after[i]) - f(&before[i]);
    eprintln!(
        "{label}: {:?}; aggregator sent {} data ({} retransmitted), {} acks, received {} acks; workers retransmitted {:?}",
        t0.elapsed(),
        d(0, |s| s.data_sent),
        d(0, |s| s.retransmitted),
        d(0, |s| s.acks_sent),
        d(0, |s| s.acks_received),
        (1..=WORKERS).map(|i| d(i, |s| s.retransmitted)).collect::<Vec<_>>(),
    );
}

#[test]
fn kernel_backend_live_attach_reduce_allreduce_broadcast_under_loss() {
    require_root();
    let bed = Bed::up("loss", |b| b);
    scenario(&bed, "no loss");
    let st = bed.attach.broadcast_counts();
    let out = bed.attach.outcomes();
    eprintln!("TC counters: {st:?}\nXDP outcomes: {out:?}");
    assert!(st[BcastStat::ResultBroadcast.label()] > 0, "RESULTs went through the result group: {st:?}");
    assert!(st[BcastStat::Broadcast.label()] > 0, "broadcasts went through TC egress: {st:?}");
    assert!(out["result"] > 0, "the XDP program reduced: {out:?}");
    for (label, loss) in [("1%", 0.01), ("5%", 0.05)] {
        bed.impair(loss);
        let label = format!("loss {label}");
        bed.under_loss(&label, || scenario(&bed, &label));
    }
    bed.impair(0.0);
}

#[test]
fn kernel_backend_live_attach_burst_and_packet_mode() {
    require_root();
    let bed = Bed::up("burst", |b| b.ack_mode(aggbox::config::AckMode::Packet).window(64));
    bed.impair(0.01);
    bed.under_loss("packet mode, loss 1%", || {
        reduce(&bed, Op::Sum, 20_000, true);
        broadcast(&bed, 80_000, Participant::Aggregator);
    });
    bed.impair(0.0);
    // A 10 % loss window of 300 ms in the middle of a large allreduce: it
    // opens once the call has sent 1000 of its ~8300 contributions (a fixed
    // delay can open it after the call has ended).
    let sent = || bed.stats().iter().map(|s| s.data_sent).sum::<u64>();
    let s0 = sent();
    let done = std::sync::atomic::AtomicBool::new(false);
    bed.under_loss("burst", || {
        std::thread::scope(|s| {
            s.spawn(|| {
                while sent() - s0 < 1000 && !done.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_micros(200));
                }
                bed.impair(0.10);
                std::thread::sleep(Duration::from_millis(300));
                bed.impair(0.0);
            });
            reduce(&bed, Op::Sum, 1_000_000, true);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        })
    });
    reduce(&bed, Op::Sum, 1000, true);
    clamped_float_input_is_an_overflow(&bed);
}

/// The default fixed scale (1e8) clamps worker 0's 30.0 and worker 1's
/// −29.5 while their sum fits: the workers flag those contributions
/// OVERFLOW, the XDP program carries it into the RESULT, so every
/// participant fails instead of returning the sum of the clamped values.
fn clamped_float_input_is_an_overflow(bed: &Bed) {
    let len = 5000;
    let outs = std::thread::scope(|s| {
        let hs: Vec<_> = bed
            .all()
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                s.spawn(move || {
                    let mut x = vec![0.25f32; len];
                    x[len / 2] = match i {
                        1 => 30.0,
                        2 => -29.5,
                        _ => 0.0,
                    };
                    c.allreduce(&mut x, Op::Sum).map(|_| x[len / 2])
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for (i, o) in outs.iter().enumerate() {
        assert!(matches!(o, Err(CommError::Overflow { .. })), "participant {i}: {o:?}");
    }
    // The next call is unaffected.
    reduce(bed, Op::Sum, 1000, true);
}

/// An allreduce of more result fragments than the workers' ACK trackers hold
/// (2763 at MTU 1500, more than 2 groups of 1024) under loss, with slots for
/// all of them: results may run more than 2 groups past a lost one, the
/// tracker then evicts that group, and the aggregator's retransmission of
/// the hole must still be used. (That retransmission was once dropped as a
/// "duplicate" and re-acknowledged, so the aggregator finished while a
/// worker waited for the fragment forever; `aggbox-bench large` at 1 M
/// elements, MTU 1500, where TC clone failures lose result copies, showed it
/// in 2 runs of 3. This loss pattern does not reliably reproduce it; the
/// test keeps the > 2-group path exact under loss.)
#[test]
fn kernel_backend_allreduce_beyond_two_ack_groups_under_loss() {
    require_root();
    // Slots for every fragment, so results can run far past a hole.
    let bed = Bed::up_with("groups", "slots = 4096\n", |b| b);
    bed.impair(0.01);
    bed.under_loss("beyond two ACK groups, loss 1%", || {
        for _ in 0..2 {
            reduce(&bed, Op::Sum, 1_000_000, true);
        }
    });
    bed.impair(0.0);
    reduce(&bed, Op::Sum, 1_000_000, true);
}

/// One vector over two jobs at once (`StripedCommunicator`): the node
/// serves two jobs with a result group each, every participant reduces its
/// two stripes in parallel, and each job's XDP counters show its stripe's
/// share of the contributions and results. Under 1 % loss; int32 SUM and
/// MAX against the reference reducer, reduce to the aggregator, and a float
/// allreduce whose every stripe agrees on its own scale.
#[test]
fn kernel_backend_striped_over_two_jobs_under_loss() {
    require_root();
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
    let workers: Vec<Ipv4Addr> = (1..=WORKERS).map(|h| tb.host(h).addr).collect();
    let list = |f: &dyn Fn(&Ipv4Addr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
    // Stripe t: job JOB + t on JOB_PORT + 2t, results to RESULT_PORT + 2t,
    // copied to group GROUP + t of the workers' DATA_PORT + t.
    let mut text = "[node]\nmetrics = \"off\"\n".to_string();
    for t in 0..2u16 {
        text += &format!(
            "\n[[job]]\nid = {}\nport = {}\nworkers = [{}]\nresult_port = {}\nresult_group = {}\n\n[[group]]\nid = {}\nmembers = [{}]\n",
            JOB + t,
            JOB_PORT + 2 * t,
            list(&|w| format!("\"{w}\"")),
            RESULT_PORT + 2 * t,
            GROUP + t,
            GROUP + t,
            list(&|w| format!("\"{w}:{}\"", DATA_PORT + t)),
        );
    }
    let attach = Attach::start(&tb.host(0).netns, "striped", &text, &[]);
    let config = Config::parse(&text, "runtime_kernel").expect("config");
    let agg_addr = tb.host(0).addr;
    let jobs = [JOB, JOB + 1];
    let tune = |b: CommunicatorBuilder| {
        b.backend(BackendKind::Kernel).deadline(Duration::from_secs(20)).quantization(aggbox::runtime::Quantization::Adaptive)
    };
    let build = |host: usize, me: Participant| {
        tb.in_host(host, || StripedCommunicator::from_config(&config, &jobs, agg_addr, DATA_PORT, me, tune))
            .expect("netns")
            .expect("striped communicator")
    };
    let parts: Vec<StripedCommunicator> =
        std::iter::once(build(0, Participant::Aggregator)).chain((0..WORKERS).map(|r| build(r + 1, Participant::Worker(r as u16)))).collect();
    for c in parts[0].stripes() {
        assert!(c.config().kernel_result_group && c.config().tc_group.is_some(), "job {}: the kernel's result group", c.config().job);
    }
    let refs: Vec<&StripedCommunicator> = parts.iter().collect();
    let run = |op: Op, len: usize, all: bool| common_runtime::int_reduction(&refs, WORKERS, op, len, all);
    let injector = impair::Injector::new();
    let impair = |loss: f64| impair_ports(&tb, &injector, loss);
    let resent = || parts.iter().map(|c| c.stats().retransmitted).sum::<u64>();
    let job_counters = || -> Vec<aggbox::wire::abi::JobStats> {
        let st = attach.status();
        jobs.iter().map(|j| st.jobs.iter().find(|s| s.id == *j).and_then(|s| s.counters).expect("job counters")).collect()
    };
    let before = job_counters();
    run(Op::Sum, 200_000, true);
    let after = job_counters();
    // 200 000 elements at MTU 1500 (362 a datagram): 553 fragments, 276 and 277 a stripe.
    for (t, (a, b)) in after.iter().zip(&before).enumerate() {
        let results = a.results - b.results;
        assert!((276..=277).contains(&results), "job {}: {results} results for its stripe", jobs[t]);
        // `accepted` counts the contributions that did not complete a slot.
        assert_eq!(a.accepted - b.accepted + results, results * WORKERS as u64, "job {}: every rank's contributions", jobs[t]);
    }
    impair(0.01);
    let (c0, r0) = (injector.counts(), resent());
    for len in [1usize, 7, 20_000, 300_000] {
        run(Op::Sum, len, true);
        run(Op::Max, len, true);
        run(Op::Sum, len, false);
    }
    let len = 100_000;
    let xs: Vec<Vec<f32>> = (0..WORKERS).map(|r| (0..len).map(|i| (i as f32 * 0.11 + r as f32).cos() * 2.0).collect()).collect();
    let outs = std::thread::scope(|s| {
        let hs: Vec<_> = parts
            .iter()
            .map(|c| {
                let mut x = match c.participant() {
                    Participant::Worker(r) => xs[r as usize].clone(),
                    Participant::Aggregator => vec![0f32; len],
                };
                s.spawn(move || {
                    c.allreduce(&mut x, Op::Sum).expect("float allreduce");
                    x
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    // Broadcasts over the stripes: from the aggregator (each job's TC group
    // copies) and from a worker (socket path).
    let before = attach.broadcast_counts();
    for (root, len) in [(Participant::Aggregator, 300_001usize), (Participant::Worker(2), 40_000)] {
        common_runtime::broadcast(&refs, len, root);
    }
    let after = attach.broadcast_counts();
    let copies = BcastStat::Broadcast.label();
    assert!(after[copies] > before[copies], "the aggregator's stripes went through TC egress: {after:?}");
    assert_lost_and_resent("striped, loss 1%", injector.counts() - c0, resent() - r0);
    impair(0.0);
    for (p, o) in outs.iter().enumerate() {
        assert_eq!(o, &outs[0], "participant {p} got the same floats");
    }
    for i in 0..len {
        let exact: f64 = xs.iter().map(|x| x[i] as f64).sum();
        assert!((outs[0][i] as f64 - exact).abs() < 1e-6, "{i}: {} vs {exact}", outs[0][i]);
    }
    drop(parts);
    drop(attach);
    tb.down().expect("testbed down");
}
