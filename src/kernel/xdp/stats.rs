//! Reading the XDP program's counters back: outcomes and drop reasons,
//! hand-off reasons, per-job and fast-slot counters, slots and blocks in use.

use std::collections::BTreeMap;

use libbpf_rs::{MapCore, MapFlags};

use crate::kernel::maps::{self, names, Counter};
use crate::wire::abi;

use super::{lookup_plain, Result, XdpError, XdpPlane};

/// Snapshot of the `stats` map, summed over CPUs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Counters of the non-drop outcomes, keyed by their label.
    pub outcomes: BTreeMap<&'static str, Counter>,
    /// Counters of the drop reasons, keyed by their label.
    pub drops: BTreeMap<&'static str, Counter>,
}

impl Stats {
    /// Counter of one outcome.
    pub fn outcome(&self, outcome: abi::Outcome) -> Counter {
        self.outcomes
            .get(outcome.label())
            .copied()
            .unwrap_or_default()
    }

    /// Counter of one drop reason.
    pub fn drop(&self, reason: abi::DropReason) -> Counter {
        self.drops.get(reason.label()).copied().unwrap_or_default()
    }

    /// Packets of every drop reason together.
    pub fn dropped_packets(&self) -> u64 {
        self.drops.values().map(|c| c.packets).sum()
    }

    /// Packets of every outcome and drop reason together.
    pub fn total_packets(&self) -> u64 {
        self.outcomes.values().map(|c| c.packets).sum::<u64>() + self.dropped_packets()
    }
}

impl XdpPlane {
    /// Job `id`'s counters (`job_stats`) summed over CPUs; `None` when the
    /// job is not configured.
    pub fn job_stats(&self, id: u16) -> Result<Option<abi::JobStats>> {
        let Some(dense) = self.job_index(id)? else {
            return Ok(None);
        };
        maps::lookup_percpu_sum(&self.skel.maps.job_stats, &dense.to_ne_bytes()).map_err(|source| XdpError::Map {
            map: names::JOB_STATS,
            source,
        })
    }

    /// Fast slots holding an unfinished fragment (CLAIMING, ACTIVE or
    /// RESULTING: the `state` field at offset 4 of `struct
    /// aggbox_fast_slot`), all jobs.
    pub fn fast_slots_in_use(&self) -> usize {
        let map = &self.skel.maps.fast_slots;
        (0..abi::FAST_SLOTS)
            .filter(|index| {
                map.lookup(&index.to_ne_bytes(), MapFlags::ANY)
                    .ok()
                    .flatten()
                    .is_some_and(|v| {
                        let state = u16::from_ne_bytes([v[4], v[5]]);
                        (1..=3).contains(&state)
                    })
            })
            .count()
    }

    /// What the fast slots did, summed over CPUs, indexed by
    /// `abi::FAST_*` (joined, taken, busy, aborted, evicted).
    pub fn fast_stats(&self) -> Result<[u64; abi::FAST_STAT_MAX as usize]> {
        let mut out = [0u64; abi::FAST_STAT_MAX as usize];
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = maps::percpu_array_sum(&self.skel.maps.fast_stats, i as u32).map_err(|source| XdpError::Map {
                map: names::FAST_STATS,
                source,
            })?;
        }
        Ok(out)
    }

    /// Number of open fragments whose path is decided (all jobs): the
    /// `slot_owner` records of the hash-map path plus the unfinished fast
    /// slots (whose index is their decision), for tests and status.
    pub fn slot_owners_in_use(&self) -> usize {
        self.skel.maps.slot_owner.keys().count() + self.fast_slots_in_use()
    }

    /// Number of unfinished slots (all jobs, hash-map and fast), for tests
    /// and status.
    pub fn slots_in_use(&self) -> usize {
        self.skel.maps.slots.keys().count() + self.fast_slots_in_use()
    }

    /// Number of pool blocks (chunks of `abi::CHUNK_ELEMS` accumulators)
    /// that slots hold (all jobs; the kernel's `blocks_used` counter), for
    /// tests: a slot of `count` elements holds `ceil(count / CHUNK_ELEMS)`
    /// of them (docs/JUMBO.md).
    pub fn blocks_in_use(&self) -> Result<usize> {
        let used: Option<u64> = lookup_plain(&self.skel.maps.blocks_used, names::BLOCKS_USED, &0u32)?;
        Ok(used.unwrap_or(0) as usize)
    }

    /// Read the `stats` map and sum every counter over CPUs.
    pub fn stats(&self) -> Result<Stats> {
        let map = &self.skel.maps.stats;
        let mut stats = Stats::default();
        let read = |idx: u32| -> Result<Counter> {
            let sum: abi::Stat = maps::percpu_array_sum(map, idx).map_err(|source| XdpError::Map {
                map: names::STATS,
                source,
            })?;
            Ok(Counter::from(sum))
        };
        for outcome in abi::Outcome::ALL {
            stats
                .outcomes
                .insert(outcome.label(), read(outcome as u32)?);
        }
        for reason in abi::DropReason::ALL {
            stats
                .drops
                .insert(reason.label(), read(reason.stats_index())?);
        }
        Ok(stats)
    }

    /// Datagrams redirected to user space, by [`abi::HandoffReason`] label,
    /// summed over CPUs (their sum equals the `to_userspace` outcome).
    pub fn handoff_stats(&self) -> Result<BTreeMap<&'static str, Counter>> {
        let map = &self.skel.maps.handoff_stats;
        let mut out = BTreeMap::new();
        for reason in abi::HandoffReason::ALL {
            let sum: abi::Stat = maps::percpu_array_sum(map, reason as u32).map_err(|source| XdpError::Map {
                map: names::HANDOFF_STATS,
                source,
            })?;
            out.insert(reason.label(), Counter::from(sum));
        }
        Ok(out)
    }
}
