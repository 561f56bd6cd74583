#!/usr/bin/env python3
"""cuvmm's answers to CUDA graph trees' allocator functions and to memory snapshots, without a
GPU: a stand-in ``torch._C`` (or the installed PyTorch's, when there is one, whose
``torch.cuda._memory_viz`` then renders the snapshot) and a stand-in library whose heaps are
JSON, as cuvmm_snapshot_json writes them.

    python3 cuvmm-capi/tests/python/test_torch_tools.py
"""

import ctypes
import json
import sys
import types
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))

from cuvmm import _graph_trees, _snapshot  # noqa: E402

try:
    import torch
    import torch.cuda._memory_viz as memory_viz
except ImportError:
    torch = memory_viz = None

NOT_HERE = "Trying to free a pointer not allocated here"


def heaps(blocks_by_segment, small=False, tag=None, asleep=False):
    """cuvmm_snapshot_json's output for device 0: one segment per list of (size, state, pool)."""
    segs, at = [], 1 << 32
    for blocks in blocks_by_segment:
        seg = {"address": at, "small": small, "tag": tag, "asleep": asleep, "page": 1 << 21, "blocks": []}
        for size, state, pool in blocks:
            seg["blocks"].append({"address": at, "size": size, "requested": size - 100 if state != "free" else 0,
                                  "graph_pool": pool, "stream": 7 if state != "free" else 0, "state": state})
            at += size
        segs.append(seg)
        at += 1 << 30
    return {"0": segs}


class FakeLib:
    """cuvmm_snapshot_json and cuvmm_set_alloc_observer as the library has them."""

    def __init__(self, raw):
        self.raw, self.observer, self.calls = raw, None, 0
        lib = self

        def snapshot_json(device, buf, size):
            lib.calls += 1
            data = {k: v for k, v in lib.raw.items() if device in (-1, int(k))}
            text = json.dumps(data).encode()
            if buf is not None and len(text) < size:
                ctypes.memmove(buf, text + b"\0", len(text) + 1)
            return len(text)

        def set_observer(fn):
            # The address the library would keep (c_void_p, or None), called as the C function.
            lib.observer = None if fn is None else _snapshot._OBSERVER(fn.value)
            return 0

        self.cuvmm_snapshot_json = snapshot_json
        self.cuvmm_set_alloc_observer = set_observer
        self.cuvmm_last_error = lambda: None


def stand_in_torch():
    """A ``torch`` whose ``_C`` has the six functions as the pluggable allocator has them."""
    freed, allocated = [], {0x1000}

    def raw_delete(ptr):
        if ptr not in allocated:
            raise RuntimeError(NOT_HERE)
        allocated.discard(ptr)
        freed.append(ptr)

    def refuse(name):
        def f(*a):
            raise RuntimeError(f"CUDAPluggableAllocator does not yet support {name}")
        return f

    c = types.SimpleNamespace(
        _cuda_checkPoolLiveAllocations=refuse("checkPoolLiveAllocations"),
        _cuda_getCheckpointState=refuse("getCheckpointState"),
        _cuda_setCheckpointPoolState=refuse("setCheckpointPoolState"),
        _cuda_cudaCachingAllocator_raw_delete=raw_delete,
        # Storages 1 and 2 own their memory (the allocator's deleter); others were made by replays.
        _free_And_Remove_DeleterFn=lambda s: freed.append(("storage", s)),
        _has_Standard_Deleter=lambda s: s in (1, 2),
        _cuda_record_memory_history=refuse("recordHistory"),
        _cuda_isHistoryEnabled=refuse("recordHistory"),
        _cuda_memorySnapshot=refuse("snapshot"),
    )
    return types.SimpleNamespace(_C=c), freed


class GraphTrees(unittest.TestCase):
    def setUp(self):
        self.torch, self.freed = stand_in_torch()
        # A graph's output given back before its replay: free, kept for graph pool 3.
        self.lib = FakeLib(heaps([[(4096, "live", 0), (8192, "free", 3), (512, "live", 3)]]))
        self.kept = (1 << 32) + 4096
        self.assertIsNone(_graph_trees.answer(self.torch, self.lib))
        self.addCleanup(_graph_trees.restore, self.torch)

    def test_a_checkpoint_is_taken_and_applied_without_an_error_and_changes_no_memory(self):
        c = self.torch._C
        self.assertTrue(c._cuda_checkPoolLiveAllocations(0, (0, 1), {0x1234}))
        state = c._cuda_getCheckpointState(0, (0, 1))
        self.assertIsInstance(state, _graph_trees.Checkpoint)
        c._cuda_setCheckpointPoolState(0, state, [], [10, 11])
        self.assertEqual(self.lib.calls, 0, "nothing asked of cuvmm until a free needs it")
        # The dead output whose block cuvmm holds for its graph: nothing to free.
        c._cuda_cudaCachingAllocator_raw_delete(self.kept)
        # A block the pluggable allocator holds is freed by it, as before.
        c._cuda_cudaCachingAllocator_raw_delete(0x1000)
        self.assertEqual(self.freed, [0x1000])
        # Any other pointer is refused as before.
        with self.assertRaisesRegex(RuntimeError, NOT_HERE):
            c._cuda_cudaCachingAllocator_raw_delete(0x9999)
        self.assertEqual(self.lib.calls, 1, "one look at the heaps per checkpoint")

    def test_storages_taken_over_at_a_checkpoint_count_as_owned_and_are_let_go_without_a_free(self):
        c = self.torch._C
        self.assertFalse(c._has_Standard_Deleter(10))
        c._cuda_setCheckpointPoolState(0, c._cuda_getCheckpointState(0, (0, 1)), [], [10])
        self.assertTrue(c._has_Standard_Deleter(10))
        self.assertTrue(c._has_Standard_Deleter(1))
        c._free_And_Remove_DeleterFn(10)
        c._free_And_Remove_DeleterFn(1)
        self.assertEqual(self.freed, [("storage", 1)], "only the owning storage goes to PyTorch's function")
        self.assertFalse(c._has_Standard_Deleter(10), "let go once")

    def test_a_free_outside_a_checkpoint_is_refused_as_before(self):
        with self.assertRaisesRegex(RuntimeError, NOT_HERE):
            self.torch._C._cuda_cudaCachingAllocator_raw_delete(self.kept)

    def test_a_state_of_another_allocator_is_refused(self):
        with self.assertRaises(TypeError):
            self.torch._C._cuda_setCheckpointPoolState(0, object(), [], [])

    def test_restore_gives_pytorchs_functions_back(self):
        _graph_trees.restore(self.torch)
        with self.assertRaisesRegex(RuntimeError, "checkPoolLiveAllocations"):
            self.torch._C._cuda_checkPoolLiveAllocations(0, (0, 1), set())

    def test_a_pytorch_without_one_of_the_functions_is_left_as_it_is_with_the_reason(self):
        t, _ = stand_in_torch()
        del t._C._has_Standard_Deleter
        why = _graph_trees.answer(t, self.lib)
        self.assertIn("_has_Standard_Deleter", why)
        with self.assertRaisesRegex(RuntimeError, "getCheckpointState"):
            t._C._cuda_getCheckpointState(0, (0, 1))


def alloc_here(lib, ptr, size):
    """An allocation as cuvmm_malloc reports it, from this function's frame."""
    lib.observer(ord("a"), 0, ptr, size, 7)


class Snapshots(unittest.TestCase):
    def setUp(self):
        self.torch, _ = stand_in_torch()
        raw = heaps([[(4096, "live", 0), (8192, "free", 0), (1024, "freed_shared", 0)],
                     [(2 << 20, "live", 2)]])
        raw["0"].append(heaps([[(1 << 21, "live", 0)]], tag="weights", asleep=True)["0"][0])
        raw["0"][-1]["address"] = raw["0"][-1]["blocks"][0]["address"] = 1 << 40
        self.raw, self.lib = raw, FakeLib(raw)
        self.assertIsNone(_snapshot.answer(self.torch, self.lib))
        self.addCleanup(_snapshot.restore, self.torch)

    def snap(self):
        return self.torch._C._cuda_memorySnapshot(None)

    def test_segments_and_blocks_are_pytorchs_format(self):
        s = self.snap()
        self.assertEqual(set(s), {"segments", "device_traces", "allocator_settings", "external_annotations"})
        seg = s["segments"][0]
        self.assertEqual([b["state"] for b in seg["blocks"]], ["active_allocated", "inactive", "active_pending_free"])
        self.assertEqual((seg["total_size"], seg["allocated_size"], seg["active_size"]), (13312, 4096, 5120))
        self.assertEqual((seg["stream"], seg["segment_type"], seg["segment_pool_id"]), (7, "large", (0, 0)))
        self.assertEqual(seg["blocks"][0]["requested_size"], 3996)
        self.assertEqual(s["segments"][1]["segment_pool_id"], (0, 2), "a graph's blocks carry its pool")
        self.assertEqual((s["segments"][2]["cuvmm_tag"], s["segments"][2]["cuvmm_asleep"]), ("weights", True))
        for seg in s["segments"]:
            self.assertEqual(seg["total_size"], sum(b["size"] for b in seg["blocks"]))
        self.assertFalse(self.torch._C._cuda_isHistoryEnabled())
        self.assertIsNone(self.lib.observer, "no function is set while no history is recorded")

    def test_history_gives_each_block_the_stack_that_allocated_it_and_a_trace(self):
        c = self.torch._C
        c._cuda_record_memory_history("all", "all", "all", 100, False, False, False, [])
        self.assertTrue(c._cuda_isHistoryEnabled())
        live = (1 << 32)
        alloc_here(self.lib, live, 4096)
        self.lib.observer(ord("a"), 0, 0xdead, 512, 7)
        self.lib.observer(ord("f"), 0, 0xdead, 512, 7)
        s = self.snap()
        frames = s["segments"][0]["blocks"][0]["frames"]
        self.assertEqual(frames[0]["name"], "alloc_here")
        self.assertEqual(frames[1]["name"], "test_history_gives_each_block_the_stack_that_allocated_it_and_a_trace")
        self.assertEqual(s["segments"][0]["blocks"][1]["frames"], [], "a free block has no stack")
        actions = [(e["action"], e["addr"]) for e in s["device_traces"][0]]
        self.assertEqual(actions, [("alloc", live), ("alloc", 0xdead), ("free_requested", 0xdead),
                                   ("free_completed", 0xdead)])
        # Off: the function goes, and so does what was recorded.
        c._cuda_record_memory_history(None, "all", "all", 100, False, False, False, [])
        self.assertIsNone(self.lib.observer)
        self.assertEqual(self.snap()["device_traces"], [[]])
        self.assertEqual(self.snap()["segments"][0]["blocks"][0]["frames"], [])

    def test_state_only_history_keeps_stacks_and_no_trace(self):
        self.torch._C._cuda_record_memory_history("state", "alloc", "python", 10, False)
        alloc_here(self.lib, 1 << 32, 4096)
        s = self.snap()
        self.assertEqual(s["segments"][0]["blocks"][0]["frames"][0]["name"], "alloc_here")
        self.assertEqual(s["device_traces"], [[]])

    def test_a_pool_snapshot_has_that_pools_segments_only(self):
        only = self.torch._C._cuda_memorySnapshot((0, 2, True))["segments"]
        self.assertEqual([s["segment_pool_id"] for s in only], [(0, 2)])

    def test_the_trace_keeps_the_latest_entries(self):
        self.torch._C._cuda_record_memory_history("all", "all", "all", 3, False)
        for k in range(5):
            self.lib.observer(ord("a"), 0, 0x1000 + k, 512, 0)
        self.assertEqual([e["addr"] for e in self.snap()["device_traces"][0]], [0x1002, 0x1003, 0x1004])

    @unittest.skipIf(memory_viz is None, "PyTorch is not installed")
    def test_pytorchs_viewer_renders_the_snapshot(self):
        self.torch._C._cuda_record_memory_history("all", "all", "all", 100, False)
        alloc_here(self.lib, 1 << 32, 4096)
        self.lib.observer(ord("f"), 0, 1 << 32, 4096, 7)
        alloc_here(self.lib, 1 << 32, 4096)
        s = self.snap()
        self.assertIn("total_reserved", memory_viz.segsum(s))
        memory_viz.segments(s, format_flamegraph=lambda lines: lines)
        memory_viz.memory(s, format_flamegraph=lambda lines: lines)
        self.assertIn("del a", memory_viz.trace(s), "the free of the first block, read from the trace")
        for html in (memory_viz.trace_plot(s), memory_viz.segment_plot(s)):
            self.assertIn("<html", html.lower())


@unittest.skipIf(torch is None, "PyTorch is not installed")
class InstalledPyTorch(unittest.TestCase):
    """The installed PyTorch has every function replaced, and gets its own back."""

    def test_every_function_is_there_and_comes_back(self):
        before = {n: getattr(torch._C, n) for n in _graph_trees._C_NAMES + _snapshot._C_NAMES}
        lib = FakeLib(heaps([[(4096, "live", 0)]]))
        self.assertIsNone(_graph_trees.answer(torch, lib))
        self.assertIsNone(_snapshot.answer(torch, lib))
        try:
            self.assertTrue(torch._C._cuda_checkPoolLiveAllocations(0, (0, 1), set()))
            s = torch.cuda.memory._snapshot()
            self.assertEqual(s["segments"][0]["blocks"][0]["state"], "active_allocated")
            torch.cuda.memory._record_memory_history(max_entries=10)
            self.assertTrue(torch._C._cuda_isHistoryEnabled())
            torch.cuda.memory._record_memory_history(enabled=None)
            self.assertFalse(torch._C._cuda_isHistoryEnabled())
        finally:
            _graph_trees.restore(torch)
            _snapshot.restore(torch)
        self.assertEqual({n: getattr(torch._C, n) for n in before}, before)


if __name__ == "__main__":
    unittest.main()
