//! Fragmentation and in-order reassembly of vectors of any length.
//!
//! A vector is cut into fragments of [`elements_per_fragment`] elements
//! (`(mtu - 20 - 8 - 24) / 4`: IPv4, UDP and `AGG1` headers; 362 at MTU 1500);
//! fragment `i` starts at element `frag_off = i * per` and the last one carries
//! `LAST_FRAGMENT`. Broadcast data uses the same fragment size in bytes
//! (`4 * per`): its `AGB1` header (16) plus the runtime's 8-byte sub-header
//! ([`crate::wire::proto::RuntimeSubHeader`]: round, offset) is exactly as
//! long as an `AGG1` header.
//!
//! A [`Coverage`] records which fragments of the current call arrived, so
//! each is written into the output at its offset once; the caller's buffer is
//! complete, and in order, exactly when every fragment has arrived. It keeps its
//! allocation between calls.

// The fragment size rule is the wire's (the node sizes its jobs' frames by
// it too); re-exported here, where callers of the runtime look for it.
pub use crate::wire::proto::{blocks_per_fragment, elements_per_fragment, elements_per_fragment_in};

/// Packets one window of a kernel-backend job may put in the node's queues:
/// every worker's contributions and every copy of their RESULTs
/// ([`kernel_window`]).
pub const KERNEL_INFLIGHT_PACKETS: usize = 1280;

/// Bytes of those packets ([`kernel_window`]).
pub const KERNEL_INFLIGHT_BYTES: usize = 8 << 20;

/// RESULT copies one window may make when the TC result group fans each
/// RESULT out to every worker ([`kernel_window`]): the copies of a RESULT
/// enter the node's per-CPU backlog (1000 packets by default) at once, and
/// they are what overflowed it.
pub const KERNEL_INFLIGHT_COPIES: usize = 400;

/// Fragments a kernel-backend worker may have in flight: at most the
/// configured `window`, the job's `slots` (each fragment in flight is one
/// slot), the node's accumulator block pool (`abi::MAX_BLOCKS` = 8192
/// blocks of all jobs) divided by the blocks one fragment holds, so that
/// large frames cannot exhaust the pool, and what the node can queue: a
/// window of `w` fragments is `w · workers` contributions and `w ·
/// result_copies` RESULT datagrams (1 for a reduce, workers + 1 for an
/// allreduce through the TC result group), within
/// [`KERNEL_INFLIGHT_PACKETS`] and [`KERNEL_INFLIGHT_BYTES`], and with a
/// fan-out (more than one copy) `w · result_copies` within
/// [`KERNEL_INFLIGHT_COPIES`] (at least 4).
///
/// Why: the kernel reduces at a fixed rate, so datagrams in flight beyond
/// that only queue, in the node's per-CPU backlog (1000 packets by default)
/// where the TC copies of each RESULT queue too; when it overflows, RESULT
/// copies are lost and their retransmissions wait for timeouts, which costs
/// far more than the smaller window does. The windows measured with and
/// without losses are in docs/RUNTIME.md ("Windows"). At least 1.
pub fn kernel_window(
    window: usize,
    slots: usize,
    per: usize,
    workers: usize,
    result_copies: usize,
    datagram_bytes: usize,
) -> usize {
    let pool = crate::wire::abi::MAX_BLOCKS as usize / blocks_per_fragment(per);
    let packets = workers.max(1) + result_copies;
    let fan_out = if result_copies > 1 {
        KERNEL_INFLIGHT_COPIES / result_copies
    } else {
        usize::MAX
    };
    let queued = (KERNEL_INFLIGHT_PACKETS / packets)
        .min(KERNEL_INFLIGHT_BYTES / packets / datagram_bytes.max(1))
        .min(fan_out)
        .max(4);
    window.min(slots).min(pool).min(queued).max(1)
}

/// Bytes one sender may have in flight (unacknowledged datagrams), so that a
/// few senders' windows fit the receivers' 8 MiB socket buffers whatever the
/// datagram size.
pub const WINDOW_BYTES: usize = 2 << 20;

/// The window in datagrams of `datagram_bytes` each under [`WINDOW_BYTES`]:
/// `min(window, WINDOW_BYTES / datagram_bytes)`, at least 8 (and at most
/// `window`): no limit at MTU 1500 (1424 > 256), 233 at 9000, 32 at 65535.
pub fn byte_window(window: usize, datagram_bytes: usize) -> usize {
    window
        .min((WINDOW_BYTES / datagram_bytes.max(1)).max(8))
        .max(1)
}

/// Number of fragments of a vector of `len` elements, `per` each (0 for an
/// empty vector).
pub fn fragments(len: usize, per: usize) -> usize {
    len.div_ceil(per.max(1))
}

/// The element range of fragment `i`.
pub fn fragment_range(i: usize, len: usize, per: usize) -> std::ops::Range<usize> {
    let start = i * per;
    start.min(len)..(start + per).min(len)
}

/// Which fragments of a vector arrived (a reused bitset).
#[derive(Debug, Clone, Default)]
pub struct Coverage {
    bits: Vec<u64>,
    total: usize,
    have: usize,
    /// Every fragment below it arrived.
    first_missing: usize,
}

impl Coverage {
    /// Empty, no allocation.
    pub fn new() -> Coverage {
        Coverage::default()
    }

    /// Starts a call of `total` fragments, keeping the allocation.
    pub fn reset(&mut self, total: usize) {
        self.bits.clear();
        self.bits.resize(total.div_ceil(64), 0);
        self.total = total;
        self.have = 0;
        self.first_missing = 0;
    }

    /// Marks fragment `i`; true when it was new (and in range).
    pub fn insert(&mut self, i: usize) -> bool {
        if i >= self.total {
            return false;
        }
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.bits[w] & b != 0 {
            return false;
        }
        self.bits[w] |= b;
        self.have += 1;
        while self.first_missing < self.total && self.contains(self.first_missing) {
            self.first_missing += 1;
        }
        true
    }

    /// The lowest fragment index that has not arrived (`total` when every
    /// one has).
    pub fn first_missing(&self) -> usize {
        self.first_missing
    }

    /// Whether fragment `i` arrived.
    pub fn contains(&self, i: usize) -> bool {
        i < self.total && self.bits[i / 64] & (1u64 << (i % 64)) != 0
    }

    /// Fragments arrived.
    pub fn have(&self) -> usize {
        self.have
    }

    /// Fragments of the call.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Every fragment arrived.
    pub fn is_complete(&self) -> bool {
        self.have == self.total
    }

    /// The missing fragment indices.
    pub fn missing(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.total).filter(|&i| !self.contains(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::proto::elements_per_datagram;

    #[test]
    fn sizes() {
        assert_eq!(elements_per_datagram(1500), 362);
        assert_eq!(elements_per_datagram(9000), 2237);
        assert_eq!(elements_per_datagram(10), 1);
        assert_eq!(fragments(0, 362), 0);
        assert_eq!(fragments(362, 362), 1);
        assert_eq!(fragments(363, 362), 2);
        assert_eq!(fragment_range(1, 363, 362), 362..363);
        // AGB1 header + sub-header == AGG1 header: same datagram size.
        assert_eq!(
            crate::wire::abi::BCAST_HDR_LEN + crate::wire::proto::RuntimeSubHeader::LEN,
            crate::wire::abi::AGG_HDR_LEN
        );
    }

    #[test]
    fn jumbo_sizing_arithmetic() {
        // Elements per fragment: the MTU's, capped at the kernel's frame limit.
        assert_eq!(elements_per_fragment(1500), 362);
        assert_eq!(elements_per_fragment(9000), 2237);
        assert_eq!(elements_per_fragment(65535), 16370);
        assert!(elements_per_fragment(65535) <= crate::wire::abi::MAX_ELEMS as usize);
        assert_eq!(
            elements_per_fragment(200_000),
            crate::wire::abi::MAX_ELEMS as usize
        );
        // A fragment at the largest MTU fits one IPv4 datagram.
        assert!(28 + crate::wire::abi::AGG_HDR_LEN + 4 * elements_per_fragment(65535) <= 65535);
        // Blocks per slot: ceil(per / 256).
        assert_eq!(crate::wire::abi::CHUNK_ELEMS, 256);
        assert_eq!(crate::wire::abi::MAX_BLOCKS, 8192);
        assert_eq!(blocks_per_fragment(362), 2);
        assert_eq!(blocks_per_fragment(2237), 9);
        assert_eq!(blocks_per_fragment(16370), 64);
        assert_eq!(blocks_per_fragment(256), 1);
        assert_eq!(blocks_per_fragment(257), 2);
        // Kernel window: min(window, slots, 8192 / blocks, what the node
        // queues: 1280 packets and 8 MiB of contributions and RESULTs, and
        // 400 RESULT copies of a fan-out).
        let dgram = |per: usize| crate::wire::proto::IP_UDP_HDR + crate::wire::abi::AGG_HDR_LEN + 4 * per;
        assert_eq!(kernel_window(256, 1024, 362, 1, 1, dgram(362)), 256);
        assert_eq!(kernel_window(1024, 4096, 362, 1, 1, dgram(362)), 640);
        assert_eq!(kernel_window(1024, 4096, 2237, 1, 1, 1), 640);
        assert_eq!(kernel_window(1024, 4096, 4000, 1, 1, 1), 512);
        assert_eq!(kernel_window(1024, 4096, 8000, 1, 1, 1), 256);
        assert_eq!(kernel_window(256, 4096, 16370, 1, 1, 1), 128);
        assert_eq!(kernel_window(256, 64, 16370, 1, 1, 1), 64);
        assert_eq!(kernel_window(0, 0, 16370, 1, 1, 1), 1);
        // Four workers (the benchmark's), allreduce (5 copies of each RESULT):
        // 80 / 80 / 14 at 1500 / 9000 / 65535 (400 copies; 14: 8 MiB); reduce
        // (1 copy, no fan-out): 256 / 186 / 25.
        for (per, all, red) in [(362, 80, 256), (2237, 80, 186), (16370, 14, 25)] {
            assert_eq!(
                kernel_window(256, 1024, per, 4, 5, dgram(per)),
                all,
                "{per}"
            );
            assert_eq!(
                kernel_window(256, 1024, per, 4, 1, dgram(per)),
                red,
                "{per}"
            );
        }
        // Many workers: at least 4 each.
        assert_eq!(kernel_window(256, 1024, 16370, 64, 65, dgram(16370)), 4);
        for mtu in [576usize, 1500, 4000, 9000, 16000, 65535] {
            let per = elements_per_fragment(mtu);
            let w = kernel_window(1024, 4096, per, 1, 1, 1);
            assert!(
                w * blocks_per_fragment(per) <= crate::wire::abi::MAX_BLOCKS as usize,
                "MTU {mtu}: pool exhausted"
            );
        }
        // Byte budget of a window.
        assert_eq!(byte_window(256, 1500), 256);
        assert_eq!(byte_window(256, 9000), 233);
        assert_eq!(byte_window(256, 65535), 32);
        assert_eq!(byte_window(4, 65535), 4);
        assert_eq!(byte_window(256, 10 << 20), 8);
    }

    #[test]
    fn coverage() {
        let mut c = Coverage::new();
        c.reset(130);
        assert!(c.insert(129) && !c.insert(129) && !c.insert(130));
        assert_eq!(c.have(), 1);
        for i in 0..129 {
            c.insert(i);
        }
        assert!(c.is_complete());
        c.reset(3);
        assert_eq!(c.missing().collect::<Vec<_>>(), vec![0, 1, 2]);
        // The first missing one moves past what arrived in order.
        assert_eq!(c.first_missing(), 0);
        c.insert(1);
        assert_eq!(c.first_missing(), 0);
        c.insert(0);
        assert_eq!(c.first_missing(), 2);
        c.insert(2);
        assert_eq!(c.first_missing(), 3);
        assert!(c.is_complete());
    }
}
