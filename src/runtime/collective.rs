//! Star or ring, chosen per call by the vector's size (docs/RING.md
//! "Choosing"): a [`StarOrRing`] holds a star communicator (a job reduced
//! by an aggregator's XDP program: lowest latency) and a ring communicator
//! (a `[[ring]]` job: each member's link carries 2(n−1)/n of the vector
//! instead of the aggregator's n times it), and sends a call to the ring
//! when it has at least [`StarOrRing::ring_threshold`] elements.
//!
//! Every member decides alike: the choice depends only on the call's length,
//! op and the configured threshold, which all members share. A ring job
//! reduces exactly its `vector_len` elements; a shorter vector is padded
//! with the op's identity ([`Op::identity`]: 0 for SUM, `i32::MIN` for MAX,
//! 1 for LAND, ...), so one ring serves every size up to its length.
//! A ring call whose partial sums saturated (docs/RING.md "Arithmetic") is
//! redone on the star when there is one, so an automatic choice returns the
//! star's result bit for bit.

use std::sync::Mutex;

use crate::runtime::api::{float_mean, Algorithm, Collective, Elements, Served};
use crate::runtime::comm::{CallOptions, Communicator, Participant};
use crate::runtime::ring::RingCommunicator;
use crate::runtime::{CommError, CommStats};
use crate::wire::abi::Op;

/// Default [`StarOrRing::ring_threshold`] where the ring is the faster
/// algorithm at jumbo MTUs ([`default_ring_threshold`]): 1 Mi elements
/// (4 MiB).
pub const DEFAULT_RING_THRESHOLD: usize = 1 << 20;

/// Default [`StarOrRing::ring_threshold`] at a star MTU of at most
/// [`RING_MTU_ANY_MEMBERS`]: 256 Ki elements (1 MiB).
pub const RING_THRESHOLD_SMALL_MTU: usize = 1 << 18;

/// Largest star MTU for which the default threshold sends large calls of
/// any ring to the ring (see [`default_ring_threshold`]).
pub const RING_MTU_ANY_MEMBERS: usize = 1500;

/// Largest star MTU for which the default threshold sends large calls of
/// rings of at most [`RING_MEMBERS_JUMBO`] members to the ring.
pub const RING_MTU_LIMIT: usize = 9000;

/// Largest ring that takes large calls at MTUs above
/// [`RING_MTU_ANY_MEMBERS`] (up to [`RING_MTU_LIMIT`]).
pub const RING_MEMBERS_JUMBO: u16 = 4;

/// The default threshold for a star of MTU `star_mtu` beside a ring of
/// `members`: the size from which the ring is the faster, else never
/// (`usize::MAX`). Why these bands: at small MTUs the star pays per-datagram
/// costs at the node for every worker's contribution and every RESULT copy,
/// which the ring spreads over all members, so the ring wins from moderate
/// sizes at any member count; with jumbo datagrams the star's per-datagram
/// cost falls and the ring's 2·(n−1) serial steps dominate, so only small
/// rings win and only on large vectors; at 64 KB datagrams the star always
/// wins. The measured crossovers behind the constants are in
/// docs/BENCHMARKS.md ("Star or ring").
pub fn default_ring_threshold(star_mtu: usize, members: u16) -> usize {
    if star_mtu <= RING_MTU_ANY_MEMBERS {
        RING_THRESHOLD_SMALL_MTU
    } else if star_mtu <= RING_MTU_LIMIT && members <= RING_MEMBERS_JUMBO {
        DEFAULT_RING_THRESHOLD
    } else {
        usize::MAX
    }
}

/// A star and a ring communicator of the same members, or either alone
/// (see the module docs). The star is any [`Collective`]: a
/// [`Communicator`] ([`StarOrRing::new`]), a striped one, or a binding's own
/// wrapper ([`StarOrRing::of`]).
pub struct StarOrRing<S: Collective = Box<dyn Collective>> {
    star: Option<S>,
    ring: Option<Mutex<RingPart>>,
    ring_len: usize,
    ring_threshold: usize,
    algorithm: Algorithm,
}

/// The ring and what its calls reuse. A ring call has the ring memory to
/// itself: calls on it are serialized here.
struct RingPart {
    comm: RingCommunicator,
    /// Padded input of the f32 path (kept between calls).
    scratch: Vec<f32>,
}

impl<S: Collective> std::fmt::Debug for StarOrRing<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StarOrRing")
            .field("star", &self.star.is_some())
            .field("ring_len", &self.ring.as_ref().map(|_| self.ring_len))
            .field("ring_threshold", &self.ring_threshold)
            .field("algorithm", &self.algorithm)
            .finish()
    }
}

impl StarOrRing<Communicator> {
    /// From a star communicator, a ring communicator, or both; the
    /// threshold is [`default_ring_threshold`] of the star's MTU and the
    /// ring's members.
    pub fn new(star: Option<Communicator>, ring: Option<RingCommunicator>) -> Result<StarOrRing<Communicator>, CommError> {
        let mtu = star.as_ref().map(|s| s.config().mtu);
        StarOrRing::of(star, ring, mtu)
    }
}

impl<S: Collective> StarOrRing<S> {
    /// From any star algorithm (a striped one, say), a ring, or both; with
    /// both, the threshold is [`default_ring_threshold`] of `star_mtu` (the
    /// MTU the star's datagrams are sized for) and the ring's members.
    pub fn of(star: Option<S>, ring: Option<RingCommunicator>, star_mtu: Option<usize>) -> Result<StarOrRing<S>, CommError> {
        let ring_threshold = match (star_mtu, &ring) {
            (Some(mtu), Some(r)) if star.is_some() => default_ring_threshold(mtu, r.members()),
            _ => DEFAULT_RING_THRESHOLD,
        };
        if star.is_none() && ring.is_none() {
            return Err(CommError::Config("a collective needs a star or a ring communicator".into()));
        }
        Ok(StarOrRing {
            star,
            ring_len: ring.as_ref().map_or(0, |r| r.len()),
            ring: ring.map(|comm| Mutex::new(RingPart { comm, scratch: Vec::new() })),
            ring_threshold,
            algorithm: Algorithm::Auto,
        })
    }

    /// Calls of at least `elements` go to the ring (with [`Algorithm::Auto`]);
    /// the default is [`default_ring_threshold`] of the star's MTU and the
    /// ring's members.
    pub fn with_ring_threshold(mut self, elements: usize) -> StarOrRing<S> {
        self.ring_threshold = elements;
        self
    }

    /// Force the star or the ring, or choose by size.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> StarOrRing<S> {
        self.algorithm = algorithm;
        self
    }

    /// The threshold in elements.
    pub fn ring_threshold(&self) -> usize {
        self.ring_threshold
    }

    /// The star, if any.
    pub fn star(&self) -> Option<&S> {
        self.star.as_ref()
    }

    /// The star and the ring it was made of.
    pub fn into_parts(self) -> (Option<S>, Option<RingCommunicator>) {
        (self.star, self.ring.map(|r| r.into_inner().unwrap_or_else(|p| p.into_inner()).comm))
    }

    /// Whether there is a ring.
    pub fn has_ring(&self) -> bool {
        self.ring.is_some()
    }

    /// The algorithm a call of `len` elements with `op` takes: the star or
    /// the ring (never [`Algorithm::Auto`]), or why neither can.
    pub fn choose(&self, len: usize, op: Op) -> Result<Algorithm, CommError> {
        let ring_fits = self.ring.is_some() && len <= self.ring_len && op.runs_in_ring();
        match self.algorithm {
            Algorithm::Star if self.star.is_some() => Ok(Algorithm::Star),
            Algorithm::Ring if ring_fits => Ok(Algorithm::Ring),
            Algorithm::Auto if ring_fits && (len >= self.ring_threshold || self.star.is_none()) => Ok(Algorithm::Ring),
            Algorithm::Auto if self.star.is_some() => Ok(Algorithm::Star),
            forced => Err(CommError::Config(format!(
                "no algorithm for {len} elements of {op:?} ({forced:?}): {}",
                match (&self.star, &self.ring) {
                    (None, Some(_)) => format!("the ring reduces {} of up to {} elements and there is no star", ring_ops(), self.ring_len),
                    (Some(_), None) => "there is no ring".to_string(),
                    (Some(_), Some(_)) => format!("the ring reduces {} of up to {} elements", ring_ops(), self.ring_len),
                    (None, None) => unreachable!("of() refuses it"),
                }
            ))),
        }
    }

    /// The star, or why a call that only the star serves cannot be made.
    fn only_star(&self, what: &str) -> Result<&S, CommError> {
        self.star.as_ref().ok_or_else(|| {
            CommError::Config(format!("a {what} needs a star communicator: the ring serves allreduce only"))
        })
    }

    fn ring_part(&self) -> std::sync::MutexGuard<'_, RingPart> {
        let ring = self.ring.as_ref().expect("chosen only with a ring");
        ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Int allreduce on the ring: `buf` padded with `op`'s identity. A call
    /// whose partial sums saturated goes again to the star when there is
    /// one and the choice was automatic (`buf` still holds the input: the
    /// star's exact rule).
    fn ring_i32(&self, buf: &mut [i32], op: Op, opts: CallOptions) -> Result<Served, CommError> {
        let mut part = self.ring_part();
        let ring = &mut part.comm;
        let mem = ring.input_mut();
        mem[..buf.len()].copy_from_slice(buf);
        mem[buf.len()..].fill(op.identity());
        let out = ring.allreduce_in_place(op)?;
        if out.overflow && self.algorithm == Algorithm::Auto {
            if let Some(star) = &self.star {
                drop(part);
                return star.allreduce_elements(Elements::I32(buf), op, opts);
            }
        }
        buf.copy_from_slice(&ring.result()[..buf.len()]);
        Ok(Served { algorithm: Algorithm::Ring, clamped: out.overflow })
    }

    /// Float allreduce on the ring (SUM or the mean through the runtime's
    /// quantization), padded with zeros.
    fn ring_f32(&self, buf: &mut [f32], mean: bool) -> Result<Served, CommError> {
        let mut part = self.ring_part();
        let RingPart { comm, scratch } = &mut *part;
        if buf.len() == comm.len() {
            comm.allreduce_f32(buf, mean)?;
        } else {
            scratch.clear();
            scratch.extend_from_slice(buf);
            scratch.resize(comm.len(), 0.0);
            comm.allreduce_f32(scratch, mean)?;
            buf.copy_from_slice(&scratch[..buf.len()]);
        }
        Ok(Served { algorithm: Algorithm::Ring, clamped: false })
    }
}

/// The ops the ring reduces, by name (the op table's).
fn ring_ops() -> String {
    Op::ALL.iter().filter(|o| o.runs_in_ring()).map(|o| o.name()).collect::<Vec<_>>().join("/")
}

/// Star or ring by [`StarOrRing::choose`]; reduce and broadcast on the star.
impl<S: Collective> Collective for StarOrRing<S> {
    fn participant(&self) -> Participant {
        match (&self.star, &self.ring) {
            (Some(s), _) => s.participant(),
            (None, _) => Participant::Worker(self.ring_part().comm.member()),
        }
    }

    fn workers(&self) -> u16 {
        match (&self.star, &self.ring) {
            (Some(s), _) => s.workers(),
            (None, _) => self.ring_part().comm.members(),
        }
    }

    /// The star's counters (the ring's are its node's: `aggbox stats`).
    fn stats(&self) -> CommStats {
        self.star.as_ref().map(|s| s.stats()).unwrap_or_default()
    }

    fn lost(&self) -> Option<String> {
        self.star.as_ref().and_then(|s| s.lost())
    }

    fn allreduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        let choice_op = match data {
            Elements::I32(_) => op,
            // A float call is a SUM of quantized values on either algorithm.
            Elements::F32(_) => {
                float_mean(op)?;
                Op::Sum
            }
        };
        match self.choose(data.len(), choice_op)? {
            Algorithm::Ring => {
                // A run's ring lives as long as its job: once the job is
                // lost, so is the ring, and its calls say so.
                if let Some(why) = self.lost() {
                    return Err(CommError::JobLost(why));
                }
                let served = match data {
                    Elements::I32(buf) => self.ring_i32(buf, op, opts),
                    Elements::F32(buf) => self.ring_f32(buf, float_mean(op)?),
                };
                served.map_err(|e| match self.lost() {
                    Some(why) => CommError::JobLost(format!("{why} (the ring call failed: {e})")),
                    None => e,
                })
            }
            _ => self.only_star("allreduce")?.allreduce_elements(data, op, opts),
        }
    }

    fn reduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.only_star("reduce")?.reduce_elements(data, op, opts)
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: Participant, opts: CallOptions) -> Result<Served, CommError> {
        self.only_star("broadcast")?.broadcast_bytes(buf, root, opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default follows the measured winner: the ring at MTU 1500 from
    /// 256 Ki elements, at 9000 from 1 Mi for 4 members only, never with
    /// 64 KB datagrams.
    #[test]
    fn the_default_threshold_follows_mtu_and_members() {
        assert_eq!(default_ring_threshold(1500, 4), RING_THRESHOLD_SMALL_MTU);
        assert_eq!(default_ring_threshold(1500, 8), RING_THRESHOLD_SMALL_MTU);
        assert_eq!(default_ring_threshold(1500, 16), RING_THRESHOLD_SMALL_MTU);
        assert_eq!(default_ring_threshold(9000, 4), DEFAULT_RING_THRESHOLD);
        assert_eq!(default_ring_threshold(9000, 8), usize::MAX);
        assert_eq!(default_ring_threshold(65535, 4), usize::MAX);
        assert_eq!(default_ring_threshold(65535, 2), usize::MAX);
    }
}
