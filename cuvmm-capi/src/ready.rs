//! The allocators made so far, found with one atomic load: every `cuvmm_malloc` and `cuvmm_free`
//! looks its device's up, and the way through `GLOBAL` (its set-up result, the device count, the
//! device's `OnceLock` and its result) costs several times that on the cached pair.

use cuvmm_lib::alloc::StreamAllocator;
use std::ffi::c_int;
use std::sync::atomic::{AtomicPtr, Ordering};

/// Devices found here; others take the way through `GLOBAL`, which serves every ordinal.
const DEVICES: usize = 64;

// Only the array's initial value: each element is a fresh copy of it.
#[allow(clippy::declare_interior_mutable_const)]
const NONE: AtomicPtr<StreamAllocator> = AtomicPtr::new(std::ptr::null_mut());
static READY: [AtomicPtr<StreamAllocator>; DEVICES] = [NONE; DEVICES];

/// `device`'s allocator, if [`set`] has recorded it.
#[inline]
pub(crate) fn get(device: c_int) -> Option<&'static StreamAllocator> {
    let slot = READY.get(usize::try_from(device).ok()?)?;
    let p = slot.load(Ordering::Acquire);
    // SAFETY: a non-null pointer was stored by `set` from a `&'static StreamAllocator` (the one in
    // `GLOBAL`, which is never dropped or replaced); the Release store and this Acquire load order
    // its construction before this use.
    unsafe { p.as_ref() }
}

/// Records `device`'s allocator, made once for the whole process.
pub(crate) fn set(device: c_int, a: &'static StreamAllocator) {
    if let Some(slot) = usize::try_from(device).ok().and_then(|d| READY.get(d)) {
        slot.store(a as *const StreamAllocator as *mut StreamAllocator, Ordering::Release);
    }
}
