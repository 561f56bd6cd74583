//! What the allocator as a whole promises between calls, checked (tests only): the model tests
//! run [`Core::check`] after every step, so that a broken invariant fails the step that broke
//! it rather than a later, unrelated one.

use super::super::front::Entry;
use super::super::heap::{Owner, State};
use super::{Backend, Caller, Core, Exported, SlotId};
use std::collections::HashMap;

impl<B: Backend> Core<B> {
    /// Checks every heap's structure, and across them:
    ///
    /// * each stream's numbering: every event number waited for lies between the latest one
    ///   known complete and the next, and so does every stamp in its front;
    /// * each front's blocks are live blocks of the size it says, in the heap it says, handed out
    ///   on its stream through its handle;
    /// * every block owned by a stream (freed, lent or cached there) belongs to a stream the
    ///   allocator still knows, and one whose work on it has not been found done (else it would
    ///   be idle);
    /// * the counters: live and requested bytes are those of the blocks held, the fronts'
    ///   uncollected counts included; mapped bytes are the pages in the tables; shared bytes are
    ///   the shared blocks';
    /// * lent pages are out of their tables, under a lent block of the stream and free that lent
    ///   them.
    pub(crate) fn check(&self) {
        let mut blocks = HashMap::new();
        for (i, s) in self.slots.iter().enumerate() {
            s.heap.check();
            for (addr, size, state) in s.heap.blocks_in_order().0 {
                blocks.insert(addr, (SlotId::of(i), size, state));
            }
        }

        let (mut front_live, mut front_requested) = (0i64, 0i64);
        let mut in_fronts: HashMap<u64, Entry> = HashMap::new();
        self.streams.check();
        for (&id, st) in self.streams.iter() {
            let f = st.front.lock();
            f.check();
            let owner = Caller { id, raw: st.front.raw };
            for (&addr, e) in &f.blocks {
                let &(slot, size, state) =
                    blocks.get(&addr).unwrap_or_else(|| panic!("{id:?}'s front holds {addr:#x}, in no heap"));
                assert!(
                    slot == e.slot && size == e.n && matches!(state, State::Live { caller, .. } if caller == owner),
                    "{owner:?}'s front holds {addr:#x} as {e:?}; its heap has it as {state:?}, {size} bytes in {slot:?}"
                );
                assert!(
                    !self.sharing.freed_shared.contains_key(&addr),
                    "{addr:#x} freed while shared stays out of fronts"
                );
                in_fronts.insert(addr, *e);
            }
            front_live += f.counts.live;
            front_requested += f.counts.requested;
        }

        let (mut live, mut requested) = (0u64, 0u64);
        for (&addr, &(_, size, state)) in &blocks {
            match state {
                State::Live { requested: r, .. } if !self.sharing.freed_shared.contains_key(&addr) => {
                    match in_fronts.get(&addr) {
                        Some(e) if e.cached => {}
                        Some(e) => (live, requested) = (live + size, requested + e.requested),
                        None => (live, requested) = (live + size, requested + r),
                    }
                }
                State::Live { .. } | State::Free(Owner::Idle) => {}
                State::Free(Owner::Stream { stream, epoch }) | State::Lent { stream, epoch } => {
                    let st = self.streams.get(&stream).unwrap_or_else(|| {
                        panic!("{addr:#x} ({state:?}) belongs to {stream:?}, which the allocator forgot")
                    });
                    assert!(
                        st.done < epoch,
                        "{addr:#x} ({state:?}) is idle: {stream:?} is done up to {:?}",
                        st.done
                    );
                }
                State::Cached { stream, .. } => {
                    assert!(
                        self.streams.contains_key(&stream),
                        "{addr:#x} cached for {stream:?}, which the allocator forgot"
                    );
                }
            }
        }
        let s = &self.stats;
        assert_eq!(
            s.live.wrapping_add_signed(front_live),
            live,
            "live bytes counted against the blocks held"
        );
        assert_eq!(
            s.requested.wrapping_add_signed(front_requested),
            requested,
            "requested bytes counted against the blocks held"
        );

        let in_tables: u64 =
            self.slots.iter().map(|s| s.pages.iter().filter(|p| p.is_some()).count() as u64 * s.page).sum();
        assert_eq!(self.held.mapped, in_tables, "mapped bytes against the pages in the tables");
        assert!(self.lending.borrowed.is_empty(), "pages lent to a batch are never kept beyond it");
        assert_eq!(
            s.mapped,
            self.held.mapped + self.held.spare.len() as u64 * self.sizes.page,
            "mapped bytes counted"
        );

        for l in &self.lending.lent {
            let slot = &self.slots[l.slot];
            for &p in &l.pages {
                assert!(
                    slot.pages[p as usize].is_none(),
                    "lent page {p} of {:?} is back in its table",
                    l.slot
                );
                let at = slot.heap.base() + p * slot.page;
                let under = blocks.iter().find(|(&a, &(i, n, _))| i == l.slot && a <= at && at < a + n);
                assert!(
                    matches!(under, Some((_, &(_, _, State::Lent { stream, epoch }))) if stream == l.stream && epoch == l.epoch),
                    "lent page {p} of {:?} lies under {under:?}, not a block {:?} lent at {:?}",
                    l.slot,
                    l.stream,
                    l.epoch
                );
            }
        }

        let mut exported = 0;
        for (&addr, &Exported { sharings: n, len }) in &self.sharing.exported {
            assert!(n > 0, "{addr:#x} shared by no one is not marked");
            assert!(
                matches!(blocks.get(&addr), Some(&(_, size, State::Live { .. })) if size == len),
                "{addr:#x} shared as {len} bytes is {:?}",
                blocks.get(&addr)
            );
            if !self.sharing.freed_shared.contains_key(&addr) {
                exported += len;
            }
        }
        let mut freed_shared = 0;
        for addr in self.sharing.freed_shared.keys() {
            freed_shared +=
                self.sharing.exported.get(addr).map(|e| e.len).expect("a block freed while shared is shared");
        }
        assert_eq!((s.exported, s.freed_shared), (exported, freed_shared), "shared bytes counted");
    }
}
