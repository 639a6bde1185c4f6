"""The loader worker: a plain class that turns a batch task into a batch.

Ray wiring (`ray.remote`, options, placement) is applied in raydl/loader.py.
A task names its samples and their augmentation seeds; the worker reads the
bytes and decodes/transforms each sample on its thread pool (IO, libjpeg-turbo
and the C kernel all release the GIL), each thread writing straight into the
sample's slot of one preallocated batch array. The returned arrays go into
Ray's object store as they are; a reader on the same node maps them without a
copy.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from raydl._process import process_name
from raydl.errors import DataSourceError
from raydl.memory import populated_empty
from raydl.storage import LocalStorage
from raydl.transforms import SampleProgram

__all__ = ["BatchResult", "BatchTask", "LoaderWorker", "WorkerSpec"]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs besides the catalog table."""

    storage: LocalStorage
    program: SampleProgram
    threads: int | None = None


@dataclass(frozen=True)
class BatchTask:
    """Batch `index` of `rank` in `epoch`: the samples, in order, and their seeds."""

    rank: int
    epoch: int
    index: int
    ids: np.ndarray
    seeds: np.ndarray


@dataclass(frozen=True)
class Skipped:
    sample_id: int
    uri: str
    reason: str


@dataclass
class BatchResult:
    """A finished batch, the samples that could not be decoded (left out of it),
    and the samples whose bytes could not be read at all (an error in every mode)."""

    batch: dict
    skipped: list[Skipped]
    unreadable: list[Skipped]


class LoaderWorker:
    """Runs batch tasks for any rank; between tasks it keeps only its decode pool and per-thread batch arrays."""

    def __init__(self, spec: WorkerSpec, table: pa.Table) -> None:
        self._spec = spec
        self._keys = table.column("key")
        self._labels = table.column("label").to_numpy()
        threads = spec.threads or len(os.sched_getaffinity(0))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raydl-decode")
        self._name = process_name()
        self._local = threading.local()

    def ready(self) -> dict:
        """Where this worker runs; the loader calls it to know the worker is up."""
        import ray

        return {"name": self._name, "node_id": ray.get_runtime_context().get_node_id(),
                "threads": self._pool._max_workers}

    def run_batch(self, task: BatchTask) -> BatchResult:
        program = self._spec.program
        n = len(task.ids)
        images = self._batch_buffer(n)
        keys = self._keys.take(pa.array(task.ids)).to_pylist()
        errors: list[str | None] = [None] * n
        unreadable: list[Skipped] = []

        def one(i: int) -> None:
            try:
                data = self._spec.storage.read(keys[i])
            except DataSourceError as exc:
                unreadable.append(Skipped(int(task.ids[i]), exc.uri or keys[i], str(exc)))
                errors[i] = str(exc)
                return
            try:
                program.run(data, int(task.seeds[i]), images[i])
            except Exception as exc:  # noqa: BLE001 - any decoder failure is this sample's fault
                errors[i] = f"{type(exc).__name__}: {exc}"

        list(self._pool.map(one, range(n)))
        ok = np.array([e is None for e in errors], dtype=bool)
        bad_read = {u.sample_id for u in unreadable}
        skipped = [
            Skipped(int(task.ids[i]), self._spec.storage.uri(keys[i]), errors[i])  # type: ignore[arg-type]
            for i in np.flatnonzero(~ok) if int(task.ids[i]) not in bad_read
        ]
        ids = task.ids.astype(np.int64, copy=False)
        if skipped:  # the batch gets shorter by the failed rows and keeps its place in the plan
            images, ids = images[ok], ids[ok]
            keys = [k for k, good in zip(keys, ok) if good]
        batch = {"image": images, "label": self._labels[ids], "id": ids, "key": keys}
        return BatchResult(batch=batch, skipped=skipped, unreadable=unreadable)

    def _batch_buffer(self, n: int) -> np.ndarray:
        """This thread's batch array, reused from its previous call.

        Fresh memory costs a page fault per 4 KiB on first touch - as much as
        the decode itself here, and serialized across threads. Reuse is safe:
        Ray copies a call's return value into the object store on the thread
        that ran the call, before that thread takes the next call.
        """
        program = self._spec.program
        shape = (n, *program.slot_shape())
        buf = getattr(self._local, "buffer", None)
        if buf is None or buf.shape[0] < n:
            buf = populated_empty(shape, program.dtype)
            self._local.buffer = buf
        return buf[:n]
