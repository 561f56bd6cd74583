//! `cuvmm bench order`: what cross-stream ordering costs. Each loop runs on the same memory twice,
//! through a view that carries the owner's record ([`cuvmm::stream::order`]) and through an untracked view
//! of the same addresses (`from_raw_parts`), in alternating batches, so the ratio compares like
//! with like in one run.

use super::median;
use crate::common::size::{parse_size, show};
use crate::common::CliResult;
use cuvmm::context::Context;
use cuvmm::error::Result;
use cuvmm::host::PinnedBuffer;
use cuvmm::kernels::Kernels;
use cuvmm::memory::{DeviceSlice, DeviceSliceMut};
use cuvmm::stream::scope;
use cuvmm::stream::Stream;
use cuvmm::vmm::VmmVec;
use serde_json::json;
use std::io::Write;
use std::time::Instant;

/// One loop: microseconds per operation with and without the record.
#[derive(Clone, Debug)]
pub struct OrderRow {
    /// What the loop does.
    pub what: &'static str,
    /// Through a tracked view.
    pub tracked_us: f64,
    /// Through an untracked view of the same memory.
    pub raw_us: f64,
}

impl OrderRow {
    /// tracked / raw.
    pub fn ratio(&self) -> f64 {
        self.tracked_us / self.raw_us
    }
}

const BATCHES: usize = 9;

/// Times `iters` runs of `op(tracked)` and of `op(raw)` per batch, alternating which goes first;
/// returns the medians per operation. `op` ends with whatever synchronisation the loop needs.
fn compare(iters: usize, mut op: impl FnMut(bool, usize) -> Result<()>) -> Result<(f64, f64)> {
    op(true, iters)?;
    op(false, iters)?;
    let (mut t, mut r) = (Vec::new(), Vec::new());
    for b in 0..BATCHES {
        for tracked in if b % 2 == 0 { [true, false] } else { [false, true] } {
            let start = Instant::now();
            op(tracked, iters)?;
            let us = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
            if tracked {
                t.push(us)
            } else {
                r.push(us)
            }
        }
    }
    Ok((median(&t), median(&r)))
}

/// Runs the loops over `bytes`-byte copies and fills, `iters` operations per batch.
pub fn run(ctx: &Context, bytes: usize, iters: usize) -> Result<Vec<OrderRow>> {
    if bytes < 4 || bytes % 4 != 0 || iters == 0 {
        return Err(crate::bench::invalid("bytes must be a positive multiple of 4 and iters positive"));
    }
    let n = bytes / 4;
    let k = Kernels::load(ctx)?;
    let (a, b) = (Stream::non_blocking(ctx)?, Stream::non_blocking(ctx)?);
    let mut v = VmmVec::<u32>::with_capacity(ctx, n)?;
    v.resize(n, 1)?;
    let src = PinnedBuffer::from_slice(ctx, &(0..n as u32).map(|i| i | 1).collect::<Vec<_>>())?;
    let mut host = vec![0u32; n];
    let ptr = v.device_ptr();
    // SAFETY: the untracked views cover `v`'s first n elements, which stay mapped while `v` lives
    // (to the end of this function); every loop synchronises before it ends.
    let raw = || unsafe { DeviceSliceMut::<u32>::from_raw_parts(ptr, n) };
    // SAFETY: as above.
    let raw_ro = || unsafe { DeviceSlice::<u32>::from_raw_parts(ptr, n) };
    let mut rows = Vec::new();

    let (t, r) = compare(iters, |tracked, iters| {
        scope(|s| {
            for _ in 0..iters {
                let dst = if tracked { v.as_mut_slice() } else { raw() };
                s.copy_to_device(&a, &src, dst)?;
            }
            Ok(())
        })
    })?;
    rows.push(OrderRow { what: "async copy to device, one stream", tracked_us: t, raw_us: r });

    let (t, r) = compare(iters, |tracked, iters| {
        for _ in 0..iters {
            if tracked {
                v.copy_range_to_host(0..n, &mut host)?;
            } else {
                cuvmm::stream::copy::to_host(ctx, &mut host, &raw_ro())?;
            }
        }
        Ok(())
    })?;
    rows.push(OrderRow { what: "synchronous copy to host", tracked_us: t, raw_us: r });

    let (t, r) = compare(iters, |tracked, iters| {
        for i in 0..iters {
            let mut dst = if tracked { v.as_mut_slice() } else { raw() };
            k.fill_u32(&a, &mut dst, i as u32)?;
        }
        a.synchronize()
    })?;
    rows.push(OrderRow { what: "kernel, one stream", tracked_us: t, raw_us: r });

    // The untracked loop here is unordered (the two streams race on the memory): it shows what
    // the waits cost, not a correct alternative.
    let (t, r) = compare(iters, |tracked, iters| {
        for i in 0..iters {
            let st = if i % 2 == 0 { &a } else { &b };
            let mut dst = if tracked { v.as_mut_slice() } else { raw() };
            k.fill_u32(st, &mut dst, i as u32)?;
        }
        a.synchronize()?;
        b.synchronize()
    })?;
    rows.push(OrderRow { what: "kernel, alternating two streams", tracked_us: t, raw_us: r });

    // The record's own host cost, without the operation it orders.
    let (t, r) = compare(iters * 50, |tracked, iters| {
        for _ in 0..iters {
            let mut dst = if tracked { v.as_mut_slice() } else { raw() };
            drop(std::hint::black_box(&mut dst).prepare_write(&a)?);
        }
        Ok(())
    })?;
    rows.push(OrderRow { what: "prepare_write alone, one stream", tracked_us: t, raw_us: r });
    Ok(rows)
}

// The options of `cuvmm bench order` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Bytes per copy or fill.
    #[arg(long, default_value = "4KiB", value_parser = parse_size)]
    bytes: usize,
    /// Operations per batch.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench order`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { bytes, iters, device, json } = args;
    let ctx = Context::for_ordinal(device)?;
    let rows = run(&ctx, bytes, iters)?;
    if !json {
        writeln!(
            out,
            "µs per operation of {} on {}, tracked vs untracked views of the same memory (median of 9 batches of {iters})",
            show(bytes),
            ctx.device().name()?
        )?;
        writeln!(out, "{:<34} {:>10} {:>10} {:>8}", "loop", "tracked", "untracked", "ratio")?;
    }
    for r in &rows {
        if json {
            writeln!(
                out,
                "{}",
                json!({"bench": "order", "what": r.what, "bytes": bytes, "tracked_us": r.tracked_us,
                "raw_us": r.raw_us, "ratio": r.ratio()})
            )?;
        } else {
            writeln!(out, "{:<34} {:>10.3} {:>10.3} {:>8.3}", r.what, r.tracked_us, r.raw_us, r.ratio())?;
        }
    }
    Ok(())
}
