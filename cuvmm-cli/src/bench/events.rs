//! `cuvmm bench events`: an event-ordered pipeline. A copy in on one stream, an event, a second stream
//! that waits for it, runs the kernel and copies back, then a host callback that consumes the
//! result, while the CPU computes the reference meanwhile.

use crate::common::CliResult;
use cuvmm::context::Context;
use cuvmm::error::Result;
use cuvmm::host::PinnedBuffer;
use cuvmm::kernels::{busy_value, Kernels};
use cuvmm::memory::DeviceBuffer;
use cuvmm::stream::scope;
use cuvmm::stream::Event;
use cuvmm::stream::Stream;
use serde_json::json;
use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What happened.
#[derive(Clone, Debug)]
pub struct EventsReport {
    /// Floats processed.
    pub n: usize,
    /// Multiply-adds per element.
    pub iters: u32,
    /// Copy in, kernel, copy out, ms (device events).
    pub stages_ms: [f64; 3],
    /// Host time from queuing everything to the callback finishing, ms.
    pub gpu_wall_ms: f64,
    /// Host time spent computing the sampled reference meanwhile, ms.
    pub cpu_ms: f64,
    /// How much of the CPU's work ran while the GPU pipeline was still going (0 to 1).
    pub overlap: f64,
    /// The sum the callback computed over the result.
    pub callback_sum: f64,
    /// Whether every sampled element (one in [`SAMPLE`]) matched the CPU's reference bit for bit.
    pub verified: bool,
}

/// One element in this many is checked against the CPU ([`busy_value`], which matches the kernel
/// bit for bit).
pub const SAMPLE: usize = 997;

/// Runs the pipeline once warm, on `n` floats with `iters` multiply-adds each.
pub fn run(ctx: &Context, n: usize, iters: u32) -> Result<EventsReport> {
    if n == 0 {
        return Err(crate::bench::invalid("n must be positive"));
    }
    let k = Kernels::load(ctx)?;
    let (copy_stream, work_stream) = (Stream::non_blocking(ctx)?, Stream::non_blocking(ctx)?);
    let ev: Vec<Event> = (0..4).map(|_| Event::new(ctx)).collect::<Result<_>>()?;
    let copied = Event::without_timing(ctx)?;
    let input =
        PinnedBuffer::from_slice(ctx, &(0..n).map(|i| (i % 4099) as f32 * 1e-3 + 0.25).collect::<Vec<_>>())?;
    let mut output = PinnedBuffer::<f32>::new(ctx, n)?;
    let mut dev = DeviceBuffer::<f32>::new(ctx, n)?;
    let consumed: Mutex<Option<(f64, Instant)>> = Mutex::new(None);
    let mut reference = Vec::new();
    let mut cpu = Duration::ZERO;
    let mut t0 = Instant::now();
    for round in 0..2 {
        *consumed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        t0 = Instant::now();
        scope(|s| {
            ev[0].record(&copy_stream)?;
            s.copy_to_device(&copy_stream, &input, dev.as_mut_slice())?;
            ev[1].record(&copy_stream)?;
            copied.record(&copy_stream)?;
            // The second stream waits for the copy on the first, not for the whole device.
            work_stream.wait_event(&copied)?;
            k.busy_f32(&work_stream, &mut dev.as_mut_slice(), iters)?;
            ev[2].record(&work_stream)?;
            let landing = s.copy_to_host(&work_stream, dev.as_slice(), &mut output)?;
            ev[3].record(&work_stream)?;
            let consumed = &consumed;
            s.then(landing, move |data| {
                let sum: f64 = data.iter().map(|&x| x as f64).sum();
                *consumed.lock().unwrap_or_else(|e| e.into_inner()) = Some((sum, Instant::now()));
            })?;
            // Meanwhile, the CPU computes the reference for a sample of the elements.
            let t = Instant::now();
            reference = (0..n).step_by(SAMPLE).map(|i| busy_value(input[i], iters)).collect();
            cpu = t.elapsed();
            let _ = round;
            Ok(())
        })?;
    }
    let (sum, done) = consumed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .ok_or_else(|| crate::bench::invalid("the host callback did not run"))?;
    let gpu_wall = done.duration_since(t0);
    let verified = output.iter().step_by(SAMPLE).zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
    let ms = |a: usize, b: usize| -> Result<f64> { Ok(ev[a].elapsed_ms(&ev[b])? as f64) };
    Ok(EventsReport {
        n,
        iters,
        stages_ms: [ms(0, 1)?, ms(1, 2)?, ms(2, 3)?],
        gpu_wall_ms: gpu_wall.as_secs_f64() * 1e3,
        cpu_ms: cpu.as_secs_f64() * 1e3,
        overlap: (gpu_wall.as_secs_f64().min(cpu.as_secs_f64()) / cpu.as_secs_f64().max(1e-12)).min(1.0),
        callback_sum: sum,
        verified,
    })
}

// The options of `cuvmm bench events` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Floats.
    #[arg(long, default_value_t = 16 << 20)]
    n: usize,
    /// Kernel multiply-adds per element.
    #[arg(long, default_value_t = 64)]
    iters: u32,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench events`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { n, iters, device, json } = args;
    let ctx = Context::for_ordinal(device)?;
    let r = run(&ctx, n, iters)?;
    if json {
        writeln!(
            out,
            "{}",
            json!({"bench": "events", "n": r.n, "iters": r.iters, "h2d_ms": r.stages_ms[0],
            "kernel_ms": r.stages_ms[1], "d2h_ms": r.stages_ms[2], "gpu_wall_ms": r.gpu_wall_ms,
            "cpu_ms": r.cpu_ms, "overlap": r.overlap, "callback_sum": r.callback_sum, "verified": r.verified})
        )?;
    } else {
        writeln!(out, "{} floats, {} multiply-adds each, on {}", r.n, r.iters, ctx.device().name()?)?;
        writeln!(out, "copy in (stream 1)            {:>9.3} ms", r.stages_ms[0])?;
        writeln!(out, "kernel (stream 2, after event) {:>8.3} ms", r.stages_ms[1])?;
        writeln!(out, "copy out (stream 2)           {:>9.3} ms", r.stages_ms[2])?;
        writeln!(out, "queue → callback done (host)  {:>9.3} ms", r.gpu_wall_ms)?;
        writeln!(
            out,
            "CPU reference (1 in {}) meanwhile {:>5.3} ms ({:.0}% of it overlapped the GPU)",
            SAMPLE,
            r.cpu_ms,
            r.overlap * 100.0
        )?;
        writeln!(
            out,
            "callback's sum of the result  {:>9.1}; sample matches the CPU bit for bit: {}",
            r.callback_sum, r.verified
        )?;
    }
    if !r.verified {
        return Err("the GPU result differs from the CPU reference".into());
    }
    Ok(())
}
