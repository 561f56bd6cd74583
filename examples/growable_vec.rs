//! Grows a `VmmVec` in steps, then shrinks it, printing length, capacity and mapped bytes.
//! Run: `cargo run --release --example growable_vec [-- STEPS]`.

mod common;

use cuvmm::{Context, VmmVec};
use std::time::Instant;

fn run() -> cuvmm::Result<()> {
    let steps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(16);
    let ctx = Context::for_ordinal(0)?;
    let mut v = VmmVec::<f32>::new(&ctx)?;
    let base = v.device_ptr();
    println!("reserved {} MiB of address space at {base:#x}", v.raw().reserved() >> 20);
    println!("{:>12} {:>12} {:>12} {:>8} {:>10}", "len", "capacity", "mapped MiB", "chunks", "step µs");
    let step = 8 << 20; // 8 Mi floats = 32 MiB a step
    for i in 0..steps {
        let t = Instant::now();
        v.resize(v.len() + step, i as f32)?;
        let us = t.elapsed().as_secs_f64() * 1e6;
        println!(
            "{:>12} {:>12} {:>12} {:>8} {:>10.0}",
            v.len(),
            v.capacity(),
            v.mapped_bytes() >> 20,
            v.raw().chunk_count(),
            us
        );
        assert_eq!(v.device_ptr(), base, "growth never moves the data");
    }
    for i in 0..steps {
        assert_eq!(v.get(i * step)?, Some(i as f32));
    }
    v.truncate(step);
    v.shrink_to_fit()?;
    println!(
        "after truncate({step}) and shrink_to_fit: len {}, capacity {}, mapped {} MiB",
        v.len(),
        v.capacity(),
        v.mapped_bytes() >> 20
    );
    let free = ctx.memory_info()?.free;
    drop(v);
    println!("dropped: {} MiB returned to the device", (ctx.memory_info()?.free - free) >> 20);
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("growable_vec", run())
}
