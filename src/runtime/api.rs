//! One collective interface ([`Collective`]): what every algorithm answers —
//! the star ([`Communicator`](crate::runtime::Communicator)), the striped
//! star ([`StripedCommunicator`](crate::runtime::StripedCommunicator)), and
//! star or ring chosen per call ([`StarOrRing`](crate::runtime::StarOrRing),
//! which also serves a ring alone) — so that a binding written once against
//! it (Python, MPI, torch) gets all of them.
//!
//! The element types are the grid's one axis: a call's buffer is an
//! [`Elements`] (int32 reduced exactly, float32 through the runtime's
//! quantization), and the generic forms ([`Collective::allreduce`] and the
//! rest) turn a `&mut [i32]` or `&mut [f32]` into one with [`Element`].

use crate::runtime::comm::{CallOptions, Participant};
use crate::runtime::{CommError, CommStats};
use crate::wire::abi::Op;
use crate::wire::proto;

/// Which algorithm served a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// By size: the ring from [`StarOrRing::ring_threshold`](crate::runtime::StarOrRing::ring_threshold)
    /// elements on (a choice, never what served a call).
    #[default]
    Auto,
    /// The star: an aggregator reduces every worker's contribution.
    Star,
    /// The ring: every member reduces a share and passes it on.
    Ring,
}

/// The buffer of one call, by element type.
#[derive(Debug)]
pub enum Elements<'a> {
    /// int32, reduced exactly with any op (clamped on OVERFLOW).
    I32(&'a mut [i32]),
    /// float32, quantized to int32: SUM or AVG (the mean).
    F32(&'a mut [f32]),
}

impl Elements<'_> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        match self {
            Elements::I32(b) => b.len(),
            Elements::F32(b) => b.len(),
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for i32 {}
    impl Sealed for f32 {}
}

/// An element type a broadcast carries: bytes, int32 or float32 (the
/// numbers big-endian on the wire).
pub trait WireElement: Copy + Send + sealed::Sealed + 'static {
    /// `buf` as the bytes a broadcast sends.
    fn write_be(buf: &[Self], out: &mut Vec<u8>);
    /// `buf` from the `bytes` a broadcast delivered (as many as
    /// [`WireElement::write_be`] wrote for it).
    fn read_be(bytes: &[u8], buf: &mut [Self]);
}

/// An element type of reductions: int32 or float32.
pub trait Element: WireElement {
    /// `buf` as a call's buffer.
    fn elements(buf: &mut [Self]) -> Elements<'_>;
}

impl WireElement for u8 {
    fn write_be(buf: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(buf)
    }
    fn read_be(bytes: &[u8], buf: &mut [u8]) {
        buf.copy_from_slice(bytes)
    }
}

impl WireElement for i32 {
    fn write_be(buf: &[i32], out: &mut Vec<u8>) {
        proto::write_i32_be(buf, out)
    }
    fn read_be(bytes: &[u8], buf: &mut [i32]) {
        proto::read_i32_be(bytes, buf)
    }
}

impl WireElement for f32 {
    fn write_be(buf: &[f32], out: &mut Vec<u8>) {
        proto::write_f32_be(buf, out)
    }
    fn read_be(bytes: &[u8], buf: &mut [f32]) {
        proto::read_f32_be(bytes, buf)
    }
}

impl Element for i32 {
    fn elements(buf: &mut [i32]) -> Elements<'_> {
        Elements::I32(buf)
    }
}

impl Element for f32 {
    fn elements(buf: &mut [f32]) -> Elements<'_> {
        Elements::F32(buf)
    }
}

/// How a call was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// The algorithm that produced the result ([`Algorithm::Star`] or
    /// [`Algorithm::Ring`]).
    pub algorithm: Algorithm,
    /// Some element was clamped (OVERFLOW; int32 only). A reduce's workers
    /// do not learn it: only the aggregator does.
    pub clamped: bool,
}

impl Served {
    /// A call the star served.
    pub fn star(clamped: bool) -> Served {
        Served { algorithm: Algorithm::Star, clamped }
    }
}

/// Whether a float32 reduction with `op` takes the mean (AVG) rather than
/// the SUM; the other ops do not apply to quantized floats.
pub fn float_mean(op: Op) -> Result<bool, CommError> {
    match op {
        Op::Sum => Ok(false),
        Op::Avg => Ok(true),
        other => Err(CommError::Config(format!(
            "a float32 reduction is SUM or AVG (the mean), not {other:?}: reduce int32 for the other ops"
        ))),
    }
}

/// The calls every algorithm answers (see the module docs). Calls take
/// `&self`: several may be issued from several threads; each algorithm runs
/// them in issue order. Every participant of a job makes the same calls in
/// the same order.
pub trait Collective: Send + Sync {
    /// This process's participant: a worker's rank, or the aggregator.
    fn participant(&self) -> Participant;

    /// Workers of the job (the contributors of a reduction).
    fn workers(&self) -> u16;

    /// Counters since the communicator was built (all of its parts added).
    fn stats(&self) -> CommStats;

    /// Why the job behind this communicator is no longer served (a job on
    /// demand whose node refused its renewal), `None` while it is: what a
    /// part that does not go through it (a run's ring) fails with.
    fn lost(&self) -> Option<String> {
        None
    }

    /// Allreduce in place: every participant's buffer receives `op` over
    /// the workers' contributions. On an error the buffer may hold part of
    /// the result.
    fn allreduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError>;

    /// Reduce to the aggregator: a worker's buffer is its contribution (left
    /// unchanged), the aggregator's receives the result.
    fn reduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError>;

    /// Broadcast of bytes from `root`, in place (every participant passes a
    /// buffer of the same length); returns when this participant's part is
    /// done: a receiver has every byte, the root every acknowledgement.
    fn broadcast_bytes(&self, buf: &mut [u8], root: Participant, opts: CallOptions) -> Result<Served, CommError>;

    /// [`Collective::allreduce_elements`] of an int32 or float32 slice.
    fn allreduce<T: Element>(&self, buf: &mut [T], op: Op) -> Result<Served, CommError>
    where
        Self: Sized,
    {
        self.allreduce_elements(T::elements(buf), op, CallOptions::default())
    }

    /// [`Collective::allreduce`] with options.
    fn allreduce_with<T: Element>(&self, buf: &mut [T], op: Op, opts: CallOptions) -> Result<Served, CommError>
    where
        Self: Sized,
    {
        self.allreduce_elements(T::elements(buf), op, opts)
    }

    /// [`Collective::reduce_elements`] of an int32 or float32 slice.
    fn reduce<T: Element>(&self, buf: &mut [T], op: Op) -> Result<Served, CommError>
    where
        Self: Sized,
    {
        self.reduce_elements(T::elements(buf), op, CallOptions::default())
    }

    /// [`Collective::reduce`] with options.
    fn reduce_with<T: Element>(&self, buf: &mut [T], op: Op, opts: CallOptions) -> Result<Served, CommError>
    where
        Self: Sized,
    {
        self.reduce_elements(T::elements(buf), op, opts)
    }

    /// [`Collective::broadcast_bytes`] of bytes or elements (numbers sent
    /// big-endian).
    fn broadcast<T: WireElement>(&self, buf: &mut [T], root: Participant) -> Result<Served, CommError>
    where
        Self: Sized,
    {
        broadcast_elements(self, buf, root, CallOptions::default())
    }

    /// [`Collective::broadcast`] with options.
    fn broadcast_with<T: WireElement>(&self, buf: &mut [T], root: Participant, opts: CallOptions) -> Result<Served, CommError>
    where
        Self: Sized,
    {
        broadcast_elements(self, buf, root, opts)
    }
}

/// A broadcast of elements through any [`Collective`] (also a `dyn` one):
/// their big-endian bytes, in and out.
pub fn broadcast_elements<C: Collective + ?Sized, T: WireElement>(
    c: &C,
    buf: &mut [T],
    root: Participant,
    opts: CallOptions,
) -> Result<Served, CommError> {
    let mut bytes = Vec::with_capacity(buf.len() * 4);
    T::write_be(buf, &mut bytes);
    let served = c.broadcast_bytes(&mut bytes, root, opts)?;
    T::read_be(&bytes, buf);
    Ok(served)
}

/// A boxed algorithm is one too (a star of [`StarOrRing`](crate::runtime::StarOrRing)
/// chosen at run time, say).
impl<C: Collective + ?Sized> Collective for Box<C> {
    fn participant(&self) -> Participant {
        (**self).participant()
    }
    fn workers(&self) -> u16 {
        (**self).workers()
    }
    fn stats(&self) -> CommStats {
        (**self).stats()
    }
    fn allreduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        (**self).allreduce_elements(data, op, opts)
    }
    fn reduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        (**self).reduce_elements(data, op, opts)
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: Participant, opts: CallOptions) -> Result<Served, CommError> {
        (**self).broadcast_bytes(buf, root, opts)
    }
}
