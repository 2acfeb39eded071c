//! The rounds each call of a [`crate::runtime::Communicator`] makes, over
//! any driver of the state machine: a broadcast or an int reduction is one
//! round. A float reduction with a fixed scale is one round, and reruns once
//! at an agreed scale when the scale overflowed (`FixedOrAdaptive`). An
//! adaptive float allreduce of at most [`quantize::ONE_ROUND_MAX_LEN`]
//! elements guesses the scale and sums the values with the scale checks
//! ([`quantize::ScaleCheck`]): one round when every worker guessed the
//! agreed scale, else a second one at the agreed scale the checks name. An
//! adaptive reduce, or a longer allreduce, agrees on the scale first (a
//! one-element MAX allreduce), then reduces: two rounds.

use std::sync::mpsc;
use std::time::Instant;

use crate::wire::abi::Op;
use crate::wire::proto;
use crate::runtime::engine::{CallOptions, Engine, Participant, RawF32, RawI32, Reduced, Sink, Src};
use crate::runtime::quantize::{self, Quantization};
use crate::runtime::CommError;

/// Result of an int reduction as the caller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReduceOutput {
    /// The vector: the result where this participant gets it, else the input.
    pub values: Vec<i32>,
    /// Whether this participant got the result (aggregator for reduce,
    /// everyone for allreduce).
    pub has_result: bool,
    /// Some element was clamped (OVERFLOW).
    pub overflow: bool,
}

/// One call of a communicator, as it is queued for the thread that runs it
/// ([`Calls::execute`]), with the channel its result goes back on.
pub(crate) enum Request {
    Bcast {
        root: usize,
        data: Vec<u8>,
        opts: CallOptions,
        reply: mpsc::Sender<Result<Vec<u8>, CommError>>,
    },
    Reduce {
        all: bool,
        op: Op,
        data: Vec<i32>,
        opts: CallOptions,
        reply: mpsc::Sender<Result<ReduceOutput, CommError>>,
    },
    ReduceF32 {
        all: bool,
        mean: bool,
        data: Vec<f32>,
        opts: CallOptions,
        reply: mpsc::Sender<Result<Vec<f32>, CommError>>,
    },
    /// A blocking int reduction on the caller's slice (see [`Raw`]); replies
    /// whether the result was clamped (OVERFLOW).
    ReduceI32In {
        all: bool,
        op: Op,
        data: RawI32,
        opts: CallOptions,
        reply: mpsc::Sender<Result<bool, CommError>>,
    },
    /// A blocking float reduction on the caller's slice (see [`RawF32`]).
    ReduceF32In {
        all: bool,
        mean: bool,
        data: RawF32,
        opts: CallOptions,
        reply: mpsc::Sender<Result<(), CommError>>,
    },
}

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

    /// An int reduction of an owned vector (the `Work` calls): the result
    /// where this participant gets it, else the input back.
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

    /// A blocking int reduction on the caller's slice `x` (see [`crate::runtime::engine::Raw`]):
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
    /// [`crate::runtime::engine::RawF32`]): a worker quantizes each fragment from `x` straight into
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
        let workers = self.engine().cfg.total_workers();
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
            Quantization::Adaptive if all && len <= quantize::ONE_ROUND_MAX_LEN => {
                match self.one_round_f32(mean, x, opts)? {
                    Some(agreed) => agreed,
                    None => return Ok(()),
                }
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
                    round: self.engine().position().0.previous(),
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
            round: self.engine().position().0.previous(),
            scale,
        })
    }

    /// The one round of an adaptive float allreduce (module docs of
    /// [`quantize`]): a worker quantizes `x` at its guess (the scale agreed
    /// for this length last, else its own) into a reused int32 vector, the
    /// scale checks appended; the aggregator application contributes
    /// nothing. Every participant reads the same verdict from the sums:
    /// `None` when every worker guessed the agreed scale (the result is in
    /// `x`), else the agreed scale to reduce at (from the checks, or from a
    /// MAX allreduce when they do not add up).
    fn one_round_f32(
        &mut self,
        mean: bool,
        x: RawF32,
        opts: CallOptions,
    ) -> Result<Option<f64>, CommError> {
        let workers = self.engine().cfg.total_workers();
        let is_agg = self.engine().cfg.me == Participant::Aggregator;
        let len = x.len;
        let check = quantize::ScaleCheck::new(workers);
        let mut v = std::mem::take(&mut self.engine().spare_i32);
        if is_agg {
            v.clear();
            v.resize(len + check.elements(), 0);
        } else {
            // SAFETY: no other reference into x lives now.
            let xs = unsafe { x.slice() };
            let m = quantize::max_abs(xs).map_err(|e| CommError::Config(e.to_string()))?;
            let own = quantize::adaptive_scale(m, workers);
            let guess = self.engine().agreed_scales.get(len).unwrap_or(own);
            check.contribution(xs, guess, own, &mut v);
        }
        let out = self.reduce_i32(true, Op::Sum, v, opts)?;
        let verdict = match out.values.get(len..) {
            Some(sums) if out.has_result => check.verdict(sums, out.overflow),
            _ => quantize::ScaleVerdict::Unknown,
        };
        let agreed = match verdict {
            quantize::ScaleVerdict::Agreed(scale) => {
                let div = if mean { scale * workers as f64 } else { scale };
                // SAFETY: no other reference into x lives now.
                quantize::dequantize_into(&out.values[..len], div, unsafe { x.slice_mut() });
                self.engine().spare_i32 = out.values;
                self.engine().agreed_scales.record(len, scale);
                self.engine().counters().float_call(true);
                return Ok(None);
            }
            quantize::ScaleVerdict::Redo(scale) => {
                self.engine().spare_i32 = out.values;
                scale
            }
            quantize::ScaleVerdict::Unknown => {
                self.engine().spare_i32 = out.values;
                self.agree_scale(x, is_agg, opts)?
            }
        };
        self.engine().agreed_scales.record(len, agreed);
        self.engine().counters().float_call(false);
        Ok(Some(agreed))
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
            self.engine().cfg.total_workers(),
        ))
    }
}

impl<D: RoundDriver> Calls for D {}

/// The calls over an in-memory network (channels, the real clock, no
/// sockets): each participant runs its calls on its own thread through a
/// [`RoundDriver`] that hands datagrams to the others' inboxes, and keeps
/// serving its engine once its calls are done (as the I/O driver's idle
/// loop does) until everyone's are.
#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::net::{Ipv4Addr, SocketAddr};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    use super::{Calls, RoundDriver};
    use crate::wire::abi::Op;
    use crate::runtime::comm::Communicator;
    use crate::runtime::engine::{CallOptions, Engine, Participant, RawF32};
    use crate::runtime::outbox::Transmit;
    use crate::runtime::quantize::{self, Quantization};
    use crate::runtime::transport::{CommStats, Counters};
    use crate::runtime::CommError;

    type Inbox = mpsc::Receiver<(SocketAddr, Vec<u8>)>;
    type Postbox = HashMap<SocketAddr, mpsc::Sender<(SocketAddr, Vec<u8>)>>;

    struct Channels<'a> {
        from: SocketAddr,
        to: &'a Postbox,
    }

    impl Transmit for Channels<'_> {
        fn send(&mut self, to: SocketAddr, datagram: &[u8]) {
            if let Some(tx) = self.to.get(&to) {
                let _ = tx.send((self.from, datagram.to_vec()));
            }
        }

        fn resend(&mut self, to: SocketAddr, datagram: &[u8]) {
            self.send(to, datagram);
        }

        fn send_batch(&mut self, datagrams: &[(&[u8], SocketAddr)], _gso: bool) {
            for (b, to) in datagrams {
                self.send(*to, b);
            }
        }
    }

    struct ChannelDriver {
        engine: Engine,
        addr: SocketAddr,
        inbox: Inbox,
        postbox: Postbox,
    }

    impl ChannelDriver {
        /// Polls, then waits for datagrams until the engine's timeout (at
        /// most `cap`).
        fn step(&mut self, cap: Duration) {
            let now = Instant::now();
            let mut tx = Channels {
                from: self.addr,
                to: &self.postbox,
            };
            self.engine.poll_transmit(now, &mut tx);
            let wait = self
                .engine
                .poll_timeout()
                .map_or(cap, |t| t.saturating_duration_since(now).min(cap));
            if let Ok((from, d)) = self.inbox.recv_timeout(wait) {
                self.engine.handle(Instant::now(), from, &d);
                while let Ok((from, d)) = self.inbox.try_recv() {
                    self.engine.handle(Instant::now(), from, &d);
                }
            }
        }
    }

    impl RoundDriver for ChannelDriver {
        fn engine(&mut self) -> &mut Engine {
            &mut self.engine
        }

        fn now(&self) -> Instant {
            Instant::now()
        }

        fn run_round(&mut self) -> Result<(), CommError> {
            loop {
                let now = Instant::now();
                let mut tx = Channels {
                    from: self.addr,
                    to: &self.postbox,
                };
                self.engine.poll_transmit(now, &mut tx);
                if let Some(outcome) = self.engine.round_outcome(now) {
                    return outcome;
                }
                self.step(Duration::from_millis(10));
            }
        }
    }

    const WORKERS: u16 = 3;

    /// Runs `calls` on every participant (workers 0..3, then the
    /// aggregator) with `quantization`; returns what each returned.
    fn run_job<T: Send>(
        quantization: Quantization,
        calls: impl Fn(&mut ChannelDriver, Participant) -> T + Sync,
    ) -> Vec<T> {
        run_job_of(WORKERS, quantization, calls)
    }

    /// [`run_job`] with `workers` workers.
    fn run_job_of<T: Send>(
        workers: u16,
        quantization: Quantization,
        calls: impl Fn(&mut ChannelDriver, Participant) -> T + Sync,
    ) -> Vec<T> {
        let participants = workers as usize + 1;
        let lo = Ipv4Addr::new(10, 0, 0, 1);
        let peers: Vec<SocketAddr> = (0..workers)
            .map(|r| SocketAddr::new(lo.into(), 5000 + r))
            .collect();
        let me_all: Vec<Participant> = (0..workers)
            .map(Participant::Worker)
            .chain([Participant::Aggregator])
            .collect();
        let cfgs: Vec<_> = me_all
            .iter()
            .map(|&me| {
                Communicator::builder(1, peers.clone(), lo, 9000, me)
                    .mtu(1500)
                    .deadline(Duration::from_secs(20))
                    .quantization(quantization)
                    .config()
                    .clone()
            })
            .collect();
        let addrs: Vec<SocketAddr> = cfgs
            .iter()
            .map(|c| c.addr_of(c.me.index(c.workers())))
            .collect();
        let (txs, rxs): (Vec<_>, Vec<_>) = addrs.iter().map(|_| mpsc::channel()).unzip();
        let postbox: Postbox = addrs.iter().copied().zip(txs).collect();
        let done = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|s| {
            let handles: Vec<_> = cfgs
                .into_iter()
                .zip(rxs)
                .enumerate()
                .map(|(i, (cfg, inbox))| {
                    let me = cfg.me;
                    let mut d = ChannelDriver {
                        engine: Engine::new(
                            cfg,
                            Arc::new(Counters::default()),
                            (i as u32 + 1) << 20,
                            Instant::now(),
                        ),
                        addr: addrs[i],
                        inbox,
                        postbox: postbox.clone(),
                    };
                    let (done, calls) = (done.clone(), &calls);
                    s.spawn(move || {
                        let out = calls(&mut d, me);
                        done.fetch_add(1, Ordering::SeqCst);
                        while done.load(Ordering::SeqCst) < participants {
                            d.step(Duration::from_millis(1));
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("participant thread"))
                .collect()
        })
    }

    fn input(r: u16, len: usize) -> Vec<f32> {
        (0..len)
            .map(|k| (k as f32 - 300.0) * 37.5 + r as f32)
            .collect()
    }

    /// A fixed scale whose sum overflows int32 reruns at the agreed
    /// adaptive scale (`FixedOrAdaptive`): every participant gets the sum
    /// (within the quantization step), and the next call lines up (the
    /// float call took 3 rounds everywhere: overflowing attempt, scale
    /// agreement, rerun).
    #[test]
    fn a_fixed_scale_that_overflows_reruns_at_the_agreed_scale_everywhere() {
        let len = 1000;
        let out = run_job(Quantization::FixedOrAdaptive(1e6), |d, me| {
            let mut x = match me {
                Participant::Worker(r) => input(r, len),
                Participant::Aggregator => vec![0.0; len],
            };
            d.reduce_f32(true, false, RawF32::of(&mut x), CallOptions::default())
                .expect("the float allreduce");
            let ints = d
                .reduce_i32(true, Op::Sum, vec![1; 4], CallOptions::default())
                .expect("the next call");
            (x, ints.values, d.engine().position().0)
        });
        let want: Vec<f64> = (0..len)
            .map(|k| (0..WORKERS).map(|r| input(r, len)[k] as f64).sum())
            .collect();
        for (i, (x, ints, round)) in out.iter().enumerate() {
            let worst = x
                .iter()
                .zip(&want)
                .map(|(g, w)| (*g as f64 - w).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-2, "participant {i}: error {worst}");
            assert_eq!(ints, &vec![WORKERS as i32; 4], "participant {i}");
            assert_eq!(*round, crate::wire::abi::Round(4), "participant {i}: 3 float rounds and 1 int round");
        }
    }

    /// The two-round definition of an adaptive float allreduce: every
    /// worker's `x` quantized at `adaptive_scale` of the global max, summed
    /// as integers, dequantized (by S · workers for a mean).
    fn two_round_result(xs: &[Vec<f32>], mean: bool) -> Vec<f32> {
        let workers = xs.len() as u16;
        let m = xs.iter().map(|x| quantize::max_abs(x).unwrap()).fold(0f32, f32::max);
        let s = quantize::adaptive_scale(m, workers);
        let mut sum = vec![0i64; xs[0].len()];
        let mut q = Vec::new();
        for x in xs {
            assert!(!quantize::quantize_into(x, s, &mut q).unwrap());
            for (a, &v) in sum.iter_mut().zip(&q) {
                *a += i64::from(v);
            }
        }
        let sum: Vec<i32> = sum.iter().map(|&a| i32::try_from(a).unwrap()).collect();
        let mut out = vec![0f32; sum.len()];
        let div = if mean { s * f64::from(workers) } else { s };
        quantize::dequantize_into(&sum, div, &mut out);
        out
    }

    /// One float call of a test: every worker's input, and whether it is a mean.
    struct FloatCall {
        xs: Vec<Vec<f32>>,
        mean: bool,
    }

    /// Worker r's input of `len` elements for call `k`, of magnitude
    /// `scale`: max |x| = (5 + 0.001 · r) · scale, at element 0.
    fn float_input(r: u16, len: usize, k: usize, scale: f32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let t = ((i * 37 + k * 13) % 1000) as f32 - 500.0;
                if i == 0 {
                    -(5.0 + 0.001 * r as f32) * scale
                } else {
                    t * 0.01 * scale
                }
            })
            .collect()
    }

    /// Runs `calls` as adaptive allreduces on 4 workers and the aggregator
    /// application; checks every participant's result bit for bit against
    /// [`two_round_result`]; returns, per participant, the rounds each call
    /// took and the counters after them.
    fn adaptive_allreduces(calls: &[FloatCall]) -> Vec<(Vec<u32>, CommStats)> {
        let out = run_job_of(4, Quantization::Adaptive, |d, me| {
            let mut rounds = Vec::new();
            let mut results = Vec::new();
            for c in calls {
                let mut x = match me {
                    Participant::Worker(r) => c.xs[r as usize].clone(),
                    Participant::Aggregator => vec![0.0; c.xs[0].len()],
                };
                let before = d.engine().position().0;
                d.reduce_f32(true, c.mean, RawF32::of(&mut x), CallOptions::default())
                    .expect("the float allreduce");
                rounds.push(d.engine().position().0.ahead_of(before) as u32);
                results.push(x);
            }
            (rounds, d.engine().counters().snapshot(), results)
        });
        out.into_iter()
            .enumerate()
            .map(|(p, (rounds, stats, results))| {
                for (k, (c, got)) in calls.iter().zip(&results).enumerate() {
                    let want = two_round_result(&c.xs, c.mean);
                    let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
                    assert!(same, "participant {p}, call {k}: not the two-round result bit for bit");
                }
                (rounds, stats)
            })
            .collect()
    }

    /// An adaptive allreduce whose scale every worker can predict takes one
    /// round: the first call (maxima 5.000 to 5.003, so every
    /// worker's own scale is the agreed one), the next ones at the same
    /// magnitude (the scale agreed last), a mean. A magnitude that jumps
    /// (×1000) or falls (×1e-6) reduces again at the agreed scale: two
    /// rounds, and the call after it is one round again. Every result is
    /// the two-round result bit for bit, on every participant, and the
    /// counters say how many calls took one round and how many reduced
    /// again.
    #[test]
    fn an_adaptive_allreduce_whose_scale_the_workers_predict_takes_one_round() {
        let len = 1000;
        let call = |k: usize, scale: f32, mean: bool| FloatCall {
            xs: (0..4).map(|r| float_input(r, len, k, scale)).collect(),
            mean,
        };
        let calls = [
            call(0, 1.0, false),
            call(1, 1.0, false),
            call(2, 1000.0, false),
            call(3, 1000.0, false),
            call(4, 1e-3, false),
            call(5, 1e-3, true),
        ];
        for (p, (rounds, stats)) in adaptive_allreduces(&calls).iter().enumerate() {
            assert_eq!(rounds, &[1, 1, 2, 1, 2, 1], "participant {p}: rounds per call");
            assert_eq!(
                (stats.float_calls_one_round, stats.float_calls_redone),
                (4, 2),
                "participant {p}"
            );
        }
    }

    /// Workers whose guesses differ (here: their own scales, on the first
    /// call, maxima 1, 4, 16, 64) reduce again at the agreed scale and get
    /// the exact two-round result; the next call of that length guesses the
    /// agreed scale everywhere and takes one round. Another length has no
    /// agreed scale yet: its first call guesses each worker's own again.
    #[test]
    fn workers_that_guess_different_scales_reduce_again_at_the_agreed_one() {
        let spread = |len: usize, k: usize| FloatCall {
            xs: (0..4).map(|r| float_input(r, len, k, 4f32.powi(r as i32) * 0.2)).collect(),
            mean: false,
        };
        let calls = [spread(300, 0), spread(300, 1), spread(7, 2), spread(300, 3), spread(7, 4)];
        for (p, (rounds, stats)) in adaptive_allreduces(&calls).iter().enumerate() {
            assert_eq!(rounds, &[2, 1, 2, 1, 1], "participant {p}: rounds per call");
            assert_eq!((stats.float_calls_one_round, stats.float_calls_redone), (3, 2), "participant {p}");
        }
    }

    /// Only a short allreduce guesses: one longer than
    /// `ONE_ROUND_MAX_LEN` and a reduce agree on the scale first (two
    /// rounds each, uncounted), with the same results as before.
    #[test]
    fn a_long_adaptive_allreduce_and_a_reduce_agree_on_the_scale_first() {
        let long = quantize::ONE_ROUND_MAX_LEN + 1;
        let xs: Vec<Vec<f32>> = (0..4).map(|r| float_input(r, long, 0, 3.0)).collect();
        let want = two_round_result(&xs, false);
        let out = run_job_of(4, Quantization::Adaptive, |d, me| {
            let mut rounds = Vec::new();
            let mut results = Vec::new();
            for (all, len) in [(true, long), (false, 100)] {
                let mut x = match me {
                    Participant::Worker(r) => xs[r as usize][..len].to_vec(),
                    Participant::Aggregator => vec![0.0; len],
                };
                let before = d.engine().position().0;
                d.reduce_f32(all, false, RawF32::of(&mut x), CallOptions::default())
                    .expect("the float call");
                rounds.push(d.engine().position().0.ahead_of(before) as u32);
                results.push(x);
            }
            (rounds, d.engine().counters().snapshot(), results, me)
        });
        let short: Vec<Vec<f32>> = xs.iter().map(|x| x[..100].to_vec()).collect();
        for (rounds, stats, results, me) in out {
            assert_eq!(rounds, [2, 2], "{me:?}");
            assert_eq!((stats.float_calls_one_round, stats.float_calls_redone), (0, 0), "{me:?}");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&results[0]), bits(&want), "{me:?}: the long allreduce");
            if me == Participant::Aggregator {
                assert_eq!(bits(&results[1]), bits(&two_round_result(&short, false)), "the reduce");
            }
        }
    }
}
