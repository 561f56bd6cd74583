#!/usr/bin/env python3
"""Weight sync between processes on cuvmm memory: parameters shared once through
torch.multiprocessing, updated in place by the sender, read by a spawned receiver ordered by a
cuvmm.torch.SharedEvent; and what tagged memory that sleeps does while it is shared.

    python3 weight_sync.py [--rounds 5] [--sleep-cycles 400000000]

Each round the sender queues a long kernel (torch.cuda._sleep) and then an in-place fill of every
parameter with the round's number, publishes the event, and tells the receiver, which waits on
the event and checks every parameter holds that number. The same rounds are run once more with
the receiver skipping the wait: it must then see a stale value at least once, which shows the
slow writer really races the reader and that the event is what orders them.

Then, with parameters allocated under cuvmm.tag("weights"): sleeping the tag is refused while
the receiver holds them (its mapping would keep the old pages while the sender's wake maps new
ones), and succeeds once the receiver has let go; after a wake the parameters can be shared again.

Checks: every round with the wait reads the new values; without it, some round reads a stale
one; the sleep transitions. Exit status 1 when one fails.
"""

import argparse
import sys
import time

from _common import Alloc, env_info, finish


def receiver(q_in, q_out):
    import torch
    torch.cuda.init()
    torch.empty(1, device="cuda")
    params, event = q_in.get()
    q_out.put("ready")
    while True:
        msg = q_in.get()
        if msg[0] == "stop":
            break
        if msg[0] == "drop":
            params = event = None
            q_out.put("dropped")
            continue
        if msg[0] == "take":
            params, event = msg[1]
            q_out.put("taken")
            continue
        _, value, wait = msg
        if wait:
            event.acquire()
        # Read on this process's stream: min and max of every parameter, one sync at the end.
        lo = torch.stack([p.detach().min() for p in params]).min()
        hi = torch.stack([p.detach().max() for p in params]).max()
        q_out.put((lo.item(), hi.item()))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sleep-cycles", type=int, default=400_000_000,
                   help="length of the writer's delay kernel before each update (about 0.2 s on an H100)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    args.alloc = "cuvmm"
    import torch
    import torch.multiprocessing as mp
    Alloc("cuvmm").setup()
    import cuvmm.torch

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receiver, args=(q_in, q_out), daemon=True)
    child.start()

    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    params = [p for p in model.parameters()]
    event = cuvmm.torch.SharedEvent()
    q_in.put((params, event))
    assert q_out.get(timeout=300) == "ready"

    def rounds(wait: bool):
        seen = []
        for k in range(1, args.rounds + 1):
            value = float(k + (0 if wait else 100))
            torch.cuda._sleep(args.sleep_cycles)
            with torch.no_grad():
                for prm in params:
                    prm.fill_(value)
            event.publish()
            q_in.put(("read", value, wait))
            seen.append((value, q_out.get(timeout=300)))
            torch.cuda.synchronize()
        return seen

    with_wait = rounds(True)
    without_wait = rounds(False)
    checks = {
        "with the event, every round reads the new values": all(lo == hi == v for v, (lo, hi) in with_wait),
        "without the wait, some round reads a stale value (the writer is slow enough)":
            any(not (lo == hi == v) for v, (lo, hi) in without_wait),
    }

    # Tagged memory shared, then put to sleep.
    with cuvmm.tag("weights"):
        tagged = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    q_in.put(("take", (tagged, event)))
    assert q_out.get(timeout=300) == "taken"
    try:
        cuvmm.sleep("weights")
        refused = False
    except RuntimeError as e:
        refused = "shared" in str(e)
    checks["sleep of a tag refused while a receiver holds its memory"] = refused
    q_in.put(("drop",))
    assert q_out.get(timeout=300) == "dropped"
    deadline = time.time() + 60
    while cuvmm.torch.pending_shares() and time.time() < deadline:
        time.sleep(0.01)
    cuvmm.sleep("weights")
    asleep = cuvmm.tag_stats("weights")["asleep"]
    cuvmm.wake("weights")
    checks["the tag sleeps once the receiver let go, and wakes with its contents"] = (
        asleep and all(t.min().item() == t.max().item() == 7.0 for t in tagged))
    q_in.put(("take", (tagged, event)))
    assert q_out.get(timeout=300) == "taken"
    q_in.put(("read", 7.0, True))
    lo, hi = q_out.get(timeout=300)
    checks["shared again after the wake, the receiver reads the restored values"] = lo == hi == 7.0
    q_in.put(("stop",))
    child.join(60)
    result = {"env": env_info(), "with_wait": with_wait, "without_wait": without_wait}
    return finish("weight_sync.py", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
