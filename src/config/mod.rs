//! The node configuration file (TOML), parsed and validated before anything
//! is attached.
//!
//! The schema is the one of `spec/INTERFACE.md` (`[node]`, `[[job]]`,
//! `[[group]]`) plus four job keys this project adds, `userspace_only`,
//! `window`, `userspace_slots` and `userspace_slot_bytes`, and two node keys,
//! `userspace_path` (`"required"`, the default, or `"optional"`: see
//! [`UserspacePathMode`]) and `userspace_slot_bytes`. `deploy/aggbox.example.toml` is a commented, valid example.
//!
//! # Why a hand-written walk instead of `#[derive(Deserialize)]`
//!
//! INTERFACE.md requires every configuration error to name the file, the line
//! and the key. serde's derive reports *what* went wrong but not *where in the
//! document tree*, and a message like "invalid type: integer, expected u16"
//! does not tell an operator which of twenty `[[job]]` tables is wrong. So the
//! TOML is first read into a small untyped tree in which every value carries
//! its byte span ([`toml::Spanned`]), and then walked by hand: each step knows
//! its key path (`job[1].workers[3]`) and its line, and unknown keys are
//! rejected the way `deny_unknown_fields` would, but with the path in the
//! message. Errors look like
//!
//! ```text
//! config.toml:12: job[1].workers[3]: "10.77.0.300" is not an IPv4 address
//! ```
//!
//! Array tables are counted from 0 (`job[0]` is the first `[[job]]`), the way
//! ranks and mask bits are counted; lines are counted from 1, like editors do.
//! TOML syntax errors get the line from the parser and a best-effort key (the
//! table header and `key =` in force at that line).
//!
//! # Decisions where the spec is silent
//!
//! - Only the first error is reported: INTERFACE.md asks for one clear line.
//! - Weights are `0..=2^23` ([`crate::wire::abi::MAX_WEIGHT`]) and must not
//!   sum to 0. The kernel keeps the AVG divisor as an unsigned `weight_sum`
//!   (`struct aggbox_job`), so a negative weight has no meaning there and a
//!   zero sum would divide by 0. The bound is the data plane's: it adds
//!   `weight * value` in a signed 64-bit sum per element, and 256 ranks ×
//!   2^31 × 2^23 stays below 2^62; checking it here names file, line and key
//!   instead of failing later inside `XdpPlane::set_job`. With it the sum
//!   (at most 256 × 2^23 = 2^31) always fits the u32 `weight_sum`. A single
//!   weight of 0 is allowed: that rank must still contribute for the slot to
//!   complete, but its values do not count.
//! - A UDP port may serve one job only, and a job's `result_port` may be
//!   neither its own port nor another job's contribution port (RESULT
//!   datagrams there would be taken for contributions). Several jobs may
//!   share one `result_port`: the `job` field tells their results apart.
//! - `result_port` is required even with `parent` (INTERFACE.md lists it as
//!   mandatory); a job with a parent sends its results upstream instead.
//!   With `consumer = "node"` it is where the node's result service takes
//!   the job's own RESULTs and the parent's (docs/PROTOCOL.md, "Trees served
//!   by the node"): `parent.result_port` is then required (the parent's
//!   result port, where the service acknowledges the parent's RESULTs),
//!   `parent.job` may be no job of this node with the same `result_port`
//!   (the XDP program would drop the parent's RESULTs there as forged), and
//!   `result_group` lists the workers' sockets the final RESULTs go to.
//!   Without `consumer = "node"`, `parent.result_port` is refused.
//! - `parent.tree_workers` (optional) is the number of workers of the whole
//!   tree, the mean divisor of this job's workers' float calls; it may not
//!   be fewer than the job's own workers.
//! - `result_group = 65535` is rejected: the jobs map uses 0xffff for "no
//!   group" ([`crate::wire::abi::NO_GROUP`]).
//! - Worker and parent addresses must be unicast: 0.0.0.0, 255.255.255.255
//!   and multicast cannot be a datagram's source (workers) or a routed
//!   next hop (parent, group members).
//! - A group may not list the same `IP:PORT` twice: each member is one mask
//!   bit, and two bits for one destination would deliver every datagram twice.
//! - `parent.rank` may be any rank but 65535, which marks RESULT datagrams;
//!   the parent's own limit on ranks is the parent's business.
//! - `metrics` also accepts an IPv6 `[ADDR]:PORT` (it is a plain TCP
//!   listener, not data-plane traffic), and rejects port 0: Prometheus must
//!   know where to scrape.
//! - At most [`crate::wire::abi::MAX_JOBS`] jobs, the size of the kernel's jobs map.

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use toml::Spanned;

use crate::wire::abi;

/// Where Prometheus metrics are served when `[node] metrics` is not given.
pub const DEFAULT_METRICS: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9435));

/// Default and largest ACK group size: one AGK1 bitmap covers at most this
/// many sequence numbers (`nbits` is 1..=1024 in PROTOCOL.md).
pub const MAX_ACK_GROUP: u16 = abi::ACK_MAX_BITS;

/// Default `slots` of a job: outstanding fragments it may hold at once.
pub const DEFAULT_SLOTS: u32 = 4096;

/// Default `window` of a job: completed rounds kept before a round is stale.
pub const DEFAULT_WINDOW: u32 = 4;

/// Default bound on a job's slots on the user-space path.
pub const DEFAULT_USERSPACE_SLOTS: u32 = 16384;

/// Default bound, in bytes, on the slot memory one job may hold on the
/// user-space path (64 MiB): the default `userspace_slots` at MTU 1500
/// (16,384 × 362 elements × 8 B ≈ 45 MiB plus per-slot overhead) fits; with
/// jumbo frames (16,370 elements, ~128 KiB a slot) the bytes bind first.
pub const DEFAULT_USERSPACE_SLOT_BYTES_JOB: u64 = 64 << 20;

/// Default bound, in bytes, on the slot memory of all jobs together on the
/// user-space path of one node (256 MiB).
pub const DEFAULT_USERSPACE_SLOT_BYTES_NODE: u64 = 256 << 20;

/// Smallest accepted `userspace_slot_bytes` (1 MiB, room for several slots
/// of the largest datagram): a smaller value is almost surely a unit slip
/// (`64` meant as MiB) and would refuse every jumbo slot.
pub const MIN_USERSPACE_SLOT_BYTES: u64 = 1 << 20;

/// Largest `window`: rounds are u32 sequence numbers compared modulo 2^32,
/// which is only unambiguous for distances below 2^31.
pub const MAX_WINDOW: u32 = i32::MAX as u32;

/// Most ranks of one job: the width of the kernel's contributor bitmap.
pub const MAX_WORKERS: usize = abi::MAX_RANKS as usize;

/// Most members of one broadcast group: the AGB1 mask has 32 bits.
pub const MAX_GROUP_MEMBERS: usize = 32;

/// The whole configuration of one node, validated.
///
/// Every cross-reference has been checked, so the data plane can write it
/// into the maps without checking again.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Config {
    /// `[node]`: settings of the node as a whole.
    pub node: NodeConfig,
    /// `[[job]]` tables in file order; ids and ports are unique.
    pub jobs: Vec<JobConfig>,
    /// `[[group]]` tables in file order; ids are unique.
    pub groups: Vec<GroupConfig>,
    /// `[[ring]]` tables in file order (ring allreduce jobs, docs/RING.md);
    /// ids unique among rings, ports unique among jobs and rings.
    pub rings: Vec<RingConfig>,
}

/// `[[ring]]`: a ring allreduce job (docs/RING.md). Every member is a node
/// running `aggbox attach` with the same table; the node finds its own
/// place in `members` by its interface's addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingConfig {
    /// The AGR1 `ring` field.
    pub id: u16,
    /// UDP port of the ring on every member.
    pub port: u16,
    /// The members in ring order: member i sends to member i + 1 (mod n).
    /// 2..=[`MAX_WORKERS`] distinct addresses.
    pub members: Vec<Ipv4Addr>,
    /// Weight of each member (all 1 when the file gives none).
    pub weights: Vec<i32>,
    /// Elements of the reduced vector (>= 1).
    pub vector_len: u32,
    /// Elements per fragment (one datagram), even, 2..=
    /// [`crate::wire::abi::RING_MAX_FRAG_ELEMS`]; default
    /// [`DEFAULT_RING_FRAG_ELEMS`] (MTU 1500). Every ring of a node has the
    /// same (the data map's value size).
    pub frag_elems: u32,
}

/// `[[ring]] frag_elems` default: the elements of a 1500-byte IPv4
/// datagram ((1500 - 20 - 8 - 24) / 4).
pub const DEFAULT_RING_FRAG_ELEMS: u32 = 362;

impl RingConfig {
    /// Fragments of the vector.
    pub fn frags(&self) -> u32 {
        self.vector_len.div_ceil(self.frag_elems)
    }

    /// Sum of the weights (the AVG divisor).
    pub fn weight_sum(&self) -> u32 {
        self.weights.iter().map(|&w| w as u32).sum()
    }
}

/// `[node]`: settings that are not per job or group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// Prometheus exposition address; `None` when `metrics = "off"`.
    pub metrics: Option<SocketAddr>,
    /// How receivers acknowledge.
    pub ack_mode: AckMode,
    /// Sequence numbers per group ACK, 1..=[`MAX_ACK_GROUP`].
    pub ack_group: u16,
    /// `userspace_path`: whether `aggbox attach` may go on without the
    /// user-space (AF_XDP) path.
    pub userspace_path: UserspacePathMode,
    /// `userspace_slot_bytes`: bound on the slot memory of all jobs together
    /// on the user-space path, bytes (>= [`MIN_USERSPACE_SLOT_BYTES`]).
    pub userspace_slot_bytes: u64,
    /// `control`: where the control endpoint (jobs on demand, AGC1)
    /// listens; it is served only when `keys` names a key file.
    pub control: SocketAddr,
    /// `keys`: the key file of the tenants that may create jobs on demand;
    /// `None`: no control endpoint.
    pub keys: Option<std::path::PathBuf>,
}

/// Where the control endpoint listens when `[node] control` is not given.
pub const DEFAULT_CONTROL: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 7471);

/// `[node] userspace_path`: what `aggbox attach` does when the user-space
/// (AF_XDP) path cannot start. Without it, contributions the kernel does not
/// aggregate (ops 5..10, FLOAT32, a full slot pool, `userspace_only` jobs)
/// reach the stack unaggregated, so running without it is a choice the
/// operator makes, not a warning scrolled past.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum UserspacePathMode {
    /// `"required"` (the default): attach fails when a job is configured and
    /// the path does not start.
    #[default]
    Required,
    /// `"optional"`: attach warns and goes on without it; `aggbox status`
    /// and `aggbox_userspace_path_up` show it is not running.
    Optional,
}

impl UserspacePathMode {
    /// The spelling used in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            UserspacePathMode::Required => "required",
            UserspacePathMode::Optional => "optional",
        }
    }
}

impl Default for NodeConfig {
    /// The values INTERFACE.md shows: metrics on 127.0.0.1:9435, group ACKs
    /// of 1024.
    fn default() -> Self {
        NodeConfig {
            metrics: Some(DEFAULT_METRICS),
            ack_mode: AckMode::Group,
            ack_group: MAX_ACK_GROUP,
            userspace_path: UserspacePathMode::Required,
            userspace_slot_bytes: DEFAULT_USERSPACE_SLOT_BYTES_NODE,
            control: DEFAULT_CONTROL,
            keys: None,
        }
    }
}

/// `[node] ack_mode`: a rule of the protocol (how AGK1 acknowledges), so it
/// lives with the wire format; the config only spells it.
pub use crate::wire::proto::AckMode;

/// `[[job]]`: one reduction group this node aggregates. Host-order fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobConfig {
    /// The AGG1 `job` field.
    pub id: u16,
    /// UDP port contributions arrive on (never 0).
    pub port: u16,
    /// Source address of each rank: rank i sends from `workers[i]`.
    /// 1..=[`MAX_WORKERS`] entries, all distinct.
    pub workers: Vec<Ipv4Addr>,
    /// Weight of each rank, same length as `workers` (all 1 when the file
    /// gives none); each is in `0..=`[`crate::wire::abi::MAX_WEIGHT`] and
    /// their sum is positive (and at most 2^31, so it fits `u32`).
    pub weights: Vec<i32>,
    /// Local UDP port RESULT datagrams are delivered to (never 0, never a
    /// job's contribution port).
    pub result_port: u16,
    /// Broadcast group that also receives every RESULT; it is configured.
    pub result_group: Option<u16>,
    /// Length of the reduced vector; `None` = unbounded.
    pub vector_len: Option<u32>,
    /// Bound on outstanding fragments (slots) of this job, >= 1.
    pub slots: u32,
    /// Upstream aggregator, for an intermediate node of a tree.
    pub parent: Option<ParentConfig>,
    /// Hand every contribution to the user-space path (no kernel
    /// aggregation), e.g. to compare paths or work around a kernel limit.
    pub userspace_only: bool,
    /// Completed rounds kept: a round older than newest − window is stale.
    pub window: u32,
    /// Bound on the slots this job may hold on the user-space path (what
    /// the kernel hands over when its pool is full or overloaded, and every
    /// slot of ops 5..10 / FLOAT32), so one job cannot take that path's
    /// memory from the others.
    pub userspace_slots: u32,
    /// Bound on the bytes of slot memory this job may hold on the user-space
    /// path (>= [`MIN_USERSPACE_SLOT_BYTES`]): with jumbo frames a slot holds
    /// up to 16,370 elements, so the slot count alone does not bound memory.
    pub userspace_slot_bytes: u64,
    /// Who takes the job's RESULTs on `result_port` (`consumer`).
    pub consumer: ResultConsumer,
    /// Elements of a full fragment as the job's senders cut them
    /// (`frag_elems`, 1..=[`crate::wire::abi::MAX_ELEMS`]); `None`: those of
    /// the attached interface's MTU. The fast slots index a round in steps
    /// of it (docs/DATAPLANE.md "Fast slots").
    pub frag_elems: Option<u32>,
}

/// `[[job]] consumer`: who takes a job's RESULTs on the node's
/// `result_port`, acknowledges the workers' contributions on the kernel's
/// behalf and resends RESULT copies a worker missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResultConsumer {
    /// `"application"` (the default): an aggregator application on the node
    /// (the runtime's `Participant::Aggregator`, e.g. a parameter server
    /// calling `reduce`).
    #[default]
    Application,
    /// `"node"`: `aggbox attach` itself (in-kernel allreduce: the job has a
    /// `result_group` whose members are the workers; or a tree job, whose
    /// RESULTs the node sends to its `parent` and whose parent's RESULTs it
    /// delivers to that group); no application runs on the node, and one
    /// that tries to take the job is refused.
    Node,
}

impl JobConfig {
    /// Sum of the weights, the AVG divisor (`weight_sum` in the jobs map).
    /// Validation guarantees it is > 0 and fits.
    pub fn weight_sum(&self) -> u32 {
        // Weights are validated non-negative with a sum <= u32::MAX, so the
        // conversions cannot fail; saturate rather than panic regardless.
        let sum: u64 = self
            .weights
            .iter()
            .map(|&w| u64::try_from(w).unwrap_or(0))
            .sum();
        u32::try_from(sum).unwrap_or(u32::MAX)
    }

    /// The parent the kernel sends this job's RESULTs to (TC's parent
    /// route, the RESULT numbered by the node's own counter). None for a
    /// node-served job: its result service sends them upstream itself and
    /// resends them until the parent acknowledges (docs/PROTOCOL.md, "Trees
    /// served by the node"), so the kernel delivers them locally.
    pub fn kernel_parent(&self) -> Option<&ParentConfig> {
        self.parent.as_ref().filter(|_| self.consumer != ResultConsumer::Node)
    }

    /// The group the kernel copies this job's RESULTs to (TC's group
    /// route). None for a node-served job with a parent: its own RESULTs
    /// are partial sums for the parent, and the final ones, the parent's,
    /// reach `result_group` from the node's result service.
    pub fn kernel_result_group(&self) -> Option<u16> {
        self.result_group.filter(|_| self.kernel_parent().is_some() || self.parent.is_none())
    }

    /// The rank whose configured source address is `addr`, if any: the
    /// source address is what identifies a rank.
    pub fn rank_of(&self, addr: Ipv4Addr) -> Option<u16> {
        self.workers
            .iter()
            .position(|&w| w == addr)
            .and_then(|i| u16::try_from(i).ok())
    }
}

/// `parent = { addr, port, job, rank, result_port }`: where an intermediate
/// aggregator sends its results, as its own contribution to the parent's job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParentConfig {
    /// The parent aggregator's IPv4 address.
    pub addr: Ipv4Addr,
    /// The parent job's contribution port (never 0).
    pub port: u16,
    /// The job id at the parent.
    pub job: u16,
    /// This node's rank in the parent job (never 65535, the RESULT rank).
    pub rank: u16,
    /// The parent job's `result_port`, where this node acknowledges the
    /// parent's RESULTs; required with `consumer = "node"` (the node's
    /// result service takes them), refused otherwise (nothing would).
    pub result_port: Option<u16>,
    /// `parent.tree_workers`: the workers of the whole tree (every worker
    /// below the root), the divisor of a float mean
    /// (`allreduce_f32(.., mean = true)`) for this job's workers; at least
    /// the job's own workers. `None`: the job's own workers.
    pub tree_workers: Option<u16>,
}

/// `[[group]]`: one broadcast group this node sends or forwards for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupConfig {
    /// The AGB1 `group` field.
    pub id: u16,
    /// Destination of each mask bit: bit i goes to `members[i]`.
    /// 1..=[`MAX_GROUP_MEMBERS`] distinct entries.
    pub members: Vec<SocketAddrV4>,
}

/// A configuration that could not be read or is invalid.
///
/// Displays as one line, `FILE:LINE: KEY: MESSAGE`; `LINE` is absent when
/// the file could not be read at all, `KEY` when a syntax error happens
/// outside any key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file name as given to [`Config::load`], or the `origin` given to
    /// [`Config::parse`].
    pub origin: String,
    /// 1-based line of the offending value.
    pub line: Option<usize>,
    /// Path of the offending key, e.g. `job[1].workers[3]`.
    pub key: Option<String>,
    /// What is wrong, without the location.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.origin)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": {key}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Read and validate the config file at `path`.
    ///
    /// # Errors
    ///
    /// The file cannot be read (no line then), or see [`Config::parse`].
    /// Errors name the path as given.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            origin: origin.clone(),
            line: None,
            key: None,
            message: format!("cannot read: {e}"),
        })?;
        Config::parse(&text, &origin)
    }

    /// Validate config `text`; `origin` names it in errors (usually the file
    /// name).
    ///
    /// # Errors
    ///
    /// The first problem in the text: a TOML syntax error, an unknown key, a
    /// missing or mistyped key, a value out of range, a duplicate id or
    /// port, a reference to a group that is not configured.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let src = Source { text, origin };
        let root: Value = toml::from_str(text).map_err(|e| src.toml_error(&e))?;
        let Value::Table(entries) = root else {
            // The TOML grammar makes the document a table; keep a message
            // anyway instead of a panic.
            return Err(src.error(0, None, "the document is not a TOML table".into()));
        };
        let mut top = Table::from_entries(&src, "", 0, entries, &["node", "job", "group", "ring"])?;

        let node = match top.take("node") {
            Some(v) => parse_node(&src, v)?,
            None => NodeConfig::default(),
        };
        let jobs = match top.take("job") {
            Some(v) => {
                let items = array_of_tables(&src, "job", v)?;
                let mut jobs = Vec::with_capacity(items.len());
                for (i, item) in items.into_iter().enumerate() {
                    let path = format!("job[{i}]");
                    if i >= abi::MAX_JOBS as usize {
                        return Err(src.error(
                            item.span().start,
                            Some(path),
                            format!(
                                "more than {} jobs; the kernel's jobs map holds {}",
                                abi::MAX_JOBS,
                                abi::MAX_JOBS
                            ),
                        ));
                    }
                    jobs.push(parse_job(&src, path, item)?);
                }
                jobs
            }
            None => Vec::new(),
        };
        let groups = match top.take("group") {
            Some(v) => {
                let items = array_of_tables(&src, "group", v)?;
                let mut groups = Vec::with_capacity(items.len());
                for (i, item) in items.into_iter().enumerate() {
                    groups.push(parse_group(&src, format!("group[{i}]"), item)?);
                }
                groups
            }
            None => Vec::new(),
        };
        check_references(&src, &jobs, &groups)?;
        let rings = match top.take("ring") {
            Some(v) => {
                let items = array_of_tables(&src, "ring", v)?;
                let mut rings: Vec<(RingConfig, String, usize, usize)> = Vec::with_capacity(items.len());
                for (i, item) in items.into_iter().enumerate() {
                    let path = format!("ring[{i}]");
                    if i >= abi::MAX_RINGS as usize {
                        return Err(src.error(
                            item.span().start,
                            Some(path),
                            format!("more than {} rings; the kernel's ring_jobs map holds {}", abi::MAX_RINGS, abi::MAX_RINGS),
                        ));
                    }
                    rings.push(parse_ring(&src, path, item)?);
                }
                check_rings(&src, &jobs, &rings)?;
                rings.into_iter().map(|r| r.0).collect()
            }
            None => Vec::new(),
        };
        Ok(Config {
            node,
            jobs: jobs.into_iter().map(|j| j.config).collect(),
            groups: groups.into_iter().map(|g| g.config).collect(),
            rings,
        })
    }

    /// The job with id `id`, if configured.
    pub fn job(&self, id: u16) -> Option<&JobConfig> {
        self.jobs.iter().find(|j| j.id == id)
    }

    /// The broadcast group with id `id`, if configured.
    pub fn group(&self, id: u16) -> Option<&GroupConfig> {
        self.groups.iter().find(|g| g.id == id)
    }

    /// The ring with id `id`, if configured.
    pub fn ring(&self, id: u16) -> Option<&RingConfig> {
        self.rings.iter().find(|r| r.id == id)
    }
}

// ---------------------------------------------------------------------------
// Sections
// ---------------------------------------------------------------------------

/// A parsed job plus the byte offsets of the keys that cross-checks
/// (duplicates, references) report on.
struct ParsedJob {
    config: JobConfig,
    path: String,
    id_at: usize,
    port_at: usize,
    result_port_at: usize,
    result_group_at: usize,
    /// Where `consumer` is (0 when absent).
    consumer_at: usize,
}

/// A parsed group plus the offset of its id, for duplicate reports.
struct ParsedGroup {
    config: GroupConfig,
    path: String,
    id_at: usize,
}

const NODE_KEYS: &[&str] = &["metrics", "ack_mode", "ack_group", "userspace_path", "userspace_slot_bytes", "control", "keys"];

/// `userspace_slot_bytes` (node or job): an integer of bytes, at least
/// [`MIN_USERSPACE_SLOT_BYTES`].
fn slot_bytes(src: &Source<'_>, key: &str, v: &Spanned<Value>) -> Result<u64, ConfigError> {
    Ok(int_in(
        src,
        key,
        v,
        MIN_USERSPACE_SLOT_BYTES as i64,
        i64::MAX,
        "a byte bound",
        "bytes, at least 1 MiB",
    )? as u64)
}

fn parse_node(src: &Source<'_>, v: Spanned<Value>) -> Result<NodeConfig, ConfigError> {
    let mut t = Table::from_value(src, "node".into(), v, NODE_KEYS)?;
    let mut node = NodeConfig::default();
    if let Some(v) = t.take("metrics") {
        let key = t.key("metrics");
        let s = expect_str(src, &key, &v)?;
        node.metrics = if s == "off" {
            None
        } else {
            let addr: SocketAddr = s.parse().map_err(|_| {
                src.error(
                    v.span().start,
                    Some(key.clone()),
                    format!("{s:?} is neither \"off\" nor an address IP:PORT"),
                )
            })?;
            if addr.port() == 0 {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{s:?}: port 0 is not a TCP port Prometheus can scrape (use \"off\" to disable metrics)"),
                ));
            }
            Some(addr)
        };
    }
    if let Some(v) = t.take("ack_mode") {
        let key = t.key("ack_mode");
        node.ack_mode = match expect_str(src, &key, &v)? {
            "group" => AckMode::Group,
            "packet" => AckMode::Packet,
            other => {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{other:?} is not an ACK mode (\"group\" or \"packet\")"),
                ))
            }
        };
    }
    if let Some(v) = t.take("userspace_path") {
        let key = t.key("userspace_path");
        node.userspace_path = match expect_str(src, &key, &v)? {
            "required" => UserspacePathMode::Required,
            "optional" => UserspacePathMode::Optional,
            other => {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{other:?} is neither \"required\" nor \"optional\""),
                ))
            }
        };
    }
    if let Some(v) = t.take("ack_group") {
        node.ack_group = int_in(
            src,
            &t.key("ack_group"),
            &v,
            1,
            i64::from(MAX_ACK_GROUP),
            "an ACK group size",
            "one AGK1 covers at most 1024 sequence numbers",
        )? as u16;
    }
    if let Some(v) = t.take("userspace_slot_bytes") {
        node.userspace_slot_bytes = slot_bytes(src, &t.key("userspace_slot_bytes"), &v)?;
    }
    if let Some(v) = t.take("control") {
        let key = t.key("control");
        let s = expect_str(src, &key, &v)?;
        node.control = s.parse().map_err(|_| {
            src.error(v.span().start, Some(key.clone()), format!("{s:?} is not an address IP:PORT"))
        })?;
    }
    if let Some(v) = t.take("keys") {
        let key = t.key("keys");
        let s = expect_str(src, &key, &v)?;
        if s.is_empty() {
            return Err(src.error(v.span().start, Some(key), "an empty path: name the key file".into()));
        }
        node.keys = Some(s.into());
    }
    Ok(node)
}

const JOB_KEYS: &[&str] = &[
    "id",
    "port",
    "workers",
    "weights",
    "result_port",
    "result_group",
    "vector_len",
    "slots",
    "parent",
    "userspace_only",
    "window",
    "userspace_slots",
    "userspace_slot_bytes",
    "consumer",
    "frag_elems",
];

fn parse_job(src: &Source<'_>, path: String, v: Spanned<Value>) -> Result<ParsedJob, ConfigError> {
    let mut t = Table::from_value(src, path, v, JOB_KEYS)?;

    let id_v = t.require("id")?;
    let id = int_in(src, &t.key("id"), &id_v, 0, 65535, "a job id", "")? as u16;
    let port_v = t.require("port")?;
    let port = udp_port(src, &t.key("port"), &port_v)?;

    let workers_v = t.require("workers")?;
    let workers = parse_workers(src, &t.key("workers"), workers_v)?;

    let weights = match t.take("weights") {
        Some(v) => parse_weights(src, &t.key("weights"), v, workers.len())?,
        None => vec![1; workers.len()],
    };

    let rp_v = t.require("result_port")?;
    let result_port = udp_port(src, &t.key("result_port"), &rp_v)?;
    if result_port == port {
        return Err(src.error(
            rp_v.span().start,
            Some(t.key("result_port")),
            format!("{result_port} is this job's own contribution port; RESULT datagrams need a port of their own"),
        ));
    }

    let mut result_group_at = 0;
    let result_group = match t.take("result_group") {
        Some(v) => {
            let key = t.key("result_group");
            let g = int_in(src, &key, &v, 0, 65535, "a group id", "")? as u16;
            if g == abi::NO_GROUP {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{g} is reserved: the jobs map uses it for \"no group\""),
                ));
            }
            result_group_at = v.span().start;
            Some(g)
        }
        None => None,
    };

    let vector_len = match t.take("vector_len") {
        Some(v) => Some(int_in(
            src,
            &t.key("vector_len"),
            &v,
            1,
            i64::from(u32::MAX),
            "a vector length",
            "leave vector_len out for no bound",
        )? as u32),
        None => None,
    };
    let slots = match t.take("slots") {
        Some(v) => int_in(
            src,
            &t.key("slots"),
            &v,
            1,
            i64::from(u32::MAX),
            "a slot count",
            "",
        )? as u32,
        None => DEFAULT_SLOTS,
    };
    let mut parent_at = 0;
    let parent = match t.take("parent") {
        Some(v) => {
            parent_at = v.span().start;
            Some(parse_parent(src, t.key("parent"), v)?)
        }
        None => None,
    };
    let userspace_only = match t.take("userspace_only") {
        Some(v) => expect_bool(src, &t.key("userspace_only"), &v)?,
        None => false,
    };
    let window = match t.take("window") {
        Some(v) => int_in(
            src,
            &t.key("window"),
            &v,
            1,
            i64::from(MAX_WINDOW),
            "a window",
            "rounds compare modulo 2^32",
        )? as u32,
        None => DEFAULT_WINDOW,
    };
    let frag_elems = match t.take("frag_elems") {
        Some(v) => Some(int_in(
            src,
            &t.key("frag_elems"),
            &v,
            1,
            i64::from(abi::MAX_ELEMS),
            "a fragment size in elements",
            "(MTU - 52) / 4 fills a datagram",
        )? as u32),
        None => None,
    };
    let userspace_slots = match t.take("userspace_slots") {
        Some(v) => int_in(
            src,
            &t.key("userspace_slots"),
            &v,
            1,
            i64::from(u32::MAX),
            "a slot count",
            "",
        )? as u32,
        None => DEFAULT_USERSPACE_SLOTS,
    };
    let userspace_slot_bytes = match t.take("userspace_slot_bytes") {
        Some(v) => slot_bytes(src, &t.key("userspace_slot_bytes"), &v)?,
        None => DEFAULT_USERSPACE_SLOT_BYTES_JOB,
    };
    let mut consumer_at = 0;
    let consumer = match t.take("consumer") {
        Some(v) => {
            let key = t.key("consumer");
            consumer_at = v.span().start;
            let c = match expect_str(src, &key, &v)? {
                "application" => ResultConsumer::Application,
                "node" => ResultConsumer::Node,
                other => {
                    return Err(src.error(
                        v.span().start,
                        Some(key),
                        format!("{other:?}: expected \"application\" or \"node\""),
                    ))
                }
            };
            if let (ResultConsumer::Node, Some(p)) = (c, &parent) {
                if p.result_port.is_none() {
                    return Err(src.error(
                        v.span().start,
                        Some(key),
                        "\"node\" with a parent needs parent.result_port: the node acknowledges the parent's RESULTs there".into(),
                    ));
                }
                if p.job == id {
                    // The parent's RESULTs come to this job's result_port
                    // with job = parent.job; the XDP program drops RESULTs
                    // of this node's own job id there as forged.
                    return Err(src.error(
                        v.span().start,
                        Some(key),
                        format!("\"node\" with a parent needs parent.job other than the job's own id {id}: the parent's RESULTs arrive at this job's result_port, where the node drops RESULTs of its own job id as forged"),
                    ));
                }
            }
            if c == ResultConsumer::Node && workers.len() > 64 {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("\"node\" serves at most 64 workers (a bit each in its resend window), this job has {}", workers.len()),
                ));
            }
            if c == ResultConsumer::Node && result_group.is_none() {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    "\"node\" needs result_group: the node acknowledges the RESULT copies that group brings to the workers".into(),
                ));
            }
            c
        }
        None => ResultConsumer::Application,
    };
    if let Some(n) = parent.and_then(|p| p.tree_workers).filter(|&n| usize::from(n) < workers.len()) {
        return Err(src.error(
            parent_at,
            Some(format!("{}.tree_workers", t.key("parent"))),
            format!("{n} is fewer than this job's own {} workers: the tree's workers include them", workers.len()),
        ));
    }
    if parent.is_some_and(|p| p.result_port.is_some()) && consumer != ResultConsumer::Node {
        return Err(src.error(
            parent_at,
            Some(format!("{}.result_port", t.key("parent"))),
            "only a job with consumer = \"node\" takes its parent's RESULTs (for the node to acknowledge them); an aggregator application gets none".into(),
        ));
    }

    Ok(ParsedJob {
        config: JobConfig {
            id,
            port,
            workers,
            weights,
            result_port,
            result_group,
            vector_len,
            slots,
            parent,
            userspace_only,
            window,
            userspace_slots,
            userspace_slot_bytes,
            consumer,
            frag_elems,
        },
        path: t.path,
        consumer_at,
        id_at: id_v.span().start,
        port_at: port_v.span().start,
        result_port_at: rp_v.span().start,
        result_group_at,
    })
}

fn parse_workers(
    src: &Source<'_>,
    key: &str,
    v: Spanned<Value>,
) -> Result<Vec<Ipv4Addr>, ConfigError> {
    let at = v.span().start;
    let items = expect_array(src, key, v)?;
    if items.is_empty() {
        return Err(src.error(
            at,
            Some(key.into()),
            "no workers: a job needs at least one rank".into(),
        ));
    }
    if items.len() > MAX_WORKERS {
        return Err(src.error(
            at,
            Some(key.into()),
            format!(
                "{} workers, at most {MAX_WORKERS} ranks per job (larger jobs use a tree of aggregators)",
                items.len()
            ),
        ));
    }
    let mut workers: Vec<Ipv4Addr> = Vec::with_capacity(items.len());
    let mut seen: HashMap<Ipv4Addr, (usize, usize)> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let ikey = format!("{key}[{i}]");
        let s = expect_str(src, &ikey, item)?;
        let addr: Ipv4Addr = s.parse().map_err(|_| {
            src.error(
                item.span().start,
                Some(ikey.clone()),
                format!("{s:?} is not an IPv4 address"),
            )
        })?;
        if let Some(why) = not_unicast(addr) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!("{s:?} cannot be a worker's source address ({why})"),
            ));
        }
        if let Some(&(j, at)) = seen.get(&addr) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!(
                    "{s:?} is also {key}[{j}] (line {}): the source address identifies the rank",
                    src.line(at)
                ),
            ));
        }
        seen.insert(addr, (i, item.span().start));
        workers.push(addr);
    }
    Ok(workers)
}

fn parse_weights(
    src: &Source<'_>,
    key: &str,
    v: Spanned<Value>,
    n_workers: usize,
) -> Result<Vec<i32>, ConfigError> {
    let at = v.span().start;
    let items = expect_array(src, key, v)?;
    if items.len() != n_workers {
        return Err(src.error(
            at,
            Some(key.into()),
            format!(
                "{} weights for {n_workers} workers: one weight per rank",
                items.len()
            ),
        ));
    }
    let mut weights = Vec::with_capacity(items.len());
    let mut sum: u64 = 0;
    for (i, item) in items.iter().enumerate() {
        let w = int_in(
            src,
            &format!("{key}[{i}]"),
            item,
            0,
            i64::from(crate::wire::abi::MAX_WEIGHT),
            "a weight",
            "the kernel adds weight × value in a 64-bit sum that 256 ranks must not overflow",
        )?;
        sum += w as u64;
        weights.push(w as i32);
    }
    if sum == 0 {
        return Err(src.error(
            at,
            Some(key.into()),
            "the weights sum to 0; AVG divides by the sum, it must be positive".into(),
        ));
    }
    Ok(weights)
}

const RING_KEYS: &[&str] = &["id", "port", "members", "weights", "vector_len", "frag_elems"];

/// A parsed ring, its path, and the offsets of its id and port.
fn parse_ring(
    src: &Source<'_>,
    path: String,
    v: Spanned<Value>,
) -> Result<(RingConfig, String, usize, usize), ConfigError> {
    let mut t = Table::from_value(src, path.clone(), v, RING_KEYS)?;
    let id_v = t.require("id")?;
    let id = int_in(src, &t.key("id"), &id_v, 0, 65535, "a ring id", "")? as u16;
    let port_v = t.require("port")?;
    let port = udp_port(src, &t.key("port"), &port_v)?;
    let members_v = t.require("members")?;
    let members_at = members_v.span().start;
    let members = parse_workers(src, &t.key("members"), members_v)?;
    if members.len() < 2 {
        return Err(src.error(
            members_at,
            Some(t.key("members")),
            "one member: a ring needs at least two (a single node has nothing to reduce with)".into(),
        ));
    }
    let weights = match t.take("weights") {
        Some(v) => parse_weights(src, &t.key("weights"), v, members.len())?,
        None => vec![1; members.len()],
    };
    let vl_v = t.require("vector_len")?;
    let vector_len = int_in(
        src,
        &t.key("vector_len"),
        &vl_v,
        1,
        i64::from(u32::MAX),
        "a vector length",
        "a ring's memory is sized from it",
    )? as u32;
    let frag_elems = match t.take("frag_elems") {
        Some(v) => {
            let key = t.key("frag_elems");
            let n = int_in(
                src,
                &key,
                &v,
                2,
                i64::from(abi::RING_MAX_FRAG_ELEMS),
                "a fragment size in elements",
                "(MTU - 52) / 4 fills a datagram",
            )? as u32;
            if !n.is_multiple_of(2) {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{n} is odd: the ring's memory holds fragments of whole 8-byte words"),
                ));
            }
            n
        }
        None => DEFAULT_RING_FRAG_ELEMS,
    };
    Ok((
        RingConfig { id, port, members, weights, vector_len, frag_elems },
        path,
        id_v.span().start,
        port_v.span().start,
    ))
}

/// Ring ids unique among rings, ports unique among jobs and rings, one
/// fragment size for the node.
fn check_rings(
    src: &Source<'_>,
    jobs: &[ParsedJob],
    rings: &[(RingConfig, String, usize, usize)],
) -> Result<(), ConfigError> {
    for (i, (ring, path, id_at, port_at)) in rings.iter().enumerate() {
        for (other, opath, oid_at, _) in &rings[..i] {
            if other.id == ring.id {
                return Err(src.error(
                    *id_at,
                    Some(format!("{path}.id")),
                    format!("ring {} is already defined by {opath} (line {})", ring.id, src.line(*oid_at)),
                ));
            }
            if other.port == ring.port {
                return Err(src.error(
                    *port_at,
                    Some(format!("{path}.port")),
                    format!("port {} is already ring {}'s ({opath}): a port serves one ring", ring.port, other.id),
                ));
            }
            if other.frag_elems != ring.frag_elems {
                return Err(src.error(
                    *id_at,
                    Some(format!("{path}.frag_elems")),
                    format!(
                        "{} elements per fragment where {opath} has {}: the rings of a node share one fragment size",
                        ring.frag_elems, other.frag_elems
                    ),
                ));
            }
        }
        if let Some(job) = jobs.iter().find(|j| j.config.port == ring.port || j.config.result_port == ring.port) {
            return Err(src.error(
                *port_at,
                Some(format!("{path}.port")),
                format!("port {} is also job {}'s ({}): a port serves one job or ring", ring.port, job.config.id, job.path),
            ));
        }
    }
    Ok(())
}

const PARENT_KEYS: &[&str] = &["addr", "port", "job", "rank", "result_port", "tree_workers"];

fn parse_parent(
    src: &Source<'_>,
    path: String,
    v: Spanned<Value>,
) -> Result<ParentConfig, ConfigError> {
    let mut t = Table::from_value(src, path, v, PARENT_KEYS)?;
    let addr_v = t.require("addr")?;
    let key = t.key("addr");
    let s = expect_str(src, &key, &addr_v)?;
    let addr: Ipv4Addr = s.parse().map_err(|_| {
        src.error(
            addr_v.span().start,
            Some(key.clone()),
            format!("{s:?} is not an IPv4 address"),
        )
    })?;
    if let Some(why) = not_unicast(addr) {
        return Err(src.error(
            addr_v.span().start,
            Some(key),
            format!("{s:?} cannot be a parent aggregator's address ({why})"),
        ));
    }
    let port_v = t.require("port")?;
    let port = udp_port(src, &t.key("port"), &port_v)?;
    let job_v = t.require("job")?;
    let job = int_in(src, &t.key("job"), &job_v, 0, 65535, "a job id", "")? as u16;
    let rank_v = t.require("rank")?;
    let rank = int_in(
        src,
        &t.key("rank"),
        &rank_v,
        0,
        i64::from(abi::RESULT_RANK) - 1,
        "a rank",
        "65535 marks RESULT datagrams",
    )? as u16;
    let result_port = match t.take("result_port") {
        Some(v) => Some(udp_port(src, &t.key("result_port"), &v)?),
        None => None,
    };
    let tree_workers = match t.take("tree_workers") {
        Some(v) => Some(int_in(
            src,
            &t.key("tree_workers"),
            &v,
            1,
            i64::from(u16::MAX),
            "a worker count",
            "",
        )? as u16),
        None => None,
    };
    Ok(ParentConfig {
        addr,
        port,
        job,
        rank,
        result_port,
        tree_workers,
    })
}

const GROUP_KEYS: &[&str] = &["id", "members"];

fn parse_group(
    src: &Source<'_>,
    path: String,
    v: Spanned<Value>,
) -> Result<ParsedGroup, ConfigError> {
    let mut t = Table::from_value(src, path, v, GROUP_KEYS)?;
    let id_v = t.require("id")?;
    let id = int_in(src, &t.key("id"), &id_v, 0, 65535, "a group id", "")? as u16;

    let members_v = t.require("members")?;
    let key = t.key("members");
    let at = members_v.span().start;
    let items = expect_array(src, &key, members_v)?;
    if items.is_empty() {
        return Err(src.error(
            at,
            Some(key),
            "no members: a group needs at least one destination".into(),
        ));
    }
    if items.len() > MAX_GROUP_MEMBERS {
        return Err(src.error(
            at,
            Some(key),
            format!(
                "{} members, at most {MAX_GROUP_MEMBERS} per group (one AGB1 mask bit each; larger groups use a tree)",
                items.len()
            ),
        ));
    }
    let mut members = Vec::with_capacity(items.len());
    let mut seen: HashMap<SocketAddrV4, (usize, usize)> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let ikey = format!("{key}[{i}]");
        let s = expect_str(src, &ikey, item)?;
        let member: SocketAddrV4 = s.parse().map_err(|_| {
            src.error(
                item.span().start,
                Some(ikey.clone()),
                format!("{s:?} is not an IPv4 address and UDP port (A.B.C.D:PORT)"),
            )
        })?;
        if member.port() == 0 {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!("{s:?}: 0 is not a UDP port (1..=65535)"),
            ));
        }
        if let Some(why) = not_unicast(*member.ip()) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!("{s:?} cannot be a broadcast destination ({why})"),
            ));
        }
        if let Some(&(j, at)) = seen.get(&member) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!(
                    "{s:?} is also {key}[{j}] (line {}): each destination gets one mask bit",
                    src.line(at)
                ),
            ));
        }
        seen.insert(member, (i, item.span().start));
        members.push(member);
    }
    Ok(ParsedGroup {
        config: GroupConfig { id, members },
        path: t.path,
        id_at: id_v.span().start,
    })
}

/// Checks that span tables: unique ids and ports, result ports that are
/// nobody's contribution port, result groups that exist.
fn check_references(
    src: &Source<'_>,
    jobs: &[ParsedJob],
    groups: &[ParsedGroup],
) -> Result<(), ConfigError> {
    let mut job_ids: HashMap<u16, &ParsedJob> = HashMap::new();
    let mut job_ports: HashMap<u16, &ParsedJob> = HashMap::new();
    for job in jobs {
        if let Some(first) = job_ids.get(&job.config.id) {
            return Err(src.error(
                job.id_at,
                Some(format!("{}.id", job.path)),
                format!(
                    "job {} is already defined by {} (line {})",
                    job.config.id,
                    first.path,
                    src.line(first.id_at)
                ),
            ));
        }
        job_ids.insert(job.config.id, job);
        if let Some(first) = job_ports.get(&job.config.port) {
            return Err(src.error(
                job.port_at,
                Some(format!("{}.port", job.path)),
                format!(
                    "port {} already serves job {} (line {}); a port serves one job",
                    job.config.port,
                    first.config.id,
                    src.line(first.port_at)
                ),
            ));
        }
        job_ports.insert(job.config.port, job);
    }
    // After all ports are known, so a later job's port counts too.
    for job in jobs {
        if let Some(other) = job_ports.get(&job.config.result_port) {
            return Err(src.error(
                job.result_port_at,
                Some(format!("{}.result_port", job.path)),
                format!(
                    "{} is the contribution port of job {} (line {}); RESULT datagrams need a port of their own",
                    job.config.result_port,
                    other.config.id,
                    src.line(other.port_at)
                ),
            ));
        }
    }

    // A node-served job's parent sends its RESULTs (job = parent.job) to
    // the job's result_port; the XDP program drops RESULTs there of a job
    // of this node with that id and result_port as forged.
    for job in jobs {
        let Some(p) = job.config.parent.filter(|_| job.config.consumer == ResultConsumer::Node) else {
            continue;
        };
        if let Some(other) = jobs.iter().find(|o| o.config.id == p.job && o.config.result_port == job.config.result_port) {
            return Err(src.error(
                job.result_port_at,
                Some(format!("{}.result_port", job.path)),
                format!(
                    "job {} (line {}) has the parent's job id {} and this result_port: the node would drop the parent's RESULTs as forged",
                    other.config.id,
                    src.line(other.id_at),
                    p.job
                ),
            ));
        }
    }

    let mut group_ids: HashMap<u16, &ParsedGroup> = HashMap::new();
    for group in groups {
        if let Some(first) = group_ids.get(&group.config.id) {
            return Err(src.error(
                group.id_at,
                Some(format!("{}.id", group.path)),
                format!(
                    "group {} is already defined by {} (line {})",
                    group.config.id,
                    first.path,
                    src.line(first.id_at)
                ),
            ));
        }
        group_ids.insert(group.config.id, group);
    }
    for job in jobs {
        if let Some(g) = job.config.result_group {
            let Some(group) = group_ids.get(&g) else {
                return Err(src.error(
                    job.result_group_at,
                    Some(format!("{}.result_group", job.path)),
                    format!("there is no [[group]] with id {g}"),
                ));
            };
            // The node resends a RESULT copy to the member socket of the
            // worker that missed it: every worker needs one.
            if job.config.consumer == ResultConsumer::Node {
                if let Some((r, w)) = job
                    .config
                    .workers
                    .iter()
                    .enumerate()
                    .find(|(_, w)| !group.config.members.iter().any(|m| m.ip() == *w))
                {
                    return Err(src.error(
                        job.consumer_at,
                        Some(format!("{}.consumer", job.path)),
                        format!("\"node\": worker {r} ({w}) is not a member of group {g}, so the node has no socket to resend its RESULTs to"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Why `addr` cannot be a unicast source or destination, if it cannot.
fn not_unicast(addr: Ipv4Addr) -> Option<&'static str> {
    if addr.is_unspecified() {
        Some("unspecified address")
    } else if addr.is_broadcast() {
        Some("broadcast address")
    } else if addr.is_multicast() {
        Some("multicast address")
    } else {
        None
    }
}

// ---------------------------------------------------------------------------
// Typed access to the spanned tree
// ---------------------------------------------------------------------------

fn udp_port(src: &Source<'_>, key: &str, v: &Spanned<Value>) -> Result<u16, ConfigError> {
    Ok(int_in(src, key, v, 1, 65535, "a UDP port", "")? as u16)
}

/// An integer in `lo..=hi`; the message says what the value should be
/// (`what`) and, when given, why the range is what it is (`why`).
fn int_in(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<Value>,
    lo: i64,
    hi: i64,
    what: &str,
    why: &str,
) -> Result<i64, ConfigError> {
    let Value::Integer(n) = *v.get_ref() else {
        return Err(src.type_error(key, v, "an integer"));
    };
    if n < lo || n > hi {
        let why = if why.is_empty() {
            String::new()
        } else {
            format!(": {why}")
        };
        return Err(src.error(
            v.span().start,
            Some(key.into()),
            format!("{n} is not {what} ({lo}..={hi}{why})"),
        ));
    }
    Ok(n)
}

fn expect_str<'v>(
    src: &Source<'_>,
    key: &str,
    v: &'v Spanned<Value>,
) -> Result<&'v str, ConfigError> {
    match v.get_ref() {
        Value::String(s) => Ok(s),
        _ => Err(src.type_error(key, v, "a string")),
    }
}

fn expect_bool(src: &Source<'_>, key: &str, v: &Spanned<Value>) -> Result<bool, ConfigError> {
    match v.get_ref() {
        Value::Boolean(b) => Ok(*b),
        _ => Err(src.type_error(key, v, "a boolean (true or false)")),
    }
}

fn expect_array(
    src: &Source<'_>,
    key: &str,
    v: Spanned<Value>,
) -> Result<Vec<Spanned<Value>>, ConfigError> {
    if !matches!(v.get_ref(), Value::Array(_)) {
        return Err(src.type_error(key, &v, "an array"));
    }
    match v.into_inner() {
        Value::Array(items) => Ok(items),
        _ => Ok(Vec::new()), // checked just above
    }
}

/// `[[name]]` sections: an array whose items are all tables.
fn array_of_tables(
    src: &Source<'_>,
    name: &str,
    v: Spanned<Value>,
) -> Result<Vec<Spanned<Value>>, ConfigError> {
    let what = format!("an array of tables (write [[{name}]], one per {name})");
    if !matches!(v.get_ref(), Value::Array(_)) {
        return Err(src.type_error(name, &v, &what));
    }
    let items = expect_array(src, name, v)?;
    for (i, item) in items.iter().enumerate() {
        if !matches!(item.get_ref(), Value::Table(_)) {
            return Err(src.type_error(&format!("{name}[{i}]"), item, "a table"));
        }
    }
    Ok(items)
}

/// One table being walked: values are taken out by key, and keys nobody
/// asks for are rejected up front (what `deny_unknown_fields` does, but with
/// the key's path and line).
struct Table<'s> {
    src: &'s Source<'s>,
    path: String,
    start: usize,
    entries: Vec<(String, Spanned<Value>)>,
}

impl<'s> Table<'s> {
    fn from_value(
        src: &'s Source<'s>,
        path: String,
        v: Spanned<Value>,
        allowed: &[&str],
    ) -> Result<Self, ConfigError> {
        let start = v.span().start;
        if !matches!(v.get_ref(), Value::Table(_)) {
            return Err(src.type_error(&path, &v, "a table"));
        }
        match v.into_inner() {
            Value::Table(entries) => Table::from_entries(src, &path, start, entries, allowed),
            _ => Ok(Table {
                src,
                path,
                start,
                entries: Vec::new(),
            }), // checked just above
        }
    }

    fn from_entries(
        src: &'s Source<'s>,
        path: &str,
        start: usize,
        entries: Vec<(String, Spanned<Value>)>,
        allowed: &[&str],
    ) -> Result<Self, ConfigError> {
        let table = Table {
            src,
            path: path.to_string(),
            start,
            entries,
        };
        if let Some((k, v)) = table
            .entries
            .iter()
            .find(|(k, _)| !allowed.contains(&k.as_str()))
        {
            return Err(src.error(
                v.span().start,
                Some(table.key(k)),
                format!("unknown key; expected one of: {}", allowed.join(", ")),
            ));
        }
        Ok(table)
    }

    /// Path of `key` inside this table.
    fn key(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    fn take(&mut self, key: &str) -> Option<Spanned<Value>> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.swap_remove(i).1)
    }

    /// A key the table must have; its absence is reported on the table's
    /// header line.
    fn require(&mut self, key: &str) -> Result<Spanned<Value>, ConfigError> {
        match self.take(key) {
            Some(v) => Ok(v),
            None => Err(self.src.error(
                self.start,
                Some(self.key(key)),
                "required key is missing".into(),
            )),
        }
    }
}

/// The text being parsed, to turn byte offsets into lines.
struct Source<'a> {
    text: &'a str,
    origin: &'a str,
}

impl Source<'_> {
    /// 1-based line of byte `offset`.
    fn line(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    fn error(&self, offset: usize, key: Option<String>, message: String) -> ConfigError {
        ConfigError {
            origin: self.origin.to_string(),
            line: Some(self.line(offset)),
            key,
            message,
        }
    }

    fn type_error(&self, key: &str, v: &Spanned<Value>, expected: &str) -> ConfigError {
        self.error(
            v.span().start,
            Some(key.to_string()),
            format!("expected {expected}, found {}", v.get_ref().describe()),
        )
    }

    /// A TOML syntax error: the parser knows the place, not the key, so the
    /// key is guessed from the text; the multi-line message becomes one line.
    fn toml_error(&self, e: &toml::de::Error) -> ConfigError {
        let message = e
            .message()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(": ");
        match e.span() {
            Some(span) => ConfigError {
                origin: self.origin.to_string(),
                line: Some(self.line(span.start)),
                key: key_at_line(self.text, self.line(span.start)),
                message,
            },
            None => ConfigError {
                origin: self.origin.to_string(),
                line: Some(1),
                key: None,
                message,
            },
        }
    }
}

/// Best-effort key path in force at 1-based `line`: the last table header
/// (with its `[[array]]` index) and the last `key =` under it. Used only for
/// syntax errors, where no parsed tree exists.
fn key_at_line(text: &str, line: usize) -> Option<String> {
    let mut section: Option<String> = None;
    let mut key: Option<String> = None;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for raw in text.lines().take(line) {
        let l = raw.trim_start();
        if let Some(rest) = l.strip_prefix("[[") {
            let name = rest.split("]]").next().unwrap_or("").trim().to_string();
            let n = counts.entry(name.clone()).or_insert(0);
            section = Some(format!("{name}[{n}]"));
            *n += 1;
            key = None;
        } else if let Some(rest) = l.strip_prefix('[') {
            if let Some((name, _)) = rest.split_once(']') {
                section = Some(name.trim().to_string());
                key = None;
            }
        } else if let Some((k, _)) = l.split_once('=') {
            let k = k.trim();
            let bare = !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            if bare {
                key = Some(k.to_string());
            }
        }
    }
    match (section, key) {
        (Some(s), Some(k)) => Some(format!("{s}.{k}")),
        (Some(s), None) => Some(s),
        (None, Some(k)) => Some(k),
        (None, None) => None,
    }
}

// ---------------------------------------------------------------------------
// Untyped TOML tree with spans
// ---------------------------------------------------------------------------

/// A TOML value whose children carry their byte spans. `toml::Value` drops
/// spans below the top, which is why this exists.
#[derive(Debug)]
enum Value {
    String(String),
    Integer(i64),
    Float(f64),
    Boolean(bool),
    Datetime(String),
    Array(Vec<Spanned<Value>>),
    /// Entries in file order, so "the first unknown key" is the first in
    /// the file.
    Table(Vec<(String, Spanned<Value>)>),
}

impl Value {
    /// How a value is named in "expected X, found Y".
    fn describe(&self) -> String {
        match self {
            Value::String(s) => format!("the string {s:?}"),
            Value::Integer(n) => format!("the integer {n}"),
            Value::Float(x) => format!("the float {x}"),
            Value::Boolean(b) => format!("the boolean {b}"),
            Value::Datetime(d) => format!("the datetime {d}"),
            Value::Array(_) => "an array".into(),
            Value::Table(_) => "a table".into(),
        }
    }
}

/// The key under which the `toml` deserializer hands out a datetime as a
/// one-entry map (`toml_datetime::__unstable::FIELD`).
const TOML_DATETIME_FIELD: &str = "$__toml_private_datetime";

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any TOML value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Boolean(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Integer(n))
    }

    fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Value, E> {
        // TOML integers are i64; kept for completeness.
        i64::try_from(n)
            .map(Value::Integer)
            .map_err(|_| E::custom("integer out of range"))
    }

    fn visit_f64<E>(self, x: f64) -> Result<Value, E> {
        Ok(Value::Float(x))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_string()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Value>>()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == TOML_DATETIME_FIELD {
                let d: String = map.next_value()?;
                return Ok(Value::Datetime(d));
            }
            entries.push((key, map.next_value::<Spanned<Value>>()?));
        }
        Ok(Value::Table(entries))
    }
}
