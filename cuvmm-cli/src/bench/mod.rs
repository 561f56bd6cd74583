//! The workloads behind `cuvmm bench …`, as library functions returning plain results.
//!
//! Method: every measured operation is warmed up first; driver-side operations (create, map,
//! unmap…) are timed on the host clock around the call, with the device synchronised where the
//! operation queues device work; results are medians over repetitions, and each result is compared
//! with a reference measured in the same run.

pub mod alloc;
pub mod bandwidth;
pub mod events;
pub mod first_map;
pub mod grow;
pub mod ipc;
pub mod model_trace;
pub mod order;
pub mod overlap;
pub mod peer;
pub mod sleep;
mod sleep_args;
mod sleep_procs;
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

/// `--host-copy` of `bench bandwidth` and `bench sleep`: `plain`, `streaming` or `both` (the
/// default first, then the other; the benchmark takes them in turns).
pub fn parse_host_copies(s: &str) -> std::result::Result<Vec<cuvmm::host::HostCopy>, String> {
    if s.trim().eq_ignore_ascii_case("both") {
        return Ok(cuvmm::host::HostCopy::ALL.to_vec());
    }
    s.parse().map(|c| vec![c]).map_err(|_| format!("{s:?}: plain, streaming or both"))
}

/// Runs `f` and returns its result with the elapsed time.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}

/// Compares a report printer's output with `src/bench/testdata/<name>`, the layout it must keep;
/// `CUVMM_BLESS=1 cargo test -p cuvmm-cli` rewrites the file from the output instead. The expected
/// reports are compiled in, so a test executable copied away from the source tree checks them too.
#[cfg(test)]
pub(crate) fn assert_report(name: &str, got: &[u8]) {
    if std::env::var_os("CUVMM_BLESS").is_some() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bench/testdata").join(name);
        std::fs::write(&path, got).expect("writing the expected report");
        return;
    }
    let want: &[u8] = match name {
        "sleep.txt" => include_bytes!("testdata/sleep.txt"),
        "sleep.jsonl" => include_bytes!("testdata/sleep.jsonl"),
        "sweep.txt" => include_bytes!("testdata/sweep.txt"),
        "sweep.jsonl" => include_bytes!("testdata/sweep.jsonl"),
        other => panic!("no expected report {other} in src/bench/testdata (add it to assert_report)"),
    };
    assert_eq!(String::from_utf8_lossy(got), String::from_utf8_lossy(want), "{name} changed");
}

#[cfg(test)]
mod tests {
    use cuvmm::host::HostCopy;

    #[test]
    fn host_copies_are_one_or_both_the_default_first() {
        assert_eq!(super::parse_host_copies("plain").unwrap(), [HostCopy::Plain]);
        assert_eq!(super::parse_host_copies("streaming").unwrap(), [HostCopy::Streaming]);
        assert_eq!(super::parse_host_copies("Both").unwrap(), [HostCopy::default(), HostCopy::Plain]);
        assert!(super::parse_host_copies("neither").is_err());
    }
}
