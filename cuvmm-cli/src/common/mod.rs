//! What the benchmarks and the command line both use, kept below both so that neither imports the
//! other for it.

pub mod size;

/// A CLI failure: a library error or an output error, printed as one line.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;
