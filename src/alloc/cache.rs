//! A caching sub-allocator for custom allocators: small allocations carved out of mapped chunks,
//! freed blocks kept for reuse, whole idle chunks returned to the driver by `trim`.

use super::peer::{PeerAllocation, PeerAllocator};
use crate::error::{Error, Refusal, Result};
use crate::ipc::WireHandle;
use crate::vmm::round_up;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, MutexGuard};

/// The smallest block: 512 bytes (2^9).
pub const MIN_CLASS: u32 = 9;

/// What the cache holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes mapped in chunks.
    pub mapped: usize,
    /// Bytes handed out (block sizes, not requested sizes).
    pub in_use: usize,
    /// Bytes mapped but free for reuse.
    pub cached: usize,
    /// Chunks held.
    pub chunks: usize,
}

/// A thread-safe caching allocator over a [`PeerAllocator`].
///
/// Requests up to the chunk size are rounded up to a power of two (at least 512 bytes) and served
/// from chunks dedicated to that size: a cached allocation and free is a lock, a pop and a push.
/// Larger requests get a chunk of their own (rounded up to the granularity), cached by size after
/// free.
///
/// # Sharing
///
/// Exporting memory exports a whole physical allocation: the importer maps all of it, whatever
/// range the message names. So [`SubAllocation::share`] exports only blocks that own their whole
/// physical allocation: those from [`allocate_shareable`](Self::allocate_shareable), and those
/// from [`allocate`](Self::allocate) that happen to fill a chunk (requests larger than half the
/// chunk size). A block carved from a chunk that holds other blocks is refused with
/// [`Error::InvalidArgument`], since its importer could read and write its neighbours.
///
/// An importer keeps the physical memory for as long as it holds its mapping, so a block that was
/// shared is never reused: when it is dropped its memory goes back to the driver instead of into
/// the cache, and no later allocation can land where an importer still looks.
#[derive(Clone)]
pub struct CachingAllocator {
    inner: Arc<Inner>,
}

struct Inner {
    peer: PeerAllocator,
    chunk: usize,
    state: Mutex<State>,
}

struct Chunk {
    alloc: PeerAllocation,
    /// Size class, or `None` for a dedicated large chunk.
    class: Option<u32>,
    live: usize,
    /// Exported at least once: other processes may still map it, so it is released, not cached,
    /// once its block is freed.
    exported: bool,
}

#[derive(Clone, Copy)]
struct Block {
    chunk: usize,
    offset: usize,
}

#[derive(Default)]
struct State {
    chunks: Vec<Option<Chunk>>,
    spare_ids: Vec<usize>,
    /// Free blocks, by class (index = class - MIN_CLASS).
    free: Vec<Vec<Block>>,
    /// Free dedicated chunks (ids).
    large_free: Vec<usize>,
    in_use: usize,
}

/// An allocation from a [`CachingAllocator`]; returned to the cache on drop.
pub struct SubAllocation {
    cache: Arc<Inner>,
    ptr: u64,
    size: usize,
    requested: usize,
    block: Block,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CachingAllocator {
    /// A cache of `chunk`-byte chunks (rounded up to the granularity; at least 2 MiB is sensible).
    pub fn new(peer: PeerAllocator, chunk: usize) -> Result<CachingAllocator> {
        let chunk = round_up(chunk, peer.granularity())?;
        if !chunk.is_power_of_two() {
            return Err(Error::invalid(format!("chunk size {chunk} must be a power of two")));
        }
        let classes = (chunk.trailing_zeros() + 1).saturating_sub(MIN_CLASS) as usize;
        let state = State { free: vec![Vec::new(); classes], ..Default::default() };
        Ok(CachingAllocator { inner: Arc::new(Inner { peer, chunk, state: Mutex::new(state) }) })
    }

    /// The allocator chunks come from.
    pub fn peer(&self) -> &PeerAllocator {
        &self.inner.peer
    }

    /// At least `size` bytes, carved from a shared chunk when `size` is at most half the chunk.
    pub fn allocate(&self, size: usize) -> Result<SubAllocation> {
        if size == 0 {
            return Err(Error::invalid("cannot allocate zero bytes"));
        }
        if size > self.inner.chunk {
            return self.allocate_large(size);
        }
        let class = size.next_power_of_two().trailing_zeros().max(MIN_CLASS);
        let ci = (class - MIN_CLASS) as usize;
        let block_size = 1usize << class;
        {
            let mut st = lock(&self.inner.state);
            if let Some(b) = st.free[ci].pop() {
                return Ok(self.hand_out(&mut st, b, block_size, size));
            }
        }
        // A new chunk, made without holding the lock (driver calls take tens of microseconds).
        let alloc = self.inner.peer.allocate(self.inner.chunk)?;
        let mut st = lock(&self.inner.state);
        let id = st.insert(Chunk { alloc, class: Some(class), live: 0, exported: false });
        let blocks = self.inner.chunk / block_size;
        st.free[ci].extend((1..blocks).rev().map(|i| Block { chunk: id, offset: i * block_size }));
        Ok(self.hand_out(&mut st, Block { chunk: id, offset: 0 }, block_size, size))
    }

    /// At least `size` bytes in a physical allocation of their own (rounded up to the granularity),
    /// which [`SubAllocation::share`] can export without exposing any other allocation.
    ///
    /// Served from the cache of freed large blocks of the same rounded size when there is one
    /// (never from one that was shared).
    pub fn allocate_shareable(&self, size: usize) -> Result<SubAllocation> {
        if size == 0 {
            return Err(Error::invalid("cannot allocate zero bytes"));
        }
        self.allocate_large(size)
    }

    fn allocate_large(&self, size: usize) -> Result<SubAllocation> {
        let rounded = round_up(size, self.inner.peer.granularity())?;
        {
            let mut st = lock(&self.inner.state);
            let found = st.large_free.iter().position(|&id| st.chunk(id).alloc.len() == rounded);
            if let Some(i) = found {
                let id = st.large_free.swap_remove(i);
                return Ok(self.hand_out(&mut st, Block { chunk: id, offset: 0 }, rounded, size));
            }
        }
        let alloc = self.inner.peer.allocate(rounded)?;
        let mut st = lock(&self.inner.state);
        let id = st.insert(Chunk { alloc, class: None, live: 0, exported: false });
        Ok(self.hand_out(&mut st, Block { chunk: id, offset: 0 }, rounded, size))
    }

    fn hand_out(&self, st: &mut State, block: Block, size: usize, requested: usize) -> SubAllocation {
        let c = st.chunk_mut(block.chunk);
        c.live += 1;
        let ptr = c.alloc.ptr() + block.offset as u64;
        st.in_use += size;
        SubAllocation { cache: Arc::clone(&self.inner), ptr, size, requested, block }
    }

    /// Returns every chunk with nothing allocated in it to the driver; returns the bytes released.
    pub fn trim(&self) -> usize {
        let mut released = Vec::new();
        {
            let mut st = lock(&self.inner.state);
            let idle: Vec<usize> = (0..st.chunks.len())
                .filter(|&id| st.chunks[id].as_ref().is_some_and(|c| c.live == 0))
                .collect();
            for &id in &idle {
                for list in st.free.iter_mut() {
                    list.retain(|b| b.chunk != id);
                }
                st.large_free.retain(|&c| c != id);
                released.push(st.chunks[id].take().expect("idle chunk"));
                st.spare_ids.push(id);
            }
        }
        // Unmapped outside the lock: an unmap waits for the device.
        released.iter().map(|c| c.alloc.len()).sum()
    }

    /// What the cache holds now.
    pub fn stats(&self) -> CacheStats {
        let st = lock(&self.inner.state);
        let (mapped, chunks) =
            st.chunks.iter().flatten().fold((0, 0), |(m, n), c| (m + c.alloc.len(), n + 1));
        CacheStats { mapped, in_use: st.in_use, cached: mapped - st.in_use, chunks }
    }
}

impl State {
    fn insert(&mut self, c: Chunk) -> usize {
        match self.spare_ids.pop() {
            Some(id) => {
                self.chunks[id] = Some(c);
                id
            }
            None => {
                self.chunks.push(Some(c));
                self.chunks.len() - 1
            }
        }
    }

    fn chunk(&self, id: usize) -> &Chunk {
        self.chunks[id].as_ref().expect("live chunk id")
    }

    fn chunk_mut(&mut self, id: usize) -> &mut Chunk {
        self.chunks[id].as_mut().expect("live chunk id")
    }
}

impl SubAllocation {
    /// Its address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Usable bytes (the block size: at least what was asked for).
    pub fn len(&self) -> usize {
        self.size
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The size that was asked for.
    pub fn requested(&self) -> usize {
        self.requested
    }

    /// Whether this block is its whole physical allocation, so that [`share`](Self::share) can
    /// export it.
    pub fn is_shareable(&self) -> bool {
        let st = lock(&self.cache.state);
        owns_whole_chunk(self.block, self.size, st.chunk(self.block.chunk).alloc.len())
    }

    /// Sends this block's physical allocation over `sock`; the importer maps exactly this block.
    ///
    /// Refused with [`Error::InvalidArgument`] for a block carved from a chunk it shares with
    /// other blocks (see [`CachingAllocator`]'s section on sharing). Once shared, the block's
    /// memory is released rather than cached when it is dropped.
    pub fn share(&self, sock: BorrowedFd<'_>, tag: u64) -> Result<WireHandle> {
        let phys = {
            let mut st = lock(&self.cache.state);
            let c = st.chunk_mut(self.block.chunk);
            if !owns_whole_chunk(self.block, self.size, c.alloc.len()) {
                return Err(Error::refused(
                    Refusal::SharesItsAllocation,
                    format_args!(
                        "this {}-byte block shares a {}-byte physical allocation with other blocks, all of \
                     which its importer could reach; allocate it with CachingAllocator::allocate_shareable",
                        self.size,
                        c.alloc.len()
                    ),
                ));
            }
            // Marked before sending: if the send fails part-way the peer may hold the handle anyway.
            c.exported = true;
            c.alloc.physical().clone()
        };
        // Sent without the cache's lock: the export asks the driver and the send may block for as
        // long as the peer does not read. The block (`&self`) keeps its chunk alive meanwhile.
        crate::ipc::share(sock, &phys, 0, self.size, tag)
    }
}

impl std::fmt::Debug for SubAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubAllocation")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.size)
            .finish()
    }
}

/// Whether a block of `size` bytes at `block.offset` covers all `alloc_len` bytes of its chunk.
fn owns_whole_chunk(block: Block, size: usize, alloc_len: usize) -> bool {
    block.offset == 0 && size == alloc_len
}

impl Drop for SubAllocation {
    fn drop(&mut self) {
        let released = {
            let mut st = lock(&self.cache.state);
            st.in_use -= self.size;
            let c = st.chunk_mut(self.block.chunk);
            c.live -= 1;
            if c.exported {
                // The block was the chunk's only one, so nothing else refers to the chunk.
                debug_assert_eq!(c.live, 0);
                let released = st.chunks[self.block.chunk].take();
                st.spare_ids.push(self.block.chunk);
                released
            } else {
                match c.class {
                    Some(class) => st.free[(class - MIN_CLASS) as usize].push(self.block),
                    None => st.large_free.push(self.block.chunk),
                }
                None
            }
        };
        // Unmapped outside the lock: an unmap waits for the device.
        drop(released);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_block_covering_its_whole_chunk_is_shareable() {
        let at = |offset| Block { chunk: 0, offset };
        let mib = 1 << 20;
        // A dedicated chunk (allocate_shareable, large requests), or the one block of a size class
        // as large as the chunk.
        assert!(owns_whole_chunk(at(0), 2 * mib, 2 * mib));
        assert!(owns_whole_chunk(at(0), 6 * mib, 6 * mib));
        // Carved blocks, the first one included: others live beside them.
        assert!(!owns_whole_chunk(at(0), 512, 2 * mib));
        assert!(!owns_whole_chunk(at(mib), mib, 2 * mib));
        assert!(!owns_whole_chunk(at(4096), 4096, 2 * mib));
    }
}
