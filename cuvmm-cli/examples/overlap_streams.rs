//! Overlapping copies and kernels with several streams; writes the fastest schedule's
//! timeline to `overlap.svg` (or the path given). Run:
//! `cargo run --release --example overlap_streams [-- FILE.svg]`.

#[path = "../../examples/common/mod.rs"]
mod common;

use cuvmm::Context;
use cuvmm_cli::bench::overlap::{self, OverlapConfig};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).unwrap_or_else(|| "overlap.svg".into());
    let ctx = Context::for_ordinal(0)?;
    let r = overlap::run(&ctx, OverlapConfig::default())?;
    println!(
        "stages alone: H2D {:.2} ms, kernel {:.2} ms ({} FMAs/element), D2H {:.2} ms",
        r.stages_ms[0], r.stages_ms[1], r.iters, r.stages_ms[2]
    );
    for s in &r.schedules {
        println!(
            "{:<14} {:>8.2} ms  ({:.2}x the longest stage)",
            s.name,
            s.total_ms,
            s.total_ms / r.longest_stage()
        );
    }
    let title = format!("{} floats on {}", r.config.n, ctx.device().name()?);
    std::fs::write(&path, overlap::svg(r.fastest(), &title))?;
    println!("timeline of '{}' written to {path}", r.fastest().name);
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("overlap_streams", run())
}
