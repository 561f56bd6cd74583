#!/usr/bin/env python3
"""How cuvmm.torch sends a tensor to another process, without a GPU or PyTorch: the descriptor's
encoding and the checks on arrival, the page descriptors' transport over a socket pair handed to
a spawned process fetching them by token over one connection (Handoff), and the sender learning that the receiver let go.

    python3 cuvmm-capi/tests/python/test_share.py
"""

import multiprocessing
import os
import socket
import sys
import threading
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))

from cuvmm import _share  # noqa: E402

PAGE = 2 << 20


def descriptor(**kw):
    args = dict(device=1, block=5 * PAGE + 4096, block_len=3 * PAGE, first_page=5 * PAGE, page=PAGE,
                count=4, ptr=5 * PAGE + 8192, nbytes=PAGE, dtype="bfloat16", size=(4, 8), stride=(1, 4),
                storage_offset=3, requires_grad=True, parameter=True)
    args.update(kw)
    return _share.encode(**args)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def memfds(n):
    out = []
    for i in range(n):
        fd = os.memfd_create(f"page{i}")
        os.write(fd, str(i).encode())
        out.append(fd)
    return out


def child_fetches_pages(offers, count, results):
    """In a spawned process: fetch each offered socket, read its page descriptors, check each is
    the page it should be, ask for the first again, report, and hang up."""
    before = open_fds()
    got = []
    for address, token in offers:
        sock = _share.fetch(address, token)
        fds = _share.recv_pages(sock, count)
        got.append([os.pread(fd, 16, 0).decode() for fd in fds])
        for fd in fds:
            os.close(fd)
        sock.close()
    try:
        _share.fetch(*offers[0])
        again = "fetched twice"
    except ValueError as e:
        again = str(e)
    connections = len(_share._connections)
    _share.forget_connections()
    results.put((got, open_fds() - before, connections, again))


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

        bad(version=2)
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


class Transport(unittest.TestCase):
    def test_pages_arrive_in_order_in_batches_and_nothing_stays_open(self):
        n = 2 * _share.MAX_FDS_PER_MESSAGE + 7
        _share.raise_fd_limit()
        fds = memfds(n)
        before = open_fds()
        keep, give = _share.send_pages(fds)
        for fd in fds:
            os.close(fd)
        got = _share.recv_pages(give, n)
        self.assertEqual([os.pread(fd, 16, 0).decode() for fd in got], [str(k) for k in range(n)])
        for fd in got:
            os.close(fd)
        keep.close()
        give.close()
        self.assertEqual(open_fds(), before - n)

    def test_a_short_or_foreign_stream_is_refused_without_leaking(self):
        fds = memfds(3)
        keep, give = _share.send_pages(fds)
        for fd in fds:
            os.close(fd)
        before = open_fds()
        with self.assertRaises(ValueError):
            _share.recv_pages(give, 5)  # three sent, then the sender's end shut
        self.assertEqual(open_fds(), before, "the three received were closed")
        keep.close()
        give.close()
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
        offers = []
        keeps = []
        released = [threading.Event() for _ in range(3)]
        releases = _share.Releases()
        pages = []
        for k in range(3):
            fds = memfds(4)
            pages.append(fds)
            keep, give = _share.send_pages(fds)
            releases.register(keep, released[k].set)
            keeps.append(keep)
            offers.append(handoff.offer(give))
        self.assertEqual(handoff.pending(), 3)
        p = ctx.Process(target=child_fetches_pages, args=(offers, 4, results))
        p.start()
        got, leaked, connections, again = results.get(timeout=60)
        self.assertEqual(got, [["0", "1", "2", "3"]] * 3)
        self.assertEqual(leaked, 0, "the child closed what it received")
        self.assertEqual(connections, 1, "one connection to the sender serves every fetch")
        self.assertIn("fetched already", again, "a token serves once")
        for e in released:
            self.assertTrue(e.wait(10), "the sender learns the receiver hung up, the Process object alive")
        self.assertEqual(releases.pending(), 0)
        self.assertEqual(handoff.pending(), 0, "the sender's copy of each offered end is closed")
        self.assertTrue(all(k.fileno() == -1 for k in keeps), "the sender's ends are closed once told")
        p.join(60)
        handoff.close()
        for fds in pages:
            for fd in fds:
                os.close(fd)

    def test_a_fetch_without_the_token_gets_nothing(self):
        handoff = _share.Handoff()
        a, b = socket.socketpair()
        address, token = handoff.offer(b)
        with self.assertRaises(ValueError):
            _share.fetch(address, bytes(16))
        with self.assertRaises(ValueError):
            _share.fetch(address, token[:8])
        with self.assertRaises(ValueError):
            _share.fetch(b"/tmp/elsewhere", token)
        self.assertEqual(handoff.pending(), 1, "the offer is still there for its receiver")
        got = _share.fetch(address, token)
        got.send(b"x")
        self.assertEqual(a.recv(1), b"x", "the offered socket itself")
        got.close()
        a.close()
        handoff.close()
        _share.forget_connections()

    def test_the_sender_is_not_told_while_the_receiver_holds_on(self):
        fds = memfds(1)
        keep, give = _share.send_pages(fds)
        os.close(fds[0])
        released = threading.Event()
        releases = _share.Releases()
        releases.register(keep, released.set)
        self.assertFalse(released.wait(0.3))
        give.close()
        self.assertTrue(released.wait(10))


if __name__ == "__main__":
    unittest.main()
