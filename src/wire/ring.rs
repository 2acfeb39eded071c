//! AGR1 ring datagrams (docs/RING.md): the header's encoding and the checks
//! that need no map, where a fragment travels ([`RingLayout`]), and the
//! arithmetic of one hop, the reference the XDP ring program is tested
//! against and the arithmetic of the node's user-space hops.
//!
//! Arithmetic: a partial travels as int32, so each hop saturates where the
//! star ([`crate::wire::reducer`]) accumulates exactly and clamps once.
//! Whenever no hop saturates, the ring's result equals the star's (the tests
//! check it over random inputs). Weights apply to SUM and AVG only, as in
//! the star (docs/PROTOCOL.md "Arithmetic").

use crate::wire::abi::{self, Op, Round, RingHdr};

/// `kind` of an AGR1 datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RingKind {
    /// Reduce-scatter: the partial result of the members it passed.
    Partial,
    /// Allgather: the fragment's result.
    Final,
    /// Fragment indexes the sender misses.
    Nack,
    /// The local runtime's "round `round` is ready".
    Kick,
}

impl RingKind {
    /// The `kind` byte.
    pub fn code(self) -> u8 {
        match self {
            RingKind::Partial => abi::RING_PARTIAL,
            RingKind::Final => abi::RING_FINAL,
            RingKind::Nack => abi::RING_NACK,
            RingKind::Kick => abi::RING_KICK,
        }
    }

    /// The kind of a `kind` byte.
    pub fn from_code(code: u8) -> Option<RingKind> {
        match code {
            abi::RING_PARTIAL => Some(RingKind::Partial),
            abi::RING_FINAL => Some(RingKind::Final),
            abi::RING_NACK => Some(RingKind::Nack),
            abi::RING_KICK => Some(RingKind::Kick),
            _ => None,
        }
    }

    /// PARTIAL and FINAL carry a fragment's elements.
    pub fn carries_elements(self) -> bool {
        matches!(self, RingKind::Partial | RingKind::Final)
    }
}

/// Most fragment indexes one NACK carries.
pub const MAX_NACK_INDEXES: usize = 256;

/// A decoded AGR1 header (host order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingHeader {
    /// Ring job id.
    pub ring: u16,
    /// What the datagram is.
    pub kind: RingKind,
    /// `abi::RING_F_*` bits.
    pub flags: u8,
    /// The call's round.
    pub round: Round,
    /// Fragment index (NACK, KICK: 0).
    pub frag: u32,
    /// Transmission number along the ring (NACK, KICK: 0).
    pub hops: u16,
    /// Payload elements (PARTIAL, FINAL) or indexes (NACK).
    pub count: u16,
    /// Member index of the sender.
    pub sender: u16,
    /// The round's op (a kernel op, SUM..AVG).
    pub op: Op,
}

/// Why an AGR1 datagram was refused. [`RingError::is_forged`] tells the
/// `forged` ones from the `malformed` ones (the XDP program's counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// Shorter than the header.
    #[error("{0} bytes: shorter than the 24-byte AGR1 header")]
    Short(usize),
    /// Not "AGR1".
    #[error("magic {0:#010x} is not AGR1")]
    Magic(u32),
    /// Unknown `kind`.
    #[error("unknown kind {0}")]
    Kind(u8),
    /// Unknown flag bits, or a flag the kind does not take.
    #[error("flags {flags:#04x} on a {kind:?}")]
    Flags {
        /// The datagram's kind.
        kind: RingKind,
        /// Its flags.
        flags: u8,
    },
    /// `op` is not one that [`Op::runs_in_ring`].
    #[error("op {0} is not a ring op")]
    Op(u8),
    /// `pad` is not 0.
    #[error("pad byte {0} is not 0")]
    Pad(u8),
    /// The payload is not `count` elements (or indexes) long.
    #[error("payload of {found} bytes where count {count} needs {}", .count * 4)]
    Length {
        /// The header's count.
        count: usize,
        /// Payload bytes.
        found: usize,
    },
    /// NACK or KICK with a fragment or hops, a KICK with a payload, or a
    /// NACK of no or more than [`MAX_NACK_INDEXES`] indexes.
    #[error("{kind:?} with frag {frag}, hops {hops}, count {count}")]
    Control {
        /// The datagram's kind.
        kind: RingKind,
        /// Its fragment field.
        frag: u32,
        /// Its hops field.
        hops: u16,
        /// Its count field.
        count: u16,
    },
    /// Fragment index past the ring's fragments.
    #[error("fragment {frag} of a ring of {frags}")]
    Frag {
        /// The fragment index.
        frag: u32,
        /// The ring's fragments.
        frags: u32,
    },
    /// `count` is not the fragment's element count.
    #[error("fragment {frag} has {expected} elements, count says {count}")]
    Count {
        /// The fragment.
        frag: u32,
        /// Its elements.
        expected: u32,
        /// The header's count.
        count: u16,
    },
    /// `hops` out of range for the kind (PARTIAL 1..n−1, FINAL n..2n−2).
    #[error("{kind:?} with hops {hops} in a ring of {members}")]
    Hops {
        /// The datagram's kind.
        kind: RingKind,
        /// Its hops.
        hops: u16,
        /// The ring's members.
        members: u16,
    },
    /// The sender is not a member.
    #[error("sender {sender} in a ring of {members}")]
    Sender {
        /// The sender field.
        sender: u16,
        /// The ring's members.
        members: u16,
    },
    /// The hops lead to another member than this one (forged).
    #[error("fragment {frag} hops {hops} goes to member {to}, this is member {me}")]
    NotHere {
        /// The fragment.
        frag: u32,
        /// Its hops.
        hops: u16,
        /// The member it goes to.
        to: u16,
        /// This member.
        me: u16,
    },
    /// The sender is not the member that sends transmission `hops` (the
    /// one before this, or for a FINAL the completing member).
    #[error("fragment {frag} hops {hops} comes from member {from}, not {sender}")]
    NotFrom {
        /// The fragment.
        frag: u32,
        /// Its hops.
        hops: u16,
        /// The sender field.
        sender: u16,
        /// The member that sends it.
        from: u16,
    },
}

impl RingError {
    /// Whether the XDP program counts it `forged` (a consistent header that
    /// does not lead here, or from the wrong member, or a sender that is
    /// not a member) rather than `malformed`.
    pub fn is_forged(&self) -> bool {
        matches!(self, RingError::NotHere { .. } | RingError::NotFrom { .. } | RingError::Sender { .. })
    }
}

impl RingHeader {
    /// The header's 24 bytes.
    pub fn encode(&self) -> [u8; abi::RING_HDR_LEN] {
        let mut b = [0u8; abi::RING_HDR_LEN];
        b[0..4].copy_from_slice(&abi::MAGIC_RING.to_be_bytes());
        b[4..6].copy_from_slice(&self.ring.to_be_bytes());
        b[6] = self.kind.code();
        b[7] = self.flags;
        b[8..12].copy_from_slice(&self.round.0.to_be_bytes());
        b[12..16].copy_from_slice(&self.frag.to_be_bytes());
        b[16..18].copy_from_slice(&self.hops.to_be_bytes());
        b[18..20].copy_from_slice(&self.count.to_be_bytes());
        b[20..22].copy_from_slice(&self.sender.to_be_bytes());
        b[22] = self.op as u8;
        b[23] = 0;
        b
    }

    /// The raw ABI struct (wire byte order in its fields, as the C side
    /// holds it).
    pub fn to_abi(&self) -> RingHdr {
        abi::from_bytes::<RingHdr>(&self.encode()).unwrap_or_default()
    }

    /// Decodes and checks a whole datagram (header and payload length)
    /// against everything that needs no ring: magic, kind, flags, op, pad,
    /// `count` against the payload, and the fields NACK and KICK leave 0.
    /// Returns the header and the payload.
    pub fn decode(datagram: &[u8]) -> Result<(RingHeader, &[u8]), RingError> {
        if datagram.len() < abi::RING_HDR_LEN {
            return Err(RingError::Short(datagram.len()));
        }
        let be16 = |i: usize| u16::from_be_bytes([datagram[i], datagram[i + 1]]);
        let be32 = |i: usize| u32::from_be_bytes([datagram[i], datagram[i + 1], datagram[i + 2], datagram[i + 3]]);
        let magic = be32(0);
        if magic != abi::MAGIC_RING {
            return Err(RingError::Magic(magic));
        }
        let kind = RingKind::from_code(datagram[6]).ok_or(RingError::Kind(datagram[6]))?;
        let flags = datagram[7];
        let allowed = match kind {
            RingKind::Partial | RingKind::Final => abi::RING_F_SATURATED,
            RingKind::Nack => abi::RING_F_NACK_FINAL,
            RingKind::Kick => 0,
        };
        if flags & !allowed != 0 {
            return Err(RingError::Flags { kind, flags });
        }
        let op = Op::from_u8(datagram[22]).filter(|o| o.runs_in_ring()).ok_or(RingError::Op(datagram[22]))?;
        if datagram[23] != 0 {
            return Err(RingError::Pad(datagram[23]));
        }
        let hdr = RingHeader {
            ring: be16(4),
            kind,
            flags,
            round: Round(be32(8)),
            frag: be32(12),
            hops: be16(16),
            count: be16(18),
            sender: be16(20),
            op,
        };
        let payload = &datagram[abi::RING_HDR_LEN..];
        if payload.len() != usize::from(hdr.count) * 4 {
            return Err(RingError::Length { count: usize::from(hdr.count), found: payload.len() });
        }
        let control_ok = match kind {
            RingKind::Partial | RingKind::Final => true,
            RingKind::Nack => hdr.frag == 0 && hdr.hops == 0 && (1..=MAX_NACK_INDEXES).contains(&usize::from(hdr.count)),
            RingKind::Kick => hdr.frag == 0 && hdr.hops == 0 && hdr.count == 0,
        };
        if !control_ok {
            return Err(RingError::Control { kind, frag: hdr.frag, hops: hdr.hops, count: hdr.count });
        }
        Ok((hdr, payload))
    }

    /// Whether the datagram carries [`abi::RING_F_SATURATED`].
    pub fn saturated(&self) -> bool {
        self.flags & abi::RING_F_SATURATED != 0
    }
}

/// The fragment indexes of a NACK's payload.
pub fn nack_indexes(payload: &[u8]) -> impl Iterator<Item = u32> + '_ {
    payload.chunks_exact(4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
}

/// The shape of a ring as one member sees it: where each fragment starts
/// and travels. Built from the node's [`abi::RingJob`] (or a test's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    /// Members of the ring (>= 2).
    pub members: u16,
    /// This member's index.
    pub me: u16,
    /// Elements of a full fragment.
    pub frag_elems: u32,
    /// Elements of the vector.
    pub vector_len: u32,
}

impl RingLayout {
    /// The layout of a ring job entry.
    pub fn of_job(job: &abi::RingJob) -> RingLayout {
        RingLayout { members: job.members, me: job.me, frag_elems: job.frag_elems, vector_len: job.vector_len }
    }

    /// Fragments of the vector.
    pub fn frags(&self) -> u32 {
        self.vector_len.div_ceil(self.frag_elems)
    }

    /// Elements of fragment `f` (the last may be short).
    pub fn frag_len(&self, f: u32) -> u32 {
        let start = u64::from(f) * u64::from(self.frag_elems);
        (u64::from(self.vector_len).saturating_sub(start)).min(u64::from(self.frag_elems)) as u32
    }

    /// The member that sends fragment `f`'s first PARTIAL.
    pub fn origin(&self, f: u32) -> u16 {
        (f % u32::from(self.members)) as u16
    }

    /// The member that receives transmission `hops` of fragment `f`.
    pub fn receiver(&self, f: u32, hops: u16) -> u16 {
        ((u32::from(self.origin(f)) + u32::from(hops)) % u32::from(self.members)) as u16
    }

    /// The member that completes fragment `f` (receives PARTIAL hops n−1).
    pub fn completer(&self, f: u32) -> u16 {
        self.receiver(f, self.members - 1)
    }

    /// The hops of the FINAL of fragment `f` that member `k` receives (not
    /// the completer, which stores the result as it completes it).
    pub fn final_hops_to(&self, f: u32, k: u16) -> u16 {
        let n = u32::from(self.members);
        (n + (u32::from(k) + n - u32::from(self.origin(f))) % n) as u16
    }

    /// The hops of the last FINAL (2n−2): its receiver sends nothing on.
    pub fn last_hops(&self) -> u16 {
        2 * self.members - 2
    }

    /// The kind of transmission `hops` (1..=2n−2).
    pub fn kind_of_hops(&self, hops: u16) -> Option<RingKind> {
        if (1..self.members).contains(&hops) {
            Some(RingKind::Partial)
        } else if (self.members..=self.last_hops()).contains(&hops) {
            Some(RingKind::Final)
        } else {
            None
        }
    }

    /// The member after this one.
    pub fn next(&self) -> u16 {
        (self.me + 1) % self.members
    }

    /// The fragments this member is the origin of, in order.
    pub fn own_frags(&self) -> impl Iterator<Item = u32> {
        (u32::from(self.me)..self.frags()).step_by(usize::from(self.members))
    }

    /// The checks of a decoded PARTIAL / FINAL / NACK / KICK that need the
    /// ring (docs/RING.md "XDP" step 1): sender a member; for PARTIAL and
    /// FINAL, fragment in range, count its elements, hops in range for the
    /// kind and leading to this member.
    pub fn check(&self, hdr: &RingHeader) -> Result<(), RingError> {
        if hdr.sender >= self.members {
            return Err(RingError::Sender { sender: hdr.sender, members: self.members });
        }
        if !hdr.kind.carries_elements() {
            return Ok(());
        }
        let frags = self.frags();
        if hdr.frag >= frags {
            return Err(RingError::Frag { frag: hdr.frag, frags });
        }
        let expected = self.frag_len(hdr.frag);
        if u32::from(hdr.count) != expected {
            return Err(RingError::Count { frag: hdr.frag, expected, count: hdr.count });
        }
        if self.kind_of_hops(hdr.hops) != Some(hdr.kind) {
            return Err(RingError::Hops { kind: hdr.kind, hops: hdr.hops, members: self.members });
        }
        let to = self.receiver(hdr.frag, hdr.hops);
        if to != self.me {
            return Err(RingError::NotHere { frag: hdr.frag, hops: hdr.hops, to, me: self.me });
        }
        // Transmission `hops` comes from the member before; a FINAL may
        // also come straight from the completing member (its answer to a
        // NACK_FINAL).
        let from = self.receiver(hdr.frag, hdr.hops - 1);
        if hdr.sender != from && !(hdr.kind == RingKind::Final && hdr.sender == self.completer(hdr.frag)) {
            return Err(RingError::NotFrom { frag: hdr.frag, hops: hdr.hops, sender: hdr.sender, from });
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Arithmetic of one hop
// ---------------------------------------------------------------------------

#[inline]
fn saturate(v: i64) -> (i32, bool) {
    let c = v.clamp(i64::from(i32::MIN), i64::from(i32::MAX));
    (c as i32, c != v)
}

/// What the origin (weight `weight`, element `x`) sends: the op's
/// identity combined with `x` by the op table's row (`w·x` for SUM and
/// AVG, `x ≠ 0` for COUNT, `x` for MAX and MIN), saturated to int32, and
/// whether it saturated.
#[inline]
pub fn origin_value(op: Op, weight: i32, x: i32) -> (i32, bool) {
    combine(op, weight, op.identity(), x)
}

/// A member's hop: `partial` combined with its element `x` of weight
/// `weight` by the op table's row ([`Op::combine`]: `partial + w·x` for
/// SUM and AVG, `partial + (x ≠ 0)` for COUNT, ...), saturated to int32,
/// and whether it saturated. Only ops that [`Op::runs_in_ring`] reach a
/// ring ([`RingHeader::decode`] refuses the others), but the arithmetic is
/// the table's for every op, as the ring program's (src/bpf/aggbox_ring.bpf.c).
#[inline]
pub fn combine(op: Op, weight: i32, partial: i32, x: i32) -> (i32, bool) {
    saturate(op.combine(i64::from(partial), x, weight))
}

/// The completing member's last step, the op table's finish: AVG divides
/// by the weight sum, truncating toward zero (the weight sum is positive,
/// the configuration checks it; 0 leaves `v`); the others keep `v`.
#[inline]
pub fn complete(op: Op, weight_sum: u32, v: i32) -> i32 {
    saturate(op.finish(i64::from(v), i64::from(weight_sum))).0
}

#[inline]
fn be_at(bytes: &[u8], i: usize) -> i32 {
    i32::from_be_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]])
}

/// [`origin_value`] over a fragment: `input` (host order) into `out`
/// (big-endian, `4 · input.len()` bytes); whether any element saturated.
pub fn origin_be(op: Op, weight: i32, input: impl IntoIterator<Item = i32>, out: &mut [u8]) -> bool {
    let mut saturated = false;
    for (chunk, x) in out.chunks_exact_mut(4).zip(input) {
        let (v, s) = origin_value(op, weight, x);
        saturated |= s;
        chunk.copy_from_slice(&v.to_be_bytes());
    }
    saturated
}

/// [`combine`] over a fragment, in place on the datagram's big-endian
/// `payload`, with this member's `input` (host order); whether any element
/// saturated.
pub fn combine_be(op: Op, weight: i32, payload: &mut [u8], input: impl IntoIterator<Item = i32>) -> bool {
    let mut saturated = false;
    for (chunk, x) in payload.chunks_exact_mut(4).zip(input) {
        let p = i32::from_be_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        let (v, s) = combine(op, weight, p, x);
        saturated |= s;
        chunk.copy_from_slice(&v.to_be_bytes());
    }
    saturated
}

/// [`complete`] over a fragment, in place on the big-endian `payload`.
pub fn complete_be(op: Op, weight_sum: u32, payload: &mut [u8]) {
    for chunk in payload.chunks_exact_mut(4) {
        let v = complete(op, weight_sum, i32::from_be_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]));
        chunk.copy_from_slice(&v.to_be_bytes());
    }
}

/// The elements of a big-endian payload, host order.
pub fn elements_be(payload: &[u8]) -> impl Iterator<Item = i32> + '_ {
    (0..payload.len() / 4).map(move |i| be_at(payload, i))
}

/// A whole ring allreduce of `inputs` (member order, weights `weights`) as
/// the ring computes it, hop by hop: the reference of the ring's result.
/// Returns the result and whether any hop saturated (OVERFLOW).
pub fn ring_reference(op: Op, inputs: &[&[i32]], weights: &[i32]) -> (Vec<i32>, bool) {
    let n = inputs.len();
    let len = inputs.first().map_or(0, |v| v.len());
    let weight_sum: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut out = Vec::with_capacity(len);
    let mut saturated = false;
    #[allow(clippy::needless_range_loop)] // i indexes every member's input
    for i in 0..len {
        // Any origin gives the same result; the fragment of element i may
        // start anywhere, so start at member i mod n.
        let o = i % n;
        let (mut p, s) = origin_value(op, weights[o], inputs[o][i]);
        saturated |= s;
        for h in 1..n {
            let m = (o + h) % n;
            let (v, s) = combine(op, weights[m], p, inputs[m][i]);
            saturated |= s;
            p = v;
        }
        out.push(complete(op, weight_sum as u32, p));
    }
    (out, saturated)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::reducer;

    use crate::wire::rng::Rng;

    /// A draw in `lo..=hi`.
    fn i32_in(rng: &mut Rng, lo: i32, hi: i32) -> i32 {
        (i64::from(lo) + rng.below((i64::from(hi) - i64::from(lo) + 1) as u64) as i64) as i32
    }

    fn header(kind: RingKind) -> RingHeader {
        RingHeader {
            ring: 40,
            kind,
            flags: 0,
            round: Round(7),
            frag: 5,
            hops: 2,
            count: 3,
            sender: 1,
            op: Op::Sum,
        }
    }

    fn datagram(h: &RingHeader, payload_len: usize) -> Vec<u8> {
        let mut d = h.encode().to_vec();
        d.resize(abi::RING_HDR_LEN + payload_len, 0);
        d
    }

    #[test]
    fn header_round_trips_and_matches_the_abi_layout() {
        let h = RingHeader { flags: abi::RING_F_SATURATED, ..header(RingKind::Final) };
        let d = datagram(&h, 12);
        let (back, payload) = RingHeader::decode(&d).expect("decode");
        assert_eq!(back, h);
        assert_eq!(payload.len(), 12);
        let raw = h.to_abi();
        assert_eq!(u32::from_be(raw.magic), abi::MAGIC_RING);
        assert_eq!(u16::from_be(raw.ring), 40);
        assert_eq!(u32::from_be(raw.round), 7);
        assert_eq!(u32::from_be(raw.frag), 5);
        assert_eq!(u16::from_be(raw.hops), 2);
        assert_eq!(u16::from_be(raw.count), 3);
        assert_eq!(u16::from_be(raw.sender), 1);
        assert_eq!(raw.kind, abi::RING_FINAL);
        assert_eq!(raw.flags, abi::RING_F_SATURATED);
    }

    #[test]
    fn decode_refuses_each_malformed_field() {
        let ok = header(RingKind::Partial);
        let good = datagram(&ok, 12);
        assert!(RingHeader::decode(&good).is_ok());
        assert_eq!(RingHeader::decode(&good[..23]), Err(RingError::Short(23)));
        let with = |i: usize, v: u8| {
            let mut d = good.clone();
            d[i] = v;
            RingHeader::decode(&d).map(|(h, _)| h)
        };
        assert!(matches!(with(0, 0x42), Err(RingError::Magic(_))));
        assert_eq!(with(6, 4), Err(RingError::Kind(4)));
        assert!(matches!(with(7, abi::RING_F_NACK_FINAL), Err(RingError::Flags { .. })));
        assert!(matches!(with(7, 0x80), Err(RingError::Flags { .. })));
        assert_eq!(with(22, Op::Prod as u8), Err(RingError::Op(Op::Prod as u8)));
        let unknown = Op::ALL.len() as u8; // the first number no row has
        assert_eq!(with(22, unknown), Err(RingError::Op(unknown)));
        assert_eq!(with(22, Op::Lor as u8), Err(RingError::Op(Op::Lor as u8)), "LOR is a star op");
        assert_eq!(with(22, Op::Avg as u8).map(|h| h.op), Ok(Op::Avg));
        assert_eq!(with(23, 1), Err(RingError::Pad(1)));
        assert_eq!(
            RingHeader::decode(&good[..good.len() - 1]).map(|(h, _)| h),
            Err(RingError::Length { count: 3, found: 11 })
        );
        // KICK: no fragment, hops or payload, no flags.
        let kick = RingHeader { frag: 0, hops: 0, count: 0, ..header(RingKind::Kick) };
        assert!(RingHeader::decode(&datagram(&kick, 0)).is_ok());
        let bad_kick = RingHeader { frag: 1, ..kick };
        assert!(matches!(RingHeader::decode(&datagram(&bad_kick, 0)), Err(RingError::Control { .. })));
        let flagged_kick = RingHeader { flags: abi::RING_F_SATURATED, ..kick };
        assert!(matches!(RingHeader::decode(&datagram(&flagged_kick, 0)), Err(RingError::Flags { .. })));
        // NACK: 1..=256 indexes, NACK_FINAL allowed, SATURATED not.
        let nack = RingHeader { frag: 0, hops: 0, count: 2, flags: abi::RING_F_NACK_FINAL, ..header(RingKind::Nack) };
        assert!(RingHeader::decode(&datagram(&nack, 8)).is_ok());
        let empty = RingHeader { count: 0, ..nack };
        assert!(matches!(RingHeader::decode(&datagram(&empty, 0)), Err(RingError::Control { .. })));
        let long = RingHeader { count: 257, ..nack };
        assert!(matches!(RingHeader::decode(&datagram(&long, 257 * 4)), Err(RingError::Control { .. })));
        let sat = RingHeader { flags: abi::RING_F_SATURATED, ..nack };
        assert!(matches!(RingHeader::decode(&datagram(&sat, 8)), Err(RingError::Flags { .. })));
    }

    #[test]
    fn nack_indexes_read_back() {
        let nack = RingHeader { frag: 0, hops: 0, count: 3, ..header(RingKind::Nack) };
        let mut d = nack.encode().to_vec();
        for i in [3u32, 70_000, 0] {
            d.extend_from_slice(&i.to_be_bytes());
        }
        let (_, payload) = RingHeader::decode(&d).expect("decode");
        assert_eq!(nack_indexes(payload).collect::<Vec<_>>(), vec![3, 70_000, 0]);
    }

    #[test]
    fn layout_walks_each_fragment_round_the_ring() {
        // 4 members, 10 elements of 3 a fragment: 4 fragments, the last of 1.
        let l = RingLayout { members: 4, me: 0, frag_elems: 3, vector_len: 10 };
        assert_eq!(l.frags(), 4);
        assert_eq!((0..4).map(|f| l.frag_len(f)).collect::<Vec<_>>(), vec![3, 3, 3, 1]);
        assert_eq!(l.origin(6), 2);
        // Fragment 1 (origin 1): PARTIALs to 2, 3, 0 (completes), FINALs to 1, 2, 3 (last).
        let to: Vec<u16> = (1..=l.last_hops()).map(|h| l.receiver(1, h)).collect();
        assert_eq!(to, vec![2, 3, 0, 1, 2, 3]);
        assert_eq!(l.completer(1), 0);
        for k in [1u16, 2, 3] {
            let h = l.final_hops_to(1, k);
            assert_eq!(l.receiver(1, h), k);
            assert_eq!(l.kind_of_hops(h), Some(RingKind::Final));
        }
        assert_eq!(l.final_hops_to(1, 3), l.last_hops());
        assert_eq!(l.kind_of_hops(0), None);
        assert_eq!(l.kind_of_hops(3), Some(RingKind::Partial));
        assert_eq!(l.kind_of_hops(4), Some(RingKind::Final));
        assert_eq!(l.kind_of_hops(7), None);
        let l2 = RingLayout { me: 1, ..l };
        assert_eq!(l2.own_frags().collect::<Vec<_>>(), vec![1]);
        // Two members: the origin's PARTIAL is completed, the FINAL (hops 2) is last.
        let two = RingLayout { members: 2, me: 0, frag_elems: 4, vector_len: 4 };
        assert_eq!(two.completer(0), 1);
        assert_eq!(two.last_hops(), 2);
        assert_eq!(two.final_hops_to(0, 0), 2);
    }

    #[test]
    fn layout_check_refuses_what_does_not_lead_here() {
        let l = RingLayout { members: 4, me: 2, frag_elems: 3, vector_len: 10 };
        let p = RingHeader { frag: 1, hops: 1, count: 3, sender: 1, ..header(RingKind::Partial) };
        assert_eq!(l.check(&p), Ok(()));
        assert!(matches!(l.check(&RingHeader { frag: 4, ..p }), Err(RingError::Frag { .. })));
        assert!(matches!(l.check(&RingHeader { frag: 3, count: 3, hops: 3, ..p }), Err(RingError::Count { .. })));
        assert!(matches!(l.check(&RingHeader { hops: 4, ..p }), Err(RingError::Hops { .. })));
        assert!(matches!(l.check(&RingHeader { sender: 4, ..p }), Err(RingError::Sender { .. })));
        let wrong = l.check(&RingHeader { hops: 2, ..p });
        assert!(wrong.as_ref().is_err_and(RingError::is_forged), "{wrong:?}");
        // FINAL of fragment 1 to member 2: hops 5.
        let f = RingHeader { kind: RingKind::Final, hops: 5, ..p };
        assert_eq!(l.check(&f), Ok(()));
        assert!(matches!(l.check(&RingHeader { hops: 3, ..f }), Err(RingError::Hops { .. })));
        // From a member that does not send that transmission: forged; a
        // FINAL straight from the completing member (member 0) is not.
        let from3 = l.check(&RingHeader { sender: 3, ..p });
        assert!(matches!(from3, Err(RingError::NotFrom { from: 1, .. })), "{from3:?}");
        assert!(from3.is_err_and(|e| e.is_forged()));
        assert_eq!(l.check(&RingHeader { sender: 0, ..f }), Ok(()));
        assert!(matches!(l.check(&RingHeader { sender: 3, ..f }), Err(RingError::NotFrom { .. })));
        let nack = RingHeader { frag: 0, hops: 0, count: 1, ..header(RingKind::Nack) };
        assert_eq!(l.check(&nack), Ok(()));
    }

    #[test]
    fn hop_arithmetic_saturates_at_int32() {
        assert_eq!(origin_value(Op::Sum, 3, 5), (15, false));
        assert_eq!(origin_value(Op::Sum, 2, i32::MAX), (i32::MAX, true));
        assert_eq!(origin_value(Op::Avg, -2, i32::MIN), (i32::MAX, true));
        assert_eq!(origin_value(Op::Count, 7, -4), (1, false));
        assert_eq!(origin_value(Op::Count, 7, 0), (0, false));
        assert_eq!(origin_value(Op::Max, 2, -3), (-3, false));
        assert_eq!(combine(Op::Sum, 1, i32::MAX - 1, 1), (i32::MAX, false));
        assert_eq!(combine(Op::Sum, 1, i32::MAX, 1), (i32::MAX, true));
        assert_eq!(combine(Op::Sum, 2, i32::MIN + 3, -2), (i32::MIN, true));
        assert_eq!(combine(Op::Count, 5, 2, 9), (3, false));
        assert_eq!(combine(Op::Max, 1, 4, 9), (9, false));
        assert_eq!(combine(Op::Max, 3, 4, 1 << 30), (1 << 30, false));
        assert_eq!(combine(Op::Min, 3, 4, -(1 << 30)), (-(1 << 30), false));
        assert_eq!(combine(Op::Min, 1, 4, 9), (4, false));
        assert_eq!(origin_value(Op::Land, 5, -3), (1, false));
        assert_eq!(origin_value(Op::Lor, 5, 0), (0, false));
        assert_eq!(combine(Op::Land, 1, 1, 0), (0, false));
        assert_eq!(combine(Op::Land, 1, 1, i32::MIN), (1, false));
        assert_eq!(combine(Op::Lor, 1, 0, 0), (0, false));
        assert_eq!(combine(Op::Lor, 1, 0, 7), (1, false));
        assert_eq!(complete(Op::Avg, 4, -7), -1);
        assert_eq!(complete(Op::Avg, 4, 7), 1);
        assert_eq!(complete(Op::Sum, 4, 7), 7);
        // A saturated partial of a sum that comes back in range stays clamped.
        let (r, s) = ring_reference(Op::Sum, &[&[i32::MAX], &[1], &[-5]], &[1, 1, 1]);
        assert!(s);
        assert_eq!(r, vec![i32::MAX - 5]);
    }

    #[test]
    fn slice_versions_match_the_scalar_ones() {
        let input = [1, -2, i32::MAX, 0];
        let mut wire = vec![0u8; 16];
        assert!(origin_be(Op::Sum, 2, input, &mut wire));
        assert_eq!(elements_be(&wire).collect::<Vec<_>>(), vec![2, -4, i32::MAX, 0]);
        assert!(!combine_be(Op::Sum, 1, &mut wire, [1, 1, -1, 5]));
        assert_eq!(elements_be(&wire).collect::<Vec<_>>(), vec![3, -3, i32::MAX - 1, 5]);
        complete_be(Op::Avg, 2, &mut wire);
        assert_eq!(elements_be(&wire).collect::<Vec<_>>(), vec![1, -1, (i32::MAX - 1) / 2, 2]);
    }

    /// Whenever no hop saturates, the ring's result is the star's, for every
    /// ring op, member count and weights.
    #[test]
    fn ring_equals_star_without_saturation() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut unsaturated = 0;
        for trial in 0..3000 {
            let op = [Op::Sum, Op::Count, Op::Max, Op::Min, Op::Avg][trial % 5];
            let n = 2 + rng.below(15) as usize;
            let len = 1 + rng.below(8) as usize;
            // Small ranges mostly, full range sometimes (those may saturate).
            let span = if rng.below(4) == 0 { i32::MAX } else { 1 << (4 + rng.below(24)) };
            let unit = rng.below(2) == 0;
            let weights: Vec<i32> =
                (0..n).map(|_| if unit { 1 } else { i32_in(&mut rng, -3, 9) }).collect();
            let mut weights = weights;
            if weights.iter().map(|&w| i64::from(w)).sum::<i64>() <= 0 {
                weights[0] = 20;
            }
            let inputs: Vec<Vec<i32>> = (0..n).map(|_| (0..len).map(|_| i32_in(&mut rng, -span, span)).collect()).collect();
            let refs: Vec<&[i32]> = inputs.iter().map(Vec::as_slice).collect();
            let (ring, saturated) = ring_reference(op, &refs, &weights);
            if saturated {
                continue;
            }
            unsaturated += 1;
            let contributions: Vec<(&[i32], i32)> = refs.iter().copied().zip(weights.iter().copied()).collect();
            let star = reducer::reduce(op, &contributions).expect("star");
            assert!(!star.overflow, "{op:?} {inputs:?} {weights:?}: the ring did not saturate, the star clamped");
            assert_eq!(ring, star.ints().expect("ints"), "{op:?} n={n} weights {weights:?} inputs {inputs:?}");
        }
        assert!(unsaturated > 2000, "only {unsaturated} unsaturated trials");
    }

    /// The fragment-order property: whichever member a fragment starts at,
    /// the result is the same (each member adds once, in ring order).
    #[test]
    fn any_origin_gives_the_same_result() {
        let mut rng = Rng(12345);
        for op in [Op::Sum, Op::Count, Op::Max, Op::Min, Op::Avg] {
            let n = 5;
            let weights: Vec<i32> = (0..n).map(|_| i32_in(&mut rng, 1, 4)).collect();
            let inputs: Vec<i32> = (0..n).map(|_| i32_in(&mut rng, -1000, 1000)).collect();
            let ws: i64 = weights.iter().map(|&w| i64::from(w)).sum();
            let results: Vec<i32> = (0..n)
                .map(|o| {
                    let (mut p, _) = origin_value(op, weights[o], inputs[o]);
                    for h in 1..n {
                        p = combine(op, weights[(o + h) % n], p, inputs[(o + h) % n]).0;
                    }
                    complete(op, ws as u32, p)
                })
                .collect();
            assert!(results.windows(2).all(|w| w[0] == w[1]), "{op:?}: {results:?}");
        }
    }
}
