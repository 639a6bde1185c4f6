"""What one process holds for checkpoints: the copies it publishes, its receive buffers, its fabric client
and the endpoints it serves from, in one object, `PROCESS`.

The checkpoint API (api.py, startup.py) is the only writer. Interpreter exit closes it (servers stop
before libfabric is unloaded); a forked child forgets its parent's endpoint and threads and opens its own.
No endpoint opens before it is needed: the serving one with the first publish (closed again with the last
unpublish), the client one with the first fetch (docs/security.md).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import numpy as np

from raydl.checkpoint.buffers import BufferPool
from raydl.checkpoint.fabric import FabricClient
from raydl.checkpoint.held import HeldCopies

__all__ = ["PROCESS", "bind_address"]


class _Process:
    """What this process holds for checkpoints: its published copies and its fabric client."""

    def __init__(self) -> None:
        self.published = HeldCopies()
        self.buffers = BufferPool(max_free=1)
        self._fabric: FabricClient | None = None
        self._endpoints: dict[tuple[str | None, str | None], Any] = {}  # (bind, provider) -> ServerEndpoint
        self._preparing: threading.Thread | None = None
        self._lock = threading.Lock()

    def start_preparing(self, target) -> threading.Thread:
        with self._lock:
            if self._preparing is None:
                self._preparing = threading.Thread(
                    target=target, name="raydl-checkpoint-prepare", daemon=True
                )
                self._preparing.start()
            return self._preparing

    def wait_prepared(self, timeout: float | None = None) -> None:
        """A fetch started while prepare() runs waits for it instead of doing the same work twice."""
        with self._lock:
            thread = self._preparing
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's endpoint and threads are not this process's. Dropped, not
        closed (closing would act on the parent's libfabric state); the next fetch opens its own."""
        self._lock = threading.Lock()
        # Never closed here, never collected
        self._leftovers = (
            self._fabric,
            self._preparing,
            self._endpoints,
        )
        self._fabric = None
        self._endpoints = {}
        self._preparing = None

    @property
    def fabric(self) -> FabricClient:
        with self._lock:
            if self._fabric is None:
                self._fabric = FabricClient()
            return self._fabric

    def serve(self, buf: np.ndarray, bind: str, provider: str):
        """Serve `buf` from this process's endpoint for (bind, provider), opened now if none is open:
        one stack and serving thread for every checkpoint it publishes, and a fetcher that read an
        earlier one reuses its connection. Nothing listens before the first publish."""
        from raydl.native import pyfi

        with self._lock:  # held while registering: an unpublish cannot close the endpoint meanwhile
            endpoint = self._endpoints.get((bind, provider))
            if endpoint is None or endpoint.closed:
                if endpoint is not None:
                    endpoint.close()  # its serving thread stopped: free its stack, serve from a new one
                endpoint = self._endpoints[(bind, provider)] = pyfi.ServerEndpoint(provider, bind=bind)
            return endpoint.serve(buf)

    def close_idle_endpoints(self) -> None:
        """Close every endpoint that serves nothing any more: the listener lives only while some
        checkpoint is published from it (docs/security.md)."""
        with self._lock:
            idle = [k for k, endpoint in self._endpoints.items() if endpoint.idle]
            endpoints = [self._endpoints.pop(k) for k in idle]
        for endpoint in endpoints:
            endpoint.close()

    def close(self) -> None:
        self.buffers.cancel_started()
        self.published.close_all()
        with self._lock:
            client, self._fabric = self._fabric, None
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            endpoint.close()
        if client is not None:
            client.close()


PROCESS = _Process()
atexit.register(PROCESS.close)


def bind_address(bind: str | None) -> str:
    """Where a publish's fabric endpoint listens: `bind` when given, else RAYDL_CHECKPOINT_BIND's choice."""
    from raydl.env import checkpoint_bind

    return bind if bind is not None else checkpoint_bind()


def _before_fork() -> None:
    # A child forked while libfabric starts up could inherit its locks held: let it finish (bounded).
    PROCESS.wait_prepared(timeout=5.0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=PROCESS.forget_after_fork)
