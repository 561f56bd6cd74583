//! A cudarc kernel launch over a `VmmVec`, in cudarc's context and on cudarc's stream, ordered
//! with cuvmm's own work. Run: `cargo run --release -p cuvmm --features cudarc --example cudarc_launch`.

mod common;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cuvmm::kernels::{pattern_value, PTX};
use cuvmm::{Context, Stream, VmmVec};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // cudarc panics when no driver can be loaded; cuvmm says so in one line first.
    cuvmm::driver::driver()?;
    let cuda = CudaContext::new(0)?;
    let cuda_stream = cuda.new_stream()?;
    let module = cuda.load_module(cudarc::nvrtc::Ptx::from_src(PTX))?;
    let pattern = module.load_function("cuvmm_pattern_u32")?;

    let ctx = Context::from_cudarc(&cuda)?;
    let stream = Stream::from_cudarc(&ctx, &cuda_stream)?;
    let mut v = VmmVec::<u32>::new(&ctx)?;
    v.resize(16 << 20, 0)?;
    let (n, first, seed) = (v.len() as u64, 0u64, 0x5eed_u32);
    let mut view = v.as_mut_slice();
    let turn = view.prepare_write(&stream)?; // after cuvmm's fill above, on any stream
    let mut launch = cuda_stream.launch_builder(&pattern);
    launch.arg(&view).arg(&n).arg(&first).arg(&seed);
    // SAFETY: cuvmm_pattern_u32(uint32_t *p, uint64_t n, uint64_t first, uint32_t seed) writes
    // exactly the n elements of the view.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;
    drop(turn);
    // cuvmm's synchronous copy waits for the launch on cudarc's stream by itself.
    let host = v.to_vec()?;
    let bad = host.iter().enumerate().filter(|&(i, &x)| x != pattern_value(i as u64, seed)).count();
    println!("cudarc launched cuvmm_pattern_u32 over {n} elements of a VmmVec: {bad} wrong");
    if bad != 0 {
        return Err(format!("{bad} elements differ from the pattern").into());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("cudarc_launch", run())
}
