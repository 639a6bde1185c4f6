"""Cluster helpers of the execute layer: Ray's nodes as raydl sees them, and starting loader workers on them.

Used by the Loader (the first workers, the room check) and by the coordinator
(workers on nodes that join, replacements). The placement decisions themselves
are pure functions in raydl/plan/scheduling.py; this module carries them out
with Ray's calls. It imports no worker dependency at the top (numpy, pyarrow,
the decoders), so the coordinator's process stays light.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl.plan import scheduling

if TYPE_CHECKING:
    from raydl.execute.worker import WorkerSpec
    from raydl.options import LoaderConfig

__all__ = [
    "READY_TIMEOUT_S",
    "WORKER_CONCURRENCY",
    "WorkerInfo",
    "free_cpus",
    "launch_workers",
    "live_nodes",
    "no_room_message",
    "remote_class",
]

READY_TIMEOUT_S = 60.0
# Concurrent batch calls per worker: enough for the next batch's samples to queue
# on the decode pool while the current one finishes, so threads never idle.
WORKER_CONCURRENCY = 4


@dataclass(frozen=True)
class WorkerInfo:
    handle: ray.actor.ActorHandle
    node_id: str
    name: str
    node_ip: str = ""  # the node's address, as Ray knows it (named in a BatchTimeoutError)


def live_nodes() -> list[scheduling.NodeInfo]:
    return [
        scheduling.NodeInfo(n["NodeID"], n["Resources"].get("CPU", 0.0), dict(n["Resources"]))
        for n in ray.nodes()
        if n["Alive"]
    ]


def free_cpus() -> dict[str, float] | None:
    """CPUs free now on each node (None when this Ray does not say: then Ray's scheduler has to wait)."""
    try:
        from ray._private.state import available_resources_per_node

        return {node: res.get("CPU", 0.0) for node, res in available_resources_per_node().items()}
    except Exception:  # noqa: BLE001 - a private API; without it, placement still works, only less politely
        return None


@functools.cache
def remote_class(cls: type):
    """`ray.remote(cls)`, made once per process: Ray exports an actor class to the cluster once per
    class object and job, which costs tenths of a second (it hashes the class's bytecode)."""
    return ray.remote(cls)


def launch_workers(
    spec: WorkerSpec | ray.ObjectRef,
    catalog_ref,
    config: LoaderConfig,
    node_id: str,
    count: int,
    *,
    node_cpus: float,
    soft: bool,
) -> list:
    """Start `count` workers pinned to `node_id` (they come up asynchronously; call `ready` to wait).

    `spec` may be the WorkerSpec's ObjectRef (Ray hands the workers the spec itself).
    """
    from raydl.execute.worker import LoaderWorker  # here, not at the top: see the module's doc

    threads = scheduling.decode_threads(
        config.threads_per_worker, cpus_per_worker=config.cpus_per_worker, node_cpus=node_cpus
    )
    cls = remote_class(LoaderWorker).options(
        num_cpus=config.cpus_per_worker,
        max_concurrency=WORKER_CONCURRENCY,
        max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=soft),
    )
    return [cls.remote(spec, catalog_ref, threads) for _ in range(count)]


def no_room_message(
    config: LoaderConfig, nodes: list[scheduling.NodeInfo], free: dict[str, float] | None, waited_s: float
) -> str:
    """Why no worker could start: each node's free and total CPUs, who holds them, and what to change."""
    cpus = {n.node_id: n.cpus for n in nodes}
    holders = _actors_by_node(set(cpus))
    parts = []
    for node, total in cpus.items():
        held = ", ".join(
            f"{name} x{k}" if k > 1 else name for name, k in holders.get(node, Counter()).most_common()
        )
        avail = "?" if free is None else f"{free.get(node, 0.0):g}"
        parts.append(
            f"node {node[:8]}: {avail} of {total:g} CPUs free" + (f", actors there: {held}" if held else "")
        )
    return (
        f"no node has room for a loader worker reserving cpus_per_worker={config.cpus_per_worker:g} CPUs "
        f"(node_resource={config.node_resource!r}; waited {waited_s:.0f} s for room): {'; '.join(parts)}. "
        "Pass cpus_per_worker=0 (the default: workers reserve no CPU in Ray's accounting and share the "
        "cores, see 'Resources' in docs/loader.md), reserve less or use fewer num_workers, or shut down "
        "what holds the CPUs (another loader: loader.shutdown())."
    )


def _actors_by_node(nodes: set[str]) -> dict[str, Counter]:
    """Alive actors' class names on each of `nodes` (best effort: Ray's state API is private here)."""
    try:
        from ray._private.state import actors

        out: dict[str, Counter] = {}
        for a in actors().values():
            node = (a.get("Address") or {}).get("NodeID")
            if a.get("State") == "ALIVE" and node in nodes:
                out.setdefault(node, Counter())[f"{a.get('ActorClassName', '?')}"] += 1
        return out
    except Exception:  # noqa: BLE001 - the message is still useful without the holders
        return {}
