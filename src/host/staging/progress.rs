//! The progress of one transfer, which the issuing and the copying threads share, and how they
//! wait for one another.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The progress of one transfer, shared by the issuing thread and the copying threads. Waits
/// spin, then yield, rather than sleep at once: a transfer's waits last microseconds, and waking a
/// sleeping thread takes longer than that (docs/PERFORMANCE.md, "Figures behind the defaults").
pub(super) struct Shared {
    /// The next piece to claim.
    pub(super) next: AtomicUsize,
    /// For each slot: no chunk holds it (to host). Set by the thread that drained the slot's
    /// last chunk, taken by the issuing thread.
    pub(super) slot_free: Vec<AtomicBool>,
    /// For each chunk, the slot it goes through, [`NO_SLOT`] until it has one.
    pub(super) slot_of: Vec<AtomicUsize>,
    /// Per chunk: pieces filled (to device) or drained (to host).
    pub(super) done: Vec<AtomicUsize>,
    /// Per chunk (to host): its DMA is queued and its slot's event recorded after it.
    pub(super) issued: Vec<AtomicBool>,
    /// Per chunk (to host): a thread has seen its DMA complete, so the others need not ask.
    pub(super) landed: Vec<AtomicBool>,
    pub(super) failed: AtomicBool,
    pub(super) error: Mutex<Option<Error>>,
}

/// In [`Shared::slot_of`]: the chunk has no slot yet.
pub(super) const NO_SLOT: usize = usize::MAX;

/// Spins this many times before yielding in a wait.
pub(super) const SPINS: u32 = 256;
/// Yields this long before sleeping in a wait.
pub(super) const YIELD_FOR: Duration = Duration::from_millis(1);

impl Shared {
    /// `slot_of` gives each chunk's slot, if it has one from the start (to device).
    pub(super) fn new(slots: usize, chunks: usize, slot_of: impl Fn(usize) -> Option<usize>) -> Shared {
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
    pub(super) fn wait_until(&self, mut cond: impl FnMut() -> bool) -> std::result::Result<(), ()> {
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
    pub(super) fn claim(&self, pieces: usize) -> Option<usize> {
        if self.failed.load(Ordering::Acquire) {
            return None;
        }
        let p = self.next.fetch_add(1, Ordering::Relaxed);
        (p < pieces).then_some(p)
    }

    /// Counts one more piece of chunk `j` done (after its bytes were copied); true for the
    /// chunk's last. Each piece's copy happens before whoever acquires the count seeing it full.
    pub(super) fn piece_done(&self, j: usize, pieces: usize) -> bool {
        self.done[j].fetch_add(1, Ordering::AcqRel) + 1 == pieces
    }

    /// The first failure, else the final synchronisation's result.
    pub(super) fn outcome(&self, synced: Result<()>) -> Result<()> {
        match self.error.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => Err(e),
            None => synced,
        }
    }

    pub(super) fn fail(&self, e: Error) {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
        self.failed.store(true, Ordering::Release);
    }
}

/// Runs its closure when dropped during a panic, and not otherwise: what a panic on a path must
/// still do.
pub(super) struct OnUnwind<F: FnMut()>(pub(super) F);

impl<F: FnMut()> Drop for OnUnwind<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}
