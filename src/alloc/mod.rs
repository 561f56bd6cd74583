//! Allocators: the stream-ordered caching allocator, and allocators whose memory other processes
//! can import.
//!
//! Take [`StreamAllocator`] for device memory; take [`CachingAllocator`] only for blocks that
//! other processes import or peer GPUs map, which the stream-ordered allocator's memory is not
//! made for: it caches [`PeerAllocator`] memory, and is not stream-ordered.
//!
//! Reach for [`PeerAllocator`] when device memory must be shared with other processes (or made
//! accessible to peer GPUs): each allocation is its own physical allocation, exportable as a POSIX
//! fd or a fabric handle. [`CachingAllocator`] carves small blocks out of cached chunks for fast
//! allocate/free; only blocks from [`CachingAllocator::allocate_shareable`] can be shared, so an
//! importer never sees a neighbour's block.

mod cache;
mod ordered;
mod peer;

pub use cache::{CacheStats, CachingAllocator, SubAllocation, MIN_CLASS};
pub use ordered::{
    backup_host_copy, fresh_backup_memory, set_backup_host_copy, AllocatorConfig, AllocatorStats, BackupKind,
    BackupOptions, BlockExport, BlockImport, BlockRange, BlockShare, BlockSnapshot, BlockState, DevicePtr,
    GraphMemory, SegmentSnapshot, SleepMode, StreamAllocator, StreamBlock, Tag, TagPhase, TagStats,
};
pub use peer::{ExportMode, PeerAllocation, PeerAllocator};
