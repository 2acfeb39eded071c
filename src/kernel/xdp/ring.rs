//! Rings in the XDP maps (docs/RING.md): a ring's members, job entry,
//! control block and port, its next hop, its memory maps and counters.

use libbpf_rs::{MapCore, MapFlags};

use crate::kernel::maps::{self, names};
use crate::wire::abi;

use super::{update_array, Result, XdpError, XdpPlane};

impl XdpPlane {
    /// Configure ring `dense` (docs/RING.md): its members' addresses
    /// (weights in `job`), its job entry, a zeroed control block, then its
    /// id and port, so a datagram never finds a port whose entries are not
    /// the ring's. The ring's fragments `job.base ..` must exist in
    /// ring_data ([`RingSizing`]).
    pub fn set_ring(&self, dense: u32, job: &abi::RingJob, members: &[std::net::Ipv4Addr]) -> Result<()> {
        if dense >= abi::MAX_RINGS || members.len() != usize::from(job.members) || members.len() > abi::MAX_RANKS as usize {
            return Err(XdpError::Map {
                map: names::RING_JOBS,
                source: libbpf_rs::Error::from(std::io::Error::from(std::io::ErrorKind::InvalidInput)),
            });
        }
        for (i, addr) in members.iter().enumerate() {
            let rank = abi::Rank {
                addr: u32::from(*addr).to_be(),
                weight: 0,
            };
            update_array(&self.skel.maps.ring_members, names::RING_MEMBERS, dense * abi::MAX_RANKS + i as u32, &rank)?;
        }
        update_array(&self.skel.maps.ring_jobs, names::RING_JOBS, dense, job)?;
        update_array(&self.skel.maps.ring_ctrl, names::RING_CTRL, dense, &abi::RingCtrl::default())?;
        update_array(&self.skel.maps.ring_index, names::RING_INDEX, u32::from(job.id), &(dense + 1))?;
        update_array(&self.skel.maps.ring_ports, names::RING_PORTS, u32::from(job.port), &(dense + 1))
    }

    /// Handles of the ring memory maps (`ring_data`, `ring_done`,
    /// `ring_ctrl`), for the node's ring service and tests in this process.
    pub fn ring_memory_maps(&self) -> Result<[libbpf_rs::MapHandle; 3]> {
        let handle = |map: &libbpf_rs::Map<'static>, name: &'static str| {
            libbpf_rs::MapHandle::try_from(map).map_err(|source| XdpError::Map { map: name, source })
        };
        Ok([
            handle(&self.skel.maps.ring_data, names::RING_DATA)?,
            handle(&self.skel.maps.ring_done, names::RING_DONE)?,
            handle(&self.skel.maps.ring_ctrl, names::RING_CTRL)?,
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
        self.skel
            .maps
            .ring_nexthop
            .update(&dense.to_ne_bytes(), &value, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: "ring_nexthop",
                source,
            })
    }

    /// Ring `dense`'s counters summed over CPUs (`abi::RingStat` indexes).
    pub fn ring_stats(&self, dense: u32) -> Result<abi::RingStats> {
        Ok(maps::lookup_percpu_sum(&self.skel.maps.ring_stats, &dense.to_ne_bytes())
            .map_err(|source| XdpError::Map {
                map: names::RING_STATS,
                source,
            })?
            .unwrap_or_default())
    }
}
