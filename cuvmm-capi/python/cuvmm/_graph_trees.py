"""Inductor's CUDA graph trees (``torch.compile(mode="reduce-overhead")``) on cuvmm.

Graph trees call six functions of ``torch._C`` that PyTorch's pluggable allocator refuses or
answers for its own bookkeeping only:

- ``_cuda_checkPoolLiveAllocations(device, pool, ptrs)``: the debug check (on by default,
  ``triton.slow_path_cudagraph_asserts``) that the tree's pool holds exactly the live outputs
  it tracks, before and after each warm-up and recording and after each checkpoint.
- ``_cuda_getCheckpointState(device, pool)``: after every recording, the pool's state to come
  back to.
- ``_cuda_setCheckpointPoolState(device, state, stale, live)``: before a new recording or
  warm-up in the middle of replaying a path, the pool rewound to that state so that the new
  graph cannot take the memory of outputs still alive; the live outputs (storages that replays
  made without a deleter) get the allocator's deleter.
- ``_cuda_cudaCachingAllocator_raw_delete(ptr)``: then, the blocks of outputs dead since.
- ``_free_And_Remove_DeleterFn(storage)`` and ``_has_Standard_Deleter(storage)``: when a
  path's outputs are given back, and in the checks after a checkpoint.

PyTorch's caching allocator needs the rewind because every graph of a tree shares one pool.
cuvmm keeps what a capture allocates for that capture's graph alone until
``cuvmm.release_graph_memory()`` (freed, it goes back to that graph's blocks only), and
warm-ups take ordinary memory: no later recording, warm-up or eager request can be handed an
address a graph's replays write, so no rewind is needed and none is made. What is replaced:

- ``_cuda_getCheckpointState`` gives a token; ``_cuda_setCheckpointPoolState`` takes it,
  changes no memory and notes the live storages as taken over (their memory is the graph's
  for as long as cuvmm keeps it, whatever becomes of them).
- ``_cuda_cudaCachingAllocator_raw_delete`` of an output's block that cuvmm already holds free
  for its graph (its tensor was given back before the replay) does nothing; any other pointer
  goes to PyTorch's function.
- ``_free_And_Remove_DeleterFn`` of a storage taken over does nothing (its memory stays the
  graph's); ``_has_Standard_Deleter`` is true for it.
- ``_cuda_checkPoolLiveAllocations`` answers True: the pool accounting it checks is PyTorch's
  own, which cuvmm does not keep (the tree's pool is several cuvmm graphs and ordinary blocks),
  and the overwrite it guards against cannot happen here.

The cost: the graphs of a tree do not share memory, so a tree takes the sum of its graphs'
memory where PyTorch's allocator takes about the largest path's.
"""

from __future__ import annotations


_C_NAMES = ("_cuda_checkPoolLiveAllocations", "_cuda_getCheckpointState", "_cuda_setCheckpointPoolState",
            "_cuda_cudaCachingAllocator_raw_delete", "_free_And_Remove_DeleterFn", "_has_Standard_Deleter")


class Checkpoint:
    """What ``_cuda_getCheckpointState`` gives under cuvmm: nothing to restore, only where from."""

    __slots__ = ("device", "pool")

    def __init__(self, device, pool):
        self.device, self.pool = int(device), tuple(pool)

    def __repr__(self):
        return f"cuvmm.Checkpoint(device={self.device}, pool={self.pool})"


class Trees:
    """The replacements, with what they remember between calls."""

    def __init__(self, original: dict, graph_blocks):
        self._orig = original
        # (device, ranges of the blocks cuvmm holds free for a graph), read at a checkpoint's
        # first raw_delete: the blocks of outputs given back before their graph's replay.
        self._graph_blocks = graph_blocks
        self._kept = None
        self.adopted = set()

    def check_pool_live_allocations(self, device, pool, ptrs):
        return True

    def get_checkpoint_state(self, device, pool):
        return Checkpoint(device, pool)

    def set_checkpoint_pool_state(self, device, state, stale_storages, live_storages=()):
        if not isinstance(state, Checkpoint):
            raise TypeError(f"not a checkpoint of cuvmm: {type(state).__name__}")
        self.adopted.update(int(s) for s in live_storages)
        self._kept = (int(device), None)

    def raw_delete(self, ptr):
        try:
            return self._orig["_cuda_cudaCachingAllocator_raw_delete"](ptr)
        except RuntimeError:
            if self._kept is None:
                raise
            device, kept = self._kept
            if kept is None:
                kept = self._graph_blocks(device)
                self._kept = (device, kept)
            # A freed block may have joined free neighbours of its graph's memory since.
            if not any(start <= int(ptr) < end for start, end in kept):
                raise

    def free_and_remove_deleter(self, storage):
        if not self._orig["_has_Standard_Deleter"](storage) and int(storage) in self.adopted:
            self.adopted.discard(int(storage))
            return None
        return self._orig["_free_And_Remove_DeleterFn"](storage)

    def has_standard_deleter(self, storage):
        return bool(self._orig["_has_Standard_Deleter"](storage)) or int(storage) in self.adopted


def free_graph_blocks(raw: dict, device: int) -> list:
    """(start, end) of each free block of ``device`` that cuvmm holds for a captured graph, from
    cuvmm_snapshot_json's parsed output."""
    return [(b["address"], b["address"] + b["size"]) for s in raw.get(str(device), ()) for b in s["blocks"]
            if b["graph_pool"] != 0 and b["state"] == "free"]


_saved = {}


def answer(torch, lib) -> str | None:
    """Replace the graph trees' functions of ``torch._C`` with cuvmm's. Returns None, or why they
    were left as they are (graph trees then raise as before)."""
    c = torch._C
    missing = [n for n in _C_NAMES if not hasattr(c, n)]
    if missing:
        return f"this PyTorch has no torch._C.{', '.join(missing)}"
    from cuvmm import _snapshot

    if not _snapshot.has_snapshots(lib):
        return "the loaded libcuvmm.so has no cuvmm_snapshot_json"
    original = {n: _saved.get(n, getattr(c, n)) for n in _C_NAMES}
    trees = Trees(original, lambda d: free_graph_blocks(_snapshot.raw_snapshot(lib, d), d))
    for name, fn in (("_cuda_checkPoolLiveAllocations", trees.check_pool_live_allocations),
                     ("_cuda_getCheckpointState", trees.get_checkpoint_state),
                     ("_cuda_setCheckpointPoolState", trees.set_checkpoint_pool_state),
                     ("_cuda_cudaCachingAllocator_raw_delete", trees.raw_delete),
                     ("_free_And_Remove_DeleterFn", trees.free_and_remove_deleter),
                     ("_has_Standard_Deleter", trees.has_standard_deleter)):
        _saved.setdefault(name, getattr(c, name))
        setattr(c, name, fn)
    return None


def restore(torch) -> None:
    for name, fn in _saved.items():
        setattr(torch._C, name, fn)
    _saved.clear()


__all__ = ["Checkpoint", "Trees", "answer", "restore", "free_graph_blocks"]
