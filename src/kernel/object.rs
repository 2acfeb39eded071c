//! Where a libbpf-rs skeleton's object lives. A skeleton borrows its
//! `OpenObject` for as long as it lives; a loaded plane keeps both in one
//! struct, so the object needs a place that never moves and is not freed
//! before the skeleton: a heap slot whose `'static` borrow the plane's field
//! order keeps sound.

use std::mem::MaybeUninit;

use libbpf_rs::OpenObject;

/// A heap slot for one skeleton's object. Keep it in the same struct as the
/// skeleton, declared after it (fields drop in declaration order, so the
/// skeleton, which borrows the slot, goes first), and never hand the borrow
/// to anything else.
pub struct ObjectSlot(#[allow(dead_code)] Box<MaybeUninit<OpenObject>>);

impl ObjectSlot {
    /// A new slot, and the borrow the skeleton's builder opens into.
    pub fn new() -> (ObjectSlot, &'static mut MaybeUninit<OpenObject>) {
        let mut slot = Box::new(MaybeUninit::uninit());
        // SAFETY: the box's heap allocation never moves (the box itself may)
        // and is freed only when the slot drops, which the owner's field
        // order puts after the skeleton that holds this borrow; the slot
        // gives out no other reference to it.
        let object: &'static mut MaybeUninit<OpenObject> = unsafe { &mut *(slot.as_mut() as *mut MaybeUninit<OpenObject>) };
        (ObjectSlot(slot), object)
    }
}

impl std::fmt::Debug for ObjectSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObjectSlot")
    }
}
