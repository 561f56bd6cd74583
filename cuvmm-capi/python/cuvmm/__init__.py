"""cuvmm from Python: libcuvmm.so (C ABI: ``cuvmm-capi/include/cuvmm.h``) through ctypes.

This module needs no PyTorch: statistics, cache control, tags, sleep and wake. The PyTorch side
(the allocator PyTorch calls, ``MemPool``) is :mod:`cuvmm.torch`; a drop-in for torch_memory_saver
is :mod:`cuvmm.torch_memory_saver`.

Every CUDA tensor of the process (call before anything touches CUDA memory)::

    import cuvmm.torch, torch
    cuvmm.torch.use_as_current_allocator()
    x = torch.randn(1 << 20, device="cuda")
    print(cuvmm.stats()["live"])

Sleep and wake of tagged memory (where the library has that part of the ABI, see has_sleep())::

    with cuvmm.tag("weights"):
        w = torch.randn(4096, 4096, device="cuda")
    cuvmm.sleep("weights")          # device memory released, contents kept in host memory
    cuvmm.wake("weights")           # same addresses, same contents

The library is found, in order: the ``path`` argument, the environment variable ``CUVMM_LIB``,
``libcuvmm.so`` inside this package (where the wheel puts it), ``target/release/libcuvmm.so`` at
the root of a source checkout.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import sys
import threading
from pathlib import Path

__version__ = "0.1.0"

__all__ = [
    "find_library", "load", "library_path", "stats", "stats_json", "reset_peaks", "empty_cache",
    "release_graph_memory", "trace_flush", "last_error", "has_sleep", "set_tag", "tag", "sleep", "wake",
    "tag_stats", "has_backup", "set_backup", "prepare_backup", "handoff_stats", "last_error_code",
    "OutOfMemoryError",
]

_HERE = Path(__file__).resolve().parent
# A source checkout: cuvmm-capi/python/cuvmm/ -> the repository root.
_CHECKOUT = _HERE.parent.parent.parent

# PyTorch releases cuvmm.torch is made for: the newest one it was tested with, and the oldest
# whose allocator, MemPool and exception interfaces it relies on.
TORCH_TESTED = (2, 11)
TORCH_MINIMUM = (2, 8)


def torch_version_problem(version: str):
    """What is wrong with PyTorch ``version`` for cuvmm.torch: None, ``("error", text)`` below
    TORCH_MINIMUM (or unreadable), ``("warning", text)`` above TORCH_TESTED.

    >>> torch_version_problem("2.11.0+cu130") is None
    True
    """
    import re
    m = re.match(r"(\d+)\.(\d+)", version or "")
    supported = (f"cuvmm {__version__} supports PyTorch {TORCH_MINIMUM[0]}.{TORCH_MINIMUM[1]} "
                 f"to {TORCH_TESTED[0]}.{TORCH_TESTED[1]}")
    if m is None:
        return "error", f"{supported}; cannot read the version of the installed one ({version!r})"
    mm = (int(m.group(1)), int(m.group(2)))
    if mm < TORCH_MINIMUM:
        return "error", f"{supported}; PyTorch {version} is older"
    if mm > TORCH_TESTED:
        return "warning", f"{supported}; PyTorch {version} is newer and was not tested"
    return None


# cuvmm_stats_t in header order (tests/python/test_helpers.py checks this against cuvmm.h).
STAT_FIELDS = (
    "live", "live_peak", "requested", "mapped", "mapped_peak", "reserved", "allocations", "frees",
    "cache_hits", "pages_created", "pages_released", "pages_remapped", "events_recorded",
    "oom_retries", "graph_held", "exported", "freed_shared",
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


HANDOFF_FIELDS = ("offered", "held", "connections", "expired", "revocations", "let_go", "leases", "kept",
                  "kept_bytes", "releasing", "held_for_good", "revoked", "senders")


class HandoffStats(ctypes.Structure):
    """``cuvmm_handoff_stats_t``."""

    _fields_ = [(name, ctypes.c_uint64) for name in HANDOFF_FIELDS]


class Export(ctypes.Structure):
    """``cuvmm_export_t``: where a shared block lies."""

    _fields_ = [(name, ctypes.c_uint64) for name in ("block", "len", "first_page", "page", "count")]


# (restype, argtypes) of every function of cuvmm.h this package calls through ctypes, set on the
# library when it is loaded (tests/python/test_header.py checks each against the header).
SIGNATURES = {
    "cuvmm_get_stats": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(Stats)]),
    "cuvmm_stats_json": (ctypes.c_ssize_t, [ctypes.c_char_p, ctypes.c_size_t]),
    "cuvmm_snapshot_json": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "cuvmm_set_alloc_observer": (ctypes.c_int, [ctypes.c_void_p]),
    "cuvmm_reset_peaks": (ctypes.c_int, [ctypes.c_int]),
    "cuvmm_empty_cache": (ctypes.c_int, [ctypes.c_int]),
    "cuvmm_release_graph_memory": (ctypes.c_int, [ctypes.c_int]),
    "cuvmm_empty_cache_all": (None, []),
    "cuvmm_record_stream": (None, [ctypes.c_void_p, ctypes.c_void_p]),
    "cuvmm_set_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
    "cuvmm_last_error": (ctypes.c_char_p, []),
    "cuvmm_last_error_code": (ctypes.c_int, []),
    "cuvmm_set_error_log": (ctypes.c_int, [ctypes.c_int]),
    "cuvmm_trace_flush": (None, []),
    "cuvmm_set_tag": (ctypes.c_int, [ctypes.c_char_p]),
    "cuvmm_sleep": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
    "cuvmm_wake": (ctypes.c_int, [ctypes.c_char_p]),
    "cuvmm_get_tag_stats": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(TagStats)]),
    "cuvmm_set_backup": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p]),
    "cuvmm_prepare_backup": (ctypes.c_int64, [ctypes.c_char_p]),
    "cuvmm_owner": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                                   ctypes.POINTER(ctypes.c_uint64)]),
    "cuvmm_export": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Export),
                                        ctypes.POINTER(ctypes.c_int), ctypes.c_size_t]),
    "cuvmm_export_pages": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Export),
                                              ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                                              ctypes.c_size_t]),
    "cuvmm_export_mark": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Export),
                                             ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]),
    "cuvmm_export_fds": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int),
                                            ctypes.c_size_t]),
    "cuvmm_unexport": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint64]),
    "cuvmm_import": (ctypes.c_void_p, [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_size_t,
                                       ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_uint64)]),
    "cuvmm_import_release": (ctypes.c_int, [ctypes.c_void_p]),
    "cuvmm_handoff_prepare": (ctypes.c_int, []),
    "cuvmm_offer": (ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p,
                                       ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)]),
    "cuvmm_withdraw": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t]),
    "cuvmm_take": (ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int),
                                     ctypes.c_size_t, ctypes.c_double, ctypes.POINTER(ctypes.c_int),
                                     ctypes.POINTER(ctypes.c_uint64)]),
    "cuvmm_lease_release": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
    "cuvmm_let_go": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_double]),
    "cuvmm_ticket_len": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)]),
    "cuvmm_handoff_stats": (ctypes.c_int, [ctypes.POINTER(HandoffStats)]),
}


_lock = threading.Lock()
_lib = None
_lib_path = None
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
        candidates = [_HERE / "libcuvmm.so", _CHECKOUT / "target" / "release" / "libcuvmm.so"]
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
_LOG_ALL, _LOG_UNRETURNED = 0, 1  # cuvmm.h's CUVMM_LOG_ALL and CUVMM_LOG_UNRETURNED
# cuvmm.h's cuvmm_error_t, the codes cuvmm_last_error_code returns (the rest: see the header).
ERROR_OK, ERROR_INVALID_ARGUMENT, ERROR_OUT_OF_MEMORY = 0, 1, 2
ERROR_PEER_REFUSED, ERROR_TIMEOUT = 8, 9
# Where each backup of a sleeping tag's contents lives (cuvmm_set_backup's `backend`).
BACKUP_BACKENDS = {"pageable": 0, "pinned": 1, "disk": 2}


def _declare(lib: ctypes.CDLL) -> None:
    missing = [n for n in _REQUIRED if not hasattr(lib, n)]
    if missing:
        raise RuntimeError(f"not a libcuvmm.so: {', '.join(missing)} missing")
    for name, (res, args) in SIGNATURES.items():
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
        if hasattr(lib, "cuvmm_set_error_log"):
            # Every error a return value reports becomes an exception here: stderr keeps only the
            # rest (frees, and the pool's allocations, whose text PyTorch never sees).
            lib.cuvmm_set_error_log(_LOG_UNRETURNED)
        _lib, _lib_path = lib, p
        return lib


def _log_every_error() -> None:
    """Write every kind of error to stderr once, as for a C caller, also those that functions of
    this package raise: for a caller that hands cuvmm_malloc's NULL on without its text."""
    lib = load()
    if hasattr(lib, "cuvmm_set_error_log"):
        lib.cuvmm_set_error_log(_LOG_ALL)


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


def last_error_code() -> int | None:
    """The code of the calling thread's last cuvmm error (``ERROR_OUT_OF_MEMORY``, ...; cuvmm.h's
    ``cuvmm_error_t``), ``ERROR_OK`` when it has met none, or None for a library without codes."""
    lib = load()
    return lib.cuvmm_last_error_code() if hasattr(lib, "cuvmm_last_error_code") else None


class OutOfMemoryError(RuntimeError):
    """A cuvmm call failed out of memory (a wake, say): the device's memory, or the memory
    fraction. Later calls may succeed once memory is freed."""


def _check(rc: int, what: str, ok=lambda rc: rc == 0) -> int:
    if not ok(rc):
        text = last_error() or "no error text"
        # The library's text starts with the C function's name, which `what` names already.
        name = what.split("(", 1)[0] + ": "
        error = OutOfMemoryError if last_error_code() == ERROR_OUT_OF_MEMORY else RuntimeError
        raise error(f"{what} failed: {text[len(name):] if text.startswith(name) else text}")
    return rc


def error_from(what: str) -> Exception:
    """The exception for a failed ``what`` whose text ``cuvmm_last_error`` holds: TimeoutError for
    a peer that did not answer in time, PermissionError for a peer refused, RuntimeError else."""
    text = last_error() or "no error text"
    name = what + ": "
    text = text[len(name):] if text.startswith(name) else text
    code = last_error_code()
    if code == ERROR_TIMEOUT or "timed out" in text:
        return TimeoutError(f"{what}: the sending process did not answer in time ({text})")
    if code == ERROR_PEER_REFUSED or "refusing" in text:
        return PermissionError(f"{what}: {text}")
    return RuntimeError(f"{what} failed: {text}")


def handoff_stats() -> dict:
    """The hand-off's counters in this process (``cuvmm_handoff_stats_t``): as a sender, offers not
    taken (``offered``), taken and held (``held``), let go, revoked pages; as a receiver, leases in
    use, mappings kept and their bytes, releases waiting for the device."""
    st = HandoffStats()
    _check(_fn("cuvmm_handoff_stats")(ctypes.byref(st)), "cuvmm_handoff_stats")
    return {name: getattr(st, name) for name in HANDOFF_FIELDS}


def _current_device() -> int:
    # PyTorch's current device where PyTorch is in use; without it nothing chose one, and CUDA's
    # default is device 0. Importing torch here would make every caller without it pay for it.
    torch = sys.modules.get("torch")
    return torch.cuda.current_device() if torch is not None else 0


def _device(device) -> int:
    """A device index from None (the current device), an int, "cuda", "cuda:N" or a torch.device."""
    if device is None:
        return _current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        m = re.fullmatch(r"cuda(?::(\d+))?", device.strip())
        if m is None:
            raise ValueError(f"not a CUDA device: {device!r}")
        return _current_device() if m.group(1) is None else int(m.group(1))
    index = getattr(device, "index", None)
    if getattr(device, "type", None) != "cuda":
        raise ValueError(f"not a CUDA device: {device!r}")
    return _current_device() if index is None else index


def stats(device=None) -> dict:
    """cuvmm_get_stats of ``device`` (default: the current one) as a dict of ints.

    >>> cuvmm.stats(0)["mapped_peak"]   # doctest: +SKIP
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
    device). Under :func:`cuvmm.torch.use_as_current_allocator` ``torch.cuda.empty_cache()``
    does the same for every device; this stays as its alias, also for a MemPool on cuvmm."""
    _check(load().cuvmm_empty_cache(device), "cuvmm_empty_cache")


def release_graph_memory(device: int = -1) -> None:
    """Release the memory cuvmm kept for CUDA graphs captured through cuvmm_malloc.

    Only after those graphs are destroyed and their output tensors dropped::

        del g, static_out; gc.collect(); torch.cuda.synchronize()
        cuvmm.release_graph_memory()
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
def tag(name: str | None):
    """Allocations of this thread inside the block carry ``name`` (None: no tag); the tag in force
    before (None outside any block) is restored on exit::

        with cuvmm.tag("cache"):
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
    contents go to host memory first (where :func:`set_backup` says, where the library has it;
    pinned host memory otherwise), else they are discarded (undefined after wake).
    Addresses stay valid for CUDA graphs and tensors, but must not be touched until
    :func:`wake`. Raises RuntimeError with cuvmm's error text on failure."""
    _check(_fn("cuvmm_sleep")(_encode(name), 1 if offload else 0), f"cuvmm_sleep({name!r})")


def wake(name: str) -> None:
    """Map the memory of ``name`` again at the same addresses, restoring offloaded contents.
    On failure (RuntimeError) what was not woken stays asleep with nothing lost, and a later
    call wakes it."""
    _check(_fn("cuvmm_wake")(_encode(name)), f"cuvmm_wake({name!r})")


def prepare_backup(name: str) -> int:
    """Get the backup of tag ``name`` ready for its first offloading sleep, in the background:
    host memory as large as that sleep would copy now is faulted in and left for the kernel to
    take back only if it needs it, as a wake leaves a backup, so the first sleep costs what later
    ones do; the staging ring those sleeps copy through is made then too (64 MiB pinned, as a first
    sleep would). Call it once the tag holds what it will sleep with (after loading the weights).
    Returns the bytes being prepared (0: nothing needed, or not possible: a pinned, disk or
    retained backup, not that much host memory available). RuntimeError for a tag asleep."""
    return _check(_fn("cuvmm_prepare_backup")(_encode(name)), f"cuvmm_prepare_backup({name!r})",
                  ok=lambda rc: rc >= 0)


def tag_stats(name: str) -> dict:
    """cuvmm_get_tag_stats: ``{"live", "mapped", "offloaded", "asleep"}``."""
    out = TagStats()
    _check(_fn("cuvmm_get_tag_stats")(_encode(name), ctypes.byref(out)), f"cuvmm_get_tag_stats({name!r})")
    return {"live": int(out.live), "mapped": int(out.mapped), "offloaded": int(out.offloaded),
            "asleep": bool(out.asleep)}


def has_backup() -> bool:
    """Whether the loaded library can be told where a tag's backup lives (cuvmm_set_backup)."""
    return hasattr(load(), "cuvmm_set_backup")


def set_backup(name: str, backend: str = "pageable", retain: bool = False,
               directory: str | os.PathLike | None = None) -> None:
    """Where the offloaded contents of tag ``name`` go at its next sleep: ``"pageable"`` host
    memory through the staging ring (the library's default), ``"pinned"`` host memory, or a file
    in ``directory`` (``"disk"``). ``retain`` keeps the host backup after a wake, for fast
    repeated cycles. RuntimeError where the library lacks cuvmm_set_backup (see has_backup())."""
    if backend not in BACKUP_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKUP_BACKENDS)}, not {backend!r}")
    if (backend == "disk") != (directory is not None):
        raise ValueError("a directory is given with the disk backend, and only with it")
    d = None if directory is None else os.fsencode(directory)
    _check(_fn("cuvmm_set_backup")(_encode(name), BACKUP_BACKENDS[backend], 1 if retain else 0, d),
           f"cuvmm_set_backup({name!r}, {backend!r})")
