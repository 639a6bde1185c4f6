"""Loader: starts the loader's coordinator, and hands out per-rank iterators.

The catalog goes into the object store once and every worker maps it. The
workers (the plain `LoaderWorker` class) are started, pinned to nodes,
replaced and shut down by one coordinator actor per loader
(`raydl/actors/coordinator.py`): `num_workers` per eligible node (one with
enough CPUs, and the `node_resource` label when one is given), also on nodes
that join; a dead worker is replaced once, on the live node with the fewest.

A Loader pickles into a handle (for Ray Train workers): the copy asks the same
coordinator for workers, and only the original's shutdown() kills them.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl.actors.coordinator import LoaderCoordinator, WorkerInfo, live_nodes
from raydl.actors.loader_worker import WorkerSpec
from raydl.catalog import Catalog
from raydl.config import LoaderConfig
from raydl.errors import LoaderError, SampleDecodeError
from raydl.plan import bucket_batch_count
from raydl.transforms import SampleProgram

if TYPE_CHECKING:
    from raydl.iterator import DataIterator

logger = logging.getLogger(__name__)

__all__ = ["Loader"]

_DEFAULT_BUDGET_FRACTION = 0.25
_NO_WORKERS_WAIT_S = 60.0  # how long a rank waits for a replacement when no worker is left


class Loader:
    """The loader of one dataset with one LoaderConfig.

    Made by `Dataset.loader(...)`. Use as a context manager, or call
    `shutdown()` (idempotent) to kill the workers and free their objects.
    """

    def __init__(self, catalog: Catalog, program: SampleProgram, config: LoaderConfig) -> None:
        shapes = program.slot_shapes()  # fail before any actor starts if batches cannot have a shape
        self.config = config
        self.program = program
        self.num_samples = len(catalog)
        self.fingerprint = catalog.fingerprint
        self.samples_fingerprint = catalog.samples_fingerprint  # seeds the shuffle: same files, same order anywhere
        self.buckets, self.bucket_of, self.unlisted, self.plan_units = _plan_units(catalog, program, config)
        self._lock = threading.Lock()
        self._closed = False
        self._owner = True
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING, log_to_driver=False)
        self.batch_bytes = config.batch_size * program.dtype.itemsize * max(math.prod(s) for s in shapes)
        self.object_store_budget = config.object_store_budget or _default_budget()
        spec = WorkerSpec(program=program, threads=config.threads_per_worker, on_error=config.on_error,
                          io_concurrency=config.io_concurrency)
        here = ray.get_runtime_context().get_node_id()
        self._coordinator = ray.remote(LoaderCoordinator).options(
            num_cpus=0, max_concurrency=16, max_restarts=0,
            # On the driver's node, whose loss ends the job anyway (soft affinity was seen elsewhere).
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(spec, [ray.put(catalog)], config)
        self._version, self._workers = ray.get(self._coordinator.workers.remote())
        if not self._workers:
            self.shutdown()
            raise LoaderError(
                f"no node could host a loader worker (cpus_per_worker={config.cpus_per_worker}, "
                f"node_resource={config.node_resource!r}); nodes: {[(n.node_id[:8], n.cpus) for n in live_nodes()]}"
            )

    # -- workers (through the coordinator) ------------------------------------------------
    def _call(self, method: str, *args):
        self._check_open()
        try:
            return ray.get(getattr(self._coordinator, method).remote(*args))
        except ray.exceptions.RayActorError as exc:
            raise LoaderError(f"the loader's coordinator is gone ({exc}); was the loader shut down?") from exc

    def _update(self, version: int, workers: list[WorkerInfo]) -> None:
        with self._lock:
            if version >= self._version:
                self._version, self._workers = version, workers

    def workers(self) -> list[WorkerInfo]:
        """The live workers as last fetched from the coordinator (see `sync`)."""
        self._check_open()
        with self._lock:
            return list(self._workers)

    def sync(self, version: int) -> None:
        """A batch said the coordinator's worker list is at `version`: fetch it when ours is older.

        The only call a rank makes to the coordinator in steady state is none: the
        version rides on every batch, so the coordinator is asked once per change.
        """
        if version > self._version:
            self._update(*self._call("workers"))

    def refresh(self) -> None:
        """Start workers on eligible nodes that lack them (e.g. nodes that just joined) and wait for them."""
        self._update(*self._call("refresh_now"))

    def replace_worker(self, dead: WorkerInfo) -> list[WorkerInfo]:
        """Report a dead worker (the coordinator replaces it once); returns the workers to use now."""
        self._update(*self._call("report_dead", dead.name))
        deadline = time.monotonic() + _NO_WORKERS_WAIT_S
        while not self._workers and time.monotonic() < deadline:  # the last one died: wait for its replacement
            time.sleep(0.2)
            self._update(*self._call("workers"))
        if not self._workers:
            raise LoaderError(f"no loader worker left after {dead.name} died, and none started within "
                              f"{_NO_WORKERS_WAIT_S:.0f} s")
        with self._lock:
            return list(self._workers)

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
        """Kill the workers and the coordinator, dropping the loader's objects. Safe to call more than once.

        On a copy of the loader (a handle passed to another process) this only
        stops that copy; the original owns the workers.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._workers = []
        if not self._owner:
            return
        try:
            workers = ray.get(self._coordinator.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a dead coordinator took its workers with it
            workers = []
        ray.kill(self._coordinator, no_restart=True)
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


def _plan_units(catalog: Catalog, program: SampleProgram, config: LoaderConfig):
    """(buckets, bucket of each sample, samples in no bucket, units the plan deals).

    Without aspect buckets the plan deals samples; with them it deals whole
    bucket-pure batches, and samples whose header gave no size are in none
    (reported through on_error).
    """
    if program.buckets is None:
        return None, None, (), len(catalog)
    names = catalog.table.column_names
    if "width" not in names or "height" not in names:
        raise ValueError("aspect_buckets() needs image sizes in the catalog (width and height columns)")
    buckets = program.buckets.buckets
    bucket_of = program.buckets.assign(catalog.table.column("width").to_numpy(),
                                       catalog.table.column("height").to_numpy())
    unlisted = tuple(
        (int(i), catalog.uri(int(i)), catalog.size_errors.get(int(i), "no image size in the catalog"))
        for i in np.flatnonzero(bucket_of < 0)
    )
    if unlisted and config.on_error == "raise":
        sample_id, uri, reason = unlisted[0]
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise SampleDecodeError(f"cannot bucket sample {sample_id} ({uri}): {reason}{more}",
                                uri=uri, sample_id=sample_id)
    units = bucket_batch_count(bucket_of, len(buckets), config.batch_size, config.drop_last)
    if units == 0:
        raise ValueError(f"no aspect bucket holds a full batch of {config.batch_size} (drop_last=True); "
                         f"bucket sizes: {np.bincount(bucket_of[bucket_of >= 0], minlength=len(buckets)).tolist()}")
    return buckets, bucket_of, unlisted, units


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
