//! The result service of one job as a state machine without sockets or a
//! clock ([`ResultService`]): ACKs on the kernel's behalf, RESULTs held
//! until every worker acknowledged, position answers, a tree leaf's
//! traffic with its parent.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

use anyhow::Result;

use crate::config::ParentConfig;
use crate::wire::abi::{self, Round};
use crate::wire::proto::{self, AckKind, AckMessage, AggHeader, MessageKind, PositionMessage, SeqBitmap};
use crate::wire::reliability::{RecvTracker, ReliabilityConfig, SendWindow, Verdict};

/// One datagram for the driver to send from the job's socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Destination (a worker's socket).
    pub to: SocketAddr,
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
pub(super) const EARLY_ACKS_MAX: usize = 4096;

/// The result service of one job (see the module docs).
#[derive(Debug)]
pub struct ResultService {
    pub(super) job: u16,
    /// Addresses of this node (the user-space path's RESULTs come from one).
    node: Vec<IpAddr>,
    /// Worker r's socket: its member socket in the result group.
    workers: Vec<SocketAddr>,
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
    pub(super) upstream: Option<Upstream>,
    /// The newest round and seq (serial order) of the RESULTs taken, for
    /// the position a new run must start at ([`ResultService::position`]).
    pub(super) seen: Option<Seen>,
    /// Set by an answered position query, taken by the serving thread
    /// before the reply goes out: release the job's unfinished slots of
    /// rounds after this newest RESULT's (`None`: of every round).
    release_after: Option<Option<Round>>,
    stats: ServiceStats,
}

/// How far a job's RESULTs have reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
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
pub(super) struct Upstream {
    /// The parent's address: what comes from it is the parent's (its
    /// RESULTs, TC copies and resends, and its ACKs).
    addr: IpAddr,
    /// The parent job's contribution port, where this node's RESULTs go.
    pub(super) contributions: SocketAddr,
    /// The parent job's result port, where its RESULTs are acknowledged.
    pub(super) acks_to: SocketAddr,
    /// The job id at the parent.
    pub(super) job: u16,
    /// This node's rank in the parent job.
    pub(super) rank: u16,
    /// This node's contributions until the parent acknowledges them.
    sent: RoundWindow,
    /// The parent's RESULTs taken, acknowledged to it.
    taken: RecvTracker,
}

/// A [`SendWindow`] of one call (round) at a time, numbered by the seqs of
/// the RESULTs it holds: a node without calls learns where a round starts
/// from its datagrams (see the module docs).
#[derive(Debug)]
pub(super) struct RoundWindow {
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
    pub fn new(job: u16, node: Vec<IpAddr>, workers: Vec<SocketAddr>, cfg: ReliabilityConfig) -> ResultService {
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
        let contributions = SocketAddr::new(parent.addr, parent.port);
        let mut sent = SendWindow::new(cfg, 1, 0);
        // The parent acknowledges a fragment once its RESULT completes
        // (on its kernel's behalf), so a hole in its ACKs is as likely
        // another child's loss as ours: only timeouts resend (as the
        // runtime's kernel-backend workers).
        sent.set_holes_are_losses(false);
        self.upstream = Some(Upstream {
            addr: contributions.ip(),
            contributions,
            acks_to: SocketAddr::new(contributions.ip(), parent_results),
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
    pub fn handle(&mut self, now: Instant, from: SocketAddr, datagram: &[u8], out: &mut Vec<Transmit>) {
        if PositionMessage::is_position(datagram) {
            self.on_position_query(from, datagram, out);
            return;
        }
        if self.upstream.as_ref().is_some_and(|u| u.addr == from.ip()) {
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
    fn on_position_query(&mut self, from: SocketAddr, datagram: &[u8], out: &mut Vec<Transmit>) {
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

    fn on_result(&mut self, now: Instant, from: SocketAddr, datagram: &[u8], out: &mut Vec<Transmit>) {
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
        if !self.node.contains(&from.ip()) && !self.workers.contains(&from) {
            self.stats.refused_results += 1;
            return;
        }
        let seq = hdr.seq;
        self.seen = Some(Seen::raise(self.seen, hdr.round, seq));
        if !hdr.is_last_fragment() {
            self.per = Some(u32::from(hdr.count));
        }
        let newer = match self.upstream.as_mut() {
            // The user-space path's RESULTs (ops the kernel does not run)
            // reach this socket from the node's own address through the
            // stack, past the TC program that copies the kernel's RESULTs
            // to the workers: this service sends their copies. Held
            // without them, a call of such an op waited for every worker's
            // retransmission timer, backed off further at every call.
            None if self.node.contains(&from.ip()) => {
                let workers = self.workers.clone();
                self.keep(now, &hdr, datagram, &mut |d: usize, b: &[u8]| out.push(Transmit { to: workers[d], datagram: b.to_vec() }))
            }
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

    fn on_ack(&mut self, now: Instant, from: SocketAddr, datagram: &[u8], out: &mut Vec<Transmit>) {
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
pub(super) fn fan_out(job: u16, workers: &[SocketAddr], bm: &SeqBitmap, out: &mut Vec<Transmit>, stats: &mut ServiceStats) {
    for (rank, &to) in workers.iter().enumerate() {
        if let Some(datagram) = ack_of(job, rank as u16, bm) {
            stats.acks_sent += 1;
            out.push(Transmit { to, datagram });
        }
    }
}

/// The AGK1 (kind aggregation) of `rank`'s datagrams of `job` in `bm`.
pub(super) fn ack_of(job: u16, rank: u16, bm: &SeqBitmap) -> Option<Vec<u8>> {
    let msg = AckMessage { id: job, rank, kind: AckKind::Aggregation, flags: 0, bitmap: *bm };
    let mut datagram = Vec::with_capacity(64);
    msg.encode_into(&mut datagram).ok().map(|_| datagram)
}
