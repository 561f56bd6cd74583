#!/usr/bin/env python3
"""Out of memory under change_current_allocator raises, and the process goes on.

    pip install --no-deps --no-index cuvmm-*.whl
    python3 oom_raises.py [--json PATH]
    python3 oom_raises.py --plain      # cuvmm_malloc itself: expected to FAIL (tensor at address 0)

With cuvmm as the process's allocator (cuvmm.torch.use_as_current_allocator): a tensor larger
than the device must raise torch.OutOfMemoryError (one check); then tensors of --chunk-gib GiB
are allocated and written until one raises torch.OutOfMemoryError (cuvmm's own out of memory, with
the device full); all are dropped, and a matmul and a reduction must give the same bits as before
the failures, with no CUDA error (the context is intact). An allocation under a sleeping tag (where
the library has sleep and wake) must raise RuntimeError that is not an OutOfMemoryError.

--plain hands PyTorch cuvmm_malloc and cuvmm_free directly, as before the raising entry points:
the oversized tensor then comes back at address 0 (reported, never touched) and the script fails.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the same bits from the same matmul

import argparse  # noqa: E402
import sys  # noqa: E402

from _common import GiB, MiB, env_info, finish  # noqa: E402

import cuvmm  # noqa: E402
import cuvmm.torch as ct  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk-gib", type=float, default=4.0)
    p.add_argument("--plain", action="store_true", help="cuvmm_malloc without the raising entry points")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch

    if args.plain:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(cuvmm.library_path(), "cuvmm_malloc", "cuvmm_free")
        torch.cuda.memory.change_current_allocator(alloc)
    else:
        ct.use_as_current_allocator()
    torch.cuda.init()
    dev = torch.device("cuda")
    free0, total = torch.cuda.mem_get_info()

    gen = torch.Generator(device=dev).manual_seed(7)
    a = torch.randn(2048, 2048, device=dev, generator=gen)

    def compute():
        return (a @ a).sum(dtype=torch.float64).item(), torch.tanh(a).view(torch.int32).sum(dtype=torch.int64).item()

    ref = compute()
    torch.cuda.synchronize()

    def attempt(fn):
        """(exception class name or None, message, whether it is an OutOfMemoryError, result)"""
        try:
            r = fn()
            return None, "", False, r
        except Exception as e:  # noqa: BLE001 - what it is, is the point
            return type(e).__name__, str(e).splitlines()[0][:300], isinstance(e, torch.OutOfMemoryError), None

    # 1. one tensor larger than the device
    too_big = total + GiB
    name, msg, is_oom, t = attempt(lambda: torch.empty(too_big, dtype=torch.uint8, device=dev))
    address = t.data_ptr() if t is not None else None
    del t
    print(f"oversized: {name}: {msg} (address {address})", file=sys.stderr)

    # 2. fill the device until cuvmm runs out
    chunk = int(args.chunk_gib * GiB)
    held, fill_name, fill_msg, fill_oom = [], None, "", False
    for _ in range(int(total // chunk) + 4):
        n, m, o, t = attempt(lambda: torch.empty(chunk, dtype=torch.uint8, device=dev))
        if n is not None:
            fill_name, fill_msg, fill_oom = n, m, o
            break
        if t.data_ptr() == 0:
            fill_name, fill_msg = None, "a tensor at address 0"
            break
        t.fill_(0x5A)
        held.append(t)
    held_bytes = len(held) * chunk
    print(f"filled {held_bytes / GiB:.1f} GiB, then {fill_name}: {fill_msg}", file=sys.stderr)
    del held, t
    torch.cuda.synchronize()
    cuvmm.empty_cache()

    # 3. an allocation under a sleeping tag: refused, not out of memory
    tag_name, tag_oom = "n/a", False
    if cuvmm.has_sleep():
        with cuvmm.tag("oom_raises"):
            w = torch.ones(MiB, device=dev)
        torch.cuda.synchronize()
        cuvmm.sleep("oom_raises", offload=False)
        with cuvmm.tag("oom_raises"):
            tag_name, tag_msg, tag_oom, t = attempt(lambda: torch.empty(MiB, device=dev))
        del t
        cuvmm.wake("oom_raises")
        print(f"sleeping tag: {tag_name}: {tag_msg}", file=sys.stderr)
        del w

    # 4. the process goes on
    after_name, after_msg, _, after = attempt(compute)
    sync_name, sync_msg, _, _ = attempt(torch.cuda.synchronize)
    b = torch.empty(chunk, dtype=torch.uint8, device=dev).fill_(3)
    big_ok = b.sum(dtype=torch.int64).item() == 3 * chunk
    del b

    result = {"env": env_info(), "plain": args.plain, "raises_on_oom": ct.raises_on_oom(),
              "native_oom_error": ct.native_oom_error(), "total": total,
              "free_before": free0, "oversized": {"exception": name, "message": msg, "address": address},
              "fill": {"held_bytes": held_bytes, "exception": fill_name, "message": fill_msg},
              "sleeping_tag": tag_name, "after": {"compute": after_name or "ok", "sync": sync_name or "ok"},
              "stats": cuvmm.stats()}
    checks = {
        "a tensor larger than the device raises torch.OutOfMemoryError": is_oom,
        "filling the device ends in torch.OutOfMemoryError": fill_oom and held_bytes > 0,
        "an allocation under a sleeping tag raises RuntimeError, not OutOfMemoryError":
            tag_name == "n/a" or (tag_name is not None and not tag_oom and tag_name != "OutOfMemoryError"),
        "computing after the failures gives the same bits": after_name is None and after == ref,
        "no CUDA error after the failures": sync_name is None,
        "a large allocation after the failures works": big_ok,
    }
    return finish("oom_raises", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
