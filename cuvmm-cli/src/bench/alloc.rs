//! `cuvmm bench alloc`: allocate+free latency of the caching sub-allocator against cuMemAlloc /
//! cuMemFree and the driver's stream-ordered pool (release threshold raised so it caches too); with
//! `--threads`, cached pairs of the stream-ordered allocator against the pool on several threads
//! at once, each on a stream of its own.

use super::median;
use crate::common::size::{parse_counts, parse_sizes, show};
use crate::common::CliResult;
use cuvmm::alloc::{CachingAllocator, ExportMode, GraphMemory, PeerAllocator, StreamAllocator};
use cuvmm::context::Context;
use cuvmm::driver::result::{self, pool};
use cuvmm::driver::{driver, sys::*};
use cuvmm::error::Result;
use cuvmm::stream::Stream;
use serde_json::json;
use std::io::Write;
use std::time::Instant;

/// Microseconds per allocate+free pair for one size.
#[derive(Clone, Debug)]
pub struct AllocRow {
    /// Bytes per allocation.
    pub size: usize,
    /// cuvmm's caching sub-allocator, warm.
    pub cached_us: f64,
    /// cuMemAlloc + cuMemFree.
    pub driver_us: f64,
    /// cuMemAllocAsync + cuMemFreeAsync on the default pool with the release threshold at its maximum.
    pub pool_us: f64,
}

/// Per-pair time of `iters` calls of `f`, median over 5 batches (after a warm-up batch).
fn per_pair(iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut samples = Vec::new();
    for batch in 0..6 {
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        if batch > 0 {
            samples.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
        }
    }
    Ok(median(&samples))
}

/// The device's default stream-ordered pool with its release threshold raised, so that it keeps
/// freed memory cached like the allocators it is measured beside.
fn caching_default_pool(ctx: &Context) -> Result<CUmemoryPool> {
    let api = driver()?.api();
    let p = pool::default_mem_pool(api, ctx.device().raw())?;
    // SAFETY: the default pool lives as long as the driver; the release threshold attribute
    // takes a cuuint64_t.
    unsafe { pool::set_attribute_u64(api, p, CUmemPool_attribute::RELEASE_THRESHOLD, u64::MAX) }?;
    Ok(p)
}

/// Measures each size.
pub fn run(ctx: &Context, sizes: &[usize]) -> Result<Vec<AllocRow>> {
    if sizes.is_empty() || sizes.contains(&0) {
        return Err(crate::bench::invalid("sizes must be positive"));
    }
    let cache = CachingAllocator::new(PeerAllocator::new(ctx, &[], ExportMode::PosixFd)?, 2 << 20)?;
    let api = driver()?.api();
    let stream = Stream::non_blocking(ctx)?;
    ctx.bind()?;
    let pool = caching_default_pool(ctx)?;
    let mut rows = Vec::new();
    for &size in sizes {
        let cached_us = per_pair(20_000, || {
            drop(std::hint::black_box(cache.allocate(size)?));
            Ok(())
        })?;
        let driver_us = per_pair(50, || {
            let p = result::mem::alloc(api, size)?;
            // SAFETY: the allocation is freed at once.
            unsafe { result::mem::free(api, p) }
        })?;
        let pool_us = per_pair(2_000, || {
            // SAFETY: stream-ordered alloc and free of the same pointer on one stream.
            unsafe {
                let p = pool::alloc_async(api, size, stream.raw())?;
                pool::free_async(api, p, stream.raw())
            }
        })?;
        stream.synchronize()?;
        rows.push(AllocRow { size, cached_us, driver_us, pool_us });
    }
    cache.trim();
    // SAFETY: returns the pool's cached memory to the driver.
    unsafe { pool::trim_to(api, pool, 0) }?;
    Ok(rows)
}

// The options of `cuvmm bench alloc` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Allocation sizes.
    #[arg(long, default_value = "4KiB,64KiB,1MiB,16MiB,64MiB", value_parser = parse_sizes)]
    sizes: std::vec::Vec<usize>,
    /// Thread counts (e.g. 1,2,4,8,16): cached pairs of the stream-ordered allocator against
    /// the pool, each thread on its own stream, instead of the latency table.
    #[arg(long, value_parser = parse_counts)]
    threads: Option<std::vec::Vec<usize>>,
    /// Pairs per thread per batch with --threads (the pool runs an eighth as many).
    #[arg(long, default_value_t = 200_000)]
    pairs: usize,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench alloc`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { sizes, threads, pairs, device, json } = args;
    let ctx = Context::for_ordinal(device)?;
    if let Some(threads) = threads {
        let rows = run_threads(&ctx, &sizes, &threads, pairs)?;
        return print_threads(out, &ctx, &rows, pairs, json);
    }
    let rows = run(&ctx, &sizes)?;
    if !json {
        writeln!(out, "µs per allocate+free pair on {} (median of 5 batches)", ctx.device().name()?)?;
        writeln!(
            out,
            "{:>9} {:>14} {:>18} {:>22}",
            "size", "cuvmm cached", "cuMemAlloc/Free", "cuMemAllocAsync pool"
        )?;
    }
    for r in &rows {
        if json {
            writeln!(
                out,
                "{}",
                json!({"bench": "alloc", "size": r.size, "cached_us": r.cached_us,
                "driver_us": r.driver_us, "pool_us": r.pool_us})
            )?;
        } else {
            writeln!(
                out,
                "{:>9} {:>14.3} {:>18.2} {:>22.3}",
                show(r.size),
                r.cached_us,
                r.driver_us,
                r.pool_us
            )?;
        }
    }
    Ok(())
}

/// Cached allocate+free pairs of one size on several threads at once, each on a stream of its own.
#[derive(Clone, Debug)]
pub struct ThreadRow {
    /// Bytes per allocation.
    pub size: usize,
    /// Threads, each on its own stream.
    pub threads: usize,
    /// cuvmm's stream-ordered allocator (`allocate_raw` / `free_raw`, as `cuvmm_malloc` /
    /// `cuvmm_free`): million pairs per second, all threads together (median of 5 batches).
    pub cuvmm_mpairs: f64,
    /// `cuMemAllocAsync` / `cuMemFreeAsync` on the default pool, release threshold raised.
    pub pool_mpairs: f64,
    /// The two driver calls each of cuvmm's requests makes (`cuStreamIsCapturing`,
    /// `cuStreamGetId`), alone: million pairs of calls per second, all threads together. cuvmm's
    /// pairs cannot go faster, so this tells the allocator's share from the driver's.
    pub stream_calls_mpairs: f64,
}

/// Million pairs per second of `threads` threads together, each running `pairs` calls of the pair
/// `f` makes for it on its own stream, from a common start to the last thread's end; median of 5
/// batches after a warm-up batch.
fn aggregate(
    ctx: &Context,
    threads: usize,
    pairs: usize,
    f: impl Fn(&Stream) -> Result<()> + Sync,
) -> Result<f64> {
    let barrier = std::sync::Barrier::new(threads + 1);
    let mut samples = Vec::new();
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let (barrier, f) = (&barrier, &f);
                scope.spawn(move || -> Result<()> {
                    let stream = Stream::non_blocking(ctx);
                    // Every batch starts together; a thread that failed still meets the others.
                    let mut r = stream.as_ref().map(|_| ()).map_err(Clone::clone);
                    for _ in 0..6 {
                        barrier.wait();
                        if let (Ok(()), Ok(s)) = (&r, &stream) {
                            ctx.bind()?;
                            for _ in 0..pairs {
                                if let Err(e) = f(s) {
                                    r = Err(e);
                                    break;
                                }
                            }
                        }
                        barrier.wait();
                    }
                    if let Ok(s) = &stream {
                        s.synchronize()?;
                    }
                    r
                })
            })
            .collect();
        for batch in 0..6 {
            barrier.wait();
            let t = Instant::now();
            barrier.wait();
            if batch > 0 {
                samples.push((threads * pairs) as f64 / t.elapsed().as_secs_f64() / 1e6);
            }
        }
        for w in workers {
            w.join().expect("a benchmark thread panicked")?;
        }
        Ok(())
    })?;
    Ok(median(&samples))
}

/// Measures each size at each thread count.
pub fn run_threads(
    ctx: &Context,
    sizes: &[usize],
    threads: &[usize],
    pairs: usize,
) -> Result<Vec<ThreadRow>> {
    if sizes.is_empty() || sizes.contains(&0) || threads.is_empty() || threads.contains(&0) || pairs == 0 {
        return Err(crate::bench::invalid("sizes, thread counts and pairs must be positive"));
    }
    let alloc = StreamAllocator::new(ctx)?;
    let api = driver()?.api();
    ctx.bind()?;
    let pool = caching_default_pool(ctx)?;
    let mut rows = Vec::new();
    for &size in sizes {
        for &n in threads {
            let cuvmm_mpairs = aggregate(ctx, n, pairs, |s| {
                // SAFETY: the stream is this thread's, alive for the call; the block is freed once,
                // on it, with nothing queued that uses it.
                unsafe {
                    let p = alloc.allocate_raw(size, s.raw(), GraphMemory::Keep)?;
                    alloc.free_raw(std::hint::black_box(p), s.raw())
                }
            })?;
            let stream_calls_mpairs = aggregate(ctx, n, pairs, |s| {
                // SAFETY: the stream is this thread's, alive for the calls.
                unsafe {
                    result::stream::is_capturing(api, s.raw())?;
                    result::stream::get_id(api, s.raw()).map(drop)
                }
            })?;
            let pool_mpairs = aggregate(ctx, n, pairs / 8, |s| {
                // SAFETY: stream-ordered alloc and free of the same pointer on one stream.
                unsafe {
                    let p = pool::alloc_async(api, size, s.raw())?;
                    pool::free_async(api, p, s.raw())
                }
            })?;
            rows.push(ThreadRow { size, threads: n, cuvmm_mpairs, pool_mpairs, stream_calls_mpairs });
        }
    }
    alloc.empty_cache()?;
    // SAFETY: returns the pool's cached memory to the driver.
    unsafe { pool::trim_to(api, pool, 0) }?;
    Ok(rows)
}

/// `bench alloc --threads`: aggregate million pairs per second, cuvmm beside the driver's pool.
fn print_threads(
    out: &mut impl Write,
    ctx: &Context,
    rows: &[ThreadRow],
    pairs: usize,
    json: bool,
) -> CliResult {
    if !json {
        writeln!(
            out,
            "cached allocate+free pairs on {}, each thread on its own stream: million pairs/s, all threads \
             (median of 5 batches of {pairs} pairs a thread; the pool {} a thread); stream calls: \
             cuStreamIsCapturing + cuStreamGetId alone, which each of cuvmm's requests makes",
            ctx.device().name()?,
            pairs / 8
        )?;
        writeln!(
            out,
            "{:>9} {:>7} {:>12} {:>9} {:>11} {:>12} {:>9} {:>10} {:>12}",
            "size", "threads", "cuvmm", "x 1 thr", "ns/pair", "pool", "x 1 thr", "cuvmm/pool", "stream calls"
        )?;
    }
    for r in rows {
        let one = rows.iter().find(|o| o.size == r.size && o.threads == 1);
        let (c1, p1) = one.map_or((f64::NAN, f64::NAN), |o| {
            (r.cuvmm_mpairs / o.cuvmm_mpairs, r.pool_mpairs / o.pool_mpairs)
        });
        // Per thread: each thread's pairs take this long on average.
        let ns = 1e3 * r.threads as f64 / r.cuvmm_mpairs;
        if json {
            writeln!(
                out,
                "{}",
                json!({"bench": "alloc_threads", "size": r.size, "threads": r.threads,
                "cuvmm_mpairs": r.cuvmm_mpairs, "pool_mpairs": r.pool_mpairs,
                "cuvmm_vs_one_thread": c1, "pool_vs_one_thread": p1, "cuvmm_ns_per_pair_per_thread": ns,
                "stream_calls_mpairs": r.stream_calls_mpairs})
            )?;
        } else {
            writeln!(
                out,
                "{:>9} {:>7} {:>12.2} {:>8.2}x {:>11.1} {:>12.3} {:>8.2}x {:>9.1}x {:>12.2}",
                show(r.size),
                r.threads,
                r.cuvmm_mpairs,
                c1,
                ns,
                r.pool_mpairs,
                p1,
                r.cuvmm_mpairs / r.pool_mpairs,
                r.stream_calls_mpairs
            )?;
        }
    }
    Ok(())
}
