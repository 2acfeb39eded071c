//! The maps the user-space path shares with the XDP program
//! ([`KernelMaps`]): AF_XDP sockets, slot ownership, completion, overload,
//! and the release of kernel slots of stale rounds.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use libbpf_rs::MapCore;

use crate::kernel::maps::{self, names};
use crate::wire::abi::{self, Round};

use super::fast_view::FastSlotView;
use super::{delete_ignore_missing, Result, TestRunner, XdpError, XdpPlane};

impl XdpPlane {
    /// Register the AF_XDP socket `xsk_fd` (bound to this interface's RX
    /// queue `queue`) in the `xsks` XSKMAP: from now on what the kernel
    /// hands to user space from that queue is redirected to it.
    pub fn register_xsk(&self, queue: u32, xsk_fd: RawFd) -> Result<()> {
        self.kernel_maps()?.register_xsk(queue, xsk_fd)
    }

    /// Set the longest frame (bytes) the XDP program redirects to the
    /// `xsks` sockets (`xsk_limits`; 0 = no limit). A longer frame keeps the
    /// fallback, as with no socket registered (docs/JUMBO.md).
    pub fn set_xsk_limit(&self, limit: u32) -> Result<()> {
        self.kernel_maps()?.set_xsk_limit(limit)
    }

    /// Remove queue `queue`'s socket from the `xsks` map (no-op if none).
    pub fn unregister_xsk(&self, queue: u32) -> Result<()> {
        delete_ignore_missing(&self.skel.maps.xsks, names::XSKS, &queue.to_ne_bytes())
    }

    /// Duplicated descriptors of the maps the user-space path shares with
    /// the XDP program (`Send + Sync`, usable from its threads).
    pub fn kernel_maps(&self) -> Result<KernelMaps> {
        let maps = &self.skel.maps;
        let dup = |fd: std::os::fd::BorrowedFd<'_>, map: &'static str| {
            fd.try_clone_to_owned().map_err(|e| XdpError::Map {
                map,
                source: libbpf_rs::Error::from(e),
            })
        };
        Ok(KernelMaps {
            xsks: dup(maps.xsks.as_fd(), names::XSKS)?,
            xsk_limits: dup(maps.xsk_limits.as_fd(), names::XSK_LIMITS)?,
            slot_owner: dup(maps.slot_owner.as_fd(), names::SLOT_OWNER)?,
            completed: dup(maps.completed.as_fd(), names::COMPLETED)?,
            job_state: dup(maps.job_state.as_fd(), names::JOB_STATE)?,
            job_handoff: dup(maps.job_handoff.as_fd(), names::JOB_HANDOFF)?,
            job_index: dup(maps.job_index.as_fd(), names::JOB_INDEX)?,
            jobs: dup(maps.jobs.as_fd(), names::JOBS)?,
            fast_slots: dup(maps.fast_slots.as_fd(), names::FAST_SLOTS)?,
            fast_slot_size: maps.fast_slots.value_size() as usize,
            fast_view: FastSlotView::map(maps.fast_slots.as_fd(), maps.fast_slots.value_size() as usize, abi::FAST_SLOTS),
            fast_discard: self
                .skel
                .progs
                .aggbox_fast_discard
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?,
            slots: dup(maps.slots.as_fd(), names::SLOTS)?,
            reclaim: self
                .skel
                .progs
                .aggbox_reclaim
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?,
        })
    }

    /// Release the kernel slot `key` with the `aggbox_reclaim` program (see
    /// [`Reclaim`]); `active_slots` of its job is given back atomically by
    /// the kernel.
    pub fn reclaim_slot(&self, key: &abi::SlotKey) -> Result<Reclaim> {
        self.kernel_maps()?.reclaim_slot(key)
    }

    /// Release every kernel slot whose round is stale (older than its job's
    /// newest completed round, of either path, minus the job's window):
    /// such a slot can never complete, since the stale-round rule drops all
    /// later contributions to it. Returns how many were released. The
    /// node's upkeep (src/node/upkeep.rs) calls the same thing periodically.
    pub fn reclaim_stale_slots(&self) -> Result<usize> {
        let maps = self.kernel_maps()?;
        let mut windows = BTreeMap::new();
        for (_, job) in self.jobs()? {
            windows.insert(job.id, job.window);
        }
        Ok(maps.reclaim_stale_slots(|job| windows.get(&job).copied()))
    }
}

/// The maps the user-space path shares with the XDP program, as duplicated
/// descriptors (`Send + Sync`): see [`XdpPlane::kernel_maps`]. The one
/// owner of the user-space side of the hand-off protocol (docs/USERSPACE.md):
/// sockets and their limit (`xsks`, `xsk_limits`), who owns a fragment
/// (`slot_owner`), completion ([`KernelMaps::release_completed`]: `completed`,
/// then `slot_owner`, then `job_handoff`), overload (`job_handoff`), and the
/// reclaim of kernel slots of stale rounds.
#[derive(Debug)]
pub struct KernelMaps {
    xsks: OwnedFd,
    xsk_limits: OwnedFd,
    slot_owner: OwnedFd,
    completed: OwnedFd,
    job_state: OwnedFd,
    job_handoff: OwnedFd,
    job_index: OwnedFd,
    jobs: OwnedFd,
    fast_slots: OwnedFd,
    fast_slot_size: usize,
    /// `fast_slots` mapped read-only (None where mmap failed: the scan then
    /// copies each value out with a syscall).
    fast_view: Option<FastSlotView>,
    fast_discard: OwnedFd,
    slots: OwnedFd,
    reclaim: OwnedFd,
}

fn raw_lookup<K: plain::Plain, V: plain::Plain + Default>(fd: &OwnedFd, key: &K) -> Option<V> {
    let mut value = V::default();
    // SAFETY: key/value point at live plain structs of the map's sizes.
    let rc = unsafe {
        libbpf_sys::bpf_map_lookup_elem(
            fd.as_raw_fd(),
            (key as *const K).cast(),
            (&mut value as *mut V).cast(),
        )
    };
    (rc == 0).then_some(value)
}

fn raw_update<K: plain::Plain, V: plain::Plain>(
    fd: &OwnedFd,
    map: &'static str,
    key: &K,
    value: &V,
    flags: u64,
) -> Result<()> {
    // SAFETY: key/value point at live plain structs of the map's sizes.
    let rc = unsafe {
        libbpf_sys::bpf_map_update_elem(
            fd.as_raw_fd(),
            (key as *const K).cast(),
            (value as *const V).cast(),
            flags,
        )
    };
    if rc < 0 {
        return Err(XdpError::Map {
            map,
            source: libbpf_rs::Error::from(std::io::Error::from_raw_os_error(-rc)),
        });
    }
    Ok(())
}

fn raw_delete<K: plain::Plain>(fd: &OwnedFd, key: &K) {
    // SAFETY: key points at a live plain struct of the map's key size.
    // ENOENT (already gone) is the only expected failure and is fine.
    unsafe {
        libbpf_sys::bpf_map_delete_elem(fd.as_raw_fd(), (key as *const K).cast());
    }
}

/// What [`XdpPlane::reclaim_slot`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reclaim {
    /// The slot was poisoned, deleted and its reservation given back.
    Reclaimed,
    /// No such slot (completed or reclaimed meanwhile).
    Absent,
    /// All its contributions are done: it is completing; left alone.
    Busy,
}

impl KernelMaps {
    /// Release kernel slot `key` (see [`XdpPlane::reclaim_slot`]).
    pub fn reclaim_slot(&self, key: &abi::SlotKey) -> Result<Reclaim> {
        let mut frame = [0u8; 14 + std::mem::size_of::<abi::SlotKey>()];
        frame[14..].copy_from_slice(abi::as_bytes(key));
        let runner = TestRunner {
            fd: self
                .reclaim
                .try_clone()
                .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?,
        };
        let (verdict, _) = runner.run(&frame)?;
        Ok(match verdict {
            2 => Reclaim::Reclaimed,
            1 => Reclaim::Absent,
            _ => Reclaim::Busy,
        })
    }

    /// Every key of the kernel's slot pool.
    pub fn slot_keys(&self) -> Vec<abi::SlotKey> {
        // The bound ends a walk that a concurrent delete sent back to the
        // first key.
        maps::raw_keys(self.slots.as_fd(), abi::MAX_SLOTS as usize + 1)
    }

    /// Every configured job's round window (`jobs` array; 0: the build
    /// default), for [`KernelMaps::reclaim_stale_slots`].
    pub fn job_windows(&self) -> BTreeMap<u16, u32> {
        (0..abi::MAX_JOBS)
            .filter_map(|dense| raw_lookup::<u32, abi::Job>(&self.jobs, &dense))
            .filter(|job| job.workers != 0)
            .map(|job| (job.id, job.window))
            .collect()
    }

    /// Release every kernel slot of a stale round. `window(job)` is the
    /// job's configured window (`None`: job unknown, its slots are left to
    /// `remove_job`; 0: the build default). A round is stale
    /// ([`Round::is_stale`], the rule the XDP program drops by) behind
    /// either path's newest completed round.
    pub fn reclaim_stale_slots(&self, window: impl Fn(u16) -> Option<u32>) -> usize {
        // Per job: its two paths' newest completed rounds and its window
        // (`None`: a job `window` does not know).
        type Newest = Option<(Option<Round>, Option<Round>, u32)>;
        let mut newest: BTreeMap<u16, Newest> = BTreeMap::new();
        self.release_open_slots(|job, round| {
            let entry = *newest.entry(job).or_insert_with(|| {
                let w = window(job)?;
                let (k, u) = self.newest_rounds(job);
                Some((k, u, w))
            });
            entry.is_some_and(|(k, u, w)| round.is_stale(k, w) || round.is_stale(u, w))
        })
    }

    /// Release every unfinished slot of job `id` whose round is after
    /// `newest` (every one with `None`): what an earlier run of the job
    /// left when its calls failed, before a new run starts after `newest`
    /// (the node's answer to a position query, src/node/serve/service.rs). Returns
    /// how many were released.
    pub fn release_rounds_after(&self, id: u16, newest: Option<Round>) -> usize {
        self.release_open_slots(|job, round| job == id && newest.is_none_or(|n| round.is_after(n)))
    }

    /// Release the unfinished kernel slots, hash-map and fast, whose (job,
    /// round) `pick` chooses; the kernel checks under each slot's lock that
    /// it still holds that round. Returns how many were released.
    fn release_open_slots(&self, mut pick: impl FnMut(u16, Round) -> bool) -> usize {
        let mut released = 0;
        for key in self.slot_keys() {
            if pick(key.job, Round(key.round)) && matches!(self.reclaim_slot(&key), Ok(Reclaim::Reclaimed)) {
                released += 1;
            }
        }
        // The fast slots (docs/DATAPLANE.md "Fast slots") of every job with
        // a region.
        for dense in 0..abi::MAX_JOBS {
            let Some(job) = raw_lookup::<u32, abi::Job>(&self.jobs, &dense) else { continue };
            if job.workers == 0 || job.fast_slots == 0 {
                continue;
            }
            let base = u32::from(job.fast_base);
            for index in base..base + u32::from(job.fast_slots) {
                let Some((state, slot_job, round)) = self.fast_slot_header(index) else { continue };
                // CLAIMING too: a take-over its taker could not undo (the
                // slot's lock busy past its bound) is undone here.
                if (state == FAST_ACTIVE || state == FAST_CLAIMING)
                    && slot_job == job.id
                    && pick(job.id, Round(round))
                    && matches!(self.discard_fast_slot(job.id, index, Some(round)), Ok(true))
                {
                    released += 1;
                }
            }
        }
        released
    }

    /// (state, job, round) of fast slot `index`: the first fields of
    /// `struct aggbox_fast_slot` after its 4-byte lock (src/bpf/slot.h).
    /// Read from the mapping (a racy snapshot, as a lookup's is: the kernel
    /// checks again under the slot's lock before it releases anything).
    fn fast_slot_header(&self, index: u32) -> Option<(u16, u16, u32)> {
        if let Some(view) = &self.fast_view {
            return view.header(index);
        }
        let value = self.fast_slot_value(index)?;
        Some((
            u16::from_ne_bytes([value[4], value[5]]),
            u16::from_ne_bytes([value[6], value[7]]),
            u32::from_ne_bytes([value[8], value[9], value[10], value[11]]),
        ))
    }

    /// (job, round, frag_off) of the fragment fast slot `index` holds or
    /// last held (`struct aggbox_fast_slot`'s key at offsets 6, 8 and 12),
    /// None past the array: where a fragment landed, for tests of the index.
    #[doc(hidden)]
    pub fn fast_slot_fragment(&self, index: u32) -> Option<(u16, u32, u32)> {
        let v = self.fast_slot_value(index)?;
        Some((
            u16::from_ne_bytes([v[6], v[7]]),
            u32::from_ne_bytes([v[8], v[9], v[10], v[11]]),
            u32::from_ne_bytes([v[12], v[13], v[14], v[15]]),
        ))
    }

    /// Fast slot `index`'s lock word (0 free, 1 held; src/bpf/slot.h).
    pub fn fast_slot_lock(&self, index: u32) -> Option<u32> {
        self.fast_slot_value(index).map(|v| u32::from_ne_bytes([v[0], v[1], v[2], v[3]]))
    }

    /// Write fast slot `index`'s lock word, as a holder that stalls would
    /// leave it: for tests of the kernel's bounded wait (slot_busy).
    /// Nothing else writes the word from user space.
    #[doc(hidden)]
    pub fn set_fast_slot_lock(&self, index: u32, word: u32) -> Result<()> {
        let mut value = self.fast_slot_value(index).ok_or(XdpError::FastSlotBusy { index })?;
        value[..4].copy_from_slice(&word.to_ne_bytes());
        // SAFETY: key is a live u32, value a buffer of the map's value size.
        let rc = unsafe {
            libbpf_sys::bpf_map_update_elem(
                self.fast_slots.as_raw_fd(),
                (&index as *const u32).cast(),
                value.as_ptr().cast(),
                0,
            )
        };
        if rc < 0 {
            return Err(XdpError::Map {
                map: names::FAST_SLOTS,
                source: libbpf_rs::Error::from(std::io::Error::from_raw_os_error(-rc)),
            });
        }
        Ok(())
    }

    fn fast_slot_value(&self, index: u32) -> Option<Vec<u8>> {
        let mut value = vec![0u8; self.fast_slot_size];
        // SAFETY: key is a live u32, value a buffer of the map's value size.
        let rc = unsafe {
            libbpf_sys::bpf_map_lookup_elem(
                self.fast_slots.as_raw_fd(),
                (&index as *const u32).cast(),
                value.as_mut_ptr().cast(),
            )
        };
        (rc == 0 && value.len() >= 12).then_some(value)
    }

    /// Release fast slot `index` of job `id` with `aggbox_fast_discard`:
    /// an unfinished fragment (its reservation given back) or a finished
    /// one; with `round`, only an unfinished fragment of that round.
    /// Returns whether an unfinished fragment was released.
    pub fn discard_fast_slot(&self, id: u16, index: u32, round: Option<u32>) -> Result<bool> {
        let mut frame = [0u8; 14 + 12];
        frame[14..16].copy_from_slice(&id.to_ne_bytes());
        frame[16..18].copy_from_slice(&u16::from(round.is_some()).to_ne_bytes());
        frame[18..22].copy_from_slice(&index.to_ne_bytes());
        frame[22..26].copy_from_slice(&round.unwrap_or(0).to_ne_bytes());
        let runner = TestRunner {
            fd: self
                .fast_discard
                .try_clone()
                .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?,
        };
        // XDP_TX: the slot's lock was busy past its bound (a holder
        // interrupted); such a wait is microseconds, so a few tries do.
        for _ in 0..FAST_DISCARD_TRIES {
            let (verdict, _) = runner.run(&frame)?;
            if verdict != XDP_TX {
                return Ok(verdict == 2);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Err(XdpError::FastSlotBusy { index })
    }

    /// Put AF_XDP socket `xsk_fd` into `xsks[queue]`.
    pub fn register_xsk(&self, queue: u32, xsk_fd: RawFd) -> Result<()> {
        raw_update(&self.xsks, names::XSKS, &queue, &(xsk_fd as u32), 0)
    }

    /// Write `xsk_limits[0]`: the longest frame redirected to the sockets
    /// (0 = no limit).
    pub fn set_xsk_limit(&self, limit: u32) -> Result<()> {
        raw_update(&self.xsk_limits, names::XSK_LIMITS, &0u32, &limit, 0)
    }

    /// Remove `xsks[queue]`.
    pub fn unregister_xsk(&self, queue: u32) {
        raw_delete(&self.xsks, &queue);
    }

    /// Which path owns slot `key` (`abi::OWNER_*`), if decided.
    pub fn slot_owner(&self, key: &abi::SlotKey) -> Option<u32> {
        raw_lookup::<_, abi::SlotOwner>(&self.slot_owner, key).map(|o| o.owner)
    }

    /// Forget who owns slot `key` (after its `completed` marker is written).
    pub fn delete_slot_owner(&self, key: &abi::SlotKey) {
        raw_delete(&self.slot_owner, key);
    }

    /// Every `slot_owner` entry.
    pub fn slot_owners(&self) -> Vec<(abi::SlotKey, u32)> {
        maps::raw_keys::<abi::SlotKey>(self.slot_owner.as_fd(), abi::MAX_OWNERS as usize + 1)
            .into_iter()
            .filter_map(|key| Some((key, self.slot_owner(&key)?)))
            .collect()
    }

    /// Publish a fragment the user-space path completed, in the kernel's
    /// release order: the `completed` marker of `recorded` (a fragment the
    /// kernel recorded in `slot_owner`), then the deletion of that record,
    /// so that no contribution can start a new slot for it on either path;
    /// then the job's newest round (`handoff`, when it advanced). Best
    /// effort, as in the kernel: a marker that cannot be written (the LRU
    /// is full of newer ones) leaves the stale-round rule to refuse late
    /// retransmissions.
    pub fn release_completed(&self, job: u16, recorded: Option<&abi::SlotKey>, handoff: Option<&abi::JobHandoff>) {
        if let Some(key) = recorded {
            let _ = self.mark_completed(key);
            self.delete_slot_owner(key);
        }
        if let Some(handoff) = handoff {
            let _ = self.set_job_handoff(job, handoff);
        }
    }

    /// Write the kernel's completed marker for `key`, so a late
    /// retransmission is never aggregated again by either path.
    pub fn mark_completed(&self, key: &abi::SlotKey) -> Result<()> {
        raw_update(&self.completed, names::COMPLETED, key, &1u32, 0)
    }

    /// Whether the kernel's completed marker for `key` exists.
    pub fn is_completed(&self, key: &abi::SlotKey) -> bool {
        raw_lookup::<_, u32>(&self.completed, key).is_some()
    }

    /// The kernel's runtime state of job `id`.
    pub fn job_state(&self, id: u16) -> Option<abi::JobState> {
        raw_lookup(&self.job_state, &self.dense(id)?)
    }

    /// Job `id`'s dense index (`job_index`), if configured.
    fn dense(&self, id: u16) -> Option<u32> {
        raw_lookup::<u32, u32>(&self.job_index, &u32::from(id))
            .filter(|&v| v != 0 && v <= abi::MAX_JOBS)
            .map(|v| v - 1)
    }

    /// The user-space path's state of job `id` as the kernel sees it.
    pub fn job_handoff(&self, id: u16) -> Option<abi::JobHandoff> {
        raw_lookup(&self.job_handoff, &self.dense(id)?)
    }

    /// The newest round job `id` completed in the kernel and in user space
    /// (`None`: none yet on that path), what [`Round::is_stale`] measures
    /// a slot's round against.
    fn newest_rounds(&self, id: u16) -> (Option<Round>, Option<Round>) {
        let kernel = self.job_state(id).filter(|s| s.completed != 0).map(|s| Round(s.newest_round));
        let user = self.job_handoff(id).filter(|h| h.completed != 0).map(|h| Round(h.newest_round));
        (kernel, user)
    }

    /// Write the user-space path's state of job `id` (an error when the job
    /// is not configured).
    pub fn set_job_handoff(&self, id: u16, value: &abi::JobHandoff) -> Result<()> {
        let dense = self.dense(id).ok_or(XdpError::InvalidJob {
            job: id,
            reason: "not configured".to_string(),
        })?;
        raw_update(&self.job_handoff, names::JOB_HANDOFF, &dense, value, 0)
    }

    /// Reset job `id`'s user-space state (overload off).
    pub fn delete_job_handoff(&self, id: u16) {
        if let Some(dense) = self.dense(id) {
            let _ = raw_update(&self.job_handoff, names::JOB_HANDOFF, &dense, &abi::JobHandoff::default(), 0);
        }
    }
}

/// `enum aggbox_fast_state` FAST_CLAIMING (src/bpf/slot.h): a fast slot
/// taken for a fragment whose taker is still checking the other paths.
const FAST_CLAIMING: u16 = 1;

/// `enum aggbox_fast_state` FAST_ACTIVE (src/bpf/slot.h): a fast slot
/// holding an unfinished fragment that contributions are added to.
const FAST_ACTIVE: u16 = 2;

/// The verdict of `aggbox_fast_discard` for a slot whose lock stayed held
/// past the kernel's spin bound.
const XDP_TX: u32 = 3;

/// Tries of `aggbox_fast_discard` on a busy slot, 1 ms apart.
pub(super) const FAST_DISCARD_TRIES: u32 = 100;
