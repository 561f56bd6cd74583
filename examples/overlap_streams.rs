//! Overlapping copies and kernels with several streams: the same work (copy in, a kernel, copy
//! out) done in one piece on one stream, then cut into pieces spread over several streams, so
//! that one piece's copies run while another's kernel does. Run:
//! `cargo run --release --example overlap_streams [-- STREAMS PIECES]`.

mod common;

use cuvmm::kernels::{busy_value, Kernels};
use cuvmm::{scope, Context, DeviceBuffer, PinnedBuffer, Stream};
use std::time::Instant;

/// Floats moved and worked on.
const N: usize = 1 << 26;
/// Multiply-adds per element: about as long on the device as the copies.
const ITERS: u32 = 64;

/// Copies `input` in, runs the busy kernel and copies the result out, in `pieces` pieces taking
/// turns on `streams`; returns the milliseconds from the first call to the last byte's arrival.
fn pipeline(
    k: &Kernels,
    streams: &[Stream],
    pieces: usize,
    input: &[f32],
    dev: &mut DeviceBuffer<f32>,
    output: &mut [f32],
) -> cuvmm::Result<f64> {
    let piece = input.len().div_ceil(pieces);
    let t = Instant::now();
    scope(|s| {
        let work = input.chunks(piece).zip(output.chunks_mut(piece)).enumerate();
        for (i, (src, dst)) in work {
            let st = &streams[i % streams.len()];
            let at = i * piece;
            let mut d = dev.as_mut_slice().slice_mut(at..at + src.len())?;
            s.copy_to_device(st, src, d.reborrow())?;
            k.busy_f32(st, &mut d, ITERS)?;
            // Read after the scope, which waits for every stream it used.
            let _ = s.copy_to_host(st, d.as_slice(), dst)?;
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let arg =
        |i: usize, default: usize| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (nstreams, pieces) = (arg(1, 4).max(1), arg(2, 16).max(1));
    let ctx = Context::for_ordinal(0)?;
    let k = Kernels::load(&ctx)?;
    let streams: Vec<Stream> =
        (0..nstreams).map(|_| Stream::non_blocking(&ctx)).collect::<cuvmm::Result<_>>()?;
    let input =
        PinnedBuffer::from_slice(&ctx, &(0..N).map(|i| (i % 4099) as f32 * 1e-3).collect::<Vec<_>>())?;
    let mut output = PinnedBuffer::<f32>::new(&ctx, N)?;
    let mut dev = DeviceBuffer::<f32>::new(&ctx, N)?;
    println!("{N} floats, {ITERS} multiply-adds each, on {}", ctx.device().name()?);
    for (label, st, p) in
        [("one piece, one stream", &streams[..1], 1), ("pieces over the streams", &streams[..], pieces)]
    {
        pipeline(&k, st, p, &input, &mut dev, &mut output)?; // warm-up
        let ms = pipeline(&k, st, p, &input, &mut dev, &mut output)?;
        println!("{label:<26} {:>2} stream(s), {p:>3} piece(s): {ms:>8.2} ms", st.len());
        // The result is right, on a sample, against the kernel's host copy.
        for i in (0..N).step_by(9973) {
            if output[i].to_bits() != busy_value(input[i], ITERS).to_bits() {
                return Err(format!(
                    "element {i}: device {} != host {}",
                    output[i],
                    busy_value(input[i], ITERS)
                )
                .into());
            }
        }
        output.fill(0.0);
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("overlap_streams", run())
}
