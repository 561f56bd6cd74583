//! `cuvmm bench bandwidth`: host↔device copies from pageable, pinned and registered memory, and the
//! staged pageable path, 1 MiB to 1 GiB.

use super::{median, timed};
use cuvmm::context::Context;
use cuvmm::driver::driver;
use cuvmm::error::Result;
use cuvmm::host::Staging;
use cuvmm::host::{PinnedBuffer, RegisterFlags, Registered};
use cuvmm::memory::DeviceBuffer;
use cuvmm::stream::scope;
use cuvmm::stream::Event;
use cuvmm::stream::Stream;

/// GB/s (10^9 bytes per second) for one transfer size; `None` where not measured.
#[derive(Clone, Debug, Default)]
pub struct BandwidthRow {
    /// Bytes per transfer.
    pub size: usize,
    /// Repetitions (medians are over these).
    pub reps: usize,
    /// Driver copy from a plain `Vec` (pageable), host→device and device→host (host clock, to completion).
    pub pageable: [f64; 2],
    /// Raw `cuMemcpy*Async` on pinned memory (device events).
    pub pinned_raw: [f64; 2],
    /// cuvmm's scoped copy on the same pinned memory (device events).
    pub pinned: [f64; 2],
    /// cuvmm's scoped copy on registered (formerly pageable) memory (device events).
    pub registered: [f64; 2],
    /// Both directions at once on pinned memory, total bytes moved per second (device events).
    pub bidirectional: f64,
    /// cuvmm's staged pageable path (host clock, to completion).
    pub staged: [f64; 2],
    /// Registering plus unregistering `size` bytes, microseconds.
    pub register_us: f64,
}

fn gbs(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn fresh(v: &mut [u8], seed: u8) {
    for (i, b) in v.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed) | 1;
    }
}

/// Measures every size in `sizes` (bytes), each `reps` times after one warm-up. The largest size
/// bounds the buffers allocated: two pinned, two pageable, one device buffer of that size.
pub fn run(ctx: &Context, sizes: &[usize], reps: usize, staging: &mut Staging) -> Result<Vec<BandwidthRow>> {
    let max = *sizes.iter().max().ok_or_else(|| crate::bench::invalid("no sizes"))?;
    if reps == 0 || sizes.contains(&0) {
        return Err(crate::bench::invalid("sizes and reps must be positive"));
    }
    let api = driver()?.api();
    let s1 = Stream::non_blocking(ctx)?;
    let s2 = Stream::non_blocking(ctx)?;
    let (e0, e1, e2) = (Event::new(ctx)?, Event::new(ctx)?, Event::new(ctx)?);
    let mut dev = DeviceBuffer::<u8>::new(ctx, max)?;
    let dev2 = DeviceBuffer::<u8>::new(ctx, max)?;
    let mut pin_src = PinnedBuffer::<u8>::new(ctx, max)?;
    let mut pin_dst = PinnedBuffer::<u8>::new(ctx, max)?;
    let mut page_src = vec![0u8; max];
    let mut page_dst = vec![0u8; max];
    // Registration gets buffers of its own: pinning and unpinning must not change the pageable
    // buffers the driver's and the staged paths are measured on.
    let mut reg_src = vec![0u8; max];
    let mut reg_dst = vec![0u8; max];
    fresh(&mut pin_src, 3);
    fresh(&mut page_src, 5);
    fresh(&mut reg_src, 7);
    fresh(&mut reg_dst, 9);

    // Device-timed: record e0, queue the copy, record e1, wait, read the elapsed time.
    let timed_on = |stream: &Stream, go: &dyn Fn() -> Result<()>| -> Result<f64> {
        e0.record(stream)?;
        go()?;
        e1.record(stream)?;
        e1.synchronize()?;
        Ok(e0.elapsed_ms(&e1)? as f64 / 1e3)
    };

    let mut rows = Vec::new();
    for &size in sizes {
        let mut row = BandwidthRow { size, reps, ..Default::default() };
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); 12];
        for rep in 0..=reps {
            let keep = rep > 0; // the first round warms up
            let mut put = |i: usize, value: f64| {
                if keep {
                    samples[i].push(value);
                }
            };
            let dptr = dev.ptr();
            // Pageable, through the driver: host clock to completion.
            let (r, t) = timed(|| -> Result<()> {
                // SAFETY: page_src holds `size` bytes; dev holds `max` >= size; the stream is synced.
                unsafe { api.cuMemcpyHtoDAsync(dptr, page_src.as_ptr().cast(), size, s1.raw()) }?;
                s1.synchronize()
            });
            r?;
            put(0, gbs(size, t.as_secs_f64()));
            let (r, t) = timed(|| -> Result<()> {
                // SAFETY: page_dst holds `size` bytes; synced before page_dst is touched again.
                unsafe { api.cuMemcpyDtoHAsync(page_dst.as_mut_ptr().cast(), dptr, size, s1.raw()) }?;
                s1.synchronize()
            });
            r?;
            put(1, gbs(size, t.as_secs_f64()));
            // Pinned, raw driver calls.
            // SAFETY: pinned buffers of `max` bytes; each timing synchronises before the next use.
            let t = timed_on(&s1, &|| unsafe {
                api.cuMemcpyHtoDAsync(dptr, pin_src.as_ptr().cast(), size, s1.raw())
            })?;
            put(2, gbs(size, t));
            let pd = pin_dst.as_mut_ptr() as usize;
            // SAFETY: as above.
            let t = timed_on(&s1, &|| unsafe { api.cuMemcpyDtoHAsync(pd as *mut _, dptr, size, s1.raw()) })?;
            put(3, gbs(size, t));
            // Pinned, through cuvmm's scope.
            let t = scope(|s| {
                e0.record(&s1)?;
                s.copy_to_device(&s1, &pin_src[..size], dev.as_mut_slice().slice_mut(0..size)?)?;
                e1.record(&s1)?;
                Ok(())
            })
            .and_then(|()| e0.elapsed_ms(&e1))?;
            put(4, gbs(size, t as f64 / 1e3));
            let t = scope(|s| {
                e0.record(&s1)?;
                let _ = s.copy_to_host(&s1, dev.as_slice().slice(0..size)?, &mut pin_dst[..size])?;
                e1.record(&s1)?;
                Ok(())
            })
            .and_then(|()| e0.elapsed_ms(&e1))?;
            put(5, gbs(size, t as f64 / 1e3));
            // Both directions at once: H2D on s1, D2H on s2, from one start to the later end.
            let t = scope(|s| {
                e0.record(&s1)?;
                s2.wait_event(&e0)?;
                s.copy_to_device(&s1, &pin_src[..size], dev.as_mut_slice().slice_mut(0..size)?)?;
                let _ = s.copy_to_host(&s2, dev2.as_slice().slice(0..size)?, &mut pin_dst[..size])?;
                e2.record(&s2)?;
                s1.wait_event(&e2)?;
                e1.record(&s1)?;
                Ok(())
            })
            .and_then(|()| e0.elapsed_ms(&e1))?;
            put(6, gbs(2 * size, t as f64 / 1e3));
            // Registered: register the registration buffers (cost timed apart), copy, unregister.
            // Registration is closure-scoped: the time to enter the closure is the registration's,
            // the time from its end until `with` returns the unregistration's.
            let start = std::time::Instant::now();
            let (t_reg, left, t) =
                Registered::with(ctx, &mut reg_src[..size], RegisterFlags::default(), |reg| {
                    let t_reg = start.elapsed();
                    let t = scope(|s| {
                        e0.record(&s1)?;
                        s.copy_to_device(&s1, reg, dev.as_mut_slice().slice_mut(0..size)?)?;
                        e1.record(&s1)?;
                        Ok(())
                    })
                    .and_then(|()| e0.elapsed_ms(&e1));
                    (t_reg, std::time::Instant::now(), t)
                })?;
            let t_unreg = left.elapsed();
            put(7, gbs(size, t? as f64 / 1e3));
            put(11, (t_reg + t_unreg).as_secs_f64() * 1e6);
            let t = Registered::with(ctx, &mut reg_dst[..size], RegisterFlags::default(), |reg_dst| {
                scope(|s| {
                    e0.record(&s1)?;
                    let _ = s.copy_to_host(&s1, dev.as_slice().slice(0..size)?, reg_dst)?;
                    e1.record(&s1)?;
                    Ok(())
                })
                .and_then(|()| e0.elapsed_ms(&e1))
            })??;
            put(8, gbs(size, t as f64 / 1e3));
            // Staged pageable path: host clock to completion.
            let (r, t) =
                timed(|| staging.to_device(&s1, &page_src[..size], dev.as_mut_slice().slice_mut(0..size)?));
            r?;
            put(9, gbs(size, t.as_secs_f64()));
            let (r, t) =
                timed(|| staging.to_host(&s1, dev.as_slice().slice(0..size)?, &mut page_dst[..size]));
            r?;
            put(10, gbs(size, t.as_secs_f64()));
        }
        // The last staged round trip must have brought back exactly what went in.
        if page_dst[..size] != page_src[..size] {
            return Err(crate::bench::invalid(format!(
                "staged round trip of {size} bytes corrupted the data"
            )));
        }
        fresh(&mut page_dst, 0);
        let m = |i: usize| median(&samples[i]);
        row.pageable = [m(0), m(1)];
        row.pinned_raw = [m(2), m(3)];
        row.pinned = [m(4), m(5)];
        row.bidirectional = m(6);
        row.registered = [m(7), m(8)];
        row.staged = [m(9), m(10)];
        row.register_us = m(11);
        rows.push(row);
    }
    drop(dev2);
    Ok(rows)
}
