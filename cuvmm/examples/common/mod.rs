//! What the examples share: an error ends the program with one line on stderr and a failure
//! status, as with the `cuvmm` tool, instead of a `Debug` dump.

use std::process::ExitCode;

/// Prints `name: error` for an error and turns the outcome into an exit status.
pub fn report<E: std::fmt::Display>(name: &str, outcome: Result<(), E>) -> ExitCode {
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
    }
}
