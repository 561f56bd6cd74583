//! The kernel lane: host-to-device chunks through the multiprocessors while the copy engines are
//! slow.

use super::Staging;
use crate::error::Result;
use crate::stream::{Event, Stream};

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
pub(super) struct Lane {
    pub(super) kernels: crate::kernels::Kernels,
    pub(super) stream: Stream,
    pub(super) config: KernelLane,
    /// Recorded on the caller's stream at a transfer's start, waited for here; and back.
    pub(super) start: Event,
    pub(super) end: Event,
}

impl Staging {
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
}
