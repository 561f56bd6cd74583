#!/usr/bin/env python3
"""torch.cuda.set_per_process_memory_fraction is a limit cuvmm enforces.

    python3 memory_fraction.py [--fraction 0.5] [--json PATH]

Under cuvmm as the current allocator, with the fraction set: one tensor of (fraction + 0.1) of the
device must raise torch.OutOfMemoryError; one of (fraction - 0.1) must work; 1 GiB tensors then
fill up to the limit and the next raises torch.OutOfMemoryError with at most the limit held. After
set_per_process_memory_fraction(1.0) the larger tensor works. A fraction of 0 refuses even one byte,
as PyTorch's own allocator does.
"""

import argparse
import sys

from _common import GiB, env_info, finish

import cuvmm
import cuvmm.torch as ct


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch

    ct.use_as_current_allocator()
    torch.cuda.init()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(args.fraction)
    limit = int(args.fraction * total)

    def attempt(nbytes):
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            t.fill_(1)
            return t, None
        except torch.OutOfMemoryError as e:
            return None, str(e).splitlines()[0][:200]

    big = int((args.fraction + 0.1) * total)
    t, big_err = attempt(big)
    del t
    small, small_err = attempt(int((args.fraction - 0.1) * total))
    del small
    held, fill_err = [], None
    for _ in range(int(total // GiB) + 2):
        t, fill_err = attempt(GiB)
        if t is None:
            break
        held.append(t)
    held_bytes = len(held) * GiB
    del held, t
    torch.cuda.set_per_process_memory_fraction(0.0)
    zero, zero_err = attempt(1)
    del zero
    torch.cuda.set_per_process_memory_fraction(1.0)
    after, after_err = attempt(big)
    del after
    print(f"limit {limit / GiB:.1f} GiB: {big / GiB:.1f} GiB -> {big_err}; filled {held_bytes / GiB:.0f} GiB "
          f"then {fill_err}; without the limit {big / GiB:.1f} GiB -> {after_err or 'ok'}", file=sys.stderr)
    result = {"env": env_info(), "fraction": args.fraction, "total": total, "limit": limit,
              "over_limit_error": big_err, "under_limit_error": small_err, "filled": held_bytes,
              "fill_error": fill_err, "zero_fraction_error": zero_err, "after_reset_error": after_err, "stats": cuvmm.stats()}
    checks = {
        "a tensor past the fraction raises torch.OutOfMemoryError": big_err is not None,
        "a tensor under the fraction works": small_err is None,
        "filling stops at the limit with torch.OutOfMemoryError":
            fill_err is not None and limit - GiB < held_bytes <= limit,
        "fraction 0 refuses even one byte with torch.OutOfMemoryError": zero_err is not None,
        "fraction 1.0 removes the limit": after_err is None,
    }
    return finish("memory_fraction", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
