//! What arrives into the round in progress: broadcast fragments (and
//! results the aggregator forwards as broadcast), a worker's RESULTs of an
//! in-kernel allreduce, and the aggregator's completed fragments from its
//! backend; each written once at its offset.

use std::time::Instant;

use super::round::RoundState;
use super::Engine;
use crate::wire::abi;
use crate::wire::proto::{self, AckKind, AggHeader, RuntimeSubHeader, SeqBitmap};
use crate::runtime::fragment::fragment_range;
use crate::wire::reliability::Verdict;

impl Engine {
    /// Places one broadcast fragment (payload after the AGB1 header: the
    /// runtime sub-header, then the fragment's bytes) into the receiving
    /// call; returns whether it completed the message.
    pub(super) fn deliver_bcast(
        &mut self,
        st: &mut RoundState,
        from: usize,
        payload: &[u8],
        now: Instant,
    ) -> bool {
        let Some(b) = st.bin.as_mut() else {
            return false;
        };
        if b.root != from {
            return false;
        }
        let Some((sub, data)) = RuntimeSubHeader::decode(payload) else {
            return false;
        };
        let off = sub.offset as usize;
        if !off.is_multiple_of(self.chunk) || off + data.len() > b.sink.len_bytes() {
            return false;
        }
        let i = off / self.chunk;
        let expect = fragment_range(i, b.sink.len_bytes(), self.chunk).len();
        if data.len() != expect {
            return false;
        }
        if st.contrib.as_ref().is_some_and(|c| i >= c.next) {
            // A result of a fragment this worker has not sent yet cannot be
            // right (and would overwrite floats not yet quantized).
            return false;
        }
        if b.cov.insert(i) {
            self.counters.delivered(data.len());
            b.sink.put(off, data);
            b.overflow |= sub.overflow;
            if let Some(c) = st.contrib.as_ref() {
                // allreduce: the result of fragment i acknowledges our contribution to it.
                self.agg_tx.ack_seq(0, c.seq_base.wrapping_add(i as u32), now);
            }
        }
        b.cov.is_complete()
    }

    /// Worker: a RESULT from the aggregator's node (a TC copy of the
    /// in-kernel allreduce, or the aggregator runtime's retransmission).
    /// Fragment i of a reduction is contribution seq `seq_base + i`: the
    /// result acknowledges our contribution and is acknowledged (`AGK1`
    /// kind aggregation, our rank) to the aggregator's runtime under that seq.
    pub(super) fn on_result(
        &mut self,
        h: &AggHeader,
        payload: &[u8],
        now: Instant,
        op: &mut Option<&mut RoundState>,
    ) {
        if h.is_float() || !(h.frag_off as usize).is_multiple_of(self.per) {
            return;
        }
        let i = h.frag_off as usize / self.per;
        let me = self.me as u16;
        let (job, agg) = (self.cfg.job, self.addrs[self.cfg.workers() as usize]);
        let current = op
            .as_deref_mut()
            .filter(|o| o.round == h.round && o.contrib.is_some());
        if let Some(o) = current {
            let Some(c) = o.contrib.as_ref() else { return };
            if i >= c.nfrags {
                return;
            }
            let seq = c.seq_base.wrapping_add(i as u32);
            // Whatever the call, the result proves our contribution arrived.
            // (Workers are therefore clocked by the kernel, not by the
            // aggregator runtime: its socket buffer must hold the backlog,
            // see `build`.)
            self.agg_tx.ack_seq(0, seq, now);
            let Some(b) = o.bin.as_mut().filter(|b| b.results) else {
                return;
            };
            let off = h.frag_off as usize * 4;
            if payload.len() != h.count as usize * 4
                || off + payload.len() > b.sink.len_bytes()
                || i >= c.next
            {
                return;
            }
            // The fragment's coverage, not the ACK tracker, decides whether
            // the data is new: the tracker evicts a group with holes once
            // results run 2 groups ahead (the kernel sends results as fast as
            // contributions complete, unbounded by any window), and then
            // calls the retransmission of such a hole a duplicate. Dropping
            // it would leave the hole forever while the re-ACK tells the
            // aggregator it arrived.
            let fresh = b.cov.insert(i);
            if fresh {
                b.sink.put(off, payload);
                b.overflow |= h.has_overflow();
                self.counters.delivered(payload.len());
            }
            let out = &mut self.out;
            let mut emit = |bm: &SeqBitmap| out.ack(job, me, AckKind::Aggregation, bm, agg);
            if self.res_rx.check(seq) == Verdict::Duplicate {
                if !fresh {
                    self.counters.duplicate();
                }
                self.res_rx.reack(seq, &mut emit);
                return;
            }
            if b.cov.is_complete() && self.cfg.node_served {
                // The call's last RESULT. The node's result service retires
                // round r for every worker when round r+1's first RESULT
                // comes (it proves every worker contributed to r+1, so had
                // r's RESULTs), so this ACK matters only if no next call
                // follows: it waits until this worker has been idle for
                // `ack_delay` (or the communicator closes), and a stream of
                // calls sends none (docs/PROTOCOL.md "Implicit
                // acknowledgement of RESULTs").
                self.res_rx.record_deferred(seq, now, &mut emit);
            } else {
                let last = b.cov.is_complete();
                self.res_rx.record(seq, last, now, &mut emit);
            }
            return;
        }
        // A late copy or retransmission of a finished reduction's result: our
        // acknowledgement was lost, send it again.
        let Some(&(_, base, n)) = self.recent.iter().find(|r| r.0 == h.round) else {
            return;
        };
        if i >= n {
            return;
        }
        let seq = base.wrapping_add(i as u32);
        let out = &mut self.out;
        let mut emit = |bm: &SeqBitmap| out.ack(job, me, AckKind::Aggregation, bm, agg);
        self.counters.duplicate();
        if self.res_rx.check(seq) == Verdict::Duplicate {
            self.res_rx.reack(seq, &mut emit);
        } else {
            self.res_rx.record(seq, true, now, &mut emit);
        }
    }

    /// Moves completed fragments of the collecting call into its output
    /// (and, for allreduce, queues them for broadcast).
    pub(super) fn drain_completed(&mut self, st: &mut RoundState, now: Instant) {
        let Some(c) = st.collect.as_mut() else { return };
        let Some(be) = self.backend.as_mut() else {
            return;
        };
        let per = self.per;
        let bout = st.bout.as_mut();
        let mut queue = bout;
        let res_tx = st.rout.then_some(&mut self.res_tx);
        let mut res_tx = res_tx;
        let (job, round, op, seq_base) = (self.cfg.job, st.round, st.op, self.agg_seq);
        let nfrags = c.cov.total();
        let all_workers = (1u64 << self.cfg.peers.len().min(63)) - 1;
        let counters = &self.counters;
        let early = &mut self.res_early;
        be.take_completed(st.round, &mut |done| {
            let off = done.frag_off as usize;
            if !off.is_multiple_of(per) {
                return;
            }
            let i = off / per;
            let range = fragment_range(i, c.out.len, per);
            if range.len() != done.values.len() || !c.cov.insert(i) {
                return;
            }
            // SAFETY: no other reference into c.out lives now.
            let out = unsafe { c.out.slice_mut() };
            out[range].copy_from_slice(done.values);
            c.overflow |= done.overflow;
            counters.delivered(done.values.len() * 4);
            if let Some(w) = res_tx.as_deref_mut() {
                // The kernel already sent this result to every worker; keep it
                // until each acknowledges it (retransmitted by unicast).
                let hdr = AggHeader {
                    job,
                    rank: abi::RESULT_RANK,
                    seq: 0,
                    round,
                    frag_off: done.frag_off,
                    op,
                    flags: abi::AGG_F_RESULT
                        | if i + 1 == nfrags {
                            abi::AGG_F_LAST_FRAGMENT
                        } else {
                            0
                        }
                        | if done.overflow {
                            abi::AGG_F_OVERFLOW
                        } else {
                            0
                        },
                    count: done.values.len() as u16,
                };
                let seq = seq_base.wrapping_add(i as u32);
                let _ = w.send_at(
                    seq,
                    all_workers,
                    now,
                    |seq, buf| proto::encode_agg_into(&AggHeader { seq, ..hdr }, done.values, buf),
                    &mut |_, _| {},
                );
                if let Some(bits) = early.remove(&seq) {
                    w.ack_early_bits(seq, bits);
                }
            }
            if let Some(b) = queue.as_deref_mut() {
                if done.overflow {
                    b.overflow.insert(i);
                }
                b.queue.push_back(i as u32);
            }
        });
    }
}
