"""Releases of received storages, each told to its sender only after the device has finished the
work queued on it, with one device wait for every release made meanwhile.

A receiver that drops the tensors of a hand-off lets go of dozens of storages at once. Each may
be told to its sender only once the work this process queued on them is done (the sender reuses
the block as soon as it is told), but a wait for the whole device that starts after a release
covers it: a thread of its own takes every release pending, waits once for each device they
name, then tells their senders. Dropping a storage costs its owner a list append and a wake."""

from __future__ import annotations

import threading


class DeviceWaits:
    """Pending releases, done in batches by a thread of their own started at the first one.
    ``synchronize(device)`` waits for all the work queued on ``device`` so far; ``after()``, when
    given, is called once a batch's releases are all told (to send what they left to send
    together)."""

    def __init__(self, synchronize, after=None):
        self._synchronize = synchronize
        self._after = after
        # Reentrant: a storage collected while this thread holds it releases through ``add``.
        self._cond = threading.Condition(threading.RLock())
        self._pending: list = []
        self._busy = 0  # taken from the list, not told yet
        self._thread = None

    def add(self, device: int, tell) -> None:
        """``tell()`` once ``device`` has finished the work queued on it before this call."""
        with self._cond:
            self._pending.append((device, tell))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cuvmm-release", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> int:
        """Releases not told to their senders yet."""
        with self._cond:
            return len(self._pending) + self._busy

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                batch, self._pending = self._pending, []
                self._busy += len(batch)
            try:
                self._flush(batch)
            finally:
                with self._cond:
                    self._busy -= len(batch)
                    self._cond.notify_all()

    def _flush(self, batch) -> None:
        # Each wait starts after every release of the batch was added: it covers their work.
        for device in dict.fromkeys(d for d, _ in batch):
            try:
                self._synchronize(device)
            except Exception:  # a device in error runs none of this work any more
                pass
        for _, tell in batch:
            try:
                tell()
            except Exception:  # one release failing must not keep the others from their senders
                pass
        if self._after is not None:
            try:
                self._after()
            except Exception:  # the next batch tries again
                pass
