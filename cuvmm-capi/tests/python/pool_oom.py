#!/usr/bin/env python3
"""Out of memory through a MemPool is PyTorch's OutOfMemoryError, even with oom=abort.

    python3 pool_oom.py

Sets CUVMM_ALLOC_CONF=oom=abort (which stops the process on a failed cuvmm_malloc, where PyTorch
would make a tensor at address 0 of the NULL) before cuvmm reads it, then asks a MemPool for more
than the device holds. The NULL must reach PyTorch, which raises; the pool then still serves a
tensor whose contents are checked. Run as its own process: the failed request leaves the device
memory it mapped with cuvmm as idle pages.
"""

import os
import sys

os.environ["CUVMM_ALLOC_CONF"] = "oom=abort"  # before cuvmm reads it, at its first call

import argparse  # noqa: E402

from _common import GiB, Alloc, add_common_args, env_info, finish  # noqa: E402


def main():
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]),
                        allocs=("cuvmm-pool",))
    args = p.parse_args()
    import torch

    alloc = Alloc(args.alloc).setup()
    too_much = alloc.total + 8 * GiB
    raised, after_ok = None, False
    with alloc.scope():
        try:
            torch.empty(too_much, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            raised = type(e).__name__
        x = torch.full((1 << 20,), 7, dtype=torch.int32, device="cuda")
        after_ok = bool((x == 7).all().item())
    checks = {"out_of_memory_raised": raised == "OutOfMemoryError", "pool_serves_after": after_ok}
    return finish("pool_oom.py", args, {"env": env_info(), "asked_bytes": too_much, "raised": raised},
                  checks)


if __name__ == "__main__":
    sys.exit(main())
