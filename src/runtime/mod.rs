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
//! - `error`: [`CommError`] and who it names ([`Peer`], [`TimeoutInfo`]).
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

pub mod api;
pub mod backend;
mod calls;
pub mod collective;
pub mod comm;
pub mod control;
mod driver;
mod engine;
mod error;
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
pub use api::{Algorithm, Collective, Element, Elements, Served, WireElement};
pub use collective::StarOrRing;
pub use error::{CommError, Partial, Peer, TimeoutInfo};
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
