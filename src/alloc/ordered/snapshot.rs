//! A picture of an allocator's memory as it is now: each heap as a segment, each block in it
//! handed out, free, or freed while another process still maps it. What PyTorch's memory
//! snapshots show of its caching allocator, for cuvmm's own heaps.

use super::{lock, StreamAllocator, Tag, TAGS};

/// What a block is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out and not freed.
    Live,
    /// Free: in the index, kept whole for its stream's next request of its size, or lent.
    Free,
    /// Freed while shared with another process: out of every request until the last sharing
    /// ends.
    FreedShared,
}

/// One block of a [`SegmentSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// Where the block starts.
    pub address: u64,
    /// Bytes, a multiple of 512.
    pub size: u64,
    /// Bytes the request asked for (0 for a free block).
    pub requested: u64,
    /// The captured graph the block is kept for (0: none).
    pub graph_pool: u32,
    /// The stream handle the block was handed out on (0 for a free block, and for the legacy
    /// default stream).
    pub stream: u64,
    /// Handed out, free, or freed while shared.
    pub state: BlockState,
}

/// One heap: a range of address space whose blocks, from `address` on, tile what was carved so
/// far (pages under free blocks may have been given back).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Where the heap's address space starts: its first block's address.
    pub address: u64,
    /// Whether the heap serves small requests (PyTorch's "small" segments).
    pub small: bool,
    /// The tag whose blocks this heap holds, if any.
    pub tag: Option<String>,
    /// Whether that tag is asleep (its blocks then have no memory under them).
    pub asleep: bool,
    /// Bytes per page of the heap.
    pub page: u64,
    /// The blocks in address order, each starting where the one before ends.
    pub blocks: Vec<BlockSnapshot>,
}

impl SegmentSnapshot {
    /// Bytes the blocks cover.
    pub fn size(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }
}

/// The core's view, with tags as numbers.
pub(crate) struct RawSegment {
    pub address: u64,
    pub small: bool,
    pub tag: Option<Tag>,
    pub asleep: bool,
    pub page: u64,
    pub blocks: Vec<RawBlock>,
}

pub(crate) struct RawBlock {
    pub address: u64,
    pub size: u64,
    pub requested: u64,
    pub pool: u32,
    pub stream: u64,
    /// Handed out, free, or freed while shared.
    pub state: BlockState,
}

impl StreamAllocator {
    /// Every heap and block as they are now, heaps in the order they were made. Takes the
    /// device-wide lock for a walk of every block: for looking at memory, not for a hot path.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let raw = self.inner.alloc.core().snapshot();
        let names = lock(&TAGS).clone();
        raw.into_iter().map(|s| segment(s, &names)).collect()
    }
}

fn segment(s: RawSegment, names: &[String]) -> SegmentSnapshot {
    SegmentSnapshot {
        address: s.address,
        small: s.small,
        tag: s.tag.and_then(|t| names.get(t.get() as usize - 1).cloned()),
        asleep: s.asleep,
        page: s.page,
        blocks: s
            .blocks
            .into_iter()
            .map(|b| BlockSnapshot {
                address: b.address,
                size: b.size,
                requested: b.requested,
                graph_pool: b.pool,
                stream: b.stream,
                state: b.state,
            })
            .collect(),
    }
}
