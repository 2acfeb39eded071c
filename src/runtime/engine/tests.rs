//! Unit tests of the state machine: a job's engines (socket backend, 3
//! workers and the aggregator) wired through a simulated network with a
//! fake clock. Nothing here opens a socket or sleeps: time moves only to
//! the next datagram arrival or the earliest `poll_timeout`, so loss,
//! reordering, duplication and deadlines are exact and repeatable.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::round::{Sink, Src};
use super::{CallOptions, CommConfig, Engine, Participant};
use crate::wire::abi::{self, Op, Round};
use crate::wire::proto::{self, AggHeader, MessageKind};
use crate::runtime::backend::BackendKind;
use crate::runtime::comm::{Communicator, CommunicatorBuilder};
use crate::runtime::outbox::Transmit;
use crate::runtime::transport::{CommStats, Counters};
use crate::runtime::error::{CommError, Peer};

// More scenarios on this simulated network, with the helpers below:
// every collective through loss, reordering, duplication, ACK modes and
// windows (`network`); missed and late calls, overflow flags (`rounds`);
// forged RESULTs and ACKs, the early-result bound (`sources`).
mod network;
mod rounds;
mod sources;

const JOB: u16 = 7;
const WORKERS: u16 = 3;
const AGG_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 100));
const JOB_PORT: u16 = 9000;
/// One-way delay of every datagram.
const LATENCY: Duration = Duration::from_micros(100);
/// MTU 1500: 362 elements per fragment.
const PER: usize = 362;
fn worker_addr(r: u16) -> SocketAddr {
    SocketAddr::new(Ipv4Addr::new(10, 0, 0, 1 + r as u8).into(), 5000)
}

fn agg_addr() -> SocketAddr {
    SocketAddr::new(AGG_IP, JOB_PORT)
}

fn builder(me: Participant) -> CommunicatorBuilder {
    let peers: Vec<SocketAddr> = (0..WORKERS).map(worker_addr).collect();
    Communicator::builder(JOB, peers, AGG_IP, JOB_PORT, me)
        .mtu(1500)
        .deadline(Duration::from_secs(2))
}

/// The socket backend: the aggregator's runtime reduces.
fn socket_config(me: Participant) -> CommConfig {
    builder(me).config().clone()
}

/// The aggregator application's socket with the kernel backend.
const RESULT_PORT: u16 = 9001;

/// The kernel backend with a result group: the node reduces
/// ([`FakeNode`]) and copies each RESULT to every worker.
fn kernel_config(me: Participant) -> CommConfig {
    builder(me)
        .backend(BackendKind::Kernel)
        .result_port(RESULT_PORT)
        .kernel_result_group(true)
        .config()
        .clone()
}

/// One datagram on the simulated wire.
#[derive(Debug, Clone)]
struct Datagram {
    from: SocketAddr,
    to: SocketAddr,
    bytes: Vec<u8>,
    /// Sent as a retransmission.
    resend: bool,
    /// When it was sent.
    at: Instant,
}

impl Datagram {
    fn kind(&self) -> Option<MessageKind> {
        proto::classify(&self.bytes)
    }

    /// The `seq` of a data datagram (`AGG1` contribution or `AGB1`).
    fn seq(&self) -> Option<u32> {
        match self.kind()? {
            MessageKind::Agg => proto::split_agg(&self.bytes).ok().map(|(h, _)| h.seq),
            MessageKind::Bcast => proto::split_bcast(&self.bytes).ok().map(|(h, _)| h.seq),
            _ => None,
        }
    }

    fn is_contribution(&self) -> bool {
        self.kind() == Some(MessageKind::Agg)
            && proto::split_agg(&self.bytes).is_ok_and(|(h, _)| !h.is_result())
    }
}

/// What one engine hands out in one poll.
struct Wire<'a> {
    from: SocketAddr,
    at: Instant,
    sent: &'a mut Vec<Datagram>,
}

impl Transmit for Wire<'_> {
    fn send(&mut self, to: SocketAddr, datagram: &[u8]) {
        self.push(to, datagram, false);
    }

    fn resend(&mut self, to: SocketAddr, datagram: &[u8]) {
        self.push(to, datagram, true);
    }

    fn send_batch(&mut self, datagrams: &[(&[u8], SocketAddr)], _gso: bool) {
        for (b, to) in datagrams {
            self.push(*to, b, false);
        }
    }
}

impl Wire<'_> {
    fn push(&mut self, to: SocketAddr, bytes: &[u8], resend: bool) {
        self.sent.push(Datagram {
            from: self.from,
            to,
            bytes: bytes.to_vec(),
            resend,
            at: self.at,
        });
    }
}

/// What the network does to each datagram sent: deliver it `copies` times
/// (0: lost).
type Fate = Box<dyn FnMut(&Datagram) -> usize>;

/// How much longer than [`LATENCY`] one copy of a datagram takes (later
/// copies are overtaken by earlier ones: reordering).
type Delay = Box<dyn FnMut(&Datagram) -> Duration>;

/// How the round of one participant ended.
#[derive(Debug)]
enum Ended {
    /// A reduction's result (the aggregator; every participant for an
    /// allreduce).
    Values(Vec<i32>),
    /// A reduce worker's contribution was acknowledged.
    Contributed,
    /// A worker's allreduce result, written into the caller's buffer (the
    /// round's sink: floats or ints).
    Written,
    /// A broadcast's bytes.
    Bytes(Vec<u8>),
    Failed(CommError),
}

struct Node {
    addr: SocketAddr,
    engine: Engine,
    counters: Arc<Counters>,
    /// Whether a round is in progress (and of which call).
    running: Option<Call>,
    ended: Option<(Ended, Instant)>,
    /// Whether the result of the last reduction that ended here was flagged
    /// OVERFLOW (clamped).
    overflow: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Reduce,
    Broadcast,
}

/// A job's engines on a simulated network.
struct Sim {
    now: Instant,
    start: Instant,
    nodes: Vec<Node>,
    /// In flight: (arrival, datagram).
    wire: Vec<(Instant, Datagram)>,
    /// Everything sent, in order.
    log: Vec<Datagram>,
    /// The copies `fate` dropped (each datagram sent at most once here: it
    /// is lost when no copy is delivered).
    lost: Vec<Datagram>,
    fate: Fate,
    delay: Delay,
    /// Reverse the order of each poll's datagrams (reordering).
    reverse: bool,
    /// Kernel backend: the node's aggregator at the job port.
    node: Option<FakeNode>,
    /// A root whose node runs the TC broadcast program, and the group's
    /// members in table order.
    tc: Option<(SocketAddr, Vec<SocketAddr>)>,
}

/// The node's XDP aggregator and TC result group as the runtime sees them:
/// each rank's contribution to a (round, fragment) is added once; the
/// RESULT (seq = the contribution seq) goes once to the aggregator's result
/// port, from the completing contribution's source, and once to every
/// worker, from the node's address and that source's port (the TC copies).
/// Contributions to a completed fragment are dropped as duplicates.
#[derive(Default)]
struct FakeNode {
    /// (round, frag_off) -> (ranks that contributed, sum).
    slots: HashMap<(Round, u32), (u64, Vec<i32>)>,
    completed: HashSet<(Round, u32)>,
}

impl FakeNode {
    /// What the node sends for one contribution from `from`.
    fn contribution(
        &mut self,
        from: SocketAddr,
        bytes: &[u8],
    ) -> Vec<(SocketAddr, SocketAddr, Vec<u8>)> {
        let Ok((h, payload)) = proto::split_agg(bytes) else {
            return Vec::new();
        };
        let key = (h.round, h.frag_off);
        if h.is_result() || self.completed.contains(&key) {
            return Vec::new();
        }
        let (ranks, sum) = self
            .slots
            .entry(key)
            .or_insert_with(|| (0, vec![0; h.count as usize]));
        let bit = 1u64 << h.rank;
        if *ranks & bit != 0 {
            return Vec::new();
        }
        *ranks |= bit;
        let mut v = vec![0; h.count as usize];
        proto::read_i32_be(payload, &mut v);
        sum.iter_mut().zip(&v).for_each(|(s, x)| *s += x);
        if *ranks != (1 << WORKERS) - 1 {
            return Vec::new();
        }
        let hdr = AggHeader {
            rank: abi::RESULT_RANK,
            flags: abi::AGG_F_RESULT | (h.flags & abi::AGG_F_LAST_FRAGMENT),
            ..h
        };
        let mut result = Vec::new();
        proto::encode_agg_into(&hdr, sum, &mut result).expect("a RESULT");
        self.completed.insert(key);
        let mut out = vec![(from, SocketAddr::new(AGG_IP, RESULT_PORT), result.clone())];
        let node = SocketAddr::new(AGG_IP, from.port());
        out.extend((0..WORKERS).map(|r| (node, worker_addr(r), result.clone())));
        out
    }
}

impl Sim {
    /// A socket-backend job: workers 0..3 then the aggregator.
    fn new() -> Sim {
        Sim::with(socket_config)
    }

    /// A kernel-backend job with a result group, and its node.
    fn kernel() -> Sim {
        let mut sim = Sim::with(kernel_config);
        sim.node = Some(FakeNode::default());
        sim
    }

    /// A job whose participants have `config(me)`.
    fn with(config: fn(Participant) -> CommConfig) -> Sim {
        let now = Instant::now();
        let mut nodes = Vec::new();
        for (i, me) in (0..WORKERS)
            .map(Participant::Worker)
            .chain([Participant::Aggregator])
            .enumerate()
        {
            let cfg = config(me);
            let addr = cfg.addr_of(cfg.me.index(cfg.workers()));
            let counters = Arc::new(Counters::default());
            // Distinct broadcast sessions per participant, as the driver's
            // random bases are.
            let base = (i as u32 + 1) << 20;
            nodes.push(Node {
                addr,
                engine: Engine::new(cfg, counters.clone(), base, now),
                counters,
                running: None,
                ended: None,
                overflow: false,
            });
        }
        Sim {
            now,
            start: now,
            nodes,
            wire: Vec::new(),
            log: Vec::new(),
            lost: Vec::new(),
            fate: Box::new(|_| 1),
            delay: Box::new(|_| Duration::ZERO),
            reverse: false,
            node: None,
            tc: None,
        }
    }

    /// Puts `d` on the wire (as many times as `fate` says) and in the log.
    /// A datagram through the TC program of the root's node, as it
    /// leaves: one copy per member whose bit is in the mask, addressed to
    /// that member (`fate` applies to each copy).
    fn send(&mut self, d: Datagram) {
        let copies: Vec<Datagram> = match &self.tc {
            Some((root, members)) if d.from == *root && d.kind() == Some(MessageKind::Bcast) => {
                let mask = proto::split_bcast(&d.bytes).map_or(0, |(h, _)| h.mask);
                members
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, &to)| Datagram { to, ..d.clone() })
                    .collect()
            }
            _ => vec![d.clone()],
        };
        for c in copies {
            let n = (self.fate)(&c);
            for _ in 0..n {
                let arrival = self.now + LATENCY + (self.delay)(&c);
                self.wire.push((arrival, c.clone()));
            }
            if n == 0 {
                self.lost.push(c);
            }
        }
        self.log.push(d);
    }

    /// Puts a datagram no engine sent (a forgery, a stranger's) on the wire,
    /// to arrive after [`LATENCY`]; not logged, no `fate`.
    fn inject(&mut self, from: SocketAddr, to: SocketAddr, bytes: Vec<u8>) {
        let d = Datagram {
            from,
            to,
            bytes,
            resend: false,
            at: self.now,
        };
        self.wire.push((self.now + LATENCY, d));
    }

    fn aggregator(&self) -> usize {
        WORKERS as usize
    }

    fn stats(&self, i: usize) -> CommStats {
        self.nodes[i].counters.snapshot()
    }

    /// Starts a SUM reduction (`all`: an allreduce) on participant `i`: a
    /// worker contributes `input(rank)`, the aggregator collects `len`
    /// elements.
    fn start_reduce(&mut self, i: usize, all: bool, len: usize, opts: CallOptions) {
        self.start_reduce_op(i, all, Op::Sum, len, opts);
    }

    /// [`Sim::start_reduce`] with `op`.
    fn start_reduce_op(&mut self, i: usize, all: bool, op: Op, len: usize, opts: CallOptions) {
        let src = if i == WORKERS as usize {
            Src::Len(len)
        } else {
            Src::I32(input(i as u16, len))
        };
        self.start_reduce_from(i, all, op, src, None, opts);
    }

    /// Starts a reduction on participant `i` contributing `src` (the
    /// aggregator: its result vector), a worker's allreduce result going to
    /// `sink` (default: bytes).
    fn start_reduce_from(
        &mut self,
        i: usize,
        all: bool,
        op: Op,
        src: Src,
        sink: Option<Sink>,
        opts: CallOptions,
    ) {
        let now = self.now;
        let n = &mut self.nodes[i];
        n.engine.start_reduce(now, all, op, src, sink, opts);
        n.running = Some(Call::Reduce);
    }

    /// Starts a broadcast from participant `root` on participant `i`.
    fn start_broadcast(&mut self, i: usize, root: usize, data: &[u8], opts: CallOptions) {
        let now = self.now;
        let n = &mut self.nodes[i];
        let buf = if i == root {
            data.to_vec()
        } else {
            vec![0; data.len()]
        };
        n.engine.start_broadcast(now, root, buf, opts);
        n.running = Some(Call::Broadcast);
    }

    /// Polls every engine once at `now`: what they send goes on the wire
    /// (through `fate`), rounds that ended are finished.
    fn poll(&mut self) {
        let now = self.now;
        let mut outgoing = Vec::new();
        for n in &mut self.nodes {
            let mut sent = Vec::new();
            n.engine.poll_transmit(
                now,
                &mut Wire {
                    from: n.addr,
                    at: now,
                    sent: &mut sent,
                },
            );
            if self.reverse {
                sent.reverse();
            }
            outgoing.extend(sent);
            if let Some(call) = n.running {
                if let Some(outcome) = n.engine.round_outcome(now) {
                    let (ended, overflow) = n.engine.finish(call, now, outcome);
                    n.running = None;
                    n.ended = Some((ended, now));
                    n.overflow = overflow;
                    // As the driver does after a call: what its end made
                    // due goes out, and the timers it leaves (a delayed
                    // ACK) are armed.
                    let mut after = Vec::new();
                    n.engine.poll_transmit(
                        now,
                        &mut Wire {
                            from: n.addr,
                            at: now,
                            sent: &mut after,
                        },
                    );
                    outgoing.extend(after);
                }
            }
        }
        for d in outgoing {
            self.send(d);
        }
    }

    /// Moves the clock to the next event (a datagram's arrival or the
    /// earliest timeout) and delivers what arrived by then. False when
    /// nothing is pending.
    fn advance(&mut self) -> bool {
        let next_arrival = self.wire.iter().map(|(t, _)| *t).min();
        let next_timer = self
            .nodes
            .iter()
            .filter_map(|n| n.engine.poll_timeout())
            .min();
        let Some(next) = [next_arrival, next_timer].into_iter().flatten().min() else {
            return false;
        };
        self.now = self.now.max(next);
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.wire)
            .into_iter()
            .partition(|(t, _)| *t <= now);
        self.wire = later;
        for (_, d) in due {
            if let Some(n) = self.nodes.iter_mut().find(|n| n.addr == d.to) {
                n.engine.handle(now, d.from, &d.bytes);
            } else if let Some(node) = self.node.as_mut().filter(|_| d.to == agg_addr()) {
                for (from, to, bytes) in node.contribution(d.from, &d.bytes) {
                    self.send(Datagram {
                        from,
                        to,
                        bytes,
                        resend: false,
                        at: now,
                    });
                }
            }
        }
        true
    }

    /// Runs until every started round ended and the wire is quiet (or
    /// `limit` of fake time passed).
    fn run(&mut self, limit: Duration) {
        self.run_checking(limit, |_| {});
    }

    /// [`Sim::run`], calling `check` after every poll (invariants that
    /// must hold at every instant, e.g. the datagrams in flight).
    fn run_checking(&mut self, limit: Duration, mut check: impl FnMut(&Sim)) {
        loop {
            self.poll();
            check(self);
            let busy = self.nodes.iter().any(|n| n.running.is_some()) || !self.wire.is_empty();
            if !busy || self.now - self.start > limit || !self.advance() {
                return;
            }
        }
    }

    fn ended(&self, i: usize) -> &Ended {
        &self.nodes[i].ended.as_ref().expect("round ended").0
    }

    fn ended_at(&self, i: usize) -> Duration {
        self.nodes[i].ended.as_ref().expect("round ended").1 - self.start
    }
}

impl Engine {
    /// Ends the round of `call` the way the driver does, with what the
    /// caller would get, and whether a reduction's result was flagged
    /// OVERFLOW.
    fn finish(
        &mut self,
        call: Call,
        now: Instant,
        outcome: Result<(), CommError>,
    ) -> (Ended, bool) {
        let failed = outcome.is_err();
        let (ended, overflow) = match call {
            Call::Broadcast => (Ended::Bytes(self.finish_broadcast(now, failed)), false),
            Call::Reduce => {
                let r = self.finish_reduce(now, failed);
                match (r.values, r.sink) {
                    (Some((v, o)), _) => (Ended::Values(v), o),
                    (None, Some((Sink::Bytes(b), o))) => {
                        let mut v = vec![0; b.len() / 4];
                        proto::read_i32_be(&b, &mut v);
                        (Ended::Values(v), o)
                    }
                    (None, Some((_, o))) => (Ended::Written, o),
                    _ => (Ended::Contributed, false),
                }
            }
        };
        match outcome {
            Err(e) => (Ended::Failed(e), overflow),
            Ok(()) => (ended, overflow),
        }
    }
}

/// Rank `r`'s contribution: distinct per rank and element.
fn input(r: u16, len: usize) -> Vec<i32> {
    (0..len as i32).map(|k| k * 10 + r as i32 + 1).collect()
}

fn expected_sum(len: usize) -> Vec<i32> {
    (0..len)
        .map(|k| (0..WORKERS).map(|r| input(r, len)[k]).sum())
        .collect()
}

/// 3 fragments (the last one short).
const LEN: usize = 2 * PER + 100;

fn start_all_allreduce(sim: &mut Sim, len: usize, opts: CallOptions) {
    for i in 0..=WORKERS as usize {
        sim.start_reduce(i, true, len, opts);
    }
}

fn assert_everyone_has_the_sum(sim: &Sim, len: usize) {
    let want = expected_sum(len);
    for i in 0..=WORKERS as usize {
        match sim.ended(i) {
            Ended::Values(v) => assert_eq!(v, &want, "participant {i}"),
            other => panic!("participant {i}: {other:?}"),
        }
    }
}

#[test]
fn allreduce_without_impairment_gives_everyone_the_sum_and_resends_nothing() {
    let mut sim = Sim::new();
    start_all_allreduce(&mut sim, LEN, CallOptions::default());
    sim.run(Duration::from_secs(5));
    assert_everyone_has_the_sum(&sim, LEN);
    assert!(sim.log.iter().all(|d| !d.resend), "nothing was lost");
    let contributions = sim.log.iter().filter(|d| d.is_contribution()).count();
    assert_eq!(
        contributions,
        WORKERS as usize * 3,
        "3 fragments per worker"
    );
    for i in 0..=WORKERS as usize {
        assert_eq!(
            sim.nodes[i].engine.position(),
            (Round(1), 3),
            "round and seq advance"
        );
    }
    // Each worker got each result byte once.
    for r in 0..WORKERS as usize {
        assert_eq!(sim.stats(r).bytes_delivered, LEN as u64 * 4);
    }
}

#[test]
fn a_lost_contribution_is_resent_by_its_worker_and_counted_once() {
    let mut sim = Sim::new();
    // Worker 1's second fragment is lost the first time it is sent.
    let lost = Arc::new(std::sync::Mutex::new(None));
    let lost2 = lost.clone();
    sim.fate = Box::new(move |d| {
        let mine = d.from == worker_addr(1) && d.is_contribution() && !d.resend;
        if mine && proto::split_agg(&d.bytes).is_ok_and(|(h, _)| h.frag_off == PER as u32) {
            *lost2.lock().unwrap() = Some((d.seq(), d.at));
            return 0;
        }
        1
    });
    start_all_allreduce(&mut sim, LEN, CallOptions::default());
    sim.run(Duration::from_secs(5));
    let (seq, sent_at) = lost
        .lock()
        .unwrap()
        .expect("the fragment was sent and dropped");
    assert_everyone_has_the_sum(&sim, LEN);
    let resends: Vec<&Datagram> = sim.log.iter().filter(|d| d.resend).collect();
    assert!(
        resends
            .iter()
            .any(|d| d.from == worker_addr(1) && d.to == agg_addr() && d.seq() == seq),
        "worker 1 resent the lost fragment to the aggregator: {resends:?}"
    );
    assert!(
        resends.iter().all(|d| d.from == worker_addr(1)),
        "only the worker that lost a datagram resends"
    );
    // The resend waited for the ACK that shows the hole, or the timeout;
    // never before the datagram could have been acknowledged.
    let first = resends.iter().map(|d| d.at).min().unwrap();
    assert!(first >= sent_at + 2 * LATENCY, "{:?}", first - sent_at);
}

#[test]
fn a_lost_ack_makes_the_worker_resend_and_the_aggregator_adds_it_once() {
    let mut sim = Sim::new();
    // Every ACK to worker 0 is lost until 30 ms: its contributions time out
    // and are resent; the aggregator must re-acknowledge, not add them again.
    let start = sim.now;
    sim.fate = Box::new(move |d| {
        let ack_to_0 = d.to == worker_addr(0) && d.kind() == Some(MessageKind::Ack);
        usize::from(!(ack_to_0 && d.at < start + Duration::from_millis(30)))
    });
    // A reduce: the workers end when their contributions are acknowledged.
    for i in 0..=WORKERS as usize {
        sim.start_reduce(i, false, LEN, CallOptions::default());
    }
    sim.run(Duration::from_secs(5));
    match sim.ended(sim.aggregator()) {
        Ended::Values(v) => assert_eq!(v, &expected_sum(LEN), "each contribution added once"),
        other => panic!("aggregator: {other:?}"),
    }
    for r in 0..WORKERS as usize {
        assert!(matches!(sim.ended(r), Ended::Contributed), "worker {r}");
    }
    let done = sim.ended_at(0);
    assert!(
        done >= Duration::from_millis(30),
        "worker 0 waited for an ACK: {done:?}"
    );
    assert!(
        sim.ended_at(1) < Duration::from_millis(5),
        "worker 1 did not wait"
    );
    let resent = sim
        .log
        .iter()
        .filter(|d| d.resend && d.from == worker_addr(0))
        .count();
    assert!(resent > 0, "worker 0 resent what was not acknowledged");
    assert!(
        sim.log
            .iter()
            .all(|d| !d.resend || d.from == worker_addr(0)),
        "only worker 0 resends"
    );
}

#[test]
fn reordered_and_duplicated_datagrams_are_delivered_once() {
    let mut sim = Sim::new();
    sim.reverse = true;
    sim.fate = Box::new(|_| 2);
    start_all_allreduce(&mut sim, LEN, CallOptions::default());
    sim.run(Duration::from_secs(5));
    assert_everyone_has_the_sum(&sim, LEN);
    for r in 0..WORKERS as usize {
        let s = sim.stats(r);
        assert_eq!(
            s.bytes_delivered,
            LEN as u64 * 4,
            "worker {r}: each result fragment delivered once"
        );
        assert!(s.duplicates_received >= 3, "worker {r}: {s:?}");
    }
}

#[test]
fn a_silent_rank_times_out_at_the_deadline_and_is_named() {
    let mut sim = Sim::new();
    let deadline = Duration::from_millis(500);
    let opts = CallOptions {
        deadline: Some(deadline),
        partial: true,
    };
    // Rank 2 never calls.
    for i in [0, 1, WORKERS as usize] {
        sim.start_reduce(i, true, LEN, opts);
    }
    sim.run(Duration::from_secs(5));
    let agg = sim.aggregator();
    let Ended::Failed(e) = sim.ended(agg) else {
        panic!("the aggregator's call fails: {:?}", sim.ended(agg));
    };
    let t = e.timeout().expect("a timeout");
    assert_eq!(t.missing, vec![Peer::Rank(2)]);
    assert!(t.missing_known);
    assert_eq!((t.arrived, t.expected), (0, 3));
    let p = t.partial.as_ref().expect("partial result asked for");
    let others: Vec<i32> = (0..LEN)
        .map(|k| input(0, LEN)[k] + input(1, LEN)[k])
        .collect();
    assert_eq!(
        p.values, others,
        "the partial sum is the others' contributions"
    );
    assert_eq!(p.contributors, vec![2, 2, 2]);
    // Exactly at the deadline, on the fake clock.
    assert_eq!(sim.ended_at(agg), deadline);
    for r in [0, 1] {
        let Ended::Failed(e) = sim.ended(r) else {
            panic!("worker {r}: {:?}", sim.ended(r));
        };
        let t = e.timeout().expect("a timeout");
        assert_eq!(
            t.missing,
            vec![Peer::Aggregator],
            "worker {r} waits for the result"
        );
        assert_eq!(sim.ended_at(r), deadline);
    }
    // The round advanced everywhere it ran, so the next call lines up.
    assert_eq!(sim.nodes[agg].engine.position().0, Round(1));
}

#[test]
fn a_broadcast_fragment_lost_to_one_receiver_is_resent_to_it_alone() {
    let mut sim = Sim::new();
    let data: Vec<u8> = (0..5000u32).map(|k| (k * 7 % 251) as u8).collect();
    // The first copy of worker 0's first fragment to worker 2 is lost.
    let mut lost = false;
    sim.fate = Box::new(move |d| {
        if !lost && !d.resend && d.from == worker_addr(0) && d.to == worker_addr(2) {
            lost = true;
            return 0;
        }
        1
    });
    for i in 0..=WORKERS as usize {
        sim.start_broadcast(i, 0, &data, CallOptions::default());
    }
    sim.run(Duration::from_secs(5));
    for i in 1..=WORKERS as usize {
        match sim.ended(i) {
            Ended::Bytes(b) => assert_eq!(b, &data, "participant {i}"),
            other => panic!("participant {i}: {other:?}"),
        }
    }
    assert!(
        matches!(sim.ended(0), Ended::Bytes(_)),
        "the root ends once all ACKed"
    );
    let resends: Vec<&Datagram> = sim.log.iter().filter(|d| d.resend).collect();
    assert!(!resends.is_empty(), "the lost fragment was resent");
    assert!(
        resends
            .iter()
            .all(|d| d.from == worker_addr(0) && d.to == worker_addr(2)),
        "only to the receiver that missed it: {resends:?}"
    );
    let first = sim
        .log
        .iter()
        .find(|d| d.from == worker_addr(0) && d.to == worker_addr(2))
        .and_then(Datagram::seq);
    assert!(resends.iter().any(|d| d.seq() == first));
    assert_eq!(sim.stats(2).bytes_delivered, data.len() as u64);
}

#[test]
fn early_broadcast_data_of_the_next_round_is_kept_until_it_starts() {
    let mut sim = Sim::new();
    let data = vec![9u8; 3000];
    // Only the root and worker 1 start now; worker 2 and the aggregator
    // start 50 ms later (their datagrams arrive before their calls).
    for i in [0, 1] {
        sim.start_broadcast(i, 0, &data, CallOptions::default());
    }
    let late = sim.now + Duration::from_millis(50);
    let mut started = false;
    for _ in 0..100_000 {
        sim.poll();
        if !started && sim.now >= late {
            for i in [2, WORKERS as usize] {
                sim.start_broadcast(i, 0, &data, CallOptions::default());
            }
            started = true;
            continue;
        }
        if started && sim.nodes.iter().all(|n| n.running.is_none()) {
            break;
        }
        if !sim.advance() {
            assert!(!started, "a round is stuck");
            sim.now = late;
        }
    }
    assert!(
        sim.ended_at(0) < Duration::from_millis(5),
        "the root's data was acknowledged before the receivers called"
    );
    assert_eq!(
        sim.ended_at(2),
        Duration::from_millis(50),
        "complete at the call"
    );
    for i in 1..=WORKERS as usize {
        match sim.ended(i) {
            Ended::Bytes(b) => assert_eq!(b, &data, "participant {i}"),
            other => panic!("participant {i}: {other:?}"),
        }
    }
    assert!(
        sim.log.iter().all(|d| !d.resend),
        "stashed data was acknowledged on arrival: nothing resent"
    );
}

#[test]
fn in_kernel_allreduce_resends_a_lost_result_copy_to_that_worker_alone() {
    let mut sim = Sim::kernel();
    // The node's copy of the second fragment's RESULT to worker 2 is lost.
    let node_to_2 = SocketAddr::new(AGG_IP, 5000);
    sim.fate = Box::new(move |d| {
        let lost = d.from == node_to_2
            && d.to == worker_addr(2)
            && proto::split_agg(&d.bytes).is_ok_and(|(h, _)| h.frag_off == PER as u32);
        usize::from(!lost)
    });
    start_all_allreduce(&mut sim, LEN, CallOptions::default());
    sim.run(Duration::from_secs(5));
    assert_everyone_has_the_sum(&sim, LEN);
    let resends: Vec<&Datagram> = sim.log.iter().filter(|d| d.resend).collect();
    assert!(!resends.is_empty(), "the lost RESULT was resent");
    let from_agg = SocketAddr::new(AGG_IP, RESULT_PORT);
    for d in &resends {
        assert_eq!((d.from, d.to), (from_agg, worker_addr(2)), "{resends:?}");
        let (h, _) = proto::split_agg(&d.bytes).expect("an AGG1 RESULT");
        assert!(h.is_result());
        assert_eq!(h.frag_off, PER as u32, "only the lost fragment");
    }
    assert_eq!(sim.stats(2).bytes_delivered, LEN as u64 * 4);
    // Nothing the workers sent was resent: the RESULTs acknowledged it.
    assert!(sim
        .log
        .iter()
        .filter(|d| d.is_contribution())
        .all(|d| !d.resend));
}

/// The TC broadcast group of the aggregator's node: the workers.
const TC_GROUP: u16 = 40;

/// The kernel backend where the aggregator's node runs the TC broadcast
/// program with the workers as its group (`from_config` sets this up).
fn tc_config(me: Participant) -> CommConfig {
    let b = builder(me)
        .backend(BackendKind::Kernel)
        .result_port(RESULT_PORT);
    match me {
        Participant::Aggregator => {
            b.tc_broadcast(TC_GROUP, (0..WORKERS).map(worker_addr))
        }
        Participant::Worker(_) => b,
    }
    .config()
    .clone()
}

#[test]
fn a_tc_broadcast_copy_lost_to_one_member_is_resent_with_that_members_bit_alone() {
    let mut sim = Sim::with(tc_config);
    let root = SocketAddr::new(AGG_IP, RESULT_PORT);
    sim.tc = Some((root, (0..WORKERS).map(worker_addr).collect()));
    // The TC copy of the first fragment to worker 1 is lost.
    let mut lost = false;
    sim.fate = Box::new(move |d| {
        if !lost && !d.resend && d.from == root && d.to == worker_addr(1) {
            lost = true;
            return 0;
        }
        1
    });
    let data: Vec<u8> = (0..4000u32).map(|k| (k % 253) as u8).collect();
    let agg = sim.aggregator();
    for i in 0..=WORKERS as usize {
        sim.start_broadcast(i, agg, &data, CallOptions::default());
    }
    sim.run(Duration::from_secs(5));
    for r in 0..WORKERS as usize {
        match sim.ended(r) {
            Ended::Bytes(b) => assert_eq!(b, &data, "worker {r}"),
            other => panic!("worker {r}: {other:?}"),
        }
    }
    assert!(matches!(sim.ended(agg), Ended::Bytes(_)));
    // One datagram per fragment, to the first member, with every member's
    // bit; the resend goes the same way with worker 1's bit alone.
    let sent: Vec<&Datagram> = sim.log.iter().filter(|d| d.from == root).collect();
    let masks = |resend: bool| -> Vec<u32> {
        sent.iter()
            .filter(|d| d.resend == resend)
            .map(|d| {
                assert_eq!(d.to, worker_addr(0), "to the group's first member");
                let (h, _) = proto::split_bcast(&d.bytes).expect("an AGB1");
                assert_eq!(h.group, TC_GROUP);
                h.mask
            })
            .collect()
    };
    assert_eq!(masks(false), vec![0b111; 3], "3 fragments, all members");
    let resent = masks(true);
    assert!(!resent.is_empty(), "the lost copy was resent");
    assert!(resent.iter().all(|&m| m == 0b010), "{resent:?}");
}

/// A node-served job (`consumer = "node"`): the workers' engines as
/// [`kernel_config`]'s, the node's result service taking the RESULTs (its
/// retirement of round r by round r+1's RESULT is `node::serve`'s test).
fn served_config(me: Participant) -> CommConfig {
    let mut cfg = kernel_config(me);
    cfg.node_served = true;
    cfg
}

/// The `AGK1`s worker `r` sent (kind aggregation): the seqs of each.
fn result_acks_of(sim: &Sim, r: u16) -> Vec<Vec<u32>> {
    sim.log
        .iter()
        .filter(|d| d.from == worker_addr(r) && d.kind() == Some(MessageKind::Ack))
        .filter_map(|d| proto::AckMessage::decode(&d.bytes).ok())
        .filter(|a| a.kind == proto::AckKind::Aggregation)
        .map(|a| a.bitmap.received().collect())
        .collect()
}

/// One-element allreduce calls on the workers only, one after the other.
fn served_calls(sim: &mut Sim, calls: usize) {
    for _ in 0..calls {
        for w in 0..WORKERS as usize {
            sim.start_reduce(w, true, 1, CallOptions::default());
        }
        sim.run(Duration::from_secs(5));
        for w in 0..WORKERS as usize {
            assert!(
                matches!(sim.ended(w), Ended::Values(_)),
                "worker {w}: {:?}",
                sim.ended(w)
            );
        }
    }
}

/// Lets the fake clock run `span` past now, polling at every timer.
fn idle_for(sim: &mut Sim, span: Duration) {
    let until = sim.now + span;
    while sim.now < until {
        let next = sim
            .nodes
            .iter()
            .filter_map(|n| n.engine.poll_timeout())
            .min();
        sim.now = next.map_or(until, |t| t.min(until)).max(sim.now);
        sim.poll();
        while !sim.wire.is_empty() && sim.advance() {
            sim.poll();
        }
        if next.is_none() {
            break;
        }
    }
}

#[test]
fn node_served_workers_acknowledge_results_only_once_no_next_call_follows() {
    let mut sim = Sim::with(served_config);
    sim.node = Some(FakeNode::default());
    let delay = sim.nodes[0].engine.cfg.reliability.ack_delay;
    // Calls back to back (each takes 2 × LATENCY, less than the delay):
    // the next call's RESULT tells the node what an ACK would, so none.
    served_calls(&mut sim, 5);
    for r in 0..WORKERS {
        assert_eq!(
            result_acks_of(&sim, r),
            Vec::<Vec<u32>>::new(),
            "worker {r}: no ACK during the calls"
        );
    }
    let seqs: Vec<u32> = sim
        .log
        .iter()
        .filter(|d| d.from == worker_addr(0) && d.is_contribution())
        .filter_map(|d| d.seq())
        .collect();
    assert_eq!(seqs.len(), 5);
    // Idle: one ACK of every RESULT, ack_delay after the last.
    idle_for(&mut sim, delay * 3);
    for r in 0..WORKERS {
        assert_eq!(
            result_acks_of(&sim, r),
            vec![seqs.clone()],
            "worker {r}: one ACK once idle"
        );
        // 5 contributions and 1 ACK for 5 calls (16 datagrams a call on
        // the wire before: an ACK from every worker, and one to it).
        // (The node's RESULT keeps the completing contribution's source.)
        let sent = sim
            .log
            .iter()
            .filter(|d| d.from == worker_addr(r))
            .filter(|d| !proto::split_agg(&d.bytes).is_ok_and(|(h, _)| h.is_result()))
            .count();
        assert_eq!(sent, 6, "worker {r}: 5 contributions and 1 ACK");
    }
}

#[test]
fn node_served_a_lost_deferred_ack_is_repaired_by_the_services_resend_and_close_flushes_it() {
    let mut sim = Sim::with(served_config);
    sim.node = Some(FakeNode::default());
    let delay = sim.nodes[0].engine.cfg.reliability.ack_delay;
    // Worker 1's (deferred) ACK is lost.
    sim.fate = Box::new(|d| {
        usize::from(!(d.from == worker_addr(1) && d.kind() == Some(MessageKind::Ack)))
    });
    served_calls(&mut sim, 2);
    idle_for(&mut sim, delay * 3);
    assert_eq!(result_acks_of(&sim, 1).len(), 1, "sent (and lost)");
    // The node's service resends the RESULT it holds to worker 1 (a copy
    // of the one the TC program brought): acknowledged at once, not after
    // another delay.
    let copy = sim
        .log
        .iter()
        .rev()
        .find(|d| {
            d.to == worker_addr(1) && proto::split_agg(&d.bytes).is_ok_and(|(h, _)| h.is_result())
        })
        .expect("worker 1's RESULT copy")
        .clone();
    sim.fate = Box::new(|_| 1);
    sim.inject(copy.from, worker_addr(1), copy.bytes.clone());
    let at = sim.now;
    sim.advance();
    sim.poll();
    let acks = result_acks_of(&sim, 1);
    assert_eq!(acks.len(), 2, "the resend is acknowledged: {acks:?}");
    assert!(acks[1].contains(&copy.seq().expect("seq")));
    assert!(sim.now - at <= LATENCY, "at once");
    // A worker that closes sends its deferred ACK then, whatever it waited.
    served_calls(&mut sim, 1);
    let before = result_acks_of(&sim, 2).len();
    let mut sent = Vec::new();
    let (now, addr) = (sim.now, worker_addr(2));
    sim.nodes[2].engine.flush_acks(&mut Wire {
        from: addr,
        at: now,
        sent: &mut sent,
    });
    assert_eq!(sent.len(), 1, "the deferred ACK at close");
    assert_eq!(sent[0].kind(), Some(MessageKind::Ack));
    assert_eq!(result_acks_of(&sim, 2).len(), before, "not before close");
}

/// The broadcast `AGK1`s worker `r` sent: when each left.
fn broadcast_acks_of(sim: &Sim, r: u16) -> Vec<Duration> {
    sim.log
        .iter()
        .filter(|d| d.from == worker_addr(r) && d.kind() == Some(MessageKind::Ack))
        .filter(|d| {
            proto::AckMessage::decode(&d.bytes).is_ok_and(|a| a.kind == proto::AckKind::Broadcast)
        })
        .map(|d| d.at - sim.start)
        .collect()
}

/// A node-served job's broadcast from worker 0 whose receivers (workers 1
/// and 2) call only `late` after it started (their data may arrive first);
/// runs until every call ended.
fn broadcast_before_the_receivers_call(data: &[u8], late: Duration) -> Sim {
    let mut sim = Sim::with(served_config);
    sim.start_broadcast(0, 0, data, CallOptions::default());
    let late = sim.now + late;
    let mut started = false;
    for _ in 0..100_000 {
        sim.poll();
        if !started && sim.now >= late {
            for w in 1..WORKERS as usize {
                sim.start_broadcast(w, 0, data, CallOptions::default());
            }
            started = true;
            continue;
        }
        if started && sim.nodes.iter().all(|n| n.running.is_none()) {
            break;
        }
        let next = sim
            .wire
            .iter()
            .map(|(t, _)| *t)
            .chain(sim.nodes.iter().filter_map(|n| n.engine.poll_timeout()))
            .min();
        if !started && next.is_none_or(|t| t > late) {
            // Nothing happens before the receivers call.
            sim.now = late;
            continue;
        }
        assert!(sim.advance(), "a round is stuck");
    }
    for w in 1..WORKERS as usize {
        match sim.ended(w) {
            Ended::Bytes(b) => assert_eq!(b, data, "worker {w}"),
            other => panic!("worker {w}: {other:?}"),
        }
    }
    sim
}

/// A broadcast that arrives before its receivers call (each rank of an MPI
/// program enters `MPI_Bcast` when it gets there, the root first) is
/// acknowledged when their calls take it, one ACK per receiver, not
/// `ack_delay` after it arrived: no arrival inside the call ends the
/// message (it completes when the call takes the kept data), so before,
/// the group's delayed ACK was the only one and the root's call of a
/// broadcast that arrived whole took `ack_delay` (1 ms; issue #42, item 2).
#[test]
fn a_broadcast_that_arrives_before_the_receivers_call_is_acknowledged_when_they_call() {
    let delay = served_config(Participant::Worker(0)).reliability.ack_delay;
    // The receivers call after their data arrived (at LATENCY), well
    // before its delayed ACK would be due.
    let late = 3 * LATENCY;
    assert!(late + LATENCY < delay);
    // 1 int32, 362 (one full datagram) and 2242 (7 datagrams).
    for len in [4usize, 4 * PER, 4 * 2242] {
        let data: Vec<u8> = (0..len as u32).map(|k| (k * 13 % 251) as u8).collect();
        let sim = broadcast_before_the_receivers_call(&data, late);
        assert_eq!(
            sim.ended_at(0),
            late + LATENCY,
            "{len} B: the root's call ends when the receivers' calls' ACKs come back"
        );
        for w in 1..WORKERS {
            assert_eq!(
                broadcast_acks_of(&sim, w),
                vec![late],
                "{len} B: worker {w} acknowledges the whole message once, at its call"
            );
            assert_eq!(sim.ended_at(w as usize), late, "{len} B: worker {w} completes at its call");
        }
        assert!(sim.log.iter().all(|d| !d.resend), "{len} B: nothing resent");
    }
}
