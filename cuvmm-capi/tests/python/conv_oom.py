#!/usr/bin/env python3
"""A convolution near the memory limit: cuvmm falls back as PyTorch's own allocator does.

    python3 conv_oom.py [--json PATH] [--batch 32 --channels 256 --size 128]

cuDNN's convolution asks the allocator for a workspace and, when that raises
c10::OutOfMemoryError in C++, takes a smaller one or another algorithm. Three processes each fill
the device until only a margin is free above the convolution's output, for a sweep of margins,
and run the convolution (heuristic algorithm choice, then cudnn.benchmark's search):

  native            PyTorch's caching allocator;
  cuvmm             cuvmm under change_current_allocator, out of memory thrown as PyTorch's own
                    c10::OutOfMemoryError (cuvmm.torch.native_oom_error());
  cuvmm-lookalike   the same with CUVMM_TORCH_NATIVE_OOM=0: the exception Python sees as
                    torch.OutOfMemoryError but C++ does not catch as c10::OutOfMemoryError.

Checks: cuvmm throws the native class; wherever PyTorch's allocator runs the convolution, cuvmm
does too; every result matches the one computed with memory to spare; every refusal under cuvmm is
torch.OutOfMemoryError and the process computes afterwards. The look-alike's outcomes are reported
beside them: where it fails and the others do not is what the native class fixes.
"""

import argparse
import json
import os
import subprocess
import sys

from _common import MiB, env_info, finish

MODES = ("native", "cuvmm", "cuvmm-lookalike")
MARGINS_MIB = (0, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def child(args) -> dict:
    import torch

    import cuvmm
    import cuvmm.torch as ct

    if args.child != "native":
        ct.use_as_current_allocator()
    torch.cuda.init()
    dev = torch.device("cuda")
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator(device=dev).manual_seed(5)
    x = torch.randn(args.batch, args.channels, args.size, args.size, device=dev, generator=gen)
    conv = torch.nn.Conv2d(args.channels, args.channels, 3, padding=1, bias=False).to(dev)
    out_bytes = x.numel() * x.element_size()

    def release():
        torch.cuda.synchronize()
        if args.child == "native":
            torch.cuda.empty_cache()
        else:
            cuvmm.empty_cache()

    def outcome(fn):
        try:
            return "ok", fn()
        except Exception as e:  # noqa: BLE001 - which class it is, is the point
            kind = "OutOfMemoryError" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
            return kind, str(e).splitlines()[0][:200]

    def run():
        # The norm is a reduction (no temporary as large as the output, which the margin may not
        # hold), and without TF32 every algorithm agrees on it to far below the tolerance.
        with torch.no_grad():
            y = conv(x)
        s = torch.linalg.vector_norm(y).item()
        del y
        return s

    sweeps = {}
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        ref = run()  # memory to spare: the reference, and cuDNN's handles made
        rows = []
        for m in MARGINS_MIB:
            release()
            free, _ = torch.cuda.mem_get_info()
            margin = out_bytes + m * MiB
            hog_kind, hog = outcome(lambda: torch.empty(max(free - margin, 0), dtype=torch.uint8, device=dev))
            if hog_kind != "ok":
                rows.append({"margin_mib": m, "outcome": "hog " + hog_kind, "detail": hog})
                continue
            kind, got = outcome(run)
            close = kind == "ok" and abs(got - ref) <= 1e-4 * abs(ref)
            rows.append({"margin_mib": m, "outcome": kind, "close": close,
                         "detail": "" if kind == "ok" else got})
            del hog
        sweeps["benchmark" if benchmark else "heuristic"] = {"reference": ref, "rows": rows}
    release()
    after_kind, after = outcome(run)
    return {"mode": args.child, "native_oom_error": args.child != "native" and ct.native_oom_error(),
            "out_bytes": out_bytes, "sweeps": sweeps, "after": after_kind}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("CHILD " + json.dumps(child(args)), flush=True)
        return 0

    runs = {}
    for mode in MODES:
        env = dict(os.environ)
        if mode == "cuvmm-lookalike":
            env["CUVMM_TORCH_NATIVE_OOM"] = "0"
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--batch", str(args.batch),
               "--channels", str(args.channels), "--size", str(args.size)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("CHILD ")]
        runs[mode] = json.loads(lines[-1][6:]) if lines else {"mode": mode, "rc": r.returncode,
                                                              "stderr": r.stderr[-2000:]}
        for name, sweep in runs[mode].get("sweeps", {}).items():
            print(f"{mode:16} {name:9} " + " ".join(f"{row['margin_mib']}:{row['outcome']}" for row in sweep["rows"]),
                  file=sys.stderr)

    def rows(mode, sweep):
        return {row["margin_mib"]: row for row in runs[mode].get("sweeps", {}).get(sweep, {}).get("rows", [])}

    sweeps = ("heuristic", "benchmark")
    complete = all("sweeps" in runs[m] for m in MODES)
    as_torch, matches, refusals_oom, lookalike_misses = True, True, True, []
    for s in sweeps:
        nat, cv, la = rows("native", s), rows("cuvmm", s), rows("cuvmm-lookalike", s)
        for m, row in nat.items():
            if row["outcome"] == "ok" and cv.get(m, {}).get("outcome") != "ok":
                as_torch = False
            if row["outcome"] == "ok" and la.get(m, {}).get("outcome") != "ok":
                lookalike_misses.append(f"{s}:{m}MiB")
        for mode_rows in (nat, cv, la):
            matches &= all(r.get("close", True) or r["outcome"] != "ok" for r in mode_rows.values())
        refusals_oom &= all(r["outcome"] in ("ok", "OutOfMemoryError") or r["outcome"].startswith("hog")
                            for r in cv.values())
    result = {"env": env_info(), "runs": runs, "lookalike_fails_where_pytorch_runs": lookalike_misses}
    checks = {
        "the three runs completed": complete,
        "cuvmm throws c10::OutOfMemoryError": runs["cuvmm"].get("native_oom_error") is True,
        "wherever PyTorch's allocator runs the convolution, cuvmm does too": complete and as_torch,
        "every convolution that ran gives the reference result": complete and matches,
        "every refusal under cuvmm is torch.OutOfMemoryError": complete and refusals_oom,
        "cuvmm computes after the sweep": runs["cuvmm"].get("after") == "ok",
    }
    return finish("conv_oom", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
