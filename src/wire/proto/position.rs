//! `AGP1`: the position query of a node-served job and the node's reply
//! (PROTOCOL.md "AGP1: the position of a node-served job").
//!
//! A new run of a job's communicators (an MPI run, docs/MPI.md) asks the
//! node's result service, on the job's `result_port`, for the round and
//! contribution seq its first call must use so that the node takes it for
//! new: the service answers from the RESULTs it has seen. Not one of the
//! three messages of the shared specification ([`MessageKind`] and
//! [`classify`] do not know it; the data plane passes it on untouched), so
//! it has its own error type.

use super::*;

/// Why a datagram is not a valid `AGP1` query or reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PositionError {
    /// Another magic (or shorter than 4 bytes).
    #[error("not an AGP1 datagram")]
    NotPosition,
    /// `AGP1` is exactly [`abi::POSITION_LEN`] bytes.
    #[error("AGP1 datagram of {0} bytes, must be {len}", len = abi::POSITION_LEN)]
    Length(usize),
    /// A flag bit AGP1 does not define, or a non-zero pad byte.
    #[error("AGP1 reserved flag or pad bits set")]
    Reserved,
    /// A query (REPLY clear) with a round, seq or the FRESH flag: only a
    /// reply carries them.
    #[error("AGP1 query carries a position")]
    QueryWithPosition,
}

/// A decoded `AGP1` datagram, host order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PositionMessage {
    /// The job.
    pub job: u16,
    /// The asking worker's rank.
    pub rank: u16,
    /// The asker's value, carried back by the reply (matches a reply to
    /// its query among retries).
    pub nonce: u32,
    /// Reply: the round of a new run's first call.
    pub round: Round,
    /// Reply: the contribution seq of that call.
    pub agg_seq: u32,
    /// `abi::POSITION_F_*`.
    pub flags: u8,
}

impl PositionMessage {
    /// Worker `rank`'s query of `job`'s position.
    pub fn query(job: u16, rank: u16, nonce: u32) -> PositionMessage {
        PositionMessage {
            job,
            rank,
            nonce,
            round: Round(0),
            agg_seq: 0,
            flags: 0,
        }
    }

    /// The node's reply to `query`: a new run starts at `round`, `agg_seq`;
    /// `fresh` when the node has seen nothing of the job.
    pub fn reply(
        query: &PositionMessage,
        round: Round,
        agg_seq: u32,
        fresh: bool,
    ) -> PositionMessage {
        let flags = abi::POSITION_F_REPLY | if fresh { abi::POSITION_F_FRESH } else { 0 };
        PositionMessage {
            round,
            agg_seq,
            flags,
            ..*query
        }
    }

    /// A reply (else a query).
    pub fn is_reply(&self) -> bool {
        self.flags & abi::POSITION_F_REPLY != 0
    }

    /// A reply of a node that has seen no RESULT of the job.
    pub fn is_fresh(&self) -> bool {
        self.flags & abi::POSITION_F_FRESH != 0
    }

    /// Whether `buf` announces itself as `AGP1` (its magic; nothing else
    /// checked).
    pub fn is_position(buf: &[u8]) -> bool {
        buf.len() >= 4 && be_u32(buf, 0) == abi::MAGIC_POSITION
    }

    /// Validates and decodes an `AGP1` datagram.
    pub fn decode(buf: &[u8]) -> Result<PositionMessage, PositionError> {
        if !Self::is_position(buf) {
            return Err(PositionError::NotPosition);
        }
        if buf.len() != abi::POSITION_LEN {
            return Err(PositionError::Length(buf.len()));
        }
        let flags = buf[20];
        if flags & !abi::POSITION_F_KNOWN != 0 || buf[21..24] != [0, 0, 0] {
            return Err(PositionError::Reserved);
        }
        let msg = PositionMessage {
            job: be_u16(buf, 4),
            rank: be_u16(buf, 6),
            nonce: be_u32(buf, 8),
            round: Round(be_u32(buf, 12)),
            agg_seq: be_u32(buf, 16),
            flags,
        };
        if !msg.is_reply() && (msg.round != Round(0) || msg.agg_seq != 0 || msg.is_fresh()) {
            return Err(PositionError::QueryWithPosition);
        }
        Ok(msg)
    }

    /// The [`abi::POSITION_LEN`] wire bytes (no validation).
    pub fn encode(&self) -> [u8; abi::POSITION_LEN] {
        let mut b = [0u8; abi::POSITION_LEN];
        b[0..4].copy_from_slice(&abi::MAGIC_POSITION.to_be_bytes());
        b[4..6].copy_from_slice(&self.job.to_be_bytes());
        b[6..8].copy_from_slice(&self.rank.to_be_bytes());
        b[8..12].copy_from_slice(&self.nonce.to_be_bytes());
        b[12..16].copy_from_slice(&self.round.0.to_be_bytes());
        b[16..20].copy_from_slice(&self.agg_seq.to_be_bytes());
        b[20] = self.flags;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_round_trip_and_wire_layout() {
        let q = PositionMessage::query(11, 3, 0xdead_beef);
        let bytes = q.encode();
        assert_eq!(
            bytes,
            [
                0x41, 0x47, 0x50, 0x31, 0, 11, 0, 3, 0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0, 0, 0, 0,
                0, 0, 0, 0, 0
            ]
        );
        assert_eq!(PositionMessage::decode(&bytes), Ok(q));
        assert!(!q.is_reply() && PositionMessage::is_position(&bytes));
        let r = PositionMessage::reply(&q, Round(0x0102_0304), u32::MAX, false);
        let back = PositionMessage::decode(&r.encode()).unwrap();
        assert_eq!(back, r);
        assert!(back.is_reply() && !back.is_fresh());
        assert_eq!((back.job, back.rank, back.nonce), (11, 3, 0xdead_beef));
        assert_eq!(
            &r.encode()[12..21],
            &[1, 2, 3, 4, 0xff, 0xff, 0xff, 0xff, abi::POSITION_F_REPLY]
        );
        assert!(
            PositionMessage::decode(&PositionMessage::reply(&q, Round(0), 0, true).encode())
                .unwrap()
                .is_fresh()
        );
        // Not AGP1: another magic is not this message (classify ignores AGP1).
        assert_eq!(classify(&bytes), None);
        assert!(!PositionMessage::is_position(b"AGK1"));
    }

    #[test]
    fn malformed_position_datagrams_are_refused() {
        let good = PositionMessage::query(1, 0, 7).encode();
        assert_eq!(
            PositionMessage::decode(&good[..23]),
            Err(PositionError::Length(23))
        );
        let mut long = good.to_vec();
        long.push(0);
        assert_eq!(
            PositionMessage::decode(&long),
            Err(PositionError::Length(25))
        );
        assert_eq!(
            PositionMessage::decode(b"AGG1"),
            Err(PositionError::NotPosition)
        );
        assert_eq!(
            PositionMessage::decode(b"AG"),
            Err(PositionError::NotPosition)
        );
        let with = |at: usize, v: u8| {
            let mut b = good;
            b[at] = v;
            b
        };
        assert_eq!(
            PositionMessage::decode(&with(20, 0x04)),
            Err(PositionError::Reserved)
        );
        assert_eq!(
            PositionMessage::decode(&with(22, 1)),
            Err(PositionError::Reserved)
        );
        assert_eq!(
            PositionMessage::decode(&with(15, 1)),
            Err(PositionError::QueryWithPosition)
        );
        assert_eq!(
            PositionMessage::decode(&with(19, 1)),
            Err(PositionError::QueryWithPosition)
        );
        assert_eq!(
            PositionMessage::decode(&with(20, abi::POSITION_F_FRESH)),
            Err(PositionError::QueryWithPosition)
        );
    }
}
