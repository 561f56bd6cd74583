#!/usr/bin/env python3
"""torch.cuda.empty_cache() gives cuvmm's memory back to the device, as under PyTorch's allocator.

    python3 torch_empty_cache.py [--alloc cuvmm|native] [--gib 12] [--json PATH]

Allocates --gib GiB of 1 GiB tensors and writes them, drops them, calls torch.cuda.empty_cache()
(nothing of cuvmm's own), and reads torch.cuda.mem_get_info() before, while held and after. Passes
when the device's free memory after is within --slack-mib of before and the held memory came back.
"""

import argparse
import sys

from _common import GiB, MiB, env_info, finish

import cuvmm
import cuvmm.torch as ct


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alloc", choices=("cuvmm", "native"), default="cuvmm")
    p.add_argument("--gib", type=int, default=12)
    p.add_argument("--slack-mib", type=int, default=256, help="what may stay held (pages, workspaces)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch

    if args.alloc == "cuvmm":
        ct.use_as_current_allocator()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    before, total = torch.cuda.mem_get_info()
    held = [torch.empty(GiB, dtype=torch.uint8, device="cuda").fill_(i) for i in range(args.gib)]
    torch.cuda.synchronize()
    during = torch.cuda.mem_get_info()[0]
    del held
    torch.cuda.synchronize()
    after_free = torch.cuda.mem_get_info()[0]
    torch.cuda.empty_cache()
    after = torch.cuda.mem_get_info()[0]
    back = after - during
    print(f"free GiB: before {before / GiB:.2f}, held {during / GiB:.2f}, after del {after_free / GiB:.2f}, "
          f"after empty_cache {after / GiB:.2f} ({back / GiB:.2f} GiB back)", file=sys.stderr)
    result = {"env": env_info(), "gib": args.gib, "free_before": before, "free_held": during,
              "free_after_del": after_free, "free_after_empty_cache": after, "given_back": back,
              "cuvmm_stats": cuvmm.stats() if args.alloc == "cuvmm" else None}
    checks = {
        "the tensors took the memory": before - during >= args.gib * GiB - args.slack_mib * MiB,
        "empty_cache gave it back": back >= args.gib * GiB - args.slack_mib * MiB,
        "free after is free before, within the slack": after >= before - args.slack_mib * MiB,
    }
    return finish("torch_empty_cache", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
