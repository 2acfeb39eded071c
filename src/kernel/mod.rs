//! The kernel layer: user-space halves of the BPF programs in `src/bpf/`,
//! one module per program, named after its hook.
//!
//! - [`xdp`]: loads the aggregation skeleton (`aggbox_xdp.bpf.c`), attaches
//!   it, writes jobs into its maps and reads its counters.
//! - [`tc`]: the broadcast programs (`aggbox_tc.bpf.c`): group tables,
//!   next-hop cache, broadcast trees.
//! - [`maps`]: what the programs' maps share: pinned names, pinning,
//!   per-CPU sums.
//! - [`object`]: where a loaded skeleton's object lives.
//! - [`xsk`]: a receive-only AF_XDP socket, one per RX queue.
//! - [`afxdp`]: the user-space aggregation path fed by those sockets, for
//!   what the XDP program hands over.

pub mod afxdp;
pub mod maps;
pub mod object;
// The ring memory moved to the wire layer, which the runtime may use; its
// old path stays.
pub use crate::wire::ring_memory;
pub mod tc;
pub mod xdp;
pub mod xsk;
