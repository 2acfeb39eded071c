//! Jobs in the XDP maps: validating a job's configuration, writing it (ranks,
//! job entry, port, fast-slot region) and removing it, and reading the jobs
//! back, from this process or from pinned maps.

use std::net::IpAddr;

use libbpf_rs::{MapCore, MapFlags};

use crate::kernel::maps::{self, names};
use crate::wire::abi;

use super::{lookup_array, update_array, Reclaim, Result, XdpError, XdpPlane};

/// One aggregation job as the control plane configures it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XdpJob {
    /// Job id (the AGG1 `job` field).
    pub id: u16,
    /// UDP port the contributions arrive on.
    pub port: u16,
    /// Local UDP port RESULT datagrams are delivered to.
    pub result_port: u16,
    /// Source address of each rank; rank i sends from `ranks[i]`. All
    /// IPv4 or all IPv6 (a job's contributions come over one IP version);
    /// a contribution over the other version, or from another address, is
    /// `source_mismatch`. Its length is the number of workers
    /// (1..=[`abi::MAX_RANKS`]).
    pub ranks: Vec<IpAddr>,
    /// Weight of each rank for SUM/AVG; empty means all 1. Each weight must
    /// satisfy `|w| <= abi::MAX_WEIGHT` and the sum must be positive.
    pub weights: Vec<i32>,
    /// Vector length; `frag_off + count` beyond it is rejected. 0 = unbounded.
    pub vector_len: u32,
    /// Bound on outstanding slots of this job; 0 = the build's maximum.
    pub slots: u32,
    /// `abi::JOB_F_*` flags.
    pub flags: u32,
    /// Broadcast group RESULTs also go to, if any.
    pub result_group: Option<u16>,
    /// Rounds older than the newest completed round minus `window` are
    /// stale; 0 = the build's default (`abi::ROUND_WINDOW`).
    pub window: u32,
    /// Elements of a full fragment as the job's senders cut them (their
    /// path MTU's, `(MTU - 52) / 4`); 0 = unknown. The fast slots index a
    /// round in steps of it ([`fast_granule`]): a fragment of fewer
    /// elements may share its fast slot with its neighbour, and that one
    /// takes the hash-map chain (same results, more work).
    pub frag_elems: u32,
}

/// Elements of a round that share one fast-slot index for a job whose
/// senders cut fragments of `frag_elems` elements (0 = unknown): that size
/// where a fast slot holds it, so consecutive fragments take consecutive
/// slots; otherwise [`abi::FAST_GRANULE`], which gives every fragment of
/// 256..=[`abi::FAST_ELEMS`] elements its own.
pub fn fast_granule(frag_elems: u32) -> u16 {
    if (1..=abi::FAST_ELEMS).contains(&frag_elems) {
        frag_elems as u16
    } else {
        abi::FAST_GRANULE as u16
    }
}

impl XdpJob {
    /// The weight of each rank (defaults applied).
    pub fn effective_weights(&self) -> Vec<i32> {
        if self.weights.is_empty() {
            vec![1; self.ranks.len()]
        } else {
            self.weights.clone()
        }
    }

    /// The `ranks` map entries of the job, rank by rank.
    pub fn rank_entries(&self) -> Vec<abi::Rank> {
        self.ranks.iter().zip(self.effective_weights()).map(|(&addr, weight)| abi::Rank::new(addr, weight)).collect()
    }

    pub(crate) fn validate(&self) -> Result<abi::Job> {
        let bad = |reason: String| XdpError::InvalidJob {
            job: self.id,
            reason,
        };
        let workers = self.ranks.len();
        if workers == 0 || workers > abi::MAX_RANKS as usize {
            return Err(bad(format!(
                "{workers} ranks; a job has 1..={} ranks",
                abi::MAX_RANKS
            )));
        }
        if self.ranks.iter().any(|a| a.is_ipv4() != self.ranks[0].is_ipv4()) {
            return Err(bad("ranks of both IPv4 and IPv6; a job's ranks are all of one IP version".to_string()));
        }
        if !self.weights.is_empty() && self.weights.len() != workers {
            return Err(bad(format!(
                "{} weights for {workers} ranks",
                self.weights.len()
            )));
        }
        let weights = self.effective_weights();
        if let Some(w) = weights
            .iter()
            .find(|w| w.unsigned_abs() > abi::MAX_WEIGHT as u32)
        {
            return Err(bad(format!(
                "weight {w} outside -{max}..={max}",
                max = abi::MAX_WEIGHT
            )));
        }
        let sum: i64 = weights.iter().map(|&w| i64::from(w)).sum();
        if sum <= 0 {
            return Err(bad(format!(
                "weights sum to {sum}; the AVG divisor must be positive"
            )));
        }
        if self.port == 0 {
            return Err(bad("port 0".to_string()));
        }
        Ok(abi::Job {
            port: self.port,
            result_port: self.result_port,
            workers: workers as u16,
            result_group: self.result_group.unwrap_or(abi::NO_GROUP),
            vector_len: self.vector_len,
            slots: self.slots,
            flags: self.flags,
            weight_sum: sum as u32,
            window: self.window,
            fast_base: 0,
            fast_slots: 0,
            id: self.id,
            fast_granule: fast_granule(self.frag_elems),
            fast_stride: 0,
        })
    }
}

impl XdpPlane {
    /// Configure (or reconfigure) job `id`: writes its ranks, the job and its
    /// port. `id` must equal `job.id`.
    pub fn set_job(&self, id: u16, job: &XdpJob) -> Result<()> {
        if id != job.id {
            return Err(XdpError::InvalidJob {
                job: id,
                reason: format!("config carries id {}", job.id),
            });
        }
        let mut value = job.validate()?;
        value.id = id;
        let old = self.job(id)?;
        let dense = match self.job_index(id)? {
            Some(dense) => dense,
            None => self.free_job_index().ok_or_else(|| XdpError::InvalidJob {
                job: id,
                reason: format!("{} jobs are configured already (the most a node serves)", abi::MAX_JOBS),
            })?,
        };
        (value.fast_base, value.fast_slots, value.fast_stride, value.fast_granule) = self.fast_region(id, &value, old.as_ref())?;
        // The old membership (address and weight of each rank), to tell a
        // membership change from a reconfiguration that keeps it.
        let old_ranks: Vec<Option<abi::Rank>> = match &old {
            Some(o) => (0..o.workers).map(|rank| self.rank(id, rank)).collect::<Result<_>>()?,
            None => Vec::new(),
        };
        if old.is_none() {
            // A new job starts from zero state and counters at its index
            // (a reconfigured job keeps its slots and counters).
            self.zero_job_entries(dense)?;
        }

        // Ranks first, so that the job never points at missing ranks.
        let new_ranks = job.rank_entries();
        for (rank, rval) in new_ranks.iter().enumerate() {
            self.write_rank(dense, rank as u16, rval)?;
        }
        update_array(&self.skel.maps.jobs, names::JOBS, dense, &value)?;
        // Published last: a datagram finds the index only once its job,
        // ranks and state are in place.
        update_array(&self.skel.maps.job_index, names::JOB_INDEX, u32::from(id), &(dense + 1))?;

        match old {
            Some(old) if old.port == value.port => {}
            Some(old) => {
                self.port_add(value.port, 1)?;
                self.port_add(old.port, -1)?;
            }
            None => self.port_add(value.port, 1)?,
        }
        if let Some(old) = old {
            for rank in value.workers..old.workers {
                self.write_rank(dense, rank, &abi::Rank::default())?;
            }
            let new_ranks: Vec<Option<abi::Rank>> = new_ranks.into_iter().map(Some).collect();
            if new_ranks != old_ranks {
                // Membership changed: the rounds in flight hold contributions
                // (and rank bits, and a worker count) of the old membership.
                // Release them, so that none of it can complete or be mixed
                // into a round of the new membership.
                self.discard_job_slots(id)?;
                if old.fast_slots == value.fast_slots && old.fast_base == value.fast_base {
                    self.discard_fast_slots(id, value.fast_base, value.fast_slots)?;
                }
            }
        }
        Ok(())
    }

    /// Job `id`'s dense index (its entry in `jobs`, `ranks`, `job_state`,
    /// `job_handoff`, `job_stats`), if configured.
    pub(super) fn job_index(&self, id: u16) -> Result<Option<u32>> {
        Ok(lookup_array::<u32>(&self.skel.maps.job_index, names::JOB_INDEX, u32::from(id))?
            .filter(|&v| v != 0 && v <= abi::MAX_JOBS)
            .map(|v| v - 1))
    }

    /// The first dense index no configured job holds.
    fn free_job_index(&self) -> Option<u32> {
        let used: Vec<u32> = self.jobs().unwrap_or_default().into_iter().map(|(dense, _)| dense).collect();
        (0..abi::MAX_JOBS).find(|d| !used.contains(d))
    }

    /// Every configured job as (dense index, job), in dense order.
    pub fn jobs(&self) -> Result<Vec<(u32, abi::Job)>> {
        configured_jobs(&self.skel.maps.jobs)
    }

    fn write_rank(&self, dense: u32, rank: u16, value: &abi::Rank) -> Result<()> {
        update_array(&self.skel.maps.ranks, names::RANKS, dense * abi::MAX_RANKS + u32::from(rank), value)
    }

    /// Zero the state, user-space hand-off state, path flags and counters at
    /// `dense`.
    fn zero_job_entries(&self, dense: u32) -> Result<()> {
        update_array(&self.skel.maps.job_state, names::JOB_STATE, dense, &abi::JobState::default())?;
        update_array(&self.skel.maps.job_handoff, names::JOB_HANDOFF, dense, &abi::JobHandoff::default())?;
        update_array(&self.skel.maps.job_paths, names::JOB_PATHS, dense, &0u32)?;
        let zero_round = vec![0u8; self.skel.maps.job_round.value_size() as usize];
        self.skel
            .maps
            .job_round
            .update(&dense.to_ne_bytes(), &zero_round, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: names::JOB_ROUND,
                source,
            })?;
        let map = &self.skel.maps.job_stats;
        let ncpu = libbpf_rs::num_possible_cpus().map_err(|source| XdpError::Map {
            map: names::JOB_STATS,
            source,
        })?;
        let zero = abi::JobStats::default();
        let values: Vec<Vec<u8>> = (0..ncpu).map(|_| abi::as_bytes(&zero).to_vec()).collect();
        map.update_percpu(&dense.to_ne_bytes(), &values, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: names::JOB_STATS,
                source,
            })
    }

    fn rank(&self, id: u16, rank: u16) -> Result<Option<abi::Rank>> {
        let Some(dense) = self.job_index(id)? else {
            return Ok(None);
        };
        lookup_array(&self.skel.maps.ranks, names::RANKS, dense * abi::MAX_RANKS + u32::from(rank))
    }

    /// Release every kernel slot of job `id` that is not completing (with
    /// `aggbox_reclaim`, so `active_slots` stays exact); returns how many.
    pub fn discard_job_slots(&self, id: u16) -> Result<usize> {
        let maps = self.kernel_maps()?;
        let mut n = 0;
        for key in maps.slot_keys().into_iter().filter(|k| k.job == id) {
            if maps.reclaim_slot(&key)? == Reclaim::Reclaimed {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Remove job `id` (no-op if unknown).
    pub fn remove_job(&self, id: u16) -> Result<()> {
        let (Some(old), Some(dense)) = (self.job(id)?, self.job_index(id)?) else {
            return Ok(());
        };
        // Unpublished first: from here on its datagrams are unknown_job.
        update_array(&self.skel.maps.job_index, names::JOB_INDEX, u32::from(id), &0u32)?;
        // Its hash-map slots (released by the kernel, so blocks go back to
        // the pool) while job_state still counts them, then the rest.
        self.clear_job_slots(id)?;
        update_array(&self.skel.maps.jobs, names::JOBS, dense, &abi::Job::default())?;
        for rank in 0..old.workers {
            self.write_rank(dense, rank, &abi::Rank::default())?;
        }
        self.port_add(old.port, -1)?;
        self.zero_job_entries(dense)?;
        // Its fast slots: nothing of the job may outlive it there.
        if old.fast_slots > 0 {
            self.zero_fast_slots(u32::from(old.fast_base), u32::from(old.fast_slots))?;
        }
        Ok(())
    }

    /// The job as written in the `jobs` array, if configured.
    pub fn job(&self, id: u16) -> Result<Option<abi::Job>> {
        let Some(dense) = self.job_index(id)? else {
            return Ok(None);
        };
        Ok(lookup_array::<abi::Job>(&self.skel.maps.jobs, names::JOBS, dense)?.filter(|j| j.workers != 0 && j.id == id))
    }

    fn port_add(&self, port: u16, delta: i64) -> Result<()> {
        let map = &self.skel.maps.ports;
        let cur = lookup_array::<abi::Port>(map, names::PORTS, u32::from(port))?
            .map(|p| i64::from(p.jobs))
            .unwrap_or(0);
        let value = abi::Port {
            jobs: (cur + delta).max(0) as u32,
        };
        update_array(map, names::PORTS, u32::from(port), &value)
    }

    /// Drop the kernel's slots of a removed job: its hash-map slots (and
    /// their blocks) and its completed markers and ownership records.
    fn clear_job_slots(&self, id: u16) -> Result<()> {
        // The kernel releases the job's slots (and gives their blocks back
        // to the pool, which only the XDP programs do); a slot that is
        // completing is deleted by its completer. The loop below deletes
        // what is left by key.
        self.discard_job_slots(id)?;
        for (map, name) in [
            (&self.skel.maps.slots, names::SLOTS),
            (&self.skel.maps.completed, names::COMPLETED),
            (&self.skel.maps.slot_owner, names::SLOT_OWNER),
        ] {
            maps::delete_where::<abi::SlotKey>(map, |k| k.job == id).map_err(|source| XdpError::Map { map: name, source })?;
        }
        Ok(())
    }

    /// The kernel's runtime state of job `id` (slots in use, newest
    /// completed round, completions, next RESULT seq).
    pub fn job_state(&self, id: u16) -> Result<Option<abi::JobState>> {
        let Some(dense) = self.job_index(id)? else {
            return Ok(None);
        };
        lookup_array(&self.skel.maps.job_state, names::JOB_STATE, dense)
    }

    /// The fast-slot region job `id` gets (docs/DATAPLANE.md "Fast slots"):
    /// a reconfigured job keeps its region; a new one gets the first free,
    /// aligned region of the largest power of two at or above its slot
    /// bound (at most FAST_JOB_SLOTS) that fits, zeroed before the job
    /// points at it; (0, 0) when none is free or the job never aggregates
    /// in the kernel (user space only, or JOB_F_NO_FAST). Returns base,
    /// size, stride and granule (`job.fast_granule` for a new job).
    fn fast_region(&self, id: u16, job: &abi::Job, old: Option<&abi::Job>) -> Result<(u16, u16, u32, u16)> {
        // Rounds of a job with a vector length whose fragments a region
        // holds at once without collisions (workers of one job are within a
        // round or two of each other; a fragment that collides still takes
        // the chain, with every rule of that path).
        const FAST_ROUNDS_IN_FLIGHT: u32 = 8;
        if job.flags & (abi::JOB_F_USERSPACE_ONLY | abi::JOB_F_NO_FAST) != 0 {
            if let Some(old) = old.filter(|o| o.fast_slots > 0) {
                // Giving the region up: release what is in flight there.
                self.discard_fast_slots(id, old.fast_base, old.fast_slots)?;
            }
            return Ok((0, 0, 0, job.fast_granule));
        }
        let limit = if job.slots == 0 { abi::MAX_SLOTS } else { job.slots };
        // A fragment of granule..=FAST_ELEMS elements covers one or two
        // granules of its round's index sequence (one when the granule is
        // the job's fragment size): a region of the next power of two above
        // the bound holds the bound's fragments without collisions.
        let mut want = abi::FAST_JOB_SLOTS.min(limit.max(1).next_power_of_two());
        let stride = job.vector_len.div_ceil(u32::from(job.fast_granule));
        if stride > 0 {
            // With a vector length no more than what FAST_ROUNDS_IN_FLIGHT
            // rounds index, and what the window guarantee needs (a slot
            // remembers 18 fragments: 18 · size ≥ (window + 1) · stride):
            // a job of small vectors then cycles over a few hot slots, not
            // 4096 cold ones, and leaves the pool to other jobs.
            let window = if job.window == 0 { abi::ROUND_WINDOW } else { job.window };
            let rounds = FAST_ROUNDS_IN_FLIGHT.max((window + 1).div_ceil(18));
            want = want.min(rounds.saturating_mul(stride).next_power_of_two());
        }
        if let Some(old) = old {
            // A reconfigured job keeps its region and index function (and
            // the fragments in flight there): both were set when the job
            // was added, so a fragment's index never changes.
            return Ok((old.fast_base, old.fast_slots, old.fast_stride, old.fast_granule));
        }
        let mut taken: Vec<(u32, u32)> = Vec::new();
        for (_, other) in self.jobs()? {
            if other.id != id && other.fast_slots > 0 {
                let base = u32::from(other.fast_base);
                taken.push((base, base + u32::from(other.fast_slots)));
            }
        }
        let mut size = want;
        while size >= 1 {
            let mut base = 0;
            while base + size <= abi::FAST_SLOTS {
                if taken.iter().all(|&(lo, hi)| base + size <= lo || base >= hi) {
                    self.zero_fast_slots(base, size)?;
                    return Ok((base as u16, size as u16, stride, job.fast_granule));
                }
                base += size;
            }
            size /= 2;
        }
        Ok((0, 0, 0, job.fast_granule))
    }

    /// Reset fast slots `base..base + n` to EMPTY, lock word included
    /// (everything but the accumulators, see `FastSlotWriter::reset_headers`;
    /// whole values through the syscall where the map cannot be mapped
    /// writable). Only slots
    /// of no job are zeroed: a region before a job points at it, and a
    /// removed job's region after its job was unpublished (an XDP run
    /// that saw the job before that holds a slot for well under a
    /// millisecond, and a region is zeroed again before its next job).
    fn zero_fast_slots(&self, base: u32, n: u32) -> Result<()> {
        let map = &self.skel.maps.fast_slots;
        let size = map.value_size() as usize;
        // The accumulators are the value's tail (slot.h).
        let header = size.saturating_sub(8 * abi::FAST_ELEMS as usize);
        let writer = self
            .fast_writer
            .get_or_init(|| super::fast_view::FastSlotWriter::map(std::os::fd::AsFd::as_fd(map), size, abi::FAST_SLOTS));
        if writer.as_ref().is_some_and(|w| w.reset_headers(header, base, n)) {
            return Ok(());
        }
        let zero = vec![0u8; size];
        for index in base..base + n {
            map.update(&index.to_ne_bytes(), &zero, MapFlags::ANY)
                .map_err(|source| XdpError::Map {
                    map: names::FAST_SLOTS,
                    source,
                })?;
        }
        Ok(())
    }

    /// Release job `id`'s fast slots in `base..base + n` with the
    /// `aggbox_fast_discard` program (which gives `active_slots` back
    /// atomically); returns how many held an unfinished fragment.
    pub fn discard_fast_slots(&self, id: u16, base: u16, n: u16) -> Result<usize> {
        let maps = self.kernel_maps()?;
        let mut released = 0;
        for index in u32::from(base)..u32::from(base) + u32::from(n) {
            if maps.discard_fast_slot(id, index, None)? {
                released += 1;
            }
        }
        Ok(released)
    }
}

/// Every configured job of a pinned `jobs` array (what `aggbox status` and
/// the metrics read from another process) as (dense index, job): the dense
/// index is the key of the job's entries in `ranks` (times
/// `abi::MAX_RANKS`, plus the rank), `job_state` and `job_stats`.
pub fn pinned_jobs(jobs: &libbpf_rs::MapHandle) -> Result<Vec<(u32, abi::Job)>> {
    configured_jobs(jobs)
}

/// Every configured job of a `jobs` array, as (dense index, job).
fn configured_jobs(jobs: &impl MapCore) -> Result<Vec<(u32, abi::Job)>> {
    let mut out = Vec::new();
    for dense in 0..abi::MAX_JOBS {
        if let Some(job) = lookup_array::<abi::Job>(jobs, names::JOBS, dense)? {
            if job.workers != 0 {
                out.push((dense, job));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn job(ranks: Vec<IpAddr>) -> XdpJob {
        XdpJob {
            id: 1,
            port: 7000,
            result_port: 7001,
            ranks,
            ..XdpJob::default()
        }
    }

    #[test]
    fn a_jobs_ranks_are_of_one_ip_version() {
        let v4 = |i| IpAddr::V4(Ipv4Addr::new(10, 0, 0, i));
        let v6 = |i| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i));
        assert!(job(vec![v4(1), v4(2)]).validate().is_ok());
        assert!(job(vec![v6(1), v6(2)]).validate().is_ok());
        let err = job(vec![v4(1), v6(2)]).validate().unwrap_err().to_string();
        assert!(err.contains("IPv4 and IPv6"), "{err}");
        assert!(job(vec![v6(1), v4(2)]).validate().is_err());
        let entries = job(vec![v6(1), v6(2)]).rank_entries();
        assert_eq!(entries.iter().map(|r| (r.family, r.weight)).collect::<Vec<_>>(), [(abi::FAMILY_IPV6, 1); 2]);
        assert_eq!(entries[1].ip(), Some(v6(2)));
    }
}
