"""PyTorch's tools that need allocator internals, answered by cuvmm while it is the current
allocator: Inductor's CUDA graph trees (:mod:`cuvmm._graph_trees`) and memory snapshots with
allocation history (:mod:`cuvmm._snapshot`). A PyTorch or library without what a part needs
keeps that part as PyTorch has it under a pluggable allocator, with one warning saying why."""

from __future__ import annotations

import warnings

from cuvmm import _graph_trees, _snapshot

_PARTS = ((_graph_trees, "torch.compile's CUDA graph trees raise as before"),
          (_snapshot, "memory snapshots and history raise as before"))


def answer(torch, lib) -> None:
    for part, effect in _PARTS:
        why = part.answer(torch, lib)
        if why is not None:
            warnings.warn(f"cuvmm.torch: {effect}: {why}", RuntimeWarning, stacklevel=4)


def restore(torch) -> None:
    for part, _ in _PARTS:
        part.restore(torch)
