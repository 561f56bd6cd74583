#!/usr/bin/env python3
"""cuvmm.torch's reduction and rebuild of a CUDA tensor, without a GPU or PyTorch: a stand-in
``torch`` and a stand-in library (counting marks, descriptors made, imports and unexports), the
sender and the receiver in this one process. A first hand-off makes the pages' descriptors and
imports them; the same pages again make, send and import nothing; the block is let go each time
the receiver's tensor goes; a descriptor the receiver refuses leaves nothing held.

    python3 cuvmm-capi/tests/python/test_torch_share.py
"""

import contextlib
import gc
import os
import sys
import threading
import time
import types
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))

PAGE = 2 << 20
BLOCK = 64 * PAGE


class Dtype:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __str__(self):
        return f"torch.{self.name}"


class Device:
    def __init__(self, type_, index=None):
        self.type, self.index = type_, index


class Storage:
    def __init__(self, ptr, nbytes, owner=None):
        self._ptr, self._nbytes, self.owner = ptr, nbytes, owner

    def data_ptr(self):
        return self._ptr

    def nbytes(self):
        return self._nbytes


class Tensor:
    layout = "strided"
    is_nested = False
    is_leaf = True

    def __init__(self, storage=None, dtype=None, size=(), stride=(), offset=0, device=0):
        self.storage, self.dtype, self.shape, self._stride = storage, dtype, tuple(size), tuple(stride)
        self._offset, self.device, self.requires_grad = offset, Device("cuda", device), False

    def untyped_storage(self):
        return self.storage

    def stride(self):
        return self._stride

    def storage_offset(self):
        return self._offset

    def set_(self, storage, offset, size, stride):
        self.storage, self._offset, self.shape, self._stride = storage, offset, tuple(size), tuple(stride)
        return self

    def requires_grad_(self, flag):
        self.requires_grad = flag
        return self


class Parameter(Tensor):
    def __init__(self, t, requires_grad=True):
        super().__init__(t.storage, t.dtype, t.shape, t._stride, t._offset, t.device.index)
        self.requires_grad = requires_grad


def fake_torch():
    torch = types.ModuleType("torch")
    torch.dtype, torch.Tensor, torch.strided = Dtype, Tensor, "strided"
    torch.float32, torch.bfloat16 = Dtype("float32", 4), Dtype("bfloat16", 2)
    torch.nn = types.SimpleNamespace(Parameter=Parameter)
    torch.device = Device
    torch._C = types.SimpleNamespace(_cuda_hasPrimaryContext=lambda d: d == 0)
    torch.cuda = types.SimpleNamespace(
        device_count=lambda: 2, current_device=lambda: 0, synchronize=lambda d=None: None,
        can_device_access_peer=lambda a, b: True, device=lambda d: contextlib.nullcontext(),
        get_device_properties=lambda d: types.SimpleNamespace(total_memory=80 << 30))
    torch.UntypedStorage = lambda n, device=None: Storage(0, n)
    torch.as_tensor = lambda m, device=None: types.SimpleNamespace(
        untyped_storage=lambda: Storage(m.__cuda_array_interface__["data"][0],
                                        m.__cuda_array_interface__["shape"][0], m))
    torch.empty = lambda shape, dtype=None, device=None: Tensor(None, dtype, shape, (1,), 0, device.index)
    return torch


class FakeLib:
    """The library calls the reduction and the rebuild make, counted."""

    def __init__(self):
        self.marks = self.unexports = self.fds_made = self.imports = self.import_releases = 0
        self.mark_calls = 0
        self.pages = [11, 12, 13]

    def cuvmm_owner(self, device, ptr, block, n):
        block._obj.value, n._obj.value = BLOCK, len(self.pages) * PAGE
        return 1

    def cuvmm_export_mark(self, device, ptr, out, pages, cap):
        # Too little room marks nothing but costs a call: the library marks and lets go.
        self.mark_calls += 1
        n = len(self.pages)
        o = out._obj
        o.block, o.len, o.first_page, o.page, o.count = BLOCK, n * PAGE, BLOCK, PAGE, n
        if n <= cap:
            self.marks += 1
            for i, s in enumerate(self.pages):
                pages[i] = s
        return n

    def cuvmm_export_fds(self, device, block, fds, cap):
        assert block == BLOCK and self.marks > self.unexports, "descriptors of a marked block only"
        for i in range(len(self.pages)):
            fds[i] = os.memfd_create(f"page{i}")
        self.fds_made += len(self.pages)
        return len(self.pages)

    def cuvmm_unexport(self, device, block):
        self.unexports += 1
        return 0

    def cuvmm_import(self, device, fds, n, page, peers, npeers, base):
        self.imports += 1
        base._obj.value = (1 << 40) + self.imports * BLOCK
        return self.imports

    def cuvmm_import_release(self, handle):
        self.import_releases += 1
        return 0


sys.modules["torch"] = fake_torch()
import cuvmm  # noqa: E402
from cuvmm import _share, _torch_share as ts  # noqa: E402


def wait_for(cond, what):
    deadline = time.monotonic() + 10
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class HandOff(unittest.TestCase):
    def setUp(self):
        self.lib = cuvmm._lib = FakeLib()
        ts._kept.release_idle()

    def tensor(self):
        t = Tensor(Storage(BLOCK + 4096, 3 * PAGE - 8192), Dtype("float32", 4), (4, 8), (1, 4), 3)
        t.requires_grad = True
        return Parameter(t, requires_grad=True)

    def send_and_receive(self):
        fn, args = ts.reduce_tensor(self.tensor())
        return fn(*args)

    def test_the_same_pages_again_make_send_and_import_nothing(self):
        lib = self.lib
        got = self.send_and_receive()
        self.assertEqual((lib.marks, lib.fds_made, lib.imports), (1, 3, 1), "a first hand-off imports")
        self.assertIsInstance(got, Parameter)
        self.assertEqual((got.shape, got.stride(), got.storage_offset(), got.requires_grad),
                         ((4, 8), (1, 4), 3, True))
        first_ptr = got.storage.data_ptr()
        del got
        wait_for(lambda: lib.unexports == 1, "the block let go")
        self.assertEqual(lib.import_releases, 0, "the mapping kept")
        for k in range(3):
            got = self.send_and_receive()
            self.assertEqual((lib.marks, lib.fds_made, lib.imports), (2 + k, 3, 1),
                             "nothing made, sent or imported for pages mapped already")
            self.assertEqual(got.storage.data_ptr(), first_ptr, "over the kept mapping")
            self.assertEqual(lib.unexports, 1 + k, "held while the tensor lives")
            del got
            wait_for(lambda: lib.unexports == 2 + k, "the block let go")
        wait_for(lambda: ts.pending_shares() == 0, "nothing pending")
        # Other pages (the block freed and allocated again elsewhere): imported afresh.
        lib.pages = [21, 22, 23]
        got = self.send_and_receive()
        self.assertEqual((lib.fds_made, lib.imports), (6, 2))
        del got
        wait_for(lambda: lib.unexports == lib.marks, "the block let go")
        self.assertEqual(ts.release_kept_mappings(), 2 * 3 * PAGE)
        self.assertEqual(lib.import_releases, 2, "idle kept mappings unmapped on request")

    def test_a_block_of_many_pages_is_marked_once(self):
        lib = self.lib
        lib.pages = list(range(100, 400))
        got = self.send_and_receive()
        self.assertEqual((lib.mark_calls, lib.marks), (1, 1), "one mark, with room for every page")
        self.assertEqual(lib.fds_made, 300)
        del got
        wait_for(lambda: lib.unexports == 1, "the block let go")
        wait_for(lambda: ts.pending_shares() == 0, "nothing pending")
        self.assertEqual(ts.release_kept_mappings(), 300 * PAGE)

    def test_storages_dropped_together_share_a_device_wait_and_are_let_go_after_it(self):
        lib, cuda = self.lib, sys.modules["torch"].cuda
        gate, waits = threading.Event(), []

        def synchronize(device=None):
            waits.append(device)
            if threading.current_thread() is not threading.main_thread():
                gate.wait(10)  # (one that waited on the dropping thread would wait alone)

        cuda.synchronize = synchronize
        try:
            got = [self.send_and_receive() for _ in range(64)]
            self.assertEqual((lib.marks, lib.imports), (64, 1))
            del got
            time.sleep(0.2)
            self.assertEqual(lib.unexports, 0, "no sender told while the device's work may run")
            gate.set()
            wait_for(lambda: lib.unexports == 64, "every block let go")
            self.assertLessEqual(len(waits), 2, "one device wait for the storages dropped together")
            wait_for(lambda: ts._waits.pending() == 0, "every release told")
            self.assertEqual(ts.release_kept_mappings(), 3 * PAGE, "the mapping kept until now")
        finally:
            cuda.synchronize = lambda d=None: None
            gate.set()

    def test_a_receiver_dying_with_releases_pending_lets_go_of_every_block(self):
        lib = self.lib
        sent = [ts.reduce_tensor(self.tensor()) for _ in range(8)]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the receiver: its device never finishes, and it dies meanwhile
            try:
                os.close(r)
                sys.modules["torch"].cuda.synchronize = lambda d=None: time.sleep(3600)
                got = [fn(*args) for fn, args in sent]
                del got
                os.write(w, b"%d" % ts._waits.pending())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            self.assertEqual(f.read(), b"8", "the receiver's releases pending when it died")
        os.waitpid(pid, 0)
        wait_for(lambda: lib.unexports == 8, "every block let go")

    def test_the_tensors_of_one_pickle_come_in_one_round_trip(self):
        import itertools
        import multiprocessing.reduction as mpr
        import pickle
        lib = self.lib
        serials, mark = itertools.count(100), lib.cuvmm_export_mark

        def other_pages_each(*a):
            lib.pages = [next(serials) for _ in range(3)]
            return mark(*a)
        lib.cuvmm_export_mark = other_pages_each
        mp = types.ModuleType("torch.multiprocessing")
        mp.reductions = types.SimpleNamespace(reduce_tensor=lambda t: None)
        sys.modules["torch.multiprocessing"] = mp
        exchanges, exchange = [], _share._exchange
        _share._exchange = lambda *a, **k: exchanges.append(1) or exchange(*a, **k)
        ts.share_tensors(True)
        try:
            first = mpr.ForkingPickler.dumps([self.tensor() for _ in range(8)])
            second = mpr.ForkingPickler.dumps([self.tensor() for _ in range(4)])
            self.assertIsNone(getattr(ts._pickling, "group", None), "no group outside a pickle")
            got = pickle.loads(first)
            self.assertEqual(len(exchanges), 1, "one round trip for a pickle's eight tensors")
            self.assertEqual((lib.fds_made, lib.imports), (24, 8))
            self.assertEqual(ts._handoff.pending(), 4, "another pickle's offers are not taken along")
            more = pickle.loads(second)
            self.assertEqual(len(exchanges), 2)
            self.assertEqual([t.storage.data_ptr() > 0 for t in got + more], [True] * 12)
        finally:
            ts.share_tensors(False)
            _share._exchange = exchange
            del sys.modules["torch.multiprocessing"]
        self.assertIs(mpr.ForkingPickler.dump, ts._plain_dump, "PyTorch's pickling put back")
        del got, more
        wait_for(lambda: lib.unexports == 12, "every block let go")
        ts.release_kept_mappings()

    def test_importing_makes_room_for_a_hand_offs_descriptors(self):
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        want = min(_share.FD_SLOTS, soft) if soft != resource.RLIM_INFINITY else _share.FD_SLOTS
        wait_for(lambda: _share.fd_slots() >= want, f"a descriptor table of {want} slots")

    def test_a_refused_descriptor_leaves_nothing_held(self):
        fn, (desc, address, token, pages) = ts.reduce_tensor(self.tensor())
        bad = list(desc)
        bad[_share._FIELDS.index("dtype")] = "no_such_dtype"
        with self.assertRaises(ValueError):
            fn(tuple(bad), address, token, pages)
        wait_for(lambda: self.lib.unexports == 1, "the block let go")
        self.assertEqual((self.lib.fds_made, self.lib.imports), (0, 0))
        self.assertEqual(ts._handoff.pending(), 0, "the offer fetched")

    def tearDown(self):
        gc.collect()
        wait_for(lambda: ts.pending_shares() == 0, "nothing pending")


if __name__ == "__main__":
    unittest.main()
