#!/usr/bin/env python3
"""NCCL all-reduce on tensors from the native allocator or from cuvmm, exact results, bus bandwidth.

    torchrun --standalone --nproc_per_node=2 nccl_allreduce.py --alloc native --json native.json
    torchrun --standalone --nproc_per_node=2 nccl_allreduce.py --alloc cuvmm  --json cuvmm.json
    python3 compare.py native.json cuvmm.json

Sizes from --min-mib to --max-mib, doubling. Each rank fills float32 k % 251 + rank + 1, so
every sum is an integer far below 2^24 and the reduced tensor must equal the exact expectation.
Timing (--timing graph, the default): --graph-calls in-place all-reduces captured in one CUDA
graph, replayed --warmup then --iters times, each replay between two CUDA events: the time of a
call is the replay's over the calls in it, so the host's launch work (PyTorch's and NCCL's, tens
of microseconds a call) is not counted, as it is not in nccl-tests. --timing call times each
eager call between two events on the current stream instead (the launch work included: below
~8 MiB it is most of the time). The median per rank, then the slowest rank's median. Bus
bandwidth as nccl-tests counts it: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n. Rank 0
prints the RESULT line.
"""

import os

# NVLink multicast stays off: forced, not defaulted, so an inherited setting cannot turn it on.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402

from _common import MiB, add_common_args, env_info, finish, median  # noqa: E402
import cuvmm_torch  # noqa: E402

MOD = 251
RESCALE_EVERY = 32


def sizes(lo_mib, hi_mib):
    out, s = [], int(lo_mib * MiB)
    while s <= hi_mib * MiB:
        out.append(s)
        s *= 2
    return out


def time_calls(torch, dist, y, world, args):
    """Median seconds of one eager all-reduce of y, timed alone between two events."""
    times = []
    for it in range(args.warmup + args.iters):
        if it and it % RESCALE_EVERY == 0:
            # Outside the timed events: scaling back what the last calls multiplied keeps it
            # finite (float32 overflows past 2^128: 200 calls on two ranks would not be).
            y.mul_(float(world) ** -RESCALE_EVERY)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(y)
        end.record()
        if it >= args.warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    return median(s.elapsed_time(e) / 1e3 for s, e in times)


def time_graph(torch, dist, y, world, args):
    """Median seconds per all-reduce of y over replays of a graph of --graph-calls of them."""
    k = args.graph_calls
    # Graph capture wants the collective's first (eager) use on a side stream behind it.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(y)
    torch.cuda.current_stream().wait_stream(side)
    y.div_(float(world))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # thread_local: NCCL's and PyTorch's other threads may query the device during the capture.
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(k):
            dist.all_reduce(y)
    scale = float(world) ** -k  # a power of two here: the rescale is exact
    times = []
    for it in range(args.warmup + args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        y.mul_(scale)  # outside the timed events: keeps y finite
        if it >= args.warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    del g
    return median(s.elapsed_time(e) / 1e3 / k for s, e in times)


def main():
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]),
                        allocs=("native", "cuvmm"))
    p.add_argument("--min-mib", type=float, default=1)
    p.add_argument("--max-mib", type=float, default=1024)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timing", choices=("graph", "call"), default="graph")
    p.add_argument("--graph-calls", type=int, default=20)
    args = p.parse_args()
    if args.graph_calls < 1 or args.iters < 1:
        p.error("--graph-calls and --iters must be positive")

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.alloc == "cuvmm":
        cuvmm_torch.use_as_current_allocator()  # before set_device, which initializes CUDA
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()

    results = []
    for size in sizes(args.min_mib, args.max_mib):
        n = size // 4
        k = torch.arange(n, dtype=torch.int32, device=dev).remainder_(MOD)
        x = (k + (rank + 1)).float()
        dist.all_reduce(x)
        want = (k * world + world * (world + 1) // 2).float()
        exact = torch.equal(x, want)
        del want, k

        y = x.clone()  # non-zero data; it grows by a factor `world` per call
        if args.timing == "graph":
            med = time_graph(torch, dist, y, world, args)
        else:
            med = time_calls(torch, dist, y, world, args)
        agg = torch.tensor([med, 0.0 if exact else 1.0], device=dev, dtype=torch.float64)
        dist.all_reduce(agg, op=dist.ReduceOp.MAX)
        slowest, any_wrong = agg.tolist()
        algbw = size / slowest / 1e9
        results.append({"bytes": size, "time_s": slowest, "algbw_gbps": algbw,
                        "busbw_gbps": algbw * 2 * (world - 1) / world, "exact": any_wrong == 0.0,
                        "finite_after_timing": bool(torch.isfinite(y).all().item())})
        del x, y
        if rank == 0:
            r = results[-1]
            print(f"{size / MiB:8.0f} MiB  {r['time_s'] * 1e6:9.1f} us  busbw {r['busbw_gbps']:7.1f} GB/s  "
                  f"exact={r['exact']}", file=sys.stderr, flush=True)

    rc = 0
    if rank == 0:
        result = {"env": env_info(), "world": world, "timing": args.timing,
                  "graph_calls": args.graph_calls if args.timing == "graph" else None,
                  "sizes": [r["bytes"] for r in results],
                  "busbw_gbps": [r["busbw_gbps"] for r in results], "per_size": results,
                  "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
                  "multicast_env": {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                 "NVSHMEM_DISABLE_NVLS")}}
        if args.alloc == "cuvmm":
            result["cuvmm"] = cuvmm_torch.stats()
        checks = {"every size reduced exactly on every rank": all(r["exact"] for r in results),
                  "timed buffers stayed finite": all(r["finite_after_timing"] for r in results)}
        rc = finish("nccl_allreduce", args, result, checks)
    ok = torch.tensor([rc], device=dev)
    dist.broadcast(ok, 0)
    dist.destroy_process_group()
    return int(ok.item())


if __name__ == "__main__":
    sys.exit(main())
