//! The allocator's entry points ([`Ordered`]) from several threads, each on its own streams,
//! against the model GPU behind the allocator's lock: the model fails the test on any block
//! handed to a stream while another stream's queued work still uses it.

use super::*;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc;

/// A block a thread holds: (address, bytes handed out, bytes asked for, stream id, handle).
type Block = (u64, u64, u64, u64, u64);

/// The shared world: the allocator over the model, and every live block of every thread.
struct World {
    alloc: Ordered<Gpu>,
    held: Mutex<Vec<Block>>,
    /// Allocations and frees made, by all threads.
    allocations: AtomicU64,
    frees: AtomicU64,
}

impl World {
    fn new(page_limit: usize) -> World {
        World {
            alloc: Ordered::new(core(page_limit)),
            held: Mutex::new(Vec::new()),
            allocations: AtomicU64::new(0),
            frees: AtomicU64::new(0),
        }
    }

    /// Allocates on stream `id` (handle `raw`) and checks, as the single-threaded helper does,
    /// that no other stream's queued work uses the block and that it overlaps no live block; then
    /// queues a use of it on the stream.
    fn alloc(&self, size: u64, id: u64, raw: u64) -> Option<u64> {
        IN_CALL.set(Some(raw));
        let wait = || self.alloc.core().backend().synchronize().is_ok();
        let r = self.alloc.allocate(size, Handle(raw), Some(StreamId(id)), Capture::None, None, wait);
        IN_CALL.set(None);
        let addr = handed_out(r)?;
        let n = size.div_ceil(ALIGN) * ALIGN;
        let mut core = self.alloc.core();
        let gpu = core.backend();
        gpu.check_new_block(addr, n, id, Some(id));
        gpu.queues.entry(id).or_default().push_back(Op::Use { addr, len: n });
        let mut held = lock(&self.held);
        for &(a, m, ..) in held.iter() {
            assert!(addr + n <= a || a + m <= addr, "{addr:#x}+{n} overlaps a live block at {a:#x}+{m}");
        }
        held.push((addr, n, size, id, raw));
        drop(held);
        drop(core);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Some(addr)
    }

    /// Frees `addr` through handle `raw`.
    fn free(&self, addr: u64, raw: u64) {
        {
            let mut held = lock(&self.held);
            let k = held.iter().position(|b| b.0 == addr).expect("a live block");
            held.swap_remove(k);
        }
        IN_CALL.set(Some(raw));
        self.alloc.free(addr, Handle(raw)).expect("free of a live block");
        IN_CALL.set(None);
        self.frees.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs up to `ops` operations queued on stream `id`, as the device would.
    fn run(&self, id: u64, ops: usize) {
        self.alloc.core().backend().run(id, ops);
    }

    /// Counters against what the threads did and hold.
    fn check_stats(&self) {
        let held = lock(&self.held).clone();
        let s = self.alloc.core().stats();
        assert_eq!(s.allocations, self.allocations.load(Ordering::Relaxed), "{s:?}");
        assert_eq!(s.frees, self.frees.load(Ordering::Relaxed), "{s:?}");
        assert_eq!(s.live, held.iter().map(|b| b.1).sum::<u64>(), "{s:?}");
        assert_eq!(s.requested, held.iter().map(|b| b.2).sum::<u64>(), "{s:?}");
        assert!(s.live_peak >= s.live);
    }
}

/// A small random generator, one per thread (the interleaving varies anyway).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Threads of the stress test, each on its own streams.
const THREADS: u64 = 4;
const SIZES: [u64; 5] = [512, 4096, 3 * 4096, SMALL, 3 * PAGE + 512];

/// One thread's work: its own stream (a new one each round, on the same handle, as a driver that
/// hands a destroyed stream's handle to the next new stream does), allocating and freeing,
/// letting the device run some of its work, and handing some blocks to the next thread, which
/// frees them on its own stream once this stream's work on them has run (as an event waited on
/// would order it).
fn worker(
    w: &World,
    t: u64,
    threads: u64,
    seed: u64,
    give: mpsc::Sender<(u64, u64)>,
    take: mpsc::Receiver<(u64, u64)>,
) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let raw = t + 1;
    let mut mine: Vec<(u64, u64)> = Vec::new();
    for round in 0..4 {
        let id = 100 * (round + 1) + t;
        w.alloc.core().backend().handles.insert(raw, id);
        for _ in 0..300 {
            match rng.below(10) {
                0..=3 => {
                    let size = SIZES[rng.below(SIZES.len() as u64) as usize];
                    if let Some(a) = w.alloc(size, id, raw) {
                        mine.push((a, id));
                    }
                }
                4..=6 if !mine.is_empty() => {
                    let (a, _) = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                    w.free(a, raw);
                }
                7 => w.run(id, rng.below(4) as usize),
                8 if !mine.is_empty() && threads > 1 => {
                    let (a, made_on) = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                    let _ = give.send((a, made_on));
                }
                _ => {
                    while let Ok((a, made_on)) = take.try_recv() {
                        // Ordered after the maker's work, used here, freed here.
                        w.run(made_on, usize::MAX);
                        w.alloc
                            .core()
                            .backend()
                            .queues
                            .entry(id)
                            .or_default()
                            .push_back(Op::Use { addr: a, len: 512 });
                        w.free(a, raw);
                    }
                }
            }
        }
        // The stream is destroyed with work queued; some of its blocks live on, freed later
        // through the handle the next stream has.
        if round == 3 {
            for (a, _) in mine.drain(..) {
                w.free(a, raw);
            }
        }
    }
    // Blocks still on their way from the previous thread are freed by the device-wide path.
    drop(give);
    std::thread::sleep(std::time::Duration::from_millis(1));
    while let Ok((a, made_on)) = take.try_recv() {
        w.run(made_on, usize::MAX);
        w.free(a, raw);
    }
}

fn run_threads(w: &World, threads: u64, seed: u64) {
    let (mut senders, mut receivers): (Vec<_>, Vec<_>) = (0..threads).map(|_| mpsc::channel()).unzip();
    // Thread t gives to thread t + 1.
    receivers.rotate_right(1);
    std::thread::scope(|s| {
        for t in 0..threads {
            let give = senders.remove(0);
            let take = receivers.remove(0);
            s.spawn(move || worker(w, t, threads, seed + t, give, take));
        }
    });
}

/// Threads on their own streams, handing blocks to one another, destroying streams between
/// rounds: no block is ever handed to a stream while another's work still uses it (the model
/// fails the test), and the counters add up to what the threads did.
#[test]
fn threads_on_their_own_streams_never_get_a_block_another_streams_work_still_uses() {
    for seed in 1..=6 {
        let w = World::new(400);
        run_threads(&w, THREADS, seed * 1000);
        w.check_stats();
        // Whatever is left: every thread's blocks were freed or handed on and freed.
        let left = lock(&w.held).clone();
        for (a, .., raw) in left {
            w.free(a, raw);
        }
        w.check_stats();
        assert_eq!(w.alloc.core().stats().live, 0);
        // The fronts went back: after a device-wide wait everything is idle and reusable.
        let mut core = w.alloc.core();
        core.empty_cache().unwrap();
        assert_eq!(core.stats().mapped, 0, "every page went back once idle");
    }
}

/// A free through the front is stamped with the number of the stream's next event: the event
/// recorded before it does not cover it. With a stale stamp, the block would become idle when
/// that earlier event completed, while the use queued after it still runs, and go to another
/// stream (the model fails the test).
#[test]
fn a_fast_free_after_an_event_is_not_covered_by_that_event() {
    let w = World::new(1000);
    let (s, t) = (1, 2);
    // S's first request found no block (demand moved): its first free goes through the core,
    // which records an event after it, S being busy.
    let a = w.alloc(4096, s, s).unwrap();
    w.free(a, s);
    w.alloc(8192, t, t).unwrap(); // a miss: demand moved again
    assert_eq!(w.alloc(4096, s, s), Some(a), "cached in S's front");
    w.free(a, s); // through the core again: a second event
    assert_eq!(w.alloc.core().stats().events_recorded, 2);
    assert_eq!(w.alloc(4096, s, s), Some(a), "S takes its block back at once");
    w.free(a, s); // the fast path: after the second event
                  // The device runs S up to the second event, not the use after it (S's queue: a use of `a`,
                  // event 1, a use, event 2, the last use).
    w.run(s, 4);
    assert_eq!(w.alloc.core().backend().queues[&s].len(), 1);
    // T misses (polling S's event) and asks again: it must not get `a`.
    let x = w.alloc(4096, t, t).unwrap();
    let y = w.alloc(4096, t, t).unwrap();
    assert!(x != a && y != a);
    // Once S's work has run and S says so (its next free after T's misses), T may have it.
    w.run(s, usize::MAX);
    let b = w.alloc(512, s, s).unwrap();
    w.run(s, usize::MAX);
    w.free(b, s);
    let got: Vec<u64> = (0..3).filter_map(|_| w.alloc(4096, t, t)).collect();
    assert!(got.contains(&a), "{got:x?}");
    w.check_stats();
}

/// Memory a stream freed serves another stream once the first stream's work has run, without a
/// wait for the whole device, also when each stream is driven by its own thread through the
/// fast paths.
#[test]
fn memory_one_threads_stream_freed_serves_another_threads_stream_after_its_work() {
    // 40 pages in all: stream 1 takes 24 and frees them, stream 2 needs 24 more than its own.
    let w = World::new(40);
    let big = 4 * PAGE;
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let blocks: Vec<u64> = (0..6).map(|_| w.alloc(big, 1, 1).unwrap()).collect();
            for a in blocks {
                w.free(a, 1);
            }
        });
    });
    // Stream 2 on another thread: its first request finds no block (demand moves).
    std::thread::scope(|sc| {
        sc.spawn(|| {
            w.alloc(2 * PAGE, 2, 2).unwrap();
        });
    });
    std::thread::scope(|sc| {
        sc.spawn(|| {
            // Stream 1's work runs; its next free finds it idle.
            w.run(1, usize::MAX);
            let a = w.alloc(512, 1, 1).unwrap();
            w.run(1, usize::MAX);
            w.free(a, 1);
        });
    });
    let created = w.alloc.core().stats().pages_created;
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for _ in 0..6 {
                w.alloc(big, 2, 2).expect("stream 1's memory");
            }
        });
    });
    let s = w.alloc.core().stats();
    assert_eq!(w.alloc.core().backend().synchronized, 0, "no wait for the whole device");
    assert_eq!(s.pages_created, created, "no new page: stream 1's served stream 2");
    w.check_stats();
}

/// A request that finds no cached block in its stream's front leaves the other streams' fronts
/// their cached blocks when the index serves it: emptying every front sent each other stream's
/// next request to the device-wide lock, and with eight threads or more, each on its own stream,
/// those requests kept emptying one another's fronts, so that more threads did fewer pairs than
/// one (docs/DECISIONS.md, "A front per stream").
#[test]
fn a_request_served_by_the_index_leaves_the_other_streams_fronts_their_blocks() {
    let w = World::new(1000);
    let big = w.alloc(8192, 1, 1).unwrap();
    w.free(big, 1);
    let theirs = w.alloc(4096, 2, 2).unwrap();
    w.free(theirs, 2);
    // Stream 1's front holds no 4 KiB block: its own 8 KiB one, split in the index, serves.
    assert_eq!(w.alloc(4096, 1, 1), Some(big));
    assert_eq!(
        w.alloc.fronts.take(StreamId(2), 4096, 4096),
        Some(theirs),
        "stream 2's block is still in its front"
    );
}
