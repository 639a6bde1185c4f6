"""broadcast(): one checkpoint to many CheckpointPeer actors, over a chain that pipelines.

Peer i reads from peer i-1 what peer i-1 already holds (at most a window per
read), while peer i-1 is still receiving the rest. Each holder keeps how many
chunks it holds, verified, in a word just after the bytes, in the same served
region, advanced chunk by chunk; the next peer reads it with RMA over the
connection its reads use, so the chain needs no Ray call per chunk: the time
for N peers is about one transfer plus N chunks (each hop: a chunk's transfer
and a look at the word, about a chunk's time apart). When a holder fails, the
peers after it carry on from the publisher (then from earlier holders).
Without an RMA provider every peer fetches through the object store instead.
"""

from __future__ import annotations

from typing import Any

from raydl.checkpoint.api import choose_transport
from raydl.checkpoint.ref import CheckpointRef
from raydl.errors import CheckpointError

__all__ = ["broadcast", "chain_sources"]

DEFAULT_WINDOW = 8 << 20  # the most a peer reads in one go before it looks at its upstream's progress again


def chain_sources(publisher: CheckpointRef, peers: list[CheckpointRef]) -> list[list[CheckpointRef]]:
    """For each peer, where to read from in order: its upstream first, then the publisher, then the
    earlier holders nearest first. Pure."""
    out = []
    for i in range(len(peers)):
        out.append([peers[i - 1], publisher, *peers[: max(0, i - 1)][::-1]] if i else [publisher])
    return out


def broadcast(
    ref: CheckpointRef,
    targets: list,
    *,
    timeout: float = 120.0,
    transport: str = "auto",
    window_bytes: int = DEFAULT_WINDOW,
    link_gbps: float | None = None,
) -> list[dict[str, Any]]:
    """Get `ref` to every target, a CheckpointPeer actor handle (see `peer_actor`).

    Over fabric the targets form a chain (each serving on what it has);
    without it each fetches through the object store. Returns one dict per
    target (holder, source, seconds, retried, ref; over fabric also
    first_window_at and last_window_at, wall-clock times). A target that cannot get
    the checkpoint from any holder is a CheckpointError naming it. link_gbps
    caps every link of the chain (a simulated network, for benchmarks and tests).
    """
    import ray

    if window_bytes <= 0:
        raise ValueError(f"window_bytes must be positive, got {window_bytes}")
    if link_gbps is not None and link_gbps <= 0:
        raise ValueError(f"link_gbps must be positive, got {link_gbps}")
    if not targets:
        return []
    if choose_transport(ref, transport) != "fabric":
        results = ray.get([t.fetch.remote(ref, transport="object_store") for t in targets], timeout=timeout)
        return [dict(r, ref=None) for r in results]
    refs = ray.get([t.prepare.remote(ref) for t in targets], timeout=timeout)
    calls = [
        t.pull.remote(sources, timeout=timeout, window_bytes=window_bytes, link_gbps=link_gbps)
        for t, sources in zip(targets, chain_sources(ref, refs), strict=True)
    ]
    results, failed = [], []
    for i, call in enumerate(calls):
        try:
            results.append(dict(ray.get(call, timeout=timeout), ref=refs[i]))
        except (ray.exceptions.RayError, CheckpointError) as exc:
            failed.append(f"target {i} ({refs[i].holder}): {exc}")
    if failed:
        raise CheckpointError(
            f"broadcast of checkpoint {ref.key[:8]} failed for {len(failed)} of "
            f"{len(targets)} targets: " + "; ".join(failed)
        )
    return results
