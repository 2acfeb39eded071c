//! The sender side of the reliability layer ([`SendWindow`]; see the
//! module docs of [`super`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{ReliabilityConfig, RttEstimator, SESSION_RESET_DISTANCE};
use crate::wire::proto::AckMode;
use crate::wire::proto::SeqBitmap;

/// Counters of one [`SendWindow`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendStats {
    /// New datagrams sent (each counted once, whatever the destinations).
    pub sent: u64,
    /// Retransmissions (one per datagram per destination).
    pub retransmitted: u64,
    /// Of those, triggered by a selective ACK rather than a timeout.
    pub fast_retransmitted: u64,
    /// ACK datagrams applied.
    pub acks: u64,
}

/// One datagram in flight.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Destinations (bit i = destination i) that have not acknowledged it.
    pending: u64,
    /// Index of its buffer in `bufs`.
    buf: u32,
    /// Retransmissions so far (0 = sent once: eligible for RTT samples).
    retries: u16,
    /// A placeholder for a seq not registered yet ([`SendWindow::send_at`]):
    /// no buffer, blocks retirement until filled.
    reserved: bool,
    first_sent: Instant,
    last_sent: Instant,
}

/// Sender side of the reliability layer: seq assignment, a window of
/// datagrams in flight kept for retransmission, ACK processing, RTT
/// estimation and timeouts. Up to 64 destinations per window (a bit each).
///
/// Transmission goes through a caller-supplied `tx(dest, bytes)` closure, so
/// the window knows nothing of sockets (and is unit-testable).
#[derive(Debug)]
pub struct SendWindow {
    cfg: ReliabilityConfig,
    next_seq: u32,
    /// Seq of `entries[0]`; entries hold `base..next_seq` contiguously.
    base: u32,
    entries: VecDeque<Entry>,
    bufs: Vec<Vec<u8>>,
    free: Vec<u32>,
    rtt: RttEstimator,
    stats: SendStats,
    ndest: usize,
    window: usize,
    /// Whether a hole in an ACK's bitmap means this sender's datagram was
    /// lost (see [`SendWindow::set_holes_are_losses`]).
    holes_are_losses: bool,
    /// Per destination, when its ACKs last acknowledged a datagram not
    /// acknowledged before (see [`SendWindow::poll`]).
    progress: Vec<Option<Instant>>,
    /// Per destination that went quiet, when its last probe went out and
    /// how many it got since its last progress (see [`SendWindow::poll`]).
    probes: Vec<Option<(Instant, u16)>>,
    /// Whether a quiet destination gets probes rather than everything that
    /// timed out (see [`SendWindow::set_probe_quiet`]).
    probe_quiet: bool,
    /// Per destination recovering from a timeout where probes are off: how
    /// many timed-out datagrams went to it at its last ACK of new data (or
    /// the timeout), 0 when it is not recovering (see [`SendWindow::poll`]).
    recovery: Vec<u32>,
}

impl SendWindow {
    /// Bytes of bookkeeping per datagram in flight (excluding the datagram copy).
    pub const ENTRY_BYTES: usize = std::mem::size_of::<Entry>();

    /// A window for `ndest` (1..=64) destinations, first seq `first_seq`.
    pub fn new(cfg: ReliabilityConfig, ndest: usize, first_seq: u32) -> SendWindow {
        SendWindow {
            cfg,
            next_seq: first_seq,
            base: first_seq,
            entries: VecDeque::with_capacity(cfg.window as usize),
            bufs: Vec::new(),
            free: Vec::new(),
            rtt: RttEstimator::new(cfg.initial_rto, cfg.min_rto, cfg.max_rto),
            stats: SendStats::default(),
            ndest: ndest.clamp(1, 64),
            window: cfg.window as usize,
            holes_are_losses: true,
            progress: vec![None; ndest.clamp(1, 64)],
            probes: vec![None; ndest.clamp(1, 64)],
            probe_quiet: false,
            recovery: vec![0; ndest.clamp(1, 64)],
        }
    }

    /// `true` where the destinations keep what arrives, so that one gone
    /// quiet is busy, not shedding load: it is then asked with the newest of
    /// its timed-out datagrams (see [`SendWindow::poll`]). The aggregator's
    /// results and broadcast data go to such receivers. Not contributions
    /// to the socket backend's aggregator: it drops, without an ACK, what it
    /// has no slot for, and a worker that ran ahead needs its timed-out
    /// window back once slots free up, oldest first (probing the newest, the
    /// fragment furthest ahead and dropped again, made a reduce with 8 slots
    /// miss a 3 s deadline).
    pub fn set_probe_quiet(&mut self, on: bool) {
        self.probe_quiet = on;
    }

    /// `false` when an ACK's holes do not show this sender's losses, so only
    /// timeouts retransmit: a kernel-backend worker's contributions are
    /// acknowledged (by the aggregator on the kernel's behalf) when each
    /// fragment's RESULT arrives, and a RESULT is missing whenever *any*
    /// worker's contribution to it is late or lost. Retransmitting every such
    /// hole made each worker resend what the kernel had already reduced
    /// (measured: 40 % of the datagrams at 21.8 M elements, MTU 1500).
    pub fn set_holes_are_losses(&mut self, on: bool) {
        self.holes_are_losses = on;
    }

    /// Lowers (or restores, up to the configured one) the window, e.g. to the
    /// kernel aggregator's slots per job.
    pub fn set_window(&mut self, window: usize) {
        self.window = window.clamp(1, self.cfg.window as usize);
    }

    /// Current window.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Seq the next new datagram gets.
    pub fn next_seq(&self) -> u32 {
        self.next_seq
    }

    /// Moves the seq counter; only allowed while nothing is in flight.
    pub fn set_next_seq(&mut self, seq: u32) {
        debug_assert!(self.entries.is_empty());
        if self.entries.is_empty() {
            self.next_seq = seq;
            self.base = seq;
        }
    }

    /// Room in the window for another new datagram.
    pub fn can_send(&self) -> bool {
        self.entries.len() < self.window
    }

    /// Nothing in flight: every datagram sent was acknowledged by every
    /// destination (or forgotten).
    pub fn is_idle(&self) -> bool {
        self.entries.is_empty()
    }

    /// Datagrams in flight.
    pub fn in_flight(&self) -> usize {
        self.entries.len()
    }

    /// Union of the destinations that still owe an acknowledgement.
    pub fn unacked_dests(&self) -> u64 {
        self.entries.iter().fold(0, |m, e| m | e.pending)
    }

    /// The RTT estimator.
    pub fn rtt(&self) -> &RttEstimator {
        &self.rtt
    }

    /// Counters.
    pub fn stats(&self) -> SendStats {
        self.stats
    }

    fn alloc_buf(&mut self) -> u32 {
        if let Some(i) = self.free.pop() {
            self.bufs[i as usize].clear();
            return i;
        }
        self.bufs.push(Vec::with_capacity(1536));
        (self.bufs.len() - 1) as u32
    }

    /// Sends a new datagram to the destinations in `dests`: `build(seq, buf)`
    /// writes it into a reused buffer, then `tx` is called once per
    /// destination. Returns the seq, or the build error (nothing is sent or
    /// kept then). Call only when [`SendWindow::can_send`].
    pub fn send<E>(
        &mut self,
        dests: u64,
        now: Instant,
        build: impl FnOnce(u32, &mut Vec<u8>) -> Result<(), E>,
        tx: &mut impl FnMut(usize, &[u8]),
    ) -> Result<u32, E> {
        // The next seq, registered in order: what send_at does for it.
        let seq = self.next_seq;
        self.send_at(seq, dests, now, build, tx)?;
        Ok(seq)
    }

    /// Registers datagram `seq` out of order, e.g. a result whose first
    /// transmission the kernel made (so `tx` may do nothing): seqs between the
    /// window's start and `seq` not registered yet are held as placeholders
    /// (they block retirement until filled or [`SendWindow::forget_all`]).
    /// Ignores a seq already registered or retired, or further than 2^24
    /// ahead. Does not look at the window limit: the caller does not choose
    /// when these datagrams exist (the number held is bounded by the
    /// senders whose results they are; see docs/RUNTIME.md).
    pub fn send_at<E>(
        &mut self,
        seq: u32,
        dests: u64,
        now: Instant,
        build: impl FnOnce(u32, &mut Vec<u8>) -> Result<(), E>,
        tx: &mut impl FnMut(usize, &[u8]),
    ) -> Result<(), E> {
        if self.entries.is_empty() && seq.wrapping_sub(self.next_seq) >= SESSION_RESET_DISTANCE {
            return Ok(()); // behind the window: retired already
        }
        let off = seq.wrapping_sub(self.base);
        if off >= SESSION_RESET_DISTANCE {
            return Ok(());
        }
        let off = off as usize;
        if off < self.entries.len() && !self.entries[off].reserved {
            return Ok(()); // registered already
        }
        let b = self.alloc_buf();
        if let Err(e) = build(seq, &mut self.bufs[b as usize]) {
            self.free.push(b);
            return Err(e);
        }
        let dests = dests & mask_of(self.ndest);
        for d in 0..self.ndest {
            if dests & (1 << d) != 0 {
                tx(d, &self.bufs[b as usize]);
            }
        }
        let entry = Entry {
            pending: dests,
            buf: b,
            retries: 0,
            reserved: false,
            first_sent: now,
            last_sent: now,
        };
        if self.entries.is_empty() {
            self.base = self.next_seq;
        }
        let off = seq.wrapping_sub(self.base) as usize;
        while self.entries.len() < off {
            self.entries.push_back(Entry {
                pending: 0,
                buf: u32::MAX,
                retries: 0,
                reserved: true,
                first_sent: now,
                last_sent: now,
            });
        }
        if off < self.entries.len() {
            self.entries[off] = entry;
        } else {
            self.entries.push_back(entry);
            self.next_seq = seq.wrapping_add(1);
        }
        self.stats.sent += 1;
        self.retire();
        Ok(())
    }

    fn index_of(&self, seq: u32) -> Option<usize> {
        let off = seq.wrapping_sub(self.base) as usize;
        (off < self.entries.len()).then_some(off)
    }

    fn retire(&mut self) {
        while let Some(e) = self.entries.front() {
            if e.pending != 0 || e.reserved {
                break;
            }
            self.free.push(e.buf);
            self.entries.pop_front();
            self.base = self.base.wrapping_add(1);
        }
    }

    /// The bytes of datagram `seq` while it is in flight (to send a batch of
    /// new datagrams after registering them).
    pub fn bytes_of(&self, seq: u32) -> Option<&[u8]> {
        let e = self.entries.get(self.index_of(seq)?)?;
        (!e.reserved).then(|| self.bufs[e.buf as usize].as_slice())
    }

    /// Marks `seq` acknowledged by `dest` (an implicit acknowledgement, e.g.
    /// the result of a fragment proves the contribution arrived), with an RTT
    /// sample when it was sent once (Karn). With the kernel backend this is
    /// how most contributions are acknowledged: without the sample the RTO
    /// stayed at its initial value while results took longer than that to
    /// come back (they wait for the slowest worker), and the workers resent
    /// contributions the kernel had already reduced.
    pub fn ack_seq(&mut self, dest: usize, seq: u32, now: Instant) {
        let Some(i) = self.index_of(seq) else {
            return;
        };
        let bit = 1u64 << dest.min(63);
        let e = &mut self.entries[i];
        if e.pending & bit != 0 {
            e.pending &= !bit;
            if e.retries == 0 && !e.reserved {
                let sent = e.first_sent;
                self.rtt.sample(now.saturating_duration_since(sent));
            }
            if let Some(p) = self.progress.get_mut(dest) {
                *p = Some(now);
                self.probes[dest] = None;
            }
        }
        self.retire();
    }

    /// Whether `seq` was registered (sent or retired) rather than not yet
    /// known (ahead of the window, or a placeholder of [`SendWindow::send_at`]).
    pub fn is_known(&self, seq: u32) -> bool {
        match self.index_of(seq) {
            Some(i) => !self.entries[i].reserved,
            None => seq.wrapping_sub(self.base) >= SESSION_RESET_DISTANCE,
        }
    }

    /// Applies an acknowledgement that arrived before the datagrams it names
    /// were registered ([`SendWindow::send_at`]): clears them for `dest`
    /// without an RTT sample or a selective retransmission.
    pub fn ack_early(&mut self, dest: usize, bm: &SeqBitmap) {
        if dest >= self.ndest {
            return;
        }
        for seq in bm.received() {
            if let Some(i) = self.index_of(seq) {
                self.entries[i].pending &= !(1u64 << dest);
            }
        }
        self.retire();
    }

    /// [`SendWindow::ack_early`] for one seq and the destinations of `bits`.
    pub fn ack_early_bits(&mut self, seq: u32, bits: u64) {
        if let Some(i) = self.index_of(seq) {
            self.entries[i].pending &= !bits;
            self.retire();
        }
    }

    /// Drops everything in flight (the call failed); the seq counter goes on.
    pub fn forget_all(&mut self) {
        while let Some(e) = self.entries.pop_front() {
            if !e.reserved {
                self.free.push(e.buf);
            }
        }
        self.base = self.next_seq;
    }

    /// Applies an `AGK1` bitmap from destination `dest`: acknowledges every
    /// seq it has, samples the RTT from the oldest datagram it newly
    /// acknowledges that was sent only once (as Linux TCP's RTO sample: a
    /// group ACK goes out up to `ack_delay` after the first arrival it
    /// covers, after the receiver drained its queue, and the newest sample
    /// left the RTO below what the oldest waited, so that 6–8 % of a kernel
    /// allreduce's results were resent as duplicates), and retransmits (to
    /// `dest` only) the holes that have been in flight longer than the
    /// smoothed RTT and lie below its highest received seq or were sent
    /// before a datagram it received (RACK).
    pub fn on_ack(
        &mut self,
        dest: usize,
        bm: &SeqBitmap,
        now: Instant,
        tx: &mut impl FnMut(usize, &[u8]),
    ) {
        if dest >= self.ndest {
            return;
        }
        self.stats.acks += 1;
        let bit = 1u64 << dest;
        let mut sample: Option<Instant> = None;
        let mut highest: Option<u32> = None;
        let mut progressed = false;
        // An ACK sooner after a resend than half the smallest RTT is the
        // original's (the resend cannot have made the round trip yet).
        let too_soon = self.rtt.min_rtt().map_or(Duration::ZERO, |m| m / 2);
        let mut original_acked = false;
        // The latest first transmission this ACK shows delivered (from the
        // datagrams sent once: unambiguous).
        let mut newest_delivered: Option<Instant> = None;
        for seq in bm.received() {
            if let Some(i) = self.index_of(seq) {
                let e = &mut self.entries[i];
                if e.retries == 0 && !e.reserved {
                    newest_delivered =
                        Some(newest_delivered.map_or(e.first_sent, |t| t.max(e.first_sent)));
                }
                if e.pending & bit != 0 {
                    e.pending &= !bit;
                    self.progress[dest] = Some(now);
                    self.probes[dest] = None;
                    progressed = true;
                    original_acked |=
                        e.retries == 0 || now.saturating_duration_since(e.last_sent) < too_soon;
                    if e.retries == 0 {
                        sample =
                            Some(sample.map_or(e.first_sent, |s: Instant| s.min(e.first_sent)));
                    }
                }
                highest = Some(seq);
            }
        }
        if let Some(sent) = sample {
            self.rtt.sample(now.saturating_duration_since(sent));
        }
        if let Some(hi) = highest.filter(|_| self.holes_are_losses) {
            let srtt = self.rtt.srtt().unwrap_or(self.rtt.rto());
            let hi_off = hi.wrapping_sub(self.base) as usize;
            // RACK's reordering window (RFC 8985): a quarter of the smallest RTT.
            let reordering = self.rtt.min_rtt().map_or(Duration::ZERO, |m| m / 4);
            for seq in bm.missing() {
                let Some(i) = self.index_of(seq) else {
                    continue;
                };
                let e = &mut self.entries[i];
                // A hole is a loss when a later seq arrived, or (RACK) a
                // datagram sent later did: where datagrams are registered
                // out of seq order (results, `send_at`: fragments complete
                // in any order), a lost copy of one of the last fragments is
                // then resent when the ACK of a later-sent one shows it
                // missing, not after a timeout and a probe.
                let sent_before_delivered =
                    newest_delivered.is_some_and(|t| e.last_sent + reordering < t);
                if i >= hi_off && !sent_before_delivered {
                    continue;
                }
                if e.pending & bit != 0 && now.saturating_duration_since(e.last_sent) > srtt {
                    e.last_sent = now;
                    e.retries = e.retries.saturating_add(1);
                    self.stats.retransmitted += 1;
                    self.stats.fast_retransmitted += 1;
                    tx(dest, &self.bufs[e.buf as usize]);
                }
            }
        }
        if progressed && self.recovery[dest] > 0 {
            // Recovering from a timeout: twice as many as last time per
            // group ACK (about one per round trip), two per per-packet ACK
            // of a resend (each resend acknowledged releases two: also twice
            // as many per round trip, TCP's slow start). A per-packet ACK of
            // an original shows that the timeout was spurious (the
            // destination was busy, not losing: F-RTO, RFC 5682): what timed
            // out is in its queue, and resending it would be a duplicate each.
            self.recovery[dest] = match self.cfg.ack_mode {
                AckMode::Packet if original_acked => 0,
                AckMode::Packet => self.resend_oldest_timed_out(dest, 2, now, tx),
                AckMode::Group => {
                    let n = self.recovery[dest].saturating_mul(2);
                    self.resend_oldest_timed_out(dest, n, now, tx)
                }
            };
        }
        self.retire();
    }

    /// Resends to `dest` up to `n` of its oldest timed-out datagrams; returns
    /// `n` when there were that many (more may follow), else 0.
    fn resend_oldest_timed_out(
        &mut self,
        dest: usize,
        n: u32,
        now: Instant,
        tx: &mut impl FnMut(usize, &[u8]),
    ) -> u32 {
        let bit = 1u64 << dest;
        let mut sent = 0;
        for e in self.entries.iter_mut() {
            if sent == n {
                return n;
            }
            if e.pending & bit == 0 || e.reserved || e.last_sent + self.rtt.backoff(e.retries) > now
            {
                continue;
            }
            tx(dest, &self.bufs[e.buf as usize]);
            self.stats.retransmitted += 1;
            e.retries = e.retries.saturating_add(1);
            e.last_sent = now;
            sent += 1;
        }
        if sent == n {
            n
        } else {
            0
        }
    }

    /// Retransmits what timed out (`RTO * 2^retries` after it was last
    /// sent) to the destinations that have not acknowledged it.
    ///
    /// Where ACK holes show losses ([`SendWindow::set_holes_are_losses`]), a
    /// destination whose ACKs acknowledged new datagrams less than one RTO
    /// ago gets nothing: its datagrams wait in its queue, and one it lost
    /// shows as a hole below what it acknowledges, which
    /// [`SendWindow::on_ack`] resends. With group ACKs (bitmaps) and
    /// receivers that keep what arrives ([`SendWindow::set_probe_quiet`]) a
    /// destination that has gone quiet is asked, not flooded: one probe per
    /// timeout, the newest of its timed-out datagrams, whose ACK shows as
    /// holes whatever else it lacks (TCP's tail loss probe; TCP's RTO also
    /// resends one segment, not the window); the next probe waits
    /// `RTO * 2^probes`, an ACK of new data ends the probing. A quiet
    /// destination is most often a busy one, not one that lost everything:
    /// resending every timed-out datagram to it resent a whole window (up to
    /// 80 datagrams of 9 KB) into its queue at every stall of a few
    /// milliseconds (11 % of a 21.8 M-element allreduce's RESULT copies at
    /// MTU 9000 on 2 vCPUs, more on 16 cores). A destination that may shed
    /// load (probes off) is asked with the oldest instead, and at each ACK
    /// of new data gets twice as many as the last time, oldest first
    /// (`recovery`, TCP's recovery after a timeout). Per-packet ACKs name
    /// one datagram and show no holes, so there a quiet destination is
    /// always asked with the oldest, and each ACK of new data releases two
    /// more (probing with the newest took 9 s instead of 0.23 s for a call at
    /// 5 % loss: it left the rest to a timeout each). Where holes are not
    /// losses a destination gets every timed-out datagram.
    /// Returns when the next timeout is due, `None` when nothing is in
    /// flight.
    pub fn poll(&mut self, now: Instant, tx: &mut impl FnMut(usize, &[u8])) -> Option<Instant> {
        let rto = self.rtt.rto();
        // A quiet destination gets one datagram per timeout: the newest
        // where ACK bitmaps show holes and receivers keep what arrives, else
        // the oldest (then more per ACK: `recovery`).
        let asking = self.holes_are_losses;
        let newest_first = self.probe_quiet && self.cfg.ack_mode == AckMode::Group;
        // Destinations that get nothing now (progress less than an RTO ago,
        // or a probe not yet answered) and when the first of them may.
        let mut quiet_until: Option<Instant> = None;
        let mut blocked = 0u64;
        if self.holes_are_losses {
            for d in 0..self.ndest {
                let held = self.progress[d].map(|p| p + rto);
                let probe = self.probes[d].map(|(t, k)| t + self.rtt.backoff(k));
                if let Some(end) = held.into_iter().chain(probe).filter(|&e| e > now).max() {
                    blocked |= 1 << d;
                    quiet_until = Some(quiet_until.map_or(end, |q: Instant| q.min(end)));
                }
            }
        }
        let mut next: Option<Instant> = None;
        let mut merge = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        // The timed-out datagram each quiet destination is asked with.
        let mut ask = [usize::MAX; 64];
        let mut waiting = false;
        for (i, e) in self.entries.iter_mut().enumerate() {
            if e.pending == 0 || e.reserved {
                continue;
            }
            let due = e.last_sent + self.rtt.backoff(e.retries);
            if due > now {
                merge(due);
                continue;
            }
            let mut owed = e.pending & !blocked;
            if owed == 0 {
                waiting = true;
                continue;
            }
            if asking {
                waiting = true;
                while owed != 0 {
                    let d = owed.trailing_zeros() as usize;
                    owed &= owed - 1;
                    if newest_first || ask[d] == usize::MAX {
                        ask[d] = i;
                    }
                }
                continue;
            }
            while owed != 0 {
                let d = owed.trailing_zeros() as usize;
                owed &= owed - 1;
                tx(d, &self.bufs[e.buf as usize]);
                self.stats.retransmitted += 1;
            }
            e.retries = e.retries.saturating_add(1);
            e.last_sent = now;
            merge(now + self.rtt.backoff(e.retries));
        }
        for (d, &i) in ask.iter().enumerate().take(self.ndest) {
            if i == usize::MAX {
                continue;
            }
            let e = &mut self.entries[i];
            tx(d, &self.bufs[e.buf as usize]);
            self.stats.retransmitted += 1;
            // Karn: no RTT sample from it any more.
            e.retries = e.retries.max(1);
            e.last_sent = now;
            if !newest_first {
                self.recovery[d] = 1;
            }
            let k = self.probes[d].map_or(0, |(_, k)| k).saturating_add(1);
            self.probes[d] = Some((now, k));
            merge(now + self.rtt.backoff(k));
        }
        if waiting {
            if let Some(q) = quiet_until {
                merge(q);
            }
        }
        next
    }
}

fn mask_of(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::reliability::test_config as cfg;

    /// `SendWindow::send`'s build for tests: a datagram holding its seq.
    fn seq_datagram(seq: u32, buf: &mut Vec<u8>) -> Result<(), ()> {
        buf.extend_from_slice(&seq.to_be_bytes());
        Ok(())
    }

    /// `(destination, seq)` of every datagram a poll at `at` resends.
    fn resent_at(w: &mut SendWindow, at: Instant) -> Vec<(usize, u32)> {
        let mut out = Vec::new();
        w.poll(at, &mut |d, b| {
            out.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        });
        out
    }

    #[test]
    fn a_group_ack_samples_its_oldest_datagram() {
        // 100..104 sent 1 ms apart, 100 resent on a timeout, then one bitmap
        // acknowledges all four: the sample is what the oldest datagram sent
        // once (101) waited, not the newest (103), and the resent 100 gives
        // none (Karn).
        let c = cfg(AckMode::Group, 1024, 8);
        let mut w = SendWindow::new(c, 1, 100);
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        for k in 0..4 {
            w.send(1, ms(k), seq_datagram, &mut |_, _| {}).unwrap();
        }
        // Initial RTO 20 ms: only 100 is due.
        assert_eq!(
            resent_at(&mut w, t0 + Duration::from_micros(20_500)),
            vec![(0, 100)]
        );
        let mut bm = SeqBitmap::new(100, 4).unwrap();
        for s in 100..104 {
            bm.set(s);
        }
        w.on_ack(0, &bm, ms(27), &mut |_, _| {});
        assert!(w.is_idle());
        // 101 was sent at 1 ms: 26 ms; 103 (the newest) would give 24 ms.
        assert_eq!(w.rtt().srtt(), Some(Duration::from_millis(26)));
    }

    #[test]
    fn a_hole_sent_before_a_delivered_datagram_is_resent_whatever_its_seq() {
        // Results registered out of seq order (send_at): 103 at 0 ms, 100 at
        // 1 ms, 102 at 2 ms, 101 at 6 ms; two destinations.
        let c = cfg(AckMode::Group, 1024, 8);
        let mut w = SendWindow::new(c, 2, 100);
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        for (seq, at) in [(103u32, 0u64), (100, 1), (102, 2), (101, 6)] {
            w.send_at::<()>(seq, 0b11, ms(at), seq_datagram, &mut |_, _| {})
                .unwrap();
        }
        let ack = |w: &mut SendWindow, dest: usize, seqs: &[u32], at: Instant| {
            let mut bm = SeqBitmap::new(100, 4).unwrap();
            for &s in seqs {
                bm.set(s);
            }
            let mut out = Vec::new();
            w.on_ack(dest, &bm, at, &mut |d, b| {
                out.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
            });
            out
        };
        // Dest 0 has everything but 103 (a sample of 9 ms from 100); dest 1
        // everything. 103 is above every seq dest 0 acknowledged, yet it went
        // out before them: lost.
        assert_eq!(ack(&mut w, 1, &[100, 101, 102, 103], ms(10)), vec![]);
        assert_eq!(ack(&mut w, 0, &[100, 101, 102], ms(10)), vec![(0, 103)]);
        // Above every acknowledged seq and sent after every delivered
        // datagram (103 at 6 ms; 100 and 102 went out at 0 and 1 ms): not a
        // loss, however long in flight; the delivery of one sent later (101,
        // 20 ms: beyond the reordering window, a quarter of the 30 ms RTT)
        // shows it lost.
        let mut w = SendWindow::new(c, 1, 100);
        for (seq, at) in [(100u32, 0u64), (103, 6), (102, 1)] {
            w.send_at::<()>(seq, 1, ms(at), seq_datagram, &mut |_, _| {})
                .unwrap();
        }
        assert_eq!(ack(&mut w, 0, &[100, 102], ms(30)), vec![]);
        w.send_at::<()>(101, 1, ms(20), seq_datagram, &mut |_, _| {})
            .unwrap();
        assert_eq!(ack(&mut w, 0, &[100, 101, 102], ms(40)), vec![(0, 103)]);
    }

    #[test]
    fn a_quiet_destination_gets_one_probe_per_timeout_and_its_ack_shows_the_rest() {
        // Two destinations; 100..104 sent at t0. Dest 0 acknowledges 100 at
        // 10 ms and 101 at 20 ms, dest 1 nothing.
        let c = cfg(AckMode::Group, 1024, 8);
        let mut w = SendWindow::new(c, 2, 100);
        w.set_probe_quiet(true);
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        let one_ms = Duration::from_millis(1);
        for _ in 0..4 {
            w.send(0b11, t0, seq_datagram, &mut |_, _| {}).unwrap();
        }
        let mut acked = SeqBitmap::new(100, 4).unwrap();
        for (k, t) in [(100u32, 10u64), (101, 20)] {
            acked.set(k);
            w.on_ack(0, &acked, ms(t), &mut |_, _| {
                panic!("no hole below what dest 0 has")
            });
        }
        let rto = w.rtt().rto();
        assert!(rto > Duration::from_millis(20), "{rto:?}");
        // One RTO after t0 everything is due. Dest 0 acknowledged new
        // datagrams less than an RTO ago: nothing. Dest 1 is quiet: one
        // probe, the newest.
        let p1 = t0 + rto + one_ms;
        assert_eq!(resent_at(&mut w, p1), vec![(1, 103)]);
        // Its next probe waits 2 RTO; nothing else goes to it meanwhile.
        assert_eq!(resent_at(&mut w, p1 + one_ms), vec![]);
        // Dest 1 had all but 102 (busy, not lost): the probe's ACK shows the
        // hole, and only 102 is resent.
        let mut has = SeqBitmap::new(100, 4).unwrap();
        for k in [100, 101, 103] {
            has.set(k);
        }
        let mut fast = Vec::new();
        w.on_ack(1, &has, p1 + 2 * one_ms, &mut |d, b| {
            fast.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        });
        assert_eq!(fast, vec![(1, 102)]);
        // Dest 0 is quiet since 20 ms, but what it lacks (102, 103) was just
        // resent (to dest 1) and is not due again before 2 RTO.
        assert_eq!(resent_at(&mut w, ms(20) + rto + one_ms), vec![]);
        // Then both are quiet: dest 0 gets its newest (103), dest 1 the one
        // it lacks; the next probes wait 2 RTO.
        // (dest 1's ACK gave an RTT sample: a new RTO.)
        let rto = w.rtt().rto();
        let p2 = p1 + 2 * one_ms + 2 * rto + one_ms;
        assert_eq!(resent_at(&mut w, p2), vec![(0, 103), (1, 102)]);
        assert_eq!(resent_at(&mut w, p2 + rto), vec![]);
        assert_eq!(
            resent_at(&mut w, p2 + 2 * rto + one_ms),
            vec![(0, 103), (1, 102)]
        );
        // Where holes are not losses (a kernel-backend worker), no hold.
        let mut w = SendWindow::new(c, 1, 100);
        w.set_holes_are_losses(false);
        for _ in 0..2 {
            w.send(1, t0, seq_datagram, &mut |_, _| {}).unwrap();
        }
        let mut one = SeqBitmap::new(100, 1).unwrap();
        one.set(100);
        w.on_ack(0, &one, ms(19), &mut |_, _| {});
        // 101 is due at t0 + RTO; a hold would last until 19 ms + RTO.
        let due = t0 + w.rtt().rto() + Duration::from_millis(1);
        assert_eq!(resent_at(&mut w, due), vec![(0, 101)]);
    }

    #[test]
    fn a_quiet_destination_is_asked_with_the_newest_only_where_acks_show_holes() {
        let t0 = Instant::now();
        let window = |mode, probe, n: u32| {
            let mut w = SendWindow::new(cfg(mode, 1024, 8), 1, 100);
            w.set_probe_quiet(probe);
            for _ in 0..n {
                w.send(1, t0, seq_datagram, &mut |_, _| {}).unwrap();
            }
            w
        };
        let due = t0 + ReliabilityConfig::default().initial_rto + Duration::from_millis(1);
        let resent_on_ack = |w: &mut SendWindow, seq: u32, at: Instant| {
            let mut got = SeqBitmap::new(seq, 1).unwrap();
            got.set(seq);
            let mut more = Vec::new();
            w.on_ack(0, &got, at, &mut |d, b| {
                more.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
            });
            more
        };
        // Group ACKs to a receiver that keeps what arrives: one probe, the newest.
        assert_eq!(
            resent_at(&mut window(AckMode::Group, true, 3), due),
            vec![(0, 102)]
        );
        // A receiver that may shed load (the socket aggregator without a
        // free slot): the oldest first, then twice as many at each ACK of new
        // data, as TCP after a timeout.
        let mut w = window(AckMode::Group, false, 3);
        assert_eq!(resent_at(&mut w, due), vec![(0, 100)]);
        let at = due + Duration::from_millis(1);
        assert_eq!(resent_on_ack(&mut w, 100, at), vec![(0, 101), (0, 102)]);
        // A per-packet ACK names one datagram and shows no holes, so a probe
        // with the newest would reveal nothing: whatever the receiver, the
        // oldest, then two more per ACK of new data (twice as many per round
        // trip), not the whole timed-out window at once.
        for probe in [true, false] {
            let mut w = window(AckMode::Packet, probe, 6);
            assert_eq!(
                resent_at(&mut w, due),
                vec![(0, 100)],
                "probe_quiet {probe}"
            );
            assert_eq!(resent_on_ack(&mut w, 100, at), vec![(0, 101), (0, 102)]);
            assert_eq!(resent_on_ack(&mut w, 101, at), vec![(0, 103), (0, 104)]);
            assert_eq!(resent_on_ack(&mut w, 102, at), vec![(0, 105)]);
            // Recovery over: nothing left that timed out.
            assert_eq!(resent_on_ack(&mut w, 103, at), vec![]);
            assert_eq!(w.in_flight(), 2);
        }
        // F-RTO: a per-packet ACK of a datagram sent once shows the
        // destination got the originals (it was busy): recovery ends, the
        // rest is in its queue.
        let mut w = window(AckMode::Packet, false, 6);
        assert_eq!(resent_at(&mut w, due), vec![(0, 100)]);
        assert_eq!(resent_on_ack(&mut w, 103, at), vec![]);
        assert_eq!(resent_on_ack(&mut w, 100, at), vec![]);
        // So does an ACK of a resend sooner than half the smallest RTT after
        // it (one sample of 4 ms: the 1 ms is the original's ACK).
        let mut w = window(AckMode::Packet, false, 6);
        assert_eq!(
            resent_on_ack(&mut w, 105, t0 + Duration::from_millis(4)),
            vec![]
        );
        assert_eq!(w.rtt().min_rtt(), Some(Duration::from_millis(4)));
        let due = t0 + Duration::from_millis(4) + w.rtt().rto() + Duration::from_millis(1);
        assert_eq!(resent_at(&mut w, due), vec![(0, 100)]);
        let at = due + Duration::from_millis(3);
        assert_eq!(resent_on_ack(&mut w, 100, at), vec![(0, 101), (0, 102)]);
        assert_eq!(
            resent_on_ack(&mut w, 101, at + Duration::from_millis(1)),
            vec![]
        );
        assert_eq!(
            resent_on_ack(&mut w, 102, at + Duration::from_millis(2)),
            vec![]
        );
    }

    #[test]
    fn window_retransmits_only_missing_to_who_misses() {
        let c = cfg(AckMode::Group, 1024, 8);
        let mut w = SendWindow::new(c, 3, 100);
        let t0 = Instant::now();
        let mut sent: Vec<(usize, u32)> = Vec::new();
        for i in 0..8u32 {
            assert!(w.can_send());
            let seq = w
                .send::<()>(
                    0b111,
                    t0,
                    |s, b| {
                        b.extend_from_slice(&s.to_be_bytes());
                        Ok(())
                    },
                    &mut |d, b| sent.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]]))),
                )
                .unwrap();
            assert_eq!(seq, 100 + i);
        }
        assert!(!w.can_send());
        assert_eq!(sent.len(), 24);
        // dest 0 and 1 have everything; dest 2 misses 103.
        let mut all = SeqBitmap::new(100, 8).unwrap();
        for s in 100..108 {
            all.set(s);
        }
        let mut part = all;
        part = {
            let mut p = SeqBitmap::new(100, 8).unwrap();
            for s in part.received().filter(|&s| s != 103) {
                p.set(s);
            }
            p
        };
        sent.clear();
        let t1 = t0 + Duration::from_millis(5);
        w.on_ack(0, &all, t1, &mut |d, _| sent.push((d, 0)));
        w.on_ack(1, &all, t1, &mut |d, _| sent.push((d, 0)));
        // Selective: 103 in flight longer than srtt (5 ms sample) only after 5 ms.
        w.on_ack(2, &part, t1, &mut |d, b| {
            sent.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        });
        assert!(sent.is_empty());
        assert_eq!(w.in_flight(), 5); // 103..107 (107 acked behind the hole)
        assert_eq!(w.unacked_dests(), 0b100);
        // Timeout: only 103, only to dest 2.
        let t2 = t0 + Duration::from_secs(2);
        let next = w.poll(t2, &mut |d, b| {
            sent.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        });
        assert_eq!(sent, vec![(2, 103)]);
        assert!(next.unwrap() > t2);
        assert_eq!(w.stats().retransmitted, 1);
        // Back-off: the second timeout is twice the first.
        let rto = w.rtt().rto();
        sent.clear();
        w.poll(t2 + rto + Duration::from_micros(10), &mut |d, _| {
            sent.push((d, 0))
        });
        assert!(sent.is_empty(), "backed off: not due after one RTO");
        w.poll(t2 + 2 * rto + Duration::from_micros(10), &mut |d, _| {
            sent.push((d, 0))
        });
        assert_eq!(sent.len(), 1);
        let mut one = SeqBitmap::new(103, 1).unwrap();
        one.set(103);
        w.on_ack(2, &one, t2, &mut |_, _| {});
        assert!(w.is_idle());
        assert!(w.can_send());
    }

    #[test]
    fn send_at_registers_out_of_order() {
        let c = cfg(AckMode::Group, 64, 8);
        let mut w = SendWindow::new(c, 2, 0);
        w.set_next_seq(1000);
        let t0 = Instant::now();
        let build = |s: u32, b: &mut Vec<u8>| -> Result<(), ()> {
            b.extend_from_slice(&s.to_be_bytes());
            Ok(())
        };
        let mut sent = 0;
        // 1002 first (placeholders 1000, 1001), then 1000, then 1001; nothing sent.
        w.send_at(1002, 0b11, t0, build, &mut |_, _| sent += 1)
            .unwrap();
        assert_eq!(w.in_flight(), 3);
        w.send_at(1000, 0b11, t0, build, &mut |_, _| sent += 1)
            .unwrap();
        w.send_at(1002, 0b11, t0, build, &mut |_, _| sent += 1)
            .unwrap(); // again: ignored
        assert_eq!(
            sent, 4,
            "tx once per destination of 1002 and 1000, not for the repeat"
        );
        let mut all = SeqBitmap::new(1000, 3).unwrap();
        for s in [1000, 1002] {
            all.set(s);
        }
        w.on_ack(0, &all, t0, &mut |_, _| {});
        w.on_ack(1, &all, t0, &mut |_, _| {});
        assert!(!w.is_idle(), "placeholder 1001 still open");
        // Timeout: 1001 is a placeholder, nothing to resend.
        let mut resent = Vec::new();
        w.poll(t0 + Duration::from_secs(2), &mut |d, b| {
            resent.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        });
        assert!(resent.is_empty());
        w.send_at(1001, 0b11, t0, build, &mut |_, _| {}).unwrap();
        w.poll(t0 + Duration::from_secs(4), &mut |d, b| {
            resent.push((d, u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        });
        assert_eq!(resent, vec![(0, 1001), (1, 1001)]);
        let mut one = SeqBitmap::new(1001, 1).unwrap();
        one.set(1001);
        w.on_ack(0, &one, t0, &mut |_, _| {});
        w.on_ack(1, &one, t0, &mut |_, _| {});
        assert!(w.is_idle());
        // Retired seqs are ignored.
        w.send_at(1000, 0b11, t0, build, &mut |_, _| sent += 1)
            .unwrap();
        assert!(w.is_idle());
        assert_eq!(sent, 4);
        assert_eq!(w.next_seq(), 1003);
    }
}
