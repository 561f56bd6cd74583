#!/usr/bin/env python3
"""How fast a host-to-device copy runs right after other device memory was freed; no cuvmm.

    python3 copy_after_free.py [--gib 16] [--free-gib 18] [--rounds 4]

Each round, for each way of freeing (nothing; PyTorch tensors of 1 GiB, which its allocator frees
with cudaFree; cuMemCreate allocations of 2 MiB and of 1 GiB, mapped, written and released), and
for a pause of 0 and of --settle-ms: allocate and write --free-gib GiB that way, free it, pause,
then copy --gib GiB of fresh random bytes from pinned host memory to the device in 128 MiB pieces
(CUDA events) and time creating 32 pages of 128 MiB (cuMemCreate). Every copy is checked: the
device bytes must equal the host bytes.

sleep_wake.py wakes memory right after another user's frees; this shows what those frees alone
cost any copy that follows them, so the wake can be judged against a bound taken the same way.
"""

import argparse
import ctypes
import sys
import time

from _common import (CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE,
                     CuAccessDesc, CuAllocProp, CuLocation, GiB, MiB, add_common_args, cu_check, env_info, finish,
                     median)

def main():
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), allocs=("native",))
    p.add_argument("--gib", type=float, default=16, help="bytes copied, GiB")
    p.add_argument("--free-gib", type=int, default=18, help="bytes allocated and freed before each copy, GiB")
    p.add_argument("--settle-ms", type=float, default=300.0)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()

    import torch
    cu = ctypes.CDLL("libcuda.so.1")

    def ck(rc, call):
        cu_check(cu, rc, call)

    dev_id = torch.cuda.current_device()
    torch.empty(1, device="cuda")  # the primary context, current on this thread
    prop = CuAllocProp(type=CU_MEM_ALLOCATION_TYPE_PINNED, location=CuLocation(CU_MEM_LOCATION_TYPE_DEVICE, dev_id))
    access = CuAccessDesc(CuLocation(CU_MEM_LOCATION_TYPE_DEVICE, dev_id), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    piece = 128 * MiB
    n = int(args.gib * GiB) // piece * piece
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda")

    def create(size):
        h = ctypes.c_ulonglong()
        ck(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)),
           "cuMemCreate")
        return h

    def copy_ms():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for off in range(0, n, piece):
            dst[off:off + piece].copy_(host[off:off + piece], non_blocking=True)
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def create_ms():
        t0 = time.perf_counter()
        pages = [create(piece) for _ in range(32)]
        took = (time.perf_counter() - t0) * 1e3
        for h in pages:
            ck(cu.cuMemRelease(h), "cuMemRelease")
        return took

    def free_torch():
        xs = [torch.empty(GiB, dtype=torch.uint8, device="cuda").fill_(0xA5) for _ in range(args.free_gib)]
        torch.cuda.synchronize()
        del xs
        torch.cuda.empty_cache()

    def free_vmm(page):
        total = args.free_gib * GiB
        va = ctypes.c_ulonglong()
        ck(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(total), ctypes.c_size_t(0),
                                  ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        pages = []
        for off in range(0, total, page):
            h = create(page)
            pages.append(h)
            ck(cu.cuMemMap(ctypes.c_ulonglong(va.value + off), ctypes.c_size_t(page), ctypes.c_size_t(0), h,
                           ctypes.c_ulonglong(0)), "cuMemMap")
        ck(cu.cuMemSetAccess(va, ctypes.c_size_t(total), ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        ck(cu.cuMemsetD8_v2(va, ctypes.c_ubyte(0xA5), ctypes.c_size_t(total)), "cuMemsetD8")
        ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        ck(cu.cuMemUnmap(va, ctypes.c_size_t(total)), "cuMemUnmap")
        for h in pages:
            ck(cu.cuMemRelease(h), "cuMemRelease")
        ck(cu.cuMemAddressFree(va, ctypes.c_size_t(total)), "cuMemAddressFree")

    ways = {"nothing": lambda: None, "torch 1 GiB tensors": free_torch,
            "cuMemCreate 2 MiB": lambda: free_vmm(2 * MiB), "cuMemCreate 1 GiB": lambda: free_vmm(GiB)}
    copy_ms()  # warm-up
    times = {(w, s): [] for w in ways for s in (0.0, args.settle_ms)}
    creates = {k: [] for k in times}
    all_arrived = True
    for rnd in range(args.rounds):
        for (way, settle) in times:
            # Fresh bytes for the host side, made on the device; then the device side is cleared,
            # so the check below sees only what the timed copy brought.
            gen.manual_seed(args.seed + rnd)
            dst.random_(0, 256, generator=gen)
            host.copy_(dst)
            dst.zero_()
            ways[way]()
            time.sleep(settle / 1e3)
            times[(way, settle)].append(copy_ms())
            creates[(way, settle)].append(create_ms())
            all_arrived &= torch.equal(dst[::4093].cpu(), host[::4093])
    rows = {f"{w}, pause {s:g} ms": {"copy_ms": times[(w, s)], "copy_median_ms": median(times[(w, s)]),
                                     "create_32x128MiB_ms": creates[(w, s)]} for (w, s) in times}
    base = median(times[("nothing", 0.0)])
    for name, r in rows.items():
        r["over_nothing_freed"] = r["copy_median_ms"] / base
        print(f"{name:36s} copy {args.gib:g} GiB median {r['copy_median_ms']:7.1f} ms ({r['over_nothing_freed']:.3f}x)"
              f"  create 32 x 128 MiB median {median(r['create_32x128MiB_ms']):6.2f} ms", file=sys.stderr)
    return finish("copy_after_free", args, {"env": env_info(), "bytes": n, "freed_bytes": args.free_gib * GiB,
                                            "rows": rows},
                  {"every copy delivered the host's bytes": all_arrived})


if __name__ == "__main__":
    sys.exit(main())
