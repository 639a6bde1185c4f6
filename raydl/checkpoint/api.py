"""publish / fetch / unpublish / prepare: the checkpoint API of one process.

broadcast (raydl/checkpoint/chain.py) and peer_actor (raydl/actors/peer.py) build on it;
raydl.checkpoint gathers all six.

publish lays a checkpoint out once and serves it; fetch picks a transport,
pulls the bytes into a FetchTarget and builds tensors on them. What the
process holds meanwhile (its published copies, receive buffers, fabric client
and endpoints) is one object in process.py; prepare(), which brings the fabric
side up ahead of the first fetch, and the cluster's size hint are in
startup.py, re-exported here.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from typing import Any

import numpy as np

from raydl.checkpoint import layout, object_store
from raydl.checkpoint.buffers import BufferPool
from raydl.checkpoint.fabric import pull, verify
from raydl.checkpoint.held import HeldCopy, SharedBuffer
from raydl.checkpoint.process import PROCESS as _PROCESS
from raydl.checkpoint.process import bind_address
from raydl.checkpoint.ref import CheckpointRef, FetchedCheckpoint, holder_name
from raydl.checkpoint.startup import (
    decline_receive_prefault,
    prepare,
    prepare_at_import,
    record_size_hint,
    sane_size_hint,
    size_hint,
)
from raydl.checkpoint.target import FetchTarget
from raydl.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK",
    "TRANSPORTS",
    "VERIFY",
    "BufferPool",
    "choose_transport",
    "decline_receive_prefault",
    "fetch",
    "prepare",
    "prepare_at_import",
    "publish",
    "sane_size_hint",
    "size_hint",
    "unpublish",
]

DEFAULT_CHUNK = 4 << 20
TRANSPORTS = ("auto", "fabric", "object_store")
VERIFY = ("xxh3", "sha256")


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
    transports = _publish_transports(transports, chunk_size, verify)
    from raydl.native import pyfi

    key = secrets.token_hex(16)
    memory = _lay_out(state, key)
    server = None
    try:
        buf = memory.array
        what = f"checkpoint {os.fspath(state)!r}" if isinstance(state, (str, os.PathLike)) else "the state"
        described = _describe(buf, chunk_size, verify, what)
        if "fabric" in transports:
            server = _PROCESS.serve(buf, bind_address(bind), pyfi.choose_provider(provider))
        ref = CheckpointRef(
            key=key,
            holder=holder_name(),
            fabric=server.address if server else None,
            location=memory.location,
            object_store="object_store" in transports,
            **described,
        )
        _hold(ref, memory, server)
    except BaseException:
        if server is not None:
            server.close()
            _PROCESS.close_idle_endpoints()
        memory.close()
        raise
    logger.info("raydl: published checkpoint %s (%d bytes) over %s", key[:8], ref.size, ref.transports)
    return ref


def _publish_transports(transports: tuple[str, ...] | None, chunk_size: int, verify: str) -> tuple[str, ...]:
    """publish()'s options checked, and the transports it serves over (default: both where fabric works,
    else the object store). Waits for a prepare() under way: libfabric does not start twice at once."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if verify not in VERIFY:
        raise ValueError(f"verify must be one of {VERIFY}, got {verify!r}")
    from raydl.native import pyfi

    _PROCESS.wait_prepared()
    if transports is None:
        transports = ("fabric", "object_store") if pyfi.available() else ("object_store",)
    bad = set(transports) - {"fabric", "object_store"}
    if bad or not transports:
        raise ValueError(f"transports must name 'fabric' and/or 'object_store', got {transports!r}")
    if "fabric" in transports and not pyfi.available():
        raise CheckpointError(
            f"transport 'fabric' asked for, but libfabric is unusable: {pyfi.unavailable_reason()}"
        )
    return transports


def _lay_out(state: dict[str, Any] | str | os.PathLike, key: str) -> SharedBuffer:
    """`state`'s safetensors bytes in memory a holder can share: a file's read-only mapping, or tensors
    packed into fresh anonymous memory (closed again when packing fails)."""
    if isinstance(state, (str, os.PathLike)):
        return SharedBuffer.file(os.fspath(state))
    memory = None

    def alloc(n: int) -> np.ndarray:
        nonlocal memory
        memory = SharedBuffer.anonymous(n, f"ckpt-{key}")
        return memory.array

    try:
        layout.pack_into(state, alloc)
    except BaseException:
        if memory is not None:
            memory.close()
        raise
    return memory


def _describe(buf: np.ndarray, chunk_size: int, verify: str, what: str) -> dict[str, Any]:
    """What a ref says of the bytes: size, chunking, header, one XXH3-64 per chunk (and one SHA-256 per
    chunk with verify="sha256"). Bytes that are not a safetensors file the format's reader would take
    are a CheckpointError naming `what`."""
    header, _start = layout.parse_header(buf, what)
    checksums = layout.checksums(buf, chunk_size)
    sha256 = layout.sha256s(buf, chunk_size) if verify == "sha256" else None
    return {
        "size": len(buf),
        "chunk_size": chunk_size,
        "checksums": checksums,
        "header": json.dumps(header),
        "sha256": sha256,
    }


def _hold(ref: CheckpointRef, memory: SharedBuffer, server) -> None:
    """Keep serving `ref` from `memory` (and `server`) until unpublish, and note its size for the cluster."""
    _PROCESS.published.add(HeldCopy(ref.key, memory, server))
    _PROCESS.buffers.decline_ahead()  # a publisher keeps no receive buffer faulted in from the hint
    record_size_hint(ref.size)


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
    ref.check()  # before anything is allocated for it
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
        pulls = {"chunk_size": chunk_size, "max_inflight": max_inflight, "link_gbps": link_gbps}
        _transfer(ref, chosen, peer, target, phases, timeout=timeout, **pulls)
        target.done()
        # the tensors before the name: bytes that are no safetensors file leave no file behind
        state = _build(ref, target, device, phases, f"checkpoint {ref.key[:8]} from {peer}")
        target.commit()
    except BaseException:
        target.done()
        target.abort()
        raise
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


def _transfer(
    ref: CheckpointRef,
    chosen: str,
    peer: str,
    target: FetchTarget,
    phases: dict[str, float],
    *,
    timeout: float,
    chunk_size: int | None,
    max_inflight: int,
    link_gbps: float | None,
) -> None:
    """The checkpoint's bytes into `target`, verified, over the `chosen` transport: fabric pulls verify
    each chunk as it lands; the object store's bytes are verified once they are all in."""
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
        return
    t = time.perf_counter()
    object_store.fetch_bytes(ref, target.buffer, timeout=timeout)
    phases["transfer"] = time.perf_counter() - t
    t = time.perf_counter()
    verify(target.buffer, ref, 0, len(ref.checksums), peer)
    phases["verify"] = time.perf_counter() - t


def _build(
    ref: CheckpointRef, target: FetchTarget, device: str, phases: dict[str, float], where: str
) -> FetchedCheckpoint:
    """The tensors on the fetched bytes (moved to `device` unless it is the CPU); adds the "build" phase.
    The header is checked again here: the digests say the bytes are the publisher's, not that they are a
    usable file."""
    t = time.perf_counter()
    header, start = layout.parse_header(target.buffer, where)
    state = FetchedCheckpoint(layout.tensors(target.final_buffer(), header, start))
    if device != "cpu":
        state = FetchedCheckpoint({k: v.to(device) for k, v in state.items()})
    phases["build"] = time.perf_counter() - t
    return state
