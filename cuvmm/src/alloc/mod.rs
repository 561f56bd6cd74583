//! The peer-sharing allocator and its caching sub-allocator.

mod cache;
mod peer;

pub use cache::{CacheStats, CachingAllocator, SubAllocation, MIN_CLASS};
pub use peer::{ExportMode, PeerAllocation, PeerAllocator};
