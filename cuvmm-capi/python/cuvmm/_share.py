"""What a CUDA tensor on cuvmm memory becomes on its way to another process, without PyTorch.

:mod:`cuvmm.torch` sends a tensor whose storage cuvmm allocated as

* a descriptor (:func:`encode` / :func:`decode`): where the storage lies on the exported pages,
  and the tensor's dtype, size, strides and storage offset, every field checked on arrival;
* one file descriptor, the receiving end of a ``SOCK_SEQPACKET`` socket pair over which the pages'
  own descriptors follow, up to ``MAX_FDS_PER_MESSAGE`` a message (:func:`send_pages` /
  :func:`recv_pages`). The sender offers it (:class:`Handoff`) under a random token that travels
  in the pickle with the sender's address; the receiver fetches it (:func:`fetch`) over one
  connection per sending process, kept for the next tensor: a tensor costs one request on an open
  connection, not a connection and a handshake of its own.

The receiver keeps its end open while it maps the pages and closes it once it has unmapped them;
the sender sees the other end hang up (:class:`Releases`) and only then lets its block go, so the
block's addresses are never handed out again while someone reads them.
"""

from __future__ import annotations

import os
import resource
import secrets
import select
import socket
import struct
import threading

VERSION = 1

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
    decode(d)
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


def send_pages(fds) -> tuple[socket.socket, socket.socket]:
    """Queues ``fds`` on a new socket pair; returns (the end this process keeps, the end to send).

    The descriptors are duplicated into the messages: close yours afterwards."""
    keep, give = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        fds = list(fds)
        for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
            part = fds[i:i + MAX_FDS_PER_MESSAGE]
            socket.send_fds(keep, [_HEADER.pack(i, len(part))], part)
        keep.shutdown(socket.SHUT_WR)
    except BaseException:
        keep.close()
        give.close()
        raise
    return keep, give


def recv_pages(sock: socket.socket, count: int) -> list[int]:
    """The ``count`` descriptors :func:`send_pages` queued, in order (the caller closes them).
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
        for fd in got:
            os.close(fd)
        raise


class Releases:
    """Calls ``on_release()`` of each registered socket once its peer has hung up (every copy of
    the other end closed: the receiver unmapped, or died), on a daemon thread of its own."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[socket.socket, object]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._poll = select.poll()
        self._poll.register(self._wake_r, select.POLLIN)
        self._thread = None

    def register(self, sock: socket.socket, on_release) -> None:
        with self._lock:
            self._waiting[sock.fileno()] = (sock, on_release)
            # Only hang-ups count: the receiver never writes.
            self._poll.register(sock.fileno(), 0)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cuvmm-share-releases", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")

    def pending(self) -> int:
        """Sockets whose peer has not hung up yet."""
        with self._lock:
            return len(self._waiting)

    def _run(self):
        while True:
            for fd, ev in self._poll.poll():
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    with self._lock:
                        entry = self._waiting.pop(fd, None)
                        self._poll.unregister(fd)
                    if entry is not None:
                        sock, on_release = entry
                        sock.close()
                        try:
                            on_release()
                        except Exception as e:  # a release must not stop the others
                            import sys
                            print(f"cuvmm: releasing a shared block failed: {e}", file=sys.stderr)


_TOKEN = 16
_OFFERED, _UNKNOWN = b"\x01", b"\x00"
_UCRED = struct.Struct("3i")  # pid, uid, gid


class Handoff:
    """Keeps sockets offered to other processes until one asks for it by its token.

    It listens on an abstract Unix socket of its own (a name in no filesystem, gone with the
    process) once something is offered; a thread per connected process answers. Only processes of
    this user may connect, and only a receiver holding the token (16 random bytes, in the pickle)
    gets the socket, once. A socket nobody fetches stays offered until the process exits, as with
    ``multiprocessing``'s resource sharer."""

    def __init__(self):
        self._lock = threading.Lock()
        self._offers: dict[bytes, socket.socket] = {}
        self._listener = None
        self.address = None

    def offer(self, sock: socket.socket) -> tuple[bytes, bytes]:
        """Takes ``sock`` (closed here once fetched); returns (address, token) for the receiver."""
        token = secrets.token_bytes(_TOKEN)
        with self._lock:
            if self._listener is None:
                self._listen()
            self._offers[token] = sock
        return self.address, token

    def pending(self) -> int:
        """Sockets offered and not fetched yet."""
        with self._lock:
            return len(self._offers)

    def close(self) -> None:
        """Stops listening and closes what was not fetched (a forked child's copy, tests)."""
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for sock in self._offers.values():
                sock.close()
            self._offers.clear()

    def _listen(self):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        address = b"\0cuvmm-share-%d-%s" % (os.getpid(), secrets.token_hex(8).encode())
        listener.bind(address)
        listener.listen(64)
        self._listener, self.address = listener, address
        threading.Thread(target=self._accept, args=(listener,), name="cuvmm-share-handoff",
                         daemon=True).start()

    def _accept(self, listener):
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if uid != os.getuid():
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="cuvmm-share-handoff",
                             daemon=True).start()

    def _serve(self, conn):
        with conn:
            while True:
                try:
                    token = conn.recv(_TOKEN + 1)
                except OSError:
                    return
                if not token:  # the receiving process is done (or gone)
                    return
                with self._lock:
                    sock = self._offers.pop(token, None) if len(token) == _TOKEN else None
                try:
                    if sock is None:
                        conn.send(_UNKNOWN)
                    else:
                        socket.send_fds(conn, [_OFFERED], [sock.fileno()])
                except OSError:
                    return
                finally:
                    if sock is not None:
                        sock.close()


_connections: dict[bytes, socket.socket] = {}
_connections_lock = threading.Lock()


def fetch(address: bytes, token: bytes) -> socket.socket:
    """The socket a :class:`Handoff` at ``address`` offered under ``token``. The connection to
    that process is kept for later fetches. ValueError when it has no such offer (fetched already);
    OSError when it cannot be reached."""
    if not isinstance(address, bytes) or not address.startswith(b"\0cuvmm-share-"):
        raise ValueError(f"not a cuvmm hand-off address: {address!r}")
    if not isinstance(token, bytes) or len(token) != _TOKEN:
        raise ValueError("not a cuvmm hand-off token")
    with _connections_lock:
        conn = _connections.get(address)
        if conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(address)
            except BaseException:
                conn.close()
                raise
            _connections[address] = conn
        try:
            conn.send(token)
            msg, fds, flags, _ = socket.recv_fds(conn, 2, 1)
        except BaseException:
            _connections.pop(address, None)
            conn.close()
            raise
        if not msg:
            _connections.pop(address, None)
            conn.close()
    if msg == _OFFERED and len(fds) == 1 and not flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        return socket.socket(fileno=fds[0])
    for fd in fds:
        os.close(fd)
    if not msg:
        raise ValueError("the sending process hung up (it exited?)")
    raise ValueError("the sending process has no such tensor (fetched already?)")


def forget_connections() -> None:
    """Closes every kept connection (a forked child must not share its parent's)."""
    with _connections_lock:
        for conn in _connections.values():
            conn.close()
        _connections.clear()
