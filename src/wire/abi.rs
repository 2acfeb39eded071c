//! Rust mirror of `include/aggbox/abi.h`.
//!
//! This is the one place where the ABI is written twice: the C header is the
//! source of truth for the BPF programs, this module for the control plane.
//! `tests/abi_layout.rs` compiles the header and compares every struct size
//! and field offset with the ones below, so the two cannot drift silently.
//!
//! Wire structs keep their fields in network byte order exactly as they sit
//! in the datagram (`_be` accessors convert); map structs are host order.

use plain::Plain;

pub const MAGIC_AGG: u32 = 0x4147_4731;
pub const MAGIC_BCAST: u32 = 0x4147_4231;
pub const MAGIC_ACK: u32 = 0x4147_4B31;

pub const AGG_F_LAST_FRAGMENT: u8 = 0x01;
pub const AGG_F_RESULT: u8 = 0x02;
pub const AGG_F_OVERFLOW: u8 = 0x04;
pub const AGG_F_FLOAT32: u8 = 0x08;
pub const AGG_F_KNOWN: u8 = 0x0f;
/// Contribution flags a slot's RESULT carries when any contribution had
/// them: LAST_FRAGMENT and OVERFLOW (a clamped input).
pub const AGG_F_CARRIED: u8 = AGG_F_LAST_FRAGMENT | AGG_F_OVERFLOW;

pub const RESULT_RANK: u16 = 0xffff;

pub const BCAST_F_FORWARD: u8 = 0x01;
pub const BCAST_F_KNOWN: u8 = 0x01;
/// Bit 31 of the runtime sub-header's `offset`: the forwarded result
/// fragment was clamped (`AGGBOX_BCAST_SUBHDR_OVERFLOW`).
pub const BCAST_SUBHDR_OVERFLOW: u32 = 0x8000_0000;

pub const ACK_KIND_AGG: u8 = 0;
pub const ACK_KIND_BCAST: u8 = 1;
pub const ACK_F_FINAL: u8 = 0x01;
pub const ACK_F_KNOWN: u8 = 0x01;
pub const ACK_MAX_BITS: u16 = 1024;

pub const AGG_HDR_LEN: usize = 24;
pub const BCAST_HDR_LEN: usize = 16;
/// The runtime's sub-header at the start of an `AGB1` payload it sends.
pub const BCAST_RUNTIME_SUBHDR_LEN: usize = 8;
pub const ACK_HDR_LEN: usize = 16;

pub const MAX_JOBS: u32 = 256;
pub const MAX_RANKS: u32 = 256;

pub const JOB_F_USERSPACE_ONLY: u32 = 0x01;
pub const JOB_F_HAS_PARENT: u32 = 0x02;
/// Give the job no fast-slot region: every contribution takes the hash-map
/// chain (`AGGBOX_JOB_F_NO_FAST`; docs/DATAPLANE.md "Fast slots").
pub const JOB_F_NO_FAST: u32 = 0x04;
pub const NO_GROUP: u16 = 0xffff;

/// `enum aggbox_op`.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Sum = 0,
    Count = 1,
    Max = 2,
    Min = 3,
    Avg = 4,
    Prod = 5,
    Band = 6,
    Bor = 7,
    Bxor = 8,
}

impl Op {
    pub const ALL: [Op; 9] = [
        Op::Sum,
        Op::Count,
        Op::Max,
        Op::Min,
        Op::Avg,
        Op::Prod,
        Op::Band,
        Op::Bor,
        Op::Bxor,
    ];

    pub fn from_u8(v: u8) -> Option<Op> {
        Op::ALL.get(v as usize).copied()
    }

    /// Ops the XDP program aggregates itself (integer payloads only).
    pub fn runs_in_kernel(self) -> bool {
        (self as u8) <= Op::Avg as u8
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Sum => "SUM",
            Op::Count => "COUNT",
            Op::Max => "MAX",
            Op::Min => "MIN",
            Op::Avg => "AVG",
            Op::Prod => "PROD",
            Op::Band => "BAND",
            Op::Bor => "BOR",
            Op::Bxor => "BXOR",
        }
    }

    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.iter().copied().find(|op| op.name().eq_ignore_ascii_case(name))
    }
}

/// `struct aggbox_agg_hdr` (wire, network order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AggHdr {
    pub magic: u32,
    pub job: u16,
    pub rank: u16,
    pub seq: u32,
    pub round: u32,
    pub frag_off: u32,
    pub op: u8,
    pub flags: u8,
    pub count: u16,
}
const _: () = assert!(core::mem::size_of::<AggHdr>() == AGG_HDR_LEN);

/// `struct aggbox_bcast_hdr` (wire, network order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BcastHdr {
    pub magic: u32,
    pub mask: u32,
    pub seq: u32,
    pub group: u16,
    pub flags: u8,
    pub hops: u8,
}
const _: () = assert!(core::mem::size_of::<BcastHdr>() == BCAST_HDR_LEN);

/// `struct aggbox_bcast_runtime_subhdr` (wire, network order): what the
/// runtime puts first in every `AGB1` payload it sends; the data plane never
/// reads it.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BcastRuntimeSubhdr {
    pub round: u32,
    pub offset: u32,
}
const _: () = assert!(core::mem::size_of::<BcastRuntimeSubhdr>() == BCAST_RUNTIME_SUBHDR_LEN);

/// `struct aggbox_ack_hdr` (wire, network order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AckHdr {
    pub magic: u32,
    pub id: u16,
    pub rank: u16,
    pub base_seq: u32,
    pub nbits: u16,
    pub kind: u8,
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<AckHdr>() == ACK_HDR_LEN);

// Position query and reply (`AGP1`, user space only): a worker of a
// node-served job asks the node's result service where a new run must
// start; docs/PROTOCOL.md "AGP1: the position of a node-served job",
// `wire::proto::PositionMessage`.
pub const MAGIC_POSITION: u32 = 0x4147_5031;
/// The node's answer (clear: a query).
pub const POSITION_F_REPLY: u8 = 0x01;
/// Reply: the node has seen no RESULT of the job (the position is 0, 0).
pub const POSITION_F_FRESH: u8 = 0x02;
pub const POSITION_F_KNOWN: u8 = 0x03;
/// An `AGP1` datagram is exactly this long.
pub const POSITION_LEN: usize = 24;

/// `struct aggbox_position_hdr` (wire, network order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PositionHdr {
    pub magic: u32,
    pub job: u16,
    pub rank: u16,
    pub nonce: u32,
    pub round: u32,
    pub agg_seq: u32,
    pub flags: u8,
    pub pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<PositionHdr>() == POSITION_LEN);

/// `enum aggbox_drop_reason`: negative codes, cilium style.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    TruncatedHeader = -130,
    InvalidOp = -131,
    ReservedFlag = -132,
    ZeroCount = -133,
    CountTooLarge = -134,
    CountTooSmall = -135,
    UnknownJob = -136,
    RankOutOfRange = -137,
    SourceMismatch = -138,
    BeyondVector = -139,
    Retransmission = -140,
    StaleRound = -141,
    SlotPoolFull = -142,
    MissedTailCall = -143,
    SlotMismatch = -144,
    IpFragment = -145,
    TooLarge = -146,
    PortMismatch = -147,
    ForgedResult = -148,
    SlotBusy = -149,
}

impl DropReason {
    pub const ALL: [DropReason; 20] = [
        DropReason::TruncatedHeader,
        DropReason::InvalidOp,
        DropReason::ReservedFlag,
        DropReason::ZeroCount,
        DropReason::CountTooLarge,
        DropReason::CountTooSmall,
        DropReason::UnknownJob,
        DropReason::RankOutOfRange,
        DropReason::SourceMismatch,
        DropReason::BeyondVector,
        DropReason::Retransmission,
        DropReason::StaleRound,
        DropReason::SlotPoolFull,
        DropReason::MissedTailCall,
        DropReason::SlotMismatch,
        DropReason::IpFragment,
        DropReason::TooLarge,
        DropReason::PortMismatch,
        DropReason::ForgedResult,
        DropReason::SlotBusy,
    ];

    /// Index of this reason in the stats map.
    pub fn stats_index(self) -> u32 {
        STATS_DROP_BASE + (DropReason::TruncatedHeader as i32 - self as i32) as u32
    }

    /// Label used in metrics and `aggbox status` (snake case).
    pub fn label(self) -> &'static str {
        match self {
            DropReason::TruncatedHeader => "truncated_header",
            DropReason::InvalidOp => "invalid_op",
            DropReason::ReservedFlag => "reserved_flag",
            DropReason::ZeroCount => "zero_count",
            DropReason::CountTooLarge => "count_larger_than_datagram",
            DropReason::CountTooSmall => "count_smaller_than_datagram",
            DropReason::UnknownJob => "unknown_job",
            DropReason::RankOutOfRange => "rank_out_of_range",
            DropReason::SourceMismatch => "source_mismatch",
            DropReason::BeyondVector => "beyond_vector_len",
            DropReason::Retransmission => "retransmission",
            DropReason::StaleRound => "stale_round",
            DropReason::SlotPoolFull => "slot_pool_full",
            DropReason::MissedTailCall => "missed_tail_call",
            DropReason::SlotMismatch => "slot_mismatch",
            DropReason::IpFragment => "ip_fragment",
            DropReason::TooLarge => "too_large",
            DropReason::PortMismatch => "port_mismatch",
            DropReason::ForgedResult => "forged_result",
            DropReason::SlotBusy => "slot_busy",
        }
    }
}

/// `enum aggbox_outcome`: what happened to a datagram that was not dropped.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    NotAggbox = 0,
    Accepted = 1,
    Result = 2,
    ToUserspace = 3,
    OtherAggbox = 4,
    /// For the user-space path, but no AF_XDP socket on the RX queue: passed.
    UserspaceUnavailable = 5,
}

impl Outcome {
    pub const ALL: [Outcome; 6] = [
        Outcome::NotAggbox,
        Outcome::Accepted,
        Outcome::Result,
        Outcome::ToUserspace,
        Outcome::OtherAggbox,
        Outcome::UserspaceUnavailable,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::NotAggbox => "not_aggbox",
            Outcome::Accepted => "accepted",
            Outcome::Result => "result",
            Outcome::ToUserspace => "to_userspace",
            Outcome::OtherAggbox => "other_aggbox",
            Outcome::UserspaceUnavailable => "userspace_unavailable",
        }
    }
}

pub const OUTCOME_COUNT_OK: u32 = 6;
pub const STATS_DROP_BASE: u32 = OUTCOME_COUNT_OK;
pub const STATS_MAX: u32 = STATS_DROP_BASE + DropReason::ALL.len() as u32;

/// `struct aggbox_stat` (per-CPU value of the stats map, host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub packets: u64,
    pub bytes: u64,
}
const _: () = assert!(core::mem::size_of::<Stat>() == 16);

/// `struct aggbox_job_key` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct JobKey {
    pub job: u16,
    pub pad: u16,
}
const _: () = assert!(core::mem::size_of::<JobKey>() == 4);

/// `struct aggbox_job` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    pub port: u16,
    pub result_port: u16,
    pub workers: u16,
    pub result_group: u16,
    pub vector_len: u32,
    pub slots: u32,
    pub flags: u32,
    pub weight_sum: u32,
    pub window: u32,
    pub fast_base: u16,
    pub fast_slots: u16,
    pub id: u16,
    pub fast_granule: u16,
    pub fast_stride: u32,
}
const _: () = assert!(core::mem::size_of::<Job>() == 40);

/// `struct aggbox_rank_key` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RankKey {
    pub job: u16,
    pub rank: u16,
}
const _: () = assert!(core::mem::size_of::<RankKey>() == 4);

/// Largest rank weight magnitude a job may have (the control plane refuses
/// more: `XdpPlane::set_job`, the config parser).
///
/// The kernel accumulates `weight * value` in a signed 64-bit integer per
/// element. With at most [`MAX_RANKS`] (2^8) ranks, `|value| <= 2^31` and
/// `|weight| <= 2^23`, the sum stays below 2^62 and can never wrap.
pub const MAX_WEIGHT: i32 = 1 << 23;

/// `struct aggbox_rank`: `addr` big-endian, `weight` host order.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rank {
    pub addr: u32,
    pub weight: i32,
}
const _: () = assert!(core::mem::size_of::<Rank>() == 8);

/// `struct aggbox_port_key` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PortKey {
    pub port: u16,
    pub pad: u16,
}
const _: () = assert!(core::mem::size_of::<PortKey>() == 4);

/// `struct aggbox_port` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Port {
    pub jobs: u32,
}
const _: () = assert!(core::mem::size_of::<Port>() == 4);

/// Largest `count` the kernel aggregates (`AGGBOX_MAX_ELEMS`): every legal
/// IPv4 datagram (at most 16370 elements) fits.
pub const MAX_ELEMS: u32 = 16384;
/// Elements of one slot block: one spin-lock acquisition, one
/// `bpf_xdp_load_bytes` (`AGGBOX_CHUNK_ELEMS`).
pub const CHUNK_ELEMS: u32 = 256;
/// Chunks one program run of the tail-call chain processes (`AGGBOX_PROG_CHUNKS`).
pub const PROG_CHUNKS: u32 = 8;

/// Chunks of the largest datagram the linear chain (kernels without
/// multi-buffer XDP) aggregates (`AGGBOX_LINEAR_MAX_CHUNKS`): one chunk per
/// program run, 1 + 2 × 15 tail calls.
pub const LINEAR_MAX_CHUNKS: u32 = 15;

/// Largest `count` the linear chain aggregates (`AGGBOX_LINEAR_MAX_ELEMS`).
pub const LINEAR_MAX_ELEMS: u32 = LINEAR_MAX_CHUNKS * CHUNK_ELEMS;
/// Slot blocks of all jobs together (`AGGBOX_MAX_BLOCKS`).
pub const MAX_BLOCKS: u32 = 2 * MAX_SLOTS;
/// Slots of all jobs together (`AGGBOX_MAX_SLOTS`).
pub const MAX_SLOTS: u32 = 4096;
/// Fast slots of all jobs together (`AGGBOX_FAST_SLOTS`, docs/DATAPLANE.md
/// "Fast slots").
pub const FAST_SLOTS: u32 = 8192;
/// Largest fast-slot region of one job (`AGGBOX_FAST_JOB_SLOTS`).
pub const FAST_JOB_SLOTS: u32 = 4096;
/// Largest `count` a fast slot holds (`AGGBOX_FAST_ELEMS`); larger
/// contributions use the hash-map slots.
pub const FAST_ELEMS: u32 = 384;
/// Elements of a round that share one fast-slot index when the job's
/// fragment size is unknown or larger than [`FAST_ELEMS`]
/// (`AGGBOX_FAST_GRANULE`; a job's own is `Job::fast_granule`).
pub const FAST_GRANULE: u32 = 256;
/// `enum aggbox_fast_stat`: index of the `fast_stats` map.
pub const FAST_JOINED: u32 = 0;
/// See [`FAST_JOINED`].
pub const FAST_TAKEN: u32 = 1;
/// See [`FAST_JOINED`].
pub const FAST_BUSY: u32 = 2;
/// See [`FAST_JOINED`].
pub const FAST_ABORTED: u32 = 3;
/// See [`FAST_JOINED`].
pub const FAST_RELEASED: u32 = 4;
/// See [`FAST_JOINED`].
pub const FAST_CHECKED: u32 = 5;
/// See [`FAST_JOINED`].
pub const FAST_STAT_MAX: u32 = 6;
/// Label of each `fast_stats` index, in index order (metrics, reports).
pub const FAST_STAT_LABELS: [&str; FAST_STAT_MAX as usize] = ["joined", "taken", "busy", "aborted", "released", "checked"];
/// Completed-slot markers kept (`AGGBOX_MAX_COMPLETED`).
pub const MAX_COMPLETED: u32 = 65536;
/// Rounds older than the newest completed round minus this are stale.
pub const ROUND_WINDOW: u32 = 64;

/// A round: the AGG1 `round`, one reduction generation of a job. Rounds wrap
/// at 2^32, so they compare in serial-number order (RFC 1982) and only
/// through [`Round::ahead_of`] (its C twin is `aggbox_rounds_ahead`,
/// include/aggbox/abi.h): there is no `<` on rounds. Map structs keep their
/// rounds as the C layout's `u32`; wrap them to compare.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Round(pub u32);

impl Round {
    /// How many rounds `self` is ahead of `other` (negative: behind).
    pub fn ahead_of(self, other: Round) -> i32 {
        self.0.wrapping_sub(other.0) as i32
    }

    /// Whether `self` comes after `other`.
    pub fn is_after(self, other: Round) -> bool {
        self.ahead_of(other) > 0
    }

    /// Whether `self` comes before `other`.
    pub fn is_before(self, other: Round) -> bool {
        self.ahead_of(other) < 0
    }

    /// The round `n` after this one.
    pub fn plus(self, n: u32) -> Round {
        Round(self.0.wrapping_add(n))
    }

    /// The round before this one.
    pub fn previous(self) -> Round {
        Round(self.0.wrapping_sub(1))
    }

    /// Whether `self` is stale: more than `window` rounds behind `newest`,
    /// the newest round one path completed (`None`: none yet, nothing is
    /// stale). `window` is a job's (`aggbox_job.window`); 0 means
    /// [`ROUND_WINDOW`]. The rule the XDP program drops by
    /// (`aggbox_rounds_ahead(newest, round) > window`); the user-space paths
    /// ask it of each path's newest round, written here once.
    pub fn is_stale(self, newest: Option<Round>, window: u32) -> bool {
        let window = if window == 0 { ROUND_WINDOW } else { window };
        let window = window.min(i32::MAX as u32) as i32;
        newest.is_some_and(|n| n.ahead_of(self) > window)
    }
}

impl std::fmt::Display for Round {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// `enum aggbox_call`: index of each program in the tail-call prog array.
pub const CALL_SLOT: u32 = 0;
/// See [`CALL_SLOT`].
pub const CALL_ADD: u32 = 1;
/// See [`CALL_SLOT`].
pub const CALL_RESULT: u32 = 2;
/// Size of the prog array.
/// See [`CALL_SLOT`].
pub const CALL_ENTRY: u32 = 3;
/// See [`CALL_SLOT`].
pub const CALL_RING: u32 = 4;
/// See [`CALL_SLOT`].
pub const CALL_MAX: u32 = 5;

/// `struct aggbox_slot_key` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SlotKey {
    pub job: u16,
    pub pad: u16,
    pub round: u32,
    pub frag_off: u32,
}
const _: () = assert!(core::mem::size_of::<SlotKey>() == 12);

/// `struct aggbox_job_state` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct JobState {
    /// Slots of the job in the kernel's pools (atomic).
    pub active_slots: u32,
    /// Newest completed round (valid once `completed` is set).
    pub newest_round: u32,
    /// 1 once a slot of the job completed; completions are counted in
    /// [`JobStats::results`].
    pub completed: u32,
    /// Seq of the next RESULT of a job whose results go upstream; 0 for
    /// other jobs (their RESULT keeps the completing contribution's seq).
    pub result_seq: u32,
}
const _: () = assert!(core::mem::size_of::<JobState>() == 16);

/// `struct aggbox_job_stats` (per-CPU value of `job_stats`, key [`JobKey`],
/// host order): what became of one job's datagrams once its job was known.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct JobStats {
    /// Contributions absorbed into a slot.
    pub accepted: u64,
    /// Contributions that completed a slot (RESULT emitted).
    pub results: u64,
    /// RESULTs with the OVERFLOW flag.
    pub overflow_results: u64,
    /// Retransmissions (duplicate contributions) dropped.
    pub retransmissions: u64,
    /// Contributions of a stale round dropped.
    pub stale: u64,
    /// Datagrams redirected to the user-space path.
    pub handed_to_userspace: u64,
    /// Every other drop reason once the job is known.
    pub dropped: u64,
    /// UDP payload bytes of the datagrams above.
    pub bytes: u64,
}
const _: () = assert!(core::mem::size_of::<JobStats>() == 64);

impl JobStats {
    /// Add another (per-CPU) value into this one.
    pub fn add(&mut self, o: &JobStats) {
        self.accepted += o.accepted;
        self.results += o.results;
        self.overflow_results += o.overflow_results;
        self.retransmissions += o.retransmissions;
        self.stale += o.stale;
        self.handed_to_userspace += o.handed_to_userspace;
        self.dropped += o.dropped;
        self.bytes += o.bytes;
    }

    /// Datagrams counted (every category but `overflow_results`, which is
    /// a subset of `results`).
    pub fn datagrams(&self) -> u64 {
        self.accepted + self.results + self.retransmissions + self.stale + self.handed_to_userspace + self.dropped
    }

    /// `(outcome label, datagrams)` of the `aggbox_job_contributions_total`
    /// metric family.
    pub fn by_outcome(&self) -> [(&'static str, u64); 6] {
        [
            ("accepted", self.accepted),
            ("result", self.results),
            ("retransmission", self.retransmissions),
            ("stale", self.stale),
            ("to_userspace", self.handed_to_userspace),
            ("dropped", self.dropped),
        ]
    }
}

/// RX queues that can have an AF_XDP socket (`AGGBOX_MAX_QUEUES`).
pub const MAX_QUEUES: u32 = 64;
/// Bytes the kernel keeps in front of each AF_XDP UMEM frame
/// (XDP_PACKET_HEADROOM, `AGGBOX_XSK_RX_HEADROOM`): a socket without
/// multi-buffer takes frames of at most frame size - UMEM headroom - this.
pub const XSK_RX_HEADROOM: u32 = 256;
/// Entries of the `slot_owner` map (`AGGBOX_MAX_OWNERS`).
pub const MAX_OWNERS: u32 = 2 * MAX_SLOTS;

/// `enum aggbox_handoff_reason`: why a datagram went to user space.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandoffReason {
    /// Op 5..8.
    Op = 0,
    /// FLOAT32 payload.
    Float32 = 1,
    /// Job flagged [`JOB_F_USERSPACE_ONLY`].
    UserspaceOnly = 2,
    /// New slot while the slot pool is full.
    PoolFull = 3,
    /// New slot of a job in overload ([`HANDOFF_F_OVERLOAD`]).
    Overload = 4,
    /// Slot already owned by user space.
    Owned = 5,
}

impl HandoffReason {
    pub const ALL: [HandoffReason; 6] = [
        HandoffReason::Op,
        HandoffReason::Float32,
        HandoffReason::UserspaceOnly,
        HandoffReason::PoolFull,
        HandoffReason::Overload,
        HandoffReason::Owned,
    ];

    /// Label used in metrics (snake case).
    pub fn label(self) -> &'static str {
        match self {
            HandoffReason::Op => "op",
            HandoffReason::Float32 => "float32",
            HandoffReason::UserspaceOnly => "userspace_only",
            HandoffReason::PoolFull => "pool_full",
            HandoffReason::Overload => "overload",
            HandoffReason::Owned => "owned",
        }
    }
}
/// Size of the `handoff_stats` map (`AGGBOX_HANDOFF_MAX`).
pub const HANDOFF_MAX: u32 = 6;

/// `slot_owner` value: the kernel serves the slot.
pub const OWNER_KERNEL: u32 = 1;
/// `slot_owner` value: user space serves the slot.
pub const OWNER_USERSPACE: u32 = 2;

/// `struct aggbox_slot_owner` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SlotOwner {
    pub owner: u32,
}
const _: () = assert!(core::mem::size_of::<SlotOwner>() == 4);

/// `job_handoff` flag: new slots of the job go to user space.
pub const HANDOFF_F_OVERLOAD: u32 = 0x01;

/// `struct aggbox_job_handoff` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct JobHandoff {
    pub flags: u32,
    pub newest_round: u32,
    pub completed: u32,
    pub pad: u32,
}
const _: () = assert!(core::mem::size_of::<JobHandoff>() == 16);

// SAFETY: every type above is repr(C), made only of integers, and valid for
// any bit pattern, which is all `plain` requires.
unsafe impl Plain for AggHdr {}
unsafe impl Plain for BcastHdr {}
unsafe impl Plain for AckHdr {}
unsafe impl Plain for Stat {}
unsafe impl Plain for JobKey {}
unsafe impl Plain for Job {}
unsafe impl Plain for RankKey {}
unsafe impl Plain for Rank {}
unsafe impl Plain for PortKey {}
unsafe impl Plain for Port {}
unsafe impl Plain for SlotKey {}
unsafe impl Plain for JobState {}
unsafe impl Plain for JobStats {}
unsafe impl Plain for SlotOwner {}
unsafe impl Plain for JobHandoff {}

/// View of a plain value as bytes, for map updates.
pub fn as_bytes<T: Plain>(value: &T) -> &[u8] {
    // SAFETY: T is Plain (no padding we read uninitialised: all mirrored
    // structs have explicit padding fields) and the slice covers exactly it.
    unsafe { plain::as_bytes(value) }
}

/// Copy a plain value out of bytes (map lookups), `None` if too short.
pub fn from_bytes<T: Plain + Default>(bytes: &[u8]) -> Option<T> {
    let mut value = T::default();
    plain::copy_from_bytes(&mut value, bytes).ok()?;
    Some(value)
}

/// Push `(struct, "sizeof", 0, size)` and `(struct, field, offset, size)`
/// of every listed field of `$ty` onto `$out` (for [`layout`]).
macro_rules! fields {
    ($out:ident, $cname:literal, $ty:ty, [$($f:ident),*]) => {
        $out.push(($cname, "sizeof", 0, core::mem::size_of::<$ty>()));
        $(
            $out.push(($cname, stringify!($f), core::mem::offset_of!($ty, $f),
                size_of_field(|s: &$ty| &s.$f)));
        )*
    };
}

/// The size of the field a closure projects to (`fields!`).
fn size_of_field<S, F>(_: impl Fn(&S) -> &F) -> usize {
    core::mem::size_of::<F>()
}

/// Field offsets of every mirrored struct, `(struct, field, offset, size)`,
/// compared with the C header by `tests/abi_layout.rs`.
pub fn layout() -> Vec<(&'static str, &'static str, usize, usize)> {
    let mut out = Vec::new();
    fields!(out, "aggbox_agg_hdr", AggHdr, [magic, job, rank, seq, round, frag_off, op, flags, count]);
    fields!(out, "aggbox_bcast_hdr", BcastHdr, [magic, mask, seq, group, flags, hops]);
    fields!(out, "aggbox_bcast_runtime_subhdr", BcastRuntimeSubhdr, [round, offset]);
    fields!(out, "aggbox_ack_hdr", AckHdr, [magic, id, rank, base_seq, nbits, kind, flags]);
    fields!(out, "aggbox_position_hdr", PositionHdr, [magic, job, rank, nonce, round, agg_seq, flags, pad]);
    fields!(out, "aggbox_stat", Stat, [packets, bytes]);
    fields!(out, "aggbox_job_key", JobKey, [job, pad]);
    fields!(out, "aggbox_job", Job, [port, result_port, workers, result_group, vector_len, slots, flags, weight_sum, window, fast_base, fast_slots, id, fast_granule, fast_stride]);
    fields!(out, "aggbox_rank_key", RankKey, [job, rank]);
    fields!(out, "aggbox_rank", Rank, [addr, weight]);
    fields!(out, "aggbox_port_key", PortKey, [port, pad]);
    fields!(out, "aggbox_port", Port, [jobs]);
    fields!(out, "aggbox_slot_key", SlotKey, [job, pad, round, frag_off]);
    fields!(out, "aggbox_job_state", JobState, [active_slots, newest_round, completed, result_seq]);
    fields!(
        out,
        "aggbox_job_stats",
        JobStats,
        [accepted, results, overflow_results, retransmissions, stale, handed_to_userspace, dropped, bytes]
    );
    fields!(out, "aggbox_slot_owner", SlotOwner, [owner]);
    fields!(out, "aggbox_job_handoff", JobHandoff, [flags, newest_round, completed, pad]);
    bcast_layout(&mut out);
    ring_layout(&mut out);
    out
}

// ---------------------------------------------------------------------------
// Broadcast (TC data plane): mirror of the "Broadcast" part of abi.h.
// ---------------------------------------------------------------------------

/// Destinations per group table (`AGGBOX_BCAST_MAX_DESTS`, the AGB1 mask width).
pub const BCAST_MAX_DESTS: u32 = 32;
/// Group tables per node (`AGGBOX_BCAST_MAX_GROUPS`).
pub const BCAST_MAX_GROUPS: u32 = 1024;
/// Next-hop cache entries (`AGGBOX_BCAST_MAX_NEIGH`).
pub const BCAST_MAX_NEIGH: u32 = 4096;
/// A datagram with `hops >=` this is delivered but not forwarded again.
pub const BCAST_MAX_HOPS: u32 = 16;
/// Default lifetime of a next-hop cache entry, seconds.
pub const BCAST_DEFAULT_NEIGH_TTL_S: u32 = 3600;
/// `skb->mark` of a finished copy.
pub const BCAST_MARK_COPY: u32 = 0xa6b1_0001;
/// `skb->mark` of a copy whose neighbour is unresolved.
pub const BCAST_MARK_NEIGH: u32 = 0xa6b1_0002;
/// `skb->mark` of a copy sent through the neighbour path.
pub const BCAST_MARK_DONE: u32 = 0xa6b1_0003;
/// `aggbox_group_key.port` of the root table / any receiving port.
pub const BCAST_PORT_ANY: u16 = 0;
/// `aggbox_neigh.flags`: marked stale by the entry's bpf_timer.
pub const NEIGH_F_STALE: u32 = 0x01;

/// `struct aggbox_group_key` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupKey {
    pub group: u16,
    pub port: u16,
}
const _: () = assert!(core::mem::size_of::<GroupKey>() == 4);

/// `struct aggbox_group_dest`: `addr` and `port` big-endian (as on the wire).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GroupDest {
    pub addr: u32,
    pub port: u16,
    pub pad: u16,
}
const _: () = assert!(core::mem::size_of::<GroupDest>() == 8);

/// `struct aggbox_group` (host order count/flags).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub count: u32,
    pub flags: u32,
    pub dests: [GroupDest; BCAST_MAX_DESTS as usize],
}
const _: () = assert!(core::mem::size_of::<Group>() == 8 + 8 * BCAST_MAX_DESTS as usize);

/// `struct aggbox_neigh_key`: `addr` big-endian, `ifindex` host order.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NeighKey {
    pub addr: u32,
    pub ifindex: u32,
}
const _: () = assert!(core::mem::size_of::<NeighKey>() == 8);

/// `struct aggbox_neigh`: the user-visible part of a `bcast_neigh` value
/// (the BPF value appends a 16-byte `struct bpf_timer`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Neigh {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub ifindex: u32,
    pub flags: u32,
    pub pad: u32,
    pub updated_ns: u64,
}
const _: () = assert!(core::mem::size_of::<Neigh>() == 32);

/// `struct aggbox_bcast_config` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BcastConfig {
    pub neigh_ttl_ns: u64,
}
const _: () = assert!(core::mem::size_of::<BcastConfig>() == 8);

/// `struct aggbox_bcast_group_stat` (per-CPU value of `bcast_gstats`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BcastGroupStat {
    pub datagrams: u64,
    pub copies: u64,
    pub neigh_misses: u64,
    pub bytes: u64,
}
const _: () = assert!(core::mem::size_of::<BcastGroupStat>() == 32);

/// `enum aggbox_bcast_stat`: index of each counter in `bcast_stats`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BcastStat {
    NotAggbox = 0,
    OwnCopy = 1,
    UnknownGroup = 2,
    Malformed = 3,
    IpFragment = 4,
    EmptyMask = 5,
    Broadcast = 6,
    Forwarded = 7,
    LocalOnly = 8,
    HopsLimit = 9,
    CopySent = 10,
    NeighMiss = 11,
    CacheHit = 12,
    FibLookup = 13,
    FwdDisabled = 14,
    FibError = 15,
    CloneFailed = 16,
    RewriteFailed = 17,
    LocalCopy = 18,
    ResultBroadcast = 19,
    ResultUpstream = 20,
}

/// `AGGBOX_BCAST_STAT_MAX`.
pub const BCAST_STAT_MAX: u32 = 21;

impl BcastStat {
    pub const ALL: [BcastStat; 21] = [
        BcastStat::NotAggbox,
        BcastStat::OwnCopy,
        BcastStat::UnknownGroup,
        BcastStat::Malformed,
        BcastStat::IpFragment,
        BcastStat::EmptyMask,
        BcastStat::Broadcast,
        BcastStat::Forwarded,
        BcastStat::LocalOnly,
        BcastStat::HopsLimit,
        BcastStat::CopySent,
        BcastStat::NeighMiss,
        BcastStat::CacheHit,
        BcastStat::FibLookup,
        BcastStat::FwdDisabled,
        BcastStat::FibError,
        BcastStat::CloneFailed,
        BcastStat::RewriteFailed,
        BcastStat::LocalCopy,
        BcastStat::ResultBroadcast,
        BcastStat::ResultUpstream,
    ];

    /// Label used in metrics and status (snake case; the C name is
    /// `AGGBOX_BCAST_` + its upper case).
    pub fn label(self) -> &'static str {
        match self {
            BcastStat::NotAggbox => "not_aggbox",
            BcastStat::OwnCopy => "own_copy",
            BcastStat::UnknownGroup => "unknown_group",
            BcastStat::Malformed => "malformed",
            BcastStat::IpFragment => "ip_fragment",
            BcastStat::EmptyMask => "empty_mask",
            BcastStat::Broadcast => "broadcast",
            BcastStat::Forwarded => "forwarded",
            BcastStat::LocalOnly => "local_only",
            BcastStat::HopsLimit => "hops_limit",
            BcastStat::CopySent => "copy_sent",
            BcastStat::NeighMiss => "neigh_miss",
            BcastStat::CacheHit => "cache_hit",
            BcastStat::FibLookup => "fib_lookup",
            BcastStat::FwdDisabled => "fwd_disabled",
            BcastStat::FibError => "fib_error",
            BcastStat::CloneFailed => "clone_failed",
            BcastStat::RewriteFailed => "rewrite_failed",
            BcastStat::LocalCopy => "local_copy",
            BcastStat::ResultBroadcast => "result_broadcast",
            BcastStat::ResultUpstream => "result_upstream",
        }
    }

    /// Whether this counter is a per-datagram outcome (exactly one per
    /// packet the TC programs see) rather than a per-copy event.
    pub fn is_datagram_outcome(self) -> bool {
        (self as u32) < BcastStat::CopySent as u32
            || matches!(self, BcastStat::ResultBroadcast | BcastStat::ResultUpstream)
    }
}

// SAFETY: as above: repr(C), integers only, any bit pattern valid.
unsafe impl Plain for GroupKey {}
unsafe impl Plain for GroupDest {}
unsafe impl Plain for Group {}
unsafe impl Plain for NeighKey {}
unsafe impl Plain for Neigh {}
unsafe impl Plain for BcastConfig {}
unsafe impl Plain for BcastGroupStat {}
unsafe impl Plain for ResultRoute {}

/// Field offsets of the broadcast structs (part of [`layout`]).
fn bcast_layout(out: &mut Vec<(&'static str, &'static str, usize, usize)>) {
    fields!(out, "aggbox_group_key", GroupKey, [group, port]);
    fields!(out, "aggbox_group_dest", GroupDest, [addr, port, pad]);
    fields!(out, "aggbox_group", Group, [count, flags, dests]);
    fields!(out, "aggbox_neigh_key", NeighKey, [addr, ifindex]);
    fields!(out, "aggbox_neigh", Neigh, [dmac, smac, ifindex, flags, pad, updated_ns]);
    fields!(out, "aggbox_bcast_config", BcastConfig, [neigh_ttl_ns]);
    fields!(out, "aggbox_bcast_group_stat", BcastGroupStat, [datagrams, copies, neigh_misses, bytes]);
    fields!(
        out,
        "aggbox_result_route",
        ResultRoute,
        [result_port, group, flags, parent_addr, parent_port, parent_job, parent_rank, pad]
    );
}

// ---------------------------------------------------------------------------
// Routes of RESULT datagrams (TC ingress): mirror of the "Routes of RESULT
// datagrams" part of abi.h.
// ---------------------------------------------------------------------------

/// `result_routes` entries (`AGGBOX_MAX_RESULT_ROUTES`).
pub const MAX_RESULT_ROUTES: u32 = MAX_JOBS;
/// `aggbox_result_route.flags`: copy each RESULT to every member of `group`.
pub const ROUTE_F_GROUP: u32 = 0x01;
/// `aggbox_result_route.flags`: send each RESULT upstream to the parent.
pub const ROUTE_F_PARENT: u32 = 0x02;
/// Every defined `aggbox_result_route.flags` bit.
pub const ROUTE_F_KNOWN: u32 = 0x03;

/// `struct aggbox_result_route` (value of `result_routes`, key [`JobKey`]):
/// `parent_addr` and `parent_port` big-endian, the rest host order.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ResultRoute {
    pub result_port: u16,
    pub group: u16,
    pub flags: u32,
    pub parent_addr: u32,
    pub parent_port: u16,
    pub parent_job: u16,
    pub parent_rank: u16,
    pub pad: u16,
}
const _: () = assert!(core::mem::size_of::<ResultRoute>() == 20);

#[cfg(test)]
mod tests {
    use super::Round;

    #[test]
    fn rounds_compare_in_serial_order_across_the_wrap() {
        assert_eq!(Round(5).ahead_of(Round(3)), 2);
        assert_eq!(Round(3).ahead_of(Round(5)), -2);
        assert_eq!(Round(0).ahead_of(Round(u32::MAX)), 1, "0 comes right after u32::MAX");
        assert!(Round(0).is_after(Round(u32::MAX)) && Round(u32::MAX).is_before(Round(0)));
        assert_eq!(Round(u32::MAX).plus(1), Round(0));
        assert_eq!(Round(0).previous(), Round(u32::MAX));
        assert_eq!(Round(7).ahead_of(Round(7)), 0);
        // Half the space away is the furthest that still reads as ahead.
        assert_eq!(Round(1 << 31).ahead_of(Round(1)), i32::MAX);
    }

    #[test]
    fn a_round_is_stale_beyond_the_window_behind_the_newest() {
        use super::ROUND_WINDOW;
        // Nothing completed yet: nothing is stale.
        assert!(!Round(0).is_stale(None, 4));
        // Exactly `window` behind is still live; one more is stale.
        assert!(!Round(10).is_stale(Some(Round(14)), 4));
        assert!(Round(9).is_stale(Some(Round(14)), 4));
        // Ahead of the newest is never stale.
        assert!(!Round(20).is_stale(Some(Round(14)), 4));
        // Window 0 is the build default.
        assert!(!Round(100).is_stale(Some(Round(100 + ROUND_WINDOW)), 0));
        assert!(Round(99).is_stale(Some(Round(100 + ROUND_WINDOW)), 0));
        // Serial order across the wrap.
        assert!(Round(u32::MAX - 4).is_stale(Some(Round(1)), 4));
        assert!(!Round(u32::MAX - 2).is_stale(Some(Round(1)), 4));
        // A window past i32::MAX is as wide as serial order reaches.
        assert!(!Round(1).is_stale(Some(Round(1 << 31)), u32::MAX));
    }
}

// ---------------------------------------------------------------------------
// Ring allreduce: mirror of the "Ring allreduce" part of abi.h
// (docs/RING.md).
// ---------------------------------------------------------------------------

/// `AGGBOX_MAGIC_RING`: "AGR1".
pub const MAGIC_RING: u32 = 0x4147_5231;
/// `AGGBOX_RING_PARTIAL`: the partial result of the members it passed.
pub const RING_PARTIAL: u8 = 0;
/// `AGGBOX_RING_FINAL`: the fragment's result.
pub const RING_FINAL: u8 = 1;
/// `AGGBOX_RING_NACK`: fragment indexes the sender misses.
pub const RING_NACK: u8 = 2;
/// `AGGBOX_RING_KICK`: local runtime to its node, a round is ready.
pub const RING_KICK: u8 = 3;
/// `AGGBOX_RING_KIND_LAST`.
pub const RING_KIND_LAST: u8 = RING_KICK;
/// `AGGBOX_RING_F_SATURATED`: some partial left the int32 range.
pub const RING_F_SATURATED: u8 = 0x01;
/// `AGGBOX_RING_F_NACK_FINAL`: a NACK for FINALs (else for PARTIALs).
pub const RING_F_NACK_FINAL: u8 = 0x02;
/// `AGGBOX_RING_F_KNOWN`.
pub const RING_F_KNOWN: u8 = 0x03;
/// Length of `struct aggbox_ring_hdr`.
pub const RING_HDR_LEN: usize = 24;
/// `AGGBOX_MAX_RINGS`.
pub const MAX_RINGS: u32 = 64;
/// `AGGBOX_RING_MAX_FRAG_ELEMS`.
pub const RING_MAX_FRAG_ELEMS: u32 = 16384;
/// `AGGBOX_RING_READY`.
pub const RING_READY: u32 = 0x01;

/// `struct aggbox_ring_hdr` (wire: big-endian fields as raw `u16`/`u32`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RingHdr {
    pub magic: u32,
    pub ring: u16,
    pub kind: u8,
    pub flags: u8,
    pub round: u32,
    pub frag: u32,
    pub hops: u16,
    pub count: u16,
    pub sender: u16,
    pub op: u8,
    pub pad: u8,
}
const _: () = assert!(core::mem::size_of::<RingHdr>() == RING_HDR_LEN);

/// `struct aggbox_ring_job` (host order but `self_addr`, `next_addr`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RingJob {
    pub id: u16,
    pub port: u16,
    pub members: u16,
    pub me: u16,
    pub frag_elems: u32,
    pub frags: u32,
    pub vector_len: u32,
    pub base: u32,
    pub weight_sum: u32,
    pub weight: i32,
    /// Big-endian (network order) IPv4 address.
    pub self_addr: u32,
    /// Big-endian (network order) IPv4 address.
    pub next_addr: u32,
}
const _: () = assert!(core::mem::size_of::<RingJob>() == 40);

impl RingJob {
    /// `AGGBOX_RING_INDEX`: the `ring_data` / `ring_done` index of
    /// fragment `frag` in round `round`. A ring has two buffers, even
    /// rounds' from `base` and odd rounds' after them, so that a round's
    /// results stay in place until this member starts the round after
    /// next (docs/RING.md "Why two buffers").
    pub fn index(&self, round: Round, frag: u32) -> u32 {
        self.round_base(round) + frag
    }

    /// The index of fragment 0 in round `round`'s buffer.
    pub fn round_base(&self, round: Round) -> u32 {
        self.base + (round.0 & 1) * self.frags
    }

    /// `ring_data` / `ring_done` entries the ring takes (both buffers).
    pub fn entries(&self) -> u32 {
        2 * self.frags
    }
}

/// `struct aggbox_ring_ctrl` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RingCtrl {
    pub ready_round: u32,
    pub state: u32,
    pub finals: u32,
    pub finals_round: u32,
    pub op: u32,
    pub round_frags: u32,
    pub pad: [u32; 10],
}
const _: () = assert!(core::mem::size_of::<RingCtrl>() == 64);

/// `struct aggbox_ring_done` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RingDone {
    /// 1 + round of the stored result, 0 = none.
    pub round_plus1: u32,
    /// 1 + round being (or last) stored: claimed by compare-and-swap before
    /// the result is written (abi.h).
    pub claimed_plus1: u32,
    /// 1 + round whose stored result saturated (written before
    /// `round_plus1`).
    pub saturated_plus1: u32,
    pub pad: u32,
}
const _: () = assert!(core::mem::size_of::<RingDone>() == 16);

/// `enum aggbox_ring_stat`: index into [`RingStats::count`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RingStat {
    Added = 0,
    Completed = 1,
    Stored = 2,
    Duplicate = 3,
    Early = 4,
    ToService = 5,
    Stale = 6,
    Forged = 7,
    Malformed = 8,
    NoRoute = 9,
    Saturated = 10,
}

impl RingStat {
    /// Every counter, in index order.
    pub const ALL: [RingStat; 11] = [
        RingStat::Added,
        RingStat::Completed,
        RingStat::Stored,
        RingStat::Duplicate,
        RingStat::Early,
        RingStat::ToService,
        RingStat::Stale,
        RingStat::Forged,
        RingStat::Malformed,
        RingStat::NoRoute,
        RingStat::Saturated,
    ];

    /// The counter's name in the metrics and `aggbox status`.
    pub fn label(self) -> &'static str {
        match self {
            RingStat::Added => "added",
            RingStat::Completed => "completed",
            RingStat::Stored => "stored",
            RingStat::Duplicate => "duplicate",
            RingStat::Early => "early",
            RingStat::ToService => "to_service",
            RingStat::Stale => "stale",
            RingStat::Forged => "forged",
            RingStat::Malformed => "malformed",
            RingStat::NoRoute => "no_route",
            RingStat::Saturated => "saturated",
        }
    }
}
/// `AGGBOX_RING_STAT_MAX`.
pub const RING_STAT_MAX: u32 = 11;

/// `struct aggbox_ring_stats` (per-CPU value of `ring_stats`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RingStats {
    pub count: [u64; 16],
}
const _: () = assert!(core::mem::size_of::<RingStats>() == 128);

// SAFETY: repr(C), integers only, any bit pattern valid.
unsafe impl Plain for RingHdr {}
unsafe impl Plain for RingJob {}
unsafe impl Plain for RingCtrl {}
unsafe impl Plain for RingDone {}
unsafe impl Plain for RingStats {}

/// Field offsets of the ring structs (part of [`layout`]).
fn ring_layout(out: &mut Vec<(&'static str, &'static str, usize, usize)>) {
    fields!(out, "aggbox_ring_hdr", RingHdr, [magic, ring, kind, flags, round, frag, hops, count, sender, op, pad]);
    fields!(
        out,
        "aggbox_ring_job",
        RingJob,
        [id, port, members, me, frag_elems, frags, vector_len, base, weight_sum, weight, self_addr, next_addr]
    );
    fields!(out, "aggbox_ring_ctrl", RingCtrl, [ready_round, state, finals, finals_round, op, round_frags, pad]);
    fields!(out, "aggbox_ring_done", RingDone, [round_plus1, claimed_plus1, saturated_plus1, pad]);
    fields!(out, "aggbox_ring_stats", RingStats, [count]);
}
