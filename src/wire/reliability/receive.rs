//! The receiver side of the reliability layer ([`RecvTracker`], one per
//! sender: dedup and `AGK1` generation; see the module docs of [`super`]).

use std::collections::VecDeque;
use std::time::Instant;

use super::{ReliabilityConfig, SESSION_RESET_DISTANCE};
use crate::wire::proto::AckMode;
use crate::wire::proto::{group_of, SeqBitmap};

/// What a receiver makes of an arriving seq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not seen before: deliver it, then [`RecvTracker::record`] it.
    New,
    /// Seen before (or settled): do not deliver; [`RecvTracker::reack`] it.
    Duplicate,
}

/// How [`RecvTracker::record_as`] acknowledges an arrival in group mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arrival {
    /// Inside a message: with the group, or `ack_delay` after the group's
    /// oldest unacknowledged arrival.
    Inner,
    /// The last of a message: at once.
    Last,
    /// The last of a message whose ACK may wait: `ack_delay` after the
    /// group's newest arrival of this kind.
    Deferred,
}

/// ACK state of one group of G sequence numbers at a receiver.
#[derive(Debug, Clone, Copy)]
pub struct GroupState {
    bitmap: SeqBitmap,
    /// Arrivals since this group's last ACK.
    unacked: u16,
    /// When the oldest unacknowledged arrival came.
    first_unacked: Option<Instant>,
}

/// Receiver side of the reliability layer for one sender: dedup and ACK
/// generation (see the module docs). ACKs are handed to an `emit(&SeqBitmap)`
/// closure that encodes and sends the `AGK1`.
#[derive(Debug, Clone)]
pub struct RecvTracker {
    cfg: ReliabilityConfig,
    started: bool,
    /// Base seq of `groups[0]`; everything below is settled.
    floor: u32,
    groups: VecDeque<GroupState>,
    duplicates: u64,
}

impl RecvTracker {
    /// Bytes kept per group of G sequence numbers.
    pub const GROUP_BYTES: usize = std::mem::size_of::<GroupState>();

    /// Most groups a tracker holds at once (see the module docs).
    pub const MAX_GROUPS: usize = 3;

    /// An empty tracker; it starts at the group of the first seq it sees.
    pub fn new(cfg: ReliabilityConfig) -> RecvTracker {
        RecvTracker {
            cfg,
            started: false,
            floor: 0,
            groups: VecDeque::with_capacity(Self::MAX_GROUPS + 1),
            duplicates: 0,
        }
    }

    /// Groups currently held.
    pub fn groups_held(&self) -> usize {
        self.groups.len()
    }

    /// Duplicates seen so far.
    pub fn duplicates(&self) -> u64 {
        self.duplicates
    }

    fn g(&self) -> u32 {
        self.cfg.group_size.max(1)
    }

    fn new_group(&self, base: u32) -> GroupState {
        let bitmap = SeqBitmap::new(base, self.g() as u16).unwrap_or_else(|_| {
            // group_size is validated to 1..=1024; fall back to one bit.
            SeqBitmap::new(base, 1).expect("nbits 1 is valid")
        });
        GroupState {
            bitmap,
            unacked: 0,
            first_unacked: None,
        }
    }

    fn reset_at(&mut self, seq: u32) {
        self.groups.clear();
        self.floor = group_of(seq, self.g()).1;
        self.started = true;
    }

    /// Classifies `seq` without recording it. A seq from a new sender session
    /// (far from everything seen) resets the tracker first.
    pub fn check(&mut self, seq: u32) -> Verdict {
        if !self.started {
            self.reset_at(seq);
            return Verdict::New;
        }
        let ahead = seq.wrapping_sub(self.floor);
        let behind = self.floor.wrapping_sub(seq);
        if ahead >= SESSION_RESET_DISTANCE && behind >= SESSION_RESET_DISTANCE {
            self.reset_at(seq);
            return Verdict::New;
        }
        if behind > 0 && behind < SESSION_RESET_DISTANCE {
            return Verdict::Duplicate;
        }
        let gi = (ahead / self.g()) as usize;
        match self.groups.get(gi) {
            Some(g) if g.bitmap.get(seq) => Verdict::Duplicate,
            _ => Verdict::New,
        }
    }

    /// Records a [`Verdict::New`] seq and sends whatever ACK the mode calls
    /// for now; `last` marks the last datagram of a message (ACK at once).
    pub fn record(
        &mut self,
        seq: u32,
        last: bool,
        now: Instant,
        emit: &mut impl FnMut(&SeqBitmap),
    ) {
        let arrival = if last { Arrival::Last } else { Arrival::Inner };
        self.record_as(seq, arrival, now, emit);
    }

    /// Records a [`Verdict::New`] seq that ends a message whose ACK may
    /// wait (group mode): instead of acknowledging at once, the group's
    /// delayed ACK is due `ack_delay` after this arrival, so a next message
    /// arriving sooner postpones it again. For a receiver whose sender
    /// learns of the arrival otherwise as long as messages keep coming (a
    /// node-served allreduce: a RESULT of round r+1 proves every worker had
    /// round r's; docs/PROTOCOL.md "Implicit acknowledgement of RESULTs"):
    /// the ACK goes out once the receiver is idle for `ack_delay`, when the
    /// group completes, or at [`RecvTracker::flush`]. Packet mode
    /// acknowledges at once, as [`RecvTracker::record`].
    pub fn record_deferred(&mut self, seq: u32, now: Instant, emit: &mut impl FnMut(&SeqBitmap)) {
        self.record_as(seq, Arrival::Deferred, now, emit);
    }

    fn record_as(
        &mut self,
        seq: u32,
        arrival: Arrival,
        now: Instant,
        emit: &mut impl FnMut(&SeqBitmap),
    ) {
        if !self.started {
            self.reset_at(seq);
        }
        let g = self.g();
        // Evict groups whose holes the sender must have abandoned.
        while seq.wrapping_sub(self.floor) >= 2 * g
            && seq.wrapping_sub(self.floor) < SESSION_RESET_DISTANCE
        {
            if let Some(front) = self.groups.pop_front() {
                if front.unacked > 0 && self.cfg.ack_mode == AckMode::Group {
                    emit(&front.bitmap);
                }
            }
            self.floor = self.floor.wrapping_add(g);
        }
        let ahead = seq.wrapping_sub(self.floor);
        if ahead >= SESSION_RESET_DISTANCE {
            return; // behind the floor: settled already
        }
        let gi = (ahead / g) as usize;
        while self.groups.len() <= gi {
            let base = self.floor.wrapping_add(g * self.groups.len() as u32);
            let ng = self.new_group(base);
            self.groups.push_back(ng);
        }
        let mode = self.cfg.ack_mode;
        let grp = &mut self.groups[gi];
        grp.bitmap.set(seq);
        match mode {
            AckMode::Packet => {
                if let Ok(mut one) = SeqBitmap::new(seq, 1) {
                    one.set(seq);
                    emit(&one);
                }
            }
            AckMode::Group => {
                grp.unacked = grp.unacked.saturating_add(1);
                if arrival == Arrival::Deferred {
                    grp.first_unacked = Some(now);
                } else {
                    grp.first_unacked.get_or_insert(now);
                }
                if grp.bitmap.is_complete() || arrival == Arrival::Last {
                    emit(&grp.bitmap);
                    grp.unacked = 0;
                    grp.first_unacked = None;
                }
            }
        }
        self.pop_settled();
    }

    fn pop_settled(&mut self) {
        while let Some(f) = self.groups.front() {
            if f.bitmap.is_complete() && f.unacked == 0 {
                self.groups.pop_front();
                self.floor = self.floor.wrapping_add(self.g());
            } else {
                break;
            }
        }
    }

    /// Re-acknowledges a [`Verdict::Duplicate`] (its earlier ACK may have been
    /// lost): the group's bitmap when the group is still held, else `seq` alone.
    pub fn reack(&mut self, seq: u32, emit: &mut impl FnMut(&SeqBitmap)) {
        self.duplicates += 1;
        if self.cfg.ack_mode == AckMode::Group {
            let ahead = seq.wrapping_sub(self.floor);
            if ahead < SESSION_RESET_DISTANCE {
                if let Some(g) = self.groups.get((ahead / self.g()) as usize) {
                    emit(&g.bitmap);
                    return;
                }
            }
        }
        if let Ok(mut one) = SeqBitmap::new(seq, 1) {
            one.set(seq);
            emit(&one);
        }
    }

    /// Group mode: sends the selective ACK of every group whose arrivals have
    /// waited `ack_delay`. Returns when the next one is due.
    pub fn poll(&mut self, now: Instant, emit: &mut impl FnMut(&SeqBitmap)) -> Option<Instant> {
        self.emit_pending(Some(now), emit)
    }

    /// Group mode: hands every group's pending selective ACK to `emit` now,
    /// whatever it has waited (a receiver whose round ends: the last
    /// arrivals' ACK must not wait for a timer that may come after it
    /// stopped repeating that round's ACKs).
    pub fn flush(&mut self, emit: &mut impl FnMut(&SeqBitmap)) {
        self.emit_pending(None, emit);
    }

    /// The ACKs of groups with arrivals waiting since `ack_delay` before
    /// `now` (every group with arrivals when `now` is `None`); returns when
    /// the next one is due.
    fn emit_pending(
        &mut self,
        now: Option<Instant>,
        emit: &mut impl FnMut(&SeqBitmap),
    ) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for g in self.groups.iter_mut() {
            if let Some(t) = g.first_unacked {
                let due = t + self.cfg.ack_delay;
                if now.is_none_or(|now| due <= now) {
                    emit(&g.bitmap);
                    g.unacked = 0;
                    g.first_unacked = None;
                } else {
                    next = Some(next.map_or(due, |n: Instant| n.min(due)));
                }
            }
        }
        self.pop_settled();
        next
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::wire::reliability::test_config as cfg;

    #[test]
    fn tracker_dedups_and_acks_groups() {
        let c = cfg(AckMode::Group, 16, 16);
        let mut t = RecvTracker::new(c);
        let now = Instant::now();
        let mut acks: Vec<SeqBitmap> = Vec::new();
        for s in 0..16u32 {
            if s == 5 {
                continue;
            }
            assert_eq!(t.check(s), Verdict::New);
            t.record(s, false, now, &mut |b| acks.push(*b));
        }
        assert!(acks.is_empty(), "group incomplete, no timeout yet");
        assert_eq!(t.check(3), Verdict::Duplicate);
        // The gap does not fill: a selective ACK after ack_delay.
        t.poll(now + Duration::from_millis(5), &mut |b| acks.push(*b));
        assert_eq!(acks.len(), 1);
        assert_eq!(acks[0].missing().collect::<Vec<_>>(), vec![5]);
        t.record(5, false, now, &mut |b| acks.push(*b));
        assert_eq!(acks.len(), 2);
        assert!(acks[1].is_complete());
        assert_eq!(t.groups_held(), 0);
        // Settled seqs are duplicates and re-acknowledged alone.
        assert_eq!(t.check(5), Verdict::Duplicate);
        t.reack(5, &mut |b| acks.push(*b));
        assert_eq!((acks[2].base_seq(), acks[2].nbits()), (5, 1));
        // Last datagram of a message: ACK at once.
        assert_eq!(t.check(16), Verdict::New);
        t.record(16, true, now, &mut |b| acks.push(*b));
        assert_eq!(acks.len(), 4);
    }

    #[test]
    fn a_deferred_last_arrival_is_acknowledged_once_the_receiver_is_idle() {
        let c = cfg(AckMode::Group, 1024, 64);
        let mut t = RecvTracker::new(c);
        let t0 = Instant::now();
        let d = c.ack_delay;
        let mut acks: Vec<SeqBitmap> = Vec::new();
        // One-datagram messages every d/4: each arrival postpones the ACK.
        for s in 0..8u32 {
            let at = t0 + d / 4 * s;
            assert_eq!(t.check(s), Verdict::New);
            t.record_deferred(s, at, &mut |b| acks.push(*b));
            assert!(
                acks.is_empty(),
                "seq {s}: no ACK while messages keep coming"
            );
            assert_eq!(
                t.poll(at, &mut |b| acks.push(*b)),
                Some(at + d),
                "due ack_delay after the newest"
            );
        }
        let newest = t0 + d / 4 * 7;
        t.poll(newest + d - Duration::from_micros(1), &mut |b| {
            acks.push(*b)
        });
        assert!(acks.is_empty());
        // Idle for ack_delay: one ACK of all eight.
        assert_eq!(t.poll(newest + d, &mut |b| acks.push(*b)), None);
        assert_eq!(acks.len(), 1);
        assert_eq!(
            acks[0].received().collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>()
        );
        // flush (a receiver that closes) sends what waits at once.
        t.record(8, false, newest + d, &mut |b| acks.push(*b));
        t.record_deferred(9, newest + d, &mut |b| acks.push(*b));
        t.flush(&mut |b| acks.push(*b));
        assert_eq!(acks.len(), 2);
        assert!(acks[1].get(9));
        // Packet mode: at once, as record.
        let mut p = RecvTracker::new(cfg(AckMode::Packet, 1024, 64));
        let mut pk = Vec::new();
        p.check(100);
        p.record_deferred(100, t0, &mut |b| pk.push(*b));
        assert_eq!(pk.len(), 1);
    }

    #[test]
    fn tracker_packet_mode_and_session_reset() {
        let mut t = RecvTracker::new(cfg(AckMode::Packet, 1024, 64));
        let now = Instant::now();
        let mut acks = Vec::new();
        t.check(5000);
        t.record(5000, false, now, &mut |b: &SeqBitmap| acks.push(*b));
        assert_eq!(acks.len(), 1);
        assert_eq!(acks[0].nbits(), 1);
        // A restarted sender far away: new session.
        assert_eq!(t.check(0x8000_0000), Verdict::New);
        t.record(0x8000_0000, false, now, &mut |b| acks.push(*b));
        assert_eq!(t.check(0x8000_0000), Verdict::Duplicate);
        assert_eq!(t.check(5000), Verdict::New);
    }

    #[test]
    fn tracker_drops_abandoned_holes() {
        let mut t = RecvTracker::new(cfg(AckMode::Group, 8, 8));
        let now = Instant::now();
        for s in [0u32, 1, 2] {
            t.check(s);
            t.record(s, false, now, &mut |_| {});
        }
        // Sender gave up on 3..8 and moved on: 16 is 2G past group 0.
        assert_eq!(t.check(16), Verdict::New);
        t.record(16, false, now, &mut |_| {});
        assert_eq!(
            t.check(3),
            Verdict::Duplicate,
            "abandoned holes are settled"
        );
        assert_eq!(t.check(9), Verdict::New);
    }
}
