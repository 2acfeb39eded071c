//! The ring maps shared between the XDP ring program, the node's ring
//! service and the application's runtime (docs/RING.md "Memory shared with
//! the application"): `ring_data`, `ring_done` and `ring_ctrl` mapped into
//! this process (`BPF_F_MMAPABLE` arrays), seen as atomics since the
//! kernel and other processes write them at the same time; or plain heap
//! memory of the same layout, for tests without a kernel.
//!
//! It also holds the one rule both user-space writers of `ring_ctrl`
//! follow: how a call makes its round ready ([`RingMemory::begin_round`]),
//! and how a stored result is claimed and published
//! ([`RingMemory::claim_result`], [`RingMemory::publish_result`]); and
//! the counters the node's ring service pins for the runtime and
//! `aggbox status` ([`RingServiceStats`]).

use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

use libbpf_rs::{MapCore, MapFlags, MapHandle};

use crate::wire::map_names as names;
use crate::wire::abi::{self, Round, RingCtrl, RingJob};

/// A `struct aggbox_ring_ctrl` seen through atomics.
#[repr(C)]
#[derive(Debug)]
pub struct RingCtrlCell {
    /// The round whose input is in `ring_data` (the runtime writes it).
    pub ready_round: AtomicU32,
    /// [`abi::RING_READY`] once `ready_round`'s input is in place.
    pub state: AtomicU32,
    /// Fragments of `finals_round` stored here.
    pub finals: AtomicU32,
    /// The round `finals` counts.
    pub finals_round: AtomicU32,
    /// The round's op.
    pub op: AtomicU32,
    /// The round covers fragments `0..round_frags`; 0: every fragment.
    pub round_frags: AtomicU32,
    pad: [u32; 10],
}
const _: () = assert!(std::mem::size_of::<RingCtrlCell>() == std::mem::size_of::<RingCtrl>());
const _: () = assert!(std::mem::offset_of!(RingCtrlCell, ready_round) == std::mem::offset_of!(RingCtrl, ready_round));
const _: () = assert!(std::mem::offset_of!(RingCtrlCell, state) == std::mem::offset_of!(RingCtrl, state));
const _: () = assert!(std::mem::offset_of!(RingCtrlCell, finals) == std::mem::offset_of!(RingCtrl, finals));
const _: () = assert!(std::mem::offset_of!(RingCtrlCell, finals_round) == std::mem::offset_of!(RingCtrl, finals_round));
const _: () = assert!(std::mem::offset_of!(RingCtrlCell, op) == std::mem::offset_of!(RingCtrl, op));
const _: () = assert!(std::mem::offset_of!(RingCtrlCell, round_frags) == std::mem::offset_of!(RingCtrl, round_frags));

impl RingCtrlCell {
    /// The round whose input is ready, `None` while a call writes its input.
    pub fn ready(&self) -> Option<Round> {
        // Acquire: the input written before READY (release) is visible.
        (self.state.load(Ordering::Acquire) & abi::RING_READY != 0).then(|| Round(self.ready_round.load(Ordering::Relaxed)))
    }

    /// How many fragments (from 0) the ready round covers, of a ring of
    /// `frags`.
    pub fn round_frags(&self, frags: u32) -> u32 {
        match self.round_frags.load(Ordering::Relaxed) {
            0 => frags,
            n => n.min(frags),
        }
    }

    /// Count one more fragment of `round` stored here, if `finals` counts
    /// that round (release: the stored elements are visible to whoever
    /// sees the count).
    pub fn count_final(&self, round: Round) {
        if self.finals_round.load(Ordering::Acquire) == round.0 {
            self.finals.fetch_add(1, Ordering::Release);
        }
    }
}

/// Why the ring maps could not be mapped or read.
#[derive(Debug, thiserror::Error)]
pub enum RingMemoryError {
    /// A pinned map could not be opened or read.
    #[error("{}: {source}", path.display())]
    Map {
        /// The pinned map.
        path: PathBuf,
        /// What libbpf said.
        source: libbpf_rs::Error,
    },
    /// mmap failed.
    #[error("mapping {}: {source}", path.display())]
    Mmap {
        /// The pinned map.
        path: PathBuf,
        /// What the kernel said.
        source: std::io::Error,
    },
    /// A map's value size is not what the ABI says.
    #[error("{}: value size {found}, expected {expected}", path.display())]
    ValueSize {
        /// The pinned map.
        path: PathBuf,
        /// Its value size.
        found: u32,
        /// What it should be.
        expected: String,
    },
    /// The ring is not configured on this node.
    #[error("ring {0} is not configured on this node (ring_index has no entry; is `aggbox attach` running with its [[ring]]?)")]
    NoRing(u16),
    /// The ring's entry does not fit the mapped memory.
    #[error("ring {id}: entries {base}..+{taken} past ring_data's {entries} entries")]
    TooSmall {
        /// The ring.
        id: u16,
        /// Its first entry.
        base: u32,
        /// Its entries (two buffers of its fragments).
        taken: u32,
        /// Entries of ring_data.
        entries: u32,
    },
}

/// Name of the pinned map of [`RingServiceStats`] by ring id (`u32` key),
/// a user-space map of the attach process: `aggbox status` shows it, the
/// runtime reads `saturated` from it.
pub const SERVICE_STATS_MAP: &str = "ring_service";

/// Counters of one ring's service (src/node/ring.rs), in `/metrics` as `aggbox_ring_service_*`
/// and in `aggbox status`; the C layout is the pinned map's value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RingServiceStats {
    /// KICKs from the local runtime.
    pub kicks: u64,
    /// Rounds started here.
    pub rounds: u64,
    /// PARTIALs hops 1 sent as this member's own fragments' origin.
    pub originals_sent: u64,
    /// NACK datagrams sent.
    pub nacks_sent: u64,
    /// NACK datagrams received.
    pub nacks_received: u64,
    /// PARTIALs or FINALs resent to answer a NACK.
    pub resends: u64,
    /// PARTIALs held because their round was not ready here.
    pub early_held: u64,
    /// Early PARTIALs dropped (the hold was full, or their round never
    /// became the ready one).
    pub early_dropped: u64,
    /// Hops made in user space (PARTIALs added to, FINALs stored).
    pub user_hops: u64,
    /// Datagrams sent on to the next member after a user-space hop.
    pub forwarded: u64,
    /// FINALs or completions already stored (dropped).
    pub duplicates: u64,
    /// Fragments stored here whose result saturated (OVERFLOW).
    pub saturated: u64,
    /// Datagrams refused: malformed, another ring, forged source, stale.
    pub refused: u64,
}

// SAFETY: only u64 fields, no padding.
unsafe impl plain::Plain for RingServiceStats {}

impl RingServiceStats {
    /// Every counter: its name (`aggbox status`, and `/metrics` as
    /// `aggbox_ring_service_<name>_total`), what it counts, its value.
    pub fn counters(&self) -> [(&'static str, &'static str, u64); 13] {
        [
            ("kicks", "KICKs from the local runtime.", self.kicks),
            ("rounds", "Rounds the ring service started.", self.rounds),
            ("originals_sent", "PARTIALs hops 1 sent as the origin of this member's own fragments.", self.originals_sent),
            ("nacks_sent", "NACK datagrams sent (the round's finals stopped moving).", self.nacks_sent),
            ("nacks_received", "NACK datagrams received.", self.nacks_received),
            ("resends", "PARTIALs or FINALs resent to answer a NACK.", self.resends),
            ("early_held", "PARTIALs held because their round was not ready here.", self.early_held),
            ("early_dropped", "Early PARTIALs dropped (hold full, or their round never came).", self.early_dropped),
            ("user_hops", "Hops made in user space (PARTIALs added to, FINALs stored).", self.user_hops),
            ("forwarded", "Datagrams sent on to the next member after a user-space hop.", self.forwarded),
            ("duplicates", "FINALs or completions stored already (dropped).", self.duplicates),
            ("saturated", "Fragments stored here whose result saturated (OVERFLOW).", self.saturated),
            ("refused", "Datagrams refused: malformed, another ring, forged, stale, another op.", self.refused),
        ]
    }
}

/// One mapped or allocated array of map values.
#[derive(Debug)]
enum Region {
    /// An mmap of a pinned map: pointer and length in bytes.
    Mapped { ptr: NonNull<u8>, len: usize },
    /// Heap memory (tests), 8-byte aligned as the map's.
    Heap(Box<[AtomicU64]>),
}

impl Region {
    fn heap(bytes: usize) -> Region {
        Region::Heap((0..bytes.div_ceil(8)).map(|_| AtomicU64::new(0)).collect())
    }

    fn base(&self) -> *const u8 {
        match self {
            Region::Mapped { ptr, .. } => ptr.as_ptr(),
            Region::Heap(b) => b.as_ptr().cast(),
        }
    }

    fn map(path: &Path, fd: i32, bytes: usize) -> Result<Region, RingMemoryError> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let len = bytes.div_ceil(page) * page;
        // SAFETY: mapping a BPF_F_MMAPABLE array's fd, shared, at offset 0
        // for no more than its values' page-rounded size.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(RingMemoryError::Mmap { path: path.to_path_buf(), source: std::io::Error::last_os_error() });
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| RingMemoryError::Mmap {
            path: path.to_path_buf(),
            source: std::io::Error::other("mmap returned NULL"),
        })?;
        Ok(Region::Mapped { ptr, len })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Region::Mapped { ptr, len } = self {
            // SAFETY: the mapping made in Region::map, unmapped once.
            unsafe { libc::munmap(ptr.as_ptr().cast(), *len) };
        }
    }
}

/// `ring_data`, `ring_done` and `ring_ctrl` of a node, as atomics.
#[derive(Debug)]
pub struct RingMemory {
    data: Region,
    done: Region,
    ctrl: Region,
    frag_elems: u32,
    data_entries: u32,
    done_entries: u32,
}

// SAFETY: every access goes through atomics; the regions live as long as
// the value.
unsafe impl Send for RingMemory {}
// SAFETY: as above.
unsafe impl Sync for RingMemory {}

/// Size of a `ring_done` value.
const DONE_STRIDE: usize = std::mem::size_of::<abi::RingDone>();
/// Size of a `ring_ctrl` value.
const CTRL_STRIDE: usize = std::mem::size_of::<RingCtrl>();

impl RingMemory {
    /// Maps the node's pinned `ring_data`, `ring_done` and `ring_ctrl`
    /// from the attachment's pin directory `pin_dir`.
    pub fn open_pinned(pin_dir: &Path) -> Result<RingMemory, RingMemoryError> {
        let open = |name: &str| {
            let path = pin_dir.join(name);
            let map = MapHandle::from_pinned_path(&path).map_err(|source| RingMemoryError::Map { path: path.clone(), source })?;
            Ok::<_, RingMemoryError>((path, map))
        };
        let (data_path, data) = open(names::RING_DATA)?;
        let (done_path, done) = open(names::RING_DONE)?;
        let (ctrl_path, ctrl) = open(names::RING_CTRL)?;
        let vs = data.value_size();
        if vs == 0 || vs % 8 != 0 {
            return Err(RingMemoryError::ValueSize { path: data_path, found: vs, expected: "a multiple of 8".into() });
        }
        if done.value_size() as usize != DONE_STRIDE {
            return Err(RingMemoryError::ValueSize { path: done_path, found: done.value_size(), expected: DONE_STRIDE.to_string() });
        }
        if ctrl.value_size() as usize != CTRL_STRIDE {
            return Err(RingMemoryError::ValueSize { path: ctrl_path, found: ctrl.value_size(), expected: CTRL_STRIDE.to_string() });
        }
        // An mmapable array's values are round_up(value_size, 8) apart.
        let data_region = Region::map(&data_path, data.as_fd().as_raw_fd(), data.max_entries() as usize * vs as usize)?;
        let done_region = Region::map(&done_path, done.as_fd().as_raw_fd(), done.max_entries() as usize * DONE_STRIDE)?;
        let ctrl_region = Region::map(&ctrl_path, ctrl.as_fd().as_raw_fd(), ctrl.max_entries() as usize * CTRL_STRIDE)?;
        // The mappings keep the maps alive; the fds close with the handles.
        Ok(RingMemory {
            data: data_region,
            done: done_region,
            ctrl: ctrl_region,
            frag_elems: vs / 4,
            data_entries: data.max_entries(),
            done_entries: done.max_entries(),
        })
    }

    /// Heap memory of the same layout: `entries` fragments of `frag_elems`
    /// elements (and their done entries), [`abi::MAX_RINGS`] ctrl entries.
    pub fn heap(frag_elems: u32, entries: u32) -> RingMemory {
        RingMemory {
            data: Region::heap(entries as usize * frag_elems as usize * 4),
            done: Region::heap(entries as usize * DONE_STRIDE),
            ctrl: Region::heap(abi::MAX_RINGS as usize * CTRL_STRIDE),
            frag_elems,
            data_entries: entries,
            done_entries: entries,
        }
    }

    /// Elements of a `ring_data` value.
    pub fn frag_elems(&self) -> u32 {
        self.frag_elems
    }

    /// Entries of `ring_data` (two buffers of fragments a ring).
    pub fn entries(&self) -> u32 {
        self.data_entries.min(self.done_entries)
    }

    /// Whether `job`'s fragments fit the memory.
    pub fn check_job(&self, job: &RingJob) -> Result<(), RingMemoryError> {
        let fits = u64::from(job.base) + u64::from(job.entries()) <= u64::from(self.entries())
            && job.frag_elems == self.frag_elems
            && job.members >= 2;
        if fits {
            Ok(())
        } else {
            Err(RingMemoryError::TooSmall { id: job.id, base: job.base, taken: job.entries(), entries: self.entries() })
        }
    }

    /// The `ring_data` value `index` (`RingJob::index`): `frag_elems`
    /// elements. Panics past the map (callers index by a checked job).
    pub fn data(&self, index: u32) -> &[AtomicI32] {
        assert!(index < self.data_entries, "ring_data index {index} past {}", self.data_entries);
        let n = self.frag_elems as usize;
        // SAFETY: in bounds (checked above), 4-byte aligned (values are
        // 8-byte multiples from a page or an AtomicU64 array), and only
        // accessed atomically while the region lives.
        unsafe { std::slice::from_raw_parts(self.data.base().add(index as usize * n * 4).cast::<AtomicI32>(), n) }
    }

    /// `ring_done[index].round_plus1`: 1 + the round of the stored result.
    pub fn done(&self, index: u32) -> &AtomicU32 {
        self.done_field(index, std::mem::offset_of!(abi::RingDone, round_plus1))
    }

    /// `ring_done[index].claimed_plus1`: 1 + the round being (or last)
    /// stored.
    pub fn claimed(&self, index: u32) -> &AtomicU32 {
        self.done_field(index, std::mem::offset_of!(abi::RingDone, claimed_plus1))
    }

    /// `ring_done[index].saturated_plus1`: 1 + the round whose stored
    /// result saturated.
    pub fn saturated(&self, index: u32) -> &AtomicU32 {
        self.done_field(index, std::mem::offset_of!(abi::RingDone, saturated_plus1))
    }

    /// Whether `round`'s stored result of fragment `index` saturated (the
    /// same on every member: it travels with the FINAL).
    pub fn result_saturated(&self, index: u32, round: Round) -> bool {
        self.saturated(index).load(Ordering::Acquire) == round.0.wrapping_add(1)
    }

    fn done_field(&self, index: u32, offset: usize) -> &AtomicU32 {
        assert!(index < self.done_entries, "ring_done index {index} past {}", self.done_entries);
        // SAFETY: in bounds, a 4-byte field of an 8-byte aligned entry,
        // accessed atomically.
        unsafe { &*self.done.base().add(index as usize * DONE_STRIDE + offset).cast::<AtomicU32>() }
    }

    /// `ring_ctrl[dense]`.
    pub fn ctrl(&self, dense: u32) -> &RingCtrlCell {
        assert!(dense < abi::MAX_RINGS, "ring_ctrl index {dense}");
        // SAFETY: ring_ctrl has MAX_RINGS entries of 64 bytes; accessed
        // through atomics only (the pad is never touched).
        unsafe { &*self.ctrl.base().add(dense as usize * CTRL_STRIDE).cast::<RingCtrlCell>() }
    }

    /// Whether `ring_done[index]` holds `round`'s result (or a newer one).
    pub fn has_result(&self, index: u32, round: Round) -> bool {
        let d = self.done(index).load(Ordering::Acquire);
        d != 0 && !Round(d.wrapping_sub(1)).is_before(round)
    }

    /// Claims the right to store `round`'s result of fragment `index`
    /// (docs/RING.md "ring_done", the XDP program's `ring_claim`): a
    /// compare-and-swap of `claimed_plus1` to `1 + round` over anything
    /// older. False: it is stored, or being stored, already (a duplicate).
    pub fn claim_result(&self, index: u32, round: Round) -> bool {
        let claimed = self.claimed(index);
        let want = round.0.wrapping_add(1);
        let mut cur = claimed.load(Ordering::Acquire);
        loop {
            if cur == want || (cur != 0 && Round(cur.wrapping_sub(1)).is_after(round)) {
                return false;
            }
            match claimed.compare_exchange_weak(cur, want, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// After a claimed result's elements are written: `saturated_plus1`
    /// says whether it saturated, `round_plus1` that it is there, and the
    /// ring's `finals` counts it when it counts that round (the XDP
    /// program's `ring_publish`).
    pub fn publish_result(&self, dense: u32, index: u32, round: Round, saturated: bool) {
        if saturated {
            self.saturated(index).store(round.0.wrapping_add(1), Ordering::Release);
        }
        self.done(index).swap(round.0.wrapping_add(1), Ordering::AcqRel);
        self.ctrl(dense).count_final(round);
    }

    /// One call's step 1 (docs/RING.md "One call") for the ring at dense
    /// index `dense` whose fragments start at `base`: state 0, the input
    /// through `write` (given the memory), `finals = 0`, `finals_round`,
    /// `op`, `round_frags` (the round covers fragments `0..round_frags`, 0:
    /// all), `ready_round` and last `state = READY` with release order.
    pub fn begin_round(&self, dense: u32, round: Round, op: abi::Op, round_frags: u32, write: impl FnOnce(&RingMemory)) {
        let ctrl = self.ctrl(dense);
        ctrl.state.store(0, Ordering::SeqCst);
        write(self);
        ctrl.finals.store(0, Ordering::Relaxed);
        ctrl.finals_round.store(round.0, Ordering::Relaxed);
        ctrl.op.store(op as u32, Ordering::Relaxed);
        ctrl.round_frags.store(round_frags, Ordering::Relaxed);
        ctrl.ready_round.store(round.0, Ordering::Relaxed);
        ctrl.state.store(abi::RING_READY, Ordering::Release);
    }

    /// Writes `input` (host order) into the ring's fragments from `base` on.
    pub fn write_vector(&self, base: u32, input: &[i32]) {
        for (f, chunk) in input.chunks(self.frag_elems as usize).enumerate() {
            for (cell, &x) in self.data(base + f as u32).iter().zip(chunk) {
                cell.store(x, Ordering::Relaxed);
            }
        }
    }

    /// Reads the ring's fragments from `base` on into `out`.
    pub fn read_vector(&self, base: u32, out: &mut [i32]) {
        for (f, chunk) in out.chunks_mut(self.frag_elems as usize).enumerate() {
            for (x, cell) in chunk.iter_mut().zip(self.data(base + f as u32)) {
                *x = cell.load(Ordering::Relaxed);
            }
        }
    }
}

/// The dense index and `ring_jobs` entry of ring `id` on the node whose
/// maps are pinned in `pin_dir` (`ring_index`, then `ring_jobs`).
pub fn pinned_ring_job(pin_dir: &Path, id: u16) -> Result<(u32, RingJob), RingMemoryError> {
    let lookup = |name: &str, key: u32| -> Result<Option<Vec<u8>>, RingMemoryError> {
        let path = pin_dir.join(name);
        let map = MapHandle::from_pinned_path(&path).map_err(|source| RingMemoryError::Map { path: path.clone(), source })?;
        map.lookup(&key.to_ne_bytes(), MapFlags::ANY).map_err(|source| RingMemoryError::Map { path, source })
    };
    let slot = lookup(names::RING_INDEX, u32::from(id))?
        .and_then(|v| abi::from_bytes::<u32>(&v))
        .filter(|&s| s != 0)
        .ok_or(RingMemoryError::NoRing(id))?;
    let dense = slot - 1;
    let job = lookup(names::RING_JOBS, dense)?
        .and_then(|v| abi::from_bytes::<RingJob>(&v))
        .filter(|j| j.id == id && j.members >= 2)
        .ok_or(RingMemoryError::NoRing(id))?;
    Ok((dense, job))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_memory_has_the_map_layout() {
        let m = RingMemory::heap(4, 6);
        m.write_vector(2, &[1, 2, 3, 4, 5, 6]);
        let mut out = [0; 6];
        m.read_vector(2, &mut out);
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
        assert_eq!(m.data(3)[1].load(Ordering::Relaxed), 6);
        assert_eq!(m.data(4)[0].load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_result_is_claimed_once_per_round_and_never_over_a_newer_one() {
        let m = RingMemory::heap(2, 2);
        assert!(!m.has_result(0, Round(5)));
        assert!(m.claim_result(0, Round(5)));
        assert!(!m.claim_result(0, Round(5)));
        assert!(!m.has_result(0, Round(5)), "claimed, not stored yet");
        m.publish_result(0, 0, Round(5), false);
        assert!(m.has_result(0, Round(5)));
        assert!(!m.claim_result(0, Round(4)));
        assert!(m.claim_result(0, Round(6)));
        // Round u32::MAX stores 0 + ... wraps: 1 + round = 0 would read
        // "none"; the next claim of it succeeds again, which is harmless.
        assert!(m.claim_result(1, Round(u32::MAX - 1)));
        m.publish_result(0, 1, Round(u32::MAX - 1), true);
        assert!(m.result_saturated(1, Round(u32::MAX - 1)) && !m.result_saturated(0, Round(5)));
        assert!(m.has_result(1, Round(u32::MAX - 1)));
    }

    #[test]
    fn begin_round_makes_the_round_ready_last() {
        let m = RingMemory::heap(2, 4);
        let ctrl = m.ctrl(3);
        ctrl.finals.store(9, Ordering::Relaxed);
        m.begin_round(3, Round(8), abi::Op::Max, 0, |mem| {
            assert_eq!(mem.ctrl(3).ready(), None);
            mem.write_vector(0, &[1, 2, 3]);
        });
        assert_eq!(ctrl.ready(), Some(Round(8)));
        assert_eq!(ctrl.finals.load(Ordering::Relaxed), 0);
        assert_eq!(ctrl.op.load(Ordering::Relaxed), abi::Op::Max as u32);
        ctrl.count_final(Round(8));
        ctrl.count_final(Round(7));
        assert_eq!(ctrl.finals.load(Ordering::Relaxed), 1);
    }
}
