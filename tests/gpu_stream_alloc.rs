//! The stream-ordered allocator on a GPU: reuse across streams waits for the work that used a
//! block, same-stream reuse does not, out of memory is retried, and the cache empties.

mod common;

use common::{read, words_mut};
use cuvmm::alloc::{AllocatorConfig, DevicePtr, SleepMode, StreamAllocator, Tag};
use cuvmm::kernels::Kernels;
use cuvmm::{Context, DeviceSlice, DeviceSliceMut, Stream};

fn ctx() -> Context {
    Context::for_ordinal(0).expect("a CUDA device")
}

/// A busy kernel over N floats runs for tens of milliseconds on an H100.
const N: usize = 1 << 20;
const ITERS: u32 = 1 << 20;

fn view_mut(ptr: u64, n: usize) -> DeviceSliceMut<'static, f32> {
    // SAFETY: every caller passes a live block of at least `n` floats from the allocator and orders
    // the work itself (that is what these tests check).
    unsafe { DeviceSliceMut::from_raw_parts(ptr, n) }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_block_freed_on_a_busy_stream_is_not_handed_to_another_stream_until_its_work_ends() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    for round in 0..5 {
        let x = alloc.allocate(N * 4, &a).unwrap();
        k.busy_f32(&a, &mut view_mut(x.ptr(), N), ITERS).unwrap();
        let old = x.ptr();
        drop(x); // freed on A while the busy kernel still runs
        let y = alloc.allocate(N * 4, &b).unwrap();
        let marker = 0xdead_0000 + round;
        k.fill_u32(&b, &mut words_mut(y.ptr(), N), marker).unwrap();
        b.synchronize().unwrap();
        a.synchronize().unwrap();
        let got = read(&ctx, y.ptr(), N);
        assert!(
            got.iter().all(|&v| v == marker),
            "round {round}: block {:#x} (old {old:#x}) was overwritten by A's kernel after B's fill",
            y.ptr()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_block_is_reused_on_its_own_stream_at_once_without_mapping() {
    let ctx = ctx();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let a = alloc.allocate(3 << 20, &s).unwrap();
    let p = a.ptr();
    drop(a);
    let before = alloc.stats();
    let b = alloc.allocate(3 << 20, &s).unwrap();
    assert_eq!(b.ptr(), p);
    let after = alloc.stats();
    assert_eq!(after.cache_hits, before.cache_hits + 1);
    assert_eq!(after.pages_created, before.pages_created);
    // A small block does not share the large heap's pages.
    let c = alloc.allocate(100, &s).unwrap();
    assert!(c.ptr() < p || c.ptr() >= p + (3 << 20));
    assert_eq!(c.ptr() % 512, 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn use_on_orders_the_free_after_work_queued_on_another_stream() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    for round in 0..5 {
        let mut x = alloc.allocate(N * 4, &a).unwrap();
        a.synchronize().unwrap();
        k.busy_f32(&b, &mut view_mut(x.ptr(), N), ITERS).unwrap();
        x.use_on(&b).unwrap();
        let old = x.ptr();
        drop(x);
        // Same stream A: the block may come back at once; A's work must then follow B's kernel.
        let y = alloc.allocate(N * 4, &a).unwrap();
        let marker = 0xbeef_0000 + round;
        k.fill_u32(&a, &mut words_mut(y.ptr(), N), marker).unwrap();
        a.synchronize().unwrap();
        b.synchronize().unwrap();
        let got = read(&ctx, y.ptr(), N);
        assert!(
            got.iter().all(|&v| v == marker),
            "round {round}: B's kernel wrote after A's fill ({old:#x})"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_memory_waits_for_freed_memory_then_the_cache_empties() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let config = AllocatorConfig { page: 2 << 20, ..AllocatorConfig::default() };
    let alloc = StreamAllocator::with_config(&ctx, config).unwrap();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    let start = ctx.memory_info().unwrap();
    // Fill the device with 1 GiB blocks on A until the driver refuses.
    let mut held = Vec::new();
    let err = loop {
        match alloc.allocate(1 << 30, &a) {
            Ok(x) => held.push(x),
            Err(e) => break e,
        }
    };
    assert!(err.is_out_of_memory(), "{err}");
    assert!(held.len() >= 8, "only {} GiB allocated", held.len());
    // Keep A busy on the last block, free half the blocks on A, ask on B for 4 GiB in one piece:
    // the freed memory is not B's until A's work is done, so the allocator must wait and remap.
    let last = held.last().unwrap().ptr();
    k.busy_f32(&a, &mut view_mut(last, N), ITERS).unwrap();
    let half = held.len() / 2;
    held.truncate(half);
    let before = alloc.stats();
    let big = alloc.allocate(4 << 30, &b).expect("freed memory should be waited for and reused");
    let after = alloc.stats();
    assert!(after.oom_retries > before.oom_retries, "{after:?}");
    // The freed memory served B (in place or moved) once A's work was done: far fewer pages were
    // made than the request needed.
    let needed = (4u64 << 30) / (2 << 20);
    assert!(after.pages_created - before.pages_created < needed / 4, "{after:?}");
    k.fill_u32(&b, &mut words_mut(big.ptr(), N), 7).unwrap();
    b.synchronize().unwrap();
    assert!(read(&ctx, big.ptr(), 16).iter().all(|&v| v == 7));
    drop(big);
    drop(held);
    let released = alloc.empty_cache().unwrap();
    let end = ctx.memory_info().unwrap();
    assert!(released > 8 << 30, "released {released}");
    assert!(end.free + (64 << 20) >= start.free, "free before {} after {}", start.free, end.free);
    assert_eq!(alloc.stats().mapped, 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_per_thread_default_stream_and_wrong_contexts_are_refused() {
    let ctx = ctx();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    // SAFETY: refused before any use of the stream.
    let r = unsafe {
        alloc.allocate_raw(4096, 2usize as cuvmm::driver::sys::CUstream, cuvmm::alloc::GraphMemory::Keep)
    };
    assert!(matches!(r, Err(cuvmm::Error::InvalidArgument(_))), "{r:?}");
    let s = Stream::new(&ctx).unwrap();
    let x = alloc.allocate(4096, &s).unwrap();
    // SAFETY: a wrong address is refused without touching memory.
    let r = unsafe { alloc.free_raw(DevicePtr::new(x.ptr() + 512), s.raw()) };
    assert!(matches!(r, Err(cuvmm::Error::InvalidArgument(_))), "{r:?}");
}

fn words(ptr: u64, n: usize) -> DeviceSlice<'static, u32> {
    // SAFETY: as in `view_mut`.
    unsafe { DeviceSlice::from_raw_parts(ptr, n) }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_sleeping_tag_gives_its_memory_back_and_wakes_at_the_same_addresses_with_its_contents() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let weights = Tag::new("weights").unwrap();
    let cache = Tag::new("cache").unwrap();
    let n = (1usize << 30) / 4;
    let w: Vec<_> = (0..3).map(|_| alloc.allocate_tagged(n * 4, &s, weights).unwrap()).collect();
    let c = alloc.allocate_tagged(n * 4, &s, cache).unwrap();
    let other = alloc.allocate(64 << 20, &s).unwrap();
    for (i, b) in w.iter().enumerate() {
        k.pattern_u32(&s, &mut words_mut(b.ptr(), n), 0, 11 + i as u32).unwrap();
    }
    k.pattern_u32(&s, &mut words_mut(other.ptr(), (64 << 20) / 4), 0, 99).unwrap();
    s.synchronize().unwrap();
    let tagged = alloc.tag_stats(weights).mapped + alloc.tag_stats(cache).mapped;
    let before = ctx.memory_info().unwrap();
    alloc.sleep(weights, SleepMode::Offload).unwrap();
    alloc.sleep(cache, SleepMode::Discard).unwrap();
    let asleep = ctx.memory_info().unwrap();
    let rose = asleep.free - before.free;
    assert!(rose as f64 >= 0.97 * tagged as f64, "free memory rose by {rose} for {tagged} tagged bytes");
    assert!(alloc.sleep(weights, SleepMode::Offload).is_err(), "sleeping twice");
    assert!(alloc.allocate_tagged(4096, &s, weights).is_err(), "allocating while asleep");
    // Someone else uses the memory meanwhile.
    let borrowed = alloc.allocate((rose / 2) & !4095, &s).unwrap();
    k.fill_u32(&s, &mut words_mut(borrowed.ptr(), 1 << 20), 5).unwrap();
    s.synchronize().unwrap();
    drop(borrowed);
    alloc.empty_cache().unwrap();
    alloc.wake(weights).unwrap();
    alloc.wake(cache).unwrap();
    assert!(alloc.wake(weights).is_err(), "waking an awake tag");
    for (i, b) in w.iter().enumerate() {
        let bad = k.count_pattern_mismatches(&s, &words(b.ptr(), n), 0, 11 + i as u32).unwrap();
        assert_eq!(bad, 0, "weights block {i} changed across sleep");
    }
    // The discarded cache is usable again; the untagged block never moved.
    k.fill_u32(&s, &mut words_mut(c.ptr(), n), 3).unwrap();
    assert_eq!(k.count_pattern_mismatches(&s, &words(other.ptr(), (64 << 20) / 4), 0, 99).unwrap(), 0);
    s.synchronize().unwrap();
}

/// The RL cycle on a full device: a tag sleeps, other work takes the memory it gave back and frees
/// it with work still queued (cached, not yet idle), and the wake needs that memory. The wake waits
/// for the device and takes the cache back; before, it failed out of memory beside idle pages.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_wake_on_a_full_device_takes_back_the_cache_other_work_left() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let weights = Tag::new("wake-full").unwrap();
    let n = (4usize << 30) / 4;
    let w = alloc.allocate_tagged(n * 4, &s, weights).unwrap();
    k.pattern_u32(&s, &mut words_mut(w.ptr(), n), 0, 23).unwrap();
    s.synchronize().unwrap();
    alloc.sleep(weights, SleepMode::Offload).unwrap();
    // Everything free but 256 MiB goes to untagged work, freed while a kernel on it still runs.
    let free = ctx.memory_info().unwrap().free;
    let hog = alloc.allocate((free - (256 << 20)) & !((2 << 20) - 1), &s).unwrap();
    k.busy_f32(&s, &mut view_mut(hog.ptr(), N), ITERS).unwrap();
    drop(hog);
    // An allocation that searched and found memory, as training does between the free and the wake.
    let small = alloc.allocate(4096, &s).unwrap();
    alloc.wake(weights).unwrap();
    assert_eq!(k.count_pattern_mismatches(&s, &words(w.ptr(), n), 0, 23).unwrap(), 0);
    drop(small);
    s.synchronize().unwrap();
}

const ASLEEP_CHILD: &str = "CUVMM_TEST_EXIT_ASLEEP";

/// The child of `a_process_that_exits_asleep_exits_cleanly`, in the copy of it the test started:
/// puts a tag to sleep and exits.
fn exit_asleep_child() -> ! {
    let ctx = ctx();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let t = Tag::new("weights").unwrap();
    let _b = alloc.allocate_tagged(256 << 20, &s, t).unwrap();
    alloc.sleep(t, SleepMode::Offload).unwrap();
    println!("child asleep");
    std::process::exit(0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_process_that_exits_asleep_exits_cleanly() {
    if std::env::var_os(ASLEEP_CHILD).is_some() {
        exit_asleep_child();
    }
    let out = common::rerun_this_test().env(ASLEEP_CHILD, "1").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("child asleep"), "{stdout}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_free_waits_for_work_queued_through_a_view_on_another_stream() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let (a, b) = (Stream::non_blocking(&ctx).unwrap(), Stream::non_blocking(&ctx).unwrap());
    for round in 0..5u32 {
        let mut x = alloc.allocate(N * 4, &a).unwrap();
        // Through the block's own view: recorded, so the free below waits for it without use_on.
        k.busy_f32(&b, &mut x.as_mut_slice(), ITERS).unwrap();
        drop(x);
        let mut y = alloc.allocate(N * 4, &a).unwrap();
        let marker = 0xcafe_0000 + round;
        k.fill_u32(&a, &mut y.as_mut_slice(), marker).unwrap();
        a.synchronize().unwrap();
        b.synchronize().unwrap();
        let got = read(&ctx, y.ptr(), N);
        assert!(got.iter().all(|&v| v == marker), "round {round}: B's kernel wrote after A's fill");
    }
}

/// A graph captured (global mode) through the allocator: allocations and frees during the capture
/// make no call that breaks it, a block freed during the capture is reused in capture order, the
/// graph's memory stays the graph's after the capture, and the graph replays correctly. The stream
/// is destroyed at the end, with a block it freed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_graph_captured_through_the_allocator_keeps_its_memory_and_replays() {
    use cuvmm::alloc::GraphMemory;
    use std::ffi::c_void;
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let s = Stream::non_blocking(&ctx).unwrap();
    let api = cuvmm::driver::driver().unwrap().api();
    let eager = alloc.allocate(N * 4, &s).unwrap();
    let eager_ptr = eager.ptr();
    ctx.bind().unwrap();
    // SAFETY: a live stream; mode 0 is global.
    unsafe { api.cuStreamBeginCapture(s.raw(), 0) }.unwrap();
    // SAFETY: the stream is live for the calls; the blocks are freed once, on it.
    let (g1, g2) = unsafe {
        let g1 = alloc.allocate_raw(N * 4, s.raw(), GraphMemory::Keep).unwrap().get();
        k.fill_u32(&s, &mut words_mut(g1, N), 1).unwrap();
        alloc.free_raw(DevicePtr::new(g1), s.raw()).unwrap();
        let g2 = alloc.allocate_raw(N * 4, s.raw(), GraphMemory::Keep).unwrap().get();
        k.fill_u32(&s, &mut words_mut(g2, N), 0xbeef).unwrap();
        (g1, g2)
    };
    assert_eq!(g1, g2, "a block freed during the capture is reused in capture order");
    assert_ne!(g2, eager_ptr);
    drop(eager); // freed during the capture: not reused until it is over
    let mut graph: *mut c_void = std::ptr::null_mut();
    // SAFETY: the capture began on this stream; the out-pointer is a valid local.
    unsafe { api.cuStreamEndCapture(s.raw(), &mut graph) }.unwrap();
    assert!(alloc.stats().graph_held >= (N * 4) as u64);
    let mut exec: *mut c_void = std::ptr::null_mut();
    // SAFETY: a graph just captured; the out-pointer is a valid local.
    unsafe { api.cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.unwrap();
    // The graph's memory is not handed out after the capture, on the same stream or another.
    let t = Stream::non_blocking(&ctx).unwrap();
    let after: Vec<_> =
        (0..3).map(|i| alloc.allocate(N * 4, if i % 2 == 0 { &s } else { &t }).unwrap()).collect();
    assert!(after.iter().all(|b| b.ptr() != g2), "graph memory handed out after the capture");
    for _ in 0..3 {
        // SAFETY: a live executable graph and stream.
        unsafe { api.cuGraphLaunch(exec, s.raw()) }.unwrap();
    }
    s.synchronize().unwrap();
    assert!(read(&ctx, g2, N).iter().all(|&v| v == 0xbeef), "the replays wrote the graph's block");
    // SAFETY: created above, destroyed once, after their last launch completed; the graph's
    // block is freed once, on its stream, and released only once no graph uses it.
    unsafe {
        api.cuGraphExecDestroy(exec).unwrap();
        api.cuGraphDestroy(graph).unwrap();
        // The graph's block is still allocated: no free bytes come back, and the block is no
        // longer kept for graphs (its free returns it to everyone).
        assert_eq!(alloc.release_graph_memory(), 0);
        assert_eq!(alloc.stats().graph_held, 0);
        alloc.free_raw(DevicePtr::new(g2), s.raw()).unwrap();
    }
    drop(after);
    drop(s); // destroyed with blocks it freed: the allocator never asks about it again
    let u = Stream::non_blocking(&ctx).unwrap();
    let x = alloc.allocate(N * 4, &u).unwrap();
    k.fill_u32(&u, &mut words_mut(x.ptr(), N), 3).unwrap();
    u.synchronize().unwrap();
    assert!(alloc.empty_cache().is_ok());
}

/// Streams destroyed with work queued that used blocks they freed, and new streams that may get
/// their handles: a new stream's block is never one that the destroyed stream's kernel still
/// writes (its fill is checked after everything ran).
#[test]
#[ignore = "needs a CUDA GPU"]
fn blocks_of_a_destroyed_busy_stream_are_not_handed_to_the_next_streams_while_its_work_runs() {
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    let t = Stream::non_blocking(&ctx).unwrap();
    for round in 0..5u32 {
        let s = Stream::non_blocking(&ctx).unwrap();
        let a = alloc.allocate(N * 4, &s).unwrap();
        let b = alloc.allocate(N * 4, &s).unwrap();
        drop(a);
        let _x = alloc.allocate((8 + round as usize) << 20, &t).unwrap();
        let _y = alloc.allocate((24 + round as usize) << 20, &t).unwrap();
        k.busy_f32(&s, &mut view_mut(b.ptr(), N), ITERS).unwrap();
        drop(b);
        drop(s);
        let u = Stream::non_blocking(&ctx).unwrap();
        let c = alloc.allocate(N * 4, &u).unwrap();
        let marker = 0xfeed_0000 + round;
        k.fill_u32(&u, &mut words_mut(c.ptr(), N), marker).unwrap();
        ctx.synchronize().unwrap();
        let got = read(&ctx, c.ptr(), N);
        assert!(
            got.iter().all(|&v| v == marker),
            "round {round}: the destroyed stream's kernel wrote a new stream's block"
        );
    }
}

/// Threads each on their own streams (a new one every round), all at once: each frees a block
/// while a kernel on its stream still writes it, asks again on its stream (served without the
/// allocator's device-wide lock), fills what it gets and reads it back; a larger request now and
/// then makes the frees record events for the others. No thread's block is written by another
/// stream's kernel, and the counters add up.
#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_on_their_own_streams_get_no_block_another_streams_kernel_still_writes() {
    const M: usize = 1 << 16;
    let ctx = ctx();
    let alloc = StreamAllocator::new(&ctx).unwrap();
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let (ctx, alloc) = (&ctx, &alloc);
            scope.spawn(move || {
                ctx.bind().unwrap();
                let k = Kernels::load(ctx).unwrap();
                for round in 0..8u32 {
                    let s = Stream::non_blocking(ctx).unwrap();
                    for i in 0..8u32 {
                        let x = alloc.allocate(M * 4, &s).unwrap();
                        k.busy_f32(&s, &mut view_mut(x.ptr(), M), 1 << 14).unwrap();
                        drop(x); // freed while the kernel runs
                        if i % 4 == 0 {
                            drop(alloc.allocate((1 + t as usize) << 22, &s).unwrap());
                        }
                        let y = alloc.allocate(M * 4, &s).unwrap();
                        let marker = 0x5100_0000 | t << 16 | round << 8 | i;
                        k.fill_u32(&s, &mut words_mut(y.ptr(), M), marker).unwrap();
                        s.synchronize().unwrap();
                        let got = read(ctx, y.ptr(), M);
                        assert!(
                            got.iter().all(|&v| v == marker),
                            "thread {t} round {round}: block {:#x} written by another stream's kernel",
                            y.ptr()
                        );
                    }
                }
            });
        }
    });
    let st = alloc.stats();
    assert_eq!((st.live, st.requested), (0, 0), "{st:?}");
    assert_eq!(st.allocations, st.frees, "{st:?}");
    assert!(st.cache_hits > st.allocations / 2, "{st:?}");
}
