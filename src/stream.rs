//! Streams.

use crate::context::Context;
use crate::driver::{driver, sys::*};
use crate::error::Result;

/// A CUDA stream: work queued on it runs in order. Destroyed on drop; the driver lets queued work
/// finish first.
pub struct Stream {
    ctx: Context,
    raw: CUstream,
}

// SAFETY: a stream handle may be used from any thread (the driver API is thread-safe and this type
// makes its context current before each call); `raw` is never dereferenced here.
unsafe impl Send for Stream {}
// SAFETY: as above; shared use only enqueues work or queries, which the driver serialises.
unsafe impl Sync for Stream {}

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
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: both out-pointers are valid locals.
        unsafe { driver()?.api().cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }?;
        Ok((least, greatest))
    }

    fn create(ctx: &Context, flags: u32, priority: Option<i32>) -> Result<Stream> {
        ctx.bind()?;
        let api = driver()?.api();
        let mut raw: CUstream = std::ptr::null_mut();
        match priority {
            // SAFETY: out-pointer valid; flags are CU_STREAM_* values.
            Some(p) => unsafe { api.cuStreamCreateWithPriority(&mut raw, flags, p) }?,
            // SAFETY: as above.
            None => unsafe { api.cuStreamCreate(&mut raw, flags) }?,
        }
        Ok(Stream { ctx: ctx.clone(), raw })
    }

    /// Blocks until all queued work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the stream is live while self is.
        unsafe { driver()?.api().cuStreamSynchronize(self.raw) }
    }

    /// Whether all queued work is done, without blocking.
    pub fn is_idle(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: the stream is live while self is.
        match unsafe { driver()?.api().cuStreamQuery(self.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.is_code(CUresult::ERROR_NOT_READY) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// The stream's context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("raw", &self.raw).finish()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(d) = driver() {
            let _ = self.ctx.bind();
            // SAFETY: destroyed once; the driver defers the release until queued work completes.
            let _ = unsafe { d.api().cuStreamDestroy(self.raw) };
        }
    }
}
