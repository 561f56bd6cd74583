"""The module name earlier releases used: every name of :mod:`cuvmm` and :mod:`cuvmm.torch`.

Importing it needs no PyTorch; the functions that do import :mod:`cuvmm.torch` (which checks the
PyTorch version) when first called. New code: ``import cuvmm`` and ``import cuvmm.torch``.
"""

from cuvmm import *  # noqa: F401,F403
from cuvmm import __all__ as _core_all
from cuvmm import STAT_FIELDS, Stats, TagStats, torch_version_problem  # noqa: F401

__all__ = list(_core_all) + ["allocator", "use_as_current_allocator", "mem_pool", "use_mem_pool_all_threads"]


def _torch_side():
    import cuvmm.torch
    return cuvmm.torch


def allocator(pool: bool = False):
    """:func:`cuvmm.torch.allocator`."""
    return _torch_side().allocator(pool)


def use_as_current_allocator():
    """:func:`cuvmm.torch.use_as_current_allocator`."""
    return _torch_side().use_as_current_allocator()


def mem_pool(**kwargs):
    """:func:`cuvmm.torch.mem_pool`."""
    return _torch_side().mem_pool(**kwargs)


def use_mem_pool_all_threads(pool, device=None):
    """:func:`cuvmm.torch.use_mem_pool_all_threads`."""
    return _torch_side().use_mem_pool_all_threads(pool, device)
