#!/usr/bin/env python3
"""Tensor.record_stream under cuvmm: a freed block is not reused while a side stream reads it.

    python3 record_stream.py [--trials 10] [--json PATH]
    python3 record_stream.py --no-hook    # the allocator without cuvmm's hooks: expected to FAIL

Each trial: x (filled with the trial's number) is made on the default stream; a side stream waits
for it, runs a slow kernel (torch.cuda._sleep) and then copies x into out; x.record_stream(side);
del x; at once a tensor of the same size is filled with -1 on the default stream. Passes when out
holds x's values in every trial (PyTorch's caching allocator gives that, 10 of 10). --no-hook
builds the same allocator without wire_hooks: the new tensor takes x's block while the side
stream still reads it.
"""

import argparse
import sys

from _common import MiB, env_info, finish

import cuvmm
import cuvmm.torch as ct


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--sleep-cycles", type=int, default=200_000_000, help="the side kernel's length (about 0.1 s)")
    p.add_argument("--no-hook", action="store_true", help="without cuvmm's hooks (expected to fail)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch

    if args.no_hook:
        shim = ct.raises_on_oom()
        if shim:
            ct._bound_shim()
        path, names = (ct._shim_path(), ("cuvmm_torch_malloc", "cuvmm_torch_free")) if shim else \
            (cuvmm.library_path(), ("cuvmm_malloc", "cuvmm_free"))
        torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(path, *names))
    else:
        ct.use_as_current_allocator()
    n = args.mib * MiB // 4
    side = torch.cuda.Stream()
    out = torch.empty(n, device="cuda")
    good, reused = 0, 0
    for trial in range(args.trials):
        x = torch.full((n,), float(trial + 1), device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(args.sleep_cycles)
            out.copy_(x)
        x.record_stream(side)
        addr = x.data_ptr()
        del x
        y = torch.full((n,), -1.0, device="cuda")
        reused += y.data_ptr() == addr
        torch.cuda.synchronize()
        good += bool((out == float(trial + 1)).all().item())
        del y
    print(f"side stream read the original values in {good} of {args.trials} trials; "
          f"the next tensor took the freed address {reused} times", file=sys.stderr)
    result = {"env": env_info(), "hooks": not args.no_hook, "trials": args.trials, "read_original": good,
              "address_reused_at_once": reused, "stats": cuvmm.stats()}
    checks = {"the side stream read the original values in every trial": good == args.trials}
    return finish("record_stream", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
