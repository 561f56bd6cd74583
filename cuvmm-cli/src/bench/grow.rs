//! `cuvmm bench grow`: a VmmVec grown step by step (as built by default, with `create_ahead(true)`
//! and with `create_ahead(false)`) against realloc-by-copy doubling.

use super::stats::{median, percentile};
use super::timed;
use cuvmm::context::Context;
use cuvmm::driver::{driver, sys::CUdeviceptr};
use cuvmm::error::Result;
use cuvmm::vmm::ChunkPolicy;
use cuvmm::vmm::VmmVec;
use std::time::Duration;

/// What to run.
#[derive(Clone, Copy, Debug)]
pub struct GrowConfig {
    /// Bytes appended per step.
    pub step: usize,
    /// Final length in bytes.
    pub target: usize,
    /// Timed repetitions of each strategy (after one untimed warm-up at a sixteenth of the target).
    pub reps: usize,
    /// The VmmVec's chunk policy.
    pub policy: ChunkPolicy,
}

impl Default for GrowConfig {
    fn default() -> Self {
        GrowConfig { step: 64 << 20, target: 16 << 30, reps: 5, policy: ChunkPolicy::default() }
    }
}

/// One strategy's outcome (times are medians over repetitions; worst step is the worst seen).
#[derive(Clone, Debug, Default)]
pub struct GrowRun {
    /// Total time to reach the target, seconds.
    pub total_s: f64,
    /// Slowest single step, seconds.
    pub worst_step_s: f64,
    /// Slowest step after the first, seconds.
    pub worst_later_step_s: f64,
    /// Median step, seconds.
    pub median_step_s: f64,
    /// 99th-percentile step, seconds.
    pub p99_step_s: f64,
    /// The five slowest steps of the run with the worst one: (step index from 0, seconds).
    pub slowest: Vec<(usize, f64)>,
    /// Most device memory in use above the starting point at any moment sampled, bytes.
    pub peak_bytes: usize,
    /// Steps per run.
    pub steps: usize,
    /// Per step of the first timed run: (seconds, most device bytes in use above the start during
    /// the step).
    pub trace: Vec<(f64, usize)>,
    /// With chunks made ahead: growths that waited for one (over all runs), and the longest wait,
    /// seconds.
    pub ahead_waits: (usize, f64),
}

/// How a [`VmmVec`] is built for a run: which chunks it makes ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ahead {
    /// The builder's default (chunks made ahead once 64 MiB are mapped, bounded by what is mapped).
    Default,
    /// `create_ahead(true)`.
    On,
    /// `create_ahead(false)`: every growth makes its own chunks.
    Off,
}

/// The strategies and their ratios.
#[derive(Clone, Debug)]
pub struct GrowReport {
    /// The configuration run.
    pub config: GrowConfig,
    /// VmmVec as built by default.
    pub vmm: GrowRun,
    /// VmmVec with `create_ahead(true)`.
    pub ahead: GrowRun,
    /// VmmVec with `create_ahead(false)`.
    pub no_ahead: GrowRun,
    /// cuMemAlloc new, cuMemcpyDtoD, cuMemFree old.
    pub copy: GrowRun,
    /// Why copy-doubling could not reach the target (it needs 1.5x the length at its peak), if it
    /// could not; its figures are then empty.
    pub copy_failed: Option<String>,
}

impl GrowReport {
    /// VmmVec total time over copy-doubling total time.
    pub fn total_ratio(&self) -> f64 {
        self.vmm.total_s / self.copy.total_s
    }
    /// VmmVec with `create_ahead(true)`, total time over copy-doubling total time.
    pub fn ahead_total_ratio(&self) -> f64 {
        self.ahead.total_s / self.copy.total_s
    }
    /// VmmVec worst step over copy-doubling worst step.
    pub fn worst_ratio(&self) -> f64 {
        self.vmm.worst_step_s / self.copy.worst_step_s
    }
    /// VmmVec peak over copy-doubling peak.
    pub fn peak_ratio(&self) -> f64 {
        self.vmm.peak_bytes as f64 / self.copy.peak_bytes as f64
    }
}

fn used(ctx: &Context) -> Result<usize> {
    Ok(ctx.memory_info()?.used())
}

/// Appended bytes are written on the device with the same memset in both strategies.
fn write(dst: CUdeviceptr, bytes: usize, value: u8) -> Result<()> {
    let api = driver()?.api();
    // SAFETY: callers pass a mapped/allocated range of `bytes` bytes; the legacy stream is waited on.
    unsafe {
        api.cuMemsetD8Async(dst, value, bytes, std::ptr::null_mut())?;
        api.cuStreamSynchronize(std::ptr::null_mut())
    }
}

fn run_vmm(ctx: &Context, cfg: &GrowConfig, target: usize, ahead: Ahead) -> Result<GrowRun> {
    let base = used(ctx)?;
    let builder = VmmVec::<u8>::builder(ctx).chunk_policy(cfg.policy);
    let mut v = match ahead {
        Ahead::Default => builder,
        Ahead::On => builder.create_ahead(true),
        Ahead::Off => builder.create_ahead(false),
    }
    .build()?;
    let mut steps = Vec::new();
    let mut mem = Vec::new();
    let mut peak = 0;
    let mut total = Duration::ZERO;
    let mut i = 0u8;
    while v.len() < target {
        i = i.wrapping_add(1) | 1;
        let n = cfg.step.min(target - v.len());
        let (r, dt) = timed(|| v.resize(v.len() + n, i));
        r?;
        total += dt;
        steps.push(dt.as_secs_f64());
        let now = used(ctx)?.saturating_sub(base);
        mem.push(now);
        peak = peak.max(now);
    }
    // The data is there: first and last byte of every step.
    let mut k = 0u8;
    for s in (0..target).step_by(cfg.step) {
        k = k.wrapping_add(1) | 1;
        let last = (s + cfg.step).min(target) - 1;
        if v.get(s)? != Some(k) || v.get(last)? != Some(k) {
            return Err(crate::bench::invalid(format!("VmmVec contents wrong at step starting {s}")));
        }
    }
    let (waits, longest) = v.raw().ahead_waits();
    Ok(GrowRun { ahead_waits: (waits, longest.as_secs_f64()), ..finish(&steps, &mem, total, peak) })
}

fn run_copy(ctx: &Context, cfg: &GrowConfig, target: usize) -> Result<GrowRun> {
    let api = driver()?.api();
    ctx.bind()?;
    let base = used(ctx)?;
    let (mut ptr, mut cap, mut len): (CUdeviceptr, usize, usize) = (0, 0, 0);
    let mut steps = Vec::new();
    let mut mem = Vec::new();
    let mut peak = 0;
    let mut total = Duration::ZERO;
    let mut i = 0u8;
    let result = (|| -> Result<()> {
        while len < target {
            i = i.wrapping_add(1) | 1;
            let n = cfg.step.min(target - len);
            let mut step = Duration::ZERO;
            let mut step_peak = 0;
            if len + n > cap {
                let new_cap = (len + n).max(cap * 2);
                let mut new_ptr = 0;
                // SAFETY: out-pointer valid.
                let (r, dt_alloc) = timed(|| unsafe { api.cuMemAlloc(&mut new_ptr, new_cap) });
                r?;
                // Sampled while both buffers exist: the true peak of a doubling. Not timed.
                step_peak = used(ctx)?.saturating_sub(base);
                peak = peak.max(step_peak);
                let (r, dt) = timed(|| -> Result<()> {
                    // SAFETY: both buffers hold at least `len` bytes; the old one is freed after the copy.
                    unsafe {
                        if len > 0 {
                            api.cuMemcpyDtoD(new_ptr, ptr, len)?;
                        }
                        if ptr != 0 {
                            api.cuMemFree(ptr)?;
                        }
                    }
                    Ok(())
                });
                if let Err(e) = r {
                    // SAFETY: the new buffer is ours and unused.
                    let _ = unsafe { api.cuMemFree(new_ptr) };
                    return Err(e);
                }
                step += dt_alloc;
                step += dt;
                ptr = new_ptr;
                cap = new_cap;
            }
            let (r, dt) = timed(|| write(ptr + len as u64, n, i));
            r?;
            step += dt;
            len += n;
            total += step;
            steps.push(step.as_secs_f64());
            let now = used(ctx)?.saturating_sub(base);
            mem.push(now.max(step_peak));
            peak = peak.max(now);
        }
        Ok(())
    })();
    if ptr != 0 {
        // SAFETY: the last buffer is ours; all work on it was synchronised.
        let _ = unsafe { api.cuMemFree(ptr) };
    }
    result?;
    Ok(finish(&steps, &mem, total, peak))
}

/// Runs each strategy (the VmmVec built three ways, then copy-doubling): one warm-up each at a
/// sixteenth of the target, then `reps` timed runs each, taking turns so that drift hits all alike.
pub fn run(ctx: &Context, cfg: GrowConfig) -> Result<GrowReport> {
    if cfg.step == 0 || cfg.target == 0 || cfg.reps == 0 {
        return Err(crate::bench::invalid("step, target and reps must be positive"));
    }
    let warm = (cfg.target / 16).max(cfg.step);
    // Each timed run starts on a synchronised, awake device: an untimed 1 MiB memset just before
    // it, the same for both strategies. (A first driver operation after the GPU idles can take
    // milliseconds; the worst step after the first is reported apart as well.)
    let wake = || -> Result<()> {
        ctx.synchronize()?;
        let b = cuvmm::memory::DeviceBuffer::<u8>::new(ctx, 1 << 20)?;
        write(b.ptr(), 1 << 20, 1)
    };
    const BUILDS: [Ahead; 3] = [Ahead::Default, Ahead::On, Ahead::Off];
    for ahead in BUILDS {
        wake()?;
        run_vmm(ctx, &cfg, warm, ahead)?;
    }
    wake()?;
    run_copy(ctx, &cfg, warm)?;
    let mut vmm: [Vec<GrowRun>; 3] = Default::default();
    let (mut copy, mut copy_failed) = (Vec::new(), None);
    for _ in 0..cfg.reps {
        for (runs, ahead) in vmm.iter_mut().zip(BUILDS) {
            wake()?;
            runs.push(run_vmm(ctx, &cfg, cfg.target, ahead)?);
        }
        if copy_failed.is_none() {
            wake()?;
            match run_copy(ctx, &cfg, cfg.target) {
                Ok(r) => copy.push(r),
                // Doubling needs the old and the new buffer at once: past about two thirds of the
                // device it runs out, which is a result, not a reason to lose the others.
                Err(e) if e.is_out_of_memory() => copy_failed = Some(e.to_string()),
                Err(e) => return Err(e),
            }
        }
    }
    if copy_failed.is_some() {
        copy.clear();
    }
    Ok(GrowReport {
        config: cfg,
        vmm: summarise(&vmm[0]),
        ahead: summarise(&vmm[1]),
        no_ahead: summarise(&vmm[2]),
        copy: summarise(&copy),
        copy_failed,
    })
}

fn finish(steps: &[f64], mem: &[usize], total: Duration, peak: usize) -> GrowRun {
    GrowRun {
        trace: steps.iter().copied().zip(mem.iter().copied()).collect(),
        total_s: total.as_secs_f64(),
        worst_step_s: steps.iter().cloned().fold(0.0, f64::max),
        worst_later_step_s: steps.iter().skip(1).cloned().fold(0.0, f64::max),
        slowest: slowest(steps),
        median_step_s: median(steps),
        p99_step_s: percentile(steps, 0.99),
        peak_bytes: peak,
        steps: steps.len(),
        ahead_waits: (0, 0.0),
    }
}

fn slowest(steps: &[f64]) -> Vec<(usize, f64)> {
    let mut v: Vec<(usize, f64)> = steps.iter().copied().enumerate().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v.truncate(5);
    v
}

fn summarise(runs: &[GrowRun]) -> GrowRun {
    let pick = |f: fn(&GrowRun) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
    GrowRun {
        total_s: pick(|r| r.total_s),
        median_step_s: pick(|r| r.median_step_s),
        p99_step_s: pick(|r| r.p99_step_s),
        worst_step_s: runs.iter().map(|r| r.worst_step_s).fold(0.0, f64::max),
        worst_later_step_s: runs.iter().map(|r| r.worst_later_step_s).fold(0.0, f64::max),
        slowest: runs
            .iter()
            .max_by(|a, b| a.worst_step_s.total_cmp(&b.worst_step_s))
            .map_or_else(Vec::new, |r| r.slowest.clone()),
        peak_bytes: runs.iter().map(|r| r.peak_bytes).max().unwrap_or(0),
        steps: runs.first().map_or(0, |r| r.steps),
        trace: runs.first().map_or_else(Vec::new, |r| r.trace.clone()),
        ahead_waits: (
            runs.iter().map(|r| r.ahead_waits.0).sum(),
            runs.iter().map(|r| r.ahead_waits.1).fold(0.0, f64::max),
        ),
    }
}
