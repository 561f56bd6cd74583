//! `cuvmm bench …`.

use super::size::{parse_size, parse_sizes, show};
use super::CliResult;
use clap::Subcommand;
use cuvmm::bench::{grow, vmm_ops};
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
            if json {
                for (which, run) in [("vmmvec", &r.vmm), ("copy_doubling", &r.copy)] {
                    writeln!(
                        out,
                        "{}",
                        json!({"bench": "grow", "device": name, "strategy": which, "step": step, "target": target,
                               "reps": reps, "steps": run.steps, "total_s": run.total_s, "worst_step_s": run.worst_step_s, "worst_later_step_s": run.worst_later_step_s,
                               "median_step_s": run.median_step_s, "slowest_steps": run.slowest, "peak_bytes": run.peak_bytes})
                    )?;
                }
                writeln!(
                    out,
                    "{}",
                    json!({"bench": "grow", "ratio_total": r.total_ratio(), "ratio_worst_step": r.worst_ratio(),
                           "ratio_peak": r.peak_ratio(), "max_chunk": max_chunk, "growth_percent": growth_percent})
                )?;
            } else {
                writeln!(
                    out,
                    "grow to {} in {} steps on {name} (median of {reps} runs; worst step over all runs)",
                    show(target),
                    show(step)
                )?;
                writeln!(
                    out,
                    "{:<16} {:>10} {:>14} {:>17} {:>15} {:>12}  slowest steps (step #: ms)",
                    "strategy",
                    "total ms",
                    "worst step ms",
                    "worst after 1st",
                    "median step ms",
                    "peak in use"
                )?;
                for (which, run) in [("VmmVec", &r.vmm), ("copy-doubling", &r.copy)] {
                    let slow: Vec<String> =
                        run.slowest.iter().map(|(i, s)| format!("{i}: {:.2}", s * 1e3)).collect();
                    writeln!(
                        out,
                        "{which:<16} {:>10.2} {:>14.3} {:>17.3} {:>15.3} {:>12}  {}",
                        run.total_s * 1e3,
                        run.worst_step_s * 1e3,
                        run.worst_later_step_s * 1e3,
                        run.median_step_s * 1e3,
                        show(run.peak_bytes),
                        slow.join(", ")
                    )?;
                }
                writeln!(
                    out,
                    "VmmVec / copy-doubling: total {:.3}x, worst step {:.3}x, peak {:.3}x (chunks up to {}, +{}%)",
                    r.total_ratio(),
                    r.worst_ratio(),
                    r.peak_ratio(),
                    show(max_chunk),
                    growth_percent
                )?;
            }
        }
        Bench::VmmOps { sizes, reps, device, json } => {
            let ctx = Context::for_ordinal(device)?;
            let rows = vmm_ops::run(&ctx, &sizes, reps)?;
            if json {
                for r in &rows {
                    for (i, op) in vmm_ops::OPS.iter().enumerate() {
                        writeln!(
                            out,
                            "{}",
                            json!({"bench": "vmm-ops", "size": r.size, "op": op, "reps": r.reps,
                                   "raw_us": r.raw_us[i], "cuvmm_us": r.crate_us[i], "overhead": r.overhead()[i]})
                        )?;
                    }
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
            }
        }
    }
    Ok(())
}
