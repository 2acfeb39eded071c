//! The jobs runs bring to the node (docs/INTERFACE.md, "Jobs on demand"),
//! as a state machine without I/O: [`Registry::handle`] takes one request
//! frame and answers it (a join may answer every rank of its run at once),
//! [`Registry::expire`] removes what outlived its lease, and
//! [`Registry::desired`] is every live job as the config tables a static
//! job of the same description has, which the node adds to its file's and
//! applies as the difference of its kernel state (`node::desired`).
//!
//! Order of the checks, so that nothing unauthenticated is remembered: the
//! frame, the tenant, revocation, the MAC, freshness, the nonce (a nonce
//! is kept only for a request whose MAC verified), then the request.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::config::{
    Config, GroupConfig, JobConfig, ParentConfig, ResultConsumer, RingConfig, DEFAULT_SLOTS, DEFAULT_USERSPACE_SLOTS,
    DEFAULT_USERSPACE_SLOT_BYTES_JOB, DEFAULT_WINDOW, MAX_WINDOW, MAX_WORKERS,
};
use crate::wire::abi;
use crate::wire::control::{Envelope, JobGrant, JobShape, Refusal, Reply, Request, RingGrant, TreeParent, NONCE_BYTES};

use super::keys::Keys;

/// A connection the server holds (whom a reply goes to).
pub type ConnId = u64;

/// The node-wide bounds of the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Live dynamic jobs at once on the node.
    pub jobs: u32,
    /// Job ids handed out (never one of the file's).
    pub job_ids: (u16, u16),
    /// Contribution ports handed out: job k takes `port` and `port + 1`
    /// (its RESULT port), so the range holds pairs.
    pub ports: (u16, u16),
    /// Result group ids handed out (never one of the file's).
    pub groups: (u16, u16),
    /// Ring ids a node proposes for its runs' rings (never one of the
    /// file's; a member node refuses one it uses).
    pub ring_ids: (u16, u16),
    /// Ring ports a node proposes for its runs' rings.
    pub ring_ports: (u16, u16),
    /// A job not renewed for this long is removed; a run whose ranks have
    /// not all joined for this long is dropped.
    pub lease_ms: u64,
    /// A request's clock may differ from the node's by this much.
    pub freshness_ms: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            jobs: 64,
            job_ids: (0xF000, 0xFFFE),
            ports: (47000, 47999),
            groups: (0xF000, 0xFFFE),
            ring_ids: (0xF000, 0xFFFE),
            ring_ports: (48000, 48999),
            lease_ms: 10_000,
            freshness_ms: 30_000,
        }
    }
}

/// A live job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveJob {
    pub tenant: String,
    pub run: String,
    pub grant: JobGrant,
    pub group: u16,
    pub shape: JobShape,
    /// When it is removed unless renewed (the registry's clock, ms).
    pub expires_ms: u64,
    /// When it was created.
    pub created_ms: u64,
    /// Ranks that have ended.
    pub ended: BTreeSet<u16>,
    /// A leaf's job of a tree: where its partial results go.
    pub upstream: Option<Upstream>,
    /// A run's ring at its ranks' nodes ([`RingStart`]), until granted.
    pub ring: Option<PendingRing>,
}

/// A job whose run asked for a ring: the ranks' nodes, and the ranks'
/// connections waiting until every member node serves the ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRing {
    /// Rank r's own node's control endpoint.
    pub nodes: Vec<SocketAddr>,
    waiting: Vec<ConnId>,
}

/// What the node must do for a job whose run asked for a ring: install it
/// at every rank's node ([`Request::RingInstall`], signed with the
/// tenant's key from this node's key file), renew it there while the job
/// lives and end it there after; then [`Registry::ring_ready`] or
/// [`Registry::ring_failed`].
#[derive(Clone)]
pub struct RingStart {
    pub job: u16,
    pub incarnation: u64,
    pub tenant: String,
    pub key: Vec<u8>,
    pub run: String,
    /// The members (the ranks' data addresses) and their nodes, by rank.
    pub members: Vec<Ipv4Addr>,
    pub nodes: Vec<SocketAddr>,
    pub vector_len: u32,
    /// Ring ids and ports to propose, and where to start in them (so that
    /// two runs of one node do not propose the same first).
    pub ring_ids: (u16, u16),
    pub ring_ports: (u16, u16),
    pub lease_ms: u64,
}

impl std::fmt::Debug for RingStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("RingStart").field("job", &self.job).field("run", &self.run).field("nodes", &self.nodes).finish()
    }
}

/// A ring this node serves for a run of another node's
/// ([`Request::RingInstall`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRing {
    pub tenant: String,
    pub run: String,
    /// Its `[[ring]]` table.
    pub config: RingConfig,
    pub created_ms: u64,
    /// When it is removed unless renewed.
    pub expires_ms: u64,
}

impl LiveJob {
    /// Whether the node serves it: a leaf's job waits for its root's.
    pub fn serving(&self) -> bool {
        self.upstream.as_ref().is_none_or(|u| u.root.is_some())
    }
}

/// A leaf's job of a tree of nodes (docs/INTERFACE.md, "Trees on
/// demand"): the node joins the root on the run's behalf ([`UpstreamStart`])
/// and answers the leaf's ranks once the root's job exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub parent: TreeParent,
    /// The root's job, once it was granted: the root node's address and
    /// the grant it gave this leaf.
    pub root: Option<(IpAddr, JobGrant)>,
    /// The ranks' connections waiting for the grant until then.
    waiting: Vec<ConnId>,
}

/// What the node must do for a leaf's job just created: join the tree's
/// root as rank `parent.leaf` of the run `run` under `tenant` (whose key
/// signs it), its data socket this node's result port on the address it
/// reaches the root from, the job's shape; then
/// [`Registry::upstream_joined`] or [`Registry::upstream_failed`].
#[derive(Clone)]
pub struct UpstreamStart {
    pub job: u16,
    pub incarnation: u64,
    pub tenant: String,
    pub key: Vec<u8>,
    pub run: String,
    pub parent: TreeParent,
    pub result_port: u16,
    pub shape: JobShape,
    pub lease_ms: u64,
}

impl std::fmt::Debug for UpstreamStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("UpstreamStart").field("job", &self.job).field("run", &self.run).field("parent", &self.parent).finish()
    }
}

/// How a leaf's join at its root ended ([`Registry::upstream_joined`]).
#[derive(Debug, PartialEq, Eq)]
pub enum UpstreamOutcome {
    /// The leaf's job is served now: the replies owed to its ranks.
    Serving(Vec<(ConnId, Reply)>),
    /// The root's job does not fit this node (refused to the ranks, the
    /// job removed): end it at the root.
    Refused(Vec<(ConnId, Reply)>),
    /// The leaf's job is gone meanwhile: end the root's.
    Gone,
}

/// A run whose ranks are joining.
#[derive(Debug, Clone)]
struct Joining {
    world: u16,
    /// The run's shape, its `ring` the first rank's (each rank names its
    /// own node: [`Joining::ring_nodes`]).
    shape: JobShape,
    /// Rank → its data socket and the connection waiting for the grant.
    ranks: BTreeMap<u16, (SocketAddr, ConnId)>,
    /// Rank → its own node, for a run with a ring.
    ring_nodes: BTreeMap<u16, SocketAddr>,
    started_ms: u64,
}

/// What every rank of a run must ask alike: its shape with the ring's node
/// (which is each rank's own) reduced to whether it asks one.
fn run_shape(shape: JobShape) -> JobShape {
    JobShape { ring: shape.ring.map(|_| SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0)), ..shape }
}

/// Counts since the node started, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    pub created: u64,
    pub ended: u64,
    pub expired: u64,
    pub refused: BTreeMap<Refusal, u64>,
}

/// The registry (see the module docs).
#[derive(Debug)]
pub struct Registry {
    keys: Keys,
    limits: Limits,
    /// The node's ACK settings, which every grant carries.
    ack: (crate::wire::proto::AckMode, u16),
    /// What the node's file uses: never handed out.
    file_ids: BTreeSet<u16>,
    file_ports: BTreeSet<u16>,
    file_groups: BTreeSet<u16>,
    file_rings: BTreeSet<u16>,
    /// The fragment size of this node's rings (fixed at attach).
    ring_frag_elems: u32,
    /// Nonces of verified requests, with their clock, oldest first: a
    /// request older than the freshness window is refused as stale, so
    /// older nonces need not be kept.
    nonces: BTreeSet<[u8; NONCE_BYTES]>,
    nonce_order: VecDeque<(u64, [u8; NONCE_BYTES])>,
    joining: BTreeMap<(String, String), Joining>,
    live: BTreeMap<u16, LiveJob>,
    incarnations: BTreeMap<(String, String), u64>,
    /// Leaves' jobs created and not yet handed to the server.
    starts: Vec<UpstreamStart>,
    /// Jobs with a ring created and not yet handed to the server.
    ring_starts: Vec<RingStart>,
    /// The rings this node serves for other nodes' runs, by id.
    rings: BTreeMap<u16, LiveRing>,
    /// Where the search for the next free job id starts: ids rotate, so a
    /// removed job's id is the last to be handed out again.
    next_id: u16,
    counts: Counts,
}

fn refuse(reason: Refusal, message: impl Into<String>) -> Reply {
    Reply::Refused { reason, message: message.into() }
}

impl Registry {
    /// A registry of `keys` beside the static jobs of `file`.
    pub fn new(keys: Keys, limits: Limits, file: &Config) -> Registry {
        let mut file_ports = BTreeSet::new();
        for j in &file.jobs {
            file_ports.insert(j.port);
            file_ports.insert(j.result_port);
        }
        for r in &file.rings {
            file_ports.insert(r.port);
        }
        Registry {
            keys,
            ack: (file.node.ack_mode, file.node.ack_group),
            next_id: limits.job_ids.0,
            limits,
            file_ids: file.jobs.iter().map(|j| j.id).collect(),
            file_ports,
            file_groups: file.groups.iter().map(|g| g.id).collect(),
            file_rings: file.rings.iter().map(|r| r.id).collect(),
            ring_frag_elems: file.ring_frag_elems(),
            nonces: BTreeSet::new(),
            nonce_order: VecDeque::new(),
            joining: BTreeMap::new(),
            live: BTreeMap::new(),
            incarnations: BTreeMap::new(),
            starts: Vec::new(),
            ring_starts: Vec::new(),
            rings: BTreeMap::new(),
            counts: Counts::default(),
        }
    }

    /// Starts handing out job ids at `seed` (taken into the id range). A
    /// node started again after a crash seeds it at random, so it does not
    /// give a new run the id its predecessor gave a run whose workers may
    /// still be sending: their datagrams carry the old id and are dropped.
    pub fn first_id(mut self, seed: u16) -> Registry {
        let (lo, hi) = self.limits.job_ids;
        self.next_id = lo + (seed as u32 % (hi as u32 - lo as u32 + 1)) as u16;
        self
    }

    /// The limits it enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The live jobs by id.
    pub fn live(&self) -> &BTreeMap<u16, LiveJob> {
        &self.live
    }

    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// The rings this node serves for other nodes' runs, by id.
    pub fn rings(&self) -> &BTreeMap<u16, LiveRing> {
        &self.rings
    }

    /// What the node's kernel state is made of: the live jobs (each with
    /// its incarnation and whether it is served) and rings. A request that
    /// changes it is applied before it is answered.
    pub fn state(&self) -> (Vec<(u16, u64, bool)>, Vec<(u16, u64)>) {
        (
            self.live.values().map(|j| (j.grant.job, j.grant.incarnation, j.serving())).collect(),
            self.rings.values().map(|r| (r.config.id, r.created_ms)).collect(),
        )
    }

    /// Every ring this node serves for a run, as the `[[ring]]` of the
    /// same description.
    pub fn desired_rings(&self) -> Vec<RingConfig> {
        self.rings.values().map(|r| r.config.clone()).collect()
    }

    /// Every live job as the `[[job]]` and `[[group]]` a static job of the
    /// same description has: node-served, its workers' data sockets its
    /// result group.
    pub fn desired(&self) -> (Vec<JobConfig>, Vec<GroupConfig>) {
        self.live
            .values()
            .filter(|j| j.serving())
            .map(|j| {
                let g = &j.grant;
                let parent = j.upstream.as_ref().and_then(|u| {
                    let (addr, root) = u.root.as_ref()?;
                    Some(ParentConfig {
                        addr: *addr,
                        port: root.port,
                        job: root.job,
                        rank: u.parent.leaf,
                        result_port: Some(root.result_port),
                        tree_workers: Some(u.parent.tree_workers),
                    })
                });
                let job = JobConfig {
                    id: g.job,
                    port: g.port,
                    workers: g.workers.iter().map(|w| w.ip()).collect(),
                    weights: vec![1; g.workers.len()],
                    result_port: g.result_port,
                    result_group: Some(j.group),
                    vector_len: j.shape.vector_len,
                    slots: DEFAULT_SLOTS,
                    parent,
                    userspace_only: false,
                    window: j.shape.window.unwrap_or(DEFAULT_WINDOW),
                    userspace_slots: DEFAULT_USERSPACE_SLOTS,
                    userspace_slot_bytes: DEFAULT_USERSPACE_SLOT_BYTES_JOB,
                    consumer: ResultConsumer::Node,
                    frag_elems: j.shape.frag_elems,
                };
                (job, GroupConfig { id: j.group, members: g.workers.clone() })
            })
            .unzip()
    }

    /// One request frame from connection `conn` at `now_ms` (the node's
    /// clock, ms since the Unix epoch): the replies it causes, each to its
    /// connection. A join that completes its run answers every rank's
    /// connection; one that does not answers nobody yet.
    pub fn handle(&mut self, now_ms: u64, conn: ConnId, frame: &[u8]) -> Vec<(ConnId, Reply)> {
        let replies = match self.authenticate(now_ms, frame) {
            Ok((tenant, request)) => self.serve(now_ms, conn, tenant, request),
            Err(reply) => vec![(conn, reply)],
        };
        for (_, r) in &replies {
            if let Reply::Refused { reason, .. } = r {
                *self.counts.refused.entry(*reason).or_default() += 1;
            }
        }
        replies
    }

    /// The envelope checked (see the module docs): its tenant and request.
    fn authenticate(&mut self, now_ms: u64, frame: &[u8]) -> Result<(String, Request), Reply> {
        let env: Envelope = serde_json::from_slice(frame)
            .map_err(|e| refuse(Refusal::Malformed, format!("not an AGC1 envelope: {e}")))?;
        let tenant = self.keys.tenants.get(&env.tenant).ok_or_else(|| {
            refuse(Refusal::UnknownTenant, format!("tenant {:?} is not in the node's key file", env.tenant))
        })?;
        if tenant.revoked {
            return Err(refuse(Refusal::Revoked, format!("tenant {}'s credential was revoked", env.tenant)));
        }
        if !env.verifies(&tenant.key) {
            return Err(refuse(Refusal::BadMac, format!("the MAC does not verify under tenant {}'s key", env.tenant)));
        }
        let skew = now_ms.abs_diff(env.time_ms);
        if skew > self.limits.freshness_ms {
            return Err(refuse(
                Refusal::Stale,
                format!("the request's clock is {skew} ms from the node's; at most {} ms", self.limits.freshness_ms),
            ));
        }
        let nonce = env
            .nonce_bytes()
            .ok_or_else(|| refuse(Refusal::Malformed, format!("the nonce is not {NONCE_BYTES} bytes of hex")))?;
        self.forget_nonces(now_ms);
        if !self.nonces.insert(nonce) {
            return Err(refuse(Refusal::Replayed, "this nonce was used before: a request is accepted once"));
        }
        self.nonce_order.push_back((env.time_ms.max(now_ms), nonce));
        let request: Request = serde_json::from_str(&env.request)
            .map_err(|e| refuse(Refusal::Malformed, format!("not an AGC1 request: {e}")))?;
        Ok((env.tenant, request))
    }

    /// Drops the nonces that a fresh request can no longer carry.
    fn forget_nonces(&mut self, now_ms: u64) {
        while let Some(&(t, n)) = self.nonce_order.front() {
            if t + self.limits.freshness_ms >= now_ms {
                break;
            }
            self.nonce_order.pop_front();
            self.nonces.remove(&n);
        }
    }

    fn serve(&mut self, now_ms: u64, conn: ConnId, tenant: String, request: Request) -> Vec<(ConnId, Reply)> {
        match request {
            Request::Join { run, world, rank, data, vector_len, window, frag_elems, parent, ring } => {
                self.join(now_ms, conn, tenant, run, world, rank, data, JobShape { vector_len, window, frag_elems, parent, ring })
            }
            Request::RingInstall { run, ring, port, members, vector_len } => {
                vec![(conn, self.install_ring(now_ms, tenant, run, ring, port, members, vector_len))]
            }
            Request::RingRenew { run, ring } => {
                let lease = self.limits.lease_ms;
                let reply = match self.rings.get_mut(&ring).filter(|r| r.tenant == tenant && r.run == run) {
                    Some(r) => {
                        r.expires_ms = now_ms + lease;
                        Reply::Renewed { lease_ms: lease }
                    }
                    None => refuse(Refusal::UnknownJob, format!("no live ring {ring} of run {run} for tenant {tenant} (ended, expired, or another's)")),
                };
                vec![(conn, reply)]
            }
            Request::RingEnd { run, ring } => {
                let reply = match self.rings.get(&ring).filter(|r| r.tenant == tenant && r.run == run) {
                    Some(_) => {
                        self.rings.remove(&ring);
                        self.counts.ended += 1;
                        Reply::Ended { remaining: 0 }
                    }
                    None => refuse(Refusal::UnknownJob, format!("no live ring {ring} of run {run} for tenant {tenant} (ended, expired, or another's)")),
                };
                vec![(conn, reply)]
            }
            Request::Renew { job, incarnation } => {
                let lease = self.limits.lease_ms;
                let reply = match self.owned(&tenant, job, incarnation) {
                    Ok(j) => {
                        j.expires_ms = now_ms + lease;
                        Reply::Renewed { lease_ms: lease }
                    }
                    Err(r) => r,
                };
                vec![(conn, reply)]
            }
            Request::End { job, incarnation, rank } => {
                let reply = match self.owned(&tenant, job, incarnation) {
                    Ok(j) if usize::from(rank) < j.grant.workers.len() => {
                        j.ended.insert(rank);
                        let remaining = (j.grant.workers.len() - j.ended.len()) as u16;
                        if remaining == 0 {
                            self.live.remove(&job);
                            self.counts.ended += 1;
                        }
                        Reply::Ended { remaining }
                    }
                    Ok(j) => refuse(Refusal::Conflict, format!("rank {rank} of a job of {} workers", j.grant.workers.len())),
                    Err(r) => r,
                };
                vec![(conn, reply)]
            }
        }
    }

    /// The live job `job` of incarnation `incarnation`, if `tenant` owns it.
    fn owned(&mut self, tenant: &str, job: u16, incarnation: u64) -> Result<&mut LiveJob, Reply> {
        match self.live.get_mut(&job) {
            Some(j) if j.tenant == tenant && j.grant.incarnation == incarnation => Ok(j),
            _ => Err(refuse(
                Refusal::UnknownJob,
                format!("no live job {job} of incarnation {incarnation} for tenant {tenant} (ended, expired, or another's)"),
            )),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn join(
        &mut self,
        now_ms: u64,
        conn: ConnId,
        tenant: String,
        run: String,
        world: u16,
        rank: u16,
        data: SocketAddr,
        shape: JobShape,
    ) -> Vec<(ConnId, Reply)> {
        if world == 0 || world as usize > MAX_WORKERS || rank >= world {
            return vec![(conn, refuse(Refusal::Conflict, format!("rank {rank} of a world of {world}: 1..={MAX_WORKERS} ranks, rank below world")))];
        }
        // The ranges a `[[job]]` of the file is held to (config/parse.rs).
        if shape.window.is_some_and(|w| !(1..=MAX_WINDOW).contains(&w)) {
            return vec![(conn, refuse(Refusal::Malformed, format!("window {:?}: 1..={MAX_WINDOW} rounds", shape.window)))];
        }
        if shape.frag_elems.is_some_and(|f| !(1..=abi::MAX_ELEMS).contains(&f)) {
            return vec![(conn, refuse(Refusal::Malformed, format!("frag_elems {:?}: 1..={} elements, (MTU - 52) / 4 fills a datagram", shape.frag_elems, abi::MAX_ELEMS)))];
        }
        if let Some(p) = shape.parent {
            if p.leaves == 0 || p.leaves as usize > MAX_WORKERS || p.leaf >= p.leaves || p.tree_workers < world {
                return vec![(conn, refuse(
                    Refusal::Malformed,
                    format!("parent: leaf {} of {} leaves (1..={MAX_WORKERS}, leaf below leaves), tree_workers {} (at least this leaf's {world})", p.leaf, p.leaves, p.tree_workers),
                ))];
            }
        }
        if shape.ring.is_some() {
            let why = if shape.parent.is_some() {
                Some("a leaf of a tree cannot also ask for a ring".to_string())
            } else if world < 2 {
                Some(format!("a ring needs at least 2 ranks, not {world}"))
            } else if !shape.vector_len.is_some_and(|n| n >= 1) {
                Some("a run with a ring names its vector_len (the ring's memory is sized from it)".to_string())
            } else {
                None
            };
            if let Some(why) = why {
                return vec![(conn, refuse(Refusal::Malformed, why))];
            }
        }
        if let Some((id, _)) = self
            .live
            .iter()
            .find(|(_, j)| !(j.tenant == tenant && j.run == run) && j.grant.workers.contains(&data))
        {
            return vec![(conn, refuse(Refusal::Conflict, format!("{data} is a worker of live job {id} of another run")))];
        }
        if let Err(r) = self.within_quota(&tenant, &run, world) {
            return vec![(conn, r)];
        }
        let key = (tenant.clone(), run.clone());
        let joining = self.joining.entry(key.clone()).or_insert_with(|| Joining {
            world,
            shape,
            ranks: BTreeMap::new(),
            ring_nodes: BTreeMap::new(),
            started_ms: now_ms,
        });
        if joining.world != world || run_shape(joining.shape) != run_shape(shape) {
            return vec![(conn, refuse(
                Refusal::Conflict,
                format!("run {run} is joining as a world of {} ({:?}), not {world} ({shape:?})", joining.world, joining.shape),
            ))];
        }
        if let Some((addr, _)) = joining.ranks.get(&rank) {
            if *addr != data {
                return vec![(conn, refuse(Refusal::Conflict, format!("rank {rank} of run {run} joined from {addr}, not {data}")))];
            }
        }
        if let Some((r, (a, _))) = joining.ranks.iter().find(|(_, (a, _))| a.is_ipv6() != data.is_ipv6()) {
            return vec![(conn, refuse(
                Refusal::Malformed,
                format!("rank {rank} joins from {data} where rank {r} joined from {a}: a run's data sockets are of one family (IPv4 or IPv6)"),
            ))];
        }
        if shape.ring.is_some() && data.is_ipv6() {
            return vec![(conn, refuse(Refusal::Malformed, format!("rank {rank} asks for a ring from {data}: rings on demand are IPv4 in this build (a [[ring]] of the nodes' files may be IPv6)")))];
        }
        if let Some((r, _)) = joining.ranks.iter().find(|(r, (a, _))| **r != rank && *a == data) {
            return vec![(conn, refuse(Refusal::Conflict, format!("{data} is rank {r}'s data socket in run {run}")))];
        }
        if let Some(node) = shape.ring {
            if let Some((r, _)) = joining.ring_nodes.iter().find(|(r, n)| **r != rank && **n == node) {
                return vec![(conn, refuse(Refusal::Conflict, format!("ranks {r} and {rank} of run {run} name the same node {node}: a ring's members are one rank a node")))];
            }
            joining.ring_nodes.insert(rank, node);
        }
        joining.ranks.insert(rank, (data, conn));
        if joining.ranks.len() < world as usize {
            return Vec::new();
        }
        let joining = self.joining.remove(&key).expect("present");
        self.create(now_ms, tenant, run, joining)
    }

    /// Whether `tenant` may have a job of `world` more workers (a run that
    /// replaces its own live job counts without it).
    fn within_quota(&self, tenant: &str, run: &str, world: u16) -> Result<(), Reply> {
        let t = &self.keys.tenants[tenant];
        let others = || self.live.values().filter(|j| !(j.tenant == tenant && j.run == run));
        let jobs = others().filter(|j| j.tenant == tenant).count() as u32;
        let workers: u32 = others().filter(|j| j.tenant == tenant).map(|j| j.grant.workers.len() as u32).sum();
        if jobs + 1 > t.jobs {
            return Err(refuse(Refusal::OverQuota, format!("tenant {tenant} has {jobs} live jobs; its quota is {} (key file: jobs)", t.jobs)));
        }
        if workers + u32::from(world) > t.workers {
            return Err(refuse(
                Refusal::OverQuota,
                format!("tenant {tenant} has {workers} workers in live jobs; {world} more exceed its quota of {} (key file: workers)", t.workers),
            ));
        }
        if others().count() as u32 + 1 > self.limits.jobs {
            return Err(refuse(Refusal::OverQuota, format!("the node serves {} dynamic jobs, its limit", self.limits.jobs)));
        }
        Ok(())
    }

    /// The job of a run whose ranks have all joined (replacing the run's
    /// live one, a restarted run's): a job id, ports and a group none of
    /// the file's or the live jobs' use.
    fn create(&mut self, now_ms: u64, tenant: String, run: String, joining: Joining) -> Vec<(ConnId, Reply)> {
        let conns: Vec<ConnId> = joining.ranks.values().map(|(_, c)| *c).collect();
        let all = |reply: Reply| conns.iter().map(|&c| (c, reply.clone())).collect::<Vec<_>>();
        if let Err(r) = self.within_quota(&tenant, &run, joining.world) {
            return all(r);
        }
        let old = self.live.iter().find(|(_, j)| j.tenant == tenant && j.run == run).map(|(id, _)| *id);
        let ids = (self.limits.job_ids.0..=self.limits.job_ids.1).count();
        let id = (0..ids)
            .map(|k| self.limits.job_ids.0 + ((self.next_id - self.limits.job_ids.0) as usize + k) as u16 % ids as u16)
            .find(|id| !self.file_ids.contains(id) && !self.live.contains_key(id) && Some(*id) != old);
        let used_ports: BTreeSet<u16> = self.live.values().flat_map(|j| [j.grant.port, j.grant.result_port]).collect();
        let port = (self.limits.ports.0..self.limits.ports.1)
            .step_by(2)
            .find(|p| [*p, p + 1].iter().all(|q| !self.file_ports.contains(q) && !used_ports.contains(q)));
        let used_groups: BTreeSet<u16> = self.live.values().map(|j| j.group).collect();
        let group = (self.limits.groups.0..=self.limits.groups.1)
            .find(|g| !self.file_groups.contains(g) && !used_groups.contains(g));
        let (Some(id), Some(port), Some(group)) = (id, port, group) else {
            return all(refuse(Refusal::Unavailable, "no free job id, port pair or group: end a run first"));
        };
        if let Some(old) = old {
            self.live.remove(&old);
            self.counts.ended += 1;
        }
        self.next_id = if id == self.limits.job_ids.1 { self.limits.job_ids.0 } else { id + 1 };
        let incarnation = self.incarnations.entry((tenant.clone(), run.clone())).or_default();
        *incarnation += 1;
        let grant = JobGrant {
            job: id,
            incarnation: *incarnation,
            port,
            result_port: port + 1,
            workers: joining.ranks.values().map(|(a, _)| *a).collect(),
            lease_ms: self.limits.lease_ms,
            ack_mode: self.ack.0,
            ack_group: self.ack.1,
            tree_workers: joining.shape.parent.map(|p| p.tree_workers),
            ring: None,
        };
        // A leaf's job answers its ranks once its root's job exists.
        let upstream = joining.shape.parent.map(|parent| {
            self.starts.push(UpstreamStart {
                job: id,
                incarnation: grant.incarnation,
                tenant: tenant.clone(),
                key: self.keys.tenants[&tenant].key.clone(),
                run: run.clone(),
                parent,
                result_port: grant.result_port,
                shape: JobShape { parent: None, ..joining.shape },
                lease_ms: self.limits.lease_ms,
            });
            Upstream { parent, root: None, waiting: conns.clone() }
        });
        // A run with a ring answers its ranks once every member serves it.
        let ring = joining.shape.ring.map(|_| {
            let nodes: Vec<SocketAddr> = joining.ring_nodes.values().copied().collect();
            self.ring_starts.push(RingStart {
                job: id,
                incarnation: grant.incarnation,
                tenant: tenant.clone(),
                key: self.keys.tenants[&tenant].key.clone(),
                run: run.clone(),
                // IPv4: a run asking for a ring from IPv6 is refused at its join
                members: grant.workers.iter().filter_map(|w| match w.ip() {
                    IpAddr::V4(a) => Some(a),
                    IpAddr::V6(_) => None,
                }).collect(),
                nodes: nodes.clone(),
                vector_len: joining.shape.vector_len.unwrap_or(1),
                ring_ids: self.limits.ring_ids,
                ring_ports: self.limits.ring_ports,
                lease_ms: self.limits.lease_ms,
            });
            PendingRing { nodes, waiting: conns.clone() }
        });
        let answer = upstream.is_none() && ring.is_none();
        self.live.insert(
            id,
            LiveJob {
                tenant,
                run,
                grant: grant.clone(),
                group,
                shape: joining.shape,
                expires_ms: now_ms + self.limits.lease_ms,
                created_ms: now_ms,
                ended: BTreeSet::new(),
                upstream,
                ring,
            },
        );
        self.counts.created += 1;
        if answer {
            all(Reply::Joined(grant))
        } else {
            Vec::new()
        }
    }

    /// The leaves' jobs created since the last call, each for the server
    /// to join at its root.
    pub fn take_upstream_starts(&mut self) -> Vec<UpstreamStart> {
        std::mem::take(&mut self.starts)
    }

    /// The jobs with a ring created since the last call, each for the
    /// server to install at its ranks' nodes.
    pub fn take_ring_starts(&mut self) -> Vec<RingStart> {
        std::mem::take(&mut self.ring_starts)
    }

    /// Every member node of job `job`'s ring serves it as `ring`: the job's
    /// grant carries it from now on, and its waiting ranks are answered.
    pub fn ring_ready(&mut self, now_ms: u64, job: u16, incarnation: u64, ring: RingGrant) -> Vec<(ConnId, Reply)> {
        let lease = self.limits.lease_ms;
        let Some(j) = self.live.get_mut(&job).filter(|j| j.grant.incarnation == incarnation) else {
            return Vec::new();
        };
        let Some(pending) = j.ring.as_mut() else { return Vec::new() };
        j.grant.ring = Some(ring);
        j.expires_ms = now_ms + lease;
        let reply = Reply::Joined(j.grant.clone());
        std::mem::take(&mut pending.waiting).into_iter().map(|c| (c, reply.clone())).collect()
    }

    /// Job `job`'s ring could not be installed (`why`): the job is removed
    /// and its waiting ranks are refused.
    pub fn ring_failed(&mut self, job: u16, incarnation: u64, why: &str) -> Vec<(ConnId, Reply)> {
        if !self.is_live(job, incarnation) {
            return Vec::new();
        }
        let j = self.live.remove(&job).expect("live");
        self.counts.expired += 1;
        let reply = refuse(Refusal::Unavailable, format!("run {}: {why}", j.run));
        let waiting = j.ring.map(|r| r.waiting).unwrap_or_default();
        *self.counts.refused.entry(Refusal::Unavailable).or_default() += waiting.len() as u64;
        waiting.into_iter().map(|c| (c, reply.clone())).collect()
    }

    /// A member node no longer serves job `job`'s ring: the job is removed
    /// (its ranks' renewals are refused, their calls fail naming this
    /// node); whether it was live.
    pub fn ring_lost(&mut self, job: u16, incarnation: u64) -> bool {
        self.upstream_lost(job, incarnation)
    }

    /// A run's ring at this node ([`Request::RingInstall`]): served once
    /// the node applied it (the reply waits for that), renewed when the
    /// same ring is asked again, replacing the run's other ring.
    #[allow(clippy::too_many_arguments)]
    fn install_ring(&mut self, now_ms: u64, tenant: String, run: String, id: u16, port: u16, members: Vec<Ipv4Addr>, vector_len: u32) -> Reply {
        let lease = self.limits.lease_ms;
        if members.len() < 2 || members.len() > MAX_WORKERS || vector_len == 0 {
            return refuse(Refusal::Malformed, format!("a ring of {} members (2..={MAX_WORKERS}) and {vector_len} elements (at least 1)", members.len()));
        }
        if members.iter().collect::<BTreeSet<_>>().len() != members.len() {
            return refuse(Refusal::Malformed, format!("ring members {members:?}: an address appears twice"));
        }
        let config = RingConfig { id, port, weights: vec![1; members.len()], members: members.into_iter().map(IpAddr::V4).collect(), vector_len, frag_elems: self.ring_frag_elems };
        if let Some(r) = self.rings.get_mut(&id).filter(|r| r.tenant == tenant && r.run == run) {
            if r.config == config {
                r.expires_ms = now_ms + lease;
                return Reply::RingInstalled { ring: id, frag_elems: config.frag_elems, lease_ms: lease };
            }
        }
        if self.file_rings.contains(&id) || self.rings.get(&id).is_some_and(|r| !(r.tenant == tenant && r.run == run)) {
            return refuse(Refusal::Conflict, format!("ring id {id} is in use on this node"));
        }
        let job_ports = self.live.values().flat_map(|j| [j.grant.port, j.grant.result_port]);
        let ring_ports = self.rings.values().filter(|r| !(r.tenant == tenant && r.run == run)).map(|r| r.config.port);
        if self.file_ports.contains(&port) || job_ports.chain(ring_ports).any(|p| p == port) {
            return refuse(Refusal::Conflict, format!("port {port} is in use on this node"));
        }
        let t = &self.keys.tenants[&tenant];
        let others = self.rings.values().filter(|r| r.tenant == tenant && r.run != run).count() as u32;
        if others + 1 > t.jobs {
            return refuse(Refusal::OverQuota, format!("tenant {tenant} has {others} live rings on this node; its quota is {} (key file: jobs)", t.jobs));
        }
        if self.rings.len() as u32 >= abi::MAX_RINGS {
            return refuse(Refusal::OverQuota, format!("the node serves {} rings, its limit", abi::MAX_RINGS));
        }
        // The run's other ring (a proposal it replaced, a restarted run's).
        self.rings.retain(|_, r| !(r.tenant == tenant && r.run == run));
        self.rings.insert(id, LiveRing { tenant, run, config, created_ms: now_ms, expires_ms: now_ms + lease });
        self.counts.created += 1;
        Reply::RingInstalled { ring: id, frag_elems: self.ring_frag_elems, lease_ms: lease }
    }

    /// Removes ring `ring` without a reply (the node could not apply it);
    /// whether it was live.
    pub fn remove_ring(&mut self, ring: u16) -> bool {
        self.rings.remove(&ring).is_some()
    }

    /// Whether job `job` of incarnation `incarnation` is live.
    pub fn is_live(&self, job: u16, incarnation: u64) -> bool {
        self.live.get(&job).is_some_and(|j| j.grant.incarnation == incarnation)
    }

    /// The root node at `addr` granted leaf job `job` its job `root`: the
    /// leaf's job is served from now on, with a fresh lease.
    pub fn upstream_joined(&mut self, now_ms: u64, job: u16, incarnation: u64, addr: IpAddr, root: JobGrant) -> UpstreamOutcome {
        let ack = self.ack;
        let lease = self.limits.lease_ms;
        let Some(j) = self.live.get_mut(&job).filter(|j| j.grant.incarnation == incarnation) else {
            return UpstreamOutcome::Gone;
        };
        let Some(u) = j.upstream.as_mut().filter(|u| u.root.is_none()) else {
            return UpstreamOutcome::Gone;
        };
        if (root.ack_mode, root.ack_group) != ack {
            let message = format!(
                "the tree's root node {} acknowledges {:?} every {}, this leaf {:?} every {}: the nodes of a tree need the same [node] ack_mode and ack_group",
                u.parent.node, root.ack_mode, root.ack_group, ack.0, ack.1
            );
            return UpstreamOutcome::Refused(self.upstream_failed(job, incarnation, &message));
        }
        u.root = Some((addr, root));
        let waiting = std::mem::take(&mut u.waiting);
        j.expires_ms = now_ms + lease;
        let reply = Reply::Joined(j.grant.clone());
        UpstreamOutcome::Serving(waiting.into_iter().map(|c| (c, reply.clone())).collect())
    }

    /// Leaf job `job` could not join its root (`why`): it is removed and
    /// its ranks are refused.
    pub fn upstream_failed(&mut self, job: u16, incarnation: u64, why: &str) -> Vec<(ConnId, Reply)> {
        if !self.is_live(job, incarnation) {
            return Vec::new();
        }
        let j = self.live.remove(&job).expect("live");
        self.counts.expired += 1;
        let reply = refuse(Refusal::Unavailable, format!("run {}: {why}", j.run));
        *self.counts.refused.entry(Refusal::Unavailable).or_default() += 1;
        j.upstream.map(|u| u.waiting).unwrap_or_default().into_iter().map(|c| (c, reply.clone())).collect()
    }

    /// Leaf job `job`'s root no longer serves its job (a renewal refused,
    /// or none for a lease): the leaf's job is removed, so its ranks'
    /// renewals are refused and their calls fail naming the node.
    pub fn upstream_lost(&mut self, job: u16, incarnation: u64) -> bool {
        let gone = self.is_live(job, incarnation);
        if gone {
            self.live.remove(&job);
            self.counts.expired += 1;
        }
        gone
    }

    /// Removes every job and ring whose lease ran out and every run whose
    /// ranks have not all joined within a lease; returns the removed jobs'
    /// and rings' ids (jobs first) and the refusals owed to the connections of the dropped runs.
    pub fn expire(&mut self, now_ms: u64) -> (Vec<u16>, Vec<(ConnId, Reply)>) {
        let mut gone: Vec<u16> = self.live.iter().filter(|(_, j)| j.expires_ms <= now_ms).map(|(id, _)| *id).collect();
        let lease = self.limits.lease_ms;
        let mut replies = Vec::new();
        for id in &gone {
            let j = self.live.remove(id).expect("live");
            self.counts.expired += 1;
            if let Some(u) = j.upstream.filter(|u| u.root.is_none()) {
                let reply = refuse(
                    Refusal::Unavailable,
                    format!("run {}: the tree's root node {} did not grant its job within {lease} ms", j.run, u.parent.node),
                );
                replies.extend(u.waiting.into_iter().map(|c| (c, reply.clone())));
            }
            if let Some(r) = j.ring.filter(|r| !r.waiting.is_empty()) {
                let reply = refuse(Refusal::Unavailable, format!("run {}: its ring was not installed at its ranks' nodes within {lease} ms", j.run));
                replies.extend(r.waiting.into_iter().map(|c| (c, reply.clone())));
            }
        }
        let rings: Vec<u16> = self.rings.iter().filter(|(_, r)| r.expires_ms <= now_ms).map(|(id, _)| *id).collect();
        for id in rings {
            self.rings.remove(&id);
            self.counts.expired += 1;
            gone.push(id);
        }
        let stale: Vec<(String, String)> = self
            .joining
            .iter()
            .filter(|(_, j)| j.started_ms + lease <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for key in stale {
            let j = self.joining.remove(&key).expect("present");
            let missing: Vec<u16> = (0..j.world).filter(|r| !j.ranks.contains_key(r)).collect();
            let reply = refuse(
                Refusal::Unavailable,
                format!("run {}: ranks {missing:?} did not join within {lease} ms", key.1),
            );
            replies.extend(j.ranks.values().map(|(_, c)| (*c, reply.clone())));
        }
        for (_, r) in &replies {
            if let Reply::Refused { reason, .. } = r {
                *self.counts.refused.entry(*reason).or_default() += 1;
            }
        }
        (gone, replies)
    }

    /// Removes live job `job` without a reply (the node could not apply
    /// it); whether it was live.
    pub fn remove(&mut self, job: u16) -> bool {
        self.live.remove(&job).is_some()
    }

    /// The node's file changed (`aggbox reload`): what it uses is never
    /// handed out from now on.
    pub fn set_file(&mut self, file: &Config) {
        let fresh = Registry::new(Keys::default(), self.limits.clone(), file);
        (self.file_ids, self.file_ports, self.file_groups) = (fresh.file_ids, fresh.file_ports, fresh.file_groups);
    }

    /// The key file was read again (`aggbox reload`): a revoked or removed
    /// tenant's requests are refused from now on; its live jobs run until
    /// their runs end them or their leases run out (a renewal is a request,
    /// so a revoked tenant's jobs end within a lease).
    pub fn set_keys(&mut self, keys: Keys) {
        self.keys = keys;
    }

    /// A connection closed: its rank's join is withdrawn.
    pub fn closed(&mut self, conn: ConnId) {
        for j in self.joining.values_mut() {
            j.ranks.retain(|_, (_, c)| *c != conn);
        }
        self.joining.retain(|_, j| !j.ranks.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::control::keys::Tenant;

    const T0: u64 = 1_800_000_000_000;

    fn keys() -> Keys {
        let mut k = Keys::default();
        for (name, revoked, jobs) in [("alice", false, 2), ("bob", false, 4), ("eve", true, 4)] {
            k.tenants.insert(
                name.into(),
                Tenant { name: name.into(), key: vec![name.len() as u8; 32], revoked, jobs, workers: 16 },
            );
        }
        k
    }

    fn registry() -> Registry {
        let file = Config::parse(
            "[[job]]\nid = 61440\nport = 47000\nworkers = [\"10.0.0.1\"]\nresult_port = 47001\n",
            "t",
        )
        .unwrap();
        Registry::new(keys(), Limits::default(), &file)
    }

    struct Client {
        tenant: &'static str,
        nonce: u128,
    }

    impl Client {
        fn frame(&mut self, time_ms: u64, r: &Request) -> Vec<u8> {
            self.nonce += 1;
            let key = vec![self.tenant.len() as u8; 32];
            serde_json::to_vec(&Envelope::sign(self.tenant, &key, self.nonce.to_be_bytes(), time_ms, r)).unwrap()
        }
    }

    fn join(run: &str, world: u16, rank: u16) -> Request {
        Request::Join {
            run: run.into(),
            world,
            rank,
            data: SocketAddr::new(std::net::Ipv4Addr::from([10, 0, run.as_bytes()[0], rank as u8 + 1]).into(), 7700),
            vector_len: None,
            window: None,
            frag_elems: None,
            parent: None,
            ring: None,
        }
    }

    fn reason(replies: &[(ConnId, Reply)]) -> Refusal {
        match &replies[..] {
            [(_, Reply::Refused { reason, .. })] => *reason,
            other => panic!("not one refusal: {other:?}"),
        }
    }

    /// Joins every rank of `run`; the grant all got.
    fn run_of(reg: &mut Registry, c: &mut Client, now: u64, run: &str, world: u16) -> JobGrant {
        let mut out = Vec::new();
        for r in 0..world {
            let f = c.frame(now, &join(run, world, r));
            out = reg.handle(now, u64::from(r), &f);
            if r + 1 < world {
                assert!(out.is_empty(), "rank {r} answered before the run is complete: {out:?}");
            }
        }
        assert_eq!(out.len(), world as usize);
        let Reply::Joined(g) = &out[0].1 else { panic!("{out:?}") };
        assert!(out.iter().all(|(_, r)| *r == Reply::Joined(g.clone())), "every rank gets the same grant");
        g.clone()
    }

    /// A run of IPv6 data sockets gets its job; a run whose ranks are of
    /// two families, or that asks for a ring from IPv6, is refused at the
    /// join.
    #[test]
    fn a_run_of_ipv6_ranks_is_granted_and_a_mix_of_families_refused() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        let v6 = |run: &str, world: u16, rank: u16| {
            let mut r = join(run, world, rank);
            if let Request::Join { data, .. } = &mut r {
                *data = SocketAddr::new(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, u16::from(run.as_bytes()[0]), rank + 1).into(), 7700);
            }
            r
        };
        let f = c.frame(T0, &v6("s", 2, 0));
        assert!(reg.handle(T0, 0, &f).is_empty());
        let f = c.frame(T0, &v6("s", 2, 1));
        let out = reg.handle(T0, 1, &f);
        let Reply::Joined(g) = &out[0].1 else { panic!("{out:?}") };
        assert_eq!(g.workers[1].to_string(), "[fd00::73:2]:7700");
        let f = c.frame(T0, &v6("m", 2, 0));
        assert!(reg.handle(T0, 2, &f).is_empty());
        let f = c.frame(T0, &join("m", 2, 1));
        assert_eq!(reason(&reg.handle(T0, 3, &f)), Refusal::Malformed);
        let mut ring = v6("r", 2, 0);
        if let Request::Join { ring, .. } = &mut ring {
            *ring = Some("[fd00::1]:7471".parse().unwrap());
        }
        let f = c.frame(T0, &ring);
        assert_eq!(reason(&reg.handle(T0, 4, &f)), Refusal::Malformed);
    }

    #[test]
    fn a_run_gets_a_job_when_every_rank_joined_never_one_of_the_file() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        let g = run_of(&mut reg, &mut c, T0, "r", 4);
        assert_ne!(g.job, 61440, "the file's job id");
        assert!(![47000, 47001].contains(&g.port) && g.result_port == g.port + 1);
        assert_eq!(g.workers.len(), 4);
        assert_eq!(g.incarnation, 1);
        let (jobs, groups) = reg.desired();
        assert_eq!(jobs[0].id, g.job);
        assert_eq!(jobs[0].consumer, ResultConsumer::Node);
        assert_eq!(groups[0].members, g.workers);
        assert_eq!(jobs[0].result_group, Some(groups[0].id));
    }

    #[test]
    fn a_grant_carries_the_nodes_ack_settings() {
        let file = Config::parse("[node]\nack_mode = \"packet\"\nack_group = 64\n", "t").unwrap();
        let mut reg = Registry::new(keys(), Limits::default(), &file);
        let g = run_of(&mut reg, &mut Client { tenant: "alice", nonce: 0 }, T0, "r", 1);
        assert_eq!((g.ack_mode, g.ack_group), (crate::wire::proto::AckMode::Packet, 64));
    }

    #[test]
    fn refusals_change_nothing_and_are_counted_by_reason() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        let f = c.frame(T0, &join("r", 2, 0));
        let mut e: Envelope = serde_json::from_slice(&f).unwrap();
        assert_eq!(reason(&reg.handle(T0, 1, b"{not json")), Refusal::Malformed);
        e.tenant = "mallory".into();
        assert_eq!(reason(&reg.handle(T0, 1, &serde_json::to_vec(&e).unwrap())), Refusal::UnknownTenant);
        let mut revoked = Client { tenant: "eve", nonce: 0 };
        assert_eq!(reason(&reg.handle(T0, 1, &revoked.frame(T0, &join("r", 2, 0)))), Refusal::Revoked);
        let mut forged: Envelope = serde_json::from_slice(&f).unwrap();
        forged.request = forged.request.replace("\"world\":2", "\"world\":3");
        assert_eq!(reason(&reg.handle(T0, 1, &serde_json::to_vec(&forged).unwrap())), Refusal::BadMac);
        assert_eq!(reason(&reg.handle(T0 + 60_000, 1, &f)), Refusal::Stale);
        assert!(reg.handle(T0, 1, &f).is_empty(), "the genuine request: rank 0 waits");
        assert_eq!(reason(&reg.handle(T0, 2, &f)), Refusal::Replayed);
        assert!(reg.live().is_empty());
        assert_eq!(reason(&reg.handle(T0, 3, &c.frame(T0, &join("r", 3, 1)))), Refusal::Conflict, "another world size");
        let counts = &reg.counts().refused;
        for r in [Refusal::Malformed, Refusal::UnknownTenant, Refusal::Revoked, Refusal::BadMac, Refusal::Stale, Refusal::Replayed, Refusal::Conflict] {
            assert_eq!(counts.get(&r), Some(&1), "{r:?} in {counts:?}");
        }
        // Rank 1 completes the run: the refusals changed nothing.
        let out = reg.handle(T0, 4, &c.frame(T0, &join("r", 2, 1)));
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn a_runs_window_and_fragment_size_reach_its_job_and_every_rank_asks_the_same() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        let shaped = |rank: u16, window: Option<u32>, frag_elems: Option<u32>| match join("s", 2, rank) {
            Request::Join { run, world, rank, data, .. } => Request::Join { run, world, rank, data, vector_len: Some(1000), window, frag_elems, parent: None, ring: None },
            _ => unreachable!(),
        };
        assert_eq!(reason(&reg.handle(T0, 1, &c.frame(T0, &shaped(0, Some(0), None)))), Refusal::Malformed, "window 0");
        assert_eq!(reason(&reg.handle(T0, 1, &c.frame(T0, &shaped(0, None, Some(abi::MAX_ELEMS + 1))))), Refusal::Malformed, "frag_elems too large");
        assert!(reg.handle(T0, 1, &c.frame(T0, &shaped(0, Some(16), Some(2240)))).is_empty(), "rank 0 waits for rank 1");
        assert_eq!(reason(&reg.handle(T0, 2, &c.frame(T0, &shaped(1, Some(32), Some(2240))))), Refusal::Conflict, "another window");
        assert_eq!(reg.handle(T0, 2, &c.frame(T0, &shaped(1, Some(16), Some(2240)))).len(), 2, "both ranks answered");
        let (jobs, _) = reg.desired();
        assert_eq!((jobs[0].vector_len, jobs[0].window, jobs[0].frag_elems), (Some(1000), 16, Some(2240)));
    }

    #[test]
    fn quotas_refuse_the_job_that_would_exceed_them_naming_the_limit() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        run_of(&mut reg, &mut c, T0, "a", 2);
        run_of(&mut reg, &mut c, T0, "b", 2);
        let out = reg.handle(T0, 9, &c.frame(T0, &join("c", 2, 0)));
        assert_eq!(reason(&out), Refusal::OverQuota);
        assert!(matches!(&out[0].1, Reply::Refused { message, .. } if message.contains("quota is 2")));
        let mut bob = Client { tenant: "bob", nonce: 100 };
        let over = Request::Join { run: "big".into(), world: 17, rank: 0, data: "10.0.9.1:1".parse().unwrap(), vector_len: None, window: None, frag_elems: None, parent: None, ring: None };
        assert_eq!(reason(&reg.handle(T0, 9, &bob.frame(T0, &over))), Refusal::OverQuota);
    }

    #[test]
    fn another_runs_worker_socket_is_a_conflict() {
        let mut reg = registry();
        let mut a = Client { tenant: "alice", nonce: 0 };
        run_of(&mut reg, &mut a, T0, "a", 2);
        let mut b = Client { tenant: "bob", nonce: 1000 };
        let taken = Request::Join { run: "b".into(), world: 2, rank: 0, data: SocketAddr::new(std::net::Ipv4Addr::from([10, 0, b'a', 2]).into(), 7700), vector_len: None, window: None, frag_elems: None, parent: None, ring: None };
        assert_eq!(reason(&reg.handle(T0, 7, &b.frame(T0, &taken))), Refusal::Conflict);
        assert!(reg.handle(T0, 7, &b.frame(T0, &join("b", 2, 0))).is_empty(), "its own sockets: accepted");
    }

    #[test]
    fn leases_renew_end_and_expire_and_a_restarted_run_is_a_new_incarnation() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        let g = run_of(&mut reg, &mut c, T0, "r", 2);
        let lease = g.lease_ms;
        let renew = Request::Renew { job: g.job, incarnation: g.incarnation };
        assert_eq!(reg.handle(T0 + lease - 1, 0, &c.frame(T0, &renew)), vec![(0, Reply::Renewed { lease_ms: lease })]);
        assert_eq!(reg.expire(T0 + lease).0, Vec::<u16>::new(), "renewed");
        let mut other = Client { tenant: "bob", nonce: 500 };
        assert_eq!(reason(&reg.handle(T0, 0, &other.frame(T0, &renew))), Refusal::UnknownJob, "another tenant's job");
        // The run restarts (its workers killed): the new incarnation
        // replaces the job at once, with another id.
        let g2 = run_of(&mut reg, &mut c, T0 + 10, "r", 2);
        assert_eq!(g2.incarnation, 2);
        assert_ne!(g2.job, g.job);
        assert_eq!(reg.live().len(), 1);
        assert_eq!(reason(&reg.handle(T0, 0, &c.frame(T0, &renew))), Refusal::UnknownJob, "the old incarnation");
        // Not renewed: gone after a lease.
        assert_eq!(reg.expire(T0 + 10 + lease).0, vec![g2.job]);
        assert!(reg.live().is_empty() && reg.desired().0.is_empty());
        let g3 = run_of(&mut reg, &mut c, T0 + 20, "r", 2);
        let end = |rank| Request::End { job: g3.job, incarnation: 3, rank };
        assert_eq!(reg.handle(T0, 0, &c.frame(T0, &end(1))), vec![(0, Reply::Ended { remaining: 1 })]);
        assert_eq!(reg.live().len(), 1, "rank 0 has not ended: the job stays");
        assert_eq!(reg.handle(T0, 0, &c.frame(T0, &end(0))), vec![(0, Reply::Ended { remaining: 0 })]);
        assert!(reg.live().is_empty());
        assert_eq!((reg.counts().created, reg.counts().ended, reg.counts().expired), (3, 2, 1));
    }

    #[test]
    fn a_revoked_tenant_cannot_renew_and_its_job_ends_within_a_lease() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        let g = run_of(&mut reg, &mut c, T0, "r", 2);
        let mut keys = keys();
        keys.tenants.get_mut("alice").unwrap().revoked = true;
        reg.set_keys(keys);
        let renew = Request::Renew { job: g.job, incarnation: g.incarnation };
        assert_eq!(reason(&reg.handle(T0 + 1, 0, &c.frame(T0 + 1, &renew))), Refusal::Revoked);
        assert_eq!(reg.expire(T0 + g.lease_ms).0, vec![g.job]);
    }

    #[test]
    fn a_run_whose_ranks_do_not_all_join_is_dropped_after_a_lease() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        assert!(reg.handle(T0, 5, &c.frame(T0, &join("r", 3, 0))).is_empty());
        let (gone, replies) = reg.expire(T0 + Limits::default().lease_ms);
        assert!(gone.is_empty());
        assert!(matches!(&replies[..], [(5, Reply::Refused { reason: Refusal::Unavailable, message })] if message.contains("[1, 2]")));
        // A closed connection withdraws its rank.
        assert!(reg.handle(T0, 6, &c.frame(T0, &join("s", 2, 0))).is_empty());
        reg.closed(6);
        assert!(reg.handle(T0, 7, &c.frame(T0, &join("s", 2, 1))).is_empty(), "rank 0 withdrew: not complete");
    }

    fn leaf_join(run: &str, world: u16, rank: u16, leaf: u16) -> Request {
        let parent = TreeParent { node: "10.0.9.9:7471".parse().unwrap(), leaf, leaves: 2, tree_workers: 2 * world };
        match join(run, world, rank) {
            Request::Join { run, world, rank, data, .. } => Request::Join { run, world, rank, data, vector_len: None, window: None, frag_elems: None, parent: Some(parent), ring: None },
            _ => unreachable!(),
        }
    }

    fn root_grant(job: u16) -> JobGrant {
        JobGrant {
            job,
            incarnation: 1,
            port: 47100,
            result_port: 47101,
            workers: vec!["10.0.1.1:47001".parse().unwrap(), "10.0.1.2:47001".parse().unwrap()],
            lease_ms: 10_000,
            ack_mode: crate::wire::proto::AckMode::Group,
            ack_group: crate::config::MAX_ACK_GROUP,
            tree_workers: None,
            ring: None,
        }
    }

    /// Rank `rank`'s join of a run of `world` with a ring, its own node
    /// 10.0.8.(rank+1):7471.
    fn ring_join(run: &str, world: u16, rank: u16, vector_len: Option<u32>) -> Request {
        let Request::Join { run, world, rank, data, .. } = join(run, world, rank) else { unreachable!() };
        let ring = Some(SocketAddr::new(std::net::Ipv4Addr::from([10, 0, 8, rank as u8 + 1]).into(), 7471));
        Request::Join { run, world, rank, data, vector_len, window: None, frag_elems: None, parent: None, ring }
    }

    #[test]
    fn a_run_with_a_ring_is_answered_once_its_ring_is_installed_at_its_ranks_nodes() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        assert_eq!(reason(&reg.handle(T0, 9, &c.frame(T0, &ring_join("m", 2, 0, None)))), Refusal::Malformed, "a ring needs a vector_len");
        assert_eq!(reason(&reg.handle(T0, 9, &c.frame(T0, &ring_join("m", 1, 0, Some(10))))), Refusal::Malformed, "a ring needs 2 ranks");
        assert!(reg.handle(T0, 1, &c.frame(T0, &ring_join("r", 2, 0, Some(5000)))).is_empty());
        // A rank without a ring in a run with one: another shape.
        let plain = join("r", 2, 1);
        assert_eq!(reason(&reg.handle(T0, 3, &c.frame(T0, &plain))), Refusal::Conflict);
        assert!(reg.handle(T0, 2, &c.frame(T0, &ring_join("r", 2, 1, Some(5000)))).is_empty(), "complete, but no ring yet");
        let starts = reg.take_ring_starts();
        assert_eq!(starts.len(), 1);
        let st = &starts[0];
        assert_eq!(st.nodes, vec!["10.0.8.1:7471".parse().unwrap(), "10.0.8.2:7471".parse::<SocketAddr>().unwrap()]);
        assert_eq!(st.members, vec![Ipv4Addr::new(10, 0, b'r', 1), Ipv4Addr::new(10, 0, b'r', 2)]);
        assert_eq!((st.vector_len, st.key.clone()), (5000, vec![5u8; 32]));
        assert_eq!(reg.desired().0.len(), 1, "the star's job is served meanwhile");
        let ring = RingGrant { id: 61500, port: 48100, members: st.members.clone(), vector_len: 5000, frag_elems: 362 };
        let replies = reg.ring_ready(T0 + 5, st.job, st.incarnation, ring.clone());
        assert_eq!(replies.iter().map(|(c, _)| *c).collect::<Vec<_>>(), vec![1, 2]);
        let Reply::Joined(g) = &replies[0].1 else { panic!("{replies:?}") };
        assert_eq!(g.ring, Some(ring.clone()));
        assert!(reg.ring_ready(T0, st.job, st.incarnation, ring).is_empty(), "answered once");
        assert!(reg.ring_lost(st.job, st.incarnation) && reg.live().is_empty(), "a member that loses the ring takes the job");

        // A ring that cannot be installed refuses the ranks and keeps nothing.
        assert!(reg.handle(T0, 4, &c.frame(T0, &ring_join("s", 2, 0, Some(10)))).is_empty());
        assert!(reg.handle(T0, 5, &c.frame(T0, &ring_join("s", 2, 1, Some(10)))).is_empty());
        let st = reg.take_ring_starts().remove(0);
        let replies = reg.ring_failed(st.job, st.incarnation, "rank 1's node 10.0.8.2:7471 refused");
        assert_eq!(replies.len(), 2);
        assert!(matches!(&replies[0].1, Reply::Refused { reason: Refusal::Unavailable, message } if message.contains("10.0.8.2:7471")), "{replies:?}");
        assert!(reg.live().is_empty());
        // Two ranks naming one node cannot both be its member.
        assert!(reg.handle(T0, 6, &c.frame(T0, &ring_join("u", 2, 0, Some(10)))).is_empty());
        let Request::Join { run, world, rank, data, vector_len, .. } = ring_join("u", 2, 1, Some(10)) else { unreachable!() };
        let same = Request::Join { run, world, rank, data, vector_len, window: None, frag_elems: None, parent: None, ring: Some("10.0.8.1:7471".parse().unwrap()) };
        assert_eq!(reason(&reg.handle(T0, 7, &c.frame(T0, &same))), Refusal::Conflict);
    }

    #[test]
    fn a_member_node_serves_a_runs_ring_renews_replaces_and_ends_it() {
        let file = Config::parse(
            "[node]\nring_frag_elems = 100\n[[ring]]\nid = 61450\nport = 48000\nmembers = [\"10.0.0.1\", \"10.0.0.2\"]\nvector_len = 10\n",
            "t",
        )
        .unwrap();
        let mut reg = Registry::new(keys(), Limits::default(), &file);
        let mut alice = Client { tenant: "alice", nonce: 0 };
        let mut bob = Client { tenant: "bob", nonce: 1 << 20 }; // nonces apart from alice's
        let members: Vec<Ipv4Addr> = vec![[10, 0, 0, 1].into(), [10, 0, 0, 2].into()];
        let install = |run: &str, ring: u16, port: u16| Request::RingInstall { run: run.into(), ring, port, members: members.clone(), vector_len: 1000 };
        assert_eq!(reason(&reg.handle(T0, 1, &alice.frame(T0, &install("a", 61450, 48200)))), Refusal::Conflict, "the file's ring id");
        assert_eq!(reason(&reg.handle(T0, 1, &alice.frame(T0, &install("a", 61451, 48000)))), Refusal::Conflict, "the file's ring port");
        let ok = reg.handle(T0, 1, &alice.frame(T0, &install("a", 61451, 48201)));
        assert_eq!(ok, vec![(1, Reply::RingInstalled { ring: 61451, frag_elems: 100, lease_ms: 10_000 })]);
        let rings = reg.desired_rings();
        assert_eq!((rings.len(), rings[0].id, rings[0].port, rings[0].frag_elems, rings[0].weights.clone()), (1, 61451, 48201, 100, vec![1, 1]));
        assert_eq!(reason(&reg.handle(T0, 2, &bob.frame(T0, &install("b", 61451, 48300)))), Refusal::Conflict, "another run's ring id");
        assert_eq!(reason(&reg.handle(T0, 2, &bob.frame(T0, &install("b", 61452, 48201)))), Refusal::Conflict, "another run's ring port");
        assert_eq!(reason(&reg.handle(T0, 2, &bob.frame(T0, &Request::RingRenew { run: "a".into(), ring: 61451 }))), Refusal::UnknownJob, "another tenant's");
        assert_eq!(reason(&reg.handle(T0, 2, &bob.frame(T0, &Request::RingEnd { run: "a".into(), ring: 61451 }))), Refusal::UnknownJob);
        // Asked again: renewed, the same ring.
        let state = reg.state();
        assert!(matches!(reg.handle(T0 + 9_000, 1, &alice.frame(T0 + 9_000, &install("a", 61451, 48201)))[0].1, Reply::RingInstalled { .. }));
        assert_eq!(reg.state(), state, "a renewal changes nothing of the kernel's");
        assert!(reg.expire(T0 + 12_000).0.is_empty(), "renewed at +9 s");
        // The run's other proposal replaces it.
        assert!(matches!(reg.handle(T0, 1, &alice.frame(T0, &install("a", 61460, 48202)))[0].1, Reply::RingInstalled { ring: 61460, .. }));
        assert_eq!(reg.rings().keys().copied().collect::<Vec<_>>(), vec![61460]);
        assert_eq!(reg.handle(T0, 1, &alice.frame(T0, &Request::RingRenew { run: "a".into(), ring: 61460 }))[0].1, Reply::Renewed { lease_ms: 10_000 });
        assert_eq!(reg.handle(T0, 1, &alice.frame(T0, &Request::RingEnd { run: "a".into(), ring: 61460 }))[0].1, Reply::Ended { remaining: 0 });
        assert!(reg.rings().is_empty());
        // Unrenewed, it expires within a lease.
        assert!(matches!(reg.handle(T0, 1, &alice.frame(T0, &install("c", 61470, 48203)))[0].1, Reply::RingInstalled { .. }));
        assert_eq!(reg.expire(T0 + 10_000).0, vec![61470]);
        assert!(reg.rings().is_empty());
        let bad = Request::RingInstall { run: "d".into(), ring: 61471, port: 48204, members: vec![[10, 0, 0, 1].into(); 2], vector_len: 10 };
        assert_eq!(reason(&reg.handle(T0, 1, &alice.frame(T0, &bad))), Refusal::Malformed, "a member twice");
    }

    #[test]
    fn a_leaf_job_is_answered_and_served_only_once_its_root_granted_its_job() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        assert!(reg.handle(T0, 1, &c.frame(T0, &leaf_join("t", 2, 0, 1))).is_empty());
        assert!(reg.handle(T0, 2, &c.frame(T0, &leaf_join("t", 2, 1, 1))).is_empty(), "complete, but no root job yet");
        let starts = reg.take_upstream_starts();
        assert_eq!(starts.len(), 1);
        let st = &starts[0];
        assert_eq!((st.run.as_str(), st.tenant.as_str(), st.parent.leaf, st.key.clone()), ("t", "alice", 1, vec![5u8; 32]));
        assert!(reg.desired().0.is_empty(), "not served before its root's job exists");
        assert_eq!(reg.live().len(), 1, "its id and ports are held meanwhile");
        let root_addr: IpAddr = Ipv4Addr::new(10, 0, 9, 9).into();
        let UpstreamOutcome::Serving(replies) = reg.upstream_joined(T0 + 5, st.job, st.incarnation, root_addr, root_grant(61000)) else { panic!() };
        assert_eq!(replies.iter().map(|(c, _)| *c).collect::<Vec<_>>(), vec![1, 2]);
        let Reply::Joined(g) = &replies[0].1 else { panic!("{replies:?}") };
        assert_eq!(g.tree_workers, Some(4));
        let (jobs, _) = reg.desired();
        let parent = jobs[0].parent.expect("a leaf's job has its root as parent");
        assert_eq!((parent.addr, parent.port, parent.job, parent.rank, parent.result_port, parent.tree_workers), (root_addr, 47100, 61000, 1, Some(47101), Some(4)));
        assert_eq!(jobs[0].consumer, ResultConsumer::Node);
        assert_eq!(reg.upstream_joined(T0, st.job, st.incarnation, root_addr, root_grant(61000)), UpstreamOutcome::Gone, "answered once");
        // The root stops serving it: the leaf's job goes too.
        assert!(reg.upstream_lost(st.job, st.incarnation));
        assert!(reg.live().is_empty() && !reg.upstream_lost(st.job, st.incarnation));
    }

    #[test]
    fn a_leaf_whose_root_refuses_or_never_answers_refuses_its_ranks_and_keeps_nothing() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        let Request::Join { run, world, rank, data, .. } = join("x", 2, 0) else { unreachable!() };
        let parent = Some(TreeParent { node: "10.0.9.9:1".parse().unwrap(), leaf: 2, leaves: 2, tree_workers: 4 });
        let bad = Request::Join { run, world, rank, data, vector_len: None, window: None, frag_elems: None, parent, ring: None };
        assert_eq!(reason(&reg.handle(T0, 1, &c.frame(T0, &bad))), Refusal::Malformed, "leaf beyond the leaves");
        for r in 0..2 {
            reg.handle(T0, 1 + u64::from(r), &c.frame(T0, &leaf_join("t", 2, r, 0)));
        }
        let st = reg.take_upstream_starts().remove(0);
        let replies = reg.upstream_failed(st.job, st.incarnation, "the tree's root node 10.0.9.9:7471 refused");
        assert_eq!(replies.len(), 2);
        assert!(matches!(&replies[0].1, Reply::Refused { reason: Refusal::Unavailable, message } if message.contains("10.0.9.9:7471")));
        assert!(reg.live().is_empty());
        // Another ack setting at the root: refused, nothing kept.
        for r in 0..2 {
            reg.handle(T0, 1 + u64::from(r), &c.frame(T0, &leaf_join("u", 2, r, 0)));
        }
        let st = reg.take_upstream_starts().remove(0);
        let other = JobGrant { ack_mode: crate::wire::proto::AckMode::Packet, ..root_grant(61000) };
        let UpstreamOutcome::Refused(replies) = reg.upstream_joined(T0, st.job, st.incarnation, [10, 0, 9, 9].into(), other) else { panic!() };
        assert!(matches!(&replies[0].1, Reply::Refused { message, .. } if message.contains("ack_mode")), "{replies:?}");
        assert!(reg.live().is_empty());
        // No grant within a lease: its ranks are refused when it expires.
        for r in 0..2 {
            reg.handle(T0, 1 + u64::from(r), &c.frame(T0, &leaf_join("v", 2, r, 0)));
        }
        let (gone, replies) = reg.expire(T0 + Limits::default().lease_ms);
        assert_eq!((gone.len(), replies.len()), (1, 2));
        assert!(matches!(&replies[0].1, Reply::Refused { reason: Refusal::Unavailable, message } if message.contains("did not grant")));
    }

    #[test]
    fn a_thousand_create_end_cycles_leave_nothing_behind() {
        let mut reg = registry();
        let mut c = Client { tenant: "alice", nonce: 0 };
        for k in 0..1000u64 {
            let now = T0 + k;
            let g = run_of(&mut reg, &mut c, now, "r", 2);
            for rank in 0..2 {
                let end = Request::End { job: g.job, incarnation: g.incarnation, rank };
                assert_eq!(reg.handle(now, 0, &c.frame(now, &end)), vec![(0, Reply::Ended { remaining: 1 - rank })]);
            }
        }
        assert!(reg.live().is_empty() && reg.joining.is_empty());
        // The nonces of the last freshness window only.
        reg.forget_nonces(T0 + 1000 + Limits::default().freshness_ms + 1);
        assert!(reg.nonces.is_empty() && reg.nonce_order.is_empty());
    }
}
