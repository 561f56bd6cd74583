//! Host memory the DMA engine can reach: pinned allocations, registered (page-locked) memory the
//! caller owns, and a staging ring for pageable memory.
//!
//! Reach for [`PinnedBuffer`] for buffers that move to and from the device often (copies from it
//! are asynchronous and overlap with other work), [`Registered::with`] to page-lock memory you
//! already have for a while, and [`Staging`] to move large pageable buffers faster than the
//! driver's own pageable path.

mod pinned;
mod staging;
mod stream_copy;

pub use pinned::{pinned_bytes, PinnedBuffer, PinnedFlags, RegisterFlags, Registered};
pub use staging::{ChunkTrace, HostCopy, KernelLane, Staging, StagingConfig, StagingTrace};
