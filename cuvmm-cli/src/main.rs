//! `cuvmm`: the command-line tool. `cuvmm info` prints the capability report.

use cuvmm_cli::cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = cli::Args::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, no backtrace: the error already says what failed and why.
            eprintln!("cuvmm: {e}");
            ExitCode::FAILURE
        }
    }
}
