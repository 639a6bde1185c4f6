"""DataIterator: one rank's view of the loader, in the style of ray.data.DataIterator.

Each `iter_batches()` call runs one epoch (epoch 0, then 1, ...). A call that
is left part-way (a `break`, a timeout) leaves the iterator at the next batch,
and the next call continues that epoch. The iterator keeps at most
`prefetch_batches` batch tasks in flight, yields in plan order, and never waits
for another rank.

Nor does it wait forever: without `timeout_s`, each batch may take what
raydl/plan/timeouts.py allows (a floor, `LoaderConfig.batch_timeout_s`, and
10 × the longest wait so far); past it, a BatchTimeoutError names the rank,
epoch, batch, the worker and its node.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import ray

from raydl.consume.formats import check_batch_format, format_batches
from raydl.errors import BatchTimeoutError, LoaderError, SampleDecodeError
from raydl.options import check_number, positive_int
from raydl.plan.failures import ErrorPolicy, Failure
from raydl.plan.mix import MixEpoch
from raydl.plan.order import (
    BucketBatches,
    EpochOrder,
    EpochPlan,
    WindowedOrder,
    augmentation_seeds,
    bucket_batches,
)
from raydl.plan.scheduling import choose_worker, prefetch_depth
from raydl.plan.tasks import BatchResult, BatchTask, batch_rows
from raydl.plan.timeouts import batch_timeout

if TYPE_CHECKING:
    from raydl.execute.coordinator import WorkerInfo
    from raydl.execute.loader import Loader

logger = logging.getLogger(__name__)

__all__ = ["DataIterator", "IteratorStats"]

_MAX_ATTEMPTS = 3  # per batch: the first run plus retries on replacement actors


@dataclass
class IteratorStats:
    """What one rank's iterator has done so far (all epochs)."""

    rank: int
    epoch: int = 0
    batches: int = 0
    samples_delivered: int = 0
    samples_skipped: int = 0
    samples_replaced: int = 0  # on_error="replace": failed samples that a substitute stood in for
    wait_s: float = 0.0
    time_to_first_batch_s: float | None = None
    elapsed_s: float = 0.0
    retries: int = 0
    local_batches: int = 0  # made by an actor on this rank's node (read from the object store without a copy)
    driver_batches: int = (
        0  # made in this process while the loader's workers started (counted in local_batches)
    )
    # The node cache (LoaderConfig.cache) while this rank's batches were made: reads served from the node's
    # disk and from the store, their bytes, entries evicted for room and entries found corrupt (refetched).
    cache_hits: int = 0
    cache_misses: int = 0
    bytes_from_cache: int = 0
    bytes_from_store: int = 0
    cache_evictions: int = 0
    cache_corrupt: int = 0
    skipped_uris: list[str] = field(default_factory=list, repr=False)
    replaced_uris: list[str] = field(default_factory=list, repr=False)

    def add_cache(self, counts: dict[str, int]) -> None:
        """Add one batch's node cache counters (BatchResult.cache)."""
        for name, value in counts.items():
            attr = name if name.startswith("bytes_") else f"cache_{name}"
            setattr(self, attr, getattr(self, attr) + value)

    @property
    def images_per_s(self) -> float:
        return self.samples_delivered / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def __str__(self) -> str:
        ttfb = "-" if self.time_to_first_batch_s is None else f"{self.time_to_first_batch_s:.2f} s"
        rows = [
            ("rank", str(self.rank)),
            ("epoch", str(self.epoch)),
            ("batches", str(self.batches)),
            ("samples delivered", str(self.samples_delivered)),
            ("samples skipped", str(self.samples_skipped)),
            ("samples replaced", str(self.samples_replaced)),
            ("images/s", f"{self.images_per_s:.1f}"),
            ("time to first batch", ttfb),
            ("consumer wait", f"{self.wait_s:.2f} s"),
            ("retried batches", str(self.retries)),
            ("local batches", f"{self.local_batches}/{self.batches}"),
        ]
        if self.cache_hits or self.cache_misses:
            rows.append(
                (
                    "node cache",
                    f"{self.cache_hits} hits ({self.bytes_from_cache / 1e6:.1f} MB), "
                    f"{self.cache_misses} misses ({self.bytes_from_store / 1e6:.1f} MB from the store), "
                    f"{self.cache_evictions} evicted, "
                    f"{self.cache_corrupt} corrupt",
                )
            )
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class DataIterator:
    """Batches of one rank. Made by `Loader.iterator(rank)`."""

    def __init__(self, loader: Loader, rank: int) -> None:
        self._loader = loader
        self._config = loader.config
        self._rank = rank
        self._n = loader.num_samples
        # The plan's unit: a sample, or with aspect buckets a whole (bucket-pure) batch.
        self._buckets = loader.buckets
        self._units = loader.plan_units
        self._mix = loader.mix  # a mix's plan (raydl/plan/mix.py), or None
        # Whole batches are the plan's unit with aspect buckets and with per_source mixing.
        self._batch_units = self._buckets is not None or (self._mix is not None and self._mix.per_source)
        self._unit = 1 if self._batch_units else loader.config.batch_size
        self._epoch = 0
        self._next = 0  # next batch index of the current epoch
        self._start = 0  # position in the epoch order where this epoch's plan starts (elastic resume)
        self._pending: dict[
            int, tuple[ray.ObjectRef | Future, WorkerInfo, int]
        ] = {}  # k -> (ref, worker, attempt)
        self._node = ray.get_runtime_context().get_node_id()
        self._stats = IteratorStats(rank=rank)
        self._created = time.perf_counter()
        self._logged: set[str] = set()  # URIs of failed samples logged so far (each once)
        self._longest_wait_s: float | None = None  # for the default timeout; None until the first batch
        self._policy = ErrorPolicy(loader.config.on_error)

    # -- plan ---------------------------------------------------------------------------
    def _plan(self) -> EpochPlan:
        c = self._config
        return EpochPlan(self._units, c.world_size, self._unit, c.drop_last, start=self._start)

    def __len__(self) -> int:
        """Batches per epoch for this rank (the same on every rank)."""
        return self._plan().batches_per_rank

    def _order(self) -> EpochOrder | WindowedOrder | BucketBatches | MixEpoch:
        """The epoch's global order: sample ids (lazy: only this rank's positions are computed), the
        bucket-pure batches, or a mix's epoch."""
        c = self._config
        if self._mix is not None:
            return self._mix.epoch(seed=c.seed, epoch=self._epoch, shuffle=c.shuffle)
        if self._buckets is None and c.shuffle and self._loader.shuffle_window:
            return WindowedOrder(
                self._loader.part_counts,
                self._loader.shuffle_window,
                seed=c.seed,
                epoch=self._epoch,
                fingerprint=self._loader.samples_fingerprint,
            )
        if self._buckets is None:
            return EpochOrder(
                self._n,
                seed=c.seed,
                epoch=self._epoch,
                shuffle=c.shuffle,
                fingerprint=self._loader.samples_fingerprint,
            )
        return bucket_batches(
            self._loader.bucket_of,
            num_buckets=len(self._buckets),
            batch_size=c.batch_size,
            seed=c.seed,
            epoch=self._epoch,
            shuffle=c.shuffle,
            drop_last=c.drop_last,
            fingerprint=self._loader.samples_fingerprint,
        )

    def _task(self, order, plan: EpochPlan, k: int) -> BatchTask:
        bucket = None
        if isinstance(order, MixEpoch):  # seeded by slot: a sample repeated in an epoch differs each time
            if order.per_source:
                j = int(plan.positions(self._rank, k)[0])
                (ids, slots), bucket = order.batch(j), order.bucket(j)
            else:
                ids, slots = order.rows(plan.positions(self._rank, k))
            seeds = augmentation_seeds(slots, seed=self._config.seed, epoch=self._epoch)
            return BatchTask(rank=self._rank, epoch=self._epoch, index=k, ids=ids, seeds=seeds, bucket=bucket)
        if isinstance(order, BucketBatches):
            j = int(plan.positions(self._rank, k)[0])
            ids, bucket = order.batch(j), self._buckets[int(order.bucket[j])]  # type: ignore[index]
        else:
            ids = plan.batch_ids(order, self._rank, k)
        seeds = augmentation_seeds(ids, seed=self._config.seed, epoch=self._epoch)
        return BatchTask(rank=self._rank, epoch=self._epoch, index=k, ids=ids, seeds=seeds, bucket=bucket)

    # -- execution ----------------------------------------------------------------------
    def _submit(self, task: BatchTask, attempt: int = 0) -> None:
        workers = self._loader.workers()
        if not workers:
            local = self._loader.bootstrap()
            if local is not None:  # no worker is up yet: this process makes the batch
                self._pending[task.index] = (local.submit(task), local.info, attempt)
                return
            workers = self._loader.wait_for_workers()
        inflight: dict[str, int] = {}
        for _ref, pw, _a in self._pending.values():
            inflight[pw.name] = inflight.get(pw.name, 0) + 1
        w = workers[choose_worker([(x.name, x.node_id) for x in workers], inflight, self._node)]
        self._pending[task.index] = (w.handle.run_batch.remote(task), w, attempt)

    def _drop_pending(self) -> None:
        """Forget the batches in flight (their objects go once no reference is left)."""
        self._pending.clear()

    def _failed(self, k: int, worker: WorkerInfo, cause: BaseException, exc: BaseException) -> NoReturn:
        """The worker raised while making batch k: not a sample it could skip. Name the rank and batch."""
        where = f"rank {self._rank}: batch {k} of epoch {self._epoch}"
        if isinstance(cause, SampleDecodeError):  # replace ran out of substitutes
            raise SampleDecodeError(f"{where}: {cause}", uri=cause.uri, sample_id=cause.sample_id) from exc
        if isinstance(cause, LoaderError):  # already names the sample and the worker
            raise LoaderError(f"{where}: {cause}") from exc
        raise LoaderError(f"{where} failed on actor {worker.name}: {type(cause).__name__}: {cause}") from exc

    def _timeout_for_next(self, timeout_s: float | None) -> tuple[float, str]:
        """(seconds, why) the next batch may take: `timeout_s` as given, else plan/timeouts.py's default."""
        if timeout_s is not None:
            return timeout_s, "timeout_s"
        return batch_timeout(self._config.batch_timeout_s, self._longest_wait_s)

    def _get(self, task_of, k: int, timeout: tuple[float, str]) -> BatchResult:
        """Wait for batch k (up to timeout[0] s each time it runs; inf: forever); re-run it on another actor
        when its actor died."""
        wait = None if math.isinf(timeout[0]) else timeout[0]
        while True:
            ref, worker, attempt = self._pending[k]
            if isinstance(ref, Future):  # made in this process while the workers start
                try:
                    return ref.result(timeout=wait)
                except FutureTimeoutError as exc:
                    raise self._timeout(k, timeout, worker) from exc
                except Exception as exc:  # noqa: BLE001 - named by _failed
                    self._failed(k, worker, exc, exc)
            try:
                return ray.get(ref, timeout=wait)
            except ray.exceptions.GetTimeoutError as exc:
                raise self._timeout(k, timeout, worker) from exc
            except ray.exceptions.RayTaskError as exc:  # the worker raised: not a sample it could skip
                self._failed(k, worker, exc.cause, exc)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                if attempt + 1 >= _MAX_ATTEMPTS:
                    raise LoaderError(
                        f"rank {self._rank}: batch {k} of epoch {self._epoch} failed {attempt + 1} times; "
                        f"last on actor {worker.name}: {exc}"
                    ) from exc
                self._loader.replace_worker(worker)
                self._stats.retries += 1
                self._submit(task_of(k), attempt + 1)

    def _timeout(self, k: int, timeout: tuple[float, str], worker: WorkerInfo) -> BatchTimeoutError:
        seconds, why = timeout
        node = f"node {worker.node_id}" + (f" ({worker.node_ip})" if worker.node_ip else "")
        return BatchTimeoutError(
            f"rank {self._rank}: batch {k} of epoch {self._epoch} did not arrive within {seconds:.3g} s "
            f"({why}) from loader worker {worker.name} on {node}; call iter_batches() again to keep "
            "waiting, or pass timeout_s= (float('inf') waits forever)",
            rank=self._rank,
            batch_index=k,
        )

    def _account(self, result: BatchResult, k: int) -> None:
        """Settle batch k's failed samples as the error policy says (raise, or skip), note its replaced ones,
        and warn when it came out empty."""
        failed = [*result.unreadable, *result.skipped]  # an unreadable sample is named first
        self._skip(self._policy.settle(failed, rank=self._rank, epoch=self._epoch, batch=k))
        for r in result.replaced:
            self._warn_once(
                r.uri,
                "raydl: replaced sample %d (%s) by sample %d: %s",
                r.sample_id,
                r.uri,
                r.substitute_id,
                r.reason,
            )
            self._stats.replaced_uris.append(r.uri)
        self._stats.samples_replaced += len(result.replaced)
        self._stats.add_cache(result.cache)
        if result.skipped and batch_rows(result.batch) == 0:
            shapes = ", ".join(
                f"{name} {v.dtype} {tuple(v.shape)}"
                for name, v in result.batch.items()
                if isinstance(v, np.ndarray) and v.ndim > 1
            )
            logger.warning(
                "raydl: rank %d: batch %d of epoch %d has no rows: all %d of its samples failed "
                "(on_error='skip'); it is yielded empty%s, so that ranks stay in step "
                "(on_error='replace' keeps batches full)",
                self._rank,
                k,
                self._epoch,
                len(result.skipped),
                f" ({shapes})" if shapes else "",
            )

    def _account_unlisted(self) -> None:
        """Samples whose size could not be read at listing are in no bucket: rank 0 reports them each
        epoch."""
        self._skip(self._policy.settle(self._loader.unlisted))

    def _skip(self, failures: list[Failure]) -> None:
        """Failed samples left out of their batches: each logged once per URI, and counted."""
        for f in failures:
            self._warn_once(f.uri, "raydl: skipped sample %d (%s): %s", f.sample_id, f.uri, f.reason)
            self._stats.skipped_uris.append(f.uri)
        self._stats.samples_skipped += len(failures)

    def _warn_once(self, uri: str, message: str, *args: object) -> None:
        if uri not in self._logged:
            self._logged.add(uri)
            logger.warning(message, *args)

    def iter_batches(
        self,
        *,
        prefetch_batches: int | None = None,
        batch_format: str = "numpy",
        timeout_s: float | None = None,
        collate_fn: Callable[[Any], Any] | None = None,
    ) -> Iterator[Any]:
        """Batches of one epoch: dicts of numpy arrays, one per field, plus "id" (int64) and "key".

        `batch_format` (raydl/consume/formats.py, docs/loader.md "Batch formats"): "numpy" (or "default"):
        the batch as the workers made it: numbers and equal-shape arrays stacked, dtype=object arrays of
        str / dicts / bytes / 1-D arrays of varying length, except that "key" is a list of str (Ray Data
        would give an object array); "bucket", with aspect buckets, the batch's (H, W). "pyarrow": a
        pyarrow.Table. "pandas": a pandas.DataFrame. `collate_fn(batch)` gets each batch in that format,
        and what it returns is yielded as it is.

        `timeout_s`: the most to wait for one batch before a BatchTimeoutError (naming the rank, batch,
        worker and node); `float("inf")` waits forever. None (the default): max(the loader's
        `batch_timeout_s`, 300 s by default, and 10 × the longest wait for a batch so far), twice
        `batch_timeout_s` for this iterator's first batch.
        """
        batch_format = check_batch_format(batch_format, collate_fn)
        depth = self._config.prefetch_batches if prefetch_batches is None else prefetch_batches
        positive_int("prefetch_batches", depth)
        check_number("timeout_s", timeout_s, above=0, optional=True)
        depth = prefetch_depth(
            depth,
            batch_bytes=self._loader.batch_bytes,
            budget_bytes=self._loader.object_store_budget,
            world_size=self._config.world_size,
        )
        batches = self._epoch_batches(depth, timeout_s)
        if batch_format == "numpy" and collate_fn is None:
            return batches
        return format_batches(batches, batch_format, collate_fn)

    def _epoch_batches(self, depth: int, timeout_s: float | None) -> Iterator[dict[str, Any]]:
        plan = self._plan()
        if self._next >= plan.batches_per_rank:  # the last call took the epoch's last batch, then stopped
            self._epoch, self._next, self._start = self._epoch + 1, 0, 0
            self._stats.epoch = self._epoch
            plan = self._plan()
        order = self._order()
        nb = plan.batches_per_rank
        if self._next == 0 and self._rank == 0:
            self._account_unlisted()

        def task_of(k: int) -> BatchTask:
            return self._task(order, plan, k)

        base_elapsed = self._stats.elapsed_s
        started = time.perf_counter()
        while self._next < nb:
            k = self._next
            for j in range(k, min(k + depth, nb)):
                if j not in self._pending:
                    self._submit(task_of(j))
            t0 = time.perf_counter()
            result = self._get(task_of, k, self._timeout_for_next(timeout_s))
            self._loader.sync(result.membership)
            worker = self._pending.pop(k)[1]
            self._stats.local_batches += worker.node_id == self._node
            self._stats.driver_batches += worker.handle is None  # made by the Loader's process (bootstrap)
            now = time.perf_counter()
            self._stats.wait_s += now - t0
            self._longest_wait_s = max(self._longest_wait_s or 0.0, now - t0)
            if self._stats.time_to_first_batch_s is None:
                self._stats.time_to_first_batch_s = now - self._created
            self._account(result, k)
            self._next = k + 1
            self._stats.batches += 1
            self._stats.samples_delivered += batch_rows(result.batch)
            self._stats.elapsed_s = base_elapsed + (now - started)
            yield result.batch
        self._epoch += 1
        self._next = 0
        self._start = 0
        self._stats.epoch = self._epoch

    def iter_torch_batches(
        self,
        *,
        collate_fn: Callable[[dict[str, Any]], Any] | None = None,
        dtypes: Any = None,
        device: str = "auto",
        pin_memory: bool = False,
        prefetch_batches: int | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[Any]:
        """As iter_batches, with the numeric columns as torch tensors on `device` (raydl/consume/torch.py
        says what each kind of column becomes: text, dicts and bytes stay lists).

        On CPU the tensors share memory with the object store (zero-copy) and are read-only in spirit:
        copy before writing into them in place. `device="auto"` is the CPU. `dtypes` is one torch dtype
        for the decoded image fields (not masks), or a dict column -> dtype. `collate_fn(batch)` gets the
        numpy batch, and what it returns is yielded as it is; with it, dtypes, device and pin_memory are a
        ValueError (as Ray Data's). `timeout_s` as in iter_batches (None: the default, derived from the
        waits so far; `float("inf")`: forever).
        """
        from raydl.consume.torch import check_torch_args, torch_batches

        check_torch_args(collate_fn=collate_fn, dtypes=dtypes, device=device, pin_memory=pin_memory)
        if collate_fn is not None:
            return self.iter_batches(
                prefetch_batches=prefetch_batches, timeout_s=timeout_s, collate_fn=collate_fn
            )
        batches = self.iter_batches(prefetch_batches=prefetch_batches, timeout_s=timeout_s)
        images = self._loader.image_fields
        return torch_batches(batches, device=device, dtypes=dtypes, pin_memory=pin_memory, images=images)

    # -- resume -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands, as plain JSON-serializable values.

        Load it into an iterator of a loader built the same way to continue the
        interrupted epoch exactly; at another world size, the rest of the epoch
        is re-dealt (every rank must have consumed the same number of batches).
        """
        c = self._config
        return {
            "version": 1,
            "epoch": self._epoch,
            "batches_done": self._next,
            "start": self._start,
            "rank": self._rank,
            "world_size": c.world_size,
            "batch_size": c.batch_size,
            "seed": c.seed,
            "shuffle": c.shuffle,
            "drop_last": c.drop_last,
            "num_samples": self._n,
            "fingerprint": self._loader.fingerprint,
            "buckets": None if self._buckets is None else [list(b) for b in self._buckets],
            "shuffle_window": self._loader.shuffle_window,
            "mix": self._loader.mix_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (see state_dict). Mismatched data or seed is a ValueError."""
        c = self._config
        if state.get("version") != 1:
            raise ValueError(f"unsupported iterator state version {state.get('version')!r}")
        mine = {
            "fingerprint": self._loader.fingerprint,
            "num_samples": self._n,
            "seed": c.seed,
            "shuffle": c.shuffle,
            "drop_last": c.drop_last,
            "buckets": None if self._buckets is None else [list(b) for b in self._buckets],
        }
        mine["shuffle_window"] = self._loader.shuffle_window
        _check_mix_state(state.get("mix"), self._loader.mix_state)
        for key, value in mine.items():
            # states written before shuffle_window existed shuffled the whole epoch together (window 0)
            if state.get(key, 0 if key == "shuffle_window" else None) != value:
                raise ValueError(
                    f"cannot resume: the state's {key} is {state.get(key)!r}, this loader's is "
                    f"{value!r}; build the loader over the same data with the same settings"
                )
        if (self._buckets is not None or self._mix is not None) and int(state["batch_size"]) != c.batch_size:
            what = "aspect buckets" if self._buckets is not None else "a mix"
            raise ValueError(
                f"cannot resume: the state's batch_size is {state['batch_size']!r}, this loader's is "
                f"{c.batch_size!r}; with {what} the batches themselves depend on it"
            )
        old_unit = 1 if self._batch_units else int(state["batch_size"])
        old = EpochPlan(
            self._units, int(state["world_size"]), old_unit, c.drop_last, start=int(state["start"])
        )
        done = int(state["batches_done"])
        epoch, start, next_batch = int(state["epoch"]), old.start, done
        if (int(state["world_size"]), int(state["batch_size"])) != (c.world_size, c.batch_size):
            start, next_batch = old.consumed(done), 0  # re-deal the rest of the epoch
            if (
                start >= self._units
                or EpochPlan(self._units, c.world_size, self._unit, c.drop_last, start=start).batches_per_rank
                == 0
            ):
                epoch, start = epoch + 1, 0
        self._epoch, self._start, self._next = epoch, start, next_batch
        self._drop_pending()
        self._stats.epoch = epoch

    def stats(self) -> IteratorStats:
        """A snapshot of this rank's counters."""
        from dataclasses import replace

        return replace(
            self._stats,
            skipped_uris=list(self._stats.skipped_uris),
            replaced_uris=list(self._stats.replaced_uris),
        )

    def __repr__(self) -> str:
        where = f"rank={self._rank}, epoch={self._epoch}, next_batch={self._next}"
        return f"DataIterator({where}, batches={len(self)})"


def _check_mix_state(theirs: dict | None, mine: dict | None) -> None:
    """A state of a mix loads only into the same mix: a ValueError naming what changed (the sources, their
    weights, the epoch size, the batching, the per-sample weights or a source's data)."""
    if theirs is None and mine is None:
        return
    if theirs is None or mine is None:
        was, now = ("one dataset", "a mix") if theirs is None else ("a mix", "one dataset")
        raise ValueError(f"cannot resume: the state is of {was}, this loader is of {now}")
    for key, value in mine.items():
        if theirs.get(key) != value:
            if key in ("sample_weights", "fingerprints"):
                pairs = zip(mine["sources"], theirs.get(key) or [], value)
                changed = [n for n, a, b in pairs if a != b] or mine["sources"]
            if key == "sample_weights":
                raise ValueError(
                    f"cannot resume: the per-sample weights of source(s) {changed} changed since the state "
                    "was saved; load it into a loader of the same mix"
                )
            if key == "fingerprints":
                raise ValueError(
                    f"cannot resume: the data of source(s) {changed} changed since the state was saved; load "
                    "it into a loader of the same mix"
                )
            if key == "weights":
                was = dict(zip(theirs.get("sources", []), theirs.get("weights", [])))
                now = dict(zip(mine["sources"], value))
                raise ValueError(
                    f"cannot resume: the mix's weights changed: the state has {was}, this loader {now}; "
                    "resume with the same weights (or start a new epoch plan without the state)"
                )
            raise ValueError(
                f"cannot resume: the mix's {key} is {theirs.get(key)!r} in the state and {value!r} here; "
                "load it into a loader of the same mix"
            )
