//! Two GPUs: an allocation on GPU 0 mapped for GPU 1 alone, read by a kernel on GPU 1, then access
//! narrowed again. On one GPU it says so and exits cleanly.
//! Run: `cargo run --release --example peer_access`.

mod common;

use cuvmm::alloc::{ExportMode, PeerAllocator};
use cuvmm::kernels::Kernels;
use cuvmm::vmm::Access;
use cuvmm::{Context, Device, Stream};

fn run() -> cuvmm::Result<()> {
    let devices = Device::all()?;
    if devices.len() < 2 {
        println!("peer_access needs two GPUs; this machine has {}. Nothing to do.", devices.len());
        return Ok(());
    }
    let (c0, c1) = (Context::new(devices[0])?, Context::new(devices[1])?);
    let alloc = PeerAllocator::new(&c0, &[(devices[1], Access::Read)], ExportMode::None)?;
    let mut a = alloc.allocate(64 << 20)?;
    for d in &devices {
        println!("device {} access: {:?}", d.ordinal(), a.access(*d)?);
    }
    let (k0, k1) = (Kernels::load(&c0)?, Kernels::load(&c1)?);
    let (s0, s1) = (Stream::new(&c0)?, Stream::new(&c1)?);
    k0.pattern_u32(&s0, &mut a.as_mut_slice::<u32>(), 0, 5)?;
    s0.synchronize()?;
    let bad = k1.count_pattern_mismatches(&s1, &a.as_slice::<u32>(), 0, 5)?;
    println!("GPU 1 read GPU 0's pattern through the mapping: {bad} wrong elements");
    a.set_access(&[(devices[1], Access::None)])?;
    println!("after narrowing, device 1 access: {:?}", a.access(devices[1])?);
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("peer_access", run())
}
