#!/usr/bin/env python3
"""The vLLM facade (cuvmm.vllm) without a GPU or PyTorch: which tags a sleep offloads and which it
discards, what a wake covers, the usage it reports, install() into vllm.device_allocator.cumem;
and vllm_compare's summary and table.

    python3 cuvmm-capi/tests/python/test_vllm.py
"""

import contextlib
import gc
import os
import sys
import threading
import types
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

import vllm_compare  # noqa: E402
import vllm_sleep_goals  # noqa: E402
from cuvmm import vllm as cv  # noqa: E402


class FakeApi:
    """cuvmm's sleep, wake, tag and tag_stats, recorded; wake of `fail_wake` fails once."""

    def __init__(self):
        self.calls, self.asleep, self.live, self.tagged = [], set(), {}, []
        self.fail_wake = None

    def sleep(self, tag, offload=True):
        if tag in self.asleep:
            raise RuntimeError("already asleep")
        self.asleep.add(tag)
        self.calls.append(("sleep", tag, offload))

    def wake(self, tag):
        if tag == self.fail_wake:
            self.fail_wake = None
            raise RuntimeError("no memory")
        self.asleep.remove(tag)
        self.calls.append(("wake", tag))

    def tag_stats(self, tag):
        return {"live": self.live.get(tag, 0), "mapped": 0, "offloaded": 0, "asleep": tag in self.asleep}

    @contextlib.contextmanager
    def tag(self, name):
        self.tagged.append(name)
        yield name


def allocator():
    a = cv.CuMemAllocator(api=FakeApi())
    # Allocating needs PyTorch; the bookkeeping does not.
    a._scope = lambda tag: a.api.tag(tag)
    return a


class Facade(unittest.TestCase):
    def test_a_sleep_offloads_the_tags_named_and_discards_the_rest(self):
        a = allocator()
        for tag in ("weights", "kv_cache", None):
            with a.use_memory_pool(tag=tag):
                self.assertEqual(a.current_tag, tag or "default")
        self.assertEqual(a.current_tag, "default")
        self.assertEqual(a.api.tagged, ["weights", "kv_cache", "default"])
        a.sleep(offload_tags=("weights",))
        self.assertEqual(a.api.calls, [("sleep", "weights", True), ("sleep", "kv_cache", False),
                                       ("sleep", "default", False)])
        a.wake_up(tags=["kv_cache"])
        a.wake_up()
        self.assertEqual(a.api.calls[3:], [("wake", "kv_cache"), ("wake", "weights"), ("wake", "default")])
        a.api.calls.clear()
        a.sleep()  # None: the default tag is offloaded, as in vLLM
        a.sleep("weights")  # while asleep: nothing more to sleep
        self.assertEqual(a.api.calls, [("sleep", "default", True), ("sleep", "weights", False),
                                       ("sleep", "kv_cache", False)])

    def test_the_full_collection_of_a_sleep_runs_while_the_offloaded_tags_copy(self):
        a = allocator()
        for tag in ("kv_cache", "weights"):
            with a.use_memory_pool(tag=tag):
                pass
        collecting, done = threading.Event(), []

        def seen(phase, info):
            if info["generation"] == 2:
                (collecting.set if phase == "start" else lambda: done.append(len(a.api.calls)))()

        sleep = a.api.sleep

        def copying(tag, offload=True):
            # The copies of an offload release the interpreter, as cuvmm's C calls do.
            if offload:
                a.api.overlapped = collecting.wait(timeout=2)
            sleep(tag, offload)

        a.api.sleep = copying
        gc.callbacks.append(seen)
        try:
            a.sleep(offload_tags=("weights",))
        finally:
            gc.callbacks.remove(seen)
        self.assertTrue(a.api.overlapped, "the collection started during the offloading sleep")
        self.assertEqual(a.api.calls, [("sleep", "weights", True), ("sleep", "kv_cache", False)])
        self.assertTrue(done, "a full collection ran to its end before the sleep returned")
        self.assertEqual(a.api.asleep, {"weights", "kv_cache"})

    def test_a_sleep_that_fails_raises_on_the_caller_after_the_collection(self):
        a = allocator()
        for tag in ("weights", "kv_cache", "default"):
            with a.use_memory_pool(tag=tag):
                pass
        sleep, collected = a.api.sleep, []

        def failing(tag, offload=True):
            if tag == "kv_cache":
                raise RuntimeError("cuvmm_sleep('kv_cache') failed")
            sleep(tag, offload)

        def seen(phase, info):
            if phase == "stop" and info["generation"] == 2:
                collected.append(True)

        a.api.sleep = failing
        gc.callbacks.append(seen)
        try:
            with self.assertRaisesRegex(RuntimeError, "kv_cache"):
                a.sleep(("weights",))
        finally:
            gc.callbacks.remove(seen)
        self.assertTrue(collected)
        self.assertEqual(a.api.asleep, {"weights"}, "the tags before the failure sleep; the rest stay awake")
        a.api.sleep = sleep
        a.sleep(("weights",))
        self.assertEqual(a.api.asleep, {"weights", "kv_cache", "default"}, "a later call sleeps the rest")

    def test_the_end_of_a_pool_block_prepares_the_backup_of_a_tag_vllm_offloads(self):
        a = allocator()
        prepared = []
        a.api.prepare_backup = prepared.append
        for tag in ("weights", "kv_cache", None):
            with a.use_memory_pool(tag=tag):
                self.assertEqual(prepared, [] if tag == "weights" else ["weights"])
        self.assertEqual(prepared, ["weights", "default"])
        a.prepare_tags = ()
        with a.use_memory_pool(tag="weights"):
            pass
        self.assertEqual(prepared, ["weights", "default"])

    def test_a_wake_that_fails_leaves_that_tag_asleep_for_the_next(self):
        a = allocator()
        for tag in ("weights", "kv_cache"):
            with a.use_memory_pool(tag=tag):
                pass
        a.sleep(("weights",))
        a.api.fail_wake = "kv_cache"
        with self.assertRaises(RuntimeError):
            a.wake_up()
        self.assertEqual(a.api.asleep, {"kv_cache"})
        a.wake_up()
        self.assertEqual(a.api.asleep, set())

    def test_allocating_under_a_sleeping_tag_or_a_bad_one_is_refused(self):
        a = allocator()
        with a.use_memory_pool(tag="weights"):
            pass
        a.sleep()
        with self.assertRaises(RuntimeError), a.use_memory_pool(tag="weights"):
            pass
        for bad in ("", 3):
            with self.assertRaises(ValueError), a.use_memory_pool(tag=bad):
                pass
        with self.assertRaises(TypeError):
            a.sleep(offload_tags=3)

    def test_usage_counts_every_tag_used_asleep_or_awake(self):
        a = allocator()
        self.assertEqual(a.get_current_usage(), 0)
        a.api.live = {"weights": 3 << 30, "kv_cache": 1 << 30, "other": 5}
        for tag in ("weights", "kv_cache"):
            with a.use_memory_pool(tag=tag):
                pass
        a.sleep(("weights",))
        self.assertEqual(a.get_current_usage(), 4 << 30)

    def test_get_instance_is_one_per_process_and_install_puts_it_under_vllm(self):
        self.assertIs(cv.CuMemAllocator.get_instance(), cv.CuMemAllocator.get_instance())
        for env, installed in (({}, False), ({"CUVMM_VLLM": "0"}, False), ({"CUVMM_VLLM": "1"}, True)):
            cumem = self.with_fake_vllm(lambda: self.plugin_with(env))
            self.assertIs(cumem.CuMemAllocator is cv.CuMemAllocator, installed, env)
        cumem = self.with_fake_vllm(cv.install)
        self.assertIs(cumem.CuMemAllocator, cv.CuMemAllocator)
        self.assertTrue(cumem.cumem_available)

    @staticmethod
    def plugin_with(env):
        saved = os.environ.get("CUVMM_VLLM")
        os.environ.pop("CUVMM_VLLM", None)
        os.environ.update(env)
        try:
            cv.plugin()
        finally:
            os.environ.pop("CUVMM_VLLM", None)
            if saved is not None:
                os.environ["CUVMM_VLLM"] = saved

    @staticmethod
    def with_fake_vllm(fn):
        """Runs ``fn`` with a stand-in vllm.device_allocator.cumem imported; that module after."""
        cumem = types.ModuleType("vllm.device_allocator.cumem")
        cumem.CuMemAllocator, cumem.cumem_available = object, False
        pkg = {"vllm": types.ModuleType("vllm"), "vllm.device_allocator": types.ModuleType("vllm.device_allocator"),
               "vllm.device_allocator.cumem": cumem}
        pkg["vllm"].device_allocator = pkg["vllm.device_allocator"]
        pkg["vllm.device_allocator"].cumem = cumem
        saved = {k: sys.modules.get(k) for k in pkg}
        sys.modules.update(pkg)
        try:
            fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
        return cumem


class Compare(unittest.TestCase):
    @staticmethod
    def rep(sleep, wake, d2h=0.32, h2d=0.33):
        return {"sleep_s": sleep, "wake_s": wake, "d2h_bound_s": d2h, "h2d_bound_s": h2d, "weights_intact": True,
                "graph_output_identical": True, "rss_before": 1, "rss_asleep": 2, "rss_after": 3}

    def test_first_cycle_apart_and_the_slowest_later_one_named(self):
        s = vllm_compare.summarize([self.rep(3.2, 0.4), self.rep(0.34, 0.35), self.rep(0.36, 0.34, d2h=0.30),
                                    self.rep(0.33, 0.36)])
        self.assertAlmostEqual(s["first_sleep_over_d2h"], 10.0)
        self.assertAlmostEqual(s["sleep_s"], 0.34)
        self.assertAlmostEqual(s["worst_later_sleep_over_d2h"], 1.2)
        self.assertTrue(s["all_weights_intact"] and s["all_graph_outputs_identical"])

    def test_kernel_counters_are_read_as_numbers(self):
        got = vllm_compare.vmstat()
        self.assertEqual(set(got), set(vllm_compare.VMSTAT))
        self.assertTrue(all(isinstance(v, int) and v >= 0 for v in got.values()))

    def test_table_puts_both_side_by_side_with_the_ratio(self):
        cu = {"summary": vllm_compare.summarize([self.rep(0.5, 0.35), self.rep(0.34, 0.35)])}
        vs = {"summary": vllm_compare.summarize([self.rep(10.0, 0.35), self.rep(0.34, 0.35)])}
        rows = vllm_compare.table({"cuvmm": cu, "vllm-style": vs})
        self.assertEqual(rows[0], "| | cuvmm | vllm-style | vllm-style / cuvmm |")
        self.assertEqual(rows[2], "| first sleep (s) | 0.500 | 10.000 | 20.00x |")


class Goals(unittest.TestCase):
    @staticmethod
    def rep(sleep, wake=0.33, d2h=0.3, h2d=0.3):
        return {"sleep_s": sleep, "wake_s": wake, "d2h_s": d2h, "h2d_s": h2d, "intact": True, "pinned_awake": 0}

    def test_each_sleep_is_over_its_own_cycles_copy_and_each_goal_is_judged(self):
        vllm = vllm_sleep_goals.summarize([self.rep(0.36), self.rep(0.33), self.rep(0.34, d2h=0.2)])
        self.assertAlmostEqual(vllm["first_sleep"], 1.2)
        self.assertAlmostEqual(vllm["later_sleep"], (1.1 + 1.7) / 2)
        self.assertAlmostEqual(vllm["worst_later_sleep"], 1.7)
        capi = vllm_sleep_goals.summarize([self.rep(0.6), self.rep(0.3)])
        lines = vllm_sleep_goals.goal_lines({"vllm": {"summary": vllm}, "capi": {"summary": capi}})
        self.assertEqual(lines, [
            "vllm: first sleep 1.200x the pinned D2H copy (goal <= 1.20x): met",
            "vllm: slowest later sleep 1.700x the pinned D2H copy (goal <= 1.10x): MISSED",
            "capi: first sleep 2.000x the pinned D2H copy (goal <= 1.50x): MISSED"])


if __name__ == "__main__":
    unittest.main()
