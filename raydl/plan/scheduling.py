"""Scheduling decisions as pure functions: where actors go, which actor runs a
batch, how deep a rank may prefetch. The loader and iterator carry them out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NodeInfo",
    "WorkerInfo",
    "batches_per_task",
    "bootstrap_threads",
    "choose_worker",
    "decode_threads",
    "fit_to_room",
    "placement_deficit",
    "prefetch_depth",
]

# A rank keeps sending to its own node's actors until each has this many of the
# rank's batches in flight; past that it spills to the least loaded actor anywhere.
LOCAL_DEPTH = 2


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    cpus: float
    resources: Mapping[str, float]


@dataclass(frozen=True)
class WorkerInfo:
    """A loader worker as ranks and the coordinator know it. `handle` runs batches: `handle.run_batch.remote(
    task)` (a Ray actor handle; or, with `in_process`, the Loader's own process while its workers start), and
    where it has it, `handle.run_batches.remote(tasks)` several of one rank at once."""

    handle: Any
    node_id: str
    name: str
    node_ip: str = ""  # the node's address, as Ray knows it (named in a BatchTimeoutError)
    in_process: bool = False


def eligible_nodes(
    nodes: Sequence[NodeInfo], *, cpus_per_worker: float, node_resource: str | None
) -> list[str]:
    """Nodes that may host loader actors: enough CPUs for one, and the label when one is asked for."""
    out = []
    for n in nodes:
        if node_resource is not None and n.resources.get(node_resource, 0) <= 0:
            continue
        if n.cpus <= 0 or n.cpus < cpus_per_worker:
            continue
        out.append(n.node_id)
    return out


def decode_threads(threads_per_worker: int | None, *, cpus_per_worker: float, node_cpus: float) -> int:
    """Decode threads of one worker: as asked; else as many as it reserves (rounded up);
    else, reserving none (the default), one per CPU Ray counts on its node."""
    if threads_per_worker:
        return threads_per_worker
    if cpus_per_worker > 0:
        return max(1, math.ceil(cpus_per_worker))
    return max(1, int(node_cpus))


def bootstrap_threads(threads_per_worker: int | None, *, usable_cores: int) -> int:
    """Decode threads of the Loader's own process while its workers start: as asked, else every core
    the process may use (nothing else of the loader runs yet: the workers start after the first batch)."""
    return threads_per_worker or max(1, usable_cores)


def fit_to_room(
    deficit: Mapping[str, int], free_cpus: Mapping[str, float], cpus_per_worker: float
) -> dict[str, int]:
    """The part of `deficit` that fits the CPUs free on each node now (all of it when workers reserve
    none)."""
    if cpus_per_worker <= 0:
        return dict(deficit)
    out = {}
    for node, want in deficit.items():
        fits = min(want, int(free_cpus.get(node, 0.0) / cpus_per_worker + 1e-9))
        if fits > 0:
            out[node] = fits
    return out


def placement_deficit(
    eligible: Sequence[str], actors_per_node: Mapping[str, int], per_node: int
) -> dict[str, int]:
    """How many actors to start on each eligible node so that each has `per_node`."""
    return {n: per_node - actors_per_node.get(n, 0) for n in eligible if actors_per_node.get(n, 0) < per_node}


def replacement_node(eligible: Sequence[str], actors_per_node: Mapping[str, int]) -> str | None:
    """Where a dead actor's replacement goes: the eligible live node with the fewest actors."""
    if not eligible:
        return None
    return min(eligible, key=lambda n: (actors_per_node.get(n, 0), n))


def choose_worker(
    workers: Sequence[tuple[str, str]], inflight: Mapping[str, int], my_node: str | None
) -> int:
    """Index of the worker for the next batch, from (name, node_id) pairs and this rank's in-flight counts.

    Local actors first (their batches stay in this node's object store, read
    without a copy), while each has fewer than LOCAL_DEPTH of this rank's
    batches; then the least loaded actor anywhere. Ties go to the earlier one.
    """
    if not workers:
        raise ValueError("no workers to choose from")
    local = [
        i for i, (name, node) in enumerate(workers) if node == my_node and inflight.get(name, 0) < LOCAL_DEPTH
    ]
    pool = local or range(len(workers))
    return min(pool, key=lambda i: (inflight.get(workers[i][0], 0), workers[i][1] != my_node, i))


TASK_BYTES = 8 << 20  # small batches are made several to a task, up to this many bytes together
MAX_BATCHES_PER_TASK = 16


def batches_per_task(batch_bytes: int, *, depth: int, budget_bytes: int, world_size: int) -> int:
    """How many consecutive batches of a rank one task makes: one when a batch is large, and small batches
    together, up to TASK_BYTES and MAX_BATCHES_PER_TASK, so that Ray's fixed cost of a task and of an object
    (the call, the object store's create, seal and release, the hand-over) is paid once for several. Never
    so many that `depth` tasks in flight and one in hand would not fit a rank's share of the object-store
    budget: making batches together never lowers the prefetch depth."""
    per_batch = max(1, batch_bytes)
    share = budget_bytes // max(1, world_size)
    fits = share // ((max(1, depth) + 1) * per_batch)
    return max(1, min(MAX_BATCHES_PER_TASK, TASK_BYTES // per_batch, fits))


def prefetch_depth(requested: int, *, batch_bytes: int, budget_bytes: int, world_size: int) -> int:
    """Tasks of `batch_bytes` each (one batch, or a task's several: see `batches_per_task`) a rank may have
    in flight so that every rank's batches fit the object-store budget.

    Each rank also holds the task's batches it is consuming, so a rank's share
    pays for depth + 1 of them. Never less than 1: a batch larger than the share
    still has to be made, one at a time.
    """
    share = budget_bytes // max(1, world_size)
    fits = share // max(1, batch_bytes) - 1
    return max(1, min(requested, fits))
