//! `cuvmm bench overlap`: the multi-stream overlap workload. N floats go host→device, through a
//! compute kernel and back, scheduled serially, breadth-first over S streams (all copies in, all
//! kernels, all copies out), depth-first over S streams, and as cuvmm's event-ordered pipeline (C
//! chunks through L lanes of three streams, one per stage, events between the stages of a chunk).
//!
//! The reference is what a hand-written CUDA C program does: the breadth-first and depth-first
//! schedules over the same stream counts, as raw `cuMemcpy*Async` and `cuLaunchKernel` calls on the
//! same buffers with the same kernel, and its best. Every schedule is timed the same way (an event
//! on stream 0 that every stream waits for, an event on each stream joined back on stream 0, no
//! events in between) and the schedules take turns, repetition by repetition. Per-operation
//! events, for the timeline, are recorded in one more run of the fastest cuvmm schedule only.

use crate::common::size::{parse_counts, show};
use crate::common::CliResult;
use cuvmm::context::Context;
use cuvmm::driver::{driver, result, sys::CUfunction};
use cuvmm::error::Result;
use cuvmm::host::PinnedBuffer;
use cuvmm::kernels::{busy_value, Kernels};
use cuvmm::memory::DeviceBuffer;
use cuvmm::module::{LaunchConfig, Module};
use cuvmm::stream::Event;
use cuvmm::stream::Stream;
use cuvmm::stream::{scope, Scope};
use serde_json::json;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::io::Write;

/// What to run.
#[derive(Clone, Debug)]
pub struct OverlapConfig {
    /// Floats moved and computed.
    pub n: usize,
    /// Stream counts of the breadth-first and depth-first schedules, cuvmm's and raw.
    pub streams: Vec<usize>,
    /// Chunk counts of the pipeline.
    pub chunks: Vec<usize>,
    /// Lane counts of the pipeline (three streams each; chunks go round the lanes).
    pub lanes: Vec<usize>,
    /// Multiply-adds per element in the kernel; `None` tunes it so the kernel takes as long as
    /// the longer copy.
    pub iters: Option<u32>,
    /// Timed repetitions of each schedule (the median is kept).
    pub reps: usize,
}

impl Default for OverlapConfig {
    fn default() -> Self {
        OverlapConfig {
            n: 64 << 20,
            streams: vec![2, 4, 8, 16, 32],
            chunks: vec![32],
            lanes: vec![1],
            iters: None,
            reps: 5,
        }
    }
}

/// One operation on the timeline, in ms from the schedule's start.
#[derive(Clone, Debug)]
pub struct Span {
    /// The lane (stream) it ran on.
    pub lane: String,
    /// "H2D", "kernel" or "D2H".
    pub kind: &'static str,
    /// Start, ms.
    pub start: f64,
    /// End, ms.
    pub end: f64,
}

/// A way to schedule the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Everything on one stream.
    Serial,
    /// All copies in, then all kernels, then all copies out, over this many streams.
    Breadth(usize),
    /// Each stream's copy in, kernel and copy out, stream after stream.
    Depth(usize),
    /// cuvmm's pipeline: chunks, lanes.
    Pipeline(usize, usize),
}

impl Plan {
    /// Streams it uses.
    fn streams(self) -> usize {
        match self {
            Plan::Serial => 1,
            Plan::Breadth(s) | Plan::Depth(s) => s,
            Plan::Pipeline(_, lanes) => 3 * lanes,
        }
    }

    /// Its name in the report.
    pub fn name(self, raw: bool) -> String {
        let who = if raw { "raw " } else { "" };
        match self {
            Plan::Serial => format!("{who}serial"),
            Plan::Breadth(s) => format!("{who}breadth-first, {s} streams"),
            Plan::Depth(s) => format!("{who}depth-first, {s} streams"),
            Plan::Pipeline(c, 1) => format!("pipeline, {c} chunks"),
            Plan::Pipeline(c, l) => format!("pipeline, {c} chunks, {l} lanes"),
        }
    }
}

/// One schedule's result.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Its name.
    pub name: String,
    /// The plan.
    pub plan: Plan,
    /// Raw driver calls (the reference) rather than cuvmm's.
    pub raw: bool,
    /// From the common start event to the joined end, ms (median run).
    pub total_ms: f64,
    /// Its operations, from a run with an event around each (the fastest cuvmm schedule only).
    pub spans: Vec<Span>,
}

/// The experiment's outcome.
#[derive(Clone, Debug)]
pub struct OverlapReport {
    /// The configuration, with the kernel's iterations resolved.
    pub config: OverlapConfig,
    /// Kernel iterations used.
    pub iters: u32,
    /// The three stages alone over all N floats, ms: host→device, kernel, device→host.
    pub stages_ms: [f64; 3],
    /// Both copies at once (H2D and D2H of all N floats on two streams), ms: what the bus allows
    /// a schedule that overlaps them, since both directions together move less than twice one.
    pub copies_together_ms: f64,
    /// Each schedule, cuvmm's then the raw ones.
    pub schedules: Vec<Schedule>,
}

impl OverlapReport {
    /// The longest stage, ms.
    pub fn longest_stage(&self) -> f64 {
        self.stages_ms.iter().cloned().fold(0.0, f64::max)
    }

    /// The least time any schedule can take: the longest stage, or both copies at once if the bus
    /// makes that longer.
    pub fn bound(&self) -> f64 {
        self.longest_stage().max(self.copies_together_ms)
    }

    fn best(&self, raw: bool) -> Option<&Schedule> {
        self.schedules.iter().filter(|s| s.raw == raw).min_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
    }

    /// The fastest cuvmm schedule (the one with a timeline).
    pub fn fastest(&self) -> &Schedule {
        self.best(false).expect("cuvmm schedules")
    }

    /// The fastest raw schedule: the reference.
    pub fn fastest_raw(&self) -> Option<&Schedule> {
        self.best(true)
    }

    /// The fastest cuvmm schedule's time over the fastest raw one's.
    pub fn ratio(&self) -> Option<f64> {
        Some(self.fastest().total_ms / self.fastest_raw()?.total_ms)
    }
}

struct Rig<'r> {
    ctx: &'r Context,
    k: Kernels,
    /// The same kernel, for raw launches.
    busy: CUfunction,
    launch: LaunchConfig,
    _module: Module,
    input: PinnedBuffer<f32>,
    output: PinnedBuffer<f32>,
    dev: DeviceBuffer<f32>,
    origin: Event,
    fin: Event,
    /// Ordering events: one per stream to join, two per pipeline chunk. Reused by each run.
    joins: Vec<Event>,
    steps: Vec<Event>,
    /// Whether operations are bracketed by timing events (the timeline run).
    timeline: Cell<bool>,
    /// Recorded spans: (lane, kind, start event, end event).
    marks: RefCell<Vec<(String, &'static str, Event, Event)>>,
}

impl Rig<'_> {
    /// Queues one stage over elements `r` on `stream` through cuvmm, bracketed by timing events
    /// in a timeline run.
    fn op<'a>(
        &'a self,
        s: &Scope<'a>,
        stream: &'a Stream,
        lane: &dyn Fn() -> String,
        kind: &'static str,
        r: std::ops::Range<usize>,
        iters: u32,
    ) -> Result<()> {
        let marks = if self.timeline.get() {
            let (a, b) = (Event::new(self.ctx)?, Event::new(self.ctx)?);
            a.record(stream)?;
            Some((a, b))
        } else {
            None
        };
        s.track(stream);
        let dev_mut = || {
            // SAFETY: `dev` holds n floats and outlives the scope; ranges are checked by slice_mut.
            unsafe { cuvmm::DeviceSliceMut::<f32>::from_raw_parts(self.dev.ptr(), self.dev.len()) }
                .slice_mut(r.clone())
        };
        match kind {
            "H2D" => s.copy_to_device(stream, &self.input[r.clone()], dev_mut()?)?,
            "kernel" => self.k.busy_f32(stream, &mut dev_mut()?, iters)?,
            _ => {
                // SAFETY: each op's output range is disjoint from every other op's, no reference to
                // `output` exists while the scope runs, and the buffer outlives the scope.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(self.output.base_ptr().add(r.start), r.len()) };
                let _ = s.copy_to_host(stream, self.dev.as_slice().slice(r.clone())?, out)?;
            }
        }
        if let Some((a, b)) = marks {
            b.record(stream)?;
            self.marks.borrow_mut().push((lane(), kind, a, b));
        }
        Ok(())
    }

    /// Queues one stage over elements `r` on `stream` with raw driver calls, as C would.
    fn raw_op(
        &self,
        stream: &Stream,
        kind: &'static str,
        r: std::ops::Range<usize>,
        iters: u32,
    ) -> Result<()> {
        let api = driver()?.api();
        let f = std::mem::size_of::<f32>();
        let d = self.dev.ptr() + (r.start * f) as u64;
        // SAFETY: every range lies inside the n-float pinned and device buffers, which outlive the
        // run; the caller synchronises (through the joined end event) before the host reads
        // `output` or touches `input` again. The kernel's parameters are its (ptr, n, iters).
        unsafe {
            match kind {
                "H2D" => result::mem::memcpy_htod_async(
                    api,
                    d,
                    self.input.base_ptr().add(r.start).cast(),
                    r.len() * f,
                    stream.raw(),
                ),
                "kernel" => {
                    let (mut p, mut n, mut it) = (d, r.len() as u64, iters);
                    let mut params: [*mut c_void; 3] = [
                        (&mut p as *mut u64).cast(),
                        (&mut n as *mut u64).cast(),
                        (&mut it as *mut u32).cast(),
                    ];
                    let c =
                        LaunchConfig::grid_stride(r.len() as u64, self.launch.block.0, self.launch.grid.0);
                    result::module::launch_kernel(
                        api,
                        self.busy,
                        c.grid,
                        c.block,
                        c.shared_bytes,
                        stream.raw(),
                        &mut params,
                    )
                }
                _ => result::mem::memcpy_dtoh_async(
                    api,
                    self.output.base_ptr().add(r.start).cast(),
                    d,
                    r.len() * f,
                    stream.raw(),
                ),
            }
        }
    }

    fn spans(&self) -> Result<(f64, Vec<Span>)> {
        let mut spans = Vec::new();
        for (lane, kind, a, b) in self.marks.borrow_mut().drain(..) {
            spans.push(Span {
                lane,
                kind,
                start: self.origin.elapsed_ms(&a)? as f64,
                end: self.origin.elapsed_ms(&b)? as f64,
            });
        }
        let end = spans.iter().map(|s| s.end).fold(0.0, f64::max);
        let start = spans.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
        for s in &mut spans {
            s.start -= start;
            s.end -= start;
        }
        Ok((end - start, spans))
    }

    /// Runs `plan` once, raw or through cuvmm, timed from a start event every stream waits for to
    /// an end event after every stream's work; ms.
    fn time(&self, st: &[Stream], plan: Plan, raw: bool, iters: u32) -> Result<f64> {
        let used = &st[..plan.streams()];
        let start = || -> Result<()> {
            self.origin.record(&used[0])?;
            for s in &used[1..] {
                s.wait_event(&self.origin)?;
            }
            Ok(())
        };
        let join = || -> Result<()> {
            for (s, e) in used[1..].iter().zip(&self.joins) {
                e.record(s)?;
                used[0].wait_event(e)?;
            }
            self.fin.record(&used[0])
        };
        if raw {
            self.bind()?;
            start()?;
            let r = plan_raw(self, used, plan, iters);
            // Whatever was queued is waited for before the buffers are touched again.
            let j = join();
            used.iter().try_for_each(|s| s.synchronize())?;
            r?;
            j?;
        } else {
            scope(|s| {
                start()?;
                plan_cuvmm(s, self, used, plan, iters)?;
                join()
            })?;
        }
        self.fin.synchronize()?;
        Ok(self.origin.elapsed_ms(&self.fin)? as f64)
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind()
    }
}

fn split(n: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let per = n.div_ceil(parts);
    (0..parts).map(|i| (i * per).min(n)..((i + 1) * per).min(n)).filter(|r| !r.is_empty()).collect()
}

/// Runs the experiment.
pub fn run(ctx: &Context, cfg: OverlapConfig) -> Result<OverlapReport> {
    let positive = |v: &[usize]| !v.is_empty() && v.iter().all(|&x| x > 0);
    if cfg.n == 0
        || cfg.reps == 0
        || !positive(&cfg.streams)
        || !positive(&cfg.chunks)
        || !positive(&cfg.lanes)
    {
        return Err(crate::bench::invalid("n, reps and every stream, chunk and lane count must be positive"));
    }
    let rig = Rig::new(ctx, &cfg)?;
    let max_streams = rig.joins.len();
    let streams: Vec<Stream> = (0..max_streams).map(|_| Stream::non_blocking(ctx)).collect::<Result<_>>()?;
    let (stages_ms, copies_together_ms, iters) = stage_times(&rig, &streams, &cfg)?;
    let mut schedules = time_schedules(&rig, &streams, &plans(&cfg), cfg.reps, iters)?;
    let fastest = |raw: bool| {
        (0..schedules.len())
            .filter(|&i| schedules[i].raw == raw)
            .min_by(|&a, &b| schedules[a].total_ms.total_cmp(&schedules[b].total_ms))
    };
    // Each result is right: the output, cleared first, checked against the CPU.
    if let Some(raw) = fastest(true) {
        rig.clear_output();
        rig.time(&streams, schedules[raw].plan, true, iters)?;
        rig.verify(iters, &schedules[raw].name)?;
    }
    // The fastest cuvmm schedule once more, each operation bracketed by events, for its timeline.
    let best = fastest(false).expect("cuvmm schedules");
    rig.clear_output();
    rig.timeline.set(true);
    rig.time(&streams, schedules[best].plan, false, iters)?;
    schedules[best].spans = rig.spans()?.1;
    rig.verify(iters, &schedules[best].name)?;
    Ok(OverlapReport {
        config: OverlapConfig { iters: Some(iters), ..cfg },
        iters,
        stages_ms,
        copies_together_ms,
        schedules,
    })
}

/// `n` floats in [0.5, 1.5), pseudo-random, pinned.
fn random_input(ctx: &Context, n: usize) -> Result<PinnedBuffer<f32>> {
    let mut input = PinnedBuffer::<f32>::new(ctx, n)?;
    let mut seed = 0x2545_f491_u32;
    for x in input.iter_mut() {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        *x = (seed >> 8) as f32 / (1u32 << 24) as f32 + 0.5;
    }
    Ok(input)
}

impl<'r> Rig<'r> {
    /// Everything the schedules of `cfg` use, allocated once: buffers of `cfg.n` floats, the
    /// kernel, and ordering events for the most streams and chunks asked for.
    fn new(ctx: &'r Context, cfg: &OverlapConfig) -> Result<Rig<'r>> {
        let input = random_input(ctx, cfg.n)?;
        let module = Module::from_ptx(ctx, cuvmm::kernels::PTX)?;
        let busy = module.function("cuvmm_busy_f32")?.raw();
        let sms = ctx.device().attribute(cuvmm::driver::sys::CUdevice_attribute::MULTIPROCESSOR_COUNT)?.max(1)
            as u32;
        let max_streams = cfg
            .streams
            .iter()
            .max()
            .copied()
            .unwrap_or(1)
            .max(3 * cfg.lanes.iter().max().copied().unwrap_or(1))
            .max(3);
        let max_chunks = cfg.chunks.iter().max().copied().unwrap_or(1);
        Ok(Rig {
            ctx,
            k: Kernels::load(ctx)?,
            busy,
            // As `Kernels` launches it: 256 threads a block, one resident wave of blocks at most.
            launch: LaunchConfig::grid_stride(u64::MAX, 256, sms * 8),
            _module: module,
            input,
            output: PinnedBuffer::<f32>::new(ctx, cfg.n)?,
            dev: DeviceBuffer::<f32>::new(ctx, cfg.n)?,
            origin: Event::new(ctx)?,
            fin: Event::new(ctx)?,
            joins: (0..max_streams).map(|_| Event::without_timing(ctx)).collect::<Result<_>>()?,
            steps: (0..2 * max_chunks).map(|_| Event::without_timing(ctx)).collect::<Result<_>>()?,
            timeline: Cell::new(true),
            marks: RefCell::new(Vec::new()),
        })
    }

    /// Zeroes the output, so that a check finds what the next run wrote.
    fn clear_output(&self) {
        // SAFETY: every stream is synchronised (each run ends so), no reference to `output`
        // exists, and `base_ptr` is derived from none.
        unsafe { std::ptr::write_bytes(self.output.base_ptr(), 0, self.output.len()) };
    }

    /// Checks a sample of the output against the same multiply-adds on the CPU (`busy_value`,
    /// which matches the kernel bit for bit).
    fn verify(&self, iters: u32, what: &str) -> Result<()> {
        let n = self.output.len();
        for i in (0..n).step_by((n / 997).max(1)) {
            let x = busy_value(self.input[i], iters);
            if self.output[i].to_bits() != x.to_bits() {
                return Err(crate::bench::invalid(format!(
                    "{what}: element {i}: device {} != host {x}",
                    self.output[i]
                )));
            }
        }
        Ok(())
    }
}

/// Each stage alone (median of the repetitions after a warm-up), the kernel's multiply-adds tuned
/// first unless `cfg` gives them, then both copies at once: `([H2D, kernel, D2H], both copies,
/// multiply-adds)`, milliseconds.
fn stage_times(rig: &Rig<'_>, streams: &[Stream], cfg: &OverlapConfig) -> Result<([f64; 3], f64, u32)> {
    let all = 0..cfg.n;
    // Stage times alone (median of reps after a warm-up), tuning the kernel first.
    let stage = |kind: &'static str, iters: u32| -> Result<f64> {
        let mut t = Vec::new();
        for rep in 0..=cfg.reps {
            scope(|s| {
                rig.origin.record(&streams[0])?;
                rig.op(s, &streams[0], &|| "s0".into(), kind, all.clone(), iters)
            })?;
            let (ms, _) = rig.spans()?;
            if rep > 0 {
                t.push(ms);
            }
        }
        Ok(super::median(&t))
    };
    let h2d = stage("H2D", 0)?;
    let d2h = stage("D2H", 0)?;
    let iters = match cfg.iters {
        Some(i) => i,
        None => {
            let probe = 256;
            let k = stage("kernel", probe)?;
            ((probe as f64 * h2d.max(d2h) / k).round() as u32).max(1)
        }
    };
    let kernel = stage("kernel", iters)?;
    let mut together = Vec::new();
    for rep in 0..=cfg.reps {
        scope(|s| {
            rig.origin.record(&streams[0])?;
            streams[1].wait_event(&rig.origin)?;
            rig.op(s, &streams[0], &|| "s0".into(), "H2D", all.clone(), 0)?;
            rig.op(s, &streams[1], &|| "s1".into(), "D2H", all.clone(), 0)
        })?;
        let (ms, _) = rig.spans()?;
        if rep > 0 {
            together.push(ms);
        }
    }
    let copies_together_ms = super::median(&together);

    Ok(([h2d, kernel, d2h], copies_together_ms, iters))
}

/// The schedules of `cfg`: serial, cuvmm's breadth- and depth-first and pipelines, then the raw
/// breadth- and depth-first references (`true`: raw).
fn plans(cfg: &OverlapConfig) -> Vec<(Plan, bool)> {
    let mut plans: Vec<(Plan, bool)> = vec![(Plan::Serial, false)];
    for raw in [false, true] {
        for &s in &cfg.streams {
            plans.push((Plan::Breadth(s), raw));
            plans.push((Plan::Depth(s), raw));
        }
        if !raw {
            for &c in &cfg.chunks {
                for &l in &cfg.lanes {
                    plans.push((Plan::Pipeline(c, l), false));
                }
            }
        }
    }
    plans
}

/// Every plan's median time over `reps`, the plans taking turns repetition by repetition.
fn time_schedules(
    rig: &Rig<'_>,
    streams: &[Stream],
    plans: &[(Plan, bool)],
    reps: usize,
    iters: u32,
) -> Result<Vec<Schedule>> {
    rig.timeline.set(false);
    let mut samples = vec![Vec::new(); plans.len()];
    for rep in 0..=reps {
        for (i, &(plan, raw)) in plans.iter().enumerate() {
            let ms = rig.time(streams, plan, raw, iters)?;
            if rep > 0 {
                samples[i].push(ms);
            }
        }
    }
    Ok(plans
        .iter()
        .zip(&samples)
        .map(|(&(plan, raw), t)| Schedule {
            name: plan.name(raw),
            plan,
            raw,
            total_ms: super::median(t),
            spans: Vec::new(),
        })
        .collect())
}

const STAGES: [&str; 3] = ["H2D", "kernel", "D2H"];

/// Queues `plan` through cuvmm on `st` (as many streams as it uses).
fn plan_cuvmm<'a>(s: &Scope<'a>, rig: &'a Rig<'_>, st: &'a [Stream], plan: Plan, iters: u32) -> Result<()> {
    let n = rig.dev.len();
    match plan {
        Plan::Serial => {
            for kind in STAGES {
                rig.op(s, &st[0], &|| "stream 0".into(), kind, 0..n, iters)?;
            }
        }
        Plan::Breadth(streams) => {
            let parts = split(n, streams);
            for kind in STAGES {
                for (i, r) in parts.iter().enumerate() {
                    rig.op(s, &st[i], &|| format!("stream {i}"), kind, r.clone(), iters)?;
                }
            }
        }
        Plan::Depth(streams) => {
            for (i, r) in split(n, streams).into_iter().enumerate() {
                for kind in STAGES {
                    rig.op(s, &st[i], &|| format!("stream {i}"), kind, r.clone(), iters)?;
                }
            }
        }
        Plan::Pipeline(chunks, lanes) => {
            // One stream per stage in each lane; each chunk's kernel waits for its copy in, and its
            // copy out for its kernel, through events. Copies in both directions and kernels overlap.
            for (c, r) in split(n, chunks).into_iter().enumerate() {
                let lane = c % lanes;
                let (h, k, d) = (&st[3 * lane], &st[3 * lane + 1], &st[3 * lane + 2]);
                let name = |what: &str| if lanes == 1 { what.to_string() } else { format!("{what} {lane}") };
                rig.op(s, h, &|| name("copy in"), "H2D", r.clone(), iters)?;
                let (e1, e2) = (&rig.steps[2 * c], &rig.steps[2 * c + 1]);
                e1.record(h)?;
                k.wait_event(e1)?;
                rig.op(s, k, &|| name("compute"), "kernel", r.clone(), iters)?;
                e2.record(k)?;
                d.wait_event(e2)?;
                rig.op(s, d, &|| name("copy out"), "D2H", r.clone(), iters)?;
            }
        }
    }
    Ok(())
}

/// Queues `plan` with raw driver calls on `st`: the hand-written reference (breadth- and
/// depth-first only).
fn plan_raw(rig: &Rig<'_>, st: &[Stream], plan: Plan, iters: u32) -> Result<()> {
    let n = rig.dev.len();
    match plan {
        Plan::Breadth(streams) => {
            let parts = split(n, streams);
            for kind in STAGES {
                for (i, r) in parts.iter().enumerate() {
                    rig.raw_op(&st[i], kind, r.clone(), iters)?;
                }
            }
        }
        Plan::Depth(streams) => {
            for (i, r) in split(n, streams).into_iter().enumerate() {
                for kind in STAGES {
                    rig.raw_op(&st[i], kind, r.clone(), iters)?;
                }
            }
        }
        other => return Err(crate::bench::invalid(format!("no raw form of {other:?}"))),
    }
    Ok(())
}

/// Draws a schedule's timeline as SVG: one lane per stream, one box per operation, like the
/// classic per-stream timelines.
pub fn svg(schedule: &Schedule, title: &str) -> String {
    let mut lanes: Vec<&str> = Vec::new();
    for s in &schedule.spans {
        if !lanes.contains(&s.lane.as_str()) {
            lanes.push(&s.lane);
        }
    }
    let (left, width, lane_h, top) = (110.0, 900.0, 34.0, 50.0);
    let total = schedule.total_ms.max(1e-9);
    let height = top + lane_h * lanes.len() as f64 + 60.0;
    let color = |k: &str| match k {
        "H2D" => "#4e79a7",
        "kernel" => "#f28e2b",
        _ => "#59a14f",
    };
    let esc = |t: &str| t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let mut o = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"22\" font-size=\"15\">{t} — {name}: {total:.2} ms</text>\n",
        w = left + width + 30.0,
        t = esc(title),
        name = schedule.name,
    );
    for (i, lane) in lanes.iter().enumerate() {
        let y = top + lane_h * i as f64;
        o += &format!("<text x=\"10\" y=\"{:.1}\">{}</text>\n", y + lane_h * 0.6, esc(lane));
        o += &format!(
            "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\n",
            left + width
        );
    }
    for s in &schedule.spans {
        let i = lanes.iter().position(|l| *l == s.lane).unwrap_or(0);
        let x = left + s.start / total * width;
        let w = ((s.end - s.start) / total * width).max(0.5);
        let y = top + lane_h * i as f64 + 4.0;
        o += &format!(
            "<rect x=\"{x:.2}\" y=\"{y:.1}\" width=\"{w:.2}\" height=\"{:.1}\" fill=\"{}\" stroke=\"white\" stroke-width=\"0.5\"><title>{} {:.3}-{:.3} ms</title></rect>\n",
            lane_h - 8.0,
            color(s.kind),
            s.kind,
            s.start,
            s.end
        );
    }
    let axis_y = top + lane_h * lanes.len() as f64 + 14.0;
    for t in 0..=5 {
        let x = left + width * t as f64 / 5.0;
        o += &format!(
            "<text x=\"{x:.1}\" y=\"{axis_y:.1}\" text-anchor=\"middle\">{:.1} ms</text>\n",
            total * t as f64 / 5.0
        );
    }
    let ly = axis_y + 22.0;
    for (i, k) in ["H2D", "kernel", "D2H"].iter().enumerate() {
        let x = left + 140.0 * i as f64;
        o += &format!("<rect x=\"{x}\" y=\"{:.1}\" width=\"14\" height=\"14\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{ly:.1}\">{}</text>\n", ly - 11.0, color(k), x + 20.0, k);
    }
    o += "</svg>\n";
    o
}

// The options of `cuvmm bench overlap` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Floats (64 Mi = 256 MiB).
    #[arg(long, default_value_t = 64 << 20)]
    n: usize,
    /// Stream counts of the breadth-first and depth-first schedules, cuvmm's and raw.
    #[arg(long, default_value = "2,4,8,16,32", value_parser = parse_counts)]
    streams: std::vec::Vec<usize>,
    /// Chunk counts of the pipeline.
    #[arg(long, default_value = "32", value_parser = parse_counts)]
    chunks: std::vec::Vec<usize>,
    /// Lane counts of the pipeline (three streams each, chunks going round them).
    #[arg(long, default_value = "1", value_parser = parse_counts)]
    lanes: std::vec::Vec<usize>,
    /// Kernel multiply-adds per element (default: tuned to balance the stages).
    #[arg(long)]
    iters: Option<u32>,
    /// Timed repetitions of each schedule.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Write the fastest schedule's timeline as SVG to this file.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON lines instead of tables.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench overlap`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { n, streams, chunks, lanes, iters, reps, svg, device, json } = args;
    let ctx = Context::for_ordinal(device)?;
    let r = run(&ctx, OverlapConfig { n, streams, chunks, lanes, iters, reps })?;
    let name = ctx.device().name()?;
    if let Some(path) = &svg {
        let title = format!("{} floats on {name}", n);
        std::fs::write(path, self::svg(r.fastest(), &title))?;
    }
    if json {
        writeln!(
            out,
            "{}",
            json!({"bench": "overlap", "device": name, "n": n, "iters": r.iters,
            "h2d_ms": r.stages_ms[0], "kernel_ms": r.stages_ms[1], "d2h_ms": r.stages_ms[2],
            "copies_together_ms": r.copies_together_ms})
        )?;
        for s in &r.schedules {
            writeln!(
                out,
                "{}",
                json!({"bench": "overlap", "schedule": s.name, "raw": s.raw, "total_ms": s.total_ms,
                "over_longest_stage": s.total_ms / r.longest_stage(), "over_bound": s.total_ms / r.bound()})
            )?;
        }
        writeln!(
            out,
            "{}",
            json!({"bench": "overlap", "fastest_cuvmm": r.fastest().name, "fastest_cuvmm_ms": r.fastest().total_ms,
                   "fastest_raw": r.fastest_raw().map(|s| s.name.clone()),
                   "fastest_raw_ms": r.fastest_raw().map(|s| s.total_ms), "ratio": r.ratio()})
        )?;
    } else {
        print_overlap(out, &r, &name)?;
        if let Some(path) = &svg {
            writeln!(out, "timeline of {} written to {}", r.fastest().name, path.display())?;
        }
    }
    Ok(())
}

/// The overlap experiment's text table.
pub fn print_overlap(out: &mut impl Write, r: &OverlapReport, name: &str) -> std::io::Result<()> {
    let n = r.config.n;
    let longest = r.longest_stage();
    writeln!(out, "{} floats ({}) on {name}, kernel {} multiply-adds per element", n, show(n * 4), r.iters)?;
    writeln!(
        out,
        "stages alone: H2D {:.3} ms, kernel {:.3} ms, D2H {:.3} ms (sum {:.3} ms)",
        r.stages_ms[0],
        r.stages_ms[1],
        r.stages_ms[2],
        r.stages_ms.iter().sum::<f64>()
    )?;
    writeln!(
        out,
        "both copies at once: {:.3} ms (the bus's bound for a schedule that overlaps them)",
        r.copies_together_ms
    )?;
    writeln!(
        out,
        "median of {} runs each, schedules taking turns; each timed from one start event to all streams joined",
        r.config.reps
    )?;
    writeln!(out, "{:<36} {:>10} {:>18} {:>14}", "schedule", "total ms", "/ longest stage", "/ bus bound")?;
    for s in &r.schedules {
        writeln!(
            out,
            "{:<36} {:>10.3} {:>17.3}x {:>13.3}x",
            s.name,
            s.total_ms,
            s.total_ms / longest,
            s.total_ms / r.bound()
        )?;
    }
    if let (Some(raw), Some(ratio)) = (r.fastest_raw(), r.ratio()) {
        let best = r.fastest();
        writeln!(
            out,
            "fastest cuvmm: {} {:.3} ms; fastest raw (hand-written reference): {} {:.3} ms; cuvmm / raw = {ratio:.3}x (goal ≤ 1.0x: {})",
            best.name,
            best.total_ms,
            raw.name,
            raw.total_ms,
            if ratio <= 1.0 { "met" } else { "not met" }
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_everything_once() {
        let parts = split(10, 4);
        assert_eq!(parts, vec![0..3, 3..6, 6..9, 9..10]);
        assert_eq!(split(3, 8).len(), 3);
    }

    #[test]
    fn svg_has_one_box_per_span_and_a_lane_per_stream() {
        let sched = Schedule {
            name: "pipeline".into(),
            plan: Plan::Pipeline(2, 1),
            raw: false,
            total_ms: 2.0,
            spans: vec![
                Span { lane: "copy in".into(), kind: "H2D", start: 0.0, end: 1.0 },
                Span { lane: "compute".into(), kind: "kernel", start: 1.0, end: 2.0 },
                Span { lane: "copy in".into(), kind: "H2D", start: 1.0, end: 2.0 },
            ],
        };
        let s = svg(&sched, "a <title>");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches("<title>").count(), 3);
        assert!(s.contains("a &lt;title&gt;"));
        assert_eq!(s.matches(">copy in</text>").count(), 1);
    }
}
