#!/usr/bin/env python3
"""A sender that frees the allocation of a tensor a receiver still maps must not hand that memory
to its next tensors: torch.multiprocessing on cuvmm, beside PyTorch's own allocator in one run.

    python3 share_free.py [--alloc all|native|cuvmm]

The sender (cuvmm under change_current_allocator, or PyTorch's allocator) fills int32 tensors of
several sizes (4 KiB to 64 MiB) with their own values and sends them to a spawned receiver, which
maps them. Then the sender frees each one's allocation while the receiver still holds it, the
ways PyTorch code does: ``untyped_storage().resize_(0)`` (FSDP's free of unsharded parameters),
a growing ``resize_``, an ``out=`` that resizes, and dropping the tensor. It allocates tensors of
the same sizes (several each), fills them, and the receiver checks that its tensors still hold
their values and writes new ones into them; the sender's new tensors must not change.

Checks: the receiver's tensors intact; the sender's new tensors untouched by the receiver's writes
and lying on none of the freed blocks' addresses; on cuvmm, ``stats()["freed_shared"]`` holding
the freed blocks while the receiver maps them and 0 once it lets go, the same after a receiver
that is killed while it holds one, and live bytes back at the end; a tensor allocated at the
address of a freed one (the receiver having let go, its mapping of the old pages revoked by the
sender's emptied cache) arrives with its own memory. About 30 s on one GPU.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from _common import KiB, MiB, env_info, finish

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (4 * KiB, 3 * MiB + 4 * KiB, 19 * MiB, 64 * MiB)
WAYS = ("resize_0", "grow", "out", "drop")


def receiver(q_in, q_out):
    """The spawned process: holds what it is sent, checks and overwrites it on request."""
    import torch
    torch.cuda.init()
    torch.empty(1, device="cuda:0")
    q_out.put(("ready", os.getpid()))
    held = None
    while True:
        cmd, payload = q_in.get()
        if cmd == "hold":
            held = payload
            torch.cuda.synchronize()
            q_out.put(("held", len(held)))
        elif cmd == "check_and_write":
            intact = [bool((t == v).all().item()) for t, v in zip(held, payload)]
            for t, v in zip(held, payload):
                t.fill_(v + 1000)
            t = None  # the loop's last tensor would stay mapped after a "drop"
            torch.cuda.synchronize()
            q_out.put(("checked", intact))
        elif cmd == "drop":
            held = None
            q_out.put(("dropped", None))
        elif cmd == "stop":
            q_out.put(("stopped", None))
            return


def free_allocation(t, way):
    """Frees the allocation under `t` the way PyTorch code does, keeping nothing of it."""
    import torch
    if way == "resize_0":
        t.untyped_storage().resize_(0)
    elif way == "grow":
        t.untyped_storage().resize_(t.untyped_storage().nbytes() * 2 + 512)
    elif way == "out":
        torch.ones(t.numel() * 2 + 128, dtype=t.dtype, device=t.device, out=t)
    # "drop": the caller deletes its last reference.


def sender(args):
    import torch
    import torch.multiprocessing as mp
    from _common import Alloc
    alloc = Alloc(args.alloc).setup()
    if alloc.uses_cuvmm:
        import cuvmm.torch  # noqa: F401  (installs the reduction)
    ctx = mp.get_context("spawn")
    result, checks = {"env": env_info()}, {}

    def start():
        q_in, q_out = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=receiver, args=(q_in, q_out), daemon=True)
        child.start()
        assert q_out.get(timeout=300)[0] == "ready"

        def ask(cmd, payload=None):
            q_in.put((cmd, payload))
            return q_out.get(timeout=300)[1]
        return child, ask

    def settle():
        if alloc.uses_cuvmm:
            deadline = time.time() + 60
            while cuvmm.torch.pending_shares() and time.time() < deadline:
                time.sleep(0.01)
            assert not cuvmm.torch.pending_shares(), "a receiver kept a tensor it was told to drop"
        torch.cuda.synchronize()

    def stats():
        return alloc.cuvmm_stats() or {}

    child, ask = start()
    settle()
    live0 = stats().get("live")
    sent, values, ranges = [], [], []
    for k, n in enumerate(SIZES):
        for j, way in enumerate(WAYS):
            v = 10 * k + j + 1
            t = torch.full((n // 4,), v, dtype=torch.int32, device="cuda:0")
            sent.append((t, way))
            values.append(v)
            ranges.append((t.data_ptr(), t.data_ptr() + n))
    assert ask("hold", [t for t, _ in sent]) == len(sent)
    # Every way frees the allocation while the receiver maps it, dropping the tensor included (the
    # hand-off holds the block in the allocator, not the storage in Python).
    freed_bytes = sum((t.untyped_storage().nbytes() + 511) // 512 * 512 for t, way in sent)
    refused = {}
    for t, way in sent:
        try:
            free_allocation(t, way)
        except RuntimeError as e:
            refused[way] = str(e)
    result["refused"] = refused
    if alloc.uses_cuvmm:
        checks["every way of freeing ran"] = not refused
    del t  # (the loop's last tensor)
    sent = None  # the dropped ones go now; the others' storages now hold other allocations
    torch.cuda.synchronize()
    during = stats().get("freed_shared")
    # The sender's next tensors, several of each size, with values the receiver never writes.
    fresh = [torch.full((n // 4,), 7, dtype=torch.int32, device="cuda:0") for n in SIZES for _ in range(6)]
    torch.cuda.synchronize()
    overlap = [(t.data_ptr(), r) for t in fresh for r in ranges
               if t.data_ptr() < r[1] and r[0] < t.data_ptr() + t.numel() * 4]
    intact = ask("check_and_write", values)
    torch.cuda.synchronize()
    untouched = all(bool((t == 7).all().item()) for t in fresh)
    checks["the receiver's tensors keep their values after the sender freed them"] = all(intact)
    checks["the sender's next tensors are untouched by the receiver's writes"] = untouched
    checks["no later tensor lies on a freed shared block"] = not overlap
    result.update(intact=intact, overlap=[[hex(a), hex(r[0])] for a, r in overlap[:8]],
                  freed_shared_during=during, freed_bytes=freed_bytes)
    assert ask("drop") is None
    settle()
    after = stats().get("freed_shared")
    if alloc.uses_cuvmm:
        checks["freed_shared holds the freed blocks while the receiver maps them"] = during == freed_bytes
        checks["freed_shared is 0 once the receiver let go"] = after == 0
    # The same address on new pages once the receiver let go (its mapping kept until the sender's
    # emptied cache revoked it): what arrives is the new tensor's memory.
    t = torch.full((64 * MiB // 4,), 5, dtype=torch.int32, device="cuda:0")
    assert ask("hold", [t]) == 1
    assert ask("drop") is None
    settle()
    addr = t.data_ptr()
    del t
    alloc.empty_cache()
    t = torch.full((64 * MiB // 4,), 9, dtype=torch.int32, device="cuda:0")
    result["reallocated_at_the_same_address"] = t.data_ptr() == addr
    assert ask("hold", [t]) == 1
    checks["a tensor at the address of a freed one arrives with its own memory"] = ask("check_and_write", [9]) == [True]
    assert ask("drop") is None
    del t
    settle()
    ask("stop")
    child.join(60)

    # A receiver killed while it maps a freed block: the block comes back.
    child, ask = start()
    t = torch.full((64 * MiB // 4,), 3, dtype=torch.int32, device="cuda:0")
    assert ask("hold", [t]) == 1
    t.untyped_storage().resize_(0)
    del t
    held_while_alive = stats().get("freed_shared")
    os.kill(child.pid, signal.SIGKILL)
    child.join(60)
    settle()
    after_death = stats().get("freed_shared")
    if alloc.uses_cuvmm:
        checks["a receiver killed while mapping a freed block gives it back"] = (
            held_while_alive == 64 * MiB and after_death == 0)
    del fresh
    settle()
    st = stats()
    if alloc.uses_cuvmm:
        checks["live bytes back at the end"] = st.get("live") == live0 and st.get("exported") == 0
    result.update(held_while_alive=held_while_alive, after_death=after_death, stats=st)
    return finish("share_free.py", args, result, checks)


def run_sender(alloc):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "sender", "--alloc", alloc]
    p = subprocess.run(cmd, cwd=HERE, stdout=subprocess.PIPE, text=True)
    sys.stdout.write("".join(line + "\n" for line in p.stdout.splitlines() if not line.startswith("RESULT ")))
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else {"error": f"exit {p.returncode}", "checks": {}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("all", "sender"), default="all")
    p.add_argument("--alloc", choices=("all", "native", "cuvmm"), default="all")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.role == "sender":
        return sender(args)
    allocs = ("native", "cuvmm") if args.alloc == "all" else (args.alloc,)
    runs = {a: run_sender(a) for a in allocs}
    checks = {}
    for a, r in runs.items():
        checks[f"{a} run completed"] = "intact" in r
        checks.update({f"{a}: {k}": v for k, v in r.get("checks", {}).items()})
    return finish("share_free.py", args, {"runs": runs}, checks)


if __name__ == "__main__":
    sys.exit(main())
