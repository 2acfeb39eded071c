//! The entries one ring has in a node's pinned ring maps, counted map by
//! map (tests/bpf_ring.rs, tests/netns_ring.rs): what
//! `XdpPlane::remove_ring` must leave none of.
#![allow(dead_code)]

use std::path::Path;

use aggbox::kernel::maps::names;
use aggbox::wire::abi;
use libbpf_rs::{MapCore, MapFlags, MapHandle};

/// Non-zero entries of one ring, per map.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RingEntries {
    /// `ring_ports[port]`.
    pub port: usize,
    /// `ring_index[id]`.
    pub index: usize,
    /// `ring_jobs[dense]`.
    pub job: usize,
    /// `ring_members[dense · MAX_RANKS ..]`.
    pub members: usize,
    /// `ring_ctrl[dense]`.
    pub ctrl: usize,
    /// `ring_nexthop[dense]`.
    pub nexthop: usize,
    /// `ring_stats[dense]` (any CPU).
    pub stats: usize,
}

impl RingEntries {
    pub fn total(&self) -> usize {
        self.port + self.index + self.job + self.members + self.ctrl + self.nexthop + self.stats
    }
}

fn open(pin_dir: &Path, name: &str) -> MapHandle {
    MapHandle::from_pinned_path(pin_dir.join(name)).unwrap_or_else(|e| panic!("{name} pinned in {}: {e}", pin_dir.display()))
}

fn nonzero(map: &MapHandle, key: u32) -> usize {
    let v = map.lookup(&key.to_ne_bytes(), MapFlags::ANY).expect("lookup").unwrap_or_default();
    usize::from(v.iter().any(|&b| b != 0))
}

/// The entries of ring `id` on `port` at dense index `dense`.
pub fn ring_entries(pin_dir: &Path, dense: u32, id: u16, port: u16) -> RingEntries {
    let members = open(pin_dir, names::RING_MEMBERS);
    let stats = open(pin_dir, names::RING_STATS);
    let per_cpu = stats.lookup_percpu(&dense.to_ne_bytes(), MapFlags::ANY).expect("ring_stats").unwrap_or_default();
    RingEntries {
        port: nonzero(&open(pin_dir, names::RING_PORTS), u32::from(port)),
        index: nonzero(&open(pin_dir, names::RING_INDEX), u32::from(id)),
        job: nonzero(&open(pin_dir, names::RING_JOBS), dense),
        members: (0..abi::MAX_RANKS).map(|m| nonzero(&members, dense * abi::MAX_RANKS + m)).sum(),
        ctrl: nonzero(&open(pin_dir, names::RING_CTRL), dense),
        nexthop: nonzero(&open(pin_dir, names::RING_NEXTHOP), dense),
        stats: usize::from(per_cpu.iter().any(|cpu| cpu.iter().any(|&b| b != 0))),
    }
}

/// Non-zero entries of `ring_ports`, `ring_index` and `ring_jobs` over the
/// whole maps: one of each per ring the node has.
pub fn live_rings(pin_dir: &Path) -> [usize; 3] {
    let count = |name: &str, entries: u32| {
        let map = open(pin_dir, name);
        (0..entries).map(|k| nonzero(&map, k)).sum::<usize>()
    };
    [count(names::RING_PORTS, 65536), count(names::RING_INDEX, 65536), count(names::RING_JOBS, abi::MAX_RINGS)]
}
