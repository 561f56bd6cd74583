//! How long the copy engines' DMAs take.

use crate::context::Context;
use crate::error::Result;
use crate::stream::{Event, Stream};
use std::sync::atomic::{AtomicU64, Ordering};

/// How long the copy engines take over each slot's DMAs: an event recorded on their stream just
/// before each DMA, read against the slot's own event after it; and the fastest so far, per byte,
/// which the kernel lane judges them by.
pub(super) struct DmaClock {
    pub(super) begun: Vec<Event>,
    /// Nanoseconds per MiB.
    pub(super) fastest: AtomicU64,
}

impl DmaClock {
    pub(super) fn new(ctx: &Context, slots: usize) -> Result<DmaClock> {
        let begun = (0..slots).map(|_| Event::new(ctx)).collect::<Result<Vec<_>>>()?;
        Ok(DmaClock { begun, fastest: AtomicU64::new(u64::MAX) })
    }

    /// Marks the start of the DMA through slot `s` that is queued next on `stream`.
    pub(super) fn start(&self, s: usize, stream: &Stream) -> Result<()> {
        self.begun[s].record(stream)
    }

    /// The DMA through slot `s` that `done` (complete) follows moved `len` bytes: how long it took
    /// and the fastest so far, this one included, in nanoseconds per MiB; `None` when the driver
    /// cannot say.
    pub(super) fn lap(&self, s: usize, done: &Event, len: usize) -> Option<(u64, u64)> {
        let ms = self.begun[s].elapsed_ms(done).ok()?;
        if len == 0 || ms < 0.0 {
            return None;
        }
        let took = (f64::from(ms) * 1e6 * (1u64 << 20) as f64 / len as f64) as u64;
        Some((took, self.fastest.fetch_min(took, Ordering::Relaxed).min(took)))
    }
}
