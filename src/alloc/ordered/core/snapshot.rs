//! The core's side of a memory snapshot: every heap with its blocks, as they are now.

use super::{Backend, Core};
use crate::alloc::ordered::heap::State;
use crate::alloc::ordered::snapshot::{BlockState, RawBlock, RawSegment};

impl<B: Backend> Core<B> {
    /// Every heap as a segment, its blocks in address order.
    pub(crate) fn snapshot(&mut self) -> Vec<RawSegment> {
        // A block cached in a front is live in its heap until flushed: free, as its owner sees it.
        self.flush_cached();
        let mut out = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let blocks = s
                .heap
                .walk()
                .into_iter()
                .map(|(address, size, pool, state)| {
                    let (state, requested, stream) = match state {
                        State::Live { caller, requested }
                            if self.sharing.freed_shared.contains_key(&address) =>
                        {
                            (BlockState::FreedShared, requested, caller.raw.0)
                        }
                        State::Live { caller, requested } => (BlockState::Live, requested, caller.raw.0),
                        State::Free(_) | State::Cached { .. } | State::Lent { .. } => {
                            (BlockState::Free, 0, 0)
                        }
                    };
                    RawBlock { address, size, requested, pool, stream, state }
                })
                .collect();
            out.push(RawSegment {
                address: s.heap.base(),
                small: s.kind.small(),
                tag: s.kind.tag(),
                asleep: self.is_asleep(s.kind.tag()),
                page: s.page,
                blocks,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::core;
    use super::super::{Capture, SleepMode, Tag};
    use crate::alloc::ordered::heap::ALIGN;
    use crate::alloc::ordered::ids::Handle;
    use crate::alloc::ordered::snapshot::BlockState;

    #[test]
    fn a_snapshot_shows_each_block_live_free_kept_for_a_graph_or_freed_while_shared() {
        let mut c = core(1000);
        let a = c.allocate(5000, 1, Capture::None, None).unwrap();
        let b = c.allocate(8192, 1, Capture::None, None).unwrap();
        let shared = c.allocate(4096, 1, Capture::None, None).unwrap();
        c.free(b, Handle(1)).unwrap();
        c.export(shared, |_| Ok(())).unwrap();
        c.free(shared, Handle(1)).unwrap();
        let g = c.allocate(1024, 5, Capture::Private(77), None).unwrap();

        let segments = c.snapshot();
        let all: Vec<_> = segments.iter().flat_map(|s| s.blocks.iter()).collect();
        let find =
            |addr: u64| all.iter().find(|x| x.address == addr).copied().expect("block in the snapshot");
        assert_eq!(
            (find(a).state, find(a).size, find(a).requested, find(a).stream),
            (BlockState::Live, 5120, 5000, 1)
        );
        assert_eq!(
            find(b).state,
            BlockState::Free,
            "a freed block, cached in its stream's front, shows free"
        );
        assert_eq!(find(shared).state, BlockState::FreedShared);
        assert_eq!((find(g).state, find(g).pool != 0), (BlockState::Live, true));
        assert_eq!(find(a).pool, 0);
        for s in &segments {
            // The blocks tile the carved part of the heap, from its base on.
            let mut at = s.address;
            for x in &s.blocks {
                assert_eq!(x.address, at, "blocks in address order with no gap");
                assert_eq!(x.size % ALIGN, 0);
                at += x.size;
            }
            assert!(!s.asleep && s.tag.is_none());
        }
        // The snapshot changed nothing: the freed block serves its stream's next request again.
        assert_eq!(c.allocate(8192, 1, Capture::None, None).unwrap(), b);
        c.unexport(shared).unwrap();
        assert!(c
            .snapshot()
            .iter()
            .flat_map(|s| s.blocks.iter())
            .all(|x| x.address != shared || x.state == BlockState::Free));
    }

    #[test]
    fn a_snapshot_says_which_heaps_belong_to_a_tag_and_whether_it_sleeps() {
        const TAG: Tag = Tag::of(3);
        let mut c = core(1000);
        let t = c.allocate(4096, 1, Capture::None, Some(TAG)).unwrap();
        let u = c.allocate(4096, 1, Capture::None, None).unwrap();
        c.sleep(TAG, SleepMode::Discard).unwrap();
        let segments = c.snapshot();
        let of = |addr: u64| segments.iter().find(|s| s.blocks.iter().any(|x| x.address == addr)).unwrap();
        assert_eq!((of(t).tag, of(t).asleep), (Some(TAG), true));
        assert_eq!((of(u).tag, of(u).asleep), (None, false));
        c.wake(TAG).unwrap();
        assert!(!c.snapshot().iter().any(|s| s.asleep));
    }
}
