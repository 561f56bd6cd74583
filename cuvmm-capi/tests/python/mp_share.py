#!/usr/bin/env python3
"""CUDA tensors handed to another process through torch.multiprocessing, on cuvmm and on
PyTorch's own allocator, in one run.

    python3 mp_share.py [--tensors 64] [--gib 16] [--rounds 3] [--runs 3] [--trips 1000]
                        [--trip-mib 1] [--no-nixl] [--export-threshold 256MiB] [--also CONF ...]

For each allocator (a sender process each: native, cuvmm under change_current_allocator with its
defaults, tensors above 1 MiB on 128 MiB pages and the receiver keeping its mappings while the
sender keeps the pages; cuvmm again with --export-threshold, 256MiB by default: a 256 MiB tensor
is one physical allocation) a spawned receiver gets:

* views of several dtypes, strides and offsets, and an nn.Parameter: it checks each against the
  sender's description (dtype, size, strides, storage offset, sum) and writes one element, which
  the sender must then see (zero copy); a view passed as a Process argument is checked too;
* --tensors tensors totalling --gib GiB, allocated after the views' hand-off (on cuvmm, their
  pages are placed in the receiver's mirror as they are mapped), --rounds times: the time from
  ``put`` to the receiver having them all usable (a kernel has read each, synchronised; its kernels
  run once before): the first round (storages never shared before) and the median of the others (the same storages again, as weight sync sends
  them every step; the receiver dropped them in between);
* with two GPUs, the same tensors read from GPU 1 (``copy_`` into GPU 1 memory: the copy engine),
  against the same copies from the receiver's own GPU 0 memory in the same process
  (cudaMemcpyPeer's path), and, when ``nixl`` is importable, a NIXL READ of the same tensors
  from GPU 1;
* memory back: the receiver holds the tensors, then drops them; the sender frees them and
  empties its cache (as a trainer's offload does), and the time until the device's free memory
  (cuMemGetInfo) is back where it was before they were allocated, the receiver still running;
* --trips round trips of a small view (--trip-mib MiB), after which descriptors (/proc/self/fd of
  both processes) and device memory (cuMemGetInfo) must be back where they were.

--runs times, each time with fresh senders, the configurations taking turns. Prints, for cuvmm
(default configuration, with --export-threshold) over the native runs, the ratios of the first
hand-off, the repeated one and the small round trip (the geometric mean of each run's ratio, with
its 95% interval), and each run's memory back. Checks: every view arrives intact and aliased; nothing leaks (cuvmm); goals: on cuvmm's
default configuration the first hand-off, a repeated one and a small round trip <= 1.0x the
native ones (the geometric means), the memory back on the device within 100 ms; GPU 1 reads cuvmm tensors at >= 0.95x
the copy engine's bandwidth. Exit status 1 when a check or goal fails.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

from _common import GiB, MiB, env_info, finish, handoff_tensors, load_read_kernels, paired_ratio

HERE = os.path.dirname(os.path.abspath(__file__))


def fds():
    return len(os.listdir("/proc/self/fd"))


def describe(t):
    import torch
    return {"dtype": str(t.dtype), "size": list(t.shape), "stride": list(t.stride()),
            "storage_offset": t.storage_offset(), "sum": float(t.double().sum().item()),
            "parameter": isinstance(t, torch.nn.Parameter), "requires_grad": t.requires_grad}


def receiver(q_in, q_out):
    """The spawned process: answers each command of the sender."""
    import torch
    torch.cuda.init()
    load_read_kernels(torch)
    two = torch.cuda.device_count() >= 2
    q_out.put(("ready", fds()))
    while True:
        cmd, payload = q_in.get()
        if cmd == "stop":
            q_out.put(("stopped", None))
            return
        if cmd == "views":
            out = {k: describe(v) for k, v in payload.items()}
            payload["whole"][0] = 12345.0
            torch.cuda.synchronize()
            q_out.put(("views", out))
        elif cmd == "handoff":
            torch.stack([t[-1] for t in payload]).sum().item()  # each one read by a kernel
            q_out.put(("handoff", len(payload)))
        elif cmd == "drop":
            del payload
            q_out.put(("dropped", None))
        elif cmd == "use_gpu1":
            # A context on GPU 1 from now on: imports grant GPU 1 access only in a process that
            # uses it, so the hand-off rounds above did not pay for it.
            torch.empty(1, device="cuda:1")
            q_out.put(("use_gpu1", None))
        elif cmd == "p2p":
            q_out.put(("p2p", p2p(payload) if two else None))
        elif cmd == "nixl":
            q_out.put(("nixl", nixl_read(*payload) if two else None))
        elif cmd == "trip":
            payload[0].item()
            del payload
            q_out.put(("trip", fds()))


def arg_child(t, expected, q):
    """A process given a tensor as its argument: whether it arrived intact."""
    q.put(describe(t) == expected)


def p2p(tensors):
    """Seconds to copy every tensor (on GPU 0) into GPU 1 memory, and the same bytes from this
    process's own GPU 0 memory."""
    import torch
    dst = [torch.empty_like(t, device="cuda:1") for t in tensors]
    own = torch.empty_like(tensors[0], device="cuda:0")

    def timed(srcs):
        best = None
        for _ in range(3):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            with torch.cuda.device(1):
                for d, s in zip(dst, srcs):
                    d.copy_(s, non_blocking=True)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        return best

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    shared = timed(tensors)
    # Checked before the reference copy below overwrites `dst`.
    ok = all(torch.equal(d[-16:].cpu(), t[-16:].cpu()) for d, t in zip(dst, tensors))
    local = timed([own] * len(tensors))
    return {"bytes": nbytes, "shared_s": shared, "peer_copy_s": local,
            "shared_gbps": nbytes / shared / 1e9, "peer_copy_gbps": nbytes / local / 1e9, "copied_intact": ok}


def nixl_read(agent_md, descs, sizes):
    """A NIXL READ of the sender's tensors (descs, of these sizes) into GPU 1 memory."""
    try:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config
        agent = nixl_agent("receiver", nixl_agent_config(backends=["UCX"]))
        remote = agent.deserialize_descs(descs)
        dst = [torch.empty(n, dtype=torch.uint8, device="cuda:1") for n in sizes]
        agent.register_memory(dst)
        name = agent.add_remote_agent(agent_md)
        local = agent.get_xfer_descs(dst)
        h = agent.initialize_xfer(operation="READ", local_descs=local, remote_descs=remote,
                                  remote_agent=name, notif_msg=b"done")
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        return {"state": state, "bytes": sum(sizes), "s": dt, "gbps": sum(sizes) / dt / 1e9}
    except Exception as e:  # reported beside the figures, never a failure of this script
        return {"error": f"{type(e).__name__}: {e}"}


def sender(args):
    import torch
    import torch.multiprocessing as mp
    from _common import Alloc
    alloc = Alloc(args.alloc).setup()
    if alloc.uses_cuvmm:
        import cuvmm.torch  # noqa: F401  (installs the reduction)
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receiver, args=(q_in, q_out), daemon=True)
    child.start()

    def ask(cmd, payload=None, expect=None):
        q_in.put((cmd, payload))
        tag, value = q_out.get(timeout=600)
        assert tag == (expect or cmd), (tag, cmd)
        return value

    _, child_fds0 = q_out.get(timeout=300)
    result, checks = {"env": env_info()}, {}

    # Views, dtypes, strides, offsets; an element written by the receiver.
    base = torch.arange(64 * 192, dtype=torch.float32, device="cuda:0")
    views = {
        "whole": base,
        "transposed": base.view(64, 192).t(),
        "strided_slice": base[100:5000:3],
        "bf16_tail": base.to(torch.bfloat16)[5:],
        "int8_rows": torch.arange(4096, device="cuda:0").to(torch.int8).view(64, 64)[3:40:2, 7:],
        "parameter": torch.nn.Parameter(torch.ones(33, 17, device="cuda:0") * 0.5),
        "scalar": base[77],
    }
    mine = {k: describe(v) for k, v in views.items()}
    theirs = ask("views", views)
    torch.cuda.synchronize()
    checks["every view arrives with its dtype, size, strides, offset and sum"] = mine == theirs
    checks["a write of the receiver is seen by the sender (zero copy)"] = base[0].item() == 12345.0
    if mine != theirs:
        result["views_mismatch"] = {k: (mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)}
    # A Process argument travels when the child starts, not through a queue.
    results = ctx.Queue()
    arg = views["transposed"]
    p = ctx.Process(target=arg_child, args=(arg, describe(arg), results))
    p.start()
    checks["a view passed as a Process argument arrives intact"] = results.get(timeout=300)
    p.join(60)
    del views, base, arg
    ask("drop", None, "dropped")

    # Hand-off of --tensors tensors totalling --gib GiB.
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    tensors = handoff_tensors(torch, args.gib, args.tensors)
    nbytes = sum(t.nbytes for t in tensors)
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        n = ask("handoff", tensors)
        times.append(time.perf_counter() - t0)
        assert n == len(tensors)
        ask("drop", None, "dropped")
    result["handoff"] = {"tensors": args.tensors, "bytes": nbytes, "rounds_s": times,
                         "median_s": statistics.median(times), "first_s": times[0],
                         "repeated_s": statistics.median(times[1:] or times)}

    if torch.cuda.device_count() >= 2:
        ask("use_gpu1")
        result["p2p"] = ask("p2p", tensors)
        ask("drop", None, "dropped")
        if not args.no_nixl and importlib.util.find_spec("nixl") is not None:
            result["nixl"] = nixl_send(tensors, ask)
        else:
            result["nixl"] = {"error": "nixl is not importable" if not args.no_nixl else "--no-nixl"}

    # Memory back: the receiver holds them, then lets go; this process frees them and empties its
    # cache, the receiver still running.
    ask("handoff", tensors)
    ask("drop", None, "dropped")
    del tensors
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    while True:
        free = torch.cuda.mem_get_info()[0]
        back_s = time.perf_counter() - t0
        if free >= free_before - 64 * MiB or back_s > 10:
            break
        time.sleep(0.001)
    result["memory_back"] = {"bytes": nbytes, "seconds": back_s, "missing": max(0, free_before - free),
                             "free_before": free_before, "free_after": free}
    print(f"{args.alloc}: {nbytes / GiB:.1f} GiB back on the device {back_s * 1e3:.1f} ms after the "
          f"cache was emptied ({max(0, free_before - free) / MiB:.0f} MiB missing)", file=sys.stderr)
    torch.cuda.synchronize()

    # Round trips: descriptors and device memory back where they were.
    x = torch.randn(args.trip_mib * MiB // 4, device="cuda:0")

    def settle():
        if alloc.uses_cuvmm:
            deadline = time.time() + 60
            while cuvmm.torch.pending_shares() and time.time() < deadline:
                time.sleep(0.01)
        torch.cuda.synchronize()

    for _ in range(20):
        ask("trip", x[1:])
    settle()
    fds0, used0 = fds(), alloc.driver_used()
    live0 = alloc.cuvmm_stats()["live"] if alloc.uses_cuvmm else None
    child_fds = None
    t0 = time.perf_counter()
    for _ in range(args.trips):
        child_fds = ask("trip", x[1:])
    trip_s = time.perf_counter() - t0
    settle()
    # The last trip's answer came after its tensor was dropped; one more to be sure it let go.
    child_fds_after = ask("trip", x[1:2])
    settle()
    fds1, used1 = fds(), alloc.driver_used()
    st = alloc.cuvmm_stats()
    result["trips"] = {
        "count": args.trips, "mean_ms": trip_s / args.trips * 1e3, "sender_fds": [fds0, fds1],
        "receiver_fds": [child_fds0, child_fds, child_fds_after], "driver_used": [used0, used1],
        "cuvmm_live": [live0, st["live"] if st else None], "cuvmm_exported": st["exported"] if st else None,
    }
    if alloc.uses_cuvmm:
        checks[f"sender descriptors back after {args.trips} round trips"] = fds1 == fds0
        checks[f"receiver descriptors steady over {args.trips} round trips"] = child_fds == child_fds_after
        # cuMemGetInfo also moves with the driver's own bookkeeping: within 2 MiB, where a leak
        # of one mapping per trip would be --trips x --trip-mib.
        checks[f"device memory back after {args.trips} round trips (cuMemGetInfo)"] = abs(used1 - used0) <= 2 * MiB
        checks["nothing left exported, live bytes back"] = st["exported"] == 0 and st["live"] == live0
    ask("stop", None, "stopped")
    child.join(60)
    result["stats"] = st
    return finish("mp_share.py", args, result, checks)


def nixl_send(tensors, ask):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
        agent = nixl_agent("sender", nixl_agent_config(backends=["UCX"]))
        agent.register_memory(tensors)
        descs = agent.get_serialized_descs(agent.get_xfer_descs(tensors))
        sizes = [t.numel() * t.element_size() for t in tensors]
        return ask("nixl", (agent.get_agent_metadata(), descs, sizes))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def run_sender(alloc, argv, conf=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "sender", "--alloc", alloc] + argv
    env = dict(os.environ)
    if conf:
        env["CUVMM_ALLOC_CONF"] = ",".join(c for c in (env.get("CUVMM_ALLOC_CONF"), conf) if c)
    p = subprocess.run(cmd, cwd=HERE, stdout=subprocess.PIPE, text=True, env=env)
    sys.stdout.write("".join(line + "\n" for line in p.stdout.splitlines() if not line.startswith("RESULT ")))
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else {"error": f"exit {p.returncode}", "checks": {}}


def measured(run):
    """Whether a sender's run got as far as the hand-offs and the round trips."""
    return "handoff" in run and "trips" in run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("all", "sender"), default="all")
    p.add_argument("--alloc", choices=("native", "cuvmm"), default="cuvmm")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=3,
                   help="fresh senders of each configuration, taking turns; ratios pair each run's")
    p.add_argument("--trips", type=int, default=1000)
    p.add_argument("--trip-mib", type=int, default=1)
    p.add_argument("--no-nixl", action="store_true")
    p.add_argument("--export-threshold", default="256MiB",
                   help="a run on cuvmm with this export_threshold (256MiB by default: a tensor that "
                        "large is one physical allocation, against the default's 4 MiB pages); "
                        "none: no such run")
    p.add_argument("--also", action="append", default=[], metavar="CONF",
                   help="one more cuvmm configuration (CUVMM_ALLOC_CONF's form), in the same runs")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.role == "sender":
        return sender(args)
    argv = [f"--tensors={args.tensors}", f"--gib={args.gib}", f"--rounds={args.rounds}",
            f"--trips={args.trips}", f"--trip-mib={args.trip_mib}"] + (["--no-nixl"] if args.no_nixl else [])
    # Each run starts fresh senders (and receivers) of every configuration, their order turning
    # from run to run; the ratios pair a run's cuvmm sender with its native one.
    configs = [("native", "native", None), ("cuvmm", "cuvmm", None)]
    has_whole = args.export_threshold not in ("none", "")
    if has_whole:
        configs.append((f"cuvmm export_threshold={args.export_threshold}", "cuvmm",
                        f"export_threshold={args.export_threshold}"))
    configs += [(f"cuvmm {conf}", "cuvmm", conf) for conf in args.also]
    runs = {name: [] for name, _, _ in configs}
    for k in range(args.runs):
        for name, alloc, conf in (configs if k % 2 == 0 else configs[::-1]):
            runs[name].append(run_sender(alloc, argv, conf))
    native, cuvmm_run = runs["native"][-1], runs["cuvmm"][-1]
    whole = runs[configs[2][0]][-1] if has_whole else None
    checks = {}
    for name, _, _ in configs:
        for k, run in enumerate(runs[name]):
            if name != "native":
                checks.update({f"{name} (run {k + 1}): {c}": v for c, v in run.get("checks", {}).items()})
            checks[f"{name} run {k + 1} completed"] = "handoff" in run
    goals, result = {}, {"runs": runs, "ratios": {}}
    for name, _, _ in configs[1:]:
        pairs = [(n, c) for n, c in zip(runs["native"], runs[name]) if measured(n) and measured(c)]
        if not pairs:
            continue
        r = {}
        for key, value in (("first", lambda x: x["handoff"]["first_s"]),
                           ("repeated", lambda x: x["handoff"]["repeated_s"]),
                           ("small", lambda x: x["trips"]["mean_ms"])):
            ratio, rel, high = paired_ratio([value(n) for n, _ in pairs], [value(c) for _, c in pairs])
            r[key] = ratio
            r[f"{key}_interval"] = rel
            r[f"{key}_each"] = [value(c) / value(n) for n, c in pairs]
        result["ratios"][name] = r
        med = lambda side, f: statistics.median(f(x) for x in side) * 1e3  # noqa: E731
        ns, cs = [n for n, _ in pairs], [c for _, c in pairs]
        print(f"{name} / native, {args.tensors} tensors of {args.gib} GiB in all, {len(pairs)} runs (geometric "
              f"mean of the runs' ratios, 95% interval): first hand-off {r['first']:.2f}x "
              f"+-{r['first_interval'] * 100:.0f}% (medians {med(cs, lambda x: x['handoff']['first_s']):.1f} / "
              f"{med(ns, lambda x: x['handoff']['first_s']):.1f} ms), repeated {r['repeated']:.2f}x "
              f"+-{r['repeated_interval'] * 100:.0f}% ({med(cs, lambda x: x['handoff']['repeated_s']):.1f} / "
              f"{med(ns, lambda x: x['handoff']['repeated_s']):.1f} ms), {args.trip_mib} MiB round trip "
              f"{r['small']:.2f}x +-{r['small_interval'] * 100:.0f}% "
              f"({med(cs, lambda x: x['trips']['mean_ms'] / 1e3):.2f} / "
              f"{med(ns, lambda x: x['trips']['mean_ms'] / 1e3):.2f} ms); each run's first "
              + ", ".join(f"{x:.2f}x" for x in r["first_each"]))
    if "cuvmm" in result["ratios"]:
        r = result["ratios"]["cuvmm"]
        result["handoff_ratio_cuvmm_to_native"] = r["repeated"]
        goals["first hand-off on cuvmm <= 1.0x native"] = r["first"] <= 1.0
        goals["repeated hand-off on cuvmm <= 1.0x native"] = r["repeated"] <= 1.0
        goals[f"{args.trip_mib} MiB round trip on cuvmm <= 1.0x native"] = r["small"] <= 1.0
    for name, _, _ in configs[:2]:
        for k, run in enumerate(runs[name]):
            back = run.get("memory_back")
            if back:
                print(f"memory back, {name} run {k + 1}: {back['bytes'] / GiB:.1f} GiB in "
                      f"{back['seconds'] * 1e3:.1f} ms ({back['missing'] / MiB:.0f} MiB missing)")
            if back and name == "cuvmm":
                goals[f"cuvmm run {k + 1}: the memory is back on the device within 100 ms"] = back["seconds"] <= 0.1
    p2p = cuvmm_run.get("p2p")
    if p2p:
        ratio = p2p["shared_gbps"] / p2p["peer_copy_gbps"]
        result["p2p_ratio"] = ratio
        checks["cuvmm: GPU 1 copied the shared tensors intact"] = p2p["copied_intact"]
        goals["GPU 1 reads cuvmm tensors >= 0.95x the copy engine"] = ratio >= 0.95
        print(f"GPU 1 reading GPU 0: cuvmm {p2p['shared_gbps']:.1f} GB/s, own memory "
              f"{p2p['peer_copy_gbps']:.1f} GB/s (ratio {ratio:.3f}); native allocator "
              f"{native.get('p2p', {}).get('shared_gbps', float('nan')):.1f} GB/s")
        for name, run in (("native", native), ("cuvmm", cuvmm_run), ("cuvmm export_threshold", whole or {})):
            print(f"NIXL READ from {name}: {run.get('nixl')}")
    if whole is not None and "handoff" in whole:
        print(f"cuvmm with export_threshold={args.export_threshold}: hand-off {whole['handoff']['median_s']:.3f} s, "
              f"GPU 1 reading {whole.get('p2p', {}).get('shared_gbps', float('nan')):.1f} GB/s")
    return finish("mp_share.py", args, result, checks, goals)


if __name__ == "__main__":
    sys.exit(main())
