//! Slot-level model of one aggregator job, used by the vector tests.
//!
//! It follows `PROTOCOL.md` "Semantics at the aggregator" literally and uses
//! the library for everything a real aggregator would share with it: decode
//! and validation (`aggbox::wire::proto`), arithmetic (`aggbox::wire::reducer`), RESULT
//! encoding. It is deliberately simple (no stale-round window, no slot bound):
//! the real user-space aggregator lives elsewhere.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::net::Ipv4Addr;

use aggbox::wire::abi::{self, DropReason};
use aggbox::wire::proto::{self, AggHeader, ProtoError};
use aggbox::wire::reducer::{Accumulator, ReduceError};

/// The control plane's view of one job.
#[derive(Debug, Clone)]
pub struct JobConfig {
    pub id: u16,
    pub workers: u16,
    pub rank_ips: Vec<Ipv4Addr>,
    pub weights: Vec<i32>,
    /// 0 = unbounded.
    pub vector_len: u32,
}

/// Why the model dropped a datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    Decode(ProtoError),
    UnknownJob(u16),
    RankOutOfRange {
        rank: u16,
        workers: u16,
    },
    SourceMismatch {
        rank: u16,
        src: Ipv4Addr,
    },
    BeyondVector {
        frag_off: u32,
        count: u16,
        vector_len: u32,
    },
    Retransmission,
    SlotMismatch,
    Reduce(ReduceError),
}

impl Reject {
    /// The counter this drop goes to (None: not AggBox, passed on).
    pub fn drop_reason(&self) -> Option<DropReason> {
        match self {
            Reject::Decode(e) => e.drop_reason(),
            Reject::UnknownJob(_) => Some(DropReason::UnknownJob),
            Reject::RankOutOfRange { .. } => Some(DropReason::RankOutOfRange),
            Reject::SourceMismatch { .. } => Some(DropReason::SourceMismatch),
            Reject::BeyondVector { .. } => Some(DropReason::BeyondVector),
            Reject::Retransmission => Some(DropReason::Retransmission),
            Reject::SlotMismatch | Reject::Reduce(_) => Some(DropReason::SlotMismatch),
        }
    }
}

/// What happened to one datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Valid, absorbed into its slot.
    Accepted,
    /// Valid and completed its slot: the RESULT datagram emitted.
    Completed(Vec<u8>),
    /// Dropped, nothing changed.
    Rejected(Reject),
}

struct Slot {
    contributed: Vec<bool>,
    remaining: u16,
    acc: Accumulator,
    last_fragment: bool,
}

/// One job's slots, keyed by (job, round, frag_off).
pub struct Aggregator {
    job: JobConfig,
    slots: HashMap<(u16, u32, u32), Slot>,
    result_seq: u32,
}

impl Aggregator {
    pub fn new(job: JobConfig) -> Aggregator {
        Aggregator {
            job,
            slots: HashMap::new(),
            result_seq: 0,
        }
    }

    /// Validates and applies one contribution received from `src`.
    pub fn receive(&mut self, src: Ipv4Addr, datagram: &[u8]) -> Verdict {
        match self.try_receive(src, datagram) {
            Ok(v) => v,
            Err(r) => Verdict::Rejected(r),
        }
    }

    fn try_receive(&mut self, src: Ipv4Addr, datagram: &[u8]) -> Result<Verdict, Reject> {
        let (hdr, payload) = proto::split_agg(datagram).map_err(Reject::Decode)?;
        let job = &self.job;
        if hdr.job != job.id {
            return Err(Reject::UnknownJob(hdr.job));
        }
        if hdr.rank >= job.workers {
            return Err(Reject::RankOutOfRange {
                rank: hdr.rank,
                workers: job.workers,
            });
        }
        if job.rank_ips.get(hdr.rank as usize) != Some(&src) {
            return Err(Reject::SourceMismatch {
                rank: hdr.rank,
                src,
            });
        }
        if job.vector_len != 0 && hdr.frag_off as u64 + hdr.count as u64 > job.vector_len as u64 {
            return Err(Reject::BeyondVector {
                frag_off: hdr.frag_off,
                count: hdr.count,
                vector_len: job.vector_len,
            });
        }
        let weight = job.weights.get(hdr.rank as usize).copied().unwrap_or(1);
        let workers = job.workers;
        let key = (hdr.job, hdr.round.0, hdr.frag_off);
        let slot = match self.slots.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let acc = Accumulator::new(hdr.op, hdr.count as usize, hdr.is_float())
                    .map_err(Reject::Reduce)?;
                e.insert(Slot {
                    contributed: vec![false; workers as usize],
                    remaining: workers,
                    acc,
                    last_fragment: false,
                })
            }
        };
        // Dedup first: a retransmission is acknowledged again whatever else.
        if slot.contributed[hdr.rank as usize] {
            return Err(Reject::Retransmission);
        }
        if slot.acc.op() != hdr.op
            || slot.acc.count() != hdr.count as usize
            || slot.acc.is_float() != hdr.is_float()
        {
            return Err(Reject::SlotMismatch);
        }
        slot.acc
            .add_be_bytes(payload, weight)
            .map_err(Reject::Reduce)?;
        slot.contributed[hdr.rank as usize] = true;
        slot.remaining -= 1;
        slot.last_fragment |= hdr.is_last_fragment();
        if slot.remaining > 0 {
            return Ok(Verdict::Accepted);
        }
        // Complete: exactly once, because every rank is now marked and any
        // further contribution is a retransmission.
        let result = slot.acc.finish().map_err(Reject::Reduce)?;
        let mut flags = abi::AGG_F_RESULT | result.flags();
        if slot.last_fragment {
            flags |= abi::AGG_F_LAST_FRAGMENT;
        }
        let out_hdr = AggHeader {
            job: hdr.job,
            rank: abi::RESULT_RANK,
            seq: self.result_seq,
            round: hdr.round,
            frag_off: hdr.frag_off,
            op: hdr.op,
            flags,
            count: hdr.count,
        };
        self.result_seq = self.result_seq.wrapping_add(1);
        let mut out = Vec::with_capacity(out_hdr.datagram_len());
        proto::write_agg_header(&out_hdr, &mut out);
        result.write_be(&mut out);
        Ok(Verdict::Completed(out))
    }
}
