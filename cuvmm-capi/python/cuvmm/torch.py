"""PyTorch on cuvmm: the allocator PyTorch calls, and MemPools whose segments come from cuvmm.

Every CUDA tensor of the process (before anything touches CUDA memory)::

    import cuvmm.torch, torch
    cuvmm.torch.use_as_current_allocator()
    x = torch.randn(1 << 20, device="cuda")

Only the tensors made inside a ``torch.cuda.MemPool``::

    pool = cuvmm.torch.mem_pool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.randn(1 << 20, device="cuda")

CUDA tensors on cuvmm memory go through ``torch.multiprocessing`` as exported pages, zero copy,
from the first :func:`allocator` on (:func:`share_tensors`; docs/multiprocessing.md);
:class:`SharedEvent` orders a reader after a writer's in-place update.

Importing this module imports PyTorch and checks its version (``cuvmm.TORCH_MINIMUM`` to
``cuvmm.TORCH_TESTED``): an older or unreadable one is an ImportError, a newer one a warning.
Nothing else happens at import: PyTorch is changed (its pickling of tensors, its
``change_current_allocator`` and statistics functions) and the library loaded only by the calls
that put cuvmm under PyTorch's memory (:func:`allocator`, and so :func:`use_as_current_allocator`
and :func:`mem_pool`; :func:`wire_hooks`; :func:`share_tensors`). Every name of :mod:`cuvmm`
(stats, tags, sleep and wake) is available here too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings

import cuvmm as _core
from cuvmm import _torch_stats as _stats
from cuvmm import _torch_tools as _tools
from cuvmm import *  # noqa: F401,F403  (the torch-free part, so that this module is enough)

try:
    import torch as _torch
except ImportError as e:  # pragma: no cover - exercised without torch by the package tests
    lo, hi = _core.TORCH_MINIMUM, _core.TORCH_TESTED
    raise ImportError(
        f"cuvmm.torch needs PyTorch ({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}), which is not installed "
        f"({e}); the rest of cuvmm (import cuvmm) works without it") from e

_problem = _core.torch_version_problem(_torch.__version__)
if _problem is not None:
    if _problem[0] == "error":
        raise ImportError(_problem[1])
    warnings.warn(_problem[1], RuntimeWarning, stacklevel=2)

from cuvmm import _torch_share as _share  # noqa: E402  (needs the PyTorch checked above)

__all__ = list(_core.__all__) + [
    "allocator", "use_as_current_allocator", "is_current_allocator", "mem_pool",
    "use_mem_pool_all_threads", "raises_on_oom", "native_oom_error", "share_tensors", "pending_shares",
    "release_kept_mappings", "SharedEvent", "wire_hooks", "HOOKS",
]

# The pluggable allocator's hooks cuvmm wires: (setter on CUDAPluggableAllocator(...).allocator(),
# cuvmm's entry point, what PyTorch calls it for). PyTorch 2.8 to 2.11 have all three; where a
# setter is missing, that call stays a no-op under cuvmm (wire_hooks warns and says which).
HOOKS = (
    ("set_reset_fn", "cuvmm_empty_cache_all", "torch.cuda.empty_cache()"),
    ("set_record_stream_fn", "cuvmm_record_stream", "Tensor.record_stream()"),
    ("set_memory_fraction_fn", "cuvmm_set_memory_fraction", "torch.cuda.set_per_process_memory_fraction()"),
)

_lock = threading.Lock()
_allocators = {}
_current = False
_shim = None
# The native allocators (``CUDAPluggableAllocator(...).allocator()``) wire_hooks wired.
_wired = []
_wired_lock = threading.Lock()


def _oom_class():
    return getattr(_torch, "OutOfMemoryError", None) or _torch.cuda.OutOfMemoryError


def _shim_path() -> str | None:
    p = os.path.join(os.path.dirname(os.path.abspath(_core.__file__)), "libcuvmm_torch.so")
    return p if os.path.isfile(p) else None


def raises_on_oom() -> bool:
    """Whether :func:`allocator` (``pool=False``) raises ``torch.OutOfMemoryError`` when cuvmm is
    out of memory. It does with the package as installed (libcuvmm_torch.so beside this file);
    from a bare source checkout it cannot, and an allocation cuvmm refuses becomes a tensor at
    address 0, whose first use faults the CUDA context."""
    return _shim_path() is not None


# c10::Error::Error(c10::SourceLocation, std::string) and c10::OutOfMemoryError's vtable.
_C10_CTORS = tuple(f"_ZN3c105ErrorC{k}ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"
                   for k in (1, 2))
_C10_OOM_VTABLE = "_ZTVN3c1016OutOfMemoryErrorE"
# Where the loaded PyTorch keeps them: the constructor in libc10, the vtable (emitted where the
# class is thrown) in whichever of these has one.
_C10_LIBS = ("libc10.so", "libc10_cuda.so", "libtorch_cuda.so", "libtorch_cpu.so", "libtorch_python.so")


def _c10_oom_symbols(lib_dir: str):
    """(constructor, vtable) addresses of c10::OutOfMemoryError in the PyTorch libraries of
    `lib_dir` that this process has loaded, or None."""
    found = {}
    for name in _C10_LIBS:
        path = os.path.join(lib_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            # Only a library PyTorch loaded already: its symbols are the ones PyTorch uses.
            lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL | getattr(os, "RTLD_NOLOAD", 0))
        except OSError:
            continue
        for key, symbols in (("ctor", _C10_CTORS), ("vtable", (_C10_OOM_VTABLE,))):
            for sym in symbols:
                if key in found:
                    break
                try:
                    found[key] = ctypes.addressof(ctypes.c_char.in_dll(lib, sym))
                except ValueError:
                    pass
    if "ctor" in found and "vtable" in found:
        return found["ctor"], found["vtable"]
    return None


def native_oom_error() -> bool:
    """Whether out of memory under :func:`allocator` (``pool=False``) throws PyTorch's own
    ``c10::OutOfMemoryError`` in C++, which PyTorch's fallbacks catch (cuDNN's convolution tries
    another algorithm or a smaller workspace), rather than an exception Python sees as
    ``torch.OutOfMemoryError`` but such C++ code does not catch. True once the allocator is made,
    where the loaded PyTorch exports the class's constructor and vtable."""
    return _native_oom


_native_oom = False


def _bound_shim():
    """libcuvmm_torch.so, bound to the loaded libcuvmm.so and to PyTorch's exception classes."""
    global _shim
    if _shim is None:
        lib = _core.load()
        shim = ctypes.CDLL(_shim_path())
        shim.cuvmm_torch_bind.restype = ctypes.c_int
        shim.cuvmm_torch_bind.argtypes = [ctypes.c_void_p] * 3 + [ctypes.py_object] * 2

        def addr(f):
            return ctypes.cast(f, ctypes.c_void_p)

        if shim.cuvmm_torch_bind(addr(lib.cuvmm_malloc), addr(lib.cuvmm_free), addr(lib.cuvmm_last_error),
                                 _oom_class(), RuntimeError) != 0:
            raise RuntimeError("cuvmm_torch_bind refused the library's functions")
        if hasattr(lib, "cuvmm_last_error_code") and hasattr(shim, "cuvmm_torch_bind_codes"):
            shim.cuvmm_torch_bind_codes.argtypes = [ctypes.c_void_p]
            shim.cuvmm_torch_bind_codes(addr(lib.cuvmm_last_error_code))
        _bind_c10(shim)
        _shim = shim
    return _shim


def _bind_c10(shim):
    global _native_oom
    if os.environ.get("CUVMM_TORCH_NATIVE_OOM", "1") == "0":
        return
    bind = getattr(shim, "cuvmm_torch_bind_c10", None)
    symbols = _c10_oom_symbols(os.path.join(os.path.dirname(os.path.abspath(_torch.__file__)), "lib"))
    if bind is None or symbols is None:
        return
    # The constructor takes a std::string of the C++11 ABI (its mangled name says so); a PyTorch
    # built with the other one has none, and the shim checks its own (cuvmm_torch_c10_refusal).
    if getattr(getattr(_torch, "_C", None), "_GLIBCXX_USE_CXX11_ABI", True) is False:
        why = "the loaded PyTorch was built with _GLIBCXX_USE_CXX11_ABI=0"
    else:
        bind.restype = ctypes.c_int
        bind.argtypes = [ctypes.c_void_p] * 2
        refusal = shim.cuvmm_torch_c10_refusal
        refusal.restype = ctypes.c_char_p
        _native_oom = bind(*symbols) == 0
        if _native_oom:
            return
        why = (refusal() or b"no reason given").decode(errors="replace")
    warnings.warn(f"cuvmm.torch: out of memory raises torch.OutOfMemoryError but not PyTorch's own "
                  f"c10::OutOfMemoryError, which C++ fallbacks (cuDNN's) catch: {why}", RuntimeWarning, stacklevel=4)


def allocator(pool: bool = False):
    """The ``torch.cuda.memory.CUDAPluggableAllocator`` over cuvmm.

    ``pool=False``: the pair for ``change_current_allocator``, cuvmm_malloc and cuvmm_free behind
    entry points that raise ``torch.OutOfMemoryError`` (RuntimeError for any other refusal)
    instead of returning NULL (see :func:`raises_on_oom`). ``pool=True``: cuvmm_pool_malloc and
    cuvmm_pool_free, the pair meant for ``MemPool`` (PyTorch raises for a NULL there itself)."""
    key = bool(pool)
    with _lock:
        if key not in _allocators:
            if pool:
                path, names = _core.library_path(), ("cuvmm_pool_malloc", "cuvmm_pool_free")
            elif raises_on_oom():
                _bound_shim()
                path, names = _shim_path(), ("cuvmm_torch_malloc", "cuvmm_torch_free")
            else:
                warnings.warn("libcuvmm_torch.so is missing (a source checkout, not the installed "
                              "package): out of memory under this allocator makes a tensor at address 0",
                              RuntimeWarning, stacklevel=3)
                path, names = _core.library_path(), ("cuvmm_malloc", "cuvmm_free")
                # PyTorch gets cuvmm_malloc's NULL without its text: stderr is where it shows.
                _core._log_every_error()
            alloc = _torch.cuda.memory.CUDAPluggableAllocator(path, *names)
            if not pool:
                wire_hooks(alloc)
            _allocators[key] = alloc
        # Tensors on its memory cannot take PyTorch's CUDA IPC: from now on they take cuvmm's.
        _share.share_by_default()
        return _allocators[key]


def wire_hooks(alloc):
    """Give a ``torch.cuda.memory.CUDAPluggableAllocator`` over cuvmm_malloc and cuvmm_free
    (or the raising entry points of :func:`allocator`) cuvmm's hooks: ``torch.cuda.empty_cache()``
    empties cuvmm's cache, ``Tensor.record_stream`` keeps a freed block from every request until
    the work of the recorded streams at the free has run (PyTorch's caching-allocator semantics),
    and ``torch.cuda.set_per_process_memory_fraction`` is a limit cuvmm enforces (past it,
    ``torch.OutOfMemoryError``). :func:`allocator` does this itself; call it for an allocator
    built by hand, before ``change_current_allocator``::

        a = torch.cuda.memory.CUDAPluggableAllocator(cuvmm.library_path(), "cuvmm_malloc", "cuvmm_free")
        cuvmm.torch.wire_hooks(a)
        torch.cuda.memory.change_current_allocator(a)

    Returns the setters used. Not for :func:`mem_pool`'s allocator: PyTorch's caching allocator
    keeps those hooks for a MemPool itself. While an allocator wired here is the current one,
    ``torch.cuda.memory_stats`` and its relatives answer from cuvmm's counters (see
    ``cuvmm._torch_stats`` for what each key means)."""
    lib = _core.load()
    native = alloc.allocator()
    used, missing = [], []
    for setter, entry, what in HOOKS:
        fn = getattr(native, setter, None)
        if fn is None or not hasattr(lib, entry):
            missing.append(f"{what} ({setter})")
            continue
        try:
            fn(ctypes.cast(getattr(lib, entry), ctypes.c_void_p).value)
        except (TypeError, RuntimeError) as e:  # a setter of another signature than 2.8 to 2.11's
            missing.append(f"{what} ({setter}: {e})")
            continue
        used.append(setter)
    if missing:
        warnings.warn(f"not reaching cuvmm with this PyTorch or library: {', '.join(missing)}",
                      RuntimeWarning, stacklevel=2)
    with _wired_lock:  # not _lock: allocator() holds that one while it calls this
        if not any(w is native for w in _wired):
            _wired.append(native)
    _wrap_change_current_allocator()
    _share.share_by_default()
    return used


def _is_wired(alloc) -> bool:
    native = getattr(alloc, "allocator", lambda: None)()
    return native is not None and any(w is native for w in _wired)


def _change_current_allocator(alloc):
    """``torch.cuda.memory.change_current_allocator`` that also answers PyTorch's statistics
    functions from cuvmm while an allocator wired to cuvmm is current, and gives PyTorch's own
    back when another one is put in its place."""
    global _current
    _original_change(alloc)
    if _is_wired(alloc):
        _stats.answer(_torch, _core.stats, _core.reset_peaks)
        _tools.answer(_torch, _core.load())
        _current = True
    else:
        _stats.restore(_torch)
        _tools.restore(_torch)
        _current = False


def _wrap_change_current_allocator():
    """Puts :func:`_change_current_allocator` in PyTorch's place, once: by the first allocator
    wired to cuvmm, which only a later ``change_current_allocator`` makes current."""
    global _original_change
    with _wired_lock:
        memory = getattr(getattr(_torch, "cuda", None), "memory", None)
        change = getattr(memory, "change_current_allocator", None)
        if change is None or change is _change_current_allocator:  # a stand-in without CUDA; done
            return
        _original_change = getattr(change, "__wrapped__", change)
        _change_current_allocator.__wrapped__ = _original_change
        memory.change_current_allocator = _change_current_allocator
        if hasattr(_torch.cuda, "change_current_allocator"):
            _torch.cuda.change_current_allocator = _change_current_allocator


_original_change = None


def use_as_current_allocator():
    """Route every CUDA allocation of this process through cuvmm; returns the allocator.

    PyTorch refuses to swap an allocator once CUDA is initialized, so call this first, before
    ``torch.cuda.init()`` or any CUDA tensor.

    Under this allocator ``torch.cuda.empty_cache()``, ``Tensor.record_stream`` and
    ``torch.cuda.set_per_process_memory_fraction`` reach cuvmm (:func:`wire_hooks`), and
    ``torch.cuda.memory_stats``, ``memory_allocated``, ``max_memory_allocated``,
    ``memory_reserved``, ``max_memory_reserved`` and ``reset_peak_memory_stats`` answer from
    cuvmm's counters in PyTorch's format. Out of memory raises ``torch.OutOfMemoryError`` and the
    process goes on. CUDA graphs captured by hand and ``torch.compile(mode="reduce-overhead")``
    work, and so do ``torch.cuda.memory._record_memory_history``, ``_snapshot`` and
    ``_dump_snapshot`` (docs/torch_tools.md).
    """
    if _torch.cuda.is_initialized():
        raise RuntimeError("use_as_current_allocator() must run before CUDA is initialized")
    alloc = allocator()
    _torch.cuda.memory.change_current_allocator(alloc)
    return alloc


def is_current_allocator() -> bool:
    """Whether :func:`use_as_current_allocator` put cuvmm under every tensor of this process."""
    return _current


def mem_pool(**kwargs):
    """A ``torch.cuda.MemPool`` whose segments come from cuvmm_pool_malloc.

    PyTorch's caching allocator places blocks inside those segments (record_stream, graphs and
    stats keep working); cuvmm supplies the device memory::

        pool = cuvmm.torch.mem_pool()
        with torch.cuda.use_mem_pool(pool):
            y = model(x)
    """
    return _torch.cuda.MemPool(allocator(pool=True).allocator(), **kwargs)


@contextlib.contextmanager
def use_mem_pool_all_threads(pool, device=None):
    """Like ``torch.cuda.use_mem_pool`` but for every thread of the process.

    ``use_mem_pool`` routes the calling thread only, and autograd runs backward on its own
    device threads, so a training step inside it puts its gradients and backward temporaries
    outside the pool. This routes the whole device instead::

        with cuvmm.torch.use_mem_pool_all_threads(pool):
            loss = model(x).sum(); loss.backward()
    """
    dev = _core._device(device)
    _torch._C._cuda_beginAllocateToPool(dev, pool.id)
    try:
        yield pool
    finally:
        _torch._C._cuda_endAllocateToPool(dev, pool.id)
        _torch._C._cuda_releasePool(dev, pool.id)


SharedEvent, pending_shares = _share.SharedEvent, _share.pending_shares
release_kept_mappings, share_tensors = _share.release_kept_mappings, _share.share_tensors
