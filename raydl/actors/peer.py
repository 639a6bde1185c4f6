"""CheckpointPeer: a process that receives a checkpoint and serves it on (see raydl.checkpoint.chain).

A plain class; peer_actor() applies ray.remote. The peer owns the copies it
holds (a HeldCopies), the one server endpoint it serves them all from (so the
next peer's connection to it, too, is made once), and its fabric client;
close() - also called by Ray when the actor exits (__ray_shutdown__) - stops
every server before the process goes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from raydl.checkpoint import api, layout
from raydl.checkpoint.fabric import FabricClient, pull
from raydl.checkpoint.held import HeldCopies, HeldCopy, SharedBuffer
from raydl.checkpoint.ref import CheckpointRef, holder_name
from raydl.errors import CheckpointError, FabricError

logger = logging.getLogger(__name__)

__all__ = ["CheckpointPeer", "peer_actor"]


class CheckpointPeer:
    """Receives one checkpoint at a time and serves it to later peers."""

    def __init__(self, *, bind: str | None = None, provider: str | None = None) -> None:
        self._bind = bind
        self._provider = provider
        self._name = holder_name()
        self._copies = HeldCopies()
        self._fabric = FabricClient()
        self._lock = threading.Lock()
        # pyfi.ServerEndpoint every copy is served from (one stack, one thread), open while it holds one
        self._endpoint = None
        self._refs: dict[str, CheckpointRef] = {}
        self._state: dict[str, Any] | None = None
        api.decline_receive_prefault()  # it receives into served memory, not a receive buffer

    def name(self) -> str:
        return self._name

    def prepare(self, ref: CheckpointRef) -> CheckpointRef:
        """Allocate and serve this peer's copy (empty so far); returns the ref other peers read it by."""
        from raydl.env import checkpoint_bind
        from raydl.native import pyfi

        ref.check()  # before its size is allocated
        # The bytes, then (8-aligned) the progress word: chunks held, verified. One region, one server:
        # the next peer reads both over one connection.
        word_at = -(-ref.size // 8) * 8
        memory = SharedBuffer.anonymous(word_at + 8, f"peer-{ref.key}")
        copy = HeldCopy(ref.key, memory, progress=memory.array[word_at : word_at + 8].view(np.int64))
        try:
            with self._lock:  # calls run on up to 4 threads
                if self._endpoint is None or self._endpoint.closed:
                    if self._endpoint is not None:
                        self._endpoint.close()  # its serving thread stopped: serve from a new one
                    bind = self._bind if self._bind is not None else checkpoint_bind()
                    self._endpoint = pyfi.ServerEndpoint(self._provider, bind=bind)
                copy.server = self._endpoint.serve(memory.array)  # under the lock: release() closes idle ones
            self._copies.add(copy)
        except BaseException:
            copy.close()
            raise
        # The publisher's digests (SHA-256 too, when it asked for them) go down the chain unchanged
        mine = dataclasses.replace(
            ref,
            holder=self._name,
            fabric=copy.server.address,
            location=memory.location,
            progress_at=word_at,
            object_store=True,
        )
        self._refs[ref.key] = mine
        return mine

    def pull(
        self,
        sources: list[CheckpointRef],
        *,
        timeout: float = 60.0,
        window_bytes: int | None = None,
        link_gbps: float | None = None,
    ) -> dict[str, Any]:
        """Fill this peer's copy from the first source that works, the rest as fallbacks. Returns
        holder, source, seconds, retried, cpu_seconds (this process's CPU time, all threads, meanwhile),
        first_window_at and last_window_at."""
        key = sources[0].key
        copy = self._copies.get(key)
        if copy is None:
            raise CheckpointError(f"peer {self._name}: prepare() checkpoint {key[:8]} before pulling it")
        t0, cpu0 = time.perf_counter(), time.process_time()
        errors = []
        # wall-clock times of the first and the last verified window: they show the chain overlapping
        seen: dict[str, float] = {}

        def on_done(n: int) -> None:
            copy.progress[0] = n
            seen.setdefault("first_window_at", time.time())
            seen["last_window_at"] = time.time()

        for src in sources:
            try:
                self._pull_from(
                    src, copy, on_done, timeout=timeout, window_bytes=window_bytes, link_gbps=link_gbps
                )
                return {
                    "holder": self._name,
                    "source": src.holder,
                    "seconds": time.perf_counter() - t0,
                    "retried": len(errors),
                    "cpu_seconds": time.process_time() - cpu0,
                    **seen,
                }
            except (CheckpointError, FabricError) as exc:
                logger.warning(
                    "raydl: peer %s: pulling from %s failed at chunk %d (%s); trying the next holder",
                    self._name,
                    src.holder,
                    int(copy.progress[0]),
                    exc,
                )
                errors.append(f"{src.holder}: {exc}")
        raise CheckpointError(
            f"peer {self._name} could not get checkpoint {key[:8]} from any holder: " + "; ".join(errors)
        )

    def _pull_from(
        self,
        src: CheckpointRef,
        copy: HeldCopy,
        on_done: Callable[[int], None],
        *,
        timeout: float,
        window_bytes: int | None,
        link_gbps: float | None,
    ) -> None:
        """The chunks of this peer's copy it does not hold yet, read from `src` (and verified)."""
        mine = self._refs.get(copy.key)
        src.check()
        if (
            mine is None
            or src.key != mine.key
            or (src.size, src.chunk_size, tuple(src.checksums), src.sha256)
            != (
                mine.size,
                mine.chunk_size,
                tuple(mine.checksums),
                mine.sha256,
            )
        ):
            raise CheckpointError(
                f"peer {self._name}: {src.holder[:200]} offers checkpoint {src.key[:8]} with other bytes "
                "(size, chunks or digests) than the one this peer prepared"
            )
        pull(
            self._fabric,
            src,
            copy.buffer[: src.size],
            start=int(copy.progress[0]),
            timeout=timeout,
            chunk_size=src.chunk_size,
            max_inflight=8,
            window_bytes=window_bytes,
            link_gbps=link_gbps,
            progress_at=src.progress_at,
            on_done=on_done,
        )

    def fetch(self, ref: CheckpointRef, *, transport: str = "auto") -> dict[str, Any]:
        """Fetch on this peer with checkpoint.fetch (the object-store path of broadcast)."""
        t0 = time.perf_counter()
        state = api.fetch(ref, transport=transport)
        self._state = state
        return {
            "holder": self._name,
            "source": state.peer,
            "seconds": time.perf_counter() - t0,
            "retried": 0,
            "transport": state.transport,
        }

    def summary(self, key: str) -> dict[str, Any]:
        """Per tensor: dtype, shape and the float64 sum, to compare copies without moving them."""
        copy = self._copies.get(key)
        if copy is not None:
            data = copy.buffer[: self._refs[key].size]
            header, start = layout.parse_header(data, f"checkpoint {key[:8]} at peer {self._name}")
            state = layout.tensors(data, header, start)
        elif self._state is not None:
            state = self._state
        else:
            raise CheckpointError(f"peer {self._name} holds no checkpoint {key[:8]}")
        return {k: (str(v.dtype), tuple(v.shape), float(v.double().sum())) for k, v in state.items()}

    def release(self, key: str) -> None:
        """Stop serving the copy of checkpoint `key` and free it; with it the last, the endpoint (and its
        listener) closes until the next prepare()."""
        self._refs.pop(key, None)
        self._copies.close(key)
        with self._lock:
            endpoint = self._endpoint
            if endpoint is not None and endpoint.idle:
                self._endpoint = None
            else:
                endpoint = None
        if endpoint is not None:
            endpoint.close()

    def close(self) -> None:
        """Stop serving every copy (their threads end) and close connections. Idempotent."""
        self._refs.clear()
        self._copies.close_all()
        with self._lock:
            endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.close()
        self._fabric.close()

    def __ray_shutdown__(self) -> None:
        """Ray calls this when the actor exits gracefully: no server may outlive the process's Python."""
        self.close()


def peer_actor(node_id: str | None = None, *, bind: str | None = None, provider: str | None = None):
    """Start a CheckpointPeer actor (on `node_id` when given): a broadcast target that serves on what it
    gets."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4}
    if node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(CheckpointPeer).options(**opts).remote(bind=bind, provider=provider)
