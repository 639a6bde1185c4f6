"""Loader: starts and owns the loader actors, and hands out per-rank iterators.

The catalog goes into the object store once and every actor maps it. Actors
are the plain `LoaderWorker` class wrapped with `ray.remote` here and pinned
to nodes: `num_workers` per eligible node (one with enough CPUs, and the
`node_resource` label when one is given), each decoding on a thread pool as
wide as its node's CPUs. Nodes that join get actors at the next refresh; a
dead actor is replaced on the live node with the fewest.

A Loader pickles into a handle (for Ray Train workers): the copy drives the
same actors, and only the original's shutdown() kills them.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl import scheduling
from raydl.actors.loader_worker import LoaderWorker, WorkerSpec
from raydl.catalog import Catalog
from raydl.config import LoaderConfig
from raydl.errors import LoaderError
from raydl.transforms import SampleProgram

if TYPE_CHECKING:
    from raydl.iterator import DataIterator

logger = logging.getLogger(__name__)

__all__ = ["Loader"]

_READY_TIMEOUT_S = 60.0
_REFRESH_S = 5.0  # how often iterators look for joined nodes
# Concurrent batch calls per actor: enough for the next batch's samples to queue
# on the decode pool while the current one finishes, so threads never idle.
_ACTOR_CONCURRENCY = 4
_DEFAULT_BUDGET_FRACTION = 0.25


@dataclass(frozen=True)
class _Worker:
    handle: ray.actor.ActorHandle
    node_id: str
    name: str


class Loader:
    """Owns the loader actors for one dataset and one LoaderConfig.

    Made by `Dataset.loader(...)`. Use as a context manager, or call
    `shutdown()` (idempotent) to kill the actors and free their objects.
    """

    def __init__(self, catalog: Catalog, program: SampleProgram, config: LoaderConfig) -> None:
        program.slot_shape()  # fail before any actor starts if batches cannot have one shape
        self.config = config
        self.program = program
        self.num_samples = len(catalog)
        self.fingerprint = catalog.fingerprint
        self.root = catalog.storage.root
        self._lock = threading.Lock()
        self._closed = False
        self._owner = True
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING, log_to_driver=False)
        self.batch_bytes = config.batch_size * program.dtype.itemsize * _prod(program.slot_shape())
        self.object_store_budget = config.object_store_budget or _default_budget()
        self._catalog_ref = ray.put(catalog.table)
        self._spec = WorkerSpec(storage=catalog.storage, program=program, threads=config.threads_per_worker)
        self._workers: list[_Worker] = []
        self._lost_nodes: set[str] = set()  # nodes where an actor died; Ray may still list them alive
        self._last_refresh = 0.0
        self.refresh(force=True)
        if not self._workers:
            raise LoaderError(
                f"no node can host a loader actor (cpus_per_worker={config.cpus_per_worker}, "
                f"node_resource={config.node_resource!r}); nodes: {[(n.node_id[:8], n.cpus) for n in _nodes()]}"
            )

    # -- actors -------------------------------------------------------------------------
    def _eligible(self) -> list[str]:
        c = self.config
        return scheduling.eligible_nodes(_nodes(), cpus_per_worker=c.cpus_per_worker, node_resource=c.node_resource)

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self._workers:
            counts[w.node_id] = counts.get(w.node_id, 0) + 1
        return counts

    def _start(self, node_id: str, count: int, *, soft: bool) -> list:
        cls = ray.remote(LoaderWorker).options(
            num_cpus=self.config.cpus_per_worker,
            max_concurrency=_ACTOR_CONCURRENCY,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=soft),
        )
        return [cls.remote(self._spec, self._catalog_ref) for _ in range(count)]

    def _await_ready(self, handles: list) -> list[_Worker]:
        """The handles' workers once up. Actors that die while starting (their node went away)
        are left out with a warning; actors still not up after the timeout are an error."""
        refs = [h.ready.remote() for h in handles]
        _ready, pending = ray.wait(refs, num_returns=len(refs), timeout=_READY_TIMEOUT_S)
        if pending:
            for h in handles:
                ray.kill(h, no_restart=True)
            raise LoaderError(f"{len(pending)} of {len(handles)} loader actors did not start within "
                              f"{_READY_TIMEOUT_S:.0f} s; is the cluster short of CPUs "
                              f"(cpus_per_worker={self.config.cpus_per_worker})?")
        out = []
        for h, ref in zip(handles, refs):
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                logger.warning("raydl: a loader actor died while starting: %s", exc)
                continue
            out.append(_Worker(h, info["node_id"], info["name"]))
        return out

    def refresh(self, *, force: bool = False) -> None:
        """Start actors on eligible nodes that have fewer than num_workers (nodes that joined)."""
        now = time.monotonic()
        if not force and now - self._last_refresh < _REFRESH_S:
            return
        self._last_refresh = now
        with self._lock:
            self._check_open()
            eligible = [n for n in self._eligible() if n not in self._lost_nodes]
            deficit = scheduling.placement_deficit(eligible, self._counts(), self.config.num_workers)
        if not deficit:
            return
        handles = [h for node, k in deficit.items() for h in self._start(node, k, soft=False)]
        new = self._await_ready(handles)
        with self._lock:
            if self._closed:
                for w in new:
                    ray.kill(w.handle, no_restart=True)
                self._check_open()
            self._workers.extend(new)
        if not force:
            logger.info("raydl: started %d loader actors on joined nodes", len(new))

    def workers(self) -> list[_Worker]:
        """The live workers (a snapshot)."""
        with self._lock:
            self._check_open()
            return list(self._workers)

    def replace_worker(self, dead: _Worker) -> None:
        """Forget a dead worker and start its replacement on the live eligible node with the fewest actors."""
        with self._lock:
            self._check_open()
            if dead not in self._workers:
                return  # another rank already replaced it
            self._workers.remove(dead)
            self._lost_nodes.add(dead.node_id)  # until it proves alive again, start nothing new there
            alive = set(self._eligible())
            self._workers = [w for w in self._workers if w.node_id in alive]  # actors of dead nodes too
            # Prefer another node: the dead actor's node may be dying (Ray notices a lost node late).
            others = sorted(alive - {dead.node_id}) or sorted(alive)
            node = scheduling.replacement_node(others, self._counts())
        logger.warning("raydl: loader actor %s died; replacing it on node %s", dead.name, node and node[:8])
        if node is None:
            return
        new = self._await_ready(self._start(node, 1, soft=True))
        with self._lock:
            self._check_open()
            self._workers.extend(new)

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError("the loader is shut down")

    # -- public -------------------------------------------------------------------------
    def iterator(self, rank: int = 0) -> DataIterator:
        """The iterator of `rank` (0 <= rank < world_size)."""
        from raydl.iterator import DataIterator

        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank must be an int in [0, world_size={self.config.world_size}), got {rank!r}")
        return DataIterator(self, rank)

    def shutdown(self) -> None:
        """Kill the actors and drop the loader's objects. Safe to call more than once.

        On a copy of the loader (a handle passed to another process) this only
        stops that copy; the original owns the actors.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
            self._catalog_ref = None
        if not self._owner:
            return
        for w in workers:
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        deadline = time.monotonic() + 10.0
        pending = list(workers)
        while pending and time.monotonic() < deadline:  # kill is asynchronous: wait until they are gone
            pending = [w for w in pending if _actor_alive(w.handle)]
            if pending:
                time.sleep(0.05)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_owner"] = False
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        c = self.config
        return (f"Loader(samples={self.num_samples}, batch_size={c.batch_size}, world_size={c.world_size}, "
                f"workers={len(self._workers)}, closed={self._closed})")


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _nodes() -> list[scheduling.NodeInfo]:
    return [
        scheduling.NodeInfo(n["NodeID"], n["Resources"].get("CPU", 0.0), dict(n["Resources"]))
        for n in ray.nodes() if n["Alive"]
    ]


def _default_budget() -> int:
    """A quarter of the smallest node's object store: batches never crowd out the training job's objects."""
    stores = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["Alive"]]
    stores = [s for s in stores if s > 0]
    return int(_DEFAULT_BUDGET_FRACTION * min(stores)) if stores else 1 << 30


def _actor_alive(handle) -> bool:
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=0.5)
        return True
    except ray.exceptions.GetTimeoutError:
        return True  # busy, not dead yet
    except Exception:  # noqa: BLE001 - RayActorError and friends: dead
        return False
