//! The memory fraction (`torch.cuda.set_per_process_memory_fraction`): a limit on the bytes a
//! device's allocator hands out, enforced at each request. A request that would take the live
//! bytes past it is refused as out of memory, which PyTorch raises as `torch.OutOfMemoryError`.
//!
//! The limit counts live blocks (`live` of the counters), not the pages cuvmm keeps cached for
//! them: cached pages serve later requests of this process or go back to the driver at an empty
//! cache, and counting them would refuse requests that cached memory already serves.
//!
//! A fraction of 0, or one that rounds down to 0 bytes, is a limit of 0 bytes, as in PyTorch's own
//! allocator: every request is refused. Only a fraction of 1 removes the limit.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// The limit of each device in bytes (`None`: none), by ordinal.
static LIMITS: Mutex<Vec<Option<u64>>> = Mutex::new(Vec::new());
/// Whether any device has a limit: requests read it without the lock.
static ANY: AtomicBool = AtomicBool::new(false);

/// Sets `device`'s limit to `fraction` of its `total` bytes; 1 or more removes it.
pub(crate) fn set(device: c_int, fraction: f64, total: u64) -> Result<(), String> {
    let d = usize::try_from(device).map_err(|_| format!("no device {device}"))?;
    if !(0.0..=1.0).contains(&fraction) {
        return Err(format!("memory fraction {fraction} is not between 0 and 1"));
    }
    let bytes = (fraction < 1.0).then_some((fraction * total as f64) as u64);
    let mut limits = LIMITS.lock().unwrap_or_else(|e| e.into_inner());
    if limits.len() <= d {
        limits.resize(d + 1, None);
    }
    limits[d] = bytes;
    ANY.store(limits.iter().any(Option::is_some), Ordering::Release);
    Ok(())
}

/// `device`'s limit in bytes, if it has one.
pub(crate) fn of(device: c_int) -> Option<u64> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let limits = LIMITS.lock().unwrap_or_else(|e| e.into_inner());
    usize::try_from(device).ok().and_then(|d| limits.get(d).copied().flatten())
}

/// Refuses `size` more bytes on `device` past its limit, `live()` bytes being handed out now
/// (asked only where a limit is set: it takes the allocator's lock).
#[inline]
pub(crate) fn check(device: c_int, size: u64, live: impl FnOnce() -> u64) -> Result<(), String> {
    // Every request asks: mostly no device has a limit, and the answer is one atomic load.
    if !ANY.load(Ordering::Acquire) {
        return Ok(());
    }
    check_limit(device, size, live)
}

#[cold]
fn check_limit(device: c_int, size: u64, live: impl FnOnce() -> u64) -> Result<(), String> {
    let Some(limit) = of(device) else {
        return Ok(());
    };
    let live = live();
    if live.saturating_add(size) > limit {
        return Err(format!(
            "out of memory: {size} bytes more than the memory fraction allows on device {device} \
             ({live} bytes live, limit {limit} bytes)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_limits_live_bytes_and_one_removes_the_limit() {
        // Device 7 only: the limits belong to the whole process, and other tests use device 0.
        set(7, 0.5, 1000).unwrap();
        assert_eq!(of(7), Some(500));
        assert!(check(7, 500, || 0).is_ok());
        let e = check(7, 101, || 400).unwrap_err();
        assert!(e.contains("out of memory") && e.contains("limit 500"), "{e}");
        assert!(check(6, 1 << 40, || 0).is_ok(), "other devices have no limit");
        for bad in [-0.1, 1.5, f64::NAN] {
            assert!(set(7, bad, 1000).unwrap_err().contains("not between 0 and 1"));
            assert_eq!(of(7), Some(500), "a refused fraction changes nothing");
        }
        assert!(set(-1, 0.5, 1000).is_err());
        set(7, 1.0, 1000).unwrap();
        assert_eq!(of(7), None);
        assert!(check(7, 1 << 40, || 0).is_ok());
    }

    #[test]
    fn a_fraction_of_zero_or_of_less_than_a_byte_refuses_every_request() {
        // Device 8 only, as above.
        for fraction in [0.0, 1e-4] {
            set(8, fraction, 1000).unwrap();
            assert_eq!(of(8), Some(0), "fraction {fraction}: a limit of 0 bytes, not none");
            let e = check(8, 1, || 0).unwrap_err();
            assert!(e.contains("out of memory") && e.contains("limit 0 bytes"), "{e}");
        }
        set(8, 1.0, 1000).unwrap();
        assert!(check(8, 1, || 0).is_ok());
    }
}
