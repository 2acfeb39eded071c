//! The wire layer: what AggBox datagrams and BPF maps hold, written once for
//! the Rust side. Nothing here does I/O or touches the kernel, except
//! [`ring_memory`], which maps the pinned ring maps that the XDP program,
//! the node and the runtime share (the layout is the ABI; the node and the
//! runtime both map it, and neither may import the other's layer).
//!
//! - [`abi`]: Rust mirror of `include/aggbox/abi.h` (wire headers, map
//!   structs, drop reasons, serial round comparison).
//! - [`frame`]: Ethernet / IPv4 / UDP frames parsed as the XDP program
//!   parses them (the twin of `src/bpf/parse.h`), for the AF_XDP path.
//! - [`proto`]: encode, decode and validate AGG1 / AGB1 / AGK1 datagrams.
//! - [`map_names`]: the names the node pins the programs' maps under.
//! - [`reducer`]: the reference reducer, oracle for the kernel path and core
//!   of the user-space aggregators.
//! - [`reliability`]: sequence windows, ACK trackers and the RTT estimator:
//!   the one seq / ACK / retransmit implementation, used by the runtime and
//!   by the node's result service.
//! - [`ring`]: AGR1 ring datagrams, where a fragment travels, and the
//!   arithmetic of one hop (docs/RING.md).
//! - [`ring_memory`]: `ring_data`, `ring_done` and `ring_ctrl` mapped
//!   into this process as atomics, and the rules their user-space writers
//!   follow (ring allreduce, docs/RING.md).
//! - [`slots`]: the aggregation slot and its rule for adding a contribution,
//!   and the slot table both user-space aggregators keep.

pub mod abi;
pub mod control;
pub mod frame;
pub mod map_names;
pub mod proto;
pub mod reducer;
pub mod reliability;
pub mod ring;
pub mod ring_memory;
pub(crate) mod rng;
pub mod slots;
