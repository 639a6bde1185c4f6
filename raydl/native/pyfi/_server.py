"""serve(): register a buffer or a file and serve it from a background thread.

    with serve(buffer_or_path) as server:   # registers the region, starts serving
        send(server.address)                # picklable; any channel (Ray) carries it
    # close() revoked the region: later reads fail at the server's MR

    endpoint = ServerEndpoint(provider, bind=...)   # one endpoint and thread, many regions
    server = endpoint.serve(buf)                    # close() revokes this region only

The serving thread matters: manual-progress providers (tcp;ofi_rxm) move a
read's bytes only while the *target* reads its CQ. It blocks in fi_cq_sread,
which wakes on socket activity (an idle server costs ~0.3% of a core, against
~10% for polling every 50 us); without wait objects it polls with 50 us naps.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
import time
import weakref
from typing import Any, Callable

from raydl.errors import CheckpointError, FabricError
from raydl.native.pyfi._buffers import Span, as_span
from raydl.native.pyfi._lib import load
from raydl.native.pyfi._lifecycle import GATE
from raydl.native.pyfi._objects import Closeable, CompletionQueue
from raydl.native.pyfi._probe import choose_provider
from raydl.native.pyfi._stack import FabricAddress, Stack, describe_peer, parse_bind

logger = logging.getLogger(__name__)

_SERVE_SLICE_S = 0.05  # how often the serving thread checks for close()
# How long close() waits for the serving thread to leave libfabric. Past it, close() returns and the
# thread closes the stack on its way out: closing the completion queue under a thread still inside
# fi_cq_sread would run it on freed provider state.
_JOIN_S = 10.0


class ServerEndpoint(Closeable):
    """One serving endpoint (stack + serving thread) for any number of regions: serve() registers
    each on it. A process that serves one region after another (a broadcast peer, a publisher of
    every checkpoint) opens the stack once (tens of ms, and a client's connection to it, tens of
    ms more on both sides), instead of once per region."""

    def __init__(self, provider: str | None = None, *, bind: str | None = "127.0.0.1:0") -> None:
        self._closed = True  # until serving: a half-built endpoint's __del__ does nothing
        # re-entrant: a Server collected while this thread holds it closes itself through _forget()
        self._lock = threading.RLock()
        self.host, service = parse_bind(bind)
        self._stack = Stack(choose_provider(provider), host=self.host, service=service, wait=True)
        self._servers: weakref.WeakSet[Server] = weakref.WeakSet()  # weak: a forgotten Server is collected
        try:
            self.raw = self._stack.ep.name()
        except BaseException:
            self._stack.close()
            raise
        self._stop = threading.Event()
        # The thread gets only what it polls and the stack's owner, not the endpoint, so one nobody
        # closed can still be collected (and __del__ closes it).
        self._owner = _StackOwner(self._stack)
        self.peer = describe_peer(self._stack.provider, self.raw)
        # A region is registered (and revoked) while the thread serves others: on a domain that is
        # not FI_THREAD_SAFE the two take turns (a registration waits at most one serving slice).
        self._domain_turn = None if self._stack.domain.thread_safe else _Turn()
        self._thread = threading.Thread(
            target=_serve_loop,
            name=f"pyfi-serve {self.peer}",
            daemon=True,
            args=(self._stack.cq, self._stop, self.peer, self._domain_turn, self._owner),
        )
        self._thread.start()
        self._closed = False

    @property
    def provider(self) -> str:
        return self._stack.provider

    def _turn(self):
        """Hold while using the domain beside the serving thread (a no-op on FI_THREAD_SAFE domains)."""
        return self._domain_turn if self._domain_turn is not None else contextlib.nullcontext()

    def serve(self, buffer_or_path: Any, *, writable: bool = False) -> Server:
        """Register a buffer (or a regular file, mapped with mmap) on this endpoint and serve it
        until the returned Server is closed (or this endpoint is)."""
        span, cleanup = _span_of(buffer_or_path, writable)
        try:
            with self._lock:
                if self.closed:
                    raise FabricError(
                        f"the server endpoint {self.peer} is closed",
                        call="serve",
                        code=errno.ENOTCONN,
                        strerror=os.strerror(errno.ENOTCONN),
                    )
                server = Server(self, span, writable=writable, on_close=cleanup)
                self._servers.add(server)
            return server
        except BaseException:
            cleanup()
            raise

    def _forget(self, server: Server) -> None:
        with self._lock:
            self._servers.discard(server)

    def close(self) -> None:
        """Stop serving every region, then the thread, then the endpoint (idempotent).

        The endpoint is closed only once the serving thread is out of libfabric for good: here, when
        the thread stops within _JOIN_S, else by the thread itself as it leaves."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            servers = list(self._servers)
            self._servers.clear()
        for server in servers:
            server.close()
        self._stop.set()
        self._stack.cq.signal()  # the serving thread sees the stop now, not at the end of its slice
        if threading.current_thread() is not self._thread:  # a collection may run close() on it
            self._thread.join(timeout=_JOIN_S)
        if not self._owner.release():
            logger.warning(
                "pyfi server %s: the serving thread did not stop within %g s; it closes the endpoint "
                "when it does",
                self.peer,
                _JOIN_S,
            )

    @property
    def idle(self) -> bool:
        """Serves no region now: its owner may close it (and its listener) until the next one."""
        with self._lock:
            return not self._servers

    @property
    def closed(self) -> bool:
        """Closed, or its serving thread stopped (a failed completion queue): serve nothing more on it."""
        return self._closed or not self._thread.is_alive()

    def __reduce__(self):
        raise TypeError("a pyfi ServerEndpoint is bound to this process; send a Server's .address")


class Server(Closeable):
    """A registered region served by a ServerEndpoint until close(). From serve(), it owns its
    endpoint (closed with it); from ServerEndpoint.serve(), it shares the endpoint."""

    def __init__(
        self,
        endpoint: ServerEndpoint,
        span: Span,
        *,
        writable: bool,
        on_close: Callable[[], None],
        owns_endpoint: bool = False,
    ) -> None:
        _, lib = load()
        self._closed = True
        self._lock = threading.Lock()
        self._endpoint = endpoint
        self._owns_endpoint = owns_endpoint
        self._on_close = on_close
        access = lib.FI_REMOTE_READ | (lib.FI_REMOTE_WRITE if writable else 0)
        stack = endpoint._stack
        with endpoint._turn():
            self._mr = stack.domain.register(span, access=access)
        self.address = FabricAddress(
            provider=stack.provider,
            fabric=stack.fabric_name,
            raw=endpoint.raw,
            key=self._mr.key,
            base=self._mr.base,
            size=span.nbytes,
            writable=writable,
            host=endpoint.host,
        )
        self._closed = False

    def close(self) -> None:
        """Revoke the region (later reads of it fail at the server's MR); a Server from serve()
        also stops its endpoint (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            with self._endpoint._turn():
                self._mr.close()  # revoke first: no read can land after this
        finally:
            self._endpoint._forget(self)
            if self._owns_endpoint:
                self._endpoint.close()
            self._on_close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __reduce__(self):
        raise TypeError("a pyfi Server holds registered memory and cannot be pickled; send .address")


class _Turn:
    """A lock the serving thread holds for each wait slice and lets go of between slices, yielding
    to a registration that waits for it (a plain lock it re-took at once could starve that)."""

    def __init__(self) -> None:
        # A Server collected inside the serving thread's slice revokes under it
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self._waiting = 0

    def __enter__(self) -> None:
        with self._count:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self._waiting -= 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def serving_slice(self):
        """The serving thread's hold on the domain for one slice, after a waiting registration (bounded)."""
        for _ in range(100):
            if not self._waiting:
                break
            time.sleep(0.001)
        return self


class _StackOwner:
    """Decides who closes a serving stack: whichever of close() and the serving thread's exit comes
    second. So the stack is closed once, and never while the thread may still be inside libfabric."""

    def __init__(self, stack: Stack) -> None:
        self._stack = stack
        self._lock = threading.Lock()
        self._released = False  # close() is done with the stack
        self._thread_out = False  # the serving thread will not enter libfabric again

    def release(self) -> bool:
        """close()'s side: True when the stack was closed now, False when the serving thread will close it."""
        with self._lock:
            self._released = True
            last = self._thread_out
        if last:
            self._stack.close()
        return last

    def thread_out(self, peer: str) -> None:
        """The serving thread's last act: close the stack when close() already let go of it."""
        with self._lock:
            self._thread_out = True
            last = self._released
        if last:
            try:
                self._stack.close()
            except FabricError as exc:  # nobody left to raise it to
                logger.warning("pyfi server %s: closing the endpoint failed: %s", peer, exc)


def _serve_loop(
    cq: CompletionQueue, stop: threading.Event, peer: str, turn: _Turn | None, owner: _StackOwner
) -> None:
    try:
        while not stop.is_set() and not GATE.closed:
            try:
                with turn.serving_slice() if turn is not None else contextlib.nullcontext():
                    _, errors = cq.wait(_SERVE_SLICE_S)
            except FabricError as exc:  # the queue itself failed, or the process exits: stop serving
                if not GATE.closed:
                    logger.error("pyfi server %s stopped: %s", peer, exc)
                return
            for err in errors:
                logger.warning("pyfi server %s: completion error %s", peer, err.text)
    finally:
        owner.thread_out(peer)


def serve(
    buffer_or_path: Any,
    *,
    bind: str | None = "127.0.0.1:0",
    provider: str | None = None,
    writable: bool = False,
) -> Server:
    """Register a buffer (or a regular file, mapped with mmap) and serve it on an endpoint of its own.

    The region is read-only for peers unless writable=True. `bind` is the local
    host:port to listen on ("127.0.0.1:0": loopback only, any port; None: the
    provider's default). Provider: the argument, else RAYDL_FABRIC_PROVIDER,
    else the first that fits of efa, verbs;ofi_rxm, tcp;ofi_rxm, sockets.
    To serve many regions from one endpoint, see ServerEndpoint."""
    provider = choose_provider(provider)
    span, cleanup = _span_of(buffer_or_path, writable)
    try:
        endpoint = ServerEndpoint(provider, bind=bind)
    except BaseException:
        cleanup()
        raise
    try:
        return Server(endpoint, span, writable=writable, on_close=cleanup, owns_endpoint=True)
    except BaseException:
        cleanup()
        endpoint.close()
        raise


def _span_of(buffer_or_path: Any, writable: bool) -> tuple[Span, Callable[[], None]]:
    if isinstance(buffer_or_path, (str, os.PathLike)):
        span, cleanup = _map_file(os.fspath(buffer_or_path), writable=writable)
    else:
        span = as_span(buffer_or_path, writable=writable)
        cleanup = span.release
    if span.nbytes == 0:
        cleanup()
        raise ValueError("nothing to serve: the region is empty")
    return span, cleanup


def _map_file(path: str, *, writable: bool) -> tuple[Span, Callable[[], None]]:
    # A bad path is the caller's checkpoint at fault, as in raydl.checkpoint.publish: a CheckpointError.
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"cannot serve checkpoint path {path!r}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"cannot serve checkpoint path {path!r}: not a regular file")
    if st.st_size == 0:
        raise ValueError(f"nothing to serve: {path} is empty")
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        mapping = mmap.mmap(
            fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        )
    finally:
        os.close(fd)
    span = as_span(mapping, writable=writable)

    def cleanup() -> None:
        span.release()
        mapping.close()

    return span, cleanup
