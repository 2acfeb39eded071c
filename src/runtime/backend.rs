//! The trait the two backends implement: what the aggregator's runtime does
//! with the `AGG1` datagrams that reach it, and who acknowledges
//! contributions.
//!
//! - [`crate::runtime::socket::SocketAggregator`]: every contribution reaches
//!   the aggregator process, which reduces it with
//!   [`crate::reducer::Accumulator`] (dedup per (job, round, frag_off, rank),
//!   completion once) and acknowledges it itself through
//!   [`crate::runtime::reliability::RecvTracker`].
//! - [`crate::runtime::kernel::KernelAggregator`]: the node's XDP program
//!   reduces; only RESULT datagrams reach the runtime (on the job's
//!   `result_port`), and the runtime acknowledges contributions on the
//!   kernel's behalf (a RESULT proves every rank's datagram of that fragment
//!   arrived).
//!
//! Everything else (fragmentation, windows, broadcast, retransmission) is the
//! same code for both, in [`crate::runtime::comm`].

use std::net::SocketAddrV4;
use std::time::Instant;

use crate::proto::{AckKind, AckMessage, AggHeader, SeqBitmap};
use crate::runtime::transport::Net;

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

/// Sends `AGK1` acknowledgements for contributions from the aggregator's
/// socket, encoding into a reused buffer.
#[derive(Debug)]
pub struct AckIo<'a> {
    /// The aggregator participant's transport.
    pub sock: &'a Net,
    /// Reused encode buffer.
    pub buf: &'a mut Vec<u8>,
    /// Job id (the ACK's `id`).
    pub job: u16,
    /// ACK datagrams sent so far (incremented here).
    pub sent: &'a mut u64,
}

impl AckIo<'_> {
    /// Sends one aggregation ACK for `rank`'s datagrams to `to`.
    pub fn send(&mut self, to: SocketAddrV4, rank: u16, bm: &SeqBitmap) {
        send_ack(
            self.sock,
            self.buf,
            self.job,
            rank,
            AckKind::Aggregation,
            bm,
            to,
        );
        *self.sent += 1;
    }
}

/// Encodes and sends one `AGK1` (send errors count as loss: the peer
/// retransmits).
pub fn send_ack(
    sock: &Net,
    buf: &mut Vec<u8>,
    id: u16,
    rank: u16,
    kind: AckKind,
    bm: &SeqBitmap,
    to: SocketAddrV4,
) {
    buf.clear();
    let msg = AckMessage {
        id,
        rank,
        kind,
        flags: 0,
        bitmap: *bm,
    };
    if msg.encode_into(buf).is_ok() {
        sock.tx(to, buf);
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
    fn expect_round(&mut self, round: u32, seq_base: u32, now: Instant);

    /// A reduction with `op` needs up to `n` slots of `count` elements:
    /// prepare them now (the socket aggregator makes its accumulators), so
    /// later calls of the same size allocate nothing. Default: nothing.
    fn reserve(&mut self, _op: crate::abi::Op, _count: usize, _n: usize) {}

    /// One valid `AGG1` datagram arrived at the aggregator's socket.
    fn on_agg(
        &mut self,
        hdr: &AggHeader,
        payload_be: &[u8],
        from: SocketAddrV4,
        now: Instant,
        io: &mut AckIo,
    );

    /// Timers (delayed ACKs); returns when the next is due.
    fn poll(&mut self, now: Instant, io: &mut AckIo) -> Option<Instant>;

    /// Hands every completed fragment of `round` to `f` and forgets it.
    fn take_completed(&mut self, round: u32, f: &mut dyn FnMut(Completed<'_>));

    /// What is known of fragment `frag_off` of `round`, not yet complete.
    fn fragment_state(&self, round: u32, frag_off: u32) -> FragmentState;
}
