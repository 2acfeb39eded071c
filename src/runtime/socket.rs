//! Socket backend, aggregator side: the aggregator process receives every
//! contribution on the job's port and reduces it with the reference
//! [`Accumulator`], with the kernel's semantics: a slot per (job, round,
//! frag_off), each rank contributes to a slot at most once (a repeated
//! contribution is acknowledged again and not added again), the slot completes
//! exactly once when every rank has contributed, a contribution to a round the
//! aggregator already finished (or gave up on) is acknowledged and dropped.
//!
//! Flow control: at most `slots` slots (open or completed but not yet taken by
//! the collecting call) exist; a contribution that would need another is
//! dropped *without* an acknowledgement, so its sender retransmits it later
//! (self-clocking, like SwitchML). Accumulators and result buffers of freed
//! slots are reused.
//!
//! Acknowledgements: one [`RecvTracker`] per rank, so contributions are
//! acknowledged per packet or per group exactly as broadcast data is.

use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::time::Instant;

use crate::wire::abi;
use crate::wire::proto::AggHeader;
use crate::wire::reducer::Accumulator;
use crate::runtime::backend::{AckIo, Backend, BackendKind, Completed, FragmentState};
use crate::runtime::reliability::{RecvTracker, ReliabilityConfig, Verdict};

#[derive(Debug)]
struct Slot {
    round: u32,
    frag_off: u32,
    acc: Accumulator,
    ranks: Vec<u64>,
    contributors: u16,
    done: bool,
    result: Vec<i32>,
    overflow: bool,
}

impl Slot {
    /// An unused slot around `acc` with a rank bitmap of `words` words and
    /// room for `result` elements.
    fn empty(acc: Accumulator, words: usize, result: usize) -> Slot {
        Slot {
            round: 0,
            frag_off: 0,
            acc,
            ranks: vec![0; words],
            contributors: 0,
            done: false,
            result: Vec::with_capacity(result),
            overflow: false,
        }
    }
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
    peers: Vec<SocketAddrV4>,
    trackers: Vec<RecvTracker>,
    slots: Vec<Slot>,
    index: HashMap<(u32, u32), usize>,
    free: Vec<usize>,
    done: Vec<usize>,
    limit: usize,
    next_round: u32,
    stats: SocketAggStats,
}

impl SocketAggregator {
    /// An aggregator for `peers.len()` ranks (rank r sends from `peers[r]`),
    /// with at most `slots` slots.
    pub fn new(
        peers: Vec<SocketAddrV4>,
        cfg: ReliabilityConfig,
        slots: usize,
        first_round: u32,
    ) -> SocketAggregator {
        SocketAggregator {
            workers: peers.len() as u16,
            trackers: (0..peers.len()).map(|_| RecvTracker::new(cfg)).collect(),
            peers,
            slots: Vec::new(),
            index: HashMap::new(),
            free: Vec::new(),
            done: Vec::new(),
            limit: slots.max(1),
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
        self.index.len()
    }

    fn free_slot(&mut self, i: usize) {
        let s = &self.slots[i];
        self.index.remove(&(s.round, s.frag_off));
        self.free.push(i);
    }

    fn alloc(&mut self, hdr: &AggHeader) -> Option<usize> {
        if self.index.len() >= self.limit {
            return None;
        }
        let words = (self.workers as usize).div_ceil(64);
        // A free slot of the same shape keeps its accumulator's allocation.
        let same = self.free.iter().rposition(|&i| {
            let a = &self.slots[i].acc;
            a.op() == hdr.op && a.count() == hdr.count as usize
        });
        // Otherwise a new slot (a slot of another shape would be reallocated
        // anyway, and is kept for its shape), up to 2 × the limit in all.
        let steal = || self.slots.len() >= 2 * self.limit;
        let pick = match same {
            Some(k) => Some(self.free.swap_remove(k)),
            None if steal() => self.free.pop(),
            None => None,
        };
        let i = if let Some(i) = pick {
            let s = &mut self.slots[i];
            if s.acc.reset(hdr.op, hdr.count as usize, false).is_err() {
                self.free.push(i);
                return None;
            }
            s.ranks.clear();
            s.ranks.resize(words, 0);
            i
        } else {
            let acc = Accumulator::new(hdr.op, hdr.count as usize, false).ok()?;
            self.slots.push(Slot::empty(acc, words, 0));
            self.slots.len() - 1
        };
        let s = &mut self.slots[i];
        s.round = hdr.round;
        s.frag_off = hdr.frag_off;
        s.contributors = 0;
        s.done = false;
        s.overflow = false;
        self.index.insert((hdr.round, hdr.frag_off), i);
        Some(i)
    }

    /// Adds a contribution; returns whether it should be acknowledged.
    fn contribute(&mut self, hdr: &AggHeader, payload: &[u8]) -> bool {
        if abi::rounds_ahead(hdr.round, self.next_round) < 0 {
            self.stats.stale += 1;
            return true;
        }
        let i = match self.index.get(&(hdr.round, hdr.frag_off)) {
            Some(&i) => i,
            None => match self.alloc(hdr) {
                Some(i) => i,
                None => {
                    self.stats.no_slot += 1;
                    return false;
                }
            },
        };
        let r = hdr.rank as usize;
        let s = &mut self.slots[i];
        let (w, b) = (r / 64, 1u64 << (r % 64));
        if s.done || s.ranks[w] & b != 0 {
            self.stats.duplicates += 1;
            return true;
        }
        if s.acc.op() != hdr.op
            || s.acc.count() != hdr.count as usize
            || s.acc.add_be_bytes(payload, 1).is_err()
        {
            self.stats.invalid += 1;
            return true;
        }
        s.ranks[w] |= b;
        s.contributors += 1;
        // A clamped input (OVERFLOW on a contribution) makes the result
        // inexact too, as at the kernel aggregator.
        s.overflow |= hdr.flags & abi::AGG_F_OVERFLOW != 0;
        self.stats.added += 1;
        if s.contributors == self.workers {
            // Into the slot's own vector: no allocation per fragment.
            if let Ok(o) = s.acc.finish_ints_into(s.acc.weight_sum(), &mut s.result) {
                s.overflow |= o;
            }
            s.done = true;
            self.done.push(i);
            self.stats.completed += 1;
        }
        true
    }
}

impl Backend for SocketAggregator {
    fn kind(&self) -> BackendKind {
        BackendKind::Socket
    }

    fn reserve(&mut self, op: crate::wire::abi::Op, count: usize, n: usize) {
        // Enough free or used slots of this shape for the call, made now, so
        // that later calls of the same size allocate nothing.
        let n = n.min(self.limit);
        let mut have = self
            .slots
            .iter()
            .filter(|s| s.acc.op() == op && s.acc.count() == count)
            .count();
        let words = (self.workers as usize).div_ceil(64);
        while have < n && self.slots.len() < 2 * self.limit {
            let Ok(acc) = Accumulator::new(op, count, false) else {
                return;
            };
            self.slots.push(Slot::empty(acc, words, count));
            self.free.push(self.slots.len() - 1);
            have += 1;
        }
    }

    fn expect_round(&mut self, round: u32, _seq_base: u32, _now: Instant) {
        self.next_round = round;
        let stale: Vec<usize> = self
            .index
            .values()
            .copied()
            .filter(|&i| abi::rounds_ahead(self.slots[i].round, round) < 0)
            .collect();
        for i in stale {
            self.free_slot(i);
        }
        let slots = &self.slots;
        let index = &self.index;
        self.done
            .retain(|&i| index.get(&(slots[i].round, slots[i].frag_off)) == Some(&i));
    }

    fn on_agg(
        &mut self,
        hdr: &AggHeader,
        payload: &[u8],
        from: SocketAddrV4,
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

    fn take_completed(&mut self, round: u32, f: &mut dyn FnMut(Completed<'_>)) {
        let mut k = 0;
        while k < self.done.len() {
            let i = self.done[k];
            if self.slots[i].round == round {
                let s = &self.slots[i];
                f(Completed {
                    frag_off: s.frag_off,
                    values: &s.result,
                    overflow: s.overflow,
                });
                self.done.swap_remove(k);
                self.free_slot(i);
            } else {
                k += 1;
            }
        }
    }

    fn fragment_state(&self, round: u32, frag_off: u32) -> FragmentState {
        match self.index.get(&(round, frag_off)) {
            None => FragmentState {
                contributors: Some(Vec::new()),
                partial: None,
            },
            Some(&i) => {
                let s = &self.slots[i];
                let ranks = (0..self.workers)
                    .filter(|&r| s.ranks[r as usize / 64] & (1 << (r % 64)) != 0)
                    .collect();
                let partial = s
                    .acc
                    .finish()
                    .ok()
                    .and_then(|r| r.ints().map(|v| v.to_vec()));
                FragmentState {
                    contributors: Some(ranks),
                    partial,
                }
            }
        }
    }
}
