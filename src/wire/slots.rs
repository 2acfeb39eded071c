//! The aggregation slot: what an aggregator holds for one fragment (round,
//! frag_off) while ranks contribute to it, and the one rule for adding a
//! contribution (PROTOCOL.md, "Semantics at the aggregator"): a slot has one
//! shape (op, count, integer or float) fixed by the contribution that opened
//! it; each rank adds at most once; the contributions' carried flags
//! (`AGG_F_CARRIED`: LAST_FRAGMENT, a clamped input's OVERFLOW) are ORed into
//! the RESULT; the slot is complete when every rank has added.
//!
//! Both user-space aggregators keep their slots in a [`SlotTable`]: the
//! AF_XDP path (`kernel::afxdp`, one table per job, with the kernel's
//! staleness and byte bounds) and the socket backend's aggregator
//! (`runtime::socket`, which keeps completed slots until the collecting call
//! takes them). The XDP program's slots follow the same rule in C
//! (`src/bpf/aggbox_xdp.bpf.c`, `fast_add` and the chain's rank claim).

use std::collections::HashMap;

use crate::wire::abi::{self, Op, Round};
use crate::wire::proto::AggHeader;
use crate::wire::reducer::{Accumulator, ReduceError};

/// Which fragment a slot aggregates: (round, frag_off) within one job.
pub type SlotKey = (Round, u32);

/// Why [`Slot::add`] did not add a contribution (nothing changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// This rank already added to the slot: a retransmission.
    AlreadyAdded,
    /// The contribution's shape (op, count, float) is not the slot's, or
    /// its payload does not hold `count` elements.
    ShapeMismatch,
}

/// What [`Slot::add`] did with a contribution it took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Added {
    /// Added; the slot waits for more ranks.
    Waiting,
    /// Added, and every rank has now added: the slot is complete (this is
    /// returned once per slot).
    Complete,
}

/// One fragment's aggregation state.
#[derive(Debug)]
pub struct Slot {
    acc: Accumulator,
    /// Bit r set: rank r has added ([`abi::MAX_RANKS`] = 256 bits).
    ranks: [u64; 4],
    added: u16,
    carried: u8,
    /// Where [`Slot::finish_into_self`] writes the integer RESULT, kept
    /// with the slot so that a reused slot allocates nothing.
    result: Vec<i32>,
}

impl Slot {
    /// An empty slot of shape (op, count, float).
    pub fn new(op: Op, count: usize, float: bool) -> Result<Slot, ReduceError> {
        Ok(Slot {
            acc: Accumulator::new(op, count, float)?,
            ranks: [0; 4],
            added: 0,
            carried: 0,
            result: Vec::new(),
        })
    }

    /// Empty this slot and give it shape (op, count, float), keeping its
    /// allocations when the shape is the same.
    pub fn reset(&mut self, op: Op, count: usize, float: bool) -> Result<(), ReduceError> {
        self.acc.reset(op, count, float)?;
        self.ranks = [0; 4];
        self.added = 0;
        self.carried = 0;
        Ok(())
    }

    /// Whether the slot has shape (op, count, float).
    pub fn has_shape(&self, op: Op, count: usize, float: bool) -> bool {
        self.acc.op() == op && self.acc.count() == count && self.acc.is_float() == float
    }

    /// Add contribution `hdr` (its big-endian `payload`) with `weight`, in a
    /// job of `workers` ranks. A refused contribution changes nothing.
    pub fn add(&mut self, hdr: &AggHeader, payload: &[u8], weight: i32, workers: u16) -> Result<Added, Refused> {
        if !self.has_shape(hdr.op, usize::from(hdr.count), hdr.is_float()) {
            return Err(Refused::ShapeMismatch);
        }
        let (word, bit) = (usize::from(hdr.rank / 64) % 4, 1u64 << (hdr.rank % 64));
        if self.ranks[word] & bit != 0 {
            return Err(Refused::AlreadyAdded);
        }
        self.acc.add_be_bytes(payload, weight).map_err(|_| Refused::ShapeMismatch)?;
        self.ranks[word] |= bit;
        self.added += 1;
        self.carried |= hdr.flags & abi::AGG_F_CARRIED;
        Ok(if self.added >= workers { Added::Complete } else { Added::Waiting })
    }

    /// The ranks that have added, in order.
    pub fn contributors(&self) -> impl Iterator<Item = u16> + '_ {
        (0..abi::MAX_RANKS as u16).filter(|r| self.ranks[usize::from(r / 64)] & (1 << (r % 64)) != 0)
    }

    /// How many ranks have added.
    pub fn added(&self) -> u16 {
        self.added
    }

    /// OR of the contributions' carried flags (`AGG_F_CARRIED`), for the
    /// RESULT's flags.
    pub fn carried(&self) -> u8 {
        self.carried
    }

    /// The accumulator (for the RESULT: `finish_with_weight_sum`).
    pub fn accumulator(&self) -> &Accumulator {
        &self.acc
    }

    /// Write the integer RESULT with AVG divisor `weight_sum` into the
    /// slot's own buffer ([`Slot::result`]); returns whether any element
    /// was clamped or a contribution carried OVERFLOW.
    pub fn finish_into_self(&mut self, weight_sum: i64) -> Result<bool, ReduceError> {
        let clamped = self.acc.finish_ints_into(weight_sum, &mut self.result)?;
        Ok(clamped || self.carried & abi::AGG_F_OVERFLOW != 0)
    }

    /// The RESULT [`Slot::finish_into_self`] wrote.
    pub fn result(&self) -> &[i32] {
        &self.result
    }
}

/// The open slots of one job, by fragment, each with the caller's own
/// per-slot data `E`; plus emptied slots whose allocations the next slot of
/// the same shape reuses, as long as open and emptied slots together are at
/// most `keep` (0: none kept, for a path whose memory is bounded by what
/// its open slots hold). Bounds on how many slots
/// may be open are the caller's: they differ (a slot count, bytes).
#[derive(Debug)]
pub struct SlotTable<E> {
    open: HashMap<SlotKey, (Slot, E)>,
    free: Vec<Slot>,
    keep: usize,
}

impl<E> SlotTable<E> {
    /// An empty table that keeps emptied slots for reuse while open and
    /// emptied slots together are at most `keep`.
    pub fn new(keep: usize) -> SlotTable<E> {
        SlotTable {
            open: HashMap::new(),
            free: Vec::new(),
            keep,
        }
    }

    /// Whether one more slot may be kept emptied.
    fn may_keep(&self) -> bool {
        self.open.len() + self.free.len() < self.keep
    }

    /// Open slots.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Whether no slot is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Whether fragment `key` has an open slot.
    pub fn contains(&self, key: SlotKey) -> bool {
        self.open.contains_key(&key)
    }

    /// The open slot of fragment `key` and its data.
    pub fn get(&self, key: SlotKey) -> Option<&(Slot, E)> {
        self.open.get(&key)
    }

    /// The open slot of fragment `key` and its data, to add to.
    pub fn get_mut(&mut self, key: SlotKey) -> Option<&mut (Slot, E)> {
        self.open.get_mut(&key)
    }

    /// The open slots.
    pub fn iter(&self) -> impl Iterator<Item = (&SlotKey, &(Slot, E))> {
        self.open.iter()
    }

    /// Open a slot of shape (op, count, float) for fragment `key` (which has
    /// none) with data `extra`: an emptied slot of that shape when there is
    /// one (no allocation), else a new one.
    pub fn open(&mut self, key: SlotKey, op: Op, count: usize, float: bool, extra: E) -> Result<&mut (Slot, E), ReduceError> {
        let slot = match self.free.iter().rposition(|s| s.has_shape(op, count, float)) {
            Some(k) => {
                let mut s = self.free.swap_remove(k);
                s.reset(op, count, float)?;
                s
            }
            None => Slot::new(op, count, float)?,
        };
        Ok(self.open.entry(key).insert_entry((slot, extra)).into_mut())
    }

    /// Close fragment `key`'s slot: it and its data, for the caller to
    /// read, then to give back with [`SlotTable::recycle`] (or drop).
    pub fn close(&mut self, key: SlotKey) -> Option<(Slot, E)> {
        self.open.remove(&key)
    }

    /// Keep an emptied slot for reuse (dropped past `keep`).
    pub fn recycle(&mut self, slot: Slot) {
        if self.may_keep() {
            self.free.push(slot);
        }
    }

    /// Have `n` slots of shape (op, count, float) ready (open or emptied),
    /// made now, with room for their RESULT ([`Slot::finish_into_self`]),
    /// so that later slots of that shape allocate nothing; at most
    /// `keep` slots are held in all.
    pub fn reserve(&mut self, op: Op, count: usize, float: bool, n: usize) {
        let mut have = self.open.values().map(|(s, _)| s).chain(&self.free).filter(|s| s.has_shape(op, count, float)).count();
        while have < n && self.may_keep() {
            let Ok(mut s) = Slot::new(op, count, float) else { return };
            s.result.reserve_exact(count);
            self.free.push(s);
            have += 1;
        }
    }

    /// Close every open slot whose fragment and data `pred` selects,
    /// returning them.
    pub fn close_where(&mut self, mut pred: impl FnMut(SlotKey, &E) -> bool) -> Vec<(SlotKey, Slot, E)> {
        let keys: Vec<SlotKey> = self.open.iter().filter(|(k, (_, e))| pred(**k, e)).map(|(k, _)| *k).collect();
        keys.into_iter()
            .filter_map(|k| self.open.remove(&k).map(|(s, e)| (k, s, e)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contribution(rank: u16, op: Op, flags: u8, values: &[i32]) -> (AggHeader, Vec<u8>) {
        let hdr = AggHeader {
            job: 1,
            rank,
            seq: 0,
            round: Round(3),
            frag_off: 0,
            op,
            flags,
            count: values.len() as u16,
        };
        (hdr, values.iter().flat_map(|v| v.to_be_bytes()).collect())
    }

    #[test]
    fn each_rank_adds_once_and_the_slot_completes_once() {
        let mut slot = Slot::new(Op::Sum, 2, false).unwrap();
        let (h0, p0) = contribution(0, Op::Sum, 0, &[1, 2]);
        let (h1, p1) = contribution(1, Op::Sum, abi::AGG_F_LAST_FRAGMENT, &[10, 20]);
        assert_eq!(slot.add(&h0, &p0, 1, 2), Ok(Added::Waiting));
        assert_eq!(slot.add(&h0, &p0, 1, 2), Err(Refused::AlreadyAdded), "a retransmission is not added again");
        assert_eq!(slot.added(), 1);
        assert_eq!(slot.add(&h1, &p1, 1, 2), Ok(Added::Complete));
        assert_eq!(slot.contributors().collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(slot.carried(), abi::AGG_F_LAST_FRAGMENT);
        assert_eq!(slot.accumulator().finish().unwrap().ints().unwrap(), &[11, 22]);
        assert_eq!(slot.add(&h1, &p1, 1, 2), Err(Refused::AlreadyAdded), "complete once");
    }

    #[test]
    fn a_contribution_of_another_shape_changes_nothing() {
        let mut slot = Slot::new(Op::Max, 2, false).unwrap();
        let (h0, p0) = contribution(0, Op::Max, 0, &[5, -5]);
        assert_eq!(slot.add(&h0, &p0, 1, 3), Ok(Added::Waiting));
        let (other_op, p) = contribution(1, Op::Min, 0, &[9, 9]);
        assert_eq!(slot.add(&other_op, &p, 1, 3), Err(Refused::ShapeMismatch));
        let (other_count, p) = contribution(1, Op::Max, 0, &[9, 9, 9]);
        assert_eq!(slot.add(&other_count, &p, 1, 3), Err(Refused::ShapeMismatch));
        let (mut short, p) = contribution(1, Op::Max, 0, &[9]);
        short.count = 2; // header says 2, payload holds 1
        assert_eq!(slot.add(&short, &p, 1, 3), Err(Refused::ShapeMismatch));
        assert_eq!((slot.added(), slot.contributors().collect::<Vec<_>>()), (1, vec![0]));
        assert_eq!(slot.accumulator().finish().unwrap().ints().unwrap(), &[5, -5]);
    }

    #[test]
    fn overflow_carried_by_a_contribution_marks_the_result() {
        let mut slot = Slot::new(Op::Sum, 1, false).unwrap();
        let (h0, p0) = contribution(0, Op::Sum, abi::AGG_F_OVERFLOW, &[i32::MAX]);
        assert_eq!(slot.add(&h0, &p0, 1, 1), Ok(Added::Complete));
        assert!(slot.finish_into_self(1).unwrap());
        assert_eq!(slot.result(), &[i32::MAX]);
        let mut clamped = Slot::new(Op::Sum, 1, false).unwrap();
        let (a, pa) = contribution(0, Op::Sum, 0, &[i32::MAX]);
        let (b, pb) = contribution(1, Op::Sum, 0, &[1]);
        clamped.add(&a, &pa, 1, 2).unwrap();
        clamped.add(&b, &pb, 1, 2).unwrap();
        assert!(clamped.finish_into_self(2).unwrap(), "clamped to int32");
        assert_eq!(clamped.result(), &[i32::MAX]);
    }

    #[test]
    fn a_reused_slot_starts_empty() {
        let mut table: SlotTable<u8> = SlotTable::new(1);
        table.reserve(Op::Sum, 2, false, 1);
        let (h0, p0) = contribution(0, Op::Sum, abi::AGG_F_LAST_FRAGMENT, &[7, 7]);
        let (slot, extra) = table.open((Round(3), 0), Op::Sum, 2, false, 9).unwrap();
        assert_eq!(*extra, 9);
        assert_eq!(slot.add(&h0, &p0, 1, 2), Ok(Added::Waiting));
        assert!(table.contains((Round(3), 0)) && table.len() == 1);
        let (slot, extra) = table.close((Round(3), 0)).unwrap();
        assert_eq!((slot.added(), extra), (1, 9));
        table.recycle(slot);
        assert!(table.is_empty());
        // The same storage, reopened for another fragment: nothing of the old one.
        let (slot, _) = table.open((Round(4), 0), Op::Sum, 2, false, 1).unwrap();
        assert_eq!((slot.added(), slot.carried()), (0, 0));
        assert_eq!(slot.add(&h0, &p0, 1, 2), Ok(Added::Waiting), "rank 0 may add again");
        assert_eq!(slot.accumulator().finish().unwrap().ints().unwrap(), &[7, 7]);
    }

    #[test]
    fn close_where_closes_exactly_the_selected_slots() {
        let mut table: SlotTable<()> = SlotTable::new(0);
        for round in 1..=4 {
            table.open((Round(round), 0), Op::Sum, 1, false, ()).unwrap();
        }
        let mut closed: Vec<u32> = table.close_where(|(round, _), _| round.is_before(Round(3))).into_iter().map(|((r, _), _, _)| r.0).collect();
        closed.sort_unstable();
        assert_eq!(closed, vec![1, 2]);
        assert_eq!(table.len(), 2);
        assert!(table.contains((Round(3), 0)) && table.contains((Round(4), 0)));
    }
}
