//! The caller's slice lent to the engine for one call ([`Raw`]).

/// The caller's slice of a blocking reduction (`&mut [f32]`: [`RawF32`],
/// `&mut [i32]`: [`RawI32`]), lent to the progress thread for the duration
/// of the call, so elements are encoded (floats quantized) straight from it
/// into datagram buffers and results decoded straight into it (no copy in,
/// no copy out, no per-call vector).
///
/// Soundness: the blocking caller holds the exclusive borrow and waits on
/// the reply channel; the engine uses the pointer only while executing the
/// request, and the reply (or the request's drop, if the thread is gone)
/// happens after its last use, so the caller's wait returns only then.
/// The engine also lends an owned vector this way (the aggregator's result
/// vector of a `Vec` call): it keeps the vector, unresized, until the call
/// is over.
#[derive(Debug)]
pub(crate) struct Raw<T> {
    ptr: *mut T,
    pub(crate) len: usize,
}

impl<T> Clone for Raw<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Raw<T> {}

/// A lent `&mut [f32]` (see [`Raw`]).
pub(crate) type RawF32 = Raw<f32>;
/// A lent `&mut [i32]` (see [`Raw`]).
pub(crate) type RawI32 = Raw<i32>;

// SAFETY: see the type's docs: one thread uses it at a time, while the
// owner waits.
unsafe impl<T: Send> Send for Raw<T> {}

impl<T> Raw<T> {
    pub(crate) fn of(s: &mut [T]) -> Raw<T> {
        Raw {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// SAFETY: no `&mut` to the same memory may be alive while the result is.
    pub(crate) unsafe fn slice<'a>(self) -> &'a [T] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }

    /// SAFETY: no other reference to the same memory may be alive while the
    /// result is.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<'a>(self) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}
