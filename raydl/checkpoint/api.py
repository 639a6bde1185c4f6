"""publish / fetch / unpublish / prepare: the checkpoint API of one process.

broadcast (raydl/checkpoint/chain.py) and peer_actor (peer.py) build on it;
raydl.checkpoint gathers all six.

This process's checkpoint state lives in one object, `_Process`: the copies it
publishes (a HeldCopies) and its fabric client (connections it reads over).
Only this module writes to it; interpreter exit closes it (servers stop before
libfabric is unloaded). Importing raydl.checkpoint starts prepare()'s fabric
work on a background thread (RAYDL_CHECKPOINT_PREPARE=0 turns that off), so a
fresh process's first fetch finds libfabric started; inside Ray that thread
also starts faulting in a receive buffer of the size the cluster's last
publish left in its KV store (the size hint), so the first fetch lands on
memory already faulted in. No endpoint opens before
it is needed: the serving one with the first publish (closed again with the
last unpublish), the client one with the first fetch (docs/security.md).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import threading
import time
from typing import Any

import numpy as np

from raydl.checkpoint import layout, object_store
from raydl.checkpoint.buffers import BufferPool
from raydl.checkpoint.fabric import FabricClient, pull, verify
from raydl.checkpoint.held import HeldCopies, HeldCopy, SharedBuffer
from raydl.checkpoint.ref import CheckpointRef, FetchedCheckpoint, holder_name
from raydl.checkpoint.target import FetchTarget
from raydl.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK",
    "TRANSPORTS",
    "VERIFY",
    "choose_transport",
    "fetch",
    "prepare",
    "publish",
    "unpublish",
]

DEFAULT_CHUNK = 4 << 20
TRANSPORTS = ("auto", "fabric", "object_store")
VERIFY = ("xxh3", "sha256")


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


_PROCESS = _Process()
atexit.register(_PROCESS.close)


def _bind(bind: str | None) -> str:
    from raydl.env import checkpoint_bind

    return bind if bind is not None else checkpoint_bind()


def prepare(*, buffer_bytes: int | None = None, wait: bool = False) -> None:
    """Bring this process's fabric side up ahead of its first fetch: libfabric's start-up (0.3-0.4 s
    here) and the provider probe; with buffer_bytes, also fault a receive buffer of that size in. It
    opens no endpoint, so nothing listens until something is published (a fetch opens its client
    endpoint, ~3-6 ms). A trainer calls it at start; it runs on a background thread unless
    wait=True. Idempotent; without a usable libfabric only the buffer is prepared."""
    if buffer_bytes is not None and buffer_bytes < 0:
        raise ValueError(f"buffer_bytes must be >= 0, got {buffer_bytes}")
    thread = _PROCESS.start_preparing(_prepare_fabric)
    prefault = None
    if buffer_bytes:
        from raydl.env import checkpoint_faults

        try:
            huge = checkpoint_faults().endswith("-huge")
        except ValueError:  # the fetch says so
            huge = False
        prefault = threading.Thread(
            target=_PROCESS.buffers.prefault,
            args=(buffer_bytes,),
            kwargs={"huge": huge},
            name="raydl-checkpoint-prefault",
            daemon=True,
        )
        prefault.start()
    if wait:
        thread.join()
        if prefault is not None:
            prefault.join()


def _prepare_fabric() -> None:
    try:
        from raydl.native import pyfi
        from raydl.native.pyfi._lifecycle import GATE

        with GATE.inside("checkpoint.prepare"):  # the process's exit waits for libfabric's start-up to end
            if pyfi.available():
                pyfi.choose_provider()
    except Exception as exc:  # noqa: BLE001 - preparing is an optimisation: the fetch will say what fails
        logger.info("raydl: checkpoint.prepare() could not start libfabric: %s", exc)


# -- the size hint: a fresh process's receive buffer faulted in before its first fetch -----------------
SIZE_HINT_KEY = b"checkpoint:last_size"
SIZE_HINT_NAMESPACE = "raydl"
HINT_TTL_S = 60.0  # a buffer faulted in from the hint and not fetched into by then is dropped
HINT_MAX_SHARE = 0.25  # ... and none is faulted in when it would take more of MemAvailable than this
_hinted: int | None = None  # the size this process last wrote there


def _ray_connected():
    """The ray module when this process is connected to a cluster (never imports Ray), else None."""
    import sys

    ray = sys.modules.get("ray")
    try:
        return ray if ray is not None and ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported Ray: no hint
        return None


def _record_size_hint(size: int) -> None:
    """Inside Ray, note the last published checkpoint's size in the cluster's KV store (best effort): a
    process that imports raydl.checkpoint later faults a receive buffer that large in before it fetches."""
    global _hinted
    if _ray_connected() is None or _hinted == size:  # a trainer publishes the same size again and again
        return
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(
            SIZE_HINT_KEY, str(int(size)).encode(), overwrite=True, namespace=SIZE_HINT_NAMESPACE
        )
        _hinted = size
    except Exception as exc:  # noqa: BLE001 - a hint, nothing depends on it
        logger.debug("raydl: could not record the checkpoint size hint: %s", exc)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def size_hint() -> int | None:
    """The last checkpoint size published in this process's Ray cluster, when it is a sane receive
    buffer here: at most HINT_MAX_SHARE of MemAvailable (the value comes from the cluster's KV store,
    so it is checked like any other input). None outside Ray, without a hint, or when too large."""
    if _ray_connected() is None:
        return None
    try:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(SIZE_HINT_KEY, namespace=SIZE_HINT_NAMESPACE)
    except Exception as exc:  # noqa: BLE001
        logger.debug("raydl: no checkpoint size hint: %s", exc)
        return None
    return sane_size_hint(raw, _mem_available())


def sane_size_hint(raw: bytes | None, available: int | None) -> int | None:
    """The hint's bytes as a size, when it is a positive decimal of at most HINT_MAX_SHARE of
    `available` bytes; else None. Pure."""
    if not raw or len(raw) > 20 or available is None:
        return None
    try:
        size = int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return size if 0 < size <= HINT_MAX_SHARE * available else None


def decline_receive_prefault() -> None:
    """This process will not fetch into a receive buffer (a broadcast peer): no receive buffer is
    faulted in from the size hint, and one under way is dropped."""
    _PROCESS.buffers.decline_ahead()


def _prepare_from_hint() -> None:
    """What the import's background thread does: inside Ray, a receive buffer of the cluster's last
    published checkpoint size starts faulting in (Toucher threads, returning at once) unless this
    process publishes or fetched already; then libfabric's start-up. A fetch that starts meanwhile
    takes the buffer over; unfetched, it goes after HINT_TTL_S."""
    from raydl.env import checkpoint_faults

    try:
        way = checkpoint_faults()
    except ValueError:
        way = "hint"
    size = None if way != "hint" or len(_PROCESS.published) else size_hint()
    if size is not None:  # first: it takes longer than libfabric's start-up, and runs beside it
        if _PROCESS.buffers.prefault_ahead(size, ttl_s=HINT_TTL_S):
            logger.debug("raydl: faulting a %d-byte receive buffer in ahead of the first fetch", size)
    _prepare_fabric()


def prepare_at_import() -> None:
    """What importing raydl.checkpoint does: prepare() in the background, as RAYDL_CHECKPOINT_PREPARE
    says (default: the fabric side, and inside Ray a receive buffer of the cluster's last published
    checkpoint size, see _prepare_from_hint; a size: a receive buffer that large; 0: nothing). It
    never blocks the import nor fails it: a bad value is logged and ignored."""
    from raydl.env import checkpoint_prepare

    try:
        enabled, buffer_bytes = checkpoint_prepare()
    except ValueError as exc:
        logger.warning("raydl: %s; not preparing the checkpoint fabric at import", exc)
        return
    if not enabled:
        return
    if buffer_bytes:
        prepare(buffer_bytes=buffer_bytes)
    else:
        _PROCESS.start_preparing(_prepare_from_hint)


def _before_fork() -> None:
    # A child forked while libfabric starts up could inherit its locks held: let it finish (bounded).
    _PROCESS.wait_prepared(timeout=5.0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_PROCESS.forget_after_fork)


def publish(
    state: dict[str, Any] | str | os.PathLike,
    *,
    transports: tuple[str, ...] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    bind: str | None = None,
    provider: str | None = None,
    verify: str = "xxh3",
) -> CheckpointRef:
    """Lay `state` out once as safetensors, serve it from this process, return its CheckpointRef.

    state: dict[str, torch.Tensor] (any dtype, shape, contiguity) or a path to a
    .safetensors file (served from a read-only mapping, not copied).
    transports: ("fabric",), ("object_store",) or both; default: both where they
    can work (fabric needs an RMA provider, the object store needs Ray). The
    object store serves on demand, from these same bytes: nothing is put in
    plasma until a peer asks. Keep serving until unpublish(ref).
    bind: "host:port" the fabric endpoint listens on (default: RAYDL_CHECKPOINT_BIND,
    else Ray's node address inside Ray, else 127.0.0.1; "" lets the provider choose).
    verify: "xxh3" (default: an XXH3-64 digest per chunk, which catches corruption)
    or "sha256" (a SHA-256 digest per chunk too, which also catches tampering in
    flight: it travels with the ref through Ray, and every fetcher checks it).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if verify not in VERIFY:
        raise ValueError(f"verify must be one of {VERIFY}, got {verify!r}")
    from raydl.native import pyfi

    _PROCESS.wait_prepared()  # libfabric's start-up may be under way: not twice at once
    if transports is None:
        transports = ("fabric", "object_store") if pyfi.available() else ("object_store",)
    bad = set(transports) - {"fabric", "object_store"}
    if bad or not transports:
        raise ValueError(f"transports must name 'fabric' and/or 'object_store', got {transports!r}")
    if "fabric" in transports and not pyfi.available():
        raise CheckpointError(
            f"transport 'fabric' asked for, but libfabric is unusable: {pyfi.unavailable_reason()}"
        )
    key = secrets.token_hex(16)
    memory = None
    server = None
    if isinstance(state, (str, os.PathLike)):
        memory = SharedBuffer.file(os.fspath(state))

    def alloc(n: int) -> np.ndarray:
        nonlocal memory
        memory = SharedBuffer.anonymous(n, f"ckpt-{key}")
        return memory.array

    try:
        if memory is None:
            layout.pack_into(state, alloc)
        buf = memory.array
        header, _start = layout.parse_header(buf)
        checksums = layout.checksums(buf, chunk_size)
        sha256 = layout.sha256s(buf, chunk_size) if verify == "sha256" else None
        if "fabric" in transports:
            server = _PROCESS.serve(buf, _bind(bind), pyfi.choose_provider(provider))
        ref = CheckpointRef(
            key=key,
            size=len(buf),
            chunk_size=chunk_size,
            checksums=checksums,
            header=json.dumps(header),
            holder=holder_name(),
            fabric=server.address if server else None,
            location=memory.location,
            object_store="object_store" in transports,
            sha256=sha256,
        )
        _PROCESS.published.add(HeldCopy(key, memory, server))
        _PROCESS.buffers.decline_ahead()  # a publisher keeps no receive buffer faulted in from the hint
        _record_size_hint(ref.size)
    except BaseException:
        if server is not None:
            server.close()
            _PROCESS.close_idle_endpoints()
        if memory is not None:
            memory.close()
        raise
    logger.info("raydl: published checkpoint %s (%d bytes) over %s", key[:8], ref.size, ref.transports)
    return ref


def unpublish(ref: CheckpointRef) -> None:
    """Stop serving `ref` from this process: deregister its fabric region and close its memory, so
    later fetches fail with a CheckpointError naming the holder; the last one unpublished from an
    endpoint closes it (its listener too). Idempotent."""
    _PROCESS.published.close(ref.key)
    _PROCESS.close_idle_endpoints()


def choose_transport(ref: CheckpointRef, transport: str) -> str:
    """ "fabric" or "object_store" for fetching `ref` here with `transport` ("auto", "fabric",
    "object_store")."""
    from raydl.native import pyfi

    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    _PROCESS.wait_prepared()
    if transport in ("auto", "fabric") and ref.fabric is not None and pyfi.available():
        return "fabric"
    if transport == "fabric":
        why = "the publisher serves no fabric address" if ref.fabric is None else pyfi.unavailable_reason()
        raise CheckpointError(f"transport='fabric' for {ref!r}, but {why}")
    if "object_store" not in ref.transports:
        raise CheckpointError(
            f"{ref!r} cannot be served through the object store (its holder has no Ray, or "
            "it was published with transports=('fabric',)), and fabric is not usable here"
        )
    if transport == "auto":
        logger.warning(
            "raydl: fetching checkpoint %s through the Ray object store (no fabric path)", ref.key[:8]
        )
    return "object_store"


def fetch(
    ref: CheckpointRef,
    *,
    transport: str = "auto",
    device: str = "cpu",
    into: str | os.PathLike | None = None,
    timeout: float = 60.0,
    chunk_size: int | None = None,
    max_inflight: int = 8,
    link_gbps: float | None = None,
) -> FetchedCheckpoint:
    """Pull the checkpoint into this process and return its tensors (built on the bytes, no copy).

    transport: "fabric" (libfabric or an error), "object_store", or "auto"
    (fabric when both sides can, else the object store; the choice is logged
    and kept in `.transport`). into=path writes a .safetensors file atomically
    (a temporary file allocated in full first, so a full disk is a
    CheckpointError naming the path and the free space; then fsync, rename,
    fsync of the directory) and returns tensors mapped from it. Every chunk's
    digest is checked (SHA-256 when published with verify="sha256", else
    XXH3-64); a mismatch is a CheckpointError naming the peer and chunk, and
    nothing is left behind. A dead or unpublished holder is a
    CheckpointError within seconds. link_gbps paces the reads (a simulated
    link, for benchmarks and tests).
    """
    if link_gbps is not None and link_gbps <= 0:
        raise ValueError(f"link_gbps must be positive, got {link_gbps}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    target = FetchTarget(ref.size, into, _PROCESS.buffers, name=ref.key[:8])
    target.fault_ahead()  # fresh memory: toucher threads fault it in just ahead of the reads
    phases["register"] = time.perf_counter() - t0
    try:
        t = time.perf_counter()
        chosen = choose_transport(ref, transport)  # waits for a prepare() under way
        phases["probe"] = time.perf_counter() - t
        peer = f"{ref.holder} ({ref.fabric.peer})" if chosen == "fabric" else f"object store ({ref.holder})"
        if chosen == "fabric":
            pull(
                _PROCESS.fabric,
                ref,
                target.buffer,
                timeout=timeout,
                chunk_size=chunk_size or ref.chunk_size,
                max_inflight=max_inflight,
                link_gbps=link_gbps,
                phases=phases,
                on_landed=target.landed,
            )
        else:
            t = time.perf_counter()
            object_store.fetch_bytes(ref, target.buffer, timeout=timeout)
            phases["transfer"] = time.perf_counter() - t
            t = time.perf_counter()
            verify(target.buffer, ref, 0, len(ref.checksums), peer)
            phases["verify"] = time.perf_counter() - t
        target.done()
        target.commit()
    except BaseException:
        target.done()
        target.abort()
        raise
    t = time.perf_counter()
    header, start = layout.parse_header(target.buffer)
    state = FetchedCheckpoint(layout.tensors(target.final_buffer(), header, start))
    if device != "cpu":
        state = FetchedCheckpoint({k: v.to(device) for k, v in state.items()})
    phases["build"] = time.perf_counter() - t
    state.transport, state.peer, state.path = chosen, peer, target.path
    state.seconds, state.phases = time.perf_counter() - t0, phases
    logger.info(
        "raydl: fetched checkpoint %s (%d bytes) over %s from %s in %.2f s",
        ref.key[:8],
        ref.size,
        chosen,
        peer,
        state.seconds,
    )
    return state
