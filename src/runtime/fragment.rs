//! Fragmentation and in-order reassembly of vectors of any length.
//!
//! A vector is cut into fragments of [`elements_per_datagram`] elements
//! (`(mtu - 20 - 8 - 24) / 4`: IPv4, UDP and `AGG1` headers; 362 at MTU 1500);
//! fragment `i` starts at element `frag_off = i * per` and the last one carries
//! `LAST_FRAGMENT`. Broadcast data uses the same fragment size in bytes
//! (`4 * per`): its `AGB1` header (16) plus the runtime's 8-byte sub-header
//! (round, offset) is exactly as long as an `AGG1` header.
//!
//! A [`Coverage`] records which fragments of the current call arrived, so
//! each is written into the output at its offset once; the caller's buffer is
//! complete, and in order, exactly when every fragment has arrived. It keeps its
//! allocation between calls.

/// IPv4 (20) + UDP (8) header bytes.
pub const IP_UDP_HDR: usize = 28;

/// Bytes of the runtime sub-header at the start of every `AGB1` payload:
/// `round: u32` and `offset: u32` (bit 31 = OVERFLOW of a forwarded result).
pub const BCAST_SUBHDR: usize = 8;

/// Bit 31 of the sub-header offset: the forwarded result fragment was clamped.
pub const SUBHDR_OVERFLOW: u32 = 0x8000_0000;

/// Elements per `AGG1` datagram at `mtu`: `(mtu - 20 - 8 - 24) / 4`, capped at
/// 65535 (the `count` field), at least 1.
pub fn elements_per_datagram(mtu: usize) -> usize {
    (mtu.saturating_sub(IP_UDP_HDR + crate::abi::AGG_HDR_LEN) / 4).clamp(1, u16::MAX as usize)
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
        true
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
        assert_eq!(crate::abi::BCAST_HDR_LEN + BCAST_SUBHDR, crate::abi::AGG_HDR_LEN);
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
    }
}
