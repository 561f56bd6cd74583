//! The `cuvmm` command-line tool's workloads, as a library for its binary and examples: the
//! benchmarks behind `cuvmm bench …`, the soak test and the tour. Not meant as a dependency: the
//! `cuvmm` crate is the library.

pub mod bench;
pub mod cli;
pub mod common;
