#!/usr/bin/env python3
"""The pure parts of the proof scripts and of cuvmm_torch, testable with no GPU and no torch.

    python3 -m pytest cuvmm-capi/tests/python/test_helpers.py      (or: python3 test_helpers.py)
"""

import contextlib
import io
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import types
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import alloc_profile  # noqa: E402
import compare  # noqa: E402
import cuvmm  # noqa: E402
import cuvmm_torch  # noqa: E402
import nccl_allreduce  # noqa: E402
import train  # noqa: E402


class Pure(unittest.TestCase):
    def test_mod_pattern_sum_matches_brute_force(self):
        for n in (0, 1, 96, 97, 98, 1000, 12345):
            for add in (-7, 0, 5):
                self.assertEqual(_common.mod_pattern_sum(n, 97, add), sum(k % 97 + add for k in range(n)))

    def test_ranges_overlap_is_half_open(self):
        self.assertTrue(_common.ranges_overlap((0, 10), (9, 20)))
        self.assertFalse(_common.ranges_overlap((0, 10), (10, 20)))
        self.assertTrue(_common.ranges_overlap((5, 6), (0, 100)))

    def test_rss_bytes_counts_memory_this_process_touches(self):
        before = _common.rss_bytes()
        touched = bytearray(b"\x01") * (64 << 20)
        self.assertGreaterEqual(_common.rss_bytes() - before, 48 << 20)
        del touched

    def test_f32_bits_round_trip(self):
        x = struct.unpack("<f", struct.pack("<f", 10.3731))[0]
        self.assertEqual(struct.unpack("<f", bytes.fromhex(_common.f32_bits(x)))[0], x)

    def test_schedule_is_seeded_varied_and_bounded(self):
        a = train.make_schedule(50, 7, 256, 4096, 128, 4096, 16384)
        self.assertEqual(a, train.make_schedule(50, 7, 256, 4096, 128, 4096, 16384))
        self.assertNotEqual(a, train.make_schedule(50, 8, 256, 4096, 128, 4096, 16384))
        self.assertGreater(len({b * l for b, l in a}), 30)
        for b, l in a:
            self.assertTrue(256 <= l <= 4096 and (l - 256) % 128 == 0 and b >= 1 and b * l <= 16384)

    def test_nccl_sizes_double(self):
        s = nccl_allreduce.sizes(1, 1024)
        self.assertEqual(s[0], 1 << 20)
        self.assertEqual(s[-1], 1 << 30)
        self.assertEqual(len(s), 11)


def train_result(alloc, bits, step_s, peak, max_alloc=None, mapped_peak=None):
    r = {"script": "train", "alloc": alloc, "loss_bits": bits, "step_s": step_s,
         "median_step_s": sorted(step_s[1:])[len(step_s[1:]) // 2], "config": {"warmup": 1},
         "peak_driver_used": peak, "pass": True, "env": {"device": "test"}}
    if max_alloc is not None:
        r["torch_max_memory_allocated"] = max_alloc
    if mapped_peak is not None:
        r["cuvmm_mapped_peak"] = mapped_peak
    return r


class PairedRatio(unittest.TestCase):
    """The interval of alloc_cost.py and mp_share.py: rounds pair a run of each allocator on the same machine."""

    def test_drift_between_rounds_cancels_within_each(self):
        native = [70.0, 91.0, 64.0, 80.0]
        r, rel, high = _common.paired_ratio(native, [x * 1.01 for x in native])
        self.assertAlmostEqual(r, 1.01)
        self.assertAlmostEqual(rel, 0.0)
        self.assertAlmostEqual(high, 1.01)

    def test_noise_widens_the_interval_and_one_round_gives_none(self):
        r, rel, high = _common.paired_ratio([70.0, 70.0, 70.0], [69.0, 72.0, 70.0])
        self.assertGreater(rel, 0.02)
        self.assertGreater(high, r)
        self.assertEqual(_common.paired_ratio([70.0], [71.0])[1:], (float("inf"), float("inf")))


class MedianPairRatio(unittest.TestCase):
    """A process's ratio in alloc_cost.py: its rounds run both allocators a fraction of a second apart."""

    def test_drift_between_rounds_cancels_and_bursts_do_not_move_it(self):
        native = [6.0, 6.2, 9.0, 6.1, 6.0, 7.5, 6.3]
        cuvmm = [x * 1.014 for x in native]
        cuvmm[0] = cuvmm[3] = 30.0  # slow bursts on cuvmm's turns and on PyTorch's
        native[5] = 25.0
        self.assertAlmostEqual(_common.median_pair_ratio(native, cuvmm), 1.014)
        # The ratio of the medians moves with the bursts and the drift.
        self.assertGreater(statistics.median(cuvmm) / statistics.median(native), 1.2)

    def test_rounds_of_one_side_only_are_refused(self):
        for a, b in (([], []), ([1.0, 2.0], [1.0])):
            with self.assertRaises(ValueError):
                _common.median_pair_ratio(a, b)


class AllocProfile(unittest.TestCase):
    """alloc_profile.py: perf's report read back and its samples put to each allocator's code."""

    REPORT = "\n".join([
        "# Samples: 9K of event 'cpu-clock:u'",
        "#      Samples\tShared Object\tSymbol",
        " 300 \tlibcuvmm.so \t[.] cuvmm_malloc",
        " 100 \tlibcuvmm.so \t[.] cuvmm_free",
        " 50 \tlibtorch_cuda.so \t[.] torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator::malloc(unsigned long, int, CUstream_st*)",
        " 350 \tlibc10_cuda.so \t[.] c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)",
        " 20 \tlibc.so.6 \t[.] _int_free",
        " 10 \tlibc.so.6 \t[.] pthread_mutex_lock@@GLIBC_2.2.5",
        " 7000 \tlibpython3.12.so \t[.] _PyEval_EvalFrameDefault",
        "",
    ])

    def test_samples_go_to_whose_code_they_fell_in(self):
        samples = alloc_profile.parse_report(self.REPORT)
        self.assertEqual(len(samples), 7)
        self.assertEqual(samples[("libcuvmm.so", "cuvmm_free")], 100)
        child = {"ms_per_token": {"native": [6.0, 6.0, 6.0], "cuvmm": [6.1, 6.1, 6.1]}, "tokens": 16}
        r = alloc_profile.summarise(samples, 20_000, 48 * 1000, child)  # 3 x 16 tokens, 1000 a token
        ns = r["ns_per_allocation"]
        self.assertEqual((ns["cuvmm"], ns["pluggable wrapper"], ns["caching allocator"]), (166.7, 20.8, 145.8))
        self.assertEqual((ns["malloc/free"], ns["locks"], ns["other"]), (8.3, 4.2, 2916.7))
        self.assertEqual((r["cuvmm_side_ns"], r["pytorch_side_ns"]), (187.5, 145.8))
        self.assertAlmostEqual(r["measured_gap_ns"], 100.0)  # 0.1 ms a token over 1000 allocations


class Compare(unittest.TestCase):
    def test_passes_when_within_bounds(self):
        native = train_result("native", ["aa", "bb"], [9.0, 1.0, 1.0, 1.0], 110, max_alloc=100)
        cuvmm = train_result("cuvmm", ["aa", "bb"], [9.0, 1.01, 1.01, 1.01], 104, mapped_peak=103)
        _, checks, rows = compare.compare_train([("n", native), ("c", cuvmm)])
        self.assertTrue(all(checks.values()), checks)
        self.assertEqual(len(rows), 2)

    def test_each_bound_fails_on_its_own(self):
        native = train_result("native", ["aa", "bb"], [9.0, 1.0, 1.0, 1.0], 110, max_alloc=100)
        cases = {
            "losses": train_result("cuvmm", ["aa", "bc"], [9.0, 1.0, 1.0, 1.0], 100, mapped_peak=100),
            "time": train_result("cuvmm", ["aa", "bb"], [9.0, 1.03, 1.03, 1.03], 100, mapped_peak=100),
            "peak driver": train_result("cuvmm", ["aa", "bb"], [9.0, 1.0, 1.0, 1.0], 106, mapped_peak=100),
            "mapped_peak": train_result("cuvmm", ["aa", "bb"], [9.0, 1.0, 1.0, 1.0], 100, mapped_peak=106),
        }
        for what, run in cases.items():
            _, checks, _ = compare.compare_train([("n", native), ("c", run)])
            failed = [k for k, v in checks.items() if not v]
            self.assertEqual(len(failed), 1, (what, failed))
            self.assertIn(what, failed[0])

    def test_pool_is_held_to_native_allocated_unless_asked_for_the_driver_peak(self):
        native = train_result("native", ["aa", "bb"], [9.0, 1.0, 1.0, 1.0], 130, max_alloc=100)
        pool = train_result("cuvmm-pool", ["aa", "bb"], [9.0, 1.0, 1.0, 1.0], 131, mapped_peak=130)
        _, checks, _ = compare.compare_train([("n", native), ("p", pool)])
        self.assertEqual(sum(not v for v in checks.values()), 2)
        _, checks, _ = compare.compare_train([("n", native), ("p", pool)], pool_mem_ref="driver")
        self.assertTrue(all(checks.values()), checks)

    def test_nccl_single_rank_has_no_bus_ratio(self):
        r = {"script": "nccl_allreduce", "alloc": "native", "sizes": [1 << 20], "busbw_gbps": [0.0], "pass": True}
        _, checks, rows = compare.compare_nccl([("a", r), ("b", dict(r, alloc="cuvmm"))])
        self.assertTrue(all(checks.values()))
        self.assertIn("n/a", rows[1])

    def test_nccl_runs_timed_differently_do_not_compare(self):
        r = {"script": "nccl_allreduce", "alloc": "native", "sizes": [1 << 20], "busbw_gbps": [9.0], "pass": True,
             "timing": "graph", "graph_calls": 20}
        _, checks, _ = compare.compare_nccl([("a", r), ("b", dict(r, alloc="cuvmm"))])
        self.assertTrue(all(checks.values()), checks)
        _, checks, _ = compare.compare_nccl([("a", r), ("b", dict(r, alloc="cuvmm", timing="call", graph_calls=None))])
        self.assertEqual([k for k, v in checks.items() if not v], ["b: timed as the native run was"])

    def test_nccl_same_process_comparison_is_held_to_two_percent(self):
        r = {"script": "nccl_allreduce", "alloc": "native", "sizes": [1 << 20, 2 << 20], "busbw_gbps": [50.0, 60.0],
             "pass": True, "timing": "graph", "graph_calls": 20,
             "ab": {"busbw_gbps": [49.5, 60.0], "ratio": [0.99, 1.0]}}
        _, checks, rows = compare.compare_nccl([("a", r)])
        self.assertTrue(all(checks.values()), checks)
        self.assertIn("| cuvmm-pool, same process | 1 MiB | 49.5 | 0.990 |", rows)
        slow = dict(r, ab={"busbw_gbps": [48.0, 60.0], "ratio": [0.96, 1.0]})
        _, checks, _ = compare.compare_nccl([("a", slow)])
        self.assertEqual(len([k for k, v in checks.items() if not v]), 1)
        short = dict(r, ab={"busbw_gbps": [50.0], "ratio": [1.0]})
        _, checks, _ = compare.compare_nccl([("a", short)])
        self.assertFalse(all(checks.values()))
        # One rank: no bus, no judgement of a no-op's timing.
        one = dict(r, busbw_gbps=[0.0, 0.0], ab={"busbw_gbps": [0.0, 0.0], "ratio": [0.84, 1.0]})
        _, checks, rows = compare.compare_nccl([("a", one)])
        self.assertTrue(all(checks.values()), checks)
        self.assertIn("| cuvmm-pool, same process | 1 MiB | 0.0 | n/a |", rows)

    def test_no_native_run_fails(self):
        _, checks, _ = compare.compare_train([("c", train_result("cuvmm", ["aa"], [1.0, 1.0], 1))])
        self.assertFalse(all(checks.values()))

    def test_main_reads_files_and_sets_status(self):
        with tempfile.TemporaryDirectory() as d:
            a, b = Path(d, "a.json"), Path(d, "b.json")
            a.write_text(json.dumps(train_result("native", ["aa"], [5.0, 1.0], 10, max_alloc=10)) + "\n")
            b.write_text(json.dumps(train_result("cuvmm", ["aa"], [5.0, 1.0], 10, mapped_peak=10)) + "\n")
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                self.assertEqual(compare.main([str(a), str(b)]), 0)
                b.write_text(json.dumps(train_result("cuvmm", ["ab"], [5.0, 1.0], 10)) + "\n")
                self.assertEqual(compare.main([str(a), str(b)]), 1)
            self.assertIn("RESULT ", quiet.getvalue())


class LogVerdict(unittest.TestCase):
    def verdict(self, text):
        with tempfile.TemporaryDirectory() as d:
            log = Path(d, "run.log")
            log.write_text(text)
            return _common.log_passed(log)

    def test_a_log_passes_only_with_result_lines_that_all_pass(self):
        ok = "RESULT " + json.dumps({"script": "x", "checks": {"a": True}, "pass": True}) + "\n"
        bad = "RESULT " + json.dumps({"script": "y", "checks": {"pass": True}, "pass": False}) + "\n"
        self.assertTrue(self.verdict("noise\n" + ok))
        self.assertFalse(self.verdict(""))
        self.assertFalse(self.verdict("all good, no result\n"))
        self.assertFalse(self.verdict(ok + bad))
        self.assertFalse(self.verdict("RESULT {not json\n"))
        self.assertFalse(self.verdict("RESULT " + json.dumps({"script": "z"}) + "\n"))


class FindLibrary(unittest.TestCase):
    def test_explicit_path_must_exist(self):
        with self.assertRaises(FileNotFoundError):
            cuvmm_torch.find_library("/nonexistent/libcuvmm.so")

    def test_env_wins_over_search_and_must_exist(self):
        with tempfile.TemporaryDirectory() as d:
            lib = Path(d, "libcuvmm.so")
            lib.write_bytes(b"")
            old = os.environ.get("CUVMM_LIB")
            try:
                os.environ["CUVMM_LIB"] = str(lib)
                self.assertEqual(cuvmm_torch.find_library(), str(lib.resolve()))
                os.environ["CUVMM_LIB"] = str(lib) + ".missing"
                with self.assertRaises(FileNotFoundError):
                    cuvmm_torch.find_library()
            finally:
                if old is None:
                    os.environ.pop("CUVMM_LIB", None)
                else:
                    os.environ["CUVMM_LIB"] = old

    def test_the_old_module_name_has_every_name_it_had(self):
        old = ("find_library", "load", "library_path", "allocator", "use_as_current_allocator", "mem_pool",
               "use_mem_pool_all_threads", "stats", "stats_json", "reset_peaks", "empty_cache",
               "release_graph_memory", "trace_flush", "last_error", "has_sleep", "set_tag", "tag", "sleep",
               "wake", "tag_stats", "STAT_FIELDS", "Stats", "TagStats")
        self.assertEqual([n for n in old if not hasattr(cuvmm_torch, n)], [])
        self.assertIs(cuvmm_torch.stats, cuvmm.stats)

    def test_struct_layout_matches_header(self):
        n = len(cuvmm_torch.STAT_FIELDS)
        self.assertGreaterEqual(cuvmm.ctypes.sizeof(cuvmm_torch.Stats), 2 * n * 8)
        self.assertEqual(cuvmm_torch.Stats.graph_held.offset, 8 * cuvmm_torch.STAT_FIELDS.index("graph_held"))
        self.assertEqual(cuvmm.ctypes.sizeof(cuvmm_torch.TagStats), 3 * 8 + 2 * 4)
        # Against cuvmm.h itself: test_header.py.


FAKE_LIB = r"""
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
static const char *err;
void *cuvmm_malloc(ssize_t s, int d, void *st) { return 0; }
void cuvmm_free(void *p, ssize_t s, int d, void *st) {}
void *cuvmm_pool_malloc(ssize_t s, int d, void *st) { return 0; }
void cuvmm_pool_free(void *p, ssize_t s, int d, void *st) {}
int cuvmm_get_stats(int d, uint64_t *out) {
    if (d != 0) { err = "cuvmm_get_stats: no device 1"; return -1; }
    for (int i = 0; i < 17; i++) out[i] = 100 + i;
    return 0;
}
ssize_t cuvmm_stats_json(char *buf, size_t len) {
    const char *j = "{\"0\":{\"live\":100}}";
    size_t n = strlen(j);
    if (buf && len > n) memcpy(buf, j, n + 1);
    return n;
}
int cuvmm_reset_peaks(int d) { return 0; }
int cuvmm_empty_cache(int d) { err = "cuvmm_empty_cache: refused while capturing"; return -1; }
int cuvmm_release_graph_memory(int d) { return 0; }
const char *cuvmm_last_error(void) { return err; }
static char tag[64];
int cuvmm_set_tag(const char *t) {
    if (t && !*t) { err = "cuvmm_set_tag: invalid argument: a tag needs a name"; return -1; }
    strncpy(tag, t ? t : "", sizeof tag - 1);
    return 0;
}
const char *fake_tag(void) { return tag; }
"""


@unittest.skipUnless(shutil.which("cc"), "needs a C compiler")
class CtypesLayer(unittest.TestCase):
    """cuvmm_torch's ctypes declarations against a fake library with the header's shape."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        src, so = Path(cls.dir.name, "fake.c"), Path(cls.dir.name, "libcuvmm.so")
        src.write_text(FAKE_LIB)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
        cuvmm._lib = None
        cuvmm_torch.load(so)

    @classmethod
    def tearDownClass(cls):
        cuvmm._lib = None
        cls.dir.cleanup()

    def test_stats_fields_in_order(self):
        st = cuvmm_torch.stats(0)
        self.assertEqual(list(st), list(cuvmm_torch.STAT_FIELDS))
        self.assertEqual(list(st.values()), list(range(100, 117)))

    def test_errors_carry_the_library_text(self):
        with self.assertRaisesRegex(RuntimeError, "no device 1"):
            cuvmm_torch.stats(1)
        with self.assertRaisesRegex(RuntimeError, "refused while capturing"):
            cuvmm_torch.empty_cache()
        self.assertIn("refused", cuvmm_torch.last_error())

    def test_an_error_names_the_function_once(self):
        with self.assertRaises(RuntimeError) as e:
            cuvmm_torch.stats(1)
        self.assertEqual(str(e.exception), "cuvmm_get_stats failed: no device 1")
        with self.assertRaises(RuntimeError) as e:
            cuvmm_torch.empty_cache()
        self.assertEqual(str(e.exception), "cuvmm_empty_cache failed: refused while capturing")

    def test_stats_json_parsed(self):
        self.assertEqual(cuvmm_torch.stats_json(), {"0": {"live": 100}})

    def test_a_refused_tag_raises_and_leaves_the_tag_in_force(self):
        fake_tag = cuvmm_torch.load().fake_tag
        fake_tag.restype = cuvmm.ctypes.c_char_p
        with cuvmm_torch.tag("weights"):
            with self.assertRaisesRegex(RuntimeError, "a tag needs a name"):
                with cuvmm_torch.tag(""):
                    self.fail("entered a block with a refused tag")
            self.assertEqual(fake_tag(), b"weights")
        self.assertEqual(fake_tag(), b"")

    def test_missing_sleep_abi_is_reported_not_crashed(self):
        self.assertFalse(cuvmm_torch.has_sleep())
        with self.assertRaisesRegex(RuntimeError, "has no cuvmm_sleep"):
            cuvmm_torch.sleep("weights")
        cuvmm_torch.reset_peaks()
        cuvmm_torch.release_graph_memory(0)


# A torch package with what cuvmm.torch touches of the pluggable allocator: the native object's
# hook setters record the addresses they get; _C's statistics functions raise as they do under a
# pluggable allocator. FAKE_TORCH_NO_RECORD drops set_record_stream_fn, as an older PyTorch might.
FAKE_TORCH = r"""
import os
__version__ = "2.11.0"


class _Native:
    def __init__(self):
        self.hooks = {}

    def __getattr__(self, name):
        if name.startswith("set_") and not (name == "set_record_stream_fn" and os.environ.get("FAKE_TORCH_NO_RECORD")):
            return lambda ptr: self.hooks.__setitem__(name, ptr)
        raise AttributeError(name)


class _Pluggable:
    def __init__(self, path, alloc_fn, free_fn):
        self.names, self._native = (path, alloc_fn, free_fn), _Native()

    def allocator(self):
        return self._native


def _raising(*_):
    raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")


class _C:
    _cuda_memoryStats = _cuda_resetPeakMemoryStats = _cuda_resetAccumulatedMemoryStats = staticmethod(_raising)


class _Memory:
    CUDAPluggableAllocator = _Pluggable
    current = None

    @staticmethod
    def change_current_allocator(a):
        _Memory.current = a


class cuda:
    memory = _Memory
    OutOfMemoryError = MemoryError

    @staticmethod
    def is_initialized():
        return False

    @staticmethod
    def current_device():
        return 0
"""

IMPORT_SCRIPT = r"""
import json, multiprocessing.reduction as mpr
import torch
change, dump = torch.cuda.memory.change_current_allocator, mpr.ForkingPickler.dump
import cuvmm, cuvmm.torch as ct
out = {"loaded": cuvmm._lib is not None, "change_kept": torch.cuda.memory.change_current_allocator is change,
       "pickler_kept": mpr.ForkingPickler.dump is dump}
ct.allocator()
out |= {"loaded_after": cuvmm._lib is not None,
        "change_wrapped_after": torch.cuda.memory.change_current_allocator.__wrapped__ is change}
print(json.dumps(out))
"""

HOOKS_SCRIPT = r"""
import ctypes, json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import torch, cuvmm, cuvmm.torch as ct
    alloc = ct.use_as_current_allocator()
lib = cuvmm.load()
addr = lambda n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
out = {
    "hooks": {k: v == addr(e) for k, v in alloc.allocator().hooks.items() for s, e, _ in ct.HOOKS if s == k},
    "current": ct.is_current_allocator(),
    "allocated": torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"],
    "warnings": [str(w.message) for w in caught],
}
other = torch.cuda.memory.CUDAPluggableAllocator("x.so", "a", "f")
torch.cuda.memory.change_current_allocator(other)
out["restored"] = torch._C._cuda_memoryStats is torch._raising and not ct.is_current_allocator()
out["other_current"] = torch.cuda.memory.current is other
print(json.dumps(out))
"""


@unittest.skipUnless(shutil.which("cc"), "needs a C compiler")
class TorchHooks(unittest.TestCase):
    """use_as_current_allocator wires cuvmm's hook entry points and the statistics, against a
    fake library and a stand-in torch package, in a process of its own."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        d = Path(cls.dir.name)
        src, cls.so = d / "fake.c", d / "libcuvmm.so"
        src.write_text(FAKE_LIB + "void cuvmm_empty_cache_all(void) {}\n"
                       "void cuvmm_record_stream(void *p, void *s) {}\n"
                       "void cuvmm_set_memory_fraction(double f, int d) {}\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(cls.so), str(src)], check=True)
        (d / "torch").mkdir()
        (d / "torch" / "__init__.py").write_text(FAKE_TORCH)

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def run_hooks(self, script=HOOKS_SCRIPT, **env):
        package = Path(cuvmm.__file__).resolve().parent.parent
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": f"{self.dir.name}:{package}", "CUVMM_LIB": str(self.so),
                                **env})
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)

    def test_the_three_hooks_get_cuvmms_entry_points_and_statistics_answer_until_another_allocator(self):
        out = self.run_hooks()
        self.assertEqual(out["hooks"], {"set_reset_fn": True, "set_record_stream_fn": True,
                                        "set_memory_fraction_fn": True})
        self.assertTrue(out["current"])
        self.assertEqual(out["allocated"], 100)  # the fake library's live
        self.assertTrue(out["restored"])
        self.assertTrue(out["other_current"])
        self.assertFalse(any("not reaching cuvmm" in w for w in out["warnings"]), out["warnings"])

    def test_importing_changes_nothing_until_an_allocator_is_made(self):
        out = self.run_hooks(IMPORT_SCRIPT)
        self.assertEqual(out, {"loaded": False, "change_kept": True, "pickler_kept": True, "loaded_after": True,
                               "change_wrapped_after": True})

    def test_a_missing_setter_is_named_in_a_warning(self):
        out = self.run_hooks(FAKE_TORCH_NO_RECORD="1")
        self.assertNotIn("set_record_stream_fn", out["hooks"])
        self.assertEqual(len(out["hooks"]), 2)
        self.assertTrue(any("Tensor.record_stream() (set_record_stream_fn)" in w for w in out["warnings"]),
                        out["warnings"])


class TorchStats(unittest.TestCase):
    """torch.cuda.memory_stats and its relatives answered from cuvmm's counters, on a stand-in
    for torch whose three _C functions raise as they do under a pluggable allocator."""

    COUNTERS = dict.fromkeys(cuvmm.STAT_FIELDS, 0) | {
        "live": 3 << 20, "live_peak": 5 << 20, "requested": (3 << 20) - 100, "mapped": 8 << 20,
        "mapped_peak": 12 << 20, "allocations": 10, "frees": 7, "pages_created": 4, "pages_released": 2,
        "oom_retries": 1,
    }

    def fake_torch(self):
        def raising(*_):
            raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

        c = types.SimpleNamespace(_cuda_memoryStats=raising, _cuda_resetPeakMemoryStats=raising,
                                  _cuda_resetAccumulatedMemoryStats=raising, _accelerator_getDeviceStats=raising)
        return types.SimpleNamespace(_C=c), raising

    def test_keys_and_meanings_in_pytorchs_format(self):
        from cuvmm import _torch_stats
        n = _torch_stats.nested(self.COUNTERS)
        flat = {}

        def walk(prefix, d):  # as torch.cuda.memory_stats flattens
            for k, v in d.items():
                walk(f"{prefix}{k}.", v) if isinstance(v, dict) else flat.__setitem__(prefix + k, v)

        walk("", n)
        self.assertEqual(flat["allocated_bytes.all.current"], 3 << 20)   # memory_allocated
        self.assertEqual(flat["allocated_bytes.all.peak"], 5 << 20)      # max_memory_allocated
        self.assertEqual(flat["reserved_bytes.all.current"], 8 << 20)    # memory_reserved
        self.assertEqual(flat["reserved_bytes.all.peak"], 12 << 20)      # max_memory_reserved
        self.assertEqual((flat["allocation.all.allocated"], flat["allocation.all.freed"],
                          flat["allocation.all.current"]), (10, 7, 3))
        self.assertEqual((flat["num_device_alloc"], flat["num_device_free"], flat["segment.all.current"]), (4, 2, 2))
        self.assertEqual(flat["num_alloc_retries"], 1)
        # Every key torch.cuda.memory_summary reads is there.
        for metric in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
                       "inactive_split_bytes", "allocation", "active", "segment", "inactive_split"):
            for pool in ("all", "large_pool", "small_pool"):
                for stat in ("current", "peak", "allocated", "freed"):
                    self.assertIn(f"{metric}.{pool}.{stat}", flat)
        self.assertTrue(all(isinstance(v, int) for v in flat.values()))

    def test_answer_then_restore_and_accumulated_counts_start_again(self):
        from cuvmm import _torch_stats
        torch, raising = self.fake_torch()
        counters = dict(self.COUNTERS)
        peaks_reset = []
        _torch_stats.answer(torch, lambda d: dict(counters), peaks_reset.append)
        self.assertTrue(_torch_stats.answering(torch))
        self.assertEqual(torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"], 3 << 20)
        self.assertEqual(torch._C._accelerator_getDeviceStats(0)["reserved_bytes"]["all"]["current"], 8 << 20)
        self.assertFalse(hasattr(torch._C, "_accelerator_resetPeakStats"), "only what this PyTorch has")
        torch._C._cuda_resetPeakMemoryStats(0)
        self.assertEqual(peaks_reset, [0])
        torch._C._cuda_resetAccumulatedMemoryStats(0)
        counters.update(allocations=12, frees=9)
        got = torch._C._cuda_memoryStats(0)["allocation"]["all"]
        self.assertEqual((got["allocated"], got["freed"], got["current"]), (2, 2, 3))
        self.assertEqual(torch._C._cuda_memoryStats(1)["allocation"]["all"]["allocated"], 12, "per device")
        _torch_stats.answer(torch, None, None)  # answering already: nothing changes
        self.assertEqual(torch._C._cuda_memoryStats(0)["allocation"]["all"]["freed"], 2)
        _torch_stats.restore(torch)
        self.assertFalse(_torch_stats.answering(torch))
        self.assertIs(torch._C._cuda_memoryStats, raising)
        self.assertIs(torch._C._cuda_resetPeakMemoryStats, raising)
        self.assertIs(torch._C._accelerator_getDeviceStats, raising)
        _torch_stats.restore(torch)  # not answering: nothing to do
        self.assertIs(torch._C._cuda_memoryStats, raising)

    def test_every_library_function_the_package_calls_is_declared(self):
        # ctypes passes an undeclared argument as a C int: a 64-bit device address would reach the
        # library cut to its low 32 bits.
        package = Path(cuvmm.__file__).resolve().parent
        called = set()
        for f in package.glob("*.py"):
            called |= set(re.findall(r"\bcuvmm_[a-z0-9_]+\b(?=\()", f.read_text()))
        called = {n for n in called if not n.startswith("cuvmm_torch")}
        source = (package / "__init__.py").read_text()
        declared = set(re.findall(r'"(cuvmm_[a-z0-9_]+)": \(', source))
        self.assertEqual(sorted(called - declared), [])

    def test_hook_entry_points_are_declared_with_the_hooks_signatures(self):
        header = (Path(__file__).resolve().parents[2] / "include" / "cuvmm.h").read_text()
        for decl in ("void cuvmm_empty_cache_all(void);", "void cuvmm_record_stream(void *ptr, cuvmm_stream_t stream);",
                     "void cuvmm_set_memory_fraction(double fraction, int device);"):
            self.assertIn(decl, header)


if __name__ == "__main__":
    unittest.main()
