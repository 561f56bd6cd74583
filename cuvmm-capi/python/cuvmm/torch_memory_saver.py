"""torch_memory_saver's API on cuvmm's sleep and wake: code written for it runs by changing one import::

    from cuvmm.torch_memory_saver import torch_memory_saver     # was: from torch_memory_saver import ...

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(8192, 8192, device="cuda")
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch_memory_saver.pause()                # every tag: weights offloaded, the cache discarded
    torch_memory_saver.resume()               # same addresses; weights as they were

Each region tag is a cuvmm tag (cuvmm.tag); pause and resume are cuvmm.sleep and cuvmm.wake.
When cuvmm is the process's allocator (cuvmm.torch.use_as_current_allocator(), before CUDA is
used) a region only tags what is allocated inside it; otherwise a region allocates from a
MemPool on cuvmm of its own per (tag, device), as torch_memory_saver's "torch" hook mode does.
What differs from torch_memory_saver is listed in docs/torch_memory_saver.md.

This module imports PyTorch only when a region, graph or disable() is entered.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

from cuvmm._tag_pools import TagPools

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]

_TAG_DEFAULT = "default"


@dataclass(frozen=True)
class BackupMode:
    """What a tag's pause does with its contents: ``offload`` them to ``backend`` ("pageable",
    "pinned", "disk"; None: the library's default), or discard them."""

    offload: bool
    backend: str | None = None


def backup_mode(enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
                cpu_backup_backend: str | None = None, environ=None) -> BackupMode:
    """torch_memory_saver's region options as a cuvmm backup: "pinned" stays pinned, "mmap"
    (reclaimable host memory) is cuvmm's pageable backup, None is TMS_INIT_CPU_BACKUP_BACKEND
    where set, else cuvmm's default (pageable host memory through the staging ring)."""
    environ = os.environ if environ is None else environ
    if cpu_backup_backend is not None:
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in ("pinned", "mmap"):
            raise ValueError(f"cpu_backup_backend must be 'pinned' or 'mmap', not {cpu_backup_backend!r}")
    if enable_cpu_backup and enable_disk_backup:
        raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
    if enable_disk_backup:
        return BackupMode(True, "disk")
    if not enable_cpu_backup:
        return BackupMode(False)
    kind = cpu_backup_backend or environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or None
    if kind not in (None, "pinned", "mmap"):
        raise ValueError(f"TMS_INIT_CPU_BACKUP_BACKEND must be 'pinned' or 'mmap', not {kind!r}")
    return BackupMode(True, {"pinned": "pinned", "mmap": "pageable", None: None}[kind])


@contextlib.contextmanager
def configure_subprocess():
    """torch_memory_saver sets LD_PRELOAD for child processes here; cuvmm needs no preloading."""
    yield


class TorchMemorySaver:
    """The object behind ``torch_memory_saver``; ``api`` is the cuvmm module (or a stand-in with
    its tag, sleep, wake, has_backup and set_backup)."""

    def __init__(self, api=None):
        self._api = api
        self._modes: dict[str, BackupMode] = {}
        self._paused: set[str] = set()
        self._retain = os.environ.get("TMS_RETAIN_CPU_BACKUP", "") not in ("", "0")
        self._disk_dir = os.environ.get("TMS_DISK_BACKUP_DIR") or None
        self._pools = TagPools()
        self._warned: set[str] = set()
        self._hook_mode = None

    # -- the parts that need neither PyTorch nor a GPU ---------------------------------------

    @property
    def api(self):
        if self._api is None:
            import cuvmm
            self._api = cuvmm
        return self._api

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    def _register(self, tag: str, mode: BackupMode) -> None:
        """Records the backup mode of ``tag``; cuvmm keeps one per tag, so a tag entered again
        with other options is refused (torch_memory_saver would keep both under one tag)."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"a region's tag is a non-empty string, not {tag!r}")
        old = self._modes.get(tag)
        if old is not None and old != mode:
            raise ValueError(f"tag {tag!r} was used with {old} and now with {mode}: cuvmm keeps one "
                             "backup mode per tag; use another tag for the other options")
        if tag in self._paused:
            raise RuntimeError(f"tag {tag!r} is paused: resume it before allocating under it")
        self._modes[tag] = mode
        try:
            self._apply_backup(tag)
        except BaseException:
            if old is None:
                del self._modes[tag]
            raise

    def _apply_backup(self, tag: str) -> None:
        mode = self._modes[tag]
        if not mode.offload:
            return
        api = self.api
        if not api.has_backup():
            if mode.backend == "disk":
                raise NotImplementedError("disk backup needs cuvmm_set_backup, which this libcuvmm.so lacks")
            if mode.backend == "pageable":
                self._warn_once("pageable", "this libcuvmm.so backs up into pinned host memory only "
                                "(no cuvmm_set_backup): cpu_backup_backend='mmap' is pinned here")
            if not self._retain:
                self._warn_once("retain", "this libcuvmm.so keeps a tag's host backup after resume "
                                "(no cuvmm_set_backup): retain_cpu_backup=False is not honoured")
            return
        backend = mode.backend or "pageable"
        directory = None
        if backend == "disk":
            if not self._disk_dir:
                raise ValueError("disk backup needs a directory: set_disk_backup_dir(path) or TMS_DISK_BACKUP_DIR")
            directory = self._disk_dir
        api.set_backup(tag, backend, retain=self._retain, directory=directory)

    def pause(self, tag: str | None = None) -> None:
        """Releases the device memory of ``tag`` (None: every tag not paused), offloading the
        contents of tags with a backup. Pausing a paused tag is a RuntimeError (torch_memory_saver
        ends the process); a tag never used is a no-op."""
        if tag is not None:
            if tag not in self._modes:
                return
            if tag in self._paused:
                raise RuntimeError(f"tag {tag!r} is already paused")
            tags = [tag]
        else:
            tags = [t for t in self._modes if t not in self._paused]
        api = self.api
        for t in tags:
            api.sleep(t, offload=self._modes[t].offload)
            self._paused.add(t)

    def resume(self, tag: str | None = None) -> None:
        """Maps the memory of ``tag`` (None: every paused tag) again at the same addresses and
        restores offloaded contents. Resuming a tag that is not paused is a RuntimeError."""
        if tag is not None:
            if tag not in self._modes:
                return
            if tag not in self._paused:
                raise RuntimeError(f"tag {tag!r} is not paused")
            tags = [tag]
        else:
            tags = [t for t in self._modes if t in self._paused]
        api = self.api
        for t in tags:
            api.wake(t)
            self._paused.discard(t)

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self):
        raise AttributeError("hook_mode can only be set")

    @hook_mode.setter
    def hook_mode(self, value) -> None:
        """Accepted for compatibility ("preload" or "torch"); cuvmm needs neither: see the module."""
        if value not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {value!r}")
        self._hook_mode = value

    @property
    def retain_cpu_backup(self) -> bool:
        """Keep host backups after resume (faster next pause, host memory held)."""
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._retain = bool(value)
        for t, m in self._modes.items():
            if m.offload:
                self._apply_backup(t)

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        if int(value) < 0:
            raise ValueError("memory_margin_bytes is a byte count")
        if int(value) > 0:
            self._warn_once("margin", "memory_margin_bytes is not enforced by cuvmm: an allocation "
                            "fails only when the device is out of memory")

    def set_disk_backup_dir(self, path) -> None:
        """The directory where disk backups of later pauses go (created if needed)."""
        os.makedirs(path, exist_ok=True)
        self._disk_dir = os.fspath(path)
        for t, m in self._modes.items():
            if m.backend == "disk":
                self._apply_backup(t)

    def get_cpu_backup(self, x, zero_copy: bool = False):
        raise NotImplementedError("cuvmm does not expose a tag's host backup; copy the tensor to the "
                                  "host before pause() instead")

    # -- the parts that allocate ---------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
               enable_disk_backup: bool = False, cpu_backup_backend: str | None = None):
        """Tensors allocated inside are released by pause(tag) and restored by resume(tag); with
        ``enable_cpu_backup`` or ``enable_disk_backup`` their contents survive, else they are
        undefined after resume. Leaving a region with ``enable_cpu_backup`` gets the tag's host
        backup ready in the background (``cuvmm.prepare_backup``), so that its first pause costs
        what later ones do."""
        self._register(tag, backup_mode(enable_cpu_backup, enable_disk_backup, cpu_backup_backend))
        with self._pools.scope(self.api, tag):
            yield
        if enable_cpu_backup:
            prepare = getattr(self.api, "prepare_backup", None)
            if prepare is not None:
                prepare(tag)

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: str | None = None):
        """``torch.cuda.graph`` whose memory is paused and resumed with ``tag``. The graph stays
        valid across pause and resume (the same addresses come back); replay it only while
        resumed. Under a MemPool (cuvmm not the process's allocator) the graph allocates from the
        tag's pool unless ``pool`` names another, whose memory then is not paused."""
        import torch
        import cuvmm.torch as ct
        self._register(tag, backup_mode(enable_cpu_backup, False, cpu_backup_backend))
        with self.api.tag(tag):
            if pool is None and not ct.is_current_allocator():
                pool = self._pools.pool(tag).id
            with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
                yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations inside are not paused, even within a region."""
        import torch
        import cuvmm.torch as ct
        with self.api.tag(None):
            if ct.is_current_allocator():
                yield
            else:
                pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pool):
                    yield
                del pool


torch_memory_saver = TorchMemorySaver()
