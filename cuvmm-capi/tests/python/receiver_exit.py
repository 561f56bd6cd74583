#!/usr/bin/env python3
"""A receiving process that returns normally exits with status 0.

    python3 receiver_exit.py [--runs 4] [--json PATH]

A sender on cuvmm (PyTorch's allocator changed to it) hands a 128 MiB and a 100 MiB tensor to a
spawned receiver, which reads both and returns while it still holds them: the process must exit
with status 0 each time, with its releases on their way (nothing aborts at exit), then again with
``export_threshold=64MiB``. Checks: every exit status 0, every tensor's sum, and the sender's
offers all let go once the receivers have exited.
"""

import argparse
import os
import sys
import time

from _common import MiB, env_info, finish


def receiver(q, out):
    import torch
    import cuvmm.torch  # noqa: F401  (rebuilds what arrives)
    ts = q.get(timeout=300)
    out.put([float(t.double().sum().item()) for t in ts])
    # Returns holding them: the lease releases run as the interpreter tears down.


def run(conf, runs):
    import torch
    import torch.multiprocessing as mp
    import cuvmm
    import cuvmm.torch
    ctx = mp.get_context("spawn")
    ts = [torch.full((128 * MiB // 4,), 1.0, device="cuda:0"), torch.full((100 * MiB // 4,), 2.0, device="cuda:0")]
    want = [float(t.double().sum().item()) for t in ts]
    codes, sums = [], []
    for _ in range(runs):
        q, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=receiver, args=(q, out))
        p.start()
        q.put(ts)
        sums.append(out.get(timeout=300) == want)
        p.join(120)
        codes.append(p.exitcode)
    deadline = time.time() + 30
    while cuvmm.torch.pending_shares() and time.time() < deadline:
        time.sleep(0.01)
    return {"exit_codes": codes, "sums_right": sums, "pending_after": cuvmm.torch.pending_shares(),
            "handoff": cuvmm.handoff_stats(), "conf": conf}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--role", default="all")
    p.add_argument("--conf", default="")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.role == "sender":
        from _common import Alloc
        if args.conf:
            os.environ["CUVMM_ALLOC_CONF"] = args.conf
        Alloc("cuvmm").setup()
        r = run(args.conf, args.runs)
        print("RESULT " + __import__("json").dumps(r), flush=True)
        return 0
    import json
    import subprocess
    results, checks = {}, {}
    for conf in ("", "export_threshold=64MiB"):
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "sender", "--runs", str(args.runs), "--conf", conf]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True).stdout
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        r = json.loads(lines[-1][7:]) if lines else {"error": out[-2000:]}
        name = conf or "default"
        results[name] = r
        checks[f"{name}: every receiver exits with status 0"] = r.get("exit_codes") == [0] * args.runs
        checks[f"{name}: every tensor arrives with its sum"] = r.get("sums_right") == [True] * args.runs
        checks[f"{name}: every offer let go once the receivers exited"] = r.get("pending_after") == 0
        print(f"{name}: exit codes {r.get('exit_codes')}, pending after {r.get('pending_after')}")
    return finish("receiver_exit.py", args, {"env": env_info(), "runs": results}, checks)


if __name__ == "__main__":
    sys.exit(main())
