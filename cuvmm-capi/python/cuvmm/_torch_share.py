"""``torch.multiprocessing`` on cuvmm memory: CUDA tensors whose storage cuvmm allocated travel
as the library's hand-off tickets instead of legacy CUDA IPC; see :func:`share_tensors`."""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import multiprocessing.reduction as _mpr
import threading

import torch as _torch

import cuvmm as _core
from cuvmm import _share

#: Seconds a receiver waits for the sending process by default.
FETCH_TIMEOUT = 60.0

# torch.multiprocessing's reductions, imported (which registers them) by share_tensors before ours.
_torch_reductions = None
_installed = False
# Whether share_tensors was called, either way: share_by_default then leaves its choice alone.
_chosen = False
_lock = threading.Lock()
# The pickle this thread is writing, if any (see _grouped): its tensors are offered as one group,
# and withdrawn if the pickle fails.
_pickling = threading.local()
_pickles = itertools.count(1)
_plain_dump = _mpr.ForkingPickler.dump


def _grouped(self, obj):
    """``ForkingPickler.dump`` (which ``dumps``, queues, pipes and ``Process`` arguments all go
    through), naming the pickle so that the offers of its tensors make one group: the receiver
    takes all of them in one round trip to this process instead of one each. A pickle that fails
    withdraws the offers it made: their tickets never leave this process."""
    if getattr(_pickling, "group", None) is not None:
        return _plain_dump(self, obj)
    _pickling.group, _pickling.tickets = next(_pickles), []
    try:
        return _plain_dump(self, obj)
    except BaseException:
        for t in _pickling.tickets:
            _withdraw(t)
        raise
    finally:
        _pickling.group = _pickling.tickets = None


def _owns(device: int, ptr: int) -> bool:
    """Whether ``ptr`` lies in a live block cuvmm handed out on ``device``."""
    lib = _core.load()
    if not hasattr(lib, "cuvmm_offer"):
        return False
    rc = lib.cuvmm_owner(device, ptr, None, None)
    return _core._check(rc, "cuvmm_owner", ok=lambda rc: rc >= 0) == 1


def _offer(device: int, ptr: int, group: int) -> tuple[bytes, int]:
    """(ticket, block address) of an offer of the block holding ``ptr``."""
    lib, block = _core.load(), ctypes.c_uint64()
    cap = 4096
    while True:
        buf = ctypes.create_string_buffer(cap)
        rc = lib.cuvmm_offer(device, ptr, group, buf, cap, ctypes.byref(block))
        n = _core._check(rc, "cuvmm_offer", ok=lambda rc: rc >= 0)
        if n <= cap:
            return buf.raw[:n], block.value
        cap = n


def _withdraw(ticket: bytes) -> None:
    try:
        _core.load().cuvmm_withdraw(ticket, len(ticket))
    except Exception:  # it was taken meanwhile, or the library is gone at exit: nothing to undo
        pass


def _let_go(ticket: bytes) -> None:
    """Tells the sender this process will not use a ticket: it frees the block. Failures are the
    caller's error's business, not this one's."""
    try:
        _core.load().cuvmm_let_go(ticket, len(ticket), FETCH_TIMEOUT)
    except Exception:
        pass


def reduce_tensor(t):
    """Our reduction for ``torch.Tensor`` and ``torch.nn.Parameter``: cuvmm's path for a CUDA
    tensor on cuvmm memory, PyTorch's own for everything else."""
    if (t.device.type != "cuda" or type(t) not in (_torch.Tensor, _torch.nn.Parameter)
            or t.layout != _torch.strided or t.is_nested):
        return _torch_reductions.reduce_tensor(t)
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    device = t.device.index
    if not ptr or not _owns(device, ptr):
        return _torch_reductions.reduce_tensor(t)
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError("Cowardly refusing to send a non-leaf tensor that requires grad across "
                           "processes (detach it first, as PyTorch asks)")
    ticket, block = _offer(device, ptr, getattr(_pickling, "group", None) or 0)
    try:
        desc = _share.encode(
            offset=ptr - block, nbytes=nbytes, dtype=str(t.dtype).removeprefix("torch."), size=tuple(t.shape),
            stride=tuple(t.stride()), storage_offset=t.storage_offset(), requires_grad=t.requires_grad,
            parameter=isinstance(t, _torch.nn.Parameter))
    except BaseException:
        _withdraw(ticket)
        raise
    tickets = getattr(_pickling, "tickets", None)
    if tickets is not None:
        tickets.append(ticket)
    return (_rebuild, (desc, ticket))


def _peers(device: int) -> list[int]:
    """Devices besides ``device`` that this process already uses (a CUDA context exists) and that
    can reach ``device``'s memory: they get access to an import too. Granting one that has no
    context would create one (hundreds of MiB of device memory) in a process that never uses it."""
    has_context = getattr(_torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:
        return []
    return [d for d in range(_torch.cuda.device_count())
            if d != device and has_context(d) and _can_access(d, device)]


_access: dict[tuple[int, int], bool] = {}


def _can_access(d: int, device: int) -> bool:
    """Whether ``d`` can reach ``device``'s memory: a property of the machine, asked once (every
    hand-off asks, and PyTorch's answer costs a driver call)."""
    got = _access.get((d, device))
    if got is None:
        got = _access[(d, device)] = bool(_torch.cuda.can_device_access_peer(d, device))
    return got


class _Lease:
    """A block taken from another process, seen by PyTorch through ``__cuda_array_interface__`` as
    the bytes of one storage. When PyTorch lets go of it, the library is told to release it after
    the work queued on the device's current stream (as PyTorch's own CUDA IPC waits for that
    stream before it lets go): it returns at once, and its own thread waits and tells the sender."""

    def __init__(self, lease: int, device: int, ptr: int, nbytes: int):
        self._lease, self._device = lease, device
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}

    def release(self):
        lease, self._lease = self._lease, None
        if not lease:
            return
        lib = _core.load()
        try:
            streams = (ctypes.c_void_p * 1)(_torch.cuda.current_stream(self._device).cuda_stream)
            n = 1
        except Exception:  # PyTorch torn down at exit: wait for the whole device instead
            streams, n = None, 0
        lib.cuvmm_lease_release(lease, streams, n)

    def __del__(self):
        try:
            self.release()
        except Exception:  # at interpreter exit the library may be gone; the process ends anyway
            pass


def _take(ticket: bytes, device_hint: int) -> tuple[int, int, int]:
    """(lease, device, block address here) of a ticket's offer."""
    lib = _core.load()
    peers = _peers(device_hint)
    parr = (ctypes.c_int * max(1, len(peers)))(*peers)
    device, block = ctypes.c_int(), ctypes.c_uint64()
    lease = lib.cuvmm_take(ticket, len(ticket), parr, len(peers), FETCH_TIMEOUT, ctypes.byref(device),
                           ctypes.byref(block))
    if not lease:
        raise _core.error_from("cuvmm_take")
    return lease, device.value, block.value


def _rebuild(desc, ticket):
    try:
        n = ctypes.c_uint64()
        _core._check(_core.load().cuvmm_ticket_len(ticket, len(ticket), ctypes.byref(n)), "cuvmm_ticket_len")
        f = _share.decode(desc, n.value)
        dtype = getattr(_torch, f.dtype, None)
        if not isinstance(dtype, _torch.dtype):
            raise ValueError(f"descriptor field dtype: {f.dtype!r} is not a torch dtype")
        if _share.extent(f.size, f.stride, f.storage_offset) * dtype.itemsize > f.nbytes:
            raise ValueError("the tensor reaches past its storage")
    except BaseException:
        # Whatever went wrong, the offer is let go: the sender frees the block.
        _let_go(ticket)
        raise
    lease, index, block = _take(ticket, _torch.cuda.current_device())
    device = _torch.device("cuda", index)
    try:
        m = _Lease(lease, index, block + f.offset, f.nbytes)
    except BaseException:
        _core.load().cuvmm_lease_release(lease, None, 0)
        raise
    with _torch.cuda.device(device):
        storage = _torch.as_tensor(m, device=device).untyped_storage()
    del m  # PyTorch holds it now: the storage's last reference releases the lease
    t = _torch.empty((0,), dtype=dtype, device=device)
    t.set_(storage, f.storage_offset, f.size, f.stride)
    if f.parameter:
        return _torch.nn.Parameter(t, requires_grad=f.requires_grad)
    return t.requires_grad_(f.requires_grad)


def share_tensors(enable: bool = True) -> None:
    """Send CUDA tensors on cuvmm memory through ``torch.multiprocessing`` (``Queue.put``, ``Pipe``,
    ``Process`` arguments) as cuvmm exports. The first :func:`cuvmm.torch.allocator` (and so
    ``use_as_current_allocator`` and ``mem_pool``) calls it unless it was called before;
    ``enable=False`` puts PyTorch's own reductions back, and keeps them there.

    The receiver gets a tensor over the same device memory (zero copy) with the same dtype, size,
    strides and storage offset (``requires_grad`` and ``nn.Parameter`` kept). The sender keeps the
    block allocated until every receiver has let go of it (its last tensor over it collected, or
    its process gone), even when the sender frees the storage's memory meanwhile
    (``storage.resize_(0)``): ``cuvmm.stats()["exported"]`` counts those bytes, and
    ``["freed_shared"]`` those already freed. A receiver keeps its mappings between hand-offs of
    the same pages while their sender keeps them (they are unmapped as soon as the sender gives
    the pages back to the device: an ``empty_cache``, a sleep), and the same pages sent again cost
    no descriptor, no import and no mapping. No
    ``pidfd_getfd``, no ``CAP_SYS_PTRACE``: descriptors travel over Unix sockets. Tensors
    PyTorch's own allocator made keep PyTorch's path."""
    global _installed, _torch_reductions, _chosen
    with _lock:
        from torch.multiprocessing import reductions

        _chosen = True
        _torch_reductions = reductions
        reducer = reduce_tensor if enable else _torch_reductions.reduce_tensor
        for cls in (_torch.Tensor, _torch.nn.Parameter):
            _mpr.ForkingPickler.register(cls, reducer)
        _mpr.ForkingPickler.dump = _grouped if enable else _plain_dump
        _installed = enable
        if enable and hasattr(_core.load(), "cuvmm_handoff_prepare"):
            # The hand-off's threads start now rather than on a first hand-off's path.
            _core.load().cuvmm_handoff_prepare()


def share_by_default() -> None:
    """:func:`share_tensors` where nobody has called it yet and PyTorch has its multiprocessing
    part: what putting cuvmm under PyTorch's memory does, since a tensor on cuvmm memory cannot
    travel through PyTorch's CUDA IPC."""
    if not _chosen and importlib.util.find_spec("torch.multiprocessing") is not None:
        share_tensors()


def release_kept_mappings() -> int:
    """Kept for code written for earlier versions: mappings a receiver keeps are unmapped as soon
    as their sender gives the pages back to the device, so there is nothing left to release here.
    Returns 0."""
    return 0


def pending_shares() -> int:
    """Offers of this process whose receivers have not let go yet (taken or not)."""
    st = _core.handoff_stats()
    return st["offered"] + st["held"]


class SharedEvent:
    """An interprocess CUDA event that orders a reader's stream after a writer's update.

    The writer updates shared tensors in place, then :meth:`publish` es (records the event on its
    stream) and tells the reader (a queue message); the reader :meth:`acquire` s (its stream waits
    for that record on the device) before reading. The event itself travels through
    ``torch.multiprocessing`` once::

        ev = cuvmm.torch.SharedEvent()          # writer
        q.put((params, ev))
        ...
        with torch.no_grad():
            p.add_(delta)
        ev.publish(); q.put("updated")

        params, ev = q.get()                     # reader
        ...
        q.get(); ev.acquire(); y = model(x)      # sees the update

    A wait covers the latest :meth:`publish` made before it (the reader's ``acquire`` must follow
    the writer's ``publish`` in time: hence the message)."""

    def __init__(self, device=None, event=None):
        if event is None:
            with _torch.cuda.device(device if device is not None else _torch.cuda.current_device()):
                event = _torch.cuda.Event(interprocess=True, blocking=False)
        self.event = event

    def publish(self, stream=None) -> None:
        self.event.record(stream if stream is not None else _torch.cuda.current_stream())

    def acquire(self, stream=None) -> None:
        (stream if stream is not None else _torch.cuda.current_stream()).wait_event(self.event)

    def __reduce__(self):
        return (SharedEvent, (None, self.event))
