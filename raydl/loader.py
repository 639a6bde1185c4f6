"""Loader: starts and owns the loader actors, and hands out per-rank iterators.

The catalog goes into the object store once and every actor maps it. Actors
are the plain `LoaderWorker` class wrapped with `ray.remote` here, one per node
by default, each decoding on a thread pool as wide as its node's CPUs.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from raydl.actors.loader_worker import LoaderWorker, WorkerSpec
from raydl.catalog import Catalog
from raydl.config import LoaderConfig
from raydl.errors import LoaderError
from raydl.transforms import SampleProgram

if TYPE_CHECKING:
    from raydl.iterator import DataIterator

logger = logging.getLogger(__name__)

__all__ = ["Loader"]

_READY_TIMEOUT_S = 120.0
# Concurrent batch calls per actor: enough for the next batch's samples to queue
# on the decode pool while the current one finishes, so threads never idle.
_ACTOR_CONCURRENCY = 4


@dataclass
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
        self.catalog = catalog
        self.program = program
        self.config = config
        self._lock = threading.Lock()
        self._closed = False
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING, log_to_driver=False)
        self._catalog_ref = ray.put(catalog.table)
        self._spec = WorkerSpec(storage=catalog.storage, program=program, threads=config.threads_per_worker)
        self._workers: list[_Worker] = self._start_workers()

    # -- actors -------------------------------------------------------------------------
    def _num_workers(self) -> int:
        if self.config.num_workers is not None:
            return self.config.num_workers
        return max(1, sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0))

    def _actor_class(self):
        return ray.remote(LoaderWorker).options(
            num_cpus=self.config.cpus_per_worker,
            max_concurrency=_ACTOR_CONCURRENCY,
            max_restarts=0,
        )

    def _start_workers(self) -> list[_Worker]:
        n = self._num_workers()
        need = n * self.config.cpus_per_worker
        have = ray.cluster_resources().get("CPU", 0.0)
        if need > have:
            raise ValueError(
                f"num_workers={n} x cpus_per_worker={self.config.cpus_per_worker} needs {need} CPUs, "
                f"but the Ray cluster has {have}; lower num_workers or cpus_per_worker"
            )
        cls = self._actor_class()
        handles = [cls.remote(self._spec, self._catalog_ref) for _ in range(n)]
        return self._await_ready(handles)

    def _await_ready(self, handles: list) -> list[_Worker]:
        refs = [h.ready.remote() for h in handles]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=_READY_TIMEOUT_S)
        if pending:
            for h in handles:
                ray.kill(h)
            raise LoaderError(f"{len(pending)} of {len(handles)} loader actors did not start within "
                              f"{_READY_TIMEOUT_S:.0f} s; is the cluster short of CPUs?")
        infos = ray.get(refs)
        return [_Worker(h, i["node_id"], i["name"]) for h, i in zip(handles, infos)]

    def workers(self) -> list[_Worker]:
        """The live workers (a snapshot)."""
        with self._lock:
            if self._closed:
                raise LoaderError("the loader is shut down")
            return list(self._workers)

    def replace_worker(self, dead: _Worker) -> _Worker:
        """Start a replacement for a dead worker; returns the new one (or the one already started)."""
        with self._lock:
            if self._closed:
                raise LoaderError("the loader is shut down")
            if dead not in self._workers:
                return self._workers[0]
            idx = self._workers.index(dead)
        logger.warning("raydl: loader actor %s died; starting a replacement", dead.name)
        new = self._await_ready([self._actor_class().remote(self._spec, self._catalog_ref)])[0]
        with self._lock:
            self._workers[idx] = new
        return new

    # -- public -------------------------------------------------------------------------
    def iterator(self, rank: int = 0) -> DataIterator:
        """The iterator of `rank` (0 <= rank < world_size)."""
        from raydl.iterator import DataIterator

        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank must be an int in [0, world_size={self.config.world_size}), got {rank!r}")
        return DataIterator(self, rank)

    def shutdown(self) -> None:
        """Kill the actors and drop the loader's objects. Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
        for w in workers:
            try:
                ray.kill(w.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self._catalog_ref = None
        deadline = time.monotonic() + 10.0
        while workers and time.monotonic() < deadline:  # kill is async: wait until Ray releases the CPUs
            alive = [w for w in workers if _actor_alive(w.handle)]
            if not alive:
                break
            time.sleep(0.05)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        c = self.config
        return (f"Loader(samples={len(self.catalog)}, batch_size={c.batch_size}, world_size={c.world_size}, "
                f"workers={len(self._workers)}, closed={self._closed})")


def _actor_alive(handle) -> bool:
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=0.5)
        return True
    except ray.exceptions.GetTimeoutError:
        return True  # busy, not dead yet
    except Exception:  # noqa: BLE001 - RayActorError and friends: dead
        return False
