//! What a traced transfer records of each chunk, and when.

use super::plan::Plan;
#[cfg(doc)]
use super::Staging;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
pub(super) enum Step {
    Filled = 0,
    Queued = 1,
    Landed = 2,
    Drained = 3,
}

/// A traced transfer's steps as they happen, nanoseconds from its start plus one (0: not
/// reached). Empty, and every mark a no-op, when the transfer is not traced.
pub(super) struct Marks {
    t0: Instant,
    pub(super) first_piece: AtomicU64,
    pub(super) at: Vec<[AtomicU64; 4]>,
}

impl Marks {
    pub(super) fn new(traced: bool, chunks: usize) -> Marks {
        let at = if traced { (0..chunks).map(|_| Default::default()).collect() } else { Vec::new() };
        Marks { t0: Instant::now(), first_piece: AtomicU64::new(0), at }
    }

    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1
    }

    pub(super) fn mark(&self, j: usize, step: Step) {
        if let Some(at) = self.at.get(j) {
            at[step as usize].store(self.now(), Ordering::Relaxed);
        }
    }

    pub(super) fn piece_taken(&self) {
        if !self.at.is_empty() && self.first_piece.load(Ordering::Relaxed) == 0 {
            let _ = self.first_piece.compare_exchange(0, self.now(), Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The trace, once every thread is done with the transfer; `None` when not traced.
    pub(super) fn finish(&self, plan: &Plan, to_device: bool) -> Option<StagingTrace> {
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
