//! Device to host: this thread queues each chunk's DMA into any slot already drained, and the
//! threads drain the chunks' pieces in order once their DMA has landed.

use super::clock::DmaClock;
use super::progress::NO_SLOT;
use super::trace::Step;
use super::{Addr, HostCopy, Staging, Transfer};
use crate::driver::{driver, result, Api};
use crate::error::Result;
use crate::host::stream_copy::copy_streaming;
use crate::memory::{DeviceCopy, DeviceSlice};
use crate::stream::{Event, Stream};
use std::sync::atomic::Ordering;

impl Staging {
    /// Copies `src` into pageable `dst` on `stream`; returns when the data is in `dst`.
    ///
    /// This thread queues each chunk's DMA into any slot already drained, and records
    /// the slot's event after it; the threads wait for that event and drain the chunk's pieces
    /// in order, writing `dst` with non-temporal stores (they skip reading each line before
    /// writing it) unless the ring's [`HostCopy`](super::HostCopy) is plain.
    pub fn to_host<T: DeviceCopy>(
        &mut self,
        stream: &Stream,
        src: DeviceSlice<'_, T>,
        dst: &mut [T],
    ) -> Result<()> {
        let Some(plan) =
            self.begin([("device", src.len()), ("host", dst.len())], std::mem::size_of_val(dst))?
        else {
            return Ok(());
        };
        let _turn = src.prepare_read(stream)?;
        let transfer = self.transfer(plan, |_| None);
        let dst = Addr(dst.as_mut_ptr() as usize);
        let api = driver()?.api();
        let (events, clock) = (&self.events[..], &self.clock);
        let drain = || drain(&transfer, dst, events, clock);
        let issue = || issue(&transfer, src.ptr(), events, clock, stream, api);
        let drain = super::pool::first_of(self.to_host_threads, &drain);
        let (trace, outcome) = transfer.run(&self.pool, stream, false, &drain, issue);
        self.last_trace = trace;
        outcome
    }
}

/// A copying thread's part of a transfer to the host: claims pieces in order and, once the
/// piece's chunk has landed in its slot, copies it out into `dst`.
fn drain(t: &Transfer, dst: Addr, events: &[Event], clock: &DmaClock) {
    let Transfer { plan, shared, marks, slots, host_copy } = t;
    loop {
        let Some(p) = shared.claim(plan.pieces) else { return };
        marks.piece_taken();
        let (j, at, len) = plan.piece(p);
        if shared.wait_until(|| shared.issued[j].load(Ordering::Acquire)).is_err() {
            return;
        }
        // Published before `issued[j]`, which the wait acquired.
        let s = shared.slot_of[j].load(Ordering::Relaxed);
        // The event was recorded after chunk j's DMA, before `issued[j]` was published, and is
        // not recorded again until every piece of chunk j is drained.
        if !shared.landed[j].load(Ordering::Acquire) {
            if let Err(e) = events[s].synchronize() {
                shared.fail(e);
                return;
            }
            clock.lap(s, &events[s], plan.chunk_len(j));
            shared.landed[j].store(true, Ordering::Release);
            marks.mark(j, Step::Landed);
        }
        // SAFETY: slot s holds chunk j (its DMA completed); these bytes of `dst` (borrowed
        // mutably for the transfer) are touched by this thread alone (pieces are disjoint). Any
        // bytes are a valid T.
        let (from, to) = unsafe {
            (
                std::slice::from_raw_parts((slots[s].0 + at) as *const u8, len),
                std::slice::from_raw_parts_mut((dst.0 + j * plan.chunk + at) as *mut u8, len),
            )
        };
        match host_copy {
            HostCopy::Streaming => copy_streaming(to, from),
            HostCopy::Plain => to.copy_from_slice(from),
        }
        if shared.piece_done(j, plan.pieces_in(j)) {
            marks.mark(j, Step::Drained);
            // Every piece's read of the slot happened before the count that found it drained.
            shared.slot_free[s].store(true, Ordering::Release);
        }
    }
}

/// The issuing thread's part of a transfer to the host from `src`: each chunk's DMA into any
/// slot already drained, its slot's event after it. Stops early, with the error in the
/// transfer's progress, when a copying thread failed.
fn issue(
    t: &Transfer,
    src: u64,
    events: &[Event],
    clock: &DmaClock,
    stream: &Stream,
    api: &Api,
) -> Result<()> {
    let Transfer { plan, shared, marks, slots, .. } = t;
    stream.context().bind()?;
    for i in 0..plan.chunks {
        // Any slot already drained: a thread descheduled in the middle of a piece holds back its
        // own chunk's slot only.
        let mut s = NO_SLOT;
        let free = shared.wait_until(|| {
            s = (0..slots.len()).find(|&s| shared.slot_free[s].load(Ordering::Acquire)).unwrap_or(NO_SLOT);
            s != NO_SLOT
        });
        if free.is_err() {
            return Ok(());
        }
        // Only this thread takes slots.
        shared.slot_free[s].store(false, Ordering::Relaxed);
        shared.slot_of[i].store(s, Ordering::Relaxed);
        clock.start(s, stream)?;
        // SAFETY: slot s is free (every read of its last chunk happened before the flag acquired
        // above); `src` holds chunk i.
        unsafe {
            result::mem::memcpy_dtoh_async(
                api,
                slots[s].0 as *mut _,
                src + (i * plan.chunk) as u64,
                plan.chunk_len(i),
                stream.raw(),
            )
        }?;
        marks.mark(i, Step::Queued);
        events[s].record(stream)?;
        shared.issued[i].store(true, Ordering::Release);
    }
    Ok(())
}
