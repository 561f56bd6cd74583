"""``torch.multiprocessing`` on cuvmm memory: CUDA tensors whose storage cuvmm allocated travel
as exported pages (POSIX descriptors) instead of legacy CUDA IPC; see :func:`share_tensors`."""

from __future__ import annotations

import ctypes
import itertools
import multiprocessing.reduction as _mpr
import os
import threading

import torch as _torch

import cuvmm as _core
from cuvmm import _share
from cuvmm._device_waits import DeviceWaits
from cuvmm._share_keep import DEFAULT_SHARE, Kept, budget_from_env


def _default_keep() -> int:
    """Idle kept mappings' bound where ``CUVMM_SHARE_KEEP`` is unset: a quarter of the current
    device's memory. Idle kept pages cost memory only once their sender has given them back to
    the driver (an ``empty_cache``, a sleep, its exit before the next hand-off): while it caches
    them, as it does between the steps of a weight sync, they are its memory anyway."""
    return _torch.cuda.get_device_properties(_torch.cuda.current_device()).total_memory // DEFAULT_SHARE


def _sharing():
    """A process's own sharing state: its offers, its releases waiting for the device, its kept
    mappings (none of any yet)."""
    return (_share.Handoff(),
            DeviceWaits(lambda device: _torch.cuda.synchronize(device), after=_share.flush_releases),
            Kept(budget_from_env(os.environ.get("CUVMM_SHARE_KEEP")), _default_keep))


_handoff, _waits, _kept = _sharing()
# Room in the descriptor table for a hand-off's page descriptors, made now and on a thread of its
# own: growing it later would wait for the kernel on the hand-off's path (see make_fd_slots).
threading.Thread(target=_share.make_fd_slots, name="cuvmm-fd-slots", daemon=True).start()


def _after_fork_in_child():
    # The parent's exports are the parent's to release and its offers the parent's to hand out;
    # the child starts with none (and without the parent's threads), and opens connections of its
    # own.
    # The parent's kept mappings are the parent's (a child cannot use CUDA after a fork anyway).
    # Releases pending in the parent are the parent's to tell.
    global _handoff, _kept, _waits
    _handoff.close()
    _handoff, _waits, _kept = _sharing()
    _share.forget_connections()


os.register_at_fork(after_in_child=_after_fork_in_child)
# torch.multiprocessing's reductions, imported (which registers them) by share_tensors before ours.
_torch_reductions = None
_installed = False
_lock = threading.Lock()
_fd_limit_raised = False
# The pickle this thread is writing, if any (see _grouped): its tensors are offered as one group.
_pickling = threading.local()
_pickles = itertools.count()
_plain_dump = _mpr.ForkingPickler.dump


def _grouped(self, obj):
    """``ForkingPickler.dump`` (which ``dumps``, queues, pipes and ``Process`` arguments all go
    through), naming the pickle so that the offers of its tensors make one group: the receiver
    takes all of them in one round trip to this process instead of one each."""
    outer = getattr(_pickling, "group", None)
    if outer is None:
        _pickling.group = next(_pickles)
    try:
        return _plain_dump(self, obj)
    finally:
        if outer is None:
            _pickling.group = None


def _owner(device: int, ptr: int):
    """(block, length) of the live cuvmm block holding ``ptr``, or None."""
    lib = _core.load()
    if not hasattr(lib, "cuvmm_owner"):
        return None
    block, n = ctypes.c_uint64(), ctypes.c_uint64()
    rc = lib.cuvmm_owner(device, ptr, ctypes.byref(block), ctypes.byref(n))
    _core._check(rc, "cuvmm_owner", ok=lambda rc: rc >= 0)
    return (block.value, n.value) if rc == 1 else None


# The driver's smallest physical allocation granularity: no page under a block is smaller.
_MIN_PAGE = 2 << 20


def _mark(device: int, ptr: int, block_len: int):
    """(cuvmm_export_t, page serials) of the block holding ``ptr`` (``block_len`` bytes long),
    marked shared (one ``cuvmm_unexport`` each): no descriptor yet, a receiver that maps those
    pages needs none. The serials are the bytes of ``count`` native 64-bit integers: they travel
    in every pickle of a hand-off and key the receiver's kept mappings as they are."""
    lib = _core.load()
    out = _core.Export()
    # Room for every page under the block from the start: a call with too little room marks the
    # block and lets it go again, which a hand-off of a large block would pay each time.
    # A block spans at most one page more than its length fills.
    cap = block_len // _MIN_PAGE + 2
    while True:
        pages = (ctypes.c_uint64 * cap)()
        rc = lib.cuvmm_export_mark(device, ptr, ctypes.byref(out), pages, cap)
        n = _core._check(rc, "cuvmm_export_mark", ok=lambda rc: rc >= 0)
        if n <= cap:
            return out, ctypes.string_at(pages, 8 * n)
        cap = n


def _page_fds(device: int, block: int, count: int) -> list:
    """New descriptors of the pages of the marked block at ``block``: asked for (on the hand-off's
    thread) by a receiver that does not map them yet."""
    fds = (ctypes.c_int * count)()
    rc = _core.load().cuvmm_export_fds(device, block, fds, count)
    n = _core._check(rc, "cuvmm_export_fds", ok=lambda rc: rc >= 0)
    if n > count:
        for fd in fds[:n]:
            os.close(fd)
        raise RuntimeError(f"cuvmm_export_fds: {n} pages where the mark counted {count}")
    return fds[:n]


def _raise_fd_limit():
    global _fd_limit_raised
    if not _fd_limit_raised:
        _share.raise_fd_limit()
        _fd_limit_raised = True


def reduce_tensor(t):
    """Our reduction for ``torch.Tensor`` and ``torch.nn.Parameter``: cuvmm's path for a CUDA
    tensor on cuvmm memory, PyTorch's own for everything else."""
    if (t.device.type != "cuda" or type(t) not in (_torch.Tensor, _torch.nn.Parameter)
            or t.layout != _torch.strided or t.is_nested):
        return _torch_reductions.reduce_tensor(t)
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    device = t.device.index
    owner = _owner(device, ptr) if ptr else None
    if owner is None:
        return _torch_reductions.reduce_tensor(t)
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError("Cowardly refusing to send a non-leaf tensor that requires grad across "
                           "processes (detach it first, as PyTorch asks)")
    _raise_fd_limit()
    layout, pages = _mark(device, ptr, owner[1])
    block, count = layout.block, layout.count
    try:
        desc = _share.encode(
            device=device, block=block, block_len=layout.len, first_page=layout.first_page,
            page=layout.page, count=count, ptr=ptr, nbytes=nbytes,
            dtype=str(t.dtype).removeprefix("torch."), size=tuple(t.shape), stride=tuple(t.stride()),
            storage_offset=t.storage_offset(), requires_grad=t.requires_grad,
            parameter=isinstance(t, _torch.nn.Parameter))
    except BaseException:
        _core.load().cuvmm_unexport(device, block)
        raise

    def release():
        # The importer has unmapped (or died): the block may be freed and its addresses reused.
        _core.load().cuvmm_unexport(device, block)
        held.clear()

    # The storage stays allocated here until the receiver lets go of it.
    held = [storage]
    # Offered in every case (a queue message or a Process argument): nothing but the token travels
    # in the pickle. (The spawning Popen's own descriptor passing would leave the parent a copy for
    # the Process object's lifetime, and the block with it.) The pages' descriptors are made only
    # for a receiver that asks for them: the block's mark keeps them, whatever this process frees
    # meanwhile, until that receiver lets go.
    address, token = _handoff.offer(release, lambda: _page_fds(device, block, count),
                                    getattr(_pickling, "group", None))
    return (_rebuild, (desc, address, token, pages))


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


class _Mapped:
    """Exported pages mapped in this process, seen by PyTorch through ``__cuda_array_interface__``
    as the bytes of one storage; unmapped (and the sender told) when PyTorch lets go of it."""

    def __init__(self, f, fds, claim):
        self._handle = None
        self._claim = claim
        lib = _core.load()
        try:
            arr = (ctypes.c_int * len(fds))(*fds)
            peers = _peers(f["device"])
            parr = (ctypes.c_int * max(1, len(peers)))(*peers)
            base = ctypes.c_uint64()
            handle = lib.cuvmm_import(f["device"], arr, len(fds), f["page"], parr, len(peers), ctypes.byref(base))
            if not handle:
                raise RuntimeError(f"cuvmm_import failed: {_core.last_error() or 'no error text'}")
        finally:
            for fd in fds:
                os.close(fd)
        self._handle = handle
        self.base = base.value
        self.ptr = base.value + f["offset"]
        self.__cuda_array_interface__ = {
            "shape": (f["nbytes"],), "typestr": "|u1", "data": (self.ptr, False), "version": 2,
        }

    def release(self):
        h, self._handle = self._handle, None
        if h:
            _core.load().cuvmm_import_release(h)
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def __del__(self):
        try:
            self.release()
        except Exception:  # at interpreter exit the library may be gone; the process ends anyway
            pass


class _Lease:
    """One storage over a kept mapping, seen by PyTorch through ``__cuda_array_interface__``:
    when PyTorch lets go of it, the device's work on it is waited for, the sender told (its
    claim released) and the mapping kept for the next hand-off of the same pages."""

    def __init__(self, key, mapping, f, claim):
        self._key, self._claim, self._device = key, claim, f["device"]
        self.ptr = mapping.base + f["offset"]
        self.__cuda_array_interface__ = {
            "shape": (f["nbytes"],), "typestr": "|u1", "data": (self.ptr, False), "version": 2,
        }

    def release(self):
        claim, self._claim = self._claim, None
        if claim is None:
            return
        key = self._key

        def tell():
            try:
                claim.release_later()  # sent with the batch's others once it is done
            finally:
                _kept.put_back(key)

        # As an unmap would, the device's work on it is waited for first (the sender may reuse the
        # block once told): one wait for the storages dropped together.
        _waits.add(self._device, tell)

    def __del__(self):
        try:
            self.release()
        except Exception:  # at interpreter exit the library may be gone; the process ends anyway
            pass


def _map_new(f, fds, claim, key):
    """What PyTorch's storage wraps for the pages ``fds`` (closed here) held by ``claim``: a
    mapping of their own when ``key`` is None, else a lease on the mapping made now and kept under
    ``key``."""
    if key is None:
        return _Mapped(f, fds, claim)
    mapping = _Mapped(f, fds, None)
    if not _kept.add(key, mapping, f["page"] * f["count"]):
        mapping._claim = claim  # another thread kept the same pages first: this one is not kept
        return mapping
    return _Lease(key, mapping, f, claim)


def _let_go(address, token):
    """Tells the sender this process will not use a hand-off: it may free the block. Failures are
    the caller's error's business, not this one's."""
    try:
        _share.let_go(address, token)
    except Exception:
        pass


def _rebuild(desc, address, token, pages=None):
    try:
        f = _share.decode(desc)
        dtype = getattr(_torch, f["dtype"], None)
        if not isinstance(dtype, _torch.dtype):
            raise ValueError(f"descriptor field dtype: {f['dtype']!r} is not a torch dtype")
        if _share.extent(f["size"], f["stride"], f["storage_offset"]) * dtype.itemsize > f["nbytes"]:
            raise ValueError("the tensor reaches past its storage")
        key = mapping = None
        if f["nbytes"]:
            _kept.trim()
            # The devices granted access are part of what a kept mapping is (asked only when kept).
            peers = _peers(f["device"]) if pages and _kept.budget > 0 else []
            key = _kept.key(address, f["device"], f["page"], f["count"], pages, peers)
            # In use from now on: no trim releases it under the fetch.
            mapping = _kept.take(key) if key is not None else None
    except BaseException:
        # Whatever went wrong, the hand-off is fetched and let go: the sender frees the block.
        _let_go(address, token)
        raise
    try:
        # Releasing the claim is what lets the sender free the block. The same pages mapped here
        # already: their descriptors are neither asked for nor made, and the sender's answer not
        # awaited.
        fds = []
        if f["nbytes"] == 0:
            _share.let_go(address, token)
            claim = None
        elif mapping is not None:
            claim = _share.hold(address, token)
        else:
            _raise_fd_limit()
            fds, claim = _share.fetch(address, token)
    except BaseException:
        if mapping is not None:
            _kept.put_back(key)
        raise
    device = _torch.device("cuda", f["device"])
    if f["nbytes"] == 0:
        storage = _torch.UntypedStorage(0, device=device)
    else:
        try:
            m = _Lease(key, mapping, f, claim) if mapping is not None else _map_new(f, fds, claim, key)
        except BaseException:
            if mapping is not None:
                _kept.put_back(key)
            claim.release()
            raise
        with _torch.cuda.device(device):
            storage = _torch.as_tensor(m, device=device).untyped_storage()
        del m  # PyTorch holds it now: the storage's last reference releases the mapping
    t = _torch.empty((0,), dtype=dtype, device=device)
    t.set_(storage, f["storage_offset"], f["size"], f["stride"])
    if f["parameter"]:
        return _torch.nn.Parameter(t, requires_grad=f["requires_grad"])
    return t.requires_grad_(f["requires_grad"])


def share_tensors(enable: bool = True) -> None:
    """Send CUDA tensors on cuvmm memory through ``torch.multiprocessing`` (``Queue.put``, ``Pipe``,
    ``Process`` arguments) as cuvmm exports. ``import cuvmm.torch`` calls it; ``enable=False`` puts
    PyTorch's own reductions back.

    The receiver gets a tensor over the same device memory (zero copy) with the same dtype, size,
    strides and storage offset (``requires_grad`` and ``nn.Parameter`` kept). The sender keeps the
    block allocated until every receiver has let go of it (its last tensor over it collected, or
    its process gone), even when the sender frees the storage's memory meanwhile
    (``storage.resize_(0)``): ``cuvmm.stats()["exported"]`` counts those bytes, and
    ``["freed_shared"]`` those already freed. A receiver keeps its mappings between hand-offs of
    the same pages (see ``cuvmm._share_keep``), up to ``CUVMM_SHARE_KEEP`` bytes idle (a quarter
    of the device's memory when unset; 0: none), and the same pages sent again cost no
    descriptor, no import and no mapping. No
    ``pidfd_getfd``, no ``CAP_SYS_PTRACE``: descriptors travel over Unix sockets. Tensors
    PyTorch's own allocator made keep PyTorch's path."""
    global _installed, _torch_reductions
    with _lock:
        from torch.multiprocessing import reductions

        _torch_reductions = reductions
        reducer = reduce_tensor if enable else _torch_reductions.reduce_tensor
        for cls in (_torch.Tensor, _torch.nn.Parameter):
            _mpr.ForkingPickler.register(cls, reducer)
        _mpr.ForkingPickler.dump = _grouped if enable else _plain_dump
        _installed = enable


def release_kept_mappings() -> int:
    """Unmaps, in this receiving process, every kept mapping no tensor uses now; returns its bytes.
    An idle kept mapping holds its sender's pages even after the sender gave them back to the
    driver (``empty_cache``, a sleep): call this where a sender needs that memory back at once,
    or set ``CUVMM_SHARE_KEEP=0`` to keep none."""
    return _kept.release_idle()


def pending_shares() -> int:
    """Exports of this process whose receivers have not let go yet."""
    return _handoff.pending() + _handoff.held()


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
