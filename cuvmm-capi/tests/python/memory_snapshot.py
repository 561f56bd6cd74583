#!/usr/bin/env python3
"""PyTorch's memory snapshots under cuvmm: history recorded, blocks allocated, freed and put to
sleep, a snapshot dumped and checked against PyTorch's format, and rendered by
torch.cuda._memory_viz.

    python3 memory_snapshot.py [--out DIR] [--json PATH]

Writes DIR/snapshot.pickle (open it at https://pytorch.org/memory_viz), DIR/trace.html and
DIR/segments.html. Exit 1 when a check fails.
"""

import argparse
import os
import pickle
import sys
import tempfile

from _common import env_info, finish

import cuvmm
import cuvmm.torch as ct

STATES = {"active_allocated", "inactive", "active_pending_free"}


def allocate_here(torch, n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=tempfile.mkdtemp(prefix="cuvmm_snapshot_"))
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch
    import torch.cuda._memory_viz as viz

    ct.use_as_current_allocator()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    kept = allocate_here(torch, 3 << 20)
    small = allocate_here(torch, 4096)
    gone = allocate_here(torch, 1 << 20)
    del gone
    other = allocate_here(torch, 2 << 20)
    with cuvmm.tag("snapshot-weights"):
        weights = allocate_here(torch, 8 << 20)
    sleep_ok = True
    try:
        cuvmm.sleep("snapshot-weights")
    except Exception as e:  # noqa: BLE001
        sleep_ok = False
        print(f"sleep: {e}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "snapshot.pickle")
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        s = pickle.load(f)
    if sleep_ok:
        cuvmm.wake("snapshot-weights")
    blocks = {b["address"]: (seg, b) for seg in s["segments"] for b in seg["blocks"]}
    here = __file__

    def allocated_here(t):
        seg, b = blocks.get(t.data_ptr(), (None, None))
        return b is not None and b["state"] == "active_allocated" and any(
            f["filename"] == here and f["name"] == "allocate_here" for f in b["frames"])

    trace = s["device_traces"][torch.cuda.current_device()]
    actions = [e["action"] for e in trace]
    html_trace = viz.trace_plot(s)
    html_segments = viz.segment_plot(s)
    for name, html in (("trace.html", html_trace), ("segments.html", html_segments)):
        with open(os.path.join(args.out, name), "w") as f:
            f.write(html)
    summary = viz.segsum(s)
    weights_seg = blocks.get(weights.data_ptr(), ({}, {}))[0]
    result = {"env": env_info(), "out": args.out, "segments": len(s["segments"]), "trace_entries": len(trace),
              "sleep": sleep_ok, "summary_tail": summary.splitlines()[-9:-6]}
    print(summary, file=sys.stderr)
    checks = {
        "the snapshot has segments and device traces": bool(s["segments"]) and "device_traces" in s,
        "each segment is tiled by its blocks": all(
            seg["total_size"] == sum(b["size"] for b in seg["blocks"]) for seg in s["segments"]),
        "every block has a known state": all(b["state"] in STATES for _, b in blocks.values()),
        "live tensors are active_allocated with the stack that allocated them": all(
            allocated_here(t) for t in (kept, small, other)),
        "the trace has allocs and frees": "alloc" in actions and "free_completed" in actions,
        "the tag's segment says it sleeps": not sleep_ok or (weights_seg.get("cuvmm_tag") == "snapshot-weights"
                                                               and weights_seg.get("cuvmm_asleep") is True),
        "PyTorch's viewer renders it": "<html" in html_trace.lower() and "<html" in html_segments.lower(),
        "history off": (torch.cuda.memory._record_memory_history(enabled=None)
                        or not torch._C._cuda_isHistoryEnabled()),
    }
    return finish("memory_snapshot", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
