"""connect(): a client endpoint that pulls a served region with pipelined fi_read.

    with connect(address) as conn:
        conn.read_into(dst, offset, size)   # chunked reads, up to max_inflight at once

Every wait is bounded: a peer that stops answering raises FabricError naming
it within `timeout`, never a hang. After a failed transfer the connection is
closed (that cancels reads still in flight into the caller's memory); connect
again to retry.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Any, Callable

from raydl.errors import FabricError
from raydl.native.pyfi._buffers import Span, as_span
from raydl.native.pyfi._lib import check, fabric_error, loaded
from raydl.native.pyfi._lifecycle import GATE
from raydl.native.pyfi._objects import Closeable, CompletionError, MemoryRegion
from raydl.native.pyfi._regcache import RegistrationCache
from raydl.native.pyfi._stack import FabricAddress, Stack, is_loopback, route_source, socket_host

logger = logging.getLogger(__name__)

# The client waits only while its reads are in flight: spin briefly, then nap
# (measured: no faster with fi_cq_sread, and sleeping leaves cores to others).
_CLIENT_SPIN = 200
_CLIENT_SLEEP_US = 20
# Paced reads complete at the link's rate (1 MiB: 8 ms at 1 Gbit/s): no spinning, 1 ms naps (the
# socket buffers hold far more than a millisecond of such a link), so a chain of paced peers leaves
# the cores to the copies.
_PACED_SLEEP_US = 1000
# How long a failed transfer waits for its other reads to end before closing the endpoint under them
# (reads on a connection its peer closed fail within milliseconds)
_REAP_S = 1.0
_MAX_EAGAIN = 100_000  # consecutive -FI_EAGAIN posts before giving up (time bounds it too)


class Pacer:
    """A token bucket of `bytes_per_s` with a burst of `burst` bytes: reads are posted no faster.
    It paces the reader, since the server of a one-sided read never sees it; in a chain
    (one reader per holder) that is the same as pacing each holder's outgoing link."""

    def __init__(self, bytes_per_s: float, burst: int = 1 << 20) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be positive, got {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self._burst = burst
        self._tokens = float(burst)
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._t) * self.rate)
        self._t = now

    def delay(self, nbytes: int) -> float:
        """Seconds until `nbytes` may go (0: now)."""
        with self._lock:
            self._refill()
            need = min(nbytes, self._burst) - self._tokens
            return 0.0 if need <= 0 else need / self.rate

    def spend(self, nbytes: int) -> None:
        """Take nbytes (the balance may go negative: a chunk larger than the burst waits it off after)."""
        with self._lock:
            self._refill()
            self._tokens -= nbytes


class Connection(Closeable):
    """A server's address in a client endpoint's AV. One operation at a time on the endpoint.

    Made by connect() (its own endpoint, closed with it) or Client.connect()
    (the client's shared endpoint: many servers, one endpoint per process)."""

    def __init__(
        self, address: FabricAddress, *, provider: str | None = None, client: Client | None = None
    ) -> None:
        if provider is not None and provider != address.provider:
            raise FabricError(
                f"the address is served over {address.provider}, not {provider}",
                call="connect",
                code=errno.EPROTONOSUPPORT,
                strerror="provider mismatch",
            )
        self.address = address
        self.peer = address.peer
        self._stack: Stack | None = None
        self._client = (
            client
            if client is not None
            else Client(address.provider, host=_client_host(address), fabric_name=address.fabric)
        )
        self._owns_client = client is None
        # Re-entrant: a failed transfer, or a progress callback, may close the
        # connection from inside an operation; other threads wait for it.
        self._lock = self._client.lock
        try:
            with self._lock:
                self._stack = self._client.live_stack(self.peer)
                self._fi_addr = self._client.peer_address(address.raw, self.peer)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ public --
    def read_into(
        self,
        dst: Any,
        offset: int = 0,
        size: int | None = None,
        *,
        chunk_size: int = 4 << 20,
        max_inflight: int = 8,
        timeout: float = 30.0,
        progress: Callable[[int], None] | None = None,
        watchdog: Callable[[], None] | None = None,
        watch_every: float = 1.0,
        pacer: Pacer | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> int:
        """Pull `size` bytes (default: all of dst) from the region at `offset` into dst.

        dst: bytearray, numpy array, CPU torch tensor, writable mmap ...; it is
        registered for the call. Reads are split into chunk_size pieces with up
        to max_inflight outstanding. `timeout` bounds the wait for any progress;
        `progress(bytes_done)` is called as chunks complete. `watchdog()` is
        called every `watch_every` seconds without a completion and may raise
        to end the transfer (e.g. when the caller learns the peer died: a
        refused rxm connection only ever answers -FI_EAGAIN). `pacer` (a Pacer,
        shared across calls) posts reads no faster than its rate: a simulated
        link. `on_chunk(pos, length)` hears each chunk of dst that has landed
        (pos from dst's start), on this thread while the other reads are in
        flight, e.g. to check it while it is still in cache; what it raises
        ends the transfer. Returns bytes read."""
        with self._lock:
            span = as_span(dst, writable=True)
            try:
                size = span.nbytes if size is None else size
                self._check_request("read_into", offset, size, span.nbytes, chunk_size, max_inflight)
                return self._transfer(
                    "fi_read",
                    span,
                    offset,
                    size,
                    chunk_size,
                    max_inflight,
                    timeout,
                    progress,
                    watchdog,
                    watch_every,
                    pacer,
                    on_chunk,
                    owner=dst,
                )
            finally:
                span.release()

    def write(
        self,
        data: Any,
        offset: int = 0,
        *,
        chunk_size: int = 4 << 20,
        max_inflight: int = 8,
        timeout: float = 30.0,
    ) -> int:
        """Write data into the region at `offset` (only a region served writable=True).
        Returns when the target holds the bytes (FI_DELIVERY_COMPLETE)."""
        if not self.address.writable:
            raise FabricError(
                f"write refused: the region served by {self.peer} is read-only (serve it with writable=True)",
                call="write",
                code=errno.EACCES,
                strerror=os.strerror(errno.EACCES),
            )
        with self._lock:
            span = as_span(data, writable=False)
            try:
                self._check_request("write", offset, span.nbytes, span.nbytes, chunk_size, max_inflight)
                return self._transfer(
                    "fi_write", span, offset, span.nbytes, chunk_size, max_inflight, timeout, None
                )
            finally:
                span.release()

    def close(self) -> None:
        """Forget the server; an own endpoint is closed with it (idempotent; waits for an operation)."""
        with self._lock:
            self._stack = None
        if self._owns_client:
            self._client.close()

    @property
    def closed(self) -> bool:
        return self._stack is None or self._client.closed

    def __reduce__(self):
        raise TypeError("a pyfi Connection is bound to this process; send the FabricAddress instead")

    # ---------------------------------------------------------- internal --
    def _check_request(
        self, op: str, offset: int, size: int, local: int, chunk_size: int, max_inflight: int
    ) -> None:
        if chunk_size <= 0 or max_inflight <= 0:
            raise ValueError(
                f"chunk_size and max_inflight must be positive, got {chunk_size}, {max_inflight}"
            )
        if size < 0 or size > local:
            raise ValueError(f"{op}: size {size} does not fit the local buffer of {local} bytes")
        if offset < 0 or offset + size > self.address.size:
            raise FabricError(
                f"{op}: bytes [{offset}, {offset + size}) are outside the {self.address.size}-byte "
                f"region served by {self.peer}",
                call=op,
                code=errno.EINVAL,
                strerror=os.strerror(errno.EINVAL),
            )

    def _live_stack(self) -> Stack:
        if self._stack is None or self._client.closed:
            raise FabricError(
                f"the connection to {self.peer} is closed",
                call="connection",
                code=errno.ENOTCONN,
                strerror=os.strerror(errno.ENOTCONN),
            )
        return self._stack

    def _transfer(self, call: str, span: Span, offset: int, size: int, *args: Any, **kwargs: Any) -> int:
        """Run one pipelined read or write (see `_transfer_inside` for its arguments) while the process is
        not exiting."""
        if size == 0:
            return 0
        with GATE.inside(call):  # at exit, the poll below raises and the transfer ends (see _lifecycle)
            return self._transfer_inside(call, span, offset, size, *args, **kwargs)

    def _transfer_inside(
        self,
        call: str,
        span: Span,
        offset: int,
        size: int,
        chunk_size: int,
        max_inflight: int,
        timeout: float,
        progress: Callable[[int], None] | None,
        watchdog: Callable[[], None] | None = None,
        watch_every: float = 1.0,
        pacer: Pacer | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
        owner: Any = None,
    ) -> int:
        """Post chunks while slots are free, reap completions, until `size` bytes are moved.
        owner: the caller's object for span (reads: its registration is cached, see _regcache)."""
        stack = self._live_stack()
        ffi, lib = loaded()
        access = lib.FI_READ if call == "fi_read" else lib.FI_WRITE
        chunk_size = min(chunk_size, stack.domain.info.max_msg_size)
        if owner is not None:
            local, local_base, owned = self._client.registrations.region(span, owner, access)
        else:
            local, local_base, owned = stack.domain.register(span, access=access), 0, True
        slots = ffi.new("struct fi_context2[]", max_inflight)
        slot_base, slot_size = int(ffi.cast("uintptr_t", slots)), ffi.sizeof("struct fi_context2")
        free = list(range(max_inflight - 1, -1, -1))
        inflight: dict[int, tuple[int, int]] = {}  # slot -> (chunk position, length)
        chunks = [(pos, min(chunk_size, size - pos)) for pos in range(0, size, chunk_size)]
        posted = done = eagain = 0
        landed: list[tuple[int, int]] = []  # chunks reaped, not yet handed to on_chunk
        busy = False
        last_progress = last_watch = time.monotonic()
        paced = 0.0
        try:
            while done < size:
                while posted < len(chunks) and free:
                    pos, length = chunks[posted]
                    paced = 0.0 if pacer is None else pacer.delay(length)
                    if paced > 0:
                        break
                    slot = free[-1]
                    rc = self._post(call, stack, local, local_base + pos, offset + pos, length, slots + slot)
                    busy = rc == -lib.FI_EAGAIN
                    if busy:  # queue full, or rxm still connecting: progress, then retry
                        eagain += 1
                        if eagain > _MAX_EAGAIN:
                            raise fabric_error(
                                call, rc, peer=self.peer, detail=f"still busy after {_MAX_EAGAIN} retries"
                            )
                        break
                    check(rc, call, peer=self.peer)
                    eagain = 0
                    if pacer is not None:
                        pacer.spend(length)
                    free.pop()
                    inflight[slot] = (pos, length)
                    posted += 1
                if landed and on_chunk is not None:  # after posting: the next reads fly meanwhile
                    for pos, length in landed:
                        on_chunk(pos, length)
                landed.clear()
                wait_s = 0.05 if inflight else (0.001 if busy else 0.0)
                if paced > 0 and not inflight:  # nothing to progress: let the link catch up
                    time.sleep(min(paced, 0.05))
                    finished, errors = [], []
                else:
                    if paced > 0:
                        wait_s = min(wait_s, paced)
                    # paced: completions come at the link's rate, so nap longer between polls
                    finished, errors = stack.cq.poll(
                        timeout_s=wait_s,
                        spin=_CLIENT_SPIN if pacer is None else 0,
                        sleep_us=_CLIENT_SLEEP_US if pacer is None else _PACED_SLEEP_US,
                    )
                if errors:
                    for err in errors:
                        inflight.pop((err.context - slot_base) // slot_size, None)
                    raise self._completion_error(call, errors[0], len(errors))
                for ctx in finished:
                    slot = (ctx - slot_base) // slot_size
                    landed.append(inflight.pop(slot))
                    done += landed[-1][1]
                    free.append(slot)
                now = time.monotonic()
                if finished or paced > 0:
                    last_progress = last_watch = now
                    if finished and progress is not None:
                        progress(done)
                elif watchdog is not None and now - last_watch > watch_every:
                    last_watch = now
                    watchdog()
                if not finished and now - last_progress > timeout:
                    stuck = (
                        f"{len(inflight)} in flight"
                        if inflight
                        else "the provider kept answering -FI_EAGAIN: is the peer gone?"
                    )
                    raise FabricError(
                        f"{call} (peer {self.peer}) timed out: no completion in {timeout:g} s "
                        f"({done} of {size} bytes done; {stuck})",
                        call=call,
                        code=errno.ETIMEDOUT,
                        strerror=os.strerror(errno.ETIMEDOUT),
                    )
            if on_chunk is not None:
                for pos, length in landed:
                    on_chunk(pos, length)
        except BaseException:
            # Let the reads still in flight end first (bounded): libfabric 1.17's rxm crashed (SIGSEGV
            # in fi_close) closing an endpoint with reads outstanding on a connection whose peer had
            # just closed. Those that do not end are cancelled by the close, before their memory is
            # deregistered.
            self._reap(stack, inflight, slot_base, slot_size)
            try:
                self._client.close()
                self.close()
            except FabricError as exc:
                logger.warning("pyfi: closing the connection to %s after a failure: %s", self.peer, exc)
            raise
        finally:
            if owned:
                local.close()
        return done

    @staticmethod
    def _reap(stack: Stack, inflight: dict[int, tuple[int, int]], slot_base: int, slot_size: int) -> None:
        """Poll until no operation is in flight, or for at most _REAP_S."""
        deadline = time.monotonic() + _REAP_S
        while inflight and time.monotonic() < deadline:
            try:
                finished, errors = stack.cq.poll(timeout_s=0.01, spin=0, sleep_us=_CLIENT_SLEEP_US)
            except FabricError:  # the queue failed, or the process exits: the close cancels the rest
                return
            for ctx in finished + [err.context for err in errors]:
                inflight.pop((ctx - slot_base) // slot_size, None)

    def _post(
        self,
        call: str,
        stack: Stack,
        local: MemoryRegion,
        local_pos: int,
        remote_pos: int,
        length: int,
        context: Any,
    ) -> int:
        ffi, lib = loaded()
        buf = local.span.ptr + local_pos
        remote = self.address.base + remote_pos
        if call == "fi_read":
            return lib.fi_read(
                stack.ep.ptr, buf, length, local.desc, self._fi_addr, remote, self.address.key, context
            )
        return lib.pyfi_write_delivery(
            stack.ep.ptr,
            buf,
            length,
            local.desc,
            self._fi_addr,
            remote,
            self.address.key,
            context,
            lib.FI_DELIVERY_COMPLETE | lib.FI_COMPLETION,
        )

    def _completion_error(self, call: str, err: CompletionError, count: int) -> FabricError:
        detail = err.text + (f" (and {count - 1} more)" if count > 1 else "")
        return fabric_error(call, -err.code, peer=self.peer, detail=detail)

    def read_raw(self, dst: Any, remote_offset: int, size: int, *, timeout: float = 10.0) -> int:
        """One fi_read of `size` bytes at base+remote_offset with no client-side bounds
        check: what a forged request looks like to the server. For tests."""
        with self._lock:
            span = as_span(dst, writable=True)
            try:
                if not 0 <= size <= span.nbytes:  # the local side is always checked
                    raise ValueError(
                        f"read_raw: size {size} does not fit the local buffer of {span.nbytes} bytes"
                    )
                return self._transfer("fi_read", span, remote_offset, size, max(size, 1), 1, timeout, None)
            finally:
                span.release()

    def write_raw(self, data: Any, remote_offset: int, *, timeout: float = 10.0) -> int:
        """One fi_write with no client-side checks (writable flag, bounds). For tests."""
        with self._lock:
            span = as_span(data, writable=False)
            try:
                return self._transfer(
                    "fi_write", span, remote_offset, span.nbytes, max(span.nbytes, 1), 1, timeout, None
                )
            finally:
                span.release()


def _client_host(address: FabricAddress) -> str | None:
    # rxm's client endpoint listens too (for connections it never gets): bind it to the one interface
    # that reaches the server (loopback for a loopback server, Ray's node address inside Ray), never
    # the provider's default. Providers without socket addresses (efa, verbs) have no such listener.
    if is_loopback(address.host):
        return address.host
    host = socket_host(address.raw) or address.host
    return route_source(host) if host else None


class Client(Closeable):
    """A client endpoint (fabric -> domain -> cq + av -> RDM endpoint) that connects to many servers.

    Opening the stack costs tens of ms (and libfabric's start-up the first
    time), so a process keeps one per (provider, fabric, host) - see
    Client.key_for - and opens it before it is needed. One operation at a
    time: connections share its lock. A failed transfer closes it (that
    cancels reads still in flight); its connections are then closed too."""

    def __init__(self, provider: str, *, host: str | None = None, fabric_name: str | None = None) -> None:
        self.provider = provider
        self.lock = threading.RLock()
        # Polled only while reads are in flight
        self._stack: Stack | None = Stack(
            provider, host=host, service=None, fabric_name=fabric_name, wait=False
        )
        self.fabric_name = self._stack.fabric_name
        # Server endpoint address -> its fi_addr_t here: regions served from one endpoint
        # (ServerEndpoint) share one AV entry, so rxm's connection to it is made once.
        self._peers: dict[bytes, int] = {}
        self._name_len: int | None = None  # bytes of this endpoint's own address: a peer's is no shorter
        self.registrations = RegistrationCache(self._stack.domain, domain_lock=self.lock)

    @staticmethod
    def key_for(address: FabricAddress) -> tuple[str, str, str | None]:
        """Addresses with the same key can share one Client: (provider, fabric, host), as
        (client.provider, client.fabric_name, the host it was opened with)."""
        return address.provider, address.fabric, _client_host(address)

    def connect(self, address: FabricAddress) -> Connection:
        if not isinstance(address, FabricAddress):
            raise TypeError(f"connect() takes a FabricAddress (Server.address), got {type(address).__name__}")
        return Connection(address, client=self)

    def peer_address(self, raw: bytes, peer: str) -> int:
        """The fi_addr_t of the server endpoint `raw` (inserted into the AV on first use)."""
        with self.lock:
            addr = self._peers.get(raw)
            if addr is None:
                stack = self.live_stack(peer)
                if self._name_len is None:
                    self._name_len = len(stack.ep.name())
                if not isinstance(raw, bytes) or len(raw) < self._name_len:
                    # fi_av_insert takes no length: it would read past the end of a shorter one
                    raise FabricError(
                        f"the address of {peer} is {len(raw) if isinstance(raw, bytes) else 'not'} bytes, "
                        f"shorter than this provider's addresses ({self._name_len})",
                        call="fi_av_insert",
                        code=errno.EINVAL,
                        strerror=os.strerror(errno.EINVAL),
                    )
                addr = self._peers[raw] = stack.av.insert(raw, peer=peer)
            return addr

    def live_stack(self, peer: str) -> Stack:
        if self._stack is None:
            raise FabricError(
                f"the client endpoint for {peer} is closed",
                call="connection",
                code=errno.ENOTCONN,
                strerror=os.strerror(errno.ENOTCONN),
            )
        return self._stack

    def close(self) -> None:
        with self.lock:
            stack, self._stack = self._stack, None
            self._peers = {}
        if stack is not None:
            # The endpoint first: closing it cancels operations still in flight, which must not
            # outlive the registration of the memory they land in.
            stack.ep.close()
            self.registrations.close()
            stack.close()

    @property
    def closed(self) -> bool:
        return self._stack is None

    def __reduce__(self):
        raise TypeError("a pyfi Client is bound to this process")


def connect(address: FabricAddress, *, provider: str | None = None) -> Connection:
    """Open a client endpoint for a served region (address from Server.address)."""
    if not isinstance(address, FabricAddress):
        raise TypeError(f"connect() takes a FabricAddress (Server.address), got {type(address).__name__}")
    return Connection(address, provider=provider)
