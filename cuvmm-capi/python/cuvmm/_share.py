"""What a CUDA tensor on cuvmm memory becomes on its way to another process, without PyTorch.

:mod:`cuvmm.torch` sends a tensor whose storage cuvmm allocated as

* a descriptor (:func:`encode` / :func:`decode`): where the storage lies on the exported pages,
  and the tensor's dtype, size, strides and storage offset, every field checked on arrival;
* one file descriptor, the receiving end of a ``SOCK_SEQPACKET`` socket pair over which the pages'
  own descriptors follow, up to ``MAX_FDS_PER_MESSAGE`` a message (:func:`send_pages` /
  :func:`recv_pages`), when the receiver needs them. The sender offers it (:class:`Handoff`) under
  a random token that travels in the pickle with the sender's address; the receiver fetches it
  (:func:`fetch`) over one connection per sending process, kept for the next tensor: a tensor
  costs one request on an open connection, not a connection and a handshake of its own. The
  request says whether the receiver needs the pages' descriptors; one that maps those pages
  already (the same serials from the same sender) does not fetch at all: it claims the offer
  (:func:`hold`) with one end of a socket pair of its own, waits for no answer, and the sender
  makes no descriptor.

Both ends check the other with ``SO_PEERCRED`` before anything travels: the sender answers only
processes of its effective uid, and the receiver talks only to the process its address names (the
pid in it) running as the receiver's effective uid, since an abstract name outlives nobody's claim
to it: once the sender has gone, any local user may take it. A fetch waits at most its timeout
(``FETCH_TIMEOUT`` by default) and holds nothing across its round trip that a fetch from another
sender or a fork would wait on.

The receiver keeps its end open while it maps the pages and closes it once it has unmapped them;
the sender sees the other end hang up (:class:`Releases`) and only then lets its block go, so the
block's addresses are never handed out again while someone reads them.
"""

from __future__ import annotations

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


def pair() -> tuple[socket.socket, socket.socket]:
    """A new socket pair: (the end this process keeps, the end to send)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def queue_pages(keep: socket.socket, fds) -> None:
    """Queues ``fds`` on ``keep`` (an end of :func:`pair`) for :func:`recv_pages` at the other end,
    and shuts ``keep`` for writing. The descriptors are duplicated into the messages: close yours
    afterwards."""
    fds = list(fds)
    for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
        part = fds[i:i + MAX_FDS_PER_MESSAGE]
        socket.send_fds(keep, [_HEADER.pack(i, len(part))], part)
    keep.shutdown(socket.SHUT_WR)


def send_pages(fds) -> tuple[socket.socket, socket.socket]:
    """Queues ``fds`` on a new socket pair; returns (the end this process keeps, the end to send).

    The descriptors are duplicated into the messages: close yours afterwards."""
    keep, give = pair()
    try:
        queue_pages(keep, fds)
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


class Releases(FdWatch):
    """Calls ``on_release()`` of each registered socket once its peer has hung up (every copy of
    the other end closed: the receiver unmapped, or died), on a daemon thread of its own."""

    def __init__(self):
        super().__init__("cuvmm-share-releases", "releasing a shared block")

    def register(self, sock: socket.socket, on_release) -> None:
        def hung_up():
            sock.close()
            on_release()

        with self._lock:
            # Only hang-ups count: the receiver never writes.
            self._add(sock.fileno(), 0, hung_up)
        self._wake()

    def pending(self) -> int:
        """Sockets whose peer has not hung up yet."""
        with self._lock:
            return len(self._waiting)


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
_OFFERED, _UNKNOWN, _FAILED = b"\x01", b"\x00", b"\x02"
# After the token: whether the receiver needs the pages' descriptors (a bare token: it does), or
# claims the offer with a socket of its own and waits for no answer (it maps the pages already).
_WANT_PAGES, _HAVE_PAGES, _HOLD = b"p", b"k", b"h"
_UCRED = struct.Struct("3i")  # pid, uid, gid
_ADDRESS = re.compile(rb"\0cuvmm-share-([1-9][0-9]{0,9})-[0-9a-f]{16}\Z")

#: Seconds a :func:`fetch` waits for the sending process by default.
FETCH_TIMEOUT = 60.0


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, effective uid, effective gid) of the process at the other end of a connected Unix
    socket, as the kernel recorded them when it connected or listened (``SO_PEERCRED``)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


class Handoff:
    """Keeps sockets offered to other processes until one asks for it by its token.

    It listens on an abstract Unix socket of its own (a name in no filesystem, gone with the
    process) once something is offered; a thread per connected process answers. Only processes
    whose effective uid is this process's may connect, and only a receiver holding the token (16
    random bytes, in the pickle) gets the socket, once. A socket nobody fetches stays offered until
    the process exits, as with ``multiprocessing``'s resource sharer."""

    def __init__(self, releases: "Releases | None" = None):
        self._lock = threading.Lock()
        self._offers: dict[bytes, tuple[socket.socket, object]] = {}
        # Watches the sockets receivers claim offers with (:func:`hold`): without it, none is taken.
        self._releases = releases
        self._listener = None
        self._pid = os.getpid()
        self.address = None

    def offer(self, sock: socket.socket, pages=None) -> tuple[bytes, bytes]:
        """Takes ``sock`` (closed here once fetched); returns (address, token) for the receiver.

        ``pages()``, when given, is called (once, on this object's thread) before ``sock`` goes to
        a receiver that asks for the pages, to queue them at the other end of ``sock``; a
        receiver that maps them already gets ``sock`` alone. Should it fail, the receiver gets a
        refusal and ``sock`` is closed."""
        token = secrets.token_bytes(_TOKEN)
        with self._lock:
            if self._listener is None:
                self._listen()
            self._offers[token] = (sock, pages)
        return self.address, token

    def pending(self) -> int:
        """Sockets offered and not fetched yet."""
        with self._lock:
            return len(self._offers)

    def close(self) -> None:
        """Stops listening and closes what was not fetched (a forked child's copy, tests)."""
        if os.getpid() != self._pid:
            # A forked child: the parent's threads are not here, so a lock one of them held at
            # the fork would never be released. The child's copy is its own.
            self._lock = threading.Lock()
            self._pid = os.getpid()
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for sock, _ in self._offers.values():
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
        # One failure (a connection gone before it is looked at, descriptors or threads running
        # out) must not end the thread: every later fetch from this process would wait for ever.
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as e:
                if listener.fileno() == -1:  # closed
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
                threading.Thread(target=self._serve, args=(conn,), name="cuvmm-share-handoff",
                                 daemon=True).start()
            except Exception as e:
                conn.close()
                _report("accepting a receiver", e)

    def _serve(self, conn):
        with conn:
            while True:
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, _TOKEN + 2, 1)
                except OSError:
                    return
                if not msg:  # the receiving process is done (or gone)
                    for fd in fds:
                        os.close(fd)
                    return
                token, want = msg[:_TOKEN], msg[_TOKEN:]
                if want == _HOLD:
                    self._hold(token, fds)
                    continue
                for fd in fds:
                    os.close(fd)
                offer = None
                if len(token) == _TOKEN and want in (b"", _WANT_PAGES, _HAVE_PAGES):
                    with self._lock:
                        offer = self._offers.pop(token, None)
                sock, pages = offer if offer is not None else (None, None)
                try:
                    if sock is None:
                        conn.send(_UNKNOWN)
                    elif not self._fill(pages if want != _HAVE_PAGES else None):
                        conn.send(_FAILED)
                    else:
                        socket.send_fds(conn, [_OFFERED], [sock.fileno()])
                except OSError:
                    return
                finally:
                    if sock is not None:
                        sock.close()

    def _hold(self, token: bytes, fds: list[int]) -> None:
        """A receiver claims the offer under ``token`` with the socket ``fds`` holds: the offered
        socket stays here until that one hangs up, then closes (which releases the offer as a
        fetched socket's hang-up does). Nothing is answered."""
        claim = None
        if len(fds) == 1:
            try:
                claim = socket.socket(fileno=fds[0])
            except OSError:  # not a socket
                pass
        for fd in fds if claim is None else fds[1:]:
            os.close(fd)
        offer = None
        if claim is not None and len(token) == _TOKEN and self._releases is not None:
            with self._lock:
                offer = self._offers.pop(token, None)
        if offer is None:
            # Told before the claim hangs up, which is all the receiver sees of it.
            _report("a receiver's claim of a tensor", ValueError("no such offer (claimed already?)"))
            if claim is not None:
                claim.close()
            return
        try:
            self._releases.register(claim, offer[0].close)
        except Exception as e:  # this thread answers every later fetch of that receiver: it goes on
            claim.close()
            offer[0].close()
            _report("holding a tensor for a receiver", e)

    @staticmethod
    def _fill(pages) -> bool:
        """Queues an offer's pages for a receiver that asked for them; False when that failed."""
        if pages is None:
            return True
        try:
            pages()
            return True
        except Exception as e:
            _report("producing a tensor's page descriptors", e)
            return False


class _Connection:
    """A connection to one sending process, checked, and the lock its round trips take turns on:
    a sender that stalls holds up fetches from itself, never from another."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()


# Taken only to look up, add or drop a connection, never across a round trip: a fork while
# another thread waits for a sender finds it free.
_connections: dict[bytes, _Connection] = {}
_connections_lock = threading.Lock()


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
        c = _Connection(_connect(address, pid, deadline))
        with _connections_lock:
            # Another thread may have connected meanwhile: keep one, close the other.
            c, extra = _connections.setdefault(address, c), c
        if extra is not c:
            extra.sock.close()
    return c


def _drop(address: bytes, c: _Connection) -> None:
    with _connections_lock:
        if _connections.get(address) is c:
            del _connections[address]
    c.sock.close()


def _exchange(address: bytes, token: bytes, timeout: float, what):
    """``what(connection, deadline)`` on the kept connection to the sender at ``address``, in
    turn with the other round trips on it; a connection that failed or timed out is dropped (out
    of step: nobody uses it again)."""
    m = _ADDRESS.match(address) if isinstance(address, bytes) else None
    if m is None:
        raise ValueError(f"not a cuvmm hand-off address: {address!r}")
    if not isinstance(token, bytes) or len(token) != _TOKEN:
        raise ValueError("not a cuvmm hand-off token")
    pid = int(m.group(1))
    deadline = time.monotonic() + timeout
    while True:
        c = _connection(address, pid, deadline)
        if not c.lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise TimeoutError(f"no turn to ask the cuvmm sending process {pid} within {timeout} s "
                               "(another fetch from it is waiting for its answer)")
        try:
            if c.sock.fileno() == -1:
                continue  # dropped by the fetch before us: connect again
            c.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            got = what(c.sock)
            if got is None:
                _drop(address, c)  # the sender hung up
            return got
        except (TimeoutError, socket.timeout):
            # (Before Python 3.10 a socket's timeout is no TimeoutError.)
            # The answer may still come: the connection is out of step, so nobody uses it again.
            _drop(address, c)
            raise TimeoutError(f"the cuvmm sending process {pid} did not answer within {timeout} s "
                               "(is it stalled?)") from None
        except BaseException:
            _drop(address, c)
            raise
        finally:
            c.lock.release()


def fetch(address: bytes, token: bytes, timeout: float = FETCH_TIMEOUT, pages: bool = True) -> socket.socket:
    """The socket a :class:`Handoff` at ``address`` offered under ``token``, with the offer's page
    descriptors queued on it when ``pages`` (see :func:`hold` for a receiver that maps them
    already). The connection to that process is kept for later fetches. ValueError when it has no
    such offer (fetched already) or could not produce its pages;
    PermissionError when the process answering is not the one the address names or runs as
    another user; TimeoutError when it has not answered within ``timeout`` seconds; another
    OSError when it cannot be reached."""

    def ask(sock):
        sock.send(token + (_WANT_PAGES if pages else _HAVE_PAGES))
        msg, fds, flags, _ = socket.recv_fds(sock, 2, 1)
        return (msg, fds, flags) if msg else None

    got = _exchange(address, token, timeout, ask)
    msg, fds, flags = got if got is not None else (b"", [], 0)
    if msg == _OFFERED and len(fds) == 1 and not flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        return socket.socket(fileno=fds[0])
    for fd in fds:
        os.close(fd)
    if not msg:
        raise ValueError("the sending process hung up (it exited?)")
    if msg == _FAILED:
        raise ValueError("the sending process could not produce the tensor's pages (see its stderr)")
    raise ValueError("the sending process has no such tensor (fetched already?)")


def hold(address: bytes, token: bytes, timeout: float = FETCH_TIMEOUT) -> socket.socket:
    """Claims the offer under ``token`` for a receiver that maps its pages already, without waiting
    for the sender: one end of a new socket pair goes to the sender with the token, and the other
    is returned. The sender keeps the block shared until that end hangs up (closed, or this
    process gone), as for a fetched socket. Nothing comes back, so a token the sender does not
    know (claimed already) is only reported on the sender's stderr, and the returned end hangs up
    at once. Raises as :func:`fetch` when the sender cannot be reached or is not the one the
    address names."""
    mine, theirs = pair()
    try:
        def send(sock):
            socket.send_fds(sock, [token + _HOLD], [theirs.fileno()])
            return True

        _exchange(address, token, timeout, send)
        return mine
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()


def forget_connections() -> None:
    """Closes every kept connection (a forked child must not share its parent's)."""
    with _connections_lock:
        kept = list(_connections.values())
        _connections.clear()
    for c in kept:
        c.sock.close()


def _after_fork_in_child():
    # The parent's threads are not in the child: a lock one of them held (a fetch waiting for its
    # sender) stays held for ever. Start afresh, without taking any, and close the child's copies
    # of the parent's connections.
    global _connections, _connections_lock
    kept, _connections, _connections_lock = _connections, {}, threading.Lock()
    for c in kept.values():
        c.sock.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
