//! The node configuration file (TOML), parsed and validated before anything
//! is attached.
//!
//! The schema is the one of `spec/INTERFACE.md` (`[node]`, `[[job]]`,
//! `[[group]]`) plus the keys this project adds, among them job keys such
//! as `userspace_only`, `window`, `userspace_slots` and
//! `userspace_slot_bytes`, node keys such as `userspace_path`
//! (`"required"`, the default, or `"optional"`: see [`UserspacePathMode`]),
//! `ring_pool` and `ring_frag_elems`, and `[[ring]]` tables (docs/RING.md);
//! docs/INTERFACE.md lists every key. `deploy/aggbox.example.toml` is a
//! commented, valid example.
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
//! config.toml:12: job[1].workers[3]: "10.77.0.300" is not an IP address (IPv4 A.B.C.D or IPv6)
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
//! - Worker and parent addresses must be unicast: 0.0.0.0, 255.255.255.255,
//!   `::` and multicast cannot be a datagram's source (workers) or a routed
//!   next hop (parent, group members). An IPv4-mapped IPv6 address
//!   (`::ffff:a.b.c.d`) is refused too: a datagram from or to it travels as
//!   IPv4, so the plain IPv4 address is what the file must say.
//! - Addresses are IPv4 or IPv6 wherever one is accepted; a socket address
//!   is `A.B.C.D:PORT` or `[IPv6]:PORT` (the brackets only there, scope ids
//!   refused). The members of one thing are of one family: a job's workers,
//!   a group's members, a ring's members, a job's parent and its workers,
//!   and a job's workers and its `result_group`'s members (the RESULT the
//!   kernel copies to them is a datagram of the workers' family). A mix is
//!   refused at the first address of the other family. One file may hold
//!   jobs of both families (a dual-stack node).
//! - A group may not list the same `IP:PORT` twice: each member is one mask
//!   bit, and two bits for one destination would deliver every datagram twice.
//! - `parent.rank` may be any rank but 65535, which marks RESULT datagrams;
//!   the parent's own limit on ranks is the parent's business.
//! - `metrics` rejects port 0: Prometheus must know where to scrape.
//! - At most [`crate::wire::abi::MAX_JOBS`] jobs, the size of the kernel's jobs map.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;

use crate::wire::abi;

mod parse;

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
    /// 2..=[`MAX_WORKERS`] distinct addresses, all of one family.
    pub members: Vec<IpAddr>,
    /// Weight of each member (all 1 when the file gives none).
    pub weights: Vec<i32>,
    /// Elements of the reduced vector (>= 1).
    pub vector_len: u32,
    /// Elements per fragment (one datagram), even, 2..=
    /// [`crate::wire::abi::RING_MAX_FRAG_ELEMS`]; default `[node]
    /// ring_frag_elems`, else [`DEFAULT_RING_FRAG_ELEMS`] (MTU 1500). Every
    /// ring of a node has the same (the data map's value size).
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
    /// `ring_pool`: ring memory reserved at attach beyond the file's
    /// `[[ring]]`s, in vector elements (docs/RING.md "Configuration"), so
    /// that a reload (or a run) can add rings without loading the programs
    /// again; 0 (the default): only the file's rings, sized exactly.
    pub ring_pool: u32,
    /// `ring_frag_elems`: the elements per fragment of every ring of the
    /// node (the ring memory's value size, fixed at attach) and the default
    /// of `[[ring]] frag_elems`; `None`: the file's rings' or
    /// [`DEFAULT_RING_FRAG_ELEMS`] ([`Config::ring_frag_elems`]).
    pub ring_frag_elems: Option<u32>,
}

/// Largest `[node] ring_pool`: 2^28 elements, 2 GiB of ring memory (two
/// int32 buffers), below the 4 GiB a BPF array map may hold.
pub const MAX_RING_POOL: u32 = 1 << 28;

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
            ring_pool: 0,
            ring_frag_elems: None,
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
    /// 1..=[`MAX_WORKERS`] entries, all distinct and of one family (IPv4
    /// or IPv6).
    pub workers: Vec<IpAddr>,
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

    /// Whether the job's workers (and so its parent and result group) are
    /// IPv6; one family per job.
    pub fn is_ipv6(&self) -> bool {
        self.workers.first().is_some_and(IpAddr::is_ipv6)
    }

    /// The rank whose configured source address is `addr`, if any: the
    /// source address is what identifies a rank.
    pub fn rank_of(&self, addr: IpAddr) -> Option<u16> {
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
    /// The parent aggregator's address, of the job's workers' family.
    pub addr: IpAddr,
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
    /// 1..=[`MAX_GROUP_MEMBERS`] distinct entries, all of one family.
    pub members: Vec<SocketAddr>,
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
        parse::parse(text, origin)
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

    /// The elements per fragment of the node's rings (one for all of them,
    /// fixed at attach): `[node] ring_frag_elems`, else the rings'
    /// (validated equal), else [`DEFAULT_RING_FRAG_ELEMS`].
    pub fn ring_frag_elems(&self) -> u32 {
        self.node
            .ring_frag_elems
            .or_else(|| self.rings.first().map(|r| r.frag_elems))
            .unwrap_or(DEFAULT_RING_FRAG_ELEMS)
    }
}
