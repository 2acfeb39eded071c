//! Kernel backend, aggregator side: the node's XDP program reduces the
//! contributions; the aggregator's runtime receives the RESULT datagrams on the
//! job's `result_port` and acknowledges contributions on the kernel's behalf.
//!
//! Who acknowledges (decision): the aggregator-side runtime. A RESULT for
//! (round, frag_off) proves that every rank's contribution to that fragment
//! arrived, so the runtime acknowledges, for every rank, the seq of that
//! fragment. That works because all ranks number their contributions alike:
//! a communicator's contribution seq starts at the same value on every rank
//! (0, or what [`crate::runtime::CommunicatorBuilder::resume`] gives) and
//! every reduction call advances it by the call's fragment count, whether the
//! call succeeded or not; fragment `i` of a call is `seq_base + i` on every
//! rank. The ACKs go through the same [`RecvTracker`] (per-packet or group
//! mode) as every other ACK, fanned out to each rank's address.
//!
//! Trade-offs: nothing in the kernel or the node daemon is needed, and an ACK
//! means more than "the kernel saw it" (the fragment is reduced); but a
//! fragment that stays incomplete (one rank's contribution lost) is
//! acknowledged to nobody, so every rank retransmits it after its timeout and
//! the kernel deduplicates what it already has (per-rank bitmap in the slot).
//!
//! Repeats (decision): PROTOCOL.md has a retransmitted contribution
//! "acknowledged again", but the kernel drops a retransmission of a
//! completed fragment without a word and the runtime never sees it. So the
//! runtime repeats on its own what it acknowledged, as cumulative bitmaps of
//! every fragment of the round it has the RESULT of (up to 1024 seqs each):
//! - while the round waits: 10 ms after the last RESULT, then at doubling
//!   intervals (at most 1 s apart, 12 times; a new RESULT starts over). A
//!   worker whose ACK of an early fragment was lost (and, with a result
//!   group, the TC copy of its RESULT too) keeps that contribution in its
//!   send window; with the window full it cannot send the fragments the
//!   round still lacks, and without a repeat the round waited for ever
//!   (5 % loss: a few rounds in ten thousand);
//! - after the round ended: 5 ms after it, then at doubling intervals as
//!   above, for the workers still waiting for the last ACKs.
//!
//! Both stop after ~6 s without progress, within the default 10 s deadline,
//! so a stalled job does not send ACKs for ever.
//!
//! With allreduce, a worker also treats each result fragment it receives as
//! the acknowledgement of its contribution to that fragment.
//!
//! Flow control: a worker's window is capped at the job's `slots`, so the
//! kernel's slot pool cannot run out because of one job's senders.
//!
//! Trust: a RESULT decides the value of a fragment and, through the ACKs on
//! behalf, what the workers stop retransmitting, so only the sources the
//! node's paths produce RESULTs from are taken: a worker's socket (the XDP
//! program rewrites the completing contribution in place, keeping its IPv4
//! source, which it checked against the rank's address, and its UDP source
//! port) and the node's own address (the user-space path sends from an
//! ephemeral port; a result group's copy to a local member goes through lo).
//! Everything else is counted and dropped. RESULTs of later rounds are kept
//! up to a byte bound as well as a count.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::wire::abi::Round;
use crate::wire::proto::{AggHeader, SeqBitmap};
use crate::runtime::backend::{AckIo, Backend, BackendKind, Completed, FragmentState};
use crate::wire::reliability::{RecvTracker, ReliabilityConfig, Verdict};
use crate::runtime::transport::Refusal;

#[derive(Debug)]
struct Done {
    round: Round,
    frag_off: u32,
    values: Vec<i32>,
    overflow: bool,
}

/// The aggregator side of the kernel backend (see the module docs).
#[derive(Debug)]
pub struct KernelAggregator {
    peers: Vec<SocketAddr>,
    /// This node's address (the job's aggregator address).
    node: IpAddr,
    per: usize,
    behalf: RecvTracker,
    round: Round,
    seq_base: u32,
    done: Vec<Done>,
    pool: Vec<Vec<i32>>,
    /// Seqs of the round in progress this runtime acknowledged (has the
    /// RESULT of), repeated while the round waits.
    taken: AckedSeqs,
    /// When `taken` is repeated next.
    taken_repeat: Repeat,
    /// The same for the round that ended last, repeated after it.
    ended: AckedSeqs,
    ended_repeat: Repeat,
    results: u64,
    /// RESULTs of a round this application has not called yet: the workers
    /// may start the next reduction first, and the kernel sends its RESULT
    /// only once (retransmissions of a completed slot are dropped), so an
    /// early RESULT is kept and taken when its round begins.
    early: Vec<(AggHeader, Vec<u8>, SocketAddr)>,
    /// Memory `early` holds (`early_cost` of each entry).
    early_bytes: usize,
    /// Bound of `early_bytes`.
    early_limit: usize,
}

/// Early RESULTs kept at most (a few rounds' worth of fragments); the byte
/// bound (`CommConfig::early_result_bytes`) usually binds first.
const EARLY_RESULTS_MAX: usize = 65536;

/// Default bound of the memory early RESULTs may hold: 256 MiB, about three
/// rounds of a 21.8 M-element allreduce (87 MB a round), instead of the
/// 4 GiB that 65536 datagrams of 64 KiB could take.
pub const DEFAULT_EARLY_RESULT_BYTES: usize = 256 << 20;

/// What one kept early RESULT costs: its payload and the entry holding it.
fn early_cost(payload_len: usize) -> usize {
    payload_len + std::mem::size_of::<(AggHeader, Vec<u8>, SocketAddr)>()
}

impl KernelAggregator {
    /// For ranks at `peers` (rank r = `peers[r]`), `per` elements per
    /// fragment, on the node at `node` (the job's aggregator address);
    /// RESULTs of later rounds are kept up to `early_limit` bytes.
    pub fn new(
        peers: Vec<SocketAddr>,
        per: usize,
        cfg: ReliabilityConfig,
        first_round: Round,
        first_seq: u32,
        node: IpAddr,
        early_limit: usize,
    ) -> KernelAggregator {
        KernelAggregator {
            peers,
            node,
            per: per.max(1),
            behalf: RecvTracker::new(cfg),
            round: first_round,
            seq_base: first_seq,
            done: Vec::new(),
            pool: Vec::new(),
            taken: AckedSeqs::new(first_seq),
            taken_repeat: Repeat::default(),
            ended: AckedSeqs::new(first_seq),
            ended_repeat: Repeat::default(),
            results: 0,
            early: Vec::new(),
            early_bytes: 0,
            early_limit,
        }
    }

    /// RESULT datagrams received.
    pub fn results(&self) -> u64 {
        self.results
    }

    /// Bytes the RESULTs of later rounds hold now (at most the bound given
    /// to [`KernelAggregator::new`]).
    pub fn early_bytes(&self) -> usize {
        self.early_bytes
    }

    /// Whether `from` is a source the node's paths send this runtime RESULTs
    /// from (see the module docs): a worker's socket, or the node itself.
    fn may_send_results(&self, from: SocketAddr) -> bool {
        from.ip() == self.node || self.peers.contains(&from)
    }

    fn recount_early(&mut self) {
        self.early_bytes = self.early.iter().map(|(_, p, _)| early_cost(p.len())).sum();
    }

    fn fan_out(peers: &[SocketAddr], io: &mut AckIo, bm: &SeqBitmap) {
        for (r, &to) in peers.iter().enumerate() {
            io.send(to, r as u16, bm);
        }
    }
}

/// First repeat of the round in progress's ACKs after its last RESULT.
const WAITING_FIRST: Duration = Duration::from_millis(10);
/// First repeat of a round's ACKs after it ended.
const AFTER_ROUND_FIRST: Duration = Duration::from_millis(5);
/// Longest interval between two repeats.
const REPEAT_INTERVAL_MAX: Duration = Duration::from_secs(1);
/// Repeats after the last progress: 10 ms doubling to 1 s, 12 times, is
/// ~6.3 s, within the default 10 s deadline of a call.
const REPEATS: u32 = 12;
/// Fragments of one round whose ACKs are repeated (128 KiB of bits; a
/// round of more, over 379 M elements at 362 per fragment, is repeated up
/// to there).
const ACKED_SEQS_MAX: usize = 1 << 20;

/// When a set of ACKs is repeated next: at `at`, then at doubling
/// intervals (up to [`REPEAT_INTERVAL_MAX`]), [`REPEATS`] times.
#[derive(Debug, Default, Clone, Copy)]
struct Repeat {
    at: Option<Instant>,
    done: u32,
}

impl Repeat {
    fn starting(at: Instant) -> Repeat {
        Repeat { at: Some(at), done: 0 }
    }

    /// Whether a repeat is due at `now` (then the next one is scheduled;
    /// `first` is the interval before the first one).
    fn due(&mut self, now: Instant, first: Duration) -> bool {
        match self.at {
            Some(at) if at <= now => {
                self.done += 1;
                let interval = first
                    .saturating_mul(1 << self.done.min(16))
                    .min(REPEAT_INTERVAL_MAX);
                self.at = (self.done < REPEATS).then(|| now + interval);
                true
            }
            _ => false,
        }
    }
}

/// The seqs a round's RESULTs acknowledged, as bits from the round's first
/// seq: repeated as cumulative `AGK1` bitmaps.
#[derive(Debug)]
struct AckedSeqs {
    seq_base: u32,
    words: Vec<u64>,
}

impl AckedSeqs {
    fn new(seq_base: u32) -> AckedSeqs {
        AckedSeqs { seq_base, words: Vec::new() }
    }

    fn reset(&mut self, seq_base: u32) {
        self.seq_base = seq_base;
        self.words.clear();
    }

    fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    fn insert(&mut self, seq: u32) {
        let i = seq.wrapping_sub(self.seq_base) as usize;
        if i >= ACKED_SEQS_MAX {
            return;
        }
        if self.words.len() <= i / 64 {
            self.words.resize(i / 64 + 1, 0);
        }
        self.words[i / 64] |= 1 << (i % 64);
    }

    /// One bitmap per 1024 seqs that holds any, each as long as its last
    /// acknowledged seq needs.
    fn for_each_bitmap(&self, mut f: impl FnMut(&SeqBitmap)) {
        let per = usize::from(crate::wire::abi::ACK_MAX_BITS) / 64;
        for (c, chunk) in self.words.chunks(per).enumerate() {
            let Some(last) = chunk.iter().rposition(|&w| w != 0) else { continue };
            let nbits = last * 64 + 64 - chunk[last].leading_zeros() as usize;
            let base = self.seq_base.wrapping_add((c * per * 64) as u32);
            let Ok(mut bm) = SeqBitmap::new(base, nbits as u16) else { continue };
            for (k, &w) in chunk.iter().enumerate() {
                let mut w = w;
                while w != 0 {
                    let b = w.trailing_zeros() as usize;
                    bm.set(base.wrapping_add((k * 64 + b) as u32));
                    w &= w - 1;
                }
            }
            f(&bm);
        }
    }
}

impl Backend for KernelAggregator {
    fn kind(&self) -> BackendKind {
        BackendKind::Kernel
    }

    fn expect_round(&mut self, round: Round, seq_base: u32, now: Instant) {
        // The ended round's last RESULTs may still wait for their group ACK
        // (only the last fragment and a full group are acknowledged at once):
        // the repeats after the round cover them (`taken` has every seq), so
        // the pending group is dropped here rather than sent later, once.
        self.behalf.flush(&mut |_| {});
        std::mem::swap(&mut self.ended, &mut self.taken);
        self.taken.reset(seq_base);
        self.taken_repeat = Repeat::default();
        self.ended_repeat = if self.ended.is_empty() {
            Repeat::default()
        } else {
            Repeat::starting(now + AFTER_ROUND_FIRST)
        };
        self.round = round;
        self.seq_base = seq_base;
        // Early RESULTs of rounds before this one can no longer be taken.
        self.early
            .retain(|(h, _, _)| h.round.ahead_of(round) >= 0);
        self.recount_early();
        let pool = &mut self.pool;
        self.done.retain_mut(|d| {
            let keep = d.round.ahead_of(round) >= 0;
            if !keep {
                pool.push(std::mem::take(&mut d.values));
            }
            keep
        });
    }

    fn on_agg(
        &mut self,
        hdr: &AggHeader,
        payload: &[u8],
        from: SocketAddr,
        now: Instant,
        io: &mut AckIo,
    ) {
        if !hdr.is_result() || hdr.is_float() {
            return;
        }
        if !self.may_send_results(from) {
            // Taken, it would become the fragment's value, the genuine
            // RESULT would then be dropped as a duplicate, and the workers
            // would be told their contributions were reduced.
            io.counters.refused(Refusal::ResultFromWrongSource);
            return;
        }
        if hdr.round != self.round {
            // A later round than the one in progress: keep it for then.
            if hdr.round.ahead_of(self.round) > 0 {
                let cost = early_cost(payload.len());
                if self.early.len() >= EARLY_RESULTS_MAX
                    || self.early_bytes + cost > self.early_limit
                {
                    io.counters.refused(Refusal::EarlyResultOverLimit);
                    return;
                }
                self.early_bytes += cost;
                self.early.push((*hdr, payload.to_vec(), from));
            }
            return;
        }
        if !(hdr.frag_off as usize).is_multiple_of(self.per) {
            return;
        }
        let seq = self.seq_base.wrapping_add(hdr.frag_off / self.per as u32);
        let peers = &self.peers;
        let mut emit = |bm: &SeqBitmap| Self::fan_out(peers, io, bm);
        if self.behalf.check(seq) == Verdict::Duplicate {
            return; // the kernel emits one RESULT per slot; ignore copies
        }
        self.behalf
            .record(seq, hdr.is_last_fragment(), now, &mut emit);
        self.taken.insert(seq);
        self.taken_repeat = Repeat::starting(now + WAITING_FIRST);
        self.results += 1;
        let mut values = self.pool.pop().unwrap_or_default();
        values.resize(hdr.count as usize, 0);
        crate::wire::proto::read_i32_be(payload, &mut values);
        self.done.push(Done {
            round: hdr.round,
            frag_off: hdr.frag_off,
            values,
            overflow: hdr.has_overflow(),
        });
    }

    fn poll(&mut self, now: Instant, io: &mut AckIo) -> Option<Instant> {
        if self.early.iter().any(|(h, _, _)| h.round == self.round) {
            let round = self.round;
            let (now_due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.early)
                .into_iter()
                .partition(|(h, _, _)| h.round == round);
            self.early = later;
            self.recount_early();
            for (hdr, payload, from) in now_due {
                self.on_agg(&hdr, &payload, from, now, io);
            }
        }
        let peers = &self.peers;
        let mut next = self.behalf.poll(now, &mut |bm| Self::fan_out(peers, io, bm));
        for (acked, repeat, first) in [
            (&self.taken, &mut self.taken_repeat, WAITING_FIRST),
            (&self.ended, &mut self.ended_repeat, AFTER_ROUND_FIRST),
        ] {
            if repeat.due(now, first) {
                let before = *io.sent;
                acked.for_each_bitmap(|bm| Self::fan_out(peers, io, bm));
                io.counters.acks_repeated(*io.sent - before);
            }
            if let Some(at) = repeat.at {
                next = Some(next.map_or(at, |n: Instant| n.min(at)));
            }
        }
        next
    }

    fn take_completed(&mut self, round: Round, f: &mut dyn FnMut(Completed<'_>)) {
        let mut k = 0;
        while k < self.done.len() {
            if self.done[k].round == round {
                let d = self.done.swap_remove(k);
                f(Completed {
                    frag_off: d.frag_off,
                    values: &d.values,
                    overflow: d.overflow,
                });
                self.pool.push(d.values);
            } else {
                k += 1;
            }
        }
    }

    fn fragment_state(&self, _round: Round, _frag_off: u32) -> FragmentState {
        // The per-rank bitmaps live in the kernel's slot map; the runtime
        // does not read them.
        FragmentState::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::abi::{self, Op};
    use crate::runtime::outbox::Outbox;
    use crate::runtime::transport::Counters;

    fn result(round: u32, frag_off: u32, values: &[i32]) -> (AggHeader, Vec<u8>) {
        let hdr = AggHeader {
            job: 7,
            rank: abi::RESULT_RANK,
            seq: 0,
            round: Round(round),
            frag_off,
            op: Op::Sum,
            flags: abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT,
            count: values.len() as u16,
        };
        let mut payload = Vec::new();
        crate::wire::proto::write_i32_be(values, &mut payload);
        (hdr, payload)
    }

    /// Workers may start round r+1 before this application calls it; the
    /// kernel sends that RESULT once, so it must be kept until the round
    /// begins (and never taken for the round in progress).
    #[test]
    fn result_of_a_later_round_is_kept_until_that_round() {
        let (counters, mut out, mut sent) = (Counters::default(), Outbox::new(), 0u64);
        let peer = SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 9);
        let mut agg = KernelAggregator::new(vec![peer], 4, ReliabilityConfig::default(), Round(1), 100, peer.ip(), DEFAULT_EARLY_RESULT_BYTES);
        let now = Instant::now();
        let (hdr, payload) = result(2, 0, &[5, 6, 7, 8]);
        {
            let mut io = AckIo {
                out: &mut out,
                counters: &counters,
                job: 7,
                sent: &mut sent,
            };
            agg.on_agg(&hdr, &payload, peer, now, &mut io);
            agg.poll(now, &mut io);
        }
        let mut round1 = Vec::new();
        agg.take_completed(Round(1), &mut |c| round1.push(c.values.to_vec()));
        assert!(round1.is_empty(), "a round-2 RESULT is not round 1's");

        agg.expect_round(Round(2), 101, now);
        {
            let mut io = AckIo {
                out: &mut out,
                counters: &counters,
                job: 7,
                sent: &mut sent,
            };
            agg.poll(now, &mut io);
        }
        let mut round2 = Vec::new();
        agg.take_completed(Round(2), &mut |c| round2.push((c.frag_off, c.values.to_vec())));
        assert_eq!(round2, vec![(0, vec![5, 6, 7, 8])]);
        assert!(
            sent > 0,
            "the kept RESULT is acknowledged to the workers once its round begins"
        );
    }

    /// A RESULT is taken only from a worker's socket (the XDP RESULT keeps
    /// the completing contribution's source) or from the node itself (the
    /// user-space path); one from anywhere else, even a worker's host on
    /// another port, is refused and counted, and the genuine RESULT that
    /// follows is the value (a forged one taken first made it a duplicate).
    #[test]
    fn a_result_from_neither_a_worker_socket_nor_the_node_is_refused() {
        let (counters, mut out, mut sent) = (Counters::default(), Outbox::new(), 0u64);
        let worker = SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 5000);
        let node = std::net::Ipv4Addr::new(127, 0, 0, 2);
        let mut agg = KernelAggregator::new(vec![worker], 4, ReliabilityConfig::default(), Round(1), 100, node.into(), DEFAULT_EARLY_RESULT_BYTES);
        let now = Instant::now();
        let mut io = AckIo { out: &mut out, counters: &counters, job: 7, sent: &mut sent };
        let (hdr, forged) = result(1, 0, &[-1, -1, -1, -1]);
        for from in [
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 5001),
            SocketAddr::new(std::net::Ipv4Addr::new(127, 0, 0, 3).into(), 5000),
        ] {
            agg.on_agg(&hdr, &forged, from, now, &mut io);
        }
        let (hdr2, forged2) = result(2, 0, &[-1, -1, -1, -1]);
        agg.on_agg(&hdr2, &forged2, SocketAddr::new(std::net::Ipv4Addr::new(10, 9, 9, 9).into(), 5000), now, &mut io);
        assert_eq!(counters.refused_snapshot().results_from_wrong_source, 3);
        assert_eq!(agg.early_bytes(), 0, "a refused later-round RESULT is not kept");
        let (_, genuine) = result(1, 0, &[1, 2, 3, 4]);
        agg.on_agg(&hdr, &genuine, worker, now, &mut io);
        let (hdr4, from_node) = result(1, 4, &[5, 6, 7, 8]);
        agg.on_agg(&hdr4, &from_node, SocketAddr::new(node.into(), 40000), now, &mut io);
        let mut got = Vec::new();
        agg.take_completed(Round(1), &mut |c| got.push((c.frag_off, c.values.to_vec())));
        got.sort();
        assert_eq!(got, vec![(0, vec![1, 2, 3, 4]), (4, vec![5, 6, 7, 8])]);
        assert_eq!(counters.refused_snapshot().results_from_wrong_source, 3);
    }

    /// RESULTs of later rounds are kept up to the byte bound: a flood of
    /// them (65536 of 64 KiB could hold 4 GiB) keeps at most the bound and
    /// counts the rest; what was kept is taken when its round begins.
    #[test]
    fn early_results_stay_within_the_byte_bound() {
        let (counters, mut out, mut sent) = (Counters::default(), Outbox::new(), 0u64);
        let worker = SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 5000);
        let per = abi::MAX_ELEMS as usize;
        let limit = 1 << 20;
        let mut agg = KernelAggregator::new(vec![worker], per, ReliabilityConfig::default(), Round(1), 100, worker.ip(), limit);
        let now = Instant::now();
        let mut io = AckIo { out: &mut out, counters: &counters, job: 7, sent: &mut sent };
        let values = vec![3i32; per];
        let (mut hdr, payload) = result(2, 0, &values);
        hdr.flags &= !abi::AGG_F_LAST_FRAGMENT;
        let flood = 1000u32;
        for k in 0..flood {
            let h = AggHeader { round: Round(2 + k / 16), frag_off: (k % 16) * per as u32, ..hdr };
            agg.on_agg(&h, &payload, worker, now, &mut io);
            assert!(agg.early_bytes() <= limit, "{} bytes held after {k}", agg.early_bytes());
        }
        let kept = limit / early_cost(payload.len());
        assert_eq!(agg.early.len(), kept);
        assert_eq!(counters.refused_snapshot().early_results_over_limit, (flood as usize - kept) as u64);
        // Round 2 begins: its kept fragments are taken, their memory freed.
        agg.expect_round(Round(2), 101, now);
        agg.poll(now, &mut io);
        let mut n = 0;
        agg.take_completed(Round(2), &mut |c| {
            assert_eq!(c.values.len(), per);
            n += 1;
        });
        assert_eq!(n, kept.min(16));
        assert_eq!(agg.early_bytes(), (kept - kept.min(16)) * early_cost(payload.len()));
    }

    /// The RESULT of the last fragment can come before others (the kernel
    /// completes fragments on two CPUs); the ones after it are acknowledged
    /// by the group's delayed ACK. When the round ends first, that ACK must be
    /// among the ones the aggregator repeats: the workers' retransmissions of
    /// those fragments never reach it (the kernel drops them as duplicates),
    /// so a single lost copy left a worker waiting until its deadline.
    #[test]
    fn the_last_arrivals_ack_lingers_after_the_round() {
        let peer = SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 5000);
        let (counters, mut out, mut sent) = (Counters::default(), Outbox::new(), 0u64);
        let cfg = ReliabilityConfig {
            ack_delay: std::time::Duration::from_secs(3600), // no timer ACK in this test
            ..ReliabilityConfig::default()
        };
        let mut agg = KernelAggregator::new(vec![peer], 4, cfg, Round(1), 100, peer.ip(), DEFAULT_EARLY_RESULT_BYTES);
        let t0 = Instant::now();
        // Fragments 0..3 of round 1 (seqs 100..103): the last one (3) first.
        for (k, frag) in [3u32, 0, 1, 2].into_iter().enumerate() {
            let (mut hdr, payload) = result(1, frag * 4, &[1, 2, 3, 4]);
            if frag != 3 {
                hdr.flags &= !abi::AGG_F_LAST_FRAGMENT;
            }
            let mut io = AckIo { out: &mut out, counters: &counters, job: 7, sent: &mut sent };
            agg.on_agg(&hdr, &payload, peer, t0 + std::time::Duration::from_micros(k as u64), &mut io);
        }
        // Round over (the application took its 4 fragments); the next begins.
        agg.take_completed(Round(1), &mut |_| {});
        agg.expect_round(Round(2), 104, t0);
        // The repeats are due 5, 15, 35 and 75 ms after the round ended.
        for at in [5u64, 15, 35, 75] {
            let mut io = AckIo { out: &mut out, counters: &counters, job: 7, sent: &mut sent };
            agg.poll(t0 + std::time::Duration::from_millis(at), &mut io);
        }
        // Everything queued for the worker: the first ACK (seq 103 only),
        // then the lingering copies, which must cover 100..103.
        let mut complete = 0;
        for (to, d, _) in out.datagrams() {
            assert_eq!(to, peer);
            let ack = crate::wire::proto::AckMessage::decode(d).expect("an AGK1");
            if (100..104).all(|q| ack.bitmap.get(q)) {
                complete += 1;
            }
        }
        assert_eq!(complete, 4, "the complete ACK goes out with each of the 4 lingering repeats");
    }

    /// The repeats are cumulative bitmaps of at most 1024 seqs each,
    /// covering exactly the seqs acknowledged: 3001 fragments with every
    /// seventh missing give three bitmaps of 1024, 1023 and 953 seqs (each
    /// ends at its last acknowledged seq: 2047 is missing); a window of
    /// 1024 with nothing acknowledged gives none.
    #[test]
    fn repeated_acks_cover_exactly_the_acknowledged_seqs() {
        let base = u32::MAX - 500; // the seqs wrap inside the round
        let mut acked = AckedSeqs::new(base);
        let want: Vec<u32> = (0..=3000u32).filter(|i| i % 7 != 3).collect();
        for &i in &want {
            acked.insert(base.wrapping_add(i));
        }
        acked.insert(base.wrapping_add(ACKED_SEQS_MAX as u32)); // past the bound: not kept
        let mut got = Vec::new();
        let mut windows = Vec::new();
        acked.for_each_bitmap(|bm| {
            windows.push((bm.base_seq().wrapping_sub(base), bm.nbits()));
            got.extend(bm.received().map(|q| q.wrapping_sub(base)));
        });
        assert_eq!(windows, vec![(0, 1024), (1024, 1023), (2048, 953)]);
        assert_eq!(got, want);

        let mut sparse = AckedSeqs::new(0);
        sparse.insert(5);
        sparse.insert(2100);
        let mut windows = Vec::new();
        sparse.for_each_bitmap(|bm| windows.push((bm.base_seq(), bm.nbits(), bm.count_received())));
        assert_eq!(windows, vec![(0, 6, 1), (2048, 53, 1)], "no bitmap for the empty window 1024..2047");
    }

    /// While a round waits, its ACKs so far go out again 10 ms after its
    /// last RESULT, then 20, 40, ... ms later (at most 1 s apart), 12 times;
    /// a new RESULT starts over. Each repeat covers every fragment taken.
    #[test]
    fn a_waiting_round_repeats_its_acks_backing_off_until_a_result_arrives() {
        let peers: Vec<SocketAddr> =
            (0..2).map(|p| SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), 5000 + p)).collect();
        let (counters, mut out, mut sent) = (Counters::default(), Outbox::new(), 0u64);
        let cfg = ReliabilityConfig {
            ack_delay: Duration::from_secs(3600), // no timer ACK in this test
            ..ReliabilityConfig::default()
        };
        let mut agg = KernelAggregator::new(peers.clone(), 4, cfg, Round(1), 100, peers[0].ip(), DEFAULT_EARLY_RESULT_BYTES);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let take = |agg: &mut KernelAggregator, frag: u32, at: Instant, out: &mut Outbox, sent: &mut u64| {
            let (mut hdr, payload) = result(1, frag * 4, &[1, 2, 3, 4]);
            hdr.flags &= !abi::AGG_F_LAST_FRAGMENT;
            let mut io = AckIo { out, counters: &counters, job: 7, sent };
            agg.on_agg(&hdr, &payload, peers[0], at, &mut io);
        };
        take(&mut agg, 0, t0, &mut out, &mut sent);
        take(&mut agg, 1, t0, &mut out, &mut sent);
        // Poll every millisecond for 10 s; note when repeats go out.
        let mut repeats = Vec::new();
        for t in 0..10_000u64 {
            let now = t0 + ms(t);
            if t == 100 {
                take(&mut agg, 2, now, &mut out, &mut sent); // progress at 100 ms
            }
            let before = out.datagrams().count();
            let mut io = AckIo { out: &mut out, counters: &counters, job: 7, sent: &mut sent };
            agg.poll(now, &mut io);
            let new: Vec<_> = out.datagrams().skip(before).map(|(to, d, _)| (to, d.to_vec())).collect();
            if !new.is_empty() {
                assert_eq!(new.len(), peers.len(), "one bitmap to each worker at {t} ms");
                for (to, d) in &new {
                    let ack = crate::wire::proto::AckMessage::decode(d).expect("an AGK1");
                    let covered: Vec<u32> = ack.bitmap.received().collect();
                    let want: &[u32] = if t < 100 { &[100, 101] } else { &[100, 101, 102] };
                    assert_eq!(covered, want, "repeat to {to} at {t} ms");
                }
                repeats.push(t);
            }
        }
        let mut want = vec![10, 30, 70];
        let mut at = 110; // a RESULT at 100 ms: 10 ms after it, then doubling, at most 1 s apart
        for k in 0..REPEATS {
            want.push(at);
            at += (10u64 << (k + 1)).min(1000);
        }
        assert_eq!(repeats, want);
        assert_eq!(
            counters.snapshot().acks_repeated,
            (want.len() * peers.len()) as u64,
            "every repeat counted, one per worker"
        );
    }
}
