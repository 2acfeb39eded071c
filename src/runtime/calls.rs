//! The rounds each call of a [`crate::runtime::Communicator`] makes, over
//! any driver of the state machine: a broadcast or an int reduction is one
//! round; a float reduction agrees on the scale first (adaptive: a
//! one-element MAX allreduce), then reduces, and reruns once at an agreed
//! scale when a fixed one overflowed (`FixedOrAdaptive`).

use std::time::Instant;

use crate::wire::abi::Op;
use crate::wire::proto;
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
    use std::net::{Ipv4Addr, SocketAddrV4};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    use super::{Calls, RoundDriver};
    use crate::wire::abi::Op;
    use crate::runtime::comm::{CallOptions, Communicator, Participant, RawF32};
    use crate::runtime::engine::Engine;
    use crate::runtime::outbox::Transmit;
    use crate::runtime::quantize::Quantization;
    use crate::runtime::transport::Counters;
    use crate::runtime::CommError;

    type Inbox = mpsc::Receiver<(SocketAddrV4, Vec<u8>)>;
    type Postbox = HashMap<SocketAddrV4, mpsc::Sender<(SocketAddrV4, Vec<u8>)>>;

    struct Channels<'a> {
        from: SocketAddrV4,
        to: &'a Postbox,
    }

    impl Transmit for Channels<'_> {
        fn send(&mut self, to: SocketAddrV4, datagram: &[u8]) {
            if let Some(tx) = self.to.get(&to) {
                let _ = tx.send((self.from, datagram.to_vec()));
            }
        }

        fn resend(&mut self, to: SocketAddrV4, datagram: &[u8]) {
            self.send(to, datagram);
        }

        fn send_batch(&mut self, datagrams: &[(&[u8], SocketAddrV4)], _gso: bool) {
            for (b, to) in datagrams {
                self.send(*to, b);
            }
        }
    }

    struct ChannelDriver {
        engine: Engine,
        addr: SocketAddrV4,
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
    const PARTICIPANTS: usize = WORKERS as usize + 1;

    /// Runs `calls` on every participant (workers 0..3, then the
    /// aggregator) with `quantization`; returns what each returned.
    fn run_job<T: Send>(
        quantization: Quantization,
        calls: impl Fn(&mut ChannelDriver, Participant) -> T + Sync,
    ) -> Vec<T> {
        let lo = Ipv4Addr::new(10, 0, 0, 1);
        let peers: Vec<SocketAddrV4> = (0..WORKERS)
            .map(|r| SocketAddrV4::new(lo, 5000 + r))
            .collect();
        let me_all: Vec<Participant> = (0..WORKERS)
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
        let addrs: Vec<SocketAddrV4> = cfgs
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
                        while done.load(Ordering::SeqCst) < PARTICIPANTS {
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
}
