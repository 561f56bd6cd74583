//! Host to device: the threads fill slots, this thread queues each chunk's DMA as soon as it is
//! filled and gives a slot to the next chunk once its DMA has completed.

use super::clock::DmaClock;
use super::lane::Lane;
use super::progress::{OnUnwind, NO_SLOT};
use super::trace::Step;
use super::{Addr, HostCopy, Staging, Transfer};
use crate::driver::{driver, result, Api};
use crate::error::Result;
use crate::host::stream_copy::copy_streaming;
use crate::memory::{DeviceCopy, DeviceSliceMut};
use crate::stream::{Event, Stream};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;

/// The issuing thread's view of a transfer to the device: which chunk has which slot, which
/// chunks have their DMA queued, and which slots wait for their DMA to complete.
///
/// The first chunks get the slots in order; each later chunk, in chunk order, gets the slot whose
/// DMA was queued first on a lane (so completes first there, each lane's stream running them in
/// order) once that DMA has completed. DMAs are queued in the order chunks are filled, which is
/// mostly chunk order; a slot goes wherever it is needed next, so a chunk filled late holds back no
/// other chunk's slot. Lane 0 is the copy engines; lane 1, where the ring has it, the kernel copy.
pub(super) struct Issuer {
    slot_of: Vec<Option<usize>>,
    queued: Vec<bool>,
    /// Every chunk before it has its DMA queued.
    first_unqueued: usize,
    /// Every chunk before it has a slot; none after it has.
    slotted: usize,
    /// Per lane, slots whose chunk's DMA is queued, in the order queued.
    in_flight: [VecDeque<usize>; LANES],
}

/// Ways a chunk goes to the device: the copy engines, and the multiprocessors.
pub(super) const LANES: usize = 2;

impl Issuer {
    pub(super) fn new(chunks: usize, slots: usize) -> Issuer {
        let slotted = slots.min(chunks);
        Issuer {
            slot_of: (0..chunks).map(|j| (j < slotted).then_some(j)).collect(),
            queued: vec![false; chunks],
            first_unqueued: 0,
            slotted,
            in_flight: [VecDeque::with_capacity(slots), VecDeque::with_capacity(slots)],
        }
    }

    /// The lowest chunk whose DMA is not queued; `None` once all are.
    pub(super) fn first_unqueued(&self) -> Option<usize> {
        (self.first_unqueued < self.queued.len()).then_some(self.first_unqueued)
    }

    /// Chunks before it have a slot, so may be filled.
    pub(super) fn slotted(&self) -> usize {
        self.slotted
    }

    pub(super) fn queued(&self, i: usize) -> bool {
        self.queued[i]
    }

    /// The slot chunk `i` goes through, if it has one.
    pub(super) fn slot(&self, i: usize) -> Option<usize> {
        self.slot_of[i]
    }

    /// Chunk `i` (filled, through its slot) has its DMA queued on `lane`; returns the slot.
    ///
    /// # Panics
    /// If chunk `i` has no slot or was queued before.
    pub(super) fn queue(&mut self, i: usize, lane: usize) -> usize {
        let s = self.slot_of[i].expect("a filled chunk has a slot");
        assert!(!std::mem::replace(&mut self.queued[i], true), "chunk {i} queued twice");
        self.in_flight[lane].push_back(s);
        while self.queued.get(self.first_unqueued) == Some(&true) {
            self.first_unqueued += 1;
        }
        s
    }

    /// The slot of `lane` whose DMA to ask about: the one queued first there, when the next chunk
    /// without a slot exists and a thread has claimed pieces up to it (`claimed`, a chunk index).
    pub(super) fn to_free(&self, claimed: usize, lane: usize) -> Option<usize> {
        let needed = self.slotted < self.queued.len() && self.slotted <= claimed;
        self.in_flight[lane].front().copied().filter(|_| needed)
    }

    /// Chunks of `lane` whose DMA is queued and not yet seen complete.
    pub(super) fn in_flight(&self, lane: usize) -> usize {
        self.in_flight[lane].len()
    }

    /// [`Issuer::to_free`]'s slot of `lane` has its DMA completed: it goes to the next chunk.
    /// Returns that chunk and the slot.
    ///
    /// # Panics
    /// If no slot of `lane` is in flight or every chunk has one.
    pub(super) fn freed(&mut self, lane: usize) -> (usize, usize) {
        let s = self.in_flight[lane].pop_front().expect("a slot in flight");
        let j = self.slotted;
        self.slot_of[j] = Some(s);
        self.slotted += 1;
        (j, s)
    }
}

impl Staging {
    /// Copies pageable `src` into `dst` on `stream`; returns when the data is on the device.
    ///
    /// The threads fill pieces in order; this thread queues each chunk's DMA as soon as its last
    /// piece is filled, records the slot's event after it, and gives the slot to the next chunk
    /// without one once that event has completed.
    pub fn to_device<T: DeviceCopy>(
        &mut self,
        stream: &Stream,
        src: &[T],
        dst: DeviceSliceMut<'_, T>,
    ) -> Result<()> {
        let Some(plan) =
            self.begin([("host", src.len()), ("device", dst.len())], std::mem::size_of_val(src))?
        else {
            return Ok(());
        };
        let mut dst = dst;
        let _turn = dst.prepare_write(stream)?;
        let ring = Issuer::new(plan.chunks, self.slots.len());
        let transfer = self.transfer(plan, |j| ring.slot(j));
        let api = driver()?.api();
        let lane = self.kernel_lane.as_ref();
        if let Some(l) = lane {
            // The kernels follow whatever the caller queued before, as the copies do.
            l.start.record(stream)?;
            l.stream.wait_event(&l.start)?;
        }
        // Whatever happens, nothing of the kernel lane may still read a slot once this returns.
        let _drained = OnUnwind(|| {
            if let Some(l) = lane {
                let _ = l.stream.synchronize();
            }
        });
        let src = Addr(src.as_ptr() as usize);
        let fill = || fill(&transfer, src);
        let mut issuer = Issue {
            ring,
            t: &transfer,
            lane,
            events: &self.events,
            clock: &self.clock,
            stream,
            api,
            dst: dst.ptr(),
            slow: lane.is_some_and(|l| l.config.slowdown <= 0.0),
            chunk_of: vec![0; self.slots.len()],
            by_kernels: 0,
        };
        let issue = || {
            let queued = issuer.run();
            // The caller's stream, which the transfer ends by waiting for, waits for the kernels.
            let joined = match lane {
                Some(l) => l.end.record(&l.stream).and_then(|()| stream.wait_event(&l.end)),
                None => Ok(()),
            };
            queued.and(joined)
        };
        let (trace, outcome) = transfer.run(&self.pool, stream, true, &fill, issue);
        self.last_trace = trace;
        self.kernel_chunks += issuer.by_kernels;
        // Already waited for through the caller's stream, unless the join failed.
        let drained = lane.map_or(Ok(()), |l| l.stream.synchronize());
        outcome.and(drained)
    }
}

/// A copying thread's part of a transfer to the device: claims pieces in order and copies each
/// from `src` into its chunk's slot, once the chunk has one.
fn fill(t: &Transfer, src: Addr) {
    let Transfer { plan, shared, marks, slots, host_copy } = t;
    loop {
        let Some(p) = shared.claim(plan.pieces) else { return };
        marks.piece_taken();
        let (j, at, len) = plan.piece(p);
        let mut s = NO_SLOT;
        let slotted = shared.wait_until(|| {
            s = shared.slot_of[j].load(Ordering::Acquire);
            s != NO_SLOT
        });
        if slotted.is_err() {
            return;
        }
        // SAFETY: these bytes of `src` (borrowed for the transfer; `T` has no padding) go to
        // their place in slot s, which no DMA uses until chunk j is complete (the slot's last
        // DMA completed before it was given to chunk j), and which no other thread touches
        // meanwhile (pieces are disjoint).
        let (from, to) = unsafe {
            (
                std::slice::from_raw_parts((src.0 + j * plan.chunk + at) as *const u8, len),
                std::slice::from_raw_parts_mut((slots[s].0 + at) as *mut u8, len),
            )
        };
        if *host_copy == HostCopy::Streaming && plan.streamed(j * plan.chunk + at) {
            copy_streaming(to, from);
        } else {
            to.copy_from_slice(from);
        }
        if shared.piece_done(j, plan.pieces_in(j)) {
            marks.mark(j, Step::Filled);
        }
    }
}

/// The issuing thread's part of a transfer to the device.
struct Issue<'a> {
    ring: Issuer,
    t: &'a Transfer,
    lane: Option<&'a Lane>,
    events: &'a [Event],
    clock: &'a DmaClock,
    stream: &'a Stream,
    api: &'a Api,
    /// Where the transfer goes.
    dst: u64,
    /// Whether the copy engines' last chunk was slow.
    slow: bool,
    /// The length each slot's DMA moved.
    chunk_of: Vec<usize>,
    /// Chunks sent through the kernel lane.
    by_kernels: u64,
}

impl Issue<'_> {
    /// Queues every chunk's DMA as it is filled; stops early, with the error in the transfer's
    /// progress, when a query or a copying thread failed.
    fn run(&mut self) -> Result<()> {
        self.stream.context().bind()?;
        while let Some(first) = self.ring.first_unqueued() {
            let Some(i) = self.next_filled(first) else { return Ok(()) };
            self.queue(i)?;
        }
        Ok(())
    }

    /// Waits for a filled chunk not yet queued, the lowest first, giving slots to later chunks
    /// meanwhile. A thread descheduled in the middle of a piece holds back its own chunk only,
    /// and the DMA engine moves the chunks filled after it meanwhile.
    fn next_filled(&mut self, first: usize) -> Option<usize> {
        let t = self.t;
        let mut ready = None;
        let found = t.shared.wait_until(|| {
            ready = (first..self.ring.slotted()).find(|&i| {
                !self.ring.queued(i) && t.shared.done[i].load(Ordering::Acquire) == t.plan.pieces_in(i)
            });
            if ready.is_some() {
                return true;
            }
            self.free_slots();
            false
        });
        ready.filter(|_| found.is_ok())
    }

    /// Gives the next chunk the slot whose DMA was queued first on a lane once that DMA has
    /// completed, asking only when a thread has claimed a piece that needs it: a query is a driver
    /// call, and asking in a tight loop slowed the copies.
    fn free_slots(&mut self) {
        let t = self.t;
        let claimed = t.shared.next.load(Ordering::Relaxed) / t.plan.per_chunk;
        let lanes = if self.lane.is_some() { LANES } else { 1 };
        for l in 0..lanes {
            let Some(s) = self.ring.to_free(claimed, l) else { continue };
            match self.events[s].is_complete() {
                Ok(true) => {
                    let (j, s) = self.ring.freed(l);
                    let lap =
                        (l == 0).then(|| self.clock.lap(s, &self.events[s], self.chunk_of[s])).flatten();
                    if let (Some(lane), Some((took, best))) = (self.lane, lap) {
                        self.slow = took as f32 > best as f32 * lane.config.slowdown;
                    }
                    t.shared.slot_of[j].store(s, Ordering::Release);
                }
                Ok(false) => {}
                // Ends this wait and every thread's: the error is in `shared`.
                Err(e) => t.shared.fail(e),
            }
        }
    }

    /// Queues filled chunk `i`: through the kernel lane while the copy engines are slow and
    /// behind, else through the copy engines; then records its slot's event.
    fn queue(&mut self, i: usize) -> Result<()> {
        let (plan, slots) = (&self.t.plan, &self.t.slots);
        let (to, len) = (self.dst + (i * plan.chunk) as u64, plan.chunk_len(i));
        let by_kernel = self.lane.filter(|l| {
            self.ring.in_flight(0) >= self.ring.in_flight(1) + l.config.bias
                && self.slow
                && len % 16 == 0
                && to % 16 == 0
        });
        let s = self.ring.queue(i, usize::from(by_kernel.is_some()));
        self.chunk_of[s] = len;
        self.by_kernels += u64::from(by_kernel.is_some());
        match by_kernel {
            // SAFETY: as below; the slot is pinned memory the device reads (unified addressing),
            // and chunks and slots are 16-byte aligned (checked).
            Some(l) => unsafe { l.kernels.copy_raw(&l.stream, slots[s].0 as u64, to, len) }?,
            None => {
                self.clock.start(s, self.stream)?;
                // SAFETY: slot s holds chunk i (every piece's copy happened before the count
                // acquired by `next_filled`); `dst` has room for it at this offset; the slot goes
                // to another chunk only after the event recorded next completes.
                unsafe {
                    result::mem::memcpy_htod_async(
                        self.api,
                        to,
                        slots[s].0 as *const _,
                        len,
                        self.stream.raw(),
                    )
                }?
            }
        }
        self.t.marks.mark(i, Step::Queued);
        self.events[s].record(by_kernel.map_or(self.stream, |l| &l.stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dmas_are_queued_as_chunks_fill_and_slots_go_to_the_next_chunk_as_dmas_complete() {
        // 6 chunks through 2 slots.
        let mut r = Issuer::new(6, 2);
        assert_eq!((r.first_unqueued(), r.slotted()), (Some(0), 2));
        assert_eq!((0..6).map(|j| r.slot(j)).collect::<Vec<_>>(), [Some(0), Some(1), None, None, None, None]);
        assert_eq!(r.to_free(6, 0), None, "no DMA queued, no slot to ask about");
        // Chunk 1 is filled before chunk 0: its DMA goes first, and its slot is the one to free.
        assert_eq!(r.queue(1, 0), 1);
        assert!(r.queued(1) && !r.queued(0));
        assert_eq!(r.first_unqueued(), Some(0));
        assert_eq!(r.to_free(1, 0), None, "no thread needs a slot for chunk 2 yet");
        assert_eq!(r.to_free(2, 0), Some(1));
        assert_eq!(r.freed(0), (2, 1), "chunk 2 gets chunk 1's slot while chunk 0 is still filling");
        assert_eq!(r.slot(2), Some(1));
        assert_eq!(r.slotted(), 3);
        assert_eq!(r.to_free(6, 0), None, "chunk 0's DMA is not queued");
        assert_eq!(r.queue(0, 0), 0);
        assert_eq!(r.first_unqueued(), Some(2));
        assert_eq!(r.queue(2, 0), 1);
        assert_eq!(r.to_free(3, 0), Some(0));
        assert_eq!(r.freed(0), (3, 0));
        assert_eq!(r.to_free(4, 0), Some(1));
        assert_eq!(r.freed(0), (4, 1));
        assert_eq!(r.queue(4, 0), 1);
        assert_eq!(r.queue(3, 0), 0);
        assert_eq!(r.to_free(5, 0), Some(1), "slots free in the order their DMAs were queued");
        assert_eq!(r.freed(0), (5, 1));
        assert_eq!(r.to_free(6, 0), None, "every chunk has a slot");
        assert_eq!(r.queue(5, 0), 1);
        assert_eq!(r.first_unqueued(), None, "every DMA is queued");
        // Fewer chunks than slots.
        let r = Issuer::new(1, 4);
        assert_eq!((r.slotted(), r.to_free(9, 0)), (1, None));
    }
    #[test]
    fn each_lane_frees_its_slots_in_its_own_order() {
        // 5 chunks through 3 slots: chunks 0 and 2 to the copy engines, chunk 1 to the kernel.
        let mut r = Issuer::new(5, 3);
        assert_eq!(r.queue(0, 0), 0);
        assert_eq!(r.queue(1, 1), 1);
        assert_eq!(r.queue(2, 0), 2);
        assert_eq!((r.in_flight(0), r.in_flight(1)), (2, 1));
        // Each lane offers its oldest; the kernel's completes first and its slot goes on at once.
        assert_eq!(r.to_free(3, 0), Some(0));
        assert_eq!(r.to_free(3, 1), Some(1));
        assert_eq!(r.freed(1), (3, 1));
        assert_eq!((r.in_flight(0), r.in_flight(1)), (2, 0));
        assert_eq!(r.to_free(4, 1), None, "nothing in flight on the kernel lane");
        assert_eq!(r.freed(0), (4, 0));
        assert_eq!(r.to_free(9, 0), None, "every chunk has a slot");
    }
    #[test]
    #[should_panic(expected = "queued twice")]
    fn a_chunk_is_queued_once() {
        let mut r = Issuer::new(3, 2);
        r.queue(0, 0);
        r.queue(0, 0);
    }
}
