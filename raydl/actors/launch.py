"""Launching the loader's actors: Ray's nodes as raydl sees them, where workers go and starting them there,
the wait for room when workers reserve CPUs, and the check that the node cache folder is writable on every
node that will host workers.

Used by the Loader (the first workers, the room check, the cache check) and by the coordinator (workers on
nodes that join, replacements). The placement decisions themselves are pure functions in
raydl/plan/scheduling.py; this module carries them out with Ray's calls. It imports no worker dependency at
the top (numpy, pyarrow, the decoders), so the coordinator's process stays light.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl.errors import LoaderError
from raydl.options import LoaderConfig
from raydl.plan import scheduling
from raydl.plan.scheduling import WorkerInfo

logger = logging.getLogger(__name__)

__all__ = [
    "READY_TIMEOUT_S",
    "ROOM_WAIT_S",
    "WORKER_CONCURRENCY",
    "WorkerInfo",
    "actor_alive",
    "check_cache",
    "free_cpus",
    "initial_placement",
    "launch_workers",
    "live_nodes",
    "no_room_message",
    "remote_class",
]

READY_TIMEOUT_S = 60.0
# Concurrent batch calls per worker: enough for the next batch's samples to queue
# on the decode pool while the current one finishes, so threads never idle.
WORKER_CONCURRENCY = 4
# With cpus_per_worker > 0: how long to wait for CPUs to free up (e.g. a loader shutting down).
ROOM_WAIT_S = 10.0
CACHE_CHECK_TIMEOUT_S = 60.0  # a node's cache-folder probe (a Ray task: a worker process starts for it)


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
    spec: ray.ObjectRef,
    catalog_ref,
    config: LoaderConfig,
    node_id: str,
    count: int,
    *,
    node_cpus: float,
    soft: bool,
) -> list:
    """Start `count` workers pinned to `node_id` (they come up asynchronously; call `ready` to wait).

    `spec` is the MixtureSpec's ObjectRef (Ray hands the workers the spec itself).
    """
    from raydl.actors.worker import LoaderWorker  # here, not at the top: see the module's doc

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
    lines = []
    for node, total in cpus.items():
        held = ", ".join(
            f"{name} x{k}" if k > 1 else name for name, k in holders.get(node, Counter()).most_common()
        )
        avail = "?" if free is None else f"{free.get(node, 0.0):g}"
        lines.append(
            f"node {node[:8]}: {avail} of {total:g} CPUs free" + (f", actors there: {held}" if held else "")
        )
    return (
        f"no node has room for a loader worker reserving cpus_per_worker={config.cpus_per_worker:g} CPUs "
        f"(node_resource={config.node_resource!r}; waited {waited_s:.0f} s for room): {'; '.join(lines)}. "
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


def initial_placement(config: LoaderConfig, nodes: list[scheduling.NodeInfo]) -> dict[str, int]:
    """Workers to start on each eligible node now; with a CPU reservation, only where it fits,
    waiting up to ROOM_WAIT_S for room. No room anywhere is a LoaderError saying who holds the CPUs."""
    eligible = scheduling.eligible_nodes(
        nodes, cpus_per_worker=config.cpus_per_worker, node_resource=config.node_resource
    )
    if not eligible:
        raise LoaderError(
            f"no node can host a loader worker: none has {config.cpus_per_worker:g} CPUs in all"
            + (f" and the resource {config.node_resource!r}" if config.node_resource else "")
            + f"; nodes (id, CPUs): {[(n.node_id[:8], n.cpus) for n in nodes]}"
        )
    want = scheduling.placement_deficit(eligible, {}, config.num_workers)
    if config.cpus_per_worker <= 0:
        return want
    start = time.monotonic()
    while True:
        free = free_cpus()
        if free is None:  # cannot tell: let Ray's scheduler wait for room
            return want
        fits = scheduling.fit_to_room(want, free, config.cpus_per_worker)
        if fits == want or (fits and time.monotonic() - start > 1.0):
            if fits != want:
                logger.warning(
                    "raydl: room for %d of %d loader workers now (cpus_per_worker=%g); the "
                    "coordinator starts the rest when CPUs free up",
                    sum(fits.values()),
                    sum(want.values()),
                    config.cpus_per_worker,
                )
            return fits
        if time.monotonic() - start > ROOM_WAIT_S:
            raise LoaderError(no_room_message(config, nodes, free, time.monotonic() - start))
        time.sleep(0.2)


def actor_alive(handle) -> bool:
    """Whether an actor still answers (a busy one counts as alive)."""
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=0.5)
        return True
    except ray.exceptions.GetTimeoutError:
        return True  # busy, not dead yet
    except Exception:  # noqa: BLE001 - RayActorError and friends: dead
        return False


def _probe_cache_folder(path: str, group: str | None = None) -> tuple[str, str | None]:
    """(this node's address, why `path` is no cache folder here, or None when it is writable)."""
    from raydl.storage.cache import check_cache_folder

    try:
        check_cache_folder(path, group)
    except OSError as exc:
        return ray.util.get_node_ip_address(), f"{type(exc).__name__}: {exc}"
    return ray.util.get_node_ip_address(), None


def check_cache(path: str, placement: dict[str, int], *, here: str, group: str | None = None) -> None:
    """The cache folder is writable on every node that will host workers (and its own user's, or `group`'s):
    the driver's own, checked here (it makes the first batches itself), and the others by a task pinned to
    each; else a LoaderError naming the path and the node."""
    _ip, why = _probe_cache_folder(path, group) if here in placement else (None, None)
    if why is not None:
        raise LoaderError(
            f"the node cache folder {path!r} is not writable on node {here} (the driver's, "
            f"{ray.util.get_node_ip_address()}): {why}"
        )
    nodes = [n for n in placement if n != here]
    if not nodes:
        return
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe_cache_folder)
    refs = {
        n: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
            path, group
        )
        for n in nodes
    }
    for node, ref in refs.items():
        try:
            ip, why = ray.get(ref, timeout=CACHE_CHECK_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the node died or never ran the probe
            raise LoaderError(
                f"cannot check the node cache folder {path!r} on node {node}: {type(exc).__name__}: {exc}"
            ) from exc
        if why is not None:
            raise LoaderError(f"the node cache folder {path!r} is not writable on node {node} ({ip}): {why}")
