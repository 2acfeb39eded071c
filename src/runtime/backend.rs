//! The trait the two backends implement: what the aggregator's runtime does
//! with the `AGG1` datagrams that reach it, and who acknowledges
//! contributions.
//!
//! - [`crate::runtime::socket::SocketAggregator`]: every contribution reaches
//!   the aggregator process, which reduces it with
//!   [`crate::wire::reducer::Accumulator`] (dedup per (job, round, frag_off, rank),
//!   completion once) and acknowledges it itself through
//!   [`crate::wire::reliability::RecvTracker`].
//! - [`crate::runtime::kernel::KernelAggregator`]: the node's XDP program
//!   reduces; only RESULT datagrams reach the runtime (on the job's
//!   `result_port`), and the runtime acknowledges contributions on the
//!   kernel's behalf (a RESULT proves every rank's datagram of that fragment
//!   arrived).
//!
//! Everything else (fragmentation, windows, broadcast, retransmission) is the
//! same code for both, in `runtime::engine`.

use std::net::SocketAddr;
use std::time::Instant;

use crate::wire::abi::Round;
use crate::wire::proto::{AckKind, AggHeader, SeqBitmap};
use crate::runtime::outbox::Outbox;
use crate::runtime::transport::Counters;

/// Which backend a communicator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackendKind {
    /// Pure user space: the aggregator process reduces (baseline, fallback).
    #[default]
    Socket,
    /// Contributions are reduced by the node's XDP aggregator.
    Kernel,
}

impl BackendKind {
    /// `"socket"` or `"kernel"`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Socket => "socket",
            BackendKind::Kernel => "kernel",
        }
    }
}

/// Queues `AGK1` acknowledgements for contributions, to go out from the
/// aggregator's socket when the I/O driver next polls the state machine.
#[derive(Debug)]
pub struct AckIo<'a> {
    /// Where the acknowledgements are queued.
    pub out: &'a mut Outbox,
    /// The communicator's counters (refused datagrams).
    pub counters: &'a Counters,
    /// Job id (the ACK's `id`).
    pub job: u16,
    /// ACK datagrams queued so far (incremented here).
    pub sent: &'a mut u64,
}

impl AckIo<'_> {
    /// Queues one aggregation ACK for `rank`'s datagrams to `to`.
    pub fn send(&mut self, to: SocketAddr, rank: u16, bm: &SeqBitmap) {
        self.out.ack(self.job, rank, AckKind::Aggregation, bm, to);
        *self.sent += 1;
    }
}

/// A fragment result handed from the backend to the collecting call.
#[derive(Debug, Clone, Copy)]
pub struct Completed<'a> {
    /// Element offset of the fragment.
    pub frag_off: u32,
    /// The reduced elements.
    pub values: &'a [i32],
    /// Some element was clamped.
    pub overflow: bool,
}

/// What the aggregator knows about an unfinished fragment (for errors).
#[derive(Debug, Clone, Default)]
pub struct FragmentState {
    /// Ranks whose contribution arrived (`None`: the backend cannot tell).
    pub contributors: Option<Vec<u16>>,
    /// The partial reduction of what arrived, when the backend has it.
    pub partial: Option<Vec<i32>>,
}

/// The aggregator side of a backend (see the module docs).
pub trait Backend: Send + std::fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// The round the aggregator collects next starts at contribution seq
    /// `seq_base` (all ranks use the same seq for the same fragment). Older
    /// rounds are stale from now on.
    fn expect_round(&mut self, round: Round, seq_base: u32, now: Instant);

    /// A reduction with `op` needs up to `n` slots of `count` elements:
    /// prepare them now (the socket aggregator makes its accumulators), so
    /// later calls of the same size allocate nothing. Default: nothing.
    fn reserve(&mut self, _op: crate::wire::abi::Op, _count: usize, _n: usize) {}

    /// One valid `AGG1` datagram arrived at the aggregator's socket.
    fn on_agg(
        &mut self,
        hdr: &AggHeader,
        payload_be: &[u8],
        from: SocketAddr,
        now: Instant,
        io: &mut AckIo,
    );

    /// Timers (delayed ACKs); returns when the next is due.
    fn poll(&mut self, now: Instant, io: &mut AckIo) -> Option<Instant>;

    /// Hands every completed fragment of `round` to `f` and forgets it.
    fn take_completed(&mut self, round: Round, f: &mut dyn FnMut(Completed<'_>));

    /// What is known of fragment `frag_off` of `round`, not yet complete.
    fn fragment_state(&self, round: Round, frag_off: u32) -> FragmentState;
}
