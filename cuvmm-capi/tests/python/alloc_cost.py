#!/usr/bin/env python3
"""What one allocation costs under cuvmm beside PyTorch's allocator, each run in a fresh process,
the order alternating (native, cuvmm, cuvmm, native, ...), until the 95% confidence interval of
the per-token ratio is within --ci (relative half-width) or --cap seconds have passed.

    python3 alloc_cost.py [--cap 540] [--ci 0.01] [--repeats 5] [--cpus 1] [--json PATH]
    python3 alloc_cost.py --profile         # where cuvmm's time per allocation goes

Each child measures (i) ``torch.empty`` and its free in a Python loop, for sizes 512 B to 8 MiB
(median ns per pair), (ii) the time per generated token of a small Llama (transformers, random
weights, fixed seed, greedy ``model.generate``), the median of --repeats generations after a
warm-up one: a single generation per process varies by tens of percent between processes, and
(iii) references of the process's own speed that no allocator touches (a Python loop, an in-place
kernel launch; reported, with the per-token ratio over the launch reference, as a diagnostic). The
two processes of a round ran one after the other on the same machine, so the interval is that of
the rounds' paired ratios (the mean of their logarithms, with Student's t): what drifts between
rounds cancels within each. The JSON gives the medians, the ratios (cuvmm / native), the interval
and its upper end; the goal is a per-token ratio of at most 1.02, the whole interval included.

``--profile`` (cuvmm only): per size, ns per pair of ``torch.empty`` + free, and of
``cuvmm_malloc`` + ``cuvmm_free`` called through ctypes directly (the ctypes call's own cost
measured with a no-op C function and taken off): the rest is PyTorch's side (its wrapper, the
pluggable allocator's map and lock, the tensor).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import paired_ratio  # (also puts the package of this checkout or bundle on the path)

SIZES = [512 << k for k in range(0, 15)]  # 512 B .. 8 MiB


def pairs_ns(torch, size, n):
    x = torch.empty(size, dtype=torch.uint8, device="cuda")
    del x
    t = time.perf_counter_ns()
    for _ in range(n):
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
        del x
    return (time.perf_counter_ns() - t) / n


def decode_ms_per_token(torch, tokens, repeats):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    times = []
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        for _ in range(repeats):
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3 / tokens)
            assert out.shape[1] == 32 + tokens
    return statistics.median(times)


def references(torch):
    """What this process's speed is, apart from any allocator: a fixed Python loop (ms) and a
    kernel launch that allocates nothing (an in-place add on a tensor made before, µs), medians
    of five. A process that is slow for its whole life shows it here too, whichever allocator
    it has, so a ratio of per-token times over these tells the allocator from the process."""
    def cpu():
        t = time.perf_counter()
        sum(i * i for i in range(200_000))
        return (time.perf_counter() - t) * 1e3

    x = torch.zeros(1, device="cuda")

    def launch():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            x.add_(1)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6 / 2000

    launch()
    return {"cpu_ms": statistics.median(cpu() for _ in range(5)),
            "launch_us": statistics.median(launch() for _ in range(5))}


def child(alloc, tokens, loops, repeats):
    import torch

    if alloc == "cuvmm":
        import cuvmm.torch as ct

        ct.use_as_current_allocator()
    torch.cuda.init()
    pairs = {s: min(pairs_ns(torch, s, loops) for _ in range(3)) for s in SIZES}
    return {"pairs_ns": pairs, "ms_per_token": decode_ms_per_token(torch, tokens, repeats),
            "refs": references(torch)}


def profile(loops):
    import ctypes

    import torch

    import cuvmm
    import cuvmm.torch as ct

    ct.use_as_current_allocator()
    torch.cuda.init()
    lib = cuvmm.load()
    malloc, free = lib.cuvmm_malloc, lib.cuvmm_free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    noop = lib.cuvmm_trace_flush  # does nothing without trace=: the price of a ctypes call
    noop.restype, noop.argtypes = None, []
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    dev = torch.cuda.current_device()
    t = time.perf_counter_ns()
    for _ in range(loops):
        noop()
        noop()
    call = (time.perf_counter_ns() - t) / loops
    rows = []
    for s in SIZES:
        p = malloc(s, dev, stream)
        free(p, s, dev, stream)
        t = time.perf_counter_ns()
        for _ in range(loops):
            p = malloc(s, dev, stream)
            free(p, s, dev, stream)
        direct = (time.perf_counter_ns() - t) / loops - call
        total = pairs_ns(torch, s, loops)
        rows.append({"size": s, "torch_pair_ns": round(total), "cuvmm_pair_ns": round(direct),
                     "pytorch_side_ns": round(total - direct), "ctypes_call_ns": round(call / 2)})
    print(json.dumps({"profile": rows}, indent=1))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", type=float, default=540.0, help="seconds in all")
    p.add_argument("--ci", type=float, default=0.01)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="generations per process, their median kept")
    p.add_argument("--loops", type=int, default=20000)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--child", choices=("cuvmm", "native"))
    p.add_argument("--cpus", type=int, default=1,
                   help="every child runs on the same first CPUs this process may use (0: wherever the "
                        "kernel puts it). On one CPU a round's two processes ran at the same speed, "
                        "which drifted between rounds; let the kernel place them, one ran up to 1.5x "
                        "slower than the other whatever its allocator")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.profile:
        return profile(args.loops)
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.loops, args.repeats)))
        return 0
    runs = {"native": [], "cuvmm": []}
    cpus = sorted(os.sched_getaffinity(0))[:args.cpus] if args.cpus > 0 else None
    start, k = time.monotonic(), 0
    ratio, rel, high = float("nan"), float("inf"), float("inf")
    while time.monotonic() - start < args.cap:
        order = ("native", "cuvmm") if k % 2 == 0 else ("cuvmm", "native")
        for a in order:
            out = subprocess.run([sys.executable, __file__, "--child", a, "--tokens", str(args.tokens),
                                  "--loops", str(args.loops), "--repeats", str(args.repeats)],
                                 capture_output=True, text=True,
                                 cwd=os.path.dirname(os.path.abspath(__file__)),
                                 preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            runs[a].append(json.loads(out.stdout.strip().splitlines()[-1]))
        k += 1
        ratio, rel, high = paired_ratio([r["ms_per_token"] for r in runs["native"]],
                                        [r["ms_per_token"] for r in runs["cuvmm"]])
        print(f"round {k}: per-token ratio {ratio:.4f} +- {rel * 100:.2f}% (upper end {high:.4f})", file=sys.stderr)
        if rel <= args.ci:
            break
    med = {a: {"ms_per_token": statistics.median(r["ms_per_token"] for r in rs),
               "pairs_ns": {s: statistics.median(r["pairs_ns"][str(s)] for r in rs) for s in SIZES}}
           for a, rs in runs.items()}
    # The same ratio with each process's per-token time over its own launch reference: a
    # diagnostic of how much of the spread is the process's rather than the allocator's (not the
    # goal's figure).
    per_launch = {a: [r["ms_per_token"] / r["refs"]["launch_us"] for r in rs] for a, rs in runs.items()}
    norm, norm_rel, _ = paired_ratio(per_launch["native"], per_launch["cuvmm"])
    print(f"per token over each process's launch reference: {norm:.4f} +- {norm_rel * 100:.2f}%", file=sys.stderr)
    result = {
        "rounds": k, "cpus": cpus, "medians": med,
        "ms_per_token": {a: [r["ms_per_token"] for r in rs] for a, rs in runs.items()},
        "refs": {a: [r["refs"] for r in rs] for a, rs in runs.items()},
        "token_over_launch_ratio": norm, "token_over_launch_ci95_rel": norm_rel,
        "pair_ratio": {s: med["cuvmm"]["pairs_ns"][s] / med["native"]["pairs_ns"][s] for s in SIZES},
        "token_ratio": ratio, "token_ratio_ci95_rel": rel, "token_ratio_ci95_high": high,
        "ci_reached": rel <= args.ci, "goal_token_ratio_le_1_02": high <= 1.02,
    }
    line = json.dumps(result)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
