//! What arrives, by message kind: `AGK1` acknowledgements to the send
//! windows, `AGB1` data to the round or the stash, `AGG1` to the
//! aggregator's backend or (a worker's RESULTs) to the round; and who may
//! send what (see `docs/RUNTIME.md`, "Who may send what").

use std::net::SocketAddr;
use std::time::Instant;

use super::round::RoundState;
use super::{Engine, Participant, Stashed, RES_EARLY_LIMIT};
use crate::wire::proto::{self, AckKind, AckMessage, MessageKind, RuntimeSubHeader};
use crate::runtime::backend::{AckIo, BackendKind};
use crate::wire::reliability::Verdict;
use crate::runtime::transport::Refusal;

impl Engine {
    pub(super) fn dispatch(
        &mut self,
        now: Instant,
        from: SocketAddr,
        d: &[u8],
        op: &mut Option<&mut RoundState>,
    ) {
        match proto::classify(d) {
            Some(MessageKind::Ack) => {
                let Ok(a) = AckMessage::decode(d) else { return };
                if a.id != self.cfg.job && self.tc.as_ref().is_none_or(|t| t.id != a.id) {
                    return;
                }
                let out = &mut self.out;
                match a.kind {
                    AckKind::Aggregation => {
                        if let Participant::Worker(me) = self.cfg.me {
                            // Contributions are acknowledged by the
                            // aggregator's socket only (the socket
                            // aggregator on `job_port`; the kernel backend's
                            // runtime, on the kernel's behalf, from
                            // `result_port`): a forged ACK would end the
                            // retransmission of a contribution that was lost.
                            if from != self.addrs[self.cfg.workers() as usize] {
                                self.counters.refused(Refusal::AckFromWrongSource);
                                return;
                            }
                            if a.rank == me {
                                let target = self.cfg.contrib_target();
                                self.agg_tx
                                    .on_ack(0, &a.bitmap, now, &mut |_, b| out.resend(target, b));
                            }
                        } else if (a.rank as usize) >= self.cfg.peers.len()
                            || self.addrs[a.rank as usize] != from
                        {
                            self.counters.refused(Refusal::AckFromWrongSource);
                        } else {
                            // A worker acknowledges results (in-kernel allreduce).
                            let addrs = &self.addrs;
                            self.res_tx
                                .on_ack(a.rank as usize, &a.bitmap, now, &mut |d, b| {
                                    out.resend(addrs[d], b)
                                });
                            let res_tx = &self.res_tx;
                            let bit = 1u64 << a.rank.min(63);
                            for q in a.bitmap.received() {
                                if !res_tx.is_known(q) {
                                    *self.res_early.entry(q).or_default() |= bit;
                                }
                            }
                            if self.res_early.len() > RES_EARLY_LIMIT {
                                // Drop what was registered or retired meanwhile;
                                // if that is not enough, the oldest knowledge
                                // is lost and only costs resends.
                                self.res_early.retain(|q, _| !res_tx.is_known(*q));
                                if self.res_early.len() > RES_EARLY_LIMIT {
                                    self.res_early.clear();
                                }
                            }
                        }
                    }
                    AckKind::Broadcast => {
                        let dest = a.rank as usize;
                        if dest >= self.addrs.len() || self.addrs[dest] != from {
                            self.counters.refused(Refusal::AckFromWrongSource);
                        } else {
                            let addrs = &self.addrs;
                            let mut tc = self.tc.as_mut();
                            self.bc_tx.on_ack(dest, &a.bitmap, now, &mut |d, b| match tc
                                .as_deref_mut()
                            {
                                Some(t) => t.resend(out, b, d),
                                None => out.resend(addrs[d], b),
                            });
                        }
                    }
                }
            }
            Some(MessageKind::Bcast) => {
                let Ok((h, payload)) = proto::split_bcast(d) else {
                    return;
                };
                let Some((sub, _)) = RuntimeSubHeader::decode(payload) else {
                    return;
                };
                // Any group id: the source socket identifies the root (a TC
                // root uses its node's group id); ACKs carry the same id.
                let Some(&idx) = self.index.get(&from) else {
                    self.counters.refused(Refusal::BroadcastFromWrongSource);
                    return;
                };
                if idx == self.me {
                    return;
                }
                self.bc_group[idx] = h.group;
                let round = sub.round;
                let (job, me) = (h.group, self.me as u16);
                match self.bc_rx[idx].check(h.seq) {
                    Verdict::Duplicate => {
                        self.counters.duplicate();
                        let out = &mut self.out;
                        self.bc_rx[idx].reack(h.seq, &mut |bm| {
                            out.ack(job, me, AckKind::Broadcast, bm, from)
                        })
                    }
                    Verdict::New => {
                        let cur = op.as_ref().map_or(self.round, |o| o.round);
                        let wanted = op.as_ref().is_some_and(|o| {
                            o.round == round && o.bin.as_ref().is_some_and(|b| b.root == idx)
                        });
                        let last;
                        if wanted {
                            let o = op.as_deref_mut().expect("wanted implies an op");
                            last = self.deliver_bcast(o, idx, payload, now);
                        } else if round.ahead_of(cur) > 0
                            || (op.is_none() && round == cur)
                        {
                            // Early data of a later call: keep it (and ACK it) if there is room.
                            if self.stash.len() >= self.cfg.stash_limit {
                                return;
                            }
                            let mut b = self.stash_pool.pop().unwrap_or_default();
                            b.clear();
                            b.extend_from_slice(payload);
                            self.stash.push(Stashed {
                                buf: b,
                                from: idx,
                                round,
                            });
                            last = false;
                        } else {
                            last = false; // old or unexpected: acknowledge and drop
                        }
                        let out = &mut self.out;
                        self.bc_rx[idx].record(h.seq, last, now, &mut |bm| {
                            out.ack(job, me, AckKind::Broadcast, bm, from)
                        });
                    }
                }
            }
            Some(MessageKind::Agg) => {
                let Ok((h, payload)) = proto::split_agg(d) else {
                    return;
                };
                if h.job != self.cfg.job {
                    return;
                }
                let Some(b) = self.backend.as_mut() else {
                    if h.is_result() {
                        if self.may_send_results(from) {
                            self.on_result(&h, payload, now, op);
                        } else {
                            // Taken, it would become the fragment's value
                            // (the genuine RESULT then a duplicate) and
                            // acknowledge this worker's contribution.
                            self.counters.refused(Refusal::ResultFromWrongSource);
                        }
                    }
                    return;
                };
                let mut io = AckIo {
                    out: &mut self.out,
                    counters: &self.counters,
                    job: self.cfg.job,
                    sent: &mut self.acks_sent,
                };
                b.on_agg(&h, payload, from, now, &mut io);
                if h.is_result() {
                    // Take it into the call at once (an in-kernel allreduce
                    // registers it before the workers' ACKs of it arrive).
                    if let Some(st) = op.as_deref_mut() {
                        self.drain_completed(st, now);
                    }
                }
            }
            None => {}
        }
    }

    /// Worker: whether `from` may send this worker RESULTs: the aggregator's
    /// node, kernel backend only (the socket backend's results are `AGB1`).
    /// The aggregator's runtime resends from `result_port`; the node's TC
    /// copies leave with the node's address and the UDP source port of the
    /// contribution that completed the slot, a worker's data port.
    fn may_send_results(&self, from: SocketAddr) -> bool {
        self.cfg.backend == BackendKind::Kernel
            && from.ip() == self.cfg.aggregator
            && (from.port() == self.cfg.result_port
                || self.cfg.peers.iter().any(|p| p.port() == from.port()))
    }
}
