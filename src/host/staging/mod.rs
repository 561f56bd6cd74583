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

mod clock;
mod host_copy;
mod lane;
mod plan;
mod pool;
mod progress;
mod to_device;
mod to_host;
mod trace;

pub use host_copy::HostCopy;
pub use lane::KernelLane;
pub use trace::{ChunkTrace, StagingTrace};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::host::PinnedBuffer;
use crate::stream::{Event, Stream};
use clock::DmaClock;
use lane::Lane;
use plan::Plan;
use pool::Pool;
use progress::{OnUnwind, Shared};
use trace::Marks;

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
    /// How they write: [`HostCopy`]. [`Staging::set_host_copy`] changes it between transfers.
    pub host_copy: HostCopy,
}

impl Default for StagingConfig {
    /// 4 MiB chunks in 256 KiB pieces, 8 slots (32 MiB pinned), three quarters of the cores
    /// copying (at most 12 threads), streaming stores: the fastest shape of the sweeps in
    /// docs/PERFORMANCE.md ("Figures behind the defaults"). Small pieces shorten the end of a
    /// transfer (the threads finish within a small piece of one another, and the last DMA
    /// follows sooner); smaller rings starve the threads.
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        StagingConfig {
            chunk: 4 << 20,
            piece: 256 << 10,
            slots: 8,
            threads: default_threads(cores),
            host_copy: HostCopy::default(),
        }
    }
}

/// Copying threads for a host with `cores` cores: three quarters of them (the rest left to the
/// thread that issues the DMAs and to the program), at most 12: more threads were no faster
/// (docs/PERFORMANCE.md, "Figures behind the defaults").
fn default_threads(cores: usize) -> usize {
    (cores - cores / 4).clamp(1, 12)
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

/// A raw base address that worker threads write through at disjoint offsets.
#[derive(Clone, Copy)]
struct Addr(usize);

/// One transfer in either direction: how it is cut, its progress, its trace, the slots' addresses.
struct Transfer {
    plan: Plan,
    host_copy: HostCopy,
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
    /// pieces of a sixteenth of a chunk (at least 64 KiB, at most the chunk), the default's ratio,
    /// with the default's stores.
    pub fn new(ctx: &Context, chunk: usize, slots: usize, threads: usize) -> Result<Staging> {
        let piece = (chunk / 16).max(64 << 10).min(chunk);
        Staging::with_config(
            ctx,
            StagingConfig { chunk, piece, slots, threads, host_copy: HostCopy::default() },
        )
    }

    /// A ring of the given shape.
    pub fn with_config(ctx: &Context, config: StagingConfig) -> Result<Staging> {
        let StagingConfig { chunk, piece, slots, threads, host_copy: _ } = config;
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

    /// How the threads write from the next transfer on: a benchmark compares both on one ring.
    pub fn set_host_copy(&mut self, copy: HostCopy) {
        self.config.host_copy = copy;
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
            host_copy: self.config.host_copy,
            plan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_quarters_of_the_cores_copy_at_most_twelve() {
        let got: Vec<usize> = [1, 2, 3, 4, 8, 12, 16, 24, 64].into_iter().map(default_threads).collect();
        assert_eq!(got, [1, 2, 3, 3, 6, 9, 12, 12, 12]);
        assert_eq!(default_threads(0), 1);
    }
}
