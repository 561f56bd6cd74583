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

/// The outcome of one side of a two-process example.
#[allow(dead_code)] // used by the two-process examples only; each example compiles this module
pub type Side = Result<(), Box<dyn std::error::Error>>;

/// Runs a two-process example from its arguments: `export PATH` or `import PATH` runs one side
/// at the Unix socket `PATH` (by default `socket` in the temporary folder); no arguments run the
/// exporter, which starts this program again as the importer.
#[allow(dead_code)] // as above
pub fn two_sides(socket: &str, export: fn(&str, bool) -> Side, import: fn(&str) -> Side) -> Side {
    let args: Vec<String> = std::env::args().collect();
    let default_path = std::env::temp_dir().join(socket).to_string_lossy().into_owned();
    match args.get(1).map(String::as_str) {
        Some("export") => export(args.get(2).unwrap_or(&default_path), false),
        Some("import") => import(args.get(2).unwrap_or(&default_path)),
        _ => export(&default_path, true),
    }
}
