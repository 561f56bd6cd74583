//! The same transfer from pageable memory (a plain `Vec`, through the driver), pinned memory,
//! registered memory and cuvmm's staged pageable path, each timed on the host from the call to
//! the data's arrival. Run: `cargo run --release --example pinned_vs_pageable [-- MiB]`.

mod common;

use cuvmm::host::{RegisterFlags, Staging};
use cuvmm::{scope, Context, DeviceBuffer, PinnedBuffer, Registered, Stream};
use std::time::Instant;

/// Rounds after one warm-up; the median is printed.
const ROUNDS: usize = 5;

/// GB/s of moving `bytes` with `copy`, the median of [`ROUNDS`] after a warm-up.
fn gbs(bytes: usize, mut copy: impl FnMut() -> cuvmm::Result<()>) -> cuvmm::Result<f64> {
    copy()?;
    let mut secs = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        copy()?;
        secs.push(t.elapsed().as_secs_f64());
    }
    secs.sort_by(f64::total_cmp);
    Ok(bytes as f64 / secs[ROUNDS / 2] / 1e9)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mib: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(256);
    let n = (mib << 20) / 4;
    let ctx = Context::for_ordinal(0)?;
    let st = Stream::non_blocking(&ctx)?;
    let mut dev = DeviceBuffer::<u32>::new(&ctx, n)?;
    let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let mut back = vec![0u32; n];
    let bytes = n * 4;
    println!("{mib} MiB on {}, GB/s host→device / device→host:", ctx.device().name()?);

    // Pageable, through the driver: it stages the copy through a buffer of its own.
    let h2d = gbs(bytes, || dev.copy_from_host(&data))?;
    let d2h = gbs(bytes, || dev.copy_to_host(&mut back))?;
    println!("  pageable Vec, driver copy   {h2d:>6.1} / {d2h:>6.1}");

    // Pinned: the DMA engines read and write it directly.
    let pinned_src = PinnedBuffer::from_slice(&ctx, &data)?;
    let mut pinned_dst = PinnedBuffer::<u32>::new(&ctx, n)?;
    let h2d = gbs(bytes, || scope(|s| s.copy_to_device(&st, &pinned_src, dev.as_mut_slice())))?;
    let d2h = gbs(bytes, || scope(|s| s.copy_to_host(&st, dev.as_slice(), &mut pinned_dst).map(drop)))?;
    println!("  pinned (cuMemHostAlloc)     {h2d:>6.1} / {d2h:>6.1}");

    // Registered: an existing Vec pinned in place for the time of a closure (which costs its own
    // time, printed apart).
    let mut registered = data.clone();
    let t = Instant::now();
    let (h2d, d2h) = Registered::with(&ctx, &mut registered, RegisterFlags::default(), |reg| {
        let took = t.elapsed();
        let h2d = gbs(bytes, || scope(|s| s.copy_to_device(&st, reg, dev.as_mut_slice())));
        let d2h = gbs(bytes, || scope(|s| s.copy_to_host(&st, dev.as_slice(), reg).map(drop)));
        println!("  (registering {mib} MiB took {:.0} µs)", took.as_secs_f64() * 1e6);
        (h2d, d2h)
    })?;
    println!("  registered Vec              {:>6.1} / {:>6.1}", h2d?, d2h?);

    // Staged: pageable memory copied through cuvmm's ring of pinned slots, filled and drained by
    // host threads while the DMA engines move the previous chunk.
    let mut staging = Staging::with_defaults(&ctx)?;
    let threads = staging.threads();
    let h2d = gbs(bytes, || staging.to_device(&st, &data, dev.as_mut_slice()))?;
    back.fill(0);
    let d2h = gbs(bytes, || staging.to_host(&st, dev.as_slice(), &mut back))?;
    println!("  staged pageable (cuvmm)     {h2d:>6.1} / {d2h:>6.1}  ({threads} threads)");

    if back != data || *pinned_dst != data[..] {
        return Err("a round trip brought back other data".into());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("pinned_vs_pageable", run())
}
