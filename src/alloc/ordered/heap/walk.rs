//! A heap's blocks in address order, for a picture of the whole heap (memory snapshots).

use super::{BlockId, Heap, State, NIL};

impl Heap {
    /// (address, size, graph pool, state) of every block carved so far, lowest address first.
    /// Walks the address-ordered list back from the block at the top: no index is kept for this,
    /// since only a snapshot, never a request, asks for it.
    pub(crate) fn walk(&self) -> Vec<(u64, u64, u32, State)> {
        let mut v = Vec::new();
        let mut i: BlockId = if self.top == self.base { NIL } else { self.last };
        while i != NIL {
            let b = &self.blocks[i];
            v.push((b.addr, b.size, b.pool, b.state));
            i = b.prev;
        }
        v.reverse();
        v
    }
}
