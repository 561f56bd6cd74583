//! `cuvmm bench …`.

use super::size::{parse_counts, parse_size, parse_sizes, show};
use super::CliResult;
use crate::bench::{alloc, bandwidth, events, grow, ipc, order, overlap, peer, sleep, trace, vmm_ops};
use clap::Subcommand;
use cuvmm::alloc::{BackupKind, BackupOptions};
use cuvmm::host::{Staging, StagingConfig};
use cuvmm::vmm::ChunkPolicy;
use cuvmm::Context;
use serde_json::json;
use std::io::Write;

#[derive(Subcommand, Debug)]
pub enum Bench {
    /// Grow a VmmVec step by step against realloc-by-copy doubling.
    Grow {
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
    },
    /// Host-device bandwidth: pageable, pinned, registered, both directions, staged pageable.
    Bandwidth {
        /// Transfer sizes.
        #[arg(long, default_value = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB", value_parser = parse_sizes)]
        sizes: std::vec::Vec<usize>,
        /// Timed repetitions per size.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Host threads of the staged path (default: three quarters of the cores, at most 12); a list sweeps.
        #[arg(long, value_parser = parse_counts)]
        threads: Option<std::vec::Vec<usize>>,
        /// Bytes per chunk (per DMA and pinned slot) of the staged path (default 4MiB); a list sweeps.
        #[arg(long, value_parser = parse_sizes)]
        chunk: Option<std::vec::Vec<usize>>,
        /// Bytes per piece a thread copies (default 256KiB, or the chunk if smaller); a list sweeps.
        #[arg(long, value_parser = parse_sizes)]
        piece: Option<std::vec::Vec<usize>>,
        /// Pinned slots in the staging ring (default 8); a list sweeps.
        #[arg(long, value_parser = parse_counts)]
        slots: Option<std::vec::Vec<usize>>,
        /// Only the staged path, for every combination of --threads, --chunk, --piece and
        /// --slots, with its references (pinned DMA, host memcpy per thread count).
        #[arg(long)]
        sweep: bool,
        /// With --sweep: milliseconds the host sleeps before each timed transfer, staged and
        /// references alike (a program that copies now and then rather than back to back).
        #[arg(long, default_value_t = 0, requires = "sweep")]
        idle_ms: u64,
        /// Print, for each size (and shape) and direction, the slowest timed staged transfer's
        /// timeline: when each chunk was filled, its DMA queued, landed, drained.
        #[arg(long)]
        trace: bool,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// JSON lines instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// The multi-stream overlap workload: serial, breadth-first, depth-first and pipelined
    /// schedules through cuvmm, against the raw-driver breadth- and depth-first schedules.
    Overlap {
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
    },
    /// An event-ordered pipeline with a host callback consuming the result.
    Events {
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
    },
    /// What cross-stream ordering costs: small copies and kernels through tracked views against
    /// untracked views of the same memory, in one run.
    Order {
        /// Bytes per copy or fill.
        #[arg(long, default_value = "4KiB", value_parser = parse_size)]
        bytes: usize,
        /// Operations per batch.
        #[arg(long, default_value_t = 2000)]
        iters: usize,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Allocate+free latency: the caching sub-allocator, cuMemAlloc, the stream-ordered pool.
    Alloc {
        /// Allocation sizes.
        #[arg(long, default_value = "4KiB,64KiB,1MiB,16MiB,64MiB", value_parser = parse_sizes)]
        sizes: std::vec::Vec<usize>,
        /// Thread counts (e.g. 1,2,4,8,16): cached pairs of the stream-ordered allocator against
        /// the pool, each thread on its own stream, instead of the latency table.
        #[arg(long, value_parser = parse_counts)]
        threads: Option<std::vec::Vec<usize>>,
        /// Pairs per thread per batch with --threads (the pool runs an eighth as many).
        #[arg(long, default_value_t = 200_000)]
        pairs: usize,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Replay an allocation trace (libcuvmm.so's `CUVMM_ALLOC_CONF=trace=PATH`) against cuvmm's
    /// stream allocator, the driver's stream-ordered pool and cuMemAlloc: host time per call, peak
    /// memory; then cached allocate+free pairs.
    Trace {
        /// The trace file; without one, a synthetic transformer-like trace.
        path: Option<std::path::PathBuf>,
        /// Measured passes per allocator (after one warm-up pass each).
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Allocate+free pairs per batch of the cached-pair measure (0 skips it).
        #[arg(long, default_value_t = 1_000_000)]
        pairs: usize,
        /// Sizes of the cached-pair measure.
        #[arg(long, default_value = "4KiB,1MiB", value_parser = parse_sizes)]
        pair_sizes: std::vec::Vec<usize>,
        /// Device ordinal to replay on; the trace's records of this device are replayed unless
        /// --trace-device says otherwise.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Replay the trace's records of this device (default: --device).
        #[arg(long)]
        trace_device: Option<i32>,
        /// JSON lines instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Put tagged memory to sleep and wake it (with offload and discarding), beside the pinned
    /// copy bounds measured in each cycle.
    Sleep {
        /// Bytes tagged.
        #[arg(long, default_value = "16GiB", value_parser = parse_size)]
        size: usize,
        /// Bytes per allocation.
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        block: usize,
        /// Sleep and wake cycles measured after the first.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Device ordinals, comma-separated: the tag on each (one allocator per device), slept
        /// and woken on all at once (overrides --device).
        #[arg(long, value_delimiter = ',')]
        devices: Vec<usize>,
        /// Where an offloading sleep keeps the contents: pageable (host memory through the
        /// staging ring), pinned (host memory as large as the tag) or disk (a file in --dir).
        #[arg(long, default_value = "pageable")]
        backup: String,
        /// Directory of the disk backup.
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
        /// Keep the backup after each wake for the next sleep.
        #[arg(long)]
        retain: bool,
        /// Run the first cycle in a child process of its own: the first sleep of a fresh process.
        #[arg(long)]
        fresh_process: bool,
        /// Milliseconds waited between each sleep and its wake.
        #[arg(long, default_value_t = 0)]
        gap_ms: u64,
        /// Run only the first cycle, as JSON lines (what --fresh-process runs in the child).
        #[arg(long, hide = true)]
        first_only: bool,
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Share an allocation with a child process: export, send, receive, import, map, access,
    /// through cuvmm and through raw driver and socket calls in the same run; bandwidth on the
    /// imported memory; the legacy cuIpc* path.
    Ipc {
        /// Bytes shared.
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        size: usize,
        /// Importer processes, one after the other (each starts with one exchange of each path,
        /// half of them with cuvmm's first).
        #[arg(long, default_value_t = 4)]
        processes: usize,
        /// Further exchanges of each path per importer process, taking turns.
        #[arg(long, default_value_t = 4)]
        pairs: usize,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Run as the importer, connecting to this socket (used by the benchmark itself).
        #[arg(long, hide = true)]
        child: Option<std::path::PathBuf>,
    },
    /// Two GPUs: a kernel on GPU 1 reading GPU 0's memory through the mapping, against cuMemcpyPeer.
    Peer {
        /// Bytes read.
        #[arg(long, default_value = "1GiB", value_parser = parse_size)]
        size: usize,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Latency of create / map / set-access / unmap / release per chunk size, raw and through cuvmm.
    VmmOps {
        /// Chunk sizes.
        #[arg(long, default_value = "2MiB,8MiB,32MiB,128MiB,512MiB,1GiB", value_parser = parse_sizes)]
        sizes: std::vec::Vec<usize>,
        /// Timed repetitions per size and side.
        #[arg(long, default_value_t = 30)]
        reps: usize,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(b: Bench) -> CliResult {
    let mut out = std::io::stdout().lock();
    match b {
        Bench::Grow { step, target, reps, max_chunk, growth_percent, device, json } => {
            let ctx = Context::for_ordinal(device)?;
            let policy = ChunkPolicy { max_chunk, growth_percent, ..ChunkPolicy::default() };
            let r = grow::run(&ctx, grow::GrowConfig { step, target, reps, policy })?;
            let name = ctx.device().name()?;
            let copy = if r.copy_failed.is_none() {
                Some(("copy_doubling", "copy-doubling", &r.copy))
            } else {
                None
            };
            let rows = [
                ("vmmvec", "VmmVec, default", &r.vmm),
                ("vmmvec_ahead", "VmmVec, ahead", &r.ahead),
                ("vmmvec_no_ahead", "VmmVec, no ahead", &r.no_ahead),
            ];
            if json {
                for (which, _, run) in rows.iter().copied().chain(copy) {
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
                    writeln!(
                        out,
                        "{}",
                        json!({"bench": "grow", "strategy": "copy_doubling", "failed": why})
                    )?;
                } else {
                    writeln!(
                        out,
                        "{}",
                        json!({"bench": "grow", "ratio_total": r.total_ratio(), "ratio_total_ahead": r.ahead_total_ratio(),
                               "ratio_worst_step": r.worst_ratio(), "ratio_peak": r.peak_ratio(),
                               "max_chunk": max_chunk, "growth_percent": growth_percent})
                    )?;
                }
            } else {
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
                for (_, which, run) in rows.iter().copied().chain(copy) {
                    let slow: Vec<String> =
                        run.slowest.iter().map(|(i, s)| format!("{i}: {:.2}", s * 1e3)).collect();
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
            }
        }
        Bench::Bandwidth {
            sizes,
            reps,
            threads,
            chunk,
            piece,
            slots,
            sweep,
            idle_ms,
            trace,
            device,
            json,
        } => {
            let ctx = Context::for_ordinal(device)?;
            let d = StagingConfig::default();
            let shapes = bandwidth::ring_shapes(
                &chunk.unwrap_or_else(|| vec![d.chunk]),
                piece.as_deref(),
                &slots.unwrap_or_else(|| vec![d.slots]),
                &threads.unwrap_or_else(|| vec![d.threads]),
            );
            if sweep {
                let idle = std::time::Duration::from_millis(idle_ms);
                let (rows, refs) = bandwidth::sweep(&ctx, &sizes, reps, &shapes, idle, trace)?;
                print_sweep(&mut out, &ctx.device().name()?, &rows, &refs, reps, idle_ms, json)?;
                for r in &rows {
                    print_slowest(&mut out, r.size, Some(&r.config), &r.slowest, json)?;
                }
                return Ok(());
            }
            let [shape] = shapes[..] else {
                return Err(format!(
                    "{} ring shapes given (a piece larger than its chunk is left out); several need --sweep",
                    shapes.len()
                )
                .into());
            };
            let mut staging = Staging::with_config(&ctx, shape)?;
            staging.set_tracing(trace);
            let rows = bandwidth::run(&ctx, &sizes, reps, &mut staging)?;
            print_bandwidth(&mut out, &ctx, &rows, &staging, json)?;
            for r in &rows {
                print_slowest(&mut out, r.size, None, &r.slowest, json)?;
            }
        }
        Bench::Overlap { n, streams, chunks, lanes, iters, reps, svg, device, json } => {
            let ctx = Context::for_ordinal(device)?;
            let r = overlap::run(&ctx, overlap::OverlapConfig { n, streams, chunks, lanes, iters, reps })?;
            let name = ctx.device().name()?;
            if let Some(path) = &svg {
                let title = format!("{} floats on {name}", n);
                std::fs::write(path, overlap::svg(r.fastest(), &title))?;
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
                print_overlap(&mut out, &r, &name)?;
                if let Some(path) = &svg {
                    writeln!(out, "timeline of {} written to {}", r.fastest().name, path.display())?;
                }
            }
        }
        Bench::Events { n, iters, device, json } => {
            let ctx = Context::for_ordinal(device)?;
            let r = events::run(&ctx, n, iters)?;
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
                    events::SAMPLE,
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
        }
        Bench::Order { bytes, iters, device, json } => {
            let ctx = Context::for_ordinal(device)?;
            let rows = order::run(&ctx, bytes, iters)?;
            if !json {
                writeln!(
                    out,
                    "µs per operation of {} on {}, tracked vs untracked views of the same memory (median of 9 batches of {iters})",
                    show(bytes),
                    ctx.device().name()?
                )?;
                writeln!(out, "{:<34} {:>10} {:>10} {:>8}", "loop", "tracked", "untracked", "ratio")?;
            }
            for r in &rows {
                if json {
                    writeln!(
                        out,
                        "{}",
                        json!({"bench": "order", "what": r.what, "bytes": bytes, "tracked_us": r.tracked_us,
                        "raw_us": r.raw_us, "ratio": r.ratio()})
                    )?;
                } else {
                    writeln!(
                        out,
                        "{:<34} {:>10.3} {:>10.3} {:>8.3}",
                        r.what,
                        r.tracked_us,
                        r.raw_us,
                        r.ratio()
                    )?;
                }
            }
        }
        Bench::Alloc { sizes, device, json, threads: Some(threads), pairs } => {
            let ctx = Context::for_ordinal(device)?;
            let rows = alloc::run_threads(&ctx, &sizes, &threads, pairs)?;
            print_alloc_threads(&mut out, &ctx, &rows, pairs, json)?;
        }
        Bench::Alloc { sizes, device, json, threads: None, .. } => {
            let ctx = Context::for_ordinal(device)?;
            let rows = alloc::run(&ctx, &sizes)?;
            if !json {
                writeln!(out, "µs per allocate+free pair on {} (median of 5 batches)", ctx.device().name()?)?;
                writeln!(
                    out,
                    "{:>9} {:>14} {:>18} {:>22}",
                    "size", "cuvmm cached", "cuMemAlloc/Free", "cuMemAllocAsync pool"
                )?;
            }
            for r in &rows {
                if json {
                    writeln!(
                        out,
                        "{}",
                        json!({"bench": "alloc", "size": r.size, "cached_us": r.cached_us,
                        "driver_us": r.driver_us, "pool_us": r.pool_us})
                    )?;
                } else {
                    writeln!(
                        out,
                        "{:>9} {:>14.3} {:>18.2} {:>22.3}",
                        show(r.size),
                        r.cached_us,
                        r.driver_us,
                        r.pool_us
                    )?;
                }
            }
        }
        Bench::Trace { path, reps, pairs, pair_sizes, device, trace_device, json } => {
            let records = match trace_device {
                Some(d) => d,
                None => {
                    i32::try_from(device).map_err(|_| crate::bench::invalid("device ordinal too large"))?
                }
            };
            // Read before touching the driver: a bad file is reported on any machine.
            let t = match &path {
                Some(p) => trace::load(p, records)?,
                None => trace::synthetic()?,
            };
            let ctx = Context::for_ordinal(device)?;
            let cfg = trace::TraceConfig { reps, pairs, pair_sizes };
            let r = trace::run(&ctx, &t, &cfg)?;
            print_trace(&mut out, &ctx.device().name()?, path.as_deref(), &t, &r, json)?;
        }
        Bench::Sleep {
            size,
            block,
            reps,
            device,
            devices,
            backup,
            dir,
            retain,
            fresh_process,
            gap_ms,
            first_only,
            json,
        } => {
            let kind = match (backup.as_str(), &dir) {
                ("pageable", _) => BackupKind::Pageable,
                ("pinned", _) => BackupKind::Pinned,
                ("disk", Some(d)) => BackupKind::Disk(d.clone()),
                ("disk", None) => return Err(crate::bench::invalid("--backup disk needs --dir").into()),
                (other, _) => {
                    return Err(crate::bench::invalid(format!(
                        "unknown --backup {other} (pageable, pinned, disk)"
                    ))
                    .into())
                }
            };
            let devices = if devices.is_empty() { vec![device] } else { devices };
            let ctxs = devices.iter().map(|&d| Context::for_ordinal(d)).collect::<cuvmm::Result<Vec<_>>>()?;
            let cfg = sleep::SleepConfig {
                bytes: size,
                block,
                reps,
                backup: BackupOptions { kind, retain },
                gap: std::time::Duration::from_millis(gap_ms),
                first_only,
            };
            if first_only {
                sleep::run(&ctxs, &cfg, 1, |c| {
                    let _ = writeln!(out, "{}", json!({"bench": "sleep-cycle", "cycle": c.to_json()}));
                })?;
                return Ok(());
            }
            let mut child = Vec::new();
            if fresh_process {
                child = sleep_in_child(size, block, &devices, &backup, dir.as_deref(), retain, gap_ms)?;
            }
            let names = ctxs.iter().map(|c| c.device().name()).collect::<cuvmm::Result<Vec<_>>>()?;
            if !json {
                writeln!(
                    out,
                    "{}: sleep and wake of {} tagged on each of {} device(s) in {} blocks, backup {backup}{}{}; bounds taken in each cycle",
                    names.join(", "),
                    show(size),
                    devices.len(),
                    show(block),
                    if retain { ", retained" } else { "" },
                    if gap_ms > 0 { format!(", {gap_ms} ms between sleep and wake") } else { String::new() },
                )?;
                writeln!(out, "{}", SLEEP_CYCLE_HEADER)?;
                writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")?;
                for c in &child {
                    print_sleep_cycle(&mut out, c, size * devices.len())?;
                }
            } else {
                for c in &child {
                    writeln!(out, "{}", json!({"bench": "sleep-cycle", "cycle": c.to_json()}))?;
                }
            }
            let first = child.len() + 1;
            let r = sleep::run(&ctxs, &cfg, first, |c| {
                let _ = if json {
                    writeln!(out, "{}", json!({"bench": "sleep-cycle", "cycle": c.to_json()}))
                } else {
                    print_sleep_cycle(&mut out, c, size * devices.len())
                };
            })?;
            let r = sleep::with_child_cycles(r, child);
            print_sleep_summary(&mut out, &r, &names, block, reps, json)?;
        }
        Bench::Ipc { size, processes, pairs, device, json, child } => {
            let ctx = Context::for_ordinal(device)?;
            if let Some(path) = child {
                let mut sock = std::os::unix::net::UnixStream::connect(path)?;
                let r = ipc::import_side(&ctx, &mut sock)?;
                writeln!(out, "{}", r.to_json())?;
                return Ok(());
            }
            if processes == 0 {
                return Err("--processes must be at least 1".into());
            }
            let dir = std::env::temp_dir().join(format!("cuvmm-bench-ipc-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let path = dir.join("sock");
            let listener = std::os::unix::net::UnixListener::bind(&path)?;
            let me = std::env::current_exe()?;
            let mut children = Vec::new();
            for c in 0..processes {
                let child = std::process::Command::new(&me)
                    .args(["bench", "ipc", "--device", &device.to_string(), "--child"])
                    .arg(&path)
                    .stdout(std::process::Stdio::piped())
                    .spawn()?;
                let (mut sock, _) = listener.accept()?;
                let exported = ipc::export_side(&ctx, &mut sock, size, c, pairs)?;
                let o = child.wait_with_output()?;
                if !o.status.success() {
                    return Err("the importer process failed".into());
                }
                let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
                children.push((exported, ipc::ImporterReport::from_json(&v)?));
            }
            let _ = std::fs::remove_dir_all(&dir);
            let r = ipc::summarize(&children)?;
            print_ipc(&mut out, &ctx.device().name()?, size, &r, json)?;
        }
        Bench::Peer { size, json } => {
            let devices = cuvmm::Device::all()?;
            if devices.len() < 2 {
                writeln!(out, "bench peer needs two GPUs; this machine has {}", devices.len())?;
                return Ok(());
            }
            let ctxs = [Context::new(devices[0])?, Context::new(devices[1])?];
            let r = peer::run(&ctxs, size)?;
            if json {
                writeln!(
                    out,
                    "{}",
                    json!({"bench": "peer", "bytes": r.bytes, "kernel_gbs": r.kernel_gbs,
                    "copy_gbs": r.copy_gbs, "ratio": r.kernel_gbs / r.copy_gbs})
                )?;
            } else {
                writeln!(out, "GPU 1 reading {} of GPU 0's memory (median of 5)", show(r.bytes))?;
                writeln!(out, "  kernel through the peer mapping  {:>8.1} GB/s", r.kernel_gbs)?;
                writeln!(out, "  cuMemcpyPeerAsync                {:>8.1} GB/s", r.copy_gbs)?;
                writeln!(out, "  ratio                            {:>8.3}x", r.kernel_gbs / r.copy_gbs)?;
            }
        }
        Bench::VmmOps { sizes, reps, device, json } => {
            let ctx = Context::for_ordinal(device)?;
            let rows = vmm_ops::run(&ctx, &sizes, reps)?;
            let costs = vmm_ops::call_costs(&ctx)?;
            if json {
                for r in &rows {
                    for (i, op) in vmm_ops::OPS.iter().enumerate() {
                        writeln!(
                            out,
                            "{}",
                            json!({"bench": "vmm-ops", "size": r.size, "op": op, "reps": r.reps,
                                   "raw_us": r.raw_us[i], "cuvmm_us": r.crate_us[i], "overhead": r.overhead()[i],
                                   "ratio": r.crate_us[i] / r.raw_us[i]})
                        )?;
                    }
                    writeln!(
                        out,
                        "{}",
                        json!({"bench": "vmm-ops", "size": r.size, "op": "map_floor", "reps": r.reps,
                               "raw_us": r.raw_us[1], "floor_us": r.floor_map_us, "cuvmm_us": r.crate_us[1]})
                    )?;
                }
                for c in &costs {
                    writeln!(out, "{}", json!({"bench": "vmm-ops", "call": c.what, "ns": c.ns}))?;
                }
            } else {
                writeln!(out, "median µs per op over {reps} reps (raw driver / cuvmm; unmap includes the context sync both do)")?;
                write!(out, "{:>9}", "chunk")?;
                for op in vmm_ops::OPS {
                    write!(out, " {op:>19}")?;
                }
                writeln!(out, " {:>10} {:>10}", "overhead", "µs per GiB")?;
                for r in &rows {
                    write!(out, "{:>9}", show(r.size))?;
                    for i in 0..5 {
                        write!(out, " {:>9.1} / {:>7.1}", r.raw_us[i], r.crate_us[i])?;
                    }
                    let per_gib = r.crate_us.iter().sum::<f64>() * (1u64 << 30) as f64 / r.size as f64;
                    writeln!(out, " {:>9.1}% {:>10.0}", r.total_overhead() * 100.0, per_gib)?;
                }
                writeln!(out, "cuvmm / raw per op:")?;
                for r in &rows {
                    write!(out, "{:>9}", show(r.size))?;
                    for i in 0..5 {
                        write!(out, " {:>19.3}", r.crate_us[i] / r.raw_us[i])?;
                    }
                    writeln!(out)?;
                }
                if let Some(r) = rows.iter().min_by_key(|r| r.size) {
                    let map = r.crate_us[1] / r.raw_us[1];
                    writeln!(
                        out,
                        "cuMemMap of {}: cuvmm {:.3} µs / raw {:.3} µs = {map:.3}x (goal ≤ 1.05x: {})",
                        show(r.size),
                        r.crate_us[1],
                        r.raw_us[1],
                        if map <= 1.05 { "met" } else { "not met" }
                    )?;
                }
                writeln!(
                    out,
                    "raw cuMemMap with what a shared Reservation's map needs around it (a mutex held across \
                     the call, the range recorded, two reference counts raised):"
                )?;
                for r in &rows {
                    writeln!(
                        out,
                        "{:>9} {:>9.3} µs = {:.3}x raw; cuvmm {:.3}x of it",
                        show(r.size),
                        r.floor_map_us,
                        r.floor_map_us / r.raw_us[1],
                        r.crate_us[1] / r.floor_map_us
                    )?;
                }
                writeln!(
                    out,
                    "what the calls cuvmm may add cost here (ns per call, median of 7 batches of 2000):"
                )?;
                for c in &costs {
                    writeln!(out, "  {:<40} {:>8.1}", c.what, c.ns)?;
                }
            }
        }
    }
    Ok(())
}

/// The slowest staged transfers' timelines (`--trace`), one line (or JSON line) per direction.
/// `bench alloc --threads`: aggregate million pairs per second, cuvmm beside the driver's pool.
fn print_alloc_threads(
    out: &mut impl Write,
    ctx: &Context,
    rows: &[alloc::ThreadRow],
    pairs: usize,
    json: bool,
) -> CliResult {
    if !json {
        writeln!(
            out,
            "cached allocate+free pairs on {}, each thread on its own stream: million pairs/s, all threads \
             (median of 5 batches of {pairs} pairs a thread; the pool {} a thread)",
            ctx.device().name()?,
            pairs / 8
        )?;
        writeln!(
            out,
            "{:>9} {:>7} {:>12} {:>9} {:>11} {:>12} {:>9} {:>10}",
            "size", "threads", "cuvmm", "x 1 thr", "ns/pair", "pool", "x 1 thr", "cuvmm/pool"
        )?;
    }
    for r in rows {
        let one = rows.iter().find(|o| o.size == r.size && o.threads == 1);
        let (c1, p1) = one.map_or((f64::NAN, f64::NAN), |o| {
            (r.cuvmm_mpairs / o.cuvmm_mpairs, r.pool_mpairs / o.pool_mpairs)
        });
        // Per thread: each thread's pairs take this long on average.
        let ns = 1e3 * r.threads as f64 / r.cuvmm_mpairs;
        if json {
            writeln!(
                out,
                "{}",
                json!({"bench": "alloc_threads", "size": r.size, "threads": r.threads,
                "cuvmm_mpairs": r.cuvmm_mpairs, "pool_mpairs": r.pool_mpairs,
                "cuvmm_vs_one_thread": c1, "pool_vs_one_thread": p1, "cuvmm_ns_per_pair_per_thread": ns})
            )?;
        } else {
            writeln!(
                out,
                "{:>9} {:>7} {:>12.2} {:>8.2}x {:>11.1} {:>12.3} {:>8.2}x {:>9.1}x",
                show(r.size),
                r.threads,
                r.cuvmm_mpairs,
                c1,
                ns,
                r.pool_mpairs,
                p1,
                r.cuvmm_mpairs / r.pool_mpairs
            )?;
        }
    }
    Ok(())
}

fn print_slowest(
    out: &mut impl Write,
    size: usize,
    shape: Option<&cuvmm::host::StagingConfig>,
    slowest: &[Option<cuvmm::host::StagingTrace>; 2],
    json: bool,
) -> CliResult {
    let us = |d: Option<std::time::Duration>| d.map(|d| d.as_secs_f64() * 1e6);
    for t in slowest.iter().flatten() {
        let dir = if t.to_device { "h2d" } else { "d2h" };
        if json {
            let chunks: Vec<_> = t
                .chunks
                .iter()
                .map(|c| {
                    json!({"offset": c.offset, "len": c.len, "filled_us": us(c.filled), "queued_us": us(c.queued),
                           "landed_us": us(c.landed), "drained_us": us(c.drained)})
                })
                .collect();
            let shape = shape
                .map(|c| json!({"chunk": c.chunk, "piece": c.piece, "slots": c.slots, "threads": c.threads}));
            writeln!(
                out,
                "{}",
                json!({"bench": "bandwidth-trace", "size": size, "shape": shape, "direction": dir,
                       "total_us": t.total.as_secs_f64() * 1e6, "first_piece_us": us(t.first_piece), "chunks": chunks})
            )?;
            continue;
        }
        let step = |d: Option<std::time::Duration>| us(d).map_or("-".to_string(), |v| format!("{v:.0}"));
        let (what, steps): (&str, Vec<String>) = if t.to_device {
            (
                "filled/queued",
                t.chunks.iter().map(|c| format!("{}/{}", step(c.filled), step(c.queued))).collect(),
            )
        } else {
            (
                "queued/landed/drained",
                t.chunks
                    .iter()
                    .map(|c| format!("{}/{}/{}", step(c.queued), step(c.landed), step(c.drained)))
                    .collect(),
            )
        };
        let shape = shape.map_or(String::new(), |c| {
            format!(
                " ({} chunks, {} pieces, {} slots, {} threads)",
                show(c.chunk),
                show(c.piece),
                c.slots,
                c.threads
            )
        });
        writeln!(
            out,
            "slowest staged {} of {}{shape}: {:.0} µs, first piece at {} µs; per chunk, µs from the call, {what}: {}",
            if t.to_device { "host to device" } else { "device to host" },
            show(size),
            t.total.as_secs_f64() * 1e6,
            step(t.first_piece),
            steps.join(" ")
        )?;
    }
    Ok(())
}

pub(super) fn print_bandwidth(
    out: &mut impl Write,
    ctx: &Context,
    rows: &[bandwidth::BandwidthRow],
    staging: &Staging,
    json: bool,
) -> CliResult {
    let name = ctx.device().name()?;
    if json {
        for r in rows {
            writeln!(
                out,
                "{}",
                json!({"bench": "bandwidth", "device": name, "size": r.size, "reps": r.reps,
                "pageable_h2d": r.pageable[0], "pageable_d2h": r.pageable[1],
                "pinned_raw_h2d": r.pinned_raw[0], "pinned_raw_d2h": r.pinned_raw[1],
                "pinned_h2d": r.pinned[0], "pinned_d2h": r.pinned[1],
                "registered_h2d": r.registered[0], "registered_d2h": r.registered[1],
                "bidirectional": r.bidirectional, "staged_h2d": r.staged[0], "staged_d2h": r.staged[1],
                "memcpy_h2d": r.memcpy[0], "memcpy_d2h": r.memcpy[1],
                "register_us": r.register_us, "staging_threads": staging.threads(), "staging_chunk": staging.chunk(),
                "staging_piece": staging.config().piece, "staging_slots": staging.config().slots})
            )?;
        }
        return Ok(());
    }
    writeln!(out, "GB/s on {name} (median of {} reps; H2D / D2H)", rows.first().map_or(0, |r| r.reps))?;
    writeln!(
        out,
        "{:>9} {:>15} {:>15} {:>15} {:>15} {:>9} {:>15} {:>15} {:>12}",
        "size",
        "pageable",
        "pinned (raw)",
        "pinned (cuvmm)",
        "registered",
        "both",
        "staged",
        "memcpy",
        "register µs"
    )?;
    for r in rows {
        writeln!(
            out,
            "{:>9} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>9.1} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>12.0}",
            show(r.size),
            r.pageable[0],
            r.pageable[1],
            r.pinned_raw[0],
            r.pinned_raw[1],
            r.pinned[0],
            r.pinned[1],
            r.registered[0],
            r.registered[1],
            r.bidirectional,
            r.staged[0],
            r.staged[1],
            r.memcpy[0],
            r.memcpy[1],
            r.register_us
        )?;
    }
    let c = staging.config();
    writeln!(
        out,
        "staged: {} threads, {} chunks in {} pieces, {} slots; memcpy: host memcpy on the same threads in \
         the same pieces, taken in turn, pageable → pinned / pinned → pageable (the staged path's \
         copying side alone, without its DMA)",
        c.threads,
        show(c.chunk),
        show(c.piece),
        c.slots
    )?;
    let big: Vec<_> = rows.iter().filter(|r| r.size >= 64 << 20).collect();
    if !big.is_empty() {
        let worst = |i: usize| big.iter().map(|r| r.staged[i]).fold(f64::INFINITY, f64::min);
        let (h, d) = (worst(0), worst(1));
        writeln!(
            out,
            "staged at ≥ 64 MiB, slowest size: {h:.1} GB/s H2D, {d:.1} GB/s D2H (goal ≥ 39 both ways: {}); \
             over memcpy on the same threads {:.3}x / {:.3}x, over pinned DMA {:.3}x / {:.3}x",
            if h >= 39.0 && d >= 39.0 { "met" } else { "not met" },
            big.iter().map(|r| r.staged[0] / r.memcpy[0]).fold(f64::INFINITY, f64::min),
            big.iter().map(|r| r.staged[1] / r.memcpy[1]).fold(f64::INFINITY, f64::min),
            big.iter().map(|r| r.staged[0] / r.pinned_raw[0]).fold(f64::INFINITY, f64::min),
            big.iter().map(|r| r.staged[1] / r.pinned_raw[1]).fold(f64::INFINITY, f64::min),
        )?;
    }
    if let Some(r) = rows.iter().max_by_key(|r| r.size) {
        writeln!(
            out,
            "at {}: cuvmm pinned / raw driver {:.3}x H2D, {:.3}x D2H; staged / driver pageable {:.2}x H2D, {:.2}x D2H ({} threads, {} chunks)",
            show(r.size),
            r.pinned[0] / r.pinned_raw[0],
            r.pinned[1] / r.pinned_raw[1],
            r.staged[0] / r.pageable[0],
            r.staged[1] / r.pageable[1],
            staging.threads(),
            show(staging.chunk())
        )?;
        // The pinned-vs-pageable comparison, with this machine's numbers beside the usual rule of thumb.
        writeln!(out, "\n=== Pinned vs Pageable Memory Transfer (measured, {}) ===", show(r.size))?;
        writeln!(out, "[Pageable (malloc) Memory]")?;
        writeln!(out, "  Allocation:   let v = vec![0u8; bytes]")?;
        writeln!(out, "  Copy path:    CPU_RAM -> [driver staging buffer] -> GPU")?;
        writeln!(out, "  Synchronous:  YES (the copy call returns once the data is staged or landed)")?;
        writeln!(out, "  Transfer BW:  {:.1} GB/s H2D, {:.1} GB/s D2H", r.pageable[0], r.pageable[1])?;
        writeln!(out, "[Pinned (cuMemHostAlloc) Memory]")?;
        writeln!(out, "  Allocation:   PinnedBuffer::<u8>::new(&ctx, bytes)")?;
        writeln!(out, "  Copy path:    CPU_RAM -> GPU (direct DMA)")?;
        writeln!(out, "  Asynchronous: YES (scope(|s| s.copy_to_device(..)))")?;
        writeln!(out, "  Transfer BW:  {:.1} GB/s H2D, {:.1} GB/s D2H", r.pinned[0], r.pinned[1])?;
        writeln!(
            out,
            "  Speedup:      {:.2}x H2D, {:.2}x D2H",
            r.pinned[0] / r.pageable[0],
            r.pinned[1] / r.pageable[1]
        )?;
        writeln!(out, "[Staged pageable (cuvmm)]")?;
        writeln!(out, "  Transfer BW:  {:.1} GB/s H2D, {:.1} GB/s D2H", r.staged[0], r.staged[1])?;
    }
    Ok(())
}

/// The sharing benchmark's report: cuvmm's steps beside the raw ones, and the ratio.
pub(super) fn print_ipc(
    out: &mut impl Write,
    name: &str,
    size: usize,
    r: &ipc::IpcSummary,
    json: bool,
) -> CliResult {
    if json {
        let path = |p: &ipc::PathStats| {
            let steps = |v: &[f64; 6]| {
                let m: serde_json::Map<String, serde_json::Value> =
                    ipc::STEPS.iter().zip(v).map(|(k, x)| (k.to_string(), json!(x))).collect();
                serde_json::Value::Object(m)
            };
            json!({"warm_us": steps(&p.warm_us), "warm_n": p.warm_n, "first_us": steps(&p.first_us), "first_n": p.first_n})
        };
        writeln!(
            out,
            "{}",
            json!({"bench": "ipc", "device": name, "size": size, "processes": r.children,
                   "cuvmm": path(&r.cuvmm), "raw": path(&r.raw),
                   "ratio_export_to_mapped": r.ratio(),
                   "ratio_first_export_to_mapped": (r.cuvmm.first_n > 0 && r.raw.first_n > 0).then(|| r.first_ratio()),
                   "imported_gbs": r.imported_gbs, "local_gbs": r.local_gbs,
                   "legacy_open_us": r.legacy_open_us, "legacy_gbs": r.legacy_gbs})
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "{} shared with {} child processes on {name}: median µs over {} exchanges per path \
         (raw = cuMemExportToShareableHandle, sendmsg, recvmsg, cuMemImportFromShareableHandle, \
         cuMemAddressReserve, cuMemMap, cuMemSetAccess, same run)",
        show(size),
        r.children,
        r.cuvmm.warm_n.min(r.raw.warm_n)
    )?;
    writeln!(out, "{:<24} {:>10} {:>10} {:>8}", "step", "cuvmm", "raw", "ratio")?;
    for (i, step) in ipc::STEPS.iter().enumerate() {
        let (c, w) = (r.cuvmm.warm_us[i], r.raw.warm_us[i]);
        writeln!(out, "{step:<24} {c:>10.1} {w:>10.1} {:>7.3}x", c / w)?;
    }
    if r.cuvmm.first_n > 0 && r.raw.first_n > 0 {
        writeln!(
            out,
            "export → mapped, first exchange of a fresh importer ({} / {} processes): cuvmm {:.1} µs, raw {:.1} µs, {:.3}x",
            r.cuvmm.first_n,
            r.raw.first_n,
            r.cuvmm.first_us[5],
            r.raw.first_us[5],
            r.first_ratio()
        )?;
    } else {
        // The importer processes take turns starting on either path: one alone gives one path no
        // first exchange to compare.
        writeln!(out, "first exchange of a fresh importer: needs --processes 2 or more to compare")?;
    }
    writeln!(
        out,
        "export → mapped and accessible: cuvmm / raw = {:.3}x (goal ≤ 1.05x: {})",
        r.ratio(),
        if r.ratio() <= 1.05 { "met" } else { "not met" }
    )?;
    writeln!(out, "legacy cuIpcOpenMemHandle {:.1} µs", r.legacy_open_us)?;
    writeln!(
        out,
        "importer D2D bandwidth: imported {:.0} GB/s, local {:.0} GB/s ({:.3}x), legacy-opened {:.0} GB/s",
        r.imported_gbs,
        r.local_gbs,
        r.imported_gbs / r.local_gbs,
        r.legacy_gbs
    )?;
    Ok(())
}

/// The staged path's sweep: GB/s per ring shape and size, the references, the best shapes.
pub(super) fn print_sweep(
    out: &mut impl Write,
    name: &str,
    rows: &[bandwidth::SweepRow],
    refs: &[bandwidth::SweepReference],
    reps: usize,
    idle_ms: u64,
    json: bool,
) -> CliResult {
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    if json {
        for r in rows {
            let c = r.config;
            writeln!(
                out,
                "{}",
                json!({"bench": "bandwidth-sweep", "device": name, "idle_ms": idle_ms, "size": r.size, "chunk": c.chunk, "piece": c.piece,
                       "slots": c.slots, "threads": c.threads, "staged_h2d": r.staged[0], "staged_d2h": r.staged[1]})
            )?;
        }
        for f in refs {
            let memcpy: Vec<_> =
                f.memcpy.iter().map(|(t, m)| json!({"threads": t, "h2d": m[0], "d2h": m[1]})).collect();
            let read: Vec<_> = f.read.iter().map(|(t, r)| json!({"threads": t, "gbps": r})).collect();
            writeln!(
                out,
                "{}",
                json!({"bench": "bandwidth-sweep", "idle_ms": idle_ms, "size": f.size, "pinned_h2d": f.pinned[0],
                       "pinned_d2h": f.pinned[1], "pinned_host_clock_h2d": f.pinned_host[0],
                       "pinned_host_clock_d2h": f.pinned_host[1], "memcpy": memcpy, "read_source": read})
            )?;
        }
        return Ok(());
    }
    writeln!(out, "staged pageable GB/s on {name}, H2D / D2H, median of {reps} (host clock, to completion)")?;
    if idle_ms > 0 {
        writeln!(
            out,
            "every timed transfer, staged and references alike, after the host slept {idle_ms} ms"
        )?;
    }
    write!(out, "{:>9} {:>9} {:>6} {:>8}", "chunk", "piece", "slots", "threads")?;
    for &s in &sizes {
        write!(out, " {:>15}", show(s))?;
    }
    writeln!(out)?;
    let mut shapes: Vec<cuvmm::host::StagingConfig> = Vec::new();
    for r in rows {
        if !shapes.contains(&r.config) {
            shapes.push(r.config);
        }
    }
    for c in &shapes {
        write!(out, "{:>9} {:>9} {:>6} {:>8}", show(c.chunk), show(c.piece), c.slots, c.threads)?;
        for &s in &sizes {
            match rows.iter().find(|r| r.config == *c && r.size == s) {
                Some(r) => write!(out, " {:>7.1} /{:>6.1}", r.staged[0], r.staged[1])?,
                None => write!(out, " {:>15}", "-")?,
            }
        }
        writeln!(out)?;
    }
    writeln!(out, "references, same run (H2D / D2H): pinned DMA (raw cuMemcpy*Async, device events, and on the host clock from the call to completion as the staged path is timed); host memcpy pageable → pinned / pinned → pageable in the default ring's pieces, taken in turn; reading the source alone (host to device cannot be faster on as many threads)")?;
    for f in refs {
        write!(
            out,
            "{:>9}  pinned {:>5.1} /{:>5.1} (host clock {:>5.1} /{:>5.1})",
            show(f.size),
            f.pinned[0],
            f.pinned[1],
            f.pinned_host[0],
            f.pinned_host[1]
        )?;
        for (t, m) in &f.memcpy {
            write!(out, "   memcpy {t} threads {:>5.1} /{:>5.1}", m[0], m[1])?;
        }
        writeln!(out)?;
        write!(out, "{:>9}  reading the pageable source alone:", "")?;
        for (t, r) in &f.read {
            write!(out, "   {t} threads {r:>5.1}")?;
        }
        writeln!(out)?;
    }
    // The shape whose slower direction at its slowest size ≥ 64 MiB (or at all sizes) is fastest.
    let judged: Vec<usize> = if sizes.iter().any(|&s| s >= 64 << 20) {
        sizes.iter().copied().filter(|&s| s >= 64 << 20).collect()
    } else {
        sizes.clone()
    };
    let floor = |c: &cuvmm::host::StagingConfig| {
        rows.iter()
            .filter(|r| r.config == *c && judged.contains(&r.size))
            .map(|r| r.staged[0].min(r.staged[1]))
            .fold(f64::INFINITY, f64::min)
    };
    if let Some(best) = shapes.iter().max_by(|a, b| floor(a).total_cmp(&floor(b))) {
        let f = floor(best);
        writeln!(
            out,
            "best shape: {} chunks, {} pieces, {} slots, {} threads: at least {f:.1} GB/s both ways at {} (goal ≥ 39: {})",
            show(best.chunk),
            show(best.piece),
            best.slots,
            best.threads,
            judged.iter().map(|&s| show(s)).collect::<Vec<_>>().join(", "),
            if f >= 39.0 { "met" } else { "not met" }
        )?;
    }
    Ok(())
}

/// The overlap experiment's text table.
pub(super) fn print_overlap(
    out: &mut impl Write,
    r: &overlap::OverlapReport,
    name: &str,
) -> std::io::Result<()> {
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

/// The trace replay's report.
pub(super) fn print_trace(
    out: &mut impl Write,
    name: &str,
    path: Option<&std::path::Path>,
    t: &trace::Trace,
    r: &trace::TraceReport,
    json: bool,
) -> CliResult {
    let source = match path {
        Some(p) => format!("file {}", p.display()),
        None => trace::SYNTHETIC.to_string(),
    };
    let threshold = "release threshold of the default pool raised to u64::MAX for the run, restored after";
    if json {
        writeln!(
            out,
            "{}",
            json!({"bench": "trace", "device": name, "source": if path.is_some() { "file" } else { "synthetic" },
                   "path": path.map(|p| p.display().to_string()), "trace_device": t.device, "ops": t.ops.len(),
                   "allocations": t.allocations, "frees": t.frees, "freed_at_end": t.unfreed,
                   "null_allocations_skipped": t.null_allocations, "other_device_records_skipped": t.other_devices,
                   "streams": t.streams.len(), "peak_live": r.peak_live, "peak_op_index": r.peak_op, "reps": r.reps,
                   "interleaved": r.interleaved, "free_at_start": r.free_at_start, "timer_ns": r.timer_ns,
                   "pool_release_threshold": threshold})
        )?;
        for row in &r.rows {
            let line = match &row.outcome {
                trace::Outcome::Measured(m) => {
                    let vs = r.vs_cuvmm(row);
                    json!({"bench": "trace", "allocator": row.key, "alloc_median_ns": m.alloc_median_ns,
                           "alloc_p99_ns": m.alloc_p99_ns, "free_median_ns": m.free_median_ns,
                           "free_p99_ns": m.free_p99_ns, "total_ms": m.total_ms, "peak_physical": m.peak_physical,
                           "peak_physical_is": row.physical, "physical_over_live": m.peak_physical as f64 / r.peak_live as f64,
                           "pages_moved_per_pass": m.pages_moved,
                           "alloc_median_vs_cuvmm": vs.map(|v| v.0), "free_median_vs_cuvmm": vs.map(|v| v.1)})
                }
                trace::Outcome::Unsupported(why) => {
                    json!({"bench": "trace", "allocator": row.key, "unsupported": why})
                }
                trace::Outcome::Failed(why) => json!({"bench": "trace", "allocator": row.key, "failed": why}),
            };
            writeln!(out, "{line}")?;
        }
        for p in &r.pair_rows {
            let fig = |v: &Result<f64, String>| match v {
                Ok(ns) => json!(ns),
                Err(why) => json!({"error": why}),
            };
            writeln!(
                out,
                "{}",
                json!({"bench": "trace", "pair_size": p.size, "pairs": r.pairs, "batches": trace::PAIR_BATCHES,
                       "cuvmm_ns": fig(&p.cuvmm_ns), "pool_ns": fig(&p.pool_ns), "goal_ns": trace::PAIR_GOAL_NS})
            )?;
        }
        if let Some(q) = &r.capture_query_ns {
            let v = match q {
                Ok(ns) => json!(ns),
                Err(why) => json!({"error": why}),
            };
            writeln!(out, "{}", json!({"bench": "trace", "capture_query_ns": v}))?;
        }
        return Ok(());
    }

    writeln!(out, "trace: {source}")?;
    writeln!(
        out,
        "  device {} records: {} allocations, {} frees, {} never freed (freed at the end); {} null allocations \
         and {} records of other devices skipped; {} streams",
        t.device,
        t.allocations,
        t.frees,
        t.unfreed,
        t.null_allocations,
        t.other_devices,
        t.streams.len()
    )?;
    writeln!(
        out,
        "  peak live {} (sizes asked for, alive at once), reached at op {} of {}",
        show(r.peak_live as usize),
        r.peak_op + 1,
        t.ops.len()
    )?;
    writeln!(
        out,
        "replayed on {name}, one stream per trace stream, no kernels: 1 warm-up pass, then {} measured passes per allocator{}",
        r.reps,
        if r.interleaved { ", taking turns pass by pass" } else { "" }
    )?;
    if !r.interleaved {
        writeln!(
            out,
            "  each allocator ran alone and gave its cache back before the next: 4x the peak live is more than the {} free at the start",
            show(r.free_at_start as usize)
        )?;
    }
    writeln!(out, "  cuMemAllocAsync: {threshold}, so that it caches like the others")?;
    writeln!(
        out,
        "  host time around each call; the clock's own {:.0} ns is part of every per-call figure",
        r.timer_ns
    )?;
    writeln!(
        out,
        "{:<22} {:>11} {:>11} {:>11} {:>11} {:>10} {:>13} {:>7} {:>11} {:>10}",
        "allocator",
        "alloc ns",
        "alloc p99",
        "free ns",
        "free p99",
        "replay ms",
        "peak physical",
        "/ live",
        "alloc/cuvmm",
        "free/cuvmm"
    )?;
    for row in &r.rows {
        match &row.outcome {
            trace::Outcome::Measured(m) => {
                let (va, vf) = match r.vs_cuvmm(row) {
                    Some((a, f)) => (format!("{a:.2}x"), format!("{f:.2}x")),
                    None => ("-".into(), "-".into()),
                };
                writeln!(
                    out,
                    "{:<22} {:>11.0} {:>11.0} {:>11.0} {:>11.0} {:>10.2} {:>13} {:>7.3} {:>11} {:>10}",
                    row.name,
                    m.alloc_median_ns,
                    m.alloc_p99_ns,
                    m.free_median_ns,
                    m.free_p99_ns,
                    m.total_ms,
                    show(m.peak_physical as usize),
                    m.peak_physical as f64 / r.peak_live as f64,
                    va,
                    vf
                )?;
            }
            trace::Outcome::Unsupported(why) => writeln!(out, "{:<22} unsupported: {why}", row.name)?,
            trace::Outcome::Failed(why) => writeln!(out, "{:<22} failed: {why}", row.name)?,
        }
    }
    writeln!(out, "ns are medians and 99th percentiles over every call of the measured passes; replay ms the median pass")?;
    writeln!(out, "peak physical, the most over the measured passes:")?;
    for row in &r.rows {
        writeln!(out, "  {:<22} {}", row.name, row.physical)?;
    }
    for row in &r.rows {
        if let trace::Outcome::Measured(trace::Measured { pages_moved: Some(n), .. }) = &row.outcome {
            writeln!(
                out,
                "{}: {n} pages moved per measured pass (median), each a few driver calls on the calling thread",
                row.name
            )?;
        }
    }
    if r.pair_rows.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "\nns per cached allocate+free pair of one size on one stream (median of {} batches of {}; cuvmm's goal ≤ {:.0} ns)",
        trace::PAIR_BATCHES,
        r.pairs,
        trace::PAIR_GOAL_NS
    )?;
    writeln!(
        out,
        "{:>9} {:>10} {:>6} {:>16} {:>12}",
        "size", "cuvmm", "goal", "cuMemAllocAsync", "pool/cuvmm"
    )?;
    let mut notes = Vec::new();
    for p in &r.pair_rows {
        let fig = |v: &Result<f64, String>, notes: &mut Vec<String>| match v {
            Ok(ns) => format!("{ns:.1}"),
            Err(why) => {
                notes.push(why.clone());
                format!("[{}]", notes.len())
            }
        };
        let goal = match p.cuvmm_ns {
            Ok(ns) if ns <= trace::PAIR_GOAL_NS => "met",
            Ok(_) => "missed",
            Err(_) => "-",
        };
        let ratio = match (&p.cuvmm_ns, &p.pool_ns) {
            (Ok(c), Ok(q)) => format!("{:.2}x", q / c),
            _ => "-".into(),
        };
        let (c, q) = (fig(&p.cuvmm_ns, &mut notes), fig(&p.pool_ns, &mut notes));
        writeln!(out, "{:>9} {c:>10} {goal:>6} {q:>16} {ratio:>12}", show(p.size))?;
    }
    for (i, why) in notes.iter().enumerate() {
        writeln!(out, "  [{}] {why}", i + 1)?;
    }
    match &r.capture_query_ns {
        Some(Ok(ns)) => writeln!(
            out,
            "cuStreamIsCapturing alone, the capture check cuvmm makes on each allocation: {ns:.1} ns"
        )?,
        Some(Err(why)) => writeln!(out, "cuStreamIsCapturing alone: {why}")?,
        None => {}
    }
    Ok(())
}

const SLEEP_CYCLE_HEADER: &str = "| cycle | sleep ms | D2H bound ms | ratio | wake ms | H2D bound ms | ratio | H2D after frees ms | ratio | discard ms | RSS MiB before / asleep / woken / settled | pinned MiB before / asleep / woken / settled | mismatches | disk: plain write ms (sleep GB/s vs write GB/s) |";

fn print_sleep_cycle(out: &mut impl Write, c: &sleep::Cycle, bytes: usize) -> std::io::Result<()> {
    let mib = |v: [u64; 4]| v.map(|b| format!("{:.0}", b as f64 / (1u64 << 20) as f64)).join(" / ");
    let gbs = |ms: f64| bytes as f64 / ms / 1e6;
    let disk = c
        .plain_write_ms
        .map_or(String::new(), |w| format!("{w:.1} ({:.2} vs {:.2})", gbs(c.offload_ms), gbs(w)));
    let place = match (c.in_child, c.first_in_process) {
        (true, _) => " (fresh child)",
        (false, true) => " (first in process)",
        _ => "",
    };
    writeln!(
        out,
        "| {}{place} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} | {:.3} | {:.1} | {:.3} | {:.2} | {} | {} | {} | {disk} |",
        c.index,
        c.offload_ms,
        c.d2h_bound_ms,
        c.offload_ratio(),
        c.wake_ms,
        c.h2d_bound_ms,
        c.wake_ratio(),
        c.h2d_after_frees_ms,
        c.wake_ratio_after_frees(),
        c.discard_ms,
        mib(c.rss),
        mib(c.pinned),
        c.mismatches,
    )
}

/// Runs the first cycle of `bench sleep` in a child process (a fresh process's first sleep) and
/// reads its cycle back.
fn sleep_in_child(
    size: usize,
    block: usize,
    devices: &[usize],
    backup: &str,
    dir: Option<&std::path::Path>,
    retain: bool,
    gap_ms: u64,
) -> Result<Vec<sleep::Cycle>, Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let mut cmd = std::process::Command::new(exe);
    let devs: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
    cmd.args([
        "bench",
        "sleep",
        "--first-only",
        "--json",
        "--size",
        &size.to_string(),
        "--block",
        &block.to_string(),
    ])
    .args(["--devices", &devs.join(","), "--backup", backup, "--gap-ms", &gap_ms.to_string()]);
    if let Some(d) = dir {
        cmd.arg("--dir").arg(d);
    }
    if retain {
        cmd.arg("--retain");
    }
    let o = cmd.stderr(std::process::Stdio::inherit()).output()?;
    if !o.status.success() {
        return Err(crate::bench::invalid(format!("the fresh child failed: {}", o.status)).into());
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let cycles: Vec<sleep::Cycle> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("cycle").and_then(sleep::Cycle::from_json))
        .collect();
    if cycles.is_empty() {
        return Err(crate::bench::invalid("the fresh child reported no cycle").into());
    }
    Ok(cycles)
}

/// Each goal of sleep and wake, judged cycle by cycle against the bounds of the same cycle.
fn sleep_goals(r: &sleep::SleepReport) -> Vec<(String, serde_json::Value)> {
    let first: Vec<&sleep::Cycle> = r.cycles.iter().filter(|c| c.first_in_process).collect();
    let later: Vec<&sleep::Cycle> = r.cycles.iter().filter(|c| !c.first_in_process).collect();
    vec![
        (
            "first sleep of a process <= 1.3x its D2H bound".into(),
            first.iter().all(|c| c.offload_ratio() <= 1.3).into(),
        ),
        (
            "every later sleep <= 1.05x its D2H bound".into(),
            later.iter().all(|c| c.offload_ratio() <= 1.05).into(),
        ),
        (
            "every wake <= 1.05x the H2D bound after the same frees".into(),
            r.cycles.iter().all(|c| c.wake_ratio_after_frees() <= 1.05).into(),
        ),
        ("every discarding sleep <= 25 ms".into(), r.cycles.iter().all(|c| c.discard_ms <= 25.0).into()),
    ]
}

fn print_sleep_summary(
    out: &mut impl Write,
    r: &sleep::SleepReport,
    names: &[String],
    block: usize,
    reps: usize,
    json: bool,
) -> CliResult {
    if json {
        let line = json!({"bench": "sleep", "bytes": r.bytes, "devices": r.devices, "d2h_bound_ms": r.d2h_bound_ms,
                "h2d_bound_ms": r.h2d_bound_ms, "first_offload_ms": r.first_offload_ms,
                "offload_ms": r.offload_ms, "offload_ratio": r.offload_ratio(), "wake_ms": r.wake_ms,
                "wake_ratio": r.wake_ratio(), "h2d_after_frees_ms": r.h2d_after_frees_ms,
                "wake_ratio_after_frees": r.wake_ratio_after_frees(), "discard_ms": r.discard_ms, "discard_wake_ms": r.discard_wake_ms,
                "freed_ratio": r.freed_ratio, "mismatches": r.mismatches,
                "goals": sleep_goals(r).into_iter().collect::<serde_json::Map<String, serde_json::Value>>(),
                "fastest_slowest_ms": {"offload": r.spread.0[0], "d2h_bound": r.spread.0[1],
                    "wake": r.spread.0[2], "h2d_bound": r.spread.0[3]}});
        writeln!(out, "{line}")?;
    } else {
        let gbs = |ms: f64| r.bytes as f64 / ms / 1e6;
        writeln!(
                out,
                "{}: sleep and wake of {} tagged in {} blocks, {} cycles after the first; medians of the cycles after each process's first",
                names.join(", "),
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
            r.offload_ms,
            off.0,
            off.1,
            gbs(r.offload_ms),
            r.d2h_bound_ms,
            d2h.0,
            d2h.1,
            r.offload_ratio()
        )?;
        writeln!(
            out,
            "| wake, restore | {:.1} | {:.1}-{:.1} | {:.1} | {:.1} (pinned H2D) | {:.1}-{:.1} | {:.3} |",
            r.wake_ms,
            wake.0,
            wake.1,
            gbs(r.wake_ms),
            r.h2d_bound_ms,
            h2d.0,
            h2d.1,
            r.wake_ratio()
        )?;
        writeln!(
                out,
                "| wake, restore, against the bound after the same frees | {:.1} | | | {:.1} (pinned H2D right after releasing {}) | | {:.3} |",
                r.wake_ms,
                r.h2d_after_frees_ms,
                show(r.bytes),
                r.wake_ratio_after_frees()
            )?;
        writeln!(out, "| sleep, discard | {:.2} | | | | | |", r.discard_ms)?;
        writeln!(out, "| wake after discard | {:.2} | | | | | |", r.discard_wake_ms)?;
        writeln!(
            out,
            "driver free memory gained by a sleep: {:.3} of the tagged bytes (lowest of the runs)",
            r.freed_ratio
        )?;
        for c in r.cycles.iter().filter(|c| c.first_in_process) {
            writeln!(
                out,
                "first sleep of {} (cycle {}): {:.1} ms, {:.3}x its cycle's D2H bound",
                if c.in_child { "a fresh child process" } else { "this process" },
                c.index,
                c.offload_ms,
                c.offload_ratio()
            )?;
        }
        writeln!(out, "elements changed across sleep and wake: {}", r.mismatches)?;
        for (goal, met) in sleep_goals(r) {
            writeln!(out, "goal: {goal}: {}", if met == true { "met" } else { "NOT met" })?;
        }
    }
    if r.mismatches > 0 {
        return Err(crate::bench::invalid(format!(
            "{} elements changed across sleep and wake: the wakes did not restore what was written",
            r.mismatches
        ))
        .into());
    }
    Ok(())
}
