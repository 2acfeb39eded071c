//! The `fast_slots` array mapped into memory: read-only for the stale-slot
//! scan ([`FastSlotView`]), writable to reset a region ([`FastSlotWriter`]).

use std::os::fd::{AsRawFd, BorrowedFd};

/// A shared mapping of the mmapable (`BPF_F_MMAPABLE`) `fast_slots` array,
/// unmapped when dropped.
struct Mapping {
    base: *mut u8,
    len: usize,
    /// Bytes from one value to the next.
    stride: usize,
    entries: u32,
}

impl Mapping {
    fn new(fd: BorrowedFd<'_>, value_size: usize, entries: u32, prot: libc::c_int, flags: libc::c_int) -> Option<Mapping> {
        // An mmapable array lays its values out from offset 0, each
        // rounded up to 8 bytes, the whole rounded up to a page.
        let stride = value_size.div_ceil(8) * 8;
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        let len = (stride * entries as usize).div_ceil(page) * page;
        // SAFETY: a fresh shared mapping of a map fd; checked below.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED | flags, fd.as_raw_fd(), 0) };
        if base == libc::MAP_FAILED {
            return None;
        }
        Some(Mapping { base: base.cast::<u8>(), len, stride, entries })
    }

    /// The start of value `index`, if there is one.
    fn value(&self, index: u32) -> Option<*mut u8> {
        // SAFETY: index < entries, so the value lies inside the mapping.
        (index < self.entries).then(|| unsafe { self.base.add(index as usize * self.stride) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`, of `len` bytes.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// The `fast_slots` array mapped read-only: the stale-slot scan reads a
/// slot's 12-byte header from memory, where a lookup would copy the whole
/// 3 KB value out through a syscall (4096 lookups per scan of the largest
/// region, every 100 ms: several % of a CPU under load).
pub(super) struct FastSlotView(Mapping);

// SAFETY: a read-only shared mapping, read with volatile loads only.
unsafe impl Send for FastSlotView {}
// SAFETY: as above; nothing is written through it.
unsafe impl Sync for FastSlotView {}

impl FastSlotView {
    pub(super) fn map(fd: BorrowedFd<'_>, value_size: usize, entries: u32) -> Option<Self> {
        Mapping::new(fd, value_size, entries, libc::PROT_READ, 0).map(FastSlotView)
    }

    pub(super) fn header(&self, index: u32) -> Option<(u16, u16, u32)> {
        let at = self.0.value(index)?;
        // SAFETY: the 12 bytes lie inside value `index`; the offsets are
        // those of struct aggbox_fast_slot (naturally aligned: every value
        // starts at a multiple of 8).
        unsafe {
            Some((
                std::ptr::read_volatile(at.add(4).cast::<u16>()),
                std::ptr::read_volatile(at.add(6).cast::<u16>()),
                std::ptr::read_volatile(at.add(8).cast::<u32>()),
            ))
        }
    }
}

impl std::fmt::Debug for FastSlotView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastSlotView").field("entries", &self.0.entries).field("stride", &self.0.stride).finish()
    }
}

/// The `fast_slots` array mapped writable (`MAP_POPULATE`, so the pages are
/// faulted in once, not at every reset), kept for the plane's life: the
/// control plane resets a region to EMPTY through it
/// ([`FastSlotWriter::reset_headers`]).
pub(super) struct FastSlotWriter(Mapping);

// SAFETY: a shared mapping written only by `reset_headers`, whose caller
// guarantees that no job points at the slots it writes.
unsafe impl Send for FastSlotWriter {}
// SAFETY: as above.
unsafe impl Sync for FastSlotWriter {}

impl FastSlotWriter {
    pub(super) fn map(fd: BorrowedFd<'_>, value_size: usize, entries: u32) -> Option<Self> {
        Mapping::new(fd, value_size, entries, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_POPULATE).map(FastSlotWriter)
    }

    /// Reset slots `base..base + n` to EMPTY: every field but the
    /// accumulators is zeroed (`header` bytes from the start of each
    /// value). The accumulators need not be: a slot's first contribution
    /// stores into them (or fills them with the op's identity) before
    /// anything reads them, and a RESULT reads only the fragment's own
    /// `count` of them. Zeroing whole 3 KB values through the syscall took
    /// a job's creation 2–3 ms at the largest region (13 MB); this writes
    /// 4096 headers. The caller guarantees that no job points at the slots.
    pub(super) fn reset_headers(&self, header: usize, base: u32, n: u32) -> bool {
        if header > self.0.stride || base.saturating_add(n) > self.0.entries {
            return false;
        }
        for index in base..base + n {
            let Some(at) = self.0.value(index) else { return false };
            // SAFETY: the header bytes lie inside value `index`.
            unsafe { std::ptr::write_bytes(at, 0, header) };
        }
        true
    }
}
