//! Encode, decode and validate the three AggBox v1 messages (`AGG1`, `AGB1`,
//! `AGK1`) exactly as `PROTOCOL.md` specifies them.
//!
//! Two layers:
//!
//! - Hot path, no allocation: [`decode_agg_header`] / [`split_agg`] validate a
//!   whole `AGG1` datagram and hand back a host-order [`AggHeader`] plus the
//!   big-endian payload bytes; [`write_agg_header`] / [`encode_agg_into`] append
//!   to a caller-owned buffer so senders can reuse one `Vec<u8>`.
//! - Owned messages: [`AggMessage`], [`BcastMessage`], [`AckMessage`] and the
//!   [`Message`] enum with [`decode`], for control code and tests.
//!
//! Every decode error is a [`ProtoError`] variant; for `AGG1` the variants map
//! one to one onto the kernel's [`abi::DropReason`] through
//! [`ProtoError::drop_reason`], so user-space and kernel counters agree.
//!
//! Sequence numbers are `u32` and wrap: every offset computation in this module
//! (`seq - base_seq`) uses wrapping arithmetic, so a [`SeqBitmap`] window that
//! starts at `0xffff_ff00` and covers 512 numbers holds `0xffff_ff00..=u32::MAX`
//! and then `0..=0xff`. The protocol never reuses a seq for new data within a
//! job session, so a wrap is only ever seen by very long sessions.

use crate::wire::abi::{self, Op, Round};

/// Which of the three AggBox messages a datagram carries (from its magic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// `AGG1`: aggregation contribution or result.
    Agg,
    /// `AGB1`: broadcast data.
    Bcast,
    /// `AGK1`: acknowledgement.
    Ack,
}

impl MessageKind {
    /// The magic value that starts datagrams of this kind.
    pub fn magic(self) -> u32 {
        match self {
            MessageKind::Agg => abi::MAGIC_AGG,
            MessageKind::Bcast => abi::MAGIC_BCAST,
            MessageKind::Ack => abi::MAGIC_ACK,
        }
    }

    /// The kind a magic value announces, `None` for non-AggBox traffic.
    pub fn from_magic(magic: u32) -> Option<MessageKind> {
        match magic {
            abi::MAGIC_AGG => Some(MessageKind::Agg),
            abi::MAGIC_BCAST => Some(MessageKind::Bcast),
            abi::MAGIC_ACK => Some(MessageKind::Ack),
            _ => None,
        }
    }

    /// Fixed header length of this kind in bytes.
    pub fn header_len(self) -> usize {
        match self {
            MessageKind::Agg => abi::AGG_HDR_LEN,
            MessageKind::Bcast => abi::BCAST_HDR_LEN,
            MessageKind::Ack => abi::ACK_HDR_LEN,
        }
    }

    /// Flag bits this kind defines; any other bit set makes a datagram invalid.
    pub fn known_flags(self) -> u8 {
        match self {
            MessageKind::Agg => abi::AGG_F_KNOWN,
            MessageKind::Bcast => abi::BCAST_F_KNOWN,
            MessageKind::Ack => abi::ACK_F_KNOWN,
        }
    }

    /// The four ASCII characters of the magic, for messages and logs.
    pub fn name(self) -> &'static str {
        match self {
            MessageKind::Agg => "AGG1",
            MessageKind::Bcast => "AGB1",
            MessageKind::Ack => "AGK1",
        }
    }
}

impl std::fmt::Display for MessageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a datagram failed to decode. Every rule of `PROTOCOL.md` that can be
/// checked on the datagram alone has its own variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// Shorter than 4 bytes or an unknown magic: not AggBox traffic, must reach
    /// the normal stack untouched (so no drop reason).
    #[error("not AggBox traffic (no known magic)")]
    NotAggbox,
    /// An AggBox datagram of another kind than the decoder was asked for.
    #[error("expected an {expected} datagram, got {found}")]
    WrongKind {
        /// Kind the caller asked to decode.
        expected: MessageKind,
        /// Kind the magic announces.
        found: MessageKind,
    },
    /// Magic present but the datagram is shorter than the fixed header.
    #[error("{kind} datagram of {len} bytes is shorter than its header")]
    TruncatedHeader {
        /// Message kind from the magic.
        kind: MessageKind,
        /// Datagram length in bytes.
        len: usize,
    },
    /// `AGG1` op above 8.
    #[error("invalid op {0}")]
    InvalidOp(u8),
    /// A flag bit the message kind does not define is set.
    #[error("{kind} reserved flag bit set (flags {flags:#04x})")]
    ReservedFlag {
        /// Message kind from the magic.
        kind: MessageKind,
        /// The whole flags byte.
        flags: u8,
    },
    /// `AGG1` count of 0.
    #[error("zero count")]
    ZeroCount,
    /// `AGG1` count needs more bytes than the datagram has.
    #[error("count {count} larger than datagram of {len} bytes")]
    CountTooLarge {
        /// Header count.
        count: u16,
        /// Datagram length in bytes.
        len: usize,
    },
    /// `AGG1` datagram longer than 24 + 4 * count.
    #[error("count {count} smaller than datagram of {len} bytes")]
    CountTooSmall {
        /// Header count.
        count: u16,
        /// Datagram length in bytes.
        len: usize,
    },
    /// `AGG1` with FLOAT32 and BAND/BOR/BXOR: bitwise ops are undefined on floats.
    #[error("op {} is invalid on FLOAT32 payloads", .0.name())]
    FloatBitwise(Op),
    /// `AGK1` nbits outside 1..=1024.
    #[error("ack nbits {0} outside 1..=1024")]
    InvalidNbits(u16),
    /// `AGK1` kind other than 0 (aggregation) or 1 (broadcast).
    #[error("ack kind {0} unknown")]
    InvalidAckKind(u8),
    /// `AGK1` bitmap not exactly ceil(nbits / 8) bytes.
    #[error("ack bitmap of {found} bytes, nbits {nbits} needs exactly {expected}")]
    BitmapLength {
        /// Header nbits.
        nbits: u16,
        /// ceil(nbits / 8).
        expected: usize,
        /// Bytes after the header.
        found: usize,
    },
    /// `AGK1` bitmap has a bit set at or beyond nbits in its last byte.
    #[error("ack bitmap has bits set beyond nbits {0}")]
    BitsBeyondNbits(u16),
}

impl ProtoError {
    /// The kernel drop reason this error is counted under, when it has one.
    ///
    /// Only `AGG1` errors have one (the XDP program passes `AGB1`/`AGK1` and
    /// non-AggBox traffic on). FLOAT32 with a bitwise op is counted as
    /// [`abi::DropReason::InvalidOp`]: the op is invalid for that payload.
    pub fn drop_reason(&self) -> Option<abi::DropReason> {
        use abi::DropReason as D;
        match *self {
            ProtoError::TruncatedHeader {
                kind: MessageKind::Agg,
                ..
            } => Some(D::TruncatedHeader),
            ProtoError::InvalidOp(_) | ProtoError::FloatBitwise(_) => Some(D::InvalidOp),
            ProtoError::ReservedFlag {
                kind: MessageKind::Agg,
                ..
            } => Some(D::ReservedFlag),
            ProtoError::ZeroCount => Some(D::ZeroCount),
            ProtoError::CountTooLarge { .. } => Some(D::CountTooLarge),
            ProtoError::CountTooSmall { .. } => Some(D::CountTooSmall),
            _ => None,
        }
    }
}

/// Why a message could not be encoded (the caller built something the
/// protocol cannot carry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// `AGG1` payload must hold 1..=65535 elements.
    #[error("payload of {0} elements outside 1..=65535")]
    PayloadLength(usize),
    /// Header count differs from the payload length.
    #[error("header count {count} but payload has {len} elements")]
    CountMismatch {
        /// Header count.
        count: u16,
        /// Payload elements.
        len: usize,
    },
    /// A flag bit the message kind does not define is set.
    #[error("{kind} reserved flag bit set (flags {flags:#04x})")]
    ReservedFlag {
        /// Message kind.
        kind: MessageKind,
        /// The whole flags byte.
        flags: u8,
    },
    /// FLOAT32 flag does not match the payload type (int vs float).
    #[error("FLOAT32 flag does not match the payload type")]
    FloatFlagMismatch,
    /// FLOAT32 payload with BAND/BOR/BXOR.
    #[error("op {} is invalid on FLOAT32 payloads", .0.name())]
    FloatBitwise(Op),
}

// ---------------------------------------------------------------------------
// Byte helpers
// ---------------------------------------------------------------------------

// Callers guarantee `b.len() >= at + N` (all uses are behind a length check),
// the fixed-size copy lets the compiler drop the per-byte bounds checks.
#[inline(always)]
fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

#[inline(always)]
fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The kind of an AggBox datagram from its first four bytes, `None` for
/// anything else (which must go to the normal stack untouched).
pub fn classify(buf: &[u8]) -> Option<MessageKind> {
    if buf.len() < 4 {
        return None;
    }
    MessageKind::from_magic(be_u32(buf, 0))
}

/// Checks the magic against `expected` and the length against its header.
fn check_kind(buf: &[u8], expected: MessageKind) -> Result<(), ProtoError> {
    let found = classify(buf).ok_or(ProtoError::NotAggbox)?;
    if found != expected {
        return Err(ProtoError::WrongKind { expected, found });
    }
    if buf.len() < expected.header_len() {
        return Err(ProtoError::TruncatedHeader {
            kind: expected,
            len: buf.len(),
        });
    }
    Ok(())
}

/// Decodes big-endian int32 elements into `out` (`out.len()` elements are
/// written; `be` must hold at least `4 * out.len()` bytes, extra is ignored).
#[inline]
pub fn read_i32_be(be: &[u8], out: &mut [i32]) {
    for (o, c) in out.iter_mut().zip(be.chunks_exact(4)) {
        *o = i32::from_be_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Decodes big-endian float32 elements into `out` (as [`read_i32_be`]).
#[inline]
pub fn read_f32_be(be: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(be.chunks_exact(4)) {
        *o = f32::from_bits(u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
    }
}

/// Appends `values` as big-endian int32 to `out`.
#[inline]
pub fn write_i32_be(values: &[i32], out: &mut Vec<u8>) {
    // Written straight into the spare capacity (no zeroing pass first).
    let n = 4 * values.len();
    out.reserve(n);
    let spare = &mut out.spare_capacity_mut()[..n];
    for (c, v) in spare.chunks_exact_mut(4).zip(values) {
        let b = v.to_be_bytes();
        c[0].write(b[0]);
        c[1].write(b[1]);
        c[2].write(b[2]);
        c[3].write(b[3]);
    }
    // SAFETY: the n bytes after len were all written above.
    unsafe { out.set_len(out.len() + n) };
}

/// Appends `values` as big-endian float32 to `out`.
#[inline]
pub fn write_f32_be(values: &[f32], out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + 4 * values.len(), 0);
    for (c, v) in out[start..].chunks_exact_mut(4).zip(values) {
        c.copy_from_slice(&v.to_bits().to_be_bytes());
    }
}

// ---------------------------------------------------------------------------
// AGG1
// ---------------------------------------------------------------------------

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
        if self.is_float() && is_bitwise(self.op) {
            return Err(EncodeError::FloatBitwise(self.op));
        }
        Ok(())
    }
}

/// BAND, BOR, BXOR: the ops that are invalid on FLOAT32 payloads.
pub fn is_bitwise(op: Op) -> bool {
    matches!(op, Op::Band | Op::Bor | Op::Bxor)
}

/// IPv4 (20) + UDP (8) header bytes in front of every AggBox datagram.
pub const IP_UDP_HDR: usize = 28;

/// Elements per `AGG1` datagram at interface MTU `mtu`: `(mtu - 20 - 8 - 24) / 4`
/// (IPv4, UDP and `AGG1` headers; 362 at MTU 1500, 2237 at 9000, 16370 at
/// 65535), capped at 65535 (the `count` field), at least 1. The one rule for
/// every sender's fragment size (the runtime caps it further at the kernel's
/// per-frame limit: `runtime::fragment::elements_per_fragment`).
pub fn elements_per_datagram(mtu: usize) -> usize {
    (mtu.saturating_sub(IP_UDP_HDR + abi::AGG_HDR_LEN) / 4).clamp(1, u16::MAX as usize)
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
    if flags & abi::AGG_F_FLOAT32 != 0 && is_bitwise(op) {
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

// ---------------------------------------------------------------------------
// AGB1
// ---------------------------------------------------------------------------

/// Host-order view of a validated `AGB1` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BcastHeader {
    /// Bit i set = deliver to destination i of the group's table.
    pub mask: u32,
    /// Root's sequence number for this group.
    pub seq: u32,
    /// Broadcast group id.
    pub group: u16,
    /// `abi::BCAST_F_*` bits.
    pub flags: u8,
    /// Hops travelled from the root.
    pub hops: u8,
}

impl BcastHeader {
    /// FORWARD set: a receiver with children re-broadcasts.
    pub fn is_forward(&self) -> bool {
        self.flags & abi::BCAST_F_FORWARD != 0
    }
}

/// Validates an `AGB1` datagram and returns its header and opaque payload.
pub fn split_bcast(buf: &[u8]) -> Result<(BcastHeader, &[u8]), ProtoError> {
    check_kind(buf, MessageKind::Bcast)?;
    let flags = buf[14];
    if flags & !abi::BCAST_F_KNOWN != 0 {
        return Err(ProtoError::ReservedFlag {
            kind: MessageKind::Bcast,
            flags,
        });
    }
    let hdr = BcastHeader {
        mask: be_u32(buf, 4),
        seq: be_u32(buf, 8),
        group: be_u16(buf, 12),
        flags,
        hops: buf[15],
    };
    Ok((hdr, &buf[abi::BCAST_HDR_LEN..]))
}

/// The 16 wire bytes of `hdr` (no validation).
pub fn bcast_header_bytes(hdr: &BcastHeader) -> [u8; abi::BCAST_HDR_LEN] {
    let mut b = [0u8; abi::BCAST_HDR_LEN];
    b[0..4].copy_from_slice(&abi::MAGIC_BCAST.to_be_bytes());
    b[4..8].copy_from_slice(&hdr.mask.to_be_bytes());
    b[8..12].copy_from_slice(&hdr.seq.to_be_bytes());
    b[12..14].copy_from_slice(&hdr.group.to_be_bytes());
    b[14] = hdr.flags;
    b[15] = hdr.hops;
    b
}

/// Appends a complete `AGB1` datagram (header + opaque payload) to `out`.
pub fn encode_bcast_into(
    hdr: &BcastHeader,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    if hdr.flags & !abi::BCAST_F_KNOWN != 0 {
        return Err(EncodeError::ReservedFlag {
            kind: MessageKind::Bcast,
            flags: hdr.flags,
        });
    }
    out.reserve(abi::BCAST_HDR_LEN + payload.len());
    out.extend_from_slice(&bcast_header_bytes(hdr));
    out.extend_from_slice(payload);
    Ok(())
}

/// An owned `AGB1` message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BcastMessage {
    /// Header fields.
    pub header: BcastHeader,
    /// Opaque payload (may be empty).
    pub payload: Vec<u8>,
}

impl BcastMessage {
    /// Validates and decodes an `AGB1` datagram.
    pub fn decode(buf: &[u8]) -> Result<BcastMessage, ProtoError> {
        let (header, payload) = split_bcast(buf)?;
        Ok(BcastMessage {
            header,
            payload: payload.to_vec(),
        })
    }

    /// Appends the datagram to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        encode_bcast_into(&self.header, &self.payload, out)
    }

    /// The datagram in a new buffer.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        self.encode_into(&mut out)?;
        Ok(out)
    }
}

// ---------------------------------------------------------------------------
// AGK1 and sequence bitmaps
// ---------------------------------------------------------------------------

/// Default ACK group size G of group mode.
pub const DEFAULT_GROUP_SIZE: u32 = 1024;

const BITMAP_WORDS: usize = abi::ACK_MAX_BITS as usize / 64;

/// How AGK1 acknowledges (PROTOCOL.md, "Acknowledgement AGK1"): one ACK per
/// datagram, or one per group of sequence numbers (`[node] ack_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AckMode {
    /// `"group"`: one AGK1 per `ack_group` sequence numbers (the default,
    /// far fewer ACKs).
    #[default]
    Group,
    /// `"packet"`: one AGK1 with `nbits = 1` per datagram.
    Packet,
}

impl AckMode {
    /// The spelling used in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            AckMode::Group => "group",
            AckMode::Packet => "packet",
        }
    }
}

impl std::fmt::Display for AckMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Group mode: the group `k = seq / G` and its first sequence number `k * G`.
///
/// `group_size` 0 is treated as 1 rather than panicking. When G does not
/// divide 2^32 the last group (ending at `u32::MAX`) is shorter than G; use
/// [`group_len`] for its real length.
pub fn group_of(seq: u32, group_size: u32) -> (u32, u32) {
    let g = group_size.max(1);
    let k = seq / g;
    (k, k * g)
}

/// Number of sequence numbers in group `k` of size G: G, except for a last
/// group cut short by the end of the u32 space.
pub fn group_len(k: u32, group_size: u32) -> u32 {
    let g = group_size.max(1) as u64;
    let base = k as u64 * g;
    let end = (base + g).min(1u64 << 32);
    end.saturating_sub(base) as u32
}

/// A window of sequence numbers `[base_seq, base_seq + nbits)` (offsets wrap
/// modulo 2^32) with one received-bit each: the content of an `AGK1` bitmap.
/// Fixed 1024-bit storage, so building and copying one never allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqBitmap {
    base_seq: u32,
    nbits: u16,
    words: [u64; BITMAP_WORDS],
}

impl SeqBitmap {
    /// An empty window; nbits must be 1..=1024.
    pub fn new(base_seq: u32, nbits: u16) -> Result<SeqBitmap, ProtoError> {
        if nbits == 0 || nbits > abi::ACK_MAX_BITS {
            return Err(ProtoError::InvalidNbits(nbits));
        }
        Ok(SeqBitmap {
            base_seq,
            nbits,
            words: [0; BITMAP_WORDS],
        })
    }

    /// The empty window of group `k` (see [`group_of`]); group_size is
    /// clamped to 1..=1024, the most one ACK can cover.
    pub fn for_group(k: u32, group_size: u32) -> SeqBitmap {
        let g = group_size.clamp(1, abi::ACK_MAX_BITS as u32);
        let nbits = group_len(k, g) as u16;
        SeqBitmap {
            base_seq: k.wrapping_mul(g),
            nbits: nbits.max(1),
            words: [0; BITMAP_WORDS],
        }
    }

    /// First sequence number covered.
    pub fn base_seq(&self) -> u32 {
        self.base_seq
    }

    /// Number of sequence numbers covered.
    pub fn nbits(&self) -> u16 {
        self.nbits
    }

    /// Offset of `seq` in the window (wrapping), `None` outside it.
    pub fn offset_of(&self, seq: u32) -> Option<u16> {
        let off = seq.wrapping_sub(self.base_seq);
        if off < self.nbits as u32 {
            Some(off as u16)
        } else {
            None
        }
    }

    /// `seq` is inside the window.
    pub fn covers(&self, seq: u32) -> bool {
        self.offset_of(seq).is_some()
    }

    /// Marks `seq` received; false (and no change) when outside the window.
    pub fn set(&mut self, seq: u32) -> bool {
        match self.offset_of(seq) {
            Some(j) => {
                self.words[j as usize / 64] |= 1u64 << (j % 64);
                true
            }
            None => false,
        }
    }

    /// `seq` was received (false outside the window).
    pub fn get(&self, seq: u32) -> bool {
        match self.offset_of(seq) {
            Some(j) => self.words[j as usize / 64] >> (j % 64) & 1 != 0,
            None => false,
        }
    }

    /// Number of received sequence numbers.
    pub fn count_received(&self) -> u32 {
        self.words.iter().map(|w| w.count_ones()).sum()
    }

    /// Every sequence number of the window was received.
    pub fn is_complete(&self) -> bool {
        self.count_received() == self.nbits as u32
    }

    /// Sequence numbers of the window not received, in window order.
    pub fn missing(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.nbits)
            .filter(move |&j| self.words[j as usize / 64] >> (j % 64) & 1 == 0)
            .map(move |j| self.base_seq.wrapping_add(j as u32))
    }

    /// Sequence numbers of the window received, in window order.
    pub fn received(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.nbits)
            .filter(move |&j| self.words[j as usize / 64] >> (j % 64) & 1 != 0)
            .map(move |j| self.base_seq.wrapping_add(j as u32))
    }

    /// Adds every bit of `other` that falls inside this window.
    pub fn merge(&mut self, other: &SeqBitmap) {
        for seq in other.received() {
            self.set(seq);
        }
    }

    /// Length of the wire bitmap: ceil(nbits / 8).
    pub fn byte_len(&self) -> usize {
        (self.nbits as usize).div_ceil(8)
    }

    /// Appends the wire bitmap (bit j = byte j/8, bit j%8, LSB first).
    pub fn write_bytes(&self, out: &mut Vec<u8>) {
        let n = self.byte_len();
        out.extend(self.words.iter().flat_map(|w| w.to_le_bytes()).take(n));
    }

    /// Parses a wire bitmap: exactly ceil(nbits / 8) bytes, no bit set at or
    /// beyond nbits.
    pub fn from_bytes(base_seq: u32, nbits: u16, bytes: &[u8]) -> Result<SeqBitmap, ProtoError> {
        let mut bm = SeqBitmap::new(base_seq, nbits)?;
        let expected = bm.byte_len();
        if bytes.len() != expected {
            return Err(ProtoError::BitmapLength {
                nbits,
                expected,
                found: bytes.len(),
            });
        }
        let tail_bits = nbits % 8;
        if tail_bits != 0 && bytes[expected - 1] >> tail_bits != 0 {
            return Err(ProtoError::BitsBeyondNbits(nbits));
        }
        // Little-endian words reproduce the LSB-first bit order of the wire.
        for (w, chunk) in bm.words.iter_mut().zip(bytes.chunks(8)) {
            let mut le = [0u8; 8];
            le[..chunk.len()].copy_from_slice(chunk);
            *w = u64::from_le_bytes(le);
        }
        Ok(bm)
    }
}

/// `AGK1` kind: what the acknowledged datagrams were.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckKind {
    /// Acknowledges `AGG1` contributions (id = job, rank = sender's rank).
    Aggregation,
    /// Acknowledges `AGB1` data (id = group, rank = receiver's index).
    Broadcast,
}

impl AckKind {
    /// Wire value.
    pub fn as_u8(self) -> u8 {
        match self {
            AckKind::Aggregation => abi::ACK_KIND_AGG,
            AckKind::Broadcast => abi::ACK_KIND_BCAST,
        }
    }

    /// From the wire value, `None` if unknown.
    pub fn from_u8(v: u8) -> Option<AckKind> {
        match v {
            abi::ACK_KIND_AGG => Some(AckKind::Aggregation),
            abi::ACK_KIND_BCAST => Some(AckKind::Broadcast),
            _ => None,
        }
    }
}

/// An owned `AGK1` message (fixed size, no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckMessage {
    /// Job (aggregation) or group (broadcast) id.
    pub id: u16,
    /// Acknowledged sender's rank / receiver's index.
    pub rank: u16,
    /// Aggregation or broadcast.
    pub kind: AckKind,
    /// `abi::ACK_F_*` bits.
    pub flags: u8,
    /// base_seq, nbits and the received bits.
    pub bitmap: SeqBitmap,
}

impl AckMessage {
    /// FINAL set: the receiver gave up waiting for the missing ones.
    pub fn is_final(&self) -> bool {
        self.flags & abi::ACK_F_FINAL != 0
    }

    /// Validates and decodes an `AGK1` datagram.
    pub fn decode(buf: &[u8]) -> Result<AckMessage, ProtoError> {
        check_kind(buf, MessageKind::Ack)?;
        let nbits = be_u16(buf, 12);
        if nbits == 0 || nbits > abi::ACK_MAX_BITS {
            return Err(ProtoError::InvalidNbits(nbits));
        }
        let kind = AckKind::from_u8(buf[14]).ok_or(ProtoError::InvalidAckKind(buf[14]))?;
        let flags = buf[15];
        if flags & !abi::ACK_F_KNOWN != 0 {
            return Err(ProtoError::ReservedFlag {
                kind: MessageKind::Ack,
                flags,
            });
        }
        let bitmap = SeqBitmap::from_bytes(be_u32(buf, 8), nbits, &buf[abi::ACK_HDR_LEN..])?;
        Ok(AckMessage {
            id: be_u16(buf, 4),
            rank: be_u16(buf, 6),
            kind,
            flags,
            bitmap,
        })
    }

    /// Appends the datagram (16 + ceil(nbits/8) bytes) to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        if self.flags & !abi::ACK_F_KNOWN != 0 {
            return Err(EncodeError::ReservedFlag {
                kind: MessageKind::Ack,
                flags: self.flags,
            });
        }
        out.reserve(abi::ACK_HDR_LEN + self.bitmap.byte_len());
        out.extend_from_slice(&abi::MAGIC_ACK.to_be_bytes());
        out.extend_from_slice(&self.id.to_be_bytes());
        out.extend_from_slice(&self.rank.to_be_bytes());
        out.extend_from_slice(&self.bitmap.base_seq().to_be_bytes());
        out.extend_from_slice(&self.bitmap.nbits().to_be_bytes());
        out.push(self.kind.as_u8());
        out.push(self.flags);
        self.bitmap.write_bytes(out);
        Ok(())
    }

    /// The datagram in a new buffer.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        self.encode_into(&mut out)?;
        Ok(out)
    }
}

// ---------------------------------------------------------------------------
// Any message
// ---------------------------------------------------------------------------

/// Any decoded AggBox message.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// `AGG1`.
    Agg(AggMessage),
    /// `AGB1`.
    Bcast(BcastMessage),
    /// `AGK1`.
    Ack(AckMessage),
}

/// Decodes and validates any AggBox datagram, dispatching on its magic.
pub fn decode(buf: &[u8]) -> Result<Message, ProtoError> {
    match classify(buf).ok_or(ProtoError::NotAggbox)? {
        MessageKind::Agg => AggMessage::decode(buf).map(Message::Agg),
        MessageKind::Bcast => BcastMessage::decode(buf).map(Message::Bcast),
        MessageKind::Ack => AckMessage::decode(buf).map(Message::Ack),
    }
}

impl Message {
    /// Appends the datagram to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        match self {
            Message::Agg(m) => m.encode_into(out),
            Message::Bcast(m) => m.encode_into(out),
            Message::Ack(m) => m.encode_into(out),
        }
    }

    /// Which kind this is.
    pub fn kind(&self) -> MessageKind {
        match self {
            Message::Agg(_) => MessageKind::Agg,
            Message::Bcast(_) => MessageKind::Bcast,
            Message::Ack(_) => MessageKind::Ack,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::abi::DropReason;

    fn hdr(count: u16, op: Op, flags: u8) -> AggHeader {
        AggHeader {
            job: 0x2266,
            rank: 2,
            seq: 0x3f6a_6abd,
            round: Round(0x0002_04f8),
            frag_off: 7,
            op,
            flags,
            count,
        }
    }

    fn agg_bytes(count: u16, op: Op, flags: u8, payload: &[i32]) -> Vec<u8> {
        let mut out = Vec::new();
        write_agg_header(&hdr(count, op, flags), &mut out);
        write_i32_be(payload, &mut out);
        out
    }

    #[test]
    fn agg_header_wire_layout() {
        // Header of the first datagram of vector case sum-basic, frag_off 0.
        let mut h = hdr(256, Op::Sum, abi::AGG_F_LAST_FRAGMENT);
        h.frag_off = 0;
        assert_eq!(
            agg_header_bytes(&h).to_vec(),
            [
                0x41, 0x47, 0x47, 0x31, 0x22, 0x66, 0x00, 0x02, 0x3f, 0x6a, 0x6a, 0xbd, 0x00, 0x02,
                0x04, 0xf8, 0, 0, 0, 0, 0, 1, 1, 0
            ]
        );
    }

    #[test]
    fn agg_int_round_trip() {
        let payload = [0, 1, -1, i32::MIN, i32::MAX, 0x0102_0304];
        let h = hdr(
            payload.len() as u16,
            Op::Bxor,
            abi::AGG_F_LAST_FRAGMENT | abi::AGG_F_OVERFLOW,
        );
        let mut out = vec![0xaa]; // encode appends
        encode_agg_into(&h, &payload, &mut out).unwrap();
        assert_eq!(out[0], 0xaa);
        let buf = &out[1..];
        assert_eq!(buf.len(), 24 + 4 * payload.len());
        assert_eq!(&buf[24..28], &[0, 0, 0, 0]);
        assert_eq!(&buf[40..44], &[0x7f, 0xff, 0xff, 0xff]);
        let (got, be) = split_agg(buf).unwrap();
        assert_eq!(got, h);
        assert!(
            got.is_last_fragment() && got.has_overflow() && !got.is_result() && !got.is_float()
        );
        let mut back = [0i32; 6];
        read_i32_be(be, &mut back);
        assert_eq!(back, payload);
        let msg = AggMessage::decode(buf).unwrap();
        assert_eq!(msg.payload, AggPayload::Int(payload.to_vec()));
        assert_eq!(msg.header(), h);
        assert_eq!(msg.encode().unwrap(), buf);
        assert_eq!(decode(buf).unwrap(), Message::Agg(msg));
    }

    #[test]
    fn agg_float_round_trip() {
        let payload = [1.5f32, -0.0, f32::INFINITY, 3.25e-20];
        let h = hdr(4, Op::Prod, abi::AGG_F_FLOAT32 | abi::AGG_F_RESULT);
        let mut out = Vec::new();
        encode_agg_f32_into(&h, &payload, &mut out).unwrap();
        assert_eq!(&out[24..28], &1.5f32.to_bits().to_be_bytes());
        let msg = AggMessage::decode(&out).unwrap();
        assert_eq!(msg.payload, AggPayload::Float(payload.to_vec()));
        assert!(msg.header().is_float() && msg.header().is_result());
        assert_eq!(msg.encode().unwrap(), out);
    }

    #[test]
    fn agg_encode_errors() {
        let mut out = Vec::new();
        assert_eq!(
            encode_agg_into(&hdr(0, Op::Sum, 0), &[], &mut out),
            Err(EncodeError::PayloadLength(0))
        );
        let big = vec![0i32; 65536];
        assert_eq!(
            encode_agg_into(&hdr(0, Op::Sum, 0), &big, &mut out),
            Err(EncodeError::PayloadLength(65536))
        );
        assert_eq!(
            encode_agg_into(&hdr(2, Op::Sum, 0), &[1], &mut out),
            Err(EncodeError::CountMismatch { count: 2, len: 1 })
        );
        assert_eq!(
            encode_agg_into(&hdr(1, Op::Sum, 0x10), &[1], &mut out),
            Err(EncodeError::ReservedFlag {
                kind: MessageKind::Agg,
                flags: 0x10
            })
        );
        assert_eq!(
            encode_agg_into(&hdr(1, Op::Sum, abi::AGG_F_FLOAT32), &[1], &mut out),
            Err(EncodeError::FloatFlagMismatch)
        );
        assert_eq!(
            encode_agg_f32_into(&hdr(1, Op::Sum, 0), &[1.0], &mut out),
            Err(EncodeError::FloatFlagMismatch)
        );
        assert_eq!(
            encode_agg_f32_into(&hdr(1, Op::Bor, abi::AGG_F_FLOAT32), &[1.0], &mut out),
            Err(EncodeError::FloatBitwise(Op::Bor))
        );
        assert!(out.is_empty(), "failed encodes must not write");
        let m = AggMessage {
            job: 1,
            rank: 0,
            seq: 0,
            round: Round(0),
            frag_off: 0,
            op: Op::Sum,
            flags: 0,
            payload: AggPayload::Int(big),
        };
        assert_eq!(m.encode(), Err(EncodeError::PayloadLength(65536)));
    }

    #[test]
    fn agg_decode_errors_and_drop_reasons() {
        let good = agg_bytes(2, Op::Sum, 0, &[1, 2]);
        assert!(decode_agg_header(&good).is_ok());

        assert_eq!(decode_agg_header(&[]), Err(ProtoError::NotAggbox));
        assert_eq!(decode_agg_header(&good[..3]), Err(ProtoError::NotAggbox));
        let mut bad_magic = good.clone();
        bad_magic[3] = b'2';
        assert_eq!(decode_agg_header(&bad_magic), Err(ProtoError::NotAggbox));
        assert_eq!(decode(&bad_magic), Err(ProtoError::NotAggbox));

        let mut bcast = Vec::new();
        encode_bcast_into(
            &BcastHeader {
                mask: 1,
                seq: 0,
                group: 0,
                flags: 0,
                hops: 0,
            },
            &[0; 40],
            &mut bcast,
        )
        .unwrap();
        assert_eq!(
            decode_agg_header(&bcast),
            Err(ProtoError::WrongKind {
                expected: MessageKind::Agg,
                found: MessageKind::Bcast
            })
        );

        let cases: Vec<(Vec<u8>, ProtoError, Option<DropReason>)> = vec![
            (
                good[..23].to_vec(),
                ProtoError::TruncatedHeader {
                    kind: MessageKind::Agg,
                    len: 23,
                },
                Some(DropReason::TruncatedHeader),
            ),
            (
                good[..4].to_vec(),
                ProtoError::TruncatedHeader {
                    kind: MessageKind::Agg,
                    len: 4,
                },
                Some(DropReason::TruncatedHeader),
            ),
            (
                {
                    let mut b = good.clone();
                    b[20] = 9;
                    b
                },
                ProtoError::InvalidOp(9),
                Some(DropReason::InvalidOp),
            ),
            (
                agg_bytes(2, Op::Sum, 0x40 | 0x01, &[1, 2]),
                ProtoError::ReservedFlag {
                    kind: MessageKind::Agg,
                    flags: 0x41,
                },
                Some(DropReason::ReservedFlag),
            ),
            (
                agg_bytes(0, Op::Sum, 0, &[]),
                ProtoError::ZeroCount,
                Some(DropReason::ZeroCount),
            ),
            (
                agg_bytes(0, Op::Sum, 0, &[1]),
                ProtoError::ZeroCount,
                Some(DropReason::ZeroCount),
            ),
            (
                agg_bytes(3, Op::Sum, 0, &[1, 2]),
                ProtoError::CountTooLarge { count: 3, len: 32 },
                Some(DropReason::CountTooLarge),
            ),
            (
                {
                    let mut b = good.clone();
                    b.pop();
                    b
                },
                ProtoError::CountTooLarge { count: 2, len: 31 },
                Some(DropReason::CountTooLarge),
            ),
            (
                agg_bytes(1, Op::Sum, 0, &[1, 2]),
                ProtoError::CountTooSmall { count: 1, len: 32 },
                Some(DropReason::CountTooSmall),
            ),
            (
                {
                    let mut b = good.clone();
                    b.push(0);
                    b
                },
                ProtoError::CountTooSmall { count: 2, len: 33 },
                Some(DropReason::CountTooSmall),
            ),
            (
                agg_bytes(2, Op::Band, abi::AGG_F_FLOAT32, &[1, 2]),
                ProtoError::FloatBitwise(Op::Band),
                Some(DropReason::InvalidOp),
            ),
            (
                agg_bytes(2, Op::Bxor, abi::AGG_F_FLOAT32, &[1, 2]),
                ProtoError::FloatBitwise(Op::Bxor),
                Some(DropReason::InvalidOp),
            ),
        ];
        for (buf, err, reason) in cases {
            assert_eq!(decode_agg_header(&buf), Err(err), "{}", err);
            assert_eq!(AggMessage::decode(&buf), Err(err));
            assert_eq!(err.drop_reason(), reason, "{err}");
            assert!(!err.to_string().is_empty());
        }
        // Several faults: the first in the kernel's order wins.
        let mut multi = agg_bytes(0, Op::Sum, 0x80, &[]);
        multi[20] = 200;
        assert_eq!(
            decode_agg_header(&multi),
            Err(ProtoError::ReservedFlag {
                kind: MessageKind::Agg,
                flags: 0x80
            })
        );
        multi[21] = 0;
        assert_eq!(decode_agg_header(&multi), Err(ProtoError::InvalidOp(200)));
        // Ops 0..=8 are all valid, including the user-space ones, on ints.
        for op in Op::ALL {
            assert_eq!(
                decode_agg_header(&agg_bytes(2, op, 0, &[1, 2])).unwrap().op,
                op
            );
        }
        // Non-AGG errors have no kernel drop reason.
        assert_eq!(ProtoError::NotAggbox.drop_reason(), None);
        assert_eq!(
            ProtoError::TruncatedHeader {
                kind: MessageKind::Ack,
                len: 5
            }
            .drop_reason(),
            None
        );
        assert_eq!(
            ProtoError::ReservedFlag {
                kind: MessageKind::Bcast,
                flags: 2
            }
            .drop_reason(),
            None
        );
        assert_eq!(ProtoError::InvalidNbits(0).drop_reason(), None);
    }

    #[test]
    fn bcast_round_trip_and_errors() {
        let h = BcastHeader {
            mask: 0x8000_0001,
            seq: u32::MAX,
            group: 0xbeef,
            flags: abi::BCAST_F_FORWARD,
            hops: 3,
        };
        let msg = BcastMessage {
            header: h,
            payload: b"opaque".to_vec(),
        };
        let buf = msg.encode().unwrap();
        assert_eq!(buf.len(), 22);
        assert_eq!(
            &buf[..16],
            &[0x41, 0x47, 0x42, 0x31, 0x80, 0, 0, 1, 0xff, 0xff, 0xff, 0xff, 0xbe, 0xef, 1, 3]
        );
        assert_eq!(BcastMessage::decode(&buf).unwrap(), msg);
        assert!(h.is_forward());
        assert_eq!(decode(&buf).unwrap(), Message::Bcast(msg.clone()));
        // Empty payload is legal.
        let empty = BcastMessage {
            header: h,
            payload: vec![],
        };
        assert_eq!(
            BcastMessage::decode(&empty.encode().unwrap()).unwrap(),
            empty
        );

        assert_eq!(
            BcastMessage::decode(&buf[..15]),
            Err(ProtoError::TruncatedHeader {
                kind: MessageKind::Bcast,
                len: 15
            })
        );
        let mut bad = buf.clone();
        bad[14] = 0x03;
        assert_eq!(
            BcastMessage::decode(&bad),
            Err(ProtoError::ReservedFlag {
                kind: MessageKind::Bcast,
                flags: 3
            })
        );
        let bad_h = BcastHeader { flags: 0x80, ..h };
        assert_eq!(
            encode_bcast_into(&bad_h, &[], &mut Vec::new()),
            Err(EncodeError::ReservedFlag {
                kind: MessageKind::Bcast,
                flags: 0x80
            })
        );
        assert_eq!(
            BcastMessage::decode(&agg_bytes(1, Op::Sum, 0, &[1])),
            Err(ProtoError::WrongKind {
                expected: MessageKind::Bcast,
                found: MessageKind::Agg
            })
        );
    }

    fn ack(base: u32, nbits: u16, set: &[u32]) -> AckMessage {
        let mut bm = SeqBitmap::new(base, nbits).unwrap();
        for &s in set {
            assert!(bm.set(s));
        }
        AckMessage {
            id: 9,
            rank: 4,
            kind: AckKind::Broadcast,
            flags: abi::ACK_F_FINAL,
            bitmap: bm,
        }
    }

    #[test]
    fn ack_round_trip_lsb_first() {
        let m = ack(100, 10, &[100, 109, 103]);
        let buf = m.encode().unwrap();
        assert_eq!(buf.len(), 16 + 2);
        assert_eq!(
            &buf[..16],
            &[0x41, 0x47, 0x4b, 0x31, 0, 9, 0, 4, 0, 0, 0, 100, 0, 10, 1, 1]
        );
        // bit j = byte j/8, bit j%8: offsets 0 and 3 in byte 0, offset 9 in byte 1.
        assert_eq!(&buf[16..], &[0b0000_1001, 0b0000_0010]);
        let back = AckMessage::decode(&buf).unwrap();
        assert_eq!(back, m);
        assert!(back.is_final());
        assert_eq!(decode(&buf).unwrap(), Message::Ack(m));

        for nbits in [1u16, 7, 8, 9, 63, 64, 65, 1023, 1024] {
            let seqs: Vec<u32> = (0..nbits as u32)
                .filter(|j| j % 3 == 0)
                .map(|j| 5000 + j)
                .collect();
            let m = AckMessage {
                kind: AckKind::Aggregation,
                flags: 0,
                ..ack(5000, nbits, &seqs)
            };
            let buf = m.encode().unwrap();
            assert_eq!(
                buf.len(),
                16 + (nbits as usize).div_ceil(8),
                "nbits {nbits}"
            );
            assert_eq!(AckMessage::decode(&buf).unwrap(), m, "nbits {nbits}");
        }
    }

    #[test]
    fn ack_decode_errors() {
        let good = ack(0, 12, &[0, 11]).encode().unwrap();
        assert!(AckMessage::decode(&good).is_ok());
        assert_eq!(
            AckMessage::decode(&good[..15]),
            Err(ProtoError::TruncatedHeader {
                kind: MessageKind::Ack,
                len: 15
            })
        );
        let with = |at: usize, v: u8| {
            let mut b = good.clone();
            b[at] = v;
            b
        };
        // nbits 0 and 1025
        let mut zero = good.clone();
        zero[12..14].copy_from_slice(&0u16.to_be_bytes());
        assert_eq!(AckMessage::decode(&zero), Err(ProtoError::InvalidNbits(0)));
        let mut over = good[..16].to_vec();
        over[12..14].copy_from_slice(&1025u16.to_be_bytes());
        over.extend_from_slice(&[0u8; 129]);
        assert_eq!(
            AckMessage::decode(&over),
            Err(ProtoError::InvalidNbits(1025))
        );
        assert_eq!(
            AckMessage::decode(&with(14, 2)),
            Err(ProtoError::InvalidAckKind(2))
        );
        assert_eq!(
            AckMessage::decode(&with(15, 0x81)),
            Err(ProtoError::ReservedFlag {
                kind: MessageKind::Ack,
                flags: 0x81
            })
        );
        assert_eq!(
            AckMessage::decode(&good[..17]),
            Err(ProtoError::BitmapLength {
                nbits: 12,
                expected: 2,
                found: 1
            })
        );
        let mut long = good.clone();
        long.push(0);
        assert_eq!(
            AckMessage::decode(&long),
            Err(ProtoError::BitmapLength {
                nbits: 12,
                expected: 2,
                found: 3
            })
        );
        // bit 12 (byte 1, bit 4) is beyond nbits 12
        assert_eq!(
            AckMessage::decode(&with(17, 0x18)),
            Err(ProtoError::BitsBeyondNbits(12))
        );
        // nbits a multiple of 8: the whole last byte is in range
        assert!(AckMessage::decode(&ack(0, 16, &[15]).encode().unwrap()).is_ok());
        let bad = AckMessage {
            flags: 2,
            ..ack(0, 1, &[])
        };
        assert_eq!(
            bad.encode(),
            Err(EncodeError::ReservedFlag {
                kind: MessageKind::Ack,
                flags: 2
            })
        );
    }

    #[test]
    fn seq_bitmap_basics() {
        assert_eq!(SeqBitmap::new(0, 0), Err(ProtoError::InvalidNbits(0)));
        assert_eq!(SeqBitmap::new(0, 1025), Err(ProtoError::InvalidNbits(1025)));
        let mut bm = SeqBitmap::new(10, 5).unwrap();
        assert!(!bm.set(9) && !bm.set(15));
        assert!(bm.set(10) && bm.set(12) && bm.set(12));
        assert!(bm.get(10) && !bm.get(11) && bm.get(12) && !bm.get(15));
        assert_eq!(bm.count_received(), 2);
        assert_eq!(bm.missing().collect::<Vec<_>>(), [11, 13, 14]);
        assert_eq!(bm.received().collect::<Vec<_>>(), [10, 12]);
        assert!(!bm.is_complete());
        for s in [11, 13, 14] {
            bm.set(s);
        }
        assert!(bm.is_complete());
        assert_eq!(bm.missing().count(), 0);

        let mut other = SeqBitmap::new(12, 10).unwrap();
        other.merge(&bm); // only 12, 13, 14 fall in [12, 22)
        assert_eq!(other.received().collect::<Vec<_>>(), [12, 13, 14]);
    }

    #[test]
    fn seq_bitmap_wraps() {
        let mut bm = SeqBitmap::new(u32::MAX - 1, 4).unwrap();
        assert!(bm.covers(u32::MAX - 1) && bm.covers(u32::MAX) && bm.covers(0) && bm.covers(1));
        assert!(!bm.covers(2) && !bm.covers(u32::MAX - 2));
        assert_eq!(bm.offset_of(0), Some(2));
        bm.set(u32::MAX);
        bm.set(1);
        assert_eq!(bm.missing().collect::<Vec<_>>(), [u32::MAX - 1, 0]);
        let m = AckMessage {
            id: 1,
            rank: 1,
            kind: AckKind::Aggregation,
            flags: 0,
            bitmap: bm,
        };
        assert_eq!(AckMessage::decode(&m.encode().unwrap()).unwrap().bitmap, bm);
    }

    #[test]
    fn group_mode_helpers() {
        assert_eq!(group_of(0, DEFAULT_GROUP_SIZE), (0, 0));
        assert_eq!(group_of(1023, 1024), (0, 0));
        assert_eq!(group_of(1024, 1024), (1, 1024));
        assert_eq!(group_of(u32::MAX, 1024), (4_194_303, u32::MAX - 1023));
        assert_eq!(group_of(7, 0), (7, 7)); // G = 0 treated as 1
        assert_eq!(group_of(250, 100), (2, 200));
        assert_eq!(group_len(4_194_303, 1024), 1024);
        // 2^32 = 42949672 * 100 + 96: the last group of size 100 has 96 numbers.
        assert_eq!(group_of(u32::MAX, 100), (42_949_672, 4_294_967_200));
        assert_eq!(group_len(42_949_672, 100), 96);
        let bm = SeqBitmap::for_group(3, 1024);
        assert_eq!((bm.base_seq(), bm.nbits()), (3072, 1024));
        let bm = SeqBitmap::for_group(42_949_672, 100);
        assert_eq!((bm.base_seq(), bm.nbits()), (4_294_967_200, 96));
        assert!(bm.covers(u32::MAX) && !bm.covers(0));
    }

    #[test]
    fn classify_by_magic() {
        assert_eq!(classify(b"AGG1"), Some(MessageKind::Agg));
        assert_eq!(classify(b"AGB1xx"), Some(MessageKind::Bcast));
        assert_eq!(classify(b"AGK1"), Some(MessageKind::Ack));
        assert_eq!(classify(b"AGX1"), None);
        assert_eq!(classify(b"AG"), None);
        for k in [MessageKind::Agg, MessageKind::Bcast, MessageKind::Ack] {
            assert_eq!(MessageKind::from_magic(k.magic()), Some(k));
            assert_eq!(k.name().as_bytes(), k.magic().to_be_bytes());
        }
        assert_eq!(
            decode(b"AGK1"),
            Err(ProtoError::TruncatedHeader {
                kind: MessageKind::Ack,
                len: 4
            })
        );
    }

    #[test]
    fn be_helpers_ignore_partial_tail() {
        let mut out = [0i32; 2];
        read_i32_be(&[0, 0, 0, 1, 0xff, 0xff, 0xff, 0xfe, 9], &mut out);
        assert_eq!(out, [1, -2]);
        let mut f = Vec::new();
        write_f32_be(&[-2.0], &mut f);
        assert_eq!(f, (-2.0f32).to_bits().to_be_bytes());
        let mut back = [0f32; 1];
        read_f32_be(&f, &mut back);
        assert_eq!(back, [-2.0]);
    }
}
