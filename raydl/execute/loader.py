"""Loader: starts the loader's workers and coordinator, and hands out per-rank iterators.

The catalog goes into the object store once and every worker maps it. The
workers (the plain `LoaderWorker` class), `num_workers` per eligible node (one
with CPUs, room for `cpus_per_worker`, and the `node_resource` label when one is
given), are started here at the same time as the coordinator actor
(raydl/execute/coordinator.py), which then owns them: it starts workers on
nodes that join and replaces a dead one once, on the live node with the
fewest. The constructor does not wait for them: until the first is up, the
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

import hashlib
import logging
import math
import os
import sys
import sysconfig
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl.describe.catalog import Catalog
from raydl.describe.mixing import Mixture
from raydl.describe.records import Pipeline, decoded_fields
from raydl.describe.transforms import SampleProgram
from raydl.errors import LoaderError
from raydl.execute.bootstrap import Bootstrap
from raydl.execute.cluster import (
    READY_TIMEOUT_S,
    WorkerInfo,
    free_cpus,
    launch_workers,
    live_nodes,
    no_room_message,
    remote_class,
)
from raydl.execute.coordinator import LoaderCoordinator
from raydl.execute.mixer import MixSpec
from raydl.execute.worker import WorkerSpec
from raydl.options import LoaderConfig, check_number
from raydl.plan import scheduling
from raydl.plan.failures import ErrorPolicy, Failure
from raydl.plan.mix import MixPlan, SourcePlan, mix_shares
from raydl.plan.order import bucket_batch_count
from raydl.util.arrow import int_column

if TYPE_CHECKING:
    from raydl.consume.iterator import DataIterator

logger = logging.getLogger(__name__)

__all__ = ["Loader"]

_DEFAULT_BUDGET_FRACTION = 0.25
_NO_WORKERS_WAIT_S = 60.0  # how long a rank waits for a replacement when no worker is left
LAUNCH_DELAY_S = 1.0  # how long the launch waits for a first batch to be asked of this process
# With cpus_per_worker > 0: how long to wait for CPUs to free up (e.g. a loader shutting down).
ROOM_WAIT_S = 10.0
DEFAULT_PART_WINDOW = 16  # LoaderConfig.shuffle_window's default for Parquet: row groups shuffled together


class Loader:
    """The loader of one dataset with one LoaderConfig.

    Made by `Dataset.loader(...)`. Use as a context manager, or call
    `shutdown()` (idempotent) to kill the workers and free their objects.
    """

    def __init__(
        self, catalog: Catalog | Mixture, pipeline: Pipeline | SampleProgram | None, config: LoaderConfig
    ) -> None:
        mixture = catalog if isinstance(catalog, Mixture) else None
        if mixture is None:
            if isinstance(pipeline, SampleProgram):
                pipeline = Pipeline(pipeline)
            members = [(catalog, pipeline)]
        else:
            members = [(m.catalog, m.pipeline) for m in mixture.members]
        # Fail before any actor starts: image fields the program cannot decode, batches without one shape,
        # user functions that cannot reach the workers.
        decoded = [_check_pipeline(cat, pipe) for cat, pipe in members]
        catalog, pipeline = members[0]
        program = pipeline.program
        self.config = config
        self.program = program
        self.image_fields = tuple(name for name, is_mask in decoded[0] if not is_mask)  # one torch dtype's
        # A mix: its plan (raydl/plan/mix.py) and what resume states record of it (not the catalogs: a Loader
        # pickles into a handle for each Ray Train worker). None for one dataset.
        self.mix: MixPlan | None = None
        self.mix_state = None if mixture is None else mixture.state()
        if mixture is None:
            self.num_samples = len(catalog)
            self.fingerprint = catalog.fingerprint
            # Seeds the shuffle: same files, same order anywhere
            self.samples_fingerprint = catalog.samples_fingerprint
            self.buckets, self.bucket_of, self.unlisted, self.plan_units = _plan_units(
                catalog, program, config
            )
            # A source that decodes a whole part to cut a sample out (Parquet row groups) is shuffled a window
            # of parts at a time by default: a batch drawn from every row group would decode them all.
            self.shuffle_window = _part_window(catalog, config)
            self.part_counts = catalog.column("count") if self.shuffle_window else None
        else:
            self.mix, unlisted = _mix_plan(mixture, config)
            self.num_samples = mixture.epoch_size
            self.fingerprint = _combined(m.catalog.fingerprint for m in mixture.members)
            self.samples_fingerprint = _combined(m.catalog.samples_fingerprint for m in mixture.members)
            self.buckets, self.bucket_of, self.unlisted = None, None, unlisted
            self.plan_units = self.mix.units
            self.shuffle_window, self.part_counts = 0, None  # each source's own window is in the mix's plan
        self._lock = threading.Lock()
        self._closed = False
        self._owner = True
        self._events_seen = 0
        self._version = 0
        self._workers: list[WorkerInfo] = []
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)  # actors' logs reach the driver (Ray's default)
        nodes = live_nodes()
        self.batch_bytes = config.batch_size * max(
            _sample_bytes(cat, pipe.program, dec) for (cat, pipe), dec in zip(members, decoded)
        )
        self.object_store_budget = config.object_store_budget or _default_budget(nodes)
        placement = _initial_placement(config, nodes)
        specs = [
            WorkerSpec(
                program=pipe.program,
                threads=config.threads_per_worker,
                on_error=config.on_error,
                io_concurrency=config.io_concurrency,
                max_sample_bytes=config.max_sample_bytes,
                sample_stages=pipe.sample_stages,
                batch_stages=pipe.batch_stages,
                cache=config.cache,
            )
            for _cat, pipe in members
        ]
        spec: WorkerSpec | MixSpec = specs[0]
        if mixture is not None:  # the workers get every source's spec, and a tuple of catalogs
            offsets = tuple(int(x) for x in self.mix.id_offsets)
            spec = MixSpec(tuple(specs), mixture.names, offsets, labelled=mixture.labelled)
            catalog = tuple(cat for cat, _pipe in members)
        self._catalog_bytes = sum(cat.nbytes for cat, _pipe in members)
        if config.cache is not None:
            _check_cache(config.cache.path, placement, here=ray.get_runtime_context().get_node_id())
        cpus = {n.node_id: n.cpus for n in nodes}
        here = ray.get_runtime_context().get_node_id()
        self._coordinator = None  # set by the launch, which the first batch does not wait for
        self._starting: dict = {}  # ready() ref -> handle of the workers started here, until they are up
        self._started_at = time.monotonic()
        self._launch_now = threading.Event()
        threads = scheduling.bootstrap_threads(
            config.threads_per_worker, usable_cores=len(os.sched_getaffinity(0))
        )
        # Only where the user lets the loader decode: this node hosts workers too (label, room).
        self._bootstrap = (
            Bootstrap(spec, catalog, threads, here, on_first=self._launch_now.set)
            if here in placement
            else None
        )
        self._launch: Future = Future()
        threading.Thread(
            target=self._run_launch,
            args=(spec, catalog, placement, cpus, here),
            name="raydl-launch",
            daemon=True,
        ).start()

    # -- start-up -------------------------------------------------------------------------
    def _run_launch(
        self,
        spec: WorkerSpec | MixSpec,
        catalog: Catalog | tuple,
        placement: dict[str, int],
        cpus: dict[str, float],
        here: str,
    ) -> None:
        """Start the workers and the coordinator (on the thread "raydl-launch").

        When this process makes the first batch itself, the launch waits for it
        (or LAUNCH_DELAY_S when no batch is asked for): on a small node, worker
        processes booting and Ray's own start-up (serializing the catalog,
        exporting the actor classes) would take CPU from that batch. A call that
        needs the coordinator (refresh, pickling, shutdown, waiting for workers)
        launches at once.
        """
        try:
            if self._bootstrap is not None and not self._launch_now.wait(LAUNCH_DELAY_S):
                if self._bootstrap.busy:  # a batch is under way here: let it finish first
                    self._launch_now.wait(READY_TIMEOUT_S)
            if self._closed:
                self._launch.set_result(None)
                return
            catalog_ref = ray.put(catalog)
            spec_ref = ray.put(spec)  # the coordinator passes it on without unpickling it
            started = [
                (h, node)
                for node, k in placement.items()
                for h in launch_workers(
                    spec_ref, catalog_ref, self.config, node, k, node_cpus=cpus[node], soft=False
                )
            ]
            coordinator = (
                remote_class(LoaderCoordinator)
                .options(
                    num_cpus=0,
                    max_concurrency=16,
                    max_restarts=0,
                    # On the driver's node, whose loss ends the job anyway (soft affinity was seen elsewhere).
                    scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
                )
                .remote([spec_ref], [catalog_ref], self.config, started)
            )
            with self._lock:
                self._starting = {h.ready.remote(): h for h, _node in started}
                self._coordinator = coordinator
            self._launch.set_result(coordinator)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever needs the coordinator
            self._launch.set_exception(exc)

    def _coordinator_handle(self):
        """The coordinator, launching the workers now if they are not yet (see `_run_launch`)."""
        if self._coordinator is None:
            self._launch_now.set()
            try:
                coordinator = self._launch.result(timeout=READY_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - named below
                raise LoaderError(
                    f"could not start the loader's workers and coordinator: {type(exc).__name__}: {exc}"
                ) from exc
            if coordinator is None:
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
                if self._bootstrap is not None:  # the coordinator has every worker that came up
                    self._bootstrap.close()
                    self._bootstrap = None
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
        """Where this loader's memory goes, in bytes: each worker's reused batch arrays (one per
        concurrent batch call), the object store's share (at most prefetch depth + 1 batches per rank in
        flight or in use), and the catalog (one copy in the object store, mapped by all)."""
        workers = self.workers()
        per_worker = ray.get([w.handle.memory.remote() for w in workers], timeout=30) if workers else []
        depth = scheduling.prefetch_depth(
            self.config.prefetch_batches,
            batch_bytes=self.batch_bytes,
            budget_bytes=self.object_store_budget,
            world_size=self.config.world_size,
        )
        return {
            "batch_bytes": self.batch_bytes,
            "worker_batch_arrays": [m["batch_arrays"] for m in per_worker],
            "worker_batch_array_count": [m["batch_arrays_count"] for m in per_worker],
            "object_store_batches_max": (depth + 1) * self.batch_bytes * self.config.world_size,
            "catalog": self._catalog_bytes,
        }

    def refresh(self) -> None:
        """Start workers on eligible nodes that lack them (e.g. nodes that just joined) and wait for them."""
        self._update(*self._call("refresh_now"))

    def replace_worker(self, dead: WorkerInfo) -> list[WorkerInfo]:
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

    # -- public -------------------------------------------------------------------------
    def iterator(self, rank: int = 0) -> DataIterator:
        """The iterator of `rank` (0 <= rank < world_size)."""
        from raydl.consume.iterator import DataIterator

        world = self.config.world_size
        check_number(f"rank (world_size={world})", rank, integer=True, at_least=0, below=world)
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
            if self._bootstrap is not None:
                self._bootstrap.close()
                self._bootstrap = None
        if not self._owner:
            return
        self._launch_now.set()  # a launch still waiting sees _closed and starts nothing
        try:
            coordinator = self._launch.result(timeout=READY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a failed launch left nothing to stop
            coordinator = None
        if coordinator is None:
            return
        try:
            workers = ray.get(coordinator.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a dead coordinator took its workers with it
            workers = []
        ray.kill(coordinator, no_restart=True)
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
        coordinator = self._coordinator_handle() if not self._closed else self._coordinator
        state = self.__dict__.copy()
        for name in ("_lock", "_launch", "_launch_now"):
            del state[name]
        state["_coordinator"] = coordinator
        state["_owner"] = False
        state["_starting"] = {}
        state["_bootstrap"] = None  # only the Loader that started the workers makes batches itself
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._launch_now = threading.Event()
        self._launch = Future()
        self._launch.set_result(self._coordinator)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Loader(samples={self.num_samples}, batch_size={c.batch_size}, world_size={c.world_size}, "
            f"workers={len(self._workers)}, closed={self._closed})"
        )


def _part_window(catalog: Catalog, config: LoaderConfig) -> int:
    """The parts shuffled together (LoaderConfig.shuffle_window, or its source's default); 0: all."""
    window = config.shuffle_window
    if window is None:
        window = 0 if catalog.source.range_is_sample else DEFAULT_PART_WINDOW
    return window if catalog.num_parts < len(catalog) else 0  # one sample a part: global


def _mix_plan(mixture: Mixture, config: LoaderConfig) -> tuple[MixPlan, tuple[Failure, ...]]:
    """The plan of a mix: each source's samples, fingerprint, window and weights, and its share; and the
    samples of bucketed datasets that are in no bucket (their size unread), reported through on_error.

    Bucketed datasets (all with the same buckets, batched per_source) are mixed a bucket at a time: each
    bucket of each dataset is a source of its own, weighted by the dataset's weight times the bucket's
    share of the dataset (of its samples, or of its per-sample weights), so that batches are bucket-pure
    and their number is fixed before any epoch.
    """
    programs = [m.pipeline.program for m in mixture.members]
    bucketed = programs[0] is not None and programs[0].buckets is not None
    sources, weights, owners, buckets, unlisted = [], [], [], [], []
    for i, (m, w) in enumerate(zip(mixture.members, mixture.weights)):
        if not bucketed:
            window = _part_window(m.catalog, config)
            sources.append(
                SourcePlan(
                    len(m.catalog),
                    m.catalog.samples_fingerprint,
                    window=window,
                    part_counts=m.catalog.column("count") if window else None,
                    weights=m.weights,
                )
            )
            weights.append(w)
            continue
        catalog = m.catalog.with_sizes()
        bucket_list = programs[i].buckets.buckets
        of = programs[i].buckets.assign(catalog.column("width"), catalog.column("height"))
        unlisted.extend(_unsized(catalog, of))
        mass = m.weights if m.weights is not None else np.ones(len(of))
        total = float(mass[of >= 0].sum()) or 1.0
        for k in np.unique(of[of >= 0]).tolist():
            ids = np.flatnonzero(of == k)
            fp = hashlib.sha256(f"{m.catalog.samples_fingerprint}:{k}".encode()).hexdigest()
            sub = None if m.weights is None else m.weights[ids]
            if sub is not None and not sub.any():
                continue  # no weight in this bucket: never drawn
            sources.append(SourcePlan(len(ids), fp, weights=sub, ids=ids))
            weights.append(w * float(mass[ids].sum()) / total)
            owners.append(i)
            buckets.append(tuple(bucket_list[k]))
    ErrorPolicy(config.on_error).settle(tuple(unlisted))  # under "raise", the first stops the loader here
    shares = tuple(int(x) for x in mix_shares(weights, mixture.epoch_size))
    plan = MixPlan(
        tuple(sources),
        shares,
        mixture.batching,
        config.batch_size,
        config.drop_last,
        owners=tuple(owners) if bucketed else None,
        buckets=tuple(buckets) if bucketed else None,
        dataset_sizes=tuple(len(m.catalog) for m in mixture.members) if bucketed else None,
    )
    return plan, tuple(unlisted)


def _combined(fingerprints) -> str:
    h = hashlib.sha256()
    for fp in fingerprints:
        h.update(fp.encode() + b"\0")
    return h.hexdigest()


def _check_pipeline(catalog: Catalog, pipeline: Pipeline) -> list[tuple[str, bool]]:
    """The image fields the pipeline decodes ((name, is_mask)), after checking that it can run: a ValueError
    naming what is wrong (a decode stage with no image field to decode, no batch shape, a user function
    that does not pickle)."""
    program, fields = pipeline.program, catalog.source.fields
    decoded = decoded_fields(program, fields)
    if program is not None and not decoded:
        raise ValueError(
            f".decode() has no image field to decode: the {catalog.source.name} source's fields are "
            f"{[f.name for f in fields]}, none of them an image; drop .decode() and the image stages"
        )
    if decoded:
        program.slot_shapes()  # a ValueError when batches cannot have one image shape
    from ray import cloudpickle

    for fn in pipeline.functions:
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        if module is not None and _send_by_value(module):
            cloudpickle.register_pickle_by_value(module)
        try:
            cloudpickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - any failure to pickle is the function's
            raise ValueError(
                f"{getattr(fn, '__qualname__', fn)!r} cannot be pickled, and the loader's workers need it: "
                f"{type(exc).__name__}: {exc}; define it at module level (not holding locks, files or "
                "sockets)"
            ) from exc
    return decoded


def _send_by_value(module) -> bool:
    """Whether a user function's module goes to the workers by value: a lone top-level module that is not
    installed (a test file, a script's sibling) may not be importable on the workers, whose path is the
    driver's script folder and working directory; a package's module (mypkg.transforms) or an installed one
    goes by reference."""
    name, path = module.__name__, getattr(module, "__file__", None)
    if name == "__main__" or "." in name or not path or not path.endswith(".py"):
        return False  # __main__ goes by value anyway; packages and extension modules by reference
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    real = os.path.realpath(path)
    return not any(real.startswith(os.path.realpath(p) + os.sep) for p in installed)


def _sample_bytes(catalog: Catalog, program: SampleProgram | None, decoded: list[tuple[str, bool]]) -> int:
    """About what one sample takes in a batch: its decoded image fields at their largest shape, else (no
    decoded image) its bytes as stored, on average."""
    if not decoded:
        stored = int(int_column(catalog.shards.column("size")).sum())
        return max(1, stored // max(1, len(catalog)))
    pixels = max(math.prod(s) for s in program.slot_shapes()) // 3  # an image slot holds 3 channels
    return sum(pixels if is_mask else 3 * pixels * program.dtype.itemsize for _name, is_mask in decoded)


def _plan_units(catalog: Catalog, program: SampleProgram | None, config: LoaderConfig):
    """(buckets, bucket of each sample, samples in no bucket, units the plan deals).

    Without aspect buckets the plan deals samples; with them it deals whole
    bucket-pure batches, and samples whose header gave no size are in none
    (reported through on_error).
    """
    if program is None or program.buckets is None:
        return None, None, (), len(catalog)
    # Read here when the catalog came without them (a ValueError where none exist)
    catalog = catalog.with_sizes()
    buckets = program.buckets.buckets
    bucket_of = program.buckets.assign(catalog.column("width"), catalog.column("height"))
    unlisted = _unsized(catalog, bucket_of)
    ErrorPolicy(config.on_error).settle(unlisted)  # under "raise", the first of them stops the loader here
    units = bucket_batch_count(bucket_of, len(buckets), config.batch_size, config.drop_last)
    if units == 0:
        raise ValueError(
            f"no aspect bucket holds a full batch of {config.batch_size} (drop_last=True); "
            f"bucket sizes: {np.bincount(bucket_of[bucket_of >= 0], minlength=len(buckets)).tolist()}"
        )
    return buckets, bucket_of, unlisted, units


def _unsized(catalog: Catalog, bucket_of: np.ndarray) -> tuple[Failure, ...]:
    """A Failure for each sample in no bucket (its header gave no size), for on_error to settle."""
    return tuple(
        Failure.unsized(
            int(i), catalog.uri(int(i)), catalog.size_errors.get(int(i), "no image size in the catalog")
        )
        for i in np.flatnonzero(bucket_of < 0)
    )


def _default_budget(nodes: list[scheduling.NodeInfo]) -> int:
    """A quarter of the smallest node's object store: batches never crowd out the training job's objects."""
    stores = [n.resources.get("object_store_memory", 0) for n in nodes]
    stores = [s for s in stores if s > 0]
    return int(_DEFAULT_BUDGET_FRACTION * min(stores)) if stores else 1 << 30


def _initial_placement(config: LoaderConfig, nodes: list[scheduling.NodeInfo]) -> dict[str, int]:
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


def _actor_alive(handle) -> bool:
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=0.5)
        return True
    except ray.exceptions.GetTimeoutError:
        return True  # busy, not dead yet
    except Exception:  # noqa: BLE001 - RayActorError and friends: dead
        return False


CACHE_CHECK_TIMEOUT_S = 60.0  # a node's cache-folder probe (a Ray task: a worker process starts for it)


def _probe_cache_folder(path: str) -> tuple[str, str | None]:
    """(this node's address, why `path` is no cache folder here, or None when it is writable)."""
    from raydl.storage.cache import check_cache_folder

    try:
        check_cache_folder(path)
    except OSError as exc:
        return ray.util.get_node_ip_address(), f"{type(exc).__name__}: {exc}"
    return ray.util.get_node_ip_address(), None


def _check_cache(path: str, placement: dict[str, int], *, here: str) -> None:
    """The cache folder is writable on every node that will host workers: the driver's own, checked here
    (it makes the first batches itself), and the others by a task pinned to each; else a LoaderError
    naming the path and the node."""
    _ip, why = _probe_cache_folder(path) if here in placement else (None, None)
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
        n: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(path)
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
