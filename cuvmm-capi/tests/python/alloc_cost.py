#!/usr/bin/env python3
"""What one allocation costs under cuvmm beside PyTorch's allocator: both allocators take turns
inside each process, generation by generation, until the 95% confidence interval of the per-token
ratio is within --ci (relative half-width) or --cap seconds have passed.

    python3 alloc_cost.py [--cap 300] [--ci 0.01] [--pairs 120] [--json PATH]
    python3 alloc_cost.py --across [--cpus 1]   # each allocator in fresh processes of its own
    python3 alloc_cost.py --from A.json B.json  # earlier runs pooled

The workload: a small Llama (transformers, random weights, fixed seed) decoding with greedy
``model.generate`` (16 tokens a generation within a process, 64 across), and ``torch.empty`` with
its free in a Python loop, 512 B to 8 MiB.

Within a process (the default): PyTorch fixes its allocator at a process's first CUDA call, and
a process runs fast or slow for its whole life whatever its allocator, by up to 1.6x, so ratios
between processes carry that spread. Here each process holds both allocators: PyTorch keeps the
current one in a single pointer (``c10::cuda::CUDACachingAllocator::allocator``, exported by
libc10_cuda.so) and frees each tensor through the deleter its allocator gave it, so the child
puts cuvmm in as users do (``use_as_current_allocator``), lets PyTorch initialise its own caching
allocator behind that pointer, and from then on points it at one or the other between
generations. Each allocator decodes with a copy of the model it allocated itself, and the two
copies must generate the same tokens. A child first checks that the pointer decides which
allocator serves a tensor (cuvmm counts an allocation under cuvmm only, and none while PyTorch's
is current). Generations are short (16 tokens) and alternate, so that the two of a pair run a
fraction of a second apart; children run on the last CPU this process may use. A process's ratio
is the median over its rounds of cuvmm's time over PyTorch's in the same round, which neither the
drift over a process's life nor a burst of slowness in a few generations moves (the ratio of its
two medians is reported beside it); the interval is Student's over the processes' ratios, so that
what differs between processes counts. ``--crossed`` also runs each allocator with the other's
copy of the weights, to tell the allocation path's share from that of where the weights lie.
``--from`` pools the processes of earlier runs' JSON files.

``--across``: the method users can copy, each process on one allocator, the order alternating
(native, cuvmm, cuvmm, native, ...), each process the median of --repeats generations after a
warm-up one, with references of its own speed that no allocator touches (a Python loop, an
in-place kernel launch); the interval is that of the rounds' paired ratios.

Where the time of an allocation goes in this decoding: alloc_profile.py.

The JSON gives the medians, the ratios (cuvmm / native), the interval and its upper end; the goal
is a per-token ratio of at most 1.02, the whole interval included.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import median_pair_ratio, paired_ratio  # (also puts the package of this checkout or bundle on the path)

SIZES = [512 << k for k in range(0, 15)]  # 512 B .. 8 MiB


def pairs_ns(torch, size, n):
    x = torch.empty(size, dtype=torch.uint8, device="cuda")
    del x
    t = time.perf_counter_ns()
    for _ in range(n):
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
        del x
    return (time.perf_counter_ns() - t) / n


def small_llama(torch):
    """The decoding workload's model (the same weights every call) and its prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
    return model, ids


def generate_ms(torch, model, ids, tokens):
    """(ms a token, the tokens) of one greedy generation of exactly ``tokens`` tokens."""
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3 / tokens
    assert out.shape[1] == ids.shape[1] + tokens
    return ms, out


def decode_ms_per_token(torch, tokens, repeats):
    model, ids = small_llama(torch)
    generate_ms(torch, model, ids, 8)
    return statistics.median(generate_ms(torch, model, ids, tokens)[0] for _ in range(repeats))


def references(torch):
    """What this process's speed is, apart from any allocator: a fixed Python loop (ms) and a
    kernel launch that allocates nothing (an in-place add on a tensor made before, µs), medians
    of five. A process that is slow for its whole life shows it here too, whichever allocator
    it has, so a ratio of per-token times over these tells the allocator from the process."""
    def cpu():
        t = time.perf_counter()
        sum(i * i for i in range(200_000))
        return (time.perf_counter() - t) * 1e3

    x = torch.zeros(1, device="cuda")

    def launch():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            x.add_(1)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6 / 2000

    launch()
    return {"cpu_ms": statistics.median(cpu() for _ in range(5)),
            "launch_us": statistics.median(launch() for _ in range(5))}


def child(alloc, tokens, loops, repeats):
    import torch

    if alloc == "cuvmm":
        import cuvmm.torch as ct

        ct.use_as_current_allocator()
    torch.cuda.init()
    pairs = {s: min(pairs_ns(torch, s, loops) for _ in range(3)) for s in SIZES}
    return {"pairs_ns": pairs, "ms_per_token": decode_ms_per_token(torch, tokens, repeats),
            "refs": references(torch)}


# c10::cuda::CUDACachingAllocator::allocator, the std::atomic<CUDAAllocator*> every tensor
# allocation of PyTorch goes through; an atomic pointer has a plain pointer's layout.
ALLOCATOR_SLOT = "_ZN3c104cuda20CUDACachingAllocator9allocatorE"


def child_within(tokens, pairs, loops, crossed):
    """Both allocators in this process, taking turns: see the module's text."""
    import ctypes

    import torch

    import cuvmm
    import cuvmm.torch as ct

    c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10_cuda.so"))
    slot = ctypes.c_void_p.in_dll(c10, ALLOCATOR_SLOT)
    native = slot.value
    ct.use_as_current_allocator()
    ours = slot.value
    if not native or not ours or native == ours:
        raise SystemExit(f"the allocator pointer did not change: {native} then {ours}")
    # PyTorch's initialisation initialises whichever allocator the pointer names: its own here
    # (cuvmm's was initialised when it was made).
    slot.value = native
    torch.cuda.init()

    def use(p):
        torch.cuda.synchronize()
        slot.value = p

    for p, served in ((native, False), (ours, True)):
        use(p)
        before = cuvmm.stats()["allocations"]
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        grew = cuvmm.stats()["allocations"] > before
        del x
        if grew != served:
            raise SystemExit(f"the pointer does not decide the allocator: cuvmm served={grew}, expected {served}")
    models = {}
    for name, p in (("native", native), ("cuvmm", ours)):
        use(p)
        models[name] = small_llama(torch)
        generate_ms(torch, *models[name], 8)
    pointers = {"native": native, "cuvmm": ours}
    # Each arm: (the allocator current during the generation, whose copy of the weights it uses).
    # The two crossed arms tell a difference of the allocation path from one of where the
    # weights lie (the device reads them every token).
    arms = [("native", "native"), ("cuvmm", "cuvmm")]
    if crossed:
        arms += [("native", "cuvmm"), ("cuvmm", "native")]
    ms = {f"{a}/{w}": [] for a, w in arms}
    per_alloc = {a: [] for a in pointers}
    outs = {}
    for k in range(pairs):
        for a, w in arms[k % len(arms):] + arms[:k % len(arms)]:
            use(pointers[a])
            before = cuvmm.stats()["allocations"]
            t, out = generate_ms(torch, *models[w], tokens)
            per_alloc[a].append(cuvmm.stats()["allocations"] - before)
            ms[f"{a}/{w}"].append(t)
            outs.setdefault(w, out)
    for a, w in arms:  # the weights' allocator names the arm in the plain case
        if a == w:
            ms[a] = ms.pop(f"{a}/{w}")
    pairs_ns_of = {"native": {}, "cuvmm": {}}
    for s in SIZES:
        for name in ("native", "cuvmm"):
            use(pointers[name])
            pairs_ns_of[name][s] = min(pairs_ns(torch, s, loops) for _ in range(3))
    use(ours)
    if any(per_alloc["native"]):
        raise SystemExit(f"cuvmm served allocations while PyTorch's allocator was current: {per_alloc['native']}")
    same = bool(torch.equal(outs["native"], outs["cuvmm"]))
    return {"ms_per_token": ms, "pairs_ns": pairs_ns_of, "same_tokens": same,
            "cuvmm_allocations_per_generation": {n: statistics.median(v) for n, v in per_alloc.items()}}


def run_child(argv, cpus):
    """This script with ``argv`` in a fresh process (on ``cpus``, if given): its JSON answer, or
    None (its error printed) if it failed."""
    out = subprocess.run([sys.executable, __file__] + argv, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)),
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def process_figures(ms):
    """One process's figures from its generations (``ms``: arm -> ms a token, round by round).

    Its ratio is the median over rounds of cuvmm's time over PyTorch's in the same round: the two
    ran a fraction of a second apart, so what drifts over the process's life cancels within each
    round, and a burst of slowness in a few generations (on either turn) moves a median of ratios
    no more than any other outlier. With the crossed arms, the allocation path's share (each
    allocator over the other with the same weights) and the weights' (each copy over the other
    under the same allocator) are told apart the same way, round by round."""
    n, c = ms["native"], ms["cuvmm"]
    out = {"ratio": median_pair_ratio(n, c), "ratio_of_medians": statistics.median(c) / statistics.median(n)}
    if "native/cuvmm" in ms:
        nc, cn = ms["native/cuvmm"], ms["cuvmm/native"]
        out["allocation_path"] = statistics.median(
            ((cc / x) * (y / nn)) ** 0.5 for nn, cc, x, y in zip(n, c, nc, cn))
        out["weights"] = statistics.median(((cc / y) * (x / nn)) ** 0.5 for nn, cc, x, y in zip(n, c, nc, cn))
    return out


def summarise(procs):
    """The result over processes (each as child_within returns it): Student's interval over the
    processes' ratios, so that what differs between processes counts."""
    figs = [process_figures(q["ms_per_token"]) for q in procs]

    def over(key):
        vals = [f[key] for f in figs]
        if len(vals) < 2:
            return {"ratio": vals[0] if vals else float("nan"), "ci95_rel": float("inf"), "ci95_high": float("inf")}
        r, rel, high = paired_ratio([1.0] * len(vals), vals)
        return {"ratio": r, "ci95_rel": rel, "ci95_high": high}

    tok = over("ratio")
    result = {
        "method": "within", "processes": len(procs),
        "ms_per_token": {n: [statistics.median(q["ms_per_token"][n]) for q in procs] for n in ("native", "cuvmm")},
        "process_ratios": [f["ratio"] for f in figs],
        "process_ratios_of_medians": [f["ratio_of_medians"] for f in figs],
        "ratio_of_medians": over("ratio_of_medians"),
        "ms_per_token_each": [q["ms_per_token"] for q in procs],
        "pairs_ns": {n: {s: statistics.median(q["pairs_ns"][n][str(s)] for q in procs) for s in SIZES}
                     for n in ("native", "cuvmm")},
        "pair_ratio": {s: statistics.median(q["pairs_ns"]["cuvmm"][str(s)] / q["pairs_ns"]["native"][str(s)]
                                            for q in procs) for s in SIZES},
        "cuvmm_allocations_per_generation": procs[-1]["cuvmm_allocations_per_generation"],
        "token_ratio": tok["ratio"], "token_ratio_ci95_rel": tok["ci95_rel"], "token_ratio_ci95_high": tok["ci95_high"],
        "goal_token_ratio_le_1_02": tok["ci95_high"] <= 1.02,
    }
    if all("allocation_path" in f for f in figs):
        result["allocation_path"], result["weights"] = over("allocation_path"), over("weights")
        result["process_allocation_path"] = [f["allocation_path"] for f in figs]
        result["process_weights"] = [f["weights"] for f in figs]
    return result


def within(args):
    """Fresh processes, each alternating both allocators, until the interval over the processes'
    ratios is within --ci or --cap seconds have passed (two processes at least)."""
    # The last CPUs: the first ones take more of the machine's interrupts.
    cpus = sorted(os.sched_getaffinity(0))[-args.cpus:] if args.cpus > 0 else None
    start, procs = time.monotonic(), []
    while time.monotonic() - start < args.cap or len(procs) < 2:
        r = run_child(["--child-within", "--tokens", str(args.tokens), "--pairs", str(args.pairs),
                       "--loops", str(args.loops)] + (["--crossed"] if args.crossed else []), cpus)
        if r is None:
            return 1
        if not r["same_tokens"]:
            print("the two allocators' copies of the model generated different tokens", file=sys.stderr)
            return 1
        procs.append(r)
        f, res = process_figures(r["ms_per_token"]), summarise(procs)
        med = {n: statistics.median(r["ms_per_token"][n]) for n in ("native", "cuvmm")}
        print(f"process {len(procs)}: {med['native']:.3f} / {med['cuvmm']:.3f} ms a token (medians), ratio "
              f"{f['ratio']:.4f}; over the processes {res['token_ratio']:.4f} +- "
              f"{res['token_ratio_ci95_rel'] * 100:.2f}% (upper end {res['token_ratio_ci95_high']:.4f})",
              file=sys.stderr)
        if "allocation_path" in f:
            print(f"  allocation path {f['allocation_path']:.4f}, weights {f['weights']:.4f}", file=sys.stderr)
        if len(procs) >= 3 and res["token_ratio_ci95_rel"] <= args.ci:
            break
    res["pairs"], res["cpus"], res["ci_reached"] = args.pairs, cpus, res["token_ratio_ci95_rel"] <= args.ci
    return res


def from_files(paths):
    """The result of earlier runs' JSON files (``--json`` of the default method) pooled: their
    processes together, summarised as one run."""
    procs = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        for k, ms in enumerate(r["ms_per_token_each"]):
            # Saved results keep the medians of the pairs' sizes, not each process's: the pooled
            # result's pair figures are those medians.
            procs.append({"ms_per_token": ms, "pairs_ns": {n: {str(s): r["pairs_ns"][n][str(s)] for s in SIZES}
                                                            for n in ("native", "cuvmm")},
                          "cuvmm_allocations_per_generation": r["cuvmm_allocations_per_generation"]})
    return summarise(procs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", type=float, default=300.0, help="seconds in all")
    p.add_argument("--ci", type=float, default=0.01)
    p.add_argument("--tokens", type=int, help="tokens a generation: 16 within, 64 across")
    p.add_argument("--repeats", type=int, default=5, help="generations per process, their median kept")
    p.add_argument("--loops", type=int, default=20000)
    p.add_argument("--pairs", type=int, default=120, help="generation pairs per process (within)")
    p.add_argument("--across", action="store_true", help="each allocator in processes of its own")
    p.add_argument("--child", choices=("cuvmm", "native"))
    p.add_argument("--child-within", action="store_true")
    p.add_argument("--crossed", action="store_true",
                   help="within: also each allocator with the other's copy of the weights")
    p.add_argument("--cpus", type=int, default=1,
                   help="every child runs on this many of the CPUs this process may use, the last "
                        "ones within a process, the first ones across (0: wherever the kernel puts it)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--from", dest="from_files", nargs="+", metavar="JSON",
                   help="summarise earlier runs' results (their processes pooled) instead of running")
    args = p.parse_args()
    if args.tokens is None:
        args.tokens = 64 if (args.across or args.child) else 16
    if args.from_files:
        return emit(from_files(args.from_files), args.json)
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.loops, args.repeats)))
        return 0
    if args.child_within:
        print(json.dumps(child_within(args.tokens, args.pairs, args.loops, args.crossed)))
        return 0
    if not args.across:
        result = within(args)
        if result == 1:
            return 1
        return emit(result, args.json)
    runs = {"native": [], "cuvmm": []}
    cpus = sorted(os.sched_getaffinity(0))[:args.cpus] if args.cpus > 0 else None
    start, k = time.monotonic(), 0
    ratio, rel, high = float("nan"), float("inf"), float("inf")
    while time.monotonic() - start < args.cap:
        order = ("native", "cuvmm") if k % 2 == 0 else ("cuvmm", "native")
        for a in order:
            r = run_child(["--child", a, "--tokens", str(args.tokens), "--loops", str(args.loops),
                           "--repeats", str(args.repeats)], cpus)
            if r is None:
                return 1
            runs[a].append(r)
        k += 1
        ratio, rel, high = paired_ratio([r["ms_per_token"] for r in runs["native"]],
                                        [r["ms_per_token"] for r in runs["cuvmm"]])
        print(f"round {k}: per-token ratio {ratio:.4f} +- {rel * 100:.2f}% (upper end {high:.4f})", file=sys.stderr)
        if rel <= args.ci:
            break
    med = {a: {"ms_per_token": statistics.median(r["ms_per_token"] for r in rs),
               "pairs_ns": {s: statistics.median(r["pairs_ns"][str(s)] for r in rs) for s in SIZES}}
           for a, rs in runs.items()}
    # The same ratio with each process's per-token time over its own launch reference: a
    # diagnostic of how much of the spread is the process's rather than the allocator's (not the
    # goal's figure).
    per_launch = {a: [r["ms_per_token"] / r["refs"]["launch_us"] for r in rs] for a, rs in runs.items()}
    norm, norm_rel, _ = paired_ratio(per_launch["native"], per_launch["cuvmm"])
    print(f"per token over each process's launch reference: {norm:.4f} +- {norm_rel * 100:.2f}%", file=sys.stderr)
    result = {
        "method": "across", "rounds": k, "cpus": cpus, "medians": med,
        "ms_per_token": {a: [r["ms_per_token"] for r in rs] for a, rs in runs.items()},
        "refs": {a: [r["refs"] for r in rs] for a, rs in runs.items()},
        "token_over_launch_ratio": norm, "token_over_launch_ci95_rel": norm_rel,
        "pair_ratio": {s: med["cuvmm"]["pairs_ns"][s] / med["native"]["pairs_ns"][s] for s in SIZES},
        "token_ratio": ratio, "token_ratio_ci95_rel": rel, "token_ratio_ci95_high": high,
        "ci_reached": rel <= args.ci, "goal_token_ratio_le_1_02": high <= 1.02,
    }
    return emit(result, args.json)


def emit(result, path):
    line = json.dumps(result)
    print(line)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
