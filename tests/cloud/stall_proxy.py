"""StallProxy: a TCP proxy on 127.0.0.1 in front of a real server that, on the connections `stall(n)` picks
(n counts accepted connections from 0), passes the request on (with the server's own address in its Host
header) but stops sending the answer after
`after_bytes` bytes of it, and holds the connection open; the others it passes through.

Every loop is bounded: a copy ends when either side goes away or the proxy closes (which shuts every socket
down).
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable

__all__ = ["StallProxy"]


class StallProxy:
    def __init__(self, upstream_port: int, *, stall: Callable[[int], bool] = lambda n: True,
                 after_bytes: int = 0) -> None:
        self.upstream_port = upstream_port
        self.stall = stall
        self.after_bytes = after_bytes
        self.connections = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, name="stall-proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                n = self.connections
                self.connections += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks.update((client, upstream))
            limit = self.after_bytes if self.stall(n) else None
            threading.Thread(target=self._copy, args=(client, upstream, None, True), daemon=True).start()
            threading.Thread(target=self._copy, args=(upstream, client, limit), daemon=True).start()

    def _copy(self, src: socket.socket, dst: socket.socket, limit: int | None, request: bool = False) -> None:
        sent = 0
        ours, theirs = f"127.0.0.1:{self.port}".encode(), f"127.0.0.1:{self.upstream_port}".encode()
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if request:  # the server's own Host header (fake-gcs-server routes by it)
                    data = data.replace(ours, theirs)
                if limit is not None:
                    data = data[: max(0, limit - sent)]
                    if not data:
                        self._closed.wait(3600)  # stalled: say nothing more, hold the connection, until close()
                        return
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def __enter__(self) -> StallProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
