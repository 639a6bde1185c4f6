"""One member's rows of a batch made by its source at once (`Source.reads_batches`: token windows). No Ray.

The source reads the whole batch in one call on the IO pool (`Source.read_batch`: a few numpy calls over
memory maps and fetched ranges); there is nothing to decode and nothing per sample to settle. A read that
fails fails the batch (the iterator tries it again on another worker), since a window is a slice of files
that every other window shares. The user's `map_batches` stages run on the result; per-sample stages are
refused before any actor starts (raydl/execute/checks.py).
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from raydl.batch.member import MemberReader
from raydl.plan.tasks import BatchResult, BatchTask

__all__ = ["WholeBatchRun"]


class WholeBatchRun:
    """The same steps as BatchRun (`_start_fetches`, `_wait`, `_result`), for a source that reads batches."""

    def __init__(self, member: MemberReader, task: BatchTask) -> None:
        self._member, self._task = member, task
        self._storage = member.storage.scoped(behind=True)
        self._io_tasks: list[Future] = []
        self._decode_tasks: list[Future] = []

    def _start_fetches(self) -> None:
        m = self._member
        self._io_tasks.append(
            m.pools.io.submit(m.source.read_batch, m.catalog, self._storage, self._task.ids)
        )

    def _wait(self) -> None:
        self._io_tasks[0].result()

    def _result(self) -> BatchResult:
        batch = self._io_tasks[0].result()
        batch["id"] = np.asarray(self._task.ids, np.int64).copy()
        if self._member.spec.batch_stages:
            batch = self._member.batch_stages(batch, self._task)
        self._storage.flush()
        mine, shared = self._storage.take_cache_counts(), self._member.storage.take_cache_counts()
        return BatchResult(
            batch=batch, skipped=[], unreadable=[], replaced=[], cache={k: mine[k] + shared[k] for k in mine}
        )
