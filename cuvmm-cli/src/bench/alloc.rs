//! `cuvmm bench alloc`: allocate+free latency of the caching sub-allocator against cuMemAlloc /
//! cuMemFree and the driver's stream-ordered pool (release threshold raised so it caches too).

use super::median;
use crate::cli::size::{parse_sizes, show};
use crate::cli::CliResult;
use cuvmm::alloc::{CachingAllocator, ExportMode, PeerAllocator};
use cuvmm::context::Context;
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

/// Measures each size.
pub fn run(ctx: &Context, sizes: &[usize]) -> Result<Vec<AllocRow>> {
    if sizes.is_empty() || sizes.contains(&0) {
        return Err(crate::bench::invalid("sizes must be positive"));
    }
    let cache = CachingAllocator::new(PeerAllocator::new(ctx, &[], ExportMode::PosixFd)?, 2 << 20)?;
    let api = driver()?.api();
    let stream = Stream::non_blocking(ctx)?;
    ctx.bind()?;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: out-pointer valid; the device handle is live.
    unsafe { api.cuDeviceGetDefaultMemPool(&mut pool, ctx.device().raw()) }?;
    let mut threshold = u64::MAX;
    // SAFETY: the release threshold attribute takes a cuuint64_t.
    unsafe {
        api.cuMemPoolSetAttribute(
            pool,
            CUmemPool_attribute::RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }?;
    let mut rows = Vec::new();
    for &size in sizes {
        let cached_us = per_pair(20_000, || {
            drop(std::hint::black_box(cache.allocate(size)?));
            Ok(())
        })?;
        let driver_us = per_pair(50, || {
            let mut p = 0;
            // SAFETY: out-pointer valid; the allocation is freed at once.
            unsafe {
                api.cuMemAlloc(&mut p, size)?;
                api.cuMemFree(p)
            }
        })?;
        let pool_us = per_pair(2_000, || {
            let mut p = 0;
            // SAFETY: stream-ordered alloc and free of the same pointer on one stream.
            unsafe {
                api.cuMemAllocAsync(&mut p, size, stream.raw())?;
                api.cuMemFreeAsync(p, stream.raw())
            }
        })?;
        stream.synchronize()?;
        rows.push(AllocRow { size, cached_us, driver_us, pool_us });
    }
    cache.trim();
    // SAFETY: returns the pool's cached memory to the driver.
    unsafe { api.cuMemPoolTrimTo(pool, 0) }?;
    Ok(rows)
}

// The options of `cuvmm bench alloc` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Allocation sizes.
    #[arg(long, default_value = "4KiB,64KiB,1MiB,16MiB,64MiB", value_parser = parse_sizes)]
    sizes: std::vec::Vec<usize>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench alloc`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { sizes, device, json } = args;
    let ctx = Context::for_ordinal(device)?;
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
