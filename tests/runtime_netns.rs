//! Runtime over a netns testbed with loss, bursts, reordering and duplication
//! (a random-drop / duplicate cls_bpf program on the switch namespace's
//! ports, since this kernel has no netem), socket backend: every receiver
//! gets every byte exactly once and in order, every reduction equals the
//! reference reducer's, within a bounded time. Also a peer killed mid-call.
//!
//! Every impaired phase asserts that the injector really dropped /
//! duplicated datagrams (its counters) and, where it dropped, that the
//! runtime really retransmitted (`CommStats::retransmitted`); an injector
//! that fails to attach fails the test.
//!
//! Needs root: fails (never skips) otherwise. Host 0 is the aggregator,
//! hosts 1..=3 are workers 0..=2.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod common_runtime;

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use aggbox::wire::abi::Op;
use aggbox::runtime::{CallOptions, CommError, CommStats, Communicator, CommunicatorBuilder, Participant, Peer};
use crate::testbed::{Testbed, TestbedConfig};
use aggbox::node::tools::pattern_vector;

const WORKERS: usize = 3;
const JOB_PORT: u16 = 7400;
const DATA_PORT: u16 = 7500;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the netns runtime tests need root (network namespaces, cls_bpf): \
         run them with sudo: `sudo -E cargo test --test runtime_netns`"
    );
}

struct Bed {
    injector: impair::Injector,
    tb: Testbed,
    agg: Option<Communicator>,
    workers: Vec<Option<Communicator>>,
}

impl Bed {
    fn up(tweak: fn(CommunicatorBuilder) -> CommunicatorBuilder) -> Bed {
        let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
        let mut bed = Bed { injector: impair::Injector::new(), tb, agg: None, workers: Vec::new() };
        let agg = bed.build(Participant::Aggregator, tweak, None);
        bed.agg = Some(agg);
        for r in 0..WORKERS {
            let w = bed.build(Participant::Worker(r as u16), tweak, None);
            bed.workers.push(Some(w));
        }
        bed
    }

    fn peers(&self) -> Vec<SocketAddrV4> {
        (1..=WORKERS).map(|h| SocketAddrV4::new(self.tb.host(h).addr, DATA_PORT)).collect()
    }

    fn build(&self, me: Participant, tweak: fn(CommunicatorBuilder) -> CommunicatorBuilder, resume: Option<(aggbox::wire::abi::Round, u32)>) -> Communicator {
        let host = match me {
            Participant::Aggregator => 0,
            Participant::Worker(r) => r as usize + 1,
        };
        let mut b = Communicator::builder(1, self.peers(), self.tb.host(0).addr, JOB_PORT, me).deadline(Duration::from_secs(20));
        if let Some((round, seq)) = resume {
            b = b.resume(round, seq);
        }
        let b = tweak(b);
        self.tb.in_host(host, move || b.build()).expect("netns").expect("build")
    }

    fn all(&self) -> Vec<&Communicator> {
        std::iter::once(self.agg.as_ref().unwrap()).chain(self.workers.iter().flatten()).collect()
    }

    /// Random loss and duplication on every switch port's egress (netem is
    /// not built into this kernel; cls_bpf is): `loss` and `dup` are
    /// probabilities per datagram in [0, 0.5).
    fn impair(&self, loss: f64, dup: f64) {
        for i in 0..=WORKERS {
            let port = self.tb.switch_port(i);
            let injector = &self.injector;
            self.tb_switch(move || injector.set(&port, loss, dup).unwrap_or_else(|e| panic!("{e:#}")));
        }
    }

    /// Every participant's counters added up (the dead rank's are gone).
    fn stats(&self) -> CommStats {
        self.all().iter().map(|c| c.stats()).fold(CommStats::default(), |a, b| a + b)
    }

    /// Runs `f` and returns what the injectors and the runtime did meanwhile:
    /// (injector counts, retransmitted, duplicates received).
    fn measure(&self, f: impl FnOnce()) -> (impair::Counts, u64, u64) {
        let (c0, s0) = (self.injector.counts(), self.stats());
        f();
        let (c1, s1) = (self.injector.counts(), self.stats());
        (c1 - c0, s1.retransmitted - s0.retransmitted, s1.duplicates_received - s0.duplicates_received)
    }

    /// [`scenario`] under the current impairment, repeated (at most 50
    /// times, each some 30 ms) until `hit` holds for what the injectors and the runtime did
    /// over all repetitions: a scenario is only some 100–700 skbs through
    /// the injectors (a UDP GSO batch crosses the switch as one), so at low
    /// rates one scenario may lose or duplicate nothing. Returns the totals.
    fn scenario_until(&self, label: &str, hit: impl Fn(&impair::Counts, u64, u64) -> bool) -> (impair::Counts, u64, u64) {
        let (mut c, mut retx, mut dups, mut reps) = (impair::Counts::default(), 0, 0, 0);
        while reps < 50 && (reps == 0 || !hit(&c, retx, dups)) {
            let t0 = Instant::now();
            let (dc, dr, dd) = self.measure(|| scenario(self, label));
            assert!(t0.elapsed() < Duration::from_secs(25), "{label}: {:?}", t0.elapsed());
            (c, retx, dups, reps) = (c + dc, retx + dr, dups + dd, reps + 1);
        }
        eprintln!("{label}: {reps} scenario(s), injector {c:?}, retransmitted {retx}, duplicates received {dups}");
        (c, retx, dups)
    }

    fn clear(&self) {
        self.impair(0.0, 0.0);
    }

    fn tb_switch(&self, f: impl FnOnce() + Send) {
        crate::testbed::in_netns(&self.tb.switch_netns(), f).expect("switch netns");
    }
}

#[path = "../src/testing/impair/mod.rs"]
mod impair;

fn allreduce(bed: &Bed, len: usize, all: bool) {
    common_runtime::int_reduction(&bed.all(), WORKERS, Op::Sum, len, all);
}

fn broadcast(bed: &Bed, len: usize, root: Participant) {
    common_runtime::broadcast(&bed.all(), len, root);
}

fn scenario(bed: &Bed, label: &str) {
    let t0 = Instant::now();
    for len in [1usize, 362, 20_000] {
        broadcast(bed, len * 4, Participant::Worker(0));
        allreduce(bed, len, false);
        allreduce(bed, len, true);
    }
    broadcast(bed, 300_000, Participant::Aggregator);
    allreduce(bed, 100_000, true);
    eprintln!("{label}: {:?}", t0.elapsed());
}

#[test]
fn runtime_netns_random_loss() {
    require_root();
    let bed = Bed::up(|b| b);
    scenario(&bed, "no loss");
    // Each level repeats the scenario until the loss has hit something the
    // runtime had to resend (0.01 % lost nothing in 20 scenarios, 0.1 %
    // loses one skb in ~3 scenarios).
    for (label, loss) in [("0.1%", 0.001), ("1%", 0.01), ("5%", 0.05)] {
        bed.impair(loss, 0.0);
        let label = format!("loss {label}");
        let (c, retx, _) = bed.scenario_until(&label, |c, retx, _| c.dropped > 0 && retx > 0);
        assert!(c.dropped > 0, "{label}: the injector dropped nothing ({c:?})");
        assert!(retx > 0, "{label}: {} dropped, nothing retransmitted", c.dropped);
    }
    bed.clear();
    let (c, _, _) = bed.measure(|| allreduce(&bed, 20_000, true));
    assert_eq!(c, impair::Counts::default(), "cleared: no injector left");
}

#[test]
fn runtime_netns_burst_loss() {
    require_root();
    let bed = Bed::up(|b| b);
    // A 10 % loss window of 300 ms in the middle of a large allreduce: it
    // opens once the call has sent 1000 of its ~8300 data datagrams (a
    // fixed delay once opened it after a 400 k allreduce had ended).
    let sent = || bed.stats().data_sent;
    let s0 = sent();
    let done = std::sync::atomic::AtomicBool::new(false);
    let (c, retx, _) = bed.measure(|| {
        std::thread::scope(|s| {
            s.spawn(|| {
                while sent() - s0 < 1000 && !done.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_micros(200));
                }
                bed.impair(0.10, 0.0);
                std::thread::sleep(Duration::from_millis(300));
                bed.clear();
            });
            allreduce(&bed, 1_000_000, true);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        })
    });
    eprintln!("burst: injector {c:?}, retransmitted {retx}");
    assert!(c.dropped > 0, "the burst dropped nothing ({c:?}): the allreduce ended before it");
    assert!(retx > 0, "{} dropped in the burst, nothing retransmitted", c.dropped);
    allreduce(&bed, 1000, true);
    bed.clear();
}

#[test]
fn runtime_netns_duplicate() {
    require_root();
    let bed = Bed::up(|b| b);
    bed.impair(0.0, 0.05);
    let (c, _, dups) = bed.scenario_until("duplicate 5%", |c, _, dups| c.duplicated > 0 && dups > 0);
    assert!(c.duplicated > 0 && c.dropped == 0, "{c:?}");
    assert!(dups > 0, "{} duplicated, none reached the receivers' dedup", c.duplicated);
    bed.impair(0.02, 0.10);
    let (c, retx, dups) =
        bed.scenario_until("loss 2% + duplicate 10%", |c, retx, dups| c.dropped > 0 && c.duplicated > 0 && retx > 0 && dups > 0);
    assert!(c.dropped > 0 && c.duplicated > 0, "{c:?}");
    assert!(retx > 0 && dups > 0, "retransmitted {retx}, duplicates received {dups}");
    bed.clear();
}

#[test]
fn runtime_netns_packet_mode_loss() {
    require_root();
    let bed = Bed::up(|b| b.ack_mode(aggbox::config::AckMode::Packet).window(64));
    bed.impair(0.01, 0.0);
    let (c, retx, _) = bed.scenario_until("packet mode, loss 1%", |c, retx, _| c.dropped > 0 && retx > 0);
    assert!(c.dropped > 0, "{c:?}");
    assert!(retx > 0, "{} dropped, nothing retransmitted", c.dropped);
    bed.clear();
}

#[test]
fn runtime_netns_peer_killed_mid_call() {
    require_root();
    let mut bed = Bed::up(|b| b);
    allreduce(&bed, 1000, true);
    // Large enough that rank 2 cannot have sent all of it when it dies 15 ms
    // in (11 k datagrams at MTU 1500, 43 windows of 256): with 400 k
    // elements (1105 datagrams) it once finished in time and the call
    // rightly succeeded.
    let len = 4_000_000;
    let opts = CallOptions { deadline: Some(Duration::from_secs(2)), partial: false };
    let t0 = Instant::now();
    let victim = bed.workers[2].take().unwrap();
    let results = std::thread::scope(|s| {
        // Rank 2 starts the call, then dies (its communicator and socket go away).
        s.spawn(move || {
            let w = victim.ireduce_i32(pattern_vector(2, len as u32), Op::Sum, true, opts);
            std::thread::sleep(Duration::from_millis(15));
            drop(victim);
            let r = w.wait();
            assert!(matches!(r, Err(CommError::Closed)) || r.is_ok(), "{r:?}");
        });
        let hs: Vec<_> = bed
            .all()
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let v = match c.rank() {
                        Some(r) => pattern_vector(r, len as u32),
                        None => vec![0; len],
                    };
                    (c.participant(), c.ireduce_i32(v, Op::Sum, true, opts).wait())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for (p, r) in results {
        let e = r.expect_err("a dead rank cannot make the call succeed");
        eprintln!("{p:?}: {e}");
        let t = e.timeout().expect("timeout error");
        match p {
            Participant::Aggregator => assert!(t.missing.contains(&Peer::Rank(2)), "{e}"),
            Participant::Worker(_) => assert_eq!(t.missing, vec![Peer::Aggregator], "{e}"),
        }
    }
    // Replace rank 2 at the survivors' position; the next calls work.
    let pos = bed.workers[0].as_ref().unwrap().position();
    let w2 = bed.build(Participant::Worker(2), |b| b, Some(pos));
    bed.workers[2] = Some(w2);
    allreduce(&bed, 5000, true);
    broadcast(&bed, 10_000, Participant::Worker(2));
}
