"""Helpers for the S3 tests: test data straight into moto, and an HTTP front that injects S3 errors.

FaultFront: an HTTP front for the moto server that answers chosen requests with S3 error responses.

Requests the `plan` leaves alone are forwarded to the server unchanged; the
others get the status and S3 error code the plan names (503 SlowDown, 500,
403 AccessDenied ...), as a real store would send them.
"""
from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["FaultFront", "put_many", "upload_folder"]

_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class FaultFront:
    """plan(method, path, n) -> (status, code) to fail the n-th request (0-based, all requests counted), or None."""

    def __init__(self, upstream: str, plan: Callable[[str, str, int], tuple[int, str] | None], *,
                 upstream_host: bool = False, drop_range: Callable[[str, str, int], bool] | None = None,
                 edit: Callable[[str, str, int, bytes], bytes] | None = None,
                 forward_path: Callable[[str, str, int], str] | None = None) -> None:
        """`upstream_host`: requests reach the server with its own Host header (fake-gcs-server routes by it).
        `drop_range(method, path, n)`: forward that request without its Range header (a store that ignores it).
        `edit(method, path, n, body)`: the forwarded answer's body as the client gets it (a lying store).
        `forward_path(method, path, n)`: the path forwarded upstream in place of the client's."""
        host, port = upstream.removeprefix("http://").split(":")
        self.plan = plan
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status sent)
        self.connections = 0  # client connections accepted (keep-alive: several requests each)
        lock = threading.Lock()
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with lock:
                    front.connections += 1

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    n = len(front.requests)
                    front.requests.append((self.command, self.path, 0))
                fault = front.plan(self.command, self.path, n)
                if fault is not None:
                    status, code = fault
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                               f"<Message>injected {code}</Message></Error>").encode()
                    # recorded before the answer goes out: the client may check `requests` the moment it has it
                    with lock:
                        front.requests[n] = (self.command, self.path, status)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    headers = dict(self.headers)
                    if drop_range is not None and drop_range(self.command, self.path, n):
                        headers = {k: v for k, v in headers.items() if k.lower() != "range"}
                    if upstream_host:
                        headers = {k: v for k, v in headers.items() if k.lower() != "host"}
                        headers["Host"] = f"{host}:{port}"
                    path = self.path if forward_path is None else forward_path(self.command, self.path, n)
                    conn.request(self.command, path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if edit is not None:
                    data = edit(self.command, self.path, n, data)
                with lock:
                    front.requests[n] = (self.command, self.path, resp.status)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _DROP:
                        self.send_header(k, v)
                # a HEAD's answer says the object's length, not its own (empty) body's
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultFront:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def put_many(bucket: str, objects: dict[str, bytes]) -> None:
    """Test data straight into the in-process moto backend (thousands of PUTs over HTTP take minutes here);
    every read in the tests still goes over HTTP."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    for key, data in objects.items():
        backend.put_object(bucket, key, data)


def upload_folder(bucket: str, root, prefix: str) -> None:
    """Every file under `root` to s3://bucket/prefix/<relative path>."""
    from pathlib import Path

    root = Path(root)
    put_many(bucket, {f"{prefix}/{p.relative_to(root).as_posix()}": p.read_bytes()
                      for p in sorted(root.rglob("*")) if p.is_file()})
