//! Uses of a block on streams other than its own (`Tensor.record_stream`), and the frees they
//! defer.
//!
//! PyTorch's caching allocator gives a block freed after such uses back only once events it
//! records on those streams at the free have completed: until then no request gets it, on its
//! own stream or any other. The same happens here. A free of a block with recorded uses records
//! one event on each of those streams and keeps the block out of the allocator; the next request
//! on its device (or an empty cache, or a request out of memory, which wait for the events) frees
//! it on its own stream once every event has completed. A recorded stream being captured runs
//! nothing meanwhile: the free does not wait for it, and a free captured with it makes its stream
//! join it in the graph instead. The events are real work's only, so asking whether they have
//! completed (in relaxed capture mode) never touches a capture.

use cuvmm_lib::alloc::StreamAllocator;
use cuvmm_lib::driver::sys::{CUstream, CU_STREAM_LEGACY};
use cuvmm_lib::Event;
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The streams recorded for each block handed out, by address (null named as the legacy stream).
static RECORDED: Mutex<Option<HashMap<u64, Vec<usize>>>> = Mutex::new(None);
/// `RECORDED`'s length, read without the lock by every free.
static BLOCKS: AtomicUsize = AtomicUsize::new(0);

/// A free waiting for work on other streams.
struct Deferred {
    device: c_int,
    ptr: u64,
    /// The stream the block was allocated and freed on.
    stream: usize,
    events: Vec<Event>,
}

static DEFERRED: Mutex<Vec<Deferred>> = Mutex::new(Vec::new());
/// `DEFERRED.len()`, read without the lock by every request.
static PENDING: AtomicUsize = AtomicUsize::new(0);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn key(stream: CUstream) -> usize {
    if stream.is_null() {
        CU_STREAM_LEGACY
    } else {
        stream as usize
    }
}

/// Remembers that the block at `ptr` is used on `stream` too.
pub(crate) fn record(ptr: u64, stream: CUstream) {
    let mut recorded = lock(&RECORDED);
    let map = recorded.get_or_insert_with(HashMap::new);
    let streams = map.entry(ptr).or_default();
    if !streams.contains(&key(stream)) {
        streams.push(key(stream));
    }
    BLOCKS.store(map.len(), Ordering::Release);
}

/// The free of `ptr` on `stream`: `Ok(true)` when it is deferred (the caller frees nothing now),
/// `Ok(false)` when the caller frees it now.
///
/// # Safety
/// `stream` and every stream recorded for `ptr` must be live streams of `a`'s context (or the
/// legacy one) for the call, as PyTorch requires of the streams a tensor was recorded on.
#[inline]
pub(crate) unsafe fn free(
    a: &StreamAllocator,
    device: c_int,
    ptr: u64,
    stream: CUstream,
) -> Result<bool, String> {
    // Every free asks: mostly no block has recorded uses, and the answer is one atomic load.
    if BLOCKS.load(Ordering::Acquire) == 0 {
        return Ok(false);
    }
    // SAFETY: this function's contract, the same.
    unsafe { free_recorded(a, device, ptr, stream) }
}

/// [`free`] where some block has recorded uses.
///
/// # Safety
/// As for [`free`].
#[cold]
unsafe fn free_recorded(
    a: &StreamAllocator,
    device: c_int,
    ptr: u64,
    stream: CUstream,
) -> Result<bool, String> {
    let taken = {
        let mut recorded = lock(&RECORDED);
        let map = recorded.get_or_insert_with(HashMap::new);
        let taken = map.remove(&ptr);
        BLOCKS.store(map.len(), Ordering::Release);
        taken
    };
    let streams: Vec<usize> = match taken {
        Some(s) => s.into_iter().filter(|&s| s != key(stream)).collect(),
        None => return Ok(false),
    };
    if streams.is_empty() {
        return Ok(false);
    }
    a.context().bind().map_err(|e| e.to_string())?;
    let raw = |s: usize| s as CUstream;
    // An error below leaves the block out of the allocator (never freed), not freed early.
    let capturing = |s: usize| {
        // SAFETY: a live stream of the context, per this function's contract.
        unsafe { cuvmm_lib::stream::is_capturing(raw(s)) }.map_err(|e| e.to_string())
    };
    let free_captured = capturing(key(stream))?;
    let mut events = Vec::with_capacity(streams.len());
    for s in streams {
        let e = Event::without_timing(a.context()).map_err(|e| e.to_string())?;
        if capturing(s)? {
            // Nothing runs on a stream being captured: its uses are nodes of a graph. Within the
            // capture of the free, the free's stream joins it, which orders the graph's reuse of
            // the block after them.
            if free_captured {
                // SAFETY: live streams of the context, per this function's contract; recording
                // and waiting are legal during a capture.
                unsafe { e.record_raw(raw(s)).and_then(|()| e.wait_raw(stream)) }
                    .map_err(|e| e.to_string())?;
            }
            continue;
        }
        // SAFETY: a live stream of the context, per this function's contract.
        unsafe { e.record_raw(raw(s)) }.map_err(|e| e.to_string())?;
        events.push(e);
    }
    if events.is_empty() {
        return Ok(false);
    }
    let mut deferred = lock(&DEFERRED);
    deferred.push(Deferred { device, ptr, stream: key(stream), events });
    PENDING.store(deferred.len(), Ordering::Release);
    Ok(true)
}

/// Frees, through `free`, every deferred block of `device` (-1: every device) whose events have
/// completed; with `wait`, waits for all of them first. Returns how many were freed. The lock is
/// not held across the wait.
pub(crate) fn settle(
    device: c_int,
    wait: bool,
    mut free: impl FnMut(c_int, u64, CUstream) -> Result<(), String>,
) -> Result<usize, String> {
    if PENDING.load(Ordering::Acquire) == 0 {
        return Ok(0);
    }
    let ready: Vec<Deferred> = {
        let mut deferred = lock(&DEFERRED);
        let mut ready = Vec::new();
        let mut i = 0;
        while i < deferred.len() {
            let d = &deferred[i];
            let mine = device == -1 || d.device == device;
            let done = wait || d.events.iter().all(|e| e.is_complete_relaxed().unwrap_or(false));
            if mine && done {
                ready.push(deferred.swap_remove(i));
            } else {
                i += 1;
            }
        }
        PENDING.store(deferred.len(), Ordering::Release);
        ready
    };
    let mut first_error = None;
    let n = ready.len();
    for d in ready {
        let waited = if wait { d.events.iter().try_for_each(|e| e.synchronize()) } else { Ok(()) };
        let freed =
            waited.map_err(|e| e.to_string()).and_then(|()| free(d.device, d.ptr, d.stream as CUstream));
        if let Err(e) = freed {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(n), Err)
}

/// Whether no free waits for other streams' work (without the lock).
#[inline]
pub(crate) fn none_pending() -> bool {
    PENDING.load(Ordering::Acquire) == 0
}

/// Whether frees of `device` (-1: any) wait for other streams' work.
pub(crate) fn pending(device: c_int) -> bool {
    PENDING.load(Ordering::Acquire) > 0 && lock(&DEFERRED).iter().any(|d| device == -1 || d.device == device)
}

/// The streams recorded for `ptr`.
#[cfg(test)]
pub(crate) fn recorded(ptr: u64) -> Vec<usize> {
    lock(&RECORDED).as_ref().and_then(|r| r.get(&ptr).cloned()).unwrap_or_default()
}
