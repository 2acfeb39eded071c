//! One round (one collective call) of the state machine: what it sends,
//! receives and collects, how it starts (`start_broadcast`,
//! `start_reduce`), when it is complete, and how it ends
//! (`finish_broadcast`, `finish_reduce`: buffers back to the caller or to
//! the reuse pools, round and contribution seq advanced).

use std::collections::VecDeque;
use std::time::Instant;

use super::{CallOptions, Engine, Participant, RawF32, RawI32};
use crate::wire::abi::{Op, Round};
use crate::wire::proto;
use crate::runtime::backend::BackendKind;
use crate::runtime::fragment::{fragments, Coverage};
use crate::runtime::quantize;
use crate::runtime::error::CommError;

/// What a worker contributes: int32s, or floats quantized at `scale` as
/// each fragment is encoded.
pub(crate) enum Src {
    I32(Vec<i32>),
    /// A blocking call's slice (see [`super::Raw`]); the aggregator's receives the
    /// result.
    RawI32(RawI32),
    F32 {
        x: RawF32,
        scale: f64,
    },
    /// The aggregator's side of a float reduction: only the length.
    Len(usize),
}

impl Src {
    pub(super) fn len(&self) -> usize {
        match self {
            Src::I32(v) => v.len(),
            Src::RawI32(x) => x.len,
            Src::F32 { x, .. } => x.len,
            Src::Len(n) => *n,
        }
    }
}

/// Where a receiving call writes what arrives: bytes (broadcast, int
/// results of a `Vec` call, big-endian), int32s decoded from big-endian on
/// arrival, or floats dequantized with `div` on arrival.
pub(crate) enum Sink {
    Bytes(Vec<u8>),
    I32(RawI32),
    F32 { out: RawF32, div: f64 },
}

impl Sink {
    pub(super) fn len_bytes(&self) -> usize {
        match self {
            Sink::Bytes(b) => b.len(),
            Sink::I32(out) => out.len * 4,
            Sink::F32 { out, .. } => out.len * 4,
        }
    }

    /// Writes `data` at byte offset `off` (in range, 4-aligned for floats).
    pub(super) fn put(&mut self, off: usize, data: &[u8]) {
        match self {
            Sink::Bytes(b) => b[off..off + data.len()].copy_from_slice(data),
            Sink::I32(out) => {
                // SAFETY: as for F32 below.
                let o = unsafe { out.slice_mut() };
                proto::read_i32_be(data, &mut o[off / 4..(off + data.len()) / 4]);
            }
            Sink::F32 { out, div } => {
                // SAFETY: the engine holds no other reference into `out`
                // while this one lives (RawF32's contract).
                let o = unsafe { out.slice_mut() };
                quantize::dequantize_be_into(data, *div, &mut o[off / 4..(off + data.len()) / 4]);
            }
        }
    }
}

/// What a reduction call leaves: the aggregator's result vector, the
/// contribution source back, a worker's received result.
pub(crate) struct Reduced {
    pub(crate) values: Option<(Vec<i32>, bool)>,
    pub(crate) src: Option<Src>,
    pub(crate) sink: Option<(Sink, bool)>,
}

pub(super) struct Contrib {
    pub(super) src: Src,
    pub(super) op: Op,
    pub(super) next: usize,
    pub(super) nfrags: usize,
    pub(super) seq_base: u32,
}

pub(super) struct BcastOut {
    /// Bytes to send (plain broadcast); empty when forwarding results.
    pub(super) bytes: Vec<u8>,
    pub(super) len_bytes: usize,
    pub(super) queue: VecDeque<u32>,
    pub(super) overflow: Coverage,
    pub(super) dests: u64,
}

pub(super) struct BcastIn {
    pub(super) root: usize,
    pub(super) sink: Sink,
    pub(super) cov: Coverage,
    pub(super) overflow: bool,
    /// The data are RESULTs copied by the node's TC program (`AGG1`), not
    /// `AGB1` forwarded by the aggregator's runtime.
    pub(super) results: bool,
}

pub(super) struct Collect {
    /// The result vector: the caller's slice (a blocking int call) or an
    /// owned vector `reduce` keeps until the call is over (see
    /// [`super::Raw`]).
    pub(super) out: RawI32,
    pub(super) cov: Coverage,
    pub(super) overflow: bool,
}

/// The state of the round in progress: what this participant sends
/// (`contrib`: its contribution; `bout`: broadcast data or results to
/// forward), receives (`bin`) and collects (`collect`: the aggregator's
/// result).
pub(crate) struct RoundState {
    pub(super) name: &'static str,
    pub(super) round: Round,
    pub(super) op: Op,
    /// Aggregator, kernel allreduce through the result group: completed
    /// fragments are registered in `res_tx` (the kernel sent them).
    pub(super) rout: bool,
    pub(super) contrib: Option<Contrib>,
    pub(super) bout: Option<BcastOut>,
    pub(super) bin: Option<BcastIn>,
    pub(super) collect: Option<Collect>,
    /// The call's deadline and options (a partial result on timeout).
    pub(super) deadline: Instant,
    pub(super) opts: CallOptions,
    /// Everything sent was acknowledged and everything expected arrived
    /// (set by `poll_transmit`).
    pub(super) complete: bool,
    /// Fragments of a reduction (the contribution seqs the round uses).
    pub(super) nfrags: usize,
    /// The aggregator's owned result vector (kept, unresized, until the
    /// round is over: `Collect::out` points into it).
    pub(super) owned: Option<Vec<i32>>,
    /// The source a reduction did not send from (the aggregator's), handed
    /// back at the end.
    pub(super) unsent: Option<Src>,
}

impl Engine {
    /// Starts a broadcast from participant index `root` at `now`: the root
    /// sends `data`; everyone else receives into `data` (its length).
    pub(crate) fn start_broadcast(
        &mut self,
        now: Instant,
        root: usize,
        data: Vec<u8>,
        opts: CallOptions,
    ) {
        let mut st = self.new_round("broadcast", now, opts);
        let n = fragments(data.len(), self.chunk);
        if root == self.me {
            let mut q = VecDeque::with_capacity(n);
            q.extend(0..n as u32);
            let ovf = self.cov(0);
            st.bout = Some(BcastOut {
                len_bytes: data.len(),
                bytes: data,
                queue: q,
                overflow: ovf,
                dests: self.all_but(self.me),
            });
        } else {
            let cov = self.cov(n);
            st.bin = Some(BcastIn {
                root,
                sink: Sink::Bytes(data),
                cov,
                overflow: false,
                results: false,
            });
        }
        self.enter_round(st, now);
    }

    /// Ends the broadcast (`failed`: it timed out or was abandoned at
    /// `now`) and returns its bytes: the root's data, or what arrived.
    pub(crate) fn finish_broadcast(&mut self, now: Instant, failed: bool) -> Vec<u8> {
        let Some(mut st) = self.current.take() else {
            return Vec::new();
        };
        let out = st
            .bout
            .take()
            .map(|b| b.bytes)
            .or_else(|| {
                st.bin.take().map(|b| {
                    self.spare_cov.push(b.cov);
                    match b.sink {
                        Sink::Bytes(v) => v,
                        Sink::I32(_) | Sink::F32 { .. } => Vec::new(),
                    }
                })
            })
            .unwrap_or_default();
        self.end_round(&mut st, failed, 0, now);
        out
    }

    /// Starts a reduction round (`all`: allreduce) at `now`. `src`: a
    /// worker's contribution (the aggregator passes its output vector as
    /// `Src::I32`, the caller's slice as `Src::RawI32`, or `Src::Len`: a
    /// reused vector); `sink`: where a worker's allreduce result goes
    /// (default: a reused byte buffer).
    pub(crate) fn start_reduce(
        &mut self,
        now: Instant,
        all: bool,
        op: Op,
        src: Src,
        sink: Option<Sink>,
        opts: CallOptions,
    ) {
        let mut st = self.new_round(if all { "allreduce" } else { "reduce" }, now, opts);
        let len = src.len();
        let n = fragments(len, self.per);
        let is_agg = self.cfg.me == Participant::Aggregator;
        st.op = op;
        let in_kernel =
            all && self.cfg.backend == BackendKind::Kernel && self.cfg.kernel_result_group;
        let mut src = Some(src);
        // The aggregator's owned result vector (kept, unresized, until the
        // call is over: `Collect::out` points into it).
        let mut owned: Option<Vec<i32>> = None;
        if is_agg {
            let out = match src.take() {
                Some(Src::RawI32(x)) => x,
                Some(Src::I32(v)) => RawI32::of(owned.insert(v)),
                _ => {
                    let mut v = std::mem::take(&mut self.spare_i32);
                    v.clear();
                    v.resize(len, 0);
                    RawI32::of(owned.insert(v))
                }
            };
            if let Some(b) = self.backend.as_mut() {
                let (full, last) = (len / self.per, len % self.per);
                b.reserve(op, self.per, full);
                if last > 0 {
                    b.reserve(op, last, 1);
                }
            }
            let cov = self.cov(n);
            st.collect = Some(Collect {
                out,
                cov,
                overflow: false,
            });
            if in_kernel {
                self.res_tx.set_next_seq(self.agg_seq);
                st.rout = true;
            } else if all {
                let ovf = self.cov(n);
                let mut queue = std::mem::take(&mut self.spare_queue);
                queue.clear();
                st.bout = Some(BcastOut {
                    bytes: Vec::new(),
                    len_bytes: len * 4,
                    queue,
                    overflow: ovf,
                    dests: self.all_but(self.me),
                });
            }
        } else {
            self.agg_tx.set_next_seq(self.agg_seq);
            self.agg_tx.set_window(if in_kernel {
                self.agg_windows.allreduce
            } else {
                self.agg_windows.reduce
            });
            st.contrib = src.take().map(|src| Contrib {
                src,
                op,
                next: 0,
                nfrags: n,
                seq_base: self.agg_seq,
            });
            if all {
                let cov = self.cov(n);
                let sink = sink.unwrap_or_else(|| {
                    let mut b = std::mem::take(&mut self.spare_bytes);
                    b.clear();
                    b.resize(len * 4, 0);
                    Sink::Bytes(b)
                });
                st.bin = Some(BcastIn {
                    root: self.cfg.workers() as usize,
                    sink,
                    cov,
                    overflow: false,
                    results: in_kernel,
                });
            }
        }
        st.nfrags = n;
        st.owned = owned;
        st.unsent = src;
        self.enter_round(st, now);
    }

    /// Ends the reduction round (`failed`: it timed out or was abandoned at
    /// `now`) and returns what it leaves (see [`Reduced`]).
    pub(crate) fn finish_reduce(&mut self, now: Instant, failed: bool) -> Reduced {
        let Some(mut st) = self.current.take() else {
            return Reduced {
                values: None,
                src: None,
                sink: None,
            };
        };
        let n = st.nfrags;
        if let Some(c) = st.contrib.as_ref() {
            self.recent.push_back((st.round, c.seq_base, c.nfrags));
            if self.recent.len() > 8 {
                self.recent.pop_front();
            }
        }
        let values = st.collect.take().map(|c| {
            self.spare_cov.push(c.cov);
            // Empty for the caller's slice (the result is already in it).
            (st.owned.take().unwrap_or_default(), c.overflow)
        });
        let sink = st.bin.take().map(|b| {
            self.spare_cov.push(b.cov);
            (b.sink, b.overflow)
        });
        if let Some(b) = st.bout.take() {
            self.spare_cov.push(b.overflow);
            self.spare_queue = b.queue;
        }
        let out = Reduced {
            values,
            src: st.contrib.take().map(|c| c.src).or(st.unsent.take()),
            sink,
        };
        self.end_round(&mut st, failed, n, now);
        out
    }

    /// What every round's end does: a failed round's datagrams are
    /// abandoned (the receivers drop their holes, see the reliability
    /// module); buffers go back to the pools; the round and contribution
    /// seq advance (`nfrags` seqs) on every participant alike, so the next
    /// call lines up; stashed data of rounds now past is dropped.
    pub(super) fn end_round(
        &mut self,
        st: &mut RoundState,
        failed: bool,
        nfrags: usize,
        now: Instant,
    ) {
        if failed {
            self.agg_tx.forget_all();
            self.bc_tx.forget_all();
            self.res_tx.forget_all();
        }

        for c in [
            st.bin.take().map(|b| b.cov),
            st.collect.take().map(|c| c.cov),
            st.bout.take().map(|b| b.overflow),
        ]
        .into_iter()
        .flatten()
        {
            self.spare_cov.push(c);
        }
        self.round = self.round.plus(1);
        self.agg_seq = self.agg_seq.wrapping_add(nfrags as u32);
        if let Some(b) = self.backend.as_mut() {
            b.expect_round(self.round, self.agg_seq, now);
        }
        let r = self.round;
        let pool = &mut self.stash_pool;
        self.stash.retain_mut(|s| {
            let keep = s.round.ahead_of(r) >= 0;
            if !keep {
                pool.push(std::mem::take(&mut s.buf));
            }
            keep
        });
    }

    /// Makes `st` the round in progress at `now`: takes the data that
    /// arrived before the call started (stashed broadcast fragments, the
    /// aggregator's completed fragments).
    fn enter_round(&mut self, mut st: RoundState, now: Instant) {
        let stash = std::mem::take(&mut self.stash);
        let mut keep = Vec::new();
        let mut completed = false;
        for s in stash {
            if s.round == st.round {
                completed |= self.deliver_bcast(&mut st, s.from, &s.buf, now);
                self.stash_pool.push(s.buf);
            } else {
                keep.push(s);
            }
        }
        self.stash = keep;
        if let Some(root) = st.bin.as_ref().filter(|_| completed).map(|b| b.root) {
            // The kept data end the message here, where an arrival inside
            // the call would have been its last and acknowledged at once:
            // the sender's call waits for this ACK, which the kept
            // arrivals left to the `ack_delay` timer (a one-datagram
            // broadcast that arrived before the call cost its root 1 ms).
            self.ack_broadcast_now(root);
        }
        self.drain_completed(&mut st, now);
        self.current = Some(Box::new(st));
    }

    /// How the round in progress ended, asked after
    /// [`Engine::poll_transmit`] at `now`: `Ok` once complete, the timeout
    /// error (who is missing) once `now` is past its deadline, `None` while
    /// it runs (or when no round is in progress).
    pub(crate) fn round_outcome(&mut self, now: Instant) -> Option<Result<(), CommError>> {
        let st = self.current.as_ref()?;
        if st.complete {
            return Some(Ok(()));
        }
        if now < st.deadline {
            return None;
        }
        let mut st = self.current.take()?;
        let e = self.timeout_error(&mut st);
        self.current = Some(st);
        Some(Err(e))
    }

    pub(super) fn is_done(&mut self, st: &mut RoundState) -> bool {
        if let Some(b) = &st.bin {
            if !b.cov.is_complete() {
                return false;
            }
            if st.contrib.is_some() {
                // allreduce worker: the result proves every contribution arrived.
                self.agg_tx.forget_all();
                return true;
            }
        }
        if let Some(c) = &st.contrib {
            if c.next < c.nfrags || !self.agg_tx.is_idle() {
                return false;
            }
        }
        if let Some(c) = &st.collect {
            if !c.cov.is_complete() {
                return false;
            }
            if st.rout && !self.res_tx.is_idle() {
                return false;
            }
        }
        if let Some(b) = &st.bout {
            let sent_all =
                b.queue.is_empty() && st.collect.as_ref().is_none_or(|c| c.cov.is_complete());
            if !sent_all || !self.bc_tx.is_idle() {
                return false;
            }
        }
        true
    }
}
