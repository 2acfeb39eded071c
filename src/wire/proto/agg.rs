//! `AGG1`: contributions and RESULTs (PROTOCOL.md "AGG1"), its header,
//! payload checks and the elements one datagram carries.

use super::*;

/// Host-order view of a validated `AGG1` header (no payload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggHeader {
    /// Collective job id.
    pub job: u16,
    /// Sender's rank, [`abi::RESULT_RANK`] on results.
    pub rank: u16,
    /// Sender's datagram sequence number.
    pub seq: u32,
    /// Reduction generation.
    pub round: Round,
    /// Element index of `payload[0]` in the reduced vector.
    pub frag_off: u32,
    /// Operation.
    pub op: Op,
    /// `abi::AGG_F_*` bits.
    pub flags: u8,
    /// Payload elements.
    pub count: u16,
}

impl AggHeader {
    /// FLOAT32 set: payload elements are IEEE-754 float32.
    pub fn is_float(&self) -> bool {
        self.flags & abi::AGG_F_FLOAT32 != 0
    }

    /// RESULT set: this is an aggregator's result, not a contribution.
    pub fn is_result(&self) -> bool {
        self.flags & abi::AGG_F_RESULT != 0
    }

    /// LAST_FRAGMENT set.
    pub fn is_last_fragment(&self) -> bool {
        self.flags & abi::AGG_F_LAST_FRAGMENT != 0
    }

    /// OVERFLOW set: some result element was clamped.
    pub fn has_overflow(&self) -> bool {
        self.flags & abi::AGG_F_OVERFLOW != 0
    }

    /// Payload length in bytes (4 * count).
    pub fn payload_len(&self) -> usize {
        4 * self.count as usize
    }

    /// Whole datagram length in bytes (24 + 4 * count).
    pub fn datagram_len(&self) -> usize {
        abi::AGG_HDR_LEN + self.payload_len()
    }

    /// Checks what a sender controls: count >= 1, no reserved flag, no
    /// bitwise op on floats.
    pub fn validate(&self) -> Result<(), EncodeError> {
        if self.flags & !abi::AGG_F_KNOWN != 0 {
            return Err(EncodeError::ReservedFlag {
                kind: MessageKind::Agg,
                flags: self.flags,
            });
        }
        if self.count == 0 {
            return Err(EncodeError::PayloadLength(0));
        }
        if self.is_float() && !self.op.valid_on_floats() {
            return Err(EncodeError::FloatBitwise(self.op));
        }
        Ok(())
    }
}

/// IPv4 (20) + UDP (8) header bytes in front of every AggBox datagram.
pub const IP_UDP_HDR: usize = 28;

/// Elements per `AGG1` datagram at interface MTU `mtu`: `(mtu - 20 - 8 - 24) / 4`
/// (IPv4, UDP and `AGG1` headers; 362 at MTU 1500, 2237 at 9000, 16370 at
/// 65535), capped at 65535 (the `count` field), at least 1. The one rule for
/// every sender's fragment size (the runtime caps it further at the kernel's
/// per-frame limit: [`elements_per_fragment`]).
pub fn elements_per_datagram(mtu: usize) -> usize {
    (mtu.saturating_sub(IP_UDP_HDR + abi::AGG_HDR_LEN) / 4).clamp(1, u16::MAX as usize)
}

/// Elements per fragment at `mtu`: [`elements_per_datagram`] (the wire rule) capped at the
/// kernel aggregator's per-frame limit (`abi::MAX_ELEMS`, 16384), so every
/// fragment the runtime sends can be reduced by the XDP program.
pub fn elements_per_fragment(mtu: usize) -> usize {
    elements_per_datagram(mtu).min(crate::wire::abi::MAX_ELEMS as usize)
}

/// IPv6 (40) + UDP (8) header bytes in front of an AggBox datagram over
/// IPv6: 20 more than over IPv4, so a datagram at the same MTU carries 5
/// elements fewer (357 at MTU 1500).
pub const IP6_UDP_HDR: usize = 48;

/// Most elements of one `AGG1` datagram over IPv6: the UDP length (at most
/// the IPv6 payload length, 16 bits, without jumbograms) bounds the payload
/// to 65535 − 8 − 24 bytes, (65535 − 8 − 24) / 4 = 16375 (docs/JUMBO.md).
pub const MAX_ELEMS_IPV6: usize = 16375;

/// The IP and UDP header bytes of a datagram of the family `ipv6` says.
pub fn ip_udp_hdr(ipv6: bool) -> usize {
    if ipv6 {
        IP6_UDP_HDR
    } else {
        IP_UDP_HDR
    }
}

/// [`elements_per_fragment`] for a datagram of the family `ipv6` says:
/// over IPv6 `(mtu - 40 - 8 - 24) / 4` (357 at MTU 1500, 2232 at 9000), at
/// most [`MAX_ELEMS_IPV6`]; over IPv4 [`elements_per_fragment`] itself.
pub fn elements_per_fragment_in(mtu: usize, ipv6: bool) -> usize {
    if ipv6 {
        (mtu.saturating_sub(IP6_UDP_HDR + abi::AGG_HDR_LEN) / 4).clamp(1, MAX_ELEMS_IPV6)
    } else {
        elements_per_fragment(mtu)
    }
}

/// Accumulator blocks (`abi::CHUNK_ELEMS` = 256 elements each) one slot of
/// `per` elements holds in the kernel: `ceil(per / 256)` (2 at MTU 1500, 9 at
/// 9000, 64 at 65535).
pub fn blocks_per_fragment(per: usize) -> usize {
    per.max(1).div_ceil(crate::wire::abi::CHUNK_ELEMS as usize)
}

/// Validates a whole `AGG1` datagram (header and length) without allocating
/// and returns its header in host order.
///
/// Checks, in this order (the XDP program's order, so a datagram with several
/// faults is counted under the same reason on both paths): magic, header
/// length, reserved flags, op, count 0, count against the datagram length
/// (both directions), then FLOAT32 with a bitwise op (user space only). The
/// first failing rule is reported.
pub fn decode_agg_header(buf: &[u8]) -> Result<AggHeader, ProtoError> {
    check_kind(buf, MessageKind::Agg)?;
    let flags = buf[21];
    if flags & !abi::AGG_F_KNOWN != 0 {
        return Err(ProtoError::ReservedFlag {
            kind: MessageKind::Agg,
            flags,
        });
    }
    let op_raw = buf[20];
    let op = Op::from_u8(op_raw).ok_or(ProtoError::InvalidOp(op_raw))?;
    let count = be_u16(buf, 22);
    if count == 0 {
        return Err(ProtoError::ZeroCount);
    }
    let want = abi::AGG_HDR_LEN + 4 * count as usize;
    if want > buf.len() {
        return Err(ProtoError::CountTooLarge {
            count,
            len: buf.len(),
        });
    }
    if want < buf.len() {
        return Err(ProtoError::CountTooSmall {
            count,
            len: buf.len(),
        });
    }
    if flags & abi::AGG_F_FLOAT32 != 0 && !op.valid_on_floats() {
        return Err(ProtoError::FloatBitwise(op));
    }
    Ok(AggHeader {
        job: be_u16(buf, 4),
        rank: be_u16(buf, 6),
        seq: be_u32(buf, 8),
        round: Round(be_u32(buf, 12)),
        frag_off: be_u32(buf, 16),
        op,
        flags,
        count,
    })
}

/// [`decode_agg_header`] plus the payload bytes (big-endian, exactly
/// `4 * count` of them), still without allocating.
pub fn split_agg(buf: &[u8]) -> Result<(AggHeader, &[u8]), ProtoError> {
    let hdr = decode_agg_header(buf)?;
    Ok((hdr, &buf[abi::AGG_HDR_LEN..]))
}

/// Appends the 24 header bytes of `hdr` to `out` exactly as given: no
/// validation, so tests can also build invalid datagrams with it.
pub fn write_agg_header(hdr: &AggHeader, out: &mut Vec<u8>) {
    out.extend_from_slice(&agg_header_bytes(hdr));
}

/// Offset of the `flags` byte in an AGG1 header.
pub const AGG_FLAGS_OFF: usize = 21;

/// The 24 wire bytes of `hdr` (no validation).
pub fn agg_header_bytes(hdr: &AggHeader) -> [u8; abi::AGG_HDR_LEN] {
    let mut b = [0u8; abi::AGG_HDR_LEN];
    b[0..4].copy_from_slice(&abi::MAGIC_AGG.to_be_bytes());
    b[4..6].copy_from_slice(&hdr.job.to_be_bytes());
    b[6..8].copy_from_slice(&hdr.rank.to_be_bytes());
    b[8..12].copy_from_slice(&hdr.seq.to_be_bytes());
    b[12..16].copy_from_slice(&hdr.round.0.to_be_bytes());
    b[16..20].copy_from_slice(&hdr.frag_off.to_be_bytes());
    b[20] = hdr.op as u8;
    b[AGG_FLAGS_OFF] = hdr.flags;
    b[22..24].copy_from_slice(&hdr.count.to_be_bytes());
    b
}

fn check_payload(hdr: &AggHeader, len: usize, float: bool) -> Result<(), EncodeError> {
    if len == 0 || len > u16::MAX as usize {
        return Err(EncodeError::PayloadLength(len));
    }
    if hdr.count as usize != len {
        return Err(EncodeError::CountMismatch {
            count: hdr.count,
            len,
        });
    }
    if hdr.is_float() != float {
        return Err(EncodeError::FloatFlagMismatch);
    }
    hdr.validate()
}

/// Appends a complete int32 `AGG1` datagram to `out` (clear `out` first to
/// reuse its allocation for one datagram per buffer). `hdr.count` must equal
/// `payload.len()` and FLOAT32 must be clear.
pub fn encode_agg_into(
    hdr: &AggHeader,
    payload: &[i32],
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    check_payload(hdr, payload.len(), false)?;
    out.reserve(hdr.datagram_len());
    write_agg_header(hdr, out);
    write_i32_be(payload, out);
    Ok(())
}

/// Appends a complete float32 `AGG1` datagram to `out`; FLOAT32 must be set.
pub fn encode_agg_f32_into(
    hdr: &AggHeader,
    payload: &[f32],
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    check_payload(hdr, payload.len(), true)?;
    out.reserve(hdr.datagram_len());
    write_agg_header(hdr, out);
    write_f32_be(payload, out);
    Ok(())
}

/// Payload of an owned `AGG1` message.
#[derive(Debug, Clone, PartialEq)]
pub enum AggPayload {
    /// int32 elements (FLOAT32 clear).
    Int(Vec<i32>),
    /// float32 elements (FLOAT32 set).
    Float(Vec<f32>),
}

impl AggPayload {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            AggPayload::Int(v) => v.len(),
            AggPayload::Float(v) => v.len(),
        }
    }

    /// No elements (never valid on the wire).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An owned `AGG1` message with host-order fields.
#[derive(Debug, Clone, PartialEq)]
pub struct AggMessage {
    /// Collective job id.
    pub job: u16,
    /// Sender's rank, [`abi::RESULT_RANK`] on results.
    pub rank: u16,
    /// Sender's datagram sequence number.
    pub seq: u32,
    /// Reduction generation.
    pub round: Round,
    /// Element index of `payload[0]`.
    pub frag_off: u32,
    /// Operation.
    pub op: Op,
    /// `abi::AGG_F_*` bits; FLOAT32 must match the payload variant.
    pub flags: u8,
    /// The elements.
    pub payload: AggPayload,
}

impl AggMessage {
    /// Header of this message (count from the payload, saturated at 65535 so
    /// an oversized payload is caught by encode, not silently truncated).
    pub fn header(&self) -> AggHeader {
        AggHeader {
            job: self.job,
            rank: self.rank,
            seq: self.seq,
            round: self.round,
            frag_off: self.frag_off,
            op: self.op,
            flags: self.flags,
            count: u16::try_from(self.payload.len()).unwrap_or(u16::MAX),
        }
    }

    /// Validates and decodes a whole `AGG1` datagram.
    pub fn decode(buf: &[u8]) -> Result<AggMessage, ProtoError> {
        let (h, be) = split_agg(buf)?;
        let payload = if h.is_float() {
            let mut v = vec![0f32; h.count as usize];
            read_f32_be(be, &mut v);
            AggPayload::Float(v)
        } else {
            let mut v = vec![0i32; h.count as usize];
            read_i32_be(be, &mut v);
            AggPayload::Int(v)
        };
        Ok(AggMessage {
            job: h.job,
            rank: h.rank,
            seq: h.seq,
            round: h.round,
            frag_off: h.frag_off,
            op: h.op,
            flags: h.flags,
            payload,
        })
    }

    /// Appends the datagram to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let h = self.header();
        match &self.payload {
            AggPayload::Int(v) => encode_agg_into(&h, v, out),
            AggPayload::Float(v) => encode_agg_f32_into(&h, v, out),
        }
    }

    /// The datagram in a new buffer.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        self.encode_into(&mut out)?;
        Ok(out)
    }
}
