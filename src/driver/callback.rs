//! Code that runs inside a stream host function.
//!
//! CUDA forbids driver calls from a host function (`cuLaunchHostFunc`): the driver thread that
//! runs it holds the stream, so a call that waits for that stream deadlocks, and the others are
//! undefined. A closure queued with [`Stream::launch_host_fn`](crate::Stream::launch_host_fn) is
//! ordinary safe code, though: it may copy, launch, or simply drop a cuvmm value whose destructor
//! frees memory. So cuvmm marks the threads while they run a host function and
//!
//! * every entry point of [`Api`](super::Api) called there returns
//!   [`Error::InHostFunction`] without reaching the driver;
//! * destructors hand their driver calls to a release function, which runs them at once on any other
//!   thread and, on a host-function thread, passes them to a thread of cuvmm's own that runs them
//!   in order. The memory is freed shortly after the host function returns
//!   ([`flush_deferred_releases`] waits for it).

pub use super::host_fn::in_host_function;
pub(crate) use super::host_fn::HostFnGuard;
use crate::error::{Error, Result};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

/// The error every driver call made inside a host function returns.
pub(crate) fn refuse(call: &'static str) -> Error {
    Error::InHostFunction { call }
}

type Job = Box<dyn FnOnce() + Send>;

/// The sending end of the release thread's queue, started on first use.
fn releaser() -> &'static Mutex<Sender<Job>> {
    static QUEUE: OnceLock<Mutex<Sender<Job>>> = OnceLock::new();
    QUEUE.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("cuvmm-release".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .expect("cuvmm could not start its release thread");
        Mutex::new(tx)
    })
}

/// Runs `f`, a destructor's driver calls, now; inside a host function, on cuvmm's release thread
/// instead, after the calls deferred before it.
pub(crate) fn release(f: impl FnOnce() + Send + 'static) {
    if !in_host_function() {
        f();
        return;
    }
    let tx = releaser().lock().unwrap_or_else(|e| e.into_inner());
    // The receiver lives as long as the process: the thread never returns while a sender exists.
    let _ = tx.send(Box::new(f));
}

/// A context a deferred release makes current before its driver call. A clone travels with the
/// release and keeps the context alive until the call has run. The context type lives in a layer
/// above the driver's, so this layer names only what it asks of it.
pub(crate) trait Bind: Clone + Send + 'static {
    /// Makes the context current on the calling thread.
    fn bind(&self) -> Result<()>;
}

/// A destructor's driver call on `handle`: `f` runs with the driver's entry points and `ctx`
/// current, now or, inside a host function, on the release thread (see [`release`]). Nothing runs
/// when no driver is loaded: then nothing was ever created.
pub(crate) fn release_in<C: Bind, H: Sendable + 'static>(
    ctx: &C,
    handle: H,
    f: impl FnOnce(&super::Api, H) + Send + 'static,
) {
    let (ctx, handle) = (ctx.clone(), Handle(handle));
    release(move || {
        let handle = handle;
        if let Ok(d) = super::driver() {
            let _ = ctx.bind();
            f(d.api(), handle.0);
        }
    });
}

/// Blocks until every release deferred from a host function before this call has run.
///
/// Returns [`Error::InHostFunction`] when called from a host function itself: a release may wait
/// for the very stream that host function holds.
pub fn flush_deferred_releases() -> Result<()> {
    if in_host_function() {
        return Err(refuse("flush_deferred_releases"));
    }
    let (done_tx, done_rx) = channel::<()>();
    {
        let tx = releaser().lock().unwrap_or_else(|e| e.into_inner());
        let _ = tx.send(Box::new(move || {
            let _ = done_tx.send(());
        }));
    }
    let _ = done_rx.recv();
    Ok(())
}

/// A driver handle moved into a deferred release.
///
/// Driver handles (pointers, streams, events, contexts) are process-wide values that any thread
/// may pass to the driver, but Rust sees raw pointers as bound to their thread; this wrapper lets
/// them, and only them, travel to the release thread.
pub(crate) struct Handle<T>(pub(crate) T);

/// What a [`Handle`] may carry to another thread.
///
/// # Safety
/// Only for values whose move to another thread is sound: a driver handle (never dereferenced on
/// the host, accepted by the driver from any thread), plain numbers, or a pointer that owns
/// values which are themselves `Send`. A value bound to its thread (`Rc`, a reference to a
/// `Cell`) must never implement it: the release thread would then share it with its owner.
pub(crate) unsafe trait Sendable {}

// SAFETY: every opaque driver handle is a `*mut c_void` (`sys::CUstream` and the others), which
// the driver takes from any thread; cuvmm never dereferences one on the host.
unsafe impl Sendable for *mut std::ffi::c_void {}
// SAFETY: numbers (device addresses, allocation handles, lengths) are `Send`.
unsafe impl Sendable for usize {}
// SAFETY: as above.
unsafe impl Sendable for u64 {}
// SAFETY: the owning pointer of a pinned buffer moves its values with it, as a `Box<T>` does, and
// `T: Send` makes that move sound.
unsafe impl<T: Send> Sendable for std::ptr::NonNull<T> {}
// SAFETY: each part is `Sendable`.
unsafe impl<A: Sendable, B: Sendable> Sendable for (A, B) {}
// SAFETY: each part is `Sendable`.
unsafe impl<A: Sendable, B: Sendable, C: Sendable> Sendable for (A, B, C) {}

// SAFETY: `Sendable` is implemented only where moving the value to another thread is sound.
unsafe impl<T: Sendable> Send for Handle<T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Asks whether `Handle<T>` is `Send` at compile time: the inherent `send` exists only where
    /// the bound holds, and method lookup prefers it to the trait's.
    struct Probe<T>(std::marker::PhantomData<T>);
    trait NotSend {
        fn send(&self) -> bool {
            false
        }
    }
    impl<T> NotSend for Probe<T> {}
    impl<T: Send> Probe<T> {
        fn send(&self) -> bool {
            true
        }
    }

    macro_rules! handle_is_send {
        ($t:ty) => {
            Probe::<Handle<$t>>(std::marker::PhantomData).send()
        };
    }

    #[test]
    fn only_driver_handles_numbers_and_owners_of_send_values_travel_to_the_release_thread() {
        assert!(handle_is_send!(crate::driver::sys::CUstream));
        assert!(handle_is_send!((usize, usize, usize)));
        assert!(handle_is_send!(std::ptr::NonNull<u8>));
        assert!(!handle_is_send!(std::rc::Rc<u8>), "an Rc would be shared with its owner's thread");
        assert!(!handle_is_send!(&'static Cell<u8>));
    }

    #[test]
    fn the_guard_marks_the_thread_and_restores_it() {
        assert!(!in_host_function());
        {
            let _g = HostFnGuard::enter();
            assert!(in_host_function());
            {
                let _inner = HostFnGuard::enter();
                assert!(in_host_function());
            }
            assert!(in_host_function());
            let other = std::thread::spawn(in_host_function).join().unwrap();
            assert!(!other, "only the thread running the host function is marked");
        }
        assert!(!in_host_function());
    }

    #[test]
    fn releases_run_inline_normally_and_deferred_inside_a_host_function() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let ran_on = Arc::new(Mutex::new(Vec::new()));
        let here = std::thread::current().id();
        let r = Arc::clone(&ran_on);
        release(move || r.lock().unwrap().push(std::thread::current().id()));
        assert_eq!(*ran_on.lock().unwrap(), vec![here]);

        let count = Arc::new(AtomicUsize::new(0));
        {
            let _g = HostFnGuard::enter();
            for _ in 0..3 {
                let (r, c) = (Arc::clone(&ran_on), Arc::clone(&count));
                release(move || {
                    r.lock().unwrap().push(std::thread::current().id());
                    c.fetch_add(1, Ordering::SeqCst);
                });
            }
            assert!(matches!(flush_deferred_releases(), Err(Error::InHostFunction { .. })));
        }
        flush_deferred_releases().unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 3);
        let ids = ran_on.lock().unwrap();
        assert!(ids[1..].iter().all(|id| *id != here), "deferred releases run on another thread");
    }

    #[test]
    fn driver_calls_are_refused_inside_a_host_function() {
        let _g = HostFnGuard::enter();
        // Whether or not a driver is installed, the call is refused before it is looked up.
        let r = crate::context::Context::for_ordinal(0);
        assert!(matches!(r, Err(Error::InHostFunction { .. })), "{r:?}");
    }
}
