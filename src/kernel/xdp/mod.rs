//! The dataplane loader: opens and loads the AggBox XDP skeletons (the
//! aggregation chain and the ring program it tail-calls), attaches the
//! chain's entry program to an interface, writes job configuration into
//! their maps and reads their counters back.
//!
//! Map layout (see `src/bpf/aggbox_xdp.bpf.c` and `docs/DATAPLANE.md`):
//!
//! | map     | key                       | value                  | written by |
//! |---------|---------------------------|------------------------|------------|
//! | `ports` (array) | `u32` UDP port    | [`abi::Port`]          | control plane |
//! | `job_index` (array) | `u32` job id  | `u32` 1 + dense index, 0 = none | control plane |
//! | `jobs` (array) | `u32` dense index  | [`abi::Job`]           | control plane |
//! | `ranks` (array) | `u32` dense · 256 + rank | [`abi::Rank`]   | control plane |
//! | `stats` | `u32` outcome index       | [`abi::Stat`] per CPU  | XDP |
//! | `job_state` (array) | `u32` dense index | [`abi::JobState`]  | control plane zeroes, XDP updates |
//! | `job_round`, `job_paths` (arrays) | `u32` dense index | BPF-only (`src/bpf/slot.h`) | XDP; control plane zeroes |
//! | `fast_slots` (array) | `u32` slot index | BPF-only fast slot (`src/bpf/slot.h`) | XDP; control plane zeroes a region |
//! | `fast_stats` | `u32` `abi::FAST_*`  | `u64` per CPU          | XDP |
//! | `slots` | [`abi::SlotKey`]          | slot header (BPF-only, `src/bpf/slot.h`) | XDP |
//! | `blocks` | (SlotKey, chunk index)   | one chunk of s64 accumulators (BPF-only) | XDP |
//! | `completed` | [`abi::SlotKey`]      | `u32` marker (LRU)     | XDP |
//! | `progs` | `u32` `abi::CALL_*`       | program fd             | control plane, once at load |
//! | `scratch`, `slot_init` | `u32` 0    | per-CPU scratch        | XDP |
//! | `xsks`  | `u32` RX queue            | AF_XDP socket fd (XSKMAP) | user-space path |
//! | `xsk_limits` | `u32` 0              | `u32` longest frame redirected (0 = any) | user-space path |
//! | `slot_owner` | [`abi::SlotKey`]     | [`abi::SlotOwner`]     | XDP decides, the completing path deletes |
//! | `job_handoff` (array) | `u32` dense index | [`abi::JobHandoff`] | user-space path |
//! | `handoff_stats` | `u32` reason      | [`abi::Stat`] per CPU  | XDP |
//! | `job_stats` (per-CPU array) | `u32` dense index | [`abi::JobStats`] | control plane zeroes, XDP counts |
//!
//! Errors inside this module are typed ([`XdpError`]); callers at the
//! edges may wrap them in `anyhow`.
//!
//! One file per idea:
//!
//! - `load.rs`: which chain runs ([`Chain`]), loading the object
//!   ([`XdpPlane`]), its reset, program facts, pinning of its maps;
//! - `attach.rs`: the BPF link on an interface ([`XdpLink`]);
//! - `jobs.rs`: writing and removing jobs ([`XdpJob`]), reading them back;
//! - `ring.rs`: the ring program's object (loaded with the chain's), writing
//!   and removing rings and reading their counters;
//! - `ring_pool.rs`: where each ring sits in the ring maps ([`RingPool`]);
//! - `stats.rs`: the program's counters ([`Stats`]) and what is in use;
//! - `test_run.rs`: BPF_PROG_TEST_RUN ([`TestRunner`]);
//! - `kernel_maps.rs`: the maps the user-space path shares ([`KernelMaps`]);
//! - `fast_view.rs`: `fast_slots` mapped read-only.

use libbpf_rs::{MapCore, MapFlags};

use crate::kernel::maps;
use crate::wire::abi;

mod attach;
mod fast_view;
mod jobs;
mod kernel_maps;
mod load;
mod ring;
mod ring_pool;
mod stats;
mod test_run;

pub use attach::{XdpLink, XdpMode};
pub use jobs::{fast_granule, pinned_jobs, XdpJob};
pub use kernel_maps::{KernelMaps, Reclaim};
use kernel_maps::FAST_DISCARD_TRIES;
pub use load::{Chain, ProgramFacts, RingSizing, XdpPlane, CHAIN_ENV};
pub use ring_pool::{RingPlace, RingPool, RingPoolError, RingPoolUsage};
pub use stats::Stats;
pub use test_run::TestRunner;

#[allow(clippy::all, missing_docs, dead_code)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/aggbox_xdp.skel.rs"));
}

#[allow(clippy::all, missing_docs, dead_code)]
mod ring_skel {
    include!(concat!(env!("OUT_DIR"), "/aggbox_ring.skel.rs"));
}

/// Errors of the dataplane loader.
#[derive(Debug, thiserror::Error)]
pub enum XdpError {
    /// Opening, loading or verifying the BPF object failed.
    #[error("loading the XDP program: {0}")]
    Load(#[source] libbpf_rs::Error),
    /// A map operation failed.
    #[error("map `{map}`: {source}")]
    Map {
        /// Name of the map.
        map: &'static str,
        /// The libbpf error.
        #[source]
        source: libbpf_rs::Error,
    },
    /// Attaching the XDP program to the interface failed in every mode tried.
    #[error("attaching XDP to ifindex {ifindex}: {source}")]
    Attach {
        /// Interface index.
        ifindex: u32,
        /// Last OS error.
        #[source]
        source: std::io::Error,
    },
    /// The chain override ([`CHAIN_ENV`]) names no chain.
    #[error("choosing the XDP chain: {0}")]
    Chain(String),
    /// A job configuration was rejected before touching any map.
    #[error("job {job}: {reason}")]
    InvalidJob {
        /// Job id.
        job: u16,
        /// What is wrong.
        reason: String,
    },
    /// A ring configuration was rejected before touching any map.
    #[error("ring {ring}: {reason}")]
    InvalidRing {
        /// Ring id.
        ring: u16,
        /// What is wrong.
        reason: String,
    },
    /// BPF_PROG_TEST_RUN failed.
    #[error("BPF_PROG_TEST_RUN: {0}")]
    TestRun(#[source] libbpf_rs::Error),
    /// A fast slot stayed locked through every try of the control plane.
    #[error("fast slot {index}: its lock stayed held through {FAST_DISCARD_TRIES} tries")]
    FastSlotBusy {
        /// Index in `fast_slots`.
        index: u32,
    },
    /// Pinning failed.
    #[error(transparent)]
    Pin(#[from] maps::PinError),
    /// [`XdpPlane::reset`] could not return a map to its state at load.
    #[error(transparent)]
    Reset(#[from] maps::ResetError),
}

/// Result type of this module.
pub type Result<T, E = XdpError> = std::result::Result<T, E>;

/// Look `key` up in `map` and read the value as `V` (`None` when absent).
fn lookup_plain<K: plain::Plain, V: plain::Plain + Default, M: MapCore>(map: &M, name: &'static str, key: &K) -> Result<Option<V>> {
    let raw = map
        .lookup(abi::as_bytes(key), MapFlags::ANY)
        .map_err(|source| XdpError::Map { map: name, source })?;
    Ok(raw.and_then(|bytes| abi::from_bytes::<V>(&bytes)))
}

/// Entry `index` of an array map (a plain struct), `None` only if the index
/// is past the array.
fn lookup_array<V: plain::Plain + Default>(map: &impl MapCore, name: &'static str, index: u32) -> Result<Option<V>> {
    lookup_plain(map, name, &index)
}

/// Write entry `index` of an array map.
fn update_array<V: plain::Plain>(map: &impl MapCore, name: &'static str, index: u32, value: &V) -> Result<()> {
    map.update(&index.to_ne_bytes(), abi::as_bytes(value), MapFlags::ANY)
        .map_err(|source| XdpError::Map { map: name, source })
}

fn delete_ignore_missing<M: MapCore>(map: &M, name: &'static str, key: &[u8]) -> Result<()> {
    maps::delete_if_present(map, key).map_err(|source| XdpError::Map { map: name, source })
}
