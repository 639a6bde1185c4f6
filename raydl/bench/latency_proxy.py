"""A TCP proxy that adds latency to every request: a stand-in for a far-away object store.

Each chunk a client sends is forwarded `delay_s` after it arrived (a timed
queue, so the delay is added latency, not a throughput limit), and replies
come back at once. An HTTP client that keeps its connections alive sends one
request per chunk, so each request takes `delay_s` longer, as across a WAN.
Used by the S3 tests (the latency-hiding check) and `raydl bench storage`.

    with LatencyProxy("127.0.0.1", 9000, delay_s=0.05) as proxy:
        boto3.client("s3", endpoint_url=proxy.url)
"""

from __future__ import annotations

import queue
import socket
import threading
import time

__all__ = ["LatencyProxy"]

_CHUNK = 1 << 16


class LatencyProxy:
    """Listens on 127.0.0.1:<free port> and forwards to (host, port) with `delay_s` added per request."""

    def __init__(self, host: str, port: int, *, delay_s: float = 0.0) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        self.upstream = (host, port)
        self.delay_s = delay_s
        self.connections = 0  # accepted so far
        # Chunks (requests) held for their delay right now, and the most held at once since the last
        # reset_peak(): how many requests a client keeps in flight, seen from the wire. A chunk counts
        # from its arrival until its delay is over, and never past its connection's end
        self.waiting = 0
        self.peak_waiting = 0
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="latency-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
                self._socks.update((client, upstream))
            threading.Thread(target=self._pipe, args=(client, upstream, self.delay_s), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, 0.0), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        if delay_s:
            # A reader stamps each chunk on arrival; this thread sends it delay_s later, in order.
            chunks: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._read, args=(src, chunks, delay_s), daemon=True).start()
            source = iter(chunks.get, None)
        else:
            source = iter(lambda: src.recv(_CHUNK), b"")
        try:
            for item in source:
                if delay_s:
                    due, item = item
                    while (left := due - time.monotonic()) > 0:
                        time.sleep(left)
                    # its wait is over before it is sent: the reply, and a serial client's next request,
                    # cannot arrive while this one still counts
                    self._count_waiting(-1)
                dst.sendall(item)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if delay_s:  # chunks still queued on a connection that failed are no longer waiting
                for _ in source:
                    self._count_waiting(-1)

    def _count_waiting(self, change: int) -> None:
        with self._lock:
            self.waiting += change
            self.peak_waiting = max(self.peak_waiting, self.waiting)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_waiting = self.waiting

    def _read(self, src: socket.socket, chunks: queue.SimpleQueue, delay_s: float) -> None:
        try:
            while data := src.recv(_CHUNK):
                self._count_waiting(1)
                chunks.put((time.monotonic() + delay_s, data))
        except OSError:
            pass
        finally:
            chunks.put(None)

    def close(self) -> None:
        """Stop accepting and drop every open connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _main() -> None:
    """`python -m raydl.bench.latency_proxy HOST:PORT DELAY_MS`: serve until killed; prints the port first."""
    import sys

    host, port = sys.argv[1].rsplit(":", 1)
    proxy = LatencyProxy(host, int(port), delay_s=float(sys.argv[2]) / 1000)
    print(proxy.port, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    _main()
