//! Star or ring, chosen per call by the vector's size (docs/RING.md
//! "Choosing"): a [`Collective`] holds a star communicator (a job reduced
//! by an aggregator's XDP program: lowest latency) and a ring communicator
//! (a `[[ring]]` job: each member's link carries 2(n−1)/n of the vector
//! instead of the aggregator's n times it), and sends a call to the ring
//! when it has at least [`Collective::ring_threshold`] elements.
//!
//! Every member decides alike: the choice depends only on the call's length,
//! op and the configured threshold, which all members share. A ring job
//! reduces exactly its `vector_len` elements; a shorter vector is padded
//! with the op's identity ([`Op::identity`]: 0 for SUM, `i32::MIN` for MAX,
//! 1 for LAND, ...), so one ring serves every size up to its length.
//! A ring call whose partial sums saturated (docs/RING.md "Arithmetic") is
//! redone on the star when there is one, so an automatic choice returns the
//! star's result bit for bit.

use crate::runtime::comm::Communicator;
use crate::runtime::ring::RingCommunicator;
use crate::runtime::CommError;
use crate::wire::abi::Op;

/// Default [`Collective::ring_threshold`] where the ring is the faster
/// algorithm at jumbo MTUs ([`default_ring_threshold`]): 1 Mi elements
/// (4 MiB).
pub const DEFAULT_RING_THRESHOLD: usize = 1 << 20;

/// Default [`Collective::ring_threshold`] at a star MTU of at most
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
/// `members`, from where the ring was the faster on the benchmark testbed
/// (docs/BENCHMARKS.md "Star or ring"), else never (`usize::MAX`): at MTU
/// 1500 the ring was faster or level from 256 Ki elements on (4 and 8
/// members; 0.56–0.62 of the star's time at 21.8 M); at 9000 it was faster
/// at 21.8 M with 4 members (0.83), level or slower with 8 (0.90–1.45) and
/// slower at 1 M in one run of two; with 64 KB datagrams the star was
/// 1.1–1.9× faster everywhere.
pub fn default_ring_threshold(star_mtu: usize, members: u16) -> usize {
    if star_mtu <= RING_MTU_ANY_MEMBERS {
        RING_THRESHOLD_SMALL_MTU
    } else if star_mtu <= RING_MTU_LIMIT && members <= RING_MEMBERS_JUMBO {
        DEFAULT_RING_THRESHOLD
    } else {
        usize::MAX
    }
}

/// Which algorithm a call takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// By size: the ring from [`Collective::ring_threshold`] elements on.
    #[default]
    Auto,
    /// Always the star.
    Star,
    /// Always the ring (vectors up to its length).
    Ring,
}

/// A star and a ring communicator of the same members (see the module docs).
#[derive(Debug)]
pub struct Collective {
    star: Option<Communicator>,
    ring: Option<RingCommunicator>,
    ring_threshold: usize,
    algorithm: Algorithm,
    /// Padded input of the f32 ring path (kept between calls).
    scratch: Vec<f32>,
}

impl Collective {
    /// From a star communicator, a ring communicator, or both.
    pub fn new(star: Option<Communicator>, ring: Option<RingCommunicator>) -> Result<Collective, CommError> {
        if star.is_none() && ring.is_none() {
            return Err(CommError::Config("a collective needs a star or a ring communicator".into()));
        }
        let ring_threshold = match (&star, &ring) {
            (Some(s), Some(r)) => default_ring_threshold(s.config().mtu, r.members()),
            _ => DEFAULT_RING_THRESHOLD,
        };
        Ok(Collective {
            star,
            ring,
            ring_threshold,
            algorithm: Algorithm::Auto,
            scratch: Vec::new(),
        })
    }

    /// Calls of at least `elements` go to the ring (with [`Algorithm::Auto`]);
    /// the default is [`default_ring_threshold`] of the star's MTU and the
    /// ring's members.
    pub fn with_ring_threshold(mut self, elements: usize) -> Collective {
        self.ring_threshold = elements;
        self
    }

    /// Force the star or the ring, or choose by size.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Collective {
        self.algorithm = algorithm;
        self
    }

    /// The threshold in elements.
    pub fn ring_threshold(&self) -> usize {
        self.ring_threshold
    }

    /// The star communicator, if any.
    pub fn star(&self) -> Option<&Communicator> {
        self.star.as_ref()
    }

    /// The ring communicator, if any.
    pub fn ring(&mut self) -> Option<&mut RingCommunicator> {
        self.ring.as_mut()
    }

    /// The algorithm a call of `len` elements with `op` takes: the star or
    /// the ring (never [`Algorithm::Auto`]), or why neither can.
    pub fn choose(&self, len: usize, op: Op) -> Result<Algorithm, CommError> {
        let ring_fits = self.ring.as_ref().is_some_and(|r| len <= r.len()) && op.runs_in_ring();
        match self.algorithm {
            Algorithm::Star if self.star.is_some() => Ok(Algorithm::Star),
            Algorithm::Ring if ring_fits => Ok(Algorithm::Ring),
            Algorithm::Auto if ring_fits && (len >= self.ring_threshold || self.star.is_none()) => Ok(Algorithm::Ring),
            Algorithm::Auto if self.star.is_some() => Ok(Algorithm::Star),
            forced => Err(CommError::Config(format!(
                "no algorithm for {len} elements of {op:?} ({forced:?}): {}",
                match (&self.star, &self.ring) {
                    (None, Some(r)) => format!("the ring reduces SUM/COUNT/MAX/MIN/AVG of up to {} elements and there is no star", r.len()),
                    (Some(_), None) => "there is no ring".to_string(),
                    (Some(_), Some(r)) => format!("the ring reduces SUM/COUNT/MAX/MIN/AVG of up to {} elements", r.len()),
                    (None, None) => unreachable!("new() refuses it"),
                }
            ))),
        }
    }

    /// Allreduce of `buf` with `op` on the algorithm [`Collective::choose`]
    /// picks; returns it and whether some element was clamped (OVERFLOW).
    pub fn allreduce_i32(&mut self, buf: &mut [i32], op: Op) -> Result<(Algorithm, bool), CommError> {
        match self.choose(buf.len(), op)? {
            Algorithm::Ring => {
                let ring = self.ring.as_mut().expect("chosen");
                let mem = ring.input_mut();
                mem[..buf.len()].copy_from_slice(buf);
                mem[buf.len()..].fill(op.identity());
                let out = ring.allreduce_in_place(op)?;
                if out.overflow && self.algorithm == Algorithm::Auto {
                    // `buf` still holds the input: the star's exact rule.
                    if let Some(star) = &self.star {
                        return Ok((Algorithm::Star, star.allreduce_i32(buf, op)?));
                    }
                }
                buf.copy_from_slice(&ring.result()[..buf.len()]);
                Ok((Algorithm::Ring, out.overflow))
            }
            _ => Ok((Algorithm::Star, self.star.as_ref().expect("chosen").allreduce_i32(buf, op)?)),
        }
    }

    /// Float allreduce (SUM, or the mean) through the runtime's quantization
    /// on the algorithm [`Collective::choose`] picks for a SUM of its length.
    pub fn allreduce_f32(&mut self, buf: &mut [f32], mean: bool) -> Result<Algorithm, CommError> {
        match self.choose(buf.len(), Op::Sum)? {
            Algorithm::Ring => {
                let ring = self.ring.as_mut().expect("chosen");
                if buf.len() == ring.len() {
                    ring.allreduce_f32(buf, mean)?;
                } else {
                    self.scratch.clear();
                    self.scratch.extend_from_slice(buf);
                    self.scratch.resize(ring.len(), 0.0);
                    ring.allreduce_f32(&mut self.scratch, mean)?;
                    buf.copy_from_slice(&self.scratch[..buf.len()]);
                }
                Ok(Algorithm::Ring)
            }
            _ => {
                self.star.as_ref().expect("chosen").allreduce_f32(buf, mean)?;
                Ok(Algorithm::Star)
            }
        }
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
