//! `AGK1`: acknowledgements and their sequence bitmaps (PROTOCOL.md "AGK1"),
//! the ACK modes and groups.

use super::*;

/// Default ACK group size G of group mode.
pub const DEFAULT_GROUP_SIZE: u32 = 1024;

const BITMAP_WORDS: usize = abi::ACK_MAX_BITS as usize / 64;

/// How AGK1 acknowledges (PROTOCOL.md, "Acknowledgement AGK1"): one ACK per
/// datagram, or one per group of sequence numbers (`[node] ack_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
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
