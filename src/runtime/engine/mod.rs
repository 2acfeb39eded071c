//! The communicator's state machine: everything a participant does for its
//! collectives, with no socket and no clock (as quinn-proto's
//! `Connection`). The I/O driver ([`crate::runtime::driver`]) owns the
//! socket and the clock and drives it:
//!
//! - [`Engine::handle`]`(now, from, datagram)` for every datagram that
//!   arrives;
//! - [`Engine::poll_transmit`]`(now, tx)` hands what is due to a
//!   [`Transmit`]: queued ACKs and retransmissions, new data the send
//!   windows allow, what the timers fire;
//! - [`Engine::poll_timeout`] says when to poll again at the latest;
//! - a call is one *round*: `start_broadcast` / `start_reduce`, then
//!   [`Engine::round_outcome`] after each poll until it is `Some`, then
//!   `finish_broadcast` / `finish_reduce` ([`round`]). The sequences of
//!   rounds a call makes (a float reduction's scale agreement and rerun)
//!   are in [`crate::runtime::calls`].
//!
//! The unit tests (`tests.rs`, more scenarios in `tests/`) drive several
//! engines through a simulated network with a fake clock.
//!
//! One concern per file:
//! - [`config`]: what the engine is configured with (the participant, the
//!   communicator's configuration, a call's options), re-exported by the
//!   public API;
//! - [`raw`]: the caller's slice lent to the engine for a call;
//! - [`round`]: a round's state, its start and end, and when it is complete;
//! - [`pump`]: new data (contribution fragments, broadcast fragments,
//!   forwarded results) within the send windows;
//! - [`deliver`]: what arrives into the round (broadcast fragments, a
//!   worker's results, the aggregator's completed fragments);
//! - [`diagnosis`]: the error of a round past its deadline (who is missing);
//! - [`dispatch`]: what arrives, by message kind, and who may send what;
//! - [`tc_route`]: broadcasts through the node's TC program;
//! - this file: the engine's state, the poll API and the timers.

mod config;
mod deliver;
mod diagnosis;
mod dispatch;
mod pump;
mod raw;
pub(crate) mod round;
mod tc_route;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::wire::abi::{self, Op, Round};
use crate::wire::proto::{self, AckKind};
use crate::runtime::backend::{AckIo, Backend, BackendKind};
use crate::runtime::fragment::{byte_window, kernel_window, Coverage};
use crate::runtime::kernel::KernelAggregator;
use crate::runtime::outbox::{Outbox, Transmit};
use crate::runtime::quantize::AgreedScales;
use crate::wire::reliability::{RecvTracker, SendWindow};
use crate::runtime::socket::SocketAggregator;
use crate::runtime::transport::{Counters, BATCH_MAX};
use crate::runtime::error::Peer;

pub use config::{CallOptions, CommConfig, Participant, TcGroup};
pub(crate) use raw::{Raw, RawF32, RawI32};
pub(crate) use round::{Reduced, RoundState, Sink, Src};
use tc_route::TcRoute;

/// Most seqs the aggregator remembers as acknowledged before it registered
/// them (`Engine::res_early`): a few windows of results.
const RES_EARLY_LIMIT: usize = 1 << 16;

/// See `Engine::agg_windows`.
#[derive(Debug, Clone, Copy)]
struct ContribWindows {
    reduce: usize,
    allreduce: usize,
}

/// Broadcast data of a later round, kept until that round starts.
struct Stashed {
    buf: Vec<u8>,
    from: usize,
    round: Round,
}

/// Which send window a queued first transmission is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxWin {
    Agg,
    Bcast,
}

/// One participant's protocol state (see the module docs).
pub(crate) struct Engine {
    pub(crate) cfg: CommConfig,
    /// The communicator's counters (shared with it): refusals, duplicates,
    /// delivered bytes. Sends and receives are counted by the driver.
    counters: Arc<Counters>,
    /// ACKs and retransmissions produced by `handle`, sent at the next poll.
    out: Outbox,
    /// The round in progress, if a call is running (boxed: `handle` and
    /// `poll_transmit` take it out and put it back for every datagram).
    current: Option<Box<RoundState>>,
    /// When the timers polled last are next due (see [`Engine::poll_timeout`]).
    next_timer: Option<Instant>,
    me: usize,
    per: usize,
    chunk: usize,
    addrs: Vec<SocketAddr>,
    index: HashMap<SocketAddr, usize>,
    /// Worker: its contributions (one destination, the aggregator).
    agg_tx: SendWindow,
    /// The contribution window of a reduce and of an allreduce whose
    /// RESULTs the kernel copies to every worker (the kernel backend's
    /// differ: `fragment::kernel_window`).
    agg_windows: ContribWindows,
    /// Broadcast root, and the aggregator forwarding results: the `AGB1`
    /// data (a destination per participant index).
    bc_tx: SendWindow,
    /// Per sender (participant index): dedup and ACKs of its `AGB1` data.
    bc_rx: Vec<RecvTracker>,
    /// The `AGB1` group each sender used last (the id its ACKs carry).
    bc_group: Vec<u16>,
    /// Aggregator, kernel allreduce via the result group: results held until
    /// every worker acknowledged them (seq = contribution seq), resent by
    /// unicast to who misses them.
    res_tx: SendWindow,
    /// Aggregator: result ACKs that named seqs not registered yet (a worker
    /// got the kernel's copy before this runtime took the RESULT): seq →
    /// workers (bit per rank), applied when the seq is registered. (Keeping
    /// whole bitmaps and re-applying all of them at every registration cost
    /// 13 % of the CPU of a 21.8 M-element allreduce.) Bounded.
    res_early: HashMap<u32, u64>,
    /// Worker: acknowledges the results it receives (seq = contribution seq).
    res_rx: RecvTracker,
    /// Worker: (round, contribution seq base, fragments) of recent reductions,
    /// to re-acknowledge late result retransmissions.
    recent: VecDeque<(Round, u32, usize)>,
    /// Set when this participant's node runs the TC broadcast program with
    /// its group: broadcasts go through it.
    tc: Option<TcRoute>,
    /// Aggregator: its backend's side (the socket reducer, or the kernel's
    /// RESULTs).
    backend: Option<Box<dyn Backend>>,
    /// Broadcast data of later rounds (at most `cfg.stash_limit`), and the
    /// buffers of used ones.
    stash: Vec<Stashed>,
    stash_pool: Vec<Vec<u8>>,
    /// New datagrams registered by `pump`, sent by `flush_tx`: (window, seq,
    /// destination).
    txq: Vec<(TxWin, u32, SocketAddr)>,
    /// Contribution ACKs the backend queued.
    acks_sent: u64,
    /// The round of the next (or current) call.
    round: Round,
    /// The contribution seq of the next (or current) reduction's first fragment.
    agg_seq: u32,
    spare_cov: Vec<Coverage>,
    /// Reused per-call buffers (kept between calls of the same size): a
    /// worker's int result bytes, the aggregator's int32 result, a float
    /// result held for a possible rerun, the forwarding queue.
    pub(crate) spare_bytes: Vec<u8>,
    pub(crate) spare_i32: Vec<i32>,
    pub(crate) spare_f32: Vec<f32>,
    spare_queue: VecDeque<u32>,
    /// The scales this communicator's one-round adaptive allreduces agreed,
    /// by length: a worker's next guess (`calls.rs`, `quantize.rs`).
    pub(crate) agreed_scales: AgreedScales,
}

impl Engine {
    /// The state machine of the participant `cfg` describes (validated by
    /// the builder), before its first call at `now`. `counters`: shared
    /// with the communicator. `broadcast_seq_base`: the first seq of this
    /// participant's broadcasts, a multiple of the ACK group size (the
    /// driver picks it at random, so a restarted participant's receivers
    /// see a new session).
    pub(crate) fn new(
        cfg: CommConfig,
        counters: Arc<Counters>,
        broadcast_seq_base: u32,
        now: Instant,
    ) -> Engine {
        let n = cfg.participants();
        let addrs: Vec<SocketAddr> = (0..n).map(|i| cfg.addr_of(i)).collect();
        let index = addrs.iter().enumerate().map(|(i, a)| (*a, i)).collect();
        let me = cfg.me.index(cfg.workers());
        let per = cfg.elements_per_fragment();
        let datagram = proto::ip_udp_hdr(cfg.is_ipv6()) + abi::AGG_HDR_LEN + 4 * per;
        let window = byte_window(cfg.reliability.window as usize, datagram);
        let mut agg_tx = SendWindow::new(cfg.reliability, 1, cfg.first_agg_seq);
        let agg_windows = match cfg.backend {
            // The kernel's slot and block pools and the node's queues bound
            // the fragments in flight.
            BackendKind::Kernel => {
                let workers = cfg.peers.len();
                let of = |copies| {
                    kernel_window(window, cfg.slots as usize, per, workers, copies, datagram)
                };
                ContribWindows {
                    reduce: of(1),
                    allreduce: of(workers + 1),
                }
            }
            // A fragment in flight holds one of the socket aggregator's
            // slots until every worker's contribution to it arrived: more in
            // flight than slots is dropped unacknowledged, and resent after
            // timeouts that double every time it is dropped again.
            BackendKind::Socket => {
                let w = window.min(cfg.slots.max(1) as usize);
                ContribWindows {
                    reduce: w,
                    allreduce: w,
                }
            }
        };
        agg_tx.set_window(agg_windows.reduce);
        // The kernel's results acknowledge contributions; their holes are
        // not this worker's losses.
        agg_tx.set_holes_are_losses(cfg.backend == BackendKind::Socket);
        let mut bc_tx = SendWindow::new(cfg.reliability, n, broadcast_seq_base);
        bc_tx.set_window(window);
        // Broadcast receivers and result receivers keep what arrives: one
        // gone quiet is busy, and gets probes (SendWindow::set_probe_quiet).
        bc_tx.set_probe_quiet(true);
        let bc_rx = (0..n).map(|_| RecvTracker::new(cfg.reliability)).collect();
        let mut res_tx = SendWindow::new(cfg.reliability, cfg.peers.len(), cfg.first_agg_seq);
        res_tx.set_probe_quiet(true);
        let res_rx = RecvTracker::new(cfg.reliability);
        let tc = match (&cfg.tc_group, cfg.backend) {
            (Some(g), BackendKind::Kernel) => Some(TcRoute {
                id: g.id,
                first: g.members[0],
                bit_of: addrs
                    .iter()
                    .map(|a| {
                        g.members
                            .iter()
                            .position(|m| m == a)
                            .map_or(0, |i| 1u32 << i)
                    })
                    .collect(),
                scratch: Vec::with_capacity(2048),
            }),
            _ => None,
        };
        let backend: Option<Box<dyn Backend>> = match (cfg.me, cfg.backend) {
            (Participant::Aggregator, BackendKind::Socket) => {
                Some(Box::new(SocketAggregator::new(
                    cfg.peers.clone(),
                    cfg.reliability,
                    cfg.slots as usize,
                    cfg.first_round,
                )))
            }
            (Participant::Aggregator, BackendKind::Kernel) => {
                Some(Box::new(KernelAggregator::new(
                    cfg.peers.clone(),
                    per,
                    cfg.reliability,
                    cfg.first_round,
                    cfg.first_agg_seq,
                    cfg.aggregator,
                    cfg.early_result_bytes,
                )))
            }
            _ => None,
        };
        let mut backend = backend;
        if let Some(b) = backend.as_mut() {
            b.expect_round(cfg.first_round, cfg.first_agg_seq, now);
        }
        Engine {
            counters,
            out: Outbox::new(),
            current: None,
            next_timer: None,
            me,
            per,
            chunk: per * 4,
            addrs,
            index,
            agg_tx,
            agg_windows,
            bc_tx,
            bc_rx,
            bc_group: vec![cfg.job; n],
            res_tx,
            res_early: HashMap::new(),
            res_rx,
            recent: VecDeque::new(),
            tc,
            backend,
            stash: Vec::new(),
            stash_pool: Vec::new(),
            txq: Vec::with_capacity(BATCH_MAX),
            acks_sent: 0,
            round: cfg.first_round,
            agg_seq: cfg.first_agg_seq,
            spare_cov: Vec::new(),
            spare_bytes: Vec::new(),
            spare_i32: Vec::new(),
            spare_f32: Vec::new(),
            spare_queue: VecDeque::new(),
            agreed_scales: AgreedScales::default(),
            cfg,
        }
    }

    fn cov(&mut self, n: usize) -> Coverage {
        let mut c = self.spare_cov.pop().unwrap_or_default();
        c.reset(n);
        c
    }

    /// A round of call `name` starting at `now`, its deadline from `opts`
    /// or the communicator's default.
    fn new_round(&self, name: &'static str, now: Instant, opts: CallOptions) -> RoundState {
        RoundState {
            name,
            round: self.round,
            op: Op::Sum,
            rout: false,
            contrib: None,
            bout: None,
            bin: None,
            collect: None,
            deadline: now + opts.deadline.unwrap_or(self.cfg.deadline),
            opts,
            complete: false,
            nfrags: 0,
            owned: None,
            unsent: None,
        }
    }

    fn all_but(&self, i: usize) -> u64 {
        let n = self.cfg.participants();
        let all = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        // A node-served job has no aggregator participant (the last index).
        let absent = if self.cfg.node_served { 1u64 << self.cfg.workers() } else { 0 };
        all & !(1u64 << i) & !absent
    }

    /// Handles one datagram that arrived at `now` from `from`. What it calls
    /// for (ACKs, retransmissions) goes out at the next
    /// [`Engine::poll_transmit`] or [`Engine::poll_acks`].
    pub(crate) fn handle(&mut self, now: Instant, from: SocketAddr, datagram: &[u8]) {
        let mut current = self.current.take();
        let mut op = current.as_deref_mut();
        self.dispatch(now, from, datagram, &mut op);
        self.current = current;
    }

    /// Hands everything due at `now` to `tx`: what `handle` queued, new data
    /// the windows allow (the round's fragments, results to forward), then
    /// the retransmissions and ACKs whose timers fired. Timers do not run
    /// once the round is complete or past its deadline: the call ends
    /// instead (see [`Engine::round_outcome`]).
    pub(crate) fn poll_transmit(&mut self, now: Instant, tx: &mut impl Transmit) {
        self.out.flush(tx);
        let mut current = self.current.take();
        let mut timers_run = true;
        if let Some(st) = current.as_deref_mut() {
            self.drain_completed(st, now);
            self.pump(st, now, tx);
            st.complete = self.is_done(st);
            timers_run = !st.complete && now < st.deadline;
        }
        self.current = current;
        self.next_timer = if timers_run { self.timers(now) } else { None };
        self.out.flush(tx);
    }

    /// Hands what `handle` queued and the receivers' ACKs due at `now` to
    /// `tx`. The driver calls it between the batches of a long receive queue
    /// (see [`Engine::receiver_acks`]).
    pub(crate) fn poll_acks(&mut self, now: Instant, tx: &mut impl Transmit) {
        self.receiver_acks(now);
        self.out.flush(tx);
    }

    /// How long a closing worker keeps answering after its last datagram
    /// from a peer (see `driver::Driver::linger`): three of its RTOs toward
    /// the aggregator, and at least five initial RTOs (100 ms by default: a
    /// peer with no RTT sample resends after its initial RTO, and one whose
    /// timer backed off in a burst of loss after a few of them). `None` for
    /// an aggregator application: no peer holds anything it must
    /// acknowledge.
    pub(crate) fn linger_quiet(&self) -> Option<std::time::Duration> {
        match self.cfg.me {
            Participant::Worker(_) => {
                Some((3 * self.agg_tx.rtt().rto()).max(5 * self.cfg.reliability.initial_rto))
            }
            Participant::Aggregator => None,
        }
    }

    /// Hands every receive tracker's pending ACK to `tx` at once, whatever
    /// it has waited: the communicator closes, and a worker's deferred ACK
    /// of its last RESULT (see `on_result`) must not be left to a timer
    /// that will not run.
    pub(crate) fn flush_acks(&mut self, tx: &mut impl Transmit) {
        let out = &mut self.out;
        let addrs = &self.addrs;
        let (job, me) = (self.cfg.job, self.me as u16);
        for (i, t) in self.bc_rx.iter_mut().enumerate() {
            let id = self.bc_group[i];
            t.flush(&mut |bm| out.ack(id, me, AckKind::Broadcast, bm, addrs[i]));
        }
        if let Participant::Worker(_) = self.cfg.me {
            let agg = addrs[self.cfg.workers() as usize];
            self.res_rx.flush(&mut |bm| out.ack(job, me, AckKind::Aggregation, bm, agg));
        }
        self.out.flush(tx);
    }

    /// Queues the pending ACK of what participant `i` broadcast (every
    /// group with unacknowledged arrivals), whatever it has waited: its
    /// message completed without an arrival that acknowledges it.
    fn ack_broadcast_now(&mut self, i: usize) {
        let out = &mut self.out;
        let (id, me, to) = (self.bc_group[i], self.me as u16, self.addrs[i]);
        self.bc_rx[i].flush(&mut |bm| out.ack(id, me, AckKind::Broadcast, bm, to));
    }

    /// When [`Engine::poll_transmit`] must run next at the latest: the
    /// earliest timer the last one armed, or the round's deadline. `None`:
    /// nothing pending. Valid after a `poll_transmit`: `handle` arms timers
    /// too (delayed ACKs, resends), so a driver polls after handling input
    /// and before it sleeps.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let deadline = self.current.as_ref().map(|st| st.deadline);
        match (self.next_timer, deadline) {
            (Some(t), Some(d)) => Some(t.min(d)),
            (t, d) => t.or(d),
        }
    }

    /// The next round and contribution seq (what
    /// [`crate::runtime::Communicator::position`] reports and a replacement
    /// resumes from).
    pub(crate) fn position(&self) -> (Round, u32) {
        (self.round, self.agg_seq)
    }

    /// The communicator's counters (the calls count what they did).
    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The receive trackers' due ACKs (broadcast data, and a worker's
    /// results); returns when the next one is due. Also called between the
    /// batches of a long receive queue: draining thousands of datagrams
    /// takes milliseconds of copying and decoding, longer than the senders'
    /// RTO, and their timeouts fire for what is sitting in this queue while
    /// its ACKs wait for the end of the drain.
    fn receiver_acks(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut merge = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n: Instant| n.min(t)));
            }
        };
        let out = &mut self.out;
        let addrs = &self.addrs;
        let (job, me) = (self.cfg.job, self.me as u16);
        for (i, t) in self.bc_rx.iter_mut().enumerate() {
            let id = self.bc_group[i];
            merge(t.poll(now, &mut |bm| {
                out.ack(id, me, AckKind::Broadcast, bm, addrs[i])
            }));
        }
        if let Participant::Worker(_) = self.cfg.me {
            let agg = addrs[self.cfg.workers() as usize];
            merge(self.res_rx.poll(now, &mut |bm| {
                out.ack(job, me, AckKind::Aggregation, bm, agg)
            }));
        }
        next
    }

    /// Retransmission and ACK timers; returns the next due time.
    fn timers(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut merge = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n: Instant| n.min(t)));
            }
        };
        let out = &mut self.out;
        let target = self.cfg.contrib_target();
        merge(self.agg_tx.poll(now, &mut |_, b| out.resend(target, b)));
        let addrs = &self.addrs;
        let mut tc = self.tc.as_mut();
        merge(self.bc_tx.poll(now, &mut |d, b| match tc.as_deref_mut() {
            Some(t) => t.resend(out, b, d),
            None => out.resend(addrs[d], b),
        }));
        merge(self.res_tx.poll(now, &mut |d, b| out.resend(addrs[d], b)));
        merge(self.receiver_acks(now));
        if let Some(b) = self.backend.as_mut() {
            let mut io = AckIo {
                out: &mut self.out,
                counters: &self.counters,
                job: self.cfg.job,
                sent: &mut self.acks_sent,
            };
            merge(b.poll(now, &mut io));
        }
        next
    }
}

fn index_peer(i: usize, workers: u16) -> Peer {
    if i < workers as usize {
        Peer::Rank(i as u16)
    } else {
        Peer::Aggregator
    }
}
