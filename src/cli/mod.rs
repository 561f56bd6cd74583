//! Argument parsing and dispatch.

mod bench;
mod info;
mod size;

use clap::{Parser, Subcommand};

/// Safe, fast CUDA virtual memory management: reports and benchmarks.
#[derive(Parser, Debug)]
#[command(name = "cuvmm", version, about)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print what the driver and each device support.
    Info {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run a benchmark.
    #[command(subcommand)]
    Bench(bench::Bench),
}

/// A CLI failure: a library error or an output error, printed as one line.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;

/// Runs the chosen subcommand.
pub fn run(args: Args) -> CliResult {
    match args.command {
        Command::Info { json } => info::run(json),
        Command::Bench(b) => bench::run(b),
    }
}
