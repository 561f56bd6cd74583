#!/usr/bin/env python3
"""Where a hand-off of 64 x 256 MiB through torch.multiprocessing spends its time, on one
allocator, round by round (the first round hands over storages never shared before).

    python3 handoff_split.py native|cuvmm [--rounds 3] [--tensors 64] [--gib 16]

The receiver's calls are timed by wrapping them (cuvmm: ``cuvmm_take``, the descriptor's decode,
``torch.as_tensor``, the whole rebuild; PyTorch: ``_new_shared_cuda``, which opens the IPC handle,
and ``rebuild_cuda_tensor``), and the moments of each phase are taken from the sender's ``put``:
the pickling (``dump``), the first unpickling in the receiver (``loads``), the first and last
rebuild, and the receiver's kernel that reads every tensor once they are all rebuilt (``kernel``:
the device's first access to the memory). Prints one JSON line per allocator, milliseconds.
``CUVMM_ALLOC_CONF`` chooses cuvmm's configuration (``page=1GiB,tag_page=1GiB``, say).
"""

import argparse
import json
import statistics
import sys
import time

from _common import Alloc, handoff_tensors, load_read_kernels


def _timed(owner, name, totals, key=None, each=None):
    """Replaces ``owner.name`` with a wrapper that adds its time to ``totals[key]``."""
    f = getattr(owner, name)
    key = key or name

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            totals[key] = totals.get(key, 0.0) + dt
            if each is not None:
                each.append(dt)
    setattr(owner, name, wrapper)


def receiver(q_in, q_out, mode):
    import multiprocessing.queues as mq

    import torch
    torch.cuda.init()
    load_read_kernels(torch)
    totals, takes, marks = {}, [], {}
    if mode == "cuvmm":
        import cuvmm._torch_share as ts
        lib = ts._core.load()
        _timed(lib, "cuvmm_take", totals, "take", takes)
        _timed(ts._share, "decode", totals)
        _timed(torch, "as_tensor", totals)
        module, rebuild = ts, "_rebuild"
    else:
        import torch.multiprocessing.reductions as module
        _timed(torch.UntypedStorage, "_new_shared_cuda", totals, "open")
        rebuild = "rebuild_cuda_tensor"
    inner = getattr(module, rebuild)

    def first_and_last(*a, **k):
        marks.setdefault("rebuild_first", time.perf_counter())
        try:
            return inner(*a, **k)
        finally:
            marks["rebuild_last"] = time.perf_counter()
    setattr(module, rebuild, first_and_last)
    _timed(module, rebuild, totals, "rebuild")
    plain = mq._ForkingPickler

    class Loads(plain):
        @classmethod
        def loads(cls, b, *a, **k):
            marks.setdefault("loads", time.perf_counter())
            return plain.loads(b, *a, **k)
    mq._ForkingPickler = Loads
    q_out.put(("ready", None))
    while True:
        cmd, payload = q_in.get()
        if cmd == "stop":
            return
        if cmd == "handoff":
            got = time.perf_counter()
            torch.stack([t[-1] for t in payload]).sum().item()
            done = time.perf_counter()
            row = {**marks, "got": got, "done": done, **{k: v for k, v in totals.items()}}
            if takes:
                row["take_median_each"] = statistics.median(takes)
            q_out.put(("handoff", row))
        else:
            q_out.put((cmd, None))
        totals.clear()
        takes.clear()
        marks.clear()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("alloc", choices=("native", "cuvmm"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--gib", type=float, default=16)
    args = p.parse_args()
    import multiprocessing.queues as mq

    import torch
    import torch.multiprocessing as mp
    alloc = Alloc(args.alloc).setup()
    if alloc.uses_cuvmm:
        import cuvmm.torch  # noqa: F401  (installs the reduction)
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receiver, args=(q_in, q_out, args.alloc), daemon=True)
    child.start()
    q_out.get(timeout=300)
    # A first small hand-off: connections and imports are made before anything is timed.
    q_in.put(("warm", torch.ones(1000, device="cuda:0")))
    q_out.get(timeout=300)
    plain, dumped = mq._ForkingPickler, {}

    class Dumps(plain):
        @classmethod
        def dumps(cls, obj, protocol=None):
            dumped["dump_start"] = time.perf_counter()
            try:
                return plain.dumps(obj, protocol)
            finally:
                dumped["dump_end"] = time.perf_counter()
    mq._ForkingPickler = Dumps
    tensors = handoff_tensors(torch, args.gib, args.tensors)
    rows = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        q_in.put(("handoff", tensors))
        _, r = q_out.get(timeout=300)
        total = time.perf_counter() - t0
        # Moments as milliseconds after the put; durations as milliseconds.
        row = {k: (r.pop(k) - t0) * 1e3 for k in ("loads", "rebuild_first", "rebuild_last", "got", "done") if k in r}
        row.update({k: (v - t0) * 1e3 for k, v in dumped.items()})
        row["kernel"] = row.pop("done") - row["got"]
        row.update({k: v * 1e3 for k, v in r.items()})
        row["total"] = total * 1e3
        rows.append({k: round(v, 3) for k, v in row.items()})
        q_in.put(("drop", None))
        q_out.get(timeout=300)
    q_in.put(("stop", None))
    child.join(30)
    print(json.dumps({"alloc": args.alloc, "rounds": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
