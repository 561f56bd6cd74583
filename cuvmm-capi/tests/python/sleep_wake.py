#!/usr/bin/env python3
"""Sleep and wake of tagged memory under a captured CUDA graph, with timings against copy bounds.

    python3 sleep_wake.py --alloc cuvmm      [--gib 16] [--cache-gib 4] [--reps 3]
    python3 sleep_wake.py --alloc cuvmm-pool [--gib 16]
        [--backup pageable|pinned|disk] [--dir DIR] [--retain]

A stack of bf16 matrices (--gib GiB in all) is allocated under tag "weights" and a KV-cache-like
set of buffers (--cache-gib) under tag "cache". A CUDA graph of the forward (matmuls through every
weight, plus a reduction over the whole cache) is captured and replayed on a fixed input; its
output and a checksum per weight are the reference. Then, --reps times:

  sleep("weights", offload) and sleep("cache", discard); the driver's free memory must rise by at
  least 0.97 x the bytes the two tags had mapped (tag_stats before); tag_stats must say asleep,
  with the weights offloaded and the cache not; then something else takes most of the freed
  memory (untagged tensors through the same allocator under cuvmm, PyTorch's own allocator under
  cuvmm-pool), writes it, frees it and empties the caches; none of it may land on a sleeping
  address; wake both; the cache, whose contents were discarded, is filled again as at the
  start; the weights (byte for byte against their copy taken before the sleep) and the graph's
  output must equal the reference bit for bit, checked before any bound copy writes the weights.
  A second sleep of the sleeping weights and a wake of the woken cache must be refused.
  Allocating under a sleeping tag is left out: cuvmm refuses it with NULL, which PyTorch turns
  into an exception only under a MemPool; under change_current_allocator it makes a tensor at
  address 0.

The weights' backup is chosen with cuvmm_set_backup (--backup: pageable host memory through the
staging ring, the default; pinned host memory; a file in --dir), released at each wake unless
--retain. Each rep reports resident memory (VmRSS) and the host memory cuvmm holds pinned
(cuvmm_pinned_bytes) before the sleep, asleep, and after the wake.

Timings (medians over the reps after the first, the first sleep of the process): the offloading
sleep against a pinned device-to-host copy of the same bytes (per weight, copy_ with
non_blocking, CUDA events) taken in the same rep just before it, the wake of the weights against
the host-to-device copy back, and the discarding sleep of the cache, whose goal is 25 ms
(--discard-goal-ms). The bounds are taken in every rep because bus copies vary by more than a
tenth from one pass to the next: bounds taken once, apart, would make the ratios luck.

The wake follows the other user's frees at once, as it would in a server. After freeing large
allocations the driver works on its own for some tens of milliseconds, and any copy started then
runs slower (copy_after_free.py measures it without cuvmm; docs/PERFORMANCE.md, "Sleep and wake",
has its figures). So the wake's bound is the same copy taken in the same conditions: right after
the other user has come and gone again.
The copy back taken just after the wake, with nothing freed before it, is reported beside it.

Under cuvmm-pool each tag has its own MemPool, entered with the tag set: PyTorch asks the pool's
allocator for segments lazily, and the tag must be in force when it does; one pool for two tags
would let PyTorch place a cache tensor inside a weights segment.
"""

import os

os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from _common import (GiB, MiB, Alloc, WeightsAndCache, add_common_args, env_info, finish, median,  # noqa: E402
                     ranges_overlap, rss_bytes, timed_copy, lazyfree_bytes)
import cuvmm_torch  # noqa: E402


def span(t):
    return (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def refused(call) -> bool:
    """True when call raises RuntimeError, as cuvmm.h says a sleep of an asleep tag and a wake
    of an awake one must."""
    try:
        call()
    except RuntimeError:
        return True
    return False


def main():
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]),
                        allocs=("cuvmm", "cuvmm-pool"))
    p.add_argument("--gib", type=float, default=16, help="bytes of weights, GiB")
    p.add_argument("--cache-gib", type=float, default=4, help="bytes of cache, GiB")
    p.add_argument("--dim", type=int, default=8192, help="weights are dim x dim bf16")
    p.add_argument("--cache-chunk-mib", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=6, help="sleep/wake cycles; the first (which pins the backup) is reported apart")
    p.add_argument("--fill-fraction", type=float, default=0.9, help="of the freed memory, for the other user")
    p.add_argument("--discard-goal-ms", type=float, default=25.0)
    p.add_argument("--settle-ms", type=float, default=0.0,
                   help="pause between the other user's last free and the wake")
    p.add_argument("--capture-error-mode", choices=("global", "thread_local", "relaxed"), default="global")
    p.add_argument("--backup", choices=("pageable", "pinned", "disk"), default="pageable")
    p.add_argument("--dir", default=None, help="directory of the disk backup")
    p.add_argument("--retain", action="store_true", help="keep the weights' backup after each wake")
    p.add_argument("--no-prepare", dest="prepare", action="store_false",
                   help="leave out cuvmm.prepare_backup('weights') after loading the weights (the first sleep "
                        "then waits for fresh host memory)")
    args = p.parse_args()
    if args.backup == "disk" and not args.dir:
        p.error("--backup disk needs --dir")
    if not cuvmm_torch.has_sleep():
        return finish("sleep_wake", args, {"error": f"{cuvmm_torch.library_path()} has no sleep/wake ABI"},
                      {"library has cuvmm_set_tag, cuvmm_sleep, cuvmm_wake, cuvmm_get_tag_stats": False})

    alloc = Alloc(args.alloc).setup()
    import torch

    lib = cuvmm_torch.load()
    if not hasattr(lib, "cuvmm_set_backup"):
        return finish("sleep_wake", args, {"error": f"{cuvmm_torch.library_path()} has no cuvmm_set_backup"},
                      {"library has cuvmm_set_backup": False})
    lib.cuvmm_set_backup.restype = ctypes.c_int
    lib.cuvmm_set_backup.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
    lib.cuvmm_pinned_bytes.restype = ctypes.c_uint64
    lib.cuvmm_pinned_bytes.argtypes = []
    backend = {"pageable": 0, "pinned": 1, "disk": 2}[args.backup]
    if lib.cuvmm_set_backup(b"weights", backend, int(args.retain), args.dir.encode() if args.dir else None) != 0:
        raise RuntimeError(f"cuvmm_set_backup: {cuvmm_torch.last_error()}")

    def host_memory():
        """(resident bytes of this process, bytes cuvmm holds pinned)."""
        return rss_bytes(), int(lib.cuvmm_pinned_bytes())

    torch.manual_seed(args.seed)
    if args.cache_chunk_mib * MiB // 2 % args.dim:
        p.error("--cache-chunk-mib must hold whole rows of --dim bf16 values")
    pools = {}

    @contextlib.contextmanager
    def tagged(name):
        with cuvmm_torch.tag(name):
            if alloc.mode == "cuvmm-pool":
                pool = pools.setdefault(name, cuvmm_torch.mem_pool())
                with torch.cuda.use_mem_pool(pool):
                    yield
            else:
                yield

    wl = WeightsAndCache(args, lambda: tagged("weights"), lambda: tagged("cache"))
    weights, cache, weight_bytes = wl.weights, wl.cache, wl.weight_bytes
    # As the documentation advises once the weights are loaded: their backup is made ready in the
    # background, so that the first sleep writes into host memory already faulted in.
    prepared = cuvmm_torch.prepare_backup("weights") if args.prepare else 0

    def checksums():
        return torch.stack([w.view(torch.int16).sum(dtype=torch.int64) for w in weights]).tolist()

    graph_pool = cuvmm_torch.mem_pool() if alloc.mode == "cuvmm-pool" else None
    static_x = torch.randn(args.batch, args.dim, device=wl.dev, dtype=wl.bf16)
    wl.warm_up(static_x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=graph_pool.id if graph_pool is not None else None,
                          capture_error_mode=args.capture_error_mode):
        static_y = wl.forward(static_x)
    g.replay()
    torch.cuda.synchronize()
    ref_y = static_y.clone()
    ref_sums = checksums()
    g.replay()
    torch.cuda.synchronize()
    replay_repeatable = torch.equal(static_y, ref_y)

    # Copy bounds: the same bytes, the same per-tensor pieces, pinned host memory, events.
    wl.pin_host()
    wl.d2h()  # warm-up of the bounds; the host buffer is kept for the bounds of every rep
    wl.h2d()
    torch.cuda.synchronize()
    bounds_kept_weights = checksums() == ref_sums

    tagged_spans = [span(w) for w in weights] + [span(c) for c in cache]

    def other_user(nbytes):
        """Allocates nbytes in 1 GiB tensors, writes them, frees them and empties the caches.
        Returns how many landed on a tagged (possibly sleeping) address."""
        others, on_tagged, t = [], 0, None
        left = nbytes
        while left > 0:
            nb = min(left, GiB)
            t = torch.empty(nb, dtype=torch.uint8, device=wl.dev).fill_(0xA5)
            on_tagged += any(ranges_overlap(span(t), s) for s in tagged_spans)
            others.append(t)
            left -= nb
        torch.cuda.synchronize()
        del others, t
        alloc.empty_cache()
        return on_tagged
    reps = []
    for rep in range(args.reps):
        torch.cuda.synchronize()
        tw0, tc0 = cuvmm_torch.tag_stats("weights"), cuvmm_torch.tag_stats("cache")
        tagged_bytes = tw0["mapped"] + tc0["mapped"]
        free0 = torch.cuda.mem_get_info()[0]
        d2h_s = timed_copy(wl.d2h)
        mem_before = host_memory()

        t0 = time.perf_counter()
        cuvmm_torch.sleep("weights", offload=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        cuvmm_torch.sleep("cache", offload=False)
        torch.cuda.synchronize()
        t2 = time.perf_counter()

        mem_asleep = host_memory()
        free1 = torch.cuda.mem_get_info()[0]
        tw1, tc1 = cuvmm_torch.tag_stats("weights"), cuvmm_torch.tag_stats("cache")
        second_sleep_refused = refused(lambda: cuvmm_torch.sleep("weights", offload=True))

        # Another user takes most of what was freed, writes it, and gives it back.
        other_bytes = int(max(0, free1 - free0) * args.fill_fraction)
        on_sleeping = other_user(other_bytes)
        free2 = torch.cuda.mem_get_info()[0]
        time.sleep(args.settle_ms / 1e3)

        t3 = time.perf_counter()
        cuvmm_torch.wake("weights")
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        cuvmm_torch.wake("cache")
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        mem_woken = host_memory()
        tw2, tc2 = cuvmm_torch.tag_stats("weights"), cuvmm_torch.tag_stats("cache")
        second_wake_refused = refused(lambda: cuvmm_torch.wake("cache"))
        # What the wake restored, checked before any bound copy writes the weights again: every
        # weight byte for byte against the copy taken before the sleep, and the graph's output.
        weights_ok = wl.weights_equal_host() and checksums() == ref_sums
        wl.fill_cache()
        g.replay()
        torch.cuda.synchronize()
        out_ok = torch.equal(static_y, ref_y)
        h2d_s = timed_copy(wl.h2d)
        # The bound again in the wake's conditions: right after the same other user's frees
        # (and pause), during which the driver's own work after large frees slows any copy.
        other_user(other_bytes)
        time.sleep(args.settle_ms / 1e3)
        h2d_after_frees_s = timed_copy(wl.h2d)
        mem_settled = host_memory()
        lazy_settled = lazyfree_bytes()

        reps.append({
            "rss": {"before": mem_before[0], "asleep": mem_asleep[0], "after_wake": mem_woken[0],
                    "settled": mem_settled[0], "settled_lazyfree": lazy_settled},
            "pinned": {"before": mem_before[1], "asleep": mem_asleep[1], "after_wake": mem_woken[1],
                       "settled": mem_settled[1]},
            "tagged_mapped_before": tagged_bytes, "free_rise": free1 - free0,
            "free_rise_over_tagged": (free1 - free0) / tagged_bytes if tagged_bytes else None,
            "tag_weights_asleep": tw1, "tag_cache_asleep": tc1,
            "other_user_bytes": other_bytes, "other_user_on_sleeping_address": on_sleeping,
            "free_after_other_user_gone": free2, "tag_weights_awake": tw2, "tag_cache_awake": tc2,
            "sleep_offload_s": t1 - t0, "sleep_discard_s": t2 - t1, "d2h_bound_s": d2h_s, "h2d_bound_s": h2d_s,
            "h2d_bound_after_frees_s": h2d_after_frees_s,
            "wake_weights_s": t4 - t3, "wake_cache_s": t5 - t4,
            "weights_intact": weights_ok, "graph_output_identical": out_ok,
            "second_sleep_refused": second_sleep_refused, "second_wake_refused": second_wake_refused,
        })
        print(f"rep {rep}: sleep offload {t1 - t0:.3f}s (bound {d2h_s:.3f}s) discard {(t2 - t1) * 1e3:.1f}ms "
              f"wake {t4 - t3:.3f}s (bound {h2d_s:.3f}s, after frees {h2d_after_frees_s:.3f}s) + {(t5 - t4) * 1e3:.1f}ms, freed {(free1 - free0) / GiB:.2f} GiB "
              f"of {tagged_bytes / GiB:.2f}, intact={weights_ok and out_ok}; RSS MiB before/asleep/woken/settled "
              f"{'/'.join(f'{m[0] / MiB:.0f}' for m in (mem_before, mem_asleep, mem_woken, mem_settled))}, pinned MiB "
              f"{'/'.join(f'{m[1] / MiB:.0f}' for m in (mem_before, mem_asleep, mem_woken, mem_settled))}",
              file=sys.stderr, flush=True)

    def all_reps(pred):
        return all(pred(r) for r in reps)

    # The first cycle is the first sleep of the process (it makes the backup and the staging
    # ring): reported apart, and the timings are the medians of the cycles after it.
    later = reps[1:] or reps
    sleep_s = median(r["sleep_offload_s"] for r in later)
    wake_s = median(r["wake_weights_s"] for r in later)
    discard_s = median(r["sleep_discard_s"] for r in later)
    d2h_b = median(r["d2h_bound_s"] for r in later)
    h2d_b = median(r["h2d_bound_s"] for r in later)
    h2d_fb = median(r["h2d_bound_after_frees_s"] for r in later)

    def spread(key):
        return [min(r[key] for r in later), max(r[key] for r in later)]
    result = {
        "env": env_info(), "weights": len(weights), "weight_bytes": weight_bytes, "cache_bytes": wl.cache_bytes,
        "backup_prepared_bytes": prepared,
        "d2h_bound_s": d2h_b, "h2d_bound_s": h2d_b,
        "d2h_bound_gbps": weight_bytes / d2h_b / 1e9, "h2d_bound_gbps": weight_bytes / h2d_b / 1e9,
        "sleep_offload_s": sleep_s, "wake_weights_s": wake_s, "sleep_discard_ms": discard_s * 1e3,
        "wake_cache_ms": median(r["wake_cache_s"] for r in later) * 1e3,
        "first_sleep_offload_s": reps[0]["sleep_offload_s"],
        "first_sleep_over_its_d2h_bound": reps[0]["sleep_offload_s"] / reps[0]["d2h_bound_s"],
        "backup": {"kind": args.backup, "dir": args.dir, "retain": args.retain},
        "h2d_bound_after_frees_s": h2d_fb,
        "sleep_offload_over_d2h_bound": sleep_s / d2h_b, "wake_over_h2d_bound": wake_s / h2d_b,
        "wake_over_h2d_bound_after_frees": wake_s / h2d_fb,
        "fastest_slowest_s": {k: spread(k) for k in ("sleep_offload_s", "d2h_bound_s", "wake_weights_s", "h2d_bound_s",
                                                     "h2d_bound_after_frees_s")},
        "reps": reps, "cuvmm": cuvmm_torch.stats(),
    }
    checks = {
        "graph replay repeatable before any sleep": replay_repeatable,
        "copy bounds left the weights unchanged": bounds_kept_weights,
        "driver free memory rose by >= 0.97 x tagged bytes": all_reps(lambda r: r["free_rise"] >= 0.97 * r["tagged_mapped_before"]),
        "asleep tags report asleep, nothing mapped": all_reps(
            lambda r: r["tag_weights_asleep"]["asleep"] and r["tag_cache_asleep"]["asleep"]
            and r["tag_weights_asleep"]["mapped"] == 0 and r["tag_cache_asleep"]["mapped"] == 0),
        "weights offloaded, cache not": all_reps(
            lambda r: r["tag_weights_asleep"]["offloaded"] >= weight_bytes and r["tag_cache_asleep"]["offloaded"] == 0),
        "no other allocation on a sleeping address": all_reps(lambda r: r["other_user_on_sleeping_address"] == 0),
        "woken tags map what they mapped before": all_reps(
            lambda r: not r["tag_weights_awake"]["asleep"] and not r["tag_cache_awake"]["asleep"]
            and r["tag_weights_awake"]["mapped"] + r["tag_cache_awake"]["mapped"] == r["tagged_mapped_before"]),
        "weights bitwise intact after wake": all_reps(lambda r: r["weights_intact"]),
        "sleeping an asleep tag and waking an awake one are refused": all_reps(
            lambda r: r["second_sleep_refused"] and r["second_wake_refused"]),
        "graph output bitwise identical after wake": all_reps(lambda r: r["graph_output_identical"]),
    }
    ring = 64 * MiB  # the staging ring's pinned slots, with room for a second device's
    goals = {
        f"discarding sleep <= {args.discard_goal_ms:g} ms": all(
            r["sleep_discard_s"] * 1e3 <= args.discard_goal_ms for r in later),
        "first sleep of the process <= 1.3 x its pinned device-to-host bound":
            reps[0]["sleep_offload_s"] <= 1.3 * reps[0]["d2h_bound_s"],
        "every later sleep with offload <= 1.05 x its pinned device-to-host bound": all(
            r["sleep_offload_s"] <= 1.05 * r["d2h_bound_s"] for r in reps[1:]),
        "every wake <= 1.05 x the pinned host-to-device bound taken after the same frees": all(
            r["wake_weights_s"] <= 1.05 * r["h2d_bound_after_frees_s"] for r in reps),
    }
    if args.backup != "pinned" and not args.retain:
        goals["pinned memory while awake: at most the staging ring"] = all(
            r["pinned"]["settled"] <= ring for r in reps)
        # A backup given back lazily stays in VmRSS until the kernel needs it (LazyFree).
        goals["resident memory the kernel cannot take back is within the ring after wake"] = all(
            r["rss"]["settled"] - r["rss"]["settled_lazyfree"] <= r["rss"]["before"] + ring for r in reps)
    rc = finish("sleep_wake", args, result, checks, goals)
    del g, static_y, weights, cache, wl
    return rc


if __name__ == "__main__":
    sys.exit(main())
