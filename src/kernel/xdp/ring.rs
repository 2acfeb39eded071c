//! The ring program's object (`src/bpf/aggbox_ring.bpf.c`, docs/RING.md):
//! its load beside the aggregation chain, and rings in its maps: a ring's
//! members, job entry, control block and port, its next hop, its memory
//! maps and counters.

use std::net::IpAddr;
use std::os::fd::BorrowedFd;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use crate::kernel::object::ObjectSlot;
use libbpf_rs::{MapCore, MapFlags};

use crate::kernel::maps::{self, names};
use crate::wire::abi;

use super::ring_skel::{AggboxRingSkel, AggboxRingSkelBuilder};
use super::{update_array, Chain, Result, RingSizing, XdpError, XdpPlane};

/// The loaded ring object: the ring program's two builds (one loaded) and
/// its maps. The aggregation chain's entry program tail-calls it at
/// `abi::CALL_RING` ([`XdpPlane`] fills that slot).
pub(super) struct RingObject {
    // Field order matters: the skeleton borrows `_object` and must drop first.
    pub(super) skel: AggboxRingSkel<'static>,
    _object: ObjectSlot,
}

impl RingObject {
    /// Maps of the ring object that are the aggregation chain's, handed to
    /// it at load (`src/bpf/ring_ports.h`): pinned and written with the
    /// chain's object.
    pub(super) const SHARED_MAPS: &'static [&'static str] = &[names::RING_PORTS];

    /// Open and load the ring program of `chain`'s build, its maps sized by
    /// `rings` (a ring's memory is fixed at load), with `ring_ports` (the
    /// aggregation chain's map) reused, so both programs read one map.
    pub(super) fn load(chain: Chain, rings: RingSizing, ring_ports: BorrowedFd<'_>) -> Result<Self> {
        let (object, object_ref) = ObjectSlot::new();
        let mut open = AggboxRingSkelBuilder::default()
            .open(object_ref)
            .map_err(XdpError::Load)?;
        let frags = chain == Chain::Frags;
        open.progs.aggbox_ring.set_autoload(frags);
        open.progs.aggbox_ring_linear.set_autoload(!frags);
        let map_error = |map: &'static str| move |source| XdpError::Map { map, source };
        open.maps.ring_ports.reuse_fd(ring_ports).map_err(map_error(names::RING_PORTS))?;
        open.maps
            .ring_data
            .set_value_size(4 * rings.frag_elems)
            .map_err(map_error(names::RING_DATA))?;
        open.maps
            .ring_data
            .set_max_entries(rings.map_entries())
            .map_err(map_error(names::RING_DATA))?;
        open.maps
            .ring_done
            .set_max_entries(rings.map_entries())
            .map_err(map_error(names::RING_DONE))?;
        if let Some(rodata) = open.maps.rodata_data.as_deref_mut() {
            rodata.ring_frag_elems = rings.frag_elems;
        }
        let skel = open.load().map_err(XdpError::Load)?;
        Ok(RingObject { skel, _object: object })
    }

    /// Name and program of the ring stage of `chain`'s build.
    pub(super) fn program(&self, chain: Chain) -> (&'static str, &libbpf_rs::Program<'static>) {
        match chain {
            Chain::Frags => ("aggbox_ring", &self.skel.progs.aggbox_ring),
            Chain::Linear => ("aggbox_ring_linear", &self.skel.progs.aggbox_ring_linear),
        }
    }
}

/// Why `members` cannot be a ring's members in the kernel, or `None`: a
/// mix of IPv4 and IPv6 (the ring program checks every sender's version
/// against its member's, and sends in one version), or an IPv4-mapped IPv6
/// address (no IPv6 datagram comes from one).
fn ring_members_problem(members: &[IpAddr]) -> Option<String> {
    if let Some(mapped) = members.iter().find(|a| matches!(a, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some())) {
        return Some(format!("member {mapped} is an IPv4-mapped IPv6 address; give an IPv4 ring its IPv4 addresses"));
    }
    let v4 = members.iter().filter(|a| a.is_ipv4()).count();
    if v4 != 0 && v4 != members.len() {
        return Some(format!(
            "{v4} IPv4 and {} IPv6 members; a ring's members are all of one IP version",
            members.len() - v4
        ));
    }
    None
}

impl XdpPlane {
    /// Configure ring `dense` (docs/RING.md): its region of `ring_data` /
    /// `ring_done` (`job.base ..`, which must exist: [`super::RingPool`])
    /// and its index's control block, next hop, counters and members
    /// cleared of whatever ring held them before, then its members'
    /// addresses (weights in `job`), its job entry, and last its id and
    /// port, so a datagram never finds a port whose entries are not the
    /// ring's and a ring never sees another ring's results.
    ///
    /// `members` are all IPv4 or all IPv6 (an IPv4-mapped IPv6 address is
    /// neither: write the IPv4 address), in ring order; a ring of another
    /// kind is refused before any map is touched. An IPv4 ring sends from
    /// `job.self_addr` to `job.next_addr`, an IPv6 ring from its member
    /// `job.me` to member `(job.me + 1) % members` (its `self_addr` and
    /// `next_addr` are not read).
    pub fn set_ring(&self, dense: u32, job: &abi::RingJob, members: &[IpAddr]) -> Result<()> {
        let invalid = |map| XdpError::Map {
            map,
            source: libbpf_rs::Error::from(std::io::Error::from(std::io::ErrorKind::InvalidInput)),
        };
        if let Some(reason) = ring_members_problem(members) {
            return Err(XdpError::InvalidRing { ring: job.id, reason });
        }
        if dense >= abi::MAX_RINGS || members.len() != usize::from(job.members) || members.len() > abi::MAX_RANKS as usize {
            return Err(invalid(names::RING_JOBS));
        }
        let entries = self.ring.skel.maps.ring_data.max_entries();
        if u64::from(job.base) + u64::from(job.entries()) > u64::from(entries) {
            return Err(invalid(names::RING_DATA));
        }
        let zero = |map: &libbpf_rs::Map<'static>, name: &'static str, first: u32, count: u32| {
            maps::zero_array_range(map, first, count).map_err(|source| XdpError::Map { map: name, source })
        };
        zero(&self.ring.skel.maps.ring_done, names::RING_DONE, job.base, job.entries())?;
        zero(&self.ring.skel.maps.ring_data, names::RING_DATA, job.base, job.entries())?;
        self.zero_ring_entries(dense)?;
        for (i, addr) in members.iter().enumerate() {
            let rank = abi::Rank::new(*addr, 0);
            update_array(&self.ring.skel.maps.ring_members, names::RING_MEMBERS, dense * abi::MAX_RANKS + i as u32, &rank)?;
        }
        update_array(&self.ring.skel.maps.ring_jobs, names::RING_JOBS, dense, job)?;
        update_array(&self.ring.skel.maps.ring_index, names::RING_INDEX, u32::from(job.id), &(dense + 1))?;
        update_array(&self.skel.maps.ring_ports, names::RING_PORTS, u32::from(job.port), &(dense + 1))
    }

    /// Remove ring `dense` (written as `job`): its port and id first (from
    /// then on its datagrams are no ring's: they pass to the stack), then
    /// its job entry, members, control block, next hop and counters. Its
    /// region of `ring_data` / `ring_done` is left as it is until a ring
    /// is written there ([`XdpPlane::set_ring`] clears it). A port or id
    /// that points at another index (written since) is left alone, and
    /// removing what is gone does nothing.
    pub fn remove_ring(&self, dense: u32, job: &abi::RingJob) -> Result<()> {
        if dense >= abi::MAX_RINGS {
            return Ok(());
        }
        let ring = &self.ring.skel.maps;
        for (map, name, key) in
            [(&self.skel.maps.ring_ports, names::RING_PORTS, u32::from(job.port)), (&ring.ring_index, names::RING_INDEX, u32::from(job.id))]
        {
            if super::lookup_array::<u32>(map, name, key)? == Some(dense + 1) {
                update_array(map, name, key, &0u32)?;
            }
        }
        update_array(&ring.ring_jobs, names::RING_JOBS, dense, &abi::RingJob::default())?;
        self.zero_ring_entries(dense)
    }

    /// Zero what ring index `dense` holds besides its job entry: members,
    /// control block, next hop (a new ring must resolve its own) and
    /// per-CPU counters.
    fn zero_ring_entries(&self, dense: u32) -> Result<()> {
        let ring = &self.ring.skel.maps;
        let zero = |map: &libbpf_rs::Map<'static>, name: &'static str, first: u32, count: u32| {
            maps::zero_array_range(map, first, count).map_err(|source| XdpError::Map { map: name, source })
        };
        zero(&ring.ring_members, names::RING_MEMBERS, dense * abi::MAX_RANKS, abi::MAX_RANKS)?;
        zero(&ring.ring_ctrl, names::RING_CTRL, dense, 1)?;
        zero(&ring.ring_nexthop, names::RING_NEXTHOP, dense, 1)?;
        let ncpu = libbpf_rs::num_possible_cpus().map_err(|source| XdpError::Map { map: names::RING_STATS, source })?;
        let zeros = vec![vec![0u8; ring.ring_stats.value_size() as usize]; ncpu];
        ring.ring_stats
            .update_percpu(&dense.to_ne_bytes(), &zeros, MapFlags::ANY)
            .map_err(|source| XdpError::Map { map: names::RING_STATS, source })
    }

    /// Handles of the ring memory maps (`ring_data`, `ring_done`,
    /// `ring_ctrl`), for the node's ring service and tests in this process.
    pub fn ring_memory_maps(&self) -> Result<[libbpf_rs::MapHandle; 3]> {
        let handle = |map: &libbpf_rs::Map<'static>, name: &'static str| {
            libbpf_rs::MapHandle::try_from(map).map_err(|source| XdpError::Map { map: name, source })
        };
        Ok([
            handle(&self.ring.skel.maps.ring_data, names::RING_DATA)?,
            handle(&self.ring.skel.maps.ring_done, names::RING_DONE)?,
            handle(&self.ring.skel.maps.ring_ctrl, names::RING_CTRL)?,
        ])
    }

    /// Put a resolved next hop for ring `dense` into the program's cache, as
    /// if `bpf_fib_lookup` had just answered (it is used for a second):
    /// lets BPF_PROG_TEST_RUN tests, whose frames have no route, see the
    /// forwarded datagram.
    pub fn set_ring_next_hop(&self, dense: u32, dmac: [u8; 6], smac: [u8; 6], ifindex: u32) -> Result<()> {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: valid clock id and out pointer. bpf_ktime_get_ns is CLOCK_MONOTONIC.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let now = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
        let mut value = Vec::with_capacity(24);
        value.extend_from_slice(&dmac);
        value.extend_from_slice(&smac);
        value.extend_from_slice(&ifindex.to_ne_bytes());
        value.extend_from_slice(&now.to_ne_bytes());
        self.ring
            .skel
            .maps
            .ring_nexthop
            .update(&dense.to_ne_bytes(), &value, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: names::RING_NEXTHOP,
                source,
            })
    }

    /// Ring `dense`'s counters summed over CPUs (`abi::RingStat` indexes).
    pub fn ring_stats(&self, dense: u32) -> Result<abi::RingStats> {
        Ok(maps::lookup_percpu_sum(&self.ring.skel.maps.ring_stats, &dense.to_ne_bytes())
            .map_err(|source| XdpError::Map {
                map: names::RING_STATS,
                source,
            })?
            .unwrap_or_default())
    }
}
