//! The same transfer from pageable memory (a plain `Vec`), pinned memory, registered
//! memory and cuvmm's staged pageable path, measured. Run:
//! `cargo run --release --example pinned_vs_pageable [-- MiB]`.

#[path = "../../examples/common/mod.rs"]
mod common;

use cuvmm::host::Staging;
use cuvmm::Context;
use cuvmm_cli::bench::bandwidth;

fn run() -> cuvmm::Result<()> {
    let mib: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(256);
    let ctx = Context::for_ordinal(0)?;
    let mut staging = Staging::with_defaults(&ctx)?;
    let r = &bandwidth::run(&ctx, &[mib << 20], 5, &mut staging)?[0];
    println!("{mib} MiB on {}, GB/s (host→device / device→host):", ctx.device().name()?);
    println!("  pageable Vec, driver copy   {:>6.1} / {:>6.1}", r.pageable[0], r.pageable[1]);
    println!("  pinned (cuMemHostAlloc)     {:>6.1} / {:>6.1}", r.pinned[0], r.pinned[1]);
    println!(
        "  registered Vec              {:>6.1} / {:>6.1}  (registering + unregistering: {:.0} µs)",
        r.registered[0], r.registered[1], r.register_us
    );
    println!(
        "  staged pageable (cuvmm)     {:>6.1} / {:>6.1}  ({} threads)",
        r.staged[0],
        r.staged[1],
        staging.threads()
    );
    println!(
        "  pinned over pageable        {:>6.2}x / {:>5.2}x",
        r.pinned[0] / r.pageable[0],
        r.pinned[1] / r.pageable[1]
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("pinned_vs_pageable", run())
}
