"""The `cuvmm` wheel: setuptools-rust builds libcuvmm.so (`cargo rustc` on cuvmm-capi, a plain
cdylib, stripped by rustc) and setuptools the C++ libcuvmm_torch.so; both land in the package as
`cuvmm/libcuvmm.so` and `cuvmm/libcuvmm_torch.so`, where cuvmm and cuvmm.torch load them with
ctypes. Project metadata is in pyproject.toml.

CUVMM_WHEEL_LIB=/path/libcuvmm.so packs that library (stripped) instead of building one.
"""

import os
import re
import shutil
import subprocess

import setuptools

# `pip install --no-build-isolation` builds with the setuptools already installed; one older than
# 77 lacks setuptools.command.bdist_wheel and the license fields of pyproject.toml, and would fail
# below with an ImportError that names neither.
_SETUPTOOLS = int(re.match(r"\d*", setuptools.__version__).group() or 0)
if _SETUPTOOLS < 77:
    raise SystemExit(f"building cuvmm needs setuptools >= 77, not {setuptools.__version__}: "
                     "pip install 'setuptools>=77' 'setuptools-rust>=1.9', or build without "
                     "--no-build-isolation")

from setuptools import Extension, setup  # noqa: E402
from setuptools.command.bdist_wheel import bdist_wheel  # noqa: E402
from setuptools.command.build_ext import build_ext  # noqa: E402
from setuptools.command.sdist import sdist  # noqa: E402
from setuptools_rust import Binding, RustExtension  # noqa: E402

GIVEN_LIB = os.environ.get("CUVMM_WHEEL_LIB")
# setuptools' intermediate files go under the workspace's target/, not into the source tree.
BUILD_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "python-build")
os.makedirs(BUILD_BASE, exist_ok=True)


class BuildExt(build_ext):
    def get_ext_filename(self, fullname):
        # Shared libraries loaded by path with ctypes, not Python modules: no ABI suffix.
        return os.path.join(*fullname.split(".")) + ".so"

    def run(self):
        super().run()
        if GIVEN_LIB:
            if not os.path.isfile(GIVEN_LIB):
                raise FileNotFoundError(f"CUVMM_WHEEL_LIB={GIVEN_LIB} does not exist")
            dest = self.get_ext_fullpath("cuvmm.libcuvmm")
            shutil.copyfile(GIVEN_LIB, dest)
            subprocess.run([os.environ.get("STRIP", "strip"), "--strip-unneeded", dest], check=True)


class BdistWheel(bdist_wheel):
    def get_tag(self):
        # Neither library uses Python's C API: one wheel serves every Python 3 on the platform.
        return ("py3", "none", super().get_tag()[2])


class NoSdist(sdist):
    def run(self):
        raise SystemExit("cuvmm has no source distribution: libcuvmm.so is built from the whole cargo "
                         "workspace; build a wheel from a checkout (tools/build-wheel)")


setup(
    rust_extensions=[] if GIVEN_LIB else [
        RustExtension("cuvmm.libcuvmm", path="Cargo.toml", binding=Binding.NoBinding,
                      args=["--locked"], rustc_flags=["-Cstrip=symbols"]),
    ],
    # C++ runtime only: no PyTorch or Python headers used, no link to libcuvmm.so (bound to the
    # loaded one at run time).
    ext_modules=[
        Extension("cuvmm.libcuvmm_torch", sources=["python/csrc/torch_oom.cpp"], language="c++",
                  extra_compile_args=["-std=c++17", "-O2", "-g0", "-fvisibility=hidden", "-Wall", "-Wextra"],
                  extra_link_args=["-s", "-Wl,--no-undefined"]),
    ],
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
    cmdclass={"build_ext": BuildExt, "bdist_wheel": BdistWheel, "sdist": NoSdist},
)
