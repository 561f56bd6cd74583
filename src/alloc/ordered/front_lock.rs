//! The lock of a stream's front: one atomic swap to take it and a plain store to give it back.
//!
//! A front is locked twice per cached pair (the request's take, the free's give), almost always
//! by the one thread driving its stream, and held for a few map operations. A `std` mutex costs
//! two atomic read-modify-writes per hold (its release swaps, to learn whether a waiter sleeps),
//! four per pair. Here the release is a store, so a waiter cannot be woken: it spins briefly,
//! then yields, then sleeps in short growing steps. That suits the holders there are: the fast
//! paths and the device-wide path's drains hold a front for map operations; the device-wide path
//! holds it across a driver call (an event record, a query) only for the requesting stream's own
//! front, which only another thread on that same stream would wait for.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A value behind a lock whose uncontended hold costs one atomic swap.
pub(crate) struct FrontLock<T> {
    held: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a `FrontGuard`, and at most one guard exists at a
// time (the swap in `lock` admits one holder, the Release store in the guard's drop and the
// Acquire swap of the next holder order their accesses): a `Mutex<T>`'s conditions, `T: Send`.
unsafe impl<T: Send> Sync for FrontLock<T> {}

/// Spins on a held lock before yielding, then sleeping (the holder may be descheduled, or in a
/// driver call); the longest sleep stays near a driver call's length, so that a waiter on a
/// contended front (two threads on one stream) is not left sleeping long after the release.
const SPINS: u32 = 100;
const YIELDS: u32 = 10;
const LONGEST_SLEEP: Duration = Duration::from_micros(20);

impl<T> FrontLock<T> {
    pub(crate) const fn new(value: T) -> Self {
        FrontLock { held: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    /// Waits for the lock and takes it. A holder that panicked released it as it unwound; what it
    /// left is used as is, as the `std` mutexes of the allocator are (their poison ignored).
    #[inline]
    pub(crate) fn lock(&self) -> FrontGuard<'_, T> {
        if self.held.swap(true, Ordering::Acquire) {
            self.lock_contended();
        }
        FrontGuard { lock: self }
    }

    #[cold]
    fn lock_contended(&self) {
        let mut round = 0u32;
        let mut sleep = Duration::from_micros(1);
        loop {
            // Reads only until it looks free: the swap would take the line from the holder.
            while self.held.load(Ordering::Relaxed) {
                if round < SPINS {
                    std::hint::spin_loop();
                } else if round < SPINS + YIELDS {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(sleep);
                    sleep = (sleep * 2).min(LONGEST_SLEEP);
                }
                round = round.saturating_add(1);
            }
            if !self.held.swap(true, Ordering::Acquire) {
                return;
            }
        }
    }
}

/// The hold of a [`FrontLock`]; dropping it releases the lock.
pub(crate) struct FrontGuard<'a, T> {
    lock: &'a FrontLock<T>,
}

impl<T> Deref for FrontGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see the `Sync` impl), so nothing writes meanwhile.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for FrontGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the only one and is borrowed mutably: no other reference exists.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for FrontGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.held.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_holder_at_a_time() {
        // Increments that are not atomic: a second holder inside would lose some of them.
        let lock = Arc::new(FrontLock::new((0u64, false)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u32 {
                        let mut g = lock.lock();
                        assert!(!g.1, "two holders at once");
                        g.1 = true;
                        let v = g.0;
                        if i % 1000 == 0 {
                            // Held across a pause, as a driver call holds it: the others sleep.
                            std::thread::sleep(Duration::from_micros(50));
                        }
                        g.0 = v + 1;
                        g.1 = false;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(lock.lock().0, 80_000);
    }

    #[test]
    fn a_panicking_holder_releases_it() {
        let lock = FrontLock::new(1u32);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut g = lock.lock();
            *g = 2;
            panic!("inside the hold");
        }));
        assert!(r.is_err());
        assert_eq!(*lock.lock(), 2);
    }
}
