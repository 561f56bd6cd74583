#!/usr/bin/env python3
"""torch.compile(mode="reduce-overhead") with cuvmm as the current allocator.

    python3 compile_graphs.py [--json PATH]
    python3 compile_graphs.py --trees    # CUDA graph trees (PyTorch's default): expected to FAIL

CUDA graph trees need the caching allocator's pool checkpoints, which a pluggable allocator does
not have ("pluggable does not yet support checkPoolLiveAllocations"). With
torch._inductor.config.triton.cudagraph_trees = False inductor captures each compiled graph with
torch.cuda.graph instead, whose allocations cuvmm keeps for the graph (capture-aware). An MLP
(forward, inference) is compiled so, run --steps times on new inputs, and each output compared
with eager; cuvmm's graph_held must show the graph's memory came from cuvmm.
"""

import argparse
import sys

from _common import env_info, finish

import cuvmm
import cuvmm.torch as ct


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", action="store_true", help="keep CUDA graph trees on (expected to fail)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    ct.use_as_current_allocator()
    inductor_config.triton.cudagraph_trees = args.trees
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda().eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    worst, err = 0.0, None
    with torch.no_grad():
        try:
            for step in range(args.steps):
                x = torch.randn(64, 512, device="cuda")
                got = compiled(x).clone()
                want = model(x)
                worst = max(worst, (got - want).abs().max().item())
        except Exception as e:  # noqa: BLE001 - what it is, is the point
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    torch.cuda.synchronize()
    s = cuvmm.stats()
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    print(f"trees={args.trees}: error {err}; max |compiled - eager| {worst:.3g}; graph_held {s['graph_held']}; "
          f"cudagraph skips {skips}", file=sys.stderr)
    result = {"env": env_info(), "trees": args.trees, "error": err, "max_abs_diff": worst,
              "cudagraph_skips": skips, "stats": s}
    checks = {
        "compiled with CUDA graphs runs": err is None,
        "outputs equal eager's (within 1e-4)": err is None and worst <= 1e-4,
        "no graph was skipped": skips == 0,
        "the graphs' memory came from cuvmm": s["graph_held"] > 0,
    }
    return finish("compile_graphs", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
