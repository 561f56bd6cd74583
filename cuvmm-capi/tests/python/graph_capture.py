#!/usr/bin/env python3
"""CUDA graph capture and replay on cuvmm memory, with eager allocations in between.

    python3 graph_capture.py --alloc cuvmm      [--replays 20] [--graphs 2]
    python3 graph_capture.py --alloc cuvmm-pool
    python3 graph_capture.py --alloc native     (the reference behaviour)

Captures forward + backward (torch.autograd.grad) of a residual MLP stack with static inputs:
under cuvmm with a plain torch.cuda.graph(g), the capture's memory then comes from cuvmm_malloc,
which keeps it for the graph; under cuvmm-pool, PyTorch carves the graph's memory out of a MemPool
of its own (torch.cuda.graph(g, pool=graph_pool.id)) while eager tensors come from a second one,
both over cuvmm segments. One pool for both would let PyTorch itself hand the graph's freed
intermediates to eager tensors, which replay then overwrites by design; with two, any overlap is
cuvmm's doing. The capture runs outside the eager pool's scope because PyTorch gives an
allocation to the first matching route, and a thread route would take the capture's
allocations. After capture, each replay round
puts new data in the static inputs, allocates and frees eager tensors of random sizes (tempting
the allocator to hand out the graph's memory) and keeps every other one alive with a known
pattern, replays, and checks (1) the graph's outputs and gradients against an eager
recomputation with the same kernels, bit for bit, and (2) that the live eager tensors still
hold their pattern, i.e. the replay wrote nothing into them. Under cuvmm it also checks that
stats.graph_held is non-zero while a graph exists and back to zero after the graph is destroyed
and cuvmm_release_graph_memory is called; --graphs N repeats capture and release N times.
"""

import os

os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"

import argparse  # noqa: E402
import gc  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

from _common import (MiB, Alloc, add_common_args, env_info, fill_mod_pattern, finish,  # noqa: E402
                     force_deterministic, mod_pattern_sum)
import cuvmm_torch  # noqa: E402  (importable once _common has set the path)


def main():
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--graphs", type=int, default=2, help="capture/replay/release rounds")
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--churn", type=int, default=16, help="eager tensors per replay round")
    p.add_argument("--capture-error-mode", choices=("global", "thread_local", "relaxed"), default="global")
    p.add_argument("--atol", type=float, default=0.0,
                   help="0: require bitwise equality with eager; else allclose(atol, rtol=0)")
    args = p.parse_args()

    alloc = Alloc(args.alloc).setup()
    import torch
    nn, F = torch.nn, torch.nn.functional

    force_deterministic(args.seed)
    # The warm-up runs on a side stream, as PyTorch asks before a capture, so the parameters'
    # AccumulateGrad nodes first saw that stream; the warning about it says nothing here.
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    rng = random.Random(args.seed)
    dev = torch.device("cuda")
    graph_pool = cuvmm_torch.mem_pool() if alloc.mode == "cuvmm-pool" else None

    def eager_scope():
        return alloc.scope(all_threads=True)  # autograd.grad allocates on autograd's threads

    class Layer(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.ln(x))))

    with eager_scope():
        model = nn.Sequential(*[Layer(args.d) for _ in range(args.layers)]).to(dev)
        params = list(model.parameters())
        static_x = torch.randn(args.batch, args.d, device=dev)
        static_t = torch.randn(args.batch, args.d, device=dev)

    def step(x, t):
        y = model(x)
        loss = F.mse_loss(y, t)
        return (y, loss, *torch.autograd.grad(loss, params))

    def same(a, b):
        if args.atol == 0:
            return torch.equal(a, b)
        return torch.allclose(a, b, rtol=0, atol=args.atol)

    def graph_held():
        return cuvmm_torch.stats()["graph_held"] if alloc.mode == "cuvmm" else None

    def capture():
        with eager_scope():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture, as PyTorch asks
                for _ in range(3):
                    step(static_x, static_t)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=graph_pool.id if graph_pool is not None else None,
                              capture_error_mode=args.capture_error_mode):
            out = step(static_x, static_t)
        torch.cuda.synchronize()
        return g, out

    def replay_rounds(g, static_out):
        mismatches, max_diff, clobbered = 0, 0.0, 0
        with eager_scope():
            for r in range(args.replays):
                static_x.copy_(torch.randn_like(static_x))
                static_t.copy_(torch.randn_like(static_t))
                # Churn: allocate, fill, free half; the other half stays alive across the replay.
                sentinels = []
                for k in range(args.churn):
                    n = rng.randint(MiB // 16, 64 * MiB) // 4
                    t = torch.empty(n, dtype=torch.int32, device=dev)
                    fill_mod_pattern(t, 97, 1000 * r + k + 1)
                    if k % 2:
                        sentinels.append((t, mod_pattern_sum(n, 97, 1000 * r + k + 1)))
                    del t
                g.replay()
                ref = step(static_x, static_t)
                for a, b in zip(static_out, ref):
                    mismatches += not same(a, b)
                    max_diff = max(max_diff, (a.float() - b.float()).abs().max().item())
                for t, want in sentinels:
                    clobbered += t.sum(dtype=torch.int64).item() != want
                del ref, sentinels
            torch.cuda.synchronize()
        return mismatches, max_diff, clobbered

    results, checks = [], {}
    for gi in range(args.graphs):
        g, static_out = capture()
        held_after_capture = graph_held()
        mismatches, max_diff, clobbered = replay_rounds(g, static_out)
        # Destroy the graph and everything it handed out, then give its memory back.
        del g, static_out
        gc.collect()
        torch.cuda.synchronize()
        held_before_release = graph_held()
        if alloc.mode == "cuvmm":
            cuvmm_torch.release_graph_memory()
        alloc.empty_cache()
        st = alloc.cuvmm_stats()
        results.append({
            "graph": gi, "replays": args.replays, "output_mismatches": mismatches, "max_abs_diff": max_diff,
            "clobbered_eager_tensors": clobbered, "graph_held_after_capture": held_after_capture,
            "graph_held_before_release": held_before_release,
            "graph_held_after_release": st["graph_held"] if st else None,
            "cuvmm_mapped_after_release": st["mapped"] if st else None})
        checks[f"graph {gi}: replays equal eager recomputation"] = mismatches == 0
        checks[f"graph {gi}: replays left live eager tensors intact"] = clobbered == 0
        if alloc.mode == "cuvmm":
            checks[f"graph {gi}: graph_held > 0 while the graph exists"] = held_after_capture > 0
            checks[f"graph {gi}: graph_held == 0 after release"] = st["graph_held"] == 0

    result = {"env": env_info(), "capture_error_mode": args.capture_error_mode, "graphs": results,
              "cuvmm": alloc.cuvmm_stats()}
    rc = finish("graph_capture", args, result, checks)
    del model, params, static_x, static_t
    return rc


if __name__ == "__main__":
    sys.exit(main())
