//! The errors of runtime calls, and who they name: beneath the engine and
//! the public API, which both return them.

use std::fmt;

use crate::runtime::position::PositionQueryError;
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
/// [`crate::runtime::CallOptions::partial`]).
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
    Position(#[from] PositionQueryError),
    /// The node no longer serves this run's job on demand (it restarted,
    /// or the job's lease ran out): the message names the node and why.
    #[error("{0}")]
    JobLost(String),
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
