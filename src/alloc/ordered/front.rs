//! Each stream's front: the blocks handed out on it and the blocks it freed, kept whole for its
//! next request of the same size, behind a lock of its own. A request served by such a block,
//! and a free through the handle its block was allocated with, take that lock alone, so threads
//! each on their own stream do not wait for one another; everything else goes through the
//! device-wide [`Core`](super::core::Core).
//!
//! # Why it is sound
//!
//! * A block in a front's cache was freed on that front's stream and is handed out again only on
//!   that stream (fronts are keyed by the driver's stream id, never reused), which runs the new
//!   work after the work queued before the free: what the allocator has always allowed.
//! * A free is attributed to the front whose block it is, and only when it passes that front's
//!   handle (the handle the block was allocated with): the stream itself, or a destroyed one
//!   whose id nothing uses again. A free that passes another handle, or a block the front it
//!   finds does not hold (a destroyed stream's handle reused by a new stream), goes to the core,
//!   which asks the driver.
//! * Each free is stamped with the front's `next` under its lock; the core reads and advances
//!   `next` under the same lock in the same critical section as it records an event on the
//!   stream (or finds the stream idle, or begins a wait for the whole device). So a free stamped
//!   `e` happened before event `e` was recorded, and event `e` covers it; a free after the record
//!   is stamped `e + 1`.
//! * Cached blocks go to the shared index only through the core ([`Core::flush_cached`]), which
//!   drains, before it searches for free space, the requesting stream's front (for a small
//!   request, its larger blocks only, the rest if the search fails) and the idle blocks of every
//!   other front, and every front before it takes new memory, waits for the device, sleeps,
//!   exports or releases graph memory: a block cached in a front is idle for others only once
//!   an event covering its stamp has completed, as for blocks the core frees itself. A block
//!   that stays in its front through a search is still only its stream's.
//! * Lock order: the core, then a front. The fast paths hold one front lock and call nothing else.
//!
//! The cost a fast path may add is a thread-local look-up, an uncontended lock (one atomic swap
//! and a store: see `front_lock.rs`) and a hash look-up or two; the core's lock is taken only by
//! requests that find no cached block, frees after another stream found memory short (one per
//! stream, to record the event the others wait for), tagged or captured requests, and the calls
//! that look at the whole device.
//!
//! [`Core::flush_cached`]: super::core::Core::flush_cached

use super::front_lock::{FrontGuard, FrontLock};
use super::heap::{AddrMap, KeyedLists};
use super::ids::{Epoch, Handle, SlotId, StreamId};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A block handed out on a front's stream, live or freed and cached there.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    /// Bytes of the block (a multiple of the alignment).
    pub n: u64,
    /// Bytes asked for by the allocation holding it.
    pub requested: u64,
    /// The core's heap slot it lies in.
    pub slot: SlotId,
    /// Freed and cached (else live).
    pub cached: bool,
    /// Its frees go through the core (the block is shared with another process).
    pub via_core: bool,
}

/// What the fast paths counted since the core last took them in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub allocations: u64,
    pub frees: u64,
    /// Bytes handed out minus bytes freed.
    pub live: i64,
    /// The highest and the lowest `live` reached (from 0): a front keeps small blocks through
    /// the core's searches, so what it hands out again may raise the peak between them.
    pub live_max: i64,
    pub live_min: i64,
    pub requested: i64,
}

pub(crate) struct State {
    /// Taken out of the registry by the core: fast paths that still hold it go to the core.
    pub retired: bool,
    /// Number of the next event recorded on the stream; a free stamped with it is covered by it.
    pub next: Epoch,
    /// Stamp of the latest free, `NONE` for none.
    pub last_free: Epoch,
    /// The demand (see [`Fronts::demand`]) when the core last recorded an event here for others,
    /// or found the stream idle: when demand has moved since, a free goes to the core.
    pub seen_demand: u64,
    /// Blocks handed out on the stream and not yet back in the core, by address.
    pub blocks: AddrMap<Entry>,
    /// The cached blocks, (address, stamp) per size.
    cache: KeyedLists<u64, (u64, Epoch)>,
    pub counts: Counts,
}

/// One stream's front. Aligned to two cache lines, so that the fronts of threads running side by
/// side share none: two threads locking mutexes of their own in one cache line slow each other's
/// locks several times over (docs/DECISIONS.md, "A front per stream").
#[repr(align(128))]
pub(crate) struct Front {
    /// The driver's stream id (or the allocator's own identity, see `Caller`).
    pub id: StreamId,
    /// The handle the stream's calls pass (one per stream while it lives).
    pub raw: Handle,
    /// Set with `State::retired`, read without the lock: a thread's memo then looks in the
    /// registry again (the locked flag is what keeps a retired front unused).
    gone: AtomicBool,
    state: FrontLock<State>,
}

impl Front {
    pub(crate) fn new(id: StreamId, raw: Handle) -> Front {
        Front {
            id,
            raw,
            gone: AtomicBool::new(false),
            state: FrontLock::new(State {
                retired: false,
                next: Epoch::FIRST,
                last_free: Epoch::NONE,
                seen_demand: 0,
                blocks: AddrMap::default(),
                cache: KeyedLists::default(),
                counts: Counts::default(),
            }),
        }
    }

    pub(crate) fn lock(&self) -> FrontGuard<'_, State> {
        self.state.lock()
    }

    /// A block of `n` bytes the stream freed, handed out again for `requested` bytes.
    fn take(&self, n: u64, requested: u64) -> Option<u64> {
        let mut s = self.lock();
        if s.retired {
            return None;
        }
        let (addr, _) = s.cache.list(n, false)?.pop()?;
        let e = s.blocks.get_mut(&addr).expect("a cached block is in the front's map");
        e.cached = false;
        e.requested = requested;
        let c = &mut s.counts;
        c.allocations += 1;
        c.live += n as i64;
        c.live_max = c.live_max.max(c.live);
        c.requested += requested as i64;
        Some(addr)
    }

    /// Frees the live block at `addr` into the cache, stamped with the next event's number, when
    /// it is this front's and nothing asks for the core (see [`Fronts::give`]).
    fn give(&self, addr: u64, demand: u64) -> bool {
        let mut guard = self.lock();
        let s = &mut *guard;
        if s.retired || s.seen_demand != demand {
            return false;
        }
        if !matches!(s.blocks.get(&addr), Some(e) if !e.cached && !e.via_core) {
            return false;
        }
        s.cache_free(addr).is_some()
    }
}

/// The entries of `cached` blocks (address, stamp), taken out of `blocks`: (address, stamp,
/// entry).
fn take_entries(
    blocks: &mut AddrMap<Entry>,
    cached: impl IntoIterator<Item = (u64, Epoch)>,
) -> Vec<(u64, Epoch, Entry)> {
    cached
        .into_iter()
        .map(|(addr, epoch)| {
            (addr, epoch, blocks.remove(&addr).expect("a cached block is in the front's map"))
        })
        .collect()
}

impl State {
    /// Frees the live block at `addr` into the cache, for the fast path ([`Front::give`]) and the
    /// core's alike: stamped with the next event's number, the stream's latest free, and counted
    /// in the front's counts, which the core takes in. Its entry, or `None`, changing nothing,
    /// when the block is not the front's or the cache of its size is full.
    pub(crate) fn cache_free(&mut self, addr: u64) -> Option<Entry> {
        let epoch = self.next;
        let e = self.blocks.get_mut(&addr)?;
        if !self.cache.push(e.n, (addr, epoch)) {
            return None;
        }
        e.cached = true;
        e.via_core = false;
        let e = *e;
        self.last_free = epoch;
        let c = &mut self.counts;
        c.frees += 1;
        c.live -= e.n as i64;
        c.live_min = c.live_min.min(c.live);
        c.requested -= e.requested as i64;
        Some(e)
    }

    /// Every cached block, taken out: (address, stamp, entry).
    pub(crate) fn drain(&mut self) -> Vec<(u64, Epoch, Entry)> {
        take_entries(&mut self.blocks, self.cache.drain())
    }

    /// The cached blocks of more than `n` bytes, taken out: (address, stamp, entry).
    pub(crate) fn drain_above(&mut self, n: u64) -> Vec<(u64, Epoch, Entry)> {
        take_entries(&mut self.blocks, self.cache.take_where(|&size| size > n))
    }

    /// The cached blocks stamped `done` or earlier (an event after their free has completed),
    /// taken out: (address, stamp, entry).
    pub(crate) fn drain_done(&mut self, done: Epoch) -> Vec<(u64, Epoch, Entry)> {
        let mut due = Vec::new();
        for list in self.cache.lists_mut() {
            list.retain(|&(addr, epoch)| {
                let idle = epoch <= done;
                if idle {
                    due.push((addr, epoch));
                }
                !idle
            });
        }
        take_entries(&mut self.blocks, due)
    }

    /// Whether the front holds no block, live or cached.
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Checks that the cache and the map of blocks agree, and that every stamp is one the stream
    /// has given out (tests only call this).
    #[cfg(test)]
    pub(crate) fn check(&self) {
        assert!(self.last_free <= self.next, "latest free {:?} past next {:?}", self.last_free, self.next);
        let mut cached = 0;
        for (n, &(addr, stamp)) in self.cache.entries() {
            let e = self.blocks.get(&addr).expect("a cached block is in the front's map");
            assert!(e.cached && e.n == n, "{addr:#x} cached for {n} bytes is {e:?}");
            assert!(
                stamp != Epoch::NONE && stamp <= self.last_free,
                "{addr:#x} stamped {stamp:?}, the latest free {:?}",
                self.last_free
            );
            cached += 1;
        }
        assert_eq!(
            cached,
            self.blocks.values().filter(|e| e.cached).count(),
            "every cached entry is in the cache"
        );
    }
}

/// The fronts of one allocator, by stream id and by handle, and what the fast paths share with
/// the core.
pub(crate) struct Fronts {
    /// Tells this allocator's entries in the thread-local memo from another's.
    key: u64,
    by_id: Apart<RwLock<AddrMap<Arc<Front>>>>,
    by_raw: Apart<RwLock<AddrMap<Arc<Front>>>>,
    /// Requests that found no cached block, so far: a stream with frees that no event covers
    /// records one at its next free when this moved since (see `Core::free`). Only the core
    /// writes it, under its lock; a fast free that reads an old value leaves its block to a later
    /// event or a device-wide wait, which costs memory for a while, never soundness.
    demand: Apart<AtomicU64>,
}

/// A value on cache lines of its own: the fast paths read `key` and `demand` on every call, while
/// the registry's locks are written whenever a thread looks a front up there.
#[repr(align(128))]
struct Apart<T>(T);

static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// Fronts this thread used last (a thread may drive a few streams in turn), as (allocator,
/// stream id or handle, front), the latest first.
type Recent = [Option<(u64, u64, Arc<Front>)>; MEMO_WAYS];

const MEMO_WAYS: usize = 4;

/// The fronts this thread used last, for requests (by stream id) and for frees (by handle).
struct Memo {
    take: Recent,
    give: Recent,
}

thread_local! {
    static MEMO: RefCell<Memo> =
        const { RefCell::new(Memo { take: [None, None, None, None], give: [None, None, None, None] }) };
}

impl Default for Fronts {
    fn default() -> Self {
        Fronts {
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
            by_id: Apart(RwLock::new(AddrMap::default())),
            by_raw: Apart(RwLock::new(AddrMap::default())),
            demand: Apart(AtomicU64::new(0)),
        }
    }
}

impl Fronts {
    pub(crate) fn demand(&self) -> u64 {
        self.demand.0.load(Ordering::Relaxed)
    }

    /// One more request found no cached block (the core, under its lock).
    pub(crate) fn add_demand(&self) {
        self.demand.0.fetch_add(1, Ordering::Relaxed);
    }

    /// Makes `front` what the fast paths find for its id and handle.
    pub(crate) fn publish(&self, front: &Arc<Front>) {
        self.by_id.0.write().unwrap_or_else(|e| e.into_inner()).insert(front.id.0, front.clone());
        self.by_raw.0.write().unwrap_or_else(|e| e.into_inner()).insert(front.raw.0, front.clone());
    }

    /// Takes `front` (already marked retired) out of the registry.
    pub(crate) fn withdraw(&self, front: &Arc<Front>) {
        front.gone.store(true, Ordering::Relaxed);
        for (map, k) in [(&self.by_id.0, front.id.0), (&self.by_raw.0, front.raw.0)] {
            let mut m = map.write().unwrap_or_else(|e| e.into_inner());
            if m.get(&k).is_some_and(|f| Arc::ptr_eq(f, front)) {
                m.remove(&k);
            }
        }
    }

    /// A block of `n` bytes that stream `id` freed with that size, handed out again to it for
    /// `requested` bytes; `None` when it has none (the core serves the request).
    pub(crate) fn take(&self, id: StreamId, n: u64, requested: u64) -> Option<u64> {
        self.with(id.0, true, |f| f.take(n, requested))
    }

    /// Frees the block at `addr` on the stream whose handle is `raw` without the core, when it is
    /// a live block of the front of that handle and that front's stream has nothing to do for the
    /// others (no request found memory short since its last event). False: the core must free it.
    pub(crate) fn give(&self, addr: u64, raw: Handle) -> bool {
        let demand = self.demand();
        self.with(raw.0, false, |f| f.give(addr, demand))
    }

    /// Runs `op` on the front of `key` (a stream id when `by_id`, else a handle): the one this
    /// thread used last for the same purpose, or the registry's.
    fn with<R: Default>(&self, key: u64, by_id: bool, op: impl FnOnce(&Front) -> R) -> R {
        let mut op = Some(op);
        let memo = MEMO.try_with(|m| {
            let mut m = m.borrow_mut();
            let recent = if by_id { &mut m.take } else { &mut m.give };
            let hit = recent.iter().position(|e| {
                e.as_ref()
                    .is_some_and(|(k, x, f)| *k == self.key && *x == key && !f.gone.load(Ordering::Relaxed))
            });
            match hit {
                Some(0) => {}
                Some(i) => recent[..=i].rotate_right(1),
                None => {
                    let f = self.find(key, by_id)?;
                    recent.rotate_right(1);
                    recent[0] = Some((self.key, key, f));
                }
            }
            let (.., f) = recent[0].as_ref().expect("just placed");
            Some((op.take().expect("once"))(f))
        });
        match memo {
            Ok(Some(r)) => r,
            Ok(None) => R::default(),
            // The thread is ending: the registry alone.
            Err(_) => match (self.find(key, by_id), op) {
                (Some(f), Some(op)) => op(&f),
                _ => R::default(),
            },
        }
    }

    fn find(&self, key: u64, by_id: bool) -> Option<Arc<Front>> {
        let map = if by_id { &self.by_id.0 } else { &self.by_raw.0 };
        map.read().unwrap_or_else(|e| e.into_inner()).get(&key).cloned()
    }
}
