#!/usr/bin/env python3
"""Stream-ordered reuse across two streams, with the side stream kept busy.

    python3 two_streams.py --alloc cuvmm      [--iters 200]
    python3 two_streams.py --alloc cuvmm-pool [--iters 200]

Each iteration, with sizes drawn from a seeded generator (1 MiB..128 MiB):
  B  the side stream allocates `a`, fills it, runs a long matmul loop, then sums `a`; `a` is freed
     while that work is still queued, and the main stream at once allocates `b` (often the same
     size) and fills it. If the allocator gave `a`'s memory to the main stream before the side
     stream's work finished, the side stream's sum of `a` comes out wrong.
  A  the side stream allocates `c` of `a`'s size: a block freed on a stream may be reused at once
     on that stream (counted by address overlap with `a`).
  C  the side stream makes `d` and fills it; the main stream waits, runs its own matmuls and sums
     `d`; then `d` is freed and the side stream allocates and overwrites `e` of the same size.
     Ordering that free after the main stream's use is the user's job: Tensor.record_stream
     (honoured by PyTorch's caching allocator, so in cuvmm-pool), and under
     change_current_allocator, where CUDAPluggableAllocator does not forward record_stream, an
     explicit side.wait_stream(main) before the last reference goes. --trust-record-stream leaves
     that wait out to show the hazard: under --alloc cuvmm the sums of `d` are then expected to
     be wrong.
Every sum is exact (int32 data, int64 sums) and checked against a closed form on the host.
"""

import os

os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from _common import (MiB, Alloc, add_common_args, env_info, finish, fill_mod_pattern,  # noqa: E402
                     mod_pattern_sum, ranges_overlap)

MOD = 251


def span(t):
    return (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def main():
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]),
                        allocs=("cuvmm", "cuvmm-pool", "native"))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--min-mib", type=float, default=1)
    p.add_argument("--max-mib", type=float, default=128)
    p.add_argument("--burn-n", type=int, default=8192, help="matmul size of the busy loops")
    p.add_argument("--burn-side", type=int, default=4, help="matmuls the side stream runs before it reads `a`")
    p.add_argument("--burn-main", type=int, default=2, help="matmuls the main stream runs before it reads `d`")
    p.add_argument("--trust-record-stream", action="store_true",
                   help="case C: rely on record_stream alone (expected to fail under --alloc cuvmm)")
    args = p.parse_args()

    alloc = Alloc(args.alloc).setup()
    import torch

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dev = torch.device("cuda")
    main_s = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    fence = args.alloc == "cuvmm" and not args.trust_record_stream
    n_lo, n_hi = int(args.min_mib * MiB) // 4, int(args.max_mib * MiB) // 4
    counts = dict(same_stream_reuse=0, cross_stream_overlap_while_pending=0, side_still_busy_at_b=0,
                  e_reused_d=0, b_same_size=0)
    expect = {k: [] for k in ("a", "b", "c", "d", "e")}

    with alloc.scope():
        def burn_bufs():
            x = torch.randn(args.burn_n, args.burn_n, device=dev, dtype=torch.bfloat16)
            return x, torch.randn_like(x), torch.empty_like(x)

        side_bufs, main_bufs = burn_bufs(), burn_bufs()
        sums = {k: torch.zeros(args.iters, dtype=torch.int64, device=dev) for k in expect}
        torch.cuda.synchronize()
        st0 = alloc.cuvmm_stats()

        def burn(bufs, n):
            x, y, out = bufs
            for _ in range(n):
                torch.matmul(x, y, out=out)

        t_start = time.perf_counter()
        for i in range(args.iters):
            n_a = rng.randint(n_lo, n_hi)
            same = rng.random() < 0.5
            n_b = n_a if same else rng.randint(n_lo, n_hi)
            n_d = rng.randint(n_lo, n_hi)
            counts["b_same_size"] += same

            # B: freed on the side stream with work queued, wanted at once by the main stream.
            with torch.cuda.stream(side):
                a = torch.empty(n_a, dtype=torch.int32, device=dev)
                fill_mod_pattern(a, MOD, i + 1)
                burn(side_bufs, args.burn_side)
                sums["a"][i] = a.sum(dtype=torch.int64)
                side_done = side.record_event()
            span_a = span(a)
            expect["a"].append(mod_pattern_sum(n_a, MOD, i + 1))
            del a
            b = torch.empty(n_b, dtype=torch.int32, device=dev)
            busy = not side_done.query()  # still queued now means still queued when b was handed out
            counts["side_still_busy_at_b"] += busy
            counts["cross_stream_overlap_while_pending"] += busy and ranges_overlap(span(b), span_a)
            fill_mod_pattern(b, MOD, -(i + 2))
            sums["b"][i] = b.sum(dtype=torch.int64)
            expect["b"].append(mod_pattern_sum(n_b, MOD, -(i + 2)))
            del b

            # A: same stream, same size, right away.
            with torch.cuda.stream(side):
                c = torch.empty(n_a, dtype=torch.int32, device=dev)
                counts["same_stream_reuse"] += ranges_overlap(span(c), span_a)
                fill_mod_pattern(c, MOD, 3 * i + 5)
                sums["c"][i] = c.sum(dtype=torch.int64)
                expect["c"].append(mod_pattern_sum(n_a, MOD, 3 * i + 5))
                del c

            # C: made on the side stream, consumed on the main stream, freed, reused by the side stream.
            with torch.cuda.stream(side):
                d = torch.empty(n_d, dtype=torch.int32, device=dev)
                fill_mod_pattern(d, MOD, 7 * i + 11)
            main_s.wait_stream(side)
            burn(main_bufs, args.burn_main)
            sums["d"][i] = d.sum(dtype=torch.int64)
            expect["d"].append(mod_pattern_sum(n_d, MOD, 7 * i + 11))
            d.record_stream(main_s)
            if fence:
                side.wait_stream(main_s)
            span_d = span(d)
            del d
            with torch.cuda.stream(side):
                e = torch.empty(n_d, dtype=torch.int32, device=dev)
                counts["e_reused_d"] += ranges_overlap(span(e), span_d)
                fill_mod_pattern(e, MOD, -(5 * i + 13))
                sums["e"][i] = e.sum(dtype=torch.int64)
                expect["e"].append(mod_pattern_sum(n_d, MOD, -(5 * i + 13)))
                del e
        torch.cuda.synchronize()
        wall = time.perf_counter() - t_start

        got = {k: v.tolist() for k, v in sums.items()}
        wrong = {k: sum(1 for x, y in zip(got[k], expect[k]) if x != y) for k in expect}
        first_wrong = {k: next((j for j, (x, y) in enumerate(zip(got[k], expect[k])) if x != y), None)
                       for k in expect}
        st1 = alloc.cuvmm_stats()

    result = {"env": env_info(), "iters": args.iters, "wall_s": wall, "record_stream_fence": fence,
              "counts": counts, "wrong_sums": wrong, "first_wrong_iter": first_wrong}
    checks = {f"sums of {k} exact": wrong[k] == 0 for k in expect}
    # Also the sign of a free that returns before the stream's work is done, as stream-ordered
    # frees should; without it case B tests nothing.
    checks["side stream still busy when main allocated in most iterations"] = (
        counts["side_still_busy_at_b"] >= args.iters // 2)
    if st1 is not None:
        delta = {k: st1[k] - st0[k] for k in ("allocations", "frees", "cache_hits", "pages_created",
                                              "events_recorded")}
        result["cuvmm_delta"] = delta
        result["cuvmm"] = st1
    if args.alloc == "cuvmm":
        checks["cuvmm served most allocations from its cache"] = delta["cache_hits"] >= delta["allocations"] // 2
        checks["a freed block was reused at once on its stream"] = counts["same_stream_reuse"] > 0
    return finish("two_streams", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
