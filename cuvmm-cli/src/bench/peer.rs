//! `cuvmm bench peer`: a kernel on GPU 1 reading GPU 0's allocation through a peer mapping,
//! against cuMemcpyPeerAsync of the same bytes, in the same run.

use super::median;
use crate::common::size::{parse_size, show};
use crate::common::CliResult;
use cuvmm::alloc::{ExportMode, PeerAllocator};
use cuvmm::context::Context;
use cuvmm::driver::{driver, result};
use cuvmm::error::Result;
use cuvmm::kernels::Kernels;
use cuvmm::memory::DeviceBuffer;
use cuvmm::stream::Event;
use cuvmm::stream::Stream;
use cuvmm::vmm::Access;
use serde_json::json;
use std::io::Write;

/// GB/s of each way to move GPU 0's bytes to GPU 1.
#[derive(Clone, Copy, Debug)]
pub struct PeerReport {
    /// Bytes read.
    pub bytes: usize,
    /// A checksum kernel on GPU 1 reading the mapping of GPU 0's memory.
    pub kernel_gbs: f64,
    /// cuMemcpyPeerAsync from GPU 0 to GPU 1.
    pub copy_gbs: f64,
}

/// Runs on devices 0 and 1 of `ctxs`.
pub fn run(ctxs: &[Context], bytes: usize) -> Result<PeerReport> {
    if ctxs.len() < 2 {
        return Err(crate::bench::unsupported("the peer benchmark", "it needs two GPUs"));
    }
    let (c0, c1) = (&ctxs[0], &ctxs[1]);
    let alloc = PeerAllocator::new(c0, &[(c1.device(), Access::Read)], ExportMode::None)?;
    let mut a = alloc.allocate(bytes)?;
    let bytes = a.len();
    let k0 = Kernels::load(c0)?;
    let s0 = Stream::new(c0)?;
    k0.pattern_u32(&s0, &mut a.as_mut_slice::<u32>(), 0, 9)?;
    s0.synchronize()?;
    let k1 = Kernels::load(c1)?;
    let s1 = Stream::non_blocking(c1)?;
    let (e0, e1) = (Event::new(c1)?, Event::new(c1)?);
    let expect = k0.checksum_u32(&s0, &a.as_slice::<u32>())?;
    let mut counter = DeviceBuffer::<u64>::new(c1, 1)?;
    let mut kernel = Vec::new();
    for rep in 0..6 {
        // Only the kernel (and the 8-byte memset of its counter) between the events.
        e0.record(&s1)?;
        k1.checksum_u32_queued(&s1, &a.as_slice::<u32>(), &mut counter.as_mut_slice())?;
        e1.record(&s1)?;
        e1.synchronize()?;
        if counter.to_vec()?[0] != expect {
            return Err(crate::bench::invalid("the peer read a different checksum"));
        }
        if rep > 0 {
            kernel.push(bytes as f64 / (e0.elapsed_ms(&e1)? as f64 / 1e3) / 1e9);
        }
    }
    let dst = DeviceBuffer::<u8>::new(c1, bytes)?;
    let api = driver()?.api();
    let mut copy = Vec::new();
    for rep in 0..6 {
        e0.record(&s1)?;
        c1.bind()?;
        // SAFETY: both ranges are `bytes` long and live; the copy is ordered on s1.
        unsafe {
            result::mem::memcpy_peer_async(api, dst.ptr(), c1.raw(), a.ptr(), c0.raw(), bytes, s1.raw())
        }?;
        e1.record(&s1)?;
        e1.synchronize()?;
        if rep > 0 {
            copy.push(bytes as f64 / (e0.elapsed_ms(&e1)? as f64 / 1e3) / 1e9);
        }
    }
    Ok(PeerReport { bytes, kernel_gbs: median(&kernel), copy_gbs: median(&copy) })
}

// The options of `cuvmm bench peer` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Bytes read.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    size: usize,
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench peer`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { size, json } = args;
    let devices = cuvmm::Device::all()?;
    if devices.len() < 2 {
        writeln!(out, "bench peer needs two GPUs; this machine has {}", devices.len())?;
        return Ok(());
    }
    let ctxs = [Context::new(devices[0])?, Context::new(devices[1])?];
    let r = run(&ctxs, size)?;
    if json {
        writeln!(
            out,
            "{}",
            json!({"bench": "peer", "bytes": r.bytes, "kernel_gbs": r.kernel_gbs,
            "copy_gbs": r.copy_gbs, "ratio": r.kernel_gbs / r.copy_gbs})
        )?;
    } else {
        writeln!(out, "GPU 1 reading {} of GPU 0's memory (median of 5)", show(r.bytes))?;
        writeln!(out, "  kernel through the peer mapping  {:>8.1} GB/s", r.kernel_gbs)?;
        writeln!(out, "  cuMemcpyPeerAsync                {:>8.1} GB/s", r.copy_gbs)?;
        writeln!(out, "  ratio                            {:>8.3}x", r.kernel_gbs / r.copy_gbs)?;
    }
    Ok(())
}
