#!/usr/bin/env python3
"""torch.cuda.memory_* statistics under cuvmm, answered from its counters in PyTorch's format.

    python3 torch_stats.py [--json PATH]

PyTorch's statistics functions are its own until cuvmm becomes the current allocator. Then, with
1 GiB held, memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved and
memory_stats must answer cuvmm's live, live_peak, mapped and mapped_peak; after del, the peak
stays and reset_peak_memory_stats brings it down; memory_summary must run.
"""

import argparse
import sys

from _common import GiB, env_info, finish

import cuvmm
import cuvmm.torch as ct


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch

    own = torch._C._cuda_memoryStats
    ct.use_as_current_allocator()
    answered = torch._C._cuda_memoryStats is not own and ct.is_current_allocator()

    def errs(fn):
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - what it is, is the point
            return None, f"{type(e).__name__}: {e}"

    x = torch.ones(GiB // 4, device="cuda")
    torch.cuda.synchronize()
    s = cuvmm.stats()
    held = {name: errs(getattr(torch.cuda, name)) for name in
            ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")}
    stats, stats_err = errs(torch.cuda.memory_stats)
    accel = getattr(torch, "accelerator", None)
    accel_allocated = errs(accel.memory_allocated) if hasattr(accel, "memory_allocated") else (None, "absent")
    del x
    torch.cuda.synchronize()
    peak_after_del = torch.cuda.max_memory_allocated()
    _, reset_err = errs(torch.cuda.reset_peak_memory_stats)
    peak_after_reset = torch.cuda.max_memory_allocated()
    summary, summary_err = errs(torch.cuda.memory_summary)
    print(f"held 1 GiB: {held}; after del: peak {peak_after_del}, after reset {peak_after_reset}", file=sys.stderr)
    result = {"env": env_info(), "held": held, "cuvmm": s, "stats_error": stats_err,
              "peak_after_del": peak_after_del, "peak_after_reset": peak_after_reset,
              "reset_error": reset_err, "summary_error": summary_err,
              "accelerator_memory_allocated": accel_allocated}
    v = {k: r[0] for k, r in held.items()}
    checks = {
        "under cuvmm they answer from cuvmm": answered,
        "no statistics function raises": all(r[1] is None for r in held.values())
        and None is stats_err is reset_err is summary_err,
        "memory_allocated is cuvmm's live bytes (1 GiB or more)": v["memory_allocated"] == s["live"] >= GiB,
        "max_memory_allocated is live_peak": v["max_memory_allocated"] == s["live_peak"] >= s["live"],
        "memory_reserved is mapped": v["memory_reserved"] == s["mapped"] >= s["live"],
        "max_memory_reserved is mapped_peak": v["max_memory_reserved"] == s["mapped_peak"] >= s["mapped"],
        "memory_stats has PyTorch's keys": stats is not None and stats.get("allocated_bytes.all.current") == s["live"]
        and "reserved_bytes.all.peak" in stats and "num_alloc_retries" in stats,
        "the peak outlives del and reset_peak_memory_stats lowers it":
            peak_after_del >= GiB and peak_after_reset < GiB,
        "memory_summary runs": isinstance(summary, str) and "allocated" in summary.lower(),
    }
    return finish("torch_stats", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
