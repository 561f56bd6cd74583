//! Where the time goes when the first chunk is mapped into a fresh reservation: create, map,
//! set-access and a first device write, each timed on its own, for several reservation sizes and
//! after continuous work ("busy"), 200 ms of idling ("idle"), freeing 16 GiB ("freed"), or idling
//! then a small memset ("woken").
//! Run: `cargo run --release --example first_map_probe`.

mod common;

use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
use cuvmm::Context;
use std::time::Instant;

fn run() -> cuvmm::Result<()> {
    let ctx = Context::for_ordinal(0)?;
    let total = ctx.device().total_memory()?;
    let api = cuvmm::driver::driver()?.api();
    let chunk = 64 << 20;
    println!(
        "{:>12} {:>6} {:>10} {:>8} {:>12} {:>10} {:>10}",
        "reservation", "round", "create µs", "map µs", "access µs", "write µs", "2nd µs"
    );
    let conditions: [(&str, usize); 6] = [
        ("busy", chunk),
        ("busy", 1 << 30),
        ("busy", total),
        ("idle", total),
        ("freed", total),
        ("woken", total),
    ];
    for (condition, reserve) in conditions {
        for round in 0..3 {
            match condition {
                "idle" => std::thread::sleep(std::time::Duration::from_millis(200)),
                "freed" => {
                    let mut p = 0;
                    // SAFETY: out-pointer valid; the 16 GiB buffer is freed at once.
                    unsafe {
                        api.cuMemAlloc(&mut p, 16 << 30)?;
                        api.cuMemsetD8Async(p, 1, 16 << 30, std::ptr::null_mut())?;
                        api.cuStreamSynchronize(std::ptr::null_mut())?;
                        api.cuMemFree(p)?;
                    }
                }
                "woken" => {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    let v = cuvmm::DeviceBuffer::<u8>::new(&ctx, 1 << 20)?;
                    // SAFETY: the buffer holds 1 MiB; the legacy stream is waited on.
                    unsafe {
                        api.cuMemsetD8Async(v.ptr(), 1, 1 << 20, std::ptr::null_mut())?;
                        api.cuStreamSynchronize(std::ptr::null_mut())?;
                    }
                }
                _ => {}
            }
            let va = Reservation::new(&ctx, reserve)?;
            let t = Instant::now();
            let p = PhysicalMemory::builder(&ctx).create(chunk)?;
            let t_create = t.elapsed();
            let t = Instant::now();
            let m = va.map(0, &p, 0, chunk)?;
            let t_map = t.elapsed();
            let t = Instant::now();
            m.set_access(&[(ctx.device(), Access::ReadWrite)])?;
            let t_access = t.elapsed();
            let write = || -> cuvmm::Result<std::time::Duration> {
                let t = Instant::now();
                // SAFETY: the chunk is mapped read-write; the legacy stream is waited on.
                unsafe {
                    api.cuMemsetD8Async(m.ptr(), 7, chunk, std::ptr::null_mut())?;
                    api.cuStreamSynchronize(std::ptr::null_mut())?;
                }
                Ok(t.elapsed())
            };
            let (w1, w2) = (write()?, write()?);
            let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
            println!(
                "{condition:>9} {:>8} MiB {round:>6} {:>10.1} {:>8.1} {:>12.1} {:>10.1} {:>10.1}",
                va.size() >> 20,
                us(t_create),
                us(t_map),
                us(t_access),
                us(w1),
                us(w2)
            );
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("first_map_probe", run())
}
