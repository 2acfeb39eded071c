//! Quantization of float32 vectors to int32 at the edge (`PROTOCOL.md`,
//! "Quantization"): `q = round_half_even(x * S)` clamped to int32; a SUM
//! result `r` turns back into `r / S` (or `r / (S * workers)` for a mean).
//!
//! Two modes ([`Quantization`]):
//! - [`Quantization::Fixed`]: a scale carried by configuration (default
//!   1e8, the paper's). A result with OVERFLOW makes the call fail with
//!   [`crate::runtime::CommError::Overflow`], or, with
//!   [`Quantization::FixedOrAdaptive`], rerun at the adaptive scale.
//! - [`Quantization::Adaptive`]: S is picked per call so the sum cannot
//!   overflow: the agreed scale is [`adaptive_scale`]`(m, workers)` of
//!   `m = max_r max_i |x_r[i]|`, the largest power of two with
//!   `workers * (m * S + 0.5) < 2^31`. A power of two makes `x * S` exact, so
//!   the only error is the final rounding. A reduce, and an allreduce longer
//!   than [`ONE_ROUND_MAX_LEN`], agree on `m` first with a one-element MAX
//!   allreduce of `m`'s float bits (the bit patterns of non-negative floats
//!   order like the floats, so an integer MAX is exact), then reduce: two
//!   rounds.
//!
//! One-round adaptive allreduce (up to [`ONE_ROUND_MAX_LEN`] elements): the
//! workers guess the scale instead of agreeing on it first. `adaptive_scale`
//! is a power of two that does not grow with `m`, so the agreed scale is the
//! smallest of the workers' own scales `adaptive_scale(m_r, workers)`. Each
//! worker quantizes at its guess (the scale agreed by the communicator's last
//! adaptive allreduce of the same length, [`AgreedScales`]; else its own
//! scale) and appends [`ScaleCheck`] elements, which the same int32 SUM adds
//! up: the count of workers, the guess's step `g` (`S = 2^(40 − g)`) and
//! `g²`, and a histogram of the workers' own steps, one digit per step, wide
//! enough for `workers`. From the sums every participant (the aggregator
//! application too, which contributes nothing) decides alike
//! ([`ScaleCheck::verdict`]): the agreed scale is the one of the largest step
//! in the histogram; `Σg = W·ḡ` and `Σg² = W·ḡ²` hold only when every worker
//! guessed `ḡ` (zero variance). When they all guessed the agreed scale the
//! values are the sum at it, bit for bit the two-round result: one round.
//! Otherwise (a first call with unequal maxima, a magnitude that jumped or
//! fell, a replaced worker) the call reduces again at the agreed scale the
//! histogram names: two rounds, as many as agreeing first. Only if the counts
//! do not add up (weights other than 1) does it agree on the scale and
//! reduce (three rounds).
//!
//! Error on realistic data (unit test `quantization_error_report`, 8 workers,
//! 100k elements each, relative to the f64 sum, adaptive scale):
//! normal(0, 1e-3) gradients: max abs error 2.1e-9 ≈ 0.5 · workers / S, mean
//! abs error 5e-10; Student-t(ν=2) heavy tails (max |x| ≈ 300): max abs error
//! 9e-7, which is still below 1 ulp of f32 at the result magnitudes of the
//! tail elements. The fixed default S = 1e8 overflows as soon as
//! `workers · max|x|` reaches 21.47, which heavy-tailed data does.

use std::collections::HashMap;
use std::mem::MaybeUninit;

/// The paper's default scale factor.
pub const DEFAULT_SCALE: f64 = 1e8;

/// How float vectors are turned into int32 contributions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Quantization {
    /// Fixed scale S; OVERFLOW in the result is an error.
    Fixed(f64),
    /// Fixed scale S; on OVERFLOW the call is rerun at the adaptive scale.
    FixedOrAdaptive(f64),
    /// Scale picked per call from the agreed max |x| and the worker count.
    Adaptive,
}

impl Default for Quantization {
    /// `Fixed(1e8)`.
    fn default() -> Self {
        Quantization::Fixed(DEFAULT_SCALE)
    }
}

/// Why floats could not be quantized.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum QuantizeError {
    /// NaN or infinity in the input.
    #[error("input holds NaN or infinity at element {0}")]
    NotFinite(usize),
    /// A scale that is not finite and positive.
    #[error("scale {0} is not a finite positive number")]
    BadScale(f64),
}

/// `round_half_even(x * scale)` clamped to int32, for every element, into
/// `out` (resized, allocation kept). Returns whether any element was clamped.
pub fn quantize_into(x: &[f32], scale: f64, out: &mut Vec<i32>) -> Result<bool, QuantizeError> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(QuantizeError::BadScale(scale));
    }
    check_finite(x)?;
    out.clear();
    out.reserve(x.len());
    let spare = &mut out.spare_capacity_mut()[..x.len()];
    let clamped = kernels::quantize(x, scale, spare, |q| q);
    // SAFETY: quantize wrote all x.len() elements after the (zero) length.
    unsafe { out.set_len(x.len()) };
    Ok(clamped)
}

/// `r / divisor` for every element into `out` (`divisor` = S for a sum,
/// S · workers for a mean); computed in f64, rounded once to f32.
pub fn dequantize_into(r: &[i32], divisor: f64, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(r) {
        *o = (v as f64 / divisor) as f32;
    }
}

/// `round_half_even(x * scale)` clamped to int32, appended big-endian to
/// `out` (a datagram being encoded): the quantization of one fragment
/// straight into its datagram buffer, with no int32 vector in between.
/// Non-finite values must have been rejected before ([`check_finite`] or
/// [`max_abs`]); here NaN becomes 0 and counts as clamped. Returns whether
/// any element was clamped.
pub fn quantize_be_into(x: &[f32], scale: f64, out: &mut Vec<u8>) -> bool {
    let start = out.len();
    out.reserve(4 * x.len());
    let spare = &mut out.spare_capacity_mut()[..4 * x.len()];
    // SAFETY: a [MaybeUninit<u8>; 4] has the size and alignment 1 of a
    // MaybeUninit<[u8; 4]>; the length is a whole number of them.
    let words: &mut [MaybeUninit<[u8; 4]>] =
        unsafe { std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast(), x.len()) };
    let clamped = kernels::quantize(x, scale, words, |q| q.to_be_bytes());
    // SAFETY: quantize wrote every one of the 4 · x.len() bytes after len.
    unsafe { out.set_len(start + 4 * x.len()) };
    clamped
}

/// `r / divisor` for big-endian int32s `be` (a datagram's payload) into
/// `out` (as many elements as both have): dequantization straight out of
/// the datagram buffer into the caller's vector.
pub fn dequantize_be_into(be: &[u8], divisor: f64, out: &mut [f32]) {
    // Dividing by a power of two is multiplying by its exact inverse (the
    // adaptive scales): the same result as `dequantize_into`, faster.
    let (m, e) = (divisor.abs(), divisor.abs().log2());
    if divisor.is_finite() && m > 0.0 && e.fract() == 0.0 && e.abs() < 1000.0 {
        let inv = 1.0 / divisor;
        for (o, b) in out.iter_mut().zip(be.chunks_exact(4)) {
            *o = (i32::from_be_bytes([b[0], b[1], b[2], b[3]]) as f64 * inv) as f32;
        }
    } else {
        for (o, b) in out.iter_mut().zip(be.chunks_exact(4)) {
            *o = (i32::from_be_bytes([b[0], b[1], b[2], b[3]]) as f64 / divisor) as f32;
        }
    }
}

/// The quantization loop, compiled for the baseline x86-64 (SSE2) and, where
/// the CPU has them, for AVX2 and AVX-512 (chosen once per call at run
/// time): `round_ties_even` has no SSE2 instruction, so the baseline build
/// called libm per element and ran at ~1/10 of memory bandwidth (`aggbox
/// bench edge`, docs/BENCHMARKS.md). Rounding here is the classic
/// add-and-subtract of 1.5 · 2^52, exact round-half-to-even for |v| < 2^51
/// under the default rounding mode, so every path vectorizes and all give
/// the same bits (`fast_quantization_matches_the_definition`).
mod kernels {
    use std::mem::MaybeUninit;

    /// 1.5 · 2^52: adding it leaves no fraction bits, so the FPU rounds the
    /// sum to an integer (half to even); subtracting it again is exact
    /// (for |v| < 2^51).
    const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;
    const MIN: f64 = i32::MIN as f64;
    const MAX: f64 = i32::MAX as f64;

    /// One element: the quantized value and whether it was clamped (NaN:
    /// 0, clamped).
    #[inline(always)]
    fn one(v: f32, scale: f64) -> (i32, bool) {
        // Beyond ±2^51 the sum is no longer exact, but rounding is monotonic:
        // a product outside int32 stays outside and is clamped all the same.
        // NaN stays NaN.
        let q = (v as f64 * scale + ROUND_MAGIC) - ROUND_MAGIC;
        let c = if q < MIN {
            MIN
        } else if q > MAX {
            MAX
        } else if !q.is_nan() {
            q
        } else {
            0.0
        };
        // SAFETY: c is an integer in the int32 range (never NaN).
        (unsafe { c.to_int_unchecked::<i32>() }, c != q)
    }

    #[inline(always)]
    fn body<T>(x: &[f32], scale: f64, out: &mut [MaybeUninit<T>], put: impl Fn(i32) -> T) -> bool {
        let mut clamped = 0u32;
        for (o, &v) in out.iter_mut().zip(x) {
            let (q, c) = one(v, scale);
            o.write(put(q));
            clamped |= c as u32;
        }
        clamped != 0
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn body_avx2<T>(x: &[f32], scale: f64, out: &mut [MaybeUninit<T>], put: impl Fn(i32) -> T) -> bool {
        body(x, scale, out, put)
    }

    /// The CPU has the AVX-512 subsets `body_avx512` is built for.
    #[cfg(target_arch = "x86_64")]
    fn has_avx512() -> bool {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512dq")
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    unsafe fn body_avx512<T>(x: &[f32], scale: f64, out: &mut [MaybeUninit<T>], put: impl Fn(i32) -> T) -> bool {
        body(x, scale, out, put)
    }

    /// Quantizes `x` into the first `x.len()` elements of `out` (which has
    /// at least that many) through `put`; returns whether any was clamped.
    pub fn quantize<T>(x: &[f32], scale: f64, out: &mut [MaybeUninit<T>], put: impl Fn(i32) -> T) -> bool {
        assert!(out.len() >= x.len());
        let out = &mut out[..x.len()];
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                // SAFETY: the CPU has the features the function was built for.
                return unsafe { body_avx512(x, scale, out, put) };
            }
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: as above.
                return unsafe { body_avx2(x, scale, out, put) };
            }
        }
        body(x, scale, out, put)
    }

    /// The definition, element by element (the oracle of the tests).
    #[cfg(test)]
    pub fn reference(v: f32, scale: f64) -> (i32, bool) {
        let q = (v as f64 * scale).round_ties_even();
        let c = q.clamp(MIN, MAX);
        (c as i32, c != q)
    }

    /// Every build of the loop this CPU can run, by name (for the tests).
    #[cfg(test)]
    #[allow(clippy::type_complexity)]
    pub fn variants() -> Vec<(&'static str, fn(&[f32], f64, &mut [MaybeUninit<i32>]) -> bool)> {
        let mut v: Vec<(&'static str, fn(&[f32], f64, &mut [MaybeUninit<i32>]) -> bool)> =
            vec![("baseline", |x, s, o| body(x, s, o, |q| q))];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                v.push(("avx2", |x, s, o| unsafe { body_avx2(x, s, o, |q| q) }));
            }
            if has_avx512() {
                // SAFETY: the CPU has these AVX-512 subsets.
                v.push(("avx512", |x, s, o| unsafe { body_avx512(x, s, o, |q| q) }));
            }
        }
        v
    }
}

/// The index of the first NaN or infinity, if any.
pub fn check_finite(x: &[f32]) -> Result<(), QuantizeError> {
    if x.iter().all(|v| v.is_finite()) {
        return Ok(());
    }
    Err(QuantizeError::NotFinite(
        x.iter().position(|v| !v.is_finite()).unwrap_or(0),
    ))
}

/// Largest |x| of a vector (0 for an empty one), or the index of a NaN or
/// infinity.
pub fn max_abs(x: &[f32]) -> Result<f32, QuantizeError> {
    // On the bits without the sign: non-negative floats order like their
    // bits, and every NaN or infinity is at least the infinity's. An integer
    // max with no early exit vectorizes (a float max, which must propagate
    // or ignore NaN, ran at 1/8 of memory speed).
    let m = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF));
    if m >= f32::INFINITY.to_bits() {
        check_finite(x)?;
    }
    Ok(f32::from_bits(m))
}

/// The adaptive scale: the largest power of two S (at most 2^40) with
/// `workers * (max_abs * S + 0.5) < 2^31`, so no sum of `workers` quantized
/// values can leave int32. 2^40 when every value is 0.
pub fn adaptive_scale(max_abs: f32, workers: u16) -> f64 {
    let w = workers.max(1) as f64;
    let limit = (2f64.powi(31) - 1.0) / w - 0.5;
    let m = max_abs as f64;
    if m <= 0.0 {
        return 2f64.powi(40);
    }
    let mut e = (limit / m).log2().floor() as i32;
    e = e.min(40);
    let mut s = 2f64.powi(e);
    while w * (m * s + 0.5) >= 2f64.powi(31) && e > -126 {
        e -= 1;
        s = 2f64.powi(e);
    }
    s
}

/// Longest vector (elements) an adaptive allreduce takes in one round (see
/// the module docs): its quantized values go through an int32 vector with
/// the [`ScaleCheck`] elements appended (a copy the two-round path, which
/// quantizes each fragment straight into its datagram, does not make). The
/// bound depends only on the length, so every participant decides alike.
pub const ONE_ROUND_MAX_LEN: usize = 16 * 1024;

/// The exponent of the largest adaptive scale (its cap, 2^40).
const TOP_EXPONENT: i32 = 40;
/// The exponent of the smallest adaptive scale (2^-126).
const BOTTOM_EXPONENT: i32 = -126;
/// Adaptive scales: `2^(TOP_EXPONENT − step)` for steps `0..SCALE_STEPS`.
pub const SCALE_STEPS: u32 = (TOP_EXPONENT - BOTTOM_EXPONENT + 1) as u32;

/// The step of an adaptive scale `S = 2^(40 − step)`: how many halvings
/// below the cap (0 ..= 166; a larger step is a smaller scale).
pub fn scale_step(scale: f64) -> u32 {
    let exponent = ((scale.to_bits() >> 52) & 0x7FF) as i32 - 1023;
    (TOP_EXPONENT - exponent).clamp(0, SCALE_STEPS as i32 - 1) as u32
}

/// The adaptive scale of a step (the bits [`adaptive_scale`] returns).
pub fn step_scale(step: u32) -> f64 {
    2f64.powi(TOP_EXPONENT - step as i32)
}

/// The check elements a worker appends to its quantized values in a
/// one-round adaptive allreduce, and what their SUM says (module docs),
/// for `workers` contributors. Layout, after the values:
/// `[1, g, g², histogram...]`, `g` the step of the worker's guess; the
/// histogram holds one digit of `bits` bits per step (`1` at the worker's own
/// step), `per_element` digits in each int32's low 31 bits, so no sum of
/// `workers` digits carries into the next digit or the sign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScaleCheck {
    workers: u16,
    bits: u32,
    per_element: u32,
}

/// What the summed [`ScaleCheck`] elements say.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleVerdict {
    /// Every worker quantized at the agreed scale: the summed values are the
    /// result at this scale.
    Agreed(f64),
    /// The agreed scale is this one, but not every worker quantized at it:
    /// reduce again at it.
    Redo(f64),
    /// The counts do not add up (a contributor that sent no checks, or
    /// weights other than 1): agree on the scale first.
    Unknown,
}

impl ScaleCheck {
    /// The checks of a sum over `workers` workers (at least 1).
    pub fn new(workers: u16) -> ScaleCheck {
        let workers = workers.max(1);
        let bits = u16::BITS - workers.leading_zeros();
        ScaleCheck {
            workers,
            bits,
            per_element: 31 / bits,
        }
    }

    /// Elements of the histogram.
    fn histogram_len(&self) -> usize {
        SCALE_STEPS.div_ceil(self.per_element) as usize
    }

    /// How many check elements follow the values.
    pub fn elements(&self) -> usize {
        3 + self.histogram_len()
    }

    /// A worker's contribution into `out` (resized, allocation kept): `x`
    /// quantized at `guess`, then the checks of `guess` and of the worker's
    /// own scale `own` (`adaptive_scale` of its max |x|, which the caller
    /// computed with [`max_abs`], so `x` is finite). Elements clamped at a
    /// guess above `own` are not flagged: the histogram makes that a
    /// [`ScaleVerdict::Redo`], whose values are not used.
    pub fn contribution(&self, x: &[f32], guess: f64, own: f64, out: &mut Vec<i32>) {
        out.clear();
        out.reserve(x.len() + self.elements());
        let spare = &mut out.spare_capacity_mut()[..x.len()];
        kernels::quantize(x, guess, spare, |q| q);
        // SAFETY: quantize wrote all x.len() elements after the (zero) length.
        unsafe { out.set_len(x.len()) };
        let g = scale_step(guess) as i32;
        out.extend_from_slice(&[1, g, g * g]);
        let start = out.len();
        out.resize(start + self.histogram_len(), 0);
        let s = scale_step(own);
        out[start + (s / self.per_element) as usize] |= 1 << (self.bits * (s % self.per_element));
    }

    /// What the summed checks say (`overflow`: the result's OVERFLOW flag),
    /// the same on every participant that has the sums.
    pub fn verdict(&self, sums: &[i32], overflow: bool) -> ScaleVerdict {
        let w = i64::from(self.workers);
        let [count, g, g2] = match sums {
            [a, b, c, ..] if sums.len() == self.elements() => [*a, *b, *c].map(i64::from),
            _ => return ScaleVerdict::Unknown,
        };
        if count != w {
            return ScaleVerdict::Unknown;
        }
        let mask = (1u32 << self.bits) - 1;
        let (mut counted, mut top) = (0i64, None);
        for step in 0..SCALE_STEPS {
            let e = sums[3 + (step / self.per_element) as usize] as u32;
            let n = (e >> (self.bits * (step % self.per_element))) & mask;
            if n > 0 {
                counted += i64::from(n);
                top = Some(step);
            }
        }
        let Some(top) = top.filter(|_| counted == w) else {
            return ScaleVerdict::Unknown;
        };
        let agreed = step_scale(top);
        // Σg = W·ḡ and Σg² = W·ḡ²: Σ(g − ḡ)² = 0, every worker guessed ḡ.
        let same_guess = g % w == 0 && g2 == w * (g / w) * (g / w);
        if same_guess && g / w == i64::from(top) && !overflow {
            ScaleVerdict::Agreed(agreed)
        } else {
            ScaleVerdict::Redo(agreed)
        }
    }
}

/// The scales agreed by a communicator's recent one-round-eligible adaptive
/// allreduces, by vector length: a worker's guess for the next call of that
/// length. Built only from agreed values, so every worker of a healthy run
/// holds the same; a worker whose differs (replaced, resumed) makes a call
/// take two rounds, never a wrong result. At most [`AgreedScales::LIMIT`]
/// lengths: a new one beyond that starts over (on every worker alike, since
/// they all see the same lengths).
#[derive(Debug, Default)]
pub struct AgreedScales {
    by_len: HashMap<usize, f64>,
}

impl AgreedScales {
    /// Most lengths remembered.
    pub const LIMIT: usize = 256;

    /// The scale agreed last for vectors of `len` elements.
    pub fn get(&self, len: usize) -> Option<f64> {
        self.by_len.get(&len).copied()
    }

    /// `scale` was agreed for a vector of `len` elements.
    pub fn record(&mut self, len: usize, scale: f64) {
        if self.by_len.len() >= Self::LIMIT && !self.by_len.contains_key(&len) {
            self.by_len.clear();
        }
        self.by_len.insert(len, scale);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small deterministic PRNG (xorshift64*), no extra dependency.
    struct Rng(u64);
    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn uniform(&mut self) -> f64 {
            ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f64 {
            let (u, v) = (self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        }
        /// Student-t with `nu` degrees of freedom (heavy tails).
        fn student_t(&mut self, nu: u32) -> f64 {
            let z = self.normal();
            let chi: f64 = (0..nu).map(|_| self.normal().powi(2)).sum();
            z / (chi / nu as f64).sqrt()
        }
    }

    fn sum_error(vectors: &[Vec<f32>], scale: f64) -> (f64, f64, bool) {
        let n = vectors[0].len();
        let mut q = Vec::new();
        let mut acc = vec![0i64; n];
        let mut clamped_any = false;
        for v in vectors {
            clamped_any |= quantize_into(v, scale, &mut q).unwrap();
            for (a, &x) in acc.iter_mut().zip(&q) {
                *a += x as i64;
            }
        }
        let overflow = clamped_any
            || acc
                .iter()
                .any(|&a| a > i32::MAX as i64 || a < i32::MIN as i64);
        let clamped: Vec<i32> = acc
            .iter()
            .map(|&a| a.clamp(i32::MIN as i64, i32::MAX as i64) as i32)
            .collect();
        let mut out = vec![0f32; n];
        dequantize_into(&clamped, scale, &mut out);
        let (mut max_err, mut sum_err) = (0f64, 0f64);
        for i in 0..n {
            let exact: f64 = vectors.iter().map(|v| v[i] as f64).sum();
            let e = (out[i] as f64 - exact).abs();
            max_err = max_err.max(e);
            sum_err += e;
        }
        (max_err, sum_err / n as f64, overflow)
    }

    #[test]
    fn round_half_even_and_clamp() {
        let mut q = Vec::new();
        assert!(!quantize_into(&[0.5, 1.5, 2.5, -0.5, -1.5], 1.0, &mut q).unwrap());
        assert_eq!(q, [0, 2, 2, 0, -2]);
        assert!(quantize_into(&[30.0, -30.0], 1e8, &mut q).unwrap());
        assert_eq!(q, [i32::MAX, i32::MIN]);
        assert_eq!(
            quantize_into(&[f32::NAN], 1.0, &mut q),
            Err(QuantizeError::NotFinite(0))
        );
        assert_eq!(
            quantize_into(&[1.0], 0.0, &mut q),
            Err(QuantizeError::BadScale(0.0))
        );
        let mut out = [0f32; 2];
        dequantize_into(&[300_000_000, -50_000_000], 1e8, &mut out);
        assert_eq!(out, [3.0, -0.5]);
    }

    /// Every build of the vectorized loop gives the bits of the definition
    /// (f64 product, round half to even, clamp) and the same clamped flag:
    /// ties at every magnitude, both signs, the int32 edges, products far
    /// beyond them, subnormals, NaN (0, clamped), then random floats at
    /// scales from 1 to 2^40 and 1e8.
    #[test]
    fn fast_quantization_matches_the_definition() {
        let mut edge: Vec<f32> = vec![
            0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997,
            f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1e-45, -1e-45, f32::MAX, f32::MIN,
            2147483520.0, 2147483648.0, -2147483648.0, -2147483904.0, 4294967296.0,
            -4294967296.0, 8.5e9, -8.5e9, 1e30, -1e30, f32::NAN,
        ];
        for e in 0..40 {
            let t = (1u64 << e) as f32 + 0.5;
            edge.extend([t, -t, t - 1.0, -(t - 1.0)]);
        }
        let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
        let mut random: Vec<f32> = (0..100_003)
            .map(|_| {
                let bits = rng.next_u64() as u32;
                let v = f32::from_bits(bits);
                if v.is_finite() {
                    v
                } else {
                    (rng.uniform() * 64.0 - 32.0) as f32
                }
            })
            .collect();
        random.extend((0..100_000).map(|_| (rng.normal() * 3e3) as f32));
        for (name, f) in kernels::variants() {
            for &scale in &[1.0, 0.5, 3.0, 1e8, 2f64.powi(20), 2f64.powi(40), 1e-3] {
                for x in [&edge[..], &random[..]] {
                    let mut out = vec![MaybeUninit::new(0i32); x.len()];
                    let clamped = f(x, scale, &mut out);
                    let mut want_clamped = false;
                    for (i, &v) in x.iter().enumerate() {
                        let (want, c) = kernels::reference(v, scale);
                        want_clamped |= c;
                        // SAFETY: f wrote every element.
                        let got = unsafe { out[i].assume_init() };
                        assert_eq!(got, want, "{name}: {v:e} · {scale:e}");
                    }
                    assert_eq!(clamped, want_clamped, "{name}: clamped flag at scale {scale:e}");
                }
            }
            // The flag is per call: a clean vector reports no clamping.
            let mut out = vec![MaybeUninit::new(0i32); 3];
            assert!(!f(&[1.0, -2.5, 0.25], 1e8, &mut out), "{name}");
        }
        // The entry points agree with the loop (big-endian bytes, i32s).
        let mut be = vec![7u8];
        assert!(quantize_be_into(&[2.5, -1e9, 3.25], 4.0, &mut be));
        assert_eq!(be[0], 7);
        assert_eq!(&be[1..5], &10i32.to_be_bytes());
        assert_eq!(&be[5..9], &i32::MIN.to_be_bytes());
        assert_eq!(&be[9..13], &13i32.to_be_bytes());
    }

    #[test]
    fn max_abs_is_the_largest_magnitude_or_the_first_non_finite() {
        assert_eq!(max_abs(&[]), Ok(0.0));
        assert_eq!(max_abs(&[-0.0, 0.0]).map(f32::to_bits), Ok(0));
        assert_eq!(max_abs(&[1.5, -3.25, 2.0, 1e-45]), Ok(3.25));
        assert_eq!(max_abs(&[f32::MIN, 1.0]), Ok(f32::MAX));
        assert_eq!(max_abs(&[1e-45, -1e-45]), Ok(1e-45));
        let mut v = vec![0.5f32; 1000];
        v[700] = -f32::INFINITY;
        v[900] = f32::NAN;
        assert_eq!(max_abs(&v), Err(QuantizeError::NotFinite(700)));
        v[700] = -7.0;
        assert_eq!(max_abs(&v), Err(QuantizeError::NotFinite(900)));
        v[900] = 6.0;
        assert_eq!(max_abs(&v), Ok(7.0));
    }

    #[test]
    fn adaptive_scale_never_overflows() {
        for &(m, w) in &[
            (1.0f32, 1u16),
            (1e-3, 8),
            (300.0, 8),
            (1e6, 256),
            (3.5, 7),
            (0.0, 4),
            (1e-30, 2),
        ] {
            let s = adaptive_scale(m, w);
            assert!(
                w as f64 * (m as f64 * s + 0.5) < 2f64.powi(31),
                "m {m} w {w} s {s}"
            );
            assert_eq!(s.log2().fract(), 0.0, "power of two");
            // and it is the largest such power of two (unless capped)
            if s < 2f64.powi(40) {
                assert!(w as f64 * (m as f64 * 2.0 * s + 0.5) >= 2f64.powi(31));
            }
        }
    }

    /// The one-round allreduce rests on these: `adaptive_scale` never grows
    /// with the max (so the agreed scale is the smallest of the workers'
    /// own), and its step fits the histogram and round-trips to the same
    /// bits, for every binade of f32 at both ends of the worker counts.
    #[test]
    fn adaptive_scale_does_not_grow_with_the_max_and_its_step_round_trips() {
        let mut ms: Vec<f32> = vec![0.0, f32::from_bits(1), f32::MAX];
        for e in -149..128 {
            let p = 2f64.powi(e);
            for f in [1.0, 1.0 + 2f64.powi(-23), 1.25, 1.5, 1.999_999_9] {
                let m = (p * f) as f32;
                if m.is_finite() {
                    ms.extend([m, f32::from_bits(m.to_bits().saturating_sub(1)), f32::from_bits(m.to_bits() + 1)]);
                }
            }
        }
        ms.retain(|m| m.is_finite());
        ms.sort_by(f32::total_cmp);
        for w in [1u16, 2, 3, 4, 7, 8, 100, 256, 4097, 65535] {
            let mut last = f64::INFINITY;
            for &m in &ms {
                let s = adaptive_scale(m, w);
                assert!(s <= last, "w {w}: scale grew from {last:e} to {s:e} at m {m:e}");
                last = s;
                let step = scale_step(s);
                assert!(step < SCALE_STEPS, "w {w} m {m:e}: step {step}");
                assert_eq!(step_scale(step).to_bits(), s.to_bits(), "w {w} m {m:e}");
            }
        }
    }

    /// The workers' contributions of a one-round allreduce summed as the
    /// aggregator sums them (int64, clamped to int32 with OVERFLOW); the
    /// verdict from the sums, and the values.
    fn one_round(xs: &[Vec<f32>], guesses: &[f64], workers: u16) -> (ScaleVerdict, Vec<i32>) {
        let check = ScaleCheck::new(workers);
        let len = xs[0].len();
        let mut acc = vec![0i64; len + check.elements()];
        let mut q = Vec::new();
        for (x, &guess) in xs.iter().zip(guesses) {
            let own = adaptive_scale(max_abs(x).unwrap(), workers);
            check.contribution(x, guess, own, &mut q);
            assert_eq!(q.len(), len + check.elements());
            for (a, &v) in acc.iter_mut().zip(&q) {
                *a += i64::from(v);
            }
        }
        for (i, &a) in acc[len..].iter().enumerate() {
            assert!((0..=i64::from(i32::MAX)).contains(&a), "check element {i} summed to {a}");
        }
        let overflow = acc.iter().any(|&a| a != a.clamp(i32::MIN.into(), i32::MAX.into()));
        let sums: Vec<i32> = acc.iter().map(|&a| a.clamp(i32::MIN.into(), i32::MAX.into()) as i32).collect();
        (check.verdict(&sums[len..], overflow), sums[..len].to_vec())
    }

    /// The two-round definition: the sum at `adaptive_scale` of the global max.
    fn agreed_sum(xs: &[Vec<f32>], workers: u16) -> (f64, Vec<i32>) {
        let m = xs.iter().map(|x| max_abs(x).unwrap()).fold(0f32, f32::max);
        let s = adaptive_scale(m, workers);
        let mut acc = vec![0i64; xs[0].len()];
        let mut q = Vec::new();
        for x in xs {
            assert!(!quantize_into(x, s, &mut q).unwrap());
            for (a, &v) in acc.iter_mut().zip(&q) {
                *a += i64::from(v);
            }
        }
        (s, acc.iter().map(|&a| i32::try_from(a).expect("the agreed scale keeps the sum in int32")).collect())
    }

    /// Every guess combination gives the agreed scale; `Agreed` exactly when
    /// every worker guessed it, and then the values are the two-round sum
    /// bit for bit: workers with equal and unequal maxima, guesses equal to
    /// the agreed scale, one worker's off, all of them too large or too
    /// small (the magnitude jumped or fell), guesses that differ, all zeros.
    #[test]
    fn scale_checks_name_the_agreed_scale_and_whether_every_worker_guessed_it() {
        let mut rng = Rng(0xA076_1D64_78BD_642F);
        for workers in [1u16, 2, 3, 4, 7, 8, 31, 64, 255, 1000] {
            for magnitudes in [[1.0f64, 1.0], [1.0, 3.0], [1e-3, 1e3], [0.0, 0.0], [1e30, 1e-30]] {
                let xs: Vec<Vec<f32>> = (0..workers as usize)
                    .map(|r| {
                        let mag = magnitudes[r % 2];
                        (0..37).map(|_| (rng.normal() * mag) as f32).collect()
                    })
                    .collect();
                let (agreed, want) = agreed_sum(&xs, workers);
                let own: Vec<f64> =
                    xs.iter().map(|x| adaptive_scale(max_abs(x).unwrap(), workers)).collect();
                let w = workers as usize;
                // Guesses beyond the scales' range stand for the nearest end.
                let cases: Vec<Vec<f64>> = vec![
                    vec![agreed; w],
                    vec![agreed * 2.0; w],
                    vec![agreed * 1024.0; w],
                    vec![agreed / 2.0; w],
                    vec![agreed / 2f64.powi(20); w],
                    (0..w).map(|r| if r == w - 1 { agreed / 2.0 } else { agreed }).collect(),
                    (0..w).map(|r| if r == 0 { agreed * 2.0 } else { agreed }).collect(),
                    own.clone(),
                ];
                for guesses in cases {
                    let guesses: Vec<f64> =
                        guesses.iter().map(|&g| step_scale(scale_step(g))).collect();
                    let hit = guesses.iter().all(|&g| g == agreed);
                    let (verdict, values) = one_round(&xs, &guesses, workers);
                    let what = format!("{workers} workers, magnitudes {magnitudes:?}, guesses {:?}", &guesses[..guesses.len().min(3)]);
                    if hit {
                        assert_eq!(verdict, ScaleVerdict::Agreed(agreed), "{what}");
                        assert_eq!(values, want, "{what}: the two-round sum");
                    } else {
                        assert_eq!(verdict, ScaleVerdict::Redo(agreed), "{what}");
                    }
                }
            }
        }
    }

    /// Sums that do not add up to one contribution per worker (a worker
    /// missing, weights other than 1, a garbled histogram) are `Unknown`.
    #[test]
    fn scale_checks_that_do_not_add_up_are_unknown() {
        let check = ScaleCheck::new(4);
        let x = vec![0.5f32; 3];
        let s = adaptive_scale(0.5, 4);
        let mut q = Vec::new();
        check.contribution(&x, s, s, &mut q);
        let one: Vec<i32> = q[3..].to_vec();
        let times = |k: i32| one.iter().map(|v| v * k).collect::<Vec<i32>>();
        assert_eq!(check.verdict(&times(4), false), ScaleVerdict::Agreed(s));
        assert_eq!(check.verdict(&times(3), false), ScaleVerdict::Unknown);
        assert_eq!(check.verdict(&times(5), false), ScaleVerdict::Unknown);
        assert_eq!(check.verdict(&times(4)[1..], false), ScaleVerdict::Unknown);
        let mut garbled = times(4);
        garbled[0] = 4;
        *garbled.last_mut().unwrap() += 1;
        assert_eq!(check.verdict(&garbled, false), ScaleVerdict::Unknown);
        // OVERFLOW in the result is never a one-round result.
        assert_eq!(check.verdict(&times(4), true), ScaleVerdict::Redo(s));
        // The largest worker count: every digit and Σg² still fit int32.
        let check = ScaleCheck::new(u16::MAX);
        assert_eq!(check.elements(), 3 + SCALE_STEPS as usize);
        let low = step_scale(SCALE_STEPS - 1);
        check.contribution(&[], low, low, &mut q);
        let sums: Vec<i32> = q.iter().map(|&v| i32::try_from(i64::from(v) * i64::from(u16::MAX)).unwrap()).collect();
        assert_eq!(check.verdict(&sums, false), ScaleVerdict::Agreed(low));
    }

    #[test]
    fn agreed_scales_are_kept_per_length_and_start_over_past_the_limit() {
        let mut a = AgreedScales::default();
        assert_eq!(a.get(10), None);
        a.record(10, 4.0);
        a.record(11, 8.0);
        a.record(10, 2.0);
        assert_eq!((a.get(10), a.get(11)), (Some(2.0), Some(8.0)));
        for len in 100..100 + AgreedScales::LIMIT - 2 {
            a.record(len, 1.0);
        }
        assert_eq!(a.get(10), Some(2.0), "at the limit");
        a.record(10, 0.5);
        assert_eq!(a.get(11), Some(8.0), "a known length replaces its scale");
        a.record(5, 1.0);
        assert_eq!((a.get(5), a.get(10), a.get(11)), (Some(1.0), None, None), "a new length past the limit starts over");
    }

    #[test]
    fn quantization_error_report() {
        let workers = 8usize;
        let n = 100_000;
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        // Gradient-like: normal(0, 1e-3).
        let normal: Vec<Vec<f32>> = (0..workers)
            .map(|_| (0..n).map(|_| (rng.normal() * 1e-3) as f32).collect())
            .collect();
        let m = normal
            .iter()
            .map(|v| max_abs(v).unwrap())
            .fold(0f32, f32::max);
        let s = adaptive_scale(m, workers as u16);
        let (max_e, mean_e, ovf) = sum_error(&normal, s);
        eprintln!("normal(0,1e-3): max|x| {m:e} S {s:e} max err {max_e:e} mean err {mean_e:e}");
        assert!(!ovf);
        assert!(max_e <= 0.5 * workers as f64 / s + 1e-9, "{max_e}");
        // Fixed 1e8 is fine for these small values too.
        let (max_f, _, ovf_f) = sum_error(&normal, DEFAULT_SCALE);
        eprintln!("normal(0,1e-3) fixed 1e8: max err {max_f:e}");
        assert!(!ovf_f && max_f < 1e-7);

        // Heavy tails: Student-t(2), unscaled (max |x| in the hundreds).
        let heavy: Vec<Vec<f32>> = (0..workers)
            .map(|_| (0..n).map(|_| rng.student_t(2) as f32).collect())
            .collect();
        let m = heavy
            .iter()
            .map(|v| max_abs(v).unwrap())
            .fold(0f32, f32::max);
        let s = adaptive_scale(m, workers as u16);
        let (max_e, mean_e, ovf) = sum_error(&heavy, s);
        eprintln!("student-t(2): max|x| {m:e} S {s:e} max err {max_e:e} mean err {mean_e:e}");
        assert!(!ovf);
        // quantization bound plus the final f32 rounding of results up to workers * m
        assert!(
            max_e <= 0.5 * workers as f64 / s + (m as f64 * workers as f64) * 2f64.powi(-24),
            "{max_e}"
        );
        // The fixed default overflows on them: that must be visible.
        let (_, _, ovf_f) = sum_error(&heavy, DEFAULT_SCALE);
        assert!(ovf_f, "fixed 1e8 on heavy tails should overflow");
    }
}
