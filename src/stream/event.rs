//! Events: markers recorded into streams, for ordering, waiting and device-side timing.

use crate::context::Context;
use crate::driver::{driver, result, sys::*};
use crate::error::{Error, Result};
use crate::stream::Stream;

/// A CUDA event. Destroyed on drop.
pub struct Event {
    ctx: Context,
    raw: CUevent,
    timing: bool,
}

// SAFETY: event handles may be used from any thread; this type binds its context before each call
// and never dereferences the handle.
unsafe impl Send for Event {}
// SAFETY: as above; recording, querying and waiting are thread-safe driver calls.
unsafe impl Sync for Event {}

impl Event {
    /// An event that records time (for [`Event::elapsed_ms`]).
    pub fn new(ctx: &Context) -> Result<Event> {
        Event::create(ctx, 0)
    }

    /// An event without timing: cheaper to record and wait on, for ordering only.
    pub fn without_timing(ctx: &Context) -> Result<Event> {
        Event::create(ctx, CU_EVENT_DISABLE_TIMING)
    }

    /// A timing event whose [`synchronize`](Self::synchronize) blocks the thread instead of spinning.
    pub fn blocking(ctx: &Context) -> Result<Event> {
        Event::create(ctx, CU_EVENT_BLOCKING_SYNC)
    }

    pub(crate) fn create(ctx: &Context, flags: u32) -> Result<Event> {
        ctx.bind()?;
        let raw = result::event::create(driver()?.api(), flags)?;
        Ok(Event { ctx: ctx.clone(), raw, timing: flags & CU_EVENT_DISABLE_TIMING == 0 })
    }

    /// Records the event at the current end of `stream`'s queue.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if !stream.context().same_as(&self.ctx) {
            return Err(Error::invalid("the stream belongs to another context than the event"));
        }
        self.ctx.bind()?;
        // SAFETY: both handles are live.
        unsafe { result::event::record(driver()?.api(), self.raw, stream.raw()) }
    }

    /// Records on a stream of this event's context (the caller checks that).
    pub(crate) fn record_on(&self, stream: &crate::stream::StreamInner) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: both handles are live.
        unsafe { result::event::record(driver()?.api(), self.raw, stream.raw) }
    }

    /// Records the event at the current end of the queue of `stream`, a stream known only by its
    /// handle (one another library made, such as PyTorch's).
    ///
    /// # Safety
    /// `stream` must be a live stream of this event's context, the null handle or
    /// `CU_STREAM_LEGACY`, for the duration of the call.
    pub unsafe fn record_raw(&self, stream: CUstream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the event is live; the stream per the caller's contract.
        unsafe { result::event::record(driver()?.api(), self.raw, stream) }
    }

    /// Makes work queued on `stream` from now on wait until this event's recorded work completes
    /// (legal during a capture, where it orders the captured work).
    ///
    /// # Safety
    /// As for [`record_raw`](Self::record_raw).
    pub unsafe fn wait_raw(&self, stream: CUstream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the event is live; the stream per the caller's contract.
        unsafe { crate::driver::result::stream::wait_event(driver()?.api(), stream, self.raw) }
    }

    /// [`synchronize`](Self::synchronize) with the calling thread's capture mode relaxed for the
    /// call, so that waiting while another thread captures in global mode neither fails nor ends
    /// that capture in error.
    pub fn synchronize_relaxed(&self) -> Result<()> {
        self.relaxed(|| self.synchronize())
    }

    fn relaxed<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let api = driver()?.api();
        let old = match result::stream::exchange_capture_mode(api, CU_STREAM_CAPTURE_MODE_RELAXED) {
            Ok(old) => Some(old),
            // Drivers before 10.1 have no capture modes: nothing to relax.
            Err(Error::Unsupported { .. }) => None,
            Err(e) => return Err(e),
        };
        let r = f();
        if let Some(old) = old {
            let _ = result::stream::exchange_capture_mode(api, old);
        }
        r
    }

    /// [`is_complete`](Self::is_complete) with the calling thread's capture mode relaxed for the
    /// call, so that asking while another thread captures in global mode does not end that
    /// capture in error.
    pub fn is_complete_relaxed(&self) -> Result<bool> {
        self.relaxed(|| self.is_complete())
    }

    /// Blocks until the work before the last record has completed (at once if never recorded).
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the handle is live.
        unsafe { result::event::synchronize(driver()?.api(), self.raw) }
    }

    /// Whether the work before the last record has completed.
    pub fn is_complete(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: the handle is live.
        unsafe { result::event::query(driver()?.api(), self.raw) }
    }

    /// Milliseconds of device time from `self` to `later` (both recorded and complete).
    pub fn elapsed_ms(&self, later: &Event) -> Result<f32> {
        if !self.timing || !later.timing {
            return Err(Error::invalid("elapsed time needs two events created with timing"));
        }
        self.ctx.bind()?;
        // SAFETY: both handles are live.
        unsafe { result::event::elapsed_time(driver()?.api(), self.raw, later.raw) }
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// The event's context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("raw", &self.raw).field("timing", &self.timing).finish()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        crate::driver::callback::release_in(&self.ctx, self.raw, |api, raw| {
            // SAFETY: destroyed once; the driver lets a pending record complete first.
            crate::error::record_drop(unsafe { result::event::destroy(api, raw) });
        });
    }
}
