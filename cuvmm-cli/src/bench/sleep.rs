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
//! the bounds) run on all of them at once, a thread per device, and are timed together. With
//! `--processes`, each device is a process of its own instead (the layout of a colocated RL job,
//! one process per GPU): the children start each cycle, and take the fresh-memory floor, at the
//! same moment, so that each one's bounds are copies made while all of them copy.
//!
//! With the default backup (pageable, released at wake: lazily unless `CUVMM_BACKUP_RELEASE`
//! says `eager`) the run measures three things in one go: the released cycles, the same cycles
//! with the backup retained (`--no-retained` leaves them out), and the fresh-memory floor.
//!
//! Each cycle records resident memory (VmRSS) and the pinned memory cuvmm holds
//! ([`cuvmm::host::pinned_bytes`], less the bench's own bound buffers) before the sleep, asleep,
//! right after the wake, and once the cycle's other work is done (a released backup is given
//! back on a thread of its own).

use super::sleep_args::child_command;
pub use super::sleep_args::Args;
use super::{invalid, median};
use crate::common::size::show;
use crate::common::CliResult;
use cuvmm::alloc::{
    AllocatorConfig, BackupKind, BackupOptions, SleepMode, StreamAllocator, StreamBlock, Tag,
};
use cuvmm::context::Context;
use cuvmm::driver::result;
use cuvmm::error::Result;
use cuvmm::host::{HostCopy, PinnedBuffer};
use cuvmm::kernels::Kernels;
use cuvmm::memory::{DeviceSlice, DeviceSliceMut};
use cuvmm::stream::{Event, Stream};
use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
use serde_json::json;
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
    /// Takes the fresh-memory floor after the cycles.
    pub floor: bool,
    /// Waits for the parent of `--processes` before each cycle and before the floor.
    pub barrier: bool,
    /// How the staging ring writes ([`cuvmm::alloc::set_backup_host_copy`]), taking turns: cycle
    /// `i` (from 1) with the `(i - 1) % len`-th. Empty: whatever the process has.
    pub host_copies: Vec<HostCopy>,
    /// Prepares the tag's backup ([`StreamAllocator::prepare_backup`]) once the tag is allocated
    /// and filled, and waits until it is ready, before the first cycle.
    pub prepare: bool,
}

impl SleepConfig {
    /// The host copy of cycle `index` (from 1), if the run sets one.
    fn host_copy(&self, index: usize) -> Option<HostCopy> {
        let n = self.host_copies.len();
        (n > 0).then(|| self.host_copies[(index.max(1) - 1) % n])
    }
}

/// One sleep and wake cycle (milliseconds unless named otherwise; bytes of memory).
#[derive(Clone, Debug, Default)]
pub struct Cycle {
    /// 1 for the first.
    pub index: usize,
    /// The first sleep of its process.
    pub first_in_process: bool,
    /// Before a first sleep: how long its backup took to be prepared in the background
    /// (`--prepare`), from the call to the backup ready.
    pub prepared_ms: Option<f64>,
    /// Ran in a child process (`--fresh-process`).
    pub in_child: bool,
    /// How the staging ring wrote in its sleep and wake, when the run set it.
    pub host_copy: Option<HostCopy>,
    /// What the cycle timed.
    pub steps: Steps,
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
    /// What the host's kernel did during the sleep, from `/proc/vmstat` (the whole host's
    /// counts): huge pages faulted in, huge-page faults that fell back to small pages, direct
    /// compaction stalls, and pages scanned for reclaim by kswapd and by the faulting threads. A
    /// first sleep far above the fresh-memory floor with fallbacks or stalls waited for the kernel
    /// to find free huge pages in fragmented memory; with pages scanned, to reclaim memory (page
    /// cache, say) to give it.
    pub sleep_vmstat: [u64; 5],
}

/// The `/proc/vmstat` counters [`Cycle::sleep_vmstat`] takes, in its order.
const VMSTAT: [&str; 5] =
    ["thp_fault_alloc", "thp_fault_fallback", "compact_stall", "pgscan_kswapd", "pgscan_direct"];

/// The host's [`VMSTAT`] counters now (zeros where /proc says nothing).
fn vmstat() -> [u64; 5] {
    let text = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    VMSTAT.map(|name| {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    })
}

/// The steps of a cycle, timed on every device at once, in milliseconds: of one cycle, or their
/// medians over a run's cycles.
#[derive(Clone, Copy, Debug, Default)]
pub struct Steps {
    /// Device-to-pinned-host copy of the tagged bytes, just before the sleep.
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
}

impl Steps {
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

impl Cycle {
    pub fn to_json(&self) -> serde_json::Value {
        let t = &self.steps;
        serde_json::json!({
            "cycle": self.index, "first_in_process": self.first_in_process, "in_child": self.in_child,
            "d2h_bound_ms": t.d2h_bound_ms, "offload_ms": t.offload_ms, "offload_ratio": t.offload_ratio(),
            "wake_ms": t.wake_ms, "h2d_bound_ms": t.h2d_bound_ms, "wake_ratio": t.wake_ratio(),
            "h2d_after_frees_ms": t.h2d_after_frees_ms, "wake_ratio_after_frees": t.wake_ratio_after_frees(),
            "discard_ms": t.discard_ms, "discard_wake_ms": t.discard_wake_ms,
            "mismatches": self.mismatches, "freed_ratio": self.freed_ratio,
            "rss": {"before": self.rss[0], "asleep": self.rss[1], "after_wake": self.rss[2], "settled": self.rss[3]},
            "pinned": {"before": self.pinned[0], "asleep": self.pinned[1], "after_wake": self.pinned[2], "settled": self.pinned[3]},
            "plain_write_ms": self.plain_write_ms,
            "sleep_vmstat": VMSTAT.iter().zip(self.sleep_vmstat).map(|(k, v)| ((*k).to_string(), v.into())).collect::<serde_json::Map<_, _>>(),
            "host_copy": self.host_copy.map(HostCopy::name),
            "prepared_ms": self.prepared_ms,
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
            host_copy: v.get("host_copy").and_then(|c| c.as_str()).and_then(|c| c.parse().ok()),
            prepared_ms: f("prepared_ms"),
            steps: Steps {
                d2h_bound_ms: f("d2h_bound_ms")?,
                offload_ms: f("offload_ms")?,
                wake_ms: f("wake_ms")?,
                h2d_bound_ms: f("h2d_bound_ms")?,
                h2d_after_frees_ms: f("h2d_after_frees_ms")?,
                discard_ms: f("discard_ms")?,
                discard_wake_ms: f("discard_wake_ms")?,
            },
            mismatches: v.get("mismatches")?.as_u64()?,
            freed_ratio: f("freed_ratio")?,
            rss: four("rss")?,
            pinned: four("pinned")?,
            plain_write_ms: f("plain_write_ms"),
            sleep_vmstat: VMSTAT
                .map(|k| v.get("sleep_vmstat").and_then(|o| o.get(k)).and_then(|x| x.as_u64()).unwrap_or(0)),
        })
    }
}

/// What one run measured (milliseconds unless named otherwise): every cycle, and medians of the
/// cycles after the first of each process.
#[derive(Clone, Debug, Default)]
pub struct SleepReport {
    /// What was run: the backup, and how it was released.
    pub label: String,
    /// Bytes tagged and put to sleep, every device together.
    pub bytes: usize,
    /// Devices.
    pub devices: usize,
    /// Every cycle, in order.
    pub cycles: Vec<Cycle>,
    /// Each step's median over the cycles after the first of each process.
    pub median: Steps,
    /// The first sleep with offload of this process.
    pub first_offload_ms: f64,
    /// Driver free memory gained by a sleep, over the tagged bytes mapped before it (lowest).
    pub freed_ratio: f64,
    /// Elements that differed from what was written, over every wake that restored contents.
    pub mismatches: u64,
    /// Fastest and slowest of each timed series: offload, D2H bound, wake, H2D bound.
    pub spread: Spread,
    /// With more than one host copy in the cycles: each one's medians over its cycles after the
    /// first of each process, and how many those are.
    pub by_host_copy: Vec<(HostCopy, Steps, usize)>,
    /// The tagged bytes of fresh host memory at best ([`cuvmm::alloc::fresh_backup_memory`],
    /// each device's at once), a few times after the cycles: the floor of a sleep into fresh
    /// memory (a process's first, or one after the kernel took a released backup back).
    pub fresh_host_ms: Vec<f64>,
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
    /// The fresh host memory's median, fastest and slowest ms, and the median over the median D2H
    /// bound of the cycles after each process's first.
    pub fn fresh_host(&self) -> Option<(f64, f64, f64, f64)> {
        let ms = &self.fresh_host_ms;
        let (lo, hi) = ms.iter().fold((f64::INFINITY, 0.0_f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        (!ms.is_empty()).then(|| (median(ms), lo, hi, median(ms) / self.median.d2h_bound_ms))
    }

    /// The first sleep of the first process over the fresh-memory floor's median.
    pub fn first_over_floor(&self) -> Option<f64> {
        let first = self.cycles.iter().find(|c| c.first_in_process)?;
        self.fresh_host().map(|f| first.steps.offload_ms / f.0)
    }

    /// Adds `c` to the cycles and the medians.
    fn summarise(&mut self) {
        let later: Vec<&Steps> =
            self.cycles.iter().filter(|c| !c.first_in_process).map(|c| &c.steps).collect();
        let get = |f: fn(&Steps) -> f64| later.iter().map(|t| f(t)).collect::<Vec<f64>>();
        let (off, d2h, wake, h2d) =
            (get(|t| t.offload_ms), get(|t| t.d2h_bound_ms), get(|t| t.wake_ms), get(|t| t.h2d_bound_ms));
        self.median = medians(&later);
        self.spread = Spread::of([&off, &d2h, &wake, &h2d]);
        let mut copies: Vec<HostCopy> = Vec::new();
        for c in self.cycles.iter().filter_map(|c| c.host_copy) {
            if !copies.contains(&c) {
                copies.push(c);
            }
        }
        self.by_host_copy = if copies.len() < 2 {
            Vec::new()
        } else {
            copies
                .into_iter()
                .map(|copy| {
                    let mine: Vec<&Steps> = self
                        .cycles
                        .iter()
                        .filter(|c| !c.first_in_process && c.host_copy == Some(copy))
                        .map(|c| &c.steps)
                        .collect();
                    (copy, medians(&mine), mine.len())
                })
                .collect()
        };
        self.first_offload_ms = self
            .cycles
            .iter()
            .find(|c| c.first_in_process && !c.in_child)
            .map_or(0.0, |c| c.steps.offload_ms);
        self.mismatches = self.cycles.iter().map(|c| c.mismatches).sum();
        self.freed_ratio = self.cycles.iter().map(|c| c.freed_ratio).fold(f64::INFINITY, f64::min);
    }
}

/// Each step's median over `steps`.
fn medians(steps: &[&Steps]) -> Steps {
    let get = |f: fn(&Steps) -> f64| median(&steps.iter().map(|t| f(t)).collect::<Vec<f64>>());
    Steps {
        d2h_bound_ms: get(|t| t.d2h_bound_ms),
        offload_ms: get(|t| t.offload_ms),
        wake_ms: get(|t| t.wake_ms),
        h2d_bound_ms: get(|t| t.h2d_bound_ms),
        h2d_after_frees_ms: get(|t| t.h2d_after_frees_ms),
        discard_ms: get(|t| t.discard_ms),
        discard_wake_ms: get(|t| t.discard_wake_ms),
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
        unsafe { result::mem::memset_d32_async(api, m.ptr(), 0x5eed_5eed, page / 4, s.raw()) }?;
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
                    result::mem::memcpy_dtoh_async(
                        api,
                        self.host.base_ptr().cast(),
                        b.ptr(),
                        self.block,
                        self.s.raw(),
                    )
                } else {
                    result::mem::memcpy_htod_async(
                        api,
                        b.ptr(),
                        self.host.base_ptr().cast(),
                        self.block,
                        self.s.raw(),
                    )
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

/// Prepares the tag's backup on every device and waits until all are ready; the milliseconds
/// from the first call.
fn prepare_backups(devs: &[Dev], tag: Tag) -> Result<f64> {
    let t = Instant::now();
    for d in devs {
        d.alloc.prepare_backup(tag)?;
    }
    while !devs.iter().all(|d| d.alloc.backups_prepared()) {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(ms(t))
}

/// Tags `bytes` on each of `ctxs` (in `block`-byte allocations), then sleeps and wakes them
/// `reps + 1` times (once with `first_only`), calling `each` with every cycle as it ends.
pub fn run(
    ctxs: &[Context],
    cfg: &SleepConfig,
    first_index: usize,
    mut each: impl FnMut(&Cycle),
) -> Result<SleepReport> {
    let SleepConfig {
        bytes,
        block,
        reps,
        ref backup,
        gap,
        first_only,
        floor,
        barrier,
        host_copies: _,
        prepare,
    } = *cfg;
    if block == 0 || block % 4 != 0 || bytes < block || ctxs.is_empty() {
        return Err(invalid("need 0 < block <= size, block a multiple of 4, and a device"));
    }
    let tag = Tag::new("bench-sleep")?;
    tag.set_backup(backup.clone())?;
    let devs = ctxs.iter().map(|c| Dev::new(c, tag, bytes, block)).collect::<Result<Vec<_>>>()?;
    let own_pinned: u64 = devs.iter().map(|d| d.host.len() as u64).sum();
    let pinned = || cuvmm::host::pinned_bytes().saturating_sub(own_pinned);
    let total = devs.iter().map(|d| d.blocks.len() * block).sum();
    let mut r =
        SleepReport { label: label(backup), bytes: total, devices: devs.len(), ..SleepReport::default() };
    // Warm both directions once: the first copies of a process pay for setting up the paths.
    on_all(&devs, |d| d.pass(true))?;
    on_all(&devs, |d| d.pass(false))?;

    let prepared_ms = if prepare { Some(prepare_backups(&devs, tag)?) } else { None };
    let page = AllocatorConfig::default().tag_page;
    let cycles = if first_only { 1 } else { reps + 1 };
    for rep in 0..cycles {
        if barrier {
            wait_for_parent()?;
        }
        let seed = 1000 + (first_index + rep) as u32;
        let mut c = Cycle {
            index: first_index + rep,
            first_in_process: rep == 0,
            prepared_ms: prepared_ms.filter(|_| rep == 0),
            ..Cycle::default()
        };
        c.host_copy = cfg.host_copy(c.index);
        if let Some(copy) = c.host_copy {
            cuvmm::alloc::set_backup_host_copy(copy);
        }
        for d in &devs {
            d.fill(seed)?;
        }
        c.steps.d2h_bound_ms = on_all(&devs, |d| d.pass(true))?.0;
        let mapped: u64 = devs.iter().map(|d| d.alloc.tag_stats(tag).mapped).sum();
        let free_before: usize =
            devs.iter().map(|d| d.ctx.memory_info().map(|m| m.free)).sum::<Result<usize>>()?;
        (c.rss[0], c.pinned[0]) = (rss(), pinned());
        let kernel = vmstat();
        c.steps.offload_ms = on_all(&devs, |d| d.alloc.sleep(tag, SleepMode::Offload))?.0;
        let after = vmstat();
        c.sleep_vmstat = std::array::from_fn(|i| after[i].saturating_sub(kernel[i]));
        (c.rss[1], c.pinned[1]) = (rss(), pinned());
        let free_after: usize =
            devs.iter().map(|d| d.ctx.memory_info().map(|m| m.free)).sum::<Result<usize>>()?;
        c.freed_ratio = free_after.saturating_sub(free_before) as f64 / mapped as f64;
        if let BackupKind::Disk(dir) = &backup.kind {
            c.plain_write_ms = Some(plain_write(dir, total)?);
        }
        std::thread::sleep(gap);
        c.steps.wake_ms = on_all(&devs, |d| d.alloc.wake(tag))?.0;
        (c.rss[2], c.pinned[2]) = (rss(), pinned());
        for d in &devs {
            c.mismatches += d.check(seed)?;
        }
        // Overwrites the blocks, which the next cycle fills again.
        c.steps.h2d_bound_ms = on_all(&devs, |d| d.pass(false))?.0;
        on_all(&devs, |d| release_like_a_sleep(&d.ctx, &d.s, mapped as usize / devs.len(), page))?;
        c.steps.h2d_after_frees_ms = on_all(&devs, |d| d.pass(false))?.0;

        c.steps.discard_ms = on_all(&devs, |d| d.alloc.sleep(tag, SleepMode::Discard))?.0;
        c.steps.discard_wake_ms = on_all(&devs, |d| d.alloc.wake(tag))?.0;
        (c.rss[3], c.pinned[3]) = (rss(), pinned());
        each(&c);
        r.cycles.push(c);
    }
    // After every cycle, so that nothing timed follows the host's work of giving the memory back;
    // each device's backup at once, as the sleeps make them.
    if floor && !first_only {
        if barrier {
            wait_for_parent()?;
        }
        for _ in 0..FRESH_SAMPLES {
            let per_device = total / devs.len();
            r.fresh_host_ms.push(on_all(&devs, |_| cuvmm::alloc::fresh_backup_memory(per_device))?.0);
        }
    }
    r.summarise();
    Ok(r)
}

/// Times the fresh host memory of a pageable backup is taken, after the cycles.
const FRESH_SAMPLES: usize = 3;

/// What a run with `backup` measures, in words.
fn label(backup: &BackupOptions) -> String {
    let kind = match backup.kind {
        BackupKind::Pageable => "pageable",
        BackupKind::Pinned => "pinned",
        BackupKind::Disk(_) => "disk",
    };
    let eager = std::env::var("CUVMM_BACKUP_RELEASE").is_ok_and(|v| v.trim() == "eager");
    let released = match (backup.retain, &backup.kind) {
        (true, _) => "retained",
        (false, BackupKind::Pageable) if !eager => "released lazily at wake",
        (false, _) => "released at wake",
    };
    format!("{kind}, {released}")
}

/// Tells the parent of `--processes` this process is at a barrier (a JSON line), and waits for
/// its word on stdin.
fn wait_for_parent() -> Result<()> {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", json!({"bench": BARRIER}));
    let _ = out.flush();
    drop(out);
    let mut line = String::new();
    match std::io::stdin().read_line(&mut line) {
        Ok(n) if n > 0 => Ok(()),
        _ => Err(invalid("the parent of --processes went away")),
    }
}

/// The `bench` of a child's barrier line.
const BARRIER: &str = "sleep-barrier";

/// Adds the cycles a child ran (`--fresh-process`) before this process's own, and summarises
/// again.
pub fn with_child_cycles(mut r: SleepReport, child: Vec<Cycle>) -> SleepReport {
    let mut all = child;
    all.append(&mut r.cycles);
    r.cycles = all;
    r.summarise();
    r
}

/// `cuvmm bench sleep`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let kind = backup_kind(&args.backup, args.dir.as_ref())?;
    if args.processes > 1 {
        if args.fresh_process {
            return Err(invalid(
                "--processes runs each device in a fresh process already: no --fresh-process",
            )
            .into());
        }
        let devices: Vec<usize> =
            if args.devices.is_empty() { (0..args.processes).collect() } else { args.devices.clone() };
        if devices.len() != args.processes {
            return Err(invalid(format!(
                "--processes {} with {} devices named",
                args.processes,
                devices.len()
            ))
            .into());
        }
        return super::sleep_procs::cli(&args, &devices, out);
    }
    let devices = if args.devices.is_empty() { vec![args.device] } else { args.devices.clone() };
    let ctxs = devices.iter().map(|&d| Context::for_ordinal(d)).collect::<cuvmm::Result<Vec<_>>>()?;
    let cfg = SleepConfig {
        bytes: args.size,
        block: args.block,
        reps: args.reps,
        backup: BackupOptions { kind, retain: args.retain },
        gap: std::time::Duration::from_millis(args.gap_ms),
        first_only: args.first_only,
        floor: false,
        barrier: args.barrier,
        host_copies: args.host_copy.clone().unwrap_or_default(),
        prepare: args.prepare,
    };
    let released = cfg.backup.kind == BackupKind::Pageable && !cfg.backup.retain;
    let cfg = SleepConfig { floor: released, ..cfg };
    let bytes = args.size * devices.len();
    if args.first_only {
        run(&ctxs, &cfg, 1, |c| {
            let _ = print_cycle(out, c, bytes, true);
        })?;
        return Ok(());
    }
    let mut child = Vec::new();
    if args.fresh_process {
        child = sleep_in_child(&args, &devices)?;
    }
    let names = ctxs.iter().map(|c| c.device().name()).collect::<cuvmm::Result<Vec<_>>>()?;
    if !args.json {
        print_sleep_header(out, &args, &names, devices.len())?;
    }
    for c in &child {
        print_cycle(out, c, bytes, args.json)?;
    }
    let r = run(&ctxs, &cfg, child.len() + 1, |c| {
        let _ = print_cycle(out, c, bytes, args.json);
    })?;
    let r = with_child_cycles(r, child);
    if !released || args.no_retained {
        return print_sleep_summary(out, &r, &names, args.block, args.reps, args.json);
    }
    // The same cycles with the backup retained, in the same run: what holding the memory buys.
    let retained =
        SleepConfig { backup: BackupOptions { retain: true, ..cfg.backup.clone() }, floor: false, ..cfg };
    if !args.json {
        writeln!(out, "the same cycles with the backup retained:")?;
        print_cycle_header(out)?;
    }
    let kept = run(&ctxs, &retained, r.cycles.len() + 1, |c| {
        let _ = print_cycle(out, c, bytes, args.json);
    })?;
    let first = print_sleep_summary(out, &r, &names, args.block, args.reps, args.json);
    let second = print_sleep_summary(out, &kept, &names, args.block, args.reps, args.json);
    first.and(second)
}

/// The backup `--backup` names (with `--dir` for a disk backup).
fn backup_kind(backup: &str, dir: Option<&std::path::PathBuf>) -> Result<BackupKind> {
    match (backup, dir) {
        ("pageable", _) => Ok(BackupKind::Pageable),
        ("pinned", _) => Ok(BackupKind::Pinned),
        ("disk", Some(d)) => Ok(BackupKind::Disk(d.clone())),
        ("disk", None) => Err(super::invalid("--backup disk needs --dir")),
        (other, _) => Err(super::invalid(format!("unknown --backup {other} (pageable, pinned, disk)"))),
    }
}

/// What the run does, and the head of the table of cycles.
fn print_sleep_header(
    out: &mut impl Write,
    args: &Args,
    names: &[String],
    devices: usize,
) -> std::io::Result<()> {
    let (backup, retain, gap_ms) = (&args.backup, args.retain, args.gap_ms);
    writeln!(
        out,
        "{}: sleep and wake of {} tagged on each of {} device(s) in {} blocks, backup {backup}{}{}{}; bounds taken in each cycle",
        names.join(", "),
        show(args.size),
        devices,
        show(args.block),
        if retain { ", retained" } else { "" },
        if gap_ms > 0 { format!(", {gap_ms} ms between sleep and wake") } else { String::new() },
        match args.host_copy.as_deref() {
            Some([one]) => format!(", {one} host copies"),
            Some(more) => format!(
                ", host copies taking turns ({})",
                more.iter().map(|c| c.name()).collect::<Vec<_>>().join(", ")
            ),
            None => String::new(),
        },
    )?;
    print_cycle_header(out)
}

/// The head of the table of cycles.
fn print_cycle_header(out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "{SLEEP_CYCLE_HEADER}")?;
    writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
}

/// One cycle, as a JSON line or a row of the table.
fn print_cycle(out: &mut impl Write, c: &Cycle, bytes: usize, json: bool) -> std::io::Result<()> {
    if json {
        writeln!(out, "{}", json!({"bench": "sleep-cycle", "cycle": c.to_json()}))
    } else {
        print_sleep_cycle(out, c, bytes)
    }
}

const SLEEP_CYCLE_HEADER: &str = "| cycle | sleep ms | D2H bound ms | ratio | wake ms | H2D bound ms | ratio | H2D after frees ms | ratio | discard ms | RSS MiB before / asleep / woken / settled | pinned MiB before / asleep / woken / settled | mismatches | disk: plain write ms (sleep GB/s vs write GB/s) | during the sleep, host-wide: huge pages faulted / fallbacks / compaction stalls / pages scanned by kswapd / directly |";

fn print_sleep_cycle(out: &mut impl Write, c: &Cycle, bytes: usize) -> std::io::Result<()> {
    let mib = |v: [u64; 4]| v.map(|b| format!("{:.0}", b as f64 / (1u64 << 20) as f64)).join(" / ");
    let gbs = |ms: f64| bytes as f64 / ms / 1e6;
    let disk = c
        .plain_write_ms
        .map_or(String::new(), |w| format!("{w:.1} ({:.2} vs {:.2})", gbs(c.steps.offload_ms), gbs(w)));
    let place = match (c.in_child, c.first_in_process) {
        (true, _) => " (fresh child)",
        (false, true) => " (first of the run)",
        _ => "",
    };
    let place = match c.host_copy {
        Some(copy) => format!("{place} {copy}"),
        None => place.to_string(),
    };
    writeln!(
        out,
        "| {}{place} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} | {:.3} | {:.1} | {:.3} | {:.2} | {} | {} | {} | {disk} | {} |",
        c.index,
        c.steps.offload_ms,
        c.steps.d2h_bound_ms,
        c.steps.offload_ratio(),
        c.steps.wake_ms,
        c.steps.h2d_bound_ms,
        c.steps.wake_ratio(),
        c.steps.h2d_after_frees_ms,
        c.steps.wake_ratio_after_frees(),
        c.steps.discard_ms,
        mib(c.rss),
        mib(c.pinned),
        c.mismatches,
        c.sleep_vmstat.map(|n| n.to_string()).join(" / "),
    )
}

/// Runs the first cycle of `bench sleep` in a child process (a fresh process's first sleep) and
/// reads its cycle back.
fn sleep_in_child(args: &Args, devices: &[usize]) -> Result<Vec<Cycle>, Box<dyn std::error::Error>> {
    let mut cmd = child_command(args, devices)?;
    cmd.arg("--first-only");
    let o = cmd.stderr(std::process::Stdio::inherit()).output()?;
    if !o.status.success() {
        return Err(super::invalid(format!("the fresh child failed: {}", o.status)).into());
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let cycles: Vec<Cycle> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("cycle").and_then(Cycle::from_json))
        .collect();
    if cycles.is_empty() {
        return Err(super::invalid("the fresh child reported no cycle").into());
    }
    Ok(cycles)
}

/// Each goal of sleep and wake, judged cycle by cycle against the bounds of the same cycle.
fn sleep_goals(r: &SleepReport) -> Vec<(String, serde_json::Value)> {
    let first: Vec<&Cycle> = r.cycles.iter().filter(|c| c.first_in_process).collect();
    let later: Vec<&Cycle> = r.cycles.iter().filter(|c| !c.first_in_process).collect();
    let mut goals = vec![
        (
            "first sleep of a process <= 1.3x its D2H bound".into(),
            first.iter().all(|c| c.steps.offload_ratio() <= 1.3).into(),
        ),
        (
            "every later sleep <= 1.05x its D2H bound".into(),
            later.iter().all(|c| c.steps.offload_ratio() <= 1.05).into(),
        ),
        (
            "every wake <= 1.05x the H2D bound after the same frees".into(),
            r.cycles.iter().all(|c| c.steps.wake_ratio_after_frees() <= 1.05).into(),
        ),
        (
            "every discarding sleep <= 25 ms".into(),
            r.cycles.iter().all(|c| c.steps.discard_ms <= 25.0).into(),
        ),
        (
            "every later sleep <= 1.10x its D2H bound".into(),
            later.iter().all(|c| c.steps.offload_ratio() <= 1.10).into(),
        ),
    ];
    if let Some(x) = r.first_over_floor() {
        goals.push(("first sleep of a process <= 1.2x the fresh-memory floor".into(), (x <= 1.2).into()));
    }
    goals
}

/// The run's summary (a JSON line or a table and its notes); an error after it when a wake did
/// not restore what was written.
fn print_sleep_summary(
    out: &mut impl Write,
    r: &SleepReport,
    names: &[String],
    block: usize,
    reps: usize,
    json: bool,
) -> CliResult {
    if json {
        print_summary_json(out, r)?;
    } else {
        print_summary_table(out, r, names, block, reps)?;
        print_summary_notes(out, r)?;
    }
    if r.mismatches > 0 {
        return Err(super::invalid(format!(
            "{} elements changed across sleep and wake: the wakes did not restore what was written",
            r.mismatches
        ))
        .into());
    }
    Ok(())
}

fn print_summary_json(out: &mut impl Write, r: &SleepReport) -> std::io::Result<()> {
    let fresh = r.fresh_host();
    let line = json!({"bench": "sleep", "run": r.label, "bytes": r.bytes, "devices": r.devices, "d2h_bound_ms": r.median.d2h_bound_ms,
            "h2d_bound_ms": r.median.h2d_bound_ms, "first_offload_ms": r.first_offload_ms,
            "offload_ms": r.median.offload_ms, "offload_ratio": r.median.offload_ratio(), "wake_ms": r.median.wake_ms,
            "wake_ratio": r.median.wake_ratio(), "h2d_after_frees_ms": r.median.h2d_after_frees_ms,
            "wake_ratio_after_frees": r.median.wake_ratio_after_frees(), "discard_ms": r.median.discard_ms, "discard_wake_ms": r.median.discard_wake_ms,
            "freed_ratio": r.freed_ratio, "mismatches": r.mismatches,
            "fresh_host_ms": fresh.map(|f| f.0), "fresh_host_ratio": fresh.map(|f| f.3),
            "first_offload_ratio": r.cycles.iter().find(|c| c.first_in_process).map(|c| c.steps.offload_ratio()),
            "first_over_floor": r.first_over_floor(),
            "goals": sleep_goals(r).into_iter().collect::<serde_json::Map<String, serde_json::Value>>(),
            "fastest_slowest_ms": {"offload": r.spread.0[0], "d2h_bound": r.spread.0[1],
                "wake": r.spread.0[2], "h2d_bound": r.spread.0[3]}});
    let mut line = line;
    if !r.by_host_copy.is_empty() {
        let by: serde_json::Map<String, serde_json::Value> = r
            .by_host_copy
            .iter()
            .map(|(copy, m, n)| {
                let v = json!({"cycles": n, "offload_ms": m.offload_ms, "offload_ratio": m.offload_ratio(),
                    "wake_ms": m.wake_ms, "wake_ratio": m.wake_ratio(), "wake_ratio_after_frees": m.wake_ratio_after_frees()});
                (copy.name().to_string(), v)
            })
            .collect();
        line["by_host_copy"] = by.into();
    }
    writeln!(out, "{line}")
}

/// Each step's median, spread and GB/s beside its bound.
fn print_summary_table(
    out: &mut impl Write,
    r: &SleepReport,
    names: &[String],
    block: usize,
    reps: usize,
) -> std::io::Result<()> {
    let gbs = |ms: f64| r.bytes as f64 / ms / 1e6;
    writeln!(
        out,
        "{}: {}: sleep and wake of {} tagged in {} blocks, {} cycles after the first; medians of the cycles after each process's first",
        names.join(", "),
        r.label,
        show(r.bytes),
        show(block),
        reps
    )?;
    let [off, d2h, wake, h2d] = r.spread.0;
    writeln!(out, "| step | ms | fastest-slowest | GB/s | bound ms | bound fastest-slowest | ratio |")?;
    writeln!(out, "|---|---|---|---|---|---|---|")?;
    writeln!(
        out,
        "| sleep, offload | {:.1} | {:.1}-{:.1} | {:.1} | {:.1} (pinned D2H) | {:.1}-{:.1} | {:.3} |",
        r.median.offload_ms,
        off.0,
        off.1,
        gbs(r.median.offload_ms),
        r.median.d2h_bound_ms,
        d2h.0,
        d2h.1,
        r.median.offload_ratio()
    )?;
    writeln!(
        out,
        "| wake, restore | {:.1} | {:.1}-{:.1} | {:.1} | {:.1} (pinned H2D) | {:.1}-{:.1} | {:.3} |",
        r.median.wake_ms,
        wake.0,
        wake.1,
        gbs(r.median.wake_ms),
        r.median.h2d_bound_ms,
        h2d.0,
        h2d.1,
        r.median.wake_ratio()
    )?;
    writeln!(
        out,
        "| wake, restore, against the bound after the same frees | {:.1} | | | {:.1} (pinned H2D right after releasing {}) | | {:.3} |",
        r.median.wake_ms,
        r.median.h2d_after_frees_ms,
        show(r.bytes),
        r.median.wake_ratio_after_frees()
    )?;
    writeln!(out, "| sleep, discard | {:.2} | | | | | |", r.median.discard_ms)?;
    writeln!(out, "| wake after discard | {:.2} | | | | | |", r.median.discard_wake_ms)
}

/// Under the table: memory freed, each process's first sleep, the contents check, the goals.
fn print_summary_notes(out: &mut impl Write, r: &SleepReport) -> std::io::Result<()> {
    writeln!(
        out,
        "driver free memory gained by a sleep: {:.3} of the tagged bytes (lowest of the runs)",
        r.freed_ratio
    )?;
    for c in r.cycles.iter().filter(|c| c.first_in_process) {
        writeln!(
            out,
            "first sleep of {} (cycle {}): {:.1} ms, {:.3}x its cycle's D2H bound",
            if c.in_child { "a fresh child process" } else { "this run's allocators, backup fresh" },
            c.index,
            c.steps.offload_ms,
            c.steps.offload_ratio()
        )?;
        if let Some(p) = c.prepared_ms {
            writeln!(
                out,
                "  its backup prepared in the background before it: ready {p:.1} ms after the call"
            )?;
        }
    }
    if let Some((ms, lo, hi, ratio)) = r.fresh_host() {
        writeln!(
            out,
            "fresh host memory at best ({} written by every core, a slice each, huge pages advised; {} times after the cycles): {ms:.1} ms ({lo:.1}-{hi:.1}), {ratio:.3}x the median D2H bound: a sleep into fresh memory takes no less",
            show(r.bytes),
            r.fresh_host_ms.len()
        )?;
    }
    if let Some(x) = r.first_over_floor() {
        writeln!(out, "first sleep of a process over that floor: {x:.3}x")?;
    }
    for (copy, m, n) in &r.by_host_copy {
        writeln!(
            out,
            "{copy} host copies (the cycles took turns; medians of {n} after each process's first): sleep {:.1} ms, \
             {:.3}x its D2H bound; wake {:.1} ms, {:.3}x its H2D bound, {:.3}x after the same frees",
            m.offload_ms,
            m.offload_ratio(),
            m.wake_ms,
            m.wake_ratio(),
            m.wake_ratio_after_frees()
        )?;
    }
    writeln!(out, "elements changed across sleep and wake: {}", r.mismatches)?;
    for (goal, met) in sleep_goals(r) {
        writeln!(out, "goal: {goal}: {}", if met == true { "met" } else { "NOT met" })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::sleep_args::parse_args;
    use super::*;
    use crate::bench::assert_report;

    fn cycle(index: usize, first_in_process: bool, in_child: bool, scale: f64) -> Cycle {
        Cycle {
            index,
            first_in_process,
            in_child,
            host_copy: None,
            prepared_ms: None,
            steps: Steps {
                d2h_bound_ms: 330.25 * scale,
                offload_ms: 343.6 * scale,
                wake_ms: 352.75 * scale,
                h2d_bound_ms: 325.3,
                h2d_after_frees_ms: 346.9,
                discard_ms: 12.345,
                discard_wake_ms: 3.5,
            },
            mismatches: 0,
            freed_ratio: 0.999 + scale / 1000.0,
            rss: [1 << 30, 17 << 30, 3 << 29, 1 << 30],
            pinned: [0, 32 << 20, 32 << 20, 0],
            plain_write_ms: (index == 3).then_some(4321.0),
            sleep_vmstat: [8192, index as u64, 3, 0, 7],
        }
    }

    fn report() -> SleepReport {
        let later =
            vec![cycle(2, true, false, 1.4), cycle(3, false, false, 1.0), cycle(4, false, false, 1.02)];
        let r = SleepReport {
            label: "pageable, released lazily at wake".into(),
            bytes: 16 << 30,
            devices: 1,
            cycles: later,
            fresh_host_ms: vec![470.5, 401.25, 433.0],
            ..SleepReport::default()
        };
        with_child_cycles(r, vec![cycle(1, true, true, 1.25)])
    }

    #[test]
    fn the_sleep_report_keeps_its_layout() {
        let r = report();
        let mut out = Vec::new();
        for c in &r.cycles {
            print_sleep_cycle(&mut out, c, r.bytes).unwrap();
        }
        print_sleep_summary(&mut out, &r, &["NVIDIA H100".to_string()], 1 << 30, 3, false).unwrap();
        assert_report("sleep.txt", &out);
        let mut out = Vec::new();
        print_sleep_summary(&mut out, &r, &["NVIDIA H100".to_string()], 1 << 30, 3, true).unwrap();
        assert_report("sleep.jsonl", &out);
    }

    #[test]
    fn cycles_taking_turns_with_host_copies_are_summed_up_per_host_copy() {
        let cfg = SleepConfig {
            bytes: 1,
            block: 1,
            reps: 4,
            backup: BackupOptions::default(),
            gap: Duration::ZERO,
            first_only: false,
            floor: false,
            barrier: false,
            host_copies: HostCopy::ALL.to_vec(),
            prepare: false,
        };
        let got: Vec<_> = (1..=5).map(|i| cfg.host_copy(i)).collect();
        let (s, p) = (Some(HostCopy::Streaming), Some(HostCopy::Plain));
        assert_eq!(got, [s, p, s, p, s]);
        assert_eq!(SleepConfig { host_copies: Vec::new(), ..cfg.clone() }.host_copy(3), None);

        // One host copy alone: nothing apart.
        let mut r = report();
        assert!(r.by_host_copy.is_empty());
        for c in &mut r.cycles {
            c.host_copy = s;
        }
        r.summarise();
        assert!(r.by_host_copy.is_empty());
        // Cycles 2 and 4 plain (scales 1.4 and 1.02; cycle 2 a process's first), 1 and 3
        // streaming (cycle 1 a process's first).
        for c in &mut r.cycles {
            c.host_copy = cfg.host_copy(c.index);
        }
        r.summarise();
        let [(c0, m0, n0), (c1, m1, n1)] = &r.by_host_copy[..] else { panic!("{:?}", r.by_host_copy) };
        assert_eq!((*c0, *n0, *c1, *n1), (HostCopy::Streaming, 1, HostCopy::Plain, 1));
        assert_eq!((m0.offload_ms, m1.offload_ms), (343.6, 343.6 * 1.02));
        let mut out = Vec::new();
        print_summary_notes(&mut out, &r).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("plain host copies (the cycles took turns; medians of 1 after each process's first): sleep 350.5 ms"), "{text}");
        let mut out = Vec::new();
        print_summary_json(&mut out, &r).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["by_host_copy"]["streaming"]["cycles"], 1);
        assert_eq!(v["by_host_copy"]["plain"]["offload_ms"], 343.6 * 1.02);
        // A child's cycle keeps its host copy.
        let mut line = Vec::new();
        print_cycle(&mut line, &r.cycles[1], 16 << 30, true).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(Cycle::from_json(&v["cycle"]).unwrap().host_copy, p);
    }

    #[test]
    fn a_run_says_what_backup_it_measured_and_how_it_was_released() {
        assert_eq!(label(&BackupOptions { kind: BackupKind::Pinned, retain: true }), "pinned, retained");
        assert_eq!(
            label(&BackupOptions { kind: BackupKind::Disk("/tmp".into()), retain: false }),
            "disk, released at wake"
        );
    }

    #[test]
    fn a_child_cycle_reads_back_from_its_json_line() {
        // serde_json parses floats to within an ulp or so, not always to the bit.
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(1.0);
        let steps = |t: &Steps| {
            [
                t.d2h_bound_ms,
                t.offload_ms,
                t.wake_ms,
                t.h2d_bound_ms,
                t.h2d_after_frees_ms,
                t.discard_ms,
                t.discard_wake_ms,
            ]
        };
        for mut c in report().cycles {
            c.prepared_ms = c.first_in_process.then_some(812.5);
            let mut line = Vec::new();
            print_cycle(&mut line, &c, 16 << 30, true).unwrap();
            let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
            let back = Cycle::from_json(&v["cycle"]).expect("a whole cycle");
            assert!(steps(&back.steps).iter().zip(steps(&c.steps)).all(|(&a, b)| close(a, b)), "{back:?}");
            assert!(close(back.freed_ratio, c.freed_ratio));
            assert_eq!(back.plain_write_ms, c.plain_write_ms);
            assert_eq!(back.prepared_ms, c.prepared_ms);
            assert_eq!(back.sleep_vmstat, c.sleep_vmstat);
            assert_eq!(
                (back.index, back.first_in_process, back.in_child, back.mismatches, back.rss, back.pinned),
                (c.index, c.first_in_process, true, c.mismatches, c.rss, c.pinned)
            );
        }
    }

    #[test]
    fn a_wake_that_changed_elements_fails_the_run_after_its_report() {
        let mut r = report();
        r.cycles[2].mismatches = 7;
        r.summarise();
        for json in [false, true] {
            let mut out = Vec::new();
            let e = print_sleep_summary(&mut out, &r, &["NVIDIA H100".to_string()], 1 << 30, 3, json)
                .expect_err("mismatches fail the run");
            assert!(e.to_string().contains("7 elements changed"), "{e}");
            assert!(!out.is_empty(), "the report is printed first");
        }
    }

    #[test]
    fn processes_with_a_fresh_child_or_the_wrong_number_of_devices_are_refused_before_any_start() {
        for (argv, says) in [
            (&["bench", "--processes", "2", "--fresh-process"][..], "--fresh-process"),
            (&["bench", "--processes", "3", "--devices", "0,1"][..], "2 devices"),
        ] {
            let args = parse_args(argv);
            let e = cli(args, &mut Vec::new()).expect_err("refused");
            assert!(e.to_string().contains(says), "{argv:?}: {e}");
        }
    }
}
