//! Broadcasts through the node's TC program: a root with a TC group sends
//! one datagram per fragment to the group's first member, with a mask of
//! who is to get a copy (see `docs/RUNTIME.md`, "Data paths").

use std::net::SocketAddr;

use crate::runtime::outbox::Outbox;

/// The TC broadcast route of a root: where its one datagram goes and which
/// table bit each participant has.
pub(super) struct TcRoute {
    /// The group id (`AGB1` `group`).
    pub(super) id: u16,
    /// Where the one datagram goes.
    pub(super) first: SocketAddr,
    /// Per participant index, its bit in the group's member table.
    pub(super) bit_of: Vec<u32>,
    /// The datagram being re-masked.
    pub(super) scratch: Vec<u8>,
}

impl TcRoute {
    pub(super) fn mask(&self, dests: u64) -> u32 {
        (0..self.bit_of.len())
            .filter(|&d| dests & (1 << d) != 0)
            .fold(0, |m, d| m | self.bit_of[d])
    }

    /// A retransmission of `bytes` to participant `d` alone: one datagram
    /// to the first member with `d`'s bit as the `AGB1` mask (the TC program
    /// re-addresses any datagram of the group, so a plain unicast is not
    /// possible).
    pub(super) fn resend(&mut self, out: &mut Outbox, bytes: &[u8], d: usize) {
        self.scratch.clear();
        self.scratch.extend_from_slice(bytes);
        if self.scratch.len() >= 8 {
            self.scratch[4..8].copy_from_slice(&self.bit_of[d].to_be_bytes());
        }
        out.resend(self.first, &self.scratch);
    }
}
