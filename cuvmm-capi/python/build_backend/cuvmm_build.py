"""PEP 517 build backend of the `cuvmm` wheel, standard library only (builds offline).

The wheel holds the pure-Python modules (cuvmm, cuvmm.torch, cuvmm.torch_memory_saver, cuvmm.vllm,
cuvmm_torch), libcuvmm.so from `cargo build --release -p cuvmm-capi` (or the file named by
CUVMM_WHEEL_LIB), stripped, and libcuvmm_torch.so compiled from python/csrc/torch_oom.cpp. The modules use
ctypes and the libraries no Python C API, so the wheel fits every Python 3 on one platform:
py3-none-<platform>.
"""

from __future__ import annotations

import ast
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

CAPI = Path(__file__).resolve().parents[2]      # cuvmm-capi/
ROOT = CAPI.parent                              # the cargo workspace
PYTHON = CAPI / "python"
SHIM_SOURCE = PYTHON / "csrc" / "torch_oom.cpp"
MODULES = ("cuvmm/__init__.py", "cuvmm/_share.py", "cuvmm/_share_keep.py", "cuvmm/_torch_share.py",
           "cuvmm/_torch_stats.py", "cuvmm/torch.py", "cuvmm/torch_memory_saver.py", "cuvmm/vllm.py",
           "cuvmm_torch.py")


class BuildError(RuntimeError):
    pass


def _toml_value(text: str):
    """One value of the TOML this backend reads: a string, a boolean, an integer, an array or an
    inline table of those."""
    text = text.strip()
    # TOML's basic strings, arrays and inline tables read as Python literals once the tables'
    # keys are quoted and the booleans spelled Python's way; nothing else is accepted.
    out, i = [], 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|([A-Za-z_][\w-]*)(\s*=)?|\d[-:_]\d', text):
        out.append(text[i:m.start()])
        if m.group(0)[1:2] in ("-", ":", "_"):  # a date, a time or 1_000: Python reads them otherwise
            raise BuildError(f"unsupported TOML value {text!r}")
        word, eq = m.group(1), m.group(2)
        if word is None:
            out.append(m.group(0))
        elif eq:
            out.append(f"{word!r}:")
        elif word in ("true", "false"):
            out.append(str(word == "true"))
        else:
            raise BuildError(f"unsupported TOML value {text!r}")
        i = m.end()
    out.append(text[i:])
    try:
        return ast.literal_eval("".join(out))
    except (ValueError, SyntaxError):
        raise BuildError(f"unsupported TOML value {text!r}") from None


def read_toml(path: Path) -> dict:
    """The subset of TOML that pyproject.toml and Cargo.toml here use: tables, dotted table
    headers, arrays of tables, `key = value` with values that may span lines, comments. The
    standard library reads TOML only from Python 3.11 (tomllib); this reader lets every Python
    the package declares build it offline."""
    doc: dict = {}
    table = doc
    pending = ""
    for raw in path.read_text().splitlines():
        line = re.sub(r'("(?:[^"\\]|\\.)*")|#.*', lambda m: m.group(1) or "", raw).strip()
        if pending:
            line, pending = pending + " " + line, ""
        if not line:
            continue
        header = re.fullmatch(r"(\[\[?)\s*([\w.-]+)\s*\]\]?", line)
        if header and not pending:
            *parents, last = header.group(2).split(".")
            node = doc
            for k in parents:
                node = node.setdefault(k, {})
                node = node[-1] if isinstance(node, list) else node
            if header.group(1) == "[[":
                node.setdefault(last, []).append({})
                table = node[last][-1]
            else:
                table = node.setdefault(last, {})
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise BuildError(f"{path}: cannot read {raw!r}")
        if value.count("[") + value.count("{") > value.count("]") + value.count("}"):
            pending = line  # the value goes on over the next lines
            continue
        *parents, last = [k.strip().strip('"') for k in key.split(".")]
        node = table
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = _toml_value(value)
    if pending:
        raise BuildError(f"{path}: a value is not closed: {pending!r}")
    return doc


def _project() -> dict:
    return read_toml(CAPI / "pyproject.toml")["project"]


def version() -> str:
    """The workspace's version (Cargo.toml), which cuvmm.__version__ must repeat."""
    v = read_toml(ROOT / "Cargo.toml")["workspace"]["package"]["version"]
    src = (PYTHON / "cuvmm" / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"', src, re.M)
    if m is None or m.group(1) != v:
        raise BuildError(f"cuvmm/__init__.py's __version__ ({m and m.group(1)}) is not the workspace's {v}")
    return v


def platform_tag() -> str:
    return re.sub(r"[-.]", "_", sysconfig.get_platform())


def wheel_name(ver: str) -> str:
    return f"cuvmm-{ver}-py3-none-{platform_tag()}.whl"


def _run(cmd, **kw):
    try:
        return subprocess.run(cmd, check=True, **kw)
    except FileNotFoundError:
        raise BuildError(f"{cmd[0]} not found: building the cuvmm wheel needs it") from None
    except subprocess.CalledProcessError as e:
        raise BuildError(f"{' '.join(map(str, cmd))} failed (exit {e.returncode})") from None


def cargo_library() -> Path:
    """libcuvmm.so: CUVMM_WHEEL_LIB, else what `cargo build --release -p cuvmm-capi` made."""
    given = os.environ.get("CUVMM_WHEEL_LIB")
    if given:
        p = Path(given)
        if not p.is_file():
            raise BuildError(f"CUVMM_WHEEL_LIB={given} does not exist (a relative path is taken from {CAPI})")
        return p
    cargo = os.environ.get("CARGO", "cargo")
    out = _run([cargo, "build", "--release", "--locked", "-p", "cuvmm-capi", "--message-format=json-render-diagnostics"],
               cwd=ROOT, stdout=subprocess.PIPE, text=True).stdout
    for line in out.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") == "compiler-artifact" and "cdylib" in msg.get("target", {}).get("kind", []):
            for f in msg.get("filenames", []):
                if f.endswith("libcuvmm.so"):
                    return Path(f)
    raise BuildError("cargo built no libcuvmm.so")


def build_shim(out_dir: Path) -> Path:
    """libcuvmm_torch.so: C++ runtime only, no PyTorch headers, no link to libcuvmm.so (it is
    bound to the loaded one at run time)."""
    out = out_dir / "libcuvmm_torch.so"
    cxx = os.environ.get("CXX", "g++")
    _run([cxx, "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror",
          "-Wl,--no-undefined", "-o", str(out), str(SHIM_SOURCE)])
    return out


def stripped(lib: Path, out_dir: Path) -> Path:
    """A copy of `lib` without its symbol table and debug sections (a third of a release build's
    size); its exported functions stay, in the dynamic symbol table."""
    out = out_dir / lib.name
    shutil.copyfile(lib, out)
    _run([os.environ.get("STRIP", "strip"), "--strip-unneeded", str(out)])
    return out


def _metadata(project: dict, ver: str) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {ver}",
             f"Summary: {project['description']}", f"Requires-Python: {project['requires-python']}",
             f"License: {project['license']['text']}"]
    lines += [f"Classifier: {c}" for c in project.get("classifiers", [])]
    lines += [f"Project-URL: {label}, {url}" for label, url in project.get("urls", {}).items()]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs]
    readme = (PYTHON / "README.md")
    body = readme.read_text() if readme.is_file() else ""
    if body:
        lines.append("Description-Content-Type: text/markdown")
    return "\n".join(lines) + "\n\n" + body


def _dist_info(project: dict, ver: str) -> dict:
    return {
        "METADATA": _metadata(project, ver).encode(),
        "WHEEL": ("Wheel-Version: 1.0\nGenerator: cuvmm_build\nRoot-Is-Purelib: false\n"
                  f"Tag: py3-none-{platform_tag()}\n").encode(),
        "top_level.txt": b"cuvmm\ncuvmm_torch\n",
        # vLLM loads its general plugins in every process it starts; this one does nothing
        # unless CUVMM_VLLM=1 (cuvmm.vllm.plugin).
        "entry_points.txt": b"[vllm.general_plugins]\ncuvmm = cuvmm.vllm:plugin\n",
    }


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(wheel_directory, lib: Path, shim: Path, ver: str) -> str:
    project = _project()
    dist_info = f"cuvmm-{ver}.dist-info"
    files = {m: (PYTHON / m).read_bytes() for m in MODULES}
    files["cuvmm/libcuvmm.so"] = lib.read_bytes()
    files["cuvmm/libcuvmm_torch.so"] = shim.read_bytes()
    for lic in sorted(ROOT.glob("LICENSE*")):
        files[f"{dist_info}/licenses/{lic.name}"] = lic.read_bytes()
    files.update({f"{dist_info}/{k}": v for k, v in _dist_info(project, ver).items()})
    record = io.StringIO()
    w = csv.writer(record, lineterminator="\n")
    for name, data in files.items():
        w.writerow([name, _digest(data), len(data)])
    w.writerow([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = record.getvalue().encode()

    name = wheel_name(ver)
    path = Path(wheel_directory) / name
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for n, data in files.items():
            info = zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if n.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    os.replace(tmp, path)
    return name


# PEP 517 hooks.

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    """The wheel's .dist-info without building the libraries (pip asks for it first)."""
    ver = version()
    d = Path(metadata_directory) / f"cuvmm-{ver}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    for name, data in _dist_info(_project(), ver).items():
        (d / name).write_bytes(data)
    return d.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    try:
        ver = version()
        lib = cargo_library()
        with tempfile.TemporaryDirectory(prefix="cuvmm-wheel-") as d:
            return write_wheel(wheel_directory, stripped(lib, Path(d)), build_shim(Path(d)), ver)
    except BuildError as e:
        print(f"cuvmm_build: {e}", file=sys.stderr)
        raise


def build_sdist(sdist_directory, config_settings=None):
    raise BuildError("cuvmm has no source distribution: libcuvmm.so is built from the whole cargo "
                     "workspace; build a wheel from a checkout (tools/build-wheel)")


if __name__ == "__main__":  # python3 cuvmm_build.py OUT_DIR: the wheel without pip
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    print(out / build_wheel(str(out)))
    shutil.rmtree(Path(__file__).parent / "__pycache__", ignore_errors=True)
