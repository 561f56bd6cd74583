#!/usr/bin/env python3
"""One workload on cuvmm's torch_memory_saver API and, where it is installed, on torch_memory_saver.

    python3 tms_compare.py [--gib 16] [--cache-gib 4] [--reps 4] [--cpu-backup-backend pinned|mmap]
                           [--cuvmm-mode current|pool] [--json PATH]

Each implementation runs in a fresh process of its own (torch_memory_saver in its default
"preload" hook mode, under its configure_subprocess(), which its pauseable cuda_graph needs; cuvmm
as the process's allocator, or through MemPools with --cuvmm-mode pool), the code the same but
for the import:

  region(tag="weights", enable_cpu_backup=True): --gib GiB of bf16 matrices, filled from seeds;
  region(tag="kv_cache"): --cache-gib GiB, no backup, filled again after every resume;
  cuda_graph(g, tag="graph"): a forward (a reduction over the cache, matmuls through every
  weight) captured once; its output on a fixed input is the reference.

Then --reps cycles of: a pinned device-to-host copy of every weight (the bound, CUDA events),
pause("weights"), pause("kv_cache"), pause("graph") (each timed to completion), resume("weights"),
resume("kv_cache"), resume("graph"); every weight compared byte for byte with the copy taken
before the pause; the cache refilled, the graph replayed and its output compared bit for bit; the
host-to-device copy of the same bytes (the bound). Host resident memory is read before, while
paused and after each cycle.

The parent prints the pause and resume times of both side by side, each against the copy bounds
measured in its own process, with the ratios torch_memory_saver / cuvmm; the first cycle (where
backups are first allocated) is reported apart. Exit status 1 when any check fails in either.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from _common import (GiB, WeightsAndCache, add_sleep_comparison_args,  # noqa: E402
                     check_sleep_comparison_args, median, report_comparison, rss_bytes,
                     run_each_in_a_child, timed_copy, wall_time)

IMPLS = ("cuvmm", "torch_memory_saver")


def summarize(reps: list) -> dict:
    """Medians over the cycles after the first, the first apart; ratios to the copy bounds."""
    later = reps[1:] or reps
    out = {k: median(r[k] for r in later) for k in
           ("pause_weights_s", "pause_cache_s", "pause_graph_s", "resume_weights_s", "resume_cache_s",
            "resume_graph_s", "d2h_bound_s", "h2d_bound_s")}
    out["first_pause_weights_s"] = reps[0]["pause_weights_s"]
    out["first_resume_weights_s"] = reps[0]["resume_weights_s"]
    out["first_d2h_bound_s"] = reps[0]["d2h_bound_s"]
    out["pause_over_d2h"] = out["pause_weights_s"] / out["d2h_bound_s"]
    out["resume_over_h2d"] = out["resume_weights_s"] / out["h2d_bound_s"]
    out["first_pause_over_d2h"] = reps[0]["pause_weights_s"] / reps[0]["d2h_bound_s"]
    out["all_weights_intact"] = all(r["weights_intact"] for r in reps)
    out["all_graph_outputs_identical"] = all(r["graph_output_identical"] for r in reps)
    out["rss"] = {k: [r[k] for r in reps] for k in ("rss_before", "rss_paused", "rss_after")}
    return out


def table(results: dict) -> list:
    """Markdown rows: cuvmm, torch_memory_saver and the ratio tms / cuvmm for each figure."""
    names = [n for n in IMPLS if n in results]
    rows = ["| | " + " | ".join(names) + (" | torch_memory_saver / cuvmm |" if len(names) == 2 else " |"),
            "|---" * (len(names) + 1 + (len(names) == 2)) + "|"]

    def row(label, key, scale=1.0, fmt="{:.3f}", ratio=True):
        vals = [results[n]["summary"][key] for n in names]
        cells = [fmt.format(v * scale) if v is not None else "n/a" for v in vals]
        if len(names) == 2:
            a, b = vals
            cells.append(f"{b / a:.2f}x" if ratio and a and b is not None else "")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    row("first pause of the weights (s)", "first_pause_weights_s")
    row("first pause / pinned D2H copy", "first_pause_over_d2h", fmt="{:.2f}", ratio=False)
    row("pause of the weights (s, median of later cycles)", "pause_weights_s")
    row("pause / pinned D2H copy", "pause_over_d2h", fmt="{:.2f}", ratio=False)
    row("resume of the weights (s)", "resume_weights_s")
    row("resume / pinned H2D copy", "resume_over_h2d", fmt="{:.2f}", ratio=False)
    row("pause of the cache, discarded (ms)", "pause_cache_s", 1e3, "{:.1f}")
    row("resume of the cache (ms)", "resume_cache_s", 1e3, "{:.1f}")
    row("pause of the graph's memory (ms)", "pause_graph_s", 1e3, "{:.1f}")
    row("resume of the graph's memory (ms)", "resume_graph_s", 1e3, "{:.1f}")
    row("pinned D2H copy of the weights (s)", "d2h_bound_s", ratio=False)
    row("pinned H2D copy of the weights (s)", "h2d_bound_s", ratio=False)
    return rows


def child(args) -> dict:
    import torch
    if args.impl == "cuvmm":
        import cuvmm
        from cuvmm.torch_memory_saver import torch_memory_saver as saver
        if args.cuvmm_mode == "current":
            import cuvmm.torch
            cuvmm.torch.use_as_current_allocator()
    else:
        cuvmm = None
        from torch_memory_saver import torch_memory_saver as saver
    torch.cuda.init()
    torch.manual_seed(args.seed)
    backend = None if args.cpu_backup_backend == "default" else args.cpu_backup_backend
    rss0 = rss_bytes(missing=-1)
    wl = WeightsAndCache(args, lambda: saver.region(tag="weights", enable_cpu_backup=True, cpu_backup_backend=backend),
                         lambda: saver.region(tag="kv_cache"))
    g, static_y, ref_y = wl.capture(lambda g: saver.cuda_graph(g, tag="graph"))
    reps = []
    for rep in range(args.reps):
        rss_before = rss_bytes(missing=-1)
        d2h_s = timed_copy(wl.d2h)
        pw = wall_time(lambda: saver.pause("weights"))
        pc = wall_time(lambda: saver.pause("kv_cache"))
        pg = wall_time(lambda: saver.pause("graph"))
        rss_paused = rss_bytes(missing=-1)
        rw = wall_time(lambda: saver.resume("weights"))
        rc = wall_time(lambda: saver.resume("kv_cache"))
        rg = wall_time(lambda: saver.resume("graph"))
        intact = wl.weights_equal_host()
        wl.fill_cache()
        g.replay()
        torch.cuda.synchronize()
        same = torch.equal(static_y, ref_y)
        h2d_s = timed_copy(wl.h2d)
        rss_after = rss_bytes(missing=-1)
        reps.append({"pause_weights_s": pw, "pause_cache_s": pc, "pause_graph_s": pg, "resume_weights_s": rw,
                     "resume_cache_s": rc, "resume_graph_s": rg, "d2h_bound_s": d2h_s, "h2d_bound_s": h2d_s,
                     "weights_intact": intact, "graph_output_identical": same, "rss_before": rss_before,
                     "rss_paused": rss_paused, "rss_after": rss_after})
        print(f"{args.impl} rep {rep}: pause {pw:.3f}s (D2H {d2h_s:.3f}s) cache {pc * 1e3:.1f}ms "
              f"graph {pg * 1e3:.1f}ms; resume {rw:.3f}s (H2D {h2d_s:.3f}s) cache {rc * 1e3:.1f}ms "
              f"graph {rg * 1e3:.1f}ms; intact={intact and same}", file=sys.stderr, flush=True)
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    info = {"device": p.name, "torch": torch.__version__, "weight_bytes": wl.weight_bytes,
            "cache_bytes": wl.cache_bytes, "rss_start": rss0}
    if cuvmm is not None:
        info["cuvmm_library"] = cuvmm.library_path()
        info["cuvmm_has_backup"] = cuvmm.has_backup()
        info["cuvmm_mode"] = args.cuvmm_mode
    else:
        import torch_memory_saver
        info["tms_version"] = getattr(torch_memory_saver, "__version__", None)
    del g, static_y
    return {"impl": args.impl, "info": info, "reps": reps, "summary": summarize(reps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sleep_comparison_args(p, IMPLS)
    p.add_argument("--cpu-backup-backend", choices=("default", "pinned", "mmap"), default="default",
                   help="for both; default: each one's own (torch_memory_saver pinned, cuvmm pageable)")
    p.add_argument("--cuvmm-mode", choices=("current", "pool"), default="current")
    args = p.parse_args(argv)
    check_sleep_comparison_args(p, args)

    if args.impl is not None:
        Path(args.child_out).write_text(json.dumps(child(args)))
        return 0

    impls = [args.only] if args.only else list(IMPLS)
    if "torch_memory_saver" in impls and importlib.util.find_spec("torch_memory_saver") is None:
        print("torch_memory_saver is not installed: cuvmm only", file=sys.stderr)
        impls.remove("torch_memory_saver")
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    strip = {"--only", "--json"}
    kept, skip = [], False
    for a in passthrough:
        if skip:
            skip = False
            continue
        if a in strip:
            skip = True
            continue
        if any(a.startswith(s + "=") for s in strip):
            continue
        kept.append(a)
    def context_of(impl):
        if impl == "torch_memory_saver":
            from torch_memory_saver import configure_subprocess
            return configure_subprocess()
        return None

    results, failed = run_each_in_a_child(__file__, kept, impls, "tms-compare-", context_of)
    for impl, r in results.items():
        s = r["summary"]
        if not s["all_weights_intact"]:
            failed.append(f"{impl}: weights not bitwise intact after a resume")
        if not s["all_graph_outputs_identical"]:
            failed.append(f"{impl}: graph output not bitwise identical after a resume")
    if results:
        first = next(iter(results.values()))["info"]
        print(f"\n{first['device']}, PyTorch {first['torch']}: {first['weight_bytes'] / GiB:.2f} GiB of weights "
              f"(CPU backup, backend {args.cpu_backup_backend}), {first['cache_bytes'] / GiB:.2f} GiB cache, "
              f"{args.reps} cycles; cuvmm mode {args.cuvmm_mode}\n")
        print("\n".join(table(results)))
    return report_comparison("tms_compare", args, results, failed)


if __name__ == "__main__":
    sys.exit(main())
