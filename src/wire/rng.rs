//! SplitMix64: a small seeded generator for decisions that must repeat
//! from run to run (the runtime's impairments, simulated networks and
//! random inputs of tests). Not for anything secret. In `wire`, the lowest
//! layer, so that every layer's tests can use the one generator.

/// SplitMix64 state (the seed).
#[derive(Debug, Clone)]
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// True with probability `ppm` / 10^6.
    pub(crate) fn chance_ppm(&mut self, ppm: u64) -> bool {
        ppm > 0 && self.next() % 1_000_000 < ppm
    }

    /// A draw in `0..n` (n > 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
