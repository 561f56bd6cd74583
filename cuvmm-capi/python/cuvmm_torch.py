"""PyTorch bindings for libcuvmm.so, the cuvmm caching allocator (C ABI: ``cuvmm-capi/include/cuvmm.h``).

Plain ctypes, nothing to build. Two ways to put PyTorch on cuvmm:

Every CUDA tensor of the process (call before anything touches CUDA memory)::

    import cuvmm_torch, torch
    cuvmm_torch.use_as_current_allocator()
    x = torch.randn(1 << 20, device="cuda")
    print(cuvmm_torch.stats()["live"])

Only the tensors made inside a ``torch.cuda.MemPool``::

    pool = cuvmm_torch.mem_pool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.randn(1 << 20, device="cuda")

Sleep and wake of tagged memory (where the library has that part of the ABI, see has_sleep())::

    with cuvmm_torch.tag("weights"):
        w = torch.randn(4096, 4096, device="cuda")
    cuvmm_torch.sleep("weights")          # device memory released, contents kept in pinned host memory
    cuvmm_torch.wake("weights")           # same addresses, same contents

The library is found, in order: the ``path`` argument, the environment variable ``CUVMM_LIB``,
``libcuvmm.so`` next to this file, ``target/release/libcuvmm.so`` at the repository root.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
from pathlib import Path

__all__ = [
    "find_library", "load", "library_path", "allocator", "use_as_current_allocator", "mem_pool",
    "use_mem_pool_all_threads", "stats", "stats_json", "reset_peaks", "empty_cache",
    "release_graph_memory", "trace_flush", "last_error", "has_sleep", "set_tag", "tag", "sleep", "wake",
    "tag_stats",
]

_HERE = Path(__file__).resolve().parent

# cuvmm_stats_t in header order (tests/python/test_helpers.py checks this against cuvmm.h).
STAT_FIELDS = (
    "live", "live_peak", "requested", "mapped", "mapped_peak", "reserved", "allocations", "frees",
    "cache_hits", "pages_created", "pages_released", "pages_remapped", "events_recorded",
    "oom_retries", "graph_held",
)


class Stats(ctypes.Structure):
    """``cuvmm_stats_t``, followed by spare room: the struct carries no size, so a library built
    from a longer header would write past a buffer of exactly this length."""

    _fields_ = [(name, ctypes.c_uint64) for name in STAT_FIELDS] + [("_spare", ctypes.c_uint64 * 48)]


class TagStats(ctypes.Structure):
    """``cuvmm_tag_stats_t``."""

    _fields_ = [
        ("live", ctypes.c_uint64),
        ("mapped", ctypes.c_uint64),
        ("offloaded", ctypes.c_uint64),
        ("asleep", ctypes.c_int32),
        ("reserved_", ctypes.c_int32),
    ]


_lock = threading.Lock()
_lib = None
_lib_path = None
_allocators = {}
_tags = threading.local()


def find_library(path: str | os.PathLike | None = None) -> str:
    """Absolute path of libcuvmm.so; FileNotFoundError naming every place tried.

    An explicit ``path`` or ``CUVMM_LIB`` that does not exist is an error, not a reason to look
    elsewhere: a silently different library would make every measurement lie.

    >>> find_library("/opt/cuvmm/lib/libcuvmm.so")   # doctest: +SKIP
    '/opt/cuvmm/lib/libcuvmm.so'
    """
    if path is not None:
        candidates, explicit = [Path(path)], True
    elif os.environ.get("CUVMM_LIB"):
        candidates, explicit = [Path(os.environ["CUVMM_LIB"])], True
    else:
        candidates = [_HERE / "libcuvmm.so", _HERE.parent.parent / "target" / "release" / "libcuvmm.so"]
        explicit = False
    for c in candidates:
        if c.is_file():
            return str(c.resolve())
    how = "given" if explicit else "searched"
    raise FileNotFoundError(f"libcuvmm.so not found ({how}: {', '.join(map(str, candidates))})")


# What every build has; the rest (trace flush; tags, sleep and wake) is looked up when used.
_REQUIRED = ("cuvmm_malloc", "cuvmm_free", "cuvmm_pool_malloc", "cuvmm_pool_free", "cuvmm_get_stats",
             "cuvmm_stats_json", "cuvmm_reset_peaks", "cuvmm_empty_cache", "cuvmm_release_graph_memory",
             "cuvmm_last_error")
_SLEEP = ("cuvmm_set_tag", "cuvmm_sleep", "cuvmm_wake", "cuvmm_get_tag_stats")


def _declare(lib: ctypes.CDLL) -> None:
    missing = [n for n in _REQUIRED if not hasattr(lib, n)]
    if missing:
        raise RuntimeError(f"not a libcuvmm.so: {', '.join(missing)} missing")
    c_int, c_char_p, c_size_t, c_ssize_t = ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_ssize_t
    sigs = {
        "cuvmm_get_stats": (c_int, [c_int, ctypes.POINTER(Stats)]),
        "cuvmm_stats_json": (c_ssize_t, [c_char_p, c_size_t]),
        "cuvmm_reset_peaks": (c_int, [c_int]),
        "cuvmm_empty_cache": (c_int, [c_int]),
        "cuvmm_release_graph_memory": (c_int, [c_int]),
        "cuvmm_last_error": (c_char_p, []),
        "cuvmm_trace_flush": (None, []),
        "cuvmm_set_tag": (c_int, [c_char_p]),
        "cuvmm_sleep": (c_int, [c_char_p, c_int]),
        "cuvmm_wake": (c_int, [c_char_p]),
        "cuvmm_get_tag_stats": (c_int, [c_char_p, ctypes.POINTER(TagStats)]),
    }
    for name, (res, args) in sigs.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args


def _fn(name: str):
    lib = load()
    try:
        return getattr(lib, name)
    except AttributeError:
        raise RuntimeError(f"{_lib_path} has no {name}") from None


def has_sleep() -> bool:
    """Whether the loaded library has the sleep/wake part of the ABI (tags, sleep, wake)."""
    lib = load()
    return all(hasattr(lib, n) for n in _SLEEP)


def load(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Load libcuvmm.so once per process and return the handle.

    PyTorch's CUDAPluggableAllocator dlopens the same file again, which yields the same loaded
    library, so the allocator PyTorch calls and the one these functions inspect share state.
    Loading a second, different file is refused for that reason.
    """
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path is not None and find_library(path) != _lib_path:
                raise RuntimeError(f"cuvmm already loaded from {_lib_path}, not {path}")
            return _lib
        p = find_library(path)
        lib = ctypes.CDLL(p)
        _declare(lib)
        _lib, _lib_path = lib, p
        return lib


def library_path() -> str:
    """Path of the loaded library (loading it if needed)."""
    load()
    return _lib_path


def _encode(name: str | None) -> bytes | None:
    return None if name is None else name.encode()


def last_error() -> str | None:
    """The calling thread's last cuvmm error text, or None."""
    msg = load().cuvmm_last_error()
    return None if msg is None else msg.decode(errors="replace")


def _check(rc: int, what: str, ok=lambda rc: rc == 0) -> int:
    if not ok(rc):
        raise RuntimeError(f"{what} failed: {last_error() or 'no error text'}")
    return rc


def _device(device) -> int:
    if device is None:
        import torch
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    import torch
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def allocator(pool: bool = False):
    """The ``torch.cuda.memory.CUDAPluggableAllocator`` over cuvmm_malloc/cuvmm_free
    (``pool=True``: cuvmm_pool_malloc/cuvmm_pool_free, the pair meant for MemPool)."""
    import torch
    path = library_path()
    key = bool(pool)
    if key not in _allocators:
        names = ("cuvmm_pool_malloc", "cuvmm_pool_free") if pool else ("cuvmm_malloc", "cuvmm_free")
        _allocators[key] = torch.cuda.memory.CUDAPluggableAllocator(path, *names)
    return _allocators[key]


def use_as_current_allocator():
    """Route every CUDA allocation of this process through cuvmm; returns the allocator.

    PyTorch refuses to swap an allocator once CUDA is initialized, so call this first,
    before ``torch.cuda.init()`` or any CUDA tensor::

        cuvmm_torch.use_as_current_allocator()
        torch.cuda.init()

    Under this allocator PyTorch (2.11) forwards neither ``Tensor.record_stream`` nor
    ``torch.cuda.empty_cache`` to cuvmm, and ``torch.cuda.memory_stats`` and its relatives
    raise: use :func:`stats` and :func:`empty_cache` from this module, and order a free after
    work on other streams yourself (``alloc_stream.wait_stream(other)`` before the last reference
    goes away). Nor does it check the pointer it gets: an allocation cuvmm refuses (out of
    memory) becomes a tensor at address 0 instead of an OutOfMemoryError, so leave headroom, or
    use :func:`mem_pool`, where PyTorch's caching allocator does raise.
    """
    import torch
    if torch.cuda.is_initialized():
        raise RuntimeError("use_as_current_allocator() must run before CUDA is initialized")
    alloc = allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc


def mem_pool(**kwargs):
    """A ``torch.cuda.MemPool`` whose segments come from cuvmm_pool_malloc.

    PyTorch's caching allocator places blocks inside those segments (record_stream, graphs and
    stats keep working); cuvmm supplies the device memory::

        pool = cuvmm_torch.mem_pool()
        with torch.cuda.use_mem_pool(pool):
            y = model(x)
    """
    import torch
    return torch.cuda.MemPool(allocator(pool=True).allocator(), **kwargs)


@contextlib.contextmanager
def use_mem_pool_all_threads(pool, device=None):
    """Like ``torch.cuda.use_mem_pool`` but for every thread of the process.

    ``use_mem_pool`` routes the calling thread only, and autograd runs backward on its own
    device threads, so a training step inside it puts its gradients and backward temporaries
    outside the pool. This routes the whole device instead::

        with cuvmm_torch.use_mem_pool_all_threads(pool):
            loss = model(x).sum(); loss.backward()
    """
    import torch
    dev = _device(device)
    torch._C._cuda_beginAllocateToPool(dev, pool.id)
    try:
        yield pool
    finally:
        torch._C._cuda_endAllocateToPool(dev, pool.id)
        torch._C._cuda_releasePool(dev, pool.id)


def stats(device=None) -> dict:
    """cuvmm_get_stats of ``device`` (default: the current one) as a dict of ints.

    >>> cuvmm_torch.stats(0)["mapped_peak"]   # doctest: +SKIP
    25769803776
    """
    out = Stats()
    _check(load().cuvmm_get_stats(_device(device), ctypes.byref(out)), "cuvmm_get_stats")
    return {name: int(getattr(out, name)) for name in STAT_FIELDS}


def stats_json():
    """cuvmm_stats_json, parsed: the stats of every device used so far."""
    lib = load()
    def call(buf, n):
        return _check(lib.cuvmm_stats_json(buf, n), "cuvmm_stats_json", ok=lambda rc: rc >= 0)

    need = call(None, 0)
    while True:
        buf = ctypes.create_string_buffer(need + 1)
        got = call(buf, need + 1)
        if got <= need:  # a device first used between the two calls makes it grow
            return json.loads(buf.value.decode())
        need = got


def reset_peaks(device: int = -1) -> None:
    """Reset live_peak and mapped_peak to the current values (-1: every device)."""
    _check(load().cuvmm_reset_peaks(device), "cuvmm_reset_peaks")


def empty_cache(device: int = -1) -> None:
    """Wait for the device's work, then give every idle page back to the driver (-1: every
    device). ``torch.cuda.empty_cache`` does not reach cuvmm under use_as_current_allocator."""
    _check(load().cuvmm_empty_cache(device), "cuvmm_empty_cache")


def release_graph_memory(device: int = -1) -> None:
    """Release the memory cuvmm kept for CUDA graphs captured through cuvmm_malloc.

    Only after those graphs are destroyed and their output tensors dropped::

        del g, static_out; gc.collect(); torch.cuda.synchronize()
        cuvmm_torch.release_graph_memory()
    """
    _check(load().cuvmm_release_graph_memory(device), "cuvmm_release_graph_memory")


def trace_flush() -> None:
    """Write the allocation trace (``trace=`` in CUVMM_ALLOC_CONF) out now."""
    _fn("cuvmm_trace_flush")()


def set_tag(name: str | None) -> None:
    """Tag this thread's later allocations with ``name`` (None: untagged). Prefer :func:`tag`.
    Raises RuntimeError for a name cuvmm refuses (empty, too long), the tag in force unchanged."""
    _check(_fn("cuvmm_set_tag")(_encode(name)), f"cuvmm_set_tag({name!r})")


@contextlib.contextmanager
def tag(name: str):
    """Allocations of this thread inside the block carry ``name``; the tag in force before
    (None outside any block) is restored on exit::

        with cuvmm_torch.tag("cache"):
            kv = torch.empty(n, device="cuda")

    With a MemPool the tag goes with the segments cuvmm hands to PyTorch, which asks for them
    lazily: give each tag its own pool and allocate in that pool only inside the block.
    """
    stack = getattr(_tags, "stack", None)
    if stack is None:
        stack = _tags.stack = []
    set_tag(name)
    stack.append(name)
    try:
        yield name
    finally:
        stack.pop()
        set_tag(stack[-1] if stack else None)


def sleep(name: str, offload: bool = True) -> None:
    """Release the device memory of every allocation tagged ``name``; with ``offload`` its
    contents go to pinned host memory first, else they are discarded (undefined after wake).
    Addresses stay valid for CUDA graphs and tensors, but must not be touched until
    :func:`wake`. Raises RuntimeError with cuvmm's error text on failure."""
    _check(_fn("cuvmm_sleep")(_encode(name), 1 if offload else 0), f"cuvmm_sleep({name!r})")


def wake(name: str) -> None:
    """Map the memory of ``name`` again at the same addresses, restoring offloaded contents.
    On failure (RuntimeError) what was not woken stays asleep with nothing lost, and a later
    call wakes it."""
    _check(_fn("cuvmm_wake")(_encode(name)), f"cuvmm_wake({name!r})")


def tag_stats(name: str) -> dict:
    """cuvmm_get_tag_stats: ``{"live", "mapped", "offloaded", "asleep"}``."""
    out = TagStats()
    _check(_fn("cuvmm_get_tag_stats")(_encode(name), ctypes.byref(out)), f"cuvmm_get_tag_stats({name!r})")
    return {"live": int(out.live), "mapped": int(out.mapped), "offloaded": int(out.offloaded),
            "asleep": bool(out.asleep)}
