//! The rounds each call of a [`crate::runtime::Communicator`] makes, over
//! any driver of the state machine: a broadcast or an int reduction is one
//! round; a float reduction agrees on the scale first (adaptive: a
//! one-element MAX allreduce), then reduces, and reruns once at an agreed
//! scale when a fixed one overflowed (`FixedOrAdaptive`).

use std::time::Instant;

use crate::abi::Op;
use crate::proto;
use crate::runtime::comm::{CallOptions, Participant, RawF32, RawI32, ReduceOutput, Request};
use crate::runtime::engine::{Engine, Reduced, Sink, Src};
use crate::runtime::quantize::{self, Quantization};
use crate::runtime::CommError;

/// Runs the rounds of a state machine to their end: the I/O driver waits on
/// its socket and clock ([`crate::runtime::driver`]); a test could deliver
/// datagrams by hand.
pub(crate) trait RoundDriver {
    /// The state machine.
    fn engine(&mut self) -> &mut Engine;
    /// The driver's clock.
    fn now(&self) -> Instant;
    /// Drives the round started on the engine until
    /// [`Engine::round_outcome`] says how it ended (or the communicator
    /// closes: [`CommError::Closed`]).
    fn run_round(&mut self) -> Result<(), CommError>;
    /// A round ended: the engine's position advanced.
    fn round_ended(&mut self) {}
}

/// The calls, for every [`RoundDriver`].
pub(crate) trait Calls: RoundDriver {
    /// Runs one request of the communicator and replies to it.
    fn execute(&mut self, req: Request) {
        match req {
            Request::Bcast {
                root,
                data,
                opts,
                reply,
            } => {
                let r = self.broadcast(root, data, opts);
                let _ = reply.send(r);
            }
            Request::Reduce {
                all,
                op,
                data,
                opts,
                reply,
            } => {
                let r = self.reduce_i32(all, op, data, opts);
                let _ = reply.send(r);
            }
            Request::ReduceI32In {
                all,
                op,
                data,
                opts,
                reply,
            } => {
                let r = self.reduce_i32_in(all, op, data, opts);
                // Last use of `data` was above: the caller may take its slice back.
                let _ = reply.send(r);
            }
            Request::ReduceF32 {
                all,
                mean,
                mut data,
                opts,
                reply,
            } => {
                let r = self.reduce_f32(all, mean, RawF32::of(&mut data), opts);
                let _ = reply.send(r.map(|()| data));
            }
            Request::ReduceF32In {
                all,
                mean,
                data,
                opts,
                reply,
            } => {
                let r = self.reduce_f32(all, mean, data, opts);
                // Last use of `data` was above: the caller may take its slice back.
                let _ = reply.send(r);
            }
        }
    }
    /// Broadcast from participant index `root` (see
    /// [`Engine::start_broadcast`]).
    fn broadcast(
        &mut self,
        root: usize,
        data: Vec<u8>,
        opts: CallOptions,
    ) -> Result<Vec<u8>, CommError> {
        let now = self.now();
        self.engine().start_broadcast(now, root, data, opts);
        let res = self.run_round();
        let now = self.now();
        let out = self.engine().finish_broadcast(now, res.is_err());
        self.round_ended();
        res.map(|()| out)
    }

    /// One reduction round (see [`Engine::start_reduce`]).
    fn reduce(
        &mut self,
        all: bool,
        op: Op,
        src: Src,
        sink: Option<Sink>,
        opts: CallOptions,
    ) -> Result<Reduced, CommError> {
        let now = self.now();
        self.engine().start_reduce(now, all, op, src, sink, opts);
        let res = self.run_round();
        let now = self.now();
        let out = self.engine().finish_reduce(now, res.is_err());
        self.round_ended();
        res.map(|()| out)
    }

    fn reduce_i32(
        &mut self,
        all: bool,
        op: Op,
        data: Vec<i32>,
        opts: CallOptions,
    ) -> Result<ReduceOutput, CommError> {
        let r = self.reduce(all, op, Src::I32(data), None, opts)?;
        if let Some((values, overflow)) = r.values {
            return Ok(ReduceOutput {
                values,
                has_result: true,
                overflow,
            });
        }
        let c = match r.src {
            Some(Src::I32(v)) => v,
            _ => Vec::new(),
        };
        match r.sink {
            Some((Sink::Bytes(b), overflow)) => {
                let mut v = c;
                proto::read_i32_be(&b, &mut v);
                self.engine().spare_bytes = b;
                Ok(ReduceOutput {
                    values: v,
                    has_result: true,
                    overflow,
                })
            }
            _ => Ok(ReduceOutput {
                values: c,
                has_result: false,
                overflow: false,
            }),
        }
    }

    /// A blocking int reduction on the caller's slice `x` (see [`crate::runtime::comm::Raw`]):
    /// a worker encodes its fragments straight from `x`; an allreduce
    /// worker's result fragments and the aggregator's completed fragments
    /// are written straight into `x`. Returns whether the result was
    /// clamped (OVERFLOW; a reduce worker gets `false`).
    fn reduce_i32_in(
        &mut self,
        all: bool,
        op: Op,
        x: RawI32,
        opts: CallOptions,
    ) -> Result<bool, CommError> {
        let is_agg = self.engine().cfg.me == Participant::Aggregator;
        let sink = (all && !is_agg).then_some(Sink::I32(x));
        let r = self.reduce(all, op, Src::RawI32(x), sink, opts)?;
        Ok(match (r.values, r.sink) {
            (Some((_, o)), _) | (None, Some((_, o))) => o,
            _ => false,
        })
    }
    /// A float SUM (or mean) reduction through quantization on `x` (see
    /// [`crate::runtime::comm::RawF32`]): a worker quantizes each fragment from `x` straight into
    /// its datagram and (allreduce) dequantizes each result fragment straight
    /// into `x`; the aggregator reduces into a reused int32 vector and
    /// dequantizes it into `x`. With `FixedOrAdaptive` the first attempt's
    /// result goes to a reused buffer (the input is needed for a rerun).
    fn reduce_f32(
        &mut self,
        all: bool,
        mean: bool,
        x: RawF32,
        opts: CallOptions,
    ) -> Result<(), CommError> {
        let workers = self.engine().cfg.workers();
        let is_agg = self.engine().cfg.me == Participant::Aggregator;
        let len = x.len;
        let q = self.engine().cfg.quantization;
        let mut scale = match q {
            Quantization::Fixed(s) | Quantization::FixedOrAdaptive(s) => {
                if !(s.is_finite() && s > 0.0) {
                    return Err(CommError::Config(
                        quantize::QuantizeError::BadScale(s).to_string(),
                    ));
                }
                if !is_agg {
                    // SAFETY: no other reference into x lives now.
                    quantize::check_finite(unsafe { x.slice() })
                        .map_err(|e| CommError::Config(e.to_string()))?;
                }
                s
            }
            Quantization::Adaptive => self.agree_scale(x, is_agg, opts)?,
        };
        for attempt in 0..2 {
            let rerun = attempt == 0 && all && matches!(q, Quantization::FixedOrAdaptive(_));
            let div = if mean { scale * workers as f64 } else { scale };
            let mut tmp = (rerun && !is_agg).then(|| {
                let mut o = std::mem::take(&mut self.engine().spare_f32);
                o.clear();
                o.resize(len, 0.0);
                o
            });
            let sink = (all && !is_agg).then(|| Sink::F32 {
                out: tmp.as_deref_mut().map_or(x, RawF32::of),
                div,
            });
            let src = if is_agg {
                Src::Len(len)
            } else {
                Src::F32 { x, scale }
            };
            let r = self.reduce(all, Op::Sum, src, sink, opts)?;
            let (has_result, overflow) = match (&r.values, &r.sink) {
                (Some((_, o)), _) | (None, Some((_, o))) => (true, *o),
                _ => (false, false),
            };
            let values = r.values.map(|(v, _)| v);
            if has_result && overflow {
                if let Some(v) = values {
                    self.engine().spare_i32 = v;
                }
                if let Some(o) = tmp {
                    self.engine().spare_f32 = o;
                }
                // Everyone who got the result knows; for reduce only the
                // aggregator does, so only allreduce can rerun in lockstep.
                if rerun {
                    scale = self.agree_scale(x, is_agg, opts)?;
                    continue;
                }
                return Err(CommError::Overflow {
                    round: self.engine().position().0.wrapping_sub(1),
                    scale,
                });
            }
            if let Some(v) = values {
                // SAFETY: no other reference into x lives now.
                quantize::dequantize_into(&v, div, unsafe { x.slice_mut() });
                self.engine().spare_i32 = v;
            }
            if let Some(o) = tmp {
                // SAFETY: as above.
                unsafe { x.slice_mut() }.copy_from_slice(&o);
                self.engine().spare_f32 = o;
            }
            return Ok(());
        }
        Err(CommError::Overflow {
            round: self.engine().position().0.wrapping_sub(1),
            scale,
        })
    }

    /// One-element MAX allreduce of max|x| (as float bits) → the adaptive scale.
    fn agree_scale(
        &mut self,
        x: RawF32,
        is_agg: bool,
        opts: CallOptions,
    ) -> Result<f64, CommError> {
        // SAFETY: no other reference into x lives now.
        let m = if is_agg {
            0.0
        } else {
            quantize::max_abs(unsafe { x.slice() }).map_err(|e| CommError::Config(e.to_string()))?
        };
        let out = self.reduce_i32(true, Op::Max, vec![m.to_bits() as i32], opts)?;
        let agreed = f32::from_bits(out.values.first().copied().unwrap_or(0) as u32);
        Ok(quantize::adaptive_scale(
            agreed,
            self.engine().cfg.workers(),
        ))
    }
}

impl<D: RoundDriver> Calls for D {}
