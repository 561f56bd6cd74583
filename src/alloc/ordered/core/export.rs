//! Blocks shared with other processes: which pages lie under a live block, and the marks that
//! keep a tag with shared blocks from sleeping.
//!
//! An importer maps the pages themselves (their physical memory stays alive as long as it holds
//! them), so sharing moves nothing here. What must not happen is the block's memory being handed
//! out again while an importer still reads and writes it: a shared block freed before its
//! importers let go stays live in its heap, out of every later allocation, until the last
//! [`Core::unexport`], as PyTorch defers the free of a block lent through CUDA IPC.

use super::{Backend, Core, Epoch, Exported, Owner, SlotId, StreamId, Tag};
use crate::alloc::{BlockShare, DevicePtr};
use crate::error::{Error, Result};

/// Where a live block lies on its pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockPages {
    /// The block's address.
    pub block: u64,
    /// The block's size (a multiple of 512).
    pub len: u64,
    /// The address of the first page under it, and the size of every page.
    pub first_page: u64,
    pub page: u64,
    /// How many pages, adjacent from `first_page`.
    pub count: u64,
}

impl BlockPages {
    /// The block as its exports give it, on pages of these serials (one per page).
    pub fn share(self, pages: Vec<u64>) -> BlockShare {
        BlockShare {
            block: DevicePtr::new(self.block),
            len: self.len,
            first_page: self.first_page,
            page: self.page as usize,
            pages,
        }
    }
}

impl<B: Backend> Core<B> {
    /// The live block holding `addr` (anywhere inside it), as (slot, address, size).
    fn live_block_at(&self, addr: u64) -> Option<(SlotId, u64, u64)> {
        let slot = SlotId::of(self.slots.iter().position(|s| s.heap.contains(addr))?);
        self.slots[slot]
            .heap
            .live_blocks()
            .find(|&(a, n)| addr >= a && addr - a < n && !self.sharing.freed_shared.contains_key(&a))
            .map(|(a, n)| (slot, a, n))
    }

    /// The live block holding `addr`, as (address, size), if this allocator handed it out.
    pub(crate) fn owner_of(&mut self, addr: u64) -> Option<(u64, u64)> {
        // A block cached in a front is still live in its heap.
        self.flush_cached();
        self.live_block_at(addr).map(|(_, a, n)| (a, n))
    }

    /// The pages under the live block holding `addr`, each given to `each` in address order, and
    /// the block marked shared: until as many [`unexport`](Self::unexport) calls, its tag refuses
    /// to sleep. A failure of `each` leaves nothing marked.
    pub(crate) fn export(
        &mut self,
        addr: u64,
        mut each: impl FnMut(&B::Page) -> Result<()>,
    ) -> Result<BlockPages> {
        // A block cached in a front is still live in its heap.
        self.flush_cached();
        let (slot, block, len) = self
            .live_block_at(addr)
            .ok_or_else(|| Error::invalid(format!("{addr:#x} is not a live allocation")))?;
        if !self.is_awake(self.slots[slot].kind.tag()) {
            return Err(Error::invalid(
                "the block's tag is asleep or going to sleep: wake it before sharing",
            ));
        }
        let at = self.pages_under(slot, block, len, &mut each)?;
        // Its free must drop the mark: the front's fast path leaves it to the core.
        self.free_via_core(slot, block);
        let mark = self.sharing.exported.entry(block).or_insert(Exported { sharings: 0, len });
        mark.sharings += 1;
        if mark.sharings == 1 {
            self.stats.exported += len;
        }
        Ok(at)
    }

    /// The pages under the shared block at `block` (its address, as [`export`](Self::export)
    /// returned it), each given to `each` in address order: what an importer maps, asked for
    /// after the mark, when it turns out to need them. The block may have been freed meanwhile
    /// (its mark keeps it, and its pages, live). Refused for a block not shared.
    pub(crate) fn exported_pages(
        &self,
        block: u64,
        mut each: impl FnMut(&B::Page) -> Result<()>,
    ) -> Result<BlockPages> {
        let &Exported { len, .. } = self
            .sharing
            .exported
            .get(&block)
            .ok_or_else(|| Error::invalid(format!("{block:#x} is not shared")))?;
        let slot = self
            .slots
            .iter()
            .position(|s| s.heap.contains(block))
            .map(SlotId::of)
            .ok_or_else(|| Error::invalid("a shared block lies in no heap"))?;
        self.pages_under(slot, block, len, &mut each)
    }

    /// The pages of `slot` under the `len` bytes at `block`, each given to `each` in order.
    fn pages_under(
        &self,
        slot: SlotId,
        block: u64,
        len: u64,
        each: &mut impl FnMut(&B::Page) -> Result<()>,
    ) -> Result<BlockPages> {
        let s = &self.slots[slot];
        let (base, page) = (s.heap.base(), s.page);
        let (first, end) = ((block - base) / page, (block + len - base).div_ceil(page));
        for p in first..end {
            let handle = s.pages[p as usize]
                .as_ref()
                .ok_or_else(|| Error::invalid("a page of a live block is not mapped"))?;
            each(handle)?;
        }
        Ok(BlockPages { block, len, first_page: base + first * page, page, count: end - first })
    }

    /// One sharing of the block at `block` (its address, as [`export`](Self::export) returned it)
    /// is over: its importers unmapped it. The last one of a block already freed frees it now.
    pub(crate) fn unexport(&mut self, block: u64) -> Result<()> {
        let Some(mark) = self.sharing.exported.get_mut(&block) else {
            return Err(Error::invalid(format!("{block:#x} is not shared")));
        };
        mark.sharings -= 1;
        if mark.sharings > 0 {
            return Ok(());
        }
        let len = mark.len;
        self.sharing.exported.remove(&block);
        let Some((stream, epoch)) = self.sharing.freed_shared.remove(&block) else {
            self.stats.exported -= len;
            return Ok(());
        };
        self.stats.freed_shared -= len;
        // Its free's event was recorded (or its stream caught up) when it was freed; a stream
        // forgotten since had run all its work.
        let idle = !matches!(self.streams.get(&stream), Some(st) if st.done < epoch);
        let owner = if idle { Owner::Idle } else { Owner::Stream { stream, epoch } };
        let slot = self.slots.iter().position(|s| s.heap.contains(block));
        let freed = slot.and_then(|slot| self.slots[slot].heap.free(block, owner));
        debug_assert!(freed.is_some(), "a block freed while shared stays live in its heap");
        if self.sharing.empty_when_unshared {
            self.sharing.empty_when_unshared = !self.sharing.freed_shared.is_empty();
            // Its free's work is done (idle) or waited for by the next emptying: pages that
            // are idle now go back, as the emptying that came while it was shared would have.
            if idle {
                self.release_idle()?;
            }
        }
        Ok(())
    }

    /// An emptying of the cache has just run: blocks freed while shared, which it could not give
    /// back, give their pages back as their last sharing ends.
    pub(crate) fn emptied(&mut self) {
        self.sharing.empty_when_unshared = !self.sharing.freed_shared.is_empty();
    }

    /// Keeps the shared block at `block`, which its owner has just freed on `stream` at `epoch`,
    /// live in its heap until its last sharing is over.
    pub(super) fn hold_freed(&mut self, block: u64, stream: StreamId, epoch: Epoch) {
        if let Some(&Exported { len, .. }) = self.sharing.exported.get(&block) {
            self.sharing.freed_shared.insert(block, (stream, epoch));
            self.stats.exported -= len;
            self.stats.freed_shared += len;
        }
    }

    /// Whether a live block of `tag` is shared.
    pub(crate) fn tag_shared(&self, tag: Tag) -> bool {
        self.sharing
            .exported
            .keys()
            .any(|&a| self.slots.iter().any(|s| s.kind.tag() == Some(tag) && s.heap.contains(a)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{core, shared_ids, Gpu, PAGE, TAG, TPAGE};
    use super::super::{Capture, Core, Handle, SleepMode};
    use crate::error::Error;

    #[test]
    fn a_block_is_shared_with_the_pages_under_it_from_any_address_inside() {
        let mut c = core(1000);
        let a = c.allocate(PAGE / 2, 1, Capture::None, None).unwrap();
        // Large: three pages and a half, starting on a page of its own heap.
        let b = c.allocate(3 * PAGE + PAGE / 2, 1, Capture::None, None).unwrap();
        let mut ids = Vec::new();
        let at = c
            .export(b + PAGE + 4096, |p| {
                ids.push(p.id);
                Ok(())
            })
            .unwrap();
        assert_eq!((at.block, at.len, at.page, at.count), (b, 3 * PAGE + PAGE / 2, PAGE, 4));
        assert_eq!(at.first_page, b / PAGE * PAGE);
        ids.dedup();
        assert_eq!(ids.len(), 4, "four distinct pages, in order");
        assert_eq!(c.stats().exported, at.len);
        assert_eq!(c.owner_of(a + 100), Some((a, 512 * (PAGE / 2 / 512))));
        assert_eq!(c.owner_of(b + at.len), None, "past the block's end");
        // Twice shared, twice let go.
        c.export(b, |_| Ok(())).unwrap();
        assert_eq!(c.stats().exported, at.len, "bytes count once");
        c.unexport(b).unwrap();
        assert_eq!(c.stats().exported, at.len);
        c.unexport(b).unwrap();
        assert_eq!(c.stats().exported, 0);
        assert!(c.unexport(b).is_err(), "no sharing left");
        assert!(c.unexport(a).is_err(), "never shared");
    }

    #[test]
    fn a_failed_export_marks_nothing_and_free_or_missing_blocks_are_refused() {
        let mut c = core(1000);
        let b = c.allocate(2 * PAGE, 1, Capture::None, None).unwrap();
        let mut calls = 0;
        let r = c.export(b, |_| {
            calls += 1;
            if calls == 2 {
                Err(Error::invalid("refused by the test"))
            } else {
                Ok(())
            }
        });
        assert!(r.is_err());
        assert_eq!(c.stats().exported, 0);
        assert!(c.unexport(b).is_err());
        assert!(c.export(b + 2 * PAGE, |_| Ok(())).is_err(), "past the block");
        c.free(b, Handle(1)).unwrap();
        assert!(c.export(b, |_| Ok(())).is_err(), "a freed block");
        assert_eq!(c.owner_of(b), None);
    }

    /// Page ids under the block at `addr`, shared once and let go.
    fn page_ids(c: &mut Core<Gpu>, addr: u64) -> Vec<u32> {
        let ids = shared_ids(c, addr);
        c.unexport(addr).unwrap();
        ids
    }

    #[test]
    fn a_block_freed_while_shared_stays_out_of_every_allocation_until_its_importers_let_go() {
        for stream in [1, 2] {
            let mut c = core(1000);
            let b = c.allocate(4 * PAGE, 1, Capture::None, None).unwrap();
            let shared = shared_ids(&mut c, b);
            c.export(b, |_| Ok(())).unwrap();
            let live = c.stats().live;
            c.free(b, Handle(stream)).unwrap();
            let s = c.stats();
            assert_eq!((s.live, s.exported, s.freed_shared), (live - 4 * PAGE, 0, 4 * PAGE));
            assert!(c.free(b, Handle(stream)).is_err(), "freed twice");
            assert_eq!(c.owner_of(b), None, "no longer the owner's block");
            assert!(c.export(b, |_| Ok(())).is_err(), "a freed block cannot be shared again");
            // Neither its addresses nor its pages serve anything, on any stream, nor are they
            // given back: the importers' pages are these very ones.
            c.empty_cache().unwrap();
            let mut held = Vec::new();
            for n in [4 * PAGE, 4 * PAGE, PAGE, 2 * PAGE + 512, 4 * PAGE] {
                for s in [1, 2] {
                    let a = c.allocate(n, s, Capture::None, None).unwrap();
                    assert!(a + n <= b || a >= b + 4 * PAGE, "{a:#x} lies on the freed shared block");
                    if n % PAGE == 0 && a % PAGE == 0 {
                        assert!(page_ids(&mut c, a).iter().all(|id| !shared.contains(id)));
                    }
                    held.push(a);
                }
            }
            for a in held.drain(..) {
                c.free(a, Handle(1)).unwrap();
            }
            c.unexport(b).unwrap();
            assert_eq!(c.stats().freed_shared, 4 * PAGE, "one importer left");
            c.unexport(b).unwrap();
            assert_eq!((c.stats().freed_shared, c.stats().exported), (0, 0));
            assert!(c.unexport(b).is_err(), "nothing shared any more");
            // Given back: its memory serves the next request of its size again.
            c.empty_cache().unwrap();
            let again = c.allocate(4 * PAGE, 1, Capture::None, None).unwrap();
            assert_eq!(again, b);
            c.free(again, Handle(1)).unwrap();
            assert_eq!(c.stats().live, 0);
        }
    }

    #[test]
    fn a_cache_emptied_while_a_freed_block_was_shared_gives_its_pages_back_when_its_sharing_ends() {
        let mut c = core(1000);
        let b = c.allocate(4 * PAGE, 1, Capture::None, None).unwrap();
        c.export(b, |_| Ok(())).unwrap();
        c.free(b, Handle(1)).unwrap();
        c.empty_cache().unwrap();
        let mapped = c.stats().mapped;
        assert!(mapped >= 4 * PAGE, "held while an importer may use it");
        c.unexport(b).unwrap();
        assert_eq!(c.stats().mapped, mapped - 4 * PAGE, "given back as the emptying would have");
        // Without an emptying meanwhile, a block let go stays cached as any freed block does.
        let b = c.allocate(4 * PAGE, 1, Capture::None, None).unwrap();
        c.export(b, |_| Ok(())).unwrap();
        c.free(b, Handle(1)).unwrap();
        let mapped = c.stats().mapped;
        c.unexport(b).unwrap();
        assert_eq!(c.stats().mapped, mapped);
    }

    #[test]
    fn a_block_let_go_while_its_stream_still_runs_goes_back_at_the_next_emptying() {
        use super::super::tests::Op;
        let mut c = core(1000);
        let b = c.allocate(4 * PAGE, 1, Capture::None, None).unwrap();
        c.export(b, |_| Ok(())).unwrap();
        // Work still queued on the block's stream when it is freed and when its sharing ends.
        c.backend().queues.entry(1).or_default().push_back(Op::Use { addr: b, len: 4096 });
        c.free(b, Handle(1)).unwrap();
        c.unexport(b).unwrap();
        let mapped = c.stats().mapped;
        c.empty_cache().unwrap();
        assert_eq!(c.stats().mapped, mapped - 4 * PAGE, "its pages stay mapped after the emptying");
    }

    #[test]
    fn blocks_let_go_after_later_ones_on_other_streams_go_back_at_the_next_emptying() {
        let mut c = core(1000);
        let mut pending = Vec::new();
        for round in 0..50usize {
            let s = 2 + (round % 2) as u64;
            let n = [4096, 100_000, 1 << 20, 3 << 20, 9 << 20][round % 5];
            c.backend().in_call = Some(s);
            let b = c.allocate(n, s, Capture::None, None).unwrap();
            c.export(b, |_| Ok(())).unwrap();
            c.free(b, Handle(s)).unwrap();
            c.backend().in_call = None;
            pending.push(b);
            if pending.len() > 2 {
                c.unexport(pending.remove(0)).unwrap();
            }
        }
        for b in pending {
            c.unexport(b).unwrap();
        }
        assert_eq!(c.stats().live, 0);
        c.empty_cache().unwrap();
        assert_eq!(c.stats().mapped, 0, "{:?}", c.stats());
    }

    #[test]
    fn a_block_freed_before_its_sharing_ends_goes_back_to_its_stream_once_let_go() {
        let mut c = core(1000);
        let b = c.allocate(2 * PAGE, 1, Capture::None, None).unwrap();
        c.export(b, |_| Ok(())).unwrap();
        c.free(b, Handle(1)).unwrap();
        c.unexport(b).unwrap();
        // Its stream's next block of that size is this one, as after any free on the stream.
        assert_eq!(c.allocate(2 * PAGE, 1, Capture::None, None).unwrap(), b);
        // A block let go before its free is freed as any other.
        c.export(b, |_| Ok(())).unwrap();
        c.unexport(b).unwrap();
        c.free(b, Handle(1)).unwrap();
        assert_eq!(c.stats().freed_shared, 0);
        assert_eq!(c.allocate(2 * PAGE, 1, Capture::None, None).unwrap(), b);
    }

    #[test]
    fn a_marked_block_gives_its_pages_later_even_freed_and_not_once_let_go() {
        let mut c = core(1000);
        let b = c.allocate(3 * PAGE, 1, Capture::None, None).unwrap();
        let mut marked = Vec::new();
        // Marked without asking for anything of its pages but their ids.
        let at = c
            .export(b + 512, |p| {
                marked.push(p.id);
                Ok(())
            })
            .unwrap();
        c.free(b, Handle(1)).unwrap();
        // Asked for by the block's address once an importer turns out to need them.
        let mut later = Vec::new();
        let again = c
            .exported_pages(b, |p| {
                later.push(p.id);
                Ok(())
            })
            .unwrap();
        assert_eq!((again, later), (at, marked), "the same pages, freed or not");
        assert!(c.exported_pages(b + 512, |_| Ok(())).is_err(), "by the block's address only");
        c.unexport(b).unwrap();
        assert!(c.exported_pages(b, |_| Ok(())).is_err(), "no longer shared");
        let never = c.allocate(PAGE, 1, Capture::None, None).unwrap();
        assert!(c.exported_pages(never, |_| Ok(())).is_err(), "never shared");
    }

    #[test]
    fn a_tag_with_a_shared_block_refuses_to_sleep_until_it_is_let_go() {
        let mut c = core(1000);
        let a = c.allocate(2 * TPAGE, 1, Capture::None, Some(TAG)).unwrap();
        let other = c.allocate(PAGE, 1, Capture::None, None).unwrap();
        c.export(a, |_| Ok(())).unwrap();
        c.export(other, |_| Ok(())).unwrap();
        let before = c.tag_stats(TAG);
        assert!(c.sleep(TAG, SleepMode::Discard).is_err());
        assert_eq!(c.tag_stats(TAG), before, "nothing changed");
        c.unexport(a).unwrap();
        // An untagged shared block does not hold the tag back.
        c.sleep(TAG, SleepMode::Discard).unwrap();
        assert!(c.export(a, |_| Ok(())).is_err(), "an asleep block cannot be shared");
        c.wake(TAG).unwrap();
        c.export(a, |_| Ok(())).unwrap();
    }
}
