//! One thin, `Result`-returning function per driver call, grouped by API area.
//!
//! The safe types call these instead of the entry-point table: each function turns its call's
//! out-pointers into return values and its status into [`Error::Driver`] naming the call, so a
//! driver call's errors are named in one place. A function is `unsafe` only where its soundness
//! depends on its arguments (a raw handle that must be live, memory the driver reads or writes);
//! one that takes only values the driver checks, or creates something new, is safe.
//!
//! Every function takes the entry points ([`Api`]) as its first argument rather than looking the
//! driver up itself: a caller on a hot path (a copy per staging chunk, the allocator's map and
//! unmap) looks it up once, and a destructor deferred to the release thread is handed it.
//!
//! [`Error::Driver`]: crate::Error::Driver

// Each function is a call and its conversions: inlined, it costs what the raw call did.

pub mod ctx;
pub mod device;
pub mod event;
pub mod host;
pub mod ipc;
pub mod mem;
pub mod module;
pub mod pool;
pub mod stream;

use super::Api;
use crate::error::Result;

/// `cuInit(0)`.
#[inline]
pub fn init(api: &Api) -> Result<()> {
    // SAFETY: cuInit takes a flags word that must be 0.
    unsafe { api.cuInit(0) }
}

/// `cuDriverGetVersion`: the driver's CUDA version (13000 for CUDA 13.0).
#[inline]
pub fn driver_version(api: &Api) -> Result<i32> {
    let mut version = 0;
    // SAFETY: the out-pointer is a valid local.
    unsafe { api.cuDriverGetVersion(&mut version) }?;
    Ok(version)
}
