//! Streams and the work queued on them: events, host functions, scoped asynchronous copies,
//! synchronous copies, and the record that orders memory use across streams.
//!
//! Reach for [`Stream`] to queue work that runs in order, [`Event`] to order or time work across
//! streams, [`scope`] for asynchronous copies that borrow host memory soundly, [`copy`] for
//! simple synchronous copies, and [`order`] to understand (or join, for your own kernels) how cuvmm
//! keeps streams that share memory from racing.

pub mod copy;
mod event;
pub mod order;
mod scope;

pub use event::Event;
pub(crate) use scope::confirm;
pub use scope::{scope, Landing, Scope};

use crate::context::Context;
use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A CUDA stream: work queued on it runs in order. Destroyed on drop; the driver lets queued work
/// finish first.
pub struct Stream {
    inner: Arc<StreamInner>,
}

/// The stream itself, shared with the access records of memory it used (see [`crate::stream::order`]),
/// which may still need to record an event on it after the `Stream` is dropped.
pub(crate) struct StreamInner {
    pub(crate) ctx: Context,
    pub(crate) raw: CUstream,
    /// Unique for the life of the process: raw handles are reused after a stream is destroyed.
    pub(crate) id: u64,
    /// For a stream another library created: what keeps it alive. Such a stream is never
    /// destroyed here.
    pub(crate) borrowed: Option<Box<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: a stream handle may be used from any thread (the driver API is thread-safe and every
// user makes the context current before each call); `raw` is never dereferenced here.
unsafe impl Send for StreamInner {}
// SAFETY: as above; shared use only enqueues work or queries, which the driver serialises.
unsafe impl Sync for StreamInner {}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Whether `stream`, a stream known only by its handle, is being captured into a CUDA graph.
///
/// # Safety
/// `stream` must be a live stream of the current context, the null handle or
/// `CU_STREAM_LEGACY`, for the duration of the call.
pub unsafe fn is_capturing(stream: CUstream) -> Result<bool> {
    // SAFETY: the stream per the caller's contract.
    let status = unsafe { result::stream::is_capturing(driver()?.api(), stream) }?;
    Ok(status != CU_STREAM_CAPTURE_STATUS_NONE)
}

impl Stream {
    /// A stream that synchronises with the legacy default stream.
    pub fn new(ctx: &Context) -> Result<Stream> {
        Stream::create(ctx, 0, None)
    }

    /// A stream that does not synchronise with the legacy default stream.
    pub fn non_blocking(ctx: &Context) -> Result<Stream> {
        Stream::create(ctx, CU_STREAM_NON_BLOCKING, None)
    }

    /// A non-blocking stream with a priority (lower numbers run first; the driver clamps the value
    /// to [`Stream::priority_range`]).
    pub fn with_priority(ctx: &Context, priority: i32) -> Result<Stream> {
        Stream::create(ctx, CU_STREAM_NON_BLOCKING, Some(priority))
    }

    /// (least, greatest) priority: greatest is numerically lowest.
    pub fn priority_range(ctx: &Context) -> Result<(i32, i32)> {
        ctx.bind()?;
        result::ctx::stream_priority_range(driver()?.api())
    }

    fn create(ctx: &Context, flags: u32, priority: Option<i32>) -> Result<Stream> {
        ctx.bind()?;
        let api = driver()?.api();
        let raw = match priority {
            Some(p) => result::stream::create_with_priority(api, flags, p)?,
            None => result::stream::create(api, flags)?,
        };
        Ok(Stream::from_parts(ctx, raw, None))
    }

    /// Wraps `raw`; `borrowed` is `None` for a stream this crate created and destroys.
    pub(crate) fn from_parts(
        ctx: &Context,
        raw: CUstream,
        borrowed: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Stream {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Stream { inner: Arc::new(StreamInner { ctx: ctx.clone(), raw, id, borrowed }) }
    }

    /// Blocks until all queued work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.ctx.bind()?;
        // SAFETY: the stream is live while self is.
        unsafe { result::stream::synchronize(driver()?.api(), self.inner.raw) }
    }

    /// Whether all queued work is done, without blocking.
    pub fn is_idle(&self) -> Result<bool> {
        self.inner.ctx.bind()?;
        // SAFETY: the stream is live while self is.
        unsafe { result::stream::query(driver()?.api(), self.inner.raw) }
    }

    /// Makes work queued on this stream from now on wait until `event`'s recorded work completes.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        if !event.context().same_as(&self.inner.ctx) {
            return Err(Error::invalid("the event belongs to another context than the stream"));
        }
        self.inner.ctx.bind()?;
        // SAFETY: both handles are live.
        unsafe { result::stream::wait_event(driver()?.api(), self.inner.raw, event.raw()) }
    }

    /// Queues `f` to run on a driver thread once all work queued before it has completed.
    ///
    /// `f` runs exactly once, in stream order, and is dropped after it runs, also when the stream
    /// is dropped first (the driver finishes a destroyed stream's queue). After a device fault the
    /// driver runs no host function: then `f` neither runs nor is dropped (it is leaked). If queuing fails, `f` is
    /// dropped without running: the driver queues nothing when `cuLaunchHostFunc` returns an
    /// error, so the closure is still cuvmm's to drop. A panic in `f` is caught and printed; it
    /// does not unwind into the driver.
    ///
    /// CUDA forbids driver calls inside `f` (they may deadlock). cuvmm makes that harmless: every
    /// cuvmm call that would reach the driver returns [`Error::InHostFunction`] there, and cuvmm
    /// values dropped inside `f` (a buffer it captured, say) are released on a thread of cuvmm's
    /// own right after; see [`crate::driver::callback`].
    pub fn launch_host_fn<F: FnOnce() + Send + 'static>(&self, f: F) -> Result<()> {
        // SAFETY: `F: 'static` outlives anything the driver can do with it.
        unsafe { self.launch_host_fn_unchecked(f) }
    }

    /// [`launch_host_fn`](Self::launch_host_fn) for closures that borrow.
    ///
    /// # Safety
    /// Everything `f` borrows must stay valid until it has run: the caller synchronises this stream
    /// (or a later event on it) before those borrows end.
    pub(crate) unsafe fn launch_host_fn_unchecked<F: FnOnce() + Send>(&self, f: F) -> Result<()> {
        unsafe extern "C" fn trampoline<F: FnOnce()>(data: *mut c_void) {
            // Driver calls made by `f`, or by destructors of what it captured, are refused or
            // deferred while this guard lives.
            let _guard = crate::driver::callback::HostFnGuard::enter();
            // SAFETY: `data` is the Box<F> leaked below, handed to the driver once and run once.
            let f = unsafe { Box::from_raw(data.cast::<F>()) };
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                let msg =
                    p.downcast_ref::<&str>().copied().or(p.downcast_ref::<String>().map(String::as_str));
                eprintln!("cuvmm: a stream host function panicked: {}", msg.unwrap_or("(no message)"));
            }
        }
        self.inner.ctx.bind()?;
        let data = Box::into_raw(Box::new(f)).cast::<c_void>();
        // SAFETY: the trampoline matches CUhostFn and takes ownership of `data` when it runs.
        let r = unsafe {
            result::stream::launch_host_func(driver()?.api(), self.inner.raw, Some(trampoline::<F>), data)
        };
        if r.is_err() {
            // SAFETY: the driver refused it, so it will never run: the box is still ours.
            drop(unsafe { Box::from_raw(data.cast::<F>()) });
        }
        r
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUstream {
        self.inner.raw
    }

    /// The stream's context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// A number that names this stream for the life of the process (raw handles are reused).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    pub(crate) fn inner(&self) -> &Arc<StreamInner> {
        &self.inner
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("id", &self.inner.id).field("raw", &self.inner.raw).finish()
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if let Some(owner) = self.borrowed.take() {
            // Its owner destroys it, maybe right now (cudarc's stream does when its last handle
            // goes): that is a driver call too, so it goes through the release path.
            crate::driver::callback::release(move || drop(owner));
            return;
        }
        crate::driver::callback::release_in(&self.ctx, self.raw, |api, raw| {
            // SAFETY: destroyed once, by the last owner (the `Stream` or a record of memory it
            // used); the driver defers the release until queued work completes.
            crate::error::record_drop(unsafe { result::stream::destroy(api, raw) });
        });
    }
}
