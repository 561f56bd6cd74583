//! The workloads behind `cuvmm bench …`, as library functions returning plain results.
//!
//! Method: every measured operation is warmed up first; driver-side operations (create, map,
//! unmap…) are timed on the host clock around the call, with the device synchronised where the
//! operation queues device work; results are medians over repetitions, and each result is compared
//! with a reference measured in the same run.

pub mod alloc;
pub mod bandwidth;
pub mod events;
pub mod grow;
pub mod ipc;
pub mod model_trace;
pub mod order;
pub mod overlap;
pub mod peer;
pub mod sleep;
pub mod soak;
pub mod stats;
pub mod trace;
pub mod vmm_ops;

pub use stats::median;
use std::time::{Duration, Instant};

/// An invalid-argument error for a benchmark's own checks.
pub fn invalid(msg: impl std::fmt::Display) -> cuvmm::Error {
    cuvmm::Error::InvalidArgument(msg.to_string())
}

/// An unsupported-feature error for a benchmark's own checks.
pub fn unsupported(what: impl std::fmt::Display, why: impl std::fmt::Display) -> cuvmm::Error {
    cuvmm::Error::Unsupported { what: what.to_string(), why: why.to_string() }
}

/// Runs `f` and returns its result with the elapsed time.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}
