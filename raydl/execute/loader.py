"""Loader: builds the plan, starts the loader's workers and coordinator, and is its iterators' worker pool.

The plan (raydl/plan/loader_plan.py) is built once, here, from the dataset's description; every rank's
iterator asks it which batch comes next, and asks this Loader (through the WorkerPool protocol,
raydl/consume/pool.py) where batches are made.

The catalogs go into the object store once and every worker maps them. The
workers (raydl/actors/worker.py), `num_workers` per eligible node (one
with CPUs, room for `cpus_per_worker`, and the `node_resource` label when one is
given), are started here, and the coordinator actor (raydl/actors/coordinator.py)
COORDINATOR_DELAY_S later, or at once when a call needs it; it then owns
them: it starts workers on nodes that join and replaces a dead one once, on
the live node with the fewest. The constructor does not wait for them: until the first is up, the
Loader that started them makes the first batches in its own process (the same
code, the same pixels) when its node is one the workers may use, so the first
batch does not wait for Ray to start worker processes.

Resources: by default a worker reserves no CPU in Ray's accounting
(cpus_per_worker=0), like the coordinator, so loaders never block training
actors or each other; it decodes on one thread per CPU of its node. With
cpus_per_worker=x > 0 it reserves x CPUs and decodes on ceil(x) threads, and the
loader waits up to ROOM_WAIT_S for room before failing with who holds the CPUs.

A Loader pickles into a handle (for Ray Train workers): the copy asks the same
coordinator for workers, and only the original's shutdown() kills them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future

import ray
from ray import runtime_context

from raydl.actors.coordinator import start_coordinator
from raydl.actors.launch import (
    READY_TIMEOUT_S,
    actor_alive,
    check_cache,
    initial_placement,
    launch_workers,
    live_nodes,
)
from raydl.batch.spec import MixtureSpec, WorkerSpec
from raydl.consume.iterator import DataIterator
from raydl.describe.catalog import Catalog
from raydl.describe.mixing import Mixture
from raydl.describe.records import Pipeline
from raydl.describe.transforms import SampleProgram
from raydl.env import local_ray_config, ray_address
from raydl.errors import LoaderError
from raydl.execute.bootstrap import Bootstrap
from raydl.execute.checks import check_mixture
from raydl.options import LoaderConfig, check_number
from raydl.plan import scheduling
from raydl.plan.build import build_plan
from raydl.plan.loader_plan import LoaderPlan
from raydl.plan.scheduling import WorkerInfo, batches_per_task, prefetch_depth

logger = logging.getLogger(__name__)

__all__ = ["Loader"]

_DEFAULT_BUDGET_FRACTION = 0.25
_NO_WORKERS_WAIT_S = 60.0  # how long a rank waits for a replacement when no worker is left
LAUNCH_DELAY_S = 1.0  # how long the launch waits for a first batch to be asked of this process
COORDINATOR_DELAY_S = 5.0  # how long the coordinator's start waits after the workers', unless a call needs it


class Loader:
    """The loader of one dataset with one LoaderConfig.

    Made by `Dataset.loader(...)` from the dataset's description (a Mixture; `Loader(catalog, pipeline,
    config)` reads one catalog as it is). Use as a context manager, or call `shutdown()` (idempotent) to
    kill the workers and free their objects.
    """

    def __init__(
        self,
        dataset: Mixture | Catalog,
        pipeline: Pipeline | SampleProgram | None,
        config: LoaderConfig,
    ) -> None:
        mixture = dataset if isinstance(dataset, Mixture) else Mixture.one(dataset, _as_pipeline(pipeline))
        check_mixture(mixture)  # before any actor starts
        self.config = config
        self.plan: LoaderPlan = build_plan(mixture, config)
        self.plan.check_epoch()  # an epoch with no batch is a mistake in the settings: say so before Ray
        self._lock = threading.Lock()
        self._closed = False
        self._owner = True
        self._events_seen = 0
        self._version = 0
        self._workers: list[WorkerInfo] = []
        if not ray.is_initialized():
            # Never a running cluster the user did not name: the one RAY_ADDRESS names (`ray job submit`
            # sets it for the job's driver), else a local Ray of this process's own. Actors' logs reach
            # the driver (Ray's default).
            address = ray_address()
            if address and address != "local":  # RAY_ADDRESS=local asks for a local Ray: raydl's own
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                ray.init(address="local", logging_level=logging.WARNING, _system_config=local_ray_config())
        self._cluster = _cluster_now()  # the Ray this loader's actors live in: no call is made in another
        nodes = live_nodes()
        self.object_store_budget = config.object_store_budget or _default_budget(nodes)
        placement = initial_placement(config, nodes)
        spec = _mixture_spec(mixture, self.plan)
        catalogs = tuple(m.catalog for m in mixture.members)
        self._catalog_bytes = sum(cat.nbytes for cat in catalogs)
        here = ray.get_runtime_context().get_node_id()
        if config.cache is not None:
            check_cache(config.cache.path, placement, here=here, group=config.cache.group)
        cpus = {n.node_id: n.cpus for n in nodes}
        self._coordinator = None  # set by the launch, which the first batch does not wait for
        self._starting: dict = {}  # ready() ref -> handle of the workers started here, until they are up
        self._started_at = time.monotonic()
        self._launch_now = threading.Event()
        self._coordinator_now = threading.Event()
        self._launched: list = []  # handles of the workers started here: shutdown() kills them
        threads = scheduling.bootstrap_threads(
            config.threads_per_worker, usable_cores=len(os.sched_getaffinity(0))
        )
        # Only where the user lets the loader decode (this node hosts workers too: label, room), and where
        # what this process decodes is not decoded again by the workers (Source.bootstraps).
        self._bootstrap = (
            Bootstrap(spec, catalogs, threads, here, on_first=self._launch_now.set)
            if here in placement and all(cat.source.bootstraps for cat in catalogs)
            else None
        )
        self._first_local: tuple[float, float] | None = None
        self._launch: Future = Future()
        threading.Thread(
            target=self._run_launch,
            args=(spec, catalogs, placement, cpus, here),
            name="raydl-launch",
            daemon=True,
        ).start()

    # -- start-up -------------------------------------------------------------------------
    def _run_launch(
        self,
        spec: MixtureSpec,
        catalogs: tuple[Catalog, ...],
        placement: dict[str, int],
        cpus: dict[str, float],
        here: str,
    ) -> None:
        """Start the workers, then the coordinator (on the thread "raydl-launch").

        When this process makes the first batch itself, the launch waits for it
        (or LAUNCH_DELAY_S when no batch is asked for): on a small node, worker
        processes booting and Ray's own start-up (serializing the catalog,
        exporting the actor classes) would take CPU from that batch. The
        coordinator starts COORDINATOR_DELAY_S after the workers: until then the
        workers started here serve this Loader as they come up, and nothing
        needs it, while its process start (a Ray worker process, Ray's
        serializers, 0.4-0.7 s of CPU) would be taken from the first batches and
        from the workers' own start. A call that needs the coordinator (refresh,
        a dead worker, pickling, waiting for workers) starts everything at once;
        shutdown() before it started kills the workers itself.
        """
        try:
            if self._bootstrap is not None and not self._launch_now.wait(LAUNCH_DELAY_S):
                if self._bootstrap.busy:  # a batch is under way here: let it finish first
                    self._launch_now.wait(READY_TIMEOUT_S)
            self._check_ray()
            catalog_ref = ray.put(catalogs)
            self._check_ray()
            spec_ref = ray.put(spec)  # the coordinator passes it on without unpickling it
            started = []
            for node, k in placement.items():
                self._check_ray()
                handles = launch_workers(
                    spec_ref, catalog_ref, self.config, node, k, node_cpus=cpus[node], soft=False
                )
                started += [(h, node) for h in handles]
                with self._lock:
                    self._launched += handles
            with self._lock:
                self._starting = {h.ready.remote(): h for h, _node in started}
            self._coordinator_now.wait(COORDINATOR_DELAY_S)
            self._check_ray()
            coordinator = start_coordinator(spec_ref, catalog_ref, self.config, started, here)
            with self._lock:
                self._coordinator = coordinator
                # the coordinator has them now (shutdown() asks it); this Loader keeps their handles to
                # kill them itself should the coordinator be gone by then
            self._launch.set_result(coordinator)
        except _Stopped:  # shut down, or Ray went away first: nothing to start, and nothing to say
            self._launch.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever needs the coordinator
            if self._closed or not self._ray_is_ours():
                self._launch.set_result(None)  # Ray went away under the launch: its errors are no news
            else:
                self._launch.set_exception(exc)

    def _ray_is_ours(self) -> bool:
        """Whether this process is still connected to the Ray the loader was built in (asks, never
        connects: Ray's own calls would connect again after a ray.shutdown())."""
        return ray.is_initialized() and _cluster_now() == self._cluster

    def _check_ray(self) -> None:
        """Before each Ray call of the launch thread: none after shutdown() or ray.shutdown(), so the
        thread never starts Ray or joins a cluster (Ray connects on its own when asked while disconnected)."""
        if self._closed or not self._ray_is_ours():
            raise _Stopped

    def _coordinator_handle(self):
        """The coordinator, launching the workers now if they are not yet (see `_run_launch`)."""
        if self._coordinator is None:
            self._launch_now.set()
            self._coordinator_now.set()
            try:
                coordinator = self._launch.result(timeout=READY_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - named below
                raise LoaderError(
                    f"could not start the loader's workers and coordinator: {type(exc).__name__}: {exc}"
                ) from exc
            if coordinator is None:
                self._check_open()
                raise LoaderError("the loader is shut down")
            return coordinator
        return self._coordinator

    # -- workers (through the coordinator) ------------------------------------------------
    def _call(self, method: str, *args):
        self._check_open()
        try:
            return ray.get(getattr(self._coordinator_handle(), method).remote(*args))
        except ray.exceptions.RayActorError as exc:
            raise LoaderError(f"the loader's coordinator is gone ({exc}); was the loader shut down?") from exc

    def _collect_started(self, ready: list) -> None:
        """Add the workers this Loader started that are up now (until the coordinator's list takes over)."""
        for ref in ready:
            with self._lock:
                handle = self._starting.pop(ref, None)
            if handle is None:
                continue
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError:
                continue  # the coordinator says why, in its warnings
            with self._lock:
                if self._version == 0:
                    self._workers.append(WorkerInfo(handle, info["node_id"], info["name"], info["node_ip"]))
                if self._bootstrap is not None:  # no batch goes to it from here on: its spare buffer goes
                    self._bootstrap.drop_spare()

    def _update(self, version: int, workers: list[WorkerInfo], events: list[tuple[int, str]]) -> None:
        with self._lock:
            # Version 0: the coordinator has not taken over the workers started here yet.
            if version > 0 and version >= self._version:
                self._version, self._workers = version, workers
                self._starting.clear()
                self._close_bootstrap()  # the coordinator has every worker that came up
            new = [(seq, msg) for seq, msg in events if seq > self._events_seen]
            if new:
                self._events_seen = new[-1][0]
        for _seq, msg in new:  # the coordinator's warnings, in this (the driver's or a rank's) process
            logger.warning("%s", msg)

    def workers(self) -> list[WorkerInfo]:
        """The live workers as last fetched from the coordinator (see `sync`)."""
        self._check_open()
        with self._lock:
            starting = list(self._starting) if self._version == 0 else []
        if starting:
            ready, _ = ray.wait(starting, num_returns=len(starting), timeout=0)
            self._collect_started(ready)
        with self._lock:
            return list(self._workers)

    def sync(self, version: int) -> None:
        """A batch said the coordinator's worker list is at `version`: fetch it when ours is older.

        The only call a rank makes to the coordinator in steady state is none: the
        version rides on every batch, so the coordinator is asked once per change
        (and its warnings come with the list).
        """
        if version > self._version:
            self._update(*self._call("workers"))

    def runners(self) -> list[WorkerInfo]:
        """Where a batch can go now (the WorkerPool protocol): the live workers; while none is up yet, this
        process (see `bootstrap`); else the workers, waiting for one to come up."""
        workers = self.workers()
        if workers:
            return workers
        local = self.bootstrap()
        return [local.info] if local is not None else self.wait_for_workers()

    def bootstrap(self) -> Bootstrap | None:
        """While none of the workers it started is up yet: the runner that makes batches in this
        process (the Loader that started the workers only, within READY_TIMEOUT_S of starting them)."""
        with self._lock:
            if (
                self._workers
                or self._bootstrap is None
                or time.monotonic() - self._started_at > READY_TIMEOUT_S
            ):
                return None
            return self._bootstrap

    @property
    def first_local_batch(self) -> tuple[float, float] | None:
        """perf_counter at the start and the end of the first batch this process made itself while its
        workers started (None: it made none)."""
        with self._lock:
            boot = self._bootstrap
        return boot.first_task if boot is not None else self._first_local

    def _close_bootstrap(self) -> None:
        """No batch is made in this process any more (call with the lock held)."""
        if self._bootstrap is not None:
            self._first_local = self._bootstrap.first_task
            self._bootstrap.close()
            self._bootstrap = None

    def wait_for_workers(self, timeout_s: float = _NO_WORKERS_WAIT_S) -> list[WorkerInfo]:
        """The live workers, waiting up to `timeout_s` for one to come up; LoaderError when none does."""
        deadline = time.monotonic() + timeout_s
        workers = self.workers()
        while not workers and time.monotonic() < deadline:
            time.sleep(0.1)
            self._update(*self._call("workers"))
            workers = self.workers()
        if not workers:
            raise LoaderError(
                f"no loader worker is up {timeout_s:.0f} s after asking; see the warnings above "
                "(a worker that could not start, or a node that is gone)"
            )
        return workers

    def memory(self) -> dict:
        """Where this loader's memory goes, in bytes: each worker's reused batch arrays (one per batch
        in flight in it), the object store's share (at most prefetch depth + 1 tasks' batches per rank in
        flight or in use; a task makes `batches_per_task` batches), and the catalog (one copy in the
        object store, mapped by all)."""
        workers = self.workers()
        per_worker = ray.get([w.handle.memory.remote() for w in workers], timeout=30) if workers else []
        budget, world = self.object_store_budget, self.config.world_size
        per_task = batches_per_task(
            self.plan.batch_bytes, depth=self.config.prefetch_batches, budget_bytes=budget, world_size=world
        )
        task_bytes = per_task * self.plan.batch_bytes
        depth = prefetch_depth(
            self.config.prefetch_batches, batch_bytes=task_bytes, budget_bytes=budget, world_size=world
        )
        return {
            "batch_bytes": self.plan.batch_bytes,
            "batches_per_task": per_task,
            "worker_batch_arrays": [m["batch_arrays"] for m in per_worker],
            "worker_batch_array_count": [m["batch_arrays_count"] for m in per_worker],
            "object_store_batches_max": (depth + 1) * task_bytes * world,
            "catalog": self._catalog_bytes,
        }

    def refresh(self) -> None:
        """Start workers on eligible nodes that lack them (e.g. nodes that just joined) and wait for them."""
        self._update(*self._call("refresh_now"))

    def replace(self, dead: WorkerInfo) -> list[WorkerInfo]:
        """Report a dead worker (the coordinator replaces it once); returns the workers to use now."""
        self._update(*self._call("report_dead", dead.name))
        with self._lock:  # also when the coordinator has not taken over the workers started here yet
            self._workers = [w for w in self._workers if w.name != dead.name]
        deadline = time.monotonic() + _NO_WORKERS_WAIT_S
        while (
            not self._workers and time.monotonic() < deadline
        ):  # the last one died: wait for its replacement
            time.sleep(0.2)
            self._update(*self._call("workers"))
        if not self._workers:
            raise LoaderError(
                f"no loader worker left after {dead.name} died, and none started within "
                f"{_NO_WORKERS_WAIT_S:.0f} s"
            )
        with self._lock:
            return list(self._workers)

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError("the loader is shut down")
        if not self._ray_is_ours():
            raise LoaderError(
                "Ray was shut down after this loader was built, so its workers are gone; build the loader "
                "again (after ray.init(), or let loader() start a local Ray)"
            )

    # -- public -------------------------------------------------------------------------
    def iterator(self, rank: int = 0) -> DataIterator:
        """The iterator of `rank` (0 <= rank < world_size)."""
        world = self.config.world_size
        check_number(f"rank (world_size={world})", rank, integer=True, at_least=0, below=world)
        self._check_open()
        return DataIterator(self.plan, self, rank)

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
            self._close_bootstrap()
        if not self._owner:
            return
        self._launch_now.set()  # a launch still waiting sees _closed and starts nothing more
        self._coordinator_now.set()
        try:
            coordinator = self._launch.result(timeout=READY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a failed launch left no coordinator
            coordinator = None
        if not self._ray_is_ours():  # after ray.shutdown(): the actors went with it
            return
        if coordinator is not None:
            try:
                workers = [w.handle for w in ray.get(coordinator.shutdown.remote(), timeout=30)]
            except Exception:  # noqa: BLE001 - a dead coordinator took the workers it started with it
                workers = []
            ray.kill(coordinator, no_restart=True)
        else:
            workers = []
        # the workers started here are this Loader's: killed here too (the coordinator may be gone)
        with self._lock:
            launched = list(self._launched)
        for handle in launched:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        workers = workers + launched
        deadline = time.monotonic() + 10.0
        pending = workers
        while pending and time.monotonic() < deadline:  # kill is asynchronous: wait until they are gone
            pending = [h for h in pending if actor_alive(h)]
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
        coordinator = self._coordinator_handle() if not self._closed else self._coordinator
        state = self.__dict__.copy()
        for name in ("_lock", "_launch", "_launch_now", "_coordinator_now"):
            del state[name]
        state["_coordinator"] = coordinator
        state["_owner"] = False
        state["_starting"] = {}
        state["_launched"] = []
        state["_bootstrap"] = None  # only the Loader that started the workers makes batches itself
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._launch_now = threading.Event()
        self._coordinator_now = threading.Event()
        self._launch = Future()
        self._launch.set_result(self._coordinator)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Loader(samples={self.plan.num_samples}, batch_size={c.batch_size}, world_size={c.world_size}, "
            f"workers={len(self._workers)}, closed={self._closed})"
        )


class _Stopped(Exception):
    """The launch stops: the loader was shut down, or Ray was."""


def _cluster_now() -> str | None:
    """The GCS address of the Ray this process is connected to; None when it is not. Ray's own
    get_runtime_context, not the `ray.` one, which would connect when it is not."""
    try:
        return runtime_context.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - not connected (Ray says so by raising)
        return None


def _as_pipeline(pipeline: Pipeline | SampleProgram | None) -> Pipeline:
    return pipeline if isinstance(pipeline, Pipeline) else Pipeline(pipeline)


def _mixture_spec(mixture: Mixture, plan: LoaderPlan) -> MixtureSpec:
    """What the workers need of every member, besides its catalog."""
    c = plan.config
    specs = tuple(
        WorkerSpec(
            program=m.pipeline.program,
            threads=c.threads_per_worker,
            policy=plan.policy,
            io_concurrency=c.io_concurrency,
            max_sample_bytes=c.max_sample_bytes,
            sample_stages=m.pipeline.sample_stages,
            batch_stages=m.pipeline.batch_stages,
            cache=c.cache,
        )
        for m in mixture.members
    )
    return MixtureSpec(specs, mixture.names, plan.order.id_offsets, labelled=mixture.labelled)


def _default_budget(nodes: list[scheduling.NodeInfo]) -> int:
    """A quarter of the smallest node's object store: batches never crowd out the training job's objects."""
    stores = [n.resources.get("object_store_memory", 0) for n in nodes]
    stores = [s for s in stores if s > 0]
    return int(_DEFAULT_BUDGET_FRACTION * min(stores)) if stores else 1 << 30
