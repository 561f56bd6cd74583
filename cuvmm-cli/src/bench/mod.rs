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
pub mod order;
pub mod overlap;
pub mod peer;
pub mod sleep;
pub mod soak;
pub mod trace;
pub mod vmm_ops;

use std::time::{Duration, Instant};

/// An invalid-argument error for a benchmark's own checks.
pub fn invalid(msg: impl std::fmt::Display) -> cuvmm::Error {
    cuvmm::Error::InvalidArgument(msg.to_string())
}

/// An unsupported-feature error for a benchmark's own checks.
pub fn unsupported(what: impl std::fmt::Display, why: impl std::fmt::Display) -> cuvmm::Error {
    cuvmm::Error::Unsupported { what: what.to_string(), why: why.to_string() }
}

/// The median of some samples (the mean of the two middle ones for an even count); 0 for none.
pub fn median(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

/// Runs `f` and returns its result with the elapsed time.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn medians() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0]), 3.0);
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
