//! `VmmVec<T>`: a growable device vector that maps physical memory behind one reserved range
//! instead of reallocating and copying.

use crate::context::Context;
use crate::driver::{driver, result, sys::CUdeviceptr};
use crate::error::{Error, Refusal, Result};
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::stream::order::{Tracker, Turn, Use};
use crate::vmm::{
    bytes_for, Access, ChunkPolicy, HandleTypes, Location, Mapping, PhysicalBuilder, PhysicalMemory,
    Reservation,
};
use std::any::Any;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The capacity half of a [`VmmVec`]: a reservation and the chunks mapped at its start, in bytes.
/// Knows nothing of elements (like std's `RawVec`).
pub struct RawVmm {
    // Field order is drop order: chunks are unmapped before the reservation is freed.
    chunks: Vec<Mapping>,
    reservation: Reservation,
    phys: PhysicalBuilder,
    policy: ChunkPolicy,
    granularity: usize,
    mapped: usize,
    /// The next chunks (at most [`AHEAD_DEPTH`]), in address order from `mapped`, being created on
    /// another thread (see [`VmmVecBuilder::create_ahead`]).
    ahead: VecDeque<Ahead>,
    /// Growths that found a chunk made ahead not ready yet, and the longest such wait.
    ahead_waits: (usize, Duration),
    ahead_mode: AheadMode,
    /// Started with the first chunk made ahead.
    worker: Option<AheadWorker>,
    /// Bytes the last growth mapped: sets the size of the chunk made ahead.
    last_growth: usize,
    /// Whoever follows the growth from outside the vector (the processes of
    /// [`VmmVec::share_growth`]).
    followers: Option<Box<dyn Followers>>,
}

/// What follows a vector's mapped range from outside it. Told of each growth before it is
/// committed, so that a failure to tell fails the growth and leaves everything as it was; then
/// once it is; and of each shrink that unmaps chunks. The sharing layer keeps a vector's importers
/// behind it: the vector knows only that someone follows, and that while anyone does its range
/// cannot move.
pub(crate) trait Followers: Any + Send + Sync {
    /// Readies the news of `fresh` chunks, about to be mapped where the mapped part ends.
    fn prepare(&mut self, fresh: &[Mapping]) -> Result<()>;
    /// Tells what [`prepare`](Self::prepare) readied: the growth is committed.
    fn grew(&mut self);
    /// Tells that the chunks from `length` bytes on are unmapped.
    fn shrank(&mut self, length: usize);
    /// How many follow.
    fn count(&self) -> usize;
    /// Itself, for the layer that made it to find its own type again.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// Chunks made ahead at once: while the appends use one, the next are on their way, so that a
/// chunk whose creation takes longer than usual (the driver stalls now and then, for up to half a
/// millisecond) is not waited for. With 64 MiB appends that is 1 GiB, sixteen appends, ahead.
const AHEAD_DEPTH: usize = 4;

/// The smallest chunk made ahead (see [`RawVmm::start_ahead`]).
const AHEAD_FLOOR: usize = 256 << 20;

/// Mapped bytes from which a vector built with the default settings makes chunks ahead. Below it
/// its chunks are small, and a small chunk is made in tens of microseconds: a small vector keeps
/// neither a thread nor memory ahead.
const AHEAD_FROM: usize = 64 << 20;

/// When a vector makes its next chunks ahead, on a thread of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AheadMode {
    /// Never: each growth makes its chunks itself.
    Off,
    /// The default: from [`AHEAD_FROM`] bytes mapped, never more bytes ahead than are mapped.
    Bounded,
    /// From `build` on, [`AHEAD_DEPTH`] chunks whatever the vector's size.
    Eager,
}

/// How many of the last growth's increments the chunk made ahead covers. Making a chunk (create,
/// map, set access) takes time roughly in proportion to its size, as does filling it; keeping the
/// chunk made ahead a few appends long, rather than as long as the policy's chunks (up to 1 GiB),
/// lets the thread that makes it finish before the appends reach it, and keeps each of its driver
/// calls short while the appending thread launches work.
const AHEAD_GROWTHS: usize = 4;

/// The next chunk, created, mapped at `offset` (the end of what is mapped) and made accessible
/// off the growth path, so that the growth which needs it only takes it.
struct Ahead {
    offset: usize,
    size: usize,
    chunk: mpsc::Receiver<Result<Mapping>>,
}

impl Ahead {
    /// Waits for the chunk; `None` if making it failed. The second value is how long it waited,
    /// zero when the chunk was ready.
    fn finish(self) -> (Option<(usize, Mapping)>, Duration) {
        let (made, waited) = match self.chunk.try_recv() {
            Ok(made) => (Some(made), Duration::ZERO),
            Err(_) => {
                let t = Instant::now();
                (self.chunk.recv().ok(), t.elapsed())
            }
        };
        (made.and_then(Result::ok).map(|m| (self.offset, m)), waited)
    }
}

/// The size of the chunk to make ahead when the policy's next chunk is `next` bytes and the last
/// growth mapped `last_growth`. While the vector is small its next chunk would be needed right
/// after it is started, so it is never smaller than [`AHEAD_FLOOR`] (nor than the policy's
/// largest chunk, where that is smaller); past that, no larger than [`AHEAD_GROWTHS`] growths like
/// the last one.
fn ahead_size(next: usize, last_growth: usize, max_chunk: usize, granularity: usize) -> Result<usize> {
    let floor = max_chunk.min(AHEAD_FLOOR);
    let span = last_growth.saturating_mul(AHEAD_GROWTHS).max(floor);
    crate::vmm::round_up(next.min(span).max(floor), granularity)
}

/// Maps all of `phys` at `offset` of `res` and makes it accessible to the device `builder`
/// creates memory on: a chunk ready for the vector's elements.
fn map_chunk(
    builder: &PhysicalBuilder,
    res: &Reservation,
    offset: usize,
    phys: &PhysicalMemory,
) -> Result<Mapping> {
    let m = res.map(offset, phys, 0, phys.size())?;
    m.set_access(&[(builder.context().device(), Access::ReadWrite)])?;
    Ok(m)
}

/// One chunk to make ahead, and where to send it.
struct AheadJob {
    phys: PhysicalBuilder,
    reservation: Reservation,
    offset: usize,
    size: usize,
    done: mpsc::SyncSender<Result<Mapping>>,
    /// Set when the vector is dropped: a job not started yet makes nothing.
    cancelled: Arc<AtomicBool>,
}

impl AheadJob {
    fn run(self) {
        if self.cancelled.load(Ordering::Acquire) {
            return; // `done` dropped: the chunk was not made
        }
        let made = self
            .phys
            .create(self.size)
            .and_then(|c| map_chunk(&self.phys, &self.reservation, self.offset, &c));
        // A vector dropped meanwhile no longer wants it: the mapping is undone here.
        let _ = self.done.send(made);
    }
}

/// The thread that makes a vector's chunks ahead: one per vector for its life (a thread started
/// per chunk would cost its start on the growth path), ending when the vector drops its sender,
/// which then joins it.
struct AheadWorker {
    jobs: mpsc::Sender<AheadJob>,
    cancelled: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl AheadWorker {
    fn start() -> Option<AheadWorker> {
        let (jobs, rx) = mpsc::channel::<AheadJob>();
        let thread = std::thread::Builder::new()
            .name("cuvmm-grow-ahead".into())
            .spawn(move || {
                for job in rx {
                    job.run();
                }
            })
            .ok()?;
        Some(AheadWorker { jobs, cancelled: Arc::new(AtomicBool::new(false)), thread })
    }

    /// Skips the jobs not started, closes the queue, waits for the chunks still being made and
    /// lets go of every chunk made for `ahead`, then waits for the thread: no chunk of the vector
    /// is made, or kept, after this returns. The chunks are let go on the caller's thread, never
    /// on the worker's: unmapping one waits for the device, which must be deferred where the
    /// vector is dropped inside a host function, and only the caller's thread knows it is there.
    fn stop(self, ahead: &mut VecDeque<Ahead>) {
        self.cancelled.store(true, Ordering::Release);
        drop(self.jobs);
        for a in ahead.drain(..) {
            drop(a.finish());
        }
        let _ = self.thread.join();
    }
}

impl Drop for RawVmm {
    fn drop(&mut self) {
        if let Some(w) = self.worker.take() {
            w.stop(&mut self.ahead);
        }
    }
}

impl RawVmm {
    fn new(
        phys: PhysicalBuilder,
        policy: ChunkPolicy,
        reserve: usize,
        ahead_mode: AheadMode,
    ) -> Result<RawVmm> {
        let granularity = phys.granularity()?.minimum;
        // Validate the policy once, up front, rather than at the first growth.
        policy.plan(0, 1, granularity)?;
        let reservation = Reservation::new(phys.context(), reserve)?;
        let mut raw = RawVmm {
            chunks: Vec::new(),
            reservation,
            phys,
            policy,
            granularity,
            mapped: 0,
            ahead: VecDeque::new(),
            ahead_waits: (0, Duration::ZERO),
            ahead_mode,
            worker: None,
            last_growth: 0,
            followers: None,
        };
        if ahead_mode == AheadMode::Eager {
            // The first chunk is mapped while building (the first append would otherwise wait for
            // it), and the next one started.
            raw.start_ahead();
            raw.grow_to(1)?;
            // That first chunk is waited for by design: not a growth that outran the thread.
            raw.ahead_waits = (0, Duration::ZERO);
        }
        Ok(raw)
    }

    /// The chunks made ahead that lie from `mapped` on and start below `need`, waited for, in
    /// address order (whatever their sizes: the growth plans the rest around them). Any that
    /// failed, and all after it, are dropped here, unmapped, so that nothing else is mapped
    /// where they lie: call it before mapping anything past `mapped`.
    fn take_ahead(&mut self, need: usize) -> Vec<Mapping> {
        let mut ready = Vec::new();
        if self.ahead.front().is_some_and(|a| a.offset != self.mapped) {
            // Made for an end that a failed growth did not reach.
            self.drop_ahead();
        }
        let mut at = self.mapped;
        while at < need && self.ahead.front().is_some_and(|a| a.offset == at) {
            let (made, waited) = self.ahead.pop_front().expect("checked").finish();
            if !waited.is_zero() {
                self.ahead_waits.0 += 1;
                self.ahead_waits.1 = self.ahead_waits.1.max(waited);
            }
            match made {
                Some((_, m)) => {
                    at += m.len();
                    ready.push(m);
                }
                None => {
                    self.drop_ahead();
                    break;
                }
            }
        }
        ready
    }

    /// Waits for every chunk made ahead and lets it go.
    fn drop_ahead(&mut self) {
        for a in self.ahead.drain(..) {
            drop(a.finish());
        }
    }

    /// Starts making the chunks the next growths will map, as the vector's [`AheadMode`] says, up
    /// to [`AHEAD_DEPTH`] of them.
    fn start_ahead(&mut self) {
        let budget = match self.ahead_mode {
            AheadMode::Off => return,
            AheadMode::Bounded if self.mapped < AHEAD_FROM => return,
            AheadMode::Bounded => self.mapped,
            AheadMode::Eager => usize::MAX,
        };
        while self.ahead.len() < AHEAD_DEPTH {
            let queued = self.ahead_bytes();
            let offset = self.mapped + queued;
            let Ok(plan) = self.policy.plan(offset, offset + 1, self.granularity) else { return };
            let Some(&next) = plan.first() else { return };
            let Ok(size) = ahead_size(next, self.last_growth, self.policy.max_chunk, self.granularity) else {
                return;
            };
            let left = budget.saturating_sub(queued) / self.granularity * self.granularity;
            if left == 0 {
                return;
            }
            let size = size.min(left);
            if offset + size > self.reservation.size() {
                return; // the next growth relocates; nothing to gain
            }
            if self.worker.is_none() {
                self.worker = AheadWorker::start();
            }
            // Without a thread the next growth simply makes its chunk itself.
            let Some(worker) = &self.worker else { return };
            let (done, chunk) = mpsc::sync_channel(1);
            let job = AheadJob {
                phys: self.phys.clone(),
                reservation: self.reservation.clone(),
                offset,
                size,
                done,
                cancelled: worker.cancelled.clone(),
            };
            if worker.jobs.send(job).is_err() {
                return;
            }
            self.ahead.push_back(Ahead { offset, size, chunk });
        }
    }

    /// Bytes of the chunks being created (or created) ahead, not yet mapped.
    pub fn ahead_bytes(&self) -> usize {
        self.ahead.iter().map(|a| a.size).sum()
    }

    /// How many growths had to wait for a chunk made ahead, and the longest wait.
    pub fn ahead_waits(&self) -> (usize, Duration) {
        self.ahead_waits
    }

    /// Bytes mapped.
    pub fn mapped(&self) -> usize {
        self.mapped
    }

    /// Bytes of address space reserved.
    pub fn reserved(&self) -> usize {
        self.reservation.size()
    }

    /// Physical chunks mapped.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The mapped chunks, in address order.
    pub fn chunks(&self) -> &[Mapping] {
        &self.chunks
    }

    /// First address.
    pub fn base(&self) -> CUdeviceptr {
        self.reservation.base()
    }

    /// Maps chunks until at least `need` bytes are mapped. On any failure nothing changes: the
    /// chunks created so far are unmapped and released, and the old mapping is untouched. More
    /// than the device's memory (for device memory) is refused before anything is made.
    pub fn grow_to(&mut self, need: usize) -> Result<()> {
        // The policy's growth past what is needed stops at the end of the reservation: a growth
        // whose bytes fit stays in place.
        let room = self.reservation.size() - self.mapped;
        if need <= self.mapped {
            return Ok(());
        }
        if let crate::vmm::Location::Device(device) = self.phys.get_location() {
            // Refused before anything is planned, reserved or created for it.
            let memory = device.total_memory()?;
            if need > memory {
                return Err(Error::refused(
                    Refusal::LargerThanDevice,
                    format_args!(
                        "growing to {need} bytes needs more than the device's {memory} bytes of memory"
                    ),
                ));
            }
        }
        let mut plan = self.policy.plan_within(self.mapped, need, self.granularity, room)?;
        if plan.is_empty() {
            return Ok(());
        }
        let mut total = self.mapped + plan.iter().sum::<usize>();
        if total > self.reservation.size() {
            // What is needed does not fit: the policy's own growth, wherever it goes.
            plan = self.policy.plan(self.mapped, need, self.granularity)?;
            total = self.mapped + plan.iter().sum::<usize>();
        }
        if total > self.reservation.size() && self.importers() > 0 {
            // Importers map each chunk at its offset in a reservation of this one's size: a move
            // is something they could only follow by remapping everything.
            return Err(Error::refused(
                Refusal::WouldMove,
                format_args!(
                    "growing to {total} bytes needs more than the {}-byte reservation, and a vector \
                 with importers cannot move: reserve more address space before sharing it",
                    self.reservation.size()
                ),
            ));
        }
        // Before anything is mapped past `mapped`: the chunks made ahead lie there.
        let ready = self.take_ahead(need);
        if total > self.reservation.size() {
            drop(ready); // they lie in the reservation about to be replaced
            self.drop_ahead();
            return self.relocate_and_grow(total, &plan);
        }
        let taken: usize = ready.iter().map(Mapping::len).sum();
        let mut fresh = Vec::with_capacity(plan.len() + ready.len());
        let mut offset = self.mapped;
        // The chunks made ahead come first, whatever their sizes; the policy plans what they
        // leave, only if that fits the reservation; else they go and the plan (which fits) is
        // followed as if nothing had been made ahead.
        let room = self.reservation.size() - (self.mapped + taken).min(self.reservation.size());
        let rest = match self.policy.plan_within(self.mapped + taken, need, self.granularity, room) {
            Ok(rest) if self.mapped + taken + rest.iter().sum::<usize>() <= self.reservation.size() => {
                offset += taken;
                fresh.extend(ready);
                rest
            }
            _ => {
                drop(ready);
                plan
            }
        };
        if !rest.is_empty() {
            // What is still being made ahead lies where `rest` goes.
            self.drop_ahead();
        }
        for size in rest {
            let phys = self.phys.create(size)?;
            fresh.push(map_chunk(&self.phys, &self.reservation, offset, &phys)?);
            offset += size;
        }
        // Told before the growth is committed, so that a failure leaves everything as it was.
        if let Some(f) = &mut self.followers {
            f.prepare(&fresh)?;
        }
        self.chunks.extend(fresh);
        self.last_growth = need - self.mapped;
        self.mapped = offset;
        if let Some(f) = &mut self.followers {
            f.grew();
        }
        self.start_ahead();
        Ok(())
    }

    /// The reservation is too small: reserve a larger range, map the existing chunks there too
    /// (no data moves: the same physical memory appears at the new addresses), add the new chunks,
    /// then drop the old mappings and range. The base address changes.
    fn relocate_and_grow(&mut self, total: usize, plan: &[usize]) -> Result<()> {
        let size = total.max(self.reservation.size().saturating_mul(2));
        let res = Reservation::new(self.phys.context(), size)?;
        let mut chunks = Vec::with_capacity(self.chunks.len() + plan.len());
        for old in &self.chunks {
            chunks.push(map_chunk(&self.phys, &res, old.offset(), old.physical())?);
        }
        let mut offset = self.mapped;
        for &size in plan {
            let phys = self.phys.create(size)?;
            chunks.push(map_chunk(&self.phys, &res, offset, &phys)?);
            offset += size;
        }
        self.chunks = chunks;
        self.reservation = res;
        self.last_growth = total - self.mapped;
        self.mapped = offset;
        self.start_ahead();
        Ok(())
    }

    /// Unmaps and releases every chunk that lies wholly past `keep` bytes, and the chunks made
    /// ahead (the next growth starts making them again).
    pub fn shrink_to(&mut self, keep: usize) {
        // Waited for and let go whether or not a chunk goes: a shrink gives back what holds no
        // element, and chunks made for an old end would not fit the next growth.
        self.drop_ahead();
        let before = self.mapped;
        while let Some(last) = self.chunks.last() {
            if last.offset() < keep {
                break;
            }
            self.mapped = last.offset();
            self.chunks.pop();
        }
        if let Some(f) = self.followers.as_mut().filter(|_| self.mapped != before) {
            f.shrank(self.mapped);
        }
    }

    /// The followers of type `F`, made by `make` (from the chunks' builder and granularity) where
    /// the range has none yet, with the chunks mapped and the bytes reserved. A failure to make
    /// them changes nothing.
    pub(crate) fn follow<F: Followers>(
        &mut self,
        make: impl FnOnce(&PhysicalBuilder, usize) -> Result<F>,
    ) -> Result<(&mut F, &[Mapping], usize)> {
        if self.followers.is_none() {
            self.followers = Some(Box::new(make(&self.phys, self.granularity)?));
        }
        let RawVmm { followers, chunks, reservation, .. } = self;
        let followers =
            followers.as_mut().and_then(|f| f.as_any_mut().downcast_mut::<F>()).ok_or_else(|| {
                Error::invalid("the vector is followed already, through something other than this")
            })?;
        Ok((followers, chunks, reservation.size()))
    }

    /// The followers, where they are of type `F`.
    pub(crate) fn followers_as<F: Followers>(&mut self) -> Option<&mut F> {
        self.followers.as_mut()?.as_any_mut().downcast_mut::<F>()
    }

    /// Processes following this range's growth (see [`VmmVec::share_growth`]).
    pub fn importers(&self) -> usize {
        self.followers.as_ref().map_or(0, |f| f.count())
    }
}

/// A growable vector of `T` in device memory.
///
/// One large address range is reserved up front (by default as large as the device's memory, so
/// the base address never changes for any growth the device can back); growing maps more physical
/// chunks at its end. Nothing is ever copied, and [`shrink_to_fit`](Self::shrink_to_fit) returns
/// whole unused chunks to the driver. A growth that fails (out of memory, or any driver error)
/// returns the error and leaves length, contents and mapping as they were.
///
/// Growing past the reservation reserves a range twice as large and maps the same physical chunks
/// there: still no copy, but the base address changes. The chunk sizes follow a [`ChunkPolicy`].
/// Once the vector has 64 MiB mapped, a thread of its own makes the next chunks ahead, so that
/// appends do not wait for the driver to create memory (at most as many bytes ahead as are mapped,
/// and at most four chunks; see [`VmmVecBuilder::create_ahead`]).
///
/// ```no_run
/// # fn main() -> cuvmm::Result<()> {
/// let ctx = cuvmm::Context::for_ordinal(0)?;
/// let mut v = cuvmm::VmmVec::<f32>::new(&ctx)?;
/// let base = v.device_ptr();
/// v.extend_from_slice(&[1.0, 2.0, 3.0])?;
/// v.resize(1 << 20, 0.5)?;
/// assert_eq!(v.device_ptr(), base);
/// assert_eq!(v.to_vec()?[..3], [1.0, 2.0, 3.0]);
/// v.truncate(3);
/// v.shrink_to_fit()?;
/// println!("{} elements, {} bytes mapped", v.len(), v.mapped_bytes());
/// # Ok(()) }
/// ```
pub struct VmmVec<T: DeviceCopy> {
    /// The first element's address, `raw.base()` kept at hand.
    base: CUdeviceptr,
    raw: RawVmm,
    len: usize,
    /// Streams that used the elements (see [`crate::stream::order`]).
    order: Tracker,
    _t: PhantomData<T>,
}

/// Configures a [`VmmVec`].
pub struct VmmVecBuilder<T: DeviceCopy> {
    phys: PhysicalBuilder,
    policy: ChunkPolicy,
    reserve: Option<usize>,
    ahead_mode: AheadMode,
    _t: PhantomData<T>,
}

impl<T: DeviceCopy> VmmVecBuilder<T> {
    /// How the next chunks are made ahead, on a thread of the vector's own (created, mapped past
    /// the end and made accessible), so that the growth that needs one only takes it: no
    /// `cuMemCreate`, `cuMemMap` or `cuMemSetAccess` on the growth's path unless the growth
    /// outruns the thread. Up to four chunks are made ahead; each spans four growths like the
    /// last one, at least 256 MiB (or the policy's largest chunk if smaller) and at most the
    /// policy's next chunk. [`RawVmm::ahead_bytes`] says how much memory they hold beyond the
    /// capacity, [`RawVmm::ahead_waits`] how often a growth outran the thread, and
    /// [`VmmVec::shrink_to_fit`] lets them go.
    ///
    /// By default (neither `true` nor `false` asked), a vector makes chunks ahead once it has 64 MiB
    /// mapped, never more bytes ahead than it has mapped: an appending program's growths make no
    /// chunk themselves past the first few, while a small vector keeps no thread and no memory
    /// ahead. `true` makes chunks ahead whatever the size, and `build` maps the first chunk at
    /// once; `false` never makes them, and every growth creates and maps its own chunks (a
    /// `cuMemCreate` of a large chunk has taken tens of milliseconds).
    pub fn create_ahead(mut self, on: bool) -> Self {
        self.ahead_mode = if on { AheadMode::Eager } else { AheadMode::Off };
        self
    }

    /// The chunk sizes to map.
    pub fn chunk_policy(mut self, policy: ChunkPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Bytes of address space to reserve (rounded up to the granularity).
    pub fn reserve_address_space(mut self, bytes: usize) -> Self {
        self.reserve = Some(bytes);
        self
    }

    /// Where the chunks live (the context's device by default).
    pub fn location(mut self, location: Location) -> Self {
        self.phys = self.phys.location(location);
        self
    }

    /// Handle types the chunks are created with, to export them.
    pub fn handle_types(mut self, handles: HandleTypes) -> Self {
        self.phys = self.phys.handle_types(handles);
        self
    }

    /// Creates the (empty) vector: reserves the address range, maps nothing.
    pub fn build(self) -> Result<VmmVec<T>> {
        if std::mem::size_of::<T>() == 0 {
            return Err(Error::invalid("VmmVec does not hold zero-sized types"));
        }
        let reserve = match self.reserve {
            Some(r) => r,
            None => self.phys.context().device().total_memory()?,
        };
        let raw = RawVmm::new(self.phys, self.policy, reserve, self.ahead_mode)?;
        Ok(VmmVec { base: raw.base(), raw, len: 0, order: Tracker::new(), _t: PhantomData })
    }
}

#[cfg(feature = "cudarc")]
impl<T: DeviceCopy> VmmVec<T> {
    /// The field holding the first element's address, for cudarc's launch builder (see
    /// `crate::cudarc`).
    pub(crate) fn addr_ref(&self) -> &CUdeviceptr {
        &self.base
    }
}

impl<T: DeviceCopy> VmmVec<T> {
    /// A builder with the default chunk policy, on `ctx`'s device.
    pub fn builder(ctx: &Context) -> VmmVecBuilder<T> {
        VmmVecBuilder {
            phys: PhysicalMemory::builder(ctx),
            policy: ChunkPolicy::default(),
            reserve: None,
            ahead_mode: AheadMode::Bounded,
            _t: PhantomData,
        }
    }

    /// An empty vector.
    pub fn new(ctx: &Context) -> Result<Self> {
        VmmVec::builder(ctx).build()
    }

    /// An empty vector with room for at least `capacity` elements mapped.
    pub fn with_capacity(ctx: &Context, capacity: usize) -> Result<Self> {
        let mut v = VmmVec::new(ctx)?;
        v.reserve(capacity)?;
        Ok(v)
    }

    fn elem() -> usize {
        std::mem::size_of::<T>()
    }

    fn ctx(&self) -> &Context {
        self.raw.phys.context()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements that fit in the mapped chunks.
    pub fn capacity(&self) -> usize {
        self.raw.mapped() / Self::elem()
    }

    /// Bytes of physical memory mapped.
    pub fn mapped_bytes(&self) -> usize {
        self.raw.mapped()
    }

    /// The capacity half: reservation size, chunk count.
    pub fn raw(&self) -> &RawVmm {
        &self.raw
    }

    /// The capacity half, to be followed from another layer (see [`RawVmm::follow`]).
    pub(crate) fn raw_mut(&mut self) -> &mut RawVmm {
        &mut self.raw
    }

    /// The first element's address. Stable while growth fits the reservation.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.raw.base()
    }

    fn addr(&self, index: usize) -> CUdeviceptr {
        self.raw.base() + (index * Self::elem()) as u64
    }

    /// Makes room for at least `additional` more elements.
    pub fn reserve(&mut self, additional: usize) -> Result<()> {
        let want = self
            .len
            .checked_add(additional)
            .ok_or_else(|| Error::invalid(format!("{} + {additional} elements overflow usize", self.len)))?;
        let base = self.raw.base();
        self.raw.grow_to(bytes_for(want, Self::elem())?)?;
        if self.raw.base() != base {
            self.base = self.raw.base();
            // The old mappings were dropped, which waited for all work on them: the record
            // speaks of addresses that no longer exist.
            self.order.clear();
        }
        Ok(())
    }

    /// Waits on the host for other streams' conflicting work on elements `[start, start+count)`
    /// (mapped memory past `len` included), before a synchronous access.
    pub(crate) fn host(&self, start: usize, count: usize, access: Use) -> Result<Turn<'_>> {
        let (a, b) = (self.addr(start), self.addr(start + count));
        self.order.host_access(a, b, access)
    }

    /// Appends one element.
    pub fn push(&mut self, value: T) -> Result<()> {
        self.extend_from_slice(std::slice::from_ref(&value))
    }

    /// Appends host data.
    pub fn extend_from_slice(&mut self, data: &[T]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.reserve(data.len())?;
        {
            let _turn = self.host(self.len, data.len(), Use::Write)?;
            crate::stream::copy::htod(self.ctx(), self.addr(self.len), data, data.len())?;
        }
        self.len += data.len();
        Ok(())
    }

    /// Grows with copies of `value` or shortens to `new_len`.
    pub fn resize(&mut self, new_len: usize, value: T) -> Result<()> {
        if new_len <= self.len {
            self.truncate(new_len);
            return Ok(());
        }
        self.reserve(new_len - self.len)?;
        self.fill(self.len, new_len - self.len, value)?;
        self.len = new_len;
        Ok(())
    }

    /// Writes `count` copies of `value` from element `start` (mapped memory past `len` included).
    fn fill(&self, start: usize, count: usize, value: T) -> Result<()> {
        let _turn = self.host(start, count, Use::Write)?;
        let api = driver()?.api();
        self.ctx().bind()?;
        let dst = self.addr(start);
        let bytes = count * Self::elem();
        // SAFETY: `value` is plain data; reading its bytes is reading initialised memory.
        let raw: &[u8] = unsafe { std::slice::from_raw_parts((&value as *const T).cast(), Self::elem()) };
        if raw.iter().all(|&b| b == raw[0]) {
            // SAFETY: [dst, dst + bytes) is mapped (reserve succeeded); the stream is the legacy one.
            unsafe { result::mem::memset_d8_async(api, dst, raw[0], bytes, std::ptr::null_mut()) }?;
        } else if Self::elem() == 4 {
            let word = u32::from_ne_bytes([raw[0], raw[1], raw[2], raw[3]]);
            // SAFETY: as above; `count` 32-bit words.
            unsafe { result::mem::memset_d32_async(api, dst, word, count, std::ptr::null_mut()) }?;
        } else {
            // Any other size: repeat a host block of copies of `value`.
            let block = vec![value; count.min((4 << 20) / Self::elem()).max(1)];
            let mut done = 0;
            while done < count {
                let n = block.len().min(count - done);
                crate::stream::copy::htod(self.ctx(), self.addr(start + done), &block[..n], n)?;
                done += n;
            }
        }
        // SAFETY: waits for the legacy stream, where the memsets were queued.
        unsafe { result::stream::synchronize(api, std::ptr::null_mut()) }
    }

    /// Shortens to `len` elements; mapped memory is kept (see [`shrink_to_fit`](Self::shrink_to_fit)).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Removes every element; mapped memory is kept.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Unmaps and releases every whole chunk past the last element, and the chunks made ahead.
    /// Importers (see [`share_growth`](Self::share_growth)) are told, and unmap them too.
    pub fn shrink_to_fit(&mut self) -> Result<()> {
        self.raw.shrink_to(bytes_for(self.len, Self::elem())?);
        Ok(())
    }

    /// A read-only view of the elements, for kernels and copies.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        // SAFETY: the first `len` elements are mapped and readable by the owning device while the
        // borrow of self lasts.
        unsafe { DeviceSlice::tracked(self.raw.base(), self.len, &self.order) }
    }

    /// A writable view of the elements.
    pub fn as_mut_slice(&mut self) -> DeviceSliceMut<'_, T> {
        // SAFETY: as above; `&mut self` makes it the only writable view.
        unsafe { DeviceSliceMut::tracked(self.raw.base(), self.len, &self.order) }
    }

    /// Copies `range` of the elements into `out` (lengths must match).
    pub fn copy_range_to_host(&self, range: Range<usize>, out: &mut [T]) -> Result<()> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::invalid(format!("range {range:?} is out of bounds for length {}", self.len)));
        }
        // `dtoh` checks `out` against the range; the host wait before it records nothing.
        let _turn = self.host(range.start, range.len(), Use::Read)?;
        crate::stream::copy::dtoh(self.ctx(), out, self.addr(range.start), range.len())
    }

    /// Copies every element into a new host vector.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let _turn = self.host(0, self.len, Use::Read)?;
        crate::stream::copy::dtoh_vec(self.ctx(), self.raw.base(), self.len)
    }

    /// Copies one element out; `None` past the end.
    pub fn get(&self, index: usize) -> Result<Option<T>> {
        if index >= self.len {
            return Ok(None);
        }
        let _turn = self.host(index, 1, Use::Read)?;
        Ok(Some(crate::stream::copy::dtoh_vec(self.ctx(), self.addr(index), 1)?[0]))
    }
}

impl<T: DeviceCopy> std::fmt::Debug for VmmVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmVec")
            .field("ptr", &format_args!("{:#x}", self.raw.base()))
            .field("len", &self.len)
            .field("mapped_bytes", &self.raw.mapped())
            .field("reserved_bytes", &self.raw.reserved())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const GIB: usize = 1 << 30;

    #[test]
    fn the_chunk_made_ahead_spans_a_few_appends_not_a_policy_chunk() {
        // 64 MiB appends into a vector whose policy has reached 1 GiB chunks.
        assert_eq!(ahead_size(GIB, 64 * MIB, GIB, 2 * MIB).unwrap(), 256 * MIB);
        // Appends of 512 MiB: two of them, still within the policy's chunk.
        assert_eq!(ahead_size(GIB, 512 * MIB, GIB, 2 * MIB).unwrap(), GIB);
        // Small appends, a small vector: the floor.
        assert_eq!(ahead_size(2 * MIB, 4096, GIB, 2 * MIB).unwrap(), 256 * MIB);
        // A policy whose chunks are all smaller than the floor caps it.
        assert_eq!(ahead_size(8 * MIB, 64 * MIB, 64 * MIB, 2 * MIB).unwrap(), 64 * MIB);
        // Rounded to the granularity.
        assert_eq!(ahead_size(GIB, 100 * MIB + 1, GIB, 2 * MIB).unwrap(), 402 * MIB);
    }
}
