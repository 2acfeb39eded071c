//! `AGB1`: broadcast data (PROTOCOL.md "AGB1").

use super::*;

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

/// The runtime's sub-header: the first [`RuntimeSubHeader::LEN`] bytes of
/// every `AGB1` payload the runtime sends, before the fragment's bytes
/// (`struct aggbox_bcast_runtime_subhdr`, PROTOCOL.md "AGB1"). The shared
/// spec leaves the `AGB1` payload opaque; this is the runtime's own framing
/// of it, which the data plane never reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuntimeSubHeader {
    /// The call's round.
    pub round: Round,
    /// Byte offset of the fragment in the message (below 2^31).
    pub offset: u32,
    /// The forwarded result fragment was clamped (a contribution or the sum
    /// overflowed), carried as bit 31 of the offset.
    pub overflow: bool,
}

impl RuntimeSubHeader {
    /// Wire bytes: `round: u32`, `offset: u32`, big-endian.
    pub const LEN: usize = abi::BCAST_RUNTIME_SUBHDR_LEN;

    /// Appends the 8 wire bytes to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        debug_assert!(self.offset & abi::BCAST_SUBHDR_OVERFLOW == 0, "offset {} uses the OVERFLOW bit", self.offset);
        let overflow = if self.overflow { abi::BCAST_SUBHDR_OVERFLOW } else { 0 };
        out.extend_from_slice(&self.round.0.to_be_bytes());
        out.extend_from_slice(&(self.offset | overflow).to_be_bytes());
    }

    /// The sub-header at the start of an `AGB1` payload and the fragment's
    /// bytes after it; `None` when the payload is shorter than the sub-header.
    pub fn decode(payload: &[u8]) -> Option<(RuntimeSubHeader, &[u8])> {
        if payload.len() < Self::LEN {
            return None;
        }
        let raw = be_u32(payload, 4);
        let hdr = RuntimeSubHeader {
            round: Round(be_u32(payload, 0)),
            offset: raw & !abi::BCAST_SUBHDR_OVERFLOW,
            overflow: raw & abi::BCAST_SUBHDR_OVERFLOW != 0,
        };
        Some((hdr, &payload[Self::LEN..]))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_sub_header_round_trips() {
        for (offset, overflow) in [(0, false), (1448, true), (0x7fff_fffc, false), (0x7fff_fffc, true)] {
            let hdr = RuntimeSubHeader {
                round: Round(0xfedc_ba98),
                offset,
                overflow,
            };
            let mut buf = Vec::new();
            hdr.encode_into(&mut buf);
            assert_eq!(buf.len(), RuntimeSubHeader::LEN);
            buf.extend_from_slice(&[1, 2, 3]);
            assert_eq!(RuntimeSubHeader::decode(&buf), Some((hdr, &[1u8, 2, 3][..])));
        }
    }

    #[test]
    fn runtime_sub_header_wire_bytes() {
        let hdr = RuntimeSubHeader {
            round: Round(7),
            offset: 0x0102,
            overflow: true,
        };
        let mut buf = Vec::new();
        hdr.encode_into(&mut buf);
        // round, then offset with bit 31 = OVERFLOW, both big-endian.
        assert_eq!(buf, [0, 0, 0, 7, 0x80, 0, 0x01, 0x02]);
        // A sub-header alone is a fragment of no bytes; shorter is none.
        assert_eq!(RuntimeSubHeader::decode(&buf).map(|(_, d)| d.len()), Some(0));
        assert_eq!(RuntimeSubHeader::decode(&buf[..7]), None);
        // AGB1 header + sub-header == AGG1 header: same datagram size.
        assert_eq!(abi::BCAST_HDR_LEN + RuntimeSubHeader::LEN, abi::AGG_HDR_LEN);
    }
}
