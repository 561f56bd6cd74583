//! Which threads are running a stream host function queued through cuvmm: the one fact about host
//! functions that the error type needs as much as the driver layer does (a driver's text for a code
//! is not asked for there), so it sits below both. What is done about it is
//! [`callback`](super::callback)'s.

use std::cell::Cell;

thread_local! {
    static IN_HOST_FN: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is running a stream host function queued through cuvmm.
#[inline]
pub fn in_host_function() -> bool {
    IN_HOST_FN.with(Cell::get)
}

/// Marks the calling thread as running a host function until dropped (also when it unwinds).
pub(crate) struct HostFnGuard {
    was: bool,
}

impl HostFnGuard {
    pub(crate) fn enter() -> HostFnGuard {
        HostFnGuard { was: IN_HOST_FN.with(|f| f.replace(true)) }
    }
}

impl Drop for HostFnGuard {
    fn drop(&mut self) {
        IN_HOST_FN.with(|f| f.set(self.was));
    }
}
