"""A first check of libcuvmm.so under PyTorch: tensors, a matmul, reuse timing, a graph capture.

    CUVMM_LIB=target/release/libcuvmm.so python3 smoke.py
"""
import ctypes
import json
import os
import time

import torch

lib_path = os.environ["CUVMM_LIB"]
alloc = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "cuvmm_malloc", "cuvmm_free")
torch.cuda.memory.change_current_allocator(alloc)
lib = ctypes.CDLL(lib_path)
lib.cuvmm_stats_json.restype = ctypes.c_ssize_t


def stats():
    n = lib.cuvmm_stats_json(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.cuvmm_stats_json(buf, n + 1)
    return json.loads(buf.value)


torch.manual_seed(0)
x = torch.randn(4096, 4096, device="cuda")
y = x @ x
ref = (x.cpu().double() @ x.cpu().double()).float()
err = (y.cpu() - ref).abs().max().item()
print("matmul max error", err)
assert err < 1e-1

for n in (512, 1 << 20, 64 << 20):
    for _ in range(100):
        torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20000):
        torch.empty(n, dtype=torch.uint8, device="cuda")
    dt = (time.perf_counter() - t) / 20000
    print(f"torch.empty({n}) + free through cuvmm: {dt * 1e6:.2f} us per pair (Python included)")

# Capture and replay through change_current_allocator.
s = torch.cuda.Stream()
static = torch.randn(1024, 1024, device="cuda")
with torch.cuda.stream(s):
    for _ in range(3):
        out = torch.relu(static @ static) + 1
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = torch.relu(static @ static) + 1
junk = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]
for i in range(3):
    static.copy_(torch.randn(1024, 1024, device="cuda"))
    g.replay()
    want = torch.relu(static @ static) + 1
    torch.cuda.synchronize()
    print("replay", i, "equal:", torch.equal(out, want))
    assert torch.equal(out, want)
    assert all(bool((j == 7.0).all()) for j in junk)
print("RESULT", json.dumps(stats()))
