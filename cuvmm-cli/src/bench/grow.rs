//! `cuvmm bench grow`: a VmmVec grown step by step (as built by default, with `create_ahead(true)`
//! and with `create_ahead(false)`) against realloc-by-copy doubling.

use super::stats::{median, percentile};
use super::timed;
use crate::common::size::{parse_size, show};
use crate::common::CliResult;
use cuvmm::context::Context;
use cuvmm::driver::{driver, result, sys::CUdeviceptr};
use cuvmm::error::Result;
use cuvmm::vmm::ChunkPolicy;
use cuvmm::vmm::VmmVec;
use serde_json::json;
use std::io::Write;
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
        result::mem::memset_d8_async(api, dst, value, bytes, std::ptr::null_mut())?;
        result::stream::synchronize(api, std::ptr::null_mut())
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
                let (r, dt_alloc) = timed(|| result::mem::alloc(api, new_cap));
                let new_ptr = r?;
                // Sampled while both buffers exist: the true peak of a doubling. Not timed.
                step_peak = used(ctx)?.saturating_sub(base);
                peak = peak.max(step_peak);
                let (r, dt) = timed(|| -> Result<()> {
                    // SAFETY: both buffers hold at least `len` bytes; the old one is freed after the copy.
                    unsafe {
                        if len > 0 {
                            result::mem::memcpy_dtod(api, new_ptr, ptr, len)?;
                        }
                        if ptr != 0 {
                            result::mem::free(api, ptr)?;
                        }
                    }
                    Ok(())
                });
                if let Err(e) = r {
                    // SAFETY: the new buffer is ours and unused.
                    let _ = unsafe { result::mem::free(api, new_ptr) };
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
        let _ = unsafe { result::mem::free(api, ptr) };
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

// The options of `cuvmm bench grow` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Bytes appended per step.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    step: usize,
    /// Final length.
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    target: usize,
    /// Timed repetitions of each strategy.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Largest chunk the VmmVec maps at once.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    max_chunk: usize,
    /// New chunks are at least this percentage of what is mapped.
    #[arg(long, default_value_t = 100)]
    growth_percent: u32,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench grow`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let ctx = Context::for_ordinal(args.device)?;
    let policy = ChunkPolicy {
        max_chunk: args.max_chunk,
        growth_percent: args.growth_percent,
        ..ChunkPolicy::default()
    };
    let r = run(&ctx, GrowConfig { step: args.step, target: args.target, reps: args.reps, policy })?;
    let name = ctx.device().name()?;
    if args.json {
        print_json(out, &args, &name, &r)
    } else {
        print_text(out, &args, &name, &r)
    }
}

/// The strategies measured: JSON key, table name, run; copy-doubling where it reached the target.
fn strategies(r: &GrowReport) -> Vec<(&'static str, &'static str, &GrowRun)> {
    let mut rows = vec![
        ("vmmvec", "VmmVec, default", &r.vmm),
        ("vmmvec_ahead", "VmmVec, ahead", &r.ahead),
        ("vmmvec_no_ahead", "VmmVec, no ahead", &r.no_ahead),
    ];
    if r.copy_failed.is_none() {
        rows.push(("copy_doubling", "copy-doubling", &r.copy));
    }
    rows
}

/// `--json`: a line per strategy, then the ratios (or why copy-doubling failed).
fn print_json(out: &mut impl Write, args: &Args, name: &str, r: &GrowReport) -> CliResult {
    let Args { step, target, reps, max_chunk, growth_percent, .. } = *args;
    for (which, _, run) in strategies(r) {
        writeln!(
            out,
            "{}",
            json!({"bench": "grow", "device": name, "strategy": which, "step": step, "target": target,
                   "reps": reps, "steps": run.steps, "total_s": run.total_s, "worst_step_s": run.worst_step_s, "worst_later_step_s": run.worst_later_step_s,
                   "median_step_s": run.median_step_s, "p99_step_s": run.p99_step_s, "slowest_steps": run.slowest, "peak_bytes": run.peak_bytes,
                   "ahead_waits": run.ahead_waits.0, "ahead_longest_wait_s": run.ahead_waits.1})
        )?;
    }
    if let Some(why) = &r.copy_failed {
        writeln!(out, "{}", json!({"bench": "grow", "strategy": "copy_doubling", "failed": why}))?;
    } else {
        writeln!(
            out,
            "{}",
            json!({"bench": "grow", "ratio_total": r.total_ratio(), "ratio_total_ahead": r.ahead_total_ratio(),
                   "ratio_worst_step": r.worst_ratio(), "ratio_peak": r.peak_ratio(),
                   "max_chunk": max_chunk, "growth_percent": growth_percent})
        )?;
    }
    Ok(())
}

/// The table, the waits for chunks made ahead, and the ratios (or why copy-doubling failed).
fn print_text(out: &mut impl Write, args: &Args, name: &str, r: &GrowReport) -> CliResult {
    let Args { step, target, reps, max_chunk, growth_percent, .. } = *args;
    writeln!(
        out,
        "grow to {} in {} steps on {name} (median of {reps} runs; worst step over all runs)",
        show(target),
        show(step)
    )?;
    writeln!(
        out,
        "{:<16} {:>10} {:>14} {:>17} {:>12} {:>15} {:>12}  slowest steps (step #: ms)",
        "strategy",
        "total ms",
        "worst step ms",
        "worst after 1st",
        "p99 step ms",
        "median step ms",
        "peak in use"
    )?;
    for (_, which, run) in strategies(r) {
        let slow: Vec<String> = run.slowest.iter().map(|(i, s)| format!("{i}: {:.2}", s * 1e3)).collect();
        writeln!(
            out,
            "{which:<16} {:>10.2} {:>14.3} {:>17.3} {:>12.3} {:>15.3} {:>12}  {}",
            run.total_s * 1e3,
            run.worst_step_s * 1e3,
            run.worst_later_step_s * 1e3,
            run.p99_step_s * 1e3,
            run.median_step_s * 1e3,
            show(run.peak_bytes),
            slow.join(", ")
        )?;
    }
    for (which, run) in [("default", &r.vmm), ("ahead", &r.ahead)] {
        writeln!(
            out,
            "VmmVec, {which}: {} growths over the {reps} runs waited for a chunk made ahead (longest {:.3} ms)",
            run.ahead_waits.0,
            run.ahead_waits.1 * 1e3
        )?;
    }
    match &r.copy_failed {
        Some(why) => writeln!(out, "copy-doubling    could not reach {}: {why}", show(target))?,
        None => writeln!(
            out,
            "over copy-doubling: VmmVec total {:.3}x, worst step {:.3}x, peak {:.3}x; VmmVec ahead total {:.3}x (chunks up to {}, +{}%)",
            r.total_ratio(),
            r.worst_ratio(),
            r.peak_ratio(),
            r.ahead_total_ratio(),
            show(max_chunk),
            growth_percent
        )?,
    }
    Ok(())
}
