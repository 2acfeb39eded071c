//! The node's kernel state as a value: what the maps of the XDP and TC
//! planes hold for a configuration, and the changes between two of them.
//!
//! This is the one place where a [`Config`] becomes map writes. `attach`
//! applies the changes from [`KernelState::default`] (empty maps) to the
//! config's state; `reload` applies the changes from the running state to
//! the new one; a failure part way is rolled back by applying the changes
//! from the target back to the state it started from. That works because
//! every change is idempotent (a set overwrites, a remove of what is absent
//! does nothing), so the inverse difference restores the old state from any
//! point in between (the entries, not what was in flight: a job removed
//! and written back starts with empty slots). Jobs created at run time enter here as more entries of
//! the same value.
//!
//! What is not kernel map state stays with its owner: the result service's
//! bound ports (`serve::BoundJobs`, `serve::ServedChange`) and the AF_XDP
//! path's user-space slots (`UserspacePath::reconfigure`), both driven from
//! the same configs by `attach` and `reload`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use anyhow::{anyhow, Result};

use crate::config::{Config, JobConfig};
use crate::kernel::tc::{ParentRoute, TcPlane};
use crate::kernel::xdp::{XdpJob, XdpPlane};
use crate::wire::abi;

/// Where the kernel sends a job's RESULTs besides its local result port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JobRoutes {
    /// In-kernel allreduce: (result port, group) whose members get a copy.
    pub result_group: Option<(u16, u16)>,
    /// Tree: the parent aggregator the RESULTs go to as a contribution.
    pub parent: Option<ParentRoute>,
}

impl JobRoutes {
    fn is_empty(&self) -> bool {
        self.result_group.is_none() && self.parent.is_none()
    }
}

/// Every entry AggBox writes into the kernel's maps for one configuration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KernelState {
    /// Aggregation jobs by id (`jobs`, `ranks`, `job_index`, `ports`).
    pub jobs: BTreeMap<u16, XdpJob>,
    /// Rings by dense index with their members (`ring_jobs`, `ring_index`,
    /// `ring_ports`, `ring_members`), each in its region of the ring memory
    /// reserved at load (`RingJob::base`, placed by `RingPool`).
    pub rings: BTreeMap<u32, (abi::RingJob, Vec<IpAddr>)>,
    /// Broadcast groups' root tables by id (`bcast_groups`).
    pub groups: BTreeMap<u16, Vec<SocketAddr>>,
    /// Result routes by job id (`result_routes`); only non-empty ones.
    pub routes: BTreeMap<u16, JobRoutes>,
}

/// One write that moves the kernel's maps towards a [`KernelState`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Write group `id`'s root table.
    SetGroup(u16, Vec<SocketAddr>),
    /// Remove every route of a job.
    RemoveRoutes(u16),
    /// Remove a job (its slots and counters with it).
    RemoveJob(u16),
    /// Write a job (in place when it exists: same membership keeps its slots).
    SetJob(XdpJob),
    /// Remove the ring at a dense index, as it was written (its port and id
    /// unpublished, its entries cleared).
    RemoveRing(u32, abi::RingJob),
    /// Write a ring's entry (its region and index cleared first).
    SetRing(u32, abi::RingJob, Vec<IpAddr>),
    /// Write a job's routes.
    SetRoutes(u16, JobRoutes),
    /// Remove group `id`'s tables.
    RemoveGroup(u16),
}

/// Convert a configured job to what the data plane stores. `iface_mtu` is
/// the attached interface's: the job's senders cut full fragments for it
/// unless the job's `frag_elems` says otherwise.
pub fn xdp_job(job: &JobConfig, iface_mtu: usize) -> XdpJob {
    let mut flags = 0;
    if job.userspace_only {
        flags |= abi::JOB_F_USERSPACE_ONLY;
    }
    if job.kernel_parent().is_some() {
        flags |= abi::JOB_F_HAS_PARENT;
    }
    XdpJob {
        id: job.id,
        port: job.port,
        result_port: job.result_port,
        // IPv4 or IPv6 (one family a job), as the kernel API takes them
        ranks: job.workers.clone(),
        weights: job.weights.clone(),
        vector_len: job.vector_len.unwrap_or(0),
        slots: job.slots,
        flags,
        result_group: job.kernel_result_group(),
        window: job.window,
        frag_elems: job
            .frag_elems
            .unwrap_or_else(|| crate::wire::proto::elements_per_fragment_in(iface_mtu, job.is_ipv6()) as u32),
    }
}

/// The routes the kernel keeps for `job` (not those of a node-served tree
/// job, whose result service sends its RESULTs on).
pub fn job_routes(job: &JobConfig) -> JobRoutes {
    JobRoutes {
        result_group: job.kernel_result_group().map(|group| (job.result_port, group)),
        parent: job.kernel_parent().map(|parent| ParentRoute::from_config(job, parent)),
    }
}

impl KernelState {
    /// The state `config` asks for on an interface of MTU `iface_mtu`, with
    /// its rings as `ring_jobs` placed them (dense index and entry, same
    /// order as `config.rings`: `node::ring_jobs`).
    ///
    /// # Errors
    ///
    /// None today: the planes take every configured job, group, route and
    /// ring (the `Result` is for what a plane may refuse).
    pub fn of(config: &Config, iface_mtu: usize, ring_jobs: &[(u32, abi::RingJob)]) -> Result<KernelState> {
        let mut rings = BTreeMap::new();
        for ((dense, job), ring) in ring_jobs.iter().zip(&config.rings) {
            rings.insert(*dense, (*job, ring.members.clone()));
        }
        let mut groups = BTreeMap::new();
        for g in &config.groups {
            groups.insert(g.id, g.members.clone());
        }
        let mut routes = BTreeMap::new();
        for j in &config.jobs {
            let r = job_routes(j);
            if !r.is_empty() {
                routes.insert(j.id, r);
            }
        }
        Ok(KernelState {
            jobs: config.jobs.iter().map(|j| (j.id, xdp_job(j, iface_mtu))).collect(),
            rings,
            groups,
            routes,
        })
    }

    /// The writes that turn the maps holding `self` into maps holding
    /// `new`, in an order where nothing points at what is missing: groups
    /// before the routes that name them, a job's old routes gone before the
    /// job, routes after their job, removed groups last. A job whose entry
    /// changes has its routes written afresh too. A ring whose entry
    /// changes (or moves) is removed and written again; removed jobs and
    /// rings go before new ones are written, so a port that passes from a
    /// job to a ring (or back) is never both.
    pub fn changes_to(&self, new: &KernelState) -> Vec<Change> {
        let mut out = Vec::new();
        for (id, members) in &new.groups {
            if self.groups.get(id) != Some(members) {
                out.push(Change::SetGroup(*id, members.clone()));
            }
        }
        let job_changed = |id: &u16| self.jobs.get(id) != new.jobs.get(id);
        let routes_changed = |id: &u16| job_changed(id) || self.routes.get(id) != new.routes.get(id);
        for id in self.routes.keys() {
            if routes_changed(id) {
                out.push(Change::RemoveRoutes(*id));
            }
        }
        for id in self.jobs.keys() {
            if !new.jobs.contains_key(id) {
                out.push(Change::RemoveJob(*id));
            }
        }
        let ring_changed = |a: &KernelState, b: &KernelState, dense: &u32| a.rings.get(dense) != b.rings.get(dense);
        for (dense, (job, _)) in &self.rings {
            if ring_changed(self, new, dense) {
                out.push(Change::RemoveRing(*dense, *job));
            }
        }
        for (id, job) in &new.jobs {
            if job_changed(id) {
                out.push(Change::SetJob(job.clone()));
            }
        }
        for (dense, (job, members)) in &new.rings {
            if ring_changed(self, new, dense) {
                out.push(Change::SetRing(*dense, *job, members.clone()));
            }
        }
        for (id, routes) in &new.routes {
            if routes_changed(id) {
                out.push(Change::SetRoutes(*id, *routes));
            }
        }
        for id in self.groups.keys() {
            if !new.groups.contains_key(id) {
                out.push(Change::RemoveGroup(*id));
            }
        }
        out
    }

    /// Jobs, groups and routes of `self` whose changes a running node can
    /// take (its rings were placed by `RingPool`, which refuses what does
    /// not fit): an error names the first that cannot be written (a job
    /// the XDP plane refuses), before anything changes.
    pub fn check(&self) -> Result<()> {
        for job in self.jobs.values() {
            job.validate().map_err(|e| anyhow!("{e}"))?;
        }
        Ok(())
    }

    /// The addresses the TC programs send copies to: every group member
    /// and every parent (each once, in order).
    pub fn next_hops(&self) -> Vec<std::net::IpAddr> {
        let mut out: Vec<std::net::IpAddr> = Vec::new();
        let members = self.groups.values().flatten().map(|m| m.ip());
        let parents = self.routes.values().filter_map(|r| r.parent.as_ref().map(|p| p.addr));
        for a in members.chain(parents) {
            if !out.contains(&a) {
                out.push(a);
            }
        }
        out
    }

    /// Whether the TC programs have anything to hold.
    pub fn needs_tc(&self) -> bool {
        !self.groups.is_empty() || !self.routes.is_empty()
    }
}

/// The maps a [`Change`] is written to.
pub trait StateTarget {
    /// Write one change.
    fn apply(&mut self, change: &Change) -> Result<()>;
}

/// The live planes: the XDP plane always, the TC plane when loaded.
pub struct Planes<'a> {
    /// The aggregation programs' maps.
    pub xdp: &'a XdpPlane,
    /// The broadcast programs' maps, if this node loaded them.
    pub tc: Option<&'a TcPlane>,
}

impl StateTarget for Planes<'_> {
    fn apply(&mut self, change: &Change) -> Result<()> {
        let tc = |what: &str| self.tc.ok_or_else(|| anyhow!("{what}: this node has no TC programs"));
        match change {
            Change::SetGroup(id, members) => tc("group")?.set_group(*id, members).map_err(|e| anyhow!("group {id}: {e}")),
            Change::RemoveGroup(id) => tc("group")?.remove_group(*id).map_err(|e| anyhow!("group {id}: {e}")),
            Change::RemoveRoutes(id) => match self.tc {
                Some(plane) => plane.remove_result_route(*id).map_err(|e| anyhow!("job {id}: removing its routes: {e}")),
                None => Ok(()),
            },
            Change::RemoveJob(id) => self.xdp.remove_job(*id).map_err(|e| anyhow!("removing job {id}: {e}")),
            Change::SetJob(job) => self.xdp.set_job(job.id, job).map_err(|e| anyhow!("job {}: {e}", job.id)),
            Change::RemoveRing(dense, job) => self.xdp.remove_ring(*dense, job).map_err(|e| anyhow!("removing ring {}: {e}", job.id)),
            Change::SetRing(dense, job, members) => {
                self.xdp.set_ring(*dense, job, members).map_err(|e| anyhow!("ring {}: {e}", job.id))
            }
            Change::SetRoutes(id, routes) => {
                let plane = tc("result route")?;
                if let Some((result_port, group)) = routes.result_group {
                    plane
                        .set_result_route(*id, result_port, group)
                        .map_err(|e| anyhow!("job {id}: result_group {group}: {e}"))?;
                }
                if let Some(parent) = &routes.parent {
                    plane
                        .set_parent_route(*id, parent)
                        .map_err(|e| anyhow!("job {id}: parent {}:{}: {e}", parent.addr, parent.port))?;
                }
                Ok(())
            }
        }
    }
}

/// Move `target` from `from` to `to`. If a write fails, the writes made so
/// far are undone by moving back to `from` (best effort: the first error is
/// returned, a failure of the undo is added to it).
pub fn apply(target: &mut impl StateTarget, from: &KernelState, to: &KernelState) -> Result<()> {
    for change in from.changes_to(to) {
        if let Err(error) = target.apply(&change) {
            let undo: Vec<String> = to
                .changes_to(from)
                .iter()
                .filter_map(|c| target.apply(c).err().map(|e| format!("{e:#}")))
                .collect();
            return Err(if undo.is_empty() {
                error
            } else {
                error.context(format!("and undoing the writes before it failed too: {}", undo.join("; ")))
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The maps as plain values: what the planes would hold.
    #[derive(Default)]
    struct Model {
        state: KernelState,
        /// Fail the n-th write (0-based), once.
        fail_at: Option<usize>,
        writes: usize,
    }

    impl StateTarget for Model {
        fn apply(&mut self, change: &Change) -> Result<()> {
            let n = self.writes;
            self.writes += 1;
            if self.fail_at == Some(n) {
                anyhow::bail!("write {n} refused");
            }
            let s = &mut self.state;
            match change {
                Change::SetGroup(id, m) => {
                    s.groups.insert(*id, m.clone());
                }
                Change::RemoveGroup(id) => {
                    s.groups.remove(id);
                }
                Change::RemoveRoutes(id) => {
                    s.routes.remove(id);
                }
                Change::RemoveJob(id) => {
                    assert!(!s.routes.contains_key(id), "job {id} removed while it has routes");
                    s.jobs.remove(id);
                }
                Change::SetJob(j) => {
                    s.jobs.insert(j.id, j.clone());
                }
                Change::RemoveRing(d, _) => {
                    s.rings.remove(d);
                }
                Change::SetRing(d, j, m) => {
                    assert!(
                        !s.rings.iter().any(|(other, (o, _))| other != d && (o.port == j.port || o.id == j.id)),
                        "ring {} written at {d} while another index holds its id or port",
                        j.id
                    );
                    s.rings.insert(*d, (*j, m.clone()));
                }
                Change::SetRoutes(id, r) => {
                    assert!(s.jobs.contains_key(id), "routes of job {id} before the job");
                    if let Some((_, g)) = r.result_group {
                        assert!(s.groups.contains_key(&g), "route of job {id} names missing group {g}");
                    }
                    s.routes.insert(*id, *r);
                }
            }
            Ok(())
        }
    }

    fn config(text: &str) -> Config {
        Config::parse(text, "t.toml").expect("config")
    }

    const BASE: &str = "\
[[group]]
id = 3
members = [\"10.0.0.2:9000\", \"10.0.0.3:9000\"]

[[job]]
id = 1
port = 7000
result_port = 7001
workers = [\"10.0.0.2\", \"10.0.0.3\"]
result_group = 3

[[job]]
id = 2
port = 7100
result_port = 7101
workers = [\"10.0.0.2\", \"10.0.0.3\"]
";

    fn state(text: &str) -> KernelState {
        let config = config(text);
        let pool = crate::kernel::xdp::RingPool::reserve(&[], 10, 1000).unwrap().place(&config.rings).expect("rings fit");
        let rings = crate::node::ring_jobs(&config, "eth0", &["10.0.0.2".parse().unwrap()], &pool).expect("ring jobs");
        KernelState::of(&config, 1500, &rings).expect("kernel state")
    }

    /// Ring `id` on `port` of `len` elements, fragments of 10.
    fn ring(id: u16, port: u16, len: u32) -> String {
        format!("[[ring]]\nid = {id}\nport = {port}\nmembers = [\"10.0.0.2\", \"10.0.0.3\"]\nvector_len = {len}\nfrag_elems = 10\n\n")
    }

    #[test]
    fn a_config_becomes_one_entry_per_job_group_and_route() {
        let s = state(BASE);
        assert_eq!(s.jobs.keys().copied().collect::<Vec<_>>(), [1, 2]);
        assert_eq!(s.jobs[&1].frag_elems, 362);
        assert_eq!(s.groups[&3].len(), 2);
        assert_eq!(s.routes.len(), 1, "job 2 has no route: {:?}", s.routes);
        assert_eq!(s.routes[&1].result_group, Some((7001, 3)));
        assert!(s.needs_tc());
    }

    #[test]
    fn attach_writes_groups_then_jobs_then_routes() {
        let changes = KernelState::default().changes_to(&state(BASE));
        let kinds: Vec<&str> = changes
            .iter()
            .map(|c| match c {
                Change::SetGroup(..) => "group",
                Change::SetJob(..) => "job",
                Change::SetRoutes(..) => "routes",
                other => panic!("attach removes nothing: {other:?}"),
            })
            .collect();
        assert_eq!(kinds, ["group", "job", "job", "routes"]);
    }

    #[test]
    fn the_same_config_changes_nothing() {
        assert!(state(BASE).changes_to(&state(BASE)).is_empty());
    }

    #[test]
    fn a_changed_job_is_rewritten_with_its_routes_and_the_others_are_untouched() {
        let new = BASE.replace("port = 7000", "port = 7002");
        let changes = state(BASE).changes_to(&state(&new));
        assert_eq!(changes.len(), 3, "{changes:?}");
        assert_eq!(changes[0], Change::RemoveRoutes(1));
        assert!(matches!(&changes[1], Change::SetJob(j) if j.id == 1 && j.port == 7002));
        assert!(matches!(&changes[2], Change::SetRoutes(1, _)));
    }

    #[test]
    fn a_removed_job_loses_its_routes_first_and_a_removed_group_goes_last() {
        let new = "[[job]]\nid = 2\nport = 7100\nresult_port = 7101\nworkers = [\"10.0.0.2\", \"10.0.0.3\"]\n";
        let changes = state(BASE).changes_to(&state(new));
        assert_eq!(changes, [Change::RemoveRoutes(1), Change::RemoveJob(1), Change::RemoveGroup(3)]);
    }

    #[test]
    fn a_changed_ring_is_removed_before_it_is_written_and_a_port_passes_from_a_job_to_a_ring() {
        let (one, resized) = (state(&format!("{BASE}{}", ring(40, 7400, 20))), state(&format!("{BASE}{}", ring(40, 7400, 40))));
        let changes = one.changes_to(&resized);
        assert!(
            matches!(&changes[..], [Change::RemoveRing(0, old), Change::SetRing(0, new, _)] if old.frags == 2 && new.frags == 4),
            "{changes:?}"
        );
        assert!(one.changes_to(&one).is_empty(), "a ring left alone is not written");
        // Job 1's port 7000 becomes ring 42's: the job goes before the ring comes.
        let to_ring = state(&format!("[[job]]\nid = 2\nport = 7100\nresult_port = 7101\nworkers = [\"10.0.0.2\", \"10.0.0.3\"]\n{}", ring(42, 7000, 20)));
        let changes = state(BASE).changes_to(&to_ring);
        let at = |want: &dyn Fn(&Change) -> bool| changes.iter().position(want).unwrap_or_else(|| panic!("{changes:?}"));
        assert!(at(&|c| matches!(c, Change::RemoveJob(1))) < at(&|c| matches!(c, Change::SetRing(_, j, _) if j.port == 7000)));
        // And back: the ring goes before the job comes.
        let changes = to_ring.changes_to(&state(BASE));
        let at = |want: &dyn Fn(&Change) -> bool| changes.iter().position(want).unwrap_or_else(|| panic!("{changes:?}"));
        assert!(at(&|c| matches!(c, Change::RemoveRing(_, j) if j.port == 7000)) < at(&|c| matches!(c, Change::SetJob(j) if j.id == 1)));
    }

    /// Configs a reload may move between: every pair is tried both ways.
    fn variants() -> Vec<KernelState> {
        let texts = [
            BASE.to_string(),
            BASE.replace("port = 7000", "port = 7002"),
            BASE.replace("\"10.0.0.3:9000\"]", "\"10.0.0.4:9000\"]"),
            BASE.replace("result_group = 3\n", ""),
            "[[job]]\nid = 2\nport = 7100\nresult_port = 7101\nworkers = [\"10.0.0.2\", \"10.0.0.3\"]\n".to_string(),
            "[[group]]\nid = 4\nmembers = [\"10.0.0.5:9000\"]\n\n[[job]]\nid = 9\nport = 7200\nresult_port = 7201\nworkers = [\"10.0.0.2\"]\nresult_group = 4\nparent = { addr = \"10.0.0.9\", port = 7300, job = 5, rank = 1 }\n".to_string(),
            String::new(),
            format!("{BASE}{}", ring(40, 7400, 20)),
            format!("{BASE}{}", ring(40, 7400, 40)),
            format!("{BASE}{}{}", ring(41, 7401, 30), ring(40, 7400, 20)),
            format!("[[job]]\nid = 2\nport = 7100\nresult_port = 7101\nworkers = [\"10.0.0.2\", \"10.0.0.3\"]\n{}", ring(42, 7000, 20)),
        ];
        texts.iter().map(|t| state(t)).collect()
    }

    #[test]
    fn applying_the_changes_reaches_the_target_from_any_state() {
        for from in variants() {
            for to in variants() {
                let mut model = Model { state: from.clone(), ..Default::default() };
                apply(&mut model, &from, &to).expect("apply");
                assert_eq!(model.state, to);
            }
        }
    }

    #[test]
    fn a_failed_write_at_any_point_leaves_the_state_it_started_from() {
        let mut tried = 0;
        for from in variants() {
            for to in variants() {
                for fail_at in 0..from.changes_to(&to).len() {
                    let mut model = Model { state: from.clone(), fail_at: Some(fail_at), writes: 0 };
                    let err = apply(&mut model, &from, &to).expect_err("the write fails");
                    assert!(format!("{err:#}").contains(&format!("write {fail_at} refused")), "{err:#}");
                    assert_eq!(model.state, from, "failed at write {fail_at}");
                    tried += 1;
                }
            }
        }
        assert!(tried > 40, "the variants exercise partial writes: {tried}");
    }
}
