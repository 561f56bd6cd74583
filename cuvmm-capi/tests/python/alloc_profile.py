#!/usr/bin/env python3
"""Where the time of an allocation goes while a small Llama decodes: a sampling profile (Linux
``perf``) of one child of alloc_cost.py, PyTorch's allocator and cuvmm taking turns generation by
generation, its samples sorted by whose code they fell in and counted per allocation.

    python3 alloc_profile.py [--pairs 40] [--period-us 20] [--json PATH]

Each allocator's code runs only on its own turns, so the samples in it, over the allocations
made on those turns, are its time per allocation (an allocation and its free) in decoding, cache
misses and all: cuvmm's library, PyTorch's pluggable-allocator wrapper around it (its map of
live blocks and its lock), and PyTorch's caching allocator. The C library's malloc and free and
the locks run on both turns and are shown apart. The per-token gap the child measured at the
same time is put beside them in the same unit.

Needs Linux ``perf`` (``$PERF`` names another command); samples of one's own processes in user
space are enough (perf_event_paranoid 2).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from _common import median_pair_ratio
import alloc_cost

# Whose code a sample is in, from its shared object and symbol; the first match wins.
CLASSES = (
    ("cuvmm", lambda dso, sym: dso.startswith("libcuvmm")),
    ("pluggable wrapper", lambda dso, sym: "CUDAPluggableAllocator" in sym),
    ("caching allocator", lambda dso, sym: "CachingAllocator" in sym),
    ("malloc/free", lambda dso, sym: re.search(r"\b(_int_)?(malloc|free|cfree)\b|operator (new|delete)|tcache", sym)
     is not None),
    ("locks", lambda dso, sym: "pthread_mutex" in sym or "__lll_lock" in sym),
    ("libc10_cuda, unnamed", lambda dso, sym: dso.startswith("libc10_cuda") and sym.startswith("0x")),
)


def classify(dso, sym):
    for name, test in CLASSES:
        if test(dso, sym):
            return name
    return "other"


def parse_report(text):
    """(dso, symbol) -> samples, from ``perf report -F sample,dso,sym -t '\\t'``."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        parts = [p.strip() for p in line.split("\t")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        sym = parts[2][4:] if parts[2].startswith("[") else parts[2]  # "[.] name"
        out[(parts[1], sym)] = out.get((parts[1], sym), 0) + int(parts[0])
    return out


def summarise(samples, period_ns, allocations, child):
    by_class, top = {}, {}
    for (dso, sym), n in samples.items():
        c = classify(dso, sym)
        by_class[c] = by_class.get(c, 0) + n
        top.setdefault(c, []).append((n, f"{dso} {sym}"))
    ns = {c: n * period_ns / allocations for c, n in by_class.items()}
    ms = child["ms_per_token"]
    med = {a: statistics.median(v) for a, v in ms.items()}
    per_token = allocations / (len(ms["cuvmm"]) * child["tokens"])
    # Round by round, as alloc_cost.py reads a process: the ratio of the medians drifts.
    gap_ns = (median_pair_ratio(ms["native"], ms["cuvmm"]) - 1) * med["native"] * 1e6 / per_token
    return {
        "allocations_each": allocations, "allocations_per_token": per_token, "period_ns": period_ns,
        "ns_per_allocation": {c: round(v, 1) for c, v in sorted(ns.items(), key=lambda kv: -kv[1])},
        "cuvmm_side_ns": round(ns.get("cuvmm", 0) + ns.get("pluggable wrapper", 0), 1),
        "pytorch_side_ns": round(ns.get("caching allocator", 0), 1),
        "measured_gap_ns": round(gap_ns, 1),
        "ms_per_token_medians": med,
        "top": {c: [f"{n} {s}" for n, s in sorted(v, reverse=True)[:8]]
                for c, v in top.items() if c != "other"},
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=40, help="generation pairs in the child")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--period-us", type=float, default=20.0, help="CPU time between samples")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    cpu = sorted(os.sched_getaffinity(0))[-1]
    period_ns = int(args.period_us * 1000)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        # --loops 1: the child's torch.empty loops would add allocations of another kind.
        perf = os.environ.get("PERF", "perf")
        cmd = [perf, "record", "-q", "-e", "cpu-clock:u", "-c", str(period_ns), "-o", data, "--",
               sys.executable, os.path.join(here, "alloc_cost.py"), "--child-within", "--pairs",
               str(args.pairs), "--tokens", str(args.tokens), "--loops", "1"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, cwd=here,
                                 preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        except FileNotFoundError:
            print("perf is not installed", file=sys.stderr)
            return 2
        if run.returncode != 0:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        child = json.loads(run.stdout.strip().splitlines()[-1])
        child["tokens"] = args.tokens
        rep = subprocess.run([perf, "report", "-i", data, "--stdio", "--no-children", "--sort", "dso,sym",
                              "-F", "sample,dso,sym", "-t", "\t"], capture_output=True, text=True)
        if rep.returncode != 0:
            print(rep.stderr[-3000:], file=sys.stderr)
            return 1
    allocations = args.pairs * child["cuvmm_allocations_per_generation"]["cuvmm"]
    result = summarise(parse_report(rep.stdout), period_ns, allocations, child)
    result["same_tokens"] = child["same_tokens"]
    return alloc_cost.emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
