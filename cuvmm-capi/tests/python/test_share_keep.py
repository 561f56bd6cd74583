#!/usr/bin/env python3
"""The mappings a receiver keeps between hand-offs of the same pages (cuvmm._share_keep), without
a GPU or PyTorch: keys, reuse, the budget on idle mappings, and senders that exited.

    python3 cuvmm-capi/tests/python/test_share_keep.py
"""

import os
import struct
import sys
import time
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from cuvmm._share_keep import Kept, budget_from_env, sender_pid  # noqa: E402

PAGE = 2 << 20


def S(*serials):
    """Page serials as a sender names them."""
    return struct.pack(f"={len(serials)}Q", *serials)
ME = b"\0cuvmm-share-%d-00ff" % os.getpid()


class Mapping:
    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def exited_pid():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


class KeptMappings(unittest.TestCase):
    def test_budget_and_address(self):
        self.assertIsNone(budget_from_env(None), "unset: the default")
        self.assertIsNone(budget_from_env(" "))
        self.assertEqual(budget_from_env("0"), 0)
        self.assertEqual(budget_from_env("4096"), 4096)
        self.assertEqual(budget_from_env("16GiB"), 16 << 30)
        self.assertEqual(budget_from_env("16G"), 16 << 30, "the sizes CUVMM_ALLOC_CONF takes")
        self.assertEqual(budget_from_env(" 3 MiB "), 3 << 20)
        for bad in ("-1", "1.5GiB", "2GB", "lots"):
            with self.assertRaises(ValueError):
                budget_from_env(bad)
        self.assertEqual(sender_pid(ME), os.getpid())
        self.assertIsNone(sender_pid(b"\0elsewhere"))

    def test_an_unset_budget_is_the_default_asked_once_when_first_needed(self):
        asked = []

        def default():
            asked.append(1)
            return 5 * PAGE
        k = Kept(None, default)
        self.assertEqual(asked, [], "not at import")
        self.assertIsNotNone(k.key(ME, 0, PAGE, 1, S(7), []), "kept by default")
        self.assertEqual((k.budget, len(asked)), (5 * PAGE, 1))
        self.assertIsNone(Kept(0, default).key(ME, 0, PAGE, 1, S(7), []), "0: none kept")

    def test_keys_name_the_sender_pages_and_peers_and_refuse_bad_serials(self):
        k = Kept(1 << 30)
        self.assertIsNone(Kept(0).key(ME, 0, PAGE, 2, S(5, 6), []), "nothing kept without a budget")
        self.assertIsNone(k.key(ME, 0, PAGE, 2, b"", []), "a sender that named no pages")
        self.assertIsNone(k.key(ME, 0, PAGE, 2, None, []))
        a = k.key(ME, 0, PAGE, 2, S(5, 6), [1])
        self.assertNotEqual(a, k.key(ME, 0, PAGE, 2, S(6, 5), [1]), "order matters")
        self.assertNotEqual(a, k.key(ME, 0, PAGE, 2, S(5, 6), []), "peers matter")
        self.assertNotEqual(a, k.key(ME + b"x", 0, PAGE, 2, S(5, 6), [1]), "another sender")
        for bad in (S(5), [5, 6], S(5, 6)[:-1], S(5, 6, 7), 7, "ab"):
            with self.assertRaises(ValueError):
                k.key(ME, 0, PAGE, 2, bad, [])

    def test_a_mapping_in_use_is_kept_and_idle_ones_past_the_budget_go_oldest_first(self):
        k = Kept(3 * PAGE)
        maps = [Mapping() for _ in range(3)]
        keys = [k.key(ME, 0, PAGE, 2, S(10 * i + 1, 10 * i + 2), []) for i in range(3)]
        self.assertIsNone(k.take(keys[0]))
        for key, m in zip(keys, maps):
            self.assertTrue(k.add(key, m, 2 * PAGE))
        self.assertFalse(k.add(keys[0], Mapping(), 2 * PAGE), "kept once")
        self.assertIs(k.take(keys[0]), maps[0])
        k.put_back(keys[0])
        self.assertEqual((k.idle_bytes(), maps[0].released), (0, 0), "still in use once")
        k.put_back(keys[0])
        k.put_back(keys[1])
        self.assertEqual(k.idle_bytes(), 4 * PAGE - 2 * PAGE)
        self.assertEqual([m.released for m in maps], [0, 1, 0], "the least recently used idle one went")
        self.assertIsNone(k.take(keys[1]))
        k.put_back(keys[2])
        self.assertEqual([m.released for m in maps], [0, 1, 1], "taken last before the first one")
        self.assertIs(k.take(keys[0]), maps[0], "reused, busy again")
        self.assertEqual(k.idle_bytes(), 0)

    def test_releasing_the_idle_mappings_leaves_those_in_use(self):
        k = Kept(1 << 40)
        busy, idle = Mapping(), Mapping()
        kb, ki = k.key(ME, 0, PAGE, 1, S(1), []), k.key(ME, 0, PAGE, 2, S(2, 3), [])
        k.add(kb, busy, PAGE)
        k.add(ki, idle, 2 * PAGE)
        k.put_back(ki)
        self.assertEqual(k.release_idle(), 2 * PAGE)
        self.assertEqual((busy.released, idle.released, k.idle_bytes()), (0, 1, 0))
        self.assertIsNone(k.take(ki), "gone")
        self.assertIs(k.take(kb), busy, "still kept")

    def test_a_sender_is_looked_at_once_however_many_of_its_mappings_are_idle(self):
        def looked_at(k):
            for i in range(50):
                key = k.key(ME, 0, PAGE, 1, S(i + 1), [])
                k.add(key, Mapping(), PAGE)
                k.put_back(key)
            looked = []
            real = os.kill
            os.kill = lambda pid, sig: looked.append(pid) or real(pid, sig)
            try:
                k.trim()
            finally:
                os.kill = real
            return looked

        self.assertEqual(looked_at(Kept(1 << 40, watch_exits=False)), [os.getpid()])
        self.assertEqual(looked_at(Kept(1 << 40)), [], "a watched sender's exit is told, not looked for")

    def test_a_sender_that_exits_has_its_idle_mappings_released_with_nothing_else_happening(self):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.read(r, 1)  # until told
            os._exit(0)
        os.close(r)
        k = Kept(1 << 40)
        key = k.key(b"\0cuvmm-share-%d-00ff" % pid, 0, PAGE, 1, S(4), [])
        m = Mapping()
        k.add(key, m, PAGE)
        k.put_back(key)
        self.assertEqual(m.released, 0, "its sender lives")
        os.close(w)
        os.waitpid(pid, 0)
        deadline = time.monotonic() + 10
        while not m.released and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(m.released, 1, "released once the sender exited, no hand-off needed")
        self.assertEqual(k._watch.watched(), 0, "no longer watched")

    def test_the_idle_mappings_of_a_sender_that_exited_are_released(self):
        k = Kept(1 << 40)
        gone = b"\0cuvmm-share-%d-00ff" % exited_pid()
        m, live = Mapping(), Mapping()
        key = k.key(gone, 0, PAGE, 1, S(3), [])
        k.add(key, m, PAGE)
        k.trim()
        self.assertEqual(m.released, 0, "in use")
        k.add(k.key(ME, 0, PAGE, 1, S(3), []), live, PAGE)
        k.put_back(k.key(ME, 0, PAGE, 1, S(3), []))
        k.put_back(key)
        self.assertEqual((m.released, live.released), (1, 0))
        self.assertEqual(k.idle_bytes(), PAGE)


if __name__ == "__main__":
    unittest.main()
