#!/usr/bin/env python3
"""torch.compile(mode="reduce-overhead") with Inductor's CUDA graph trees on (PyTorch's default).

    python3 compile_reduce_overhead.py --alloc cuvmm [--json PATH]
    python3 compile_reduce_overhead.py --alloc native      # PyTorch's allocator, the reference

Three uses, each compared with the same model run eagerly (float32, within --tol, relative):

- inference with three input shapes, cycled (a root of the tree per shape);
- a model with a graph break whose second half changes with a Python flag while the first half
  is replayed: the new half is warmed up and recorded in the middle of a path, which takes the
  tree's checkpoints (``_cuda_setCheckpointPoolState``); the script checks that they were taken;
- training steps, forward and backward (the backward a child of the forward in the tree), the
  gradients compared and an SGD step applied to both copies.

Exit 1 on any mismatch or error, or when a graph was skipped.
"""

import argparse
import copy
import sys
import traceback

from _common import env_info, finish


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alloc", choices=("cuvmm", "native"), default="cuvmm")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch
    from torch._dynamo.utils import counters

    if args.alloc == "cuvmm":
        import cuvmm
        import cuvmm.torch as ct

        ct.use_as_current_allocator()
    torch.manual_seed(0)
    worst, errors = {}, []

    def note(what, got, want):
        worst[what] = max(worst.get(what, 0.0), rel_err(got, want))

    def run(what, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - what it is, is the point
            errors.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            traceback.print_exc()

    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()

    def inference():
        model = mlp.eval()
        compiled = torch.compile(model, mode="reduce-overhead")
        with torch.no_grad():
            for step in range(args.steps):
                for rows in (16, 48, 128):
                    x = torch.randn(rows, 256, device="cuda")
                    note("inference", compiled(x).clone(), model(x))

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(256, 256)
            self.b = torch.nn.Linear(256, 256)
            self.c = torch.nn.Linear(256, 256)

        def forward(self, x, flag: bool):
            h = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h).sin() if flag else self.c(h).cos()

    def checkpoints():
        model = Broken().cuda().eval()
        compiled = torch.compile(model, mode="reduce-overhead")
        with torch.no_grad():
            for step in range(args.steps):
                for flag in (True, True, False, True, False):
                    x = torch.randn(64, 256, device="cuda")
                    out = compiled(x, flag)
                    note("checkpoints", out.clone(), model(x, flag))

    def training():
        model = copy.deepcopy(mlp).train()
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, mode="reduce-overhead")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        eager_opt = torch.optim.SGD(eager.parameters(), lr=1e-3)
        for step in range(args.steps):
            x = torch.randn(64, 256, device="cuda")
            torch.compiler.cudagraph_mark_step_begin()
            loss = compiled(x).pow(2).mean()
            loss.backward()
            eager_loss = eager(x).pow(2).mean()
            eager_loss.backward()
            note("training loss", loss.detach().clone(), eager_loss.detach())
            for pc, pe in zip(model.parameters(), eager.parameters()):
                note("training grads", pc.grad, pe.grad)
            opt.step()
            eager_opt.step()
            opt.zero_grad(set_to_none=True)
            eager_opt.zero_grad(set_to_none=True)

    for what, fn in (("inference", inference), ("checkpoints", checkpoints), ("training", training)):
        run(what, fn)
    torch.cuda.synchronize()
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    taken = 0
    try:
        from torch._inductor import cudagraph_trees

        mgr = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
        taken = getattr(mgr, "debug_checkpointing_counter", 0) if mgr is not None else 0
    except Exception as e:  # noqa: BLE001
        errors.append(f"reading the tree manager: {e}")
    stats = cuvmm.stats() if args.alloc == "cuvmm" else {}
    print(f"{args.alloc}: errors {errors}; worst relative error {worst}; cudagraph skips {skips}; "
          f"checkpoints {taken}", file=sys.stderr)
    result = {"env": env_info(), "errors": errors, "worst_rel_err": worst, "cudagraph_skips": skips,
              "checkpoints": taken, "stats": stats}
    checks = {
        "no error": not errors,
        f"outputs and gradients equal eager's (relative {args.tol})": bool(worst)
        and all(v <= args.tol for v in worst.values()),
        "no graph was skipped": skips == 0,
        "checkpoints were taken in the middle of a path": taken > 0,
    }
    if args.alloc == "cuvmm":
        checks["the graphs' memory came from cuvmm"] = stats.get("graph_held", 0) > 0
    return finish("compile_reduce_overhead", args, result, checks)


if __name__ == "__main__":
    sys.exit(main())
