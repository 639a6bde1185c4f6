"""The loader coordinator: one actor per loader that owns the loader workers.

Every copy of a Loader (the driver's, and the handles Ray Train workers
unpickle) asks this one actor for the current workers and reports dead ones to
it, so a lost actor is replaced once, not once per rank, and nodes that join
get their actors once. It stays off the data path: when its worker list
changes it tells the workers the list's new version, every batch carries that
version back to its rank, and only a rank holding an older list calls here.
Its load is one call per rank per change, not a stream that grows with ranks. It is a plain class; `raydl/loader.py` applies
`ray.remote` and starts it. Workers it starts are owned by it, so they die with
it.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl import scheduling
from raydl.actors.loader_worker import LoaderWorker, WorkerSpec
from raydl.config import LoaderConfig

logger = logging.getLogger(__name__)

__all__ = ["LoaderCoordinator", "WorkerInfo"]

READY_TIMEOUT_S = 60.0
REFRESH_S = 5.0  # how often the coordinator looks for joined nodes
# Concurrent batch calls per worker: enough for the next batch's samples to queue
# on the decode pool while the current one finishes, so threads never idle.
WORKER_CONCURRENCY = 4


@dataclass(frozen=True)
class WorkerInfo:
    handle: ray.actor.ActorHandle
    node_id: str
    name: str


def live_nodes() -> list[scheduling.NodeInfo]:
    return [
        scheduling.NodeInfo(n["NodeID"], n["Resources"].get("CPU", 0.0), dict(n["Resources"]))
        for n in ray.nodes() if n["Alive"]
    ]


class LoaderCoordinator:
    """Keeps `num_workers` workers on each eligible node and replaces dead ones (once)."""

    def __init__(self, spec: WorkerSpec, catalog_ref: list, config: LoaderConfig) -> None:
        self._spec = spec
        self._catalog_ref = catalog_ref[0]  # wrapped in a list so Ray passes the reference, not the catalog
        self._config = config
        self._lock = threading.Lock()
        self._workers: list[WorkerInfo] = []
        self._dead: set[str] = set()  # names reported dead
        self._lost_nodes: set[str] = set()  # nodes where a worker died; Ray may still list them alive
        self._version = 0
        self._replacing: list[threading.Thread] = []
        self._closed = False
        self._start_missing()
        self._thread = threading.Thread(target=self._refresh_loop, name="raydl-refresh", daemon=True)
        self._thread.start()

    # -- what iterators call -------------------------------------------------------------
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def workers(self) -> tuple[int, list[WorkerInfo]]:
        with self._lock:
            return self._version, list(self._workers)

    def report_dead(self, name: str) -> tuple[int, list[WorkerInfo]]:
        """Drop the named worker and start its replacement in the background. Idempotent."""
        with self._lock:
            dead = next((w for w in self._workers if w.name == name), None)
            if dead is not None and not self._closed:
                self._dead.add(name)
                self._workers.remove(dead)
                self._lost_nodes.add(dead.node_id)
                self._version += 1
                self._announce()
                t = threading.Thread(target=self._replace, args=(dead,), daemon=True)
                self._replacing.append(t)
                t.start()
            return self._version, list(self._workers)

    def refresh_now(self) -> tuple[int, list[WorkerInfo]]:
        """Wait for replacements under way, start workers on nodes that lack them, and wait for those."""
        with self._lock:
            replacing, self._replacing = self._replacing, []
        for t in replacing:
            t.join(READY_TIMEOUT_S)
        self._start_missing()
        return self.workers()

    def shutdown(self) -> list[WorkerInfo]:
        """Kill every worker; returns them so the caller can wait for them to be gone."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
            self._version += 1
        for w in workers:
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        return workers

    # -- mechanism -----------------------------------------------------------------------
    def _eligible(self) -> list[str]:
        c = self._config
        return scheduling.eligible_nodes(live_nodes(), cpus_per_worker=c.cpus_per_worker,
                                         node_resource=c.node_resource)

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self._workers:
            counts[w.node_id] = counts.get(w.node_id, 0) + 1
        return counts

    def _launch(self, node_id: str, count: int, *, soft: bool) -> list:
        cls = ray.remote(LoaderWorker).options(
            num_cpus=self._config.cpus_per_worker,
            max_concurrency=WORKER_CONCURRENCY,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=soft),
        )
        return [cls.remote(self._spec, self._catalog_ref) for _ in range(count)]

    def _await(self, handles: list) -> list[WorkerInfo]:
        """Workers that came up; ones that died starting are left out, ones still pending killed."""
        refs = [h.ready.remote() for h in handles]
        _ready, pending = ray.wait(refs, num_returns=len(refs), timeout=READY_TIMEOUT_S)
        out = []
        for h, ref in zip(handles, refs):
            if ref in pending:
                logger.warning("raydl: a loader worker did not start within %.0f s", READY_TIMEOUT_S)
                ray.kill(h, no_restart=True)
                continue
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                logger.warning("raydl: a loader worker died while starting: %s", exc)
                continue
            out.append(WorkerInfo(h, info["node_id"], info["name"]))
        return out

    def _add(self, new: list[WorkerInfo]) -> None:
        with self._lock:
            if self._closed:
                for w in new:
                    ray.kill(w.handle, no_restart=True)
                return
            self._workers.extend(new)
            self._version += 1
            self._announce()

    def _announce(self) -> None:
        """Tell every worker the list's version (under the lock); their batches carry it to the ranks."""
        for w in self._workers:
            try:
                w.handle.set_membership.remote(self._version)
            except Exception:  # noqa: BLE001 - a dead worker is found and replaced through the ranks
                pass

    def _start_missing(self) -> None:
        with self._lock:
            if self._closed:
                return
            eligible = [n for n in self._eligible() if n not in self._lost_nodes]
            deficit = scheduling.placement_deficit(eligible, self._counts(), self._config.num_workers)
        if deficit:
            self._add(self._await([h for node, k in deficit.items() for h in self._launch(node, k, soft=False)]))

    def _replace(self, dead: WorkerInfo) -> None:
        with self._lock:
            alive = set(self._eligible())
            self._workers = [w for w in self._workers if w.node_id in alive]  # workers of dead nodes too
            # Prefer another node: the dead worker's node may be dying (Ray notices a lost node late).
            node = scheduling.replacement_node(sorted(alive - {dead.node_id}) or sorted(alive), self._counts())
        logger.warning("raydl: loader worker %s died; replacing it on node %s", dead.name, node and node[:8])
        if node is not None:
            self._add(self._await(self._launch(node, 1, soft=True)))

    def _refresh_loop(self) -> None:
        while not self._closed:
            time.sleep(REFRESH_S)
            try:
                self._start_missing()
            except Exception:  # noqa: BLE001 - a failed refresh is retried next period
                logger.exception("raydl: refreshing loader workers failed")
