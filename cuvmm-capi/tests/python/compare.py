#!/usr/bin/env python3
"""Compare train.py runs against the native allocator's run.

    python3 compare.py native.json cuvmm.json pool.json [--max-time-ratio 1.02] [--max-mem-ratio 1.05]

Checks: the loss bits of every run equal the native run's, step by step; each other run's median
step time is at most max-time-ratio times native's; a cuvmm run's peak driver-level memory
(total - free above the baseline) and its cuvmm mapped_peak are at most max-mem-ratio times
native's max_memory_allocated, for cuvmm-pool runs too (--pool-mem-ref driver holds those to
native's peak driver-level memory instead: there PyTorch's own caching allocator carves its blocks
out of the pool's segments just as it does natively, so its slack comes along). Prints a markdown table (one row a run, for
the README) and the RESULT line; exit status 1 on any failed check.

nccl_allreduce.py results may be given too (all ranks' JSONs are not needed, rank 0's is the
result): they are checked for correctness and their bus bandwidth is set against the native run's;
a run made with --ab on two ranks or more must have its second buffers (cuvmm-pool's, or native
ones in the control) at least 0.98 of its first ones at every size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

GiB = 1 << 30


def load(path):
    with open(path) as f:
        return json.loads(f.readline())


def compare_train(runs, max_time_ratio=1.02, max_mem_ratio=1.05, pool_mem_ref="allocated"):
    """runs: [(name, result dict)]. Returns (summary, checks, table_rows). Pure.

    Every run is held to native's max_memory_allocated, unless pool_mem_ref is "driver": then
    cuvmm-pool runs are held to native's peak driver-level use, since PyTorch's own caching
    allocator places the blocks inside cuvmm's segments and its slack (native's reserved over
    allocated) comes along unchanged."""
    natives = [(n, r) for n, r in runs if r.get("alloc") == "native"]
    checks, summary, rows = {}, {}, []
    if not natives:
        return {"error": "no native run among the inputs"}, {"native_run_present": False}, rows
    ref_name, ref = natives[0]
    ref_alloc = ref.get("torch_max_memory_allocated")
    ref_time = ref["median_step_s"]
    summary["reference"] = ref_name
    summary["native_max_memory_allocated"] = ref_alloc
    summary["native_peak_driver_used"] = ref["peak_driver_used"]
    # What the driver sees beyond the allocator's peak under native: the context-free part of
    # libraries and kernels plus native's own caching slack; the bound below charges it to cuvmm.
    summary["native_driver_over_allocated"] = ref["peak_driver_used"] / ref_alloc if ref_alloc else None
    per_run = {}
    for name, r in runs:
        same_losses = r["loss_bits"] == ref["loss_bits"]
        first_diff = next((i for i, (a, b) in enumerate(zip(r["loss_bits"], ref["loss_bits"])) if a != b), None)
        time_ratio = r["median_step_s"] / ref_time
        paired = [a / b for a, b in zip(r["step_s"][r["config"]["warmup"]:], ref["step_s"][ref["config"]["warmup"]:])]
        if r["alloc"] == "cuvmm-pool" and pool_mem_ref == "driver":
            mem_ref, mem_ref_name = ref["peak_driver_used"], "native peak driver used"
        else:
            mem_ref, mem_ref_name = ref_alloc, "native max_memory_allocated"
        mem_ratio = r["peak_driver_used"] / mem_ref if mem_ref else None
        mapped_ratio = r["cuvmm_mapped_peak"] / mem_ref if mem_ref and "cuvmm_mapped_peak" in r else None
        info = {
            "alloc": r["alloc"], "losses_identical": same_losses, "first_loss_diff_step": first_diff,
            "median_step_s": r["median_step_s"], "time_ratio": time_ratio,
            "paired_time_ratio_median": statistics.median(paired) if paired else None,
            "peak_driver_used": r["peak_driver_used"], "memory_reference": mem_ref_name,
            "peak_driver_over_reference": mem_ratio,
            "peak_driver_over_native_allocated": r["peak_driver_used"] / ref_alloc if ref_alloc else None,
            "cuvmm_mapped_peak": r.get("cuvmm_mapped_peak"), "mapped_peak_over_reference": mapped_ratio,
            "run_passed": r.get("pass"),
        }
        per_run[name] = info
        checks[f"{name}: run passed its own checks"] = bool(r.get("pass"))
        checks[f"{name}: losses bitwise identical to native"] = same_losses and len(r["loss_bits"]) == len(ref["loss_bits"])
        if r["alloc"] != "native":
            checks[f"{name}: median step time <= {max_time_ratio} x native"] = time_ratio <= max_time_ratio
            checks[f"{name}: peak driver memory <= {max_mem_ratio} x {mem_ref_name}"] = (
                mem_ratio is not None and mem_ratio <= max_mem_ratio)
            if mapped_ratio is not None:
                # Sampled after each step, driver use misses a peak inside a step when an
                # allocator hands pages back before the step ends; mapped_peak does not.
                checks[f"{name}: cuvmm mapped_peak <= {max_mem_ratio} x {mem_ref_name}"] = (
                    mapped_ratio <= max_mem_ratio)
        env = r.get("env", {})
        rows.append("| {alloc} | {dev} | {steps} | {ms:.1f} | {tr:.3f} | {pk:.2f} | {mr} | {mp} | {same} |".format(
            alloc=r["alloc"], dev=env.get("device", "?"), steps=len(r["loss_bits"]), ms=r["median_step_s"] * 1e3,
            tr=time_ratio, pk=r["peak_driver_used"] / GiB,
            mr=f"{r['peak_driver_used'] / ref_alloc:.3f}" if ref_alloc else "n/a",
            mp=f"{r['cuvmm_mapped_peak'] / GiB:.2f}" if "cuvmm_mapped_peak" in r else "n/a",
            same="yes" if same_losses else f"no (step {first_diff})"))
    summary["runs"] = per_run
    return summary, checks, rows


TRAIN_HEADER = ("| allocator | device | steps | median step (ms) | time / native | peak driver used (GiB) "
                "| peak / native max_allocated | cuvmm mapped_peak (GiB) | losses bitwise = native |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def compare_nccl(runs, min_ab_ratio=0.98):
    """Bus bandwidth of each nccl_allreduce run against the native one, size by size; a run made
    with --ab also sets its MemPool buffers against its native ones. Pure."""
    checks, rows, summary = {}, [], {}
    ref = next((r for _, r in runs if r.get("alloc") == "native"), None)
    for name, r in runs:
        checks[f"{name}: all-reduce results exact"] = bool(r.get("pass"))
        if ref is not None:
            # Graph replays leave the host's launch work out; single timed calls count it.
            checks[f"{name}: timed as the native run was"] = (
                (r.get("timing", "call"), r.get("graph_calls")) == (ref.get("timing", "call"), ref.get("graph_calls")))
        for size, bw in zip(r["sizes"], r["busbw_gbps"]):
            ratio = None
            if ref is not None and size in ref["sizes"]:
                ref_bw = ref["busbw_gbps"][ref["sizes"].index(size)]
                ratio = bw / ref_bw if ref_bw > 0 else None  # one rank moves nothing over a bus
            rows.append(f"| {r['alloc']} | {size / (1 << 20):g} MiB | {bw:.1f} | "
                        + (f"{ratio:.3f} |" if ratio is not None else "n/a |"))
            summary.setdefault(name, {})[str(size)] = {"busbw_gbps": bw, "over_native": ratio}
        ab = r.get("ab")
        if ab:
            # Both memories in one process, timed in turn: the launch's own speed is common.
            # The second buffer is cuvmm's, or (a control) PyTorch's again.
            second = ab.get("second", "cuvmm-pool")
            # One rank moves nothing over a bus: its all-reduce is a no-op, and nothing is judged.
            bus = any(bw > 0 for bw in ab["busbw_gbps"])
            for size, bw, ratio in zip(r["sizes"], ab["busbw_gbps"], ab["ratio"]):
                rows.append(f"| {second}, same process | {size / (1 << 20):g} MiB | {bw:.1f} | "
                            + (f"{ratio:.3f} |" if bus else "n/a |"))
                summary[name][str(size)][f"{second}_same_process"] = {
                    "busbw_gbps": bw, "over_native": ratio if bus else None}
            if bus:
                checks[f"{name}: {second} buffers at least {min_ab_ratio} of native ones in the same process"] = (
                    len(ab["ratio"]) == len(r["sizes"]) and all(x >= min_ab_ratio for x in ab["ratio"]))
    return summary, checks, rows


NCCL_HEADER = "| allocator | size | bus bandwidth (GB/s) | / native |\n| --- | --- | --- | --- |"


def main(argv=None):
    p = argparse.ArgumentParser(description="compare train.py (and nccl_allreduce.py) results")
    p.add_argument("files", nargs="+")
    p.add_argument("--max-time-ratio", type=float, default=1.02)
    p.add_argument("--max-mem-ratio", type=float, default=1.05)
    p.add_argument("--pool-mem-ref", choices=("driver", "allocated"), default="allocated",
                   help="what cuvmm-pool's peak is held to: native's peak driver use, or its max_memory_allocated")
    args = p.parse_args(argv)
    runs = [(f, load(f)) for f in args.files]
    train = [(n, r) for n, r in runs if r.get("script") == "train"]
    nccl = [(n, r) for n, r in runs if r.get("script") == "nccl_allreduce"]
    other = [n for n, r in runs if r.get("script") not in ("train", "nccl_allreduce")]
    out, checks = {}, {}
    if other:
        checks["inputs are train or nccl_allreduce results"] = False
        out["unrecognised"] = other
    if train:
        s, c, rows = compare_train(train, args.max_time_ratio, args.max_mem_ratio, args.pool_mem_ref)
        out["train"], checks = s, {**checks, **c}
        print(TRAIN_HEADER)
        print("\n".join(rows))
    if nccl:
        s, c, rows = compare_nccl(nccl)
        out["nccl_allreduce"], checks = s, {**checks, **c}
        print(NCCL_HEADER)
        print("\n".join(rows))
    ok = bool(checks) and all(checks.values())
    for k, v in checks.items():
        print(f"{'ok  ' if v else 'FAIL'} {k}", file=sys.stderr)
    print("RESULT " + json.dumps({"script": "compare", **out, "checks": checks, "pass": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
