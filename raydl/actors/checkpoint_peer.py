"""CheckpointPeer: a process that receives a checkpoint and serves it on; and broadcast().

broadcast() lines the peers up in a chain: peer i reads from peer i-1 what
peer i-1 already holds, chunk window by chunk window, while peer i-1 is still
receiving the rest. Each holder publishes how many chunks it holds in a small
registered word that the next peer reads with RMA, so the chain needs no Ray
call per chunk. The time for N peers is about one transfer plus N windows.
When a holder fails, the peers after it carry on from the publisher. Without
an RMA provider every peer fetches through the object store instead.

CheckpointPeer is a plain class; broadcast() applies ray.remote.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from raydl import checkpoint as ckpt
from raydl._process import process_name
from raydl.errors import CheckpointError, FabricError

logger = logging.getLogger(__name__)

__all__ = ["CheckpointPeer", "broadcast"]

_POLL_S = 0.001


class CheckpointPeer:
    """Receives one checkpoint at a time and serves it to later peers."""

    def __init__(self, *, bind: str | None = None, provider: str | None = None) -> None:
        self._bind = bind
        self._provider = provider
        self._name = process_name()
        self._refs: dict[str, ckpt.CheckpointRef] = {}

    def name(self) -> str:
        return self._name

    def prepare(self, ref: ckpt.CheckpointRef) -> ckpt.CheckpointRef:
        """Allocate and serve this peer's copy (empty so far); returns the ref other peers read it by."""
        from raydl.native import pyfi

        buf = ckpt._aligned_empty(ref.size)
        progress = np.zeros(1, np.int64)  # chunks held, verified
        bind = ckpt._bind(self._bind)
        server = pyfi.serve(buf, bind=bind, provider=self._provider)
        progress_server = pyfi.serve(progress, bind=bind, provider=self._provider)
        mine = ckpt.CheckpointRef(key=ref.key, size=ref.size, chunk_size=ref.chunk_size, checksums=ref.checksums,
                                  header=ref.header, holder=self._name, fabric=server.address,
                                  progress=progress_server.address)
        with ckpt._held_lock:
            ckpt._held[mine.key + mine.holder] = ckpt._Held(buf, server, progress_server, progress)
        self._refs[ref.key] = mine
        return mine

    def pull(self, sources: list[ckpt.CheckpointRef], *, timeout: float = 60.0) -> dict[str, Any]:
        """Fill this peer's copy from the first source that works, the rest as fallbacks."""
        key = sources[0].key
        held = ckpt._held[key + self._refs[key].holder]
        t0 = time.perf_counter()
        done = int(held.progress[0])
        errors = []

        def on_done(n: int) -> None:
            held.progress[0] = n

        for src in sources:
            try:
                with _UpstreamProgress(src) as upstream:
                    ckpt._pull_fabric(src, held.buffer, start=done, timeout=timeout, chunk_size=src.chunk_size,
                                      max_inflight=8, upstream_done=upstream.done, on_done=on_done)
                return {"holder": self._name, "source": src.holder, "seconds": time.perf_counter() - t0,
                        "retried": len(errors)}
            except (CheckpointError, FabricError) as exc:
                done = int(held.progress[0])
                logger.warning("raydl: peer %s: pulling from %s failed at chunk %d (%s); trying the next holder",
                               self._name, src.holder, done, exc)
                errors.append(f"{src.holder}: {exc}")
        raise CheckpointError(f"peer {self._name} could not get checkpoint {key[:8]} from any holder: "
                              + "; ".join(errors))

    def fetch(self, ref: ckpt.CheckpointRef, *, transport: str = "auto") -> dict[str, Any]:
        """Fetch on this peer with checkpoint.fetch (the object-store path of broadcast)."""
        t0 = time.perf_counter()
        state = ckpt.fetch(ref, transport=transport)
        self._state = state
        return {"holder": self._name, "source": state.peer, "seconds": time.perf_counter() - t0, "retried": 0,
                "transport": state.transport}

    def summary(self, key: str) -> dict[str, Any]:
        """Per tensor: dtype, shape and the float64 sum, to compare copies without moving them."""
        held = ckpt._held.get(key + self._refs[key].holder) if key in self._refs else None
        if held is not None:
            header, start = ckpt._parse_header(held.buffer)
            state = ckpt._tensors(held.buffer, header, start)
        else:
            state = self._state
        return {k: (str(v.dtype), tuple(v.shape), float(v.double().sum())) for k, v in state.items()}

    def release(self, key: str) -> None:
        """Stop serving the copy of checkpoint `key` and free it."""
        ref = self._refs.pop(key, None)
        if ref is not None:
            ckpt.unpublish(ref)

    def close(self) -> None:
        """Stop serving every copy (their threads end) - call before killing the actor. Idempotent."""
        for key in list(self._refs):
            self.release(key)


class _UpstreamProgress:
    """How many chunks a source holds: all, for a publisher; read with RMA from a holder's word."""

    def __init__(self, src: ckpt.CheckpointRef) -> None:
        self._src = src
        self._conn = None
        self._word = np.zeros(1, np.int64)
        self._lock = threading.Lock()

    def __enter__(self) -> _UpstreamProgress:
        if self._src.progress is not None:
            from raydl.native import pyfi

            self._conn = pyfi.connect(self._src.progress)
        return self

    def __exit__(self, *exc) -> None:
        if self._conn is not None:
            self._conn.close()

    def done(self) -> int:
        if self._conn is None:
            return len(self._src.checksums)
        with self._lock:
            self._conn.read_into(self._word, timeout=30.0)
            n = int(self._word[0])
        if n < len(self._src.checksums):
            time.sleep(_POLL_S)  # the holder is still receiving: don't spin on its progress word
        return n


def broadcast(ref: ckpt.CheckpointRef, targets: list, *, timeout: float = 120.0,
              transport: str = "auto") -> list[dict[str, Any]]:
    """Get `ref` to every target, a CheckpointPeer actor handle (see `peer_actor`).

    Over fabric the targets form a chain (each serving on what it has);
    without it each fetches through the object store. Returns one dict per
    target (holder, source, seconds, retried, ref). A target that cannot get
    the checkpoint from any holder is a CheckpointError naming it.
    """
    import ray

    if not targets:
        return []
    if transport not in ("auto", "fabric", "object_store"):
        raise ValueError(f"transport must be 'auto', 'fabric' or 'object_store', got {transport!r}")
    use_fabric = transport != "object_store" and ckpt._choose_transport(ref, transport) == "fabric"
    if not use_fabric:
        results = ray.get([t.fetch.remote(ref, transport="object_store") for t in targets], timeout=timeout)
        return [dict(r, ref=None) for r in results]
    refs = ray.get([t.prepare.remote(ref) for t in targets], timeout=timeout)
    calls = []
    for i, t in enumerate(targets):
        # Upstream first, then the publisher and every earlier holder as fallbacks.
        sources = [refs[i - 1] if i else ref] + ([ref] if i else []) + refs[:max(0, i - 1)][::-1]
        calls.append(t.pull.remote(sources, timeout=timeout))
    results, failed = [], []
    for i, call in enumerate(calls):
        try:
            results.append(dict(ray.get(call, timeout=timeout), ref=refs[i]))
        except (ray.exceptions.RayError, CheckpointError) as exc:
            failed.append(f"target {i} ({refs[i].holder}): {exc}")
    if failed:
        raise CheckpointError(f"broadcast of checkpoint {ref.key[:8]} failed for {len(failed)} of "
                              f"{len(targets)} targets: " + "; ".join(failed))
    return results


def peer_actor(node_id: str | None = None, *, bind: str | None = None, provider: str | None = None):
    """Start a CheckpointPeer actor (on `node_id` when given) and return its handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4}
    if node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(CheckpointPeer).options(**opts).remote(bind=bind, provider=provider)
