//! `cuvmm soak`: many cycles of VmmVec create / grow / shrink / drop and of allocation export /
//! import, checking that device memory in use and the process's open fds return to their baseline.

use cuvmm::alloc::{ExportMode, PeerAllocator};
use cuvmm::context::Context;
use cuvmm::error::Result;
use cuvmm::ipc::{recv_message, PeerPolicy, SharedMemory};
use cuvmm::vmm::VmmVec;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

/// One checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct SoakSample {
    /// Cycles done.
    pub cycles: usize,
    /// Device memory in use minus the baseline, bytes (may be negative).
    pub memory_delta: i64,
    /// Open fds minus the baseline.
    pub fd_delta: i64,
}

fn used(ctx: &Context) -> Result<i64> {
    Ok(ctx.memory_info()?.used() as i64)
}

fn open_fds() -> Result<i64> {
    Ok(std::fs::read_dir("/proc/self/fd")
        .map_err(|_| crate::bench::invalid("cannot list /proc/self/fd"))?
        .count() as i64)
}

/// Runs `cycles` cycles, reporting a checkpoint every `every` cycles and at the end. Fails at the
/// first wrong byte; the caller judges the deltas.
pub fn run(
    ctx: &Context,
    cycles: usize,
    every: usize,
    mut report: impl FnMut(SoakSample),
) -> Result<Vec<SoakSample>> {
    let alloc = PeerAllocator::new(ctx, &[], ExportMode::PosixFd)?;
    // One untimed cycle first: the driver keeps some memory for itself after first use.
    let cycle = |i: usize| -> Result<()> {
        let mut v = VmmVec::<u32>::new(ctx)?;
        let grow = ((i * 7919) % 24 + 1) << 18; // 1 to 24 MiB of u32s
        v.resize(grow, i as u32)?;
        v.extend_from_slice(&[i as u32 ^ 0xabcd; 100])?;
        v.truncate(grow / 3);
        v.shrink_to_fit()?;
        if v.get(grow / 3 - 1)? != Some(i as u32) {
            return Err(crate::bench::invalid(format!("cycle {i}: VmmVec lost its contents")));
        }
        drop(v);
        let mut a = alloc.allocate(2 << 20)?;
        let data = [i as u32; 64];
        cuvmm::stream::copy::to_device(ctx, &mut a.as_mut_slice::<u32>().slice_mut(0..64)?, &data)?;
        let (x, y) = UnixStream::pair().map_err(|_| crate::bench::invalid("socketpair failed"))?;
        a.share(x.as_fd(), 0, a.len(), i as u64)?;
        let msg = recv_message(y.as_fd(), PeerPolicy::SameUid)?
            .ok_or_else(|| cuvmm::Error::Protocol("the socket closed before the share".into()))?;
        let shm = SharedMemory::import(ctx, msg, &[])?;
        let mut back = [0u32; 64];
        shm.copy_to_host(0, &mut back)?;
        if back != data {
            return Err(crate::bench::invalid(format!("cycle {i}: the imported memory differs")));
        }
        Ok(())
    };
    cycle(0)?;
    ctx.synchronize()?;
    let (mem0, fds0) = (used(ctx)?, open_fds()?);
    let mut samples = Vec::new();
    for i in 1..=cycles {
        cycle(i)?;
        if i % every.max(1) == 0 || i == cycles {
            let s = SoakSample { cycles: i, memory_delta: used(ctx)? - mem0, fd_delta: open_fds()? - fds0 };
            report(s);
            samples.push(s);
        }
    }
    Ok(samples)
}
