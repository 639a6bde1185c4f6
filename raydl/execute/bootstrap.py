"""The Loader's own process makes the first batches while its workers start (the bootstrap).

Ray takes seconds to start worker processes; a Loader whose node may host
workers makes batches itself until the first worker is up, with the same
BatchMaker code as the workers (so the same pixels), one batch at a time, in plan order.
Its batches are handed to the caller as they are, with no copy into the object
store. After the first batch its threads drop to Ray's worker niceness, so the
worker processes starting beside them are not starved.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from raydl.batch.maker import BatchMaker
from raydl.batch.spec import MixtureSpec
from raydl.describe.catalog import Catalog
from raydl.env import ray_worker_niceness
from raydl.plan.scheduling import WorkerInfo
from raydl.util.process import process_name

__all__ = ["Bootstrap", "renice"]


class Bootstrap:
    """Makes batches in the Loader's own process while its workers start (one batch at a time, in order).

    Its `info` is a WorkerInfo like a worker's (`in_process`): `info.handle.run_batch.remote(task)` gives a
    Future of the batch, as an actor's gives an ObjectRef.
    """

    def __init__(
        self,
        spec: MixtureSpec,
        catalogs: tuple[Catalog, ...],
        threads: int,
        node_id: str,
        *,
        on_first: Callable[[], None],
    ) -> None:
        self._spec, self._catalogs, self._threads = spec, catalogs, threads
        self._worker: BatchMaker | None = None
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="raydl-bootstrap")
        self._on_first = on_first  # called when the first batch is done (or failed)
        self.busy = False  # a batch was asked for and the first is not done yet
        self.first_task: tuple[float, float] | None = None  # perf_counter at the first batch's start and end
        self._taken = threading.Event()  # the caller has the first batch in hand
        import ray

        name = f"{process_name()} (this process, while the workers start)"
        self.run_batch = _Submit(self.submit)
        self.info = WorkerInfo(self, node_id, name, ray.util.get_node_ip_address(), in_process=True)

    def submit(self, task) -> Future:
        self.busy = True
        out = _Handed(self._taken)
        inner = self._exec.submit(self._run, task)
        inner.add_done_callback(out.copy)
        return out

    def _run(self, task):
        first = self._worker is None
        if not first:
            # The second batch starts once the caller has the first in hand: its set-up (planning the
            # reads, queueing them) holds the GIL that the hand-over waits for, 40-60 ms of it measured
            # on 2 cores (docs/benchmarks.md, "Start-up, first batch and short epochs"); bounded, should the
            # caller never take it.
            self._taken.wait(_HAND_OVER_WAIT_S)
        started = time.perf_counter()
        try:
            if first:
                # The caller gets the arrays as they are, with no copy into the object store; a batch's
                # buffer is reused once the caller has dropped it (fresh memory costs a page fault per 4 KiB).
                self._worker = BatchMaker(self._spec, self._catalogs, self._threads, handoff=True)
            result = self._worker.run_batch(task)
        finally:
            if first:
                self.first_task = (started, time.perf_counter())
                self._on_first()
                # From the second batch on, the worker processes starting now must not be starved: Ray
                # starts them at niceness 15 (RAY_worker_niceness), and this process's loader threads
                # take the same from here.
                renice([threading.get_native_id(), *self._worker.thread_ids()], ray_worker_niceness())
        for value in result.batch.values():  # read-only, like the object store's batches
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        return result

    def drop_spare(self) -> None:
        """A worker is up, so no batch is asked of this process any more: free the buffer it keeps for its
        next batch now (one batch of memory, 147 MiB at batch 256 of 224 x 224 float32), not when the
        coordinator takes the workers over (`close`). The batches it made stay valid while they are held."""
        if self._worker is not None:
            self._worker.drop_buffers()

    def close(self) -> None:
        self._exec.shutdown(wait=False)  # batches already asked for still finish
        if self._worker is not None:  # the buffer kept for the next batch: there is none
            self._worker.drop_buffers()


_HAND_OVER_WAIT_S = 0.25


class _Submit:
    """`run_batch.remote(task)`, as on an actor handle, for batches made in this process."""

    def __init__(self, submit: Callable) -> None:
        self.remote = submit


class _Handed(Future):
    """A bootstrap batch's future: the executor's result copied in, and `taken` set once the caller has it."""

    def __init__(self, taken: threading.Event) -> None:
        super().__init__()
        self._taken_event = taken

    def copy(self, inner: Future) -> None:
        if inner.cancelled():
            self.cancel()
            self.set_running_or_notify_cancel()
            return
        exc = inner.exception()
        if exc is None:
            self.set_result(inner.result())
        else:
            self.set_exception(exc)

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        finally:
            if self.done():
                self._taken_event.set()


def renice(thread_ids: list[int], niceness: int) -> None:
    """Lower these threads of this process to `niceness` (Linux: priority is per thread); never raise it."""
    for tid in thread_ids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except (AttributeError, OSError):  # not Linux, or the thread is gone
            pass
