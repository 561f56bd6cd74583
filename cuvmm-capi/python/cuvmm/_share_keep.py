"""Mappings a receiver keeps after its tensors over them are gone, so that the same pages sent
again (weight sync sends the same storages every step) are neither imported nor mapped again.

A mapping is kept under its sender's hand-off address (one per sending process, never given
again) and the serials of the pages it maps, in order (see ``cuvmm_export_pages``): a serial
names one physical allocation of the sender and never comes back, so the same key is the same
memory, whatever the sender freed and allocated meanwhile. A kept mapping holds nothing of the
sender's allocator (the sender frees and reuses the block as usual once the tensors are gone), but
pages the sender gave back to the driver stay allocated while a receiver keeps them mapped: idle
mappings are therefore bounded by ``CUVMM_SHARE_KEEP`` bytes (0: none kept; unset: a quarter of
the device's memory), the least recently used released first, and those of senders that exited
are released as soon as they exit (a thread watches each sender's process), or at the next
hand-off or release where that cannot be watched.
"""

from __future__ import annotations

import os
import re
import select
import threading
from collections import OrderedDict

from cuvmm import _parse_size
from cuvmm._share import FdWatch


#: The share of a device's memory idle kept mappings may hold when ``CUVMM_SHARE_KEEP`` is unset.
DEFAULT_SHARE = 4


def budget_from_env(value: str | None) -> int | None:
    """Bytes of ``CUVMM_SHARE_KEEP``, a size as ``CUVMM_ALLOC_CONF`` takes one (``16GiB``,
    ``16G``, ``4096``); None when unset (the default applies)."""
    if value is None or not value.strip():
        return None
    try:
        return _parse_size(value)
    except ValueError as e:
        raise ValueError(f"CUVMM_SHARE_KEEP={value!r}: {e}; expected bytes, e.g. 16GiB") from None


def sender_pid(address: bytes) -> int | None:
    """The process named in a hand-off address, when it names one."""
    m = re.match(rb"\0cuvmm-share-(\d+)-", address)
    return int(m.group(1)) if m else None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _Entry:
    __slots__ = ("mapping", "nbytes", "users", "pid")

    def __init__(self, mapping, nbytes, pid):
        self.mapping, self.nbytes, self.users, self.pid = mapping, nbytes, 0, pid


class Kept:
    """The kept mappings of this process. ``mapping`` objects only need ``release()``; they are
    released outside the lock (a release waits for the device).

    ``budget`` None: ``default()`` bytes, asked once, when first needed (a quarter of the device's
    memory: the device need not be looked at before a tensor arrives)."""

    def __init__(self, budget: int | None, default=lambda: 0, watch_exits: bool = True):
        self._budget, self._default = budget, default
        self._lock = threading.Lock()
        self._entries: OrderedDict = OrderedDict()
        self._idle = 0
        # Senders seen exit by their pidfd: gone, though os.kill finds them until reaped.
        self._exited: set = set()
        # Senders no pidfd watches, looked at (os.kill) at each eviction instead.
        self._unwatched: set = set()
        self._watch = _Exits(self._sender_exited) if watch_exits and hasattr(os, "pidfd_open") else None

    @property
    def budget(self) -> int:
        if self._budget is None:
            self._budget = int(self._default())
        return self._budget

    def key(self, address: bytes, device: int, page: int, count: int, pages, peers) -> tuple | None:
        """The key of a hand-off's ``count`` pages (their serials ``pages``, 8 bytes each, mapped
        with access for ``peers`` too), or None when nothing is kept: no budget, or a sender that
        did not name its pages. Serials that are not ``count`` of them are refused."""
        if self.budget <= 0 or not pages:
            return None
        if type(pages) is not bytes or len(pages) != 8 * count:
            raise ValueError(f"descriptor field pages: not {count} page serials")
        return (address, device, page, pages, tuple(peers))

    def take(self, key):
        """The kept mapping under ``key``, now in use once more, or None."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            if e.users == 0:
                self._idle -= e.nbytes
            e.users += 1
            self._entries.move_to_end(key)
            return e.mapping

    def add(self, key, mapping, nbytes: int) -> bool:
        """Keeps ``mapping`` (in use once) under ``key``; False when another one got there first
        (then the caller's is not kept)."""
        with self._lock:
            if key in self._entries:
                return False
            e = _Entry(mapping, nbytes, sender_pid(key[0]))
            e.users = 1
            self._entries[key] = e
            # A process that sends now is alive, whatever had that pid before.
            self._exited.discard(e.pid)
        if e.pid is not None and (self._watch is None or not self._watch.add(e.pid)):
            with self._lock:
                self._unwatched.add(e.pid)
        return True

    def put_back(self, key) -> None:
        """One use of the mapping under ``key`` is over; releases what is past the budget."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                e.users -= 1
                if e.users == 0:
                    self._idle += e.nbytes
            gone = self._evict()
        for mapping in gone:
            mapping.release()

    def trim(self) -> None:
        """Releases the idle mappings of senders that exited, and what is past the budget."""
        with self._lock:
            gone = self._evict()
        for mapping in gone:
            mapping.release()

    def _sender_exited(self, pid: int) -> None:
        with self._lock:
            self._exited.add(pid)
        self.trim()

    def release_idle(self) -> int:
        """Releases every idle mapping now (those in use stay); returns their bytes."""
        with self._lock:
            gone = [(k, e) for k, e in self._entries.items() if e.users == 0]
            for k, e in gone:
                del self._entries[k]
                self._idle -= e.nbytes
        for _, e in gone:
            e.mapping.release()
        return sum(e.nbytes for _, e in gone)

    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle

    def _evict(self) -> list:
        budget = self.budget
        if self._idle <= budget and not self._exited and not self._unwatched:
            return []  # (every hand-off and release comes here)
        gone = []
        # Each sender looked at once: every hand-off and release comes here, and a weight sync
        # keeps hundreds of mappings from one sender.
        alive: dict = {}
        for key in list(self._entries):
            e = self._entries[key]
            if e.users == 0 and e.pid not in alive:
                alive[e.pid] = e.pid not in self._exited and _alive(e.pid)
            if e.users == 0 and (self._idle > budget or not alive[e.pid]):
                del self._entries[key]
                self._idle -= e.nbytes
                gone.append(e.mapping)
        # Exits seen are forgotten once nothing of theirs is kept (a pid may come back).
        held = {e.pid for e in self._entries.values()}
        self._exited &= held
        self._unwatched &= held
        return gone


class _Exits(FdWatch):
    """Calls ``on_exit(pid)`` on a daemon thread of its own once a watched process has exited (its
    pidfd readable), so that a receiver that receives nothing more still lets go of the memory of
    a sender that is gone."""

    def __init__(self, on_exit):
        super().__init__("cuvmm-share-kept", "releasing the kept mappings of an exited sender")
        self._on_exit = on_exit
        self._pids: set[int] = set()

    def add(self, pid: int) -> bool:
        """Watches ``pid``; False where it cannot (then its exit is for the caller to find)."""
        with self._lock:
            if pid in self._pids:
                return True
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already (the caller's next look sees it), or not ours to watch
                return False

            def exited():
                with self._lock:
                    self._pids.discard(pid)
                os.close(fd)
                self._on_exit(pid)

            self._pids.add(pid)
            self._add(fd, select.POLLIN, exited)
        self._wake()
        return True

    def watched(self) -> int:
        with self._lock:
            return len(self._pids)
