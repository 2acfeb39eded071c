//! The node's result service: for every job with `consumer = "node"`,
//! `aggbox attach` itself takes the job's RESULTs on its `result_port` and
//! does what an aggregator application does for an in-kernel allreduce, so
//! the workers need nothing but the configuration:
//!
//! - it acknowledges every worker's contribution on the kernel's behalf: a
//!   RESULT proves every rank's contribution to its fragment arrived, and it
//!   names that contribution's seq (docs/PROTOCOL.md, "RESULT seq"), the
//!   same on every rank; the ACKs go per packet or per group as `[node]
//!   ack_mode` says, to every worker's socket;
//! - it keeps each RESULT until every worker acknowledged the copy the TC
//!   program brought it (AGK1 kind aggregation, the worker's rank, that
//!   seq), and resends it by unicast to only the workers that miss it, after
//!   the RTO or for a hole in their ACKs;
//! - it answers a worker's position query (`AGP1`, docs/PROTOCOL.md) with
//!   the round and contribution seq a new run of the job's communicators
//!   must start at, from the RESULTs it has seen
//!   ([`ResultService::position`]), so that a second MPI run on a running
//!   node starts where the first left off.
//!
//! Both halves are `wire::reliability` (`RecvTracker`, `SendWindow`), the
//! implementation the runtime's aggregator uses; this module adds only what
//! a node without calls must work out itself: where a round starts. A call
//! of round r+1 can only complete a fragment once every worker finished
//! round r, so the first RESULT of a newer round retires what is still held
//! of the older ones (a worker that missed one gave up on that call).
//!
//! A node-served job with a `parent` (a leaf of a tree of aggregators,
//! docs/PROTOCOL.md "Trees served by the node") is served the same way
//! toward its workers, but the kernel neither routes its RESULTs upstream
//! nor copies them to the group ([`JobConfig::kernel_parent`]): its own
//! RESULT, the subtree's partial reduction, is acknowledged on the kernel's
//! behalf as above and then sent by this service to the parent as the
//! node's contribution (same seq, round, frag_off, flags without RESULT),
//! held in a `SendWindow` until the parent acknowledges it; the parent's
//! RESULTs arrive on the same socket, are acknowledged to the parent's
//! result port, renamed to this job and delivered to every worker, and
//! held until each worker acknowledged its copy, like the kernel's copies
//! of a plain served job. The parent itself is a plain served job whose
//! workers are its children's result sockets.
//!
//! [`ResultService`] has no socket and no clock (`handle(now, from,
//! datagram)`, `poll(now)`); [`ResultServer`] is its thread, with one UDP
//! socket per served job bound to the job's `result_port`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use crate::config::{Config, JobConfig, ParentConfig, ResultConsumer};
use crate::kernel::xdp::KernelMaps;

use libbpf_rs::MapCore;

use crate::wire::abi::{self, Round};
use crate::wire::proto::{self, AckKind, AckMessage, AggHeader, MessageKind, PositionMessage, SeqBitmap};
use crate::wire::reliability::{RecvTracker, ReliabilityConfig, SendWindow, Verdict};

/// One datagram for the driver to send from the job's socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Destination (a worker's socket).
    pub to: SocketAddrV4,
    /// The datagram.
    pub datagram: Vec<u8>,
}

/// Counters of one served job; also the value of the pinned
/// `result_service` map (`aggbox status` reads it from another process),
/// hence the C layout.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServiceStats {
    /// RESULTs taken (each fragment once).
    pub results: u64,
    /// RESULTs that were copies of one taken already.
    pub duplicate_results: u64,
    /// ACK datagrams sent on the kernel's behalf (one per worker each).
    pub acks_sent: u64,
    /// Workers' ACKs of RESULTs taken.
    pub acks_received: u64,
    /// RESULT copies resent to a worker that missed them.
    pub resent: u64,
    /// RESULT-shaped datagrams from a source the node's paths never send
    /// RESULTs from (dropped: taken, they would decide a value and end the
    /// workers' retransmissions).
    pub refused_results: u64,
    /// ACKs from a socket that is not the worker they name, or of another
    /// job or kind.
    pub refused_acks: u64,
    /// Datagrams that were neither (contributions, broadcast data, garbage).
    pub other: u64,
    /// Rounds (calls) the node saw RESULTs of.
    pub rounds: u64,
    /// Workers that owe an ACK of some RESULT held now (a gauge).
    pub workers_behind: u64,
    /// Tree jobs: this node's contributions sent to its parent (each
    /// fragment's RESULT once).
    pub upstream_sent: u64,
    /// Tree jobs: contributions resent to the parent, which had not
    /// acknowledged them.
    pub upstream_resent: u64,
    /// Tree jobs: the parent's ACKs of this node's contributions.
    pub upstream_acks: u64,
    /// Tree jobs: the parent's RESULTs taken (each fragment once) and
    /// delivered to every worker.
    pub parent_results: u64,
    /// Tree jobs: copies of a parent's RESULT taken already (acknowledged
    /// again, not delivered again).
    pub duplicate_parent_results: u64,
    /// Tree jobs: ACKs of the parent's RESULTs sent to the parent.
    pub parent_acks_sent: u64,
    /// Tree jobs: contributions the parent has not acknowledged yet (a
    /// gauge).
    pub upstream_held: u64,
    /// Position queries (`AGP1`) of the job's workers, answered.
    pub position_queries: u64,
    /// `AGP1` datagrams refused: malformed, a reply, another job's, or from
    /// a socket that is not the worker it names (nothing answered, nothing
    /// changed).
    pub refused_queries: u64,
    /// Unfinished slots of rounds after the newest RESULT, released when a
    /// worker asked where a new run starts: contributions an earlier run
    /// left in calls that failed ([`ResultService::take_release`]).
    pub released_slots: u64,
}

// SAFETY: only u64 fields, no padding.
unsafe impl plain::Plain for ServiceStats {}

/// Name of the pinned map of [`ServiceStats`] by job id (`u32` key), a
/// user-space map of the attach process: `aggbox status` shows it.
pub const STATS_MAP: &str = "result_service";

/// Worker ACKs kept for RESULTs not taken yet (the TC copy can reach a
/// worker, and its ACK come back, before the local copy is read).
const EARLY_ACKS_MAX: usize = 4096;

/// The result service of one job (see the module docs).
#[derive(Debug)]
pub struct ResultService {
    job: u16,
    /// Addresses of this node (the user-space path's RESULTs come from one).
    node: Vec<Ipv4Addr>,
    /// Worker r's socket: its member socket in the result group.
    workers: Vec<SocketAddrV4>,
    behalf: RecvTracker,
    /// The RESULTs the workers get (the kernel's copies, or the parent's
    /// RESULTs this service delivers), until each worker acknowledged.
    results: RoundWindow,
    /// Seq → workers (bits) that acknowledged it before it was taken.
    early: HashMap<u32, u64>,
    /// Elements per fragment, learnt from a RESULT that is not its call's
    /// last (fragment i starts at `i * per`).
    per: Option<u32>,
    /// Tree jobs: the parent, and what is held for it.
    upstream: Option<Upstream>,
    /// The newest round and seq (serial order) of the RESULTs taken, for
    /// the position a new run must start at ([`ResultService::position`]).
    seen: Option<Seen>,
    /// Set by an answered position query, taken by the serving thread
    /// before the reply goes out: release the job's unfinished slots of
    /// rounds after this newest RESULT's (`None`: of every round).
    release_after: Option<Option<Round>>,
    stats: ServiceStats,
}

/// How far a job's RESULTs have reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    round: Round,
    seq: u32,
}

impl Seen {
    /// `seen` raised to a RESULT of `round` under `seq`, each in serial
    /// order (a late copy of an older one lowers nothing).
    fn raise(seen: Option<Seen>, round: Round, seq: u32) -> Seen {
        match seen {
            None => Seen { round, seq },
            Some(s) => Seen {
                round: if s.round.is_before(round) { round } else { s.round },
                seq: if (seq.wrapping_sub(s.seq) as i32) > 0 { seq } else { s.seq },
            },
        }
    }
}

/// The parent of a node-served tree job, and the service's state toward it.
#[derive(Debug)]
struct Upstream {
    /// The parent's address: what comes from it is the parent's (its
    /// RESULTs, TC copies and resends, and its ACKs).
    addr: Ipv4Addr,
    /// The parent job's contribution port, where this node's RESULTs go.
    contributions: SocketAddrV4,
    /// The parent job's result port, where its RESULTs are acknowledged.
    acks_to: SocketAddrV4,
    /// The job id at the parent.
    job: u16,
    /// This node's rank in the parent job.
    rank: u16,
    /// This node's contributions until the parent acknowledges them.
    sent: RoundWindow,
    /// The parent's RESULTs taken, acknowledged to it.
    taken: RecvTracker,
}

/// A [`SendWindow`] of one call (round) at a time, numbered by the seqs of
/// the RESULTs it holds: a node without calls learns where a round starts
/// from its datagrams (see the module docs).
#[derive(Debug)]
struct RoundWindow {
    window: SendWindow,
    round: Option<Round>,
}

impl RoundWindow {
    fn new(window: SendWindow) -> RoundWindow {
        RoundWindow { window, round: None }
    }

    /// Holds `datagram`, fragment `hdr.frag_off` of `hdr.round` under
    /// `hdr.seq`, until every destination in `dests` acknowledged it; `tx`
    /// sends it now (or does nothing where the kernel sent it). `per` is
    /// the elements per fragment, where known. Returns whether it is the
    /// first of a newer round (what is held of the older ones is dropped:
    /// every worker finished them). A datagram of an older round, or one
    /// held already, changes nothing.
    fn hold(
        &mut self,
        now: Instant,
        hdr: &AggHeader,
        per: Option<u32>,
        datagram: &[u8],
        dests: u64,
        tx: &mut impl FnMut(usize, &[u8]),
    ) -> bool {
        let seq = hdr.seq;
        let newer = match self.round {
            Some(r) if hdr.round.is_before(r) => return false,
            Some(r) if hdr.round == r => false,
            _ => {
                self.window.forget_all();
                let index = match (hdr.frag_off, per) {
                    (0, _) => Some(0),
                    (f, Some(per)) if per > 0 && f % per == 0 => Some(f / per),
                    _ => None,
                };
                // Start the window at the new round's first seq, so that its
                // fragments that come later are not behind it. Where this
                // one's index is unknown (no full fragment seen yet), a small
                // gap from the old round's end is held as placeholders
                // instead (the earlier fragments fill it); a large one is
                // skipped.
                match index {
                    Some(i) => self.window.set_next_seq(seq.wrapping_sub(i)),
                    None if seq.wrapping_sub(self.window.next_seq()) <= self.window.window() as u32 => {}
                    None => self.window.set_next_seq(seq),
                }
                self.round = Some(hdr.round);
                true
            }
        };
        let _ = self.window.send_at(
            seq,
            dests,
            now,
            |_, buf: &mut Vec<u8>| -> Result<(), ()> {
                buf.extend_from_slice(datagram);
                Ok(())
            },
            tx,
        );
        newer
    }
}

impl ResultService {
    /// The service of `job` on a node with addresses `node`, whose workers'
    /// sockets are `workers` (rank order; at most 64).
    pub fn new(job: u16, node: Vec<Ipv4Addr>, workers: Vec<SocketAddrV4>, cfg: ReliabilityConfig) -> ResultService {
        let mut results = SendWindow::new(cfg, workers.len(), 0);
        // Workers keep what arrives: one gone quiet is busy, and is asked
        // with the newest of what it misses (as the runtime's aggregator).
        results.set_probe_quiet(true);
        ResultService {
            job,
            node,
            workers,
            behalf: RecvTracker::new(cfg),
            results: RoundWindow::new(results),
            early: HashMap::new(),
            per: None,
            upstream: None,
            seen: None,
            release_after: None,
            stats: ServiceStats::default(),
        }
    }

    /// The service of a tree job whose `parent` (its `result_port` at
    /// `parent_results`) takes this node's RESULTs as its contribution.
    pub fn with_parent(mut self, parent: &ParentConfig, parent_results: u16, cfg: ReliabilityConfig) -> ResultService {
        let mut sent = SendWindow::new(cfg, 1, 0);
        // The parent acknowledges a fragment once its RESULT completes
        // (on its kernel's behalf), so a hole in its ACKs is as likely
        // another child's loss as ours: only timeouts resend (as the
        // runtime's kernel-backend workers).
        sent.set_holes_are_losses(false);
        self.upstream = Some(Upstream {
            addr: parent.addr,
            contributions: SocketAddrV4::new(parent.addr, parent.port),
            acks_to: SocketAddrV4::new(parent.addr, parent_results),
            job: parent.job,
            rank: parent.rank,
            sent: RoundWindow::new(sent),
            taken: RecvTracker::new(cfg),
        });
        self
    }

    /// The job's counters.
    pub fn stats(&self) -> ServiceStats {
        ServiceStats {
            workers_behind: u64::from(self.results.window.unacked_dests().count_ones()),
            upstream_held: self.upstream.as_ref().map_or(0, |u| u.sent.window.in_flight() as u64),
            ..self.stats
        }
    }

    /// Where a new run of the job's communicators must start: the round
    /// and contribution seq of its first call
    /// ([`crate::runtime::CommunicatorBuilder::resume`]), and whether the
    /// node has seen no RESULT of the job (then `(0, 0)`, as a first run).
    ///
    /// The round is the newest round seen **+ 2**, the seq the newest seq
    /// seen + 1. Why: the XDP program knows a fragment by (round,
    /// frag_off), and keeps its slot, its `completed` key and its rank
    /// bits (docs/DATAPLANE.md), so a new run must use rounds no run used
    /// before: a contribution to a slot where its rank's bit is set is a
    /// `retransmission` (not added), and one of a round more than the
    /// job's `window` behind the newest is `stale_round`. Calls run in
    /// order and a worker's call ends only once each of its fragments
    /// completed (allreduce: their RESULTs; reduce: the ACKs on the
    /// kernel's behalf, sent for RESULTs), so a worker is at most one round
    /// past the newest RESULT: an earlier run cut off in its next call
    /// (killed, aborted) may have left contributions in slots of round
    /// newest + 1 without any RESULT, and a new run taking that round would
    /// add its values to theirs. So that round is skipped. The seq, which
    /// names RESULTs in this service's windows and in the ACKs on the
    /// kernel's behalf, must be newer than every RESULT's, or the new run's
    /// would be taken for copies of old ones; the seqs the cut-off call
    /// used never come back as RESULTs (its round is never completed), so
    /// newest + 1 suffices. A run that went on past calls that failed (each
    /// failed call's round may hold contributions, and the runtime goes on
    /// with the next round) is beyond this: its successor needs a node
    /// restart (docs/MPI.md, limits).
    pub fn position(&self) -> (Round, u32, bool) {
        match self.seen {
            None => (Round(0), 0, true),
            Some(s) => (Round(s.round.0.wrapping_add(2)), s.seq.wrapping_add(1), false),
        }
    }

    /// What the node must release before the reply to a position query
    /// goes out (taken once): the job's unfinished slots of rounds after
    /// the returned newest RESULT's round (`None`: of every round). A run
    /// that went on past calls that failed (each failed call's round may
    /// hold some workers' contributions, and the runtime goes on with the
    /// next round) leaves such slots in rounds a new run will use; the
    /// kernel would take the new run's contributions of those ranks for
    /// retransmissions and complete the fragments with the old values. A
    /// new run's contributions released this way (a worker that started
    /// before another one asked) are not acknowledged, so their senders
    /// send them again.
    pub fn take_release(&mut self) -> Option<Option<Round>> {
        self.release_after.take()
    }

    /// Counts slots released for [`ResultService::take_release`].
    pub fn released(&mut self, slots: usize) {
        self.stats.released_slots += slots as u64;
    }

    /// RESULTs held until a worker acknowledges them.
    pub fn held(&self) -> usize {
        self.results.window.in_flight()
    }

    /// Every worker's bit.
    fn all_workers(&self) -> u64 {
        if self.workers.len() >= 64 {
            u64::MAX
        } else {
            (1u64 << self.workers.len()) - 1
        }
    }

    /// Takes one datagram that arrived on the job's `result_port` from
    /// `from` at `now`; what it makes the node send goes to `out`.
    pub fn handle(&mut self, now: Instant, from: SocketAddrV4, datagram: &[u8], out: &mut Vec<Transmit>) {
        if PositionMessage::is_position(datagram) {
            self.on_position_query(from, datagram, out);
            return;
        }
        if self.upstream.as_ref().is_some_and(|u| u.addr == *from.ip()) {
            match proto::classify(datagram) {
                Some(MessageKind::Agg) => self.on_parent_result(now, datagram, out),
                Some(MessageKind::Ack) => self.on_parent_ack(now, datagram, out),
                _ => self.stats.other += 1,
            }
            return;
        }
        match proto::classify(datagram) {
            Some(MessageKind::Agg) => self.on_result(now, from, datagram, out),
            Some(MessageKind::Ack) => self.on_ack(now, from, datagram, out),
            _ => self.stats.other += 1,
        }
    }

    /// A worker asks where a new run starts (`AGP1`): answered to the
    /// asking socket when it is the worker the query names (as for its
    /// ACKs); anything else is counted and changes nothing. The reply is no
    /// larger than the query and goes only to a worker's socket.
    fn on_position_query(&mut self, from: SocketAddrV4, datagram: &[u8], out: &mut Vec<Transmit>) {
        let query = match PositionMessage::decode(datagram) {
            Ok(q) if !q.is_reply() && q.job == self.job && self.workers.get(usize::from(q.rank)) == Some(&from) => q,
            _ => {
                self.stats.refused_queries += 1;
                return;
            }
        };
        self.stats.position_queries += 1;
        self.release_after = Some(self.seen.map(|s| s.round));
        let (round, seq, fresh) = self.position();
        let reply = PositionMessage::reply(&query, round, seq, fresh);
        out.push(Transmit { to: from, datagram: reply.encode().to_vec() });
    }

    fn on_result(&mut self, now: Instant, from: SocketAddrV4, datagram: &[u8], out: &mut Vec<Transmit>) {
        let Ok((hdr, payload)) = proto::split_agg(datagram) else {
            self.stats.other += 1;
            return;
        };
        if !hdr.is_result() || hdr.job != self.job {
            self.stats.other += 1;
            return;
        }
        // The XDP program rewrites the completing contribution in place (a
        // worker's socket is the source); the user-space path sends from
        // the node's address.
        if !self.node.contains(from.ip()) && !self.workers.contains(&from) {
            self.stats.refused_results += 1;
            return;
        }
        let seq = hdr.seq;
        self.seen = Some(Seen::raise(self.seen, hdr.round, seq));
        if !hdr.is_last_fragment() {
            self.per = Some(u32::from(hdr.count));
        }
        let newer = match self.upstream.as_mut() {
            // The kernel sent the workers their copies: nothing to send.
            None => self.keep(now, &hdr, datagram, &mut |_: usize, _: &[u8]| {}),
            Some(up) => {
                // The subtree's partial reduction: this node's contribution
                // to the parent, as TC's parent route would rewrite it
                // (docs/BROADCAST.md), but numbered by the RESULT's seq, the
                // seq under which the parent acknowledges it.
                let contribution = AggHeader { job: up.job, rank: up.rank, flags: hdr.flags & !abi::AGG_F_RESULT, ..hdr };
                let mut bytes = proto::agg_header_bytes(&contribution).to_vec();
                bytes.extend_from_slice(payload);
                let (to, stats) = (up.contributions, &mut self.stats);
                up.sent.hold(now, &hdr, self.per, &bytes, 1, &mut |_, b| {
                    stats.upstream_sent += 1;
                    out.push(Transmit { to, datagram: b.to_vec() });
                })
            }
        };
        if newer {
            self.stats.rounds += 1;
        }
        // Acknowledge every rank's contribution to the fragment (once per
        // fragment; a copy of a RESULT is acknowledged again).
        let workers = &self.workers;
        let (job, stats) = (self.job, &mut self.stats);
        let mut emit = |bm: &SeqBitmap| fan_out(job, workers, bm, out, stats);
        if self.behalf.check(seq) == Verdict::Duplicate {
            self.behalf.reack(seq, &mut emit);
            self.stats.duplicate_results += 1;
            return;
        }
        if hdr.is_last_fragment() {
            // The workers' RESULT copies acknowledge their contributions
            // (the runtime's workers take a RESULT as the ACK of their
            // contribution to it), so this ACK repairs only a lost copy, and
            // a stream of calls needs none: it waits until no RESULT came
            // for `ack_delay` (docs/PROTOCOL.md "Implicit acknowledgement of
            // RESULTs").
            self.behalf.record_deferred(seq, now, &mut emit);
        } else {
            self.behalf.record(seq, false, now, &mut emit);
        }
        self.stats.results += 1;
    }

    /// Hold RESULT `hdr.seq` until every worker acknowledged its copy; `tx`
    /// sends the copies now (nothing where the kernel sent them). Returns
    /// whether it is the first of a newer round.
    fn keep(&mut self, now: Instant, hdr: &AggHeader, datagram: &[u8], tx: &mut impl FnMut(usize, &[u8])) -> bool {
        let all = self.all_workers();
        let newer = self.results.hold(now, hdr, self.per, datagram, all, tx);
        if let Some(bits) = self.early.remove(&hdr.seq) {
            self.results.window.ack_early_bits(hdr.seq, bits);
        }
        newer
    }

    /// A RESULT of the parent's job (the final reduction of the tree): it
    /// is acknowledged to the parent, and delivered to every worker under
    /// this job's id (seq, round, frag_off, flags and payload as they came)
    /// and held until each acknowledged it; a copy taken already is only
    /// acknowledged again.
    fn on_parent_result(&mut self, now: Instant, datagram: &[u8], out: &mut Vec<Transmit>) {
        let Some(up) = self.upstream.as_mut() else { return };
        let Ok((hdr, payload)) = proto::split_agg(datagram) else {
            self.stats.other += 1;
            return;
        };
        if !hdr.is_result() || hdr.job != up.job {
            // The parent sends this port nothing else: whatever it is, it
            // must not reach the workers.
            self.stats.refused_results += 1;
            return;
        }
        // The parent's RESULT of a fragment proves this node's contribution
        // to it arrived (as a worker's allreduce RESULT does): an ACK.
        up.sent.window.ack_seq(0, hdr.seq, now);
        let (seq, stats) = (hdr.seq, &mut self.stats);
        let (acks_to, job, rank) = (up.acks_to, up.job, up.rank);
        let mut emit = |bm: &SeqBitmap| {
            if let Some(datagram) = ack_of(job, rank, bm) {
                stats.parent_acks_sent += 1;
                out.push(Transmit { to: acks_to, datagram });
            }
        };
        if up.taken.check(seq) == Verdict::Duplicate {
            up.taken.reack(seq, &mut emit);
            self.stats.duplicate_parent_results += 1;
            return;
        }
        up.taken.record(seq, hdr.is_last_fragment(), now, &mut emit);
        self.stats.parent_results += 1;
        self.seen = Some(Seen::raise(self.seen, hdr.round, seq));
        if !hdr.is_last_fragment() {
            self.per = Some(u32::from(hdr.count));
        }
        let mine = AggHeader { job: self.job, ..hdr };
        let mut result = proto::agg_header_bytes(&mine).to_vec();
        result.extend_from_slice(payload);
        let workers = self.workers.clone();
        self.keep(now, &mine, &result, &mut |d, b| out.push(Transmit { to: workers[d], datagram: b.to_vec() }));
    }

    /// The parent's ACK of this node's contributions (on its kernel's
    /// behalf): what it acknowledges is no longer resent; a hole it shows
    /// after the RTO is.
    fn on_parent_ack(&mut self, now: Instant, datagram: &[u8], out: &mut Vec<Transmit>) {
        let Some(up) = self.upstream.as_mut() else { return };
        let Ok(ack) = AckMessage::decode(datagram) else {
            self.stats.other += 1;
            return;
        };
        if ack.kind != AckKind::Aggregation || ack.id != up.job || ack.rank != up.rank {
            self.stats.refused_acks += 1;
            return;
        }
        self.stats.upstream_acks += 1;
        let (to, stats) = (up.contributions, &mut self.stats);
        up.sent.window.on_ack(0, &ack.bitmap, now, &mut |_, b| {
            stats.upstream_resent += 1;
            out.push(Transmit { to, datagram: b.to_vec() });
        });
    }

    fn on_ack(&mut self, now: Instant, from: SocketAddrV4, datagram: &[u8], out: &mut Vec<Transmit>) {
        let Ok(ack) = AckMessage::decode(datagram) else {
            self.stats.other += 1;
            return;
        };
        let rank = usize::from(ack.rank);
        if ack.kind != AckKind::Aggregation || ack.id != self.job || self.workers.get(rank) != Some(&from) {
            // Only worker r's own socket acknowledges worker r's copies: a
            // forged ACK would stop the resend of a RESULT it missed.
            self.stats.refused_acks += 1;
            return;
        }
        self.stats.acks_received += 1;
        let (workers, stats) = (&self.workers, &mut self.stats);
        self.results.window.on_ack(rank, &ack.bitmap, now, &mut |d, bytes| {
            stats.resent += 1;
            out.push(Transmit { to: workers[d], datagram: bytes.to_vec() });
        });
        for seq in ack.bitmap.received() {
            if !self.results.window.is_known(seq) {
                *self.early.entry(seq).or_default() |= 1u64 << rank.min(63);
            }
        }
        if self.early.len() > EARLY_ACKS_MAX {
            // Costs resends only (a worker re-acknowledges a duplicate).
            self.early.clear();
        }
    }

    /// Sends what is due at `now` (delayed ACKs, resends); returns when to
    /// poll again at the latest.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Transmit>) -> Option<Instant> {
        let (job, workers, stats) = (self.job, &self.workers, &mut self.stats);
        let a = self.behalf.poll(now, &mut |bm| fan_out(job, workers, bm, out, stats));
        let stats = &mut self.stats;
        let b = self.results.window.poll(now, &mut |d, bytes| {
            stats.resent += 1;
            out.push(Transmit { to: workers[d], datagram: bytes.to_vec() });
        });
        let mut wake = [a, b];
        let mut upstream = [None, None];
        if let Some(up) = self.upstream.as_mut() {
            let (to, acks_to, job, rank) = (up.contributions, up.acks_to, up.job, up.rank);
            upstream[0] = up.sent.window.poll(now, &mut |_, bytes| {
                stats.upstream_resent += 1;
                out.push(Transmit { to, datagram: bytes.to_vec() });
            });
            upstream[1] = up.taken.poll(now, &mut |bm| {
                if let Some(datagram) = ack_of(job, rank, bm) {
                    stats.parent_acks_sent += 1;
                    out.push(Transmit { to: acks_to, datagram });
                }
            });
        }
        wake.iter_mut().chain(upstream.iter_mut()).filter_map(|w| *w).min()
    }
}

/// One ACK on the kernel's behalf to every worker (each under its rank).
fn fan_out(job: u16, workers: &[SocketAddrV4], bm: &SeqBitmap, out: &mut Vec<Transmit>, stats: &mut ServiceStats) {
    for (rank, &to) in workers.iter().enumerate() {
        if let Some(datagram) = ack_of(job, rank as u16, bm) {
            stats.acks_sent += 1;
            out.push(Transmit { to, datagram });
        }
    }
}

/// The AGK1 (kind aggregation) of `rank`'s datagrams of `job` in `bm`.
fn ack_of(job: u16, rank: u16, bm: &SeqBitmap) -> Option<Vec<u8>> {
    let msg = AckMessage { id: job, rank, kind: AckKind::Aggregation, flags: 0, bitmap: *bm };
    let mut datagram = Vec::with_capacity(64);
    msg.encode_into(&mut datagram).ok().map(|_| datagram)
}

/// Reliability settings of a served job: the node's ACK mode and group.
fn reliability_of(config: &Config) -> ReliabilityConfig {
    let mut cfg = ReliabilityConfig {
        ack_mode: config.node.ack_mode,
        group_size: config.node.ack_group as u32,
        ..ReliabilityConfig::default()
    };
    cfg.window = cfg.window.min(cfg.group_size);
    cfg
}

/// Worker r's socket of a node-served job: its member of the result group.
fn worker_sockets(config: &Config, job: &JobConfig) -> Result<Vec<SocketAddrV4>> {
    let g = job.result_group.ok_or_else(|| anyhow!("job {}: consumer = \"node\" without result_group", job.id))?;
    let group = config.group(g).ok_or_else(|| anyhow!("job {}: no [[group]] {g}", job.id))?;
    job.workers
        .iter()
        .map(|w| {
            group
                .members
                .iter()
                .find(|m| m.ip() == w)
                .copied()
                .ok_or_else(|| anyhow!("job {}: worker {w} is not a member of group {g}", job.id))
        })
        .collect()
}

/// The thread that serves every `consumer = "node"` job of a node, one UDP
/// socket each on its `result_port`; stopped and joined on drop. Jobs are
/// added and removed while it runs ([`ResultServer::apply`], a reload).
pub struct ResultServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<Mutex<HashMap<u16, ServiceStats>>>,
    changes: mpsc::Sender<(ServedChange, mpsc::Sender<()>)>,
}

impl std::fmt::Debug for ResultServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResultServer").finish_non_exhaustive()
    }
}

/// The socket of a served job: bound beforehand, or the one a job that
/// the same change removes holds on the same port.
#[derive(Debug)]
enum JobSocket {
    Bound(UdpSocket),
    TakeOver(u16),
}

/// A set of served jobs to remove and to add, with every new port bound
/// before anything changes: a port another process holds fails
/// [`BoundJobs::bind`] / [`BoundJobs::bind_change`], which then change
/// nothing.
#[derive(Debug, Default)]
pub struct ServedChange {
    remove: Vec<u16>,
    add: Vec<(JobSocket, ResultService)>,
}

/// The sockets of a [`ResultServer`] at attach (a [`ServedChange`] that
/// only adds).
pub type BoundJobs = ServedChange;

/// A served job's `result_port`, bound for the result service.
fn bind_result_port(job: &JobConfig) -> Result<UdpSocket> {
    let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, job.result_port)).map_err(|e| {
        anyhow!(
            "job {}: result_port {} (consumer = \"node\"): {e}; another process (an aggregator application?) holds it",
            job.id,
            job.result_port
        )
    })?;
    socket.set_nonblocking(true)?;
    // A call's RESULTs arrive in a burst (the kernel completes fragments as
    // fast as contributions come): as the runtime's aggregator, 64 MiB, or
    // what rmem_max allows without CAP_NET_ADMIN.
    crate::netif::set_socket_buffers(&socket, 64 << 20);
    Ok(socket)
}

/// Whether `job` of `config` is node-served.
fn is_served(job: &JobConfig) -> bool {
    job.consumer == ResultConsumer::Node
}

/// A served job's settings as the service sees them: the job, and the
/// group its RESULT copies go to (the workers' sockets).
fn served_view<'a>(config: &'a Config, job: &'a JobConfig) -> (&'a JobConfig, Option<&'a crate::config::GroupConfig>) {
    (job, job.result_group.and_then(|g| config.group(g)))
}

impl ServedChange {
    /// Binds `0.0.0.0:result_port` for every node-served job of `config`
    /// (none: an empty set), for a node with addresses `node`.
    pub fn bind(config: &Config, node: Vec<Ipv4Addr>) -> Result<ServedChange> {
        Self::bind_change(&Config::default(), config, node)
    }

    /// What turns the served jobs of `old` into those of `new`: a served
    /// job whose settings (or result group) differ is removed and added
    /// afresh, one that is unchanged is left alone. New ports are bound
    /// now; a port that a removed job holds passes to its successor.
    pub fn bind_change(old: &Config, new: &Config, node: Vec<Ipv4Addr>) -> Result<ServedChange> {
        let kept = |j: &JobConfig| {
            old.job(j.id).is_some_and(|o| is_served(o) && served_view(old, o) == served_view(new, j))
        };
        let mut change = ServedChange::default();
        for o in old.jobs.iter().filter(|o| is_served(o)) {
            if !new.job(o.id).is_some_and(|j| is_served(j) && kept(j)) {
                change.remove.push(o.id);
            }
        }
        for job in new.jobs.iter().filter(|j| is_served(j) && !kept(j)) {
            let workers = worker_sockets(new, job)?;
            let freed = old
                .jobs
                .iter()
                .any(|o| is_served(o) && o.result_port == job.result_port && change.remove.contains(&o.id));
            let socket = if freed { JobSocket::TakeOver(job.result_port) } else { JobSocket::Bound(bind_result_port(job)?) };
            let mut service = ResultService::new(job.id, node.clone(), workers, reliability_of(new));
            if let Some(parent) = &job.parent {
                let results = parent.result_port.ok_or_else(|| {
                    anyhow!("job {}: consumer = \"node\" with a parent needs parent.result_port", job.id)
                })?;
                service = service.with_parent(parent, results, reliability_of(new));
            }
            change.add.push((socket, service));
        }
        Ok(change)
    }

    /// Whether the change neither removes nor adds a job.
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.add.is_empty()
    }

    /// Jobs it removes, and jobs it adds.
    pub fn jobs(&self) -> (Vec<u16>, Vec<u16>) {
        (self.remove.clone(), self.add.iter().map(|(_, s)| s.job).collect())
    }

    /// Serve the jobs on a thread of their own (also with none: a reload
    /// may add some); their counters also go to a map pinned as
    /// `pin_dir/result_service` ([`STATS_MAP`]).
    pub fn start(self, pin_dir: &std::path::Path, maps: KernelMaps) -> Result<ResultServer> {
        let map = crate::kernel::maps::create_pinned_counters(
            pin_dir,
            STATS_MAP,
            std::mem::size_of::<ServiceStats>() as u32,
            abi::MAX_JOBS,
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(HashMap::new()));
        let (flag, shared) = (stop.clone(), stats.clone());
        let (changes, queued) = mpsc::channel();
        let mut jobs = Vec::new();
        apply_change(&mut jobs, self, &stats, &map);
        let thread = std::thread::Builder::new()
            .name("aggbox-results".into())
            .spawn(move || serve(&mut jobs, &queued, &flag, &shared, &map, &maps))?;
        Ok(ResultServer { stop, thread: Some(thread), stats, changes })
    }
}

/// A job removed and added again by the same change (its settings
/// changed) keeps its kernel state (`XdpPlane::set_job` zeroes only a new
/// job's), so its new service answers positions from where the old one's
/// RESULTs reached.
fn carry_positions<'a>(gone: impl Iterator<Item = &'a ResultService>, added: &mut [(JobSocket, ResultService)]) {
    let seen: HashMap<u16, Option<Seen>> = gone.map(|service| (service.job, service.seen)).collect();
    for (_, service) in added.iter_mut() {
        if let Some(&s) = seen.get(&service.job) {
            service.seen = s;
        }
    }
}

/// Apply `change` to the serving thread's jobs: the removed ones go (their
/// counters with them), the added ones start from nothing (but where a
/// job's RESULTs reached: [`carry_positions`]).
fn apply_change(
    jobs: &mut Vec<(UdpSocket, ResultService)>,
    change: ServedChange,
    stats: &Mutex<HashMap<u16, ServiceStats>>,
    pinned: &libbpf_rs::MapHandle,
) {
    let (gone, kept): (Vec<_>, Vec<_>) =
        std::mem::take(jobs).into_iter().partition(|(_, service)| change.remove.contains(&service.job));
    *jobs = kept;
    let mut change = change;
    carry_positions(gone.iter().map(|(_, service)| service), &mut change.add);
    let mut freed: HashMap<u16, UdpSocket> = gone
        .into_iter()
        .filter_map(|(socket, _)| Some((socket.local_addr().ok()?.port(), socket)))
        .collect();
    for &job in &change.remove {
        if let Ok(mut s) = stats.lock() {
            s.remove(&job);
        }
        let _ = pinned.delete(&u32::from(job).to_ne_bytes());
    }
    for (socket, service) in change.add {
        let socket = match socket {
            JobSocket::Bound(s) => s,
            // bind_change saw the port held by a job this change removes.
            JobSocket::TakeOver(port) => match freed.remove(&port) {
                Some(s) => s,
                None => continue,
            },
        };
        jobs.push((socket, service));
    }
}

/// A function returning the counters of every served job (for the metrics
/// endpoint, which runs on its own thread).
pub type ResultStatsFn = Arc<dyn Fn() -> HashMap<u16, ServiceStats> + Send + Sync>;

impl ResultServer {
    /// The counters of every served job, as of the last poll.
    pub fn stats(&self) -> HashMap<u16, ServiceStats> {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// [`ResultServer::stats`] as a `Send + Sync` function.
    pub fn stats_fn(&self) -> ResultStatsFn {
        let stats = self.stats.clone();
        Arc::new(move || stats.lock().map(|s| s.clone()).unwrap_or_default())
    }

    /// Remove and add served jobs between two polls of the serving thread;
    /// returns once it has. The other jobs' windows are untouched.
    pub fn apply(&self, change: ServedChange) -> Result<()> {
        let (done, applied) = mpsc::channel();
        self.changes.send((change, done)).map_err(|_| anyhow!("the result service has stopped"))?;
        applied
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow!("the result service did not take the change within 5 s"))
    }
}

impl Drop for ResultServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// While datagrams keep coming, the serving thread reads its sockets once
/// every READ_EVERY instead of waking for each (it polls the sockets again
/// once a read finds nothing). For jobs without a `parent` the service is
/// off the calls' path: the TC program delivers every RESULT, and the
/// service only holds them for resends (after an RTO of at least 2 ms) and
/// acknowledges on the kernel's behalf (deferred, docs/PROTOCOL.md
/// "Implicit acknowledgement of RESULTs"). Woken once a call, it took ~10
/// µs of CPU a one-datagram call on the development VM, at the moment the
/// call's ranks wake for their RESULTs. The 64 MiB socket buffer holds what
/// comes meanwhile. A tree job's service sends the node's contribution
/// upstream when its RESULT comes (on the calls' path): with one, every
/// datagram is read at once.
const READ_EVERY: Duration = Duration::from_micros(500);

/// Longest wait in `poll(2)`, so that a stop is seen.
const IDLE_WAIT: Duration = Duration::from_millis(50);

fn serve(
    jobs: &mut Vec<(UdpSocket, ResultService)>,
    changes: &mpsc::Receiver<(ServedChange, mpsc::Sender<()>)>,
    stop: &AtomicBool,
    stats: &Mutex<HashMap<u16, ServiceStats>>,
    pinned: &libbpf_rs::MapHandle,
    maps: &KernelMaps,
) {
    let mut buf = vec![0u8; 65536];
    let mut out = Vec::new();
    // Zeros at once, so the counters exist from the start.
    publish(jobs, stats, pinned);
    let mut published = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        while let Ok((change, done)) = changes.try_recv() {
            apply_change(jobs, change, stats, pinned);
            publish(jobs, stats, pinned);
            let _ = done.send(());
        }
        let now = Instant::now();
        let mut wake = now + IDLE_WAIT;
        let mut taken = 0usize;
        for (socket, service) in jobs.iter_mut() {
            // Everything queued now, then what is due.
            while let Ok((n, from)) = socket.recv_from(&mut buf) {
                if let std::net::SocketAddr::V4(from) = from {
                    service.handle(Instant::now(), from, &buf[..n], &mut out);
                    // Before the reply to a position query is sent.
                    if let Some(after) = service.take_release() {
                        let released = maps.release_rounds_after(service.job, after);
                        service.released(released);
                    }
                    taken += 1;
                }
            }
            if let Some(at) = service.poll(Instant::now(), &mut out) {
                wake = wake.min(at);
            }
            for t in out.drain(..) {
                let _ = socket.send_to(&t.datagram, t.to);
            }
        }
        // The counters go out every PUBLISH_EVERY, not at every wake-up (a
        // bpf syscall each, and this thread wakes per burst of RESULTs).
        if published.elapsed() >= PUBLISH_EVERY {
            published = Instant::now();
            publish(jobs, stats, pinned);
        }
        if taken > 0 && jobs.iter().all(|(_, s)| s.upstream.is_none()) {
            // Datagrams keep coming: read again after READ_EVERY rather than
            // at the next one (see READ_EVERY).
            let pause = READ_EVERY.min(wake.saturating_duration_since(Instant::now()));
            std::thread::sleep(pause);
            continue;
        }
        let mut fds: Vec<libc::pollfd> = jobs
            .iter()
            .map(|(s, _)| libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 })
            .collect();
        let timeout = wake.saturating_duration_since(Instant::now()).as_millis().min(IDLE_WAIT.as_millis()) as libc::c_int;
        // SAFETY: fds is a valid array of pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout.max(1)) };
    }
    publish(jobs, stats, pinned);
}

/// How often the serving thread publishes its counters (metrics, status).
const PUBLISH_EVERY: Duration = Duration::from_millis(50);

/// Hand the counters to the metrics endpoint and the pinned map.
fn publish(jobs: &[(UdpSocket, ResultService)], stats: &Mutex<HashMap<u16, ServiceStats>>, pinned: &libbpf_rs::MapHandle) {
    if let Ok(mut s) = stats.lock() {
        for (_, service) in jobs {
            let now = service.stats();
            if s.insert(service.job, now) != Some(now) {
                let key = u32::from(service.job);
                let _ = pinned.update(&key.to_ne_bytes(), abi::as_bytes(&now), libbpf_rs::MapFlags::ANY);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::abi::{self, Op};
    use crate::wire::proto::{AckMode, AggHeader};

    const JOB: u16 = 9;
    const NODE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);

    fn worker(r: u16) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1 + r as u8), 5000)
    }

    fn service(mode: AckMode) -> ResultService {
        let cfg = ReliabilityConfig { ack_mode: mode, ..ReliabilityConfig::default() };
        ResultService::new(JOB, vec![NODE], (0..3).map(worker).collect(), cfg)
    }

    /// RESULT of fragment `index` (of `per` elements) of `round`, named by
    /// contribution seq `seq`.
    fn result(round: u32, seq: u32, index: u32, last: bool) -> Vec<u8> {
        let hdr = AggHeader {
            job: JOB,
            rank: abi::RESULT_RANK,
            seq,
            round: Round(round),
            frag_off: index * 4,
            op: Op::Sum,
            flags: abi::AGG_F_RESULT | if last { abi::AGG_F_LAST_FRAGMENT } else { 0 },
            count: 4,
        };
        let mut out = Vec::new();
        proto::encode_agg_into(&hdr, &[1, 2, 3, 4], &mut out).unwrap();
        out
    }

    fn ack(rank: u16, seqs: &[u32]) -> Vec<u8> {
        let mut bm = SeqBitmap::new(seqs[0], 64).unwrap();
        for &s in seqs {
            bm.set(s);
        }
        let mut out = Vec::new();
        AckMessage { id: JOB, rank, kind: AckKind::Aggregation, flags: 0, bitmap: bm }.encode_into(&mut out).unwrap();
        out
    }

    fn acks_to(out: &[Transmit]) -> Vec<(SocketAddrV4, u16, Vec<u32>)> {
        out.iter()
            .filter_map(|t| AckMessage::decode(&t.datagram).ok().map(|a| (t.to, a.rank, a.bitmap.received().collect())))
            .collect()
    }

    fn resends(out: &[Transmit]) -> Vec<(SocketAddrV4, u32)> {
        out.iter().filter_map(|t| proto::split_agg(&t.datagram).ok().map(|(h, _)| (t.to, h.seq))).collect()
    }

    #[test]
    fn a_result_is_acknowledged_to_every_worker_under_its_seq() {
        let mut s = service(AckMode::Packet);
        let (now, mut out) = (Instant::now(), Vec::new());
        s.handle(now, worker(1), &result(5, 40, 0, false), &mut out);
        let acks = acks_to(&out);
        assert_eq!(acks, (0..3).map(|r| (worker(r), r, vec![40])).collect::<Vec<_>>());
        assert_eq!((s.stats().results, s.stats().acks_sent, s.held()), (1, 3, 1));
        assert_eq!((s.stats().rounds, s.stats().workers_behind), (1, 3), "every worker owes the ACK of its copy");
        // A copy is acknowledged again, not taken again.
        out.clear();
        s.handle(now, worker(1), &result(5, 40, 0, false), &mut out);
        assert_eq!(acks_to(&out).len(), 3);
        assert_eq!((s.stats().results, s.stats().duplicate_results), (1, 1));
    }

    #[test]
    fn only_the_worker_that_misses_a_result_gets_it_again() {
        let mut s = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        s.handle(t0, NODE_SOCKET, &result(5, 40, 0, false), &mut out);
        s.handle(t0, worker(0), &result(5, 41, 1, true), &mut out);
        out.clear();
        // Workers 0 and 2 acknowledge both copies; worker 1 only the first.
        s.handle(t0, worker(0), &ack(0, &[40, 41]), &mut out);
        s.handle(t0, worker(2), &ack(2, &[40, 41]), &mut out);
        s.handle(t0, worker(1), &ack(1, &[40]), &mut out);
        assert_eq!(s.stats().acks_received, 3);
        // Until the RTO nothing is resent; then only 41, only to worker 1.
        let at = s.poll(t0, &mut out).expect("a timer for the missing ACK");
        assert!(resends(&out).is_empty());
        let later = at.max(t0) + Duration::from_millis(1);
        s.poll(later, &mut out);
        assert_eq!(resends(&out), vec![(worker(1), 41)]);
        assert_eq!(s.stats().resent, 1);
        out.clear();
        s.handle(later, worker(1), &ack(1, &[40, 41]), &mut out);
        assert_eq!(s.held(), 0, "every copy acknowledged: nothing held");
        s.poll(later + Duration::from_secs(5), &mut out);
        assert!(resends(&out).is_empty());
    }

    const NODE_SOCKET: SocketAddrV4 = SocketAddrV4::new(NODE, 40000);

    #[test]
    fn forged_results_and_acks_are_refused_and_change_nothing() {
        let mut s = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        let stranger = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 66), 5000);
        s.handle(t0, stranger, &result(5, 40, 0, true), &mut out);
        // Worker 1's address on another port is not worker 1's socket.
        s.handle(t0, SocketAddrV4::new(*worker(1).ip(), 6000), &result(5, 40, 0, true), &mut out);
        assert!(out.is_empty(), "a forged RESULT acknowledges nothing");
        assert_eq!((s.stats().refused_results, s.stats().results), (2, 0));
        s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
        out.clear();
        // Worker 2's ACK sent from worker 0's socket must not stop its resend.
        s.handle(t0, worker(0), &ack(2, &[40]), &mut out);
        s.handle(t0, worker(0), &ack(0, &[40]), &mut out);
        s.handle(t0, worker(1), &ack(1, &[40]), &mut out);
        assert_eq!(s.stats().refused_acks, 1);
        s.poll(t0 + Duration::from_secs(2), &mut out);
        assert_eq!(resends(&out), vec![(worker(2), 40)]);
    }

    #[test]
    fn an_ack_before_the_result_counts_and_a_newer_round_retires_the_older() {
        let mut s = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        // Worker 2's ACK of seq 40 arrives before the node took RESULT 40.
        s.handle(t0, worker(2), &ack(2, &[40]), &mut out);
        s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
        s.handle(t0, worker(0), &ack(0, &[40]), &mut out);
        out.clear();
        s.poll(t0 + Duration::from_secs(2), &mut out);
        assert_eq!(resends(&out), vec![(worker(1), 40)], "worker 2's early ACK counted");
        // Round 6's first RESULT (fragment 1 first): every worker finished
        // round 5, so its RESULT 40 is no longer held or resent.
        out.clear();
        s.handle(t0 + Duration::from_secs(2), worker(0), &result(6, 42, 1, true), &mut out);
        s.handle(t0 + Duration::from_secs(2), worker(0), &result(6, 41, 0, false), &mut out);
        assert_eq!(s.held(), 2, "round 6's two RESULTs, both registered (fragment 0 came second)");
        for r in 0..3 {
            s.handle(t0 + Duration::from_secs(2), worker(r), &ack(r, &[41, 42]), &mut out);
        }
        out.clear();
        s.poll(t0 + Duration::from_secs(10), &mut out);
        assert!(resends(&out).is_empty());
        assert_eq!(s.held(), 0);
    }

    /// Worker `rank`'s position query of `job`, with nonce `nonce`.
    fn query(job: u16, rank: u16, nonce: u32) -> Vec<u8> {
        PositionMessage::query(job, rank, nonce).encode().to_vec()
    }

    /// The position replies in `out`: (destination, message).
    fn replies(out: &[Transmit]) -> Vec<(SocketAddrV4, PositionMessage)> {
        out.iter().filter_map(|t| PositionMessage::decode(&t.datagram).ok().map(|m| (t.to, m))).collect()
    }

    #[test]
    fn a_workers_position_query_is_answered_with_the_round_after_next_and_the_seq_after_the_newest() {
        let mut s = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        // Nothing seen: a new run starts at 0, 0, and the reply says so.
        s.handle(t0, worker(2), &query(JOB, 2, 77), &mut out);
        let r = replies(&out);
        assert_eq!(r.len(), 1, "{out:?}");
        assert_eq!(r[0].0, worker(2), "the reply goes to the asking socket");
        assert!(r[0].1.is_reply() && r[0].1.is_fresh());
        assert_eq!((r[0].1.job, r[0].1.rank, r[0].1.nonce, r[0].1.round, r[0].1.agg_seq), (JOB, 2, 77, Round(0), 0));
        // Before the reply goes out, the node releases what an earlier run
        // left: with no RESULT seen, the job's unfinished slots of any round.
        assert_eq!(s.take_release(), Some(None));
        assert_eq!(s.take_release(), None, "taken once");
        // Round 5 (seqs 40, 41), then a late copy of round 4 (seq 30): the
        // newest round and seq count, in serial order.
        s.handle(t0, worker(0), &result(5, 41, 1, true), &mut out);
        s.handle(t0, worker(0), &result(5, 40, 0, false), &mut out);
        s.handle(t0, worker(1), &result(4, 30, 0, true), &mut out);
        out.clear();
        s.handle(t0, worker(0), &query(JOB, 0, 78), &mut out);
        let r = replies(&out);
        assert_eq!(r.len(), 1);
        assert!(r[0].1.is_reply() && !r[0].1.is_fresh());
        // Round 6 is skipped: a run cut off in it may hold slots of it.
        assert_eq!((r[0].0, r[0].1.nonce, r[0].1.round, r[0].1.agg_seq), (worker(0), 78, Round(7), 42));
        assert_eq!(s.take_release(), Some(Some(Round(5))), "the slots of rounds after the newest RESULT's");
        assert_eq!(s.position(), (Round(7), 42, false));
        assert_eq!((s.stats().position_queries, s.stats().refused_queries), (2, 0));
        // Serial order across the wrap: after u32::MAX, 0 is newer.
        let mut s = service(AckMode::Packet);
        s.handle(t0, worker(0), &result(u32::MAX - 1, u32::MAX - 1, 0, true), &mut out);
        assert_eq!(s.position(), (Round(0), u32::MAX, false));
        s.handle(t0, worker(0), &result(u32::MAX, u32::MAX, 0, true), &mut out);
        s.handle(t0, worker(0), &result(0, 0, 0, true), &mut out);
        assert_eq!(s.position(), (Round(2), 1, false));
    }

    #[test]
    fn a_position_query_of_a_stranger_or_a_malformed_one_is_refused_counted_and_changes_nothing() {
        let mut s = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
        let before = (s.position(), s.held());
        out.clear();
        let stranger = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 66), 5000);
        let mut bad_flags = query(JOB, 0, 1);
        bad_flags[20] = 0x80;
        let mut with_position = query(JOB, 0, 1);
        with_position[15] = 9;
        let reply = PositionMessage::reply(&PositionMessage::query(JOB, 0, 1), Round(1), 1, false).encode().to_vec();
        let refused: Vec<(SocketAddrV4, Vec<u8>)> = vec![
            (stranger, query(JOB, 0, 1)),
            // Worker 1's address on another port is not worker 1's socket.
            (SocketAddrV4::new(*worker(1).ip(), 6000), query(JOB, 1, 1)),
            // Worker 0's socket asking as worker 2.
            (worker(0), query(JOB, 2, 1)),
            (worker(0), query(JOB, 7, 1)),
            (worker(0), query(JOB + 1, 0, 1)),
            (worker(0), query(JOB, 0, 1)[..23].to_vec()),
            (worker(0), [query(JOB, 0, 1), vec![0]].concat()),
            (worker(0), bad_flags),
            (worker(0), with_position),
            (worker(0), reply),
            (worker(0), b"AGP1".to_vec()),
            // From the node's own address: not a worker either.
            (NODE_SOCKET, query(JOB, 0, 1)),
        ];
        for (from, d) in &refused {
            s.handle(t0, *from, d, &mut out);
        }
        assert!(out.is_empty(), "nothing answered: {out:?}");
        assert_eq!((s.stats().refused_queries, s.stats().position_queries), (refused.len() as u64, 0));
        assert_eq!((s.stats().other, s.stats().refused_acks, s.stats().refused_results), (0, 0, 0));
        assert_eq!((s.position(), s.held()), before, "a refused query changes nothing");
        assert_eq!(s.take_release(), None, "a refused query releases nothing");
        s.handle(t0, worker(1), &query(JOB, 1, 5), &mut out);
        assert_eq!(replies(&out).len(), 1);
    }

    #[test]
    fn a_tree_leaf_answers_positions_from_its_own_and_its_parents_results_and_refuses_the_parent() {
        let mut s = leaf(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
        s.handle(t0, SocketAddrV4::new(PARENT_ADDR, 33333), &parent_result(6, 41, 0, true), &mut out);
        assert_eq!(s.position(), (Round(8), 42, false));
        out.clear();
        s.handle(t0, SocketAddrV4::new(PARENT_ADDR, 7501), &query(JOB, 0, 1), &mut out);
        assert!(out.is_empty());
        assert_eq!(s.stats().refused_queries, 1);
    }

    #[test]
    fn a_job_replaced_by_a_reload_answers_positions_from_where_its_predecessor_was() {
        let mut old = service(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        old.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
        let other = ResultService::new(JOB + 1, vec![NODE], vec![worker(0)], ReliabilityConfig::default());
        let mut added = vec![(JobSocket::TakeOver(1), service(AckMode::Packet)), (JobSocket::TakeOver(2), other)];
        carry_positions([&old].into_iter(), &mut added);
        assert_eq!(added[0].1.position(), (Round(7), 41, false), "the same job: its kernel state stayed");
        assert_eq!(added[1].1.position(), (Round(0), 0, true), "another job starts fresh");
    }

    const PARENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 9, 1);
    const PARENT: ParentConfig = ParentConfig { addr: PARENT_ADDR, port: 7500, job: 20, rank: 1, result_port: Some(7501), tree_workers: None };

    /// A leaf of a tree: `service(mode)` whose RESULTs go to [`PARENT`].
    fn leaf(mode: AckMode) -> ResultService {
        let cfg = ReliabilityConfig { ack_mode: mode, ..ReliabilityConfig::default() };
        service(mode).with_parent(&PARENT, 7501, cfg)
    }

    /// `result(..)` as the parent's RESULT (its job id).
    fn parent_result(round: u32, seq: u32, index: u32, last: bool) -> Vec<u8> {
        let mut d = result(round, seq, index, last);
        d[4..6].copy_from_slice(&PARENT.job.to_be_bytes());
        d
    }

    fn parent_ack(seqs: &[u32]) -> Vec<u8> {
        let mut d = ack(PARENT.rank, seqs);
        d[4..6].copy_from_slice(&PARENT.job.to_be_bytes());
        d
    }

    /// The AGG1 datagrams in `out`: (destination, header).
    fn aggs(out: &[Transmit]) -> Vec<(SocketAddrV4, AggHeader)> {
        out.iter().filter_map(|t| proto::split_agg(&t.datagram).ok().map(|(h, _)| (t.to, h))).collect()
    }

    #[test]
    fn a_leaf_sends_its_result_upstream_as_its_contribution_and_resends_it_until_the_parent_acks() {
        let mut s = leaf(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        s.handle(t0, worker(1), &result(5, 40, 0, true), &mut out);
        // The workers' contributions are acknowledged on the kernel's behalf.
        assert_eq!(acks_to(&out).len(), 3);
        // One contribution to the parent's job port: its job, this node's
        // rank, RESULT cleared (LAST_FRAGMENT kept), the RESULT's seq.
        let up = aggs(&out);
        assert_eq!(up.len(), 1, "{up:?}");
        let (to, h) = up[0];
        assert_eq!(to, SocketAddrV4::new(PARENT_ADDR, 7500));
        assert_eq!((h.job, h.rank, h.seq, h.round, h.flags), (20, 1, 40, Round(5), abi::AGG_F_LAST_FRAGMENT));
        assert_eq!((s.held(), s.stats().upstream_sent, s.stats().upstream_held), (0, 1, 1), "the partial result is not the workers'");
        // Unacknowledged: resent after the RTO, to the parent only.
        out.clear();
        s.poll(t0 + Duration::from_secs(2), &mut out);
        assert_eq!(aggs(&out).iter().map(|(to, h)| (*to, h.job, h.seq)).collect::<Vec<_>>(), vec![(SocketAddrV4::new(PARENT_ADDR, 7500), 20, 40)]);
        assert_eq!(s.stats().upstream_resent, 1);
        // Another rank's ACK, or one from elsewhere, stops nothing.
        let mut other = ack(0, &[40]);
        other[4..6].copy_from_slice(&20u16.to_be_bytes());
        s.handle(t0, SocketAddrV4::new(PARENT_ADDR, 7501), &other, &mut out);
        assert_eq!(s.stats().refused_acks, 1);
        s.handle(t0, SocketAddrV4::new(PARENT_ADDR, 7501), &parent_ack(&[40]), &mut out);
        assert_eq!((s.stats().upstream_acks, s.stats().upstream_held), (1, 0));
        out.clear();
        s.poll(t0 + Duration::from_secs(10), &mut out);
        assert!(aggs(&out).is_empty(), "acknowledged: never resent");
    }

    #[test]
    fn a_leaf_acknowledges_the_parents_result_and_delivers_it_to_every_worker_until_each_acked() {
        let mut s = leaf(AckMode::Packet);
        let (t0, mut out) = (Instant::now(), Vec::new());
        s.handle(t0, worker(0), &result(5, 40, 0, true), &mut out);
        out.clear();
        let from_parent = SocketAddrV4::new(PARENT_ADDR, 33333);
        s.handle(t0, from_parent, &parent_result(5, 40, 0, true), &mut out);
        // ACK to the parent's result port, under this node's rank in its job.
        let acks: Vec<_> = out.iter().filter_map(|t| AckMessage::decode(&t.datagram).ok().map(|a| (t.to, a.id, a.rank, a.bitmap.received().collect::<Vec<_>>()))).collect();
        assert_eq!(acks, vec![(SocketAddrV4::new(PARENT_ADDR, 7501), 20, 1, vec![40])]);
        // A copy to each worker, under this job's id, seq as it came.
        let copies: Vec<_> = aggs(&out).iter().map(|(to, h)| (*to, h.job, h.seq, h.is_result())).collect();
        assert_eq!(copies, (0..3).map(|r| (worker(r), JOB, 40, true)).collect::<Vec<_>>());
        assert_eq!((s.stats().parent_results, s.stats().parent_acks_sent, s.held()), (1, 1, 1));
        assert_eq!(s.stats().upstream_held, 0, "the parent's RESULT acknowledges the contribution to it");
        // A copy of it again (the parent resent: our ACK was lost): acknowledged, not delivered again.
        out.clear();
        s.handle(t0, from_parent, &parent_result(5, 40, 0, true), &mut out);
        assert_eq!((acks_to(&out).len(), aggs(&out).len(), s.stats().duplicate_parent_results), (1, 0, 1));
        // Workers 0 and 2 acknowledge; only worker 1 gets it again.
        s.handle(t0, worker(0), &ack(0, &[40]), &mut out);
        s.handle(t0, worker(2), &ack(2, &[40]), &mut out);
        out.clear();
        s.poll(t0 + Duration::from_secs(2), &mut out);
        assert_eq!(resends(&out), vec![(worker(1), 40)]);
        // Something else from the parent's address never reaches a worker.
        out.clear();
        s.handle(t0, from_parent, &result(5, 41, 1, true), &mut out);
        assert!(out.is_empty() && s.stats().refused_results == 1);
    }

    #[test]
    fn group_mode_acknowledges_on_behalf_once_results_stop_for_the_delay() {
        let mut s = service(AckMode::Group);
        let delay = ReliabilityConfig::default().ack_delay;
        let (t0, mut out) = (Instant::now(), Vec::new());
        s.handle(t0, worker(0), &result(5, 40, 0, false), &mut out);
        assert!(acks_to(&out).is_empty(), "group mode waits");
        // The call's last fragment: its RESULT copies acknowledge the
        // workers' contributions, so the ACK waits too.
        s.handle(t0, worker(0), &result(5, 41, 1, true), &mut out);
        assert!(acks_to(&out).is_empty(), "the last fragment's ACK waits");
        // Next calls (one fragment each) within the delay postpone it.
        let mut at = t0;
        for (round, seq) in [(6, 42), (7, 43), (8, 44)] {
            at += delay / 2;
            s.handle(at, worker(0), &result(round, seq, 0, true), &mut out);
            s.poll(at, &mut out);
            assert!(acks_to(&out).is_empty(), "round {round}: no ACK while calls keep coming");
        }
        assert_eq!(s.poll(at, &mut out), Some(at + delay), "due once idle for the delay");
        // Idle for the delay: one ACK to each worker of everything.
        s.poll(at + delay, &mut out);
        let acks = acks_to(&out);
        assert_eq!(acks.len(), 3, "{acks:?}");
        assert!(acks.iter().all(|(_, _, seqs)| seqs == &vec![40, 41, 42, 43, 44]));
        assert_eq!(s.stats().acks_sent, 3);
    }

    #[test]
    fn a_result_of_the_next_round_retires_the_round_for_every_worker_without_their_acks() {
        let mut s = service(AckMode::Group);
        let (t0, mut out) = (Instant::now(), Vec::new());
        // A stream of one-fragment calls and no worker ACK at all: each
        // call's RESULT retires the one before, nothing is resent.
        for i in 0..50u32 {
            let at = t0 + Duration::from_micros(100) * i;
            s.handle(at, worker(0), &result(5 + i, 40 + i, 0, true), &mut out);
            s.poll(at, &mut out);
            assert_eq!(s.held(), 1, "call {i}: only the newest RESULT is held");
        }
        assert_eq!((s.stats().rounds, s.stats().acks_received), (50, 0));
        assert!(resends(&out).is_empty(), "nothing resent: {:?}", resends(&out));
        // The last call's copies wait for the workers' ACKs, and are resent
        // to a worker whose ACK does not come.
        s.handle(t0 + Duration::from_millis(6), worker(0), &ack(0, &[89]), &mut out);
        s.handle(t0 + Duration::from_millis(6), worker(1), &ack(1, &[89]), &mut out);
        out.clear();
        s.poll(t0 + Duration::from_secs(2), &mut out);
        assert_eq!(resends(&out), vec![(worker(2), 89)]);
    }

    #[test]
    fn a_result_port_another_process_holds_fails_the_bind_and_names_the_job() {
        let taken = UdpSocket::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let text = format!(
            "[[job]]\nid = 12\nport = {}\nworkers = [\"10.0.0.1\"]\nresult_port = {port}\nresult_group = 1\nconsumer = \"node\"\n\n[[group]]\nid = 1\nmembers = [\"10.0.0.1:5000\"]\n",
            if port == 40000 { 40001 } else { 40000 }
        );
        let config = Config::parse(&text, "t.toml").expect("config");
        let err = BoundJobs::bind(&config, vec![NODE]).expect_err("the port is taken");
        let msg = format!("{err:#}");
        assert!(msg.contains("job 12") && msg.contains(&format!("result_port {port}")) && msg.contains("holds it"), "{msg}");
        drop(taken);
        let bound = BoundJobs::bind(&config, vec![NODE]).expect("free again");
        assert!(!bound.is_empty());
    }

    #[test]
    fn a_served_tree_job_is_bound_with_its_parent() {
        let (port, _) = free_ports();
        let text = format!(
            "[[job]]\nid = 12\nport = 7600\nworkers = [\"10.0.0.1\"]\nresult_port = {port}\nresult_group = 1\nconsumer = \"node\"\nparent = {{ addr = \"10.0.9.1\", port = 7500, job = 20, rank = 3, result_port = 7501 }}\n\n{GROUP}"
        );
        let config = Config::parse(&text, "t.toml").expect("config");
        let bound = BoundJobs::bind(&config, vec![NODE]).expect("bound");
        let up = bound.add[0].1.upstream.as_ref().expect("the service sends upstream");
        assert_eq!(
            (up.contributions, up.acks_to, up.job, up.rank),
            ("10.0.9.1:7500".parse().unwrap(), "10.0.9.1:7501".parse().unwrap(), 20, 3)
        );
    }

    /// Two free UDP ports (bound and released at once).
    fn free_ports() -> (u16, u16) {
        let a = UdpSocket::bind("0.0.0.0:0").unwrap();
        let b = UdpSocket::bind("0.0.0.0:0").unwrap();
        (a.local_addr().unwrap().port(), b.local_addr().unwrap().port())
    }

    fn served_job(id: u16, result_port: u16, window: u32) -> String {
        format!(
            "[[job]]\nid = {id}\nport = {}\nworkers = [\"10.0.0.1\"]\nresult_port = {result_port}\nresult_group = 1\nwindow = {window}\nconsumer = \"node\"\n\n",
            30000 + id
        )
    }

    const GROUP: &str = "[[group]]\nid = 1\nmembers = [\"10.0.0.1:5000\"]\n";

    #[test]
    fn a_change_binds_only_new_ports_and_hands_a_removed_jobs_port_to_its_successor() {
        let (p, q) = free_ports();
        let old = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(2, q, 4)), "old.toml").unwrap();
        // Job 1 unchanged; job 2 changed (same port): removed and added,
        // its socket passed on, nothing bound (the old one still holds q).
        let holder = UdpSocket::bind(("0.0.0.0", q)).unwrap();
        let new = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(2, q, 8)), "new.toml").unwrap();
        let change = ServedChange::bind_change(&old, &new, vec![NODE]).expect("q passes on, nothing to bind");
        assert_eq!(change.jobs(), (vec![2], vec![2]));
        assert!(matches!(change.add[0].0, JobSocket::TakeOver(port) if port == q));
        // Job 2 removed, job 3 takes its port: the same hand-over.
        let new = Config::parse(&format!("{}{}{GROUP}", served_job(1, p, 4), served_job(3, q, 4)), "new.toml").unwrap();
        let change = ServedChange::bind_change(&old, &new, vec![NODE]).expect("q passes on");
        assert_eq!(change.jobs(), (vec![2], vec![3]));
        // A job on a port nobody of the old config held must bind it.
        drop(holder);
        let holder = UdpSocket::bind(("0.0.0.0", p)).unwrap();
        let new = Config::parse(&format!("{}{GROUP}", served_job(4, p, 4)), "new.toml").unwrap();
        let fresh = Config::default();
        let err = ServedChange::bind_change(&fresh, &new, vec![NODE]).expect_err("p is held");
        assert!(format!("{err:#}").contains("job 4"), "{err:#}");
        drop(holder);
        // Nothing changed: an empty change.
        assert!(ServedChange::bind_change(&old, &old, vec![NODE]).unwrap().is_empty());
    }
}
