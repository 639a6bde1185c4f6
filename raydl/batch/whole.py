"""One member's rows of a batch made by its source at once (`Source.reads_batches`: token windows;
`Source.reads_plain_batches`: Parquet numbers and arrays with no per-sample stage). No Ray.

The source reads the whole batch in one call on the IO pool (`Source.read_batch`: a few numpy calls over
memory maps, fetched ranges and decoded row groups); nothing per sample is settled. For a token source a
read that fails fails the batch (the iterator tries it again on another worker), since a window is a slice
of files that every other window shares. For a source that also reads sample by sample, a read that fails
with a DataSourceError is made again as a BatchRun (`per_sample`), where on_error settles each sample. The
user's `map_batches` stages run on the result; per-sample stages are refused for a source that only reads
batches before any actor starts (raydl/execute/checks.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from raydl.batch.member import MemberReader
from raydl.errors import DataSourceError
from raydl.plan.tasks import BatchResult, BatchTask

__all__ = ["WholeBatchRun"]


class WholeBatchRun:
    """The same steps as BatchRun (`_start_fetches`, `_wait`, `_result`), for a source that reads batches."""

    def __init__(self, member: MemberReader, task: BatchTask, per_sample: Callable | None = None) -> None:
        self._member, self._task, self._per_sample = member, task, per_sample
        self._storage = member.storage.scoped(behind=True)
        self._own_io: list[Future] = []
        self._fallback = None  # the BatchRun that reads the batch sample by sample, once read_batch failed

    @property
    def _io_tasks(self) -> list[Future]:
        return self._own_io + (self._fallback._io_tasks if self._fallback is not None else [])

    @property
    def _decode_tasks(self) -> list[Future]:
        return self._fallback._decode_tasks if self._fallback is not None else []

    def _start_fetches(self) -> None:
        m, task = self._member, self._task
        args = [m.catalog, self._storage, task.ids]
        if task.ahead is not None and m.source.reads_ahead:
            args.append(task.ahead)
        self._own_io.append(m.pools.io.submit(m.source.read_batch, *args))

    def _wait(self) -> None:
        try:
            self._own_io[0].result()
        except DataSourceError:
            if self._per_sample is None:
                raise
            self._storage.flush()
            self._fallback = self._per_sample()
            self._fallback._start_fetches()
            self._fallback._wait()

    def _result(self) -> BatchResult:
        if self._fallback is not None:
            result = self._fallback._result()
            mine = self._storage.take_cache_counts()  # the failed read's own reads
            return (
                dataclasses.replace(result, cache={k: result.cache.get(k, 0) + mine[k] for k in mine})
                if mine
                else result
            )
        batch = self._own_io[0].result()
        batch["id"] = np.asarray(self._task.ids, np.int64).copy()
        if self._member.spec.batch_stages:
            batch = self._member.batch_stages(batch, self._task)
        self._storage.flush()
        mine, shared = self._storage.take_cache_counts(), self._member.storage.take_cache_counts()
        return BatchResult(
            batch=batch, skipped=[], unreadable=[], replaced=[], cache={k: mine[k] + shared[k] for k in mine}
        )
