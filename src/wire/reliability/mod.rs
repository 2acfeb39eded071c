//! The one sequence / acknowledgement / retransmission module of AggBox
//! (docs/RUNTIME.md, "Reliability"). Every reliable path of the
//! runtime uses it: worker contributions (`AGG1`), broadcast data (`AGB1`) and
//! the acknowledgements the aggregator sends for contributions, on both the
//! socket and the kernel backend.
//!
//! - [`SendWindow`] ([`send`]): the sender side. Gives every new datagram the next `seq`,
//!   keeps a copy in a reused buffer until every destination acknowledged it,
//!   limits the datagrams in flight to a window, retransmits only what is
//!   missing and only to who misses it, with a timeout from
//!   [`RttEstimator`] ([`rtt`]; Jacobson/Karels SRTT/RTTVAR, RFC 6298) that doubles on
//!   every retransmission of the same datagram (exponential back-off) and,
//!   where ACK holes show losses, does not expire for a destination whose
//!   ACKs keep acknowledging new datagrams (one RTO after the last, as RFC
//!   6298 (5.3) restarts its timer on every ACK of new data). An
//!   `AGK1` whose bitmap shows a hole below a received seq triggers a selective
//!   retransmission of the hole at most once per smoothed RTT.
//! - [`RecvTracker`] ([`receive`]): the receiver side, one per sender. Classifies each
//!   arriving seq as new or duplicate (duplicates are re-acknowledged, never
//!   delivered), and produces `AGK1` bitmaps per [`AckMode`]: per-packet mode
//!   acknowledges each datagram with `nbits = 1`; group mode (group size G,
//!   default 1024) acknowledges a group once it is complete, at the end of a
//!   message (a datagram flagged as last), or, when arrivals are left
//!   unacknowledged for `ack_delay` (a gap that did not fill, or a sender that
//!   stopped inside a group), with a selective bitmap of what the group has.
//!
//! Invariant that bounds the receiver's memory: a sender never has more than
//! `window <= G` datagrams in flight ([`ReliabilityConfig::validate`] enforces
//! it), so when a tracker sees a seq at least `2G` past the start of its oldest
//! group, every hole of that group was abandoned by the sender (its call failed
//! at its deadline) and the group is dropped. A tracker therefore holds at most
//! three groups. A seq more than [`SESSION_RESET_DISTANCE`] away from the
//! tracker's floor (a restarted sender, which starts at a fresh random group)
//! resets the tracker.
//!
//! Memory (asserted in the unit tests, see `docs/RUNTIME.md`): a receiver keeps
//! `size_of::<GroupState>()` = 160 bytes per group of 1024 datagrams per sender
//! (a 1024-bit [`crate::wire::proto::SeqBitmap`] plus ACK timing); a sender keeps 48 bytes of
//! bookkeeping per datagram in flight ([`SendWindow::ENTRY_BYTES`] = 48, 48 KiB per
//! 1024) plus the datagram copy itself (at most the MTU, ~1.5 MiB per 1024 at
//! MTU 1500; the buffers are allocated once and reused).

pub mod receive;
pub mod rtt;
pub mod send;

pub use receive::{GroupState, RecvTracker, Verdict};
pub use rtt::RttEstimator;
pub use send::{SendStats, SendWindow};

use std::time::Duration;

use crate::wire::proto::AckMode;
use crate::wire::proto::DEFAULT_GROUP_SIZE;

/// Distance (in seq numbers) from a tracker's floor beyond which a datagram is
/// taken as the start of a new sender session and resets the tracker.
pub const SESSION_RESET_DISTANCE: u32 = 1 << 24;

/// Settings of the reliability layer, shared by senders and receivers of one
/// communicator (they must agree on `ack_mode` and `group_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReliabilityConfig {
    /// Per-packet or group acknowledgements.
    pub ack_mode: AckMode,
    /// Group size G of group mode, 1..=1024 (also the tracker's bitmap size).
    pub group_size: u32,
    /// Datagrams in flight per sender, 1..=`group_size`.
    pub window: u32,
    /// Retransmission timeout before the first RTT sample.
    pub initial_rto: Duration,
    /// Lower bound of the retransmission timeout.
    pub min_rto: Duration,
    /// Upper bound of the retransmission timeout (also caps the back-off).
    pub max_rto: Duration,
    /// Group mode: how long arrivals may stay unacknowledged before a
    /// selective ACK is sent.
    pub ack_delay: Duration,
}

impl Default for ReliabilityConfig {
    /// Group mode with G = 1024, a window of 256, RTO 20 ms before the first
    /// sample and within [2 ms, 1 s], ACK delay 1 ms.
    fn default() -> Self {
        ReliabilityConfig {
            ack_mode: AckMode::Group,
            group_size: DEFAULT_GROUP_SIZE,
            window: 256,
            initial_rto: Duration::from_millis(20),
            min_rto: Duration::from_millis(2),
            max_rto: Duration::from_secs(1),
            ack_delay: Duration::from_millis(1),
        }
    }
}

impl ReliabilityConfig {
    /// Checks the ranges: G in 1..=1024, window in 1..=G, min_rto <= max_rto.
    pub fn validate(&self) -> Result<(), String> {
        if self.group_size == 0 || self.group_size > 1024 {
            return Err(format!(
                "ack group size {} outside 1..=1024",
                self.group_size
            ));
        }
        if self.window == 0 || self.window > self.group_size {
            return Err(format!(
                "window {} outside 1..=group size {} (a sender may not have more than G datagrams in flight)",
                self.window, self.group_size
            ));
        }
        if self.min_rto > self.max_rto || self.min_rto.is_zero() {
            return Err("need 0 < min_rto <= max_rto".into());
        }
        Ok(())
    }
}

/// A configuration for the unit tests: `mode`, group size `g`, `window`.
#[cfg(test)]
pub(crate) fn test_config(mode: AckMode, g: u32, window: u32) -> ReliabilityConfig {
    ReliabilityConfig {
        ack_mode: mode,
        group_size: g,
        window,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn memory_per_group_of_1024() {
        // Receiver: one GroupState per 1024 datagrams per sender.
        assert_eq!(
            RecvTracker::GROUP_BYTES,
            160,
            "GroupState grew: update docs/RUNTIME.md"
        );
        // Sender: bookkeeping per datagram in flight.
        assert_eq!(
            SendWindow::ENTRY_BYTES,
            48,
            "Entry grew: update docs/RUNTIME.md"
        );
        assert_eq!(1024 * SendWindow::ENTRY_BYTES, 48 * 1024);
        // A tracker never holds more than MAX_GROUPS groups, whatever it sees.
        let mut t = RecvTracker::new(test_config(AckMode::Group, 1024, 1024));
        let now = Instant::now();
        for s in (0..100_000u32).filter(|s| s % 7 != 3) {
            if t.check(s) == Verdict::New {
                t.record(s, false, now, &mut |_| {});
            }
            assert!(t.groups_held() <= RecvTracker::MAX_GROUPS);
        }
    }
}
