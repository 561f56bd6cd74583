//! The stream-ordered allocator on the CPU, against the fake driver's FAKE_VMM device with host
//! functions on a thread of their own (so work queued on a stream is really pending until they
//! return) and destroyed stream handles handed to new streams, as the driver may do. The driver,
//! its counters and its settings belong to the whole process, so the tests take turns.

mod common;

use common::{count, fake_symbol};

use cuvmm::alloc::{AllocatorConfig, DevicePtr, SleepMode, StreamAllocator, Tag};
use cuvmm::{Context, Stream};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// This test's turn, the fake driver (loaded for the whole process, host functions on their own
/// thread) and its device's context.
fn fake_device() -> (std::sync::MutexGuard<'static, ()>, std::path::PathBuf, Context) {
    let (turn, lib, ctx) = common::fake_device();
    let on = fake_symbol(&lib, "fake_host_thread");
    // SAFETY: `void fake_host_thread(int)` of the fake driver.
    unsafe { std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(c_int)>(on)(1) };
    (turn, lib, ctx)
}

/// Work queued on `stream` that runs until the returned sender says go (or 10 s pass); the flag
/// says whether it still runs.
fn busy(stream: &Stream) -> (mpsc::Sender<()>, Arc<AtomicBool>) {
    let (go, wait) = mpsc::channel::<()>();
    let running = Arc::new(AtomicBool::new(true));
    let r = running.clone();
    stream
        .launch_host_fn(move || {
            let _ = wait.recv_timeout(Duration::from_secs(10));
            r.store(false, Ordering::SeqCst);
        })
        .unwrap();
    (go, running)
}

/// With safe code only: blocks `a` and `b` on stream `s`; `a` freed; two requests on `t` that
/// miss; work queued on `s` that still runs; `b` freed; `s` dropped (destroyed with that work
/// queued); a new
/// stream that gets `s`'s handle asks for a block of the same size. It must not get `b` while
/// `s`'s work may still use it, and no call may pass the driver the destroyed handle.
#[test]
fn a_new_stream_with_a_destroyed_streams_handle_gets_none_of_its_blocks_while_its_work_runs() {
    let (_turn, lib, ctx) = fake_device();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let t = Stream::non_blocking(&ctx).unwrap();
    let a = alloc.allocate(4096, &s).unwrap();
    let b = alloc.allocate(4096, &s).unwrap();
    let (a_ptr, b_ptr) = (a.ptr(), b.ptr());
    drop(a);
    let x = alloc.allocate(8 << 20, &t).unwrap();
    let y = alloc.allocate(16 << 20, &t).unwrap();
    // Work on `s` that uses `b`, queued before its free.
    let (go, running) = busy(&s);
    drop(b);
    let raw = s.raw();
    drop(s);
    let u = Stream::non_blocking(&ctx).unwrap();
    assert_eq!(u.raw(), raw, "the fake hands a destroyed stream's handle to the next stream");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(alloc.allocate(4096, &u).unwrap());
        let _ = alloc.allocate(32 << 20, &t).unwrap();
    }
    let ptrs: Vec<u64> = got.iter().map(|g| g.ptr()).collect();
    assert!(
        !ptrs.contains(&b_ptr) || !running.load(Ordering::SeqCst),
        "a block the destroyed stream's work still uses went to the new stream: {ptrs:x?}"
    );
    assert_eq!(count(&lib, "destroyed_stream_calls"), 0, "a destroyed stream's handle reached the driver");
    // Once that work has run, a wait for the whole device gives the blocks back to everyone.
    go.send(()).unwrap();
    drop(got);
    alloc.empty_cache().unwrap();
    assert!(!running.load(Ordering::SeqCst));
    let again: Vec<u64> = (0..4)
        .map(|_| alloc.allocate(4096, &u).unwrap())
        .map(|g| {
            let p = g.ptr();
            std::mem::forget(g);
            p
        })
        .collect();
    assert!(again.contains(&a_ptr) || again.contains(&b_ptr), "{again:x?}");
    drop((x, y));
    u.synchronize().unwrap();
}

/// Runs `f` on a thread of its own and fails the test if it has not returned within 5 s (a
/// deadlock), instead of hanging. The process exits then: unwinding would drop the test's blocks,
/// whose frees wait for the deadlocked lock.
fn within_5s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5)).unwrap_or_else(|_| {
        // Straight to stderr: the test harness's capture is lost at exit.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "{what} did not return within 5 s: a host function and the allocator deadlocked"
        );
        std::process::exit(101)
    })
}

/// A host function that reads the allocator's counters (no driver call: allowed there) while a
/// sleep, and then `empty_cache`, waits for the device, which waits for that host function. The
/// allocator's lock is not held across those waits.
#[test]
fn a_host_function_reads_the_counters_while_sleep_and_empty_cache_wait_for_the_device() {
    use cuvmm::alloc::{SleepMode, Tag};
    let (_turn, lib, ctx) = fake_device();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let tag = Tag::new("fake-host-function-counters").unwrap();
    let block = alloc.allocate_tagged(8 << 20, &s, tag).unwrap();
    for round in 0..2 {
        let (tx, rx) = mpsc::channel();
        let a = alloc.clone();
        s.launch_host_fn(move || {
            // Long enough for the waiting call to have started its wait.
            std::thread::sleep(Duration::from_millis(200));
            let st = a.stats();
            let ts = a.tag_stats(tag);
            a.reset_peaks();
            let _ = tx.send((st, ts));
        })
        .unwrap();
        let a = alloc.clone();
        if round == 0 {
            let released = within_5s("sleep", move || a.sleep(tag, SleepMode::Discard)).unwrap();
            assert!(released >= 8 << 20, "{released}");
        } else {
            within_5s("empty_cache", move || a.empty_cache()).unwrap();
        }
        let (st, ts) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(st.live, 8 << 20, "the host function read the counters");
        assert_eq!(ts.live, 8 << 20);
        if round == 0 {
            alloc.wake(tag).unwrap();
        }
    }
    assert_eq!(count(&lib, "destroyed_stream_calls"), 0);
    drop(block);
    s.synchronize().unwrap();
}

/// Preparing a tag's backup makes the staging ring its sleeps copy through, on a thread of its
/// own, so that the first sleep pins nothing: the ring's slots are the only pinned memory, made
/// once, and go with the allocator.
#[test]
fn preparing_a_backup_makes_the_ring_ahead_of_the_first_sleep_once() {
    let (_turn, _lib, ctx) = fake_device();
    let before = cuvmm::host::pinned_bytes();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let tag = Tag::new("fake-prepared-ring").unwrap();
    let block = alloc.allocate_tagged(8 << 20, &s, tag).unwrap();
    assert_eq!(cuvmm::host::pinned_bytes(), before, "no ring before anything is prepared");
    assert!(alloc.prepare_backup(tag).unwrap() >= 8 << 20);
    let ready = || {
        let t = std::time::Instant::now();
        while !alloc.backups_prepared() {
            assert!(t.elapsed() < Duration::from_secs(10), "preparing never ended");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    ready();
    // The backup ring: four slots of 16 MiB.
    assert_eq!(cuvmm::host::pinned_bytes() - before, 64 << 20, "the ring, and nothing else pinned");
    let other = Tag::new("fake-prepared-ring-2").unwrap();
    let second = alloc.allocate_tagged(4 << 20, &s, other).unwrap();
    alloc.prepare_backup(other).unwrap();
    ready();
    assert_eq!(cuvmm::host::pinned_bytes() - before, 64 << 20, "one ring per allocator");
    drop((block, second));
    s.synchronize().unwrap();
    drop(alloc);
    let t = std::time::Instant::now();
    while cuvmm::host::pinned_bytes() != before {
        assert!(t.elapsed() < Duration::from_secs(10), "the ring outlived its allocator");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Threads on streams of their own allocate, queue work that uses a block, free it, destroy their
/// stream and go on with a new one (which may get any destroyed handle), all at once: no thread
/// gets a block that queued work of any stream still uses, and no destroyed handle reaches the
/// driver.
#[test]
fn threads_destroying_their_streams_never_get_a_block_still_in_use() {
    use std::collections::HashMap;
    use std::sync::Mutex;
    let (_turn, lib, ctx) = fake_device();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let busy_blocks: Mutex<HashMap<u64, Arc<AtomicBool>>> = Mutex::new(HashMap::new());
    std::thread::scope(|scope| {
        for t in 0..4usize {
            let (alloc, ctx, busy_blocks) = (&alloc, &ctx, &busy_blocks);
            scope.spawn(move || {
                for round in 0..20usize {
                    let s = Stream::non_blocking(ctx).unwrap();
                    let size = 4096 << (round % 3);
                    let mut blocks: Vec<_> = (0..3).map(|_| alloc.allocate(size, &s).unwrap()).collect();
                    for b in &blocks {
                        let flag = busy_blocks.lock().unwrap().get(&b.ptr()).cloned();
                        assert!(
                            !flag.is_some_and(|f| f.load(Ordering::SeqCst)),
                            "thread {t} round {round}: block {:#x} handed out while queued work uses it",
                            b.ptr()
                        );
                    }
                    // A miss now and then, so that other streams' frees are looked for.
                    let big = alloc.allocate((8 + t) << 20, &s).unwrap();
                    let used = blocks.pop().unwrap();
                    let running = Arc::new(AtomicBool::new(true));
                    busy_blocks.lock().unwrap().insert(used.ptr(), running.clone());
                    let r = running.clone();
                    s.launch_host_fn(move || {
                        std::thread::sleep(Duration::from_millis(2));
                        r.store(false, Ordering::SeqCst);
                    })
                    .unwrap();
                    drop(used);
                    drop(blocks);
                    drop(big);
                    drop(s);
                }
            });
        }
    });
    alloc.empty_cache().unwrap();
    assert_eq!(count(&lib, "destroyed_stream_calls"), 0);
}

/// Threads on streams of their own allocate blocks of a few sizes (most served by the stream's
/// own freed blocks, without the allocator's lock), queue work that checks, when it runs, that
/// every 512 bytes of its block still belong to its stream, hand some blocks to the next thread
/// (which frees them on their stream from its own thread), and destroy their streams between
/// rounds while that work is queued: no work ever finds its block handed to another stream, and
/// the counters add up.
#[test]
fn threads_see_their_blocks_owned_by_their_own_stream_until_their_work_has_run() {
    use std::collections::HashMap;
    use std::sync::Mutex;
    let (_turn, lib, ctx) = fake_device();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    // Owner of every 512-byte unit handed out: (thread, round), the stream's identity.
    let owners: Arc<Mutex<HashMap<u64, (usize, usize)>>> = Arc::new(Mutex::new(HashMap::new()));
    let wrong: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let threads = 4;
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| mpsc::channel::<cuvmm::alloc::StreamBlock>()).unzip();
    let mut receivers: Vec<Option<_>> = receivers.into_iter().map(Some).collect();
    receivers.rotate_right(1);
    let (mut allocated, mut freed_elsewhere) = (0u64, 0u64);
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (t, give) in senders.into_iter().enumerate() {
            let take = receivers[t].take().unwrap();
            let (alloc, ctx, owners, wrong) = (&alloc, &ctx, owners.clone(), wrong.clone());
            handles.push(scope.spawn(move || {
                let (mut made, mut taken) = (0u64, 0u64);
                for round in 0..24usize {
                    let s = Stream::non_blocking(ctx).unwrap();
                    for k in 0..60usize {
                        let size = [4096, 8192, 512 * 3][(k + t) % 3];
                        let b = alloc.allocate(size, &s).unwrap();
                        made += 1;
                        let units: Vec<u64> = (b.ptr()..b.ptr() + size as u64).step_by(512).collect();
                        {
                            let mut o = owners.lock().unwrap();
                            for &u in &units {
                                o.insert(u, (t, round));
                            }
                        }
                        let (o, w) = (owners.clone(), wrong.clone());
                        s.launch_host_fn(move || {
                            if k % 8 == 0 {
                                std::thread::sleep(Duration::from_micros(300));
                            }
                            let o = o.lock().unwrap();
                            if let Some(u) = units.iter().find(|u| o.get(u) != Some(&(t, round))) {
                                w.lock().unwrap().push(format!(
                                    "thread {t} round {round}: {u:#x} belongs to {:?} while its work runs",
                                    o.get(u)
                                ));
                            }
                        })
                        .unwrap();
                        if k % 5 == 0 {
                            // Freed on its stream by the next thread.
                            let _ = give.send(b);
                        } else {
                            drop(b);
                        }
                        while let Ok(other) = take.try_recv() {
                            drop(other);
                            taken += 1;
                        }
                    }
                    // A request no cached block serves now and then, so that frees record events.
                    drop(alloc.allocate((1 + t) << 20, &s).unwrap());
                    made += 1;
                    drop(s);
                }
                drop(give);
                while let Ok(other) = take.recv_timeout(Duration::from_millis(200)) {
                    drop(other);
                    taken += 1;
                }
                (made, taken)
            }));
        }
        for h in handles {
            let (m, f) = h.join().unwrap();
            allocated += m;
            freed_elsewhere += f;
        }
    });
    alloc.empty_cache().unwrap();
    let wrong = wrong.lock().unwrap();
    assert!(
        wrong.is_empty(),
        "{} blocks handed out under queued work: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    let st = alloc.stats();
    assert_eq!((st.allocations, st.frees, st.live, st.requested), (allocated, allocated, 0, 0), "{st:?}");
    assert!(freed_elsewhere > 0);
    assert!(st.cache_hits > allocated / 2, "most requests took their stream's own blocks: {st:?}");
    assert_eq!(count(&lib, "destroyed_stream_calls"), 0);
}

/// The driver's memory limit for this test (bytes above what the process holds now), lifted when
/// dropped.
struct MemoryLimit(unsafe extern "C" fn(u64));

impl MemoryLimit {
    fn set(lib: &std::path::Path, bytes: u64) -> MemoryLimit {
        let f = fake_symbol(lib, "fake_memory_limit");
        // SAFETY: `void fake_memory_limit(uint64_t)` of the fake driver.
        let f = unsafe { std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(u64)>(f) };
        // SAFETY: as above; it only sets a number.
        unsafe { f(bytes) };
        MemoryLimit(f)
    }
}

impl Drop for MemoryLimit {
    fn drop(&mut self) {
        // SAFETY: as in `set`.
        unsafe { (self.0)(0) };
    }
}

/// The sleep, train, wake cycle on a full device: the memory a tag gave back is taken by other
/// work and freed with that work still queued, and the wake needs it. The wake waits for the
/// device and takes the cache back instead of failing out of memory (before, it took the exit the
/// last allocation had left open, which nothing retried).
#[test]
fn a_wake_out_of_memory_waits_for_the_device_and_takes_back_the_cache() {
    let (_turn, lib, ctx) = fake_device();
    let mib = 1usize << 20;
    let cfg = AllocatorConfig { page: 4 << 20, tag_page: 4 << 20, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, cfg).unwrap();
    let (s, t) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let _limit = MemoryLimit::set(&lib, 64 << 20);
    let tag = Tag::new("fake-wake-full").unwrap();
    let w = alloc.allocate_tagged(32 * mib, &s, tag).unwrap();
    alloc.sleep(tag, SleepMode::Discard).unwrap();
    let hog = alloc.allocate(48 * mib, &s).unwrap();
    let (go, running) = busy(&s);
    drop(hog);
    // Another stream's request, which searched and found memory: it leaves the settle flag set.
    let small = alloc.allocate(4096, &t).unwrap();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let _ = go.send(());
    });
    alloc.wake(tag).unwrap();
    assert!(!running.load(Ordering::SeqCst), "the wake waited for the work on the freed block");
    assert_eq!(alloc.tag_stats(tag).mapped, 32 << 20);
    drop((w, small));
    s.synchronize().unwrap();
}

/// Pairs of threads on one stream each (so both lock that stream's front at once, for cached
/// pairs of the same sizes) while every thread now and then asks for a size no front holds (so
/// the device-wide path takes the fronts' idle blocks, locking each front from another thread):
/// no block is ever handed to two holders at once, and the counters add up.
#[test]
fn threads_sharing_a_streams_front_never_hold_one_block_twice() {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    let (_turn, _lib, ctx) = fake_device();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let streams: Vec<Stream> = (0..2).map(|_| Stream::non_blocking(&ctx).unwrap()).collect();
    // Every block held now, by address: (end, holder).
    let held: Mutex<BTreeMap<u64, (u64, usize)>> = Mutex::new(BTreeMap::new());
    let take = |addr: u64, len: u64, who: usize| {
        let mut h = held.lock().unwrap();
        let before = h.range(..=addr).next_back().map(|(&a, &(end, w))| (a, end, w));
        let after = h.range(addr..).next().map(|(&a, &(end, w))| (a, end, w));
        for (a, end, w) in before.into_iter().chain(after) {
            assert!(
                end <= addr || a >= addr + len,
                "thread {who} got {addr:#x}+{len:#x}, overlapping {a:#x}..{end:#x} that thread {w} holds"
            );
        }
        h.insert(addr, (addr + len, who));
    };
    let give = |addr: u64| {
        held.lock().unwrap().remove(&addr);
    };
    let before = alloc.stats();
    std::thread::scope(|scope| {
        for t in 0..4usize {
            let (alloc, stream, take, give) = (&alloc, &streams[t / 2], &take, &give);
            scope.spawn(move || {
                for i in 0..8000usize {
                    let size = 4096 << (i % 3);
                    let b = alloc.allocate(size, stream).unwrap();
                    take(b.ptr(), size as u64, t);
                    if i % 1000 == t {
                        let big = alloc.allocate((24 + t + i % 7) << 20, stream).unwrap();
                        take(big.ptr(), big.len() as u64, t);
                        give(big.ptr());
                        drop(big);
                    }
                    give(b.ptr());
                    drop(b);
                }
            });
        }
    });
    let after = alloc.stats();
    assert_eq!(after.live, before.live, "every block was freed");
    assert_eq!(after.allocations - before.allocations, after.frees - before.frees);
    assert!(after.cache_hits - before.cache_hits > 16_000, "the pairs were mostly served by their fronts");
}

/// A block freed while shared keeps the stream and number of its free until its sharing ends. A
/// stream whose work has all run is forgotten, and numbered afresh when it comes back: the block,
/// let go after that, must not wait for a number of the stream's next life (its pages stayed
/// mapped through every `empty_cache`, and 10,000 hand-offs on four streams held 2.4 GiB so).
#[test]
fn a_block_let_go_after_its_stream_was_forgotten_goes_back_at_the_next_emptying() {
    let (_turn, _lib, ctx) = fake_device();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let streams: Vec<Stream> = (0..2).map(|_| Stream::non_blocking(&ctx).unwrap()).collect();
    let mut pending = Vec::new();
    for round in 0..50usize {
        let st = &streams[round % 2];
        let n = [4096, 100_000, 1 << 20, 3 << 20, 9 << 20][round % 5];
        let b = alloc.allocate(n, st).unwrap();
        let shared = alloc.export_mark(DevicePtr::new(b.ptr())).unwrap();
        drop(b);
        pending.push(shared.block);
        if pending.len() > 2 {
            alloc.unexport(pending.remove(0)).unwrap();
        }
    }
    for b in pending {
        alloc.unexport(b).unwrap();
    }
    assert_eq!(alloc.stats().live, 0);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().mapped, 0, "{:?}", alloc.stats());
}

/// A block used on another stream and dropped comes back to no request, on its own stream or
/// any other, while that stream's work runs, whether the use was named (`use_on`) or recorded by
/// a raw free after `record_stream`: one rule for both. Its stream may be dropped with it.
#[test]
fn a_block_used_on_another_stream_comes_back_only_once_that_work_has_run() {
    let (_turn, _lib, ctx) = fake_device();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let t = Stream::non_blocking(&ctx).unwrap();
    for raw in [false, true] {
        let s = Stream::non_blocking(&ctx).unwrap();
        let mut x = alloc.allocate(4096, &s).unwrap();
        let p = x.ptr();
        let (go, running) = busy(&t);
        if raw {
            assert!(alloc.record_stream(DevicePtr::new(p), t.raw()));
            std::mem::forget(x);
            // SAFETY: `p` is a live block of `alloc`, freed once, on the stream it came from,
            // which lives until the deferred free is made (dropped below only after that).
            unsafe { alloc.free_raw(DevicePtr::new(p), s.raw()) }.unwrap();
        } else {
            x.use_on(&t).unwrap();
            drop(x);
        }
        assert_eq!(alloc.deferred_frees(), 1, "raw {raw}: the free did not wait for the other stream");
        let meanwhile: Vec<_> = (0..3).map(|_| alloc.allocate(4096, &s).unwrap()).collect();
        let elsewhere = alloc.allocate(4096, &t).unwrap();
        assert!(running.load(Ordering::SeqCst));
        assert!(
            meanwhile.iter().chain([&elsewhere]).all(|b| b.ptr() != p),
            "raw {raw}: the block came back while the other stream's work used it"
        );
        if !raw {
            drop(s);
        }
        go.send(()).unwrap();
        t.synchronize().unwrap();
        drop((meanwhile, elsewhere));
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.deferred_frees(), 0, "raw {raw}: the free was not made once the work had run");
    }
}
