//! A stream-ordered caching allocator over large reservations, for custom allocators
//! (PyTorch's pluggable allocator among them: see the `cuvmm-capi` crate).
//!
//! Memory is allocated *on a stream*. A block freed on a stream may be handed out again at once
//! for work on that stream (the stream runs it after the work that used the block), and for
//! another stream only once an event recorded on the first stream after the free has completed,
//! or after a wait for the whole device (out of memory, [`StreamAllocator::empty_cache`]).
//!
//! # Streams: identity and handles
//!
//! A stream handle is not an identity: once a stream is destroyed the driver may hand the same
//! handle to a new stream, and a destroyed stream may still have queued work that uses blocks it
//! freed. So the allocator keys everything it remembers about a stream by the driver's stream id
//! (`cuStreamGetId`, unique for the life of the process; one call per allocation on a stream
//! other than the legacy default one, none on the cached free), and passes a handle to the
//! driver only during a call that passes that handle: it never queries, records on or captures
//! through a stream it merely remembers. A block freed on a stream is that stream's until an
//! event the allocator owns, recorded on it during one of its own calls, has completed. Events
//! are recorded lazily: when another stream's request found no cached block, each stream's next
//! free asks whether its own stream has run all its work (then its frees serve every stream at
//! the next request that looks) or records one event after them. A stream destroyed before that
//! leaves its freed blocks to the next wait for the whole device (`cuCtxSynchronize`, which covers
//! every stream's work), so destroying streams is safe at any time. During a capture the
//! allocator does not ask (the driver may forbid it) and names the stream by the capture and the
//! handle, which within one capture name one stream; where the driver cannot name a stream
//! (before CUDA 12.0) the allocator makes up an identity it never uses again. Blocks freed under
//! such an identity outside its call wait for a wait for the whole device. A free through the
//! handle its block was allocated with is on that stream, or on a destroyed one whose identity
//! nothing uses again (such a free asks the driver whether the handle still names the stream
//! before it records an event or asks whether the stream is idle, since the answer would
//! otherwise be the new stream's); a free through another handle asks the driver.
//!
//! # Threads
//!
//! Each stream has a front of its own (`front.rs`), behind its own lock: the blocks handed out on
//! it and the blocks it freed, kept whole for its next request of the same size. A request such a
//! block serves, and a free through the handle its block was allocated with, take that lock alone,
//! so threads each on their own stream do not wait for one another; the device-wide lock is taken
//! by requests that find no such block, by a stream's first free after another stream's request
//! found none (to record the event the others wait for), by tagged or captured requests, by frees
//! through other handles, and by the calls that look at the whole device. Soundness rests on the
//! numbering: a free is stamped, under its front's lock, with the number of the next event to be
//! recorded on its stream, and that number is taken and advanced under the same lock, in the same
//! hold, as the event is recorded (or the stream found idle, or a wait for the whole device
//! begun), so an event covers exactly the frees made before it. Cached blocks reach other streams
//! only through the device-wide path, which takes cached blocks into the shared index, each owned
//! by its stream until an event covering its stamp has completed: before it looks for free space,
//! the requesting stream's and every other stream's idle ones (the others keep their blocks still
//! waiting for work, for their own next requests); before it takes new memory, waits, sleeps,
//! exports or releases graph memory, every one. Lock order: the device-wide lock, then
//! one front's.
//!
//! Address space is reserved in large heaps (by default twice the device's memory: address space
//! costs nothing) and physical pages are mapped under blocks only as they are handed out. A heap
//! is carved best-fit, blocks are split and coalesced, and no size is rounded beyond 512 bytes.
//! Requests up to 1 MiB come from separate heaps, so small blocks never hold large pages. When
//! the free blocks of the heap do not fit a request, new address space is taken and its pages are
//! taken first from idle free blocks (unmapped there, mapped here), then from the driver: holes
//! cost address space, not memory. When the driver is out of memory the allocator waits for every
//! freed block's work to finish, moves those pages, and retries before failing.
//!
//! # Graph capture
//!
//! Allocating or freeing on a stream that is being captured into a CUDA graph makes no call that
//! a capture forbids. What [`GraphMemory`] says decides what becomes of memory handed out then.
//! An allocation asks the driver whether its stream is being captured; a free asks nothing unless
//! it records an event: a block freed on a stream is that stream's alone until an event recorded
//! on it after the free has completed (none is recorded on a captured stream) or a wait for the
//! whole device returns (the driver refuses one during a capture: a request out of memory
//! while another thread captures in global mode fails, and may end that capture in error), and requests made
//! during a capture take only their graph's blocks or idle ones. So a block freed during a
//! capture comes back once the capture is over, with no need to know at the free.
//!
//! # Example
//!
//! ```no_run
//! use cuvmm::alloc::StreamAllocator;
//! use cuvmm::{Context, Stream};
//!
//! # fn main() -> cuvmm::Result<()> {
//! let ctx = Context::for_ordinal(0)?;
//! let stream = Stream::non_blocking(&ctx)?;
//! let alloc = StreamAllocator::new(&ctx)?;
//! let a = alloc.allocate(1 << 20, &stream)?;
//! let p = a.ptr();
//! drop(a); // freed on `stream`, in stream order
//! let b = alloc.allocate(1 << 20, &stream)?; // the same block, at once
//! assert_eq!(b.ptr(), p);
//! println!("{:?}", alloc.stats());
//! # Ok(())
//! # }
//! ```

mod backend;
mod backup;
pub(crate) mod core;
mod front;
mod front_lock;
mod heap;
mod host_memory;
mod ids;
mod lazy;
mod phase;
mod ptr;
mod snapshot;
mod uses;

pub use self::backup::{
    backup_host_copy, fresh_backup_memory, set_backup_host_copy, BackupKind, BackupOptions,
};
pub use self::core::{AllocatorStats, SleepMode, TagStats};
pub use self::phase::TagPhase;
pub use self::ptr::{BlockRange, DevicePtr};
pub use self::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot};

use self::backend::DriverBackend;
use self::core::{Capture, Core, Ordered, Settle, Sizes};
use crate::context::Context;
use crate::driver::sys::*;
use crate::error::{Error, Refusal, Result};
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::stream::order::Tracker;
use crate::stream::{Stream, StreamInner};
use crate::vmm::{Access, Mapping, PhysicalMemory, Reservation};
use crate::Device;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Sizes of a [`StreamAllocator`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocatorConfig {
    /// Bytes per physical page of the heaps that serve requests above 1 MiB (a multiple of the
    /// device's granularity, 2 MiB on current GPUs), 128 MiB by default. Every driver call on a
    /// page (create, map, grant access, export, import, unmap) costs about as much for 128 MiB as
    /// for 4 MiB, so large pages make a block cheap to map, to [`lend`](Self::lend) and to share
    /// with another process: 16 GiB is 128 pages to export and import, not 4,096
    /// (docs/DECISIONS.md, "Large pages"). Requests up to 1 MiB share pages of 4 MiB (`page` itself
    /// when 4 MiB does not divide it) in heaps of their own.
    pub page: usize,
    /// Address space per large heap; 0 for twice the device's memory.
    pub reserve: usize,
    /// Bytes per page of tagged large heaps (a multiple of `page`): larger pages make sleep and
    /// wake cost few driver calls (releasing 16 GiB as 2 MiB pages takes hundreds of them per
    /// millisecond).
    pub tag_page: usize,
    /// Lets pages of blocks a stream freed, whose work may not have run yet, serve that stream's
    /// next blocks instead of new pages (mapped at both places until the work has run), when new
    /// pages would bring the memory held past 1.03x the largest live total. On by default.
    /// Without it, a block that fits no free block takes new pages while freed ones sit in blocks
    /// too small for it; each page moved costs the calling thread tens of microseconds of driver
    /// calls. Off, nothing moves once a repeated pattern has its pages (docs/PERFORMANCE.md,
    /// "Lending threshold").
    pub lend: bool,
    /// Untagged blocks of at least this many bytes (0: none, the default) are each one physical
    /// allocation of their size rounded to 4 MiB, exportable as a POSIX descriptor and, where the
    /// device supports it and an IMEX channel exists, as a fabric handle: what transfer engines
    /// that register a range by its allocation (UCX's POSIX-descriptor path, fabric handles) can
    /// carry. Such a block's allocation, once freed, serves later blocks it exceeds by at most an
    /// eighth, smallest first; it is never moved to where other blocks need it, but goes back to
    /// the driver once idle at [`StreamAllocator::empty_cache`], or when a new one would take the
    /// memory held past the bound lending keeps (a little above the largest live total); past
    /// that bound, a block takes a larger allocation already held or ordinary pages.
    pub export_threshold: usize,
}

/// Bytes per page of the heaps of requests up to 1 MiB, unless `page` is smaller.
const SMALL_PAGE: usize = 4 << 20;

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig { page: 128 << 20, reserve: 0, tag_page: 128 << 20, lend: true, export_threshold: 0 }
    }
}

/// A name for allocations that sleep and wake together ([`StreamAllocator::sleep`]). Names are
/// interned for the life of the process; the same name gives the same tag on every allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag(NonZeroU32);

static TAGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl Tag {
    /// The tag named `name` (not empty).
    pub fn new(name: &str) -> Result<Tag> {
        if name.is_empty() {
            return Err(Error::invalid("a tag needs a name"));
        }
        let mut tags = lock(&TAGS);
        let i = match tags.iter().position(|t| t == name) {
            Some(i) => i,
            None => {
                tags.push(name.to_owned());
                tags.len() - 1
            }
        };
        Ok(Tag(NonZeroU32::new(i as u32 + 1).expect("fewer than u32::MAX names")))
    }

    /// The tag numbered `n` without a name, for the core's tests, which never ask for one.
    #[cfg(test)]
    pub(crate) const fn of(n: u32) -> Tag {
        match NonZeroU32::new(n) {
            Some(n) => Tag(n),
            None => panic!("tags count from 1"),
        }
    }

    /// Its number for the whole process, from 1 up.
    pub(crate) fn get(self) -> u32 {
        self.0.get()
    }

    /// Its name.
    pub fn name(&self) -> String {
        lock(&TAGS)[self.get() as usize - 1].clone()
    }

    /// Where this tag's later offloading sleeps keep its contents, on every allocator: pageable
    /// host memory through a staging ring by default, released lazily at wake (the kernel takes
    /// the pages back only when it needs them; until then the next sleep writes into them).
    /// Refused, changing
    /// nothing, for a disk backup whose directory is not one.
    pub fn set_backup(&self, options: BackupOptions) -> Result<()> {
        backup::set_options(*self, options)
    }

    /// The options [`set_backup`](Self::set_backup) gave (the default when none).
    pub fn backup(&self) -> BackupOptions {
        backup::options_of(*self)
    }

    /// Where this tag stands for the whole process ([`sleep_on`](Self::sleep_on),
    /// [`wake_on`](Self::wake_on)); a sleep of one allocator alone
    /// ([`StreamAllocator::sleep`]) leaves it awake.
    pub fn phase(&self) -> TagPhase {
        phase::PROCESS.phase(self.get())
    }

    /// Refused, as an allocation with the tag would be, when the tag is not
    /// [`Awake`](TagPhase::Awake) for the process: for a caller that has no allocator to ask yet.
    pub fn check_awake(&self) -> Result<()> {
        match self.phase().on(phase::Step::Allocate) {
            phase::Next::Refuse(why) => Err(why.error()),
            _ => Ok(()),
        }
    }

    /// Puts this tag to sleep on every allocator `allocators` lists, for the whole process: until
    /// [`wake_on`](Self::wake_on), every allocation with it is refused, on those allocators and on
    /// any made later. All or nothing: when one allocator refuses, those this call put to sleep
    /// are woken again (a failure there is recorded as a destructor's is,
    /// [`take_drop_error`](crate::error::take_drop_error), and the tag then stays
    /// [`Asleep`](TagPhase::Asleep) for a wake to finish).
    ///
    /// A sleep or wake of the tag already under way on another thread is waited for, and so are
    /// the allocations with the tag already past their check; `allocators` is called after those,
    /// with the tag falling asleep, so an allocator made meanwhile is listed or refuses the tag.
    /// Refused when the tag is asleep then.
    pub fn sleep_on<'a>(
        &self,
        allocators: impl FnOnce() -> Vec<&'a StreamAllocator>,
        mode: SleepMode,
    ) -> Result<()> {
        let t = *self;
        phase::sleep_tag(
            &phase::PROCESS,
            self.get(),
            allocators,
            |a| a.sleep(t, mode).map(drop),
            |a| a.wake(t),
            |a| a.tag_stats(t).asleep,
        )
    }

    /// Wakes this tag on every allocator `allocators` lists where it is asleep, after a
    /// [`sleep_on`](Self::sleep_on). Refused when the tag is not asleep for the process. A
    /// failure stops the call: the allocators woken before stay awake, the rest asleep with
    /// nothing lost, and the tag asleep, so that a later call wakes those.
    pub fn wake_on<'a>(&self, allocators: impl FnOnce() -> Vec<&'a StreamAllocator>) -> Result<()> {
        let t = *self;
        phase::wake_tag(&phase::PROCESS, self.get(), allocators, |a| a.tag_stats(t).asleep, |a| a.wake(t))
    }
}

/// What becomes of memory handed out on a stream while it is being captured into a CUDA graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphMemory {
    /// The graph's replays write it for as long as the graph lives, so it is kept for the graph:
    /// never handed out outside that capture, even once freed, until
    /// [`StreamAllocator::release_graph_memory`]. Blocks allocated before the capture and freed
    /// during it come back only after it. (What PyTorch's `change_current_allocator` needs.)
    Keep,
    /// The caller keeps graph memory apart itself (PyTorch's `MemPool` does), so blocks are
    /// ordinary; during the capture only memory known idle is handed out.
    Share,
}

/// A stream-ordered caching allocator for one device. Cloning shares it; it is `Send + Sync`.
#[derive(Clone)]
pub struct StreamAllocator {
    inner: Arc<Shared>,
}

/// The allocator's state is behind one lock, which `stats`, `tag_stats` and `reset_peaks` take
/// (they make no driver call, so a host function may call them). The lock is never held across a
/// wait that a host function can hold up: the waits for the whole device (out of memory,
/// `empty_cache`, `sleep`) are made without it, the state saying what they cover (see
/// `Core::settle_begin`, and the tag falling asleep meanwhile); unmaps do not wait (only pages no
/// queued work uses are unmapped); the copies of `sleep` and `wake` wait only for the allocator's
/// own copy streams, whose work waits for nothing else.
struct Shared {
    ctx: Context,
    /// The device's memory in bytes: no block can be larger.
    memory: u64,
    /// The most bytes live blocks may hold ([`StreamAllocator::set_memory_fraction`]); `NO_LIMIT`
    /// for none. Every request reads it: mostly there is none, and the answer is one atomic load.
    limit: AtomicU64,
    /// Streams recorded for raw blocks ([`StreamAllocator::record_stream`]), and the frees they
    /// defer.
    uses: uses::Uses,
    alloc: Ordered<DriverBackend>,
    /// Shared with the backend: whether pages are exported as they are made.
    exports_ahead: Arc<AtomicBool>,
}

/// [`Shared::limit`] when none is set.
const NO_LIMIT: u64 = u64::MAX;

/// The limit `fraction` of `memory` bytes sets ([`StreamAllocator::set_memory_fraction`]).
fn limit_for(fraction: f64, memory: u64) -> Result<u64> {
    if !(0.0..=1.0).contains(&fraction) {
        return Err(Error::invalid(format!("memory fraction {fraction} is not between 0 and 1")));
    }
    Ok(if fraction < 1.0 { (fraction * memory as f64) as u64 } else { NO_LIMIT })
}

/// Whether `size` more bytes, `live` being live, pass `limit`.
fn over_limit(live: u64, size: u64, limit: u64) -> bool {
    live.saturating_add(size) > limit
}

impl Drop for Shared {
    fn drop(&mut self) {
        let core = self.alloc.core_mut();
        let pages = core.mapped_addresses();
        core.backend().unmap_all(pages.into_iter());
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StreamAllocator {
    /// An allocator for `ctx`'s device with the default sizes.
    pub fn new(ctx: &Context) -> Result<StreamAllocator> {
        StreamAllocator::with_config(ctx, AllocatorConfig::default())
    }

    /// An allocator with the given sizes.
    pub fn with_config(ctx: &Context, config: AllocatorConfig) -> Result<StreamAllocator> {
        let granularity =
            crate::caps::device_granularity(&ctx.device(), CUmemAllocationHandleType::NONE)?.minimum;
        if config.page == 0 || config.page % granularity != 0 {
            return Err(Error::invalid(format!(
                "page size {} is not a non-zero multiple of the granularity ({granularity})",
                config.page
            )));
        }
        if config.tag_page == 0 || config.tag_page % config.page != 0 {
            return Err(Error::invalid(format!(
                "tagged page size {} is not a non-zero multiple of the page size ({})",
                config.tag_page, config.page
            )));
        }
        let total = ctx.device().total_memory()?;
        let round = |x: usize| x.div_ceil(config.page) * config.page;
        let large = if config.reserve == 0 { 2 * total } else { config.reserve };
        // Small heaps' pages: 4 MiB where the granularity allows and it divides `page` (their
        // reservations are rounded to `page`), else `page`.
        let small_page = if SMALL_PAGE % granularity == 0 && config.page % SMALL_PAGE == 0 {
            SMALL_PAGE
        } else {
            config.page
        };
        let sizes = Sizes {
            page: config.page as u64,
            small_page: small_page as u64,
            tag_page: config.tag_page as u64,
            large_reserve: round(large) as u64,
            small_reserve: round((large / 16).max(config.page)) as u64,
            lend: config.lend,
        };
        let exports_ahead = Arc::new(AtomicBool::new(false));
        let backend = DriverBackend::new(ctx, config.page, config.export_threshold, exports_ahead.clone());
        let mut core = Core::new(backend, sizes);
        core.set_whole_above(config.export_threshold as u64);
        Ok(StreamAllocator {
            inner: Arc::new(Shared {
                ctx: ctx.clone(),
                memory: total as u64,
                limit: AtomicU64::new(NO_LIMIT),
                uses: uses::Uses::default(),
                alloc: Ordered::new(core),
                exports_ahead,
            }),
        })
    }

    /// The context whose device it allocates on.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// A request larger than the device's memory could never be served: refused before anything
    /// (a heap, its page table) is built for it.
    fn check_size(&self, size: usize) -> Result<()> {
        if size as u64 > self.inner.memory {
            return Err(Error::refused(
                Refusal::LargerThanDevice,
                format_args!("{size} bytes are more than the device's {} bytes of memory", self.inner.memory),
            ));
        }
        Ok(())
    }

    /// Limits the bytes live blocks hold to `fraction` of the device's memory (PyTorch's
    /// `torch.cuda.set_per_process_memory_fraction`): a request that would take them past it is
    /// refused as out of memory ([`Refusal::OverLimit`]). 1 removes the limit; 0, or a fraction
    /// that rounds down to 0 bytes, refuses every request, as PyTorch's own allocator does.
    /// Refused, changing nothing, for a fraction outside 0 to 1.
    ///
    /// The limit counts live blocks ([`AllocatorStats::live`]), not the pages kept cached for
    /// them: cached pages serve later requests or go back to the driver at an empty cache, and
    /// counting them would refuse requests that cached memory already serves.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        let bytes = limit_for(fraction, self.inner.memory)?;
        self.inner.limit.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// The most bytes live blocks may hold ([`set_memory_fraction`](Self::set_memory_fraction)),
    /// if limited.
    pub fn memory_limit(&self) -> Option<u64> {
        Some(self.inner.limit.load(Ordering::Relaxed)).filter(|&l| l != NO_LIMIT)
    }

    /// Refuses `size` more bytes past the limit, if one is set (asked only then: it takes the
    /// allocator's lock to count the live bytes).
    #[inline]
    fn check_limit(&self, size: usize) -> Result<()> {
        match self.memory_limit() {
            None => Ok(()),
            Some(limit) => self.check_limit_of(limit, size as u64),
        }
    }

    #[cold]
    fn check_limit_of(&self, limit: u64, size: u64) -> Result<()> {
        let live = self.stats().live;
        if over_limit(live, size, limit) {
            return Err(Error::refused(
                Refusal::OverLimit,
                format_args!(
                    "{size} bytes more than the memory fraction allows on device {} ({live} bytes live, \
                     limit {limit} bytes)",
                    self.inner.ctx.device().ordinal()
                ),
            ));
        }
        Ok(())
    }

    /// `size` bytes for work on `stream`. The block is freed, in stream order, when dropped.
    /// Refused ([`Refusal::LargerThanDevice`]) when larger than the device's memory.
    ///
    /// On a stream being captured into a graph, the block is kept for the graph
    /// ([`GraphMemory::Keep`]).
    pub fn allocate(&self, size: usize, stream: &Stream) -> Result<StreamBlock> {
        self.allocate_on(size, stream, None)
    }

    fn allocate_on(&self, size: usize, stream: &Stream, tag: Option<Tag>) -> Result<StreamBlock> {
        self.check_size(size)?;
        if !stream.context().same_as(&self.inner.ctx) {
            return Err(Error::invalid("the stream belongs to another context than the allocator"));
        }
        // SAFETY: `stream` is alive for the call (borrowed), and the block keeps it alive until
        // its free.
        let ptr = unsafe { self.allocate_raw_tagged(size, stream.raw(), GraphMemory::Keep, tag) }?;
        Ok(StreamBlock::new(self, ptr.get(), size, stream))
    }

    /// Allocates `size` bytes for work on the raw stream `stream` and returns the address.
    ///
    /// # Safety
    /// `stream` must be a live stream of this allocator's context (or null, or the legacy default
    /// stream) for the duration of the call. It may be destroyed afterwards, blocks freed on it
    /// or not: the allocator keys streams by the driver's stream id, never reused, and passes a
    /// handle to the driver only during a call that passes it.
    pub unsafe fn allocate_raw(
        &self,
        size: usize,
        stream: CUstream,
        graphs: GraphMemory,
    ) -> Result<DevicePtr> {
        // SAFETY: the caller's contract, the same.
        unsafe { self.allocate_raw_tagged(size, stream, graphs, None) }
    }

    /// [`allocate_raw`](Self::allocate_raw) for memory that sleeps and wakes with `tag`.
    ///
    /// # Safety
    /// As for `allocate_raw`.
    pub unsafe fn allocate_raw_tagged(
        &self,
        size: usize,
        stream: CUstream,
        graphs: GraphMemory,
        tag: Option<Tag>,
    ) -> Result<DevicePtr> {
        self.check_size(size)?;
        self.check_limit(size)?;
        let (capture, id) = caller_of(stream, graphs)?;
        // Counted until the allocation returns: a sleep of the tag for the process waits for it.
        let _allocating = tag.map(|t| phase::PROCESS.begin_allocation(t.get())).transpose()?;
        // Every driver call the allocator may make binds the context itself: the cached path makes
        // none.
        self.settle_uses(false);
        let allocate = || {
            let wait = || self.inner.ctx.synchronize().is_ok();
            self.inner
                .alloc
                .allocate(size as u64, stream_key(stream), id, capture, tag, wait)
                .map(DevicePtr::new)
        };
        let got = allocate();
        if got.as_ref().is_err_and(Error::is_out_of_memory) && self.inner.uses.pending() > 0 {
            // Blocks whose frees wait for other streams' work: wait for it, as PyTorch does.
            self.settle_uses(true);
            return allocate();
        }
        got
    }

    /// Frees the blocks whose frees waited for other streams' work ([`record_stream`]) once it
    /// has run (with `wait`, waiting for it). What goes wrong is recorded as a destructor's
    /// failure is ([`take_drop_error`](crate::error::take_drop_error)): the request or empty cache
    /// that settles goes on, and the free it finishes was accepted long before.
    ///
    /// [`record_stream`]: Self::record_stream
    #[inline]
    fn settle_uses(&self, wait: bool) {
        // Every request asks: nothing waits, mostly, and the answer is one atomic load.
        if self.inner.uses.pending() > 0 {
            self.settle_uses_now(wait);
        }
    }

    #[cold]
    fn settle_uses_now(&self, wait: bool) {
        let settled = self.inner.uses.settle(wait, |ptr, stream| {
            // The work of the other streams that used it has completed, and `stream` is the one
            // it was freed on, live by the contract of `record_stream`.
            self.inner.alloc.free(ptr, stream_key(stream))
        });
        crate::error::record_drop(settled);
    }

    /// Says that work queued on `stream` uses the raw block at `ptr` too (PyTorch's
    /// `Tensor.record_stream`): its free ([`free_raw`](Self::free_raw)) then records an event on
    /// `stream` and keeps the block out of every request until that event has completed (a later
    /// request, an [`empty_cache`](Self::empty_cache), or a request out of memory, which waits
    /// for it, gives the block back). A use on the block's own stream changes nothing. Returns
    /// whether `ptr` is the start of a live block of this allocator: any other pointer is ignored
    /// (memory another allocator handed out, or a place inside a block).
    ///
    /// The free's contract extends to `stream`: it must be a live stream of this allocator's
    /// context (or null, or the legacy default stream) when the block is freed, and until its
    /// deferred free is made.
    pub fn record_stream(&self, ptr: DevicePtr, stream: CUstream) -> bool {
        let ptr = ptr.get();
        let ours = self.inner.alloc.core().owner_of(ptr).is_some_and(|(start, _)| start == ptr);
        if ours {
            self.inner.uses.record(ptr, stream);
        }
        ours
    }

    /// How many streams [`record_stream`](Self::record_stream) recorded for the live block at
    /// `ptr`, its own excepted or not.
    pub fn recorded_streams(&self, ptr: DevicePtr) -> usize {
        self.inner.uses.recorded(ptr.get())
    }

    /// How many freed blocks wait for the work of streams [`record_stream`](Self::record_stream)
    /// recorded before they come back.
    pub fn deferred_frees(&self) -> usize {
        self.inner.uses.pending()
    }

    /// `size` bytes on `stream` that sleep and wake with `tag`.
    pub fn allocate_tagged(&self, size: usize, stream: &Stream, tag: Tag) -> Result<StreamBlock> {
        self.allocate_on(size, stream, Some(tag))
    }

    /// Waits for all queued work, then releases the device memory of every block tagged `tag`,
    /// first copying what they hold to the tag's backup with [`SleepMode::Offload`] (see
    /// [`Tag::set_backup`]: pageable host memory through a staging ring unless the tag asks for
    /// pinned memory or a file). The addresses stay reserved: nothing else is placed there.
    /// Returns the bytes released.
    ///
    /// Refused, changing nothing, when the tag is asleep already or a stream is being captured
    /// (the driver refuses the wait for the whole device, which also ends that capture in error:
    /// do not sleep during a capture). A backup that cannot be made or written (no host memory, a
    /// full disk) fails the call with the tag awake and whole. Device work that touches a sleeping
    /// block faults the context: sleep only what nothing queued will use before
    /// [`wake`](Self::wake).
    pub fn sleep(&self, tag: Tag, mode: SleepMode) -> Result<usize> {
        let settle = self.inner.alloc.core().sleep_begin(tag)?;
        // Not under the lock: a host function the device waits for may take it (`stats`).
        let waited = self.inner.ctx.synchronize();
        self.inner.alloc.core().sleep_finish(tag, mode, settle, waited).map(|b| b as usize)
    }

    /// Maps memory again under every live block tagged `tag`, at the same addresses with the same
    /// access, and restores what an offloading sleep saved. Refused when the tag is not asleep.
    /// Out of memory, it gives back what it had mapped and the tag stays asleep with nothing lost:
    /// a later wake may succeed.
    ///
    /// Before it reports out of memory it uses every page the allocator can give back: it waits
    /// for the whole device (without the allocator's lock) so that every free so far is idle, and
    /// gives the idle and spare pages back to the driver, as [`empty_cache`](Self::empty_cache).
    pub fn wake(&self, tag: Tag) -> Result<()> {
        let mut core = self.inner.alloc.core();
        let r = core.wake_with(tag, true);
        if r.is_err() && core.wants_settle() {
            core.flush_cached();
            let settle = core.settle_begin();
            let (mut core, waited) = self.settle(core, settle);
            // A failed wait (a capture elsewhere) still leaves what was known idle to give back.
            let _ = waited;
            core.release_idle()?;
            return core.wake_with(tag, false);
        }
        r
    }

    /// Gets `tag`'s backup ready for its first offloading sleep, in the background: pageable host
    /// memory as large as that sleep would copy now is faulted in on threads of its own, then left
    /// for the kernel to take back only if it needs the memory (`MADV_FREE`), as a wake leaves a
    /// backup. The first sleep then writes into pages the kernel kept instead of faulting fresh
    /// memory in, which bounds a first sleep well above the copy; a sleep that comes before the
    /// backup is ready waits for it. Call it once the tag holds what it will sleep with (after
    /// loading weights, say). Returns the bytes being prepared: 0 when there is nothing to copy,
    /// when the tag's backup is not pageable memory ([`Tag::set_backup`]), is retained, or fits
    /// one kept already, when lazy release is off (`CUVMM_BACKUP_RELEASE=eager`), or when the host
    /// has not that much memory available. Refused for an untagged or sleeping tag.
    ///
    /// While awake the process then holds that memory as a released backup: `top` counts it as
    /// resident, `/proc/self/smaps` as `LazyFree`, and the kernel takes it before swapping.
    ///
    /// For a pageable or disk backup it also starts making the staging ring their sleeps copy
    /// through (64 MiB pinned, which a first sleep would otherwise pin itself, at tens of
    /// milliseconds), on a thread of its own; the ring stays with the allocator, as it does after
    /// a first sleep. Nothing else is pinned.
    ///
    /// ```no_run
    /// # fn main() -> cuvmm::error::Result<()> {
    /// use cuvmm::alloc::{SleepMode, StreamAllocator, Tag};
    /// let ctx = cuvmm::Context::for_ordinal(0)?;
    /// let alloc = StreamAllocator::new(&ctx)?;
    /// let weights = Tag::new("weights")?;
    /// // ... allocate the weights under `weights` and load them ...
    /// alloc.prepare_backup(weights)?;
    /// // ... serve; later:
    /// alloc.sleep(weights, SleepMode::Offload)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn prepare_backup(&self, tag: Tag) -> Result<usize> {
        self.inner.alloc.core().prepare_backup(tag).map(|b| b as usize)
    }

    /// Whether every backup [`prepare_backup`](Self::prepare_backup) started is ready (faulted in
    /// and released) and the staging ring made, so that a sleep now would not wait for them.
    pub fn backups_prepared(&self) -> bool {
        self.inner.alloc.core().backups_prepared()
    }

    /// What `tag` holds.
    pub fn tag_stats(&self, tag: Tag) -> TagStats {
        self.inner.alloc.core().tag_stats(tag)
    }

    /// Frees the block at `ptr` on the raw stream `stream`: work queued on `stream` before this
    /// call may still use it; work of other streams must not.
    ///
    /// # Safety
    /// `ptr` must come from [`allocate_raw`](Self::allocate_raw) of this allocator and not be
    /// freed yet (a wrong address is refused, but a block of someone else's would be freed); every
    /// use of it on other streams must be ordered before the work queued on `stream` now, or be
    /// on a stream [`record_stream`](Self::record_stream) named, live until the block's deferred
    /// free is made; and `stream` is subject to what `allocate_raw` requires.
    ///
    /// A free on the stream the block was allocated on asks the driver nothing, during a capture
    /// as at any other time (see the module's "Graph capture"), except, once after another
    /// stream found memory short, to record an event after the free.
    pub unsafe fn free_raw(&self, ptr: DevicePtr, stream: CUstream) -> Result<()> {
        check_stream(stream)?;
        // SAFETY: the caller's contract.
        unsafe { self.free_after_uses(ptr.get(), stream, None) }
    }

    /// Frees the block at `ptr` on `stream`, deferred until the work of the other streams
    /// recorded for it has run ([`Uses::defer`](uses::Uses::defer)); `held`, given, is `stream`'s
    /// owner, kept by a deferred free until it is made.
    ///
    /// # Safety
    /// As for [`free_raw`](Self::free_raw), `stream` checked.
    unsafe fn free_after_uses(
        &self,
        ptr: u64,
        stream: CUstream,
        held: Option<&Arc<StreamInner>>,
    ) -> Result<()> {
        // SAFETY: the caller's contract: `stream` and the streams recorded for `ptr` are live
        // streams of the context.
        if unsafe { self.inner.uses.defer(&self.inner.ctx, ptr, stream, held) }? {
            return Ok(());
        }
        self.inner.alloc.free(ptr, stream_key(stream))
    }

    /// A [`StreamBlock`]'s free: the streams it was used on are recorded as
    /// [`record_stream`](Self::record_stream) records them, and the free is deferred until their
    /// work has run, as a raw block's is; the deferred free holds the block's stream.
    fn free_block(&self, ptr: u64, stream: &Arc<StreamInner>, used_on: &[Arc<StreamInner>]) -> Result<()> {
        for other in used_on {
            self.inner.uses.record(ptr, other.raw);
        }
        // SAFETY: the block came from this allocator and is freed once, here; the block holds its
        // stream and the streams it was used on, all of the allocator's context, alive for the
        // call, and the deferred free holds its stream until it is made.
        unsafe { self.free_after_uses(ptr, stream.raw, Some(stream)) }
    }

    /// The live block holding `ptr` (anywhere inside it), if this allocator handed it out.
    pub fn owner_of(&self, ptr: DevicePtr) -> Option<BlockRange> {
        let (start, len) = self.inner.alloc.core().owner_of(ptr.get())?;
        Some(BlockRange { start: DevicePtr::new(start), len })
    }

    /// Shares the live block holding `ptr` with another process: a POSIX descriptor for each page
    /// under it (the pages hold the block's neighbours too, as legacy CUDA IPC shares a whole
    /// segment). [`BlockImport::import`] maps them elsewhere. Each page's first export is kept with
    /// the page (see [`PhysicalMemory::export_fd_kept`](crate::vmm::PhysicalMemory::export_fd_kept)):
    /// sharing the same block again duplicates those descriptors instead of asking the driver, and
    /// a kept descriptor closes when the allocator gives its page back.
    ///
    /// Once the importers have let go, call [`unexport`](Self::unexport) (once per export). Until
    /// then the block's bytes count in [`AllocatorStats::exported`] and its tag refuses to sleep.
    /// The block may be freed before: its memory (addresses and pages) stays out of every later
    /// allocation, its bytes move to [`AllocatorStats::freed_shared`], and the last `unexport`
    /// frees it, so that no new block lands on memory an importer still reads and writes.
    /// Refused for a block whose tag is asleep, and where the device cannot export POSIX
    /// descriptors.
    pub fn export(&self, ptr: DevicePtr) -> Result<BlockExport> {
        let mut held = Vec::new();
        let at = self.inner.alloc.core().export(ptr.get(), |page| {
            held.push(page.clone());
            Ok(())
        })?;
        let fds = match descriptors_of(&held) {
            Ok(fds) => fds,
            Err(e) => {
                // Undoes this call's own mark, which only a broken allocator state refuses.
                self.unexport(DevicePtr::new(at.block))?;
                return Err(e);
            }
        };
        let pages = held.iter().map(PhysicalMemory::serial).collect();
        Ok(BlockExport { share: at.share(pages), fds })
    }

    /// [`export`](Self::export) without the descriptors: marks the block shared (as `export`
    /// does, until as many [`unexport`](Self::unexport) calls) and says where it lies and which
    /// pages are under it, costing no descriptor and no driver call. An importer that already
    /// maps pages with these serials from this process needs nothing more; one that does not
    /// gets their descriptors from [`exported_fds`](Self::exported_fds).
    pub fn export_mark(&self, ptr: DevicePtr) -> Result<BlockShare> {
        let mut pages = Vec::new();
        let at = self.inner.alloc.core().export(ptr.get(), |page| {
            pages.push(page.serial());
            Ok(())
        })?;
        Ok(at.share(pages))
    }

    /// From now on, exports each page as it is made and keeps the descriptor with it (see
    /// [`export`](Self::export)), for a process that hands its blocks to others: a later export of
    /// a block on those pages asks nothing of the driver, so the hand-off does not wait for it.
    /// A page's creation costs one export more (tens of microseconds) and a kept descriptor
    /// (within the process's budget for them). The hand-off's sender asks for it at its first
    /// offer.
    pub fn export_pages_ahead(&self) {
        self.inner.exports_ahead.store(true, Ordering::Relaxed);
    }

    /// One POSIX descriptor for each page under the shared block at `block` (as
    /// [`export_mark`](Self::export_mark) or [`export`](Self::export) returned it), in address
    /// order, as `export` gives them; the block may have been freed since (its mark keeps its
    /// pages). Refused for a block not shared (any more).
    pub fn exported_fds(&self, block: DevicePtr) -> Result<Vec<std::os::fd::OwnedFd>> {
        let mut held = Vec::new();
        self.inner.alloc.core().exported_pages(block.get(), |page| {
            held.push(page.clone());
            Ok(())
        })?;
        descriptors_of(&held)
    }

    /// One sharing of the block at `block` (as [`export`](Self::export) returned it) is over.
    /// Refused for a block not shared.
    pub fn unexport(&self, block: DevicePtr) -> Result<()> {
        self.inner.alloc.core().unexport(block.get())
    }

    /// Counters of this allocator.
    pub fn stats(&self) -> AllocatorStats {
        self.inner.alloc.core().stats()
    }

    /// Resets the peaks of [`stats`](Self::stats) to the current values.
    pub fn reset_peaks(&self) {
        self.inner.alloc.core().reset_peaks()
    }

    /// Waits for the work that used freed blocks, then gives every idle page back to the driver.
    /// Returns the bytes released. Refused while a stream is being captured (the driver refuses the
    /// wait for the whole device, which also ends that capture in error: do not empty the cache
    /// during a capture).
    pub fn empty_cache(&self) -> Result<usize> {
        self.settle_uses(true);
        self.inner.ctx.bind()?;
        let mut core = self.inner.alloc.core();
        core.flush_cached();
        let settle = core.settle_begin();
        let (mut core, waited) = self.settle(core, settle);
        waited?;
        let released = core.release_idle()?;
        core.emptied();
        Ok(released as usize)
    }

    /// Waits for the whole device without the allocator's lock, which a host function the device
    /// waits for may take (`stats` is allowed there), then takes the lock again and tells the
    /// allocator what the wait covered. Returns the lock and how the wait went.
    fn settle<'a>(
        &'a self,
        core: MutexGuard<'a, Core<DriverBackend>>,
        settle: Settle,
    ) -> (MutexGuard<'a, Core<DriverBackend>>, Result<()>) {
        drop(core);
        let waited = self.inner.ctx.synchronize();
        let mut core = self.inner.alloc.core();
        let r = core.settled(settle, waited.is_ok());
        (core, waited.and(r))
    }

    /// Returns the memory kept for captured graphs ([`GraphMemory::Keep`]) to the shared pool:
    /// free blocks at once, live ones when freed. Returns the free bytes that came back.
    ///
    /// # Safety
    /// No graph captured with memory from this allocator may be replayed again (destroy them
    /// first): their replays would write memory handed out to others.
    pub unsafe fn release_graph_memory(&self) -> usize {
        self.inner.alloc.core().release_graph_memory() as usize
    }
}

/// Refuses the per-thread default stream, which names a different stream on each thread.
fn check_stream(stream: CUstream) -> Result<()> {
    if stream as usize == CU_STREAM_PER_THREAD {
        return Err(Error::invalid(
            "the per-thread default stream names a different stream on each thread: pass the stream itself",
        ));
    }
    Ok(())
}

/// The capture mode of a request on `stream` and the stream's id (`None`: not asked, or the
/// driver could not name it). The legacy default stream is never captured and its id is the
/// allocator's own: the cached pair on it asks the driver nothing.
#[inline]
fn caller_of(stream: CUstream, graphs: GraphMemory) -> Result<(Capture, Option<ids::StreamId>)> {
    if stream.is_null() || stream as usize == CU_STREAM_LEGACY {
        return Ok((Capture::None, Some(ids::LEGACY)));
    }
    check_stream(stream)?;
    Ok(match (backend::capture_of(stream)?, graphs) {
        // Not asked during a capture, where the driver may forbid it: see `Core::caller`.
        (None, _) => (Capture::None, backend::stream_id(stream)),
        (Some(id), GraphMemory::Keep) => (Capture::Private(id), None),
        (Some(id), GraphMemory::Share) => (Capture::Shared(id), None),
    })
}

/// The null handle and `CU_STREAM_LEGACY` name the same stream.
fn stream_key(stream: CUstream) -> ids::Handle {
    ids::Handle(if stream.is_null() { CU_STREAM_LEGACY as u64 } else { stream as usize as u64 })
}

/// A live block of a [`StreamAllocator`] shared with another process ([`StreamAllocator::export`]).
#[derive(Debug)]
pub struct BlockExport {
    /// Where the block lies and which pages are under it.
    pub share: BlockShare,
    /// One descriptor per page, in address order.
    pub fds: Vec<std::os::fd::OwnedFd>,
}

/// Where a live block of a [`StreamAllocator`] marked shared lies and which pages are under it
/// ([`StreamAllocator::export_mark`]; [`BlockExport`] adds the pages' descriptors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockShare {
    /// The block's address.
    pub block: DevicePtr,
    /// The block's size.
    pub len: u64,
    /// The address of the first page under the block; the pages follow it without gaps.
    pub first_page: u64,
    /// Bytes per page.
    pub page: usize,
    /// Each page's [`serial`](crate::vmm::PhysicalMemory::serial), in address order: an importer
    /// that kept a mapping of pages with these numbers from this process may use it again.
    pub pages: Vec<u64>,
}

/// A descriptor of each page, asked of the driver without the allocator's lock (an export takes
/// tens of microseconds, the first in a process hundreds): allocations and offers on other threads
/// go on meanwhile. The clones keep the pages alive; the block's mark keeps them out of reuse.
fn descriptors_of(pages: &[PhysicalMemory]) -> Result<Vec<std::os::fd::OwnedFd>> {
    pages.iter().map(PhysicalMemory::export_fd_kept).collect()
}

/// Pages another process exported ([`StreamAllocator::export`]), mapped here side by side as they
/// lie there, readable and writable by the exporter's device and by the peers named at the import.
/// Dropping it waits for the work of those devices, then unmaps; the memory lives on while its
/// exporter or any other importer holds it.
pub struct BlockImport {
    // Dropped before the reservation they are mapped in.
    mappings: Vec<Mapping>,
    reservation: Reservation,
}

impl BlockImport {
    /// Imports `fds` (pages of `page` bytes each, in address order) on `ctx`'s device, which must
    /// be the device they were made on, and grants `peers` access too (each must be able to reach
    /// it; granting a device access retains its primary context, so name only devices this
    /// process uses). The descriptors are not consumed: close them afterwards.
    pub fn import(
        ctx: &Context,
        fds: &[std::os::fd::BorrowedFd<'_>],
        page: usize,
        peers: &[Device],
    ) -> Result<BlockImport> {
        if fds.is_empty() {
            return Err(Error::invalid("nothing to import"));
        }
        let total =
            fds.len().checked_mul(page).filter(|_| page > 0).ok_or_else(|| {
                Error::invalid(format!("{} pages of {page} bytes cannot be mapped", fds.len()))
            })?;
        // Every page is mapped at a multiple of `page`, so the base needs no more alignment than
        // the largest power of two dividing it: a whole-block export's page is the block's size
        // (20 MiB, say), which no reservation can be aligned to.
        let reservation = Reservation::with_options(ctx, total, 1 << page.trailing_zeros(), None)?;
        let mut mappings = Vec::with_capacity(fds.len());
        for (i, fd) in fds.iter().enumerate() {
            let phys = PhysicalMemory::import_fd(ctx, *fd, page)?;
            mappings.push(reservation.map_all(i * page, &phys)?);
        }
        let mut grants = vec![(ctx.device(), Access::ReadWrite)];
        for &d in peers {
            if grants.iter().any(|&(g, _)| g == d) {
                continue;
            }
            if !d.can_access_peer(&ctx.device())? {
                return Err(Error::invalid(format!(
                    "device {} cannot reach device {}'s memory",
                    d.ordinal(),
                    ctx.device().ordinal()
                )));
            }
            grants.push((d, Access::ReadWrite));
        }
        reservation.set_access(0, total, &grants)?;
        Ok(BlockImport { mappings, reservation })
    }

    /// The address of the first page.
    pub fn ptr(&self) -> u64 {
        self.reservation.base()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.mappings.len() * self.mappings.first().map_or(0, Mapping::len)
    }

    /// Whether nothing is mapped (never: an import maps at least one page).
    pub fn is_empty(&self) -> bool {
        self.mappings.is_empty()
    }

    /// Its drop unmaps at once, without waiting for the devices granted access.
    ///
    /// # Safety
    /// As for [`Mapping::assume_idle`](crate::vmm::Mapping::assume_idle): no work that uses the
    /// pages may be queued or running when it is dropped.
    pub(crate) unsafe fn assume_idle(&mut self) {
        for m in &mut self.mappings {
            // SAFETY: per this function's contract.
            unsafe { m.assume_idle() };
        }
    }
}

impl std::fmt::Debug for BlockImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockImport")
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .field("len", &self.len())
            .finish()
    }
}

/// Device memory from a [`StreamAllocator`], freed on its stream when dropped.
///
/// Work queued through its views ([`as_slice`](Self::as_slice), [`as_mut_slice`](Self::as_mut_slice))
/// is ordered across streams as for every cuvmm memory type ([`crate::stream::order`]). Its free
/// follows the work of every other stream that used it that way or was named by
/// [`use_on`](Self::use_on), as a raw block's after
/// [`record_stream`](StreamAllocator::record_stream): the block goes back to the allocator only
/// once that work has run.
pub struct StreamBlock {
    alloc: StreamAllocator,
    ptr: u64,
    len: usize,
    stream: Arc<StreamInner>,
    used_on: Vec<Arc<StreamInner>>,
    order: Tracker,
}

impl StreamBlock {
    fn new(alloc: &StreamAllocator, ptr: u64, len: usize, stream: &Stream) -> StreamBlock {
        StreamBlock {
            alloc: alloc.clone(),
            ptr,
            len,
            stream: stream.inner().clone(),
            used_on: Vec::new(),
            order: Tracker::new(),
        }
    }

    /// A read-only view of the block as `len() / size_of::<T>()` elements of `T`.
    pub fn as_slice<T: DeviceCopy>(&self) -> DeviceSlice<'_, T> {
        // SAFETY: the block holds `len` bytes, 512-aligned (enough for any `DeviceCopy` type), and
        // lives as long as the borrow; uses are recorded in the block's own tracker.
        unsafe { DeviceSlice::tracked(self.ptr, self.len / std::mem::size_of::<T>().max(1), &self.order) }
    }

    /// A writable view of the block as `len() / size_of::<T>()` elements of `T`.
    pub fn as_mut_slice<T: DeviceCopy>(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as in `as_slice`, and `&mut self` makes it the only writable view.
        unsafe { DeviceSliceMut::tracked(self.ptr, self.len / std::mem::size_of::<T>().max(1), &self.order) }
    }

    /// The device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether zero bytes were asked for (never: zero is refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Says that work queued on `other` uses this block: when the block is dropped, it goes back
    /// to the allocator only once the work queued there by then has run (PyTorch's
    /// `record_stream`).
    pub fn use_on(&mut self, other: &Stream) -> Result<()> {
        if !other.context().same_as(&self.alloc.inner.ctx) {
            return Err(Error::invalid("the stream belongs to another context than the allocator"));
        }
        if other.raw() != self.stream.raw && !self.used_on.iter().any(|s| s.id == other.inner().id) {
            self.used_on.push(other.inner().clone());
        }
        Ok(())
    }
}

impl std::fmt::Debug for StreamBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamBlock")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for StreamBlock {
    fn drop(&mut self) {
        let (alloc, ptr, stream, mut used_on) =
            (self.alloc.clone(), self.ptr, self.stream.clone(), std::mem::take(&mut self.used_on));
        for s in self.order.take().streams() {
            if s.id != stream.id && !used_on.iter().any(|u| u.id == s.id) {
                used_on.push(s.clone());
            }
        }
        // An error leaves the block out of the allocator rather than freed early.
        crate::driver::callback::release(move || {
            crate::error::record_drop(alloc.free_block(ptr, &stream, &used_on));
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_limits_live_bytes_and_one_removes_the_limit() {
        let limit = limit_for(0.5, 1000).unwrap();
        assert_eq!(limit, 500);
        assert!(!over_limit(0, 500, limit));
        assert!(over_limit(400, 101, limit));
        assert!(over_limit(u64::MAX - 1, u64::MAX, NO_LIMIT - 1), "no overflow past the largest limit");
        for bad in [-0.1, 1.5, f64::NAN] {
            let e = limit_for(bad, 1000).unwrap_err();
            assert!(e.to_string().contains("not between 0 and 1"), "{e}");
        }
        assert_eq!(limit_for(1.0, 1000).unwrap(), NO_LIMIT);
        assert!(!over_limit(1 << 40, 1 << 40, NO_LIMIT));
    }

    #[test]
    fn a_fraction_of_zero_or_of_less_than_a_byte_refuses_every_request() {
        for fraction in [0.0, 1e-4] {
            let limit = limit_for(fraction, 1000).unwrap();
            assert_eq!(limit, 0, "fraction {fraction}: a limit of 0 bytes, not none");
            assert!(over_limit(0, 1, limit));
        }
    }
}
