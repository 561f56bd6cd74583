//! `cuvmm bench overlap`: the multi-stream overlap workload. N floats go host→device, through a compute
//! kernel and back, scheduled serially, breadth-first over N streams (all copies in, all kernels,
//! all copies out), depth-first over N streams, and as cuvmm's
//! event-ordered pipeline (one stream per stage, events between the stages of each chunk).

use cuvmm::context::Context;
use cuvmm::error::Result;
use cuvmm::host::PinnedBuffer;
use cuvmm::kernels::Kernels;
use cuvmm::memory::DeviceBuffer;
use cuvmm::stream::Event;
use cuvmm::stream::Stream;
use cuvmm::stream::{scope, Scope};
use std::cell::RefCell;

/// What to run.
#[derive(Clone, Copy, Debug)]
pub struct OverlapConfig {
    /// Floats moved and computed.
    pub n: usize,
    /// Streams of the breadth-first and depth-first schedules.
    pub streams: usize,
    /// Chunks of the pipeline.
    pub chunks: usize,
    /// Multiply-adds per element in the kernel; `None` tunes it so the kernel takes as long as
    /// the longer copy.
    pub iters: Option<u32>,
    /// Timed repetitions of each schedule (the median run is kept).
    pub reps: usize,
}

impl Default for OverlapConfig {
    fn default() -> Self {
        OverlapConfig { n: 64 << 20, streams: 4, chunks: 32, iters: None, reps: 5 }
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

/// One schedule's result.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Its name.
    pub name: &'static str,
    /// Start of the first operation to end of the last, ms (median run).
    pub total_ms: f64,
    /// The median run's operations.
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
    /// Each schedule.
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

    /// The fastest schedule.
    pub fn fastest(&self) -> &Schedule {
        self.schedules.iter().min_by(|a, b| a.total_ms.total_cmp(&b.total_ms)).expect("schedules")
    }
}

struct Rig<'r> {
    ctx: &'r Context,
    k: Kernels,
    input: PinnedBuffer<f32>,
    output: PinnedBuffer<f32>,
    dev: DeviceBuffer<f32>,
    origin: Event,
    /// Recorded spans: (lane, kind, start event, end event).
    marks: RefCell<Vec<(String, &'static str, Event, Event)>>,
}

impl Rig<'_> {
    /// Queues one stage over elements `r` on `stream`, bracketed by timing events.
    fn op<'a>(
        &'a self,
        s: &Scope<'a>,
        stream: &'a Stream,
        lane: &str,
        kind: &'static str,
        r: std::ops::Range<usize>,
        iters: u32,
    ) -> Result<()> {
        let (a, b) = (Event::new(self.ctx)?, Event::new(self.ctx)?);
        s.track(stream);
        a.record(stream)?;
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
        b.record(stream)?;
        self.marks.borrow_mut().push((lane.to_owned(), kind, a, b));
        Ok(())
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
}

fn split(n: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let per = n.div_ceil(parts);
    (0..parts).map(|i| (i * per).min(n)..((i + 1) * per).min(n)).filter(|r| !r.is_empty()).collect()
}

/// Runs the experiment.
pub fn run(ctx: &Context, cfg: OverlapConfig) -> Result<OverlapReport> {
    if cfg.n == 0 || cfg.streams == 0 || cfg.chunks == 0 || cfg.reps == 0 {
        return Err(crate::bench::invalid("n, streams, chunks and reps must be positive"));
    }
    let mut input = PinnedBuffer::<f32>::new(ctx, cfg.n)?;
    let mut seed = 0x2545_f491_u32;
    for x in input.iter_mut() {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        *x = (seed >> 8) as f32 / (1u32 << 24) as f32 + 0.5;
    }
    let rig = Rig {
        ctx,
        k: Kernels::load(ctx)?,
        input,
        output: PinnedBuffer::<f32>::new(ctx, cfg.n)?,
        dev: DeviceBuffer::<f32>::new(ctx, cfg.n)?,
        origin: Event::new(ctx)?,
        marks: RefCell::new(Vec::new()),
    };
    let streams: Vec<Stream> =
        (0..cfg.streams.max(3)).map(|_| Stream::non_blocking(ctx)).collect::<Result<_>>()?;
    let all = 0..cfg.n;

    // Stage times alone (median of reps after a warm-up), tuning the kernel first.
    let stage = |kind: &'static str, iters: u32| -> Result<f64> {
        let mut t = Vec::new();
        for rep in 0..=cfg.reps {
            scope(|s| {
                rig.origin.record(&streams[0])?;
                rig.op(s, &streams[0], "s0", kind, all.clone(), iters)
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
            rig.op(s, &streams[0], "s0", "H2D", all.clone(), 0)?;
            rig.op(s, &streams[1], "s1", "D2H", all.clone(), 0)
        })?;
        let (ms, _) = rig.spans()?;
        if rep > 0 {
            together.push(ms);
        }
    }
    let copies_together_ms = super::median(&together);

    let parts = split(cfg.n, cfg.streams);
    let chunks = split(cfg.n, cfg.chunks);
    let mut schedules = Vec::new();
    for name in ["serial", "breadth-first", "depth-first", "pipeline"] {
        let mut runs = Vec::new();
        for rep in 0..=cfg.reps {
            scope(|s| {
                // Every stream starts after the common origin.
                rig.origin.record(&streams[0])?;
                for st in &streams[1..] {
                    st.wait_event(&rig.origin)?;
                }
                plan(name, s, &rig, &streams, &parts, &chunks, iters)
            })?;
            let (ms, spans) = rig.spans()?;
            if rep > 0 {
                runs.push((ms, spans));
            }
        }
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (total_ms, spans) = runs.swap_remove(runs.len() / 2);
        schedules.push(Schedule { name, total_ms, spans });
    }

    // The result is right: a sample checked against the same multiply-adds on the CPU
    // (f32::mul_add is the fused fmaf the kernel uses, so results match bit for bit).
    for i in (0..cfg.n).step_by((cfg.n / 997).max(1)) {
        let mut x = rig.input[i];
        for _ in 0..iters {
            x = x.mul_add(0.999, 0.001);
        }
        if rig.output[i].to_bits() != x.to_bits() {
            return Err(crate::bench::invalid(format!("element {i}: device {} != host {x}", rig.output[i])));
        }
    }
    Ok(OverlapReport {
        config: OverlapConfig { iters: Some(iters), ..cfg },
        iters,
        stages_ms: [h2d, kernel, d2h],
        copies_together_ms,
        schedules,
    })
}

/// Queues one schedule.
fn plan<'a>(
    name: &str,
    s: &Scope<'a>,
    rig: &'a Rig<'_>,
    st: &'a [Stream],
    parts: &[std::ops::Range<usize>],
    chunks: &[std::ops::Range<usize>],
    iters: u32,
) -> Result<()> {
    const STAGES: [&str; 3] = ["H2D", "kernel", "D2H"];
    match name {
        "serial" => {
            for kind in STAGES {
                rig.op(s, &st[0], "stream 0", kind, 0..rig.dev.len(), iters)?;
            }
        }
        "breadth-first" => {
            for kind in STAGES {
                for (i, r) in parts.iter().enumerate() {
                    rig.op(s, &st[i], &format!("stream {i}"), kind, r.clone(), iters)?;
                }
            }
        }
        "depth-first" => {
            for (i, r) in parts.iter().enumerate() {
                for kind in STAGES {
                    rig.op(s, &st[i], &format!("stream {i}"), kind, r.clone(), iters)?;
                }
            }
        }
        _ => {
            // One stream per stage; each chunk's kernel waits for its copy in, and its copy out
            // for its kernel, through events. Copies in both directions and kernels overlap.
            let (h, k, d) = (&st[0], &st[1], &st[2]);
            for r in chunks {
                rig.op(s, h, "copy in", "H2D", r.clone(), iters)?;
                let e = Event::without_timing(rig.ctx)?;
                e.record(h)?;
                k.wait_event(&e)?;
                rig.op(s, k, "compute", "kernel", r.clone(), iters)?;
                let e = Event::without_timing(rig.ctx)?;
                e.record(k)?;
                d.wait_event(&e)?;
                rig.op(s, d, "copy out", "D2H", r.clone(), iters)?;
            }
        }
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
            name: "pipeline",
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
