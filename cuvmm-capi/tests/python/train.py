#!/usr/bin/env python3
"""Train a deterministic decoder-only transformer under one allocator and record what it did.

    python3 train.py --alloc native     --json native.json
    python3 train.py --alloc cuvmm      --json cuvmm.json
    python3 train.py --alloc cuvmm-pool --json pool.json
    python3 compare.py native.json cuvmm.json pool.json

Every step has its own sequence length and batch (a seeded schedule), so the sizes asked of the
allocator change from step to step the way they do in real training. Per step it records the
loss (float and its float32 bits), the step time (synchronize, perf_counter, synchronize: the
allocator's host time counts) and the driver-level memory in use (total - free) above a baseline
taken before the first tensor. The defaults (d_model 2048, 10 layers, 571 M parameters, up to
16384 tokens a step, bf16 autocast over fp32 weights, AdamW, 40 steps): under
PyTorch's native allocator they peak near 23 GiB allocated and 31 GiB reserved, and the loss
falls from about 10.9 to 9.5 (docs/DECISIONS.md, "Training and its trace replayed on 4 MiB pages",
has the measured runs).

cuvmm-pool runs the whole training inside the pool, on every thread: torch.cuda.use_mem_pool
routes only the calling thread, and autograd allocates backward's tensors on its own threads.
"""

import os

os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before torch: read when cuBLAS makes a handle

import argparse  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from _common import GiB, Alloc, add_common_args, env_info, f32_bits, finish, force_deterministic, median  # noqa: E402


def make_schedule(steps, seed, min_len, max_len, len_step, min_tokens, max_tokens):
    """[(batch, seq_len)] per step: lengths on a grid of len_step, batch from a token budget
    that is itself drawn per step, so both the sequence-shaped and the token-shaped buffers
    change size. Pure, so runs under every allocator see the same shapes."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        length = rng.randrange(min_len, max_len + 1, len_step)
        tokens = rng.randint(min_tokens, max_tokens)
        out.append((max(1, tokens // length), length))
    return out


def build_model(torch, cfg):
    nn, F = torch.nn, torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Flash's backward is deterministic once use_deterministic_algorithms(True) is set; fp32
    # has no flash kernel, and the math backend is deterministic anyway.
    backend = SDPBackend.FLASH_ATTENTION if cfg.dtype == "bf16" else SDPBackend.MATH

    class Block(nn.Module):
        def __init__(self, d, heads, ff):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.fc1 = nn.Linear(d, ff, bias=False)
            self.fc2 = nn.Linear(ff, d, bias=False)

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            with sdpa_kernel(backend):
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg.d_model
            self.emb = nn.Embedding(cfg.vocab, d)
            self.blocks = nn.ModuleList(Block(d, cfg.heads, cfg.ff_mult * d) for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(d)
            # Fixed sinusoidal positions: no parameter, nothing random.
            pos = torch.arange(cfg.max_len, dtype=torch.float32)[:, None]
            div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
            pe = torch.zeros(cfg.max_len, d)
            pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
            self.register_buffer("pe", pe, persistent=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, tokens, targets):
            x = self.emb(tokens) + self.pe[: tokens.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            logits = self.ln_f(x) @ self.emb.weight.t()  # tied output head
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    return Decoder()


def make_batch(torch, seed, step, batch, length, vocab):
    """Rows that repeat a random motif of skewed token frequencies: the frequencies are learnt
    within a few dozen steps and the repeats by copying later, so the loss goes down. Generated
    on the CPU from a per-step seed so every run sees the same tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    period = torch.randint(8, 65, (batch, 1), generator=g)
    motif = (torch.rand(batch, 64, generator=g).pow(4) * vocab).long().clamp_(max=vocab - 1)
    idx = torch.arange(length + 1)[None, :] % period
    return torch.gather(motif, 1, idx)


def main():
    p = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median time")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ff-mult", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--len-step", type=int, default=128)
    p.add_argument("--min-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=16384, help="sets the peak memory")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: autocast over fp32 weights; fp32: everything fp32, math attention")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--pool-scope", choices=("all-threads", "thread"), default="all-threads",
                   help="cuvmm-pool: route every thread (default) or only this one (use_mem_pool)")
    p.add_argument("--pool-no-split", action="store_true",
                   help="cuvmm-pool: MemPool(no_split=True), PyTorch never splits the pool's segments")
    args = p.parse_args()
    args.max_len = args.max_len - (args.max_len - args.min_len) % args.len_step

    pool_kwargs = {"no_split": True} if args.pool_no_split else None
    alloc = Alloc(args.alloc, pool_kwargs).setup()  # before any CUDA tensor
    import torch

    force_deterministic(args.seed)
    schedule = make_schedule(args.steps, args.seed, args.min_len, args.max_len, args.len_step,
                             args.min_tokens, args.max_tokens)
    dev = torch.device("cuda")
    losses, bits, times, used = [], [], [], []

    with alloc.scope(all_threads=args.pool_scope == "all-threads"):
        with dev:
            model = build_model(torch, args)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        n_params = sum(p.numel() for p in model.parameters())
        torch.cuda.synchronize()
        used_after_init = alloc.driver_used()

        for step, (batch, length) in enumerate(schedule):
            host = make_batch(torch, args.seed, step, batch, length, args.vocab).pin_memory()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            seq = host.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                loss = model(seq[:, :-1], seq[:, 1:])
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            lf = float(loss.detach().float().item())
            losses.append(lf)
            bits.append(f32_bits(lf))
            used.append(alloc.driver_used())
            del seq, loss, host
            print(f"step {step:3d} B={batch:3d} L={length:4d} loss={lf:.6f} ({bits[-1]}) "
                  f"{times[-1] * 1e3:8.1f} ms  used {used[-1] / GiB:6.2f} GiB", file=sys.stderr, flush=True)

        result = {
            "config": {k: getattr(args, k) for k in ("steps", "warmup", "d_model", "layers", "heads", "ff_mult",
                                                     "vocab", "min_len", "max_len", "len_step", "min_tokens",
                                                     "max_tokens", "dtype", "lr", "seed", "pool_scope",
                                                     "pool_no_split")},
            "env": env_info(),
            "params": n_params,
            "schedule": schedule,
            "losses": losses,
            "loss_bits": bits,
            "step_s": times,
            "median_step_s": median(times[args.warmup:]),
            "baseline_used": alloc.baseline_used,
            "driver_used_after_init": used_after_init,
            "driver_used_per_step": used,
            "peak_driver_used": max(used + [used_after_init]),
            **alloc.torch_stats(),
        }
        st = alloc.cuvmm_stats()
        if st is not None:
            result["cuvmm"] = st
            result["cuvmm_live_peak"] = st["live_peak"]
            result["cuvmm_mapped_peak"] = st["mapped_peak"]
        checks = {"losses_finite": all(math.isfinite(x) for x in losses)}
        if args.alloc == "cuvmm":
            checks["cuvmm_served_allocations"] = st["allocations"] > 0 and st["live_peak"] > 0
        if args.alloc == "cuvmm-pool":
            # Every PyTorch segment came from the pool's allocator exactly when cuvmm's requested
            # bytes cover what PyTorch reserved; a thread outside the pool would show up here.
            share = st["requested"] / max(1, result["torch_memory_reserved"])
            result["pool_share_of_reserved"] = share
            checks["training_ran_in_pool"] = share >= 0.99
        del model, opt
    rc = finish("train", args, result, checks)
    return rc


if __name__ == "__main__":
    sys.exit(main())
