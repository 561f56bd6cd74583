"""``torch.cuda.memory_stats`` and its relatives answered from cuvmm's counters.

PyTorch's pluggable allocator has no hook for statistics: under ``change_current_allocator``
``torch.cuda.memory_stats``, ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
``max_memory_reserved`` and ``reset_peak_memory_stats`` raise. They all go through three functions
of ``torch._C`` (``_cuda_memoryStats``, ``_cuda_resetPeakMemoryStats``,
``_cuda_resetAccumulatedMemoryStats``), which :func:`answer` replaces while cuvmm is the current
allocator and :func:`restore` puts back. No PyTorch is needed here: the module is handed in.

What each key means under cuvmm (``POOLS``: ``all`` and ``large_pool`` hold the same values,
``small_pool`` zeros; cuvmm's counters do not split blocks by size class):

- ``allocated_bytes``, ``active_bytes``: bytes handed out (``live``, block sizes, multiples of
  512); ``peak`` is ``live_peak``. ``requested_bytes``: bytes asked for (``requested``).
- ``reserved_bytes``: physical memory held (``mapped``: pages under blocks and cached idle pages);
  ``peak`` is ``mapped_peak``. What :func:`cuvmm.empty_cache` and ``torch.cuda.empty_cache`` give
  back comes off it.
- ``allocation``: counts of allocations (``allocated``), frees (``freed``) and their difference
  (``current``, also ``peak``: cuvmm keeps no peak count). ``segment``: pages created, released
  and held. ``num_device_alloc`` / ``num_device_free``: pages created / released with the driver.
- ``num_alloc_retries``: page creations refused and retried after freeing idle memory.
- The cumulative byte counts (``allocated``/``freed`` of the byte stats), ``inactive_split*``,
  ``num_ooms``, ``num_sync_all_streams``, ``max_split_size`` and the ``oversize_*`` stats are 0:
  cuvmm does not count them.

A block whose free waits for the streams ``Tensor.record_stream`` named counts as allocated until
that work has run and cuvmm frees it (PyTorch's caching allocator counts it as active only).
``torch.accelerator``'s memory functions answer the same where PyTorch has them.

``reset_peak_memory_stats`` resets cuvmm's peaks; ``reset_accumulated_memory_stats`` makes the
cumulative counts start again from zero (cuvmm's own counters are not changed).
"""

from __future__ import annotations

POOLS = ("all", "large_pool", "small_pool")
_STATS = ("current", "peak", "allocated", "freed")
# cuvmm counters that only grow: reset_accumulated_memory_stats subtracts their value at the reset.
CUMULATIVE = ("allocations", "frees", "pages_created", "pages_released", "oom_retries")
_C_NAMES = ("_cuda_memoryStats", "_cuda_resetPeakMemoryStats", "_cuda_resetAccumulatedMemoryStats")
# The same three behind torch.accelerator's memory functions, in the PyTorch versions that have them.
_ACCELERATOR_NAMES = ("_accelerator_getDeviceStats", "_accelerator_resetPeakStats",
                      "_accelerator_resetAccumulatedStats")


def _stat(current=0, peak=0, allocated=0, freed=0) -> dict:
    return {"current": current, "peak": max(peak, current), "allocated": allocated, "freed": freed}


def _pooled(stat: dict) -> dict:
    zero = _stat()
    return {"all": stat, "large_pool": dict(stat), "small_pool": dict(zero)}


def nested(s: dict, base: dict | None = None) -> dict:
    """PyTorch's nested ``memory_stats`` dict from the cuvmm counters ``s`` (:func:`cuvmm.stats`),
    with the cumulative counts taken from ``base`` on (the counters at the last
    ``reset_accumulated_memory_stats``)."""
    base = base or {}

    def acc(name):
        return s[name] - base.get(name, 0)

    allocs, frees = acc("allocations"), acc("frees")
    created, released = acc("pages_created"), acc("pages_released")
    live_blocks = s["allocations"] - s["frees"]
    held_pages = s["pages_created"] - s["pages_released"]
    return {
        "allocated_bytes": _pooled(_stat(s["live"], s["live_peak"])),
        "active_bytes": _pooled(_stat(s["live"], s["live_peak"])),
        "requested_bytes": _pooled(_stat(s["requested"], s["requested"])),
        "reserved_bytes": _pooled(_stat(s["mapped"], s["mapped_peak"])),
        "inactive_split_bytes": _pooled(_stat()),
        "allocation": _pooled(_stat(live_blocks, live_blocks, allocs, frees)),
        "active": _pooled(_stat(live_blocks, live_blocks, allocs, frees)),
        "segment": _pooled(_stat(held_pages, held_pages, created, released)),
        "inactive_split": _pooled(_stat()),
        "oversize_allocations": _stat(),
        "oversize_segments": _stat(),
        "num_alloc_retries": acc("oom_retries"),
        "num_ooms": 0,
        "num_sync_all_streams": 0,
        "num_device_alloc": created,
        "num_device_free": released,
        "max_split_size": -1,
    }


class Answer:
    """The replacements of the three ``torch._C`` functions, over ``stats(device)`` and
    ``reset_peaks(device)`` (cuvmm's)."""

    def __init__(self, stats, reset_peaks):
        self._stats, self._reset_peaks = stats, reset_peaks
        self._base = {}

    def memory_stats(self, device):
        return nested(self._stats(device), self._base.get(device))

    def reset_peak(self, device):
        self._reset_peaks(device)

    def reset_accumulated(self, device):
        s = self._stats(device)
        self._base[device] = {k: s[k] for k in CUMULATIVE}


_saved = {}


def answering(torch_module) -> bool:
    """Whether :func:`answer` is in force on ``torch_module``."""
    return id(torch_module) in _saved


def answer(torch_module, stats, reset_peaks) -> None:
    """Answer PyTorch's statistics functions from ``stats`` and ``reset_peaks`` until
    :func:`restore`. Answering already, it changes nothing."""
    c = torch_module._C
    if answering(torch_module) or not all(hasattr(c, n) for n in _C_NAMES):
        return
    a = Answer(stats, reset_peaks)
    saved = _saved[id(torch_module)] = {}
    for names in (_C_NAMES, _ACCELERATOR_NAMES):
        for name, fn in zip(names, (a.memory_stats, a.reset_peak, a.reset_accumulated)):
            if hasattr(c, name):
                saved[name] = getattr(c, name)
                setattr(c, name, fn)


def restore(torch_module) -> None:
    """Put PyTorch's own statistics functions back (nothing if :func:`answer` is not in force)."""
    saved = _saved.pop(id(torch_module), None)
    for name, fn in (saved or {}).items():
        setattr(torch_module._C, name, fn)
