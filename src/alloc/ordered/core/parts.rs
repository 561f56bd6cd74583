//! The small parts of the [`Core`](super::Core), each with its own invariant: the identities
//! made up for streams the driver cannot name, the graph pools of captures, the pages held
//! beyond the heaps' tables, and the pages lent between blocks of one stream.

use super::super::ids::{Epoch, Handle, SlotId, StreamId, LEGACY};
use super::CAPTURE_IDS;
use std::collections::HashMap;

/// Identities made up for streams the driver could not name: never one the driver gives, never
/// one given before, and within one capture the same one for the same handle (a capture's
/// handle names one stream).
pub(crate) struct Identities {
    /// By (capture, handle); at most [`CAPTURE_IDS`].
    pub(super) by_capture: HashMap<(u64, Handle), StreamId>,
    next: StreamId,
}

impl Default for Identities {
    fn default() -> Self {
        Identities { by_capture: HashMap::new(), next: StreamId(LEGACY.0 + 1) }
    }
}

impl Identities {
    /// One never used before.
    pub(crate) fn fresh(&mut self) -> StreamId {
        let id = self.next;
        self.next = StreamId(id.0 + 1);
        id
    }

    /// The identity of `raw` in `capture`: the one it got earlier in that capture, or a fresh one.
    pub(crate) fn in_capture(&mut self, capture: u64, raw: Handle) -> StreamId {
        if let Some(&id) = self.by_capture.get(&(capture, raw)) {
            return id;
        }
        if self.by_capture.len() >= CAPTURE_IDS {
            // Captures end without telling the allocator: past the bound, those of other captures
            // go (a capture still running then gives its stream a new identity, taken as another
            // stream's: less reuse, never unsound).
            self.by_capture.retain(|&(other, _), _| other == capture);
            if self.by_capture.len() >= CAPTURE_IDS {
                self.by_capture.clear();
            }
        }
        let id = self.fresh();
        self.by_capture.insert((capture, raw), id);
        id
    }
}

/// The graph pools of captures (`GraphMemory::Keep`): each capture its own number, never 0
/// (the shared pool's) and never given twice.
pub(crate) struct Pools {
    by_capture: HashMap<u64, u32>,
    next: u32,
}

impl Default for Pools {
    fn default() -> Self {
        Pools { by_capture: HashMap::new(), next: 1 }
    }
}

impl Pools {
    /// The graph pool of `capture`.
    pub(crate) fn of(&mut self, capture: u64) -> u32 {
        let next = &mut self.next;
        *self.by_capture.entry(capture).or_insert_with(|| {
            let p = *next;
            *next += 1;
            p
        })
    }

    /// Every capture's memory goes back to the shared pool: later captures get new numbers.
    pub(crate) fn clear(&mut self) {
        self.by_capture.clear();
    }
}

/// Physical memory held outside the heaps' tables' accounting: `mapped` counts the bytes of
/// pages mapped in heaps, `spare` the pages of the ordinary size unmapped and kept for later.
pub(crate) struct Held<P> {
    pub spare: Vec<P>,
    /// Bytes of pages mapped (spare ones apart).
    pub mapped: u64,
}

impl<P> Default for Held<P> {
    fn default() -> Self {
        Held { spare: Vec::new(), mapped: 0 }
    }
}

/// Pages of a lent block (see [`super::super::heap::State::Lent`]): still mapped at its address
/// (as well as where they now serve) until the work queued on `stream` before the block's free
/// has run.
pub(crate) struct Lent {
    pub slot: SlotId,
    pub stream: StreamId,
    pub epoch: Epoch,
    /// Page indexes in the slot.
    pub pages: Vec<u64>,
}

/// Pages lent between blocks of one stream (see `Core::lend`): the blocks that lent them, and
/// the pages lent to the batch being mapped, for it alone (they are still mapped where they came
/// from), never kept beyond it.
pub(crate) struct Lending<P> {
    /// Blocks whose pages were lent, until their stream's work has caught up.
    pub lent: Vec<Lent>,
    pub borrowed: Vec<P>,
    /// The latest free among the blocks that lent `borrowed`.
    pub borrowed_epoch: Epoch,
}

impl<P> Default for Lending<P> {
    fn default() -> Self {
        Lending { lent: Vec::new(), borrowed: Vec::new(), borrowed_epoch: Epoch::NONE }
    }
}
