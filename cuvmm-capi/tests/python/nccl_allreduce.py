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

--ab (with --alloc native) compares the two allocators' memory inside one process: at each size
one buffer from PyTorch's allocator and one from a torch.cuda.MemPool whose segments cuvmm maps,
reduced on the same communicator and timed in turn, --ab-rounds times each, first one then the
other. A launch's own speed (it varies from one launch to the next at small sizes, whatever the
allocator) is then common to both, and the ratio is the memory's alone. --ab-second native takes
the second buffer from PyTorch's allocator too: a control, showing how far two buffers of the
same allocator differ.
"""

import os

# NVLink multicast stays off: forced, not defaulted, so an inherited setting cannot turn it on.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
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
    p.add_argument("--ab", action="store_true", help="native and cuvmm-pool buffers in one process")
    p.add_argument("--ab-rounds", type=int, default=4)
    p.add_argument("--ab-second", choices=("cuvmm-pool", "native"), default="cuvmm-pool",
                   help="where --ab's second buffer comes from: native makes a control, two native buffers")
    args = p.parse_args()
    if args.graph_calls < 1 or args.iters < 1 or args.ab_rounds < 1:
        p.error("--graph-calls, --iters and --ab-rounds must be positive")
    if args.ab and args.alloc != "native":
        p.error("--ab runs with --alloc native (the cuvmm buffers come from a MemPool)")

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.alloc == "cuvmm":
        cuvmm_torch.use_as_current_allocator()  # before set_device, which initializes CUDA
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()

    def filled(size):
        """A buffer of size bytes, all-reduced once and checked exact; then the timed copy."""
        n = size // 4
        k = torch.arange(n, dtype=torch.int32, device=dev).remainder_(MOD)
        x = (k + (rank + 1)).float()
        dist.all_reduce(x)
        want = (k * world + world * (world + 1) // 2).float()
        exact = torch.equal(x, want)
        del want, k
        return x, exact

    def timed(y):
        """The slowest rank's median seconds per all-reduce of y."""
        med = time_graph(torch, dist, y, world, args) if args.timing == "graph" else \
            time_calls(torch, dist, y, world, args)
        agg = torch.tensor([med], device=dev, dtype=torch.float64)
        dist.all_reduce(agg, op=dist.ReduceOp.MAX)
        return agg.item()

    def all_exact(exact):
        agg = torch.tensor([0.0 if exact else 1.0], device=dev, dtype=torch.float64)
        dist.all_reduce(agg, op=dist.ReduceOp.MAX)
        return agg.item() == 0.0

    def row(size, slowest, exact, y):
        algbw = size / slowest / 1e9
        return {"bytes": size, "time_s": slowest, "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (world - 1) / world, "exact": exact,
                "finite_after_timing": bool(torch.isfinite(y).all().item())}

    pool = cuvmm_torch.mem_pool() if args.ab and args.ab_second == "cuvmm-pool" else None
    results, ab = [], []
    for size in sizes(args.min_mib, args.max_mib):
        if not args.ab:
            x, exact = filled(size)
            y = x.clone()  # non-zero data; it grows by a factor `world` per call
            results.append(row(size, timed(y), all_exact(exact), y))
            del x, y
        else:
            x, exact_n = filled(size)
            y_n = x.clone()
            with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
                xc, exact_c = filled(size)
                y_c = xc.clone()
            times = {"first": [], "second": []}
            for r in range(args.ab_rounds):
                order = ("first", "second") if r % 2 == 0 else ("second", "first")
                for which in order:
                    times[which].append(timed(y_n if which == "first" else y_c))
            t_n, t_c = median(times["first"]), median(times["second"])
            results.append(row(size, t_n, all_exact(exact_n), y_n))
            c = row(size, t_c, all_exact(exact_c), y_c)
            c["busbw_over_first"] = t_n / t_c  # as busbw's ratio, and defined on one rank too
            c["rounds_s"] = times
            # Where each buffer sits: a slow buffer can then be told apart by its placement.
            c["ptr_first"], c["ptr_second"] = y_n.data_ptr(), y_c.data_ptr()
            ab.append(c)
            del x, y_n, xc, y_c
        if rank == 0:
            r = results[-1]
            line = (f"{size / MiB:8.0f} MiB  {r['time_s'] * 1e6:9.1f} us  busbw {r['busbw_gbps']:7.1f} GB/s  "
                    f"exact={r['exact']}")
            if ab:
                c = ab[-1]
                line += (f"  {args.ab_second} {c['busbw_gbps']:7.1f} GB/s exact={c['exact']}  "
                         f"ratio {c['busbw_over_first']:.3f}")
            print(line, file=sys.stderr, flush=True)

    rc = 0
    if rank == 0:
        result = {"env": env_info(), "world": world, "timing": args.timing,
                  "graph_calls": args.graph_calls if args.timing == "graph" else None,
                  "sizes": [r["bytes"] for r in results],
                  "busbw_gbps": [r["busbw_gbps"] for r in results], "per_size": results,
                  "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
                  "multicast_env": {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                 "NVSHMEM_DISABLE_NVLS")}}
        if args.alloc == "cuvmm" or pool is not None:
            result["cuvmm"] = cuvmm_torch.stats()
        if args.ab:
            result["ab"] = {"rounds": args.ab_rounds, "second": args.ab_second, "second_buffers": ab,
                            "busbw_gbps": [c["busbw_gbps"] for c in ab],
                            "ratio": [c["busbw_over_first"] for c in ab]}
        checks = {"every size reduced exactly on every rank": all(r["exact"] for r in results + ab),
                  "timed buffers stayed finite": all(r["finite_after_timing"] for r in results + ab)}
        rc = finish("nccl_allreduce", args, result, checks)
    ok = torch.tensor([rc], device=dev)
    dist.broadcast(ok, 0)
    dist.destroy_process_group()
    return int(ok.item())


if __name__ == "__main__":
    sys.exit(main())
