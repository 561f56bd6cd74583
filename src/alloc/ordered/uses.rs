//! Uses of a raw block on streams other than its own ([`StreamAllocator::record_stream`], PyTorch's
//! `Tensor.record_stream`), and the frees they defer.
//!
//! PyTorch's caching allocator gives a block freed after such uses back only once events it
//! records on those streams at the free have completed: until then no request gets it, on its
//! own stream or any other. The same happens here. A free of a block with recorded uses records
//! one event on each of those streams and keeps the block out of the allocator; the allocator's
//! next request (or an empty cache, or a request out of memory, which wait for the events) frees
//! it on its own stream once every event has completed. A recorded stream being captured runs
//! nothing meanwhile: the free does not wait for it, and a free captured with it makes its stream
//! join it in the graph instead. The events are real work's only, so asking whether they have
//! completed (in relaxed capture mode) never touches a capture.
//!
//! A [`StreamBlock`](super::StreamBlock)'s drop takes the same way: the streams it was used on
//! (named by `use_on` or met by its views) are recorded as `record_stream` would, and its free is
//! deferred as a raw block's is. The deferred free holds the block's stream until it is made, so a
//! stream dropped with the block stays valid for it.
//!
//! [`StreamAllocator::record_stream`]: super::StreamAllocator::record_stream

use super::{lock, stream_key};
use crate::context::Context;
use crate::driver::sys::CUstream;
use crate::error::Result;
use crate::stream::{Event, StreamInner};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A free waiting for work on other streams.
struct Deferred {
    ptr: u64,
    /// The stream it was freed on, the one it is freed on at last (as [`stream_key`] names it).
    stream: u64,
    events: Vec<Event>,
    /// The stream itself, for a [`StreamBlock`](super::StreamBlock)'s free: held alive until the
    /// free is made. A raw free's stream is the caller's to keep alive.
    _held: Option<Arc<StreamInner>>,
}

/// One allocator's recorded uses and deferred frees.
#[derive(Default)]
pub(crate) struct Uses {
    /// The streams recorded for each block handed out, by address (handles as [`stream_key`]
    /// gives them: the null handle named as the legacy stream).
    recorded: Mutex<HashMap<u64, Vec<u64>>>,
    /// `recorded`'s length, read without the lock by every free.
    blocks: AtomicUsize,
    deferred: Mutex<Vec<Deferred>>,
    /// `deferred`'s length, read without the lock by every request.
    pending: AtomicUsize,
}

impl Uses {
    /// Remembers that the block at `ptr` is used on `stream` too.
    pub(crate) fn record(&self, ptr: u64, stream: CUstream) {
        let key = stream_key(stream).0;
        let mut recorded = lock(&self.recorded);
        let streams = recorded.entry(ptr).or_default();
        if !streams.contains(&key) {
            streams.push(key);
        }
        self.blocks.store(recorded.len(), Ordering::Release);
    }

    /// The streams recorded for the block at `ptr`.
    pub(crate) fn recorded(&self, ptr: u64) -> usize {
        lock(&self.recorded).get(&ptr).map_or(0, Vec::len)
    }

    /// Whether frees wait for other streams' work.
    #[inline]
    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    /// The free of `ptr` on `stream`: `Ok(true)` when it is deferred (the caller frees nothing
    /// now), `Ok(false)` when the caller frees it now. An error leaves the block out of the
    /// allocator (never freed) rather than freed early.
    ///
    /// `held`, when given, is `stream`'s owner, kept until the deferred free is made.
    ///
    /// # Safety
    /// `stream` and every stream recorded for `ptr` must be live streams of `ctx` (or the legacy
    /// one) for the call.
    #[inline]
    pub(crate) unsafe fn defer(
        &self,
        ctx: &Context,
        ptr: u64,
        stream: CUstream,
        held: Option<&Arc<StreamInner>>,
    ) -> Result<bool> {
        // Every free asks: mostly no block has recorded uses, and the answer is one atomic load.
        if self.blocks.load(Ordering::Acquire) == 0 {
            return Ok(false);
        }
        // SAFETY: this function's contract, the same.
        unsafe { self.defer_recorded(ctx, ptr, stream, held) }
    }

    /// [`defer`](Self::defer) where some block has recorded uses.
    ///
    /// # Safety
    /// As for `defer`.
    #[cold]
    unsafe fn defer_recorded(
        &self,
        ctx: &Context,
        ptr: u64,
        stream: CUstream,
        held: Option<&Arc<StreamInner>>,
    ) -> Result<bool> {
        let own = stream_key(stream).0;
        let taken = {
            let mut recorded = lock(&self.recorded);
            let taken = recorded.remove(&ptr);
            self.blocks.store(recorded.len(), Ordering::Release);
            taken
        };
        let others: Vec<u64> = taken.unwrap_or_default().into_iter().filter(|&s| s != own).collect();
        if others.is_empty() {
            return Ok(false);
        }
        ctx.bind()?;
        let raw = |s: u64| s as usize as CUstream;
        // SAFETY: a live stream of the context, per this function's contract.
        let capturing = |s: u64| unsafe { crate::stream::is_capturing(raw(s)) };
        let free_captured = capturing(own)?;
        let mut events = Vec::with_capacity(others.len());
        for s in others {
            let e = Event::without_timing(ctx)?;
            if capturing(s)? {
                // Nothing runs on a stream being captured: its uses are nodes of a graph. Within
                // the capture of the free, the free's stream joins it, which orders the graph's
                // reuse of the block after them.
                if free_captured {
                    // SAFETY: live streams of the context, per this function's contract;
                    // recording and waiting are legal during a capture.
                    unsafe { e.record_raw(raw(s)).and_then(|()| e.wait_raw(stream)) }?;
                }
                continue;
            }
            // SAFETY: a live stream of the context, per this function's contract.
            unsafe { e.record_raw(raw(s)) }?;
            events.push(e);
        }
        if events.is_empty() {
            return Ok(false);
        }
        let mut deferred = lock(&self.deferred);
        deferred.push(Deferred { ptr, stream: own, events, _held: held.cloned() });
        self.pending.store(deferred.len(), Ordering::Release);
        Ok(true)
    }

    /// Frees, through `free`, every deferred block whose events have completed; with `wait`,
    /// waits for all of them first. Returns how many were freed, or the first error met (the
    /// others were freed all the same). The lock is not held across the wait.
    pub(crate) fn settle(
        &self,
        wait: bool,
        mut free: impl FnMut(u64, CUstream) -> Result<()>,
    ) -> Result<usize> {
        if self.pending() == 0 {
            return Ok(0);
        }
        let ready: Vec<Deferred> = {
            let mut deferred = lock(&self.deferred);
            let (ready, waiting) = std::mem::take(&mut *deferred)
                .into_iter()
                .partition(|d| wait || d.events.iter().all(|e| e.is_complete_relaxed().unwrap_or(false)));
            *deferred = waiting;
            self.pending.store(deferred.len(), Ordering::Release);
            ready
        };
        let mut first_error = None;
        let n = ready.len();
        for d in ready {
            let waited = if wait { d.events.iter().try_for_each(Event::synchronize) } else { Ok(()) };
            if let Err(e) = waited.and_then(|()| free(d.ptr, d.stream as usize as CUstream)) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(n), Err)
    }
}
