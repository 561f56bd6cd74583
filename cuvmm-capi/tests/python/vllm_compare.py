#!/usr/bin/env python3
"""One workload slept through vLLM's CuMemAllocator API: on cuvmm, and the way vLLM's own does it.

    python3 vllm_compare.py [--gib 16] [--cache-gib 4] [--reps 4] [--only cuvmm|vllm-style] [--json PATH]

Each implementation runs in a fresh process of its own, the code the same but for the allocator:

  cuvmm: cuvmm.vllm.CuMemAllocator (MemPools on cuvmm, one per tag; sleep and wake are cuvmm's,
    the weights' backup its default: pageable memory, released lazily at wake);
  vllm-style: vLLM's own sleep as its source (vllm/device_allocator/cumem.py) does it, on the
    same pools: at every sleep, each offloaded allocation is copied into a CPU tensor made then
    (pin_memory=True) with a synchronous copy, then every allocation is released (here: cuvmm's
    discarding sleep); at wake each is mapped again (cuvmm's wake) and the CPU tensor copied back
    and dropped; then, as vLLM does, gc.collect() and torch.cuda.empty_cache() after the sleep.
    PyTorch's caching host allocator keeps the pinned tensors for reuse after the first sleep.

  use_memory_pool(tag="weights"): --gib GiB of bf16 matrices, filled from seeds;
  use_memory_pool(tag="kv_cache"): --cache-gib GiB, discarded at each sleep and refilled;
  a CUDA graph of a forward through both (PyTorch's own graph pool), replayed after every wake.

Then --reps cycles of: the pinned device-to-host copy of every weight (the bound, CUDA events),
sleep(offload_tags=("weights",)), wake_up(), every weight compared byte for byte with the copy
taken before the sleep, the cache refilled, the graph replayed and its output compared bit for
bit, the host-to-device copy of the same bytes (the bound). The parent prints both side by side;
the first cycle (the first sleep of each process) apart. Exit status 1 when any check fails.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from _common import (GiB, WeightsAndCache, add_sleep_comparison_args,  # noqa: E402
                     check_sleep_comparison_args, median, report_comparison, rss_bytes,
                     run_each_in_a_child, timed_copy, wall_time)

IMPLS = ("cuvmm", "vllm-style")
# Host-wide kernel counters taken around each sleep: huge pages faulted in, huge-page faults that
# fell back to small pages, direct compaction stalls, pages scanned for reclaim by kswapd and by
# the faulting threads (a first sleep that waits on the kernel to find huge pages in fragmented
# memory, or to reclaim page cache, shows there).
VMSTAT = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "pgscan_kswapd", "pgscan_direct")


def vmstat() -> dict:
    try:
        with open("/proc/vmstat") as f:
            got = dict(line.split() for line in f if line.split()[0] in VMSTAT)
    except OSError:
        got = {}
    return {k: int(got.get(k, 0)) for k in VMSTAT}


def vllm_style_allocator(weights_of):
    """cuvmm.vllm.CuMemAllocator with vLLM's own sleep and wake_up: a pinned CPU tensor per
    offloaded allocation made at every sleep. ``weights_of(tag)`` lists the tag's allocations
    (the workload's tensors, each one allocation)."""
    from cuvmm.vllm import CuMemAllocator

    class VllmStyle(CuMemAllocator):
        def __init__(self):
            super().__init__()
            self.backups = {}

        def sleep(self, offload_tags=None):
            import torch
            if offload_tags is None:
                offload_tags = (CuMemAllocator.default_tag,)
            elif isinstance(offload_tags, str):
                offload_tags = (offload_tags,)
            for tag in self._tags:
                if tag in offload_tags:
                    for t in weights_of(tag):
                        src = t.view(-1).view(torch.uint8)
                        cpu = torch.empty(src.numel(), dtype=torch.uint8, device="cpu", pin_memory=True)
                        cpu.copy_(src)  # synchronous, as cudaMemcpy
                        self.backups[t.data_ptr()] = (t, cpu)
                self.api.sleep(tag, offload=False)
                self._asleep.add(tag)
            gc.collect()
            torch.cuda.empty_cache()

        def wake_up(self, tags=None):
            import torch
            for tag in list(self._tags):
                if tag in self._asleep and (tags is None or tag in tags):
                    self.api.wake(tag)
                    self._asleep.discard(tag)
            for ptr, (t, cpu) in list(self.backups.items()):
                t.view(-1).view(torch.uint8).copy_(cpu)
                del self.backups[ptr]
            torch.cuda.synchronize()

    return VllmStyle()


def summarize(reps: list) -> dict:
    """Medians over the cycles after the first, the first apart; ratios to the copy bounds."""
    later = reps[1:] or reps
    out = {k: median(r[k] for r in later) for k in ("sleep_s", "wake_s", "d2h_bound_s", "h2d_bound_s")}
    out["first_sleep_s"] = reps[0]["sleep_s"]
    out["first_wake_s"] = reps[0]["wake_s"]
    out["first_sleep_over_d2h"] = reps[0]["sleep_s"] / reps[0]["d2h_bound_s"]
    out["sleep_over_d2h"] = out["sleep_s"] / out["d2h_bound_s"]
    out["worst_later_sleep_over_d2h"] = max(r["sleep_s"] / r["d2h_bound_s"] for r in later)
    out["wake_over_h2d"] = out["wake_s"] / out["h2d_bound_s"]
    out["all_weights_intact"] = all(r["weights_intact"] for r in reps)
    out["all_graph_outputs_identical"] = all(r["graph_output_identical"] for r in reps)
    out["rss"] = {k: [r[k] for r in reps] for k in ("rss_before", "rss_asleep", "rss_after")}
    out["sleep_vmstat"] = [r.get("sleep_vmstat") for r in reps]
    return out


def table(results: dict) -> list:
    """Markdown rows: each implementation, and vllm-style / cuvmm where both ran."""
    names = [n for n in IMPLS if n in results]
    both = len(names) == 2
    rows = ["| | " + " | ".join(names) + (" | vllm-style / cuvmm |" if both else " |"),
            "|---" * (len(names) + 1 + both) + "|"]

    def row(label, key, scale=1.0, fmt="{:.3f}", ratio=True):
        vals = [results[n]["summary"][key] for n in names]
        cells = [fmt.format(v * scale) for v in vals]
        if both:
            cells.append(f"{vals[1] / vals[0]:.2f}x" if ratio and vals[0] else "")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    row("first sleep (s)", "first_sleep_s")
    row("first sleep / pinned D2H copy", "first_sleep_over_d2h", fmt="{:.2f}", ratio=False)
    row("sleep (s, median of later cycles)", "sleep_s")
    row("sleep / pinned D2H copy", "sleep_over_d2h", fmt="{:.2f}", ratio=False)
    row("slowest later sleep / its D2H copy", "worst_later_sleep_over_d2h", fmt="{:.2f}", ratio=False)
    row("first wake (s)", "first_wake_s")
    row("wake (s)", "wake_s")
    row("wake / pinned H2D copy", "wake_over_h2d", fmt="{:.2f}", ratio=False)
    row("pinned D2H copy of the weights (s)", "d2h_bound_s", ratio=False)
    row("pinned H2D copy of the weights (s)", "h2d_bound_s", ratio=False)
    return rows


def child(args) -> dict:
    import torch
    import cuvmm
    from cuvmm.vllm import CuMemAllocator
    torch.cuda.init()
    torch.manual_seed(args.seed)
    rss0 = rss_bytes(missing=-1)
    holder = {}
    alloc = (CuMemAllocator.get_instance() if args.impl == "cuvmm"
             else vllm_style_allocator(lambda tag: holder["wl"].weights if tag == "weights" else []))
    wl = WeightsAndCache(args, lambda: alloc.use_memory_pool(tag="weights"),
                         lambda: alloc.use_memory_pool(tag="kv_cache"))
    holder["wl"] = wl
    g, static_y, ref_y = wl.capture()
    usage = alloc.get_current_usage()
    reps = []
    for rep in range(args.reps):
        rss_before = rss_bytes(missing=-1)
        d2h_s = timed_copy(wl.d2h)
        kernel = vmstat()
        s = wall_time(lambda: alloc.sleep(offload_tags=("weights",)))
        kernel = {k: v - kernel[k] for k, v in vmstat().items()}
        rss_asleep = rss_bytes(missing=-1)
        w = wall_time(alloc.wake_up)
        intact = wl.weights_equal_host()
        wl.fill_cache()
        g.replay()
        torch.cuda.synchronize()
        same = torch.equal(static_y, ref_y)
        h2d_s = timed_copy(wl.h2d)
        rss_after = rss_bytes(missing=-1)
        reps.append({"sleep_s": s, "wake_s": w, "d2h_bound_s": d2h_s, "h2d_bound_s": h2d_s,
                     "weights_intact": intact, "graph_output_identical": same, "rss_before": rss_before,
                     "rss_asleep": rss_asleep, "rss_after": rss_after, "sleep_vmstat": kernel})
        print(f"{args.impl} rep {rep}: sleep {s:.3f}s (D2H {d2h_s:.3f}s); wake {w:.3f}s (H2D {h2d_s:.3f}s); "
              f"intact={intact and same}; during the sleep {kernel}", file=sys.stderr, flush=True)
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    info = {"device": p.name, "torch": torch.__version__, "weight_bytes": wl.weight_bytes,
            "cache_bytes": wl.cache_bytes, "rss_start": rss0, "usage_bytes": usage,
            "cuvmm_library": cuvmm.library_path()}
    del g, static_y
    return {"impl": args.impl, "info": info, "reps": reps, "summary": summarize(reps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sleep_comparison_args(p, IMPLS)
    args = p.parse_args(argv)
    check_sleep_comparison_args(p, args)
    if args.impl is not None:
        Path(args.child_out).write_text(json.dumps(child(args)))
        return 0

    keep = ["--gib", str(args.gib), "--cache-gib", str(args.cache_gib), "--dim", str(args.dim),
            "--cache-chunk-mib", str(args.cache_chunk_mib), "--batch", str(args.batch),
            "--reps", str(args.reps), "--seed", str(args.seed)]
    results, failed = run_each_in_a_child(__file__, keep, [args.only] if args.only else IMPLS, "vllm-compare-")
    for impl, r in results.items():
        s = r["summary"]
        if not s["all_weights_intact"]:
            failed.append(f"{impl}: weights not bitwise intact after a wake")
        if not s["all_graph_outputs_identical"]:
            failed.append(f"{impl}: graph output not bitwise identical after a wake")
        if r["info"]["usage_bytes"] < r["info"]["weight_bytes"] + r["info"]["cache_bytes"]:
            failed.append(f"{impl}: get_current_usage() {r['info']['usage_bytes']} is below what the pools hold")
    if results:
        first = next(iter(results.values()))["info"]
        print(f"\n{first['device']}, PyTorch {first['torch']}: {first['weight_bytes'] / GiB:.2f} GiB of weights "
              f"offloaded, {first['cache_bytes'] / GiB:.2f} GiB cache discarded, {args.reps} cycles, "
              "each implementation in a fresh process\n")
        print("\n".join(table(results)))
    return report_comparison("vllm_compare", args, results, failed)


if __name__ == "__main__":
    sys.exit(main())
