//! Encode, decode and validate the three AggBox v1 messages exactly as
//! `PROTOCOL.md` specifies them, one module each: `agg.rs` (`AGG1`),
//! `bcast.rs` (`AGB1`), `ack.rs` (`AGK1` and sequence bitmaps); this file
//! holds what they share (the magic, errors, byte order) and [`decode`].
//! `position.rs` holds `AGP1`, AggBox's own position query of a node-served
//! job (not a message of the specification).
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
    /// `AGG1` with FLOAT32 and an op not valid on floats ([`Op::valid_on_floats`]:
    /// the bitwise and logical ops).
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
    /// FLOAT32 payload with an op not valid on floats.
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

mod ack;
mod agg;
mod bcast;
mod position;

pub use ack::*;
pub use agg::*;
pub use bcast::*;
pub use position::*;

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
                    b[20] = Op::ALL.len() as u8; // the first number no row has
                    b
                },
                ProtoError::InvalidOp(Op::ALL.len() as u8),
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
