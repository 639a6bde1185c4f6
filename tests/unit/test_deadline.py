"""raydl.storage.deadline: a try's deadline shuts its bound connection's socket down, waking a blocked recv."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from raydl.storage import deadline

pytestmark = pytest.mark.timeout(30)


class _Conn:
    """What a connection class offers the watchdog: a `.sock` (None until connected)."""

    def __init__(self, sock=None) -> None:
        self.sock = sock


def test_a_recv_blocked_on_a_silent_peer_returns_at_the_deadline():
    """A recv on a socket whose peer sends nothing returns (EOF) when the try's deadline passes, not before: the
    watchdog shut the socket down. (How late past it, on a loaded machine, is for a benchmark to say.)"""
    a, b = socket.socketpair()
    with a, b:
        t0 = time.monotonic()
        with deadline.deadline(0.3) as attempt:
            deadline.bind_current(_Conn(a))
            got = a.recv(10)  # would block forever: only the watchdog's shutdown ends it
        took = time.monotonic() - t0
        assert got == b"" and attempt.expired
        assert took > 0.25


def test_a_try_that_ends_in_time_leaves_its_socket_alone():
    """A try that finishes before its deadline is never expired, and the socket it used keeps working after."""
    a, b = socket.socketpair()
    with a, b:
        with deadline.deadline(2.0) as attempt:  # long beside a busy machine's scheduling delays
            deadline.bind_current(_Conn(a))
            b.sendall(b"hi")
            assert a.recv(2) == b"hi"
        # The watchdog expires tries in deadline order: once a later try's socket is shut down, it has passed
        # this one's deadline too
        c, d = socket.socketpair()
        with c, d:
            with deadline.deadline(2.1) as later:
                deadline.bind_current(_Conn(c))
                assert c.recv(1) == b"" and later.expired
        assert not attempt.expired and deadline.current() is None
        b.sendall(b"again")
        assert a.recv(5) == b"again"


def test_a_deadline_that_passes_while_connecting_shuts_the_connection_down_once_connected():
    """Bound before it has a socket (connecting), the connection is shut down the moment it binds again with one."""
    a, b = socket.socketpair()
    with a, b:
        conn = _Conn()
        with deadline.deadline(0.05) as attempt:
            deadline.bind_current(conn)
            end = time.monotonic() + 10
            while not attempt.expired:  # the deadline passes with no socket to shut down
                assert time.monotonic() < end, "the watchdog never expired a 0.05 s deadline"
                time.sleep(0.01)
            conn.sock = a
            deadline.bind_current(conn)  # what the connection class does after its connect
            assert a.recv(1) == b""


def test_many_threads_each_get_their_own_deadline():
    """Tries on 8 threads with deadlines from 0.1 to 0.8 s each end at their own, not at another's."""
    took: dict[int, float] = {}

    def run(i: int) -> None:
        a, b = socket.socketpair()
        with a, b:
            t0 = time.monotonic()
            with deadline.deadline(0.1 * (i + 1)):
                deadline.bind_current(_Conn(a))
                a.recv(1)
            took[i] = time.monotonic() - t0

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(took) == list(range(8))
    for i, t in took.items():
        assert 0.1 * (i + 1) - 0.02 < t < 0.1 * (i + 1) + 1.0, (i, t)
