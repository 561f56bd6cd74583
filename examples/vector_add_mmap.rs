//! The vectorAddMMAP sample: three vectors, each one flat range whose chunks are striped over every
//! GPU, added by a kernel on device 0. On one GPU the stripes all live on it.
//! Run: `cargo run --release --example vector_add_mmap [-- N]`.

mod common;

use cuvmm::kernels::Kernels;
use cuvmm::stream::copy;
use cuvmm::vmm::Striped;
use cuvmm::{Context, Device, Stream};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(50_000_000);
    let ctxs: Vec<Context> = Device::all()?.into_iter().map(Context::new).collect::<cuvmm::Result<_>>()?;
    let bytes = n * 4;
    let stripe = 2 << 20;
    let mut a = Striped::new(&ctxs, bytes, stripe)?;
    let mut b = Striped::new(&ctxs, bytes, stripe)?;
    let mut c = Striped::new(&ctxs, bytes, stripe)?;
    println!(
        "{n} floats per vector, {} MiB striped in {} MiB chunks over {} device(s)",
        a.len() >> 20,
        stripe >> 20,
        ctxs.len()
    );

    let ha: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5).collect();
    let hb: Vec<f32> = (0..n).map(|i| (i % 777) as f32 + 0.25).collect();
    let ctx = &ctxs[0];
    copy::to_device(ctx, &mut a.as_mut_slice::<f32>().slice_mut(0..n)?, &ha)?;
    copy::to_device(ctx, &mut b.as_mut_slice::<f32>().slice_mut(0..n)?, &hb)?;

    let k = Kernels::load(ctx)?;
    let s = Stream::new(ctx)?;
    let (sa, sb) = (a.as_slice::<f32>().slice(0..n)?, b.as_slice::<f32>().slice(0..n)?);
    k.vector_add_f32(&s, &sa, &sb, &mut c.as_mut_slice::<f32>().slice_mut(0..n)?)?;
    s.synchronize()?;

    let mut hc = vec![0f32; n];
    copy::to_host(ctx, &mut hc, &c.as_slice::<f32>().slice(0..n)?)?;
    let bad = (0..n).filter(|&i| hc[i] != ha[i] + hb[i]).count();
    if bad > 0 {
        return Err(format!("{bad} of {n} sums are wrong").into());
    }
    println!("c = a + b verified for all {n} elements");
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("vector_add_mmap", run())
}
