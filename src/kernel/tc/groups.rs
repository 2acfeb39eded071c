//! Broadcast groups in the TC maps: group tables (root and forwarding),
//! their counters, and the next-hop cache.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use libbpf_rs::{MapCore, MapFlags};

use crate::wire::abi;
use crate::kernel::maps::{self, names};

use super::{map_err, num_possible_cpus, Result, TcError, TcPlane};

/// One entry of the next-hop cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeighEntry {
    /// Destination (IPv4 or IPv6).
    pub addr: IpAddr,
    /// Interface the lookup was made for.
    pub lookup_ifindex: u32,
    /// What the FIB said (MACs, egress interface, stale flag, time).
    pub neigh: abi::Neigh,
}

impl NeighEntry {
    /// Marked stale by its timer (re-resolved on next use).
    pub fn is_stale(&self) -> bool {
        self.neigh.flags & abi::NEIGH_F_STALE != 0
    }
}

impl TcPlane {
    /// Change the next-hop cache lifetime. Applies to entries resolved from
    /// now on (an entry's timer is armed when it is resolved).
    pub fn set_neigh_ttl(&self, ttl: Duration) -> Result<()> {
        let mut cfg = self.config()?;
        cfg.neigh_ttl_ns = u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX);
        self.write_config(&cfg)
    }

    /// `bcast_config` as it is now.
    pub fn config(&self) -> Result<abi::BcastConfig> {
        let value = self
            .skel
            .maps
            .bcast_config
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .map_err(map_err(names::BCAST_CONFIG))?;
        Ok(value.and_then(|v| abi::from_bytes(&v)).unwrap_or_default())
    }

    pub(super) fn write_config(&self, cfg: &abi::BcastConfig) -> Result<()> {
        self.skel
            .maps
            .bcast_config
            .update(&0u32.to_ne_bytes(), abi::as_bytes(cfg), MapFlags::ANY)
            .map_err(map_err(names::BCAST_CONFIG))
    }

    /// Drop every next-hop cache entry (the next datagrams re-resolve).
    pub fn flush_neigh_cache(&self) -> Result<()> {
        maps::delete_where::<abi::NeighKey>(&self.skel.maps.bcast_neigh, |_| true).map_err(map_err(names::BCAST_NEIGH))
    }

    /// The next-hop cache.
    pub fn neigh_cache(&self) -> Result<Vec<NeighEntry>> {
        let entries = maps::entries::<abi::NeighKey, abi::Neigh>(&self.skel.maps.bcast_neigh).map_err(map_err(names::BCAST_NEIGH))?;
        Ok(entries
            .into_iter()
            .filter_map(|(key, neigh)| {
                Some(NeighEntry {
                    addr: key.ip()?,
                    lookup_ifindex: key.ifindex,
                    neigh,
                })
            })
            .collect())
    }

    /// Write the root table of group `id`: mask bit i goes to `members[i]`
    /// (1..=32 members, IPv4 or IPv6, all of one family: the table copies
    /// only datagrams of that family, counting the others
    /// `family_mismatch`). Also the table a tree node uses for FORWARD
    /// datagrams of `id` arriving on any port.
    pub fn set_group<A: Into<SocketAddr> + Copy>(&self, id: u16, members: &[A]) -> Result<()> {
        self.write_group(id, abi::BCAST_PORT_ANY, members)
    }

    /// Write a tree node's table: FORWARD datagrams of group `id` arriving
    /// on UDP port `receive_port` (this node's own member port, non-zero)
    /// are re-broadcast to `children` with hops + 1.
    pub fn set_forwarding<A: Into<SocketAddr> + Copy>(&self, id: u16, receive_port: u16, children: &[A]) -> Result<()> {
        if receive_port == 0 {
            return Err(TcError::InvalidGroup {
                group: id,
                reason: "forwarding table for port 0: use set_group".into(),
            });
        }
        self.write_group(id, receive_port, children)
    }

    fn write_group<A: Into<SocketAddr> + Copy>(&self, id: u16, port: u16, members: &[A]) -> Result<()> {
        let members: Vec<SocketAddr> = members.iter().map(|&m| m.into()).collect();
        let bad = |reason: String| TcError::InvalidGroup { group: id, reason };
        if members.is_empty() || members.len() > abi::BCAST_MAX_DESTS as usize {
            return Err(bad(format!(
                "{} destinations; a table has 1..={}",
                members.len(),
                abi::BCAST_MAX_DESTS
            )));
        }
        if let Some(m) = members.iter().find(|m| m.port() == 0 || m.ip().is_unspecified()) {
            return Err(bad(format!("destination {m} has no address or port")));
        }
        if let Some(m) = members.iter().find(|m| matches!(m.ip(), IpAddr::V6(a) if a.to_ipv4_mapped().is_some())) {
            return Err(bad(format!("destination {m} is an IPv4-mapped IPv6 address: give the IPv4 address")));
        }
        if let Some(m) = members.iter().find(|m| m.is_ipv4() != members[0].is_ipv4()) {
            return Err(bad(format!(
                "destinations {} and {m} mix IPv4 and IPv6: a table's destinations are all of one family",
                members[0]
            )));
        }
        let mut value = abi::Group {
            count: members.len() as u32,
            ..Default::default()
        };
        for (d, m) in value.dests.iter_mut().zip(&members) {
            *d = abi::GroupDest::new(*m);
        }
        let key = abi::GroupKey { group: id, port };
        // counters first, so the programs find them with the table
        let zeros = vec![vec![0u8; std::mem::size_of::<abi::BcastGroupStat>()]; num_possible_cpus()?];
        match self
            .skel
            .maps
            .bcast_gstats
            .update_percpu(abi::as_bytes(&key), &zeros, MapFlags::NO_EXIST)
        {
            Ok(()) => {}
            Err(e) if e.kind() == libbpf_rs::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(map_err(names::BCAST_GSTATS)(e)),
        }
        self.skel
            .maps
            .bcast_groups
            .update(abi::as_bytes(&key), abi::as_bytes(&value), MapFlags::ANY)
            .map_err(map_err(names::BCAST_GROUPS))
    }

    /// Remove every table of group `id` (root and forwarding) and its
    /// counters. No-op if unknown.
    pub fn remove_group(&self, id: u16) -> Result<()> {
        for (map, name) in [
            (&self.skel.maps.bcast_groups, names::BCAST_GROUPS),
            (&self.skel.maps.bcast_gstats, names::BCAST_GSTATS),
        ] {
            maps::delete_where::<abi::GroupKey>(map, |k| k.group == id).map_err(map_err(name))?;
        }
        Ok(())
    }

    /// The table of `(id, port)` as written (port 0 = root table).
    pub fn group(&self, id: u16, port: u16) -> Result<Option<Vec<SocketAddr>>> {
        let key = abi::GroupKey { group: id, port };
        let raw = self
            .skel
            .maps
            .bcast_groups
            .lookup(abi::as_bytes(&key), MapFlags::ANY)
            .map_err(map_err(names::BCAST_GROUPS))?;
        Ok(raw.and_then(|b| abi::from_bytes::<abi::Group>(&b)).map(|g| {
            g.dests
                .iter()
                .take(g.count.min(abi::BCAST_MAX_DESTS) as usize)
                .filter_map(|d| d.socket_addr())
                .collect()
        }))
    }

    /// Per-group counters of table `(id, port)`, summed over CPUs.
    pub fn group_stats(&self, id: u16, port: u16) -> Result<Option<abi::BcastGroupStat>> {
        let key = abi::GroupKey { group: id, port };
        maps::lookup_percpu_sum(&self.skel.maps.bcast_gstats, abi::as_bytes(&key)).map_err(map_err(names::BCAST_GSTATS))
    }
}

