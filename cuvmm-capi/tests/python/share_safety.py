#!/usr/bin/env python3
"""Whom a receiver of cuvmm tensors trusts, and blocks of any size above the export threshold,
through torch.multiprocessing on a GPU.

    python3 share_safety.py [--export-threshold 16MiB] [--json PATH]

* A spawned sender (cuvmm as PyTorch's allocator, with --export-threshold, so every tensor of at
  least that size is one physical allocation of its size) sends tensors of 19, 33 and 100 MiB
  (sizes no power of two) and one below the threshold through a queue; this process receives
  them, checks their exact sums, writes one element of each, and the sender must see the writes.
* As root: a second sender pickles a tensor and exits before it is received; a process running
  as user nobody takes the abstract socket name the pickle names; unpickling here must raise
  PermissionError, and that process must have had no token. Not root: skipped, and said so.

Checks: every tensor arrives with its sum and aliased; the impostor gets nothing. Exit status 1
when a check fails.
"""

import argparse
import os
import re
import sys

from _common import MiB, as_nobody, env_info, exact_sum, fill_mod_pattern, finish, mod_pattern_sum, squat

SIZES_MIB = (19, 33, 100, 3)  # the last below any sensible threshold: ordinary pages
MOD, ADD = 251, 7
ADDRESS = re.compile(rb"\x00cuvmm-handoff-[0-9]+-[0-9a-f]{16}")


def sender(q, back):
    """Spawned: the tensors through the queue, then whether the receiver's writes are seen."""
    import torch
    from _common import Alloc
    Alloc("cuvmm").setup()
    import cuvmm.torch  # noqa: F401  (installs the reduction)
    ts = [fill_mod_pattern(torch.empty(m * MiB // 4, dtype=torch.int32, device="cuda:0"), MOD, ADD)
          for m in SIZES_MIB]
    torch.cuda.synchronize()
    q.put(ts)
    back.get(timeout=300)  # the receiver has written
    torch.cuda.synchronize()
    q.put([int(t[0].item()) for t in ts])
    back.get(timeout=300)  # the receiver let go


def pickler(q):
    """Spawned: one tensor pickled for torch.multiprocessing, then exits without waiting."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    from _common import Alloc
    Alloc("cuvmm").setup()
    import cuvmm.torch  # noqa: F401
    t = torch.ones(1 << 20, device="cuda:0")
    q.put(bytes(ForkingPickler.dumps(t)))


def impostor(ctx):
    """The second bullet of the module's text: (checks, details)."""
    from multiprocessing.reduction import ForkingPickler
    q = ctx.Queue()
    p = ctx.Process(target=pickler, args=(q,))
    p.start()
    data = q.get(timeout=300)
    p.join(120)
    found = ADDRESS.search(data)
    if found is None:
        return {"the pickle names a hand-off address": False}, {}
    pid, said = as_nobody(squat, found.group(0))
    with said:
        ready = said.readline().strip() == "ready"
        try:
            ForkingPickler.loads(data)
            raised = "nothing"
        except PermissionError as e:
            raised = f"PermissionError: {e}"
        except Exception as e:
            raised = f"{type(e).__name__}: {e}"
        told = said.readline().strip()
    os.waitpid(pid, 0)
    checks = {
        "the impostor took the exited sender's name": ready,
        "unpickling refuses the impostor (PermissionError)": raised.startswith("PermissionError"),
        "the impostor got no token": told == "no token",
    }
    return checks, {"impostor_raised": raised, "impostor_said": told}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export-threshold", default="16MiB")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    # Before cuvmm is loaded, here and in the spawned processes (they inherit the environment).
    os.environ["CUVMM_ALLOC_CONF"] = ",".join(
        c for c in (os.environ.get("CUVMM_ALLOC_CONF"), f"export_threshold={args.export_threshold}") if c)
    import torch
    import torch.multiprocessing as mp
    import cuvmm.torch  # noqa: F401  (rebuilds what arrives)
    torch.cuda.init()
    torch.empty(1, device="cuda:0")
    ctx = mp.get_context("spawn")
    result, checks = {"env": env_info(), "export_threshold": args.export_threshold}, {}

    q, back = ctx.Queue(), ctx.Queue()
    s = ctx.Process(target=sender, args=(q, back))
    s.start()
    ts = q.get(timeout=300)
    sums = [int(exact_sum(t).item()) for t in ts]
    want = [mod_pattern_sum(m * MiB // 4, MOD, ADD) for m in SIZES_MIB]
    result["sizes_mib"] = list(SIZES_MIB)
    checks["every tensor arrives with its exact sum (19, 33, 100 MiB whole blocks; 3 MiB on pages)"] = sums == want
    for k, t in enumerate(ts):
        t[0] = -1 - k
    torch.cuda.synchronize()
    back.put("written")
    seen = q.get(timeout=300)
    checks["the sender sees each write (zero copy)"] = seen == [-1 - k for k in range(len(ts))]
    del ts, t
    back.put("dropped")
    s.join(120)
    checks["the sender exited cleanly"] = s.exitcode == 0

    if os.geteuid() == 0:
        more, details = impostor(ctx)
        checks.update(more)
        result.update(details)
    else:
        print("skipped: the impostor of another user needs root (to run a process as nobody)", file=sys.stderr)
        result["impostor"] = "skipped: not root"
    return finish("share_safety.py", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
