//! The address-space side of one heap: blocks carved out of a reservation, best-fit search,
//! splitting and coalescing, with each free block remembering which stream may reuse it.
//!
//! Nothing here calls the driver; [`super::core`] adds pages and events.

use super::ids::{Caller, Epoch, StreamId, IDLE};
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::{Index, IndexMut, RangeInclusive};

mod walk;

/// Every block starts and ends on this boundary.
pub(crate) const ALIGN: u64 = 512;

/// Where a free block may be reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Freed on `stream`: reusable on that stream at once, on others once an event recorded on
    /// `stream` after the free (its number at least `epoch`) has completed.
    Stream { stream: StreamId, epoch: Epoch },
    /// No queued work uses it.
    Idle,
}

impl Owner {
    fn key(self) -> StreamId {
        match self {
            Owner::Stream { stream, .. } => stream,
            Owner::Idle => IDLE,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Free(Owner),
    Live {
        /// The stream it was handed out on, and the handle that call passed: a free passing the
        /// same handle is on that stream unless it was destroyed since (then the free is
        /// attributed to the destroyed stream, whose identity nothing uses again).
        caller: Caller,
        requested: u64,
    },
    /// Freed on `stream` and kept whole, unindexed, for that stream's next request of its size:
    /// the common case of a training step costs a hash lookup instead of a best-fit search, a
    /// split and a merge. Flushed into the index before anything else looks for free space.
    Cached {
        stream: StreamId,
        epoch: Epoch,
    },
    /// Freed on `stream`, whose whole pages were lent to a later block of the same stream (mapped
    /// there too) before the work queued ahead of the free had run: out of use, and still mapped
    /// here, until an event recorded on `stream` after the free (number `epoch`) has completed.
    Lent {
        stream: StreamId,
        epoch: Epoch,
    },
}

/// Free blocks [`Heap::find`] compares by address, smallest first: a bound on its work, above what
/// real workloads offer (docs/PERFORMANCE.md, "Figures behind the defaults").
const FIT_AMONG: usize = 64;

/// Blocks kept per list of [`KeyedLists`] (per (stream, size) in the heap, per size in a
/// stream's front) before frees go further.
pub(crate) const CACHED_PER_SIZE: usize = 16;

/// A block's index in [`Heap`]'s table: stable while the block exists, reused after it merges
/// into a neighbour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockId(u32);

/// No block: the ends of the address-ordered list.
const NIL: BlockId = BlockId(u32::MAX);

#[derive(Clone, Copy, Debug)]
struct Block {
    addr: u64,
    size: u64,
    prev: BlockId,
    next: BlockId,
    /// 0 for the shared pool; others belong to a captured graph.
    pool: u32,
    state: State,
}

impl Index<BlockId> for Vec<Block> {
    type Output = Block;
    fn index(&self, i: BlockId) -> &Block {
        &self[i.0 as usize]
    }
}

impl IndexMut<BlockId> for Vec<Block> {
    fn index_mut(&mut self, i: BlockId) -> &mut Block {
        &mut self[i.0 as usize]
    }
}

/// The free index's key, ordered field by field (owner key, pool, size, address): a best fit for
/// one owner and pool is one range query. The id, last, names the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct FreeKey {
    owner: StreamId,
    pool: u32,
    size: u64,
    addr: u64,
    id: BlockId,
}

impl FreeKey {
    fn of(owner: Owner, b: &Block, id: BlockId) -> FreeKey {
        FreeKey { owner: owner.key(), pool: b.pool, size: b.size, addr: b.addr, id }
    }

    /// The keys of free blocks owned by `owner` in `pools` holding at least `size` bytes.
    fn range(owner: StreamId, pools: RangeInclusive<u32>, size: u64) -> RangeInclusive<FreeKey> {
        let lo = FreeKey { owner, pool: *pools.start(), size, addr: 0, id: BlockId(0) };
        let hi = FreeKey { owner, pool: *pools.end(), size: u64::MAX, addr: u64::MAX, id: BlockId(u32::MAX) };
        lo..=hi
    }
}

/// A block [`Heap::stream_free`] lists: freed on a stream whose work may not have run yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PendingFree {
    pub id: BlockId,
    pub addr: u64,
    pub size: u64,
    /// The number of the first event recorded on the stream after the free.
    pub epoch: Epoch,
}

/// A fast hash for addresses, which are distinct multiples of 512.
#[derive(Default)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        // Multiplying leaves low bits of multiples of 512 zero; `finish` folds high bits down.
        self.0 = (self.0.rotate_left(23) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type AddrMap<V> = KeyMap<u64, V>;

/// A map hashed as [`AddrMap`] is, for keys that are a `u64` underneath (stream identities).
pub(crate) type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<AddrHasher>>;

/// Cached blocks, one list per key (the latest last), found through a map or, for the key used
/// last, without hashing: a free and the next request of the same size meet there. The heap's
/// lists per (stream, size) and a stream front's per size.
pub(crate) struct KeyedLists<K, T> {
    lists: Vec<Vec<T>>,
    index: HashMap<K, u32, BuildHasherDefault<AddrHasher>>,
    last: Option<(K, u32)>,
}

impl<K, T> Default for KeyedLists<K, T> {
    fn default() -> Self {
        KeyedLists { lists: Vec::new(), index: HashMap::default(), last: None }
    }
}

impl<K: Copy + Eq + std::hash::Hash, T> KeyedLists<K, T> {
    /// The list of `key`, made if `make`.
    #[inline]
    pub(crate) fn list(&mut self, key: K, make: bool) -> Option<&mut Vec<T>> {
        let l = match self.last {
            Some((k, l)) if k == key => l,
            _ => self.find(key, make)?,
        };
        Some(&mut self.lists[l as usize])
    }

    /// The index of `key`'s list through the map, made if `make`; it becomes the one used last.
    /// Out of line: a cached pair of one size never comes here, and [`list`](Self::list) inlines.
    #[inline(never)]
    fn find(&mut self, key: K, make: bool) -> Option<u32> {
        let l = match self.index.get(&key) {
            Some(&l) => l,
            None if make => {
                self.lists.push(Vec::new());
                let l = (self.lists.len() - 1) as u32;
                self.index.insert(key, l);
                l
            }
            None => return None,
        };
        self.last = Some((key, l));
        Some(l)
    }

    /// Adds `item` to the list of `key` unless that holds [`CACHED_PER_SIZE`].
    #[inline]
    pub(crate) fn push(&mut self, key: K, item: T) -> bool {
        let list = self.list(key, true).expect("made");
        if list.len() >= CACHED_PER_SIZE {
            return false;
        }
        list.push(item);
        true
    }

    /// Every item, taken out, the lists and their index emptied.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.index.clear();
        self.last = None;
        self.lists.drain(..).flatten()
    }

    /// The items of every key for which `f` holds, taken out (their lists stay, empty).
    pub(crate) fn take_where(&mut self, f: impl Fn(&K) -> bool) -> Vec<T> {
        let mut out = Vec::new();
        for (k, &l) in &self.index {
            if f(k) {
                out.append(&mut self.lists[l as usize]);
            }
        }
        out
    }

    /// Every list, to take some items out.
    pub(crate) fn lists_mut(&mut self) -> impl Iterator<Item = &mut Vec<T>> {
        self.lists.iter_mut()
    }

    /// Items held, every list together.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lists.iter().map(Vec::len).sum()
    }

    /// Every item with its key, after checking that each list has one key (tests only).
    #[cfg(test)]
    pub(crate) fn entries(&self) -> impl Iterator<Item = (K, &T)> + '_ {
        let mut seen: Vec<u32> = self.index.values().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), self.lists.len(), "every list has a key of its own");
        if let Some((k, l)) = self.last {
            assert!(self.index.get(&k) == Some(&l), "the key used last names its list");
        }
        self.index.iter().flat_map(move |(&k, &l)| self.lists[l as usize].iter().map(move |t| (k, t)))
    }
}

/// What [`Heap::free`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Freed {
    pub size: u64,
    pub requested: u64,
    pub pool: u32,
}

/// Blocks of `[base, base + size)`. Addresses below `top` are covered by blocks; the rest has never
/// been handed out.
pub(crate) struct Heap {
    base: u64,
    size: u64,
    top: u64,
    /// The block that ends at `top`.
    last: BlockId,
    blocks: Vec<Block>,
    spare: Vec<BlockId>,
    /// Blocks in the `Lent` state.
    lent: Vec<BlockId>,
    /// Free blocks, ordered by [`FreeKey`].
    free: BTreeSet<FreeKey>,
    /// Blocks handed out and not yet back in the index: `Live` and `Cached` ones. A cached block
    /// stays here, so that a free and the next request of its size touch the map once between
    /// them (a lookup) instead of removing and inserting.
    live: AddrMap<BlockId>,
    /// Bytes of blocks in graph pools.
    graph: u64,
    /// `Cached` blocks, one list per (stream, size).
    cached: KeyedLists<(StreamId, u64), BlockId>,
    cached_count: usize,
}

impl Heap {
    pub(crate) fn new(base: u64, size: u64) -> Heap {
        debug_assert!(base % ALIGN == 0 && size % ALIGN == 0);
        Heap {
            base,
            size,
            top: base,
            last: NIL,
            blocks: Vec::new(),
            spare: Vec::new(),
            free: BTreeSet::new(),
            live: AddrMap::default(),
            lent: Vec::new(),
            graph: 0,
            cached: KeyedLists::default(),
            cached_count: 0,
        }
    }

    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    pub(crate) fn contains(&self, addr: u64) -> bool {
        addr >= self.base && addr - self.base < self.size
    }

    /// (address, size) of every live block.
    pub(crate) fn live_blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.live
            .values()
            .map(|&i| &self.blocks[i])
            .filter(|b| matches!(b.state, State::Live { .. }))
            .map(|b| (b.addr, b.size))
    }

    /// Blocks whose memory must be there whenever the tag is awake: live blocks, and free blocks
    /// of graph pools, which a captured graph goes on using.
    pub(crate) fn kept_blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let graph_free = self.free.iter().filter(|k| k.pool != 0).map(|k| {
            let b = &self.blocks[k.id];
            (b.addr, b.size)
        });
        self.live_blocks().chain(graph_free)
    }

    /// Bytes in graph pools, free or live.
    pub(crate) fn graph_bytes(&self) -> u64 {
        self.graph
    }

    /// The free block of `pool` at the lowest address holding `size` bytes that `stream` may
    /// take now (its own or an idle one), among the [`FIT_AMONG`] smallest that do for each.
    ///
    /// Lowest address first keeps live blocks packed at the bottom of the heap, so the free space
    /// above stays in large pieces and a repeated pattern of allocations finds the blocks it had
    /// last time, pages and all, where best fit scatters free space further on every repetition
    /// once pages are lent (docs/PERFORMANCE.md, "Figures behind the defaults").
    pub(crate) fn find(&self, pool: u32, stream: StreamId, size: u64) -> Option<(u64, BlockId)> {
        let lowest = |owner: StreamId| {
            self.free
                .range(FreeKey::range(owner, pool..=pool, size))
                .take(FIT_AMONG)
                .min_by_key(|k| k.addr)
                .map(|k| (k.addr, k.id))
        };
        let own = if stream == IDLE { None } else { lowest(stream) };
        match (own, lowest(IDLE)) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// Takes `size` bytes at the start of free block `i` (from [`find`](Self::find)) for `stream`,
    /// leaving the rest free with the same owner. Returns the address.
    pub(crate) fn take(&mut self, i: BlockId, size: u64, caller: Caller, requested: u64, pool: u32) -> u64 {
        let b = self.blocks[i];
        let State::Free(owner) = b.state else { unreachable!("take of a block that is not free") };
        debug_assert!(b.size >= size && size % ALIGN == 0);
        self.free.remove(&FreeKey::of(owner, &b, i));
        if b.size > size {
            let rest = self.split(i, size);
            self.index(rest);
        }
        if b.pool == 0 && pool != 0 {
            self.graph += size;
        }
        let blk = &mut self.blocks[i];
        blk.pool = pool;
        blk.state = State::Live { caller, requested };
        self.live.insert(blk.addr, i);
        blk.addr
    }

    /// Carves `size` bytes from the never-used part, if it holds them. `reuse` is the owner key
    /// whose free blocks the request may take besides idle ones (as for [`find`](Self::find)):
    /// the requesting stream, or [`IDLE`] where only idle blocks qualify (during a capture that
    /// shares memory with other streams).
    pub(crate) fn carve(
        &mut self,
        size: u64,
        caller: Caller,
        requested: u64,
        pool: u32,
        reuse: StreamId,
    ) -> Option<u64> {
        // A free block at the end that the request may use grows into the never-used part: its
        // pages serve again instead of new ones beside them.
        if self.last != NIL {
            let l = self.blocks[self.last];
            if let State::Free(owner) = l.state {
                let usable = l.pool == pool
                    && match owner {
                        Owner::Idle => true,
                        Owner::Stream { stream: s, .. } => reuse != IDLE && s == caller.id,
                    };
                let grow = size.saturating_sub(l.size);
                if usable && grow > 0 && self.base + self.size - self.top >= grow {
                    self.unindex(self.last);
                    self.blocks[self.last].size += grow;
                    self.top += grow;
                    if pool != 0 {
                        // Already in the graph's pool, so `take` will not count it: the growth is
                        // graph memory too.
                        self.graph += grow;
                    }
                    self.blocks[self.last].state = State::Free(owner);
                    self.index(self.last);
                    return Some(self.take(self.last, size, caller, requested, pool));
                }
            }
        }
        if self.base + self.size - self.top < size {
            return None;
        }
        let i = self.slot(Block {
            addr: self.top,
            size,
            prev: self.last,
            next: NIL,
            pool,
            state: State::Live { caller, requested },
        });
        if self.last != NIL {
            self.blocks[self.last].next = i;
        }
        if pool != 0 {
            self.graph += size;
        }
        self.last = i;
        self.live.insert(self.top, i);
        self.top += size;
        Some(self.top - size)
    }

    /// A block `stream` freed whole with exactly `size` bytes, handed out again to it.
    pub(crate) fn take_cached(&mut self, caller: Caller, size: u64, requested: u64) -> Option<u64> {
        if self.cached_count == 0 {
            return None;
        }
        let i = self.cached.list((caller.id, size), false)?.pop()?;
        self.cached_count -= 1;
        let b = &mut self.blocks[i];
        b.state = State::Live { caller, requested };
        Some(b.addr)
    }

    /// The live block at `addr`: its id (for [`free_cached`](Self::free_cached)), and the stream
    /// it was handed out on with the handle that call passed.
    pub(crate) fn live_block(&self, addr: u64) -> Option<(BlockId, Caller)> {
        let i = *self.live.get(&addr)?;
        match self.blocks[i].state {
            State::Live { caller, .. } => Some((i, caller)),
            _ => None,
        }
    }

    /// What freeing live block `i` would give back, the block left live.
    pub(crate) fn live_freed(&self, i: BlockId) -> Freed {
        let b = self.blocks[i];
        let State::Live { requested, .. } = b.state else {
            unreachable!("live_freed of a block that is not live")
        };
        Freed { size: b.size, requested, pool: b.pool }
    }

    /// Frees live block `i` (from [`live_block`](Self::live_block)) on `stream` at `epoch`,
    /// keeping it whole for the stream's next request of its size when there is room; else as
    /// [`free`](Self::free) does.
    pub(crate) fn free_cached(&mut self, i: BlockId, stream: StreamId, epoch: Epoch) -> Freed {
        let b = self.blocks[i];
        let State::Live { requested, .. } = b.state else {
            unreachable!("free_cached of a block that is not live")
        };
        if b.pool == 0 && self.cached.push((stream, b.size), i) {
            self.cached_count += 1;
            self.blocks[i].state = State::Cached { stream, epoch };
            return Freed { size: b.size, requested, pool: 0 };
        }
        self.live.remove(&b.addr);
        self.free_block(i, Owner::Stream { stream, epoch })
    }

    /// Moves every cached block into the index, merging as a free would have.
    /// `done(stream, epoch)` says whether an event covering that free has completed: such a
    /// block is idle at once.
    pub(crate) fn flush_cached(&mut self, done: impl Fn(StreamId, Epoch) -> bool) {
        if self.cached_count == 0 {
            return;
        }
        let lists: Vec<BlockId> = self.cached.drain().collect();
        self.cached_count = 0;
        for i in lists {
            let b = self.blocks[i];
            let State::Cached { stream, epoch } = b.state else { unreachable!() };
            self.live.remove(&b.addr);
            let owner = if done(stream, epoch) { Owner::Idle } else { Owner::Stream { stream, epoch } };
            self.settle(i, owner);
        }
    }

    /// Frees the live block at `addr`, now owned by `owner`, merging it with free neighbours of
    /// the same pool that `owner`'s stream may use.
    pub(crate) fn free(&mut self, addr: u64, owner: Owner) -> Option<Freed> {
        let i = *self.live.get(&addr)?;
        if !matches!(self.blocks[i].state, State::Live { .. }) {
            return None;
        }
        self.live.remove(&addr);
        Some(self.free_block(i, owner))
    }

    /// [`free`](Self::free) of block `i`, already out of the live map.
    fn free_block(&mut self, i: BlockId, owner: Owner) -> Freed {
        let b = self.blocks[i];
        let State::Live { requested, .. } = b.state else { unreachable!("live map names a free block") };
        let freed = Freed { size: b.size, requested, pool: b.pool };
        self.blocks[i].state = State::Free(owner);
        self.settle(i, owner);
        freed
    }

    /// Indexes free block `i` with `owner`, merging it with neighbours it may share with.
    fn settle(&mut self, mut i: BlockId, mut owner: Owner) {
        let pool = self.blocks[i].pool;
        let prev = self.blocks[i].prev;
        if let Some(o) = self.mergeable(prev, pool, owner) {
            owner = o;
            self.unindex(prev);
            self.absorb(prev, i);
            i = prev;
        }
        let next = self.blocks[i].next;
        if let Some(o) = self.mergeable(next, pool, owner) {
            owner = o;
            self.unindex(next);
            self.absorb(i, next);
        }
        self.blocks[i].state = State::Free(owner);
        self.index(i);
    }

    /// The owner of `owner`'s block merged with block `j`, if they may merge: same pool, and `j`
    /// idle or freed on the same stream (the merged block is then as late as the later free).
    fn mergeable(&self, j: BlockId, pool: u32, owner: Owner) -> Option<Owner> {
        if j == NIL {
            return None;
        }
        let b = &self.blocks[j];
        let State::Free(other) = b.state else { return None };
        if b.pool != pool {
            return None;
        }
        match (owner, other) {
            (Owner::Idle, Owner::Idle) => Some(Owner::Idle),
            (Owner::Stream { stream, epoch }, Owner::Idle)
            | (Owner::Idle, Owner::Stream { stream, epoch }) => Some(Owner::Stream { stream, epoch }),
            (Owner::Stream { stream: a, epoch: x }, Owner::Stream { stream: b, epoch: y }) if a == b => {
                Some(Owner::Stream { stream: a, epoch: x.max(y) })
            }
            _ => None,
        }
    }

    /// Merges `hi` (the block after `lo`) into `lo`.
    fn absorb(&mut self, lo: BlockId, hi: BlockId) {
        let h = self.blocks[hi];
        self.blocks[lo].size += h.size;
        self.blocks[lo].next = h.next;
        if h.next != NIL {
            self.blocks[h.next].prev = lo;
        } else {
            self.last = lo;
        }
        self.spare.push(hi);
    }

    fn index(&mut self, i: BlockId) {
        let b = &self.blocks[i];
        if let State::Free(owner) = b.state {
            self.free.insert(FreeKey::of(owner, b, i));
        }
    }

    fn unindex(&mut self, i: BlockId) {
        let b = &self.blocks[i];
        if let State::Free(owner) = b.state {
            self.free.remove(&FreeKey::of(owner, b, i));
        }
    }

    fn slot(&mut self, b: Block) -> BlockId {
        match self.spare.pop() {
            Some(i) => {
                self.blocks[i] = b;
                i
            }
            None => {
                self.blocks.push(b);
                BlockId((self.blocks.len() - 1) as u32)
            }
        }
    }

    /// Makes every block freed on `stream` up to `epoch` idle. Returns how many moved.
    pub(crate) fn promote(&mut self, stream: StreamId, epoch: Epoch) -> usize {
        let due: Vec<BlockId> = self
            .free
            .range(FreeKey::range(stream, 0..=u32::MAX, 0))
            .filter(|k| matches!(self.blocks[k.id].state, State::Free(Owner::Stream { epoch: e, .. }) if e <= epoch))
            .map(|k| k.id)
            .collect();
        for &i in &due {
            self.unindex(i);
            self.settle(i, Owner::Idle);
        }
        due.len()
    }

    /// Free blocks of the shared pool freed on `stream` whose work may not have run yet, highest
    /// address first.
    pub(crate) fn stream_free(&self, stream: StreamId) -> Vec<PendingFree> {
        let mut v: Vec<PendingFree> = self
            .free
            .range(FreeKey::range(stream, 0..=0, 0))
            .filter_map(|k| match self.blocks[k.id].state {
                State::Free(Owner::Stream { epoch, .. }) => {
                    Some(PendingFree { id: k.id, addr: k.addr, size: k.size, epoch })
                }
                _ => None,
            })
            .collect();
        // Pages leave the top of the heap first: the holes they leave are where `find`, lowest
        // address first, looks last.
        v.sort_unstable_by_key(|f| std::cmp::Reverse(f.addr));
        v
    }

    /// Takes `[start, end)` of free block `id` (from [`stream_free`](Self::stream_free)) out of
    /// use, as a block of its own: its pages are being lent. The rest stays free as it was.
    pub(crate) fn lend(&mut self, id: BlockId, start: u64, end: u64) {
        let mut i = id;
        let b = self.blocks[i];
        let State::Free(Owner::Stream { stream, epoch }) = b.state else {
            unreachable!("only blocks freed on a stream are lent")
        };
        debug_assert!(b.addr <= start && start < end && end <= b.addr + b.size);
        self.unindex(i);
        if start > b.addr {
            let j = self.split(i, start - b.addr);
            self.index(i);
            i = j;
        }
        let b = self.blocks[i];
        if end < b.addr + b.size {
            let k = self.split(i, end - b.addr);
            self.index(k);
        }
        self.blocks[i].state = State::Lent { stream, epoch };
        self.lent.push(i);
    }

    /// The blocks beside block `i` that reach into `[lo, hi)`, before it then after it.
    fn beside(&self, i: BlockId, lo: u64, hi: u64) -> impl Iterator<Item = BlockId> + '_ {
        let step = move |j: BlockId, next: bool| {
            let b = &self.blocks[j];
            let k = if next { b.next } else { b.prev };
            let c = (k != NIL).then(|| &self.blocks[k])?;
            (if next { c.addr < hi } else { c.addr + c.size > lo }).then_some(k)
        };
        let before = std::iter::successors(step(i, false), move |&j| step(j, false));
        before.chain(std::iter::successors(step(i, true), move |&j| step(j, true)))
    }

    /// Whether every byte of `[lo, hi)` outside the live block at `addr` lies in free blocks of
    /// the shared pool that `stream` may take now (its own or idle ones), or past the used part
    /// and inside the heap: the rest of a page that the block partly covers.
    pub(crate) fn edges_claimable(&self, addr: u64, lo: u64, hi: u64, stream: StreamId) -> bool {
        let Some(&i) = self.live.get(&addr) else { return false };
        let ok = |j: BlockId| {
            let b = &self.blocks[j];
            b.pool == 0
                && match b.state {
                    State::Free(Owner::Idle) => true,
                    State::Free(Owner::Stream { stream: s, .. }) => s == stream,
                    _ => false,
                }
        };
        hi <= self.base + self.size && self.beside(i, lo, hi).all(ok)
    }

    /// Makes the free bytes of `[lo, hi)` around the live block at `addr` (checked with
    /// [`edges_claimable`](Self::edges_claimable)) `stream`'s until an event numbered `epoch` or
    /// later has completed, extending the used part up to `hi` if it ends before: the page under
    /// them was lent, so it may still be in use where it came from by that stream's queued work.
    pub(crate) fn claim_edges(&mut self, addr: u64, lo: u64, hi: u64, stream: StreamId, epoch: Epoch) {
        let i = self.live[&addr];
        if hi > self.top {
            let owner = Owner::Stream { stream, epoch };
            let t = self.slot(Block {
                addr: self.top,
                size: hi - self.top,
                prev: self.last,
                next: NIL,
                pool: 0,
                state: State::Free(owner),
            });
            self.blocks[self.last].next = t;
            self.last = t;
            self.top = hi;
            self.settle(t, owner);
        }
        // Each re-owned block may merge with its neighbours, so the walk starts over after each.
        let claimed = |b: &Block| matches!(b.state, State::Free(Owner::Stream { stream: s, epoch: e }) if s == stream && e >= epoch);
        loop {
            let due = self.beside(i, lo, hi).find(|&j| !claimed(&self.blocks[j]));
            let Some(due) = due else { return };
            let State::Free(old) = self.blocks[due].state else { unreachable!("checked claimable") };
            let e = match old {
                Owner::Stream { epoch: e, .. } => e.max(epoch),
                Owner::Idle => epoch,
            };
            self.unindex(due);
            self.settle(due, Owner::Stream { stream, epoch: e });
        }
    }

    /// Cuts block `i` (not indexed) after `at` bytes; the part after, in the same state and pool,
    /// becomes a new block (not indexed), whose id is returned.
    fn split(&mut self, i: BlockId, at: u64) -> BlockId {
        let b = self.blocks[i];
        debug_assert!(at > 0 && at < b.size && at % ALIGN == 0);
        let rest = self.slot(Block {
            addr: b.addr + at,
            size: b.size - at,
            prev: i,
            next: b.next,
            pool: b.pool,
            state: b.state,
        });
        if b.next != NIL {
            self.blocks[b.next].prev = rest;
        } else {
            self.last = rest;
        }
        self.blocks[i].next = rest;
        self.blocks[i].size = at;
        rest
    }

    /// Frees, idle, the lent blocks of `stream` up to `epoch`. Returns their addresses, whose
    /// lent pages the caller unmaps first.
    pub(crate) fn return_lent(&mut self, stream: StreamId, epoch: Epoch) -> Vec<u64> {
        let mut due = Vec::new();
        self.lent.retain(|&i| {
            let State::Lent { stream: s, epoch: e } = self.blocks[i].state else { unreachable!() };
            let hit = s == stream && e <= epoch;
            if hit {
                due.push(i);
            }
            !hit
        });
        due.iter()
            .map(|&i| {
                let addr = self.blocks[i].addr;
                self.settle(i, Owner::Idle);
                addr
            })
            .collect()
    }

    /// Moves every free block of graph pools into the shared pool, each owned as it was; live
    /// blocks of those pools join the shared pool when freed (`pool_of` then says 0).
    pub(crate) fn dissolve_pools(&mut self) -> u64 {
        let due: Vec<BlockId> = self.free.iter().filter(|k| k.pool != 0).map(|k| k.id).collect();
        let mut bytes = 0;
        for &i in &due {
            self.unindex(i);
            self.blocks[i].pool = 0;
            bytes += self.blocks[i].size;
            let State::Free(owner) = self.blocks[i].state else { unreachable!() };
            self.settle(i, owner);
        }
        for &i in self.live.values() {
            self.blocks[i].pool = 0;
        }
        self.graph = 0;
        bytes
    }

    /// Page indexes (pages of `page` bytes from `base`) lying wholly inside idle free blocks of the
    /// shared pool, in address order.
    pub(crate) fn idle_pages(&self, page: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut tail = self.top;
        for k in self.free.range(FreeKey::range(IDLE, 0..=0, 0)) {
            let b = &self.blocks[k.id];
            if b.addr + b.size == self.top {
                // It runs on into the never-used part: a page across the boundary is idle too.
                tail = b.addr;
                continue;
            }
            let first = (b.addr - self.base).div_ceil(page);
            let end = (b.addr + b.size - self.base) / page;
            out.extend(first..end);
        }
        // Past `top` nothing was ever handed out, so nothing is mapped there: only the pages from
        // the idle end of the used part up to `top` can be.
        let first = (tail - self.base).div_ceil(page);
        out.extend(first..(self.top - self.base).div_ceil(page));
        out.sort_unstable();
        out
    }

    /// Checks the structure's invariants (tests only call this).
    #[cfg(test)]
    pub(crate) fn check(&self) {
        let mut at = self.base;
        let mut i = if self.top == self.base { NIL } else { self.first() };
        let mut prev = NIL;
        let (mut free, mut live, mut cached, mut lent, mut graph) = (0, 0, 0, 0, 0);
        while i != NIL {
            let b = &self.blocks[i];
            assert_eq!(b.addr, at, "blocks are contiguous");
            assert_eq!(b.prev, prev);
            assert!(b.size > 0 && b.size % ALIGN == 0);
            if b.pool != 0 {
                graph += b.size;
            }
            match b.state {
                State::Free(Owner::Stream { stream, epoch })
                | State::Cached { stream, epoch }
                | State::Lent { stream, epoch } => {
                    assert!(
                        stream != IDLE && epoch != Epoch::NONE,
                        "{:?} at {:#x}: no such stream or stamp",
                        b.state,
                        b.addr
                    );
                }
                State::Free(Owner::Idle) | State::Live { .. } => {}
            }
            match b.state {
                State::Free(o) => {
                    free += 1;
                    assert!(self.free.contains(&FreeKey::of(o, b, i)));
                    if prev != NIL {
                        let p = &self.blocks[prev];
                        if p.pool == b.pool {
                            if let State::Free(po) = p.state {
                                assert!(
                                    self.mergeable(prev, b.pool, o).is_none(),
                                    "neighbours {po:?} and {o:?} should have merged"
                                );
                            }
                        }
                    }
                }
                State::Live { .. } => {
                    live += 1;
                    assert_eq!(self.live.get(&b.addr), Some(&i));
                }
                State::Lent { .. } => {
                    lent += 1;
                    assert!(self.lent.contains(&i));
                }
                State::Cached { .. } => {
                    cached += 1;
                    assert_eq!(self.live.get(&b.addr), Some(&i));
                }
            }
            at += b.size;
            prev = i;
            i = b.next;
        }
        assert_eq!(at, self.top);
        assert_eq!(free, self.free.len());
        assert_eq!(cached, self.cached_count);
        assert_eq!(cached, self.cached.len());
        for ((stream, size), &j) in self.cached.entries() {
            let b = &self.blocks[j];
            assert!(
                matches!(b.state, State::Cached { stream: s, .. } if s == stream) && b.size == size,
                "the cache of {stream:?} for {size} bytes holds {:?} of {} bytes",
                b.state,
                b.size
            );
        }
        assert_eq!(live + cached, self.live.len(), "the map holds live and cached blocks only");
        assert_eq!(lent, self.lent.len(), "the lent list holds lent blocks only");
        assert_eq!(graph, self.graph, "graph bytes are the blocks of graph pools");
        assert_eq!(prev, self.last);
    }

    /// (address, size, state) of every block in address order, and `top` (tests only).
    #[cfg(test)]
    pub(crate) fn blocks_in_order(&self) -> (Vec<(u64, u64, State)>, u64) {
        let mut v = Vec::new();
        let mut i = if self.top == self.base { NIL } else { self.first() };
        while i != NIL {
            let b = &self.blocks[i];
            v.push((b.addr, b.size, b.state));
            i = b.next;
        }
        (v, self.top)
    }

    #[cfg(test)]
    fn first(&self) -> BlockId {
        let mut i = self.last;
        while self.blocks[i].prev != NIL {
            i = self.blocks[i].prev;
        }
        i
    }
}

#[cfg(test)]
mod tests {
    use super::super::ids::Handle;
    use super::*;

    const S: StreamId = StreamId(10);
    const T: StreamId = StreamId(20);

    fn alloc(h: &mut Heap, size: u64, stream: StreamId) -> u64 {
        let caller = Caller { id: stream, raw: Handle(stream.0) };
        match h.find(0, stream, size) {
            Some((_, id)) => h.take(id, size, caller, size, 0),
            None => h.carve(size, caller, size, 0, stream).expect("space"),
        }
    }

    #[test]
    fn a_block_freed_on_a_stream_is_reused_there_and_not_elsewhere_until_idle() {
        let mut h = Heap::new(1 << 20, 1 << 20);
        let a = alloc(&mut h, 4096, S);
        h.free(a, Owner::Stream { stream: S, epoch: Epoch(1) });
        assert_eq!(h.find(0, T, 4096), None, "another stream must not see it");
        assert_eq!(h.find(0, S, 4096).map(|(a, _)| a), Some(a));
        assert_eq!(h.promote(S, Epoch(0)), 0, "epoch 0 does not cover a free at epoch 1");
        assert_eq!(h.promote(S, Epoch(1)), 1);
        assert_eq!(h.find(0, T, 4096).map(|(a, _)| a), Some(a));
        h.check();
    }

    #[test]
    fn neighbours_merge_only_when_the_result_is_safe_for_its_owner() {
        let mut h = Heap::new(0, 1 << 20);
        let a = alloc(&mut h, 512, S);
        let b = alloc(&mut h, 512, S);
        let c = alloc(&mut h, 512, S);
        h.free(a, Owner::Stream { stream: S, epoch: Epoch(1) });
        h.free(c, Owner::Stream { stream: T, epoch: Epoch(1) });
        h.check();
        // b between a (S) and c (T): freed on S it merges with a only.
        h.free(b, Owner::Stream { stream: S, epoch: Epoch(2) });
        h.check();
        assert_eq!(h.find(0, S, 1024).map(|(x, _)| x), Some(a));
        assert_eq!(h.find(0, S, 1536), None);
        // Once both are idle everything is one block.
        h.promote(S, Epoch(2));
        h.promote(T, Epoch(1));
        h.check();
        assert_eq!(h.find(0, StreamId(99), 1536).map(|(x, _)| x), Some(a));
    }

    #[test]
    fn the_lowest_block_that_fits_wins_among_own_and_idle_and_splits() {
        let mut h = Heap::new(0, 1 << 20);
        let big = alloc(&mut h, 8192, S);
        let _sep = alloc(&mut h, 512, S);
        let small = alloc(&mut h, 2048, T);
        let _sep2 = alloc(&mut h, 512, S);
        let high = alloc(&mut h, 2048, S);
        let _sep3 = alloc(&mut h, 512, S);
        h.free(high, Owner::Idle);
        h.free(small, Owner::Idle);
        // Both idle blocks fit 1 KiB exactly as well; the lower one wins, and S's own block,
        // lower still, wins over both once it is free.
        assert_eq!(h.find(0, S, 1024).map(|(x, _)| x), Some(small));
        h.free(big, Owner::Stream { stream: S, epoch: Epoch(1) });
        assert_eq!(h.find(0, S, 1024).map(|(x, _)| x), Some(big));
        assert_eq!(h.find(0, T, 1024).map(|(x, _)| x), Some(small), "S's block is not T's to take");
        let (_, id) = h.find(0, S, 4096).unwrap();
        assert_eq!(h.take(id, 4096, Caller { id: S, raw: Handle(S.0) }, 4000, 0), big);
        h.check();
        // The rest of the split keeps its owner.
        assert_eq!(h.find(0, T, 4096), None);
        assert_eq!(h.find(0, S, 4096).map(|(x, _)| x), Some(big + 4096));
    }

    #[test]
    fn graph_pools_are_kept_apart_until_dissolved() {
        let mut h = Heap::new(0, 1 << 20);
        let g = h.carve(4096, Caller { id: S, raw: Handle(S.0) }, 4096, 7, S).unwrap();
        h.free(g, Owner::Idle);
        assert_eq!(h.find(0, S, 512), None);
        assert_eq!(h.find(7, S, 512).map(|(x, _)| x), Some(g));
        assert_eq!(h.idle_pages(4096), Vec::<u64>::new(), "a graph pool's free page is not idle");
        assert_eq!(h.dissolve_pools(), 4096);
        assert_eq!(h.find(0, S, 512).map(|(x, _)| x), Some(g));
        assert_eq!(h.idle_pages(4096), vec![0], "dissolved, it is");
        h.check();
    }

    #[test]
    fn idle_pages_are_whole_pages_inside_idle_blocks_and_never_past_the_used_end() {
        let page = 4096;
        let mut h = Heap::new(0, 4 * page);
        let a = alloc(&mut h, page + 512, S); // pages 0, 1 (part)
        let b = alloc(&mut h, page, S); // pages 1 (part), 2 (part); page 3 never used
        assert_eq!(h.idle_pages(page), Vec::<u64>::new());
        h.free(a, Owner::Idle);
        assert_eq!(h.idle_pages(page), vec![0]);
        // b freed on S merges with idle a: the whole is S's until an event covers it.
        h.free(b, Owner::Stream { stream: S, epoch: Epoch(1) });
        assert_eq!(h.idle_pages(page), Vec::<u64>::new());
        h.promote(S, Epoch(1));
        assert_eq!(h.idle_pages(page), vec![0, 1, 2]);
        h.check();
    }

    /// The checker can fail: free neighbours left apart where they should have merged, and a
    /// graph count that the blocks do not add up to.
    #[test]
    #[should_panic(expected = "should have merged")]
    fn the_checker_finds_free_neighbours_left_apart() {
        let mut h = Heap::new(0, 1 << 20);
        let a = alloc(&mut h, 512, S);
        let b = alloc(&mut h, 512, S);
        h.free(a, Owner::Idle);
        h.check();
        // Freed behind the heap's back: indexed, not merged.
        let i = h.live.remove(&b).unwrap();
        h.blocks[i].state = State::Free(Owner::Idle);
        h.index(i);
        h.check();
    }

    #[test]
    #[should_panic(expected = "graph bytes")]
    fn the_checker_finds_graph_bytes_the_blocks_do_not_hold() {
        let mut h = Heap::new(0, 1 << 20);
        h.carve(4096, Caller { id: S, raw: Handle(S.0) }, 4096, 7, S).unwrap();
        h.check();
        h.graph += ALIGN;
        h.check();
    }

    #[test]
    fn freeing_an_unknown_or_already_freed_address_is_refused() {
        let mut h = Heap::new(0, 1 << 20);
        let a = alloc(&mut h, 512, S);
        assert!(h.free(a + 512, Owner::Idle).is_none());
        assert_eq!(h.free(a, Owner::Idle), Some(Freed { size: 512, requested: 512, pool: 0 }));
        assert!(h.free(a, Owner::Idle).is_none());
        h.check();
    }
}
