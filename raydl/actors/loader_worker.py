"""The loader worker: a plain class that turns a batch task into a batch.

Ray wiring (`ray.remote`, options, placement) is applied in raydl/loader.py.
A task names its samples and their augmentation seeds; the worker reads the
bytes and decodes/transforms each sample on its thread pool (IO, libjpeg-turbo
and the C kernel all release the GIL), each thread writing straight into the
sample's slot of one preallocated batch array. The returned arrays go into
Ray's object store as they are; a reader on the same node maps them without a
copy.

Error policy: a sample whose bytes cannot be read (DataSourceError) or
decoded (DecodeError) is this sample's fault, and on_error decides: it is left
out ("skip"), stands in for by a substitute drawn from its seed ("replace"),
or named to the trainer ("raise"). Anything else raised while making a sample
(a NativeKernelError, a MemoryError, a bug) fails the whole batch as a
LoaderError naming the sample and this worker: no mode hides it.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from raydl._process import process_name
from raydl.errors import DataSourceError, DecodeError, LoaderError, SampleDecodeError
from raydl.memory import populated_empty
from raydl.plan import substitute_id
from raydl.storage import LocalStorage
from raydl.transforms import SampleProgram

__all__ = ["BatchResult", "BatchTask", "LoaderWorker", "WorkerSpec"]

MAX_SUBSTITUTES = 8  # tries per failed sample under on_error="replace" before the batch fails


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs besides the catalog table."""

    storage: LocalStorage
    program: SampleProgram
    threads: int | None = None
    on_error: str = "skip"


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
    unreadable: bool = False  # the bytes could not be read, rather than decoded


@dataclass(frozen=True)
class Replaced:
    sample_id: int
    uri: str
    reason: str
    substitute_id: int


@dataclass
class BatchResult:
    """A finished batch; the samples that could not be decoded (left out of it); the
    samples whose bytes could not be read (an error unless replaced); the replaced ones."""

    batch: dict
    skipped: list[Skipped]
    unreadable: list[Skipped]
    replaced: list[Replaced] = field(default_factory=list)


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
        n = len(task.ids)
        images = self._batch_buffer(n)
        ids = task.ids.astype(np.int64, copy=True)  # substitutes are written into it
        keys = self._keys.take(pa.array(ids)).to_pylist()
        failed: list[Skipped | None] = [None] * n
        replaced: list[Replaced] = []
        replace = self._spec.on_error == "replace"

        def one(i: int) -> None:
            sid, seed = int(ids[i]), int(task.seeds[i])
            failure = self._sample(sid, keys[i], seed, images[i])
            if failure is not None and replace:
                ids[i] = self._substitute(failure, seed, images[i])
                keys[i] = self._keys[int(ids[i])].as_py()
                replaced.append(Replaced(sid, failure.uri, failure.reason, int(ids[i])))
            else:
                failed[i] = failure

        list(self._pool.map(one, range(n)))
        ok = np.array([f is None for f in failed], dtype=bool)
        bad = [f for f in failed if f is not None]
        if bad:  # the batch gets shorter by the failed rows (maybe to 0) and keeps its place in the plan
            images, ids = images[ok], ids[ok]
            keys = [k for k, good in zip(keys, ok) if good]
        batch = {"image": images, "label": self._labels[ids], "id": ids, "key": keys}
        return BatchResult(batch=batch, skipped=[f for f in bad if not f.unreadable],
                           unreadable=[f for f in bad if f.unreadable],
                           replaced=sorted(replaced, key=lambda r: r.sample_id))

    def _sample(self, sid: int, key: str, seed: int, out: np.ndarray) -> Skipped | None:
        """Read and decode one sample into `out`; a Skipped when its bytes are at fault, else None.

        Any other failure is not the sample's fault: it fails the batch, naming the sample and this worker.
        """
        uri = self._spec.storage.uri(key)
        try:
            data = self._spec.storage.read(key)
        except DataSourceError as exc:
            return Skipped(sid, exc.uri or uri, str(exc), unreadable=True)
        try:
            self._spec.program.run(data, seed, out)
        except DecodeError as exc:
            return Skipped(sid, uri, str(exc))
        except Exception as exc:  # noqa: BLE001 - named and re-raised: a kernel error or a bug is never skipped
            raise LoaderError(f"loader worker {self._name}: sample {sid} ({uri}) failed with "
                              f"{type(exc).__name__}: {exc} (not a decode error: on_error does not cover it)") from exc
        return None

    def _substitute(self, failure: Skipped, seed: int, out: np.ndarray) -> int:
        """on_error="replace": the first of the slot's substitutes (a pure function of its seed) that decodes."""
        n = len(self._keys)
        tried = []
        for attempt in range(MAX_SUBSTITUTES):
            sub = substitute_id(seed, attempt, n)
            if sub == failure.sample_id:
                continue
            tried.append(sub)
            if self._sample(sub, self._keys[sub].as_py(), seed, out) is None:
                return sub
        raise SampleDecodeError(
            f"sample {failure.sample_id} ({failure.uri}) failed ({failure.reason}) and none of its "
            f"substitutes {tried} could be decoded either; is most of the data bad?",
            uri=failure.uri, sample_id=failure.sample_id,
        )

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
