//! `cuvmm bench sleep`: putting tagged memory to sleep and waking it, beside the copy bounds.
//!
//! The bounds are measured in every cycle, beside the sleep and the wake: the tagged bytes copied
//! between the device and pinned host memory, each way, timed with events. A sleep with offload
//! must copy as much to the host, a wake as much back, so those copies are what they are judged
//! against. The first sleep also pins its host backup (kept for later sleeps); it is reported
//! apart, with its cycle.
//!
//! A wake follows its sleep at once, and the sleep has just given the device's memory back: after
//! large releases the driver keeps working on its own for some tens of milliseconds, and a copy
//! that starts then runs slower. So the host-to-device bound is also taken right after releasing
//! as much memory, made, mapped and written the same way, and the wake is reported against both.

use super::{invalid, median};
use cuvmm::alloc::{AllocatorConfig, SleepMode, StreamAllocator, Tag};
use cuvmm::context::Context;
use cuvmm::error::Result;
use cuvmm::host::PinnedBuffer;
use cuvmm::kernels::Kernels;
use cuvmm::memory::{DeviceSlice, DeviceSliceMut};
use cuvmm::stream::{Event, Stream};
use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
use std::time::Instant;

/// What one run measured (milliseconds unless named otherwise).
#[derive(Clone, Debug, Default)]
pub struct SleepReport {
    /// Bytes tagged and put to sleep.
    pub bytes: usize,
    /// Device-to-pinned-host copies of `bytes`, one per cycle, just before its sleep (median).
    pub d2h_bound_ms: f64,
    /// Pinned-host-to-device copies of `bytes`, one per cycle, just after its wake (median).
    pub h2d_bound_ms: f64,
    /// The same copies, each right after as many bytes as a sleep frees were released (median).
    pub h2d_after_frees_ms: f64,
    /// The first sleep with offload (pins its backup).
    pub first_offload_ms: f64,
    /// Later sleeps with offload (median).
    pub offload_ms: f64,
    /// Wakes after an offloading sleep, contents restored (median).
    pub wake_ms: f64,
    /// Sleeps that drop the contents (median).
    pub discard_ms: f64,
    /// Wakes after those (median).
    pub discard_wake_ms: f64,
    /// Driver free memory gained by a sleep, over the tagged bytes mapped before it.
    pub freed_ratio: f64,
    /// Elements that differed from what was written, over every wake that restored contents.
    pub mismatches: u64,
    /// Fastest and slowest of each timed series: offload, D2H bound, wake, H2D bound.
    pub spread: Spread,
}

/// (fastest, slowest) milliseconds of the offloads, the D2H bounds, the wakes and the H2D bounds.
#[derive(Clone, Debug, Default)]
pub struct Spread(pub [(f64, f64); 4]);

impl Spread {
    fn of(series: [&[f64]; 4]) -> Spread {
        Spread(series.map(|v| v.iter().fold((f64::INFINITY, 0.0_f64), |(lo, hi), &x| (lo.min(x), hi.max(x)))))
    }
}

impl SleepReport {
    /// Sleep with offload over the device-to-host bound.
    pub fn offload_ratio(&self) -> f64 {
        self.offload_ms / self.d2h_bound_ms
    }

    /// Wake over the host-to-device bound.
    pub fn wake_ratio(&self) -> f64 {
        self.wake_ms / self.h2d_bound_ms
    }

    /// Wake over the host-to-device bound taken after the same frees.
    pub fn wake_ratio_after_frees(&self) -> f64 {
        self.wake_ms / self.h2d_after_frees_ms
    }
}

/// Makes `bytes` of device memory in `page`-byte pages, maps and writes it as tagged memory is,
/// then releases all of it: what a sleep leaves the driver to do.
fn release_like_a_sleep(ctx: &Context, s: &Stream, bytes: usize, page: usize) -> Result<()> {
    let bytes = bytes.next_multiple_of(page);
    let va = Reservation::new(ctx, bytes)?;
    let api = cuvmm::driver::driver()?.api();
    let mut held = Vec::with_capacity(bytes / page);
    for off in (0..bytes).step_by(page) {
        let phys = PhysicalMemory::builder(ctx).create(page)?;
        let m = va.map(off, &phys, 0, page)?;
        m.set_access(&[(ctx.device(), Access::ReadWrite)])?;
        // SAFETY: the range is mapped read-write for this device and nothing else uses it; the
        // stream is synchronised before the mapping is dropped.
        unsafe { api.cuMemsetD32Async(m.ptr(), 0x5eed_5eed, page / 4, s.raw()) }?;
        held.push(m);
    }
    s.synchronize()?;
    drop(held);
    Ok(())
}

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// Tags `bytes` (in `block`-byte allocations), then sleeps and wakes them `reps` times each way.
pub fn run(ctx: &Context, bytes: usize, block: usize, reps: usize) -> Result<SleepReport> {
    if block == 0 || block % 4 != 0 || bytes < block || reps == 0 {
        return Err(invalid("need 0 < block <= size, block a multiple of 4, and reps > 0"));
    }
    let k = Kernels::load(ctx)?;
    let alloc = StreamAllocator::new(ctx)?;
    let s = Stream::non_blocking(ctx)?;
    let tag = Tag::new("bench-sleep")?;
    let blocks: Vec<_> =
        (0..bytes / block).map(|_| alloc.allocate_tagged(block, &s, tag)).collect::<Result<_>>()?;
    let n = block / 4;
    let fill = |seed: u32| -> Result<()> {
        for (i, b) in blocks.iter().enumerate() {
            // SAFETY: a live block of `n` words, used only on `s`.
            let mut v = unsafe { DeviceSliceMut::<u32>::from_raw_parts(b.ptr(), n) };
            k.pattern_u32(&s, &mut v, (i * n) as u64, seed)?;
        }
        s.synchronize()
    };
    let check = |seed: u32| -> Result<u64> {
        let mut bad = 0;
        for (i, b) in blocks.iter().enumerate() {
            // SAFETY: as in `fill`.
            let v = unsafe { DeviceSlice::<u32>::from_raw_parts(b.ptr(), n) };
            bad += k.count_pattern_mismatches(&s, &v, (i * n) as u64, seed)?;
        }
        Ok(bad)
    };
    let total = blocks.len() * block;
    let mut r = SleepReport { bytes: total, ..SleepReport::default() };

    // The bounds: every block through one pinned host buffer, one way, timed with device events.
    // They are taken in every cycle, next to the sleep and the wake they judge: bus copies on one
    // machine vary by more than a tenth from one pass to the next, so bounds measured once, apart
    // from the cycles, would make the ratios a matter of luck.
    let host = PinnedBuffer::<u8>::new(ctx, block)?;
    let (start, end) = (Event::new(ctx)?, Event::new(ctx)?);
    let api = cuvmm::driver::driver()?.api();
    let pass = |to_host: bool| -> Result<f64> {
        start.record(&s)?;
        for b in &blocks {
            // SAFETY: the device range is a live, mapped block; the host buffer outlives the
            // copy (synchronised below) and nothing else touches it.
            unsafe {
                if to_host {
                    api.cuMemcpyDtoHAsync(host.base_ptr().cast(), b.ptr(), block, s.raw())
                } else {
                    api.cuMemcpyHtoDAsync(b.ptr(), host.base_ptr().cast(), block, s.raw())
                }
            }?;
        }
        end.record(&s)?;
        end.synchronize()?;
        Ok(start.elapsed_ms(&end)? as f64)
    };
    pass(true)?;
    pass(false)?;

    let (mut off, mut wake, mut disc, mut dwake) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut d2h, mut h2d, mut h2d_freed) = (Vec::new(), Vec::new(), Vec::new());
    let page = AllocatorConfig::default().tag_page;
    for rep in 0..=reps {
        let seed = 1000 + rep as u32;
        fill(seed)?;
        let d2h_ms = pass(true)?;
        let mapped = alloc.tag_stats(tag).mapped;
        let free_before = ctx.memory_info()?.free;
        let t = Instant::now();
        alloc.sleep(tag, SleepMode::Offload)?;
        let took = ms(t);
        let gained = ctx.memory_info()?.free.saturating_sub(free_before);
        let ratio = gained as f64 / mapped as f64;
        r.freed_ratio = if rep == 0 { ratio } else { r.freed_ratio.min(ratio) };
        if rep == 0 {
            r.first_offload_ms = took;
        } else {
            off.push(took);
            d2h.push(d2h_ms);
        }
        let t = Instant::now();
        alloc.wake(tag)?;
        let took = ms(t);
        r.mismatches += check(seed)?;
        // Overwrites the blocks, which the next cycle fills again.
        let h2d_ms = pass(false)?;
        release_like_a_sleep(ctx, &s, mapped as usize, page)?;
        let h2d_freed_ms = pass(false)?;
        if rep > 0 {
            wake.push(took);
            h2d.push(h2d_ms);
            h2d_freed.push(h2d_freed_ms);
        }

        let t = Instant::now();
        alloc.sleep(tag, SleepMode::Discard)?;
        let took = ms(t);
        let t = Instant::now();
        alloc.wake(tag)?;
        if rep > 0 {
            disc.push(took);
            dwake.push(ms(t));
        }
    }
    r.d2h_bound_ms = median(&d2h);
    r.h2d_bound_ms = median(&h2d);
    r.h2d_after_frees_ms = median(&h2d_freed);
    r.spread = Spread::of([&off, &d2h, &wake, &h2d]);
    r.offload_ms = median(&off);
    r.wake_ms = median(&wake);
    r.discard_ms = median(&disc);
    r.discard_wake_ms = median(&dwake);
    Ok(r)
}
