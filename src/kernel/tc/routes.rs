//! Where a job's RESULTs go (`result_routes`): copies to a broadcast group
//! and an intermediate aggregator's contribution upstream.

use std::net::IpAddr;

use libbpf_rs::{MapCore, MapFlags};

use crate::wire::abi;
use crate::kernel::maps::names;

use super::{delete_ignore_missing, map_err, Result, TcError, TcPlane};

/// Where an intermediate aggregator sends each RESULT of a job: upstream,
/// as its own contribution to the parent's job (config
/// `parent = { addr, port, job, rank }` plus the job's `result_port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParentRoute {
    /// The parent aggregator's address, of the family of the job's
    /// RESULTs (a RESULT of the other family is dropped, counted
    /// `family_mismatch`).
    pub addr: IpAddr,
    /// The parent job's contribution port (non-zero).
    pub port: u16,
    /// The job id at the parent.
    pub job: u16,
    /// This node's rank in the parent job (not 0xffff, the RESULT rank).
    pub rank: u16,
    /// The local job's `result_port`: the UDP port its RESULTs arrive on
    /// (where the XDP aggregator addresses them), non-zero.
    pub result_port: u16,
}

impl ParentRoute {
    /// The route of a configured job's `parent` (its `result_port` included).
    pub fn from_config(job: &crate::config::JobConfig, parent: &crate::config::ParentConfig) -> Self {
        ParentRoute {
            addr: parent.addr.into(),
            port: parent.port,
            job: parent.job,
            rank: parent.rank,
            result_port: job.result_port,
        }
    }
}

/// Where the RESULTs of one job go besides the local result port, as
/// written in `result_routes` (see [`TcPlane::result_route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResultRouteInfo {
    /// UDP port the job's RESULTs arrive on.
    pub result_port: u16,
    /// Broadcast group whose members get a copy (allreduce), if any.
    pub group: Option<u16>,
    /// Parent aggregator (tree), if any.
    pub parent: Option<ParentRoute>,
}

impl TcPlane {
    /// In-kernel allreduce: each RESULT of `job` that arrives (from the XDP
    /// aggregator) at this interface, addressed to this host, UDP port
    /// `result_port`, is also copied to every member of broadcast group
    /// `group` (its root table, written with [`set_group`](Self::set_group);
    /// the mask covers all members): destination address, port and next-hop
    /// MAC written in, IP source = this host's address (the RESULT's
    /// destination), AGG1 header and payload unchanged, checksums valid (an
    /// IPv4 UDP checksum of 0 stays 0; IPv6's is never 0). The group's
    /// family is the RESULTs' (else they are dropped, `family_mismatch`).
    /// The RESULT itself is still delivered to
    /// the local stack unchanged. Keeps a parent route of the job (then the
    /// RESULT goes upstream instead of to the local stack).
    pub fn set_result_route(&self, job: u16, result_port: u16, group: u16) -> Result<()> {
        let mut route = self.route_for_update(job, result_port)?;
        route.group = group;
        route.flags |= abi::ROUTE_F_GROUP;
        self.write_route(job, &route)
    }

    /// Multi-level aggregation: each RESULT of `job` arriving at
    /// `parent.result_port` is rewritten into this node's contribution to
    /// the parent's job (job = `parent.job`, rank = `parent.rank`, RESULT
    /// flag cleared, LAST_FRAGMENT and OVERFLOW kept, seq/round/frag_off/op/
    /// count/payload unchanged; IP source = this host's address,
    /// destination = `parent.addr`, UDP port `parent.port`, next-hop MACs from
    /// the FIB) and sent out; it is not delivered locally. A result group
    /// of the job ([`set_result_route`](Self::set_result_route)) still gets
    /// its copies (of the RESULT, before the rewrite).
    pub fn set_parent_route(&self, job: u16, parent: &ParentRoute) -> Result<()> {
        let bad = |reason: String| TcError::InvalidRoute { job, reason };
        if parent.port == 0 {
            return Err(bad("the parent's port is 0".into()));
        }
        if parent.rank == abi::RESULT_RANK {
            return Err(bad(format!("rank {} is the RESULT rank, not a contributor's", parent.rank)));
        }
        let unicast = match parent.addr {
            IpAddr::V4(a) => !(a.is_unspecified() || a.is_broadcast() || a.is_multicast()),
            IpAddr::V6(a) => !(a.is_unspecified() || a.is_multicast() || a.to_ipv4_mapped().is_some()),
        };
        if !unicast {
            return Err(bad(format!("parent address {} is not unicast", parent.addr)));
        }
        let mut route = self.route_for_update(job, parent.result_port)?;
        (route.parent_family, route.parent_addr) = abi::family_addr(parent.addr);
        route.parent_port = parent.port.to_be();
        route.parent_job = parent.job;
        route.parent_rank = parent.rank;
        route.flags |= abi::ROUTE_F_PARENT;
        self.write_route(job, &route)
    }

    /// Remove every route of `job` (result group and parent): its RESULTs
    /// only go to the local result port again. No-op if none.
    pub fn remove_result_route(&self, job: u16) -> Result<()> {
        let key = abi::JobKey { job, pad: 0 };
        delete_ignore_missing(&self.skel.maps.result_routes, names::RESULT_ROUTES, abi::as_bytes(&key))
    }

    /// Remove only the parent route of `job` (its result group stays).
    pub fn remove_parent_route(&self, job: u16) -> Result<()> {
        let Some(mut route) = self.raw_route(job)? else {
            return Ok(());
        };
        route.flags &= !abi::ROUTE_F_PARENT;
        route.parent_family = abi::FAMILY_NONE;
        route.parent_addr = [0; 16];
        route.parent_port = 0;
        route.parent_job = 0;
        route.parent_rank = 0;
        if route.flags & abi::ROUTE_F_KNOWN == 0 {
            return self.remove_result_route(job);
        }
        self.write_route(job, &route)
    }

    /// The routes of `job` as written, `None` if it has none.
    pub fn result_route(&self, job: u16) -> Result<Option<ResultRouteInfo>> {
        Ok(self.raw_route(job)?.map(|r| ResultRouteInfo {
            result_port: r.result_port,
            group: (r.flags & abi::ROUTE_F_GROUP != 0).then_some(r.group),
            parent: (r.flags & abi::ROUTE_F_PARENT != 0)
                .then(|| {
                    Some(ParentRoute {
                        addr: abi::ip_of(r.parent_family, &r.parent_addr)?,
                        port: u16::from_be(r.parent_port),
                        job: r.parent_job,
                        rank: r.parent_rank,
                        result_port: r.result_port,
                    })
                })
                .flatten(),
        }))
    }

    fn raw_route(&self, job: u16) -> Result<Option<abi::ResultRoute>> {
        let key = abi::JobKey { job, pad: 0 };
        let raw = self
            .skel
            .maps
            .result_routes
            .lookup(abi::as_bytes(&key), MapFlags::ANY)
            .map_err(map_err(names::RESULT_ROUTES))?;
        Ok(raw.and_then(|b| abi::from_bytes::<abi::ResultRoute>(&b)))
    }

    /// The job's current route (or a fresh one) for an update naming
    /// `result_port`, which must agree with a route already there.
    fn route_for_update(&self, job: u16, result_port: u16) -> Result<abi::ResultRoute> {
        if result_port == 0 {
            return Err(TcError::InvalidRoute {
                job,
                reason: "result port 0".into(),
            });
        }
        match self.raw_route(job)? {
            Some(r) if r.result_port != result_port => Err(TcError::InvalidRoute {
                job,
                reason: format!(
                    "result port {result_port} differs from the route's {} (remove_result_route first)",
                    r.result_port
                ),
            }),
            Some(r) => Ok(r),
            None => Ok(abi::ResultRoute {
                result_port,
                ..Default::default()
            }),
        }
    }

    fn write_route(&self, job: u16, route: &abi::ResultRoute) -> Result<()> {
        let key = abi::JobKey { job, pad: 0 };
        self.skel
            .maps
            .result_routes
            .update(abi::as_bytes(&key), abi::as_bytes(route), MapFlags::ANY)
            .map_err(map_err(names::RESULT_ROUTES))
    }
}

