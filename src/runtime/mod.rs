//! The runtime library: collectives for applications over AggBox.
//!
//! A [`Communicator`] is one participant of a job — a worker rank or the
//! aggregator's application — with `broadcast`, `reduce` and `allreduce` for
//! int32 slices and (through [`quantize`]) float32 slices, blocking with
//! per-call deadlines or non-blocking with a [`Work`] handle. Two backends
//! sit behind the [`backend::Backend`] trait: [`BackendKind::Socket`] (pure
//! user space, the baseline and fallback) and [`BackendKind::Kernel`]
//! (contributions reduced by the node's XDP aggregator).
//!
//! - [`fragment`]: MTU-sized fragments, window sizing and reassembly.
//! - [`pmtu`]: path MTU discovery (the default `mtu`).
//! - [`position`]: where a new run of a node-served job starts (the node's
//!   answer to `AGP1`, for [`CommunicatorBuilder::resume`]).
//! - [`quantize`]: float ↔ int32 with fixed or adaptive scale.
//! - [`socket`], [`kernel`]: the aggregator side of each backend.
//! - [`comm`]: the communicator and its builder (the public API).
//! - `engine`: the communicator's state machine, with no socket and no
//!   clock (`handle(now, datagram)` / `poll_transmit(now)` /
//!   `poll_timeout()`); `calls`: the rounds each call makes; `driver`: the
//!   one I/O driver (socket, clock, progress thread); [`outbox`]: the
//!   datagrams between them.
//! - [`ring`]: ring allreduce over the node's ring memory
//!   ([`RingCommunicator`], docs/RING.md).
//! - [`striped`]: one vector over several jobs at once, a thread each.
//! - [`transport`]: the datagram transport, counters ([`CommStats`]) and the
//!   impairment test hook (drop / duplicate / reorder).
//! - [`work`]: non-blocking handles.
//!
//! `docs/RUNTIME.md` has the design, the failure behaviour and the numbers.

pub mod backend;
mod calls;
pub mod collective;
pub mod comm;
mod driver;
mod engine;
pub mod fragment;
pub mod kernel;
pub mod outbox;
pub mod pmtu;
pub mod position;
pub mod quantize;
pub mod ring;
pub mod socket;
pub mod striped;
pub mod transport;
pub mod tuner;
pub mod work;

pub use backend::BackendKind;
pub use collective::{Algorithm, Collective};
pub use comm::{
    CallOptions, CommConfig, Communicator, CommunicatorBuilder, Participant, ReduceOutput, TcGroup,
    DEFAULT_CALLER_SPIN,
};
pub use position::{query_position, NodePosition, PositionQueryError};
pub use quantize::Quantization;
pub use ring::{RingCommunicator, RingOutput};
pub use crate::wire::reliability::ReliabilityConfig;
pub use striped::StripedCommunicator;
pub use transport::{CommStats, ImpairControl, Impairment, IoStats, RefusedStats};
pub use work::Work;

use std::fmt;

use crate::wire::abi::Round;

/// A participant named in an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// Worker rank.
    Rank(u16),
    /// The aggregator (its node or its application).
    Aggregator,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Rank(r) => write!(f, "rank {r}"),
            Peer::Aggregator => f.write_str("aggregator"),
        }
    }
}

/// What a reduction had when its deadline passed (asked for with
/// [`CallOptions::partial`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partial {
    /// Complete fragments hold the result; incomplete ones the reduction of
    /// what arrived (socket backend) or 0 (kernel backend, unknown).
    pub values: Vec<i32>,
    /// Per fragment: how many ranks contributed (all of them for complete
    /// fragments; 0 where unknown).
    pub contributors: Vec<u16>,
    /// Elements per fragment.
    pub per_fragment: usize,
}

/// Details of a call that reached its deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimeoutInfo {
    /// `broadcast`, `reduce` or `allreduce`.
    pub op: &'static str,
    /// The call's round.
    pub round: Round,
    /// Who did not answer: the root of a broadcast, receivers that did not
    /// acknowledge, the aggregator, or ranks whose contributions are missing.
    pub missing: Vec<Peer>,
    /// False when the backend cannot tell which ranks are missing (kernel
    /// backend: the per-rank state is in the kernel's slots).
    pub missing_known: bool,
    /// How many fragments arrived (see `what`).
    pub arrived: usize,
    /// Out of how many.
    pub expected: usize,
    /// What `arrived` counts.
    pub what: String,
    /// The partial result, when asked for.
    pub partial: Option<Partial>,
}

/// Errors of runtime calls.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The deadline passed; see [`TimeoutInfo`].
    #[error("{} round {} timed out: missing {}; {}/{} {}", .0.op, .0.round, fmt_missing(&.0.missing, .0.missing_known), .0.arrived, .0.expected, .0.what)]
    Timeout(Box<TimeoutInfo>),
    /// A quantized result overflowed int32 at `scale` (never returned as a
    /// number).
    #[error("round {round}: quantized sum overflowed int32 at scale {scale:e}; use a smaller or adaptive scale")]
    Overflow {
        /// The round of the reduction.
        round: Round,
        /// The scale used.
        scale: f64,
    },
    /// Invalid configuration or arguments.
    #[error("runtime configuration: {0}")]
    Config(String),
    /// Socket or thread error.
    #[error("runtime I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The communicator's thread is gone.
    #[error("communicator closed")]
    Closed,
    /// A worker of a node-served job could not learn from the node where
    /// its run starts (`AGP1`), so it was not built.
    #[error("{0}")]
    Position(#[from] crate::runtime::position::PositionQueryError),
}

impl CommError {
    /// The timeout details, if this is a timeout.
    pub fn timeout(&self) -> Option<&TimeoutInfo> {
        match self {
            CommError::Timeout(t) => Some(t),
            _ => None,
        }
    }
}

fn fmt_missing(m: &[Peer], known: bool) -> String {
    if m.is_empty() {
        return if known {
            "nobody".into()
        } else {
            "unknown ranks (kernel backend)".into()
        };
    }
    m.iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
