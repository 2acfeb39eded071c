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
