#!/usr/bin/env python3
"""How cuvmm.torch sends a tensor to another process, without a GPU or PyTorch: the descriptor's
encoding and the checks on arrival, the page descriptors fetched by token by a spawned process
over one connection (Handoff), the sender learning that the receiver let go (a release, batched
releases, the receiver's exit), page descriptors made only for a receiver that asks for them (none
for one that maps those pages already), what a connection dropped after a timeout still holds,
and whom a fetch trusts and how long it waits: another user or another process answering on the
sender's address, a stalled sender, a fork during a fetch, a failing accept.

    python3 cuvmm-capi/tests/python/test_share.py
"""

import contextlib
import gc
import io
import multiprocessing
import os
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
import unittest
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = HERE.parents[1] / "python"
sys.path.insert(0, str(PYTHON))

from cuvmm import _share  # noqa: E402
from _common import NOBODY, as_nobody, squat  # noqa: E402

PAGE = 2 << 20


def descriptor(**kw):
    args = dict(device=1, block=5 * PAGE + 4096, block_len=3 * PAGE, first_page=5 * PAGE, page=PAGE,
                count=4, ptr=5 * PAGE + 8192, nbytes=PAGE, dtype="bfloat16", size=(4, 8), stride=(1, 4),
                storage_offset=3, requires_grad=True, parameter=True)
    args.update(kw)
    return _share.encode(**args)


def open_fds():
    # Sockets other tests left to the garbage collector close first, not in the middle of a count.
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def settled_fds(want, timeout=10.0):
    """The open descriptor count once it is ``want``, or what it is after ``timeout`` seconds: the
    sender's thread closes its copy of an offered socket just after handing it over."""
    deadline = time.monotonic() + timeout
    n = open_fds()
    while n != want and time.monotonic() < deadline:
        time.sleep(0.01)
        n = open_fds()
    return n


def memfds(n):
    out = []
    for i in range(n):
        fd = os.memfd_create(f"page{i}")
        os.write(fd, str(i).encode())
        out.append(fd)
    return out


def child_fetches_pages(offers, count, results, done):
    """In a spawned process: fetch each offer's page descriptors, check each is the page it should
    be, ask for the first again, release the first two offers, report, and exit holding the third
    once ``done``."""
    before = open_fds()
    got, claims = [], []
    for address, token in offers:
        fds, claim = _share.fetch(address, token)
        got.append([os.pread(fd, 16, 0).decode() for fd in fds])
        for fd in fds:
            os.close(fd)
        claims.append(claim)
    try:
        _share.fetch(*offers[0])
        again = "fetched twice"
    except ValueError as e:
        again = str(e)
    for claim in claims[:2]:
        claim.release()
    connections = len(_share._connections)
    results.put((got, open_fds() - before - connections, connections, again))
    done.wait(60)


def offered(handoff, pages=None):
    """An offer of ``handoff``: (address, token), and the event its release sets."""
    released = threading.Event()
    return handoff.offer(released.set, pages), released


def answered(handoff):
    """A list that gets an item for each message of a receiver ``handoff`` reads and answers."""
    answers, real = [], handoff._answer

    def counted(*a):
        ok = real(*a)
        if ok:
            answers.append(1)
        return ok
    handoff._answer = counted
    return answers


def group_fetched(handoff, n):
    """``n`` offers of ``handoff`` in one group, each of one page, the first fetched (its
    descriptors closed): (the events their releases set, the offers, the first one's claim)."""
    events = [threading.Event() for _ in range(n)]
    offers = [handoff.offer(e.set, lambda: memfds(1), "g") for e in events]
    got, first = _share.fetch(*offers[0])
    for fd in got:
        os.close(fd)
    return events, offers, first


def taken_along_files():
    """(descriptor, inode) of each descriptor held for offers a fetch took along."""
    with _share._connections_lock:
        fds = [fd for held, _, _ in _share._along.values() for fd in held]
    return {(fd, os.fstat(fd).st_ino) for fd in fds}


def still_open(files):
    """Those of ``files`` (descriptor, inode) still open: by inode, since a closed descriptor's
    number may be open again on something else (other threads open and close their own)."""
    def same(fd, ino):
        try:
            return os.fstat(fd).st_ino == ino
        except OSError:
            return False
    return {f for f in files if same(*f)}


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


class Descriptor(unittest.TestCase):
    def test_round_trip_keeps_every_field(self):
        f = _share.decode(descriptor())
        self.assertEqual((f["device"], f["offset"], f["nbytes"], f["dtype"]), (1, 8192, PAGE, "bfloat16"))
        self.assertEqual((f["size"], f["stride"], f["storage_offset"]), ((4, 8), (1, 4), 3))
        self.assertTrue(f["requires_grad"] and f["parameter"])
        self.assertEqual((f["page"], f["count"], f["block"], f["block_len"]), (PAGE, 4, 5 * PAGE + 4096, 3 * PAGE))

    def test_a_storage_outside_its_block_is_refused_at_the_sender(self):
        with self.assertRaises(ValueError):
            descriptor(ptr=5 * PAGE)  # before the block
        with self.assertRaises(ValueError):
            descriptor(nbytes=3 * PAGE)  # past its end

    def test_anything_else_is_refused_on_arrival(self):
        good = list(descriptor())
        i = {name: k for k, name in enumerate(_share._FIELDS)}

        def bad(**changes):
            d = list(good)
            for k, v in changes.items():
                d[i[k]] = v
            with self.assertRaises(ValueError, msg=str(changes)):
                _share.decode(tuple(d))

        bad(version=_share.VERSION + 1)
        bad(version=_share.VERSION - 1)
        bad(count=0)
        bad(page=0)
        bad(offset=4 * PAGE - 16)            # the storage ends past the pages
        bad(nbytes=-1)
        bad(device=True)                     # not an int
        bad(block=4 * PAGE)                  # the block before its first page
        bad(block_len=4 * PAGE)              # the block past the pages
        bad(offset=0)                        # the storage before the block
        bad(dtype="float32; import os")
        bad(dtype=7)
        bad(size=(4, -8))
        bad(stride=(1,))
        bad(size=[4, 8])
        bad(requires_grad=1)
        with self.assertRaises(ValueError):
            _share.decode(tuple(good[:-1]))
        with self.assertRaises(ValueError):
            _share.decode("not a tuple")

    def test_extent_is_how_far_a_view_reaches(self):
        self.assertEqual(_share.extent((4, 8), (1, 4), 3), 3 + 1 + 3 + 28)
        self.assertEqual(_share.extent((), (), 5), 6)
        self.assertEqual(_share.extent((2, 0), (1, 1), 100), 0)


class FdSlots(unittest.TestCase):
    def run_fresh(self, code, limit=None):
        """``code`` in a fresh interpreter (a descriptor table of its own, never grown), with the
        soft descriptor limit ``limit`` if given; its last line of output."""
        pre = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n" if limit else ""
        out = subprocess.run([sys.executable, "-c", pre + "import sys; sys.path.insert(0, %r)\n" % str(PYTHON) + code],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout.strip().splitlines()[-1]

    def test_the_table_grows_in_one_step_to_the_slots_asked_within_the_limit_opening_nothing(self):
        code = ("import os; from cuvmm import _share\n"
                "n = len(os.listdir('/proc/self/fd')); a = _share.fd_slots(); b = _share.make_fd_slots(2048)\n"
                "print(a, b, _share.fd_slots(), len(os.listdir('/proc/self/fd')) - n)")
        a, b, c, opened = map(int, self.run_fresh(code, limit=4096).split())
        self.assertLess(a, 2048, "a fresh process's table is small")
        self.assertEqual((b, c, opened), (2048, 2048, 0))
        # Never past the soft limit.
        a, b, c, opened = map(int, self.run_fresh(code, limit=512).split())
        self.assertEqual((b, c, opened), (512, 512, 0))


class Transport(unittest.TestCase):
    def tearDown(self):
        # The senders' threads end once their receivers have hung up: descriptor counts in the
        # next test are not disturbed.
        _share.forget_connections()
        wait_until(lambda: not any(t.name == "cuvmm-share-serve" for t in threading.enumerate()))

    def test_pages_arrive_in_order_in_batches_and_nothing_stays_open(self):
        n = 2 * _share.MAX_FDS_PER_MESSAGE + 7
        _share.raise_fd_limit()
        fds = memfds(n)
        before = open_fds()
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _share.send_page_fds(a, fds)
        for fd in fds:
            os.close(fd)
        got = _share.recv_pages(b, n)
        self.assertEqual([os.pread(fd, 16, 0).decode() for fd in got], [str(k) for k in range(n)])
        for fd in got:
            os.close(fd)
        a.close()
        b.close()
        self.assertEqual(open_fds(), before - n)

    def test_a_short_or_foreign_stream_is_refused_without_leaking(self):
        fds = memfds(3)
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _share.send_page_fds(a, fds)
        a.close()
        for fd in fds:
            os.close(fd)
        before = open_fds()
        with self.assertRaises(ValueError):
            _share.recv_pages(b, 5)  # three sent, then the sender hung up
        self.assertEqual(open_fds(), before, "the three received were closed")
        b.close()
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        a.send(b"hello")
        with self.assertRaises(ValueError):
            _share.recv_pages(b, 1)
        a.close()
        b.close()

    def test_a_spawned_process_fetches_the_pages_by_token_and_the_sender_sees_it_let_go(self):
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        handoff = _share.Handoff()
        pages = [memfds(4) for _ in range(3)]
        offers = [offered(handoff, lambda k=k: [os.dup(fd) for fd in pages[k]]) for k in range(3)]
        self.assertEqual(handoff.pending(), 3)
        done = ctx.Event()
        p = ctx.Process(target=child_fetches_pages, args=([o for o, _ in offers], 4, results, done))
        p.start()
        got, leaked, connections, again = results.get(timeout=60)
        self.assertEqual(got, [["0", "1", "2", "3"]] * 3)
        self.assertEqual(leaked, 0, "the child closed what it received")
        self.assertEqual(connections, 1, "one connection to the sender serves every fetch")
        self.assertIn("fetched already", again, "a token serves once")
        for _, released in offers[:2]:
            self.assertTrue(released.wait(10), "released as the receiver says")
        self.assertFalse(offers[2][1].wait(0.3), "held while the receiver lives")
        self.assertEqual((handoff.pending(), handoff.held()), (0, 1))
        done.set()
        p.join(60)
        self.assertTrue(offers[2][1].wait(10), "released when the receiver exits holding it")
        self.assertTrue(wait_until(lambda: handoff.held() == 0))
        handoff.close()
        for fds in pages:
            for fd in fds:
                os.close(fd)

    def test_a_fetch_without_the_token_gets_nothing(self):
        handoff = _share.Handoff()
        (address, token), released = offered(handoff, lambda: [])
        with self.assertRaises(ValueError):
            _share.fetch(address, bytes(16))
        with self.assertRaises(ValueError):
            _share.fetch(address, token[:8])
        with self.assertRaises(ValueError):
            _share.fetch(b"/tmp/elsewhere", token)
        self.assertEqual(handoff.pending(), 1, "the offer is still there for its receiver")
        self.assertFalse(released.is_set())
        fds, claim = _share.fetch(address, token)
        self.assertEqual((fds, handoff.pending()), ([], 0))
        claim.release()
        claim.release()  # once is enough
        self.assertTrue(released.wait(10))
        self.assertTrue(wait_until(lambda: handoff.held() == 0))
        handoff.close()

    def test_pages_are_made_only_for_a_receiver_that_asks_and_a_hold_gets_no_descriptor(self):
        handoff = _share.Handoff()
        made = []
        page_fds = memfds(3)

        def pages(k):
            made.append(k)
            return [os.dup(fd) for fd in page_fds]

        (hit, hit_released), (miss, miss_released) = [offered(handoff, lambda k=k: pages(k)) for k in range(2)]
        self.assertEqual(made, [], "nothing made at the offer")
        with self.assertRaises(ValueError):
            _share.fetch(hit[0], bytes(16))  # the connection (both of its ends here), made first
        before = open_fds()
        claim = _share.hold(*hit)
        self.assertTrue(wait_until(lambda: handoff.pending() == 1), "taken")
        self.assertEqual(made, [], "a receiver that maps the pages already makes the sender make none")
        self.assertEqual(open_fds(), before, "no descriptor opened on either side")
        self.assertFalse(hit_released.wait(0.2), "held while the receiver holds its claim")
        claim.release()
        self.assertTrue(hit_released.wait(10), "let go once released")
        got, claim = _share.fetch(*miss)
        self.assertEqual(made, [1])
        self.assertEqual([os.pread(fd, 1, 0) for fd in got], [b"0", b"1", b"2"])
        for fd in got:
            os.close(fd)
        claim.release()
        self.assertTrue(miss_released.wait(10))
        with self.assertRaises(ValueError):
            _share.fetch(*hit)  # a token serves once, held or fetched
        handoff.close()
        for fd in page_fds:
            os.close(fd)

    def test_a_hold_waits_for_no_answer_and_an_unknown_token_is_reported_at_the_sender(self):
        handoff = _share.Handoff()
        offer, released = offered(handoff)
        claim = _share.hold(*offer, timeout=30)
        self.assertTrue(wait_until(lambda: handoff.held() == 1))
        self.assertEqual(handoff.pending(), 0, "claimed")
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            again = _share.hold(*offer, timeout=30)
            self.assertTrue(wait_until(lambda: "no such offer" in stderr.getvalue()))
        again.release()  # the sender ignores the token it does not hold
        self.assertFalse(released.wait(0.3), "the first claim still holds it")
        claim.release()
        self.assertTrue(released.wait(10))
        self.assertTrue(wait_until(lambda: handoff.held() == 0))
        handoff.close()

    def test_releases_told_later_travel_together(self):
        handoff = _share.Handoff()
        batches = []
        real = handoff._let_go
        handoff._let_go = lambda offers: batches.append(len(offers)) or real(offers)
        offers = [offered(handoff) for _ in range(5)]
        claims = [_share.hold(*o) for o, _ in offers]
        self.assertTrue(wait_until(lambda: handoff.held() == 5))
        for c in claims:
            c.release_later()
        self.assertFalse(any(r.wait(0.2) for _, r in offers), "nothing told before the flush")
        _share.flush_releases()
        self.assertTrue(all(r.wait(10) for _, r in offers))
        self.assertEqual(batches, [5], "one message for the five")
        handoff.close()

    def test_a_receiver_that_will_not_use_an_offer_lets_it_go(self):
        handoff = _share.Handoff()
        offer, released = offered(handoff)
        _share.let_go(*offer)
        self.assertTrue(released.wait(10))
        self.assertEqual((handoff.pending(), handoff.held()), (0, 0))
        handoff.close()

    def test_pages_the_sender_fails_to_make_are_refused_and_the_offer_let_go(self):
        handoff = _share.Handoff()

        def pages():
            raise OSError("no descriptor left")
        offer, released = offered(handoff, pages)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            with self.assertRaisesRegex(ValueError, "could not produce"):
                _share.fetch(*offer)
        self.assertIn("no descriptor left", stderr.getvalue())
        self.assertTrue(released.wait(10), "the sender frees the block")
        self.assertEqual((handoff.pending(), handoff.held()), (0, 0))
        handoff.close()

    def test_a_connection_dropped_after_a_timeout_keeps_what_it_holds_until_released(self):
        handoff = _share.Handoff()
        held, held_released = offered(handoff)
        slow_gate = threading.Event()

        def slow_pages():
            slow_gate.wait(30)
            return []
        slow, slow_released = offered(handoff, slow_pages)
        claim = _share.hold(*held)
        with self.assertRaises(TimeoutError):
            _share.fetch(*slow, timeout=0.5)
        self.assertEqual(len(_share._connections), 0, "nobody asks on it again")
        self.assertFalse(held_released.wait(0.3), "what the dropped connection holds stays held")
        slow_gate.set()
        self.assertTrue(slow_released.wait(10), "what the sender took after the timeout is let go")
        self.assertFalse(held_released.is_set())
        conn = claim._conn
        claim.release()
        self.assertTrue(held_released.wait(10))
        self.assertEqual(conn.sock.fileno(), -1, "closed once it holds nothing")
        self.assertTrue(wait_until(lambda: handoff.held() == 0))
        handoff.close()

    def test_a_fetch_takes_the_rest_of_its_group_in_the_same_answer(self):
        handoff = _share.Handoff()
        answers = answered(handoff)
        page_fds = memfds(8)

        def pages(k):
            return [os.dup(page_fds[2 * k]), os.dup(page_fds[2 * k + 1])]

        group = [handoff.offer(threading.Event().set, lambda k=k: pages(k), "one pickle") for k in range(3)]
        other = handoff.offer(threading.Event().set, lambda: pages(3), "another")
        loose, _ = offered(handoff, lambda: pages(3))
        fds, claims = [], []
        for address, token in group:
            got, claim = _share.fetch(address, token)
            fds.append([os.pread(fd, 1, 0) for fd in got])
            for fd in got:
                os.close(fd)
            claims.append(claim)
        self.assertEqual(fds, [[b"0", b"1"], [b"2", b"3"], [b"4", b"5"]], "each offer its own pages")
        # One message answered: the first fetch; its group came along. (An answer is counted just
        # after it is sent: waited for.)
        self.assertTrue(wait_until(lambda: len(answers) == 1 and handoff.held() == 3))
        self.assertEqual(len(answers), 1, "one round trip for the group")
        self.assertEqual(handoff.pending(), 2, "offers of another group, or of none, stay offered")
        got, claim = _share.fetch(*other)
        for fd in got:
            os.close(fd)
        claims.append(claim)
        for c in claims:
            c.release()
        self.assertTrue(wait_until(lambda: handoff.held() == 0))
        _share.let_go(*loose)
        handoff.close()
        for fd in page_fds:
            os.close(fd)

    def test_an_offer_taken_along_is_held_or_let_go_without_a_message(self):
        handoff = _share.Handoff()
        answers = answered(handoff)
        events, offers, first = group_fetched(handoff, 3)
        along = taken_along_files()
        self.assertEqual(len(along), 2)
        held = _share.hold(*offers[1])  # (the receiver maps those pages already)
        _share.let_go(*offers[2])
        self.assertEqual(still_open(along), set(), "the descriptors taken along are closed")
        self.assertTrue(events[2].wait(10), "let go")
        self.assertTrue(wait_until(lambda: len(answers) == 2), "the release: the one message after the fetch")
        self.assertFalse(events[1].wait(0.2), "held until released")
        held.release()
        first.release()
        self.assertTrue(events[0].wait(10) and events[1].wait(10))
        handoff.close()

    def test_offers_taken_along_and_never_asked_for_are_let_go(self):
        handoff = _share.Handoff()
        events, offers, first = group_fetched(handoff, 3)
        along = taken_along_files()
        self.assertEqual(len(along), 2)
        self.assertFalse(events[1].wait(0.2), "held for the receiver while it may still ask")
        saved = _share.ALONG_FOR
        _share.ALONG_FOR = 0.0
        try:
            time.sleep(0.01)
            unrelated, released = offered(handoff)
            _share.hold(*unrelated).release()  # any later call lets the stale ones go
        finally:
            _share.ALONG_FOR = saved
        self.assertTrue(events[1].wait(10) and events[2].wait(10) and released.wait(10))
        self.assertFalse(events[0].is_set(), "the one asked for is still held")
        first.release()
        self.assertTrue(events[0].wait(10))
        self.assertEqual(still_open(along), set(), "the descriptors taken along closed")
        handoff.close()

    def test_an_offer_of_the_group_whose_pages_fail_is_not_taken_along(self):
        handoff = _share.Handoff()
        tries = []

        def failing():
            tries.append(1)
            raise OSError("no descriptor left")
        events = [threading.Event() for _ in range(2)]
        good = handoff.offer(events[0].set, lambda: memfds(1), "g")
        bad = handoff.offer(events[1].set, failing, "g")
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            got, claim = _share.fetch(*good)
            for fd in got:
                os.close(fd)
            self.assertEqual(handoff.pending(), 1, "offered again")
            with self.assertRaisesRegex(ValueError, "could not produce"):
                _share.fetch(*bad)
        self.assertEqual(len(tries), 2, "tried along, then for its own fetch")
        self.assertTrue(events[1].wait(10), "refused and let go at its own fetch")
        claim.release()
        self.assertTrue(events[0].wait(10))
        handoff.close()

    def test_a_failing_release_does_not_keep_the_others(self):
        handoff = _share.Handoff()

        def failing():
            raise RuntimeError("injected")
        bad = handoff.offer(failing)
        good, good_released = offered(handoff)
        claims = [_share.hold(*bad), _share.hold(*good)]
        self.assertTrue(wait_until(lambda: handoff.held() == 2))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            for c in claims:
                c.release_later()
            _share.flush_releases()
            self.assertTrue(good_released.wait(10))
        self.assertIn("RuntimeError: injected", err.getvalue())
        self.assertTrue(wait_until(lambda: handoff.held() == 0))
        handoff.close()


def ask(out, address, token):
    """Connects to a Handoff and asks for ``token``; prints the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(address)
        s.settimeout(10)
        try:
            s.send(token)
            answer = s.recv(2)
        except (BrokenPipeError, ConnectionResetError):  # hung up on before or after the token
            answer = b""
        print(repr(answer), file=out)


def reap(pid):
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def an_address(pid=None):
    return b"\0cuvmm-share-%d-%s" % (pid or os.getpid(), secrets.token_hex(8).encode())


class FakeSender:
    """Listens on ``address`` in this process: answers each token with a socket when ``answer``,
    else holds the connection without a word (a stalled sender). ``got_token`` is set once one came."""

    def __init__(self, address, answer):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(address)
        self.listener.listen(4)
        self.address, self.answer = address, answer
        self.got_token = threading.Event()
        self.conns = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        self.conns.append(conn)
        while True:
            try:
                token = conn.recv(17)
            except OSError:
                return
            if not token:
                return
            self.got_token.set()
            if self.answer:
                conn.send(_share._OFFERED + _share._COUNT.pack(0))

    def close(self):
        self.listener.close()
        for c in self.conns:
            c.close()


def an_offer():
    handoff = _share.Handoff()
    return handoff, handoff.offer(lambda: None)


class Trust(unittest.TestCase):
    def tearDown(self):
        _share.forget_connections()

    @unittest.skipUnless(os.geteuid() == 0, "needs root, to run a process as another user")
    def test_another_user_answering_on_the_address_gets_no_token_and_gives_no_memory(self):
        # The sender has gone; a process of another user has taken its abstract name.
        address = an_address(pid=os.getpid())
        pid, said = as_nobody(squat, address)
        with said:
            self.assertEqual(said.readline().strip(), "ready")
            with self.assertRaises(PermissionError) as e:
                _share.fetch(address, bytes(16), timeout=10)
            self.assertIn(f"uid {NOBODY}", str(e.exception))
            self.assertEqual(said.readline().strip(), "no token")
        self.assertEqual(reap(pid), 0)
        self.assertEqual(len(_share._connections), 0, "nothing kept of it")

    @unittest.skipUnless(os.geteuid() == 0, "needs root, to run a process as another user")
    def test_a_receiver_of_another_user_is_refused_by_the_sender(self):
        handoff, (address, token) = an_offer()
        pid, said = as_nobody(ask, address, token)
        with said:
            self.assertEqual(said.read().strip(), "b''", "hung up on")
        self.assertEqual(reap(pid), 0)
        self.assertEqual(handoff.pending(), 1, "still offered, to its receiver")
        _share.fetch(address, token, timeout=10)[1].release()
        handoff.close()

    @unittest.skipUnless(os.geteuid() == 0, "needs root, to set real and effective uids apart")
    def test_same_user_means_the_effective_uid_on_both_sides(self):
        # As a set-uid-root program runs (real uid nobody, effective root), a process fetches
        # from itself: both sides see effective uid 0 and accept each other.
        code = (f"import os, socket, sys; sys.path.insert(0, {str(HERE.parents[1] / 'python')!r}); "
                "from cuvmm import _share; os.setresuid(65534, 0, 0); h = _share.Handoff(); "
                "_share.fetch(*h.offer(lambda: None), timeout=10)[1].release(); print('fetched')")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        self.assertEqual(out.stdout.strip(), "fetched", out.stderr)

    def test_another_process_of_this_user_answering_on_the_address_gets_no_token(self):
        # The name says pid 1; this process answers.
        sender = FakeSender(an_address(pid=1), answer=True)
        with self.assertRaises(PermissionError) as e:
            _share.fetch(sender.address, bytes(16), timeout=10)
        self.assertIn(f"pid {os.getpid()}", str(e.exception))
        self.assertFalse(sender.got_token.wait(0.2))
        sender.close()
        self.assertEqual(_share._own_pid(os.getpid()), os.getpid(), "the pid in our own namespace")

    def test_an_address_that_names_no_process_is_refused(self):
        for bad in (b"\0cuvmm-share-0-0123456789abcdef", b"\0cuvmm-share-x-0123456789abcdef",
                    b"\0cuvmm-share-12-short", b"\0cuvmm-share-12-0123456789abcdef\0"):
            with self.assertRaises(ValueError, msg=bad):
                _share.fetch(bad, bytes(16), timeout=1)


class Liveness(unittest.TestCase):
    def tearDown(self):
        _share.forget_connections()

    def test_a_stalled_sender_times_out_clearly_and_blocks_no_other_sender(self):
        stalled = FakeSender(an_address(), answer=False)
        handoff, offer = an_offer()
        errors = []

        def fetch_stalled():
            try:
                _share.fetch(stalled.address, bytes(16), timeout=3)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=fetch_stalled)
        t.start()
        self.assertTrue(stalled.got_token.wait(10), "the stalled fetch is waiting for its answer")
        t0 = time.monotonic()
        _share.fetch(*offer, timeout=10)[1].release()
        self.assertLess(time.monotonic() - t0, 2, "another sender answers at once")
        t.join(20)
        self.assertEqual([type(e) for e in errors], [TimeoutError])
        self.assertIn("did not answer within 3", str(errors[0]))
        self.assertNotIn(stalled.address, _share._connections, "a connection out of step is not kept")
        stalled.close()
        handoff.close()

    def test_a_claim_waits_for_no_answer(self):
        silent = FakeSender(an_address(), answer=False)
        t0 = time.monotonic()
        mine = _share.hold(silent.address, bytes(16), timeout=5)
        self.assertLess(time.monotonic() - t0, 2, "sent, not answered")
        self.assertTrue(silent.got_token.wait(10))
        with self.assertRaises(TimeoutError):
            _share.fetch(silent.address, bytes(16), timeout=1)  # where a fetch waits for one
        mine.release()
        silent.close()
        _share.forget_connections()

    def test_a_fetch_waiting_its_turn_on_a_connection_dropped_meanwhile_connects_again(self):
        stalled = FakeSender(an_address(), answer=False)
        errors = {}

        def fetch(name, timeout):
            try:
                _share.fetch(stalled.address, bytes(16), timeout=timeout)
            except BaseException as e:
                errors[name] = e

        first = threading.Thread(target=fetch, args=("first", 1))
        first.start()
        self.assertTrue(stalled.got_token.wait(10))
        second = threading.Thread(target=fetch, args=("second", 2.5))  # waits for the first's turn
        second.start()
        first.join(20)
        second.join(20)
        self.assertIsInstance(errors["first"], TimeoutError)
        self.assertIsInstance(errors["second"], TimeoutError, "asked again on a new connection, not a closed one")
        self.assertIn("did not answer", str(errors["second"]))
        stalled.close()

    def test_a_fork_while_a_thread_waits_for_a_sender_leaves_a_working_child(self):
        stalled = FakeSender(an_address(), answer=False)
        handoff = _share.Handoff()
        held, hold = threading.Event(), threading.Event()

        def hold_handoff_lock():  # as a thread of the parent may at the moment of the fork
            with handoff._lock:
                held.set()
                hold.wait(30)

        waiter = threading.Thread(target=lambda: self.assertRaises(
            TimeoutError, _share.fetch, stalled.address, bytes(16), timeout=4))
        waiter.start()
        holder = threading.Thread(target=hold_handoff_lock)
        holder.start()
        self.assertTrue(stalled.got_token.wait(10) and held.wait(10))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: we mean it
            pid = os.fork()
        if pid == 0:  # the child: what cuvmm.torch's at-fork hook does, then a fetch of its own
            try:
                _share.forget_connections()
                handoff.close()
                h = _share.Handoff()
                _share.fetch(*h.offer(lambda: None), timeout=5)[1].release()
                os._exit(0)
            except BaseException:
                os._exit(1)
        hold.set()
        deadline = time.monotonic() + 15
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            self.fail("the child hung after the fork")
        self.assertEqual(os.waitstatus_to_exitcode(done[1]), 0, "the child fetched on its own")
        waiter.join(20)
        holder.join(20)
        stalled.close()
        handoff.close()

    def test_the_accept_thread_survives_an_exception(self):
        handoff, offer = an_offer()
        real = _share.peer_credentials
        failed = []

        def failing_once(sock):
            if threading.current_thread().name == "cuvmm-share-handoff" and not failed:
                failed.append(True)
                raise RuntimeError("injected")
            return real(sock)

        _share.peer_credentials = failing_once
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                with self.assertRaises((ValueError, ConnectionError)):  # this connection was dropped
                    _share.fetch(*offer, timeout=10)
                _share.fetch(*offer, timeout=10)[1].release()
        finally:
            _share.peer_credentials = real
        self.assertIn("RuntimeError: injected", err.getvalue())
        self.assertEqual(handoff.pending(), 0)
        handoff.close()


if __name__ == "__main__":
    unittest.main()
