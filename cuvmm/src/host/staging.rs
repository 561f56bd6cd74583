//! Pageable host memory moved through a ring of pinned staging buffers, the host-side copies done
//! by several threads while the DMA engine moves earlier chunks: much faster than the driver's own
//! pageable path, which stages through one small buffer on one thread.

use crate::context::Context;
use crate::driver::driver;
use crate::error::{Error, Result};
use crate::host::PinnedBuffer;
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::stream::Event;
use crate::stream::Stream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A reusable ring of pinned slots and the threads that fill or drain them.
pub struct Staging {
    slots: Vec<PinnedBuffer<u8>>,
    events: Vec<Event>,
    chunk: usize,
    threads: usize,
}

struct State {
    next_claim: usize,
    /// For each slot, the chunk allowed to use it next.
    slot_for: Vec<usize>,
    /// Per chunk: filled (to device) or queued (to host).
    ready: Vec<bool>,
    failed: Option<Error>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn new(slots: usize, chunks: usize) -> Shared {
        Shared {
            state: Mutex::new(State {
                next_claim: 0,
                slot_for: (0..slots).collect(),
                ready: vec![false; chunks],
                failed: None,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `cond` holds or someone failed; `Err` in the latter case.
    fn wait_until(
        &self,
        mut cond: impl FnMut(&State) -> bool,
    ) -> std::result::Result<MutexGuard<'_, State>, ()> {
        let mut g = self.lock();
        loop {
            if g.failed.is_some() {
                return Err(());
            }
            if cond(&g) {
                return Ok(g);
            }
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// As [`wait_until`](Self::wait_until), but also gives up (failing everyone) when `stream`
    /// reports an error: the driver runs no host function after a device fault, so the slots they
    /// hand on would never come back.
    fn wait_watching(
        &self,
        stream: &Stream,
        mut cond: impl FnMut(&State) -> bool,
    ) -> std::result::Result<MutexGuard<'_, State>, ()> {
        let mut g = self.lock();
        loop {
            if g.failed.is_some() {
                return Err(());
            }
            if cond(&g) {
                return Ok(g);
            }
            let (next, timeout) = self
                .cv
                .wait_timeout(g, std::time::Duration::from_millis(20))
                .unwrap_or_else(|e| e.into_inner());
            g = next;
            if timeout.timed_out() {
                drop(g);
                if let Err(e) = stream.is_idle() {
                    self.fail(e);
                    return Err(());
                }
                g = self.lock();
            }
        }
    }

    /// The next chunk to work on and its slot, or `None` when all are taken or someone failed.
    fn claim(&self, n: usize, k: usize) -> Option<(usize, usize)> {
        let mut g = self.lock();
        if g.next_claim >= n || g.failed.is_some() {
            return None;
        }
        let j = g.next_claim;
        g.next_claim += 1;
        Some((j, j % k))
    }

    /// The first failure, else the final synchronisation's result.
    fn outcome(&self, synced: Result<()>) -> Result<()> {
        match self.lock().failed.take() {
            Some(e) => Err(e),
            None => synced,
        }
    }

    fn fail(&self, e: Error) {
        self.lock().failed.get_or_insert(e);
        self.cv.notify_all();
    }
}

/// A raw base address that worker threads write through at disjoint offsets.
#[derive(Clone, Copy)]
struct Addr(usize);

impl Staging {
    /// `slots` pinned buffers of `chunk` bytes each, filled or drained by `threads` threads.
    pub fn new(ctx: &Context, chunk: usize, slots: usize, threads: usize) -> Result<Staging> {
        if chunk == 0 || slots < 2 || threads == 0 {
            return Err(Error::invalid("staging needs chunk > 0, at least 2 slots and 1 thread"));
        }
        let slots_v = (0..slots).map(|_| PinnedBuffer::<u8>::new(ctx, chunk)).collect::<Result<Vec<_>>>()?;
        let events = (0..slots).map(|_| Event::without_timing(ctx)).collect::<Result<Vec<_>>>()?;
        Ok(Staging { slots: slots_v, events, chunk, threads })
    }

    /// 8 MiB chunks, two slots per thread, one thread per core up to 8.
    pub fn with_defaults(ctx: &Context) -> Result<Staging> {
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(8);
        Staging::new(ctx, 8 << 20, 2 * threads, threads)
    }

    /// Bytes per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Host threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn slot_addrs(&mut self) -> Vec<Addr> {
        self.slots.iter_mut().map(|s| Addr(s.as_mut_ptr() as usize)).collect()
    }

    /// Copies pageable `src` into `dst` on `stream`; returns when the data is on the device.
    ///
    /// Workers fill slots in parallel, chunk after chunk; this thread queues each chunk's DMA as
    /// soon as it is filled, and a host function queued behind that DMA hands the slot to the chunk
    /// `slots` places later, so filling never waits for this thread.
    pub fn to_device<T: DeviceCopy>(
        &mut self,
        stream: &Stream,
        src: &[T],
        dst: DeviceSliceMut<'_, T>,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::invalid(format!(
                "length mismatch: host {} elements, device {}",
                src.len(),
                dst.len()
            )));
        }
        let bytes = std::mem::size_of_val(src);
        if bytes == 0 {
            return Ok(());
        }
        let mut dst = dst;
        let _turn = dst.prepare_write(stream)?;
        let (k, chunk) = (self.slots.len(), self.chunk);
        let n = bytes.div_ceil(chunk);
        // Shared with host functions, which may in principle outlive this call: reference-counted.
        let shared = Arc::new(Shared::new(k, n));
        let slots = self.slot_addrs();
        let src_addr = Addr(src.as_ptr() as usize);
        let api = driver()?.api();
        std::thread::scope(|sc| {
            for _ in 0..self.threads.min(n) {
                let (shared, slots) = (&*shared, &slots);
                sc.spawn(move || loop {
                    let Some((j, s)) = shared.claim(n, k) else { return };
                    if shared.wait_until(|g| g.slot_for[s] == j).is_err() {
                        return;
                    }
                    let len = chunk.min(bytes - j * chunk);
                    // SAFETY: chunk j of `src` (borrowed for this call) goes to slot s, which no
                    // DMA and no other thread uses until `ready[j]` is published below.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            (src_addr.0 + j * chunk) as *const u8,
                            slots[s].0 as *mut u8,
                            len,
                        )
                    };
                    shared.lock().ready[j] = true;
                    shared.cv.notify_all();
                });
            }
            let issue = || -> Result<()> {
                stream.context().bind()?;
                for i in 0..n {
                    let s = i % k;
                    if shared.wait_watching(stream, |g| g.ready[i]).is_err() {
                        return Ok(()); // a worker or the stream failed; the error is in `shared`
                    }
                    let len = chunk.min(bytes - i * chunk);
                    // SAFETY: slot s holds chunk i (published under the lock); `dst` has room
                    // for it at this offset; the slot is handed on only after this DMA completes.
                    unsafe {
                        api.cuMemcpyHtoDAsync(
                            dst.ptr() + (i * chunk) as u64,
                            slots[s].0 as *const _,
                            len,
                            stream.raw(),
                        )
                    }?;
                    let release = Arc::clone(&shared);
                    stream.launch_host_fn(move || {
                        release.lock().slot_for[s] = i + k;
                        release.cv.notify_all();
                    })?;
                }
                Ok(())
            };
            if let Err(e) = issue() {
                shared.fail(e);
            }
        });
        // Whatever happened, no DMA may still read the slots when this returns.
        let synced = crate::stream::confirm(stream);
        shared.outcome(synced)
    }

    /// Copies `src` into pageable `dst` on `stream`; returns when the data is in `dst`.
    pub fn to_host<T: DeviceCopy>(
        &mut self,
        stream: &Stream,
        src: DeviceSlice<'_, T>,
        dst: &mut [T],
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::invalid(format!(
                "length mismatch: device {} elements, host {}",
                src.len(),
                dst.len()
            )));
        }
        let bytes = std::mem::size_of_val(dst);
        if bytes == 0 {
            return Ok(());
        }
        let _turn = src.prepare_read(stream)?;
        let (k, chunk) = (self.slots.len(), self.chunk);
        let n = bytes.div_ceil(chunk);
        let shared = Shared::new(k, n);
        let slots = self.slot_addrs();
        let dst_addr = Addr(dst.as_mut_ptr() as usize);
        let api = driver()?.api();
        let events = &self.events;
        std::thread::scope(|sc| {
            for _ in 0..self.threads.min(n) {
                let (shared, slots) = (&shared, &slots);
                sc.spawn(move || loop {
                    let Some((j, s)) = shared.claim(n, k) else { return };
                    if shared.wait_until(|g| g.ready[j]).is_err() {
                        return;
                    }
                    // The event was recorded before ready[j] was published, and is not recorded
                    // again until this thread hands the slot on.
                    if let Err(e) = events[s].synchronize() {
                        shared.fail(e);
                        return;
                    }
                    let len = chunk.min(bytes - j * chunk);
                    // SAFETY: slot s holds chunk j (its DMA completed); chunk j of `dst`
                    // (borrowed mutably for this call) is written by this thread alone. Any bytes
                    // are a valid T.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            slots[s].0 as *const u8,
                            (dst_addr.0 + j * chunk) as *mut u8,
                            len,
                        )
                    };
                    shared.lock().slot_for[s] = j + k;
                    shared.cv.notify_all();
                });
            }
            let issue = || -> Result<()> {
                stream.context().bind()?;
                for i in 0..n {
                    let s = i % k;
                    if shared.wait_until(|g| g.slot_for[s] == i).is_err() {
                        return Ok(());
                    }
                    let len = chunk.min(bytes - i * chunk);
                    // SAFETY: slot s is free (its last chunk was drained); `src` holds chunk i.
                    unsafe {
                        api.cuMemcpyDtoHAsync(
                            slots[s].0 as *mut _,
                            src.ptr() + (i * chunk) as u64,
                            len,
                            stream.raw(),
                        )
                    }?;
                    events[s].record(stream)?;
                    shared.lock().ready[i] = true;
                    shared.cv.notify_all();
                }
                Ok(())
            };
            if let Err(e) = issue() {
                shared.fail(e);
            }
        });
        let synced = crate::stream::confirm(stream);
        shared.outcome(synced)
    }
}
