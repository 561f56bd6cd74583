//! Argument parsing and dispatch.

pub mod bench;
pub mod info;
pub mod plot;
pub mod tour;

use crate::common::CliResult;

use clap::{Parser, Subcommand};

/// Safe, fast CUDA virtual memory management: reports and benchmarks. With no command, runs the
/// tour of what cuvmm does on the first GPU.
#[derive(Parser, Debug)]
#[command(name = "cuvmm", version, about)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The tour (the default): capability report, a growing VmmVec, sharing with a child process,
    /// bandwidth, overlap; pictures written to a folder.
    Tour {
        /// Where the pictures go (cuvmm-tour in the system's temporary folder unless given).
        #[arg(long, default_value_os_t = default_tour_dir())]
        out: std::path::PathBuf,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// The tour's child process (started by the tour itself).
    #[command(hide = true)]
    TourChild {
        /// The socket to connect to.
        socket: std::path::PathBuf,
    },
    /// Print what the driver and each device support.
    Info {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Cycles of VmmVec create/grow/shrink/drop and export/import; checks memory and fds return.
    Soak {
        /// Cycles.
        #[arg(long, default_value_t = 10_000)]
        cycles: usize,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// Run a benchmark.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Write an allocation trace's events in the compact form the allocator's model tests replay
    /// (src/alloc/ordered/core/testdata, whose README gives the commands that made its files).
    TraceEvents {
        /// The trace (as libcuvmm.so writes with CUVMM_ALLOC_CONF=trace=PATH); without one, the
        /// synthetic trace of `cuvmm bench trace`.
        trace: Option<std::path::PathBuf>,
        /// Where the events go.
        #[arg(long)]
        out: std::path::PathBuf,
        /// Only the trace's first this many records (null allocations count, then are left out).
        #[arg(long)]
        records: Option<usize>,
        /// Each event's stream too (at most three streams).
        #[arg(long)]
        streams: bool,
        /// The device whose records are taken.
        #[arg(long, default_value_t = 0)]
        device: i32,
    },
}

/// Runs the chosen subcommand.
/// Where the tour writes its pictures unless told: the system's temporary folder, so running it
/// leaves nothing behind in the current directory.
fn default_tour_dir() -> std::path::PathBuf {
    std::env::temp_dir().join("cuvmm-tour")
}

pub fn run(args: Args) -> CliResult {
    match args.command.unwrap_or(Command::Tour { out: default_tour_dir(), device: 0 }) {
        Command::Tour { out, device } => tour::run(&out, device),
        Command::TourChild { socket } => tour::child(&socket),
        Command::Info { json } => info::run(json),
        Command::Bench(b) => bench::run(b),
        Command::Soak { cycles, device } => soak(cycles, device),
        Command::TraceEvents { trace, out, records, streams, device } => {
            trace_events(trace.as_deref(), &out, records, streams, device)
        }
    }
}

fn trace_events(
    trace: Option<&std::path::Path>,
    out: &std::path::Path,
    records: Option<usize>,
    streams: bool,
    device: i32,
) -> CliResult {
    use crate::bench::{model_trace, trace as tr};
    let text = match trace {
        Some(p) => std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?,
        None => tr::synthetic_text(),
    };
    let t = tr::parse(model_trace::first_records(&text, records).as_bytes(), device)?;
    let form = if streams { model_trace::Form::Streams } else { model_trace::Form::Sizes };
    let bytes = model_trace::encode(&t, form)?;
    std::fs::write(out, &bytes).map_err(|e| format!("{}: {e}", out.display()))?;
    println!(
        "{}: {} events ({} allocations, {} frees, {} never freed, {} null allocations left out), {} bytes",
        out.display(),
        t.allocations + t.frees,
        t.allocations,
        t.frees,
        t.unfreed,
        t.null_allocations,
        bytes.len()
    );
    Ok(())
}

fn soak(cycles: usize, device: usize) -> CliResult {
    use std::io::Write;
    let ctx = cuvmm::Context::for_ordinal(device)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{:>8} {:>18} {:>10}", "cycles", "memory delta MiB", "fd delta")?;
    let t = std::time::Instant::now();
    let samples = crate::bench::soak::run(&ctx, cycles, 1000, |s| {
        let _ = writeln!(
            out,
            "{:>8} {:>18.2} {:>10}",
            s.cycles,
            s.memory_delta as f64 / (1 << 20) as f64,
            s.fd_delta
        );
    })?;
    let last = samples.last().ok_or("no cycles")?;
    let ok = last.memory_delta.unsigned_abs() <= 2 << 20 && last.fd_delta == 0;
    println!(
        "{cycles} cycles in {:.1} s; memory back within 2 MiB and fds back to baseline: {}",
        t.elapsed().as_secs_f64(),
        if ok { "yes" } else { "NO" }
    );
    if !ok {
        return Err("resources did not return to their baseline".into());
    }
    Ok(())
}
