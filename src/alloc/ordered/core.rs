//! The allocator's logic for one device: heaps, the pages behind them, the events that make
//! blocks freed on one stream safe for others, graph pools, and the out-of-memory path.
//!
//! It is generic over [`Backend`] so that the same code runs against the driver and, in tests,
//! against a model of the GPU that checks every page is mapped only where no queued work can see
//! the change.

use super::front::{lock, Entry, Fronts};
use super::heap::{BlockId, Freed, Heap, Owner, PendingFree, ALIGN};
use super::ids::{Caller, Epoch, Handle, SlotId, StreamId, IDLE, LEGACY, SYNTHETIC};
use super::Tag;
use crate::error::{Error, Result};
use parts::{Held, Lending, Lent, Pools};
use std::collections::HashMap;
use std::ops::{Index, IndexMut};
use std::sync::{Arc, Mutex, MutexGuard};
use streams::Streams;

/// What the allocator needs from the device.
pub(crate) trait Backend {
    /// A physical page (released when dropped).
    type Page;
    /// A reusable event.
    type Event;

    /// Reserves `size` bytes of address space; returns its base. Released with the backend.
    fn reserve(&mut self, size: u64) -> Result<u64>;
    /// Creates one page of `size` bytes of physical memory.
    fn create_page(&mut self, size: u64) -> Result<Self::Page>;
    fn map(&mut self, addr: u64, page: &Self::Page, size: u64) -> Result<()>;
    fn unmap(&mut self, addr: u64, size: u64) -> Result<()>;
    /// Grants the device read-write access to `[addr, addr + len)`, which is mapped.
    fn set_access(&mut self, addr: u64, len: u64) -> Result<()>;
    fn new_event(&mut self) -> Result<Self::Event>;
    /// Records `event` on the stream whose handle is `raw`. Called only with the handle of the
    /// call under way (see [`Caller`]).
    fn record(&mut self, event: &Self::Event, raw: Handle) -> Result<()>;
    fn query(&mut self, event: &Self::Event) -> Result<bool>;
    /// Whether all work queued so far on the stream whose handle is `raw` (that of the call under
    /// way) has run; it is not being captured.
    fn stream_idle(&mut self, raw: Handle) -> Result<bool>;
    /// The capture under way on the stream whose handle is `raw` (that of the call under way).
    fn capture_of(&mut self, raw: Handle) -> Result<Option<u64>>;
    /// The identity of the stream whose handle is `raw` (that of the call under way), never that
    /// of another stream, before or after; `None` when the driver cannot say.
    fn stream_id(&mut self, raw: Handle) -> Option<StreamId>;
    /// Lets this thread make calls a capture in global mode elsewhere would forbid; returns what
    /// to restore.
    fn relax(&mut self) -> Result<u32>;
    fn restore(&mut self, mode: u32);

    /// Where a sleeping tag's contents are kept.
    type Host;
    /// A backup of at least `bytes` for `tag`, as its options ask: `old` (the tag's retained
    /// backup) when it still fits them, else a new one (`old` is released).
    fn host_alloc(&mut self, tag: Tag, bytes: u64, old: Option<Self::Host>) -> Result<Self::Host>;
    /// Whether the backup is kept after a wake.
    fn host_retained(host: &Self::Host) -> bool;
    /// Starts getting a backup of `bytes` for `tag` ready ahead of its first sleep, in the
    /// background, where its options make that worth it; whether it started.
    fn host_prepare(&mut self, tag: Tag, bytes: u64) -> bool;
    /// Whether every backup [`host_prepare`](Self::host_prepare) started is ready.
    fn host_prepared(&self) -> bool {
        true
    }
    /// Gives a backup back (its memory or its file).
    fn host_release(&mut self, host: Self::Host) {
        drop(host);
    }
    /// Queues a copy of `len` bytes at `src` into `host` at `offset` on copy lane `lane`.
    fn copy_out(&mut self, host: &mut Self::Host, offset: u64, src: u64, len: u64, lane: usize)
        -> Result<()>;
    /// Queues a copy of `len` bytes of `host` at `offset` to `dst` on copy lane `lane`.
    fn copy_in(&mut self, dst: u64, host: &Self::Host, offset: u64, len: u64, lane: usize) -> Result<()>;
    /// Waits for the copies queued on every lane.
    fn finish_copies(&mut self) -> Result<()>;
    /// Marks the copies queued so far, for [`wait_copies`](Self::wait_copies).
    fn mark_copies(&mut self) -> Result<u64>;
    /// Waits for the copies queued before `mark` (not for those queued since): whether they all
    /// succeeded (a failure itself is for [`finish_copies`](Self::finish_copies) to report).
    fn wait_copies(&mut self, mark: u64) -> Result<bool>;
    /// Waits for all work queued on the device. The allocator itself waits without its lock (see
    /// [`Core::settle_begin`]); the model tests' one-step paths call this.
    #[cfg_attr(not(test), allow(dead_code))]
    fn synchronize(&mut self) -> Result<()>;
}

/// Pages are lent (see [`Core::lend`]) only when new ones would bring the memory held past this
/// many times the largest live total so far: each page moved costs the calling thread tens of
/// microseconds of driver calls, so a little memory buys far fewer moves (docs/PERFORMANCE.md,
/// "Lending threshold").
const LEND_ABOVE: f64 = 1.03;

/// Requests up to this size come from the small heaps, so small blocks never pin large pages.
pub(crate) const SMALL: u64 = 1 << 20;

/// A request up to this size searches the index before its stream's cached blocks up to this
/// size are put back there: decoding asks for small blocks of a few sizes in turn, and emptying
/// the stream's cache at each search sent four requests in five to the index (the
/// `decoding_takes_most_of_its_blocks_from_its_streams_front` test). Larger cached blocks go back
/// first, as before: held whole in a cache, they keep a training run's memory above its live
/// peak (every small block kept, up to 1 MiB: 1.066x where 1.041x in
/// `whole_blocks_keep_a_training_runs_memory_near_its_live_peak`).
pub(crate) const KEEP: u64 = 64 << 10;

/// How a call relates to graph capture on its stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Capture {
    /// The stream is not being captured.
    None,
    /// Captured (the capture's id); memory handed out now belongs to the graph
    /// (`change_current_allocator` use).
    Private(u64),
    /// Captured (the capture's id); the caller keeps graph memory apart itself (PyTorch's
    /// `MemPool` use).
    Shared(u64),
}

impl Capture {
    fn id(self) -> Option<u64> {
        match self {
            Capture::None => None,
            Capture::Private(id) | Capture::Shared(id) => Some(id),
        }
    }
}

/// The most (capture, handle) identities kept (see [`Core::caller`]): far more streams than one
/// capture uses, and a bound on a process that captures for ever.
pub(crate) const CAPTURE_IDS: usize = 4096;

/// Counters, in bytes unless named a count. Laid out as `cuvmm_stats_t` of the C header.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Bytes handed out (block sizes, multiples of 512).
    pub live: u64,
    /// The largest `live` since the last reset. Requests and frees served by a stream's own
    /// cache count there, with the highest and lowest point they reached, until the allocator
    /// adds them up (at each request or free that takes its device-wide lock, and at each read
    /// of the counters); the peak is then each stream's highest point with every other stream at
    /// its lowest. Exact while requests come from one stream at a time; otherwise a lower bound.
    pub live_peak: u64,
    /// Bytes asked for by live allocations.
    pub requested: u64,
    /// Physical memory held: pages mapped plus spare pages.
    pub mapped: u64,
    /// The largest `mapped` since the last reset.
    pub mapped_peak: u64,
    /// Address space reserved.
    pub reserved: u64,
    /// Successful allocations.
    pub allocations: u64,
    /// Frees.
    pub frees: u64,
    /// Allocations served without mapping a page.
    pub cache_hits: u64,
    /// Pages created with the driver.
    pub pages_created: u64,
    /// Pages given back to the driver.
    pub pages_released: u64,
    /// Pages moved to where they were needed: idle ones unmapped, or pages of blocks a stream
    /// freed lent to that stream's next blocks.
    pub pages_remapped: u64,
    /// Events recorded to learn when freed blocks became idle.
    pub events_recorded: u64,
    /// Page creations refused for lack of memory and retried after freeing idle memory.
    pub oom_retries: u64,
    /// Bytes kept for captured CUDA graphs (free inside graph pools, or live there).
    pub graph_held: u64,
    /// Bytes of live blocks shared with other processes (exported, not yet let go by their
    /// importers): counted in `live` too, since the exporter keeps them allocated meanwhile.
    pub exported: u64,
    /// Bytes of blocks freed while still shared: neither live nor exported, and kept (their
    /// addresses and pages) out of every later allocation until their importers let go, so that
    /// no new block lands on memory another process still reads and writes.
    pub freed_shared: u64,
}

/// Whether the fast paths may find the stream `id`: the driver's ids and the legacy default
/// stream's, not the identities made up for one call or one capture.
fn published(id: StreamId) -> bool {
    id < SYNTHETIC || id == LEGACY
}

/// A request served by a block its stream's front cached with that size, without the core:
/// untagged, outside captures, on a stream the driver named.
fn take_fast(fronts: &Fronts, id: StreamId, size: u64, capture: Capture, tag: Option<Tag>) -> Option<u64> {
    if capture != Capture::None || tag.is_some() || !published(id) {
        return None;
    }
    let n = size.checked_add(ALIGN - 1).map(|s| s & !(ALIGN - 1)).filter(|&n| n > 0)?;
    fronts.take(id, n, size)
}

/// The error of a free of a block that is not live.
fn freed_twice(addr: u64) -> Error {
    Error::invalid(format!("{addr:#x} is not a live allocation (freed twice?)"))
}

/// Records what the driver refused in the part of a free that is best effort: the free has
/// succeeded, so there is nothing to return it with and nothing to retry, as with a destructor's.
fn record_missed(e: Error) {
    crate::error::record_drop::<()>(Err(e));
}

/// A block being freed (see [`Core::free`]): where it lies, who allocated and who frees it, and
/// what the steps before its front found.
struct FreeAt {
    addr: u64,
    slot: SlotId,
    block: BlockId,
    shared: bool,
    allocated: Caller,
    stream: Caller,
    /// Its entry, taken out of the allocating stream's front when another stream frees it.
    moved: Option<Entry>,
    /// The fronts' demand counter when the free began.
    demand: u64,
}

struct Slot<P> {
    heap: Heap,
    /// Which requests its blocks serve.
    kind: HeapKind,
    /// Bytes per page of this heap.
    page: u64,
    pages: Vec<Option<P>>,
}

impl<P> Index<SlotId> for Vec<Slot<P>> {
    type Output = Slot<P>;
    fn index(&self, i: SlotId) -> &Slot<P> {
        &self[i.index()]
    }
}

impl<P> IndexMut<SlotId> for Vec<Slot<P>> {
    fn index_mut(&mut self, i: SlotId) -> &mut Slot<P> {
        &mut self[i.index()]
    }
}

/// Which heaps serve a request: the small ones (requests up to [`SMALL`]) or the large ones,
/// untagged or of a tag, or those of one allocation per block (see [`Core::set_whole_above`]),
/// which are never tagged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeapKind {
    Small(Option<Tag>),
    Large(Option<Tag>),
    Whole,
}

impl HeapKind {
    fn small(self) -> bool {
        matches!(self, HeapKind::Small(_))
    }

    /// The tag its blocks sleep and wake with.
    fn tag(self) -> Option<Tag> {
        match self {
            HeapKind::Small(tag) | HeapKind::Large(tag) => tag,
            HeapKind::Whole => None,
        }
    }

    /// Untagged and of many blocks a page: the heaps whose pages are spare, lent and moved.
    fn ordinary(self) -> bool {
        matches!(self, HeapKind::Small(None) | HeapKind::Large(None))
    }
}

impl<P> Slot<P> {
    fn kind(&self) -> HeapKind {
        self.kind
    }
}

/// One allocation under way.
#[derive(Clone, Copy)]
struct Request {
    /// Bytes handed out: `size` rounded up to [`ALIGN`].
    n: u64,
    /// Bytes asked for.
    size: u64,
    stream: Caller,
    /// Which heaps serve it.
    kind: HeapKind,
    /// The pool the block goes to: the capture's graph pool, or 0.
    pool: u32,
    capture: Capture,
}

/// What a device-wide wait covers: each stream's number that the work queued before the wait
/// began reaches.
pub(crate) struct Settle {
    upto: Vec<(StreamId, Epoch)>,
}

/// Sizes chosen at creation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    /// Pages of untagged large heaps: the ones spare, lent and moved between heaps.
    pub page: u64,
    /// Pages of small heaps (requests up to [`SMALL`]): at most `page`. Smaller than it, they stay
    /// in their heap until idle at [`Core::release_idle`], so that a process with a few small
    /// blocks does not hold a large page for them.
    pub small_page: u64,
    /// Pages of tagged large heaps: larger, so that a tag sleeps and wakes in few driver calls.
    pub tag_page: u64,
    pub large_reserve: u64,
    pub small_reserve: u64,
    /// Whether pages are lent (see [`Core::lend`]).
    pub lend: bool,
}

/// The core's part in device-wide waits, which run without its lock (see
/// [`Core::settle_begin`] and [`Core::try_allocate`]).
#[derive(Default)]
struct Settling {
    /// Device-wide waits under way.
    under_way: usize,
    /// Whether the allocation under way may fail for its caller to wait for the whole device.
    may_ask: bool,
    /// Whether it did.
    asked: bool,
}

/// A block shared with other processes.
#[derive(Clone, Copy, Debug)]
struct Exported {
    /// Sharings not yet over (at least one while recorded).
    sharings: u32,
    /// The block's size.
    len: u64,
}

/// Blocks shared with other processes, kept apart from the heaps' own state because a shared block
/// stays live in its heap past its free, until its importers let go.
#[derive(Default)]
struct Sharing {
    /// By address.
    exported: HashMap<u64, Exported>,
    /// Those of them already freed (see [`AllocatorStats::freed_shared`]): still live in their
    /// heap, as (stream, epoch) of their free, until the last sharing is over.
    freed_shared: HashMap<u64, (StreamId, Epoch)>,
    /// The cache was emptied while blocks freed while shared were still held: each gives its
    /// pages back as its last sharing ends, as that emptying would have.
    empty_when_unshared: bool,
}

impl Sharing {
    /// Stream `s` is forgotten, all its work having run: its frees of shared blocks are idle.
    fn forget_stream(&mut self, s: StreamId) {
        for (stream, epoch) in self.freed_shared.values_mut() {
            if *stream == s {
                *epoch = Epoch::NONE;
            }
        }
    }
}

pub(crate) struct Core<B: Backend> {
    backend: B,
    sizes: Sizes,
    slots: Vec<Slot<B::Page>>,
    /// Pages held beyond the heaps' tables: spare ones, and the bytes mapped.
    held: Held<B::Page>,
    /// Every stream's numbering, events and front.
    streams: Streams<B::Event>,
    pools: Pools,
    stats: AllocatorStats,
    sleepers: HashMap<Tag, sleep::Sleeper<B::Host>>,
    lending: Lending<B::Page>,
    settle: Settling,
    sharing: Sharing,
    /// Blocks of at least this many bytes (untagged) are one physical allocation each; 0: off.
    whole_above: u64,
    /// Bytes of a sleep's copies after which the pages they read are released while the next
    /// ones copy (see [`sleep::SLEEP_BATCH`]).
    sleep_batch: u64,
    /// Whether the tests' allocations and every free end with [`Core::check`] (tests that
    /// replay long recordings check between steps instead).
    #[cfg(test)]
    pub(super) check_calls: bool,
}

impl<B: Backend> Core<B> {
    pub(crate) fn new(backend: B, sizes: Sizes) -> Core<B> {
        Core {
            backend,
            sizes,
            slots: Vec::new(),
            held: Held::default(),
            streams: Streams::default(),
            pools: Pools::default(),
            stats: AllocatorStats::default(),
            sleepers: HashMap::new(),
            lending: Lending::default(),
            settle: Settling::default(),
            sharing: Sharing::default(),
            whole_above: 0,
            sleep_batch: sleep::SLEEP_BATCH,
            #[cfg(test)]
            check_calls: true,
        }
    }

    pub(crate) fn backend(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The counters, the fronts' included. Makes no driver call (a host function may ask).
    pub(crate) fn stats(&mut self) -> AllocatorStats {
        self.take_counts();
        AllocatorStats { graph_held: self.slots.iter().map(|s| s.heap.graph_bytes()).sum(), ..self.stats }
    }

    /// Adds what the fronts counted since last time to the core's counters.
    ///
    /// The peak: each front's highest point with every other front at its lowest (the order of
    /// what they did in between is not known): exact with one stream, never above the truth.
    fn take_counts(&mut self) {
        let base = self.stats.live;
        let (mut lows, mut rise) = (0i64, 0i64);
        for (_, st) in self.streams.iter() {
            let c = std::mem::take(&mut st.front.lock().counts);
            let s = &mut self.stats;
            s.allocations += c.allocations;
            s.cache_hits += c.allocations;
            s.frees += c.frees;
            s.live = s.live.wrapping_add_signed(c.live);
            s.requested = s.requested.wrapping_add_signed(c.requested);
            lows += c.live_min;
            rise = rise.max(c.live_max - c.live_min);
        }
        let high = base.wrapping_add_signed(lows + rise);
        self.stats.live_peak = self.stats.live_peak.max(self.stats.live).max(high);
    }

    /// Addresses of every mapped page (for teardown).
    pub(crate) fn mapped_addresses(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for s in &self.slots {
            let base = s.heap.base();
            out.extend(
                s.pages
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.is_some())
                    .map(|(i, _)| (base + i as u64 * s.page, s.page)),
            );
        }
        for l in &self.lending.lent {
            let s = &self.slots[l.slot];
            out.extend(l.pages.iter().map(|&p| (s.heap.base() + p * s.page, s.page)));
        }
        out
    }

    /// The streams' caches stay: what they hand out after the reset counts from here.
    pub(crate) fn reset_peaks(&mut self) {
        self.take_counts();
        self.stats.live_peak = self.stats.live;
        self.stats.mapped_peak = self.stats.mapped;
    }

    fn note_mapped(&mut self) {
        self.stats.mapped = self.held.mapped + self.held.spare.len() as u64 * self.sizes.page;
        self.stats.mapped_peak = self.stats.mapped_peak.max(self.stats.mapped);
    }

    /// The stream of a call passing handle `raw`, which the driver named `id` (`None`: it could
    /// not, or was not asked, as during a capture). A stream without a name gets one never used
    /// before, or, during a capture, the one it got earlier in that capture: within one capture a
    /// handle names one stream.
    pub(crate) fn caller(&mut self, raw: Handle, id: Option<StreamId>, capture: Capture) -> Caller {
        self.streams.caller(raw, id, capture)
    }

    /// `size` bytes for use on `stream`, waiting for the whole device when out of memory (the
    /// tests' path: the allocator waits without its lock, see [`try_allocate`](Self::try_allocate)).
    #[cfg(test)]
    pub(crate) fn allocate(
        &mut self,
        size: u64,
        stream: impl Into<Caller>,
        capture: Capture,
        tag: Option<Tag>,
    ) -> Result<u64> {
        let stream = stream.into();
        let mut r = match take_fast(&self.streams.fronts, stream.id, size, capture, tag) {
            Some(addr) => Ok(addr),
            None => self.try_allocate(size, stream, capture, tag, true),
        };
        if r.is_err() && self.wants_settle() {
            let settle = self.settle_begin();
            let waited = self.backend.synchronize();
            self.settled(settle, waited.is_ok())?;
            r = self.try_allocate(size, stream, capture, tag, false);
        }
        if self.check_calls {
            self.check();
        }
        r
    }

    /// `size` bytes for use on `stream`. Returns the address.
    ///
    /// Out of memory with `may_settle`, when a wait for the whole device could free memory, it
    /// fails with [`wants_settle`](Self::wants_settle) set: the caller waits without holding
    /// the allocator (a host function may be waiting for it, and the device for that host
    /// function) between [`settle_begin`](Self::settle_begin) and [`settled`](Self::settled),
    /// then asks again without `may_settle`.
    pub(crate) fn try_allocate(
        &mut self,
        size: u64,
        stream: Caller,
        capture: Capture,
        tag: Option<Tag>,
        may_settle: bool,
    ) -> Result<u64> {
        self.settle.asked = false;
        if size == 0 {
            return Err(Error::invalid("cannot allocate zero bytes"));
        }
        if !self.is_awake(tag) {
            return Err(Error::invalid(
                "cannot allocate with a tag that is asleep or going to sleep: wake it first",
            ));
        }
        let n = size
            .checked_add(ALIGN - 1)
            .map(|s| s & !(ALIGN - 1))
            .ok_or_else(|| Error::invalid(format!("{size} bytes cannot be allocated")))?;
        let pool = match capture {
            Capture::Private(id) => self.pools.of(id),
            _ => 0,
        };
        let req = Request { n, size, stream, kind: self.kind_of(n, tag), pool, capture };
        // Before anything moves `live` here: the fronts' rises count from where it stood.
        self.take_counts();
        if capture == Capture::None {
            let found = self
                .slots
                .iter_mut()
                .enumerate()
                .filter(|(_, s)| s.kind() == req.kind)
                .find_map(|(i, slot)| slot.heap.take_cached(stream, n, size).map(|a| (SlotId::of(i), a)));
            if let Some((slot, addr)) = found {
                // A block of its own stream's cache: the peak stays where the last search left it.
                self.stats.allocations += 1;
                self.stats.cache_hits += 1;
                self.stats.live = self.stats.live.wrapping_add(n);
                self.stats.requested = self.stats.requested.wrapping_add(size);
                self.register(&req, slot, addr);
                return Ok(addr);
            }
        }
        self.settle.may_ask = may_settle;
        // The caller's own cached blocks and every idle one first: emptying every front here
        // would send every other stream's next request to this lock too, and each of those would
        // empty the others' again (threads each on their own stream kept one another off their
        // fronts). A small request leaves the caller's small cached blocks where they are unless
        // the index cannot serve it without them.
        let keep = n <= KEEP;
        self.flush_fronts(Some(stream.id), keep);
        let mut found = self.find_free(&req)?;
        if found.is_none() && keep {
            self.flush_fronts(Some(stream.id), false);
            found = self.find_free(&req)?;
        }
        if found.is_none() {
            // Other streams' cached blocks may be idle by now: all of them, before new memory.
            self.flush_cached();
            found = self.find_free(&req)?;
        }
        let (slot, addr) = match found {
            Some(f) => f,
            None => {
                let old = self.backend.relax()?;
                let r = self.allocate_slow(&req);
                self.backend.restore(old);
                r?
            }
        };
        self.register(&req, slot, addr);
        Ok(addr)
    }

    /// A free block for `req` in the index: its stream's or an idle one, of its pool, else an idle
    /// one of the shared pool. During a capture nothing may be queried, so only blocks known idle
    /// (or this capture's own, reused in capture order) qualify.
    fn find_free(&mut self, req: &Request) -> Result<Option<(SlotId, u64)>> {
        let reuse = if matches!(req.capture, Capture::Shared(_)) { IDLE } else { req.stream.id };
        let found = self.reuse(req, reuse, req.pool)?;
        if found.is_none() && req.pool != 0 {
            return self.reuse(req, IDLE, 0);
        }
        Ok(found)
    }

    /// Gives the front of the request's stream the block just handed out, so that its free
    /// through the same handle, and the stream's later requests of its size, need not come here:
    /// untagged blocks of the shared pool (not one-allocation blocks) outside captures, on
    /// streams the driver named.
    fn register(&mut self, req: &Request, slot: SlotId, addr: u64) {
        if req.capture != Capture::None || !req.kind.ordinary() || req.pool != 0 || !published(req.stream.id)
        {
            return;
        }
        let entry = Entry { n: req.n, requested: req.size, slot, cached: false, via_core: false };
        if let Some(front) = self.streams.publish(req.stream) {
            front.lock().blocks.insert(addr, entry);
        }
    }

    /// Gives every spare page back to the driver.
    fn release_spare(&mut self) {
        self.stats.pages_released += self.held.spare.len() as u64;
        self.held.spare.clear();
        self.note_mapped();
    }

    fn allocate_slow(&mut self, req: &Request) -> Result<(SlotId, u64)> {
        self.streams.fronts.add_demand();
        if req.capture == Capture::None {
            self.poll_all(req.stream)?;
            if let Some(found) = self.reuse(req, req.stream.id, req.pool)? {
                return Ok(found);
            }
        }
        if req.kind == HeapKind::Whole {
            if let Some(found) = self.whole_over_bound(req)? {
                return Ok(found);
            }
        }
        // Fresh address space; its pages come from idle ones, spare ones, or the driver.
        let (slot, addr) = self.carve(req)?;
        match self.ensure_pages(slot, addr, req.n, req.capture, req.stream.id) {
            Ok(()) => {
                self.count_alloc(req.n, req.size, false);
                Ok((slot, addr))
            }
            Err(e) => {
                self.give_back_block(slot, addr, req.stream);
                Err(e)
            }
        }
    }

    /// Returns a block whose pages could not be mapped. It may hold memory `stream`'s queued work
    /// still uses (a hole it freed, grown or merged), so it goes back as freed on `stream` now.
    fn give_back_block(&mut self, slot: SlotId, addr: u64, stream: Caller) {
        let epoch = {
            let mut f = self.streams.entry(stream).front.lock();
            f.last_free = f.next;
            f.next
        };
        self.slots[slot].heap.free(addr, Owner::Stream { stream: stream.id, epoch });
    }

    /// Takes a free block of pool `pool` that `reuse` (a stream, or [`IDLE`]) may use, for `req`
    /// (and its pool).
    fn reuse(&mut self, req: &Request, reuse: StreamId, pool: u32) -> Result<Option<(SlotId, u64)>> {
        // Heaps of one kind are few (more only when one's address space ran out): the first that
        // fits wins. Whole heaps are one per block: the best fit.
        let found = if req.kind == HeapKind::Whole {
            self.find_whole(pool, reuse, req.n)
        } else {
            self.slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.kind() == req.kind)
                .find_map(|(i, s)| s.heap.find(pool, reuse, req.n).map(|(_, id)| (SlotId::of(i), id)))
        };
        let Some((slot, id)) = found else { return Ok(None) };
        self.take_found(req, slot, id).map(Some)
    }

    /// Hands out `req.n` bytes at the start of free block `id` of `slot`, its pages mapped.
    fn take_found(&mut self, req: &Request, slot: SlotId, id: BlockId) -> Result<(SlotId, u64)> {
        let addr = self.slots[slot].heap.take(id, req.n, req.stream, req.size, req.pool);
        let mapped_before = self.held.mapped;
        if let Err(e) = self.ensure_pages(slot, addr, req.n, req.capture, req.stream.id) {
            self.give_back_block(slot, addr, req.stream);
            return Err(e);
        }
        self.count_alloc(req.n, req.size, self.held.mapped == mapped_before);
        Ok((slot, addr))
    }

    fn count_alloc(&mut self, n: u64, size: u64, hit: bool) {
        let s = &mut self.stats;
        s.allocations += 1;
        s.cache_hits += u64::from(hit);
        s.live = s.live.wrapping_add(n);
        s.requested = s.requested.wrapping_add(size);
        s.live_peak = s.live_peak.max(s.live);
    }

    fn carve(&mut self, req: &Request) -> Result<(SlotId, u64)> {
        let small = req.kind.small();
        let Request { n, size, stream, pool, capture, .. } = *req;
        // As in `allocate`: a capture shared with other streams takes only idle blocks.
        let reuse = if matches!(capture, Capture::Shared(_)) { IDLE } else { stream.id };
        let limit = if req.kind == HeapKind::Whole { self.whole_limit(n) } else { u64::MAX };
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.kind() == req.kind && s.page <= limit {
                if let Some(a) = s.heap.carve(n, stream, size, pool, reuse) {
                    return Ok((SlotId::of(i), a));
                }
            }
        }
        let want = if small { self.sizes.small_reserve } else { self.sizes.large_reserve };
        let (want, page) = match req.kind {
            HeapKind::Small(_) => (want, self.sizes.small_page),
            HeapKind::Large(Some(_)) => (want, self.sizes.tag_page),
            HeapKind::Large(None) => (want, self.sizes.page),
            // A heap of one page, for a block that must be one physical allocation.
            HeapKind::Whole => (self.whole_page(n)?, self.whole_page(n)?),
        };
        let pages = n
            .div_ceil(page)
            .checked_mul(page)
            .ok_or_else(|| Error::invalid(format!("{size} bytes cannot be allocated")))?;
        let reserve = want.max(pages);
        if self.slots.len() >= SlotId::MAX {
            return Err(Error::invalid(format!(
                "{size} bytes cannot be allocated: no room for another heap"
            )));
        }
        // The table is sized by the reservation (a configured size, or the request): one that
        // cannot be allocated is an error, not an abort.
        let mut table = Vec::new();
        table.try_reserve_exact((reserve / page) as usize).map_err(|_| {
            Error::invalid(format!("{size} bytes cannot be allocated: no page table for {reserve} bytes"))
        })?;
        table.resize_with((reserve / page) as usize, || None);
        let base = self.backend.reserve(reserve)?;
        self.stats.reserved += reserve;
        self.slots.push(Slot { heap: Heap::new(base, reserve), kind: req.kind, page, pages: table });
        let i = SlotId::of(self.slots.len() - 1);
        let a =
            self.slots[i].heap.carve(n, stream, size, pool, reuse).expect("a new heap holds its first block");
        Ok((i, a))
    }

    /// Maps every page under `[addr, addr + n)` of `slot` that is not mapped yet.
    fn ensure_pages(
        &mut self,
        slot: SlotId,
        addr: u64,
        n: u64,
        capture: Capture,
        stream: StreamId,
    ) -> Result<()> {
        let page = self.slots[slot].page;
        let base = self.slots[slot].heap.base();
        let first = (addr - base) / page;
        let end = (addr + n - base).div_ceil(page);
        if self.slots[slot].pages[first as usize..end as usize].iter().all(Option::is_some) {
            return Ok(());
        }
        let missing: Vec<u64> =
            (first..end).filter(|&p| self.slots[slot].pages[p as usize].is_none()).collect();
        let old = self.backend.relax()?;
        let r = self.map_pages(slot, (addr, n), &missing, capture, stream);
        // Lent pages left over (a failure part-way) are released: the memory stays mapped where
        // it came from until that mapping is undone.
        self.stats.pages_released += self.lending.borrowed.len() as u64;
        self.lending.borrowed.clear();
        self.lending.borrowed_epoch = Epoch::NONE;
        if matches!(&r, Err(e) if e.is_out_of_memory()) {
            // The pages made or moved for a block that could not have them all would hold the
            // device's memory for nothing: even a kernel's first launch needs some.
            self.release_spare();
        }
        self.backend.restore(old);
        self.note_mapped();
        r
    }

    /// Maps `missing` (page indexes, ascending) under block `(addr, n)` run by run of adjacent
    /// pages, granting access once per run. A run that fails part-way is unmapped again: a page
    /// stays in the table only with access granted, since later blocks on it take it as usable.
    ///
    /// Pages come from spare ones, idle ones moved from elsewhere, pages lent by blocks `stream`
    /// freed whose work may not have run yet, and new ones, in that order. A lent page stays
    /// mapped where it came from until that work has run; serving a block of the same stream,
    /// whose work is queued after it, is safe. A page the block covers only in part takes one
    /// only when the rest of the page is free for that stream, and the rest is then kept the
    /// stream's until the same work has run: otherwise another stream's block could share memory
    /// the lender's queued work still touches. Without edge pages each lending block took a new
    /// page for its last one, and those added up over repeated steps.
    fn map_pages(
        &mut self,
        slot: SlotId,
        (addr, n): (u64, u64),
        missing: &[u64],
        capture: Capture,
        stream: StreamId,
    ) -> Result<()> {
        let page = self.slots[slot].page;
        let base = self.slots[slot].heap.base();
        let whole = |p: u64| base + p * page >= addr && base + (p + 1) * page <= addr + n;
        let edge = |c: &Self, p: u64| {
            !whole(p)
                && c.slots[slot].heap.edges_claimable(addr, base + p * page, base + (p + 1) * page, stream)
        };
        if self.held.spare.len() < missing.len() && page == self.sizes.page {
            self.reclaim(missing.len() - self.held.spare.len())?;
            // Lending moves pages back and forth (a map, an access grant and later an unmap each),
            // so it is kept for when new pages would take the memory held past LEND_ABOVE times
            // the largest live total so far.
            let short = missing.len().saturating_sub(self.held.spare.len());
            let after = self.stats.mapped + short as u64 * page;
            let peak = (self.stats.live + n).max(self.stats.live_peak);
            if self.sizes.lend
                && capture == Capture::None
                && self.slots[slot].kind.ordinary()
                && after as f64 > peak as f64 * LEND_ABOVE
            {
                let lendable = missing.iter().filter(|&&p| whole(p) || edge(self, p)).count();
                self.lend(short.min(lendable), stream);
            }
        }
        // Pages lent to this block: never given back as spare ones, since their memory may still
        // be in use where they came from.
        let mut lent_here = Vec::new();
        for run in missing.chunk_by(|a, b| a + 1 == *b) {
            let mut done = 0;
            let mut r = Ok(());
            for &p in run {
                let lend_edge = !self.lending.borrowed.is_empty() && edge(self, p);
                let borrowed = if whole(p) || lend_edge { self.lending.borrowed.pop() } else { None };
                let is_lent = borrowed.is_some();
                let handle = match borrowed.map_or_else(|| self.page_for(0, capture, page), Ok) {
                    Ok(h) => h,
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                };
                if let Err(e) = self.backend.map(base + p * page, &handle, page) {
                    self.give_back_unless_lent(handle, page, is_lent);
                    r = Err(e);
                    break;
                }
                if is_lent {
                    lent_here.push(p);
                }
                if lend_edge {
                    let (lo, hi) = (base + p * page, base + (p + 1) * page);
                    self.slots[slot].heap.claim_edges(addr, lo, hi, stream, self.lending.borrowed_epoch);
                }
                self.slots[slot].pages[p as usize] = Some(handle);
                self.held.mapped += page;
                done += 1;
            }
            if r.is_ok() {
                r = self.backend.set_access(base + run[0] * page, run.len() as u64 * page);
            }
            if let Err(e) = r {
                for &q in &run[..done] {
                    let _ = self.backend.unmap(base + q * page, page);
                    let h = self.slots[slot].pages[q as usize].take().expect("just mapped");
                    self.held.mapped -= page;
                    self.give_back_unless_lent(h, page, lent_here.contains(&q));
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// A page to map: a spare one, an idle one moved from elsewhere, or a new one. The first call
    /// of a batch passes how many pages the batch needs (`want`), so idle pages are found and
    /// unmapped once for all of them; the others pass 0 and take a spare page or make one.
    fn page_for(&mut self, want: usize, capture: Capture, size: u64) -> Result<B::Page> {
        if size != self.sizes.page {
            return self.large_page(size, capture);
        }
        if want > 0 && self.held.spare.len() < want {
            self.reclaim(want - self.held.spare.len())?;
        }
        if let Some(p) = self.held.spare.pop() {
            return Ok(p);
        }
        match self.backend.create_page(size) {
            Ok(p) => {
                self.stats.pages_created += 1;
                Ok(p)
            }
            Err(e) if e.is_out_of_memory() => {
                self.stats.oom_retries += 1;
                // Everything freed may become idle once the work queued before it has run; during
                // a capture nothing may wait, so only what is known idle helps.
                if self.ask_settle(capture) {
                    return Err(e);
                }
                // All of them: the rest of the batch takes the spares instead of asking again.
                if self.reclaim(usize::MAX)? > 0 {
                    return Ok(self.held.spare.pop().expect("reclaimed"));
                }
                self.release_small_idle()?;
                self.backend.create_page(size).inspect(|_| self.stats.pages_created += 1)
            }
            Err(e) => Err(e),
        }
    }

    /// Moves up to `want` mapped pages out of blocks `stream` freed (oldest frees first) into
    /// `borrowed`, leaving them mapped where they are; each block they came from is out of use
    /// until its stream's work has caught up with its free (see [`Core::poll`]).
    fn lend(&mut self, want: usize, stream: StreamId) {
        let page = self.sizes.page;
        let mut got = 0;
        for slot in 0..self.slots.len() {
            if got >= want {
                return;
            }
            if self.slots[slot].page != page || !self.slots[slot].kind.ordinary() {
                continue;
            }
            let base = self.slots[slot].heap.base();
            for PendingFree { id, addr, size, epoch } in self.slots[slot].heap.stream_free(stream) {
                if got >= want {
                    return;
                }
                // The first run of mapped whole pages in the block, as many as still wanted.
                let (first, end) = ((addr - base).div_ceil(page), (addr + size - base) / page);
                let mapped = |p: &u64| self.slots[slot].pages[*p as usize].is_some();
                let Some(from) = (first..end).find(mapped) else { continue };
                let pages: Vec<u64> = (from..end).take_while(mapped).take(want - got).collect();
                let span = (base + from * page, base + (from + pages.len() as u64) * page);
                self.slots[slot].heap.lend(id, span.0, span.1);
                for &p in &pages {
                    let h = self.slots[slot].pages[p as usize].take().expect("mapped");
                    self.lending.borrowed.push(h);
                    self.held.mapped -= page;
                }
                got += pages.len();
                self.lending.borrowed_epoch = self.lending.borrowed_epoch.max(epoch);
                self.stats.pages_remapped += pages.len() as u64;
                self.lending.lent.push(Lent { slot: SlotId::of(slot), stream, epoch, pages });
            }
        }
    }

    /// Unmaps the lent pages of `stream`'s blocks freed up to `epoch` from where they came from,
    /// and frees those blocks, idle.
    fn return_lent(&mut self, stream: StreamId, epoch: Epoch) -> Result<()> {
        let mut r = Ok(());
        let mut slots = Vec::new();
        let backend = &mut self.backend;
        let all = &self.slots;
        self.lending.lent.retain(|l| {
            if l.stream != stream || l.epoch > epoch {
                return true;
            }
            let (base, page) = (all[l.slot].heap.base(), all[l.slot].page);
            for &p in &l.pages {
                if let Err(e) = backend.unmap(base + p * page, page) {
                    r = Err(e);
                }
            }
            slots.push(l.slot);
            false
        });
        slots.sort_unstable();
        slots.dedup();
        for slot in slots {
            self.slots[slot].heap.return_lent(stream, epoch);
        }
        r
    }

    /// A page of a tagged heap's size: created, or, out of memory, created after every idle
    /// ordinary page went back to the driver.
    fn large_page(&mut self, size: u64, capture: Capture) -> Result<B::Page> {
        match self.backend.create_page(size) {
            Err(e) if e.is_out_of_memory() => {
                self.stats.oom_retries += 1;
                if self.ask_settle(capture) {
                    return Err(e);
                }
                self.reclaim(usize::MAX)?;
                self.release_spare();
                self.release_small_idle()?;
                self.backend.create_page(size)
            }
            r => r,
        }
        .inspect(|_| self.stats.pages_created += 1)
    }

    /// A page that was not mapped after all: kept if it is an ordinary one.
    fn give_back(&mut self, handle: B::Page, size: u64) {
        if size == self.sizes.page {
            self.held.spare.push(handle);
        } else {
            self.stats.pages_released += 1;
        }
    }

    /// [`give_back`](Self::give_back), except for a lent page (whose memory may still be in use
    /// where it came from), which is released.
    fn give_back_unless_lent(&mut self, handle: B::Page, size: u64, lent: bool) {
        if lent {
            drop(handle);
            self.stats.pages_released += 1;
        } else {
            self.give_back(handle, size);
        }
    }

    /// Unmaps up to `want` mapped pages lying wholly in idle free blocks into `spare`.
    fn reclaim(&mut self, want: usize) -> Result<usize> {
        let page = self.sizes.page;
        let mut got = 0;
        for slot in 0..self.slots.len() {
            if got >= want {
                break;
            }
            if self.slots[slot].page != page {
                continue;
            }
            let base = self.slots[slot].heap.base();
            for p in self.slots[slot].heap.idle_pages(page) {
                if got >= want {
                    break;
                }
                if self.slots[slot].pages[p as usize].is_none() {
                    continue;
                }
                self.backend.unmap(base + p * page, page)?;
                let h = self.slots[slot].pages[p as usize].take().expect("mapped");
                self.held.spare.push(h);
                self.held.mapped -= page;
                self.stats.pages_remapped += 1;
                got += 1;
            }
        }
        Ok(got)
    }

    /// Takes in the events that completed, making the blocks they cover idle, and forgets streams
    /// with nothing left to wait for. Of the caller's own frees, makes those idle whose work has
    /// run, or records an event after them: the caller's stream is the only one this call may
    /// pass to the driver.
    fn poll_all(&mut self, caller: Caller) -> Result<()> {
        for s in self.streams.ids() {
            self.poll(s)?;
            if self.settle.under_way > 0 {
                // While a device-wide wait is under way its numbers must stay, or a free after
                // the wait began could be taken as covered.
                continue;
            }
            if self.streams.retire_if_done(s) {
                // Its numbers start again if it comes back: a block freed on it while shared,
                // whose work has run like the rest of its frees, must not wait for a number of
                // the stream's next life.
                self.sharing.forget_stream(s);
            }
        }
        if self.streams.contains_key(&caller.id) && !self.caught_up(caller, true)? {
            self.fence(caller)?;
        }
        Ok(())
    }

    /// If the caller's stream has frees no completed event covers and has run all its work, makes
    /// them idle, as a completed event recorded now would. Asked at a request of that stream that
    /// found no block, and at its first free after another stream's request found no cached
    /// block: with events alone, when the device keeps up with the host, a stream that frees much
    /// while another allocates keeps its memory to itself and the others take new pages
    /// (docs/PERFORMANCE.md, "Streams that have caught up").
    ///
    /// `now` makes them idle at once (a request about to search); otherwise at the next poll, so
    /// that a free just after, merging with them, does not take them back to its stream first.
    fn caught_up(&mut self, c: Caller, now: bool) -> Result<bool> {
        let st = &self.streams[&c.id];
        let (front, done) = (st.front.clone(), st.done);
        // The front stays locked from the query to the new number: a free stamped with the old
        // one happened before the query, a free after it takes the new one.
        let mut f = front.lock();
        if f.last_free <= done
            || self.backend.capture_of(c.raw)?.is_some()
            || !self.backend.stream_idle(c.raw)?
        {
            return Ok(false);
        }
        let n = f.next.take();
        drop(f);
        self.streams.found_idle(c.id, n, now);
        if now {
            self.work_ran(c.id, n)?;
        }
        Ok(true)
    }

    fn poll(&mut self, s: StreamId) -> Result<()> {
        let backend = &mut self.backend;
        match self.streams.poll(s, |ev| backend.query(ev))? {
            Some(n) => self.work_ran(s, n),
            None => Ok(()),
        }
    }

    /// The work `s` queued before its event number `n` has run: blocks freed there until then
    /// are idle, and pages they lent come home.
    fn work_ran(&mut self, s: StreamId, n: Epoch) -> Result<()> {
        for slot in &mut self.slots {
            slot.heap.promote(s, n);
        }
        self.return_lent(s, n)
    }

    /// Records an event on the caller's stream if a free there is not covered by one yet and the
    /// stream is not being captured.
    fn fence(&mut self, c: Caller) -> Result<()> {
        let front = self.streams[&c.id].front.clone();
        // Locked from the check to the new number, the record between: a free stamped with the
        // event's number happened before the record, a free after it takes the next number.
        let mut f = front.lock();
        if f.last_free < f.next {
            return Ok(());
        }
        if self.backend.capture_of(c.raw)?.is_some() {
            return Ok(());
        }
        let ev = match self.streams.spare_event() {
            Some(e) => e,
            None => self.backend.new_event()?,
        };
        if let Err(e) = self.backend.record(&ev, c.raw) {
            self.streams.keep_event(ev);
            return Err(e);
        }
        self.stats.events_recorded += 1;
        let n = f.next.take();
        drop(f);
        self.streams.fenced(c.id, n, ev);
        Ok(())
    }

    /// The first half of a device-wide wait: every free so far is covered by it, so each stream's
    /// numbering moves past them. Returns what [`settled`](Self::settled) takes once the wait
    /// has returned.
    pub(crate) fn settle_begin(&mut self) -> Settle {
        self.settle.under_way += 1;
        Settle { upto: self.streams.advance_all() }
    }

    /// The second half: the device-wide wait has returned, so the work queued before
    /// [`settle_begin`](Self::settle_begin) has run, on every stream, and no capture was under
    /// way (the driver refuses the wait during one). `ok` says whether the wait succeeded.
    pub(crate) fn settled(&mut self, settle: Settle, ok: bool) -> Result<()> {
        self.settle.under_way -= 1;
        if !ok {
            self.streams.unskip(&settle.upto);
            return Ok(());
        }
        let mut r = Ok(());
        for (s, n) in settle.upto {
            self.streams.ran_to(s, n);
            if let Err(e) = self.work_ran(s, n) {
                r = Err(e);
            }
        }
        r
    }

    /// Whether an allocation out of memory should fail for its caller to wait for the whole
    /// device and ask again: not during its own capture (nothing may wait there), nor a second
    /// time. Whether another stream is being captured cannot be known without asking a stream
    /// this call did not pass (a capture may have ended long ago on a stream that never calls
    /// again): the driver refuses the wait while one is, and the request then fails out of memory.
    fn ask_settle(&mut self, capture: Capture) -> bool {
        let ask = self.settle.may_ask && capture == Capture::None;
        self.settle.asked |= ask;
        ask
    }

    /// Whether the last [`try_allocate`](Self::try_allocate) failed for want of a wait for the
    /// whole device.
    pub(crate) fn wants_settle(&self) -> bool {
        self.settle.asked
    }

    /// Waits for all work queued on the device, making every free so far idle (the tests' path;
    /// the allocator waits without its lock).
    #[cfg(test)]
    fn settle_all(&mut self) -> Result<()> {
        let settle = self.settle_begin();
        let r = self.backend.synchronize();
        self.settled(settle, r.is_ok())?;
        r
    }

    /// Frees the block at `addr`, last used on the stream whose handle is `raw`.
    ///
    /// The same whether or not the stream is being captured: a block freed during a capture is
    /// owned by its stream like any other, and becomes anyone's only once an event recorded on
    /// that stream after the free has completed, which cannot be recorded before the capture
    /// ends, or after a device-wide wait, which the driver refuses during a capture. Until then
    /// only the stream's own eager requests could take it, and those cannot come during the
    /// capture: captured requests take blocks of their graph's pool or idle ones. A graph's own
    /// blocks freed during its capture go back to its pool as always.
    ///
    /// It asks the driver nothing when `raw` is the handle the block was allocated with (then it
    /// names the same stream, or one destroyed since, whose identity nothing uses again: the
    /// block waits for a device-wide wait) and no other stream found memory short since this
    /// stream's last event; otherwise it asks the stream's identity, and records an event after
    /// the free for the others.
    pub(crate) fn free(&mut self, addr: u64, raw: Handle) -> Result<Freed> {
        self.take_counts();
        let (slot, i, allocated) = self.live_at(addr)?;
        // Importers still map it: it stays live in its heap until they let go (see `unexport`).
        let shared = self.sharing.exported.contains_key(&addr);
        let stream = if raw == allocated.raw { allocated } else { self.freeing_stream(raw) };
        let demand = self.streams.fronts.demand();
        let moved = self.take_from_allocating_front(allocated.id, stream.id, addr)?;
        let (freed, epoch, ask) =
            self.free_in_front(FreeAt { addr, slot, block: i, shared, allocated, stream, moved, demand })?;
        // Attributed without asking, the stream may have been destroyed and its handle given to
        // another: an event recorded (or an idle query) through the handle would then be the
        // other stream's, taken for this one's. So the handle is asked first (never its id while
        // captured); a destroyed stream's frees wait for a device-wide wait.
        if ask && (raw != allocated.raw || self.names(stream)) {
            self.cover_frees(stream);
        }
        if shared {
            self.hold_freed(addr, stream.id, epoch);
        }
        #[cfg(test)]
        if self.check_calls {
            self.check();
        }
        Ok(freed)
    }

    /// The live block at `addr`: its heap, its place there, and the stream that allocated it;
    /// an error when no heap holds the address, or the block there is not live (freed already,
    /// or freed while shared and kept for its importers).
    fn live_at(&self, addr: u64) -> Result<(SlotId, BlockId, Caller)> {
        let Some(slot) = self.slots.iter().position(|s| s.heap.contains(addr)).map(SlotId::of) else {
            return Err(Error::invalid(format!("{addr:#x} was not allocated here")));
        };
        if self.sharing.freed_shared.contains_key(&addr) {
            return Err(freed_twice(addr));
        }
        let (i, allocated) = self.slots[slot].heap.live_block(addr).ok_or_else(|| freed_twice(addr))?;
        Ok((slot, i, allocated))
    }

    /// The stream a free through `raw`, another handle than its block was allocated with, is
    /// made on. During a capture the stream is named by the capture, as its allocations are. A
    /// handle the driver cannot place is taken as a stream of its own, never named again; what
    /// the driver said is recorded.
    fn freeing_stream(&mut self, raw: Handle) -> Caller {
        match self.backend.capture_of(raw) {
            Ok(Some(c)) => self.caller(raw, None, Capture::Private(c)),
            Ok(None) => {
                let id = self.backend.stream_id(raw);
                self.caller(raw, id, Capture::None)
            }
            Err(e) => {
                record_missed(e);
                self.caller(raw, None, Capture::None)
            }
        }
    }

    /// Takes the entry of the block at `addr` out of the front of the stream that allocated it,
    /// when another stream frees it. Each front's blocks are looked at and changed under one hold
    /// of its lock (a fast path may run meanwhile), one front at a time.
    fn take_from_allocating_front(
        &self,
        allocated: StreamId,
        freeing: StreamId,
        addr: u64,
    ) -> Result<Option<Entry>> {
        if freeing == allocated {
            return Ok(None);
        }
        let Some(st) = self.streams.get(&allocated) else { return Ok(None) };
        let mut g = st.front.lock();
        match g.blocks.get(&addr).copied() {
            Some(e) if e.cached => Err(freed_twice(addr)),
            Some(e) => {
                g.blocks.remove(&addr);
                Ok(Some(e))
            }
            None => Ok(None),
        }
    }

    /// Frees the block in the freeing stream's front: stamped with its next number, and cached
    /// there when it is that front's own (unshared) block, else freed in its heap. Returns what
    /// was freed, its stamp, and whether the stream should be asked to cover its frees for the
    /// others (another stream found memory short since it was last asked).
    fn free_in_front(&mut self, at: FreeAt) -> Result<(Freed, Epoch, bool)> {
        let FreeAt { addr, slot, block, shared, allocated, stream, moved, demand } = at;
        let own = self.streams.entry(stream).front.clone();
        let mut f = own.lock();
        let epoch = f.next;
        let same = stream.id == allocated.id;
        let entry = if same { f.blocks.get(&addr).copied() } else { moved };
        if same && entry.is_some_and(|e| e.cached) {
            return Err(freed_twice(addr));
        }
        f.last_free = epoch;
        let freed = match entry {
            // Its own front's block, freed there and counted there, as a fast free is.
            Some(e) if same && !shared && f.cache_free(addr).is_some() => {
                Freed { size: e.n, requested: e.requested, pool: 0 }
            }
            _ => {
                if same && entry.is_some() {
                    f.blocks.remove(&addr);
                }
                let freed = if shared {
                    self.slots[slot].heap.live_freed(block)
                } else {
                    self.slots[slot].heap.free_cached(block, stream.id, epoch)
                };
                self.count_free(Freed { requested: entry.map_or(freed.requested, |e| e.requested), ..freed })
            }
        };
        let ask = f.seen_demand < demand;
        if ask {
            f.seen_demand = demand;
        }
        Ok((freed, epoch, ask))
    }

    /// Makes the stream's frees idle at once if its work has run, else records an event after
    /// them. Best effort: without the event the blocks wait for a later one, or for a
    /// device-wide wait, so the free itself has succeeded either way; what the driver refused is
    /// recorded. Relaxed, as a capture elsewhere in global mode forbids the event.
    fn cover_frees(&mut self, stream: Caller) {
        let old = match self.backend.relax() {
            Ok(old) => old,
            Err(e) => return record_missed(e),
        };
        // A stream whose idleness cannot be asked may still take an event.
        let idle = self.caught_up(stream, false).unwrap_or_else(|e| {
            record_missed(e);
            false
        });
        if !idle {
            if let Err(e) = self.fence(stream) {
                record_missed(e);
            }
        }
        self.backend.restore(old);
    }

    /// Makes the free of the live block at `addr` in `slot` go through the core.
    pub(super) fn free_via_core(&mut self, slot: SlotId, addr: u64) {
        let Some((_, Caller { id, .. })) = self.slots[slot].heap.live_block(addr) else { return };
        if let Some(st) = self.streams.get(&id) {
            if let Some(e) = st.front.lock().blocks.get_mut(&addr) {
                e.via_core = true;
            }
        }
    }

    /// Whether the handle of `c` still names the stream `c.id` (it is not being captured, and the
    /// driver gives that id): the legacy default stream always; an identity the allocator made
    /// up, never.
    fn names(&mut self, c: Caller) -> bool {
        if c.id == LEGACY {
            return true;
        }
        published(c.id)
            && matches!(self.backend.capture_of(c.raw), Ok(None))
            && self.backend.stream_id(c.raw) == Some(c.id)
    }

    fn count_free(&mut self, freed: Freed) -> Freed {
        // Wrapping: a block a front handed out is counted there until the core takes the
        // fronts' counts in, so the core's own share may dip below zero meanwhile.
        self.stats.frees += 1;
        self.stats.live = self.stats.live.wrapping_sub(freed.size);
        self.stats.requested = self.stats.requested.wrapping_sub(freed.requested);
        freed
    }

    /// Moves every cached block, the fronts' and the heaps', into the shared index (idle when an
    /// event covering its free has completed), and takes in the fronts' counters.
    pub(crate) fn flush_cached(&mut self) {
        self.take_counts();
        self.flush_fronts(None, false);
    }

    /// [`flush_cached`](Self::flush_cached), except that with `Some(s)` the fronts of streams
    /// other than `s` give up only their idle blocks (which any stream may take): their blocks
    /// still waiting for their stream's work stay cached, for that stream's next request. With
    /// `keep_small`, `s`'s front keeps its blocks up to [`KEEP`] too. The fronts' counters are
    /// the caller's to take in (the blocks moved were counted when they were freed).
    fn flush_fronts(&mut self, only: Option<StreamId>, keep_small: bool) {
        let mut due = Vec::new();
        for (&t, st) in self.streams.iter() {
            let mut f = st.front.lock();
            let blocks = match only {
                Some(s) if s != t => f.drain_done(st.done),
                Some(_) if keep_small => f.drain_above(KEEP),
                _ => f.drain(),
            };
            due.extend(blocks.into_iter().map(|(addr, epoch, e)| {
                let owner = if st.done >= epoch { Owner::Idle } else { Owner::Stream { stream: t, epoch } };
                (addr, owner, e.slot)
            }));
        }
        for (addr, owner, slot) in due {
            let freed = self.slots[slot].heap.free(addr, owner);
            debug_assert!(freed.is_some(), "a block cached in a front is live in its heap");
        }
        let streams = &self.streams;
        let done = |s: StreamId, epoch: Epoch| streams.get(&s).is_some_and(|st| st.done >= epoch);
        for s in &mut self.slots {
            s.heap.flush_cached(done);
        }
    }

    /// Waits for queued work, then releases every idle page and every spare page. Returns the
    /// bytes given back. (The tests' path: the allocator waits without its lock, between
    /// [`settle_begin`](Self::settle_begin) and [`settled`](Self::settled), then calls
    /// [`release_idle`](Self::release_idle).)
    #[cfg(test)]
    pub(crate) fn empty_cache(&mut self) -> Result<u64> {
        self.flush_cached();
        self.settle_all()?;
        let r = self.release_idle();
        self.emptied();
        if self.check_calls {
            self.check();
        }
        r
    }

    /// Releases every idle page and every spare page. Returns the bytes given back.
    pub(crate) fn release_idle(&mut self) -> Result<u64> {
        let old = self.backend.relax()?;
        self.flush_cached();
        let r = self.reclaim(usize::MAX).and_then(|_| Ok(self.release_whole()? + self.release_small_idle()?));
        self.backend.restore(old);
        let other = r?;
        let n = self.held.spare.len() as u64;
        self.release_spare();
        Ok(n * self.sizes.page + other)
    }

    /// Unmaps and releases the pages of small heaps (of their own page size, not the ordinary
    /// one) lying wholly in idle free blocks; returns the bytes. Those pages are never moved
    /// between heaps: this is how they go back.
    fn release_small_idle(&mut self) -> Result<u64> {
        let mut bytes = 0;
        for slot in 0..self.slots.len() {
            let (small, page) = (self.slots[slot].kind.small(), self.slots[slot].page);
            if !small || page == self.sizes.page {
                continue;
            }
            for p in self.slots[slot].heap.idle_pages(page) {
                bytes += self.release_page(SlotId::of(slot), p)?;
            }
        }
        self.note_mapped();
        Ok(bytes)
    }

    /// Unmaps page `p` of `slot` and gives it back to the driver, if it is mapped; its bytes (0
    /// if it was not).
    pub(super) fn release_page(&mut self, slot: SlotId, p: u64) -> Result<u64> {
        if self.slots[slot].pages[p as usize].is_none() {
            return Ok(0);
        }
        let page = self.slots[slot].page;
        self.backend.unmap(self.slots[slot].heap.base() + p * page, page)?;
        drop(self.slots[slot].pages[p as usize].take());
        self.held.mapped -= page;
        self.stats.pages_released += 1;
        Ok(page)
    }

    /// Gives the memory held for captured graphs back to the shared pool; returns the free bytes
    /// that came back (live ones follow when freed).
    pub(crate) fn release_graph_memory(&mut self) -> u64 {
        self.flush_cached();
        self.pools.clear();
        self.slots.iter_mut().map(|s| s.heap.dissolve_pools()).sum()
    }
}

/// The allocator's state for one device: the core behind its lock, and the streams' fronts,
/// which serve a stream's cached requests and its frees through the allocating handle without
/// that lock (see [`super::front`]).
pub(crate) struct Ordered<B: Backend> {
    core: Mutex<Core<B>>,
    fronts: Arc<Fronts>,
}

impl<B: Backend> Ordered<B> {
    pub(crate) fn new(core: Core<B>) -> Ordered<B> {
        let fronts = core.streams.fronts.clone();
        Ordered { core: Mutex::new(core), fronts }
    }

    /// The core, locked. Lock order: the core, then a front.
    pub(crate) fn core(&self) -> MutexGuard<'_, Core<B>> {
        lock(&self.core)
    }

    pub(crate) fn core_mut(&mut self) -> &mut Core<B> {
        self.core.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// `size` bytes for work on the stream whose handle is `raw` and which the driver named `id`
    /// (`None`: it could not, or was not asked). Out of memory, the core's lock is let go while
    /// `wait` waits for the whole device (it says whether the wait succeeded), and the request
    /// asks once more.
    pub(crate) fn allocate(
        &self,
        size: u64,
        raw: Handle,
        id: Option<StreamId>,
        capture: Capture,
        tag: Option<Tag>,
        wait: impl FnOnce() -> bool,
    ) -> Result<u64> {
        if let Some(addr) = id.and_then(|id| take_fast(&self.fronts, id, size, capture, tag)) {
            return Ok(addr);
        }
        let mut core = self.core();
        let caller = core.caller(raw, id, capture);
        let r = core.try_allocate(size, caller, capture, tag, true);
        if r.is_err() && core.wants_settle() {
            // Out of memory: what was freed becomes idle once the device has run the work queued
            // before, waited for without the lock (a host function the device waits for may
            // take it).
            let settle = core.settle_begin();
            drop(core);
            let ok = wait();
            let mut core = self.core();
            let _ = core.settled(settle, ok);
            return core.try_allocate(size, caller, capture, tag, false);
        }
        r
    }

    /// Frees the block at `addr` on the stream whose handle is `raw`: through that stream's front
    /// when it is the front's block, else through the core.
    pub(crate) fn free(&self, addr: u64, raw: Handle) -> Result<()> {
        if self.fronts.give(addr, raw) {
            return Ok(());
        }
        self.core().free(addr, raw).map(|_| ())
    }
}

mod export;
#[cfg(test)]
mod invariants;
mod parts;
mod sleep;
mod snapshot;
mod streams;
mod whole;
pub use sleep::{SleepMode, TagStats};

#[cfg(test)]
mod tests;
