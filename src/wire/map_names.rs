//! Names of the pinned maps that other processes open by name: the BPF
//! objects' own map names (src/bpf/xdp_maps.h, src/bpf/tc_maps.h), which
//! `kernel::maps::pin_object_maps` uses as file names. They are part of the
//! ABI: the node pins under them and the runtime opens the ring maps by them
//! ([`crate::wire::ring_memory`]); `kernel::maps::names` re-exports them.

/// Per-CPU counters by outcome and drop reason (`abi::Stat`).
pub const STATS: &str = "stats";
/// The jobs array (`abi::Job`), indexed by dense job index.
pub const JOBS: &str = "jobs";
/// Rank addresses and weights (`abi::Rank`), dense · MAX_RANKS + rank.
pub const RANKS: &str = "ranks";
/// Per-job progress (`abi::JobState`).
pub const JOB_STATE: &str = "job_state";
/// Per-CPU per-job counters (`abi::JobStats`).
pub const JOB_STATS: &str = "job_stats";
/// Pool blocks held by slots (one `u64`).
pub const BLOCKS_USED: &str = "blocks_used";
/// Per-CPU counters of hand-offs to user space, by reason (`abi::Stat`).
pub const HANDOFF_STATS: &str = "handoff_stats";
/// Per-CPU broadcast counters (`abi::Stat`), TC object.
pub const BCAST_STATS: &str = "bcast_stats";
/// Per-CPU per-group broadcast counters (`abi::BcastGroupStat`), TC object.
pub const BCAST_GSTATS: &str = "bcast_gstats";
/// Broadcast tables (`abi::GroupKey` → `abi::Group`), TC object.
pub const BCAST_GROUPS: &str = "bcast_groups";
/// The next-hop cache (`abi::NeighKey` → `abi::Neigh`, then a timer), TC object.
pub const BCAST_NEIGH: &str = "bcast_neigh";
/// Node-wide broadcast settings (`abi::BcastConfig`), TC object.
pub const BCAST_CONFIG: &str = "bcast_config";
/// Routes of RESULT datagrams (`abi::JobKey` → `abi::ResultRoute`), TC object.
pub const RESULT_ROUTES: &str = "result_routes";
/// Jobs listening on each UDP port (`abi::Port`), indexed by port.
pub const PORTS: &str = "ports";
/// Job id → 1 + the job's dense index (0: not configured).
pub const JOB_INDEX: &str = "job_index";
/// The user-space path's state of each job (`abi::JobHandoff`).
pub const JOB_HANDOFF: &str = "job_handoff";
/// Per job (dense index): whether the hash-map path has made a
/// `slot_owner` record for it yet.
pub const JOB_PATHS: &str = "job_paths";
/// Per job (dense index): the newest round the kernel completed, on a
/// cache line of its own for the stale-round rule.
pub const JOB_ROUND: &str = "job_round";
/// The tail-call program array of the multi-buffer chain.
pub const PROGS: &str = "progs";
/// The slot pool (`abi::SlotKey` → slot header).
pub const SLOTS: &str = "slots";
/// Indexes of the unused accumulator blocks (a stack).
pub const FREE_BLOCKS: &str = "free_blocks";
/// Markers of completed slots (`abi::SlotKey`, an LRU hash).
pub const COMPLETED: &str = "completed";
/// Which path serves a slot (`abi::SlotKey` → `abi::SlotOwner`).
pub const SLOT_OWNER: &str = "slot_owner";
/// The fast-slot regions of the jobs (docs/DATAPLANE.md "Fast slots").
pub const FAST_SLOTS: &str = "fast_slots";
/// Per-CPU fast-slot counters (`abi::FAST_*`).
pub const FAST_STATS: &str = "fast_stats";
/// Ring port → 1 + dense ring index (docs/RING.md).
pub const RING_PORTS: &str = "ring_ports";
/// Ring id → 1 + dense ring index.
pub const RING_INDEX: &str = "ring_index";
/// Per ring (dense index): `abi::RingJob`.
pub const RING_JOBS: &str = "ring_jobs";
/// Ring members' addresses (`abi::Rank`), dense · MAX_RANKS + member.
pub const RING_MEMBERS: &str = "ring_members";
/// The rings' fragments (mmapable): input, then result.
pub const RING_DATA: &str = "ring_data";
/// Per fragment (mmapable): `abi::RingDone`.
pub const RING_DONE: &str = "ring_done";
/// Per ring (mmapable): `abi::RingCtrl`.
pub const RING_CTRL: &str = "ring_ctrl";
/// Per-CPU per-ring counters (`abi::RingStats`).
pub const RING_STATS: &str = "ring_stats";
/// Per ring (dense index): the next hop's MACs and interface (BPF-only).
pub const RING_NEXTHOP: &str = "ring_nexthop";
/// AF_XDP sockets by RX queue (XSKMAP).
pub const XSKS: &str = "xsks";
/// The longest frame redirected to an AF_XDP socket (0: no limit).
pub const XSK_LIMITS: &str = "xsk_limits";
