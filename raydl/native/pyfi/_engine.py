"""The transfer engine: serve a region, connect to it, pull it with pipelined reads.

    server = serve(buffer_or_path)          # registers the region, polls from a thread
    conn = connect(server.address)          # the address travels over any channel (Ray)
    conn.read_into(dst, offset, size)       # chunked fi_read, up to max_inflight at once
    server.close()                          # revokes the region

Both sides open the same stack: fabric -> domain -> cq + av -> RDM endpoint.
Remote addresses are `base + offset`: base is the region's virtual address
when the provider sets FI_MR_VIRT_ADDR (efa, verbs) and 0 when it does not
(tcp;ofi_rxm, sockets: offsets, application-chosen keys). Every wait is bounded:
a peer that stops answering raises FabricError naming it, never a hang.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from raydl.errors import DataSourceError, FabricError
from raydl.native.pyfi._buffers import Span, as_span
from raydl.native.pyfi._lib import check, fabric_error, load
from raydl.native.pyfi._objects import (AddressVector, CompletionError, CompletionQueue, Domain,
                                        Endpoint, Fabric, MemoryRegion, getinfo)
from raydl.native.pyfi._probe import choose_provider

logger = logging.getLogger(__name__)

# The serving thread: manual-progress providers (tcp;ofi_rxm) move a read's
# bytes only while the *target* reads its CQ. It blocks in fi_cq_sread, which
# wakes on socket activity (an idle server costs ~0.3% of a core, against
# ~10% for polling every 50 us); without wait objects it polls with 50 us naps.
_SERVE_SLICE_S = 0.05          # how often the thread checks for close()
# The client waits only while its reads are in flight: spin briefly, then nap
# (measured: no faster with fi_cq_sread, and sleeping leaves cores to others).
_CLIENT_SPIN = 200
_CLIENT_SLEEP_US = 20
_MAX_EAGAIN = 100_000          # consecutive -FI_EAGAIN posts before giving up (time bounds it too)


@dataclass(frozen=True)
class FabricAddress:
    """What a client needs to reach a served region; small and picklable."""

    provider: str
    fabric: str
    raw: bytes          # the server endpoint's fi_getname bytes
    key: int            # the region's MR key
    base: int           # added to offsets: a virtual address (FI_MR_VIRT_ADDR) or 0
    size: int
    writable: bool
    host: str | None    # the host the server bound to, e.g. "127.0.0.1"; None: any

    @property
    def peer(self) -> str:
        return describe_peer(self.provider, self.raw)

    def __repr__(self) -> str:
        return (f"FabricAddress({self.peer}, size={self.size}, "
                f"{'writable' if self.writable else 'read-only'})")


def describe_peer(provider: str, raw: bytes) -> str:
    """'tcp;ofi_rxm@127.0.0.1:43121' for socket addresses, else a hex prefix."""
    family = struct.unpack_from("<H", raw)[0] if len(raw) >= 2 else -1
    if family == socket.AF_INET and len(raw) >= 8:
        port = struct.unpack_from(">H", raw, 2)[0]
        return f"{provider}@{socket.inet_ntop(socket.AF_INET, raw[4:8])}:{port}"
    if family == socket.AF_INET6 and len(raw) >= 24:
        port = struct.unpack_from(">H", raw, 2)[0]
        return f"{provider}@[{socket.inet_ntop(socket.AF_INET6, raw[8:24])}]:{port}"
    return f"{provider}@{raw[:16].hex()}"


def _parse_bind(bind: str | None) -> tuple[str | None, str | None]:
    if not bind:
        return None, None
    host, sep, port = bind.rpartition(":")
    if not sep:
        return bind, None
    host = host.strip("[]") or None
    return host, (None if port in ("", "0") else port)


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Stack:
    """fabric -> domain -> cq, av -> enabled RDM endpoint, for one provider."""

    def __init__(self, provider: str, *, host: str | None, service: str | None,
                 fabric_name: str | None = None, wait: bool = True) -> None:
        with getinfo(provider, node=host, service=service, source=host is not None) as infos:
            entries = [e for e in infos if fabric_name is None
                       or load()[0].string(e.fabric_attr.name).decode() == fabric_name]
            entry = (entries or list(infos))[0]
            self.fabric = Fabric(entry)
            try:
                self.domain = Domain(self.fabric, entry)
                self.cq: CompletionQueue = self.domain.cq(wait=wait)
                self.av: AddressVector = self.domain.av()
                self.ep: Endpoint = self.domain.endpoint(entry, cq=self.cq, av=self.av)
            except BaseException:
                self.fabric.close()
                raise
        self.provider = self.domain.info.provider
        self.fabric_name = self.domain.info.fabric

    def close(self) -> None:
        self.fabric.close()  # closes the tree beneath it, newest first


class Server:
    """A registered region served from a background thread until close()."""

    def __init__(self, span: Span, *, provider: str, bind: str | None, writable: bool,
                 on_close: Callable[[], None]) -> None:
        _, lib = load()
        self._closed = True           # until serving: a half-built Server's __del__ does nothing
        self._lock = threading.Lock()
        host, service = _parse_bind(bind)
        self._on_close = on_close
        self._stack = _Stack(provider, host=host, service=service)
        try:
            access = lib.FI_REMOTE_READ | (lib.FI_REMOTE_WRITE if writable else 0)
            self._mr = self._stack.domain.register(span, access=access)
            self.address = FabricAddress(
                provider=self._stack.provider, fabric=self._stack.fabric_name,
                raw=self._stack.ep.name(), key=self._mr.key, base=self._mr.base,
                size=span.nbytes, writable=writable, host=host)
        except BaseException:
            self._stack.close()
            raise
        self._stop = threading.Event()
        # The thread gets only what it polls, not the Server, so a Server
        # nobody closed can still be collected (and __del__ closes it).
        self._thread = threading.Thread(target=_serve_loop, name=f"pyfi-serve {self.address.peer}", daemon=True,
                                        args=(self._stack.cq, self._stop, self.address.peer))
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        """Stop serving and revoke the region (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._mr.close()      # revoke first: no read can land after this
        finally:
            self._stack.close()
            self._on_close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __reduce__(self):
        raise TypeError("a pyfi Server holds registered memory and cannot be pickled; send .address")


def _serve_loop(cq: CompletionQueue, stop: threading.Event, peer: str) -> None:
    while not stop.is_set():
        try:
            _, errors = cq.wait(_SERVE_SLICE_S)
        except FabricError as exc:  # the queue itself failed: stop serving, say why
            logger.error("pyfi server %s stopped: %s", peer, exc)
            return
        for err in errors:
            logger.warning("pyfi server %s: completion error %s", peer, err.text)


def serve(buffer_or_path: Any, *, bind: str | None = "127.0.0.1:0", provider: str | None = None,
          writable: bool = False) -> Server:
    """Register a buffer (or a regular file, mapped with mmap) and serve it.

    The region is read-only for peers unless writable=True. `bind` is the local
    host:port to listen on ("127.0.0.1:0": loopback only, any port; None: the
    provider's default). Provider: the argument, else RAYDL_FABRIC_PROVIDER,
    else the first that fits of efa, verbs;ofi_rxm, tcp;ofi_rxm, sockets."""
    provider = choose_provider(provider)
    if isinstance(buffer_or_path, (str, os.PathLike)):
        span, cleanup = _map_file(os.fspath(buffer_or_path), writable=writable)
    else:
        span = as_span(buffer_or_path, writable=writable)
        cleanup = span.release
    if span.nbytes == 0:
        cleanup()
        raise ValueError("nothing to serve: the region is empty")
    try:
        return Server(span, provider=provider, bind=bind, writable=writable, on_close=cleanup)
    except BaseException:
        cleanup()
        raise


def _map_file(path: str, *, writable: bool) -> tuple[Span, Callable[[], None]]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DataSourceError(f"cannot serve {path}: {exc.strerror}", uri=path) from exc
    if not stat.S_ISREG(st.st_mode):
        raise DataSourceError(f"cannot serve {path}: not a regular file", uri=path)
    if st.st_size == 0:
        raise ValueError(f"nothing to serve: {path} is empty")
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)
    span = as_span(mapping, writable=writable)

    def cleanup() -> None:
        span.release()
        mapping.close()
    return span, cleanup


class Connection:
    """A client endpoint with the server's address in its AV. One operation at a time."""

    def __init__(self, address: FabricAddress, *, provider: str | None = None) -> None:
        if provider is not None and provider != address.provider:
            raise FabricError(f"the address is served over {address.provider}, not {provider}",
                              call="connect", code=errno.EPROTONOSUPPORT, strerror="provider mismatch")
        self.address = address
        self.peer = address.peer
        self._lock = threading.Lock()
        self._stack: _Stack | None = None
        # A loopback server is only reachable from loopback: bind there too.
        # Otherwise the provider's default interface, on the server's fabric.
        host = address.host if _is_loopback(address.host) else None
        self._stack = _Stack(address.provider, host=host, service=None, fabric_name=address.fabric)
        try:
            self._fi_addr = self._stack.av.insert(address.raw, peer=self.peer)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ public --
    def read_into(self, dst: Any, offset: int = 0, size: int | None = None, *,
                  chunk_size: int = 4 << 20, max_inflight: int = 8, timeout: float = 30.0,
                  progress: Callable[[int], None] | None = None) -> int:
        """Pull `size` bytes (default: all of dst) from the region at `offset` into dst.

        dst: bytearray, numpy array, CPU torch tensor, writable mmap ...; it is
        registered for the call. Reads are split into chunk_size pieces with up
        to max_inflight outstanding. `timeout` bounds the wait for any progress;
        `progress(bytes_done)` is called as chunks complete. Returns bytes read."""
        with self._lock:
            span = as_span(dst, writable=True)
            try:
                size = span.nbytes if size is None else size
                self._check_request("read_into", offset, size, span.nbytes, chunk_size, max_inflight)
                return self._transfer("fi_read", span, offset, size, chunk_size, max_inflight,
                                      timeout, progress)
            finally:
                span.release()

    def write(self, data: Any, offset: int = 0, *, chunk_size: int = 4 << 20, max_inflight: int = 8,
              timeout: float = 30.0) -> int:
        """Write data into the region at `offset` (only a region served writable=True).
        Returns when the target holds the bytes (FI_DELIVERY_COMPLETE)."""
        if not self.address.writable:
            raise FabricError(f"write refused: the region served by {self.peer} is read-only "
                              "(serve it with writable=True)", call="write", code=errno.EACCES,
                              strerror=os.strerror(errno.EACCES))
        with self._lock:
            span = as_span(data, writable=False)
            try:
                self._check_request("write", offset, span.nbytes, span.nbytes, chunk_size, max_inflight)
                return self._transfer("fi_write", span, offset, span.nbytes, chunk_size, max_inflight,
                                      timeout, None)
            finally:
                span.release()

    def close(self) -> None:
        """Close the endpoint and its stack (idempotent)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    @property
    def closed(self) -> bool:
        return self._stack is None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __reduce__(self):
        raise TypeError("a pyfi Connection is bound to this process; send the FabricAddress instead")

    # ---------------------------------------------------------- internal --
    def _check_request(self, op: str, offset: int, size: int, local: int, chunk_size: int,
                       max_inflight: int) -> None:
        if chunk_size <= 0 or max_inflight <= 0:
            raise ValueError(f"chunk_size and max_inflight must be positive, got {chunk_size}, {max_inflight}")
        if size < 0 or size > local:
            raise ValueError(f"{op}: size {size} does not fit the local buffer of {local} bytes")
        if offset < 0 or offset + size > self.address.size:
            raise FabricError(
                f"{op}: bytes [{offset}, {offset + size}) are outside the {self.address.size}-byte "
                f"region served by {self.peer}", call=op, code=errno.EINVAL,
                strerror=os.strerror(errno.EINVAL))

    def _live_stack(self) -> _Stack:
        if self._stack is None:
            raise FabricError(f"the connection to {self.peer} is closed", call="connection",
                              code=errno.ENOTCONN, strerror=os.strerror(errno.ENOTCONN))
        return self._stack

    def _transfer(self, call: str, span: Span, offset: int, size: int, chunk_size: int,
                  max_inflight: int, timeout: float, progress: Callable[[int], None] | None) -> int:
        """Run one pipelined read or write: post chunks while slots are free, reap completions."""
        if size == 0:
            return 0
        stack = self._live_stack()
        ffi, lib = load()
        access = lib.FI_READ if call == "fi_read" else lib.FI_WRITE
        local = stack.domain.register(span, access=access)
        slots = ffi.new("struct fi_context2[]", max_inflight)
        slot_base, slot_size = int(ffi.cast("uintptr_t", slots)), ffi.sizeof("struct fi_context2")
        free = list(range(max_inflight - 1, -1, -1))
        inflight: dict[int, int] = {}         # slot -> chunk length
        chunks = [(pos, min(chunk_size, size - pos)) for pos in range(0, size, chunk_size)]
        posted = done = eagain = 0
        busy = False
        last_progress = time.monotonic()
        try:
            while done < size:
                while posted < len(chunks) and free:
                    pos, length = chunks[posted]
                    slot = free[-1]
                    rc = self._post(call, stack, local, pos, offset + pos, length, slots + slot)
                    busy = rc == -lib.FI_EAGAIN
                    if busy:   # queue full, or rxm still connecting: progress, then retry
                        eagain += 1
                        if eagain > _MAX_EAGAIN:
                            raise fabric_error(call, rc, peer=self.peer,
                                               detail=f"still busy after {_MAX_EAGAIN} retries")
                        break
                    check(rc, call, peer=self.peer)
                    eagain = 0
                    free.pop()
                    inflight[slot] = length
                    posted += 1
                wait_s = 0.05 if inflight else (0.001 if busy else 0.0)
                finished, errors = stack.cq.poll(timeout_s=wait_s, spin=_CLIENT_SPIN,
                                                 sleep_us=_CLIENT_SLEEP_US)
                if errors:
                    raise self._completion_error(call, errors[0], len(errors))
                for ctx in finished:
                    slot = (ctx - slot_base) // slot_size
                    done += inflight.pop(slot)
                    free.append(slot)
                now = time.monotonic()
                if finished:
                    last_progress = now
                    if progress is not None:
                        progress(done)
                elif now - last_progress > timeout:
                    stuck = (f"{len(inflight)} in flight" if inflight else
                             "the provider kept answering -FI_EAGAIN: is the peer gone?")
                    raise FabricError(
                        f"{call} (peer {self.peer}) timed out: no completion in {timeout:g} s "
                        f"({done} of {size} bytes done; {stuck})",
                        call=call, code=errno.ETIMEDOUT, strerror=os.strerror(errno.ETIMEDOUT))
        except BaseException:
            # Operations may still be in flight into caller memory: close the
            # endpoint (cancelling them) before that memory is deregistered.
            try:
                self.close()
            except FabricError as exc:
                logger.warning("pyfi: closing the connection to %s after a failure: %s", self.peer, exc)
            raise
        finally:
            local.close()
        return done

    def _post(self, call: str, stack: _Stack, local: MemoryRegion, local_pos: int, remote_pos: int,
              length: int, context: Any) -> int:
        ffi, lib = load()
        buf = local.span.ptr + local_pos
        remote = self.address.base + remote_pos
        if call == "fi_read":
            return lib.fi_read(stack.ep.ptr, buf, length, local.desc, self._fi_addr, remote,
                               self.address.key, context)
        return lib.pyfi_write_delivery(stack.ep.ptr, buf, length, local.desc, self._fi_addr, remote,
                                       self.address.key, context,
                                       lib.FI_DELIVERY_COMPLETE | lib.FI_COMPLETION)

    def _completion_error(self, call: str, err: CompletionError, count: int) -> FabricError:
        detail = err.text + (f" (and {count - 1} more)" if count > 1 else "")
        return fabric_error(call, -err.code, peer=self.peer, detail=detail)

    def read_raw(self, dst: Any, remote_offset: int, size: int, *, timeout: float = 10.0) -> int:
        """One fi_read of `size` bytes at base+remote_offset with no client-side bounds
        check: what a forged request looks like to the server. For tests."""
        with self._lock:
            span = as_span(dst, writable=True)
            try:
                return self._transfer("fi_read", span, remote_offset, size, max(size, 1), 1, timeout, None)
            finally:
                span.release()

    def write_raw(self, data: Any, remote_offset: int, *, timeout: float = 10.0) -> int:
        """One fi_write with no client-side checks (writable flag, bounds). For tests."""
        with self._lock:
            span = as_span(data, writable=False)
            try:
                return self._transfer("fi_write", span, remote_offset, span.nbytes, max(span.nbytes, 1), 1,
                                      timeout, None)
            finally:
                span.release()


def connect(address: FabricAddress, *, provider: str | None = None) -> Connection:
    """Open a client endpoint for a served region (address from Server.address)."""
    if not isinstance(address, FabricAddress):
        raise TypeError(f"connect() takes a FabricAddress (Server.address), got {type(address).__name__}")
    return Connection(address, provider=provider)
