"""raydl.bench.latency_proxy: what it counts as waiting is what a client keeps in flight, seen from the wire."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from raydl.bench.latency_proxy import LatencyProxy

pytestmark = pytest.mark.timeout(30)

DELAY_S = 0.05


class _Upstream:
    """A server on 127.0.0.1 that answers each chunk it receives with b"ok", noting how many chunks the proxy
    counted as waiting at the moment the chunk reached it; or, with `hold`, keeps each connection unread
    until `drop()` closes them."""

    def __init__(self, *, hold: bool = False) -> None:
        self.proxy: LatencyProxy | None = None
        self.waiting_seen: list[int] = []
        self.hold = hold
        self.held: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self.hold:
                self.held.append(conn)
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            while conn.recv(1 << 16):
                self.waiting_seen.append(self.proxy.waiting)
                conn.sendall(b"ok")

    def drop(self) -> None:
        for conn in self.held:
            conn.close()

    def close(self) -> None:
        self._listener.close()
        self.drop()


def _wait_for(condition, what: str, limit_s: float = 10.0) -> None:
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_a_serial_client_is_one_request_waiting_and_none_once_it_is_sent():
    """A request stops counting when its delay is over, before it is forwarded: by the time the server has
    it (and so before its reply and the client's next request), it no longer counts, so a client that waits
    for each reply is seen with one request in flight at most."""
    upstream = _Upstream()
    try:
        with LatencyProxy("127.0.0.1", upstream.port, delay_s=DELAY_S) as proxy:
            upstream.proxy = proxy
            with socket.create_connection(("127.0.0.1", proxy.port)) as client:
                for i in range(10):
                    client.sendall(b"GET %d" % i)
                    assert client.recv(16) == b"ok"
            assert upstream.waiting_seen == [0] * 10
            assert proxy.peak_waiting == 1
    finally:
        upstream.close()


def test_chunks_of_a_connection_that_failed_stop_counting():
    """A chunk whose forwarding fails (the server closed the connection), and those queued behind it, are no
    longer waiting: the count goes back to zero rather than carrying them into the next measurement."""
    upstream = _Upstream(hold=True)
    try:
        with LatencyProxy("127.0.0.1", upstream.port, delay_s=1.0) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port)) as client:
                for i in range(3):
                    client.sendall(b"x" * 100)
                    # one chunk at a time, each read by the proxy before the next is sent
                    _wait_for(lambda n=i + 1: proxy.waiting == n, f"chunk {i + 1} never counted as waiting")
                _wait_for(lambda: len(upstream.held) == 1, "the proxy never connected upstream")
                upstream.drop()  # before the first chunk is due: its forwarding fails
                _wait_for(lambda: proxy.waiting == 0, f"{proxy.waiting} chunk(s) still counted as waiting")
            assert proxy.peak_waiting == 3
            proxy.reset_peak()
            assert proxy.peak_waiting == 0
    finally:
        upstream.close()
