"""PyTorch's memory snapshots and allocation history answered from cuvmm.

Under ``change_current_allocator`` PyTorch's ``torch.cuda.memory._record_memory_history``,
``_snapshot`` and ``_dump_snapshot`` raise: the pluggable allocator has no history and no
snapshot. They go through ``torch._C._cuda_record_memory_history`` (``_legacy`` for the boolean
form), ``_cuda_isHistoryEnabled`` and ``_cuda_memorySnapshot``, which :func:`answer` replaces
while cuvmm is the current allocator and :func:`restore` puts back.

A snapshot is PyTorch's format: each cuvmm heap is a segment (``segment_type`` "small" for the
heaps of requests up to 1 MiB), each block ``active_allocated`` (handed out), ``inactive`` (free)
or ``active_pending_free`` (freed while another process still maps it); a segment of a tag says
so (``cuvmm_tag``, and ``cuvmm_asleep`` while the tag sleeps, its blocks then without memory
under them), and blocks kept for a captured CUDA graph carry that graph's pool in
``segment_pool_id`` ``(0, n)``. While history is recorded, each block has the Python stack that
allocated it and ``device_traces`` lists each allocation and free (``alloc``, then
``free_requested`` and ``free_completed`` together: cuvmm frees at once in PyTorch's eyes).

The stacks come from a function cuvmm calls at every allocation and free while history is
recorded (``cuvmm_set_alloc_observer``): it takes the GIL and walks the calling thread's Python
frames, a few microseconds per call, about as PyTorch's own recorder costs. With history off no
function is set, and each allocation pays one atomic load. C++ frames are not recorded
(``stacks="all"`` gives the Python ones).
"""

from __future__ import annotations

import collections
import ctypes
import json
import sys
import threading
import time

_C_NAMES = ("_cuda_record_memory_history", "_cuda_record_memory_history_legacy", "_cuda_isHistoryEnabled",
            "_cuda_memorySnapshot")
_STATES = {"live": "active_allocated", "free": "inactive", "freed_shared": "active_pending_free"}
_OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_ssize_t, ctypes.c_void_p)
_ALLOC, _FREE = ord("a"), ord("f")


def stack(skip: int = 0) -> list:
    """The calling thread's Python frames, innermost first, as PyTorch's snapshots list them."""
    out = []
    f = sys._getframe(skip + 1)
    while f is not None:
        out.append({"filename": f.f_code.co_filename, "line": f.f_lineno, "name": f.f_code.co_name})
        f = f.f_back
    return out


class History:
    """What ``_record_memory_history`` asked for, and what was recorded since."""

    def __init__(self, lib):
        self._lib = lib
        self._lock = threading.Lock()
        self.enabled = None  # None, "state" or "all"
        self.context = "all"
        self.max_entries = sys.maxsize
        self.traces = {}
        self.frames = {}
        self._callback = _OBSERVER(self._observe)

    def record(self, enabled, context="all", stacks="all", max_entries=sys.maxsize, clear_history=False):
        if enabled not in (None, "state", "all"):
            raise ValueError(f"enabled must be None, 'state' or 'all', not {enabled!r}")
        with self._lock:
            if clear_history or enabled is None:
                self.traces.clear()
            if enabled is None:
                self.frames.clear()
            self.enabled, self.context = enabled, context
            self.max_entries = max(int(max_entries), 0)
            for d in list(self.traces):
                self.traces[d] = collections.deque(self.traces[d], maxlen=self.max_entries)
        # The callback object stays referenced by this recorder for as long as the library may call it.
        fn = None if enabled is None else ctypes.cast(self._callback, ctypes.c_void_p)
        self._lib.cuvmm_set_alloc_observer(fn)

    def _observe(self, kind, device, ptr, size, stream):
        # Called from cuvmm_malloc and cuvmm_free with the GIL taken by ctypes: nothing may unwind.
        try:
            if kind == _ALLOC:
                frames = stack(1) if self.context else []
                self.frames[(device, ptr)] = frames
            else:
                self.frames.pop((device, ptr), None)
                frames = stack(1) if self.context == "all" and self.enabled == "all" else []
            if self.enabled != "all":
                return
            trace = self.traces.get(device)
            if trace is None:
                trace = self.traces.setdefault(device, collections.deque(maxlen=self.max_entries))
            now = time.time_ns() // 1000
            entry = {"addr": ptr, "size": size, "stream": stream or 0, "frames": frames, "time_us": now,
                     "compile_context": "N/A", "user_metadata": ""}
            if kind == _ALLOC:
                trace.append(dict(entry, action="alloc"))
            else:
                trace.append(dict(entry, action="free_requested"))
                trace.append(dict(entry, action="free_completed"))
        except BaseException:  # noqa: BLE001 - a lost record is better than a crash in C
            pass


def segments_from(raw: dict, frames: dict) -> list:
    """PyTorch's snapshot segments from cuvmm_snapshot_json's ``raw`` (by device), each block
    with the stack ``frames`` holds for it ((device, address) -> frames)."""
    out = []
    for dev, segs in sorted(raw.items(), key=lambda kv: int(kv[0])):
        d = int(dev)
        for s in segs:
            blocks, streams, pool = [], collections.Counter(), 0
            for b in s["blocks"]:
                state = _STATES[b["state"]]
                live = state != "inactive"
                if live:
                    streams[b["stream"]] += 1
                pool = pool or b["graph_pool"]
                blocks.append({
                    "address": b["address"], "size": b["size"],
                    "requested_size": b["requested"] if live else b["size"],
                    "state": state, "frames": frames.get((d, b["address"]), []) if live else [],
                })
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            out.append({
                "device": d, "address": s["address"], "total_size": sum(b["size"] for b in blocks),
                "allocated_size": allocated,
                "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
                "stream": streams.most_common(1)[0][0] if streams else 0,
                "segment_type": "small" if s["small"] else "large",
                "segment_pool_id": (0, pool), "is_expandable": True, "frames": [], "blocks": blocks,
                "cuvmm_tag": s["tag"], "cuvmm_asleep": s["asleep"],
            })
    return out


def raw_snapshot(lib, device: int = -1) -> dict:
    """cuvmm_snapshot_json of ``device`` (-1: every device used), parsed."""
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.cuvmm_snapshot_json(device, buf, size)
        if n < 0:
            err = lib.cuvmm_last_error()
            raise RuntimeError((err or b"cuvmm_snapshot_json failed").decode(errors="replace"))
        if n < size:
            return json.loads(buf.value.decode())
        size = n + (n >> 2) + 1  # blocks come and go between the two calls


def snapshot(lib, history: History, pool=None, include_traces: bool = True) -> dict:
    segs = segments_from(raw_snapshot(lib), dict(history.frames))
    if pool is not None and tuple(pool) != (0, 0):
        segs = [s for s in segs if s["segment_pool_id"] == tuple(pool)]
    devices = 1 + max([s["device"] for s in segs] + list(history.traces) + [-1])
    traces = [list(history.traces.get(d, ())) if include_traces else [] for d in range(devices)]
    return {"segments": segs, "device_traces": traces, "allocator_settings": {}, "external_annotations": []}


def has_snapshots(lib) -> bool:
    """Whether the library has the snapshot functions (their C types are cuvmm.SIGNATURES')."""
    return hasattr(lib, "cuvmm_snapshot_json") and hasattr(lib, "cuvmm_set_alloc_observer")


_saved = {}
_history = None


def answer(torch, lib) -> str | None:
    """Answer the history and snapshot functions of ``torch._C`` from cuvmm. Returns None, or why
    they were left as they are."""
    global _history
    if not has_snapshots(lib):
        return "the loaded libcuvmm.so has no cuvmm_snapshot_json"
    c = torch._C
    if not all(hasattr(c, n) for n in ("_cuda_record_memory_history", "_cuda_memorySnapshot")):
        return "this PyTorch has no torch._C._cuda_record_memory_history or _cuda_memorySnapshot"
    if _history is None or _history._lib is not lib:
        _history = History(lib)
    h = _history

    def record_memory_history(enabled, context="all", stacks="all", max_entries=sys.maxsize,
                              clear_history=False, *_more, **_kw):
        h.record(enabled, context, stacks, max_entries, clear_history)

    def record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                                     trace_alloc_record_context=False, *_more, **_kw):
        if not enabled:
            h.record(None)
        else:
            h.record("all" if trace_alloc_record_context else "state", "all" if record_context else None,
                     "python", trace_alloc_max_entries)

    def memory_snapshot(arg=None):
        if arg is None:
            return snapshot(lib, h)
        pool = tuple(arg[:2])
        include = bool(arg[2]) if len(arg) > 2 else True
        return snapshot(lib, h, pool, include)

    replacements = {
        "_cuda_record_memory_history": record_memory_history,
        "_cuda_record_memory_history_legacy": record_memory_history_legacy,
        "_cuda_isHistoryEnabled": lambda: h.enabled is not None,
        "_cuda_memorySnapshot": memory_snapshot,
    }
    for name, fn in replacements.items():
        if hasattr(c, name):
            _saved.setdefault(name, getattr(c, name))
            setattr(c, name, fn)
    return None


def restore(torch) -> None:
    """Put PyTorch's own functions back, and stop recording."""
    if _history is not None and _history.enabled is not None:
        _history.record(None)
    for name, fn in _saved.items():
        setattr(torch._C, name, fn)
    _saved.clear()
