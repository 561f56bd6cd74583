"""vLLM's sleep-mode allocator (``CuMemAllocator``) on cuvmm's sleep and wake.

vLLM, and RL frameworks on top of it, sleep an engine through
``vllm.device_allocator.cumem.CuMemAllocator``. This class has the same calls. With the cuvmm
wheel installed, ``CUVMM_VLLM=1`` in the environment puts cuvmm under vLLM's sleep mode in every
process vLLM starts (through vLLM's plugin entry point); or one line in each process that runs a
worker, before the engine starts::

    import cuvmm.vllm; cuvmm.vllm.install()     # then LLM(..., enable_sleep_mode=True) as before

and code that drives the allocator itself runs unchanged::

    from cuvmm.vllm import CuMemAllocator     # was: from vllm.device_allocator.cumem import ...

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        load_weights()
    with allocator.use_memory_pool(tag="kv_cache"):
        make_cache()
    allocator.sleep(offload_tags=("weights",))    # weights offloaded, everything else discarded
    allocator.wake_up()                           # same addresses; weights as they were

Each pool tag is a cuvmm tag: ``sleep`` is :func:`cuvmm.sleep` of every tag used (with offload
for those named), ``wake_up`` is :func:`cuvmm.wake`. Allocations inside ``use_memory_pool`` come
from a MemPool on cuvmm per (tag, device), or, when cuvmm is the process's allocator
(:func:`cuvmm.torch.use_as_current_allocator`), from that allocator under the tag. What differs
from vLLM's own is listed in docs/vllm.md.

This module imports PyTorch only when a pool is entered or a sleep ends.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading

from cuvmm._tag_pools import TagPools

__all__ = ["CuMemAllocator", "install", "plugin"]


class CuMemAllocator:
    """One per process (``get_instance``), as vLLM's is. ``api`` is the cuvmm module (or a
    stand-in with its tag, sleep, wake and tag_stats)."""

    instance: "CuMemAllocator | None" = None
    default_tag: str = "default"
    #: Tags whose host backup is made ready (``cuvmm.prepare_backup``) when their
    #: ``use_memory_pool`` block ends: those vLLM's workers offload at a sleep (the weights, and
    #: the default tag ``sleep`` offloads when not told otherwise), so that the first sleep costs
    #: what later ones do. Make it empty to prepare none.
    prepare_tags: tuple[str, ...] = ("weights", "default")

    @staticmethod
    def get_instance() -> "CuMemAllocator":
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def __init__(self, api=None):
        self._api = api
        self.current_tag: str = CuMemAllocator.default_tag
        # Tags in the order first used: the tags a sleep covers.
        self._tags: dict[str, None] = {}
        self._asleep: set[str] = set()
        self._pools = TagPools()

    @property
    def api(self):
        if self._api is None:
            import cuvmm
            self._api = cuvmm
        return self._api

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Releases the device memory of every tag used and awake; the contents of those in
        ``offload_tags`` (None: the default tag) go to host memory first, the rest are
        discarded. Called while asleep it sleeps only what was woken since."""
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        if not isinstance(offload_tags, (tuple, list, set, frozenset)):
            raise TypeError(f"offload_tags is a tag, a tuple of tags or None, not {offload_tags!r}")
        api = self.api
        # Those offloaded first: their copies are what the collection below runs beside.
        todo = sorted((t for t in self._tags if t not in self._asleep), key=lambda t: t not in offload_tags)
        failed = []
        entered = threading.Event()

        def sleep_tags():
            entered.set()
            try:
                for tag in todo:
                    api.sleep(tag, offload=tag in offload_tags)
                    self._asleep.add(tag)
            except BaseException as e:  # raised on the caller's thread below
                failed.append(e)

        # As vLLM does: a full collection, then what PyTorch caches outside the pools goes back.
        # The collection walks every object of the process (PyTorch's own, from its import, are
        # most of them) and holds the interpreter meanwhile; cuvmm's sleeps do not need it, so
        # they run on a thread of their own and the collection on this one, during their copies.
        worker = threading.Thread(target=sleep_tags, name="cuvmm-vllm-sleep")
        worker.start()
        try:
            entered.wait()
            gc.collect()
        finally:
            worker.join()
        if failed:
            raise failed[0]
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Maps the memory of ``tags`` (None: every sleeping tag) again at the same addresses,
        restoring offloaded contents; discarded ones are undefined. A tag that fails to wake
        stays asleep with nothing lost (a later call wakes it) and the error is raised."""
        api = self.api
        for tag in list(self._tags):
            if tag in self._asleep and (tags is None or tag in tags):
                api.wake(tag)
                self._asleep.discard(tag)

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None):
        """Allocations of this thread inside the block carry ``tag`` (None: the default tag)
        and sleep with it."""
        if tag is None:
            tag = CuMemAllocator.default_tag
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"a pool's tag is a non-empty string, not {tag!r}")
        if tag in self._asleep:
            raise RuntimeError(f"tag {tag!r} is asleep: wake it up before allocating under it")
        self._tags.setdefault(tag, None)
        old, self.current_tag = self.current_tag, tag
        try:
            with self._scope(tag):
                yield
        finally:
            self.current_tag = old
        prepare = getattr(self.api, "prepare_backup", None)
        if tag in self.prepare_tags and prepare is not None:
            prepare(tag)

    def get_current_usage(self) -> int:
        """Bytes cuvmm has handed out under the tags used, asleep or awake (vLLM counts its
        allocations whether mapped or not)."""
        return sum(int(self.api.tag_stats(t)["live"]) for t in self._tags)

    def _scope(self, tag: str):
        """Where this thread's allocations under ``tag`` come from (a seam for the tests)."""
        return self._pools.scope(self.api, tag)


def plugin() -> None:
    """vLLM's general plugin (the ``vllm.general_plugins`` entry point of the cuvmm wheel), which
    vLLM runs in every process it starts: :func:`install` when ``CUVMM_VLLM=1``, else nothing.
    So setting that variable for the job (workers inherit it, Ray's too through its runtime
    environment) puts every worker's sleep mode on cuvmm."""
    if os.environ.get("CUVMM_VLLM", "").strip() not in ("", "0"):
        install()


def install() -> None:
    """Makes vLLM's sleep mode use cuvmm in this process: vLLM's workers look the allocator up
    in ``vllm.device_allocator.cumem`` when they load weights, make the cache, sleep and wake,
    so it must run before that, in each process that runs a worker."""
    import vllm.device_allocator.cumem as cumem
    cumem.CuMemAllocator = CuMemAllocator
    cumem.cumem_available = True
