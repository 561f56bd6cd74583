//! `cuvmm bench first-map`: where the time goes when the first chunk is mapped into a fresh
//! reservation. Create, map, set-access and two device writes, each timed on its own, for several
//! reservation sizes and after continuous work ("busy"), 200 ms of idling ("idle"), freeing 16 GiB
//! ("freed"), or idling then a small memset ("woken").

use crate::common::CliResult;
use cuvmm::driver::{driver, result, Api};
use cuvmm::error::Result;
use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
use cuvmm::{Context, DeviceBuffer};
use std::io::Write;
use std::time::{Duration, Instant};

// The options of `cuvmm bench first-map` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Rounds per condition.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
}

/// What runs before a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Before {
    /// Nothing: the previous round's work just ended.
    Busy,
    /// 200 ms of idling.
    Idle,
    /// 16 GiB allocated, written and freed.
    Freed,
    /// 200 ms of idling, then a 1 MiB memset.
    Woken,
}

impl Before {
    fn name(self) -> &'static str {
        match self {
            Before::Busy => "busy",
            Before::Idle => "idle",
            Before::Freed => "freed",
            Before::Woken => "woken",
        }
    }
}

/// Writes `bytes` bytes at `ptr` on the legacy stream and waits for them.
///
/// # Safety
/// `ptr` is device memory writable for `bytes` bytes.
unsafe fn write(api: &Api, ptr: u64, bytes: usize) -> Result<()> {
    let legacy = std::ptr::null_mut();
    // SAFETY: the caller's contract; the legacy stream always exists and is waited on.
    unsafe {
        result::mem::memset_d8_async(api, ptr, 7, bytes, legacy)?;
        result::stream::synchronize(api, legacy)
    }
}

fn prepare(ctx: &Context, api: &Api, before: Before) -> Result<()> {
    let idle = || std::thread::sleep(Duration::from_millis(200));
    match before {
        Before::Busy => {}
        Before::Idle => idle(),
        Before::Freed => {
            let p = result::mem::alloc(api, 16 << 30)?;
            // SAFETY: `p` holds 16 GiB, written, waited for and freed once.
            unsafe {
                write(api, p, 16 << 30)?;
                result::mem::free(api, p)?;
            }
        }
        Before::Woken => {
            idle();
            let v = DeviceBuffer::<u8>::new(ctx, 1 << 20)?;
            // SAFETY: the buffer holds 1 MiB.
            unsafe { write(api, v.ptr(), 1 << 20) }?;
        }
    }
    Ok(())
}

pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let ctx = Context::for_ordinal(args.device)?;
    let total = ctx.device().total_memory()?;
    let api = driver()?.api();
    let chunk = 64 << 20;
    writeln!(
        out,
        "{:>12} {:>6} {:>10} {:>8} {:>12} {:>10} {:>10}",
        "reservation", "round", "create µs", "map µs", "access µs", "write µs", "2nd µs"
    )?;
    let conditions = [
        (Before::Busy, chunk),
        (Before::Busy, 1 << 30),
        (Before::Busy, total),
        (Before::Idle, total),
        (Before::Freed, total),
        (Before::Woken, total),
    ];
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    for (before, reserve) in conditions {
        for round in 0..args.rounds {
            prepare(&ctx, api, before)?;
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
            let timed_write = || -> Result<Duration> {
                let t = Instant::now();
                // SAFETY: the chunk is mapped read-write.
                unsafe { write(api, m.ptr(), chunk) }?;
                Ok(t.elapsed())
            };
            let (w1, w2) = (timed_write()?, timed_write()?);
            writeln!(
                out,
                "{:>9} {:>8} MiB {round:>6} {:>10.1} {:>8.1} {:>12.1} {:>10.1} {:>10.1}",
                before.name(),
                va.size() >> 20,
                us(t_create),
                us(t_map),
                us(t_access),
                us(w1),
                us(w2)
            )?;
        }
    }
    Ok(())
}
