#!/usr/bin/env python3
"""A MemPool on cuvmm with PyTorch's expandable segments switched on.

    python3 pool_expandable.py

Sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (unless the variable is already set) before
torch is imported, makes a 256 MiB and a 300 MiB tensor inside a cuvmm MemPool and one outside,
and checks the pool's tensors exactly and that every byte of the pool's segments is cuvmm's. It
records which segments PyTorch made expandable: in PyTorch 2.11 those of its own pool only, so a
MemPool's segments stay the fixed sizes PyTorch asks the plugin for, with the fragmentation of
PyTorch's caching inside them.
"""

import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402

from _common import MiB, Alloc, add_common_args, env_info, exact_sum, fill_mod_pattern, finish, \
    mod_pattern_sum  # noqa: E402


def main():
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]),
                        allocs=("cuvmm-pool",))
    args = p.parse_args()
    import torch

    alloc = Alloc(args.alloc).setup()
    sizes = (256 * MiB, 300 * MiB)
    exact = []
    with alloc.scope():
        pooled = [torch.empty(n // 4, dtype=torch.int32, device="cuda") for n in sizes]
        for i, t in enumerate(pooled):
            fill_mod_pattern(t, 1000 + i, 3)
    outside = torch.empty(sizes[0] // 4, dtype=torch.int32, device="cuda")
    fill_mod_pattern(outside, 999, 1)
    for i, t in enumerate(pooled):
        exact.append(exact_sum(t).item() == mod_pattern_sum(t.numel(), 1000 + i, 3))
    pool_id = tuple(alloc.pool.id)
    segments = [{"address": s["address"], "bytes": s["total_size"], "in_pool": tuple(s["segment_pool_id"]) == pool_id,
                 "expandable": bool(s.get("is_expandable"))}
                for s in torch.cuda.memory._snapshot()["segments"]]
    pool_bytes = sum(s["bytes"] for s in segments if s["in_pool"])
    stats = alloc.cuvmm_stats()
    result = {
        "env": env_info(),
        "alloc_conf": os.environ["PYTORCH_CUDA_ALLOC_CONF"],
        "segments": segments,
        "pool_segment_bytes": pool_bytes,
        "pool_segments_expandable": [s["expandable"] for s in segments if s["in_pool"]],
        "other_segments_expandable": [s["expandable"] for s in segments if not s["in_pool"]],
        "cuvmm": stats,
    }
    checks = {
        "pool tensors hold exactly what was written": all(exact),
        "the pool's segments are cuvmm's, byte for byte": pool_bytes == stats["live"] and pool_bytes >= sum(sizes),
        "the tensor outside the pool is intact": exact_sum(outside).item() == mod_pattern_sum(outside.numel(), 999, 1),
    }
    return finish("pool_expandable.py", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
