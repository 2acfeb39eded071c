//! AggBox: in-kernel aggregation and broadcast for distributed communication.
//!
//! The library holds the product; `src/main.rs` (the `aggbox` binary) is a
//! thin command line over it. The evaluation is an executable of its own
//! on this public API (`src/bin/aggbox-bench/`, `make bench`), and the
//! network-namespace testbed it shares with the tests lives in
//! `src/testing/`, outside the library.
//!
//! - [`abi`]: Rust mirror of `include/aggbox/abi.h` (wire headers, map structs).
//! - [`proto`]: encode, decode and validate AGG1 / AGB1 / AGK1 datagrams.
//! - [`reducer`]: the reference reducer, oracle for the kernel path and core of
//!   the socket baseline.
//! - [`dataplane`]: loads the BPF skeletons, attaches, configures, reads counters.
//! - [`xsk`], [`userspace`]: the AF_XDP socket and the user-space aggregation path.
//! - [`netif`]: interface facts (MTU) that the node and the runtime both read.

pub mod abi;
pub mod broadcast;
pub mod config;
pub mod dataplane;
pub mod proto;
pub mod reducer;
pub mod runtime;
pub mod metrics;
pub mod netif;
pub mod node;
pub mod tools;
pub mod userspace;
pub mod xsk;
