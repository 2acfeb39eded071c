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

pub const RESULT_RANK: u16 = 0xffff;

pub const BCAST_F_FORWARD: u8 = 0x01;
pub const BCAST_F_KNOWN: u8 = 0x01;

pub const ACK_KIND_AGG: u8 = 0;
pub const ACK_KIND_BCAST: u8 = 1;
pub const ACK_F_FINAL: u8 = 0x01;
pub const ACK_F_KNOWN: u8 = 0x01;
pub const ACK_MAX_BITS: u16 = 1024;

pub const AGG_HDR_LEN: usize = 24;
pub const BCAST_HDR_LEN: usize = 16;
pub const ACK_HDR_LEN: usize = 16;

pub const MAX_JOBS: u32 = 256;
pub const MAX_RANKS: u32 = 256;

pub const JOB_F_USERSPACE_ONLY: u32 = 0x01;
pub const JOB_F_HAS_PARENT: u32 = 0x02;
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
}

impl DropReason {
    pub const ALL: [DropReason; 17] = [
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
}

impl Outcome {
    pub const ALL: [Outcome; 5] = [
        Outcome::NotAggbox,
        Outcome::Accepted,
        Outcome::Result,
        Outcome::ToUserspace,
        Outcome::OtherAggbox,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::NotAggbox => "not_aggbox",
            Outcome::Accepted => "accepted",
            Outcome::Result => "result",
            Outcome::ToUserspace => "to_userspace",
            Outcome::OtherAggbox => "other_aggbox",
        }
    }
}

pub const OUTCOME_COUNT_OK: u32 = 5;
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
}
const _: () = assert!(core::mem::size_of::<Job>() == 24);

/// `struct aggbox_rank_key` (host order).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RankKey {
    pub job: u16,
    pub rank: u16,
}
const _: () = assert!(core::mem::size_of::<RankKey>() == 4);

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

/// Elements one slot holds (`AGGBOX_MAX_ELEMS`).
pub const MAX_ELEMS: u32 = 384;
/// Elements one program of the tail-call chain processes (`AGGBOX_CHUNK_ELEMS`).
pub const CHUNK_ELEMS: u32 = 32;
/// Slots of all jobs together (`AGGBOX_MAX_SLOTS`).
pub const MAX_SLOTS: u32 = 4096;
/// Completed-slot markers kept (`AGGBOX_MAX_COMPLETED`).
pub const MAX_COMPLETED: u32 = 65536;
/// Rounds older than the newest completed round minus this are stale.
pub const ROUND_WINDOW: u32 = 64;

/// `enum aggbox_call`: index of each program in the tail-call prog array.
pub const CALL_SLOT: u32 = 0;
/// See [`CALL_SLOT`].
pub const CALL_ADD: u32 = 1;
/// See [`CALL_SLOT`].
pub const CALL_RESULT: u32 = 2;
/// Size of the prog array.
pub const CALL_MAX: u32 = 3;

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
    pub active_slots: u32,
    pub newest_round: u32,
    pub completed: u32,
    pub result_seq: u32,
}
const _: () = assert!(core::mem::size_of::<JobState>() == 16);

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

/// Field offsets of every mirrored struct, `(struct, field, offset, size)`,
/// compared with the C header by `tests/abi_layout.rs`.
pub fn layout() -> Vec<(&'static str, &'static str, usize, usize)> {
    macro_rules! fields {
        ($out:ident, $cname:literal, $ty:ty, [$($f:ident),*]) => {
            $out.push(($cname, "sizeof", 0, core::mem::size_of::<$ty>()));
            $(
                $out.push(($cname, stringify!($f), core::mem::offset_of!($ty, $f),
                    size_of_field(|s: &$ty| &s.$f)));
            )*
        };
    }
    fn size_of_field<S, F>(_: impl Fn(&S) -> &F) -> usize {
        core::mem::size_of::<F>()
    }
    let mut out = Vec::new();
    fields!(out, "aggbox_agg_hdr", AggHdr, [magic, job, rank, seq, round, frag_off, op, flags, count]);
    fields!(out, "aggbox_bcast_hdr", BcastHdr, [magic, mask, seq, group, flags, hops]);
    fields!(out, "aggbox_ack_hdr", AckHdr, [magic, id, rank, base_seq, nbits, kind, flags]);
    fields!(out, "aggbox_stat", Stat, [packets, bytes]);
    fields!(out, "aggbox_job_key", JobKey, [job, pad]);
    fields!(out, "aggbox_job", Job, [port, result_port, workers, result_group, vector_len, slots, flags, weight_sum]);
    fields!(out, "aggbox_rank_key", RankKey, [job, rank]);
    fields!(out, "aggbox_rank", Rank, [addr, weight]);
    fields!(out, "aggbox_port_key", PortKey, [port, pad]);
    fields!(out, "aggbox_port", Port, [jobs]);
    fields!(out, "aggbox_slot_key", SlotKey, [job, pad, round, frag_off]);
    fields!(out, "aggbox_job_state", JobState, [active_slots, newest_round, completed, result_seq]);
    out
}
