//! Events between a copy and a kernel on two streams, a host callback that consumes the
//! result, and CPU work overlapped meanwhile. Run: `cargo run --release --example events_callbacks`.

mod common;

use cuvmm::{scope, Context, DeviceBuffer, Event, PinnedBuffer, Stream};
use std::sync::Mutex;

fn run() -> cuvmm::Result<()> {
    let ctx = Context::for_ordinal(0)?;
    let k = cuvmm::kernels::Kernels::load(&ctx)?;
    let (copy, work) = (Stream::non_blocking(&ctx)?, Stream::non_blocking(&ctx)?);
    let (start, copied, computed) = (Event::new(&ctx)?, Event::new(&ctx)?, Event::new(&ctx)?);
    let n = 1 << 24;
    let input = PinnedBuffer::from_slice(&ctx, &vec![1.0f32; n])?;
    let mut output = PinnedBuffer::<f32>::new(&ctx, n)?;
    let mut dev = DeviceBuffer::<f32>::new(&ctx, n)?;
    let result = Mutex::new(0.0f64);
    let mut cpu_iterations = 0u64;
    scope(|s| {
        start.record(&copy)?;
        s.copy_to_device(&copy, &input, dev.as_mut_slice())?;
        copied.record(&copy)?;
        work.wait_event(&copied)?; // the kernel waits for the copy, on another stream
        k.busy_f32(&work, &mut dev.as_mut_slice(), 500)?;
        computed.record(&work)?;
        let landing = s.copy_to_host(&work, dev.as_slice(), &mut output)?;
        let result = &result;
        s.then(landing, move |data| {
            // Runs on a driver thread once the result has landed.
            *result.lock().unwrap() = data.iter().map(|&x| x as f64).sum();
        })?;
        // The CPU keeps working until the GPU is done.
        while !computed.is_complete()? {
            cpu_iterations += 1;
            std::hint::black_box((0..1000u64).sum::<u64>());
        }
        Ok(())
    })?;
    println!(
        "copy {:.3} ms, kernel {:.3} ms (device events)",
        start.elapsed_ms(&copied)?,
        copied.elapsed_ms(&computed)?
    );
    println!("the CPU did {cpu_iterations} units of work meanwhile");
    println!("callback's sum of {n} results: {:.1}", result.into_inner().unwrap());
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("events_callbacks", run())
}
