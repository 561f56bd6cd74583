#!/usr/bin/env python3
"""First and later sleeps through vLLM's API and through the C ABI, against their goals.

    python3 vllm_sleep_goals.py [--gib 16] [--cache-gib 4] [--reps 5] [--idle-s 8] [--json PATH]

Each way runs in a fresh process of its own, so that its first cycle is the first sleep of a
process:

  vllm: cuvmm.vllm.CuMemAllocator as a vLLM worker uses it: the weights loaded inside
    use_memory_pool(tag="weights") (which prepares their backup when the block ends), the cache
    inside use_memory_pool(tag="kv_cache"), sleep(offload_tags=("weights",)) (its gc.collect()
    and empty_cache included), and wake_up() on even cycles, wake_up(tags=["weights"]) then
    wake_up(tags=["kv_cache"]) on odd ones;
  capi: cuvmm as PyTorch's allocator (change_current_allocator) and the C ABI's tag, sleep and
    wake called directly, with no cuvmm_prepare_backup: weights under "weights" offloaded, cache
    under "kv_cache" discarded;
  capi-prepared: the same, with cuvmm_prepare_backup("weights") once the weights are loaded.

The workload is vllm_compare.py's (--gib GiB of bf16 weights, --cache-gib GiB of cache, a CUDA
graph through both replayed after every wake, every weight compared byte for byte after every
wake). The first sleep comes --idle-s seconds after the weights were loaded. In every cycle the
pinned device-to-host copy of the weights (CUDA events, after a warm-up copy) is taken just before
the sleep and the host-to-device copy just after the wake: each sleep and wake is divided by the
copy of its own cycle. A sleep is timed on the host from its call to its return, the device idle
before and after. Each process also reports the objects the collector tracks and one full
gc.collect() alone, and the host memory cuvmm holds pinned while awake.

Prints each ratio against its goal (vLLM's API: later sleeps <= 1.10x, the first <= 1.2x; the C
ABI unprepared: the first <= 1.5x); exit status 1 only when a check of the contents fails.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from _common import (GiB, WeightsAndCache, add_sleep_comparison_args, median, report_comparison, run_each_in_a_child,  # noqa: E402
                     timed_copy, wall_time)

WAYS = ("vllm", "capi", "capi-prepared")
# (way, which sleeps, goal over the pinned D2H copy)
GOALS = (("vllm", "first", 1.2), ("vllm", "later", 1.10), ("capi", "first", 1.5))


def summarize(reps: list) -> dict:
    """Each cycle's ratios; the first apart, the later ones as median and worst."""
    sleeps = [r["sleep_s"] / r["d2h_s"] for r in reps]
    wakes = [r["wake_s"] / r["h2d_s"] for r in reps]
    later = sleeps[1:] or sleeps
    return {"first_sleep": sleeps[0], "later_sleep": median(later), "worst_later_sleep": max(later),
            "first_wake": wakes[0], "later_wake": median(wakes[1:] or wakes),
            "first_sleep_s": reps[0]["sleep_s"], "later_sleep_s": median(r["sleep_s"] for r in reps[1:] or reps),
            "d2h_s": median(r["d2h_s"] for r in reps), "all_intact": all(r["intact"] for r in reps)}


def goal_lines(results: dict) -> list:
    """One line per goal: the figure, the goal, met or missed."""
    out = []
    for way, which, goal in GOALS:
        if way not in results:
            continue
        s = results[way]["summary"]
        got = s["first_sleep"] if which == "first" else s["worst_later_sleep"]
        what = "first sleep" if which == "first" else "slowest later sleep"
        out.append(f"{way}: {what} {got:.3f}x the pinned D2H copy (goal <= {goal:.2f}x): "
                   + ("met" if got <= goal else "MISSED"))
    return out


def pinned_bytes() -> int:
    import cuvmm
    f = cuvmm.load().cuvmm_pinned_bytes
    f.restype, f.argtypes = ctypes.c_uint64, []
    return int(f())


def collector() -> dict:
    """Objects the collector tracks now, and one full collection's time (median of three)."""
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        ts.append(time.perf_counter() - t)
    return {"tracked": len(gc.get_objects()), "collect_ms": median(ts) * 1e3}


def child(args) -> dict:
    import torch
    import cuvmm
    import cuvmm.torch as ct
    if args.impl != "vllm":
        ct.use_as_current_allocator()
    torch.cuda.init()
    if args.impl == "vllm":
        from cuvmm.vllm import CuMemAllocator
        alloc = CuMemAllocator.get_instance()
        scopes = (lambda: alloc.use_memory_pool(tag="weights"), lambda: alloc.use_memory_pool(tag="kv_cache"))

        def sleep():
            alloc.sleep(offload_tags=("weights",))

        def wake(rep):
            if rep % 2 == 0:
                alloc.wake_up()
            else:
                alloc.wake_up(tags=["weights"])
                alloc.wake_up(tags=["kv_cache"])
    else:
        scopes = (lambda: cuvmm.tag("weights"), lambda: cuvmm.tag("kv_cache"))

        def sleep():
            cuvmm.sleep("weights", offload=True)
            cuvmm.sleep("kv_cache", offload=False)

        def wake(rep):
            cuvmm.wake("weights")
            cuvmm.wake("kv_cache")

    wl = WeightsAndCache(args, *scopes)
    loaded = time.monotonic()
    if args.impl == "capi-prepared":
        cuvmm.prepare_backup("weights")
    g, y, ref = wl.capture()
    time.sleep(max(0.0, args.idle_s - (time.monotonic() - loaded)))
    gc_info = collector()
    reps = []
    for rep in range(args.reps):
        d2h = timed_copy(wl.d2h)
        s = wall_time(sleep)
        w = wall_time(lambda: wake(rep))
        weights_ok = wl.weights_equal_host()
        wl.fill_cache()
        g.replay()
        torch.cuda.synchronize()
        graph_ok = torch.equal(y, ref)
        intact = weights_ok and graph_ok
        h2d = timed_copy(wl.h2d)
        reps.append({"sleep_s": s, "wake_s": w, "d2h_s": d2h, "h2d_s": h2d, "intact": intact,
                     "pinned_awake": pinned_bytes()})
        print(f"{args.impl} cycle {rep}: sleep {s:.3f} s = {s / d2h:.3f}x D2H ({d2h:.3f} s); wake {w:.3f} s = "
              f"{w / h2d:.3f}x H2D; intact={intact} (weights {weights_ok}, graph {graph_ok}); pinned awake {reps[-1]['pinned_awake'] >> 20} MiB",
              file=sys.stderr, flush=True)
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    info = {"device": p.name, "torch": torch.__version__, "weight_bytes": wl.weight_bytes,
            "cache_bytes": wl.cache_bytes, "collector": gc_info, "cuvmm_library": cuvmm.library_path()}
    del g, y
    return {"way": args.impl, "info": info, "reps": reps, "summary": summarize(reps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sleep_comparison_args(p, WAYS)
    p.set_defaults(reps=5)
    p.add_argument("--idle-s", type=float, default=8.0)
    args = p.parse_args(argv)
    if args.impl is not None:
        Path(args.child_out).write_text(json.dumps(child(args)))
        return 0
    keep = [a for k in ("gib", "cache_gib", "dim", "cache_chunk_mib", "batch", "reps", "seed", "idle_s")
            for a in ("--" + k.replace("_", "-"), str(getattr(args, k)))]
    ways = [args.only] if args.only else list(WAYS)
    results, failed = run_each_in_a_child(__file__, keep, ways, "vllm-sleep-goals-")
    failed += [f"{w}: weights or graph output not intact after a wake" for w, r in results.items()
               if not r["summary"]["all_intact"]]
    if results:
        info = next(iter(results.values()))["info"]
        print(f"\n{info['device']}, PyTorch {info['torch']}: {info['weight_bytes'] / GiB:.2f} GiB offloaded, "
              f"{info['cache_bytes'] / GiB:.2f} GiB discarded, {args.reps} cycles, each way in a fresh process\n")
        print("| way | first sleep | later sleeps (median, slowest) | first wake | later wakes | "
              "D2H copy (s) | tracked objects | gc.collect alone (ms) | pinned awake (MiB) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for w, r in results.items():
            s, c = r["summary"], r["info"]["collector"]
            print(f"| {w} | {s['first_sleep']:.3f}x | {s['later_sleep']:.3f}x, {s['worst_later_sleep']:.3f}x | "
                  f"{s['first_wake']:.3f}x | {s['later_wake']:.3f}x | {s['d2h_s']:.3f} | {c['tracked']} | "
                  f"{c['collect_ms']:.1f} | {max(x['pinned_awake'] for x in r['reps']) >> 20} |")
        print()
        print("\n".join(goal_lines(results)))
    return report_comparison("vllm_sleep_goals", args, results, failed)


if __name__ == "__main__":
    sys.exit(main())
