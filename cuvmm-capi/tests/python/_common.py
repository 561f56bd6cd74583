"""Plumbing shared by the proof scripts: allocator set-up, timing, exact checks, the RESULT line.

Nothing here imports torch at module level, so the pure helpers can be tested without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import statistics
import struct
import sys
import time
from pathlib import Path

# The installed package (pip install ./cuvmm-capi, or the wheel) when there is one, else the
# modules of this checkout; either way CUVMM_LIB, when set, names the library.
try:
    import cuvmm_torch
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    import cuvmm_torch  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ALLOCS = ("native", "cuvmm", "cuvmm-pool")


NOBODY = 65534


def as_nobody(fn, *args):
    """Runs ``fn(out, *args)`` in a forked child as user and group nobody (the caller is root),
    ``out`` a text file the child prints to; returns (pid, that file's reading end). The child
    must use no CUDA."""
    import warnings
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: we mean it
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with os.fdopen(w, "w", buffering=1) as out:
                fn(out, *args)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)


def squat(out, address: bytes):
    """Takes a cuvmm hand-off address (an abstract socket name) as an impostor would, answers a
    token with a socket, and prints "ready", then whether a token came."""
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(address)
        s.listen(1)
        print("ready", file=out, flush=True)
        s.settimeout(60)
        conn, _ = s.accept()
        with conn:
            conn.settimeout(5)
            try:
                token = conn.recv(17)
            except OSError:
                token = b""
            if token:
                a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                with a, b:
                    socket.send_fds(conn, [b"\x01"], [b.fileno()])
    print("got a token" if token else "no token", file=out, flush=True)


def median(xs):
    xs = list(xs)
    return statistics.median(xs) if xs else None


# Student's t at 97.5% for 1..30 degrees of freedom; 1.96 past them.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def paired_ratio(a, b):
    """(ratio, relative half-width, upper end) of the 95% interval of b over a, from rounds that
    measured a[k] and b[k] together: the geometric mean of b[k] / a[k] and Student's interval of
    the mean of their logarithms. Fewer than two rounds: an infinite interval.

    >>> r, rel, hi = paired_ratio([10.0, 20.0, 30.0], [11.0, 22.0, 33.0])
    >>> round(r, 6), round(rel, 6), round(hi, 6)
    (1.1, 0.0, 1.1)
    """
    logs = [math.log(y / x) for x, y in zip(a, b)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("inf"), float("inf")
    t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.expm1(half), math.exp(mean + half)


def median_pair_ratio(a, b):
    """The median over rounds of b[k] / a[k]: the ratio of two things measured side by side in each
    round, which neither a drift between rounds nor a burst in a few of them moves.

    >>> median_pair_ratio([10.0, 20.0, 30.0, 10.0], [10.2, 20.4, 30.6, 40.0])
    1.02
    """
    if not a or len(a) != len(b):
        raise ValueError(f"need rounds of both, as many of each: {len(a)} and {len(b)}")
    return statistics.median(y / x for x, y in zip(a, b))


def handoff_tensors(torch, gib: float, count: int) -> list:
    """The hand-off benchmarks' workload: ``count`` uint8 tensors on GPU 0 totalling ``gib`` GiB
    (each a multiple of 512 bytes), tensor k filled with k % 251, the fills synchronised."""
    per = int(gib * GiB) // count // 512 * 512
    tensors = [torch.full((per,), k % 251, dtype=torch.uint8, device="cuda:0") for k in range(count)]
    torch.cuda.synchronize()
    return tensors


def load_read_kernels(torch, count: int = 64):
    """Runs once the kernels a hand-off's timed read runs (uint8 stack of ``count`` elements, then
    sum) on GPU 0, with the context: CUDA loads a kernel's module at its first launch, which would
    be timed otherwise."""
    x = torch.ones(1024, dtype=torch.uint8, device="cuda:0")
    torch.stack([x[-1 - k] for k in range(count)]).sum().item()


def f32_bits(x: float) -> str:
    """Little-endian hex of x as an IEEE float32; exact for values that came from a float32."""
    return struct.pack("<f", x).hex()


def ranges_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Half-open address ranges [start, end)."""
    return a[0] < b[1] and b[0] < a[1]


def mod_pattern_sum(n: int, mod: int, add: int) -> int:
    """sum(k % mod + add for k in range(n)), closed form; the reference for fill_mod_pattern."""
    q, r = divmod(n, mod)
    return q * (mod * (mod - 1) // 2) + r * (r - 1) // 2 + n * add


def fill_mod_pattern(t, mod: int, add: int):
    """Fill an int32 CUDA tensor with k % mod + add in place, on the current stream, without
    allocating: a kernel writes every element, and the exact sum is known (mod_pattern_sum)."""
    import torch
    torch.arange(t.numel(), out=t.view(-1))
    t.remainder_(mod).add_(add)
    return t


def exact_sum(t):
    """int64 sum of an integer tensor as a 0-d CUDA tensor, on the current stream."""
    import torch
    return t.sum(dtype=torch.int64)


def rss_bytes(missing: int = 0) -> int:
    """Resident memory of this process (VmRSS), bytes; `missing` where /proc says nothing."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return missing


def lazyfree_bytes() -> int:
    """Bytes of this process's memory given back lazily (MADV_FREE) that the kernel has not taken
    yet: counted in VmRSS, though the kernel takes them whenever it needs memory (0 where /proc
    says nothing)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("LazyFree:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_each_in_a_child(script: str, argv: list, impls, prefix: str, context_of=None):
    """Runs ``script argv --impl IMPL --child-out FILE`` for each implementation, each in a fresh
    process (inside ``context_of(impl)`` where that gives a context manager), and returns
    (results by implementation, failures) from the JSON each child wrote."""
    import subprocess
    import tempfile
    results, failed = {}, []
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        for impl in impls:
            out = Path(d, impl + ".json")
            cmd = [sys.executable, str(Path(script).resolve()), *argv, "--impl", impl, "--child-out", str(out)]
            with (context_of(impl) if context_of else None) or contextlib.nullcontext():
                rc = subprocess.run(cmd).returncode
            if rc != 0 or not out.exists():
                failed.append(f"{impl}: the run failed (exit {rc})")
                continue
            results[impl] = json.loads(out.read_text())
    return results, failed


def report_comparison(script: str, args, results: dict, failed: list) -> int:
    """The closing lines of a comparison of implementations run by run_each_in_a_child: the JSON
    file of --json (every child's results), a FAILED line per failure and the RESULT line (each
    implementation's summary); the exit status."""
    line = {"script": script, "config": {k: v for k, v in vars(args).items() if k not in ("impl", "child_out")},
            "results": results, "failed": failed, "pass": not failed}
    if args.json:
        Path(args.json).write_text(json.dumps(line) + "\n")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    print("RESULT " + json.dumps({k: v for k, v in line.items() if k != "results"} |
                                 {"summary": {k: v["summary"] for k, v in results.items()}}), flush=True)
    return 0 if not failed else 1


def wall_time(fn) -> float:
    """Seconds fn takes on the host, the device synchronized before and after (a call that may
    wait on the host too: a sleep, a pause)."""
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def timed_copy(fn) -> float:
    """Seconds between CUDA events recorded on the current stream around fn, the device idle
    before: how long the copies fn queues take on the device."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def add_sleep_comparison_args(p, impls):
    """The arguments of a sleep comparison (vllm_compare.py, tms_compare.py): the
    WeightsAndCache workload's, --reps, --seed, --only, --json, and the two a child of
    run_each_in_a_child is given (--impl, --child-out)."""
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--cache-gib", type=float, default=4)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--cache-chunk-mib", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--only", choices=impls)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--impl", choices=impls, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)


def check_sleep_comparison_args(p, args):
    """Refuses (p.error) a cache chunk that does not hold whole rows of the weights."""
    if args.cache_chunk_mib * MiB // 2 % args.dim:
        p.error("--cache-chunk-mib must hold whole rows of --dim bf16 values")


class WeightsAndCache:
    """The sleep and pause workload: a model's weights, a KV-cache-like set of buffers, a forward
    through both for a CUDA graph to capture, and pinned copies of the weights that bound how
    fast their bytes can leave the device and come back.

    args: gib (GiB of dim x dim bf16 weights, allocated inside the context weights_scope() returns
    and filled from seeds), cache_gib (GiB of cache_chunk_mib MiB chunks inside cache_scope(),
    filled from seeds by fill_cache), dim, batch, seed. Both are filled outside their scopes, so
    that no temporary of a fill is allocated there; the fills leave the global generator alone.
    """

    def __init__(self, args, weights_scope, cache_scope):
        import torch
        self.args = args
        self.dev, self.bf16 = torch.device("cuda"), torch.bfloat16
        n_weights = max(1, int(args.gib * GiB) // (args.dim * args.dim * 2))
        self.chunk_elems = args.cache_chunk_mib * MiB // 2
        self.n_chunks = max(1, int(args.cache_gib * GiB) // (self.chunk_elems * 2))
        with weights_scope():
            self.weights = [torch.empty(args.dim, args.dim, dtype=self.bf16, device=self.dev)
                            for _ in range(n_weights)]
        with cache_scope():
            self.cache = [torch.empty(self.chunk_elems, dtype=self.bf16, device=self.dev)
                          for _ in range(self.n_chunks)]
        self.gen = torch.Generator(device=self.dev)
        for i, w in enumerate(self.weights):
            self.gen.manual_seed(args.seed * 7919 + i)
            w.normal_(0.0, 1.0 / math.sqrt(args.dim), generator=self.gen)
        self.fill_cache()
        self.weight_bytes = sum(w.numel() * 2 for w in self.weights)
        self.cache_bytes = self.n_chunks * self.chunk_elems * 2
        self.host = None

    def fill_cache(self):
        """The cache's contents, the same every time (a wake after a discarding sleep refills it)."""
        for i, c in enumerate(self.cache):
            self.gen.manual_seed(self.args.seed * 104729 + i)
            c.uniform_(-1.0, 1.0, generator=self.gen)

    def forward(self, x):
        """A reduction over the whole cache, then a matmul through every weight."""
        import torch
        dim = self.args.dim
        c = torch.zeros(dim, dtype=torch.float32, device=self.dev)
        for chunk in self.cache:
            c += chunk.view(-1, dim).sum(0, dtype=torch.float32)
        h = x + (c * (1.0 / (self.n_chunks * self.chunk_elems // dim))).to(self.bf16)
        for w in self.weights:
            h = torch.tanh(h @ w)
        return h

    def warm_up(self, x):
        """Two forwards on a side stream, as before a capture."""
        import torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def capture(self, graph_context=None):
        """A forward on a fixed input captured in a CUDA graph (inside ``graph_context(g)``,
        torch.cuda.graph by default) and replayed once, then the pinned buffer of the bound copies
        made and both copies warmed up: (the graph, its output, a copy of that output)."""
        import torch
        # Kept with the workload: the graph reads it at every replay, and freed it would be
        # another tensor's memory by then.
        self.graph_input = x = torch.randn(self.args.batch, self.args.dim, device=self.dev, dtype=self.bf16)
        self.warm_up(x)
        g = torch.cuda.CUDAGraph()
        with (graph_context or torch.cuda.graph)(g):
            y = self.forward(x)
        g.replay()
        torch.cuda.synchronize()
        ref = y.clone()
        self.pin_host()
        self.d2h()
        self.h2d()
        torch.cuda.synchronize()
        return g, y, ref

    def pin_host(self):
        """The pinned host buffer the bound copies use, as large as the weights."""
        import torch
        self.host = torch.empty(self.weight_bytes, dtype=torch.uint8, pin_memory=True)

    def d2h(self):
        """Queues a copy of every weight into the pinned buffer, per tensor, non-blocking."""
        import torch
        off = 0
        for w in self.weights:
            nb = w.numel() * 2
            self.host[off:off + nb].copy_(w.view(-1).view(torch.uint8), non_blocking=True)
            off += nb

    def h2d(self):
        """Queues the copy back of what d2h read, so the weights do not change."""
        import torch
        off = 0
        for w in self.weights:
            nb = w.numel() * 2
            w.view(-1).view(torch.uint8).copy_(self.host[off:off + nb], non_blocking=True)
            off += nb

    def weights_equal_host(self) -> bool:
        """Every weight byte for byte against the pinned buffer (what d2h copied last)."""
        import torch
        off = 0
        for w in self.weights:
            nb = w.numel() * 2
            if not torch.equal(w.view(-1).view(torch.uint8), self.host[off:off + nb].to(self.dev)):
                return False
            off += nb
        return True


# The driver's virtual memory API as ctypes sees it, for the scripts that measure it directly
# (CUmemLocation, CUmemAllocationProp, CUmemAccessDesc and the constants they use).
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CuLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CuAllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CuLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class CuAccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", CuLocation), ("flags", ctypes.c_int)]


def cu_check(cu, rc: int, call: str) -> None:
    """Raises for a CUresult other than CUDA_SUCCESS, naming the call and the result's name."""
    if rc != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: CUresult {rc} ({(name.value or b'?').decode()})")


def driver_version() -> str | None:
    try:
        v = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return None


def env_info() -> dict:
    import torch
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": p.name,
        "device_mem_gib": round(p.total_memory / GiB, 2),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver_cuda": driver_version(),
    }


def force_deterministic(seed: int) -> None:
    """Bitwise-repeatable runs. CUBLAS_WORKSPACE_CONFIG must already be in the environment
    (each script sets it before importing torch: cuBLAS reads it when its handle is made)."""
    import torch
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(seed)


class Alloc:
    """The allocator under test, set up before anything touches CUDA memory.

    native: PyTorch's caching allocator. cuvmm: change_current_allocator to cuvmm_malloc/free.
    cuvmm-pool: a torch.cuda.MemPool over cuvmm_pool_malloc/free, entered with scope().

    The driver-level baseline is taken once CUDA's context exists and before any tensor:
    torch.cuda.init() sets up PyTorch's CUDA state without allocating, and mem_get_info()
    (cudaMemGetInfo) creates the primary context, so the baseline holds the context and nothing
    of the allocator. Memory that libraries take later outside the allocator (cuBLAS and cuDNN
    handles, lazily loaded kernels) does count against every mode alike.
    """

    def __init__(self, mode: str, pool_kwargs: dict | None = None):
        if mode not in ALLOCS:
            raise ValueError(f"--alloc must be one of {ALLOCS}, not {mode!r}")
        self.mode = mode
        self.pool_kwargs = pool_kwargs or {}
        self.pool = None
        self.baseline_used = None
        self.total = None

    def setup(self):
        import torch
        if self.mode == "cuvmm":
            cuvmm_torch.use_as_current_allocator()
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        self.total, self.baseline_used = total, total - free
        if self.mode == "cuvmm-pool":
            self.pool = cuvmm_torch.mem_pool(**self.pool_kwargs)
        return self

    @property
    def uses_cuvmm(self) -> bool:
        return self.mode != "native"

    def scope(self, all_threads: bool = False):
        """Route allocations to the pool (cuvmm-pool), else a no-op. all_threads: the whole
        device, for code whose allocations happen on other threads (autograd's backward)."""
        import torch
        if self.pool is None:
            return contextlib.nullcontext()
        if all_threads:
            return cuvmm_torch.use_mem_pool_all_threads(self.pool)
        return torch.cuda.use_mem_pool(self.pool)

    def driver_used(self) -> int:
        """Device memory in use by everything (total - free) minus the baseline."""
        import torch
        free, total = torch.cuda.mem_get_info()
        return total - free - self.baseline_used

    def cuvmm_stats(self) -> dict | None:
        return cuvmm_torch.stats() if self.uses_cuvmm else None

    def empty_cache(self) -> None:
        """Give every idle byte back to the driver, whichever allocator holds it."""
        import torch
        torch.cuda.synchronize()
        if self.mode != "cuvmm":
            torch.cuda.empty_cache()  # native blocks, and free MemPool segments back to cuvmm
        if self.uses_cuvmm:
            cuvmm_torch.empty_cache()

    def torch_stats(self) -> dict:
        """PyTorch's own peak counters; they raise under a pluggable current allocator."""
        import torch
        if self.mode == "cuvmm":
            return {}
        return {
            "torch_max_memory_allocated": torch.cuda.max_memory_allocated(),
            "torch_max_memory_reserved": torch.cuda.max_memory_reserved(),
            "torch_memory_reserved": torch.cuda.memory_reserved(),
        }


def add_common_args(p, allocs=ALLOCS, default=None):
    p.add_argument("--alloc", choices=allocs, default=default or allocs[0])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="PATH", help="also write the result object here")
    return p


def log_passed(path) -> bool:
    """Whether a run's log states that its checks passed: at least one RESULT line, and every one
    saying "pass": true (what run_all.sh requires beside the exit status)."""
    results = []
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("RESULT "):
                try:
                    results.append(json.loads(line[len("RESULT "):]))
                except ValueError:
                    return False
    return bool(results) and all(isinstance(r, dict) and r.get("pass") is True for r in results)


def finish(script: str, args, result: dict, checks: dict, goals: dict | None = None) -> int:
    """Print the one RESULT line, write --json, and return the exit status.

    checks are correctness conditions; goals are performance targets. Both decide "pass"; they
    are kept apart so a reader sees which kind failed."""
    goals = goals or {}
    checks = {k: bool(v) for k, v in checks.items()}
    goals = {k: bool(v) for k, v in goals.items()}
    ok = all(checks.values()) and all(goals.values())
    out = {"script": script, "alloc": getattr(args, "alloc", None), **result,
           "checks": checks, "goals": goals, "pass": ok}
    line = json.dumps(out, default=_json_default)
    if getattr(args, "json", None):
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(line + "\n")
    failed = [k for k, v in {**checks, **goals}.items() if not v]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    print("RESULT " + line, flush=True)
    return 0 if ok else 1


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
