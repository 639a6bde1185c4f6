"""SlowDrip: an HTTP server on 127.0.0.1 that speaks just enough S3 for a ranged GET, and stalls on purpose.

Every GET of any key answers with bytes of `payload` (206 with Content-Range when the request has a
Range header, else 200). A connection that `stall(n)` picks (n counts accepted connections from 0)
sends its reply `drip_bytes` at a time, one piece every `interval_s` seconds: in the body
(`phase="body"`: the headers come at once), in the status line and headers (`phase="headers"`), or
nothing at all (`phase="silent"`). The others answer at once. Connections are kept alive, as S3's are.

Every loop is bounded: a drip ends when the client goes away, when the reply is sent, or when the
server closes (which shuts every socket down).
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable

__all__ = ["SlowDrip"]

_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


class SlowDrip:
    """Listens on 127.0.0.1:<free port>; `url` is its endpoint; `connections` and `requests` say what came."""

    def __init__(
        self,
        payload: bytes,
        *,
        stall: Callable[[int], bool] = lambda n: True,
        phase: str = "body",
        interval_s: float = 0.5,
        drip_bytes: int = 1,
    ) -> None:
        if phase not in ("body", "headers", "silent"):
            raise ValueError(f"phase must be body, headers or silent, got {phase!r}")
        self.payload = payload
        self.stall = stall
        self.phase = phase
        self.interval_s = interval_s
        self.drip_bytes = drip_bytes
        self.connections = 0  # accepted so far
        self.closed_by_client = 0  # connections the client closed (or shut down) before the server did
        self.requests: list[tuple[int, str, str]] = []  # (connection number, method, range header)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, name="slow-drip", daemon=True)
        self._thread.start()

    # -- the server ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                n = self.connections
                self.connections += 1
                self._socks.add(conn)
            threading.Thread(target=self._serve, args=(conn, n), daemon=True).start()

    def _serve(self, conn: socket.socket, n: int) -> None:
        stalls = self.stall(n)
        buf = b""
        try:
            while not self._closed.is_set():
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        self._count_client_close()
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method = lines[0].split(" ")[0]
                headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                headers = {k.lower(): v for k, v in headers.items()}
                length = int(headers.get("content-length", 0))
                while len(buf) < length:  # a request body (none for GET); read and ignore it
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                buf = buf[length:]
                rng = headers.get("range", "")
                with self._lock:
                    self.requests.append((n, method, rng))
                head_bytes, body = self._reply(method, rng)
                if not stalls:
                    conn.sendall(head_bytes + body)
                elif self.phase == "silent":
                    self._closed.wait(3600)  # hold the connection open, send nothing, until close()
                    return
                elif self.phase == "headers":
                    if not self._drip(conn, head_bytes + body):
                        return
                else:
                    conn.sendall(head_bytes)
                    if not self._drip(conn, body):
                        return
        except OSError:
            self._count_client_close()
        finally:
            with self._lock:
                self._socks.discard(conn)
            conn.close()

    def _drip(self, conn: socket.socket, data: bytes) -> bool:
        """Send data drip_bytes at a time, interval_s apart; False when the client went away or we closed."""
        for i in range(0, len(data), self.drip_bytes):
            if self._closed.wait(self.interval_s if i else 0):
                return False
            try:
                conn.sendall(data[i : i + self.drip_bytes])
            except OSError:
                self._count_client_close()
                return False
        return True

    def _count_client_close(self) -> None:
        if not self._closed.is_set():
            with self._lock:
                self.closed_by_client += 1

    def _reply(self, method: str, rng: str) -> tuple[bytes, bytes]:
        size = len(self.payload)
        m = _RANGE.fullmatch(rng)
        if m:
            first, last = int(m.group(1)), min(int(m.group(2)), size - 1)
            body = self.payload[first : last + 1]
            status = "206 Partial Content"
            extra = f"Content-Range: bytes {first}-{last}/{size}\r\n"
        else:
            body, status, extra = self.payload, "200 OK", ""
        head = (
            f"HTTP/1.1 {status}\r\n"
            "Content-Type: binary/octet-stream\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"{extra}"
            'ETag: "5l0wdr1p"\r\n'
            "Accept-Ranges: bytes\r\n"
            "Last-Modified: Tue, 01 Dec 2026 00:00:00 GMT\r\n"
            "\r\n"
        ).encode()
        return head, b"" if method == "HEAD" else body

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not, on Linux)
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

    def __enter__(self) -> SlowDrip:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
