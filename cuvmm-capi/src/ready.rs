//! The allocators made so far, found with one atomic load: every `cuvmm_malloc` and `cuvmm_free`
//! looks its device's up, and the way through the set-up (its result, the device count, the
//! device's `OnceLock` and its result) costs several times that on the cached pair.

use cuvmm_lib::alloc::StreamAllocator;
use std::ffi::c_int;
use std::sync::atomic::{AtomicPtr, Ordering};

/// Devices found here; others take the way through the set-up, which serves every ordinal.
const DEVICES: usize = 64;

// Only the array's initial value: each element is a fresh copy of it.
#[allow(clippy::declare_interior_mutable_const)]
const NONE: AtomicPtr<StreamAllocator> = AtomicPtr::new(std::ptr::null_mut());

/// Each device's allocator once made, by ordinal.
pub(crate) struct Ready([AtomicPtr<StreamAllocator>; DEVICES]);

impl Ready {
    pub(crate) const fn new() -> Ready {
        Ready([NONE; DEVICES])
    }

    /// `device`'s allocator, if [`set`](Self::set) has recorded it.
    #[inline]
    pub(crate) fn get(&self, device: c_int) -> Option<&'static StreamAllocator> {
        let slot = self.0.get(usize::try_from(device).ok()?)?;
        let p = slot.load(Ordering::Acquire);
        // SAFETY: a non-null pointer was stored by `set` from a `&'static StreamAllocator` (one
        // the process's set-up holds, never dropped or replaced); the Release store and this
        // Acquire load order its construction before this use.
        unsafe { p.as_ref() }
    }

    /// Records `device`'s allocator, made once for the whole process.
    pub(crate) fn set(&self, device: c_int, a: &'static StreamAllocator) {
        if let Some(slot) = usize::try_from(device).ok().and_then(|d| self.0.get(d)) {
            slot.store(a as *const StreamAllocator as *mut StreamAllocator, Ordering::Release);
        }
    }
}
