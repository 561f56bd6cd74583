"""What a CUDA tensor on cuvmm memory becomes on its way to another process, without PyTorch.

:mod:`cuvmm.torch` sends a tensor whose storage cuvmm allocated as

* a descriptor (:func:`encode` / :func:`decode`): where the storage lies on the exported pages,
  and the tensor's dtype, size, strides and storage offset, every field checked on arrival;
* an offer of the sending process (:class:`Handoff`): a random token that travels in the pickle
  with the sender's address. The receiver takes it over one connection per sending process, kept
  for the next tensor and for every message about what it took: a receiver that does not map
  the block's pages yet fetches their descriptors (:func:`fetch`: one round trip, the
  descriptors up to ``MAX_FDS_PER_MESSAGE`` a message), and one that maps them already (the
  same serials from the same sender) claims the offer without waiting for an answer
  (:func:`hold`), and the sender makes no descriptor. Offers made together (one pickle: a
  *group*) travel together: a fetch of one takes every offer of its group not taken yet, with
  their descriptors, in the same answer, so a pickle of many tensors costs one round trip per
  sender, not one per tensor.

Both ends check the other with ``SO_PEERCRED`` before anything travels: the sender answers only
processes of its effective uid, and the receiver talks only to the process its address names (the
pid in it) running as the receiver's effective uid, since an abstract name outlives nobody's claim
to it: once the sender has gone, any local user may take it. A fetch waits at most its timeout
(``FETCH_TIMEOUT`` by default) and holds nothing across its round trip that a fetch from another
sender or a fork would wait on.

The sender holds what a connection took until the receiver releases it (:class:`Claim`, a message
on the same connection, many a message for storages dropped together) or the connection ends (the
receiving process closed it, or died), and only then lets its block go, so the block's addresses
are never handed out again while someone reads them. A receiver never closes a connection that
holds something, even one it no longer asks anything on.
"""

from __future__ import annotations

import fcntl
import os
import re
import resource
import secrets
import select
import socket
import struct
import sys
import threading
import time

VERSION = 3

# SCM_MAX_FD is 253 on Linux.
MAX_FDS_PER_MESSAGE = 250

_HEADER = struct.Struct("<II")  # index of the first descriptor in this message, how many

_FIELDS = ("version", "device", "block", "block_len", "first_page", "page", "count", "offset", "nbytes",
           "dtype", "size", "stride", "storage_offset", "requires_grad", "parameter")


def encode(*, device: int, block: int, block_len: int, first_page: int, page: int, count: int, ptr: int,
           nbytes: int, dtype: str, size, stride, storage_offset: int, requires_grad: bool,
           parameter: bool) -> tuple:
    """The descriptor of a tensor whose storage (``nbytes`` at ``ptr``) lies in the exported block
    ``[block, block + block_len)`` on ``count`` pages of ``page`` bytes from ``first_page``.

    >>> d = encode(device=0, block=1 << 21, block_len=4096, first_page=1 << 21, page=1 << 21, count=1,
    ...            ptr=(1 << 21) + 512, nbytes=1024, dtype="float32", size=(2, 3), stride=(3, 1),
    ...            storage_offset=4, requires_grad=False, parameter=False)
    >>> decode(d)["offset"]
    512
    """
    if not (block <= ptr and ptr + nbytes <= block + block_len):
        raise ValueError(f"the storage ({nbytes} bytes at {ptr:#x}) is not inside its block "
                         f"({block_len} bytes at {block:#x})")
    d = (VERSION, device, block, block_len, first_page, page, count, ptr - first_page, nbytes, dtype,
         tuple(int(s) for s in size), tuple(int(s) for s in stride), int(storage_offset),
         bool(requires_grad), bool(parameter))
    return d


def _int(name, v, lo=0):
    if type(v) is not int or v < lo:
        raise ValueError(f"descriptor field {name}: {v!r} is not an integer >= {lo}")
    return v


def decode(d) -> dict:
    """The fields of a descriptor, checked: a descriptor that does not describe a tensor lying
    inside the pages it names is refused (ValueError), whoever made it."""
    if not isinstance(d, tuple) or len(d) != len(_FIELDS):
        raise ValueError("not a cuvmm tensor descriptor")
    f = dict(zip(_FIELDS, d))
    if f["version"] != VERSION:
        raise ValueError(f"descriptor version {f['version']!r}, this cuvmm reads {VERSION}")
    for name in ("device", "block", "block_len", "first_page", "offset", "nbytes", "storage_offset"):
        _int(name, f[name])
    _int("page", f["page"], 1)
    _int("count", f["count"], 1)
    mapped = f["page"] * f["count"]
    if f["offset"] + f["nbytes"] > mapped:
        raise ValueError(f"the storage ({f['nbytes']} bytes at offset {f['offset']}) ends past the "
                         f"{mapped} bytes of its pages")
    block_offset = f["block"] - f["first_page"]
    if block_offset < 0 or block_offset >= f["page"] or block_offset + f["block_len"] > mapped:
        raise ValueError("the block does not lie on its pages")
    if not (block_offset <= f["offset"] and f["offset"] + f["nbytes"] <= block_offset + f["block_len"]):
        raise ValueError("the storage is not inside its block")
    if not isinstance(f["dtype"], str) or not f["dtype"].isidentifier():
        raise ValueError(f"descriptor field dtype: {f['dtype']!r}")
    for name in ("size", "stride"):
        if not isinstance(f[name], tuple) or not all(type(v) is int and v >= 0 for v in f[name]):
            raise ValueError(f"descriptor field {name}: {f[name]!r} is not a tuple of integers >= 0")
    if len(f["size"]) != len(f["stride"]):
        raise ValueError("size and stride differ in length")
    for name in ("requires_grad", "parameter"):
        if type(f[name]) is not bool:
            raise ValueError(f"descriptor field {name}: {f[name]!r}")
    return f


def extent(size, stride, storage_offset: int) -> int:
    """Elements of storage a view reaches: one past the furthest element, 0 for an empty view.

    >>> extent((2, 3), (3, 1), 4)
    10
    >>> extent((0, 3), (3, 1), 4)
    0
    """
    if any(s == 0 for s in size):
        return 0
    return storage_offset + 1 + sum((s - 1) * st for s, st in zip(size, stride))


def raise_fd_limit() -> int:
    """Raises this process's soft limit on open descriptors to the hard one, and returns it.

    A block's pages travel as one descriptor each, and the kernel refuses to have more descriptors
    in flight over Unix sockets than the sender's limit (often 1,024 by default)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


#: Descriptor slots :func:`make_fd_slots` makes room for: a hand-off of 16 GiB on 128 MiB pages
#: holds 128 descriptors on each side, and the sender keeps one a page besides.
FD_SLOTS = 4096


def fd_slots() -> int:
    """The size of this process's descriptor table (``FDSize`` in ``/proc/self/status``), 0 where
    it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def make_fd_slots(n: int = FD_SLOTS) -> int:
    """Grows this process's descriptor table to ``n`` slots (no more than the soft limit on open
    descriptors allows) in one step, ahead of the descriptors a hand-off makes or receives;
    returns the table's size.

    Linux grows the table of a process that has several threads (every process with a CUDA
    context) only after an RCU grace period, milliseconds each time it doubles. A first hand-off
    that exports or receives a hundred page descriptors in a fresh process grew it two or three
    times on its way: 23-31 ms of a receiver's `recvmsg` on an H200 host, where a process of one
    thread receives the same 128 descriptors in 0.03 ms. The table never shrinks: this is paid
    once, and off the hand-off's path when called early (:mod:`cuvmm.torch` does it at import,
    on a thread of its own)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        n = min(n, soft)
    if fd_slots() < n and n > 3:
        try:
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # The lowest free descriptor at or above n - 1: never one in use.
                os.close(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, n - 1))
            finally:
                os.close(fd)
        except OSError:
            pass  # a descriptor limit lowered meanwhile, say: the table grows as it would have
    return fd_slots()


def recv_pages(sock: socket.socket, count: int) -> list[int]:
    """The ``count`` descriptors :func:`send_page_fds` sent, in order (the caller closes them).
    Anything else on the socket (too few, too many, out of order, truncated) is a ValueError and
    leaves no descriptor open."""
    got: list[int] = []
    try:
        while len(got) < count:
            msg, fds, flags, _ = socket.recv_fds(sock, _HEADER.size + 1, MAX_FDS_PER_MESSAGE)
            got.extend(fds)
            if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                raise ValueError("a message of page descriptors was truncated")
            if not msg:
                raise ValueError(f"the sender hung up after {len(got)} of {count} page descriptors")
            if len(msg) != _HEADER.size:
                raise ValueError("not a message of page descriptors")
            first, n = _HEADER.unpack(msg)
            if first != len(got) - len(fds) or n != len(fds):
                raise ValueError("page descriptors out of order")
        if len(got) != count:
            raise ValueError(f"{len(got)} page descriptors where {count} were announced")
        return got
    except BaseException:
        _close_all(got)
        raise


class FdWatch:
    """Calls the callback given with each watched descriptor once it reports an event, on a
    daemon thread of its own (started with the first), then forgets the descriptor. A failure of
    one callback, or of one round of watching, is reported and the thread goes on: it alone
    watches the others."""

    def __init__(self, name: str, what: str):
        self._name, self._what = name, what
        self._lock = threading.Lock()
        self._waiting: dict[int, object] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._poll = select.poll()
        self._poll.register(self._wake_r, select.POLLIN)
        self._thread = None

    def _add(self, fd: int, events: int, on_event) -> None:
        """Watches ``fd`` for ``events`` (as ``poll`` takes them: hang-ups and errors always
        count); the caller holds ``self._lock``."""
        self._waiting[fd] = on_event
        self._poll.register(fd, events)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _wake(self) -> None:
        os.write(self._wake_w, b"x")

    def _run(self):
        while True:
            try:
                self._watch()
            except Exception as e:
                _report(f"{self._name}: watching", e)

    def _watch(self):
        while True:
            for fd, _ in poll_events(self._poll, self._wake_r):
                with self._lock:
                    on_event = self._waiting.pop(fd, None)
                    self._poll.unregister(fd)
                if on_event is not None:
                    try:
                        on_event()
                    except Exception as e:  # one callback must not stop the others
                        _report(self._what, e)


def poll_events(poll, wake_r: int):
    """The events of ``poll``, less those of the pipe ``wake_r`` that only wakes it (drained)."""
    for fd, ev in poll.poll():
        if fd == wake_r:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            continue
        yield fd, ev


def _report(what: str, e: BaseException) -> None:
    print(f"cuvmm: {what} failed: {type(e).__name__}: {e}", file=sys.stderr)


_TOKEN = 16
# A message to the sender: one of these, then the token (a release: any number of tokens).
_WANT_PAGES, _HOLD, _RELEASE = b"p", b"h", b"r"
# Tokens a release message carries at most (a message of 16 KiB).
_RELEASES_PER_MESSAGE = 1024
# Offers of a fetched one's group that come with it, at most, in one answer.
_GROUP_PER_ANSWER = 1024
# The sender's answer to a fetch: the first byte, then (offered) the page count as _COUNT, then
# for each other offer of its group that comes along, its token and page count; the descriptors
# follow, the fetched offer's first.
_OFFERED, _UNKNOWN, _FAILED = b"\x01", b"\x00", b"\x02"
_COUNT = struct.Struct("<I")
_UCRED = struct.Struct("3i")  # pid, uid, gid
_ADDRESS = re.compile(rb"\0cuvmm-share-([1-9][0-9]{0,9})-[0-9a-f]{16}\Z")

#: Seconds a :func:`fetch` waits for the sending process by default.
FETCH_TIMEOUT = 60.0


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, effective uid, effective gid) of the process at the other end of a connected Unix
    socket, as the kernel recorded them when it connected or listened (``SO_PEERCRED``)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


class _Offer:
    __slots__ = ("release", "pages", "group")

    def __init__(self, release, pages, group):
        self.release, self.pages, self.group = release, pages, group


class Handoff:
    """Offers of this process, each taken by one receiver with its token, and held for that
    receiver until it lets go.

    It listens on an abstract Unix socket of its own (a name in no filesystem, gone with the
    process) once something is offered; a thread per connected process answers. Only processes
    whose effective uid is this process's may connect, and only a receiver holding the token (16
    random bytes, in the pickle) takes the offer, once. What a connection took is held until its
    receiver releases it or the connection ends (the receiving process closed it, or died): then
    the offer's ``release()`` is called, once. An offer nobody takes stays until the process exits,
    as with ``multiprocessing``'s resource sharer."""

    def __init__(self):
        self._lock = threading.Lock()
        self._offers: dict[bytes, _Offer] = {}
        # Tokens of offers not taken yet, by group.
        self._groups: dict[object, set] = {}
        self._claimed = 0
        self._listener = None
        self._pid = os.getpid()
        self.address = None

    def offer(self, release, pages=None, group=None) -> tuple[bytes, bytes]:
        """Offers something a receiver takes with the returned (address, token); ``release()`` is
        called once that receiver lets go of it (on this object's threads).

        ``pages()``, when given, returns new descriptors (closed here once sent) for a receiver
        that asks for them (:func:`fetch`); one that maps them already (:func:`hold`) makes none.
        Should it fail, the receiver gets a refusal and the offer is released.

        ``group``, when given, names offers that travel to one receiver together (the tensors of
        one pickle): the first fetch of any of them takes all of them that are not taken yet."""
        token = secrets.token_bytes(_TOKEN)
        with self._lock:
            if self._listener is None:
                self._listen()
            self._offers[token] = _Offer(release, pages, group)
            if group is not None:
                self._groups.setdefault(group, set()).add(token)
        return self.address, token

    def pending(self) -> int:
        """Offers not taken yet."""
        with self._lock:
            return len(self._offers)

    def held(self) -> int:
        """Offers taken whose receivers have not let go yet."""
        with self._lock:
            return self._claimed

    def close(self) -> None:
        """Stops listening and forgets the offers not taken, releasing none (a forked child's
        copy: they are the parent's; tests)."""
        forked = os.getpid() != self._pid
        if forked:
            # A forked child: the parent's threads are not here, so a lock one of them held at
            # the fork would never be released. The child's copy is its own.
            self._lock = threading.Lock()
            self._pid = os.getpid()
        with self._lock:
            if self._listener is not None:
                if not forked:  # (a shutdown would stop the parent's listening too)
                    try:
                        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
                    except OSError:
                        pass
                self._listener.close()
                self._listener = None
            self._offers.clear()
            self._groups.clear()

    def _listen(self):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        address = b"\0cuvmm-share-%d-%s" % (os.getpid(), secrets.token_hex(8).encode())
        listener.bind(address)
        listener.listen(64)
        self._listener, self.address = listener, address
        threading.Thread(target=self._accept, args=(listener,), name="cuvmm-share-handoff",
                         daemon=True).start()

    def _accept(self, listener):
        # One failure (a connection gone before it is looked at, descriptors or threads running
        # out) must not end the thread: every later fetch from this process would wait for ever.
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as e:
                with self._lock:  # (close() shuts it, then closes it, holding the lock)
                    if self._listener is not listener:  # closed
                        return
                _report("accepting a receiver", e)
                time.sleep(0.05)  # out of descriptors, say: let some go
                continue
            try:
                _, uid, _ = peer_credentials(conn)
                # SO_PEERCRED gives the peer's effective uid: compare like with like.
                if uid != os.geteuid():
                    conn.close()
                    continue
                threading.Thread(target=self._serve, args=(conn,), name="cuvmm-share-serve",
                                 daemon=True).start()
            except Exception as e:
                conn.close()
                _report("accepting a receiver", e)

    def _take(self, token: bytes):
        with self._lock:
            offer = self._offers.pop(token, None)
            if offer is not None:
                self._claimed += 1
                self._ungroup(token, offer.group)
            return offer

    def _ungroup(self, token: bytes, group) -> None:
        if group is not None:
            members = self._groups.get(group)
            if members is not None:
                members.discard(token)
                if not members:
                    del self._groups[group]

    def _take_group(self, group) -> list:
        """Takes the offers of ``group`` not taken yet (at most ``_GROUP_PER_ANSWER``)."""
        if group is None:
            return []
        with self._lock:
            members = self._groups.get(group)
            if not members:
                return []
            taken = []
            for token in list(members)[:_GROUP_PER_ANSWER]:
                taken.append((token, self._offers.pop(token)))
                members.discard(token)
            if not members:
                del self._groups[group]
            self._claimed += len(taken)
            return taken

    def _give_back(self, taken) -> None:
        """Offers taken by :meth:`_take_group` that are not sent after all: offered again."""
        with self._lock:
            for token, offer in taken:
                self._offers[token] = offer
                if offer.group is not None:
                    self._groups.setdefault(offer.group, set()).add(token)
            self._claimed -= len(taken)

    def _let_go(self, offers) -> None:
        """Releases taken offers (their receiver let go, or its connection ended)."""
        for offer in offers:
            try:
                offer.release()
            except Exception as e:  # one failing must not keep the others
                _report("releasing a shared block", e)
        with self._lock:
            self._claimed -= len(offers)

    def _serve(self, conn):
        # What this connection took, by token: released as the receiver says, or all of it when
        # the connection ends however it ends. And the claims of tokens refused, by token: the
        # receiver does not know they were, and releases each (which must not release the offer
        # the same token took before).
        held: dict[bytes, _Offer] = {}
        refused: dict[bytes, int] = {}
        try:
            with conn:
                while self._answer(conn, held, refused):
                    pass
        finally:
            self._let_go(list(held.values()))

    def _answer(self, conn, held: dict, refused: dict) -> bool:
        """Reads and answers one message of a receiver; False once the connection ended."""
        try:
            msg, fds, flags, _ = socket.recv_fds(conn, 1 + _TOKEN * _RELEASES_PER_MESSAGE, 1)
        except OSError:
            return False
        _close_all(fds)  # no message of a receiver carries one
        if not msg or flags & socket.MSG_TRUNC:
            return False  # done (or gone), or not a receiver of ours: what it took is released
        kind, body = msg[:1], msg[1:]
        if kind == _RELEASE:
            if len(body) % _TOKEN:
                return False
            gone = []
            for i in range(0, len(body), _TOKEN):
                t = body[i:i + _TOKEN]
                if refused.get(t):
                    refused[t] -= 1
                    continue
                # A token not taken yet (a receiver that will not use it) is taken and let go.
                offer = held.pop(t, None) or self._take(t)
                if offer is not None:
                    gone.append(offer)
            self._let_go(gone)
            return True
        if len(body) != _TOKEN or kind not in (_WANT_PAGES, _HOLD):
            return False
        offer = self._take(body)
        if kind == _HOLD:  # no answer awaited
            if offer is None:
                refused[body] = refused.get(body, 0) + 1
                _report("a receiver's claim of a tensor", ValueError("no such offer (taken already?)"))
            else:
                held[body] = offer
            return True
        if offer is None:
            return _send(conn, _UNKNOWN)
        pages = self._pages(offer)
        if pages is None:
            self._let_go([offer])
            return _send(conn, _FAILED)
        held[body] = offer
        # The rest of its group comes along. One whose descriptors cannot be made is offered
        # again: its own fetch then gets the refusal.
        along, back, all_fds = [], [], list(pages)
        for token, other in self._take_group(offer.group):
            fds = self._pages(other)
            if fds is None:
                back.append((token, other))
                continue
            held[token] = other
            along.append(token + _COUNT.pack(len(fds)))
            all_fds += fds
        self._give_back(back)
        try:
            conn.send(_OFFERED + _COUNT.pack(len(pages)) + b"".join(along))
            send_page_fds(conn, all_fds)
            return True
        except OSError:
            return False
        finally:
            _close_all(all_fds)

    @staticmethod
    def _pages(offer):
        """An offer's page descriptors for a receiver that asked; None when making them failed."""
        if offer.pages is None:
            return []
        try:
            return list(offer.pages())
        except Exception as e:
            _report("producing a tensor's page descriptors", e)
            return None


def _send(conn, msg: bytes) -> bool:
    try:
        conn.send(msg)
        return True
    except OSError:
        return False


def send_page_fds(sock: socket.socket, fds) -> None:
    """Sends ``fds`` for :func:`recv_pages`, up to ``MAX_FDS_PER_MESSAGE`` a message (the kernel
    duplicates them into the messages: the caller still closes its own)."""
    fds = list(fds)
    for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
        part = fds[i:i + MAX_FDS_PER_MESSAGE]
        socket.send_fds(sock, [_HEADER.pack(i, len(part))], part)


class _Connection:
    """A connection to one sending process, checked; the lock its messages take turns on (a
    sender that stalls holds up fetches from itself, never from another); and how many offers
    this process holds over it. A connection is what the sender holds them for: one dropped
    while it holds some (out of step after a timeout) stays open, for their releases alone,
    until the last is released."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.lock = threading.Lock()
        self.claims = 0
        self.dropped = False
        self.later: list[bytes] = []  # releases to send at the next flush_releases()


# Taken only to look up, add or drop a connection and to count claims, never across a round trip:
# a fork while another thread waits for a sender finds it free.
_connections: dict[bytes, _Connection] = {}
_connections_lock = threading.Lock()
# Connections with releases to send at the next flush.
_later: set = set()
# Offers a fetch took along with the one it asked for (the rest of its group), until this process
# asks for them: by (address, token), (descriptors, claim, when taken). Under _connections_lock.
_along: dict = {}
# Seconds an offer taken along waits to be asked for before it is let go: a pickle's tensors are
# rebuilt one after another, so one still waiting belongs to a pickle whose loading failed.
ALONG_FOR = 60.0


class Claim:
    """This process's hold on one offer of a sender (:func:`fetch`, :func:`hold`): the sender
    keeps the offer (a shared block) until :meth:`release`, or until this process exits."""

    __slots__ = ("_conn", "_token")

    def __init__(self, conn: _Connection, token: bytes):
        self._conn, self._token = conn, token

    def release(self) -> None:
        """Tells the sender now (idempotent)."""
        c, self._conn = self._conn, None
        if c is not None:
            _release(c, [self._token])

    def release_later(self) -> None:
        """Tells the sender at the next :func:`flush_releases`, with the other releases then
        pending to it (one message for a hand-off's tensors dropped together)."""
        c, self._conn = self._conn, None
        if c is not None:
            with _connections_lock:
                c.later.append(self._token)
                _later.add(c)


def flush_releases() -> None:
    """Sends every release :meth:`Claim.release_later` left pending."""
    with _connections_lock:
        pending = [(c, c.later) for c in _later]
        for c, _ in pending:
            c.later = []
        _later.clear()
    for c, tokens in pending:
        _release(c, tokens)


def _release(c: _Connection, tokens: list) -> None:
    """Tells the sender over ``c`` that ``tokens`` are let go of; closes ``c`` once it holds nothing
    more where it was dropped. A sender that has gone released them anyway; one that does not
    take the message in time keeps them until the connection closes."""
    for i in range(0, len(tokens), _RELEASES_PER_MESSAGE):
        _tell(c, _RELEASE + b"".join(tokens[i:i + _RELEASES_PER_MESSAGE]))
    with _connections_lock:
        c.claims -= len(tokens)
        close = c.dropped and c.claims == 0
    if close:
        c.sock.close()


def _tell(c: _Connection, msg: bytes) -> None:
    """Sends ``msg`` (which awaits no answer) on ``c`` in turn with its other messages."""
    if not c.lock.acquire(timeout=FETCH_TIMEOUT):
        _report("telling a cuvmm sending process", TimeoutError("its connection stayed busy"))
        return
    try:
        if c.sock.fileno() != -1:
            c.sock.settimeout(FETCH_TIMEOUT)
            c.sock.send(msg)
    except OSError:
        pass  # gone: it let go of everything this connection held
    finally:
        c.lock.release()


def _connect(address: bytes, pid: int, deadline: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(address)
        except socket.timeout:
            # A TimeoutError, as fetch promises, before Python 3.10 too.
            raise TimeoutError(f"no connection to the cuvmm sending process {pid} in time") from None
        # Before the token goes out or a descriptor comes in: whoever holds the name now must be
        # the process it names, running as us. Abstract names are visible to every user, and
        # free for any of them to take once the sender has gone. A peer whose PID namespace we
        # cannot see (pid 0: a sibling container sharing our network namespace) is checked by
        # its user alone.
        got_pid, uid, _ = peer_credentials(sock)
        if uid != os.geteuid() or (got_pid != 0 and _own_pid(got_pid) != pid):
            raise PermissionError(
                f"refusing the cuvmm hand-off at {address[1:].decode()}: it is answered by pid "
                f"{got_pid} running as uid {uid}, not by pid {pid} running as uid {os.geteuid()} "
                "(the sending process has exited, and another has taken its address?)")
        return sock
    except BaseException:
        sock.close()
        raise


def _own_pid(pid: int) -> int:
    """The pid that process ``pid`` (as this process sees it) has in its own PID namespace: what
    its ``os.getpid()`` returns, and so what its address names. They differ where it runs in a
    namespace nested in ours (a container's process seen from the host)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return pid


def _connection(address: bytes, pid: int, deadline: float) -> _Connection:
    """The kept connection to ``address``, made (and checked) if there is none."""
    with _connections_lock:
        c = _connections.get(address)
    if c is None:
        c = _Connection(_connect(address, pid, deadline), pid)
        with _connections_lock:
            # Another thread may have connected meanwhile: keep one, close the other.
            c, extra = _connections.setdefault(address, c), c
        if extra is not c:
            extra.sock.close()
    return c


def _drop(address: bytes, c: _Connection, token: bytes | None = None) -> None:
    """Nobody asks anything on ``c`` again (it is out of step, or its sender hung up). It closes
    at once if it holds nothing; else it stays open for the releases of what it holds, and
    ``token``, whose answer may still come, is released at once."""
    with _connections_lock:
        if _connections.get(address) is c:
            del _connections[address]
        c.dropped = True
        close = c.claims == 0
    if close:
        c.sock.close()
    elif token is not None:
        _tell(c, _RELEASE + token)


def _exchange(address: bytes, token: bytes, timeout: float, what, claims: bool):
    """``what(socket)`` on the kept connection to the sender at ``address``, in turn with the
    other messages on it; returns (its answer, the connection). ``claims``: the exchange takes the
    offer under ``token`` when it answers at all, so the connection counts it from before anything
    is sent (it must stay open while it might hold it); the caller uncounts a refusal. A connection
    that failed or timed out is dropped (out of step: nobody asks anything on it again), and
    whatever the sender took for this exchange is released."""
    if not isinstance(token, bytes) or len(token) != _TOKEN:
        raise ValueError("not a cuvmm hand-off token")
    pid = _sender(address)
    deadline = time.monotonic() + timeout
    while True:
        c = _connection(address, pid, deadline)
        if not c.lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise TimeoutError(f"no turn to ask the cuvmm sending process {pid} within {timeout} s "
                               "(another fetch from it is waiting for its answer)")
        failed = True
        try:
            with _connections_lock:
                if c.dropped:
                    continue  # dropped by the exchange before us: connect again
                if claims:
                    c.claims += 1
            c.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                got = what(c.sock)
            except (TimeoutError, socket.timeout):
                # (Before Python 3.10 a socket's timeout is no TimeoutError.)
                raise TimeoutError(f"the cuvmm sending process {pid} did not answer within "
                                   f"{timeout} s (is it stalled?)") from None
            failed = got is None  # the sender hung up
            return got, c
        finally:
            c.lock.release()
            if failed and not c.dropped:
                if claims:
                    _unclaim(c)
                _drop(address, c, token if claims else None)


def _sender(address) -> int:
    """The pid a hand-off address names; ValueError for anything else."""
    if isinstance(address, bytes):
        c = _connections.get(address)
        if c is not None:
            return c.pid  # (read once, when it connected)
        m = _ADDRESS.match(address)
        if m is not None:
            return int(m.group(1))
    raise ValueError(f"not a cuvmm hand-off address: {address!r}")


def _unclaim(c: _Connection) -> None:
    with _connections_lock:
        c.claims -= 1


def fetch(address: bytes, token: bytes, timeout: float = FETCH_TIMEOUT) -> tuple[list, Claim]:
    """Takes the offer under ``token`` from the :class:`Handoff` at ``address``: returns its page
    descriptors (the caller closes them) and the claim that holds it until released (see
    :func:`hold` for a receiver that maps them already). The connection to that process is kept
    for later fetches. ValueError when it has no such offer (taken already) or could not produce
    its pages; PermissionError when the process answering is not the one the address names or
    runs as another user; TimeoutError when it has not answered within ``timeout`` seconds;
    another OSError when it cannot be reached."""

    taken = _taken_along(address, token)
    if taken is not None:
        return taken

    def ask(sock):
        sock.send(_WANT_PAGES + token)
        msg = sock.recv(1 + _COUNT.size + _GROUP_PER_ANSWER * (_TOKEN + _COUNT.size))
        if not msg:
            return None
        head = 1 + _COUNT.size
        if msg[:1] != _OFFERED or len(msg) < head or (len(msg) - head) % (_TOKEN + _COUNT.size):
            return msg
        counts = [(token, _COUNT.unpack_from(msg, 1)[0])]
        for i in range(head, len(msg), _TOKEN + _COUNT.size):
            counts.append((msg[i:i + _TOKEN], _COUNT.unpack_from(msg, i + _TOKEN)[0]))
        fds = recv_pages(sock, sum(n for _, n in counts))
        out, at = [], 0
        for t, n in counts:
            out.append((t, fds[at:at + n]))
            at += n
        return out

    got, c = _exchange(address, token, timeout, ask, claims=True)
    if isinstance(got, list):
        now = time.monotonic()
        with _connections_lock:
            c.claims += len(got) - 1
            for t, fds in got[1:]:
                _along[(address, t)] = (fds, Claim(c, t), now)
        return got[0][1], Claim(c, token)
    if got is None:  # (uncounted with the connection dropped)
        raise ValueError("the sending process hung up (it exited?)")
    _unclaim(c)
    if got == _FAILED:
        raise ValueError("the sending process could not produce the tensor's pages (see its stderr)")
    raise ValueError("the sending process has no such tensor (fetched already?)")


def hold(address: bytes, token: bytes, timeout: float = FETCH_TIMEOUT) -> Claim:
    """Takes the offer under ``token`` for a receiver that maps its pages already, without waiting
    for the sender: the token goes to the sender and nothing comes back, so a token it does not
    know (taken already) is only reported on the sender's stderr. The sender keeps the offer until
    the claim is released or this process exits. Raises as :func:`fetch` when the sender cannot
    be reached or is not the one the address names."""

    claim = _claim_taken_along(address, token)
    if claim is not None:
        return claim

    def send(sock):
        sock.send(_HOLD + token)
        return True

    _, c = _exchange(address, token, timeout, send, claims=True)
    return Claim(c, token)


def let_go(address: bytes, token: bytes, timeout: float = FETCH_TIMEOUT) -> None:
    """Tells the sender this process will not use the offer under ``token`` (it releases it),
    without waiting for an answer."""
    claim = _claim_taken_along(address, token)
    if claim is not None:
        claim.release()
        return

    def send(sock):
        sock.send(_RELEASE + token)
        return True

    _exchange(address, token, timeout, send, claims=False)


def _taken_along(address, token):
    """(descriptors, claim) of the offer under ``token`` if a fetch took it along, else None; lets
    go of what was taken along and not asked for within ``ALONG_FOR`` seconds."""
    now = time.monotonic()
    stale = []
    with _connections_lock:
        got = _along.pop((address, token), None)
        # Oldest first (the order they were added in): the stale ones lead.
        while _along:
            key = next(iter(_along))
            if now - _along[key][2] <= ALONG_FOR:
                break
            stale.append(_along.pop(key))
    for fds, claim, _ in stale:
        _close_all(fds)
        claim.release()
    return None if got is None else got[:2]


def _claim_taken_along(address, token):
    """The claim on the offer under ``token`` if a fetch took it along (its descriptors closed:
    the caller maps them already, or will not), else None."""
    taken = _taken_along(address, token)
    if taken is None:
        return None
    _close_all(taken[0])
    return taken[1]


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


def forget_connections() -> None:
    """Closes every kept connection (a forked child must not share its parent's)."""
    with _connections_lock:
        kept = list(_connections.values())
        _connections.clear()
        along = list(_along.values())
        _along.clear()
    for fds, _, _ in along:
        _close_all(fds)
    for c in kept:
        c.sock.close()


def _after_fork_in_child():
    # The parent's threads are not in the child: a lock one of them held (a fetch waiting for its
    # sender) stays held for ever. Start afresh, without taking any, and close the child's copies
    # of the parent's connections (the parent's stay open: they hold what the parent took).
    global _connections, _connections_lock, _later, _along
    kept, _connections, _connections_lock, _later = _connections, {}, threading.Lock(), set()
    # What the parent took along is the parent's to use: the child closes its copies of the
    # descriptors and tells nobody.
    along, _along = _along, {}
    for fds, _, _ in along.values():
        _close_all(fds)
    for c in kept.values():
        c.sock.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
