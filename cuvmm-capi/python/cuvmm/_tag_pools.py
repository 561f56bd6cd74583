"""Allocations under a tag wherever cuvmm serves PyTorch: what the torch_memory_saver and vLLM
façades share."""

from __future__ import annotations

import contextlib


class TagPools:
    """A MemPool on cuvmm per (tag, device), made on first use and kept as long as this object:
    a pool dropped while its tensors live would free their memory."""

    def __init__(self):
        self._pools = {}

    def pool(self, tag: str):
        import torch
        import cuvmm.torch as ct
        key = (tag, torch.cuda.current_device())
        if key not in self._pools:
            self._pools[key] = ct.mem_pool()
        return self._pools[key]

    @contextlib.contextmanager
    def scope(self, api, tag: str):
        """Allocations of this thread carry ``tag`` (``api.tag``): through cuvmm directly where it
        is the process's allocator, else from the tag's MemPool."""
        import torch
        import cuvmm.torch as ct
        with api.tag(tag):
            if ct.is_current_allocator():
                yield
            else:
                with torch.cuda.use_mem_pool(self.pool(tag)):
                    yield
