//! Striping: one vector reduced over several jobs at once.
//!
//! A [`Communicator`] is one progress thread: it encodes every fragment,
//! makes the send and receive system calls (on the kernel backend its CPU
//! also runs the XDP program for its own contributions, in the softirq of
//! its sends) and decodes every result. On a machine with more cores than
//! participants that one thread is the limit of a large reduction
//! (docs/BENCHMARKS.md, "On a 16-core machine"). A [`StripedCommunicator`]
//! holds one communicator per *stripe*, each a job of its own (own job id,
//! ports, result group; the same workers), and splits each vector into
//! contiguous stripes that run at the same time, each in its communicator's
//! thread. Nothing changes on the wire: the aggregator sees ordinary jobs,
//! and different UDP ports spread the stripes over a NIC's (or a multi-queue
//! veth's) receive queues.
//!
//! Every participant of the jobs must use the same number of stripes: the
//! split depends only on the vector's length and the stripe count
//! ([`stripe_bounds`]).

use std::net::IpAddr;
use std::ops::Range;
use std::sync::mpsc;

use super::comm::{CallOptions, Communicator, CommunicatorBuilder, Participant};
use super::engine::Raw;
use super::api::{float_mean, Collective, Elements, Served};
use super::{CommError, CommStats, IoStats, RefusedStats};
use crate::wire::abi::Op;
use crate::config::Config;

/// The element ranges of the stripes of an `n`-element vector over
/// `stripes` jobs: `t·n/stripes .. (t+1)·n/stripes`, without empty ones
/// (an `n` below the stripe count uses `n` stripes; `n = 0` one empty
/// stripe, which each call handles as it always does).
pub fn stripe_bounds(n: usize, stripes: usize) -> Vec<Range<usize>> {
    let k = stripes.clamp(1, n.max(1));
    (0..k).map(|t| t * n / k..(t + 1) * n / k).collect()
}

/// One participant of several jobs that reduce each vector together, a
/// stripe each (see the module docs).
#[derive(Debug)]
pub struct StripedCommunicator {
    stripes: Vec<Communicator>,
}

impl StripedCommunicator {
    /// Stripes over `stripes` (at least one): communicators of the same
    /// participant and number of workers, each of its own job. A job is its
    /// id at its aggregator: stripes at different nodes may have the same
    /// id (nodes hand out the ids of jobs on demand independently).
    pub fn new(stripes: Vec<Communicator>) -> Result<StripedCommunicator, CommError> {
        let first = stripes
            .first()
            .ok_or_else(|| CommError::Config("a striped communicator needs a stripe".into()))?;
        let (me, workers) = (first.participant(), first.workers());
        let mut jobs = std::collections::BTreeSet::new();
        for c in &stripes {
            if c.participant() != me || c.workers() != workers {
                return Err(CommError::Config(format!(
                    "stripes of one participant: job {} is {:?} of {} workers, job {} {:?} of {}",
                    first.config().job,
                    me,
                    workers,
                    c.config().job,
                    c.participant(),
                    c.workers()
                )));
            }
            if !jobs.insert((c.config().aggregator, c.config().job)) {
                return Err(CommError::Config(format!(
                    "job {} at {} is two stripes; each stripe needs a job of its own",
                    c.config().job,
                    c.config().aggregator
                )));
            }
        }
        Ok(StripedCommunicator { stripes })
    }

    /// From a node configuration: stripe t is job `jobs[t]`
    /// ([`CommunicatorBuilder::from_config`]) with this participant's data
    /// socket on `data_port + t` (where that job's `result_group` members
    /// listen); `tune` sets the rest of each builder (backend, MTU, ...).
    pub fn from_config(
        config: &Config,
        jobs: &[u16],
        aggregator: impl Into<IpAddr>,
        data_port: u16,
        me: Participant,
        tune: impl Fn(CommunicatorBuilder) -> CommunicatorBuilder,
    ) -> Result<StripedCommunicator, CommError> {
        let aggregator = aggregator.into();
        let stripes = jobs
            .iter()
            .enumerate()
            .map(|(t, &job)| {
                let port = u16::try_from(data_port as usize + t).map_err(|_| {
                    CommError::Config(format!("data port {data_port} + stripe {t} is past 65535"))
                })?;
                tune(CommunicatorBuilder::from_config(
                    config, job, aggregator, port, me,
                )?)
                .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        StripedCommunicator::new(stripes)
    }

    /// The stripes' communicators, in stripe order.
    pub fn stripes(&self) -> &[Communicator] {
        &self.stripes
    }

    /// This participant.
    pub fn participant(&self) -> Participant {
        self.stripes[0].participant()
    }

    /// The stripes' counters added up.
    pub fn stats(&self) -> CommStats {
        self.stripes
            .iter()
            .map(|c| c.stats())
            .fold(CommStats::default(), |a, s| a + s)
    }

    /// The stripes' system-call batching added up.
    pub fn io_stats(&self) -> IoStats {
        self.stripes
            .iter()
            .map(|c| c.io_stats())
            .fold(IoStats::default(), |a, s| a + s)
    }

    /// The stripes' refusals added up ([`Communicator::refused`]).
    pub fn refused(&self) -> RefusedStats {
        self.stripes
            .iter()
            .map(|c| c.refused())
            .fold(RefusedStats::default(), |a, s| a + s)
    }

    /// An int32 reduction over the stripes: whether any element was
    /// clamped (OVERFLOW). On an error (the first stripe's that failed)
    /// `buf` may hold part of the result; a timeout's details (fragment
    /// counts, the partial result asked for with `CallOptions::partial`) are
    /// that stripe's, which [`stripe_bounds`] locates in the vector.
    fn reduce_i32_in(
        &self,
        buf: &mut [i32],
        all: bool,
        op: Op,
        opts: CallOptions,
    ) -> Result<bool, CommError> {
        if let [c] = &self.stripes[..] {
            return c.reduce_i32_in(buf, all, op, opts);
        }
        let clamped = self.run(buf, |c, part| c.start_reduce_i32(part, all, op, opts))?;
        Ok(clamped.into_iter().any(|x| x))
    }

    /// Lends each stripe of `buf` to its communicator (`start`), then waits
    /// for every reply, also after a failure: a stripe's thread may use its
    /// part until it replies, and `buf` stays borrowed here until then.
    fn run<T, R>(
        &self,
        buf: &mut [T],
        start: impl Fn(&Communicator, Raw<T>) -> Result<mpsc::Receiver<Result<R, CommError>>, CommError>,
    ) -> Result<Vec<R>, CommError> {
        let bounds = stripe_bounds(buf.len(), self.stripes.len());
        let mut pending = Vec::with_capacity(bounds.len());
        let mut rest = &mut buf[..];
        for (c, r) in self.stripes.iter().zip(&bounds) {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
            rest = tail;
            pending.push(start(c, Raw::of(part)));
        }
        let mut out = Vec::with_capacity(pending.len());
        let mut first_error = None;
        for p in pending {
            let r = p.and_then(|rx| rx.recv().unwrap_or(Err(CommError::Closed)));
            match r {
                Ok(v) => out.push(v),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}

/// The striped star: each call's vector split over the stripes' jobs, which
/// run it at once.
impl Collective for StripedCommunicator {
    fn participant(&self) -> Participant {
        StripedCommunicator::participant(self)
    }

    fn workers(&self) -> u16 {
        self.stripes[0].workers()
    }

    fn stats(&self) -> CommStats {
        StripedCommunicator::stats(self)
    }

    fn allreduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.reduce_elements_in(data, true, op, opts)
    }

    fn reduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.reduce_elements_in(data, false, op, opts)
    }

    /// Each stripe's bytes from `root` through its job at once (copied in
    /// and out, as the one-job broadcast does). On an error (the first
    /// stripe's that failed) the stripes that completed hold the root's
    /// bytes.
    fn broadcast_bytes(&self, buf: &mut [u8], root: Participant, opts: CallOptions) -> Result<Served, CommError> {
        if let [c] = &self.stripes[..] {
            // One stripe: its blocking call (on this thread when it can).
            return c.broadcast_bytes(buf, root, opts);
        }
        let bounds = stripe_bounds(buf.len(), self.stripes.len());
        let works: Vec<_> = self
            .stripes
            .iter()
            .zip(&bounds)
            .map(|(c, r)| c.ibroadcast(buf[r.clone()].to_vec(), root, opts))
            .collect();
        let mut first_error = None;
        for (w, r) in works.into_iter().zip(bounds) {
            match w.wait() {
                Ok(out) => buf[r].copy_from_slice(&out),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(Served::star(false)), Err)
    }
}

impl StripedCommunicator {
    /// An int32 reduction, or a float32 one (each stripe agrees on its own
    /// adaptive scale, which is at least as fine as one scale for the whole
    /// vector).
    fn reduce_elements_in(&self, data: Elements<'_>, all: bool, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        match data {
            Elements::I32(buf) => self.reduce_i32_in(buf, all, op, opts).map(Served::star),
            Elements::F32(buf) => {
                let mean = float_mean(op)?;
                if let [c] = &self.stripes[..] {
                    return c.reduce_f32_in(buf, all, mean, opts).map(|()| Served::star(false));
                }
                self.run(buf, |c, part| c.start_reduce_f32(part, all, mean, opts))
                    .map(|_| Served::star(false))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripe_bounds_cover_the_vector_in_order_without_empty_stripes() {
        for n in [0usize, 1, 2, 3, 7, 1000, 21_800_000] {
            for k in [1usize, 2, 3, 4, 16] {
                let b = stripe_bounds(n, k);
                assert_eq!(b.len(), k.min(n.max(1)), "n {n} k {k}");
                assert_eq!(b[0].start, 0);
                assert_eq!(b.last().unwrap().end, n);
                for w in b.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                if n > 0 {
                    assert!(b.iter().all(|r| !r.is_empty()), "n {n} k {k}: {b:?}");
                    // Even: stripes differ by at most one element.
                    let lens: Vec<usize> = b.iter().map(|r| r.len()).collect();
                    assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
                }
            }
        }
    }
}
