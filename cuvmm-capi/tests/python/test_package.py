#!/usr/bin/env python3
"""The `cuvmm` Python package without a GPU or PyTorch: the wheel (built through pip from the
package's setuptools-rust build, installed into a fresh virtual environment, found there with no PYTHONPATH), the
PyTorch version check, the entry points that raise instead of returning NULL, and the
torch_memory_saver facade's bookkeeping and option mapping.

    python3 cuvmm-capi/tests/python/test_package.py       (needs cc and g++)

The wheel is built as `pip install --no-build-isolation` builds it offline: with the setuptools and
setuptools-rust of the Python that runs this (skipped without them).
"""

import contextlib
import ctypes
import hashlib
import base64
import csv
import io
import os
import re
import shutil
import subprocess
import sys
import types
import sysconfig
import tempfile
import unittest
import warnings
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPI = HERE.parents[1]
sys.path.insert(0, str(CAPI / "python"))
sys.path.insert(0, str(HERE))

import cuvmm  # noqa: E402
import tms_compare  # noqa: E402
from cuvmm import torch_memory_saver as tms  # noqa: E402

HAVE_TOOLS = bool(shutil.which("cc") and shutil.which(os.environ.get("CXX", "g++")))
try:
    import setuptools_rust  # noqa: F401
    HAVE_BUILD = True
except ImportError:
    HAVE_BUILD = False

# A libcuvmm.so stand-in: allocations above 1 MiB fail as the driver's out of memory does, a
# size of 7 fails for another reason, 0 is NULL without error; frees and set_backup are recorded.
FAKE_LIB = r"""
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
static __thread const char *err;
static __thread int code;
char heap[4096];
void *last_freed;
char backup_tag[64], backup_dir[256];
int backup_backend = -1, backup_retain = -1;
void *cuvmm_malloc(ssize_t s, int d, void *st) {
    if (s == 0) return 0;
    if (s == 7) { err = "cuvmm_malloc: invalid argument: allocating with a sleeping tag"; code = 1; return 0; }
    if (s == 9) { err = "cuvmm_malloc: invalid argument: 9 bytes are more than the device's 8 bytes of memory"; code = 2; return 0; }
    if (s == 11) { err = "cuvmm_malloc: refused: 11 bytes would pass the limit set"; code = 2; return 0; }
    if (s > (1 << 20)) { err = "cuvmm_malloc: cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"; code = 2; return 0; }
    return heap;
}
void cuvmm_free(void *p, ssize_t s, int d, void *st) { last_freed = p; }
void *cuvmm_pool_malloc(ssize_t s, int d, void *st) { return 0; }
void cuvmm_pool_free(void *p, ssize_t s, int d, void *st) {}
int cuvmm_get_stats(int d, uint64_t *out) { for (int i = 0; i < 15; i++) out[i] = 100 + i; return 0; }
ssize_t cuvmm_stats_json(char *buf, size_t len) { return 0; }
int cuvmm_reset_peaks(int d) { return 0; }
int cuvmm_empty_cache(int d) { return 0; }
int cuvmm_release_graph_memory(int d) { return 0; }
const char *cuvmm_last_error(void) { return err; }
int cuvmm_last_error_code(void) { return code; }
int error_log_mode = -1;
int cuvmm_set_error_log(int m) { error_log_mode = m; return 0; }
int cuvmm_set_backup(const char *t, int b, int r, const char *dir) {
    if (b < 0 || b > 2) { err = "cuvmm_set_backup: invalid argument: no backend 3"; return -1; }
    strncpy(backup_tag, t, sizeof backup_tag - 1);
    strncpy(backup_dir, dir ? dir : "", sizeof backup_dir - 1);
    backup_backend = b; backup_retain = r;
    return 0;
}
"""

# What PyTorch's Python bindings do with an exception from the allocator (torch/csrc/Exceptions.h):
# catch torch::PyTorchError (declared as PyTorch declares it) and raise python_type() with what();
# any other std::exception is a RuntimeError. Returns 1, 2, or 0 when nothing was thrown.
CATCHER = r"""
#include <exception>
#include <string>
#include <cstring>
#include <sys/types.h>
namespace torch {
struct PyTorchError : public std::exception {
  PyTorchError() = default;
  virtual void *python_type() = 0;
  const char *what() const noexcept override { return msg.c_str(); }
  std::string msg;
};
}
extern "C" int call(void *(*fn)(ssize_t, int, void *), ssize_t size, void **ptr, void **type, char *text, size_t n) {
  try {
    *ptr = fn(size, 0, nullptr);
    return 0;
  } catch (torch::PyTorchError &e) {
    *type = e.python_type();
    std::strncpy(text, e.what(), n - 1);
    return 1;
  } catch (const std::exception &e) {
    std::strncpy(text, e.what(), n - 1);
    return 2;
  }
}
"""


# c10's error classes as PyTorch declares them (c10/util/Exception.h), with members of another
# layout than any PyTorch's: the shim must build the object with the library's own constructor,
# never assume a layout. FAKE_C10 is the "libc10" (the constructor out of line, the vtable of
# OutOfMemoryError emitted by a function that throws one); C10_CATCHER is PyTorch's C++ code that
# falls back on out of memory (cuDNN's algorithm search): it catches c10::OutOfMemoryError by type
# and reads what_without_backtrace() as the Python bindings do. 3: caught as that type, 1: as
# torch::PyTorchError, 2: any other std::exception, 0: nothing thrown.
C10_DECLS = r"""
#include <cstdint>
#include <exception>
#include <string>
#include <vector>
namespace c10 {
struct SourceLocation { const char *function; const char *file; uint32_t line; };
class Error : public std::exception {
  std::string msg_;
  std::vector<std::string> context_;
  std::string what_, what_without_backtrace_;
  const void *caller_ = nullptr;
 public:
  Error(SourceLocation where, std::string msg);
  const char *what() const noexcept override { return what_.c_str(); }
  virtual const char *what_without_backtrace() const noexcept { return what_without_backtrace_.c_str(); }
};
class OutOfMemoryError : public Error { using Error::Error; };
}
"""
FAKE_C10 = C10_DECLS + r"""
c10::Error::Error(SourceLocation where, std::string msg)
    : msg_(msg), what_(msg + " (raised from " + where.function + ")"), what_without_backtrace_(msg) {}
extern "C" void fake_c10_throw_oom() { throw c10::OutOfMemoryError({"here", "file", 1}, "native"); }
"""
# A PyTorch whose c10::Error is larger than the room the shim reserves for it.
FAKE_C10_BIG = FAKE_C10.replace("const void *caller_ = nullptr;", "const void *caller_ = nullptr;\n  char more_[4096] = {1};")
C10_CATCHER = C10_DECLS + r"""
#include <cstring>
#include <sys/types.h>
namespace torch {
struct PyTorchError : public std::exception {
  virtual void *python_type() = 0;
};
}
extern "C" int call(void *(*fn)(ssize_t, int, void *), ssize_t size, char *text, size_t n) {
  try {
    fn(size, 0, nullptr);
    return 0;
  } catch (c10::OutOfMemoryError &e) {
    std::strncpy(text, e.what_without_backtrace(), n - 1);
    return 3;
  } catch (torch::PyTorchError &e) {
    std::strncpy(text, e.what(), n - 1);
    return 1;
  } catch (const std::exception &e) {
    std::strncpy(text, e.what(), n - 1);
    return 2;
  }
}
"""


def build_c(tmp: Path, name: str, src: str, cxx: bool = False) -> Path:
    ext = ".cpp" if cxx else ".c"
    (tmp / (name + ext)).write_text(src)
    so = tmp / f"lib{name}.so"
    compiler = os.environ.get("CXX", "g++") if cxx else "cc"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(so), str(tmp / (name + ext))], check=True)
    return so


def build_shim(tmp: Path, *flags: str) -> Path:
    """libcuvmm_torch.so with the package's flags (cuvmm-capi/setup.py), its warnings errors, and
    `flags` (a user's CXXFLAGS) after them."""
    so = tmp / "libcuvmm_torch.so"
    if flags:
        (tmp / "flagged").mkdir(exist_ok=True)
        so = tmp / "flagged" / "libcuvmm_torch.so"
    subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
                    "-Wall", "-Wextra", "-Werror", "-Wl,--no-undefined", *flags, "-o", str(so),
                    str(CAPI / "python" / "csrc" / "torch_oom.cpp")], check=True)
    return so


class TorchVersion(unittest.TestCase):
    def test_supported_tested_and_newer(self):
        self.assertIsNone(cuvmm.torch_version_problem("2.11.0+cu130"))
        self.assertIsNone(cuvmm.torch_version_problem("2.8.1"))
        kind, text = cuvmm.torch_version_problem("2.7.1+cu126")
        self.assertEqual(kind, "error")
        self.assertIn("2.7.1+cu126", text)
        self.assertIn("2.8 to 2.11", text)
        kind, text = cuvmm.torch_version_problem("2.12.0.dev20260101")
        self.assertEqual(kind, "warning")
        self.assertIn("2.12.0.dev20260101", text)
        self.assertEqual(cuvmm.torch_version_problem("3.0.0")[0], "warning")
        self.assertEqual(cuvmm.torch_version_problem("unknown")[0], "error")

    def test_version_is_the_workspaces(self):
        # The wheel takes its version from cuvmm.__version__; the library's is the workspace's.
        cargo = (CAPI.parent / "Cargo.toml").read_text()
        m = re.search(r'^\[workspace\.package\]\n(?:[^\[].*\n)*?version = "([^"]+)"', cargo, re.M)
        self.assertIsNotNone(m)
        self.assertEqual(m.group(1), cuvmm.__version__)


class BuildRequirements(unittest.TestCase):
    def test_an_older_setuptools_is_named_with_the_version_needed(self):
        """`pip install --no-build-isolation` runs setup.py with the setuptools installed; an old
        one (here a stand-in of 69.5.1 without setuptools.command) is refused by name."""
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "setuptools").mkdir()
            (Path(d) / "setuptools" / "__init__.py").write_text(
                '__version__ = "69.5.1"\n'
                'class Extension:\n    def __init__(self, *a, **k): pass\n'
                'def setup(**k): pass\n')
            r = subprocess.run([sys.executable, "setup.py", "--version"], cwd=CAPI, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": d})
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("building cuvmm needs setuptools >= 77, not 69.5.1", r.stderr)
        self.assertNotIn("ModuleNotFoundError", r.stderr)


@unittest.skipUnless(HAVE_TOOLS, "needs cc and g++")
class RaisingEntryPoints(unittest.TestCase):
    """libcuvmm_torch.so as the package builds it, called the way PyTorch calls an allocator."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        tmp = Path(cls.dir.name)
        cls.fake = ctypes.CDLL(str(build_c(tmp, "fakecuvmm", FAKE_LIB)))
        cls.shim = ctypes.CDLL(str(build_shim(tmp)))
        cls.catcher = ctypes.CDLL(str(build_c(tmp, "catcher", CATCHER, cxx=True)))
        cls.catcher.call.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
        cls.shim.cuvmm_torch_bind.argtypes = [ctypes.c_void_p] * 3 + [ctypes.py_object] * 2

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def call(self, fn, size):
        ptr, typ, text = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.create_string_buffer(2048)
        rc = self.catcher.call(ctypes.cast(fn, ctypes.c_void_p), size, ptr, typ, text, 2048)
        return rc, ptr.value, typ.value, text.value.decode()

    def bind(self):
        f = self.fake
        rc = self.shim.cuvmm_torch_bind(ctypes.cast(f.cuvmm_malloc, ctypes.c_void_p),
                                        ctypes.cast(f.cuvmm_free, ctypes.c_void_p),
                                        ctypes.cast(f.cuvmm_last_error, ctypes.c_void_p), MemoryError, LookupError)
        self.assertEqual(rc, 0)

    def test_0_unbound_raises_runtime_error(self):
        rc, _, _, text = self.call(self.shim.cuvmm_torch_malloc, 64)
        self.assertEqual(rc, 2)
        self.assertIn("not bound", text)

    def test_out_of_memory_raises_the_oom_class_with_the_librarys_text(self):
        self.bind()
        rc, _, typ, text = self.call(self.shim.cuvmm_torch_malloc, 2 << 20)
        self.assertEqual(rc, 1, text)
        self.assertEqual(typ, id(MemoryError))
        self.assertTrue(text.startswith("CUDA out of memory"), text)
        self.assertIn(f"{2 << 20} bytes on device 0", text)
        self.assertIn("CUDA_ERROR_OUT_OF_MEMORY", text)

    def test_a_request_larger_than_the_device_raises_the_oom_class(self):
        self.bind()
        rc, _, typ, text = self.call(self.shim.cuvmm_torch_malloc, 9)
        self.assertEqual((rc, typ), (1, id(MemoryError)), text)
        self.assertIn("more than the device's", text)

    def test_plain_cuvmm_malloc_hands_pytorch_a_null(self):
        """What the entry points fix: cuvmm_malloc itself throws nothing."""
        self.assertEqual(self.call(self.fake.cuvmm_malloc, 2 << 20)[:2], (0, None))

    def test_out_of_memory_is_told_by_the_librarys_code_once_bound_whatever_the_text(self):
        self.bind()
        self.assertEqual(self.call(self.shim.cuvmm_torch_malloc, 11)[2], id(LookupError), "read by its text")
        self.shim.cuvmm_torch_bind_codes.argtypes = [ctypes.c_void_p]
        self.assertEqual(self.shim.cuvmm_torch_bind_codes(ctypes.cast(self.fake.cuvmm_last_error_code,
                                                                       ctypes.c_void_p)), 0)
        try:
            rc, _, typ, text = self.call(self.shim.cuvmm_torch_malloc, 11)
            self.assertEqual((rc, typ), (1, id(MemoryError)), text)
            self.assertEqual(self.call(self.shim.cuvmm_torch_malloc, 7)[2], id(LookupError))
        finally:
            self.shim.cuvmm_torch_bind_codes(None)

    def test_other_refusals_raise_the_error_class(self):
        self.bind()
        rc, _, typ, text = self.call(self.shim.cuvmm_torch_malloc, 7)
        self.assertEqual((rc, typ), (1, id(LookupError)))
        self.assertIn("sleeping tag", text)

    def test_success_and_size_zero_return_without_raising(self):
        self.bind()
        rc, ptr, _, _ = self.call(self.shim.cuvmm_torch_malloc, 4096)
        self.assertEqual(rc, 0)
        self.assertEqual(ptr, ctypes.addressof(ctypes.c_char.in_dll(self.fake, "heap")))
        self.assertEqual(self.call(self.shim.cuvmm_torch_malloc, 0)[:2], (0, None))
        self.shim.cuvmm_torch_free(ctypes.c_void_p(ptr), ctypes.c_ssize_t(4096), 0, None)
        self.assertEqual(ctypes.c_void_p.in_dll(self.fake, "last_freed").value, ptr)

    def test_binding_refuses_a_missing_function(self):
        self.assertEqual(self.shim.cuvmm_torch_bind(None, None, None, MemoryError, RuntimeError), -1)


@unittest.skipUnless(HAVE_TOOLS, "needs cc and g++")
class NativeOutOfMemoryError(unittest.TestCase):
    """Bound to a libc10 (cuvmm_torch_bind_c10), out of memory throws c10::OutOfMemoryError, which
    C++ that catches that type (cuDNN's fallbacks) catches; before, only the look-alike was thrown
    and went past such a catch clause."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        tmp = Path(cls.dir.name)
        cls.fake = ctypes.CDLL(str(build_c(tmp, "fakecuvmm", FAKE_LIB)))
        cls.c10 = ctypes.CDLL(str(build_c(tmp, "c10", FAKE_C10, cxx=True)))
        cls.shim = ctypes.CDLL(str(build_shim(tmp)))
        cls.catcher = ctypes.CDLL(str(build_c(tmp, "c10catcher", C10_CATCHER, cxx=True)))
        cls.catcher.call.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_char_p, ctypes.c_size_t]
        cls.shim.cuvmm_torch_bind.argtypes = [ctypes.c_void_p] * 3 + [ctypes.py_object] * 2
        cls.shim.cuvmm_torch_bind_c10.argtypes = [ctypes.c_void_p] * 2
        f = cls.fake
        assert cls.shim.cuvmm_torch_bind(ctypes.cast(f.cuvmm_malloc, ctypes.c_void_p),
                                         ctypes.cast(f.cuvmm_free, ctypes.c_void_p),
                                         ctypes.cast(f.cuvmm_last_error, ctypes.c_void_p),
                                         MemoryError, LookupError) == 0

    @classmethod
    def tearDownClass(cls):
        cls.shim.cuvmm_torch_bind_c10(None, None)
        cls.dir.cleanup()

    def symbol(self, name):
        return ctypes.addressof(ctypes.c_char.in_dll(self.c10, name))

    def bind_c10(self, vtable="_ZTVN3c1016OutOfMemoryErrorE"):
        ctor = self.symbol("_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traits"
                           "IcESaIcEEE")
        return self.shim.cuvmm_torch_bind_c10(ctor, self.symbol(vtable))

    def call(self, size):
        text = ctypes.create_string_buffer(2048)
        rc = self.catcher.call(ctypes.cast(self.shim.cuvmm_torch_malloc, ctypes.c_void_p), size, text, 2048)
        return rc, text.value.decode()

    def test_out_of_memory_is_caught_as_c10_out_of_memory_error_once_bound(self):
        self.shim.cuvmm_torch_bind_c10(None, None)
        self.assertEqual(self.call(2 << 20)[0], 1, "unbound: the look-alike, which such a catch misses")
        self.assertEqual(self.bind_c10(), 0)
        for _ in range(3):
            rc, text = self.call(2 << 20)
            self.assertEqual(rc, 3, text)
            self.assertTrue(text.startswith("CUDA out of memory"), text)
            self.assertIn("CUDA_ERROR_OUT_OF_MEMORY", text)
        rc, text = self.call(9)
        self.assertEqual(rc, 3, text)

    def test_other_refusals_stay_runtime_errors(self):
        self.assertEqual(self.bind_c10(), 0)
        rc, text = self.call(7)
        self.assertEqual(rc, 1, text)
        self.assertIn("sleeping tag", text)

    def test_a_vtable_of_another_class_or_a_missing_symbol_is_refused(self):
        self.assertEqual(self.bind_c10("_ZTVN3c105ErrorE"), -1)
        self.assertEqual(self.shim.cuvmm_torch_bind_c10(None, self.symbol("_ZTVN3c1016OutOfMemoryErrorE")), -1)

    def refusal(self, shim=None):
        f = (shim or self.shim).cuvmm_torch_c10_refusal
        f.restype = ctypes.c_char_p
        return (f() or b"").decode()

    def test_a_shim_built_with_another_string_abi_refuses_to_bind_and_throws_the_look_alike(self):
        """Built with -D_GLIBCXX_USE_CXX11_ABI=0 (CXXFLAGS kept for old extensions), the shim would
        hand PyTorch's constructor a std::string it reads as another: the heap is corrupted at the
        first out of memory. It refuses instead, saying why, and throws the look-alike."""
        shim = ctypes.CDLL(str(build_shim(Path(self.dir.name), "-D_GLIBCXX_USE_CXX11_ABI=0")))
        shim.cuvmm_torch_bind.argtypes = [ctypes.c_void_p] * 3 + [ctypes.py_object] * 2
        shim.cuvmm_torch_bind_c10.argtypes = [ctypes.c_void_p] * 2
        f = self.fake
        self.assertEqual(shim.cuvmm_torch_bind(ctypes.cast(f.cuvmm_malloc, ctypes.c_void_p),
                                               ctypes.cast(f.cuvmm_free, ctypes.c_void_p),
                                               ctypes.cast(f.cuvmm_last_error, ctypes.c_void_p),
                                               MemoryError, LookupError), 0)
        ctor = self.symbol("_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traits"
                           "IcESaIcEEE")
        self.assertEqual(shim.cuvmm_torch_bind_c10(ctor, self.symbol("_ZTVN3c1016OutOfMemoryErrorE")), -1)
        self.assertIn("-D_GLIBCXX_USE_CXX11_ABI=0", self.refusal(shim))
        text = ctypes.create_string_buffer(2048)
        rc = self.catcher.call(ctypes.cast(shim.cuvmm_torch_malloc, ctypes.c_void_p), 2 << 20, text, 2048)
        self.assertEqual(rc, 1, text.value)
        self.assertTrue(text.value.startswith(b"CUDA out of memory"), text.value)

    def test_a_build_that_lays_out_source_location_otherwise_is_refused(self):
        """PyTorch's constructor takes a c10::SourceLocation by value: a layout of the shim's own
        (here packed by a CXXFLAGS of -fpack-struct=4) would hand it other bytes."""
        r = subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-fsyntax-only", "-fpack-struct=4",
                            str(CAPI / "python" / "csrc" / "torch_oom.cpp")], capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("c10::SourceLocation's layout differs from PyTorch's", r.stderr)

    def test_an_error_larger_than_the_room_reserved_is_refused(self):
        big = ctypes.CDLL(str(build_c(Path(self.dir.name), "c10big", FAKE_C10_BIG, cxx=True)))

        def symbol(name):
            return ctypes.addressof(ctypes.c_char.in_dll(big, name))

        ctor = symbol("_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE")
        self.assertEqual(self.shim.cuvmm_torch_bind_c10(ctor, symbol("_ZTVN3c1016OutOfMemoryErrorE")), -1)
        self.assertIn("larger than the room", self.refusal())
        self.assertEqual(self.call(2 << 20)[0], 1, "the look-alike, not an object past its room")
        self.assertEqual(self.bind_c10(), 0, "PyTorch's size binds")
        self.assertEqual(self.refusal(), "")


@unittest.skipUnless(HAVE_TOOLS, "needs cc and g++")
@unittest.skipUnless(HAVE_BUILD, "needs setuptools>=77 and setuptools-rust (pip install setuptools setuptools-rust)")
class InstalledWheel(unittest.TestCase):
    """`pip wheel --no-build-isolation ./cuvmm-capi` (the PEP 517 path, offline) with a stand-in
    library, installed with `pip install --no-deps --no-index` into a fresh virtual environment."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        tmp = Path(cls.dir.name)
        lib = build_c(tmp, "cuvmm", FAKE_LIB)
        env = dict(os.environ, CUVMM_WHEEL_LIB=str(lib), PIP_NO_CACHE_DIR="1")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                        "--no-index", "--no-build-isolation", "-w", str(tmp / "dist"), str(CAPI)],
                       check=True, env=env, cwd=tmp)
        wheels = list((tmp / "dist").glob("*.whl"))
        assert len(wheels) == 1, wheels
        cls.wheel = wheels[0]
        cls.venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(cls.venv)], check=True)
        cls.python = cls.venv / "bin" / "python"
        subprocess.run([sys.executable, "-m", "pip", "--python", str(cls.python), "install", "--quiet",
                        "--no-deps", "--no-index", str(cls.wheel)], check=True, env=env, cwd=tmp)
        cls.site = Path(subprocess.run([str(cls.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       check=True, capture_output=True, text=True).stdout.strip())

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def run_py(self, code, fake_torch=None, torch_libs=()):
        """Runs code in the environment with no PYTHONPATH, no CUVMM_LIB, outside the checkout;
        fake_torch: a torch module of that version installed beside the package meanwhile, with
        the libraries `torch_libs` in its lib folder."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUVMM_LIB")}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        torch_dir = self.site / "torch"
        if fake_torch is not None:
            torch_dir.mkdir()
            (torch_dir / "__init__.py").write_text(f"__version__ = {fake_torch!r}\n")
            (torch_dir / "lib").mkdir()
            for lib in torch_libs:
                shutil.copy(lib, torch_dir / "lib" / Path(lib).name)
        try:
            return subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, env=env,
                                  cwd=self.dir.name)
        finally:
            shutil.rmtree(torch_dir, ignore_errors=True)

    def test_wheel_is_tagged_for_any_python3_on_this_platform(self):
        platform = re.sub(r"[-.]", "_", sysconfig.get_platform())
        self.assertEqual(self.wheel.name, f"cuvmm-{cuvmm.__version__}-py3-none-{platform}.whl")
        with zipfile.ZipFile(self.wheel) as z:
            info = f"cuvmm-{cuvmm.__version__}.dist-info/"
            wheel = z.read(info + "WHEEL").decode()
            self.assertIn("Root-Is-Purelib: false", wheel)
            self.assertIn(f"Tag: py3-none-{platform}", wheel)
            self.assertIn('Requires-Dist: torch>=2.8; extra == "torch"', z.read(info + "METADATA").decode())
            rows = list(csv.reader(io.StringIO(z.read(info + "RECORD").decode())))
            names = {r[0] for r in rows}
            self.assertEqual(names, set(z.namelist()))
            for name, digest, size in rows:
                if name.endswith("RECORD"):
                    continue
                data = z.read(name)
                h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                self.assertEqual((digest, int(size)), ("sha256=" + h, len(data)), name)
            self.assertEqual({n for n in names if not n.startswith(info)},
                             {"cuvmm/__init__.py", "cuvmm/_graph_trees.py", "cuvmm/_share.py", "cuvmm/_snapshot.py",
                              "cuvmm/_tag_pools.py", "cuvmm/_torch_share.py", "cuvmm/_torch_stats.py",
                              "cuvmm/_torch_tools.py", "cuvmm/torch.py",
                              "cuvmm/torch_memory_saver.py", "cuvmm/vllm.py", "cuvmm_torch.py", "cuvmm/libcuvmm.so",
                              "cuvmm/libcuvmm_torch.so"})
            self.assertIn(info + "licenses/LICENSE-MIT", names)
            self.assertIn(info + "licenses/LICENSE-APACHE", names)
            metadata = z.read(info + "METADATA").decode()
            # No address the project cannot stand behind: no project URLs at all.
            self.assertEqual([line for line in metadata.splitlines() if line.startswith(("Project-URL", "Home-page"))], [])
            self.assertIn("Requires-Python: >=3.9", metadata)
            self.assertIn("License-Expression: MIT OR Apache-2.0", metadata)
            # Stripped: no static symbol table left (its section name goes with it).
            self.assertNotIn(b".symtab", z.read("cuvmm/libcuvmm.so"))

    def test_vllm_finds_the_plugin_and_it_does_nothing_unless_asked(self):
        # Python 3.9's entry_points() takes no group: it returns a dict of groups.
        r = self.run_py("from importlib.metadata import entry_points; eps = entry_points(); "
                        "eps = eps.select(group='vllm.general_plugins') if hasattr(eps, 'select') "
                        "else eps.get('vllm.general_plugins', ()); "
                        "[ep] = [e for e in eps if e.name == 'cuvmm']; "
                        "print(ep.value); ep.load()(); print('loaded')")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split(), ["cuvmm.vllm:plugin", "loaded"])

    def test_build_leaves_the_source_tree_alone(self):
        self.assertEqual([p.name for p in CAPI.iterdir() if p.name == "build" or p.name.endswith(".egg-info")], [])
        self.assertEqual([p.name for p in (CAPI / "python").iterdir() if p.name.endswith(".egg-info")], [])

    def test_library_found_in_the_installed_package(self):
        r = self.run_py("import cuvmm, cuvmm_torch; print(cuvmm.library_path()); print(cuvmm_torch.stats(0)['live'])")
        self.assertEqual(r.returncode, 0, r.stderr)
        path, live = r.stdout.split()
        self.assertEqual(Path(path), (self.site / "cuvmm" / "libcuvmm.so").resolve())
        self.assertEqual(live, "100")

    def test_statistics_without_torch_take_device_0_and_never_import_it(self):
        r = self.run_py("import sys, cuvmm; print(cuvmm.stats()['live'], cuvmm.stats('cuda')['live'], "
                        "cuvmm.stats('cuda:0')['live'], 'torch' in sys.modules)")
        self.assertEqual((r.returncode, r.stdout.split()), (0, ["100", "100", "100", "False"]), r.stderr)
        r = self.run_py("import cuvmm; cuvmm.stats('cpu')")
        self.assertIn("ValueError: not a CUDA device: 'cpu'", r.stderr)

    def test_loading_leaves_stderr_the_errors_no_exception_reports(self):
        header = (CAPI / "include" / "cuvmm.h").read_text()
        self.assertIn(f"#define CUVMM_LOG_UNRETURNED {cuvmm._LOG_UNRETURNED}\n", header)
        self.assertIn(f"#define CUVMM_LOG_ALL {cuvmm._LOG_ALL}\n", header)
        r = self.run_py("import ctypes, cuvmm; print(ctypes.c_int.in_dll(cuvmm.load(), 'error_log_mode').value)")
        self.assertEqual((r.returncode, r.stdout.strip()), (0, str(cuvmm._LOG_UNRETURNED)), r.stderr)

    def test_plain_cuvmm_malloc_handed_to_pytorch_writes_every_error(self):
        # Without libcuvmm_torch.so PyTorch gets cuvmm_malloc's NULL and no text: stderr has it.
        code = ("import ctypes, types, warnings, cuvmm, cuvmm.torch as t\n"
                "t._shim_path = lambda: None\n"
                "class Pluggable:\n"
                "    def __init__(self, path, m, f): self.names = (m, f)\n"
                "    def allocator(self): return types.SimpleNamespace()\n"
                "t._torch.cuda = types.SimpleNamespace(memory=types.SimpleNamespace(CUDAPluggableAllocator=Pluggable))\n"
                "warnings.simplefilter('ignore')\n"
                "print(*t.allocator().names, ctypes.c_int.in_dll(cuvmm.load(), 'error_log_mode').value)")
        r = self.run_py(code, fake_torch="2.11.0")
        self.assertEqual((r.returncode, r.stdout.split()), (0, ["cuvmm_malloc", "cuvmm_free", "0"]), r.stderr)

    def test_cuvmm_torch_without_torch_says_what_is_missing(self):
        r = self.run_py("import cuvmm.torch")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ImportError: cuvmm.torch needs PyTorch (2.8 to 2.11), which is not installed", r.stderr)
        r = self.run_py("import cuvmm, cuvmm_torch; from cuvmm.torch_memory_saver import torch_memory_saver; "
                        "print(torch_memory_saver.enabled)")
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "True"), r.stderr)

    def test_torch_version_checked_at_import(self):
        r = self.run_py("import cuvmm.torch", fake_torch="2.6.0+cu124")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ImportError: cuvmm 0.1.0 supports PyTorch 2.8 to 2.11; PyTorch 2.6.0+cu124 is older", r.stderr)
        r = self.run_py("import cuvmm.torch as t; print(t.raises_on_oom())", fake_torch="2.13.0")
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "True"), r.stderr)
        self.assertIn("RuntimeWarning: cuvmm 0.1.0 supports PyTorch 2.8 to 2.11; PyTorch 2.13.0 is newer", r.stderr)
        r = self.run_py("import warnings; warnings.simplefilter('error'); import cuvmm.torch", fake_torch="2.11.0+cu130")
        self.assertEqual((r.returncode, r.stderr), (0, ""))

    def test_the_loaded_pytorchs_c10_out_of_memory_error_is_found_and_bound(self):
        c10 = build_c(Path(self.dir.name), "c10", FAKE_C10, cxx=True)
        code = """if True:
            import ctypes, os, torch, cuvmm.torch as t
            lib = os.path.join(os.path.dirname(torch.__file__), "lib")
            print(t._c10_oom_symbols(lib) is None)  # not loaded by PyTorch: not used
            ctypes.CDLL(os.path.join(lib, "libc10.so"))
            print(t._c10_oom_symbols(lib) is not None)
            torch.OutOfMemoryError = MemoryError
            t._bound_shim()  # what allocator() binds
            print(t.native_oom_error())
        """
        r = self.run_py(code, fake_torch="2.11.0", torch_libs=[c10])
        self.assertEqual((r.returncode, r.stdout.split()), (0, ["True", "True", "True"]), r.stderr)
        r = self.run_py(code.replace("t._bound_shim()", "os.environ['CUVMM_TORCH_NATIVE_OOM'] = '0'; t._bound_shim()"),
                        fake_torch="2.11.0", torch_libs=[c10])
        self.assertEqual((r.returncode, r.stdout.split()), (0, ["True", "True", "False"]), r.stderr)

    def test_a_c10_error_the_shim_cannot_build_falls_back_with_the_reason_written(self):
        big = build_c(Path(self.dir.name), "c10", FAKE_C10_BIG, cxx=True)
        code = """if True:
            import ctypes, os, types, torch, cuvmm.torch as t
            ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
            torch.OutOfMemoryError = MemoryError
            t._bound_shim()
            print(t.native_oom_error())
        """
        r = self.run_py(code, fake_torch="2.11.0", torch_libs=[big])
        self.assertEqual((r.returncode, r.stdout.split()), (0, ["False"]), r.stderr)
        self.assertIn("not PyTorch's own c10::OutOfMemoryError", r.stderr)
        self.assertIn("larger than the room libcuvmm_torch.so reserves", r.stderr)
        c10 = build_c(Path(self.dir.name), "c10", FAKE_C10, cxx=True)
        r = self.run_py(code.replace("t._bound_shim()", "torch._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=False); "
                                     "t._bound_shim()"), fake_torch="2.11.0", torch_libs=[c10])
        self.assertEqual((r.returncode, r.stdout.split()), (0, ["False"]), r.stderr)
        self.assertIn("the loaded PyTorch was built with _GLIBCXX_USE_CXX11_ABI=0", r.stderr)


class FakeApi:
    """cuvmm's tag functions as the facade uses them, with cuvmm's refusals."""

    def __init__(self, backup=True):
        self.calls = []
        self.asleep = set()
        self.backup = backup

    def has_backup(self):
        return self.backup

    def set_backup(self, tag, backend, retain=False, directory=None):
        self.calls.append(("set_backup", tag, backend, retain, directory))

    def sleep(self, tag, offload=True):
        if tag in self.asleep:
            raise RuntimeError("already asleep")
        self.asleep.add(tag)
        self.calls.append(("sleep", tag, offload))

    def wake(self, tag):
        if tag not in self.asleep:
            raise RuntimeError("not asleep")
        self.asleep.discard(tag)
        self.calls.append(("wake", tag))


class Facade(unittest.TestCase):
    def test_backup_options_map_onto_cuvmm_backups(self):
        bm, M = tms.backup_mode, tms.BackupMode
        self.assertEqual(bm(environ={}), M(False))
        self.assertEqual(bm(True, environ={}), M(True, None))
        self.assertEqual(bm(True, cpu_backup_backend="pinned", environ={}), M(True, "pinned"))
        self.assertEqual(bm(True, cpu_backup_backend="mmap", environ={}), M(True, "pageable"))
        self.assertEqual(bm(True, environ={"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}), M(True, "pageable"))
        self.assertEqual(bm(True, cpu_backup_backend="pinned", environ={"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}),
                         M(True, "pinned"))
        self.assertEqual(bm(enable_disk_backup=True, environ={}), M(True, "disk"))
        for bad in (dict(cpu_backup_backend="pinned"), dict(enable_cpu_backup=True, enable_disk_backup=True),
                    dict(enable_cpu_backup=True, cpu_backup_backend="hugepages")):
            with self.assertRaises(ValueError, msg=bad):
                bm(environ={}, **bad)

    def saver(self, **kw):
        s = tms.TorchMemorySaver(api=FakeApi(**kw))
        s._retain, s._disk_dir = False, None
        return s

    def test_pause_and_resume_every_tag_with_its_own_mode(self):
        s = self.saver()
        s._register("weights", tms.BackupMode(True, "pinned"))
        s._register("kv", tms.BackupMode(False))
        s._register("weights", tms.BackupMode(True, "pinned"))  # again, same options: fine
        s.pause()
        self.assertEqual(s.api.calls, [("set_backup", "weights", "pinned", False, None), ("set_backup", "weights", "pinned", False, None),
                                       ("sleep", "weights", True), ("sleep", "kv", False)])
        s.api.calls.clear()
        s.resume("kv")
        with self.assertRaisesRegex(RuntimeError, "'kv' is not paused"):
            s.resume("kv")
        s.pause("kv")
        with self.assertRaisesRegex(RuntimeError, "'kv' is already paused"):
            s.pause("kv")
        s.resume()
        self.assertEqual(s.api.calls, [("wake", "kv"), ("sleep", "kv", False), ("wake", "weights"), ("wake", "kv")])
        self.assertEqual(s.api.asleep, set())

    def test_pause_of_all_skips_paused_tags_and_unknown_tags_are_no_ops(self):
        s = self.saver()
        s._register("a", tms.BackupMode(False))
        s._register("b", tms.BackupMode(False))
        s.pause("a")
        s.pause()
        s.pause("never-used")
        s.resume("never-used")
        self.assertEqual([c for c in s.api.calls if c[0] == "sleep"], [("sleep", "a", False), ("sleep", "b", False)])

    def test_one_backup_mode_per_tag(self):
        s = self.saver()
        s._register("w", tms.BackupMode(True, "pinned"))
        with self.assertRaisesRegex(ValueError, "one backup mode per tag"):
            s._register("w", tms.BackupMode(True, "pageable"))
        s.pause("w")
        with self.assertRaisesRegex(RuntimeError, "is paused"):
            s._register("w", tms.BackupMode(True, "pinned"))

    def test_retain_and_disk_directory_reach_every_offloading_tag(self):
        s = self.saver()
        s._register("w", tms.BackupMode(True, None))
        s._register("kv", tms.BackupMode(False))
        with self.assertRaisesRegex(ValueError, "set_disk_backup_dir"):
            s._register("big", tms.BackupMode(True, "disk"))
        s.api.calls.clear()
        s.retain_cpu_backup = True
        self.assertTrue(s.retain_cpu_backup)
        self.assertEqual(s.api.calls, [("set_backup", "w", "pageable", True, None)])
        with tempfile.TemporaryDirectory() as d:
            sub = Path(d, "spill")
            s.set_disk_backup_dir(sub)
            self.assertTrue(sub.is_dir())
            s._register("big", tms.BackupMode(True, "disk"))
            self.assertEqual(s.api.calls[-1], ("set_backup", "big", "disk", True, str(sub)))

    def test_leaving_a_region_with_a_cpu_backup_prepares_that_backup(self):
        s = self.saver()
        prepared = []
        s.api.prepare_backup = prepared.append
        entered = []

        @contextlib.contextmanager
        def scope(api, tag):
            entered.append(tag)
            yield

        s._pools = types.SimpleNamespace(scope=scope)
        with s.region("weights", enable_cpu_backup=True):
            self.assertEqual(prepared, [], "not while the weights are still being allocated")
        with s.region("kv"):
            pass
        self.assertEqual((entered, prepared), (["weights", "kv"], ["weights"]))
        del s.api.prepare_backup  # a library without it: nothing to prepare, nothing fails
        with s.region("w2", enable_cpu_backup=True):
            pass

    def test_a_library_without_set_backup(self):
        s = self.saver(backup=False)
        with self.assertRaisesRegex(NotImplementedError, "cuvmm_set_backup"):
            s._register("big", tms.BackupMode(True, "disk"))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s._register("w", tms.BackupMode(True, "pageable"))
            s._register("w2", tms.BackupMode(True, "pageable"))
        texts = [str(x.message) for x in w]
        self.assertEqual(sum("'mmap' is pinned here" in t for t in texts), 1, texts)
        self.assertEqual(s.api.calls, [])

    def test_settings_torch_memory_saver_has(self):
        s = self.saver()
        with self.assertRaises(NotImplementedError):
            s.memory_margin_bytes
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s.memory_margin_bytes = 1 << 30
        self.assertIn("not enforced", str(w[0].message))
        s.hook_mode = "torch"
        with self.assertRaises(ValueError):
            s.hook_mode = "ld_preload"
        with self.assertRaises(NotImplementedError):
            s.get_cpu_backup(None)
        with tms.configure_subprocess():
            pass


class CompareReport(unittest.TestCase):
    """tms_compare.py's summary and table (the GPU run feeds them)."""

    @staticmethod
    def rep(pause, resume, d2h=1.0, h2d=1.0, ok=True):
        return {"pause_weights_s": pause, "pause_cache_s": 0.01, "pause_graph_s": 0.002, "resume_weights_s": resume,
                "resume_cache_s": 0.02, "resume_graph_s": 0.003, "d2h_bound_s": d2h, "h2d_bound_s": h2d,
                "weights_intact": ok, "graph_output_identical": True, "rss_before": 1, "rss_paused": 2, "rss_after": 3}

    def test_first_cycle_apart_medians_after_it_and_ratios(self):
        s = tms_compare.summarize([self.rep(5.0, 2.0), self.rep(1.2, 1.1), self.rep(1.0, 1.3), self.rep(1.1, 1.2)])
        self.assertEqual((s["first_pause_weights_s"], s["pause_weights_s"], s["resume_weights_s"]), (5.0, 1.1, 1.2))
        self.assertAlmostEqual(s["first_pause_over_d2h"], 5.0)
        self.assertAlmostEqual(s["pause_over_d2h"], 1.1)
        self.assertTrue(s["all_weights_intact"])
        self.assertFalse(tms_compare.summarize([self.rep(1, 1), self.rep(1, 1, ok=False)])["all_weights_intact"])

    def test_table_puts_both_side_by_side_with_the_ratio(self):
        cu = {"summary": tms_compare.summarize([self.rep(1.0, 1.0), self.rep(0.4, 0.3, d2h=0.35, h2d=0.3)])}
        tm = {"summary": tms_compare.summarize([self.rep(7.0, 3.0), self.rep(7.2, 2.4, d2h=0.35, h2d=0.3)])}
        rows = tms_compare.table({"cuvmm": cu, "torch_memory_saver": tm})
        self.assertEqual(rows[0], "| | cuvmm | torch_memory_saver | torch_memory_saver / cuvmm |")
        self.assertIn("| pause of the weights (s, median of later cycles) | 0.400 | 7.200 | 18.00x |", rows)
        self.assertIn("| resume / pinned H2D copy | 1.00 | 8.00 |  |", rows)
        self.assertEqual({r.count("|") for r in rows}, {5})
        alone = tms_compare.table({"cuvmm": cu})
        self.assertEqual({r.count("|") for r in alone}, {3})


@unittest.skipUnless(HAVE_TOOLS, "needs cc")
class SetBackupAbi(unittest.TestCase):
    """cuvmm.set_backup's arguments as cuvmm_set_backup receives them."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        cuvmm._lib = None
        self.lib = cuvmm.load(build_c(Path(self.dir.name), "cuvmm", FAKE_LIB))

    def tearDown(self):
        cuvmm._lib = None
        self.dir.cleanup()

    def test_backends_retain_and_directory(self):
        self.assertTrue(cuvmm.has_backup())
        cuvmm.set_backup("weights", "pinned", retain=True)
        self.assertEqual((ctypes.c_int.in_dll(self.lib, "backup_backend").value,
                          ctypes.c_int.in_dll(self.lib, "backup_retain").value), (1, 1))
        self.assertEqual(ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(self.lib, "backup_tag"))), b"weights")
        cuvmm.set_backup("big", "disk", directory=Path("/var/tmp/spill"))
        self.assertEqual((ctypes.c_int.in_dll(self.lib, "backup_backend").value,
                          ctypes.c_int.in_dll(self.lib, "backup_retain").value), (2, 0))
        self.assertEqual(ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(self.lib, "backup_dir"))), b"/var/tmp/spill")
        cuvmm.set_backup("w", "pageable")
        self.assertEqual(ctypes.c_int.in_dll(self.lib, "backup_backend").value, 0)
        with self.assertRaisesRegex(ValueError, "only with it"):
            cuvmm.set_backup("w", "disk")
        with self.assertRaisesRegex(ValueError, "one of pageable, pinned, disk"):
            cuvmm.set_backup("w", "mmap")


if __name__ == "__main__":
    unittest.main()
