"""The two processes of `raydl bench checkpoint`: a Source on the publisher's node, a Sink on another.

Plain classes; checkpoint.py applies `ray.remote` with node affinity. Every
figure is timed inside the process that receives the bytes, with
`time.perf_counter`, so the driver's Ray round trips are not counted.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["ColdFetcher", "Sink", "Source", "make_state"]

_PAGE = 4096


def make_state(size: int, seed: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    """One uint8 buffer of `size` bytes and a state dict of float32/bfloat16 tensors viewing all of it.

    The tensors are views, so the state dict and the raw buffer are the same
    bytes: what raydl publishes and what the plain `ray.put` baseline puts.
    `size` must be a multiple of 4 and at least 64 KiB.
    """
    import torch

    if size % 4 or size < 64 << 10:
        raise ValueError(f"checkpoint size must be a multiple of 4 bytes and >= 64 KiB, got {size}")
    blob = np.empty(size, np.uint8)
    cuts = [0]
    for frac in (3 / 8, 3 / 4, 7 / 8):  # page-aligned boundaries
        cuts.append(int(size * frac) // _PAGE * _PAGE)
    cuts.append(size)
    layout = (
        ("layers.0.attn.qkv.weight", torch.float32),
        ("layers.0.mlp.up.weight", torch.bfloat16),
        ("layers.1.mlp.down.weight", torch.float32),
        ("embed.weight", torch.bfloat16),
    )
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for (name, dtype), lo, hi in zip(layout, cuts, cuts[1:], strict=False):
        count = (hi - lo) // dtype.itemsize
        flat = torch.frombuffer(blob, dtype=dtype, offset=lo, count=count)
        flat.normal_(0.0, 0.02, generator=gen)
        cols = 1024 if count % 1024 == 0 else 1
        state[name] = flat.view(count // cols, cols) if cols > 1 else flat
    return blob, state


class Source:
    """Node 0: holds the checkpoint, publishes it (fabric or object store) and puts its raw bytes."""

    def __init__(self, size: int, warm_size: int, provider: str | None, seed: int = 0) -> None:
        self._provider = provider
        self._data = {"full": make_state(size, seed), "warm": make_state(warm_size, seed + 1)}
        self._refs: dict[str, Any] = {}
        self._puts: dict[str, Any] = {}

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def publish(self, kind: str, transports: tuple[str, ...], chunk_size: int):
        from raydl import checkpoint

        _blob, state = self._data[kind]
        ref = checkpoint.publish(state, transports=transports, chunk_size=chunk_size, provider=self._provider)
        self._refs[ref.key] = ref
        return ref

    def unpublish(self, key: str) -> None:
        """Stop serving, and drop this process's handle on any object-store copy."""
        from raydl import checkpoint

        ref = self._refs.pop(key, None)
        if ref is not None:
            checkpoint.unpublish(ref)

    def put(self, kind: str) -> list:
        """`ray.put` the raw bytes (one numpy uint8 array); the ObjectRef comes back wrapped in a list."""
        import ray

        blob, _state = self._data[kind]
        oref = ray.put(blob)
        self._puts[oref.hex()] = oref
        return [oref]

    def drop(self, hex_id: str) -> None:
        self._puts.pop(hex_id, None)

    def clear(self) -> None:
        for key in list(self._refs):
            self.unpublish(key)
        self._puts.clear()


class Sink:
    """Node 1: receives, times, lets go."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def fetch(self, ref, transport: str, timeout: float, link_gbps: float | None = None) -> dict[str, Any]:
        from raydl import checkpoint

        t0 = time.perf_counter()
        state = checkpoint.fetch(ref, transport=transport, timeout=timeout, link_gbps=link_gbps)
        seconds = time.perf_counter() - t0
        out = {
            "seconds": seconds,
            "bytes": ref.size,
            "transport": state.transport,
            "peer": state.peer,
            "fetch_seconds": state.seconds,
            "tensors": len(state),
        }
        del state  # the copy goes now, not at the next call
        return out

    def get(self, wrapped: list, timeout: float) -> dict[str, Any]:
        import ray

        t0 = time.perf_counter()
        arr = ray.get(wrapped[0], timeout=timeout)
        seconds = time.perf_counter() - t0
        out = {"seconds": seconds, "bytes": int(arr.nbytes)}
        del arr
        return out


class ColdFetcher:
    """A fresh process on the fetching node, as a trainer is: torch imported at start and, when
    `prepare`, checkpoint.prepare() called there (in the background). Its first fetch is the cold one."""

    def __init__(self, prepare: bool, buffer_bytes: int | None = None) -> None:
        import torch

        torch.zeros(1)
        from raydl import checkpoint

        if prepare:
            checkpoint.prepare(buffer_bytes=buffer_bytes)

    def ready(self) -> bool:
        return True

    def fetch(self, ref, transport: str, timeout: float, link_gbps: float | None = None) -> dict[str, Any]:
        import os

        from raydl import checkpoint

        c0 = os.times()
        t0 = time.perf_counter()
        state = checkpoint.fetch(ref, transport=transport, timeout=timeout, link_gbps=link_gbps)
        seconds = time.perf_counter() - t0
        c1 = os.times()
        out = {
            "seconds": seconds,
            "bytes": ref.size,
            "transport": state.transport,
            "phases": dict(state.phases),
            # every thread of this process, during the fetch: the reads, the faults, the digests
            "cpu_seconds": (c1.user - c0.user) + (c1.system - c0.system),
        }
        del state
        return out

    def get(self, wrapped: list, timeout: float) -> dict[str, Any]:
        import ray

        t0 = time.perf_counter()
        arr = ray.get(wrapped[0], timeout=timeout)
        out = {"seconds": time.perf_counter() - t0, "bytes": int(arr.nbytes)}
        del arr
        return out

    def raw(
        self, ref, timeout: float, link_gbps: float | None = None, max_inflight: int = 8
    ) -> dict[str, Any]:
        """The raw pyfi read loop from the same holder into this process: one read_into of every
        byte, with fetch()'s chunk size and reads in flight, into memory already faulted in (4 KiB
        pages, as fetch's), on a connection already up; no digest, no tensors. What a warm fetch is
        measured against."""
        from raydl.checkpoint.buffers import fresh, populate
        from raydl.native import pyfi

        mm = fresh(ref.size)  # the kind of memory a fetch reads into (4 KiB pages), faulted in
        populate(mm)
        dst = np.frombuffer(mm, np.uint8)[: ref.size]
        pacer = pyfi.Pacer(link_gbps * 1e9 / 8, burst=ref.chunk_size) if link_gbps else None
        provider, fabric, host = pyfi.Client.key_for(ref.fabric)
        client = pyfi.Client(provider, host=host, fabric_name=fabric)
        try:
            conn = client.connect(ref.fabric)
            conn.read_into(dst[:8], 0, 8, timeout=timeout)  # rxm connects on first use: not timed
            t0 = time.perf_counter()
            conn.read_into(
                dst,
                0,
                ref.size,
                chunk_size=ref.chunk_size,
                max_inflight=max_inflight,
                timeout=timeout,
                pacer=pacer,
            )
            seconds = time.perf_counter() - t0
        finally:
            client.close()
        return {"seconds": seconds, "bytes": ref.size}
