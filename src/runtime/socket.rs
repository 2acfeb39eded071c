//! Socket backend, aggregator side: the aggregator process receives every
//! contribution on the job's port and reduces it in a
//! [`crate::wire::slots::SlotTable`], with the kernel's semantics
//! ([`crate::wire::slots::Slot::add`]): a slot per (job, round, frag_off),
//! each rank contributes to a slot at most once (a repeated contribution is
//! acknowledged again and not added again), the slot completes exactly once
//! when every rank has contributed, a contribution to a round the aggregator
//! already finished (or gave up on) is acknowledged and dropped.
//!
//! Flow control: at most `slots` slots (open or completed but not yet taken by
//! the collecting call) exist; a contribution that would need another is
//! dropped *without* an acknowledgement, so its sender retransmits it later
//! (self-clocking, like SwitchML). Accumulators and result buffers of freed
//! slots are reused.
//!
//! Acknowledgements: one [`RecvTracker`] per rank, so contributions are
//! acknowledged per packet or per group exactly as broadcast data is.

use std::net::SocketAddr;
use std::time::Instant;

use crate::wire::abi::Round;
use crate::wire::proto::AggHeader;
use crate::wire::slots::{Added, Refused, SlotKey, SlotTable};
use crate::runtime::backend::{AckIo, Backend, BackendKind, Completed, FragmentState};
use crate::wire::reliability::{RecvTracker, ReliabilityConfig, Verdict};

/// What the socket aggregator keeps with each slot.
#[derive(Debug, Default)]
struct Held {
    /// Complete: its RESULT is in the slot, waiting for the collecting call.
    done: bool,
    /// The RESULT was clamped, or a contribution carried OVERFLOW.
    overflow: bool,
}

/// Counters of the socket aggregator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketAggStats {
    /// Contributions added to a slot.
    pub added: u64,
    /// Duplicates (same seq, or same (round, frag_off, rank)): acknowledged, not added.
    pub duplicates: u64,
    /// Contributions to a finished round: acknowledged, dropped.
    pub stale: u64,
    /// Dropped unacknowledged because every slot was in use.
    pub no_slot: u64,
    /// Dropped: unknown rank, wrong source address, FLOAT32, or a shape
    /// (op, count) different from the slot's.
    pub invalid: u64,
    /// Slots completed.
    pub completed: u64,
}

/// The user-space aggregator of the socket backend (see the module docs).
#[derive(Debug)]
pub struct SocketAggregator {
    workers: u16,
    peers: Vec<SocketAddr>,
    trackers: Vec<RecvTracker>,
    slots: SlotTable<Held>,
    /// Complete slots not yet taken by the collecting call.
    done: Vec<SlotKey>,
    limit: usize,
    next_round: Round,
    stats: SocketAggStats,
}

impl SocketAggregator {
    /// An aggregator for `peers.len()` ranks (rank r sends from `peers[r]`),
    /// with at most `slots` slots.
    pub fn new(
        peers: Vec<SocketAddr>,
        cfg: ReliabilityConfig,
        slots: usize,
        first_round: Round,
    ) -> SocketAggregator {
        let limit = slots.max(1);
        SocketAggregator {
            workers: peers.len() as u16,
            trackers: (0..peers.len()).map(|_| RecvTracker::new(cfg)).collect(),
            peers,
            // Emptied slots are kept for reuse, up to twice the limit in
            // all (a call's shape and another's, e.g. a float call's scale
            // agreement), so that same-sized calls allocate nothing.
            slots: SlotTable::new(2 * limit),
            done: Vec::new(),
            limit,
            next_round: first_round,
            stats: SocketAggStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> SocketAggStats {
        self.stats
    }

    /// Slots in use (open or completed and not yet taken).
    pub fn slots_in_use(&self) -> usize {
        self.slots.len()
    }

    /// Adds a contribution; returns whether it should be acknowledged.
    fn contribute(&mut self, hdr: &AggHeader, payload: &[u8]) -> bool {
        if hdr.round.ahead_of(self.next_round) < 0 {
            self.stats.stale += 1;
            return true;
        }
        let key = (hdr.round, hdr.frag_off);
        if !self.slots.contains(key) {
            let opened = self.slots.len() < self.limit
                && self.slots.open(key, hdr.op, usize::from(hdr.count), false, Held::default()).is_ok();
            if !opened {
                self.stats.no_slot += 1;
                return false;
            }
        }
        let Some((slot, held)) = self.slots.get_mut(key) else {
            return false;
        };
        if held.done {
            self.stats.duplicates += 1;
            return true;
        }
        match slot.add(hdr, payload, 1, self.workers) {
            Err(Refused::AlreadyAdded) => self.stats.duplicates += 1,
            Err(Refused::ShapeMismatch) => self.stats.invalid += 1,
            Ok(Added::Waiting) => self.stats.added += 1,
            Ok(Added::Complete) => {
                self.stats.added += 1;
                // Into the slot's own buffer: no allocation per fragment.
                let weight_sum = slot.accumulator().weight_sum();
                if let Ok(overflow) = slot.finish_into_self(weight_sum) {
                    held.overflow = overflow;
                }
                held.done = true;
                self.done.push(key);
                self.stats.completed += 1;
            }
        }
        true
    }
}

impl Backend for SocketAggregator {
    fn kind(&self) -> BackendKind {
        BackendKind::Socket
    }

    fn reserve(&mut self, op: crate::wire::abi::Op, count: usize, n: usize) {
        // Enough slots of this shape for the call, made now, so that later
        // calls of the same size allocate nothing.
        self.slots.reserve(op, count, false, n.min(self.limit));
    }

    fn expect_round(&mut self, round: Round, _seq_base: u32, _now: Instant) {
        self.next_round = round;
        for (_, slot, _) in self.slots.close_where(|(r, _), _| r.ahead_of(round) < 0) {
            self.slots.recycle(slot);
        }
        let slots = &self.slots;
        self.done.retain(|&key| slots.contains(key));
    }

    fn on_agg(
        &mut self,
        hdr: &AggHeader,
        payload: &[u8],
        from: SocketAddr,
        now: Instant,
        io: &mut AckIo,
    ) {
        let r = hdr.rank as usize;
        if hdr.is_result() || hdr.is_float() || r >= self.peers.len() || self.peers[r] != from {
            self.stats.invalid += 1;
            return;
        }
        let mut emit = |bm: &crate::wire::proto::SeqBitmap| io.send(from, hdr.rank, bm);
        match self.trackers[r].check(hdr.seq) {
            Verdict::Duplicate => {
                self.stats.duplicates += 1;
                self.trackers[r].reack(hdr.seq, &mut emit);
            }
            Verdict::New => {
                if self.contribute(hdr, payload) {
                    self.trackers[r].record(hdr.seq, hdr.is_last_fragment(), now, &mut emit);
                }
            }
        }
    }

    fn poll(&mut self, now: Instant, io: &mut AckIo) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for (r, t) in self.trackers.iter_mut().enumerate() {
            let to = self.peers[r];
            if let Some(d) = t.poll(now, &mut |bm| io.send(to, r as u16, bm)) {
                next = Some(next.map_or(d, |n: Instant| n.min(d)));
            }
        }
        next
    }

    fn take_completed(&mut self, round: Round, f: &mut dyn FnMut(Completed<'_>)) {
        let mut k = 0;
        while k < self.done.len() {
            let key = self.done[k];
            if key.0 != round {
                k += 1;
                continue;
            }
            self.done.swap_remove(k);
            if let Some((slot, held)) = self.slots.close(key) {
                f(Completed {
                    frag_off: key.1,
                    values: slot.result(),
                    overflow: held.overflow,
                });
                self.slots.recycle(slot);
            }
        }
    }

    fn fragment_state(&self, round: Round, frag_off: u32) -> FragmentState {
        match self.slots.get((round, frag_off)) {
            None => FragmentState {
                contributors: Some(Vec::new()),
                partial: None,
            },
            Some((slot, _)) => FragmentState {
                contributors: Some(slot.contributors().collect()),
                partial: slot.accumulator().finish().ok().and_then(|r| r.ints().map(|v| v.to_vec())),
            },
        }
    }
}
