#!/usr/bin/env python3
"""cuvmm.torch's reduction and rebuild of a CUDA tensor, without a GPU or PyTorch: a stand-in
``torch`` and a stand-in library (the hand-off's C functions, recorded), the sender and the
receiver in this one process. The protocol itself (connections, fetches, releases, revocations)
is the library's and is tested there (src/ipc/handoff/tests.rs); this tests what Python does
around it: what travels beside the ticket, the tensor rebuilt from it, the release after the
current stream's work, and that nothing offered is left behind when something fails.

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
        current_stream=lambda d=None: types.SimpleNamespace(cuda_stream=0x5757),
        can_device_access_peer=lambda a, b: True, device=lambda d: contextlib.nullcontext(),
        get_device_properties=lambda d: types.SimpleNamespace(total_memory=80 << 30))
    torch.UntypedStorage = lambda n, device=None: Storage(0, n)
    torch.as_tensor = lambda m, device=None: types.SimpleNamespace(
        untyped_storage=lambda: Storage(m.__cuda_array_interface__["data"][0],
                                        m.__cuda_array_interface__["shape"][0], m))
    torch.empty = lambda shape, dtype=None, device=None: Tensor(None, dtype, shape, (1,), 0, device.index)
    return torch


class FakeLib:
    """The hand-off's C functions the reduction and the rebuild call, recorded."""

    def __init__(self):
        self.offered, self.groups, self.taken = [], [], []
        self.released, self.let_go, self.withdrawn = [], [], []
        self.error = None
        self.prepared = 0

    def cuvmm_owner(self, device, ptr, block, n):
        return 1 if BLOCK <= ptr < BLOCK + LEN else 0

    def cuvmm_offer(self, device, ptr, group, buf, cap, block):
        ticket = b"ticket-%d" % len(self.offered)
        if len(ticket) > cap:
            return len(ticket)
        buf[:len(ticket)] = ticket
        block._obj.value = BLOCK
        self.offered.append(ticket)
        self.groups.append(group)
        return len(ticket)

    def cuvmm_withdraw(self, ticket, n):
        self.withdrawn.append(ticket)
        return 1

    def cuvmm_ticket_len(self, ticket, n, out):
        out._obj.value = LEN
        return 0

    def cuvmm_take(self, ticket, n, peers, npeers, timeout, device, block):
        if self.error is not None:
            return None
        self.taken.append(ticket)
        device._obj.value, block._obj.value = 0, MAPPED
        return len(self.taken)

    def cuvmm_lease_release(self, lease, streams, n):
        self.released.append((lease, streams[0] if n else None))
        return 0

    def cuvmm_let_go(self, ticket, n, timeout):
        self.let_go.append(ticket)
        return 0

    def cuvmm_handoff_prepare(self):
        self.prepared += 1
        return 0

    def cuvmm_handoff_stats(self, out):
        out._obj.offered = len(self.offered) - len(self.taken) - len(self.withdrawn) - len(self.let_go)
        out._obj.held = len(self.taken) - len(self.released)
        return 0

    def cuvmm_last_error(self):
        return self.error


LEN = 3 * PAGE
MAPPED = 1 << 40

sys.modules["torch"] = fake_torch()
import cuvmm  # noqa: E402
from cuvmm import _share, _torch_share as ts  # noqa: E402


def pickling(enable):
    """torch.multiprocessing's reductions stood in, and cuvmm's installed (or taken out)."""
    mp = types.ModuleType("torch.multiprocessing")
    mp.reductions = types.SimpleNamespace(reduce_tensor=lambda t: (list, ()))
    sys.modules["torch.multiprocessing"] = mp
    ts.share_tensors(enable)


class HandOff(unittest.TestCase):
    def setUp(self):
        self.lib = cuvmm._lib = FakeLib()

    def tensor(self, requires_grad=True):
        t = Tensor(Storage(BLOCK + 4096, 2 * PAGE), Dtype("float32", 4), (4, 8), (1, 4), 3)
        t.requires_grad = requires_grad
        return Parameter(t, requires_grad=requires_grad)

    def test_a_tensor_comes_back_over_the_block_and_is_released_after_the_current_stream(self):
        fn, args = ts.reduce_tensor(self.tensor())
        got = fn(*args)
        self.assertIsInstance(got, Parameter)
        self.assertEqual((got.shape, got.stride(), got.storage_offset(), got.requires_grad),
                         ((4, 8), (1, 4), 3, True))
        self.assertEqual(got.storage.data_ptr(), MAPPED + 4096, "the storage where it lies in the block")
        self.assertEqual(self.lib.taken, [b"ticket-0"])
        self.assertEqual(self.lib.released, [])
        del got
        gc.collect()
        self.assertEqual(self.lib.released, [(1, 0x5757)], "released after the device's current stream")

    def test_a_release_at_teardown_waits_for_the_device(self):
        cuda = sys.modules["torch"].cuda
        fn, args = ts.reduce_tensor(self.tensor())
        got = fn(*args)
        stream, cuda.current_stream = cuda.current_stream, None  # torn down
        try:
            del got
            gc.collect()
        finally:
            cuda.current_stream = stream
        self.assertEqual(self.lib.released, [(1, None)])

    def test_a_descriptor_decodes_to_its_fields_frozen(self):
        d = _share.decode(_share.encode(offset=512, nbytes=1024, dtype="float32", size=(2, 3), stride=(3, 1),
                                        storage_offset=4, requires_grad=True, parameter=False), 4096)
        self.assertEqual((d.offset, d.nbytes, d.dtype, d.size, d.stride, d.storage_offset, d.requires_grad),
                         (512, 1024, "float32", (2, 3), (3, 1), 4, True))
        with self.assertRaises(AttributeError):  # dataclasses.FrozenInstanceError
            d.nbytes = 1 << 20

    def test_a_refused_descriptor_lets_the_offer_go_and_takes_nothing(self):
        fn, (desc, ticket) = ts.reduce_tensor(self.tensor())
        for field, bad in (("dtype", "no_such_dtype"), ("nbytes", LEN + 1), ("size", (1 << 40, 8))):
            d = list(desc)
            d[_share._FIELDS.index(field)] = bad
            with self.assertRaises(ValueError):
                fn(tuple(d), ticket)
        self.assertEqual(self.lib.let_go, [ticket] * 3)
        self.assertEqual(self.lib.taken, [])

    def test_a_sender_that_does_not_answer_is_a_timeout_error(self):
        fn, args = ts.reduce_tensor(self.tensor())
        self.lib.error = b"cuvmm_take: timed out with 0 of 1 bytes of a message received"
        with self.assertRaises(TimeoutError):
            fn(*args)

    def test_a_non_leaf_that_requires_grad_is_refused_before_anything_is_offered(self):
        t = self.tensor()
        t.is_leaf = False
        with self.assertRaises(RuntimeError):
            ts.reduce_tensor(t)
        self.assertEqual(self.lib.offered, [])

    def test_a_tensor_on_other_memory_takes_pytorchs_path(self):
        pickling(True)
        try:
            t = self.tensor()
            t.storage = Storage(BLOCK + LEN, 64)
            self.assertEqual(ts.reduce_tensor(t), (list, ()))
            self.assertEqual(self.lib.offered, [])
        finally:
            ts.share_tensors(False)

    def test_the_tensors_of_one_pickle_are_one_group_and_a_failed_pickle_withdraws_its_offers(self):
        import multiprocessing.reduction as mpr
        pickling(True)
        try:
            self.assertEqual(self.lib.prepared, 1, "the hand-off's threads started with the reductions")
            mpr.ForkingPickler.dumps([self.tensor() for _ in range(3)])
            mpr.ForkingPickler.dumps([self.tensor() for _ in range(2)])
            g = self.lib.groups
            self.assertEqual(len(set(g[:3])), 1)
            self.assertEqual(len(set(g[3:])), 1)
            self.assertNotEqual(g[0], g[3])
            self.assertNotIn(0, g, "a pickle's offers are grouped")
            with self.assertRaises(Exception):
                mpr.ForkingPickler.dumps([self.tensor(), self.tensor(), lambda: None])
            self.assertEqual(self.lib.withdrawn, self.lib.offered[5:7], "the failed pickle's offers withdrawn")
            self.assertIsNone(getattr(ts._pickling, "group", None), "no group outside a pickle")
            self.assertEqual(ts.reduce_tensor(self.tensor())[0], ts._rebuild)
            self.assertEqual(self.lib.groups[-1], 0, "a tensor reduced outside a pickle has no group")
        finally:
            ts.share_tensors(False)
            del sys.modules["torch.multiprocessing"]
        self.assertIs(mpr.ForkingPickler.dump, ts._plain_dump, "PyTorch's pickling put back")


if __name__ == "__main__":
    unittest.main()
