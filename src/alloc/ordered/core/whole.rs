//! Blocks that are one physical allocation each (see [`Core::set_whole_above`]): which heap
//! serves one, and how the memory they hold stays near what is live.
//!
//! Such a block takes a heap of one page of its own size, which another process imports and maps
//! in one call (a physical allocation can only be mapped whole). Freed, that heap serves a later
//! block of about its size. Those pages are neither moved nor lent, so a training step's varied
//! large sizes would each keep an allocation of their own: instead a heap serves only blocks it
//! fits within [`WASTE`], and a new page that would take the memory held past the allocator's
//! bound first gives idle memory back to the driver.

use super::super::heap::BlockId;
use super::super::ids::IDLE;
use super::{Backend, Capture, Core, HeapKind, Request, SlotId, StreamId, Tag, LEND_ABOVE, SMALL};
use crate::error::{Error, Result};

/// A whole heap serves a block whose own page it exceeds by at most 1/WASTE of the block: a
/// training step repeats its sizes, so the heap of each size finds its size again, and a larger
/// idle one is given back rather than pinning its excess under a smaller block.
const WASTE: u64 = 8;

impl<B: Backend> Core<B> {
    /// Makes every later untagged block of at least `bytes` bytes (0: none) one physical
    /// allocation at offset 0, which engines that register a range by its allocation (UCX's POSIX
    /// descriptor path, fabric handles) can carry, and another process maps in one call: such a
    /// block takes a heap of one page of its own size, rounded to the small pages' size, and a
    /// later block it fits (see [`WASTE`]) may reuse it. Those pages are not moved or lent; idle
    /// ones go back to the driver at `empty_cache`, or when a new one would take the memory held
    /// past the lending bound.
    pub(crate) fn set_whole_above(&mut self, bytes: u64) {
        self.whole_above = bytes;
    }

    /// The heaps that serve `n` bytes tagged `tag`.
    pub(super) fn kind_of(&self, n: u64, tag: Option<Tag>) -> HeapKind {
        if tag.is_none() && self.whole_above != 0 && n >= self.whole_above.max(SMALL + 1) {
            HeapKind::Whole
        } else if n <= SMALL {
            HeapKind::Small(tag)
        } else {
            HeapKind::Large(tag)
        }
    }

    /// The page (and heap) size of a whole block of `n` bytes: rounded to the small page, not
    /// the large one, which would add up to 124 MiB to a block of one allocation.
    pub(super) fn whole_page(&self, n: u64) -> Result<u64> {
        let unit = self.sizes.small_page;
        n.div_ceil(unit)
            .checked_mul(unit)
            .ok_or_else(|| Error::invalid(format!("{n} bytes cannot be allocated")))
    }

    /// The largest page of a whole heap that may serve a block of `n` bytes: its own page, or
    /// the block and 1/[`WASTE`] of it.
    pub(super) fn whole_limit(&self, n: u64) -> u64 {
        let own = self.whole_page(n).unwrap_or(u64::MAX);
        own.max(n.saturating_add(n / WASTE))
    }

    /// The free block of a whole heap for `n` bytes of pool `pool` that `reuse` may take (as for
    /// [`Heap::find`](super::Heap::find)), in the smallest heap within [`whole_limit`](Self::whole_limit).
    pub(super) fn find_whole(&self, pool: u32, reuse: StreamId, n: u64) -> Option<(SlotId, BlockId)> {
        self.best_whole(pool, reuse, n, self.whole_limit(n), true)
    }

    /// The free block for `n` bytes of pool `pool` that `reuse` may take in the smallest whole heap
    /// of at most `limit` bytes, mapped or (`mapped` false) given back to the driver.
    fn best_whole(
        &self,
        pool: u32,
        reuse: StreamId,
        n: u64,
        limit: u64,
        mapped: bool,
    ) -> Option<(SlotId, BlockId)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind == HeapKind::Whole && s.page <= limit)
            .filter(|(_, s)| s.pages.first().is_some_and(Option::is_some) == mapped)
            .filter_map(|(i, s)| s.heap.find(pool, reuse, n).map(|(_, id)| (s.page, SlotId::of(i), id)))
            .min_by_key(|&(page, slot, _)| (page, slot))
            .map(|(_, slot, id)| (slot, id))
    }

    /// Before a new whole page of `page` bytes is made for a block of `n`: when it would take the
    /// memory held past [`LEND_ABOVE`] times the largest live total, gives idle memory back to
    /// the driver until it would not (or none is left), spare pages first, then idle whole
    /// pages, largest first (fewest driver calls), then idle ordinary pages. Only idle memory
    /// goes: no stream's queued work nor any graph can reach it, and a block freed while shared
    /// is live in its heap. Returns whether the page now fits under the bound.
    pub(super) fn make_room(&mut self, page: u64, n: u64) -> Result<bool> {
        // The block's own rounding up to its page counts as live: without it a first block whose
        // page exceeds it by more than the bound's margin could never be whole.
        let own = page.max(n);
        if self.over_bound(page, own) == 0 {
            return Ok(true);
        }
        self.release_spare();
        let over = self.over_bound(page, own);
        self.give_back_whole(over)?;
        let over = self.over_bound(page, own);
        if over > 0 {
            self.reclaim(over.div_ceil(self.sizes.page) as usize)?;
            self.release_spare();
        }
        Ok(self.over_bound(page, own) == 0)
    }

    /// How far `new` more bytes would take the memory held (mapped and spare pages) past
    /// [`LEND_ABOVE`] times the largest live total, counting `own` bytes about to be live.
    /// Blocks freed while shared count as live: importers still use them, so a sender whose
    /// tensors were freed before their receivers let go still makes its next ones whole.
    fn over_bound(&mut self, new: u64, own: u64) -> u64 {
        self.take_counts();
        let peak = (self.stats.live + self.stats.freed_shared + own).max(self.stats.live_peak);
        let held = self.held.mapped + self.held.spare.len() as u64 * self.sizes.page + new;
        held.saturating_sub((peak as f64 * LEND_ABOVE) as u64)
    }

    /// Gives idle whole pages back to the driver, largest first, until `over` bytes went (or none
    /// is left).
    fn give_back_whole(&mut self, over: u64) -> Result<()> {
        let mut idle: Vec<(u64, usize)> =
            (0..self.slots.len()).filter(|&i| self.idle_whole(i)).map(|i| (self.slots[i].page, i)).collect();
        idle.sort_unstable_by(|a, b| b.cmp(a));
        let mut gone = 0;
        for (_, i) in idle {
            if gone >= over {
                break;
            }
            gone += self.drop_whole(i)?;
        }
        self.note_mapped();
        Ok(())
    }

    /// Unmaps the page of whole heap `i` and gives it back to the driver; returns its bytes.
    fn drop_whole(&mut self, i: usize) -> Result<u64> {
        self.release_page(SlotId::of(i), 0)
    }

    /// A block for `req` (of whole kind) that no heap within [`WASTE`] serves, when a new page for
    /// it would take the memory held past the bound even once idle memory went back: the smallest
    /// mapped whole heap it may take, whatever its excess (its memory is held already), else
    /// ordinary pages (which lending keeps within the bound). `None`: a new whole heap is fine.
    pub(super) fn whole_over_bound(&mut self, req: &Request) -> Result<Option<(SlotId, u64)>> {
        let reuse = if matches!(req.capture, Capture::Shared(_)) { IDLE } else { req.stream.id };
        let room = self.make_room(self.whole_page(req.n)?, req.n)?;
        let (limit, mapped) = if room { (self.whole_limit(req.n), false) } else { (u64::MAX, true) };
        if let Some((slot, id)) = self.best_whole(req.pool, reuse, req.n, limit, mapped) {
            // Within the bound: a heap given back earlier maps a page again. Past it: memory
            // already held.
            return self.take_found(req, slot, id).map(Some);
        }
        if room {
            return Ok(None);
        }
        let ordinary = Request { kind: HeapKind::Large(None), ..*req };
        self.allocate_slow(&ordinary).map(Some)
    }

    /// Whether slot `i` is a whole heap of one page larger than an ordinary one (those are
    /// `reclaim`'s), mapped and wholly idle.
    fn idle_whole(&self, i: usize) -> bool {
        let s = &self.slots[i];
        s.kind == HeapKind::Whole
            && s.page != self.sizes.page
            && s.pages.first().is_some_and(Option::is_some)
            && s.heap.idle_pages(s.page).first() == Some(&0)
    }

    /// Unmaps and releases the pages of one-page heaps whose free space is idle; returns the bytes.
    pub(super) fn release_whole(&mut self) -> Result<u64> {
        let mut bytes = 0;
        for slot in 0..self.slots.len() {
            if self.idle_whole(slot) {
                bytes += self.drop_whole(slot)?;
            }
        }
        self.note_mapped();
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{core, shared_ids, PAGE, TAG, TPAGE};
    use super::super::{Capture, Handle};

    #[test]
    fn above_the_threshold_a_block_is_one_allocation_released_by_empty_cache() {
        let mut c = core(1000);
        c.set_whole_above(24 * PAGE);
        let units = c.backend().units.get();
        let big = c.allocate(40 * PAGE + 100, 1, Capture::None, None).unwrap();
        let at = c.export(big, |_| Ok(())).unwrap();
        assert_eq!((at.count, at.page, at.first_page), (1, 41 * PAGE, big), "one page of the block's size");
        c.unexport(big).unwrap();
        // Below the threshold, and tagged: ordinary heaps.
        let small = c.allocate(2 * PAGE, 1, Capture::None, None).unwrap();
        assert_eq!(c.export(small, |_| Ok(())).unwrap().page, PAGE);
        let tagged = c.allocate(40 * PAGE, 1, Capture::None, Some(TAG)).unwrap();
        assert_eq!(c.export(tagged, |_| Ok(())).unwrap().page, TPAGE);
        assert_eq!(c.backend().units.get() - units, 41 + 2 + 40);
        // Freed, it serves the next block it fits within an eighth where it is, still one
        // allocation.
        c.free(big, Handle(1)).unwrap();
        let again = c.allocate(38 * PAGE, 1, Capture::None, None).unwrap();
        assert_eq!(again, big);
        assert_eq!(c.export(again, |_| Ok(())).unwrap().count, 1);
        c.unexport(again).unwrap();
        c.free(again, Handle(1)).unwrap();
        // A much smaller block does not pin it: the idle heap goes back to the driver rather than
        // the new one taking the memory held past the bound.
        let small = c.allocate(30 * PAGE, 1, Capture::None, None).unwrap();
        assert!(small < big || small >= big + 41 * PAGE, "a heap of 41 pages does not serve 30");
        assert_eq!(c.backend().units.get() - units, 30 + 2 + 40, "the idle 41 pages went back");
        c.free(small, Handle(1)).unwrap();
        let released = c.stats().pages_released;
        assert_eq!(c.empty_cache().unwrap(), 30 * PAGE);
        assert_eq!(c.stats().pages_released - released, 1);
        assert_eq!(c.backend().units.get() - units, 2 + 40, "the whole blocks' memory went back");
        // The heap given back maps a fresh page for a block it fits.
        let fresh = c.allocate(41 * PAGE, 1, Capture::None, None).unwrap();
        assert_eq!(fresh, big);
        assert_eq!(c.export(fresh, |_| Ok(())).unwrap().count, 1);
        assert_eq!(c.backend().units.get() - units, 41 + 2 + 40);
    }

    #[test]
    fn a_whole_block_freed_while_shared_keeps_its_allocation_and_counts_as_held_for_the_bound() {
        let mut c = core(1000);
        c.set_whole_above(24 * PAGE);
        let units = c.backend().units.get();
        let big = c.allocate(40 * PAGE, 1, Capture::None, None).unwrap();
        let shared = shared_ids(&mut c, big);
        c.free(big, Handle(1)).unwrap();
        assert_eq!(c.stats().freed_shared, 40 * PAGE);
        // The shared allocation is neither given back nor reused; the memory importers hold
        // counts as live, so the next block of its size is whole too, beside it.
        let next = c.allocate(40 * PAGE, 1, Capture::None, None).unwrap();
        assert!(next + 40 * PAGE <= big || next >= big + 40 * PAGE, "not on the shared block");
        let at = c.export(next, |_| Ok(())).unwrap();
        assert_eq!((at.page, at.count), (40 * PAGE, 1), "one allocation");
        c.unexport(next).unwrap();
        let mut still = Vec::new();
        c.exported_pages(big, |p| {
            still.push(p.id);
            Ok(())
        })
        .unwrap();
        assert_eq!(still, shared, "the importers' allocation stays where it is");
        assert_eq!(c.backend().units.get() - units, 80);
        c.empty_cache().unwrap();
        assert_eq!(c.backend().units.get() - units, 80, "neither is idle");
        // Let go, it is idle: given back, and the next whole block of its size maps it again.
        c.free(next, Handle(1)).unwrap();
        c.unexport(big).unwrap();
        c.empty_cache().unwrap();
        assert_eq!(c.backend().units.get() - units, 0);
        let again = c.allocate(40 * PAGE, 1, Capture::None, None).unwrap();
        assert!(again == big || again == next);
        assert_eq!(c.export(again, |_| Ok(())).unwrap().count, 1);
    }
}
