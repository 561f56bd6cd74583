#!/usr/bin/env python3
"""The package's ctypes declarations against cuvmm.h, with no GPU, no library and no PyTorch.

cuvmm.h is generated from the Rust declarations (tools/gen-header); the ctypes side is written by
hand. This parses the header and checks every signature in ``cuvmm.SIGNATURES`` (restype and
argtypes), every ``ctypes.Structure`` of the package (field names, types and order), the
constants the package mirrors, and that every function the package calls is declared.

    python3 cuvmm-capi/tests/python/test_header.py
"""

import ctypes
import re
import sys
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
CAPI = HERE.parents[1]
HEADER = CAPI / "include" / "cuvmm.h"
PACKAGE = CAPI / "python" / "cuvmm"
sys.path.insert(0, str(CAPI / "python"))

import cuvmm  # noqa: E402

# C scalar types of the header, as ctypes spells them.
SCALARS = {
    "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint8_t": ctypes.c_uint8,
    "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t, "ptrdiff_t": ctypes.c_ssize_t,
    "ssize_t": ctypes.c_ssize_t, "double": ctypes.c_double, "char": ctypes.c_char,
}
# The header's pointer typedefs.
HANDLES = {"cuvmm_stream_t": ctypes.c_void_p, "cuvmm_alloc_observer_t": ctypes.c_void_p}
# The header's structs and the package's class for each.
STRUCTS = {"cuvmm_stats_t": cuvmm.Stats, "cuvmm_tag_stats_t": cuvmm.TagStats,
           "cuvmm_handoff_stats_t": cuvmm.HandoffStats, "cuvmm_export_t": cuvmm.Export}


class Header:
    """What cuvmm.h declares: functions as (return type, [parameter types]), structs as
    [(type, field)], enums as {constant: value}, #defines as integers; types as the C text,
    `const` dropped."""

    def __init__(self, text: str):
        self.defines = {m[0]: int(m[1]) for m in re.findall(r"^#define\s+(\w+)\s+(-?\d+)\s*$", text, re.M)}
        code = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        code = re.sub(r"//[^\n]*", " ", code)
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
        self.prototypes = set(re.findall(r"\b(cuvmm_\w+)\s*\(", code))
        code = re.sub(r'extern\s+"C"\s*\{|^\s*\}\s*$', " ", code, flags=re.M)
        struct = re.compile(r"typedef\s+struct\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", re.S)
        self.structs = {name: [self.split(f) for f in body.split(";") if f.strip()]
                        for body, name in struct.findall(code)}
        enum = re.compile(r"typedef\s+enum\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", re.S)
        self.enums = {name: {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(-?\d+)", body)}
                      for body, name in enum.findall(code)}
        code = re.sub(r"typedef[^;{]*;", " ", enum.sub(" ", struct.sub(" ", code)))
        self.functions = {}
        for decl in code.split(";"):
            decl = " ".join(decl.split())
            m = re.fullmatch(r"(.+?)\b(cuvmm_\w+)\s*\((.*)\)", decl)
            if not m:
                assert not decl, f"not understood: {decl!r}"
                continue
            params = [] if m[3].strip() in ("", "void") else [self.split(p)[0] for p in m[3].split(",")]
            self.functions[m[2]] = (self.norm(m[1]), params)

    @staticmethod
    def norm(ctype: str) -> str:
        ctype = re.sub(r"\bconst\b", " ", ctype)
        return re.sub(r"\s*\*", " *", " ".join(ctype.split())).strip()

    @classmethod
    def split(cls, decl: str):
        """(type, name) of `T *name`."""
        m = re.fullmatch(r"(.*?[\s*])(\w+)", " ".join(decl.split()))
        return cls.norm(m[1]), m[2]


def expected(ctype: str):
    """The ctypes type a C type is declared as."""
    if ctype == "void":
        return None
    if ctype in SCALARS:
        return SCALARS[ctype]
    if ctype in HANDLES:
        return HANDLES[ctype]
    if ctype in STRUCTS:
        return STRUCTS[ctype]
    if ctype.endswith(" *"):
        inner = ctype[:-2]
        if inner == "void":
            return ctypes.c_void_p
        if inner in ("char", "uint8_t"):
            # NUL-terminated text, or bytes a Python buffer holds: both as char *.
            return ctypes.c_char_p
        return ctypes.POINTER(expected(inner))
    raise AssertionError(f"a C type this test does not know: {ctype!r}")


def same(declared, ctype: str) -> bool:
    want = expected(ctype)
    if declared is want:
        return True
    # POINTER(T) is one class per T; ctypes' fixed-width names alias the platform's types.
    return (isinstance(declared, type) and issubclass(declared, ctypes._Pointer)
            and isinstance(want, type) and issubclass(want, ctypes._Pointer) and declared._type_ is want._type_)


class CtypesAgainstHeader(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.header = Header(HEADER.read_text())

    def test_the_header_parses_into_every_function_and_struct(self):
        self.assertEqual(set(self.header.functions), self.header.prototypes)
        self.assertGreater(len(self.header.functions), 30)
        self.assertEqual(set(self.header.structs), set(STRUCTS))
        self.assertEqual(self.header.functions["cuvmm_malloc"], ("void *", ["ptrdiff_t", "int", "cuvmm_stream_t"]))
        self.assertEqual(self.header.functions["cuvmm_lease_release"][1], ["void *", "cuvmm_stream_t *", "size_t"])

    def test_every_signature_matches_its_declaration(self):
        for name, (restype, argtypes) in cuvmm.SIGNATURES.items():
            with self.subTest(name):
                self.assertIn(name, self.header.functions, "declared in Python, not in cuvmm.h")
                ret, params = self.header.functions[name]
                self.assertTrue(same(restype, ret), f"restype {restype} for {ret}")
                self.assertEqual(len(argtypes), len(params), f"{argtypes} for ({', '.join(params)})")
                for i, (a, p) in enumerate(zip(argtypes, params)):
                    self.assertTrue(same(a, p), f"argument {i}: {a} for {p}")

    def test_every_struct_matches_its_declaration(self):
        for cname, cls in STRUCTS.items():
            with self.subTest(cname):
                fields = self.header.structs[cname]
                ours = cls._fields_[:len(fields)]
                self.assertEqual([n for n, _ in ours], [n for _, n in fields])
                for (name, t), (ctype, _) in zip(ours, fields):
                    self.assertTrue(same(t, ctype), f"{name}: {t} for {ctype}")
                # Room past the header's fields is private spare room only (see cuvmm.Stats).
                self.assertEqual([n for n, _ in cls._fields_[len(fields):] if not n.startswith("_")], [])

    def test_the_constants_the_package_mirrors(self):
        self.assertEqual(cuvmm._LOG_ALL, self.header.defines["CUVMM_LOG_ALL"])
        self.assertEqual(cuvmm._LOG_UNRETURNED, self.header.defines["CUVMM_LOG_UNRETURNED"])
        self.assertEqual(cuvmm.STAT_FIELDS, tuple(n for _, n in self.header.structs["cuvmm_stats_t"]))
        self.assertEqual(cuvmm.HANDOFF_FIELDS, tuple(n for _, n in self.header.structs["cuvmm_handoff_stats_t"]))
        codes = self.header.enums["cuvmm_error_t"]
        mirrored = {n: getattr(cuvmm, n) for n in dir(cuvmm) if n.startswith("ERROR_")}
        self.assertTrue(mirrored)
        for n, v in mirrored.items():
            self.assertEqual(codes["CUVMM_OK" if n == "ERROR_OK" else "CUVMM_" + n], v, n)

    def test_every_name_the_package_uses_is_declared_and_every_call_typed(self):
        named, called = set(cuvmm._REQUIRED + cuvmm._SLEEP), set()
        for path in PACKAGE.glob("*.py"):
            text = path.read_text()
            # cuvmm_torch_*: the package's own PyTorch shim (csrc/), not libcuvmm.so.
            named |= {n for n in re.findall(r"\bcuvmm_\w+", text) if not n.startswith("cuvmm_torch")}
            called |= {n for n in re.findall(r"\.(cuvmm_\w+)\(", text) + re.findall(r'_fn\("(cuvmm_\w+)"\)', text)
                       if not n.startswith("cuvmm_torch")}
        # Fields cuvmm adds to the segments of PyTorch's memory snapshots (cuvmm/_snapshot.py).
        named -= {"cuvmm_tag", "cuvmm_asleep"}
        declared = set(self.header.functions) | set(self.header.structs) | set(self.header.enums)
        self.assertEqual(sorted(named - declared), [])
        # A function called without argtypes would pass Python ints as C ints: pointers cut short.
        self.assertEqual(sorted(called - set(cuvmm.SIGNATURES)), [])

    def test_a_wrong_declaration_is_caught(self):
        ret, params = self.header.functions["cuvmm_export"]
        self.assertFalse(same(ctypes.c_int, ret))
        self.assertFalse(same(ctypes.POINTER(cuvmm.Stats), params[2]))
        self.assertTrue(same(ctypes.POINTER(cuvmm.Export), params[2]))
        self.assertFalse(same(ctypes.c_void_p, "cuvmm_stream_t *"))


if __name__ == "__main__":
    unittest.main()
