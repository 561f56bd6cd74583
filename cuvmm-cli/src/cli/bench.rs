//! `cuvmm bench …`.

use crate::bench::{
    alloc, bandwidth, events, first_map, grow, ipc, order, overlap, peer, sleep, trace, vmm_ops,
};
use crate::common::CliResult;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum Bench {
    /// Grow a VmmVec step by step against realloc-by-copy doubling.
    Grow(grow::Args),
    /// Host-device bandwidth: pageable, pinned, registered, both directions, staged pageable.
    Bandwidth(bandwidth::Args),
    /// The multi-stream overlap workload: serial, breadth-first, depth-first and pipelined
    /// schedules through cuvmm, against the raw-driver breadth- and depth-first schedules.
    Overlap(overlap::Args),
    /// An event-ordered pipeline with a host callback consuming the result.
    Events(events::Args),
    /// What cross-stream ordering costs: small copies and kernels through tracked views against
    /// untracked views of the same memory, in one run.
    Order(order::Args),
    /// Allocate+free latency: the caching sub-allocator, cuMemAlloc, the stream-ordered pool.
    Alloc(alloc::Args),
    /// Replay an allocation trace (libcuvmm.so's `CUVMM_ALLOC_CONF=trace=PATH`) against cuvmm's
    /// stream allocator, the driver's stream-ordered pool and cuMemAlloc: host time per call, peak
    /// memory; then cached allocate+free pairs.
    Trace(trace::Args),
    /// Put tagged memory to sleep and wake it (with offload and discarding), beside the pinned
    /// copy bounds measured in each cycle.
    Sleep(sleep::Args),
    /// Share an allocation with a child process: export, send, receive, import, map, access,
    /// through cuvmm and through raw driver and socket calls in the same run; bandwidth on the
    /// imported memory; the legacy cuIpc* path.
    Ipc(ipc::Args),
    /// Two GPUs: a kernel on GPU 1 reading GPU 0's memory through the mapping, against cuMemcpyPeer.
    Peer(peer::Args),
    /// Latency of create / map / set-access / unmap / release per chunk size, raw and through cuvmm.
    VmmOps(vmm_ops::Args),
    /// Where the time goes when the first chunk is mapped into a fresh reservation: create, map,
    /// set-access and two writes, after work, idling, freeing 16 GiB or a small memset.
    FirstMap(first_map::Args),
}

pub fn run(b: Bench) -> CliResult {
    let mut out = std::io::stdout().lock();
    match b {
        Bench::Grow(args) => grow::cli(args, &mut out),
        Bench::Bandwidth(args) => bandwidth::cli(args, &mut out),
        Bench::Overlap(args) => overlap::cli(args, &mut out),
        Bench::Events(args) => events::cli(args, &mut out),
        Bench::Order(args) => order::cli(args, &mut out),
        Bench::Alloc(args) => alloc::cli(args, &mut out),
        Bench::Trace(args) => trace::cli(args, &mut out),
        Bench::Sleep(args) => sleep::cli(args, &mut out),
        Bench::Ipc(args) => ipc::cli(args, &mut out),
        Bench::Peer(args) => peer::cli(args, &mut out),
        Bench::VmmOps(args) => vmm_ops::cli(args, &mut out),
        Bench::FirstMap(args) => first_map::cli(args, &mut out),
    }
}
