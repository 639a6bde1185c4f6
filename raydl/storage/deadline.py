"""A total deadline for one blocking request: when it passes, the request's socket is shut down.

A socket timeout bounds one recv, not a request: a peer that sends a byte every
half second keeps every recv under any timeout and a 12-byte read going for
minutes. Here each try of a request runs inside `deadline(seconds)`;
the connection it runs on registers itself (`bind_current`, called by the
storage's connection class), and one watchdog thread per process shuts that
connection's socket down (`shutdown(SHUT_RDWR)`) the moment the deadline
passes. On Linux a shutdown wakes a recv blocked in another thread at once
(a close from another thread does not); the fd stays open until its owner
closes it, so no other socket can take its number meanwhile. The owner then
sees the connection end, its HTTP client discards the connection, and the
try fails: `Attempt.expired` says it was the deadline.
"""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Attempt", "bind_current", "current", "deadline"]

_local = threading.local()
_GRAIN_S = 0.01  # how late past its deadline a try may be cut off


class Attempt:
    """One try's deadline (time.monotonic()), and the connection it runs on once bound."""

    __slots__ = ("_conn", "_lock", "done", "expired", "limit_s", "when")

    def __init__(self, when: float, limit_s: float) -> None:
        self.when = when
        self.limit_s = limit_s
        self.expired = False
        self.done = False
        self._conn = None
        self._lock = threading.Lock()

    def bind(self, conn) -> None:
        """`conn` (anything with a `.sock`) carries this try; shut it down now if the deadline has passed."""
        with self._lock:
            self._conn = conn
            if self.expired and not self.done:
                _shutdown(conn)

    def expire(self) -> None:
        """The deadline passed (the watchdog): shut the bound connection down, if the try is still running."""
        with self._lock:
            if self.done:
                return
            self.expired = True
            if self._conn is not None:
                _shutdown(self._conn)

    def finish(self) -> None:
        with self._lock:
            self.done = True
            self._conn = None


def _shutdown(conn) -> None:
    sock = getattr(conn, "sock", None)
    if sock is None:
        return  # still connecting: bind() after the connect shuts it down
    try:
        # socket.socket's own shutdown, also for an SSLSocket (whose override would drop its SSL state under
        # a read in flight in the owner's thread)
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its owner


class _Watchdog:
    """One daemon thread: expires each watched Attempt at its deadline."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Attempt]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="raydl-deadlines", daemon=True).start()

    def watch(self, attempt: Attempt) -> None:
        with self._cond:
            heapq.heappush(self._heap, (attempt.when, next(self._seq), attempt))
            if self._heap[0][2] is attempt:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    # a little late on purpose: tries that ended long ago are dropped in batches, not one
                    # wake-up each (a loader makes thousands of requests a second)
                    self._cond.wait(wait + _GRAIN_S)
                    continue
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
            for attempt in due:
                attempt.expire()  # outside the heap's lock: it takes the attempt's


_watchdogs: dict[int, _Watchdog] = {}  # by pid: a forked child starts its own thread
_watchdogs_lock = threading.Lock()


def _watchdog() -> _Watchdog:
    pid = os.getpid()
    dog = _watchdogs.get(pid)
    if dog is None:
        with _watchdogs_lock:
            dog = _watchdogs.get(pid)
            if dog is None:
                dog = _watchdogs[pid] = _Watchdog()
    return dog


@contextmanager
def deadline(seconds: float) -> Iterator[Attempt]:
    """Run a try that must end within `seconds`: connections bound in this thread meanwhile are shut down
    when they pass."""
    attempt = Attempt(time.monotonic() + seconds, seconds)
    outer = getattr(_local, "attempt", None)
    _local.attempt = attempt
    _watchdog().watch(attempt)
    try:
        yield attempt
    finally:
        attempt.finish()
        _local.attempt = outer


def current() -> Attempt | None:
    """The try this thread is running under `deadline()`, if any."""
    return getattr(_local, "attempt", None)


def bind_current(conn) -> None:
    """Called by a connection as it starts a request (and after it connects): the current try, if any,
    watches it."""
    attempt = current()
    if attempt is not None:
        attempt.bind(conn)
