//! `cuvmm bench sleep`: putting tagged memory to sleep and waking it, beside the copy bounds.
//!
//! The bounds are measured in every cycle, beside the sleep and the wake: the tagged bytes copied
//! between the device and pinned host memory, each way, timed with events. A sleep with offload
//! must copy as much to the host, a wake as much back, so those copies are what they are judged
//! against, whatever the backup (pageable, pinned, a file). The first sleep of a process also
//! makes its backup (and the staging ring); it is reported apart, with its cycle, and with
//! `--fresh-process` the first cycle runs in a child process of its own.
//!
//! A wake follows its sleep at once, and the sleep has just given the device's memory back: after
//! large releases the driver keeps working on its own for some tens of milliseconds, and a copy
//! that starts then runs slower. So the host-to-device bound is also taken right after releasing
//! as much memory, made, mapped and written the same way, and the wake is reported against both.
//! `--gap-ms` waits between the sleep and the wake, to see how much of a wake is that work.
//!
//! With several devices, one allocator per device holds the tag; the sleeps (and the wakes, and
//! the bounds) run on all of them at once, a thread per device, and are timed together.
//!
//! Each cycle records resident memory (VmRSS) and the pinned memory cuvmm holds
//! ([`cuvmm::host::pinned_bytes`], less the bench's own bound buffers) before the sleep, asleep,
//! right after the wake, and once the cycle's other work is done (a released backup is given
//! back on a thread of its own).

use super::{invalid, median};
use cuvmm::alloc::{
    AllocatorConfig, BackupKind, BackupOptions, SleepMode, StreamAllocator, StreamBlock, Tag,
};
use cuvmm::context::Context;
use cuvmm::error::Result;
use cuvmm::host::PinnedBuffer;
use cuvmm::kernels::Kernels;
use cuvmm::memory::{DeviceSlice, DeviceSliceMut};
use cuvmm::stream::{Event, Stream};
use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// What to run.
#[derive(Clone, Debug)]
pub struct SleepConfig {
    /// Bytes tagged on each device.
    pub bytes: usize,
    /// Bytes per allocation.
    pub block: usize,
    /// Cycles after the first.
    pub reps: usize,
    /// The tag's backup.
    pub backup: BackupOptions,
    /// Waited between each sleep and its wake.
    pub gap: Duration,
    /// Only the first cycle (what a child of `--fresh-process` runs).
    pub first_only: bool,
}

/// One sleep and wake cycle (milliseconds unless named otherwise; bytes of memory).
#[derive(Clone, Debug, Default)]
pub struct Cycle {
    /// 1 for the first.
    pub index: usize,
    /// The first sleep of its process.
    pub first_in_process: bool,
    /// Ran in a child process (`--fresh-process`).
    pub in_child: bool,
    /// Device-to-pinned-host copy of the tagged bytes, every device at once, just before the sleep.
    pub d2h_bound_ms: f64,
    /// The sleep with offload.
    pub offload_ms: f64,
    /// The wake, contents restored.
    pub wake_ms: f64,
    /// Pinned-host-to-device copy right after the wake (undisturbed).
    pub h2d_bound_ms: f64,
    /// The same copy right after releasing as much memory as a sleep does.
    pub h2d_after_frees_ms: f64,
    /// A sleep that drops the contents, and its wake.
    pub discard_ms: f64,
    pub discard_wake_ms: f64,
    /// Elements that differed from what was written, after the wake.
    pub mismatches: u64,
    /// Driver free memory gained by the sleep, over the tagged bytes mapped before it.
    pub freed_ratio: f64,
    /// Resident memory before the sleep, asleep, right after the wake, at the end of the cycle.
    pub rss: [u64; 4],
    /// Pinned memory cuvmm holds, at the same points.
    pub pinned: [u64; 4],
    /// A plain sequential write of the tagged bytes to a file in the disk backup's directory
    /// (`write` of 64 MiB pieces, then `fdatasync`), taken in the same cycle.
    pub plain_write_ms: Option<f64>,
}

impl Cycle {
    pub fn offload_ratio(&self) -> f64 {
        self.offload_ms / self.d2h_bound_ms
    }
    pub fn wake_ratio(&self) -> f64 {
        self.wake_ms / self.h2d_bound_ms
    }
    pub fn wake_ratio_after_frees(&self) -> f64 {
        self.wake_ms / self.h2d_after_frees_ms
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "cycle": self.index, "first_in_process": self.first_in_process, "in_child": self.in_child,
            "d2h_bound_ms": self.d2h_bound_ms, "offload_ms": self.offload_ms, "offload_ratio": self.offload_ratio(),
            "wake_ms": self.wake_ms, "h2d_bound_ms": self.h2d_bound_ms, "wake_ratio": self.wake_ratio(),
            "h2d_after_frees_ms": self.h2d_after_frees_ms, "wake_ratio_after_frees": self.wake_ratio_after_frees(),
            "discard_ms": self.discard_ms, "discard_wake_ms": self.discard_wake_ms,
            "mismatches": self.mismatches, "freed_ratio": self.freed_ratio,
            "rss": {"before": self.rss[0], "asleep": self.rss[1], "after_wake": self.rss[2], "settled": self.rss[3]},
            "pinned": {"before": self.pinned[0], "asleep": self.pinned[1], "after_wake": self.pinned[2], "settled": self.pinned[3]},
            "plain_write_ms": self.plain_write_ms,
        })
    }

    /// Reads back what [`to_json`](Self::to_json) wrote (a child's cycle).
    pub fn from_json(v: &serde_json::Value) -> Option<Cycle> {
        let f = |k: &str| v.get(k).and_then(|x| x.as_f64());
        let four = |k: &str| -> Option<[u64; 4]> {
            let o = v.get(k)?;
            let g = |n: &str| o.get(n).and_then(|x| x.as_u64());
            Some([g("before")?, g("asleep")?, g("after_wake")?, g("settled")?])
        };
        Some(Cycle {
            index: v.get("cycle")?.as_u64()? as usize,
            first_in_process: v.get("first_in_process")?.as_bool()?,
            in_child: true,
            d2h_bound_ms: f("d2h_bound_ms")?,
            offload_ms: f("offload_ms")?,
            wake_ms: f("wake_ms")?,
            h2d_bound_ms: f("h2d_bound_ms")?,
            h2d_after_frees_ms: f("h2d_after_frees_ms")?,
            discard_ms: f("discard_ms")?,
            discard_wake_ms: f("discard_wake_ms")?,
            mismatches: v.get("mismatches")?.as_u64()?,
            freed_ratio: f("freed_ratio")?,
            rss: four("rss")?,
            pinned: four("pinned")?,
            plain_write_ms: f("plain_write_ms"),
        })
    }
}

/// What one run measured (milliseconds unless named otherwise): every cycle, and medians of the
/// cycles after the first of each process.
#[derive(Clone, Debug, Default)]
pub struct SleepReport {
    /// Bytes tagged and put to sleep, every device together.
    pub bytes: usize,
    /// Devices.
    pub devices: usize,
    /// Every cycle, in order.
    pub cycles: Vec<Cycle>,
    /// Device-to-pinned-host copies of `bytes`, one per later cycle, just before its sleep (median).
    pub d2h_bound_ms: f64,
    /// Pinned-host-to-device copies of `bytes`, one per later cycle, just after its wake (median).
    pub h2d_bound_ms: f64,
    /// The same copies, each right after as many bytes as a sleep frees were released (median).
    pub h2d_after_frees_ms: f64,
    /// The first sleep with offload of this process.
    pub first_offload_ms: f64,
    /// Later sleeps with offload (median).
    pub offload_ms: f64,
    /// Wakes after an offloading sleep, contents restored (median).
    pub wake_ms: f64,
    /// Sleeps that drop the contents (median).
    pub discard_ms: f64,
    /// Wakes after those (median).
    pub discard_wake_ms: f64,
    /// Driver free memory gained by a sleep, over the tagged bytes mapped before it (lowest).
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

    /// Adds `c` to the cycles and the medians.
    fn summarise(&mut self) {
        let later: Vec<&Cycle> = self.cycles.iter().filter(|c| !c.first_in_process).collect();
        let get = |f: fn(&Cycle) -> f64| later.iter().map(|c| f(c)).collect::<Vec<f64>>();
        let (off, d2h, wake, h2d) =
            (get(|c| c.offload_ms), get(|c| c.d2h_bound_ms), get(|c| c.wake_ms), get(|c| c.h2d_bound_ms));
        self.offload_ms = median(&off);
        self.d2h_bound_ms = median(&d2h);
        self.wake_ms = median(&wake);
        self.h2d_bound_ms = median(&h2d);
        self.h2d_after_frees_ms = median(&get(|c| c.h2d_after_frees_ms));
        self.discard_ms = median(&get(|c| c.discard_ms));
        self.discard_wake_ms = median(&get(|c| c.discard_wake_ms));
        self.spread = Spread::of([&off, &d2h, &wake, &h2d]);
        self.first_offload_ms =
            self.cycles.iter().find(|c| c.first_in_process && !c.in_child).map_or(0.0, |c| c.offload_ms);
        self.mismatches = self.cycles.iter().map(|c| c.mismatches).sum();
        self.freed_ratio = self.cycles.iter().map(|c| c.freed_ratio).fold(f64::INFINITY, f64::min);
    }
}

/// Resident memory of this process (VmRSS), bytes; 0 where /proc says nothing.
pub fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
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

/// A plain sequential write of `bytes` to a new file in `dir` (64 MiB `write`s, then
/// `fdatasync`), removed after: what a disk backup's throughput is judged against.
fn plain_write(dir: &Path, bytes: usize) -> Result<f64> {
    let path = dir.join(format!("cuvmm-bench-plain-{}.bin", std::process::id()));
    let buf: Vec<u8> = (0..64usize << 20).map(|i| (i >> 12) as u8).collect();
    let io = |e: std::io::Error| invalid(format!("plain write to {}: {e}", path.display()));
    let t = Instant::now();
    let r = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&path)?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(buf.len());
            f.write_all(&buf[..n])?;
            left -= n;
        }
        f.sync_data()
    })();
    let took = ms(t);
    let _ = std::fs::remove_file(&path);
    r.map_err(io)?;
    Ok(took)
}

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// One device's part: its allocator, blocks and bound buffers.
struct Dev {
    ctx: Context,
    k: Kernels,
    alloc: StreamAllocator,
    s: Stream,
    blocks: Vec<StreamBlock>,
    block: usize,
    host: PinnedBuffer<u8>,
    start: Event,
    end: Event,
}

impl Dev {
    fn new(ctx: &Context, tag: Tag, bytes: usize, block: usize) -> Result<Dev> {
        let k = Kernels::load(ctx)?;
        let alloc = StreamAllocator::new(ctx)?;
        let s = Stream::non_blocking(ctx)?;
        let blocks =
            (0..bytes / block).map(|_| alloc.allocate_tagged(block, &s, tag)).collect::<Result<_>>()?;
        let host = PinnedBuffer::<u8>::new(ctx, block)?;
        let (start, end) = (Event::new(ctx)?, Event::new(ctx)?);
        Ok(Dev { ctx: ctx.clone(), k, alloc, s, blocks, block, host, start, end })
    }

    fn fill(&self, seed: u32) -> Result<()> {
        let n = self.block / 4;
        for (i, b) in self.blocks.iter().enumerate() {
            // SAFETY: a live block of `n` words, used only on `s`.
            let mut v = unsafe { DeviceSliceMut::<u32>::from_raw_parts(b.ptr(), n) };
            self.k.pattern_u32(&self.s, &mut v, (i * n) as u64, seed)?;
        }
        self.s.synchronize()
    }

    fn check(&self, seed: u32) -> Result<u64> {
        let n = self.block / 4;
        let mut bad = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            // SAFETY: as in `fill`.
            let v = unsafe { DeviceSlice::<u32>::from_raw_parts(b.ptr(), n) };
            bad += self.k.count_pattern_mismatches(&self.s, &v, (i * n) as u64, seed)?;
        }
        Ok(bad)
    }

    /// Every block through the one pinned host buffer, one way, timed with device events.
    fn pass(&self, to_host: bool) -> Result<f64> {
        self.ctx.bind()?;
        let api = cuvmm::driver::driver()?.api();
        self.start.record(&self.s)?;
        for b in &self.blocks {
            // SAFETY: the device range is a live, mapped block; the host buffer outlives the
            // copy (synchronised below) and nothing else touches it.
            unsafe {
                if to_host {
                    api.cuMemcpyDtoHAsync(self.host.base_ptr().cast(), b.ptr(), self.block, self.s.raw())
                } else {
                    api.cuMemcpyHtoDAsync(b.ptr(), self.host.base_ptr().cast(), self.block, self.s.raw())
                }
            }?;
        }
        self.end.record(&self.s)?;
        self.end.synchronize()?;
        Ok(self.start.elapsed_ms(&self.end)? as f64)
    }
}

/// Runs `f` on every device at once, a thread each; the wall time of the slowest and the first
/// error.
fn on_all<T: Send>(devs: &[Dev], f: impl Fn(&Dev) -> Result<T> + Sync) -> Result<(f64, Vec<T>)> {
    if let [d] = devs {
        let t = Instant::now();
        let v = f(d)?;
        return Ok((ms(t), vec![v]));
    }
    let t = Instant::now();
    let out: Vec<Result<T>> = std::thread::scope(|s| {
        let hs: Vec<_> = devs.iter().map(|d| s.spawn(|| f(d))).collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(invalid("a device's thread panicked"))))
            .collect()
    });
    let took = ms(t);
    Ok((took, out.into_iter().collect::<Result<Vec<T>>>()?))
}

/// Tags `bytes` on each of `ctxs` (in `block`-byte allocations), then sleeps and wakes them
/// `reps + 1` times (once with `first_only`), calling `each` with every cycle as it ends.
pub fn run(
    ctxs: &[Context],
    cfg: &SleepConfig,
    first_index: usize,
    mut each: impl FnMut(&Cycle),
) -> Result<SleepReport> {
    let SleepConfig { bytes, block, reps, ref backup, gap, first_only } = *cfg;
    if block == 0 || block % 4 != 0 || bytes < block || ctxs.is_empty() {
        return Err(invalid("need 0 < block <= size, block a multiple of 4, and a device"));
    }
    let tag = Tag::new("bench-sleep")?;
    tag.set_backup(backup.clone())?;
    let devs = ctxs.iter().map(|c| Dev::new(c, tag, bytes, block)).collect::<Result<Vec<_>>>()?;
    let own_pinned: u64 = devs.iter().map(|d| d.host.len() as u64).sum();
    let pinned = || cuvmm::host::pinned_bytes().saturating_sub(own_pinned);
    let total = devs.iter().map(|d| d.blocks.len() * block).sum();
    let mut r = SleepReport { bytes: total, devices: devs.len(), ..SleepReport::default() };
    // Warm both directions once: the first copies of a process pay for setting up the paths.
    on_all(&devs, |d| d.pass(true))?;
    on_all(&devs, |d| d.pass(false))?;

    let page = AllocatorConfig::default().tag_page;
    let cycles = if first_only { 1 } else { reps + 1 };
    for rep in 0..cycles {
        let seed = 1000 + (first_index + rep) as u32;
        let mut c = Cycle { index: first_index + rep, first_in_process: rep == 0, ..Cycle::default() };
        for d in &devs {
            d.fill(seed)?;
        }
        c.d2h_bound_ms = on_all(&devs, |d| d.pass(true))?.0;
        let mapped: u64 = devs.iter().map(|d| d.alloc.tag_stats(tag).mapped).sum();
        let free_before: usize =
            devs.iter().map(|d| d.ctx.memory_info().map(|m| m.free)).sum::<Result<usize>>()?;
        (c.rss[0], c.pinned[0]) = (rss(), pinned());
        c.offload_ms = on_all(&devs, |d| d.alloc.sleep(tag, SleepMode::Offload))?.0;
        (c.rss[1], c.pinned[1]) = (rss(), pinned());
        let free_after: usize =
            devs.iter().map(|d| d.ctx.memory_info().map(|m| m.free)).sum::<Result<usize>>()?;
        c.freed_ratio = free_after.saturating_sub(free_before) as f64 / mapped as f64;
        if let BackupKind::Disk(dir) = &backup.kind {
            c.plain_write_ms = Some(plain_write(dir, total)?);
        }
        std::thread::sleep(gap);
        c.wake_ms = on_all(&devs, |d| d.alloc.wake(tag))?.0;
        (c.rss[2], c.pinned[2]) = (rss(), pinned());
        for d in &devs {
            c.mismatches += d.check(seed)?;
        }
        // Overwrites the blocks, which the next cycle fills again.
        c.h2d_bound_ms = on_all(&devs, |d| d.pass(false))?.0;
        on_all(&devs, |d| release_like_a_sleep(&d.ctx, &d.s, mapped as usize / devs.len(), page))?;
        c.h2d_after_frees_ms = on_all(&devs, |d| d.pass(false))?.0;

        c.discard_ms = on_all(&devs, |d| d.alloc.sleep(tag, SleepMode::Discard))?.0;
        c.discard_wake_ms = on_all(&devs, |d| d.alloc.wake(tag))?.0;
        (c.rss[3], c.pinned[3]) = (rss(), pinned());
        each(&c);
        r.cycles.push(c);
    }
    r.summarise();
    Ok(r)
}

/// Adds the cycles a child ran (`--fresh-process`) before this process's own, and summarises
/// again.
pub fn with_child_cycles(mut r: SleepReport, child: Vec<Cycle>) -> SleepReport {
    let mut all = child;
    all.append(&mut r.cycles);
    r.cycles = all;
    r.summarise();
    r
}
