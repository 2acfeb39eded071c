//! AggBox: in-kernel aggregation and broadcast for distributed communication.
//!
//! The library holds the product; `src/main.rs` (the `aggbox` binary) is a
//! thin command line over it. The evaluation is an executable of its own
//! on this public API (`src/bin/aggbox-bench/`, `make bench`), and the
//! network-namespace testbed it shares with the tests lives in
//! `src/testing/`, outside the library.
//!
//! The folders are the layers, and dependencies point one way:
//! `wire` ← `config` ← `kernel` ← `node`, and `wire` ← `config` ← `runtime`.
//! `wire` imports nothing of the crate, `config` only `wire`; `node` and
//! `runtime` never import each other, nor `runtime` the `kernel`: what both
//! stacks need lives in `wire` (the ring memory, the fragment size).
//! `netif` imports nothing and the layers above `config` may read it. In
//! the runtime, the public API (`comm`, `calls`, `driver`, `striped`,
//! `collective`, `ring`, `runtime/mod.rs`) sits on the engine and the
//! modules it is built from, which never import the API. Unit tests may use
//! any layer. `tests/layers.rs` checks every import against these rules.
//!
//! - [`wire`]: what is on the wire and in the maps: the ABI mirror of
//!   `include/aggbox/abi.h`, the message codecs, the reference reducer.
//! - [`config`]: the node TOML that the daemon and the workers' runtime both
//!   read (one file describes a deployment).
//! - [`netif`]: interface facts (MTU) that the node and the runtime both read.
//! - [`kernel`]: the BPF programs' user-space halves: the XDP aggregator,
//!   the TC broadcaster, AF_XDP sockets and the user-space aggregation path
//!   they feed.
//! - [`node`]: `aggbox attach` and its services: pins, status, upkeep,
//!   Prometheus metrics, operator tools.
//! - [`runtime`]: the application library (broadcast / reduce / allreduce):
//!   a state machine without I/O and the driver that gives it sockets.

pub mod config;
pub mod kernel;
pub mod netif;
pub mod node;
pub mod runtime;
pub mod wire;
