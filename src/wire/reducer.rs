//! The reference reducer: every AGG1 op of the op table
//! (`include/aggbox/ops.def`) with `PROTOCOL.md`'s exact semantics, in pure
//! Rust.
//!
//! It is the oracle the kernel path is tested against and the arithmetic core
//! of the user-space path and the socket baseline. Contributions arrive one at
//! a time, so the API is an incremental [`Accumulator`]: create one per slot,
//! [`Accumulator::add_be_bytes`] each contribution straight from the datagram,
//! [`Accumulator::finish`] when every rank has contributed.
//!
//! Integer semantics: accumulation is exact (i64, promoted to i128 when the
//! weights could make i64 overflow; PROD keeps a saturating i64 that preserves
//! the sign of the true product), then every element is clamped once to the
//! int32 range and [`ReduceResult::overflow`] says whether any was clamped.
//! Float semantics: SUM, AVG and PROD in f64 rounded once to f32; MAX/MIN
//! exact (NaN only wins when every contribution is NaN, as `f32::max`);
//! COUNT is a float; the ops not [`Op::valid_on_floats`] (BAND/BOR/BXOR,
//! LAND/LOR) are rejected.
//!
//! Speed: each op has its own tight loop over the elements (no per-element
//! `match`), written over a generic element source so the same loop serves
//! host-order slices and big-endian wire bytes and autovectorizes for both.
//! An int op with no loop of its own (LAND, LOR: a new row of the table) is
//! the table's [`Op::combine`] over int32 accumulators seeded with its
//! [`Op::identity`].

use crate::wire::abi::{self, Op};

/// Why a reduction could not be done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReduceError {
    /// An op not valid on floats (BAND/BOR/BXOR, LAND/LOR) on float32 data.
    #[error("op {} is invalid on FLOAT32 payloads", .0.name())]
    FloatBitwise(Op),
    /// A contribution's length differs from the slot's element count.
    #[error("contribution of {found} elements, slot has {expected}")]
    LengthMismatch {
        /// Elements of the slot.
        expected: usize,
        /// Elements (or bytes / 4) in the contribution.
        found: usize,
    },
    /// A big-endian contribution's byte length is not a multiple of 4.
    #[error("payload of {0} bytes is not a whole number of elements")]
    RaggedPayload(usize),
    /// Int data added to a float accumulator or the reverse.
    #[error("contribution type (int/float) differs from the accumulator's")]
    TypeMismatch,
    /// AVG with a weight sum of 0.
    #[error("AVG with weight sum 0")]
    ZeroWeightSum,
    /// `finish` on an accumulator nobody contributed to.
    #[error("no contributions")]
    NoContributions,
}

/// Result elements of a reduction.
#[derive(Debug, Clone, PartialEq)]
pub enum ReduceValues {
    /// int32 result.
    Int(Vec<i32>),
    /// float32 result.
    Float(Vec<f32>),
}

/// A finished reduction: the elements and whether any was clamped.
#[derive(Debug, Clone, PartialEq)]
pub struct ReduceResult {
    /// The result elements.
    pub values: ReduceValues,
    /// Some integer element left the int32 range and was clamped.
    pub overflow: bool,
}

impl ReduceResult {
    /// The AGG1 flag bits this result contributes: OVERFLOW and FLOAT32
    /// (the caller adds RESULT and LAST_FRAGMENT).
    pub fn flags(&self) -> u8 {
        let mut f = 0;
        if self.overflow {
            f |= abi::AGG_F_OVERFLOW;
        }
        if matches!(self.values, ReduceValues::Float(_)) {
            f |= abi::AGG_F_FLOAT32;
        }
        f
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.values {
            ReduceValues::Int(v) => v.len(),
            ReduceValues::Float(v) => v.len(),
        }
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the elements big-endian, ready to be an AGG1 payload.
    pub fn write_be(&self, out: &mut Vec<u8>) {
        match &self.values {
            ReduceValues::Int(v) => crate::wire::proto::write_i32_be(v, out),
            ReduceValues::Float(v) => crate::wire::proto::write_f32_be(v, out),
        }
    }

    /// The int elements, `None` for a float result.
    pub fn ints(&self) -> Option<&[i32]> {
        match &self.values {
            ReduceValues::Int(v) => Some(v),
            ReduceValues::Float(_) => None,
        }
    }

    /// The float elements, `None` for an int result.
    pub fn floats(&self) -> Option<&[f32]> {
        match &self.values {
            ReduceValues::Float(v) => Some(v),
            ReduceValues::Int(_) => None,
        }
    }
}

// Integer PROD keeps values with |x| <= 2^31 exact and saturates anything
// larger to ±(2^31 + 1). Multiplying by a nonzero int never shrinks a
// magnitude, so a saturated value stays out of range with the right sign, and
// 2^31 itself stays exact (i32::MIN * -1 * -1 must come back in range).
//
// The accumulator is an f64 holding that integer: the product of two such
// integers is exact in f64 whenever |p| <= 2^53, and when it is larger the
// correctly rounded f64 is still larger than 2^31 + 1 with the true sign
// (rounding is monotonic and 2^31 + 1 is representable), so saturating in
// f64 gives exactly the integer answer. Unlike an i64 version (no 64-bit
// vector multiply before AVX-512, and `clamp` became a mispredicted branch)
// this loop vectorizes to mulpd/minpd/maxpd.
const PROD_POS_SAT: f64 = 2_147_483_649.0; // 2^31 + 1
const PROD_NEG_SAT: f64 = -PROD_POS_SAT;

/// Per-op accumulation storage.
#[derive(Debug, Clone)]
enum State {
    /// int SUM/AVG while Σ|w|·2^31 fits i64.
    Wide(Vec<i64>),
    /// int SUM/AVG once the weights could overflow i64.
    Huge(Vec<i128>),
    /// COUNT (int and float): ranks with a nonzero element.
    Count(Vec<u32>),
    /// int MAX/MIN/BAND/BOR/BXOR and every other op that keeps int32s
    /// (LAND/LOR): starts at the op's identity.
    Narrow(Vec<i32>),
    /// float SUM/AVG/PROD; int PROD (saturating exact integers, see above).
    F64(Vec<f64>),
    /// float MAX/MIN.
    F32(Vec<f32>),
}

/// Incremental reduction of one slot: `count` elements, one op, int or float.
#[derive(Debug, Clone)]
pub struct Accumulator {
    op: Op,
    float: bool,
    count: usize,
    contributions: u32,
    weight_sum: i64,
    /// Upper bound of |accumulated| for int SUM/AVG: Σ |w| · 2^31.
    bound: u128,
    state: State,
}

#[inline(always)]
fn be_i32(c: &[u8]) -> i32 {
    i32::from_be_bytes([c[0], c[1], c[2], c[3]])
}

#[inline(always)]
fn be_f32(c: &[u8]) -> f32 {
    f32::from_bits(u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
}

#[inline]
fn clamp_i32(x: i64, overflow: &mut bool) -> i32 {
    let c = x.clamp(i32::MIN as i64, i32::MAX as i64);
    *overflow |= c != x;
    c as i32
}

#[inline]
fn clamp_i32_wide(x: i128, overflow: &mut bool) -> i32 {
    let c = x.clamp(i32::MIN as i128, i32::MAX as i128);
    *overflow |= c != x;
    c as i32
}

impl Accumulator {
    /// A fresh accumulator for `count` elements; `float` selects the FLOAT32
    /// semantics. Fails only for a bitwise op on floats.
    pub fn new(op: Op, count: usize, float: bool) -> Result<Accumulator, ReduceError> {
        if float && !op.valid_on_floats() {
            return Err(ReduceError::FloatBitwise(op));
        }
        let state = Self::initial_state(op, count, float);
        Ok(Accumulator {
            op,
            float,
            count,
            contributions: 0,
            weight_sum: 0,
            bound: 0,
            state,
        })
    }

    fn initial_state(op: Op, count: usize, float: bool) -> State {
        match (op, float) {
            (Op::Count, _) => State::Count(vec![0; count]),
            (Op::Sum | Op::Avg, false) => State::Wide(vec![0; count]),
            (Op::Prod, false) => State::F64(vec![1.0; count]),
            (Op::Sum | Op::Avg, true) => State::F64(vec![0.0; count]),
            (Op::Prod, true) => State::F64(vec![1.0; count]),
            (Op::Max, true) => State::F32(vec![f32::NEG_INFINITY; count]),
            (Op::Min, true) => State::F32(vec![f32::INFINITY; count]),
            // Every other int op keeps int32s. MAX/MIN take the first
            // contribution as is (see add_*), so their identity only
            // matters for an empty accumulator. (No other op is valid on
            // floats: `ops_valid_on_floats_have_float_states` below.)
            (_, _) => State::Narrow(vec![op.identity(); count]),
        }
    }

    /// Starts over for a new slot, keeping the allocation when the shape
    /// (op, count, float) is unchanged.
    pub fn reset(&mut self, op: Op, count: usize, float: bool) -> Result<(), ReduceError> {
        if float && !op.valid_on_floats() {
            return Err(ReduceError::FloatBitwise(op));
        }
        let same = op == self.op
            && count == self.count
            && float == self.float
            && !matches!(self.state, State::Huge(_));
        if same {
            match (&mut self.state, op) {
                (State::Count(v), _) => v.fill(0),
                (State::Wide(v), _) => v.fill(0),
                (State::Narrow(v), _) => v.fill(op.identity()),
                (State::F64(v), Op::Prod) => v.fill(1.0),
                (State::F64(v), _) => v.fill(0.0),
                (State::F32(_), _) | (State::Huge(_), _) => {}
            }
        } else {
            self.state = Self::initial_state(op, count, float);
        }
        self.op = op;
        self.count = count;
        self.float = float;
        self.contributions = 0;
        self.weight_sum = 0;
        self.bound = 0;
        Ok(())
    }

    /// The op.
    pub fn op(&self) -> Op {
        self.op
    }

    /// Elements per contribution.
    pub fn count(&self) -> usize {
        self.count
    }

    /// FLOAT32 semantics.
    pub fn is_float(&self) -> bool {
        self.float
    }

    /// Contributions added so far.
    pub fn contributions(&self) -> u32 {
        self.contributions
    }

    /// Σ of the weights of the contributions added so far (AVG divisor).
    pub fn weight_sum(&self) -> i64 {
        self.weight_sum
    }

    /// Adds one int32 contribution (host order) with its rank weight.
    pub fn add_int(&mut self, payload: &[i32], weight: i32) -> Result<(), ReduceError> {
        if self.float {
            return Err(ReduceError::TypeMismatch);
        }
        self.check_len(payload.len())?;
        self.add_int_src(payload.iter().copied(), weight);
        Ok(())
    }

    /// Adds one float32 contribution (host order) with its rank weight.
    pub fn add_f32(&mut self, payload: &[f32], weight: i32) -> Result<(), ReduceError> {
        if !self.float {
            return Err(ReduceError::TypeMismatch);
        }
        self.check_len(payload.len())?;
        self.add_float_src(payload.iter().copied(), weight);
        Ok(())
    }

    /// Adds one contribution straight from its big-endian wire payload (int32
    /// or float32 by the accumulator's type): the hot path, no copy.
    pub fn add_be_bytes(&mut self, payload_be: &[u8], weight: i32) -> Result<(), ReduceError> {
        if payload_be.len() % 4 != 0 {
            return Err(ReduceError::RaggedPayload(payload_be.len()));
        }
        self.check_len(payload_be.len() / 4)?;
        if self.float {
            self.add_float_src(payload_be.chunks_exact(4).map(be_f32), weight);
        } else {
            self.add_int_src(payload_be.chunks_exact(4).map(be_i32), weight);
        }
        Ok(())
    }

    fn check_len(&self, found: usize) -> Result<(), ReduceError> {
        if found != self.count {
            return Err(ReduceError::LengthMismatch {
                expected: self.count,
                found,
            });
        }
        Ok(())
    }

    #[inline(always)]
    fn add_int_src<I: Iterator<Item = i32>>(&mut self, src: I, weight: i32) {
        let first = self.contributions == 0;
        self.contributions = self.contributions.saturating_add(1);
        self.weight_sum += weight as i64;
        let op = self.op;
        if matches!(op, Op::Sum | Op::Avg) {
            // Promote before the add that could overflow i64: each term is at
            // most |w| * 2^31 in magnitude.
            self.bound += weight.unsigned_abs() as u128 * (1u128 << 31);
            if self.bound > i64::MAX as u128 {
                if let State::Wide(v) = &self.state {
                    self.state = State::Huge(v.iter().map(|&x| x as i128).collect());
                }
            }
        }
        match (&mut self.state, op) {
            (State::Wide(acc), Op::Sum | Op::Avg) => {
                if weight == 1 {
                    for (a, v) in acc.iter_mut().zip(src) {
                        *a += v as i64;
                    }
                } else {
                    let w = weight as i64;
                    for (a, v) in acc.iter_mut().zip(src) {
                        *a += w * v as i64;
                    }
                }
            }
            (State::Huge(acc), _) => {
                let w = weight as i128;
                for (a, v) in acc.iter_mut().zip(src) {
                    *a += w * v as i128;
                }
            }
            (State::F64(acc), _) => {
                // PROD
                for (a, v) in acc.iter_mut().zip(src) {
                    *a = (*a * v as f64).clamp(PROD_NEG_SAT, PROD_POS_SAT);
                }
            }
            (State::Count(acc), _) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a += (v != 0) as u32;
                }
            }
            (State::Narrow(acc), _) if first && matches!(op, Op::Max | Op::Min) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a = v;
                }
            }
            (State::Narrow(acc), Op::Max) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a = (*a).max(v);
                }
            }
            (State::Narrow(acc), Op::Min) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a = (*a).min(v);
                }
            }
            (State::Narrow(acc), Op::Band) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a &= v;
                }
            }
            (State::Narrow(acc), Op::Bor) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a |= v;
                }
            }
            (State::Narrow(acc), Op::Bxor) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a ^= v;
                }
            }
            (State::Narrow(acc), _) => {
                // An op with no loop of its own (LAND, LOR): the table's
                // row, whose int32 accumulators stay int32.
                for (a, v) in acc.iter_mut().zip(src) {
                    *a = op.combine(i64::from(*a), v, weight) as i32;
                }
            }
            // Wide only serves SUM/AVG; F32 never occurs for ints.
            (State::Wide(_) | State::F32(_), _) => {}
        }
    }

    #[inline(always)]
    fn add_float_src<I: Iterator<Item = f32>>(&mut self, src: I, weight: i32) {
        let first = self.contributions == 0;
        self.contributions = self.contributions.saturating_add(1);
        self.weight_sum += weight as i64;
        let op = self.op;
        match (&mut self.state, op) {
            (State::F64(acc), Op::Prod) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a *= v as f64;
                }
            }
            (State::F64(acc), _) => {
                // SUM/AVG in f64 as the spec prescribes; w * v (24-bit
                // mantissa times a 32-bit weight) may itself round in f64 for
                // huge weights, which is part of that f64 arithmetic.
                if weight == 1 {
                    for (a, v) in acc.iter_mut().zip(src) {
                        *a += v as f64;
                    }
                } else {
                    let w = weight as f64;
                    for (a, v) in acc.iter_mut().zip(src) {
                        *a += w * v as f64;
                    }
                }
            }
            (State::Count(acc), _) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a += (v != 0.0) as u32;
                }
            }
            (State::F32(acc), _) if first => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a = v;
                }
            }
            (State::F32(acc), Op::Max) => {
                for (a, v) in acc.iter_mut().zip(src) {
                    *a = a.max(v);
                }
            }
            (State::F32(acc), _) => {
                // MIN
                for (a, v) in acc.iter_mut().zip(src) {
                    *a = a.min(v);
                }
            }
            // Int states never occur for a float accumulator.
            (State::Wide(_) | State::Huge(_) | State::Narrow(_), _) => {}
        }
    }

    /// The result, AVG dividing by the weights of the contributions added.
    pub fn finish(&self) -> Result<ReduceResult, ReduceError> {
        self.finish_with_weight_sum(self.weight_sum)
    }

    /// The result, AVG dividing by `weight_sum` (e.g. the job's configured
    /// Σ w_r, as the kernel does). Integer AVG truncates toward zero.
    pub fn finish_with_weight_sum(&self, weight_sum: i64) -> Result<ReduceResult, ReduceError> {
        if !self.float {
            let mut v = Vec::with_capacity(self.count);
            let overflow = self.finish_ints_into(weight_sum, &mut v)?;
            return Ok(ReduceResult {
                values: ReduceValues::Int(v),
                overflow,
            });
        }
        self.check_finish(weight_sum)?;
        let values = match &self.state {
            State::Count(acc) => ReduceValues::Float(acc.iter().map(|&c| c as f32).collect()),
            State::F64(acc) if self.op == Op::Avg => {
                let ws = weight_sum as f64;
                ReduceValues::Float(acc.iter().map(|&a| (a / ws) as f32).collect())
            }
            State::F64(acc) => ReduceValues::Float(acc.iter().map(|&a| a as f32).collect()),
            State::F32(acc) => ReduceValues::Float(acc.clone()),
            // Int states never occur for a float accumulator.
            State::Wide(_) | State::Huge(_) | State::Narrow(_) => {
                return Err(ReduceError::TypeMismatch)
            }
        };
        Ok(ReduceResult {
            values,
            overflow: false,
        })
    }

    /// The integer result of an int accumulator into `out` (cleared, its
    /// allocation reused: the socket aggregator's slots keep one each), AVG
    /// dividing by `weight_sum`; returns whether an element was clamped
    /// (OVERFLOW). A float accumulator is a `TypeMismatch`.
    pub fn finish_ints_into(&self, weight_sum: i64, out: &mut Vec<i32>) -> Result<bool, ReduceError> {
        if self.float {
            return Err(ReduceError::TypeMismatch);
        }
        self.check_finish(weight_sum)?;
        let avg = self.op == Op::Avg;
        let mut overflow = false;
        out.clear();
        match &self.state {
            State::Wide(acc) if avg => {
                out.extend(acc.iter().map(|&a| clamp_i32(a / weight_sum, &mut overflow)))
            }
            State::Wide(acc) => out.extend(acc.iter().map(|&a| clamp_i32(a, &mut overflow))),
            State::Huge(acc) if avg => {
                let ws = weight_sum as i128;
                out.extend(acc.iter().map(|&a| clamp_i32_wide(a / ws, &mut overflow)))
            }
            State::Huge(acc) => out.extend(acc.iter().map(|&a| clamp_i32_wide(a, &mut overflow))),
            State::Count(acc) => out.extend(acc.iter().map(|&c| clamp_i32(c as i64, &mut overflow))),
            State::Narrow(acc) => out.extend_from_slice(acc),
            // int PROD: exact integers or ±(2^31 + 1), so `as i64` is exact.
            State::F64(acc) => out.extend(acc.iter().map(|&a| clamp_i32(a as i64, &mut overflow))),
            // Float states never occur for an int accumulator.
            State::F32(_) => return Err(ReduceError::TypeMismatch),
        }
        Ok(overflow)
    }

    fn check_finish(&self, weight_sum: i64) -> Result<(), ReduceError> {
        if self.contributions == 0 {
            return Err(ReduceError::NoContributions);
        }
        if self.op == Op::Avg && weight_sum == 0 {
            return Err(ReduceError::ZeroWeightSum);
        }
        Ok(())
    }
}

/// Reduces int32 contributions `(payload, weight)` in one call.
pub fn reduce(op: Op, contributions: &[(&[i32], i32)]) -> Result<ReduceResult, ReduceError> {
    let first = contributions.first().ok_or(ReduceError::NoContributions)?;
    let mut acc = Accumulator::new(op, first.0.len(), false)?;
    for (payload, weight) in contributions {
        acc.add_int(payload, *weight)?;
    }
    acc.finish()
}

/// Reduces float32 contributions `(payload, weight)` in one call.
pub fn reduce_f32(op: Op, contributions: &[(&[f32], i32)]) -> Result<ReduceResult, ReduceError> {
    let first = contributions.first().ok_or(ReduceError::NoContributions)?;
    let mut acc = Accumulator::new(op, first.0.len(), true)?;
    for (payload, weight) in contributions {
        acc.add_f32(payload, *weight)?;
    }
    acc.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(op: Op, contribs: &[(&[i32], i32)]) -> (Vec<i32>, bool) {
        let r = reduce(op, contribs).unwrap();
        (r.ints().unwrap().to_vec(), r.overflow)
    }

    fn floats(op: Op, contribs: &[(&[f32], i32)]) -> Vec<f32> {
        let r = reduce_f32(op, contribs).unwrap();
        assert!(!r.overflow);
        r.floats().unwrap().to_vec()
    }

    const MAX: i32 = i32::MAX;
    const MIN: i32 = i32::MIN;

    #[test]
    fn sum_exact_and_clamped_both_ways() {
        assert_eq!(
            ints(Op::Sum, &[(&[1, -5, MAX, MIN], 1), (&[2, 5, 0, 0], 1)]),
            (vec![3, 0, MAX, MIN], false)
        );
        // Wraparound would give a negative / positive result; clamp instead.
        assert_eq!(
            ints(Op::Sum, &[(&[MAX, MIN, 1], 1), (&[1, -1, 1], 1)]),
            (vec![MAX, MIN, 2], true)
        );
        // An intermediate outside int32 is fine when the final sum is inside.
        assert_eq!(
            ints(
                Op::Sum,
                &[
                    (&[MAX], 1),
                    (&[MAX], 1),
                    (&[MIN], 1),
                    (&[MIN], 1),
                    (&[7], 1)
                ]
            ),
            (vec![5], false)
        );
    }

    /// `finish_ints_into` gives `finish`'s values and OVERFLOW for every
    /// integer op and state (narrow, wide, huge weights, count, PROD),
    /// reusing the caller's vector; float accumulators and empty ones are
    /// errors.
    #[test]
    fn finish_ints_into_is_finish_into_a_reused_vector() {
        let a = [i32::MAX, -7, 3, i32::MIN, 0];
        let b = [i32::MAX, 2, -3, -1, 5];
        let mut out = Vec::with_capacity(64);
        let cap = out.capacity();
        for op in Op::ALL {
            for (wa, wb) in [(1, 1), (3, -2), (i32::MAX, i32::MAX)] {
                let mut acc = Accumulator::new(op, a.len(), false).unwrap();
                acc.add_int(&a, wa).unwrap();
                acc.add_int(&b, wb).unwrap();
                let want = acc.finish().unwrap();
                out.push(99);
                let overflow = acc.finish_ints_into(acc.weight_sum(), &mut out).unwrap();
                assert_eq!(Some(&out[..]), want.ints(), "{op:?} {wa} {wb}");
                assert_eq!(overflow, want.overflow, "{op:?} {wa} {wb}");
                assert_eq!(out.capacity(), cap, "the vector is reused");
            }
        }
        let empty = Accumulator::new(Op::Sum, 3, false).unwrap();
        assert_eq!(empty.finish_ints_into(1, &mut out), Err(ReduceError::NoContributions));
        let mut f = Accumulator::new(Op::Sum, 1, true).unwrap();
        f.add_f32(&[1.0], 1).unwrap();
        assert_eq!(f.finish_ints_into(1, &mut out), Err(ReduceError::TypeMismatch));
        let mut avg = Accumulator::new(Op::Avg, 1, false).unwrap();
        avg.add_int(&[4], 1).unwrap();
        assert_eq!(avg.finish_ints_into(0, &mut out), Err(ReduceError::ZeroWeightSum));
    }

    #[test]
    fn sum_weighted() {
        assert_eq!(
            ints(Op::Sum, &[(&[1, 10], 1), (&[1, 10], 2), (&[1, -10], 3)]),
            (vec![6, 0], false)
        );
        assert_eq!(
            ints(Op::Sum, &[(&[MAX], -1), (&[1], -1)]),
            (vec![MIN], false)
        );
        assert_eq!(ints(Op::Sum, &[(&[MIN], -1)]), (vec![MAX], true));
        assert_eq!(ints(Op::Sum, &[(&[5], 0), (&[3], 1)]), (vec![3], false));
    }

    #[test]
    fn sum_huge_weights_never_wrap() {
        // Each term is about 2^62: i64 would wrap after two of them.
        let c: [(&[i32], i32); 5] = [
            (&[MAX], MAX),
            (&[MAX], MAX),
            (&[-MAX], MAX),
            (&[-MAX], MAX),
            (&[5], 1),
        ];
        assert_eq!(ints(Op::Sum, &c), (vec![5], false));
        let c: [(&[i32], i32); 3] = [(&[MAX], MAX), (&[MAX], MAX), (&[MAX], MAX)];
        assert_eq!(ints(Op::Sum, &c), (vec![MAX], true));
        let c: [(&[i32], i32); 3] = [(&[MIN], MAX), (&[MIN], MAX), (&[MIN], MAX)];
        assert_eq!(ints(Op::Sum, &c), (vec![MIN], true));
        // AVG after promotion: (3 * MAX * MAX) / (3 * MAX) = MAX.
        let c: [(&[i32], i32); 3] = [(&[MAX], MAX), (&[MAX], MAX), (&[MAX], MAX)];
        assert_eq!(ints(Op::Avg, &c), (vec![MAX], false));
    }

    #[test]
    fn avg_truncates_toward_zero() {
        assert_eq!(
            ints(
                Op::Avg,
                &[(&[-3, 3, -4, MIN, MAX], 1), (&[-4, 4, 0, MIN, MAX], 1)]
            ),
            (vec![-3, 3, -2, MIN, MAX], false)
        );
        // weighted: (5*1 + 1*2 + 2*(-10)) / 8 = -13/8 = -1.625 -> -1
        assert_eq!(
            ints(Op::Avg, &[(&[1], 5), (&[2], 1), (&[-10], 2)]),
            (vec![-1], false)
        );
        // negative weight sum: (7*1 + 0*-3) / -2 = -3.5 -> -3
        assert_eq!(ints(Op::Avg, &[(&[7], 1), (&[0], -3)]), (vec![-3], false));
        let mut acc = Accumulator::new(Op::Avg, 1, false).unwrap();
        acc.add_int(&[10], 1).unwrap();
        acc.add_int(&[-10], -1).unwrap();
        assert_eq!(acc.weight_sum(), 0);
        assert_eq!(acc.finish(), Err(ReduceError::ZeroWeightSum));
        // The configured weight sum wins when given.
        assert_eq!(acc.finish_with_weight_sum(3).unwrap().ints().unwrap(), [6]);
        assert_eq!(
            acc.finish_with_weight_sum(-4).unwrap().ints().unwrap(),
            [-5]
        );
    }

    #[test]
    fn count_ignores_weights_and_zeros() {
        assert_eq!(
            ints(
                Op::Count,
                &[
                    (&[0, 1, MIN, 0], 5),
                    (&[0, 0, -1, 7], 0),
                    (&[0, 2, 1, 0], -3)
                ]
            ),
            (vec![0, 2, 3, 1], false)
        );
        assert_eq!(
            floats(
                Op::Count,
                &[
                    (&[0.0, -0.0, f32::NAN, 1e-45], 9),
                    (&[0.0, 1.0, 0.0, 2.0], 1)
                ]
            ),
            [0.0, 1.0, 1.0, 2.0]
        );
    }

    #[test]
    fn max_min_extremes() {
        assert_eq!(
            ints(Op::Max, &[(&[MIN, MIN, 5], 1), (&[MIN, 0, -5], 1)]),
            (vec![MIN, 0, 5], false)
        );
        assert_eq!(
            ints(Op::Min, &[(&[MAX, MAX, 5], 1), (&[MAX, 0, -5], 1)]),
            (vec![MAX, 0, -5], false)
        );
        // Weights do not apply.
        assert_eq!(ints(Op::Max, &[(&[3], 100), (&[4], 0)]), (vec![4], false));
    }

    #[test]
    fn prod_exact_then_clamped_with_true_sign() {
        assert_eq!(
            ints(Op::Prod, &[(&[2, -3, 0, 7], 1), (&[5, 4, MAX, -1], 1)]),
            (vec![10, -12, 0, -7], false)
        );
        assert_eq!(
            ints(
                Op::Prod,
                &[(&[65536, 65536, -65536], 1), (&[32768, -32768, -32768], 1)]
            ),
            (vec![MAX, MIN, MAX], true)
        );
        // i32::MIN * -1 = 2^31: out of range alone, back in range after * -1.
        assert_eq!(
            ints(Op::Prod, &[(&[MIN], 1), (&[-1], 1)]),
            (vec![MAX], true)
        );
        assert_eq!(
            ints(Op::Prod, &[(&[MIN], 1), (&[-1], 1), (&[-1], 1)]),
            (vec![MIN], false)
        );
        // Saturated intermediates keep their sign through later factors.
        let c: [(&[i32], i32); 4] = [
            (&[1 << 20, 1 << 20], 1),
            (&[1 << 20, -(1 << 20)], 1),
            (&[-1, -1], 1),
            (&[3, 1], 1),
        ];
        assert_eq!(ints(Op::Prod, &c), (vec![MIN, MAX], true));
        // ... and a zero anywhere wins.
        let c: [(&[i32], i32); 3] = [(&[MAX], 1), (&[MAX], 1), (&[0], 1)];
        assert_eq!(ints(Op::Prod, &c), (vec![0], false));
        let c: [(&[i32], i32); 3] = [(&[MIN], 1), (&[MIN], 1), (&[MIN], 1)];
        assert_eq!(ints(Op::Prod, &c), (vec![MIN], true));
        // Weights do not apply.
        assert_eq!(ints(Op::Prod, &[(&[3], 7), (&[4], 0)]), (vec![12], false));
        // Right at the int32 edges.
        let c: [(&[i32], i32); 2] = [
            (&[46340, 46341, -46341, -65536, 65536], 1),
            (&[46341, 46341, 46341, 32768, 32768], 1),
        ];
        assert_eq!(
            ints(Op::Prod, &c),
            (vec![2_147_441_940, MAX, MIN, MIN, MAX], true)
        );
        let c: [(&[i32], i32); 3] = [(&[MAX, MAX], 1), (&[MAX, -MAX], 1), (&[0, 1], 1)];
        assert_eq!(ints(Op::Prod, &c), (vec![0, MIN], true));
    }

    #[test]
    fn bitwise_ops() {
        let a: &[i32] = &[0b1100, -1, 0];
        let b: &[i32] = &[0b1010, 0x0f0f, 0];
        assert_eq!(ints(Op::Band, &[(a, 1), (b, 1)]).0, [0b1000, 0x0f0f, 0]);
        assert_eq!(ints(Op::Bor, &[(a, 1), (b, 1)]).0, [0b1110, -1, 0]);
        assert_eq!(ints(Op::Bxor, &[(a, 1), (b, 1)]).0, [0b0110, !0x0f0f, 0]);
        assert_eq!(ints(Op::Bxor, &[(a, 1), (a, 1)]).0, [0, 0, 0]);
    }

    #[test]
    fn float_rounds_once() {
        // Summed in f32, 1e8 + 1 stays 1e8 eight times; in f64 it is 1e8 + 8.
        let mut c: Vec<(&[f32], i32)> = vec![(&[1e8], 1)];
        c.extend(std::iter::repeat_n((&[1.0f32][..], 1), 8));
        assert_eq!(floats(Op::Sum, &c), [100_000_008.0]);
        // AVG: (1e8 + 8) / 9 computed in f64, rounded once.
        assert_eq!(floats(Op::Avg, &c), [(100_000_008.0f64 / 9.0) as f32]);
        // Weighted SUM and AVG: Σ w·v and Σ w·v / Σ w.
        let c: [(&[f32], i32); 2] = [(&[1.5, -2.0], 1), (&[0.25, 3.0], 3)];
        assert_eq!(floats(Op::Sum, &c), [2.25, 7.0]);
        assert_eq!(floats(Op::Avg, &c), [0.5625, 1.75]);
        // PROD in f64: 3e30 * 1e10 * 1e-20 overflows f32 in the middle only.
        assert_eq!(
            floats(Op::Prod, &[(&[3e30], 1), (&[1e10], 1), (&[1e-20], 1)]),
            [(3e30f32 as f64 * 1e10f32 as f64 * 1e-20f32 as f64) as f32]
        );
        assert!(floats(Op::Prod, &[(&[3e30], 1), (&[1e10], 1)])[0].is_infinite());
    }

    #[test]
    fn float_max_min() {
        let c: [(&[f32], i32); 3] = [
            (&[1.0, f32::NAN, -3.5, f32::NAN], 1),
            (&[2.0, 5.0, f32::NEG_INFINITY, f32::NAN], 1),
            (&[-1.0, f32::NAN, 0.0, f32::NAN], 1),
        ];
        let max = floats(Op::Max, &c);
        assert_eq!(&max[..3], [2.0, 5.0, 0.0]);
        assert!(max[3].is_nan(), "all-NaN stays NaN");
        let min = floats(Op::Min, &c);
        assert_eq!(&min[..3], [-1.0, 5.0, f32::NEG_INFINITY]);
        assert!(min[3].is_nan());
    }

    /// The float states exist for SUM, AVG, PROD, MAX, MIN and COUNT only:
    /// a row valid on floats must be one of them.
    #[test]
    fn ops_valid_on_floats_have_float_states() {
        for op in Op::ALL.into_iter().filter(|op| op.valid_on_floats()) {
            let state = Accumulator::new(op, 1, true).unwrap().state;
            assert!(!matches!(state, State::Narrow(_) | State::Wide(_) | State::Huge(_)), "{op:?}");
        }
    }

    #[test]
    fn logical_ops() {
        let (a, b): (&[i32], &[i32]) = (&[0, 1, -7, 0, MIN], &[0, 0, 3, 5, MAX]);
        assert_eq!(ints(Op::Land, &[(a, 1), (b, 1)]), (vec![0, 0, 1, 0, 1], false));
        assert_eq!(ints(Op::Lor, &[(a, 1), (b, 1)]), (vec![0, 1, 1, 1, 1], false));
        // weights do not scale them
        assert_eq!(ints(Op::Land, &[(&[2], -3)]), (vec![1], false));
        assert_eq!(ints(Op::Lor, &[(&[0], 9)]), (vec![0], false));
    }

    #[test]
    fn errors() {
        for op in Op::ALL.into_iter().filter(|op| !op.valid_on_floats()) {
            assert_eq!(
                Accumulator::new(op, 1, true).err(),
                Some(ReduceError::FloatBitwise(op))
            );
        }
        let mut acc = Accumulator::new(Op::Sum, 2, false).unwrap();
        assert_eq!(acc.finish(), Err(ReduceError::NoContributions));
        assert_eq!(
            acc.add_int(&[1], 1),
            Err(ReduceError::LengthMismatch {
                expected: 2,
                found: 1
            })
        );
        assert_eq!(
            acc.add_be_bytes(&[0; 12], 1),
            Err(ReduceError::LengthMismatch {
                expected: 2,
                found: 3
            })
        );
        assert_eq!(
            acc.add_be_bytes(&[0; 7], 1),
            Err(ReduceError::RaggedPayload(7))
        );
        assert_eq!(acc.add_f32(&[1.0, 2.0], 1), Err(ReduceError::TypeMismatch));
        assert_eq!(acc.contributions(), 0, "failed adds change nothing");
        let mut facc = Accumulator::new(Op::Sum, 1, true).unwrap();
        assert_eq!(facc.add_int(&[1], 1), Err(ReduceError::TypeMismatch));
        assert_eq!(reduce(Op::Sum, &[]), Err(ReduceError::NoContributions));
        assert_eq!(
            reduce(Op::Sum, &[(&[1, 2], 1), (&[1], 1)]),
            Err(ReduceError::LengthMismatch {
                expected: 2,
                found: 1
            })
        );
    }

    /// Deterministic pseudo-random ints that hit the extremes often.
    fn lcg_values(seed: u64, n: usize) -> Vec<i32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                match (s >> 60) as u8 {
                    0 => MAX,
                    1 => MIN,
                    2 => 0,
                    3 => -1,
                    _ => (s >> 16) as i32 >> ((s >> 8) % 31),
                }
            })
            .collect()
    }

    #[test]
    fn be_bytes_path_matches_host_path() {
        let n = 97; // not a multiple of any vector width
        let contribs: Vec<(Vec<i32>, i32)> = (0..6)
            .map(|r| (lcg_values(r + 1, n), [1, 2, -3, 1, MAX, 0][r as usize]))
            .collect();
        for op in Op::ALL {
            for float in [false, true] {
                if float && !op.valid_on_floats() {
                    continue;
                }
                let mut host = Accumulator::new(op, n, float).unwrap();
                let mut wire = Accumulator::new(op, n, float).unwrap();
                for (v, w) in &contribs {
                    let mut be = Vec::new();
                    if float {
                        let f: Vec<f32> = v.iter().map(|&x| x as f32 / 65536.0).collect();
                        host.add_f32(&f, *w).unwrap();
                        crate::wire::proto::write_f32_be(&f, &mut be);
                    } else {
                        host.add_int(v, *w).unwrap();
                        crate::wire::proto::write_i32_be(v, &mut be);
                    }
                    wire.add_be_bytes(&be, *w).unwrap();
                }
                let (a, b) = (host.finish().unwrap(), wire.finish().unwrap());
                let (mut ba, mut bb) = (Vec::new(), Vec::new());
                a.write_be(&mut ba);
                b.write_be(&mut bb);
                assert_eq!(ba, bb, "{op:?} float={float}");
                assert_eq!(a.overflow, b.overflow);
            }
        }
    }

    /// The fast loops agree with a straightforward i128 / f64 model.
    #[test]
    fn matches_naive_model() {
        let n = 64;
        let contribs: Vec<(Vec<i32>, i32)> = (0..5)
            .map(|r| (lcg_values(r + 40, n), [1, 3, -2, 1, 1][r as usize]))
            .collect();
        for op in Op::ALL {
            let refs: Vec<(&[i32], i32)> = contribs.iter().map(|(v, w)| (&v[..], *w)).collect();
            let got = reduce(op, &refs).unwrap();
            let wsum: i128 = contribs.iter().map(|c| c.1 as i128).sum();
            let mut overflow = false;
            let want: Vec<i32> = (0..n)
                .map(|i| {
                    let col = contribs.iter().map(|(v, w)| (v[i] as i128, *w as i128));
                    let exact: i128 = match op {
                        Op::Sum => col.map(|(v, w)| v * w).sum(),
                        Op::Avg => col.map(|(v, w)| v * w).sum::<i128>() / wsum,
                        Op::Count => col.filter(|(v, _)| *v != 0).count() as i128,
                        Op::Max => col.map(|c| c.0).max().unwrap(),
                        Op::Min => col.map(|c| c.0).min().unwrap(),
                        // |product| of 5 int32 < 2^155: use checked i128 and
                        // fall back to the sign of the product when it overflows.
                        Op::Prod => col
                            .map(|c| c.0)
                            .try_fold(1i128, |p, v| p.checked_mul(v))
                            .unwrap_or_else(|| {
                                let neg =
                                    contribs.iter().filter(|(v, _)| v[i] < 0).count() % 2 == 1;
                                if neg {
                                    i128::MIN
                                } else {
                                    i128::MAX
                                }
                            }),
                        Op::Band => col.map(|c| c.0).fold(-1, |a, v| a & v),
                        Op::Bor => col.map(|c| c.0).fold(0, |a, v| a | v),
                        Op::Bxor => col.map(|c| c.0).fold(0, |a, v| a ^ v),
                        Op::Land => col.fold(1, |a, c| a & (c.0 != 0) as i128),
                        Op::Lor => col.fold(0, |a, c| a | (c.0 != 0) as i128),
                    };
                    let c = exact.clamp(MIN as i128, MAX as i128);
                    overflow |= c != exact;
                    c as i32
                })
                .collect();
            assert_eq!(got.ints().unwrap(), want, "{op:?}");
            assert_eq!(got.overflow, overflow, "{op:?}");
            assert_eq!(got.flags(), if overflow { abi::AGG_F_OVERFLOW } else { 0 });
        }
    }

    #[test]
    fn reset_reuses_and_clears() {
        let mut acc = Accumulator::new(Op::Prod, 2, false).unwrap();
        acc.add_int(&[MAX, 3], 1).unwrap();
        acc.add_int(&[MAX, 3], 1).unwrap();
        assert!(acc.finish().unwrap().overflow);
        acc.reset(Op::Prod, 2, false).unwrap();
        assert_eq!(acc.contributions(), 0);
        acc.add_int(&[2, 3], 1).unwrap();
        assert_eq!(
            acc.finish().unwrap(),
            ReduceResult {
                values: ReduceValues::Int(vec![2, 3]),
                overflow: false
            }
        );
        for op in Op::ALL {
            acc.reset(op, 2, false).unwrap();
            acc.add_int(&[6, -6], 1).unwrap();
            // one contribution: the table's combine from the identity
            let want = if matches!(op, Op::Count | Op::Land | Op::Lor) { [1, 1] } else { [6, -6] };
            assert_eq!(
                acc.finish().unwrap().ints().unwrap(),
                want,
                "{op:?} after reset"
            );
        }
        acc.reset(Op::Max, 1, true).unwrap();
        acc.add_f32(&[-7.5], 1).unwrap();
        assert_eq!(acc.finish().unwrap().floats().unwrap(), [-7.5]);
        assert_eq!(acc.finish().unwrap().flags(), abi::AGG_F_FLOAT32);
        assert_eq!(
            acc.reset(Op::Bor, 1, true),
            Err(ReduceError::FloatBitwise(Op::Bor))
        );
        // Promotion to i128 is undone by a reset.
        acc.reset(Op::Sum, 1, false).unwrap();
        for _ in 0..3 {
            acc.add_int(&[MAX], MAX).unwrap();
        }
        acc.reset(Op::Sum, 1, false).unwrap();
        acc.add_int(&[4], 1).unwrap();
        assert_eq!(acc.finish().unwrap().ints().unwrap(), [4]);
    }
}
