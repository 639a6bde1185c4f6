"""DataIterator: one rank's view of the loader, in the style of ray.data.DataIterator.

Each `iter_batches()` call runs one epoch (epoch 0, then 1, ...). A call that
is left part-way (a `break`, a timeout) leaves the iterator at the next batch,
and the next call continues that epoch. The iterator keeps at most
`prefetch_batches` batch tasks in flight, yields in plan order, and never waits
for another rank.

It knows two things: the loader's plan (raydl/plan/loader_plan.py), which says
what batch k of this rank is, and a worker pool (raydl/consume/pool.py), which
says where batches are made. Batches come through Ray's object store: from a
worker on this rank's node as read-only views of it, with no copy.

Nor does it wait forever: without `timeout_s`, each batch may take what
raydl/plan/timeouts.py allows (a floor, `LoaderConfig.batch_timeout_s`, and
10 × the longest wait so far); past it, a BatchTimeoutError names the rank,
epoch, batch, the worker and its node.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import replace
from typing import Any, NamedTuple, NoReturn

import ray

from raydl.consume.accounting import Accounting
from raydl.consume.formats import check_batch_format, format_batches
from raydl.consume.pool import WorkerPool
from raydl.consume.stats import IteratorStats
from raydl.errors import AccessDeniedError, BatchTimeoutError, DataSourceError, LoaderError, SampleDecodeError
from raydl.options import check_number, positive_int
from raydl.plan.loader_plan import LoaderPlan, Position
from raydl.plan.scheduling import WorkerInfo, batches_per_task, choose_worker, prefetch_depth
from raydl.plan.tasks import BatchResult, batch_rows
from raydl.plan.timeouts import batch_timeout

__all__ = ["DataIterator", "IteratorStats"]

_MAX_ATTEMPTS = 3  # per batch: the first run plus retries on replacement actors


class _Task(NamedTuple):
    """A task in flight: batches first, ..., first + count - 1 of the rank (its key in `_pending`)."""

    ref: Any  # ray.ObjectRef, or a Future for a batch made in this process
    worker: WorkerInfo
    attempt: int  # 0 the first time it runs, then 1, 2 on replacement actors
    count: int


class DataIterator:
    """Batches of one rank. Made by `Loader.iterator(rank)`: `DataIterator(plan, pool, rank)`."""

    def __init__(self, plan: LoaderPlan, pool: WorkerPool, rank: int) -> None:
        self._plan, self._pool, self._rank = plan, pool, rank
        self._config = plan.config
        self._position = Position(0, 0, 0)  # epoch, where its dealt order starts (elastic resume), next batch
        # the tasks in flight, by their first batch: each makes batches k, ..., k + n - 1 (see _Task)
        self._pending: dict[int, _Task] = {}
        self._made: dict[int, tuple[BatchResult, WorkerInfo]] = {}  # batches of a finished task, not yielded
        self._loads = 0  # load_state_dict() calls: an iteration under way goes on from the state loaded
        self._node = ray.get_runtime_context().get_node_id()
        self._stats = IteratorStats(rank=rank, unit=plan.sample_unit)
        self._accounting = Accounting(plan.policy, self._stats, rank)
        self._created = time.perf_counter()
        self._longest_wait_s: float | None = None  # for the default timeout; None until the first batch

    def __len__(self) -> int:
        """Batches per epoch for this rank (the same on every rank)."""
        epoch, start, _next = self._position
        return self._plan.batches_per_rank(epoch, start=start)

    # -- execution ----------------------------------------------------------------------
    def _submit(
        self, k: int, n: int, attempt: int = 0, avoid: WorkerInfo | None = None, *, node: bool = False
    ) -> None:
        """Send batches k, ..., k + n - 1 to a worker: one task, or one per batch where the runner makes
        one at a time (this process while the workers start, a pool whose workers have no run_batches).
        A retry avoids the worker it failed on (`avoid`) and, after that worker died (`node`), the other
        workers of its node, which a lost node takes with it, while workers elsewhere can run it."""
        workers = self._pool.runners()
        if avoid is not None:
            others = [w for w in workers if w.name != avoid.name]
            elsewhere = [w for w in others if w.node_id != avoid.node_id] if node else []
            workers = elsewhere or others or workers
        inflight: dict[str, int] = {}
        for pending in self._pending.values():
            inflight[pending.worker.name] = inflight.get(pending.worker.name, 0) + 1
        w = workers[choose_worker([(x.name, x.node_id) for x in workers], inflight, self._node)]
        epoch, start, _next = self._position
        group = None if w.in_process or n == 1 else getattr(w.handle, "run_batches", None)
        if group is None:
            for j in range(k, k + n):
                task = self._plan.task(self._rank, epoch, j, start=start)
                self._pending[j] = _Task(w.handle.run_batch.remote(task), w, attempt, 1)
            return
        tasks = self._plan.tasks(self._rank, epoch, k, n, start=start)
        self._pending[k] = _Task(group.remote(tasks), w, attempt, n)

    def _failed(
        self, k: int, worker: WorkerInfo, cause: BaseException, exc: BaseException, tries: int = 1
    ) -> NoReturn:
        """The worker raised while making batch k: not a sample it could skip. Name the rank and batch."""
        where = f"rank {self._rank}: batch {k} of epoch {self._position.epoch}"
        if isinstance(cause, SampleDecodeError):  # replace ran out of substitutes
            raise SampleDecodeError(f"{where}: {cause}", uri=cause.uri, sample_id=cause.sample_id) from exc
        if isinstance(cause, LoaderError):  # already names the sample and the worker
            raise LoaderError(f"{where}: {cause}") from exc
        what = f"{type(cause).__name__}: {cause}"
        if tries > 1:  # a read that failed, tried on other workers too
            raise LoaderError(f"{where} (tried {tries} times) failed on actor {worker.name}: {what}") from exc
        raise LoaderError(f"{where} failed on actor {worker.name}: {what}") from exc

    def _timeout_for_next(self, timeout_s: float | None) -> tuple[float, str]:
        """(seconds, why) the next batch may take: `timeout_s` as given, else plan/timeouts.py's default."""
        if timeout_s is not None:
            return timeout_s, "timeout_s"
        return batch_timeout(self._config.batch_timeout_s, self._longest_wait_s)

    def _get(self, k: int, timeout: tuple[float, str]) -> tuple[list[BatchResult], _Task]:
        """Wait for the task whose first batch is k (up to timeout[0] s each time it runs; inf: forever) and
        return its batches (fewer than it was sent for when one raised after the first: see
        LoaderWorker.run_batches) and the task; re-run it on another actor when its actor died. Failing to
        take a batch into this process (memory, a mapping) is this rank's error, never a reason to replace a
        worker."""
        wait = None if math.isinf(timeout[0]) else timeout[0]
        while True:
            task = self._pending[k]
            ref, worker, attempt, n = task
            if isinstance(ref, Future):  # made in this process while the workers start
                try:
                    return [ref.result(timeout=wait)], task
                except FutureTimeoutError as exc:
                    raise self._timeout(k, timeout, worker) from exc
                except Exception as exc:  # noqa: BLE001 - named by _failed
                    self._failed(k, worker, exc, exc)
            if not ray.is_initialized():  # ray.get would connect to a cluster again: say what happened
                raise LoaderError(
                    f"rank {self._rank}: Ray was shut down while batch {k} of epoch {self._position.epoch} "
                    "was on its way; build the loader again"
                )
            try:
                got = ray.get(ref, timeout=wait)
                return (got if n > 1 else [got]), task
            except ray.exceptions.GetTimeoutError as exc:
                raise self._timeout(k, timeout, worker) from exc
            except ray.exceptions.RayTaskError as exc:  # the worker raised: not a sample it could skip
                cause = exc.cause
                retry = isinstance(cause, DataSourceError) and not isinstance(
                    cause, (AccessDeniedError, SampleDecodeError)
                )
                if not retry or attempt + 1 >= _MAX_ATTEMPTS:
                    self._failed(k, worker, cause, exc, attempt + 1)
                # a read that failed (a store's error past its retries, a file that changed): once more,
                # on another worker
                self._stats.retries += 1
                del self._pending[k]
                self._submit(k, n, attempt + 1, worker)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                if attempt + 1 >= _MAX_ATTEMPTS:
                    raise LoaderError(
                        f"rank {self._rank}: batch {k} of epoch {self._position.epoch} failed {attempt + 1} "
                        f"times; last on actor {worker.name}: {exc}"
                    ) from exc
                self._pool.replace(worker)
                self._stats.retries += 1
                del self._pending[k]
                self._submit(k, n, attempt + 1, worker, node=True)
            except (MemoryError, OSError) as exc:
                raise LoaderError(
                    f"rank {self._rank}: batch {k} of epoch {self._position.epoch} from loader worker "
                    f"{worker.name} could not be taken into this process: {type(exc).__name__}: {exc}"
                ) from exc

    def _timeout(self, k: int, timeout: tuple[float, str], worker: WorkerInfo) -> BatchTimeoutError:
        seconds, why = timeout
        node = f"node {worker.node_id}" + (f" ({worker.node_ip})" if worker.node_ip else "")
        return BatchTimeoutError(
            f"rank {self._rank}: batch {k} of epoch {self._position.epoch} did not arrive within "
            f"{seconds:.3g} s ({why}) from loader worker {worker.name} on {node}; call iter_batches() again "
            "to keep waiting, or pass timeout_s= (float('inf') waits forever)",
            rank=self._rank,
            batch_index=k,
        )

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
        per_task = batches_per_task(
            self._plan.batch_bytes,
            depth=depth,
            budget_bytes=self._pool.object_store_budget,
            world_size=self._config.world_size,
        )
        depth = prefetch_depth(
            depth,
            batch_bytes=per_task * self._plan.batch_bytes,
            budget_bytes=self._pool.object_store_budget,
            world_size=self._config.world_size,
        )
        batches = self._epoch_batches(depth, per_task, timeout_s)
        if batch_format == "numpy" and collate_fn is None:
            return batches
        return format_batches(batches, batch_format, collate_fn)

    def _epoch_batches(self, depth: int, per_task: int, timeout_s: float | None) -> Iterator[dict[str, Any]]:
        """One epoch's batches: at most `depth` tasks in flight, each of up to `per_task` batches (the
        first of a call of one batch, the next ones twice as many as the one before, so that the first
        batch comes as soon as one batch is made)."""
        loads = self._loads
        epoch, start, k = self._position
        if k >= self._plan.batches_per_rank(epoch, start=start):  # the last call took the epoch's last batch
            self._next_epoch(epoch + 1)
        epoch, start, _k = self._position
        nb = self._plan.batches_per_rank(epoch, start=start)
        if self._position.next == 0 and self._rank == 0:
            self._accounting.unsized(self._plan.unsized)
        base_elapsed = self._stats.elapsed_s
        started = time.perf_counter()
        size = 1  # the next task's batches
        while True:
            if self._loads != loads:  # load_state_dict() while this iteration waited: go on from its state
                yield from self._epoch_batches(depth, per_task, timeout_s)
                return
            if self._position.next >= nb:
                break
            k = self._position.next
            j = max([k, *(i + t.count for i, t in self._pending.items()), *(i + 1 for i in self._made)])
            if len(self._pending) >= depth or j >= nb:
                self._pool.runners()  # a pool that can make no batch any more (shut down) says so now
            while len(self._pending) < depth and j < nb:
                n = min(size, nb - j)
                self._submit(j, n)
                j += n
                size = min(per_task, 2 * size)
            t0 = time.perf_counter()
            made = self._made.pop(k, None)
            try:
                if made is None:
                    results, task = self._get(k, self._timeout_for_next(timeout_s))
                    del self._pending[k]
                    made = (results[0], task.worker)
                    self._made.update((k + i, (r, task.worker)) for i, r in enumerate(results[1:], start=1))
                    if len(results) < task.count:  # the worker stopped at a batch that raised: send it alone
                        self._submit(k + len(results), task.count - len(results))
                result, worker = made
                self._pool.sync(result.membership)
                self._accounting.batch(result, k, epoch)
            except BaseException:
                if made is not None:  # not yielded: the next call takes batch k again (and says the same)
                    self._made[k] = made
                raise
            now = time.perf_counter()
            self._count(worker, now - t0, now)
            self._position = self._position._replace(next=k + 1)
            self._stats.batches += 1
            self._stats.samples_delivered += batch_rows(result.batch)
            self._stats.elapsed_s = base_elapsed + (now - started)
            yield result.batch
        self._next_epoch(epoch + 1)

    def _next_epoch(self, epoch: int) -> None:
        self._position = Position(epoch, 0, 0)
        self._stats.epoch = epoch

    def _count(self, worker: WorkerInfo, waited: float, now: float) -> None:
        """A batch arrived from `worker` after `waited` seconds."""
        self._stats.local_batches += worker.node_id == self._node
        self._stats.driver_batches += worker.in_process  # made by the Loader's own process (bootstrap)
        self._stats.wait_s += waited
        self._longest_wait_s = max(self._longest_wait_s or 0.0, waited)
        if self._stats.time_to_first_batch_s is None:
            self._stats.time_to_first_batch_s = now - self._created

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
        images = self._plan.image_fields
        return torch_batches(batches, device=device, dtypes=dtypes, pin_memory=pin_memory, images=images)

    # -- resume -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands, as plain JSON-serializable values.

        Load it into an iterator of a loader built the same way to continue the
        interrupted epoch exactly; at another world size, the rest of the epoch
        is re-dealt (every rank must have consumed the same number of batches).
        """
        return self._plan.state(rank=self._rank, position=self._position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (see state_dict). Mismatched data or seed is a ValueError. An iteration
        under way (an iter_batches() generator not run to its end) goes on from the state loaded: the rest
        of the state's epoch."""
        self._position = self._plan.check_state(state)
        self._loads += 1
        self._pending.clear()  # the batches in flight: their objects go once no reference is left
        self._made.clear()
        self._stats.epoch = self._position.epoch

    def stats(self) -> IteratorStats:
        """A snapshot of this rank's counters."""
        return replace(
            self._stats,
            skipped_uris=list(self._stats.skipped_uris),
            replaced_uris=list(self._stats.replaced_uris),
        )

    def __repr__(self) -> str:
        epoch, _start, k = self._position
        return f"DataIterator(rank={self._rank}, epoch={epoch}, next_batch={k}, batches={len(self)})"
