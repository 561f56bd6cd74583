//! Pageable host memory moved through a ring of pinned staging buffers, the host-side copies done
//! by several threads while the DMA engine moves earlier chunks: much faster than the driver's own
//! pageable path, which stages through one small buffer on one thread.
//!
//! A transfer is cut into chunks, one DMA each, through `slots` pinned buffers of `chunk` bytes;
//! each chunk is cut into pieces of `piece` bytes, which the threads copy in order. So the threads
//! work on one or two chunks at a time and chunks mostly complete in order: the first DMA starts
//! once one chunk is filled, not once every thread has filled a whole chunk of its own, and the
//! last DMA moves one chunk, not one per thread. The threads are started with the ring and kept:
//! a transfer starts none.
//!
//! A thread descheduled in the middle of a piece (a busy host) holds back only its own chunk,
//! while the other threads and the DMA engine go on: to the device, a chunk's DMA is queued as
//! soon as the chunk is filled, whatever the order, and a slot goes to the next chunk as soon as
//! the DMA through it completes; to the host, each chunk's DMA goes into any slot already drained.
//! With slots used in turn, one late piece stopped the DMA engine until it was copied.

use super::stream_copy::copy_streaming;
use crate::context::Context;
use crate::driver::{driver, result};
use crate::error::{Error, Result};
use crate::host::PinnedBuffer;
use crate::memory::{DeviceCopy, DeviceSlice, DeviceSliceMut};
use crate::stream::Event;
use crate::stream::Stream;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The shape of a staging ring: see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes per chunk: per DMA, and per pinned slot.
    pub chunk: usize,
    /// Bytes per piece, the unit one thread copies (at most `chunk`; a chunk holds whole pieces
    /// and a shorter last one).
    pub piece: usize,
    /// Pinned slots in the ring (at least 2): chunks in flight between the threads and the DMA.
    pub slots: usize,
    /// Host threads copying.
    pub threads: usize,
}

impl Default for StagingConfig {
    /// 4 MiB chunks in 256 KiB pieces, 8 slots (32 MiB pinned), three quarters of the cores
    /// copying (at most 12 threads): the fastest shape of the sweeps in docs/PERFORMANCE.md
    /// ("Figures behind the defaults"). Small pieces shorten the end of a transfer (the threads
    /// finish within a small piece of one another, and the last DMA follows sooner); smaller
    /// rings starve the threads.
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        StagingConfig { chunk: 4 << 20, piece: 256 << 10, slots: 8, threads: default_threads(cores) }
    }
}

/// Copying threads for a host with `cores` cores: three quarters of them (the rest left to the
/// thread that issues the DMAs and to the program), at most 12: more threads were no faster
/// (docs/PERFORMANCE.md, "Figures behind the defaults").
fn default_threads(cores: usize) -> usize {
    (cores - cores / 4).clamp(1, 12)
}

/// When host-to-device chunks go through a kernel as well as the copy engines:
/// [`Staging::set_kernel_lane`].
///
/// For some tens of milliseconds after a program frees much device memory, the driver's own work
/// runs on the copy engines and they move host-to-device copies at about half their rate; a
/// kernel's reads of pinned memory are slowed far less, but otherwise move 5-10% less than the
/// copy engines (docs/PERFORMANCE.md, "Sleep and wake"). So the ring sends a chunk through the
/// kernel only while the copy engines are slow and behind.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KernelLane {
    /// The copy engines hold at least this many more chunks in flight than the kernel (at
    /// least 1).
    pub bias: usize,
    /// The copy engines' last chunk took more than this many times, per byte, the fastest chunk
    /// the ring has moved either way (0: whatever they took).
    pub slowdown: f32,
}

impl Default for KernelLane {
    /// Two chunks behind, 1.3 times the fastest: the copy engines at half their rate are well
    /// past it, their ordinary spread well under it.
    fn default() -> Self {
        KernelLane { bias: 2, slowdown: 1.3 }
    }
}

/// The kernel lane of a ring: see [`KernelLane`].
struct Lane {
    kernels: crate::kernels::Kernels,
    stream: Stream,
    config: KernelLane,
    /// Recorded on the caller's stream at a transfer's start, waited for here; and back.
    start: Event,
    end: Event,
}

/// A reusable ring of pinned slots and the threads that fill or drain them.
pub struct Staging {
    /// First, so that its threads (idle between transfers) stop before the slots are freed.
    pool: Pool,
    slots: Vec<PinnedBuffer<u8>>,
    events: Vec<Event>,
    config: StagingConfig,
    /// Threads that drain a device-to-host transfer (at most `config.threads`).
    to_host_threads: usize,
    /// The multiprocessors' way to the device, when on: [`Staging::set_kernel_lane`].
    kernel_lane: Option<Lane>,
    /// How long the copy engines' DMAs take.
    clock: DmaClock,
    /// Chunks sent through it so far.
    kernel_chunks: u64,
    /// Whether transfers record a [`StagingTrace`].
    tracing: bool,
    last_trace: Option<StagingTrace>,
}

/// When each chunk of a staged transfer reached each step, counted from the call: what
/// [`Staging::last_trace`] gives after a transfer made with tracing on
/// ([`Staging::set_tracing`]). A step a chunk never reached (the transfer failed) is `None`.
///
/// Meant to find where a slow transfer lost its time: a chunk filled or drained long after the
/// others is a copying thread that stopped in the middle of a piece (descheduled, on a busy host);
/// a late first piece is a slow start of the threads; DMAs queued back to back but landing slowly
/// are the bus.
///
/// ```no_run
/// # fn main() -> cuvmm::Result<()> {
/// use cuvmm::host::Staging;
/// use cuvmm::{Context, DeviceBuffer, Stream};
/// let ctx = Context::for_ordinal(0)?;
/// let stream = Stream::non_blocking(&ctx)?;
/// let data = vec![7u8; 64 << 20];
/// let mut dev = DeviceBuffer::<u8>::new(&ctx, data.len())?;
/// let mut staging = Staging::with_defaults(&ctx)?;
/// staging.set_tracing(true);
/// staging.to_device(&stream, &data, dev.as_mut_slice())?;
/// if let Some(trace) = staging.last_trace() {
///     let late = trace.chunks.iter().filter_map(|c| c.filled).max();
///     println!("{:?} in all, last chunk filled at {late:?}", trace.total);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagingTrace {
    /// Host to device, else device to host.
    pub to_device: bool,
    /// Bytes moved.
    pub bytes: usize,
    /// When a thread took the first piece.
    pub first_piece: Option<Duration>,
    /// The whole call, up to the data having arrived.
    pub total: Duration,
    /// Per chunk, in address order.
    pub chunks: Vec<ChunkTrace>,
}

/// One chunk of a [`StagingTrace`]: one DMA, through one pinned slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChunkTrace {
    /// Its offset in the transfer, bytes.
    pub offset: usize,
    /// Its length, bytes.
    pub len: usize,
    /// To the device: its last piece copied into its slot.
    pub filled: Option<Duration>,
    /// Its DMA queued.
    pub queued: Option<Duration>,
    /// To the host: a thread saw its DMA complete.
    pub landed: Option<Duration>,
    /// To the host: its last piece copied out of its slot.
    pub drained: Option<Duration>,
}

/// The steps of a chunk a transfer marks when traced, indices into [`Marks::at`].
#[derive(Clone, Copy)]
enum Step {
    Filled = 0,
    Queued = 1,
    Landed = 2,
    Drained = 3,
}

/// A traced transfer's steps as they happen, nanoseconds from its start plus one (0: not
/// reached). Empty, and every mark a no-op, when the transfer is not traced.
struct Marks {
    t0: Instant,
    first_piece: AtomicU64,
    at: Vec<[AtomicU64; 4]>,
}

impl Marks {
    fn new(traced: bool, chunks: usize) -> Marks {
        let at = if traced { (0..chunks).map(|_| Default::default()).collect() } else { Vec::new() };
        Marks { t0: Instant::now(), first_piece: AtomicU64::new(0), at }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1
    }

    fn mark(&self, j: usize, step: Step) {
        if let Some(at) = self.at.get(j) {
            at[step as usize].store(self.now(), Ordering::Relaxed);
        }
    }

    fn piece_taken(&self) {
        if !self.at.is_empty() && self.first_piece.load(Ordering::Relaxed) == 0 {
            let _ = self.first_piece.compare_exchange(0, self.now(), Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The trace, once every thread is done with the transfer; `None` when not traced.
    fn finish(&self, plan: &Plan, to_device: bool) -> Option<StagingTrace> {
        if self.at.is_empty() {
            return None;
        }
        let when = |v: &AtomicU64| match v.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns - 1)),
        };
        let chunks = self
            .at
            .iter()
            .enumerate()
            .map(|(j, at)| ChunkTrace {
                offset: j * plan.chunk,
                len: plan.chunk_len(j),
                filled: when(&at[Step::Filled as usize]),
                queued: when(&at[Step::Queued as usize]),
                landed: when(&at[Step::Landed as usize]),
                drained: when(&at[Step::Drained as usize]),
            })
            .collect();
        Some(StagingTrace {
            to_device,
            bytes: plan.bytes,
            first_piece: when(&self.first_piece),
            total: self.t0.elapsed(),
            chunks,
        })
    }
}

/// How a transfer of `bytes` is cut: chunks of `chunk` bytes (the last one shorter), each in
/// pieces of `piece` bytes (the last one of a chunk shorter), numbered in address order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    bytes: usize,
    chunk: usize,
    piece: usize,
    /// Pieces in a full chunk.
    per_chunk: usize,
    /// Chunks.
    chunks: usize,
    /// Pieces in all.
    pieces: usize,
}

impl Plan {
    /// `bytes`, `chunk` and `piece` must be non-zero, `piece <= chunk`.
    fn new(bytes: usize, chunk: usize, piece: usize) -> Plan {
        let per_chunk = chunk.div_ceil(piece);
        let chunks = bytes.div_ceil(chunk);
        let last = (bytes - (chunks - 1) * chunk).div_ceil(piece);
        Plan { bytes, chunk, piece, per_chunk, chunks, pieces: (chunks - 1) * per_chunk + last }
    }

    fn chunk_len(&self, j: usize) -> usize {
        self.chunk.min(self.bytes - j * self.chunk)
    }

    fn pieces_in(&self, j: usize) -> usize {
        self.chunk_len(j).div_ceil(self.piece)
    }

    /// Piece `p`: its chunk, its offset in the chunk, its length.
    fn piece(&self, p: usize) -> (usize, usize, usize) {
        let (j, q) = (p / self.per_chunk, p % self.per_chunk);
        let at = q * self.piece;
        (j, at, self.piece.min(self.chunk_len(j) - at))
    }

    /// Whether the bytes at `offset` of the transfer are copied into the ring with non-temporal
    /// stores: those of the last [`STREAMED_TAIL`] bytes.
    fn streamed(&self, offset: usize) -> bool {
        offset >= self.bytes.saturating_sub(STREAMED_TAIL)
    }
}

/// Host to device, the last bytes of a transfer go into the ring with non-temporal stores.
///
/// The DMA engine reads a slot shortly after the threads filled it. While they go on copying,
/// the lines they wrote earlier leave their cores' private caches for the shared cache, from
/// which the DMA reads them quickly; the lines of the last chunks stay in the private caches,
/// where every DMA read is a snoop into a core (an idle one at that, once the threads are done),
/// and those DMAs are slow. Sixteen MiB is about what the copying threads' cores hold in their
/// private caches; streaming every byte makes the DMA read all of them from memory, which is
/// slower (see `stream_copy`). docs/PERFORMANCE.md ("Figures behind the defaults") has the
/// measurements.
const STREAMED_TAIL: usize = 16 << 20;

/// The progress of one transfer, shared by the issuing thread and the copying threads. Waits
/// spin, then yield, rather than sleep at once: a transfer's waits last microseconds, and waking a
/// sleeping thread takes longer than that (docs/PERFORMANCE.md, "Figures behind the defaults").
struct Shared {
    /// The next piece to claim.
    next: AtomicUsize,
    /// For each slot: no chunk holds it (to host). Set by the thread that drained the slot's
    /// last chunk, taken by the issuing thread.
    slot_free: Vec<AtomicBool>,
    /// For each chunk, the slot it goes through, [`NO_SLOT`] until it has one.
    slot_of: Vec<AtomicUsize>,
    /// Per chunk: pieces filled (to device) or drained (to host).
    done: Vec<AtomicUsize>,
    /// Per chunk (to host): its DMA is queued and its slot's event recorded after it.
    issued: Vec<AtomicBool>,
    /// Per chunk (to host): a thread has seen its DMA complete, so the others need not ask.
    landed: Vec<AtomicBool>,
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
}

/// In [`Shared::slot_of`]: the chunk has no slot yet.
const NO_SLOT: usize = usize::MAX;

/// Spins this many times before yielding in a wait.
const SPINS: u32 = 256;
/// Yields this long before sleeping in a wait.
const YIELD_FOR: Duration = Duration::from_millis(1);

impl Shared {
    /// `slot_of` gives each chunk's slot, if it has one from the start (to device).
    fn new(slots: usize, chunks: usize, slot_of: impl Fn(usize) -> Option<usize>) -> Shared {
        Shared {
            next: AtomicUsize::new(0),
            slot_free: (0..slots).map(|_| AtomicBool::new(true)).collect(),
            slot_of: (0..chunks).map(|j| AtomicUsize::new(slot_of(j).unwrap_or(NO_SLOT))).collect(),
            done: (0..chunks).map(|_| AtomicUsize::new(0)).collect(),
            issued: (0..chunks).map(|_| AtomicBool::new(false)).collect(),
            landed: (0..chunks).map(|_| AtomicBool::new(false)).collect(),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
        }
    }

    /// Waits until `cond` holds (`Ok`) or someone failed (`Err`). `cond` reads with `Acquire`
    /// what it needs to see published.
    ///
    /// Spins, then yields; a wait longer than [`YIELD_FOR`] (the stream is busy with other work
    /// before the transfer) sleeps between checks instead, so that idle threads do not hold cores.
    fn wait_until(&self, mut cond: impl FnMut() -> bool) -> std::result::Result<(), ()> {
        let mut spins = 0;
        let mut since = None;
        loop {
            if self.failed.load(Ordering::Acquire) {
                return Err(());
            }
            if cond() {
                return Ok(());
            }
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else if since.get_or_insert_with(Instant::now).elapsed() < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// The next piece to work on, or `None` when all are taken or someone failed.
    fn claim(&self, pieces: usize) -> Option<usize> {
        if self.failed.load(Ordering::Acquire) {
            return None;
        }
        let p = self.next.fetch_add(1, Ordering::Relaxed);
        (p < pieces).then_some(p)
    }

    /// Counts one more piece of chunk `j` done (after its bytes were copied); true for the
    /// chunk's last. Each piece's copy happens before whoever acquires the count seeing it full.
    fn piece_done(&self, j: usize, pieces: usize) -> bool {
        self.done[j].fetch_add(1, Ordering::AcqRel) + 1 == pieces
    }

    /// The first failure, else the final synchronisation's result.
    fn outcome(&self, synced: Result<()>) -> Result<()> {
        match self.error.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => Err(e),
            None => synced,
        }
    }

    fn fail(&self, e: Error) {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
        self.failed.store(true, Ordering::Release);
    }
}

/// Runs its closure when dropped during a panic, and not otherwise: what a panic on a path must
/// still do.
struct OnUnwind<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnUnwind<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}

/// The issuing thread's view of a transfer to the device: which chunk has which slot, which
/// chunks have their DMA queued, and which slots wait for their DMA to complete.
///
/// The first chunks get the slots in order; each later chunk, in chunk order, gets the slot whose
/// DMA was queued first on a lane (so completes first there, each lane's stream running them in
/// order) once that DMA has completed. DMAs are queued in the order chunks are filled, which is
/// mostly chunk order; a slot goes wherever it is needed next, so a chunk filled late holds back no
/// other chunk's slot. Lane 0 is the copy engines; lane 1, where the ring has it, the kernel copy.
struct Issuer {
    slot_of: Vec<Option<usize>>,
    queued: Vec<bool>,
    /// Every chunk before it has its DMA queued.
    first_unqueued: usize,
    /// Every chunk before it has a slot; none after it has.
    slotted: usize,
    /// Per lane, slots whose chunk's DMA is queued, in the order queued.
    in_flight: [VecDeque<usize>; LANES],
}

/// Ways a chunk goes to the device: the copy engines, and the multiprocessors.
const LANES: usize = 2;

impl Issuer {
    fn new(chunks: usize, slots: usize) -> Issuer {
        let slotted = slots.min(chunks);
        Issuer {
            slot_of: (0..chunks).map(|j| (j < slotted).then_some(j)).collect(),
            queued: vec![false; chunks],
            first_unqueued: 0,
            slotted,
            in_flight: [VecDeque::with_capacity(slots), VecDeque::with_capacity(slots)],
        }
    }

    /// The lowest chunk whose DMA is not queued; `None` once all are.
    fn first_unqueued(&self) -> Option<usize> {
        (self.first_unqueued < self.queued.len()).then_some(self.first_unqueued)
    }

    /// Chunks before it have a slot, so may be filled.
    fn slotted(&self) -> usize {
        self.slotted
    }

    fn queued(&self, i: usize) -> bool {
        self.queued[i]
    }

    /// The slot chunk `i` goes through, if it has one.
    fn slot(&self, i: usize) -> Option<usize> {
        self.slot_of[i]
    }

    /// Chunk `i` (filled, through its slot) has its DMA queued on `lane`; returns the slot.
    ///
    /// # Panics
    /// If chunk `i` has no slot or was queued before.
    fn queue(&mut self, i: usize, lane: usize) -> usize {
        let s = self.slot_of[i].expect("a filled chunk has a slot");
        assert!(!std::mem::replace(&mut self.queued[i], true), "chunk {i} queued twice");
        self.in_flight[lane].push_back(s);
        while self.queued.get(self.first_unqueued) == Some(&true) {
            self.first_unqueued += 1;
        }
        s
    }

    /// The slot of `lane` whose DMA to ask about: the one queued first there, when the next chunk
    /// without a slot exists and a thread has claimed pieces up to it (`claimed`, a chunk index).
    fn to_free(&self, claimed: usize, lane: usize) -> Option<usize> {
        let needed = self.slotted < self.queued.len() && self.slotted <= claimed;
        self.in_flight[lane].front().copied().filter(|_| needed)
    }

    /// Chunks of `lane` whose DMA is queued and not yet seen complete.
    fn in_flight(&self, lane: usize) -> usize {
        self.in_flight[lane].len()
    }

    /// [`Issuer::to_free`]'s slot of `lane` has its DMA completed: it goes to the next chunk.
    /// Returns that chunk and the slot.
    ///
    /// # Panics
    /// If no slot of `lane` is in flight or every chunk has one.
    fn freed(&mut self, lane: usize) -> (usize, usize) {
        let s = self.in_flight[lane].pop_front().expect("a slot in flight");
        let j = self.slotted;
        self.slot_of[j] = Some(s);
        self.slotted += 1;
        (j, s)
    }
}

/// A raw base address that worker threads write through at disjoint offsets.
#[derive(Clone, Copy)]
struct Addr(usize);

/// One transfer in either direction: how it is cut, its progress, its trace, the slots' addresses.
struct Transfer {
    plan: Plan,
    shared: Shared,
    marks: Marks,
    slots: Vec<Addr>,
}

impl Transfer {
    /// Runs the transfer: `copy` on every thread of `pool`, `issue` (which queues the DMAs) on
    /// this one. Whatever happened, a panic here included, no DMA may still use the slots when
    /// this returns. Gives the trace and the first failure, else the final synchronisation's
    /// result.
    fn run(
        &self,
        pool: &Pool,
        stream: &Stream,
        to_device: bool,
        copy: &(dyn Fn() + Sync),
        issue: impl FnOnce() -> Result<()>,
    ) -> (Option<StagingTrace>, Result<()>) {
        let shared = &self.shared;
        let _confirm = OnUnwind(|| drop(crate::stream::confirm(stream)));
        pool.run(
            copy,
            || {
                if let Err(e) = issue() {
                    shared.fail(e);
                }
            },
            || shared.fail(Error::invalid("the staging transfer was abandoned")),
        );
        let synced = crate::stream::confirm(stream);
        (self.marks.finish(&self.plan, to_device), shared.outcome(synced))
    }
}

impl Staging {
    /// `slots` pinned buffers of `chunk` bytes each, filled or drained by `threads` threads, in
    /// pieces of a sixteenth of a chunk (at least 64 KiB, at most the chunk), the default's ratio.
    pub fn new(ctx: &Context, chunk: usize, slots: usize, threads: usize) -> Result<Staging> {
        let piece = (chunk / 16).max(64 << 10).min(chunk);
        Staging::with_config(ctx, StagingConfig { chunk, piece, slots, threads })
    }

    /// A ring of the given shape.
    pub fn with_config(ctx: &Context, config: StagingConfig) -> Result<Staging> {
        let StagingConfig { chunk, piece, slots, threads } = config;
        if chunk == 0 || piece == 0 || piece > chunk || slots < 2 || threads == 0 {
            return Err(Error::invalid(format!(
                "staging needs chunk > 0, 0 < piece <= chunk, at least 2 slots and 1 thread ({config:?})"
            )));
        }
        let slots_v = (0..slots).map(|_| PinnedBuffer::<u8>::new(ctx, chunk)).collect::<Result<Vec<_>>>()?;
        let events = (0..slots).map(|_| Event::new(ctx)).collect::<Result<Vec<_>>>()?;
        Ok(Staging {
            pool: Pool::new(threads)?,
            slots: slots_v,
            events,
            config,
            to_host_threads: threads,
            kernel_lane: None,
            clock: DmaClock::new(ctx, slots)?,
            kernel_chunks: 0,
            tracing: false,
            last_trace: None,
        })
    }

    /// [`StagingConfig::default`].
    pub fn with_defaults(ctx: &Context) -> Result<Staging> {
        Staging::with_config(ctx, StagingConfig::default())
    }

    /// Its shape.
    pub fn config(&self) -> StagingConfig {
        self.config
    }

    /// Whether transfers from now on record when each chunk reached each step (a few atomic stores
    /// per chunk), kept until the next transfer: [`Staging::last_trace`].
    pub fn set_tracing(&mut self, on: bool) {
        self.tracing = on;
        if !on {
            self.last_trace = None;
        }
    }

    /// The last transfer's trace, if it was made with tracing on.
    pub fn last_trace(&self) -> Option<&StagingTrace> {
        self.last_trace.as_ref()
    }

    /// Bytes per chunk.
    pub fn chunk(&self) -> usize {
        self.config.chunk
    }

    /// Host threads.
    pub fn threads(&self) -> usize {
        self.config.threads
    }

    /// Lets only `n` of the ring's threads (at least 1, at most all) drain device-to-host
    /// transfers from now on; the others sit them out. For a ring that writes into memory the
    /// kernel is still faulting in: the threads faulting it need the cores more than the copies
    /// do (docs/PERFORMANCE.md, "Sleep and wake").
    pub fn set_to_host_threads(&mut self, n: usize) {
        self.to_host_threads = n.clamp(1, self.config.threads);
    }

    /// Threads that drain a device-to-host transfer.
    pub fn to_host_threads(&self) -> usize {
        self.to_host_threads
    }

    /// Lets host-to-device transfers send chunks through the copy kernel of `kernels` (loaded
    /// into the ring's context) as well as the copy engines, as the [`KernelLane`] says; `None`
    /// turns it off. Loading the kernels takes some tens of milliseconds where the driver's cache
    /// of compiled kernels is cold, which a caller may spend on another thread.
    ///
    /// ```no_run
    /// # fn main() -> cuvmm::Result<()> {
    /// use cuvmm::host::{KernelLane, Staging};
    /// let ctx = cuvmm::Context::for_ordinal(0)?;
    /// let mut staging = Staging::with_defaults(&ctx)?;
    /// staging.set_kernel_lane(Some((cuvmm::kernels::Kernels::load(&ctx)?, KernelLane::default())))?;
    /// # Ok(()) }
    /// ```
    pub fn set_kernel_lane(&mut self, lane: Option<(crate::kernels::Kernels, KernelLane)>) -> Result<()> {
        self.kernel_lane = match lane {
            None => None,
            Some((kernels, config)) => {
                let ctx = kernels.context().clone();
                Some(Lane {
                    stream: Stream::non_blocking(&ctx)?,
                    config: KernelLane { bias: config.bias.max(1), ..config },
                    start: Event::without_timing(&ctx)?,
                    end: Event::without_timing(&ctx)?,
                    kernels,
                })
            }
        };
        Ok(())
    }

    /// Chunks host-to-device transfers have sent through the kernel lane so far.
    pub fn kernel_chunks(&self) -> u64 {
        self.kernel_chunks
    }

    /// Starts a transfer of `bytes`: forgets the last trace, refuses sides of different lengths
    /// (named, with their lengths in elements, in the order the data moves) and cuts the bytes
    /// into chunks and pieces (`None`: nothing to move).
    fn begin(&mut self, sides: [(&str, usize); 2], bytes: usize) -> Result<Option<Plan>> {
        self.last_trace = None;
        let [(from, from_len), (to, to_len)] = sides;
        if from_len != to_len {
            return Err(Error::invalid(format!(
                "length mismatch: {from} {from_len} elements, {to} {to_len}"
            )));
        }
        Ok((bytes > 0).then(|| Plan::new(bytes, self.config.chunk, self.config.piece)))
    }

    /// What the threads of a transfer cut by `plan` share; `slot_of` as in [`Shared::new`].
    fn transfer(&mut self, plan: Plan, slot_of: impl Fn(usize) -> Option<usize>) -> Transfer {
        Transfer {
            shared: Shared::new(self.slots.len(), plan.chunks, slot_of),
            marks: Marks::new(self.tracing, plan.chunks),
            slots: self.slots.iter_mut().map(|s| Addr(s.as_mut_ptr() as usize)).collect(),
            plan,
        }
    }

    /// Copies pageable `src` into `dst` on `stream`; returns when the data is on the device.
    ///
    /// The threads fill pieces in order; this thread queues each chunk's DMA as soon as its last
    /// piece is filled, records the slot's event after it, and gives the slot to the next chunk
    /// without one once that event has completed.
    pub fn to_device<T: DeviceCopy>(
        &mut self,
        stream: &Stream,
        src: &[T],
        dst: DeviceSliceMut<'_, T>,
    ) -> Result<()> {
        let Some(plan) =
            self.begin([("host", src.len()), ("device", dst.len())], std::mem::size_of_val(src))?
        else {
            return Ok(());
        };
        let mut dst = dst;
        let _turn = dst.prepare_write(stream)?;
        let ring = Issuer::new(plan.chunks, self.slots.len());
        let transfer = self.transfer(plan, |j| ring.slot(j));
        let Transfer { plan, shared, marks, slots } = &transfer;
        let src_addr = Addr(src.as_ptr() as usize);
        let api = driver()?.api();
        let events = &self.events;
        let lane = self.kernel_lane.as_ref();
        if let Some(l) = lane {
            // The kernels follow whatever the caller queued before, as the copies do.
            l.start.record(stream)?;
            l.stream.wait_event(&l.start)?;
        }
        // Whatever happens, nothing of the kernel lane may still read a slot once this returns.
        let _drained = OnUnwind(|| {
            if let Some(l) = lane {
                let _ = l.stream.synchronize();
            }
        });
        let fill = || loop {
            let Some(p) = shared.claim(plan.pieces) else { return };
            marks.piece_taken();
            let (j, at, len) = plan.piece(p);
            let mut s = NO_SLOT;
            let slotted = shared.wait_until(|| {
                s = shared.slot_of[j].load(Ordering::Acquire);
                s != NO_SLOT
            });
            if slotted.is_err() {
                return;
            }
            // SAFETY: these bytes of `src` (borrowed for this call; `T` has no padding) go to
            // their place in slot s, which no DMA uses until chunk j is complete (the slot's last
            // DMA completed before it was given to chunk j), and which no other thread touches
            // meanwhile (pieces are disjoint).
            let (from, to) = unsafe {
                (
                    std::slice::from_raw_parts((src_addr.0 + j * plan.chunk + at) as *const u8, len),
                    std::slice::from_raw_parts_mut((slots[s].0 + at) as *mut u8, len),
                )
            };
            if plan.streamed(j * plan.chunk + at) {
                copy_streaming(to, from);
            } else {
                to.copy_from_slice(from);
            }
            if shared.piece_done(j, plan.pieces_in(j)) {
                marks.mark(j, Step::Filled);
            }
        };
        let lanes = if lane.is_some() { LANES } else { 1 };
        let clock = &self.clock;
        // Whether the copy engines' last chunk was slow; the length each slot's DMA moved.
        let mut slow = lane.is_some_and(|l| l.config.slowdown <= 0.0);
        let mut chunk_of = vec![0usize; self.slots.len()];
        let mut by_kernels = 0;
        let issue = || -> Result<()> {
            stream.context().bind()?;
            let mut ring = ring;
            while let Some(first) = ring.first_unqueued() {
                let mut ready = None;
                let found = shared.wait_until(|| {
                    // A filled chunk, the lowest first: a thread descheduled in the middle of a
                    // piece holds back its own chunk only, and the DMA engine moves the chunks
                    // filled after it meanwhile.
                    ready = (first..ring.slotted()).find(|&i| {
                        !ring.queued(i) && shared.done[i].load(Ordering::Acquire) == plan.pieces_in(i)
                    });
                    if ready.is_some() {
                        return true;
                    }
                    // Meanwhile, give the next chunk the slot whose DMA was queued first once that
                    // DMA has completed, asking only when a thread has claimed a piece that needs
                    // it: a query is a driver call, and asking in a tight loop slowed the copies.
                    let claimed = shared.next.load(Ordering::Relaxed) / plan.per_chunk;
                    for l in 0..lanes {
                        if let Some(s) = ring.to_free(claimed, l) {
                            match events[s].is_complete() {
                                Ok(true) => {
                                    let (j, s) = ring.freed(l);
                                    let lap =
                                        (l == 0).then(|| clock.lap(s, &events[s], chunk_of[s])).flatten();
                                    if let (Some(lane), Some((took, best))) = (lane, lap) {
                                        slow = took as f32 > best as f32 * lane.config.slowdown;
                                    }
                                    shared.slot_of[j].store(s, Ordering::Release);
                                }
                                Ok(false) => {}
                                // Ends this wait and every thread's: the error is in `shared`.
                                Err(e) => shared.fail(e),
                            }
                        }
                    }
                    false
                });
                let Some(i) = ready.filter(|_| found.is_ok()) else {
                    return Ok(()); // a query or a worker failed; the error is in `shared`
                };
                let (to, len) = (dst.ptr() + (i * plan.chunk) as u64, plan.chunk_len(i));
                let by_kernel = lane.filter(|l| {
                    ring.in_flight(0) >= ring.in_flight(1) + l.config.bias
                        && slow
                        && len % 16 == 0
                        && to % 16 == 0
                });
                let s = ring.queue(i, usize::from(by_kernel.is_some()));
                chunk_of[s] = len;
                by_kernels += u64::from(by_kernel.is_some());
                match by_kernel {
                    // SAFETY: as below; the slot is pinned memory the device reads (unified
                    // addressing), and chunks and slots are 16-byte aligned (checked).
                    Some(l) => unsafe { l.kernels.copy_raw(&l.stream, slots[s].0 as u64, to, len) }?,
                    None => {
                        clock.start(s, stream)?;
                        // SAFETY: slot s holds chunk i (every piece's copy happened before the
                        // count acquired above); `dst` has room for it at this offset; the slot
                        // goes to another chunk only after the event recorded next completes.
                        unsafe {
                            result::mem::memcpy_htod_async(api, to, slots[s].0 as *const _, len, stream.raw())
                        }?
                    }
                }
                marks.mark(i, Step::Queued);
                events[s].record(by_kernel.map_or(stream, |l| &l.stream))?;
            }
            Ok(())
        };
        let issue = || -> Result<()> {
            let queued = issue();
            // The caller's stream, which the transfer ends by waiting for, waits for the kernels.
            let joined = match lane {
                Some(l) => l.end.record(&l.stream).and_then(|()| stream.wait_event(&l.end)),
                None => Ok(()),
            };
            queued.and(joined)
        };
        let (trace, outcome) = transfer.run(&self.pool, stream, true, &fill, issue);
        self.last_trace = trace;
        self.kernel_chunks += by_kernels;
        // Already waited for through the caller's stream, unless the join failed.
        let drained = lane.map_or(Ok(()), |l| l.stream.synchronize());
        outcome.and(drained)
    }

    /// Copies `src` into pageable `dst` on `stream`; returns when the data is in `dst`.
    ///
    /// This thread queues each chunk's DMA into any slot already drained, and records
    /// the slot's event after it; the threads wait for that event and drain the chunk's pieces
    /// in order, writing `dst` with non-temporal stores (they skip reading each line before
    /// writing it).
    pub fn to_host<T: DeviceCopy>(
        &mut self,
        stream: &Stream,
        src: DeviceSlice<'_, T>,
        dst: &mut [T],
    ) -> Result<()> {
        let Some(plan) =
            self.begin([("device", src.len()), ("host", dst.len())], std::mem::size_of_val(dst))?
        else {
            return Ok(());
        };
        let _turn = src.prepare_read(stream)?;
        let k = self.slots.len();
        let transfer = self.transfer(plan, |_| None);
        let Transfer { plan, shared, marks, slots } = &transfer;
        let dst_addr = Addr(dst.as_mut_ptr() as usize);
        let api = driver()?.api();
        let events = &self.events;
        let clock = &self.clock;
        let drain = || loop {
            let Some(p) = shared.claim(plan.pieces) else { return };
            marks.piece_taken();
            let (j, at, len) = plan.piece(p);
            if shared.wait_until(|| shared.issued[j].load(Ordering::Acquire)).is_err() {
                return;
            }
            // Published before `issued[j]`, which the wait acquired.
            let s = shared.slot_of[j].load(Ordering::Relaxed);
            // The event was recorded after chunk j's DMA, before `issued[j]` was published, and is
            // not recorded again until every piece of chunk j is drained.
            if !shared.landed[j].load(Ordering::Acquire) {
                if let Err(e) = events[s].synchronize() {
                    shared.fail(e);
                    return;
                }
                clock.lap(s, &events[s], plan.chunk_len(j));
                shared.landed[j].store(true, Ordering::Release);
                marks.mark(j, Step::Landed);
            }
            // SAFETY: slot s holds chunk j (its DMA completed); these bytes of `dst` (borrowed
            // mutably for this call) are touched by this thread alone (pieces are disjoint). Any
            // bytes are a valid T.
            let (from, to) = unsafe {
                (
                    std::slice::from_raw_parts((slots[s].0 + at) as *const u8, len),
                    std::slice::from_raw_parts_mut((dst_addr.0 + j * plan.chunk + at) as *mut u8, len),
                )
            };
            copy_streaming(to, from);
            if shared.piece_done(j, plan.pieces_in(j)) {
                marks.mark(j, Step::Drained);
                // Every piece's read of the slot happened before the count that found it drained.
                shared.slot_free[s].store(true, Ordering::Release);
            }
        };
        let issue = || -> Result<()> {
            stream.context().bind()?;
            for i in 0..plan.chunks {
                // Any slot already drained: a thread descheduled in the middle of a piece
                // holds back its own chunk's slot only.
                let mut s = NO_SLOT;
                let free = shared.wait_until(|| {
                    s = (0..k).find(|&s| shared.slot_free[s].load(Ordering::Acquire)).unwrap_or(NO_SLOT);
                    s != NO_SLOT
                });
                if free.is_err() {
                    return Ok(());
                }
                // Only this thread takes slots.
                shared.slot_free[s].store(false, Ordering::Relaxed);
                shared.slot_of[i].store(s, Ordering::Relaxed);
                clock.start(s, stream)?;
                // SAFETY: slot s is free (every read of its last chunk happened before the flag
                // acquired above); `src` holds chunk i.
                unsafe {
                    result::mem::memcpy_dtoh_async(
                        api,
                        slots[s].0 as *mut _,
                        src.ptr() + (i * plan.chunk) as u64,
                        plan.chunk_len(i),
                        stream.raw(),
                    )
                }?;
                marks.mark(i, Step::Queued);
                events[s].record(stream)?;
                shared.issued[i].store(true, Ordering::Release);
            }
            Ok(())
        };
        let drain = first_of(self.to_host_threads, &drain);
        let (trace, outcome) = transfer.run(&self.pool, stream, false, &drain, issue);
        self.last_trace = trace;
        outcome
    }
}

/// How long the copy engines take over each slot's DMAs: an event recorded on their stream just
/// before each DMA, read against the slot's own event after it; and the fastest so far, per byte,
/// which the kernel lane judges them by.
struct DmaClock {
    begun: Vec<Event>,
    /// Nanoseconds per MiB.
    fastest: AtomicU64,
}

impl DmaClock {
    fn new(ctx: &Context, slots: usize) -> Result<DmaClock> {
        let begun = (0..slots).map(|_| Event::new(ctx)).collect::<Result<Vec<_>>>()?;
        Ok(DmaClock { begun, fastest: AtomicU64::new(u64::MAX) })
    }

    /// Marks the start of the DMA through slot `s` that is queued next on `stream`.
    fn start(&self, s: usize, stream: &Stream) -> Result<()> {
        self.begun[s].record(stream)
    }

    /// The DMA through slot `s` that `done` (complete) follows moved `len` bytes: how long it took
    /// and the fastest so far, this one included, in nanoseconds per MiB; `None` when the driver
    /// cannot say.
    fn lap(&self, s: usize, done: &Event, len: usize) -> Option<(u64, u64)> {
        let ms = self.begun[s].elapsed_ms(done).ok()?;
        if len == 0 || ms < 0.0 {
            return None;
        }
        let took = (f64::from(ms) * 1e6 * (1u64 << 20) as f64 / len as f64) as u64;
        Some((took, self.fastest.fetch_min(took, Ordering::Relaxed).min(took)))
    }
}

/// A pool job that runs `job` on the first `n` threads to start it; the others return at once.
fn first_of(n: usize, job: &(dyn Fn() + Sync)) -> impl Fn() + Sync + '_ {
    let started = AtomicUsize::new(0);
    move || {
        if started.fetch_add(1, Ordering::Relaxed) < n {
            job()
        }
    }
}

/// A job for the pool's threads, its lifetime erased. [`Pool::run`] returns only once every
/// thread is done with it, so the closure it points to, and everything that borrows, outlives
/// every use.
#[derive(Clone, Copy)]
struct JobRef(*const (dyn Fn() + Sync + 'static));

// SAFETY: the pointee is `Sync` (shared calls from several threads are allowed), and `Pool::run`
// keeps it alive until no thread uses it any more (see the type's documentation).
unsafe impl Send for JobRef {}

struct PoolState {
    job: Option<JobRef>,
    /// Bumped for each job; each thread runs each job once.
    generation: u64,
    /// Threads not yet done with the current job.
    busy: usize,
    /// A thread's run of the current job panicked.
    panicked: bool,
    shutdown: bool,
}

struct PoolShared {
    state: Mutex<PoolState>,
    start: Condvar,
    done: Condvar,
}

impl PoolShared {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Threads kept for a ring's lifetime, each running every job it is given once: starting
/// threads for each transfer cost tens of microseconds per thread.
struct Pool {
    shared: Arc<PoolShared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    fn new(threads: usize) -> Result<Pool> {
        let shared = Arc::new(PoolShared {
            state: Mutex::new(PoolState {
                job: None,
                generation: 0,
                busy: 0,
                panicked: false,
                shutdown: false,
            }),
            start: Condvar::new(),
            done: Condvar::new(),
        });
        let mut pool = Pool { shared, threads: Vec::with_capacity(threads) };
        for _ in 0..threads {
            let shared = Arc::clone(&pool.shared);
            let spawned =
                std::thread::Builder::new().name("cuvmm-staging".into()).spawn(move || work(&shared));
            match spawned {
                Ok(t) => pool.threads.push(t),
                // Dropping `pool` stops the threads started so far.
                Err(e) => return Err(Error::invalid(format!("cannot start a staging thread: {e}"))),
            }
        }
        Ok(pool)
    }

    /// Runs `job` on every thread of the pool and `here` on this one, then waits until every
    /// thread is done with `job`. If `here` panics, `cancel` (which must make `job` and `here`
    /// return soon) runs and the threads are still waited for before the panic goes on; if `job`
    /// panics on a thread, `cancel` runs there (so that `here` does not wait for its work for
    /// ever) and the panic is passed on after the wait.
    fn run<R>(&self, job: &(dyn Fn() + Sync), here: impl FnOnce() -> R, cancel: impl Fn() + Sync) -> R {
        /// Waits for the threads when dropped, so also while unwinding from `here`.
        struct Wait<'p, C: Fn()> {
            pool: &'p Pool,
            cancel: Option<C>,
        }
        impl<C: Fn()> Drop for Wait<'_, C> {
            fn drop(&mut self) {
                if let Some(cancel) = &self.cancel {
                    cancel();
                }
                let mut g = self.pool.shared.lock();
                while g.busy > 0 {
                    g = self.pool.shared.done.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                g.job = None;
            }
        }
        if self.threads.is_empty() {
            job();
            return here();
        }
        let cancel = &cancel;
        let guarded = || {
            let _cancel = OnUnwind(cancel);
            job()
        };
        let job: &(dyn Fn() + Sync) = &guarded;
        // SAFETY: only the lifetime changes; `Wait` below keeps `job` borrowed until no thread
        // uses it (see JobRef).
        let erased = unsafe {
            std::mem::transmute::<*const (dyn Fn() + Sync + '_), *const (dyn Fn() + Sync + 'static)>(job)
        };
        {
            let mut g = self.shared.lock();
            g.job = Some(JobRef(erased));
            g.generation += 1;
            g.busy = self.threads.len();
            g.panicked = false;
        }
        self.shared.start.notify_all();
        let mut wait = Wait { pool: self, cancel: Some(cancel) };
        let r = here();
        wait.cancel = None;
        drop(wait);
        if std::mem::take(&mut self.shared.lock().panicked) {
            std::panic::panic_any("a cuvmm staging thread panicked");
        }
        r
    }
}

/// A pool thread: runs each job once, until the pool is dropped.
fn work(shared: &PoolShared) {
    let mut seen = 0;
    loop {
        let job = {
            let mut g = shared.lock();
            loop {
                if g.shutdown {
                    return;
                }
                if g.generation != seen {
                    seen = g.generation;
                    break g.job;
                }
                g = shared.start.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        let ok = match job {
            Some(job) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: `Pool::run` published this job and keeps it alive until `busy` reaches
                // 0, which this thread's decrement below is part of.
                unsafe { (*job.0)() }
            }))
            .is_ok(),
            None => true,
        };
        let mut g = shared.lock();
        g.panicked |= !ok;
        g.busy -= 1;
        if g.busy == 0 {
            shared.done.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.start.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn three_quarters_of_the_cores_copy_at_most_twelve() {
        let got: Vec<usize> = [1, 2, 3, 4, 8, 12, 16, 24, 64].into_iter().map(default_threads).collect();
        assert_eq!(got, [1, 2, 3, 3, 6, 9, 12, 12, 12]);
        assert_eq!(default_threads(0), 1);
    }

    #[test]
    fn only_the_last_bytes_are_streamed() {
        let streamed = |plan: &Plan| -> Vec<usize> {
            (0..plan.pieces)
                .filter(|&p| {
                    let (j, at, _) = plan.piece(p);
                    plan.streamed(j * plan.chunk + at)
                })
                .collect()
        };
        let plan = Plan::new(64 << 20, 4 << 20, 256 << 10);
        // The last 16 MiB: the last four chunks' 64 pieces.
        assert_eq!(streamed(&plan), (plan.pieces - 64..plan.pieces).collect::<Vec<_>>());
        // A transfer no longer than the tail is streamed whole.
        let small = Plan::new(13 << 20, 4 << 20, 256 << 10);
        assert_eq!(streamed(&small).len(), small.pieces);
    }

    #[test]
    fn a_plan_covers_every_byte_once_in_order() {
        for (bytes, chunk, piece) in [
            (1, 8, 8),
            (8, 8, 8),
            (9, 8, 3),
            (100, 16, 5),
            (64 << 20, 2 << 20, 512 << 10),
            (5 << 20 | 3, 1 << 20, 256 << 10),
        ] {
            let plan = Plan::new(bytes, chunk, piece);
            let mut at = 0;
            let mut done = vec![0; plan.chunks];
            for p in 0..plan.pieces {
                let (j, off, len) = plan.piece(p);
                assert_eq!(j * chunk + off, at, "{bytes} {chunk} {piece}: piece {p}");
                assert!(len > 0 && len <= piece && off + len <= plan.chunk_len(j));
                done[j] += 1;
                at += len;
            }
            assert_eq!(at, bytes);
            assert!((0..plan.chunks).all(|j| done[j] == plan.pieces_in(j)));
            assert_eq!((0..plan.chunks).map(|j| plan.chunk_len(j)).sum::<usize>(), bytes);
        }
    }

    #[test]
    fn dmas_are_queued_as_chunks_fill_and_slots_go_to_the_next_chunk_as_dmas_complete() {
        // 6 chunks through 2 slots.
        let mut r = Issuer::new(6, 2);
        assert_eq!((r.first_unqueued(), r.slotted()), (Some(0), 2));
        assert_eq!((0..6).map(|j| r.slot(j)).collect::<Vec<_>>(), [Some(0), Some(1), None, None, None, None]);
        assert_eq!(r.to_free(6, 0), None, "no DMA queued, no slot to ask about");
        // Chunk 1 is filled before chunk 0: its DMA goes first, and its slot is the one to free.
        assert_eq!(r.queue(1, 0), 1);
        assert!(r.queued(1) && !r.queued(0));
        assert_eq!(r.first_unqueued(), Some(0));
        assert_eq!(r.to_free(1, 0), None, "no thread needs a slot for chunk 2 yet");
        assert_eq!(r.to_free(2, 0), Some(1));
        assert_eq!(r.freed(0), (2, 1), "chunk 2 gets chunk 1's slot while chunk 0 is still filling");
        assert_eq!(r.slot(2), Some(1));
        assert_eq!(r.slotted(), 3);
        assert_eq!(r.to_free(6, 0), None, "chunk 0's DMA is not queued");
        assert_eq!(r.queue(0, 0), 0);
        assert_eq!(r.first_unqueued(), Some(2));
        assert_eq!(r.queue(2, 0), 1);
        assert_eq!(r.to_free(3, 0), Some(0));
        assert_eq!(r.freed(0), (3, 0));
        assert_eq!(r.to_free(4, 0), Some(1));
        assert_eq!(r.freed(0), (4, 1));
        assert_eq!(r.queue(4, 0), 1);
        assert_eq!(r.queue(3, 0), 0);
        assert_eq!(r.to_free(5, 0), Some(1), "slots free in the order their DMAs were queued");
        assert_eq!(r.freed(0), (5, 1));
        assert_eq!(r.to_free(6, 0), None, "every chunk has a slot");
        assert_eq!(r.queue(5, 0), 1);
        assert_eq!(r.first_unqueued(), None, "every DMA is queued");
        // Fewer chunks than slots.
        let r = Issuer::new(1, 4);
        assert_eq!((r.slotted(), r.to_free(9, 0)), (1, None));
    }

    #[test]
    fn each_lane_frees_its_slots_in_its_own_order() {
        // 5 chunks through 3 slots: chunks 0 and 2 to the copy engines, chunk 1 to the kernel.
        let mut r = Issuer::new(5, 3);
        assert_eq!(r.queue(0, 0), 0);
        assert_eq!(r.queue(1, 1), 1);
        assert_eq!(r.queue(2, 0), 2);
        assert_eq!((r.in_flight(0), r.in_flight(1)), (2, 1));
        // Each lane offers its oldest; the kernel's completes first and its slot goes on at once.
        assert_eq!(r.to_free(3, 0), Some(0));
        assert_eq!(r.to_free(3, 1), Some(1));
        assert_eq!(r.freed(1), (3, 1));
        assert_eq!((r.in_flight(0), r.in_flight(1)), (2, 0));
        assert_eq!(r.to_free(4, 1), None, "nothing in flight on the kernel lane");
        assert_eq!(r.freed(0), (4, 0));
        assert_eq!(r.to_free(9, 0), None, "every chunk has a slot");
    }

    #[test]
    #[should_panic(expected = "queued twice")]
    fn a_chunk_is_queued_once() {
        let mut r = Issuer::new(3, 2);
        r.queue(0, 0);
        r.queue(0, 0);
    }

    #[test]
    fn the_pool_runs_each_job_once_per_thread_and_waits_for_it() {
        let pool = Pool::new(3).unwrap();
        for round in 1..=50 {
            let ran = AtomicUsize::new(0);
            let claimed = AtomicUsize::new(0);
            let job = || {
                ran.fetch_add(1, Ordering::SeqCst);
                while claimed.fetch_add(1, Ordering::SeqCst) < 100 {}
            };
            let here = pool.run(&job, || round, || {});
            assert_eq!(here, round);
            assert_eq!(ran.load(Ordering::SeqCst), 3, "every thread ran the job once, and is done");
        }
    }

    #[test]
    fn a_job_limited_to_some_threads_runs_on_that_many() {
        let pool = Pool::new(4).unwrap();
        for n in [1, 2, 4, 9] {
            let ran = AtomicUsize::new(0);
            let count = || {
                ran.fetch_add(1, Ordering::SeqCst);
            };
            let job = first_of(n, &count);
            pool.run(&job, || (), || {});
            assert_eq!(ran.load(Ordering::SeqCst), n.min(4), "limit {n}");
        }
    }

    #[test]
    fn a_copying_thread_that_panics_abandons_the_transfer_instead_of_leaving_it_waiting() {
        // The job's panic cancels the transfer on its thread, so the issuing thread's wait for its
        // pieces ends, and the panic is passed on after the threads are done.
        let pool = Pool::new(2).unwrap();
        let shared = Shared::new(1, 1, |_| Some(0));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(
                &|| panic!("a copying thread"),
                || shared.wait_until(|| false),
                || shared.fail(Error::invalid("the staging transfer was abandoned")),
            )
        }));
        assert!(r.is_err(), "the thread's panic is passed on");
        assert!(shared.outcome(Ok(())).unwrap_err().to_string().contains("abandoned"));
        // Without a panic the guard does nothing.
        let calm = Shared::new(1, 1, |_| Some(0));
        drop(OnUnwind(|| calm.fail(Error::invalid("never"))));
        assert!(calm.outcome(Ok(())).is_ok());
    }

    #[test]
    fn a_panic_here_cancels_and_still_waits_and_a_panic_in_a_thread_is_passed_on() {
        let pool = Pool::new(2).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let left = AtomicUsize::new(0);
        let job = || {
            while !stop.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            left.fetch_add(1, Ordering::SeqCst);
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&job, || panic!("issuer"), || stop.store(true, Ordering::SeqCst))
        }));
        assert!(r.is_err());
        assert_eq!(left.load(Ordering::SeqCst), 2, "both threads finished before the panic went on");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|| panic!("worker"), || (), || {})
        }));
        assert!(r.is_err());
        // The pool still works.
        let ran = AtomicUsize::new(0);
        pool.run(
            &|| {
                ran.fetch_add(1, Ordering::SeqCst);
            },
            || (),
            || {},
        );
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }
}
