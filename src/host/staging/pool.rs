//! The ring's copying threads, kept for its lifetime.

use super::progress::OnUnwind;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// A pool job that runs `job` on the first `n` threads to start it; the others return at once.
pub(super) fn first_of(n: usize, job: &(dyn Fn() + Sync)) -> impl Fn() + Sync + '_ {
    let started = AtomicUsize::new(0);
    move || {
        if started.fetch_add(1, Ordering::Relaxed) < n {
            job()
        }
    }
}

/// A job for the pool's threads, its lifetime erased. [`Pool::run`] returns only once every
/// thread is done with it, so the closure it points to, and everything that borrows, outlives
/// every use.
#[derive(Clone, Copy)]
pub(super) struct JobRef(*const (dyn Fn() + Sync + 'static));

// SAFETY: the pointee is `Sync` (shared calls from several threads are allowed), and `Pool::run`
// keeps it alive until no thread uses it any more (see the type's documentation).
unsafe impl Send for JobRef {}

pub(super) struct PoolState {
    job: Option<JobRef>,
    /// Bumped for each job; each thread runs each job once.
    generation: u64,
    /// Threads not yet done with the current job.
    busy: usize,
    /// A thread's run of the current job panicked.
    panicked: bool,
    shutdown: bool,
}

pub(super) struct PoolShared {
    state: Mutex<PoolState>,
    start: Condvar,
    done: Condvar,
}

impl PoolShared {
    pub(super) fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Threads kept for a ring's lifetime, each running every job it is given once: starting
/// threads for each transfer cost tens of microseconds per thread.
pub(super) struct Pool {
    shared: Arc<PoolShared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    pub(super) fn new(threads: usize) -> Result<Pool> {
        let shared = Arc::new(PoolShared {
            state: Mutex::new(PoolState {
                job: None,
                generation: 0,
                busy: 0,
                panicked: false,
                shutdown: false,
            }),
            start: Condvar::new(),
            done: Condvar::new(),
        });
        let mut pool = Pool { shared, threads: Vec::with_capacity(threads) };
        for _ in 0..threads {
            let shared = Arc::clone(&pool.shared);
            let spawned =
                std::thread::Builder::new().name("cuvmm-staging".into()).spawn(move || work(&shared));
            match spawned {
                Ok(t) => pool.threads.push(t),
                // Dropping `pool` stops the threads started so far.
                Err(e) => return Err(Error::invalid(format!("cannot start a staging thread: {e}"))),
            }
        }
        Ok(pool)
    }

    /// Runs `job` on every thread of the pool and `here` on this one, then waits until every
    /// thread is done with `job`. If `here` panics, `cancel` (which must make `job` and `here`
    /// return soon) runs and the threads are still waited for before the panic goes on; if `job`
    /// panics on a thread, `cancel` runs there (so that `here` does not wait for its work for
    /// ever) and the panic is passed on after the wait.
    pub(super) fn run<R>(
        &self,
        job: &(dyn Fn() + Sync),
        here: impl FnOnce() -> R,
        cancel: impl Fn() + Sync,
    ) -> R {
        /// Waits for the threads when dropped, so also while unwinding from `here`.
        struct Wait<'p, C: Fn()> {
            pool: &'p Pool,
            cancel: Option<C>,
        }
        impl<C: Fn()> Drop for Wait<'_, C> {
            fn drop(&mut self) {
                if let Some(cancel) = &self.cancel {
                    cancel();
                }
                let mut g = self.pool.shared.lock();
                while g.busy > 0 {
                    g = self.pool.shared.done.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                g.job = None;
            }
        }
        if self.threads.is_empty() {
            job();
            return here();
        }
        let cancel = &cancel;
        let guarded = || {
            let _cancel = OnUnwind(cancel);
            job()
        };
        let job: &(dyn Fn() + Sync) = &guarded;
        // SAFETY: only the lifetime changes; `Wait` below keeps `job` borrowed until no thread
        // uses it (see JobRef).
        let erased = unsafe {
            std::mem::transmute::<*const (dyn Fn() + Sync + '_), *const (dyn Fn() + Sync + 'static)>(job)
        };
        {
            let mut g = self.shared.lock();
            g.job = Some(JobRef(erased));
            g.generation += 1;
            g.busy = self.threads.len();
            g.panicked = false;
        }
        self.shared.start.notify_all();
        let mut wait = Wait { pool: self, cancel: Some(cancel) };
        let r = here();
        wait.cancel = None;
        drop(wait);
        if std::mem::take(&mut self.shared.lock().panicked) {
            std::panic::panic_any("a cuvmm staging thread panicked");
        }
        r
    }
}

/// A pool thread: runs each job once, until the pool is dropped.
pub(super) fn work(shared: &PoolShared) {
    let mut seen = 0;
    loop {
        let job = {
            let mut g = shared.lock();
            loop {
                if g.shutdown {
                    return;
                }
                if g.generation != seen {
                    seen = g.generation;
                    break g.job;
                }
                g = shared.start.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        let ok = match job {
            Some(job) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: `Pool::run` published this job and keeps it alive until `busy` reaches
                // 0, which this thread's decrement below is part of.
                unsafe { (*job.0)() }
            }))
            .is_ok(),
            None => true,
        };
        let mut g = shared.lock();
        g.panicked |= !ok;
        g.busy -= 1;
        if g.busy == 0 {
            shared.done.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.start.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::staging::progress::Shared;

    #[test]
    fn the_pool_runs_each_job_once_per_thread_and_waits_for_it() {
        let pool = Pool::new(3).unwrap();
        for round in 1..=50 {
            let ran = AtomicUsize::new(0);
            let claimed = AtomicUsize::new(0);
            let job = || {
                ran.fetch_add(1, Ordering::SeqCst);
                while claimed.fetch_add(1, Ordering::SeqCst) < 100 {}
            };
            let here = pool.run(&job, || round, || {});
            assert_eq!(here, round);
            assert_eq!(ran.load(Ordering::SeqCst), 3, "every thread ran the job once, and is done");
        }
    }
    #[test]
    fn a_job_limited_to_some_threads_runs_on_that_many() {
        let pool = Pool::new(4).unwrap();
        for n in [1, 2, 4, 9] {
            let ran = AtomicUsize::new(0);
            let count = || {
                ran.fetch_add(1, Ordering::SeqCst);
            };
            let job = first_of(n, &count);
            pool.run(&job, || (), || {});
            assert_eq!(ran.load(Ordering::SeqCst), n.min(4), "limit {n}");
        }
    }
    #[test]
    fn a_copying_thread_that_panics_abandons_the_transfer_instead_of_leaving_it_waiting() {
        // The job's panic cancels the transfer on its thread, so the issuing thread's wait for its
        // pieces ends, and the panic is passed on after the threads are done.
        let pool = Pool::new(2).unwrap();
        let shared = Shared::new(1, 1, |_| Some(0));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(
                &|| panic!("a copying thread"),
                || shared.wait_until(|| false),
                || shared.fail(Error::invalid("the staging transfer was abandoned")),
            )
        }));
        assert!(r.is_err(), "the thread's panic is passed on");
        assert!(shared.outcome(Ok(())).unwrap_err().to_string().contains("abandoned"));
        // Without a panic the guard does nothing.
        let calm = Shared::new(1, 1, |_| Some(0));
        drop(OnUnwind(|| calm.fail(Error::invalid("never"))));
        assert!(calm.outcome(Ok(())).is_ok());
    }
    #[test]
    fn a_panic_here_cancels_and_still_waits_and_a_panic_in_a_thread_is_passed_on() {
        let pool = Pool::new(2).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let left = AtomicUsize::new(0);
        let job = || {
            while !stop.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            left.fetch_add(1, Ordering::SeqCst);
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&job, || panic!("issuer"), || stop.store(true, Ordering::SeqCst))
        }));
        assert!(r.is_err());
        assert_eq!(left.load(Ordering::SeqCst), 2, "both threads finished before the panic went on");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|| panic!("worker"), || (), || {})
        }));
        assert!(r.is_err());
        // The pool still works.
        let ran = AtomicUsize::new(0);
        pool.run(
            &|| {
                ran.fetch_add(1, Ordering::SeqCst);
            },
            || (),
            || {},
        );
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }
}
