"""The loader worker: a plain class that turns a batch task into a batch.

Ray wiring (`ray.remote`, options, placement) is applied in raydl/execute/cluster.py.
A task names its samples and their augmentation seeds. The worker turns the
samples into byte ranges (catalog rows: shard, offset, length), coalesces
neighbouring ranges into blocks, and fetches the blocks on its IO pool
(`io_concurrency` threads: many for S3, a few for disk; several blocks per IO
task when a batch has many, as an image folder's one-file blocks). As each
block lands, its samples are cut out and queued for the decode pool, so IO and
decode overlap within a batch; decode threads take the queued samples a chunk
at a time, decode a chunk's JPEGs in one native call (libjpeg-turbo and the C
kernel, the GIL released once per chunk) and write straight into each
sample's slot of one preallocated batch array.
The returned arrays go into Ray's object store as they are; a reader on the
same node maps them without a copy.

Error policy: a sample whose bytes cannot be read (DataSourceError) or
decoded (DecodeError) is this sample's fault, and the on_error policy
(raydl/plan/failures.py, ErrorPolicy) decides what becomes of it. Where it says
"replace", the worker puts a substitute drawn from the slot's seed in its place;
any other failed sample is left out of the batch and recorded in the result,
for the iterator to skip or raise as the same policy says. Anything else raised
while making a sample (a NativeKernelError, a MemoryError, a bug) fails the
whole batch as a LoaderError naming the sample and this worker: no mode hides it.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import numpy as np

from raydl.describe.catalog import Catalog
from raydl.describe.transforms import SampleProgram
from raydl.errors import DataSourceError
from raydl.plan.failures import ErrorPolicy, Failure, Replaced
from raydl.plan.order import substitute_id
from raydl.plan.tasks import BatchResult, BatchTask
from raydl.storage.base import ObjectInfo
from raydl.storage.fetch import Block, IOPool, coalesce
from raydl.util.arrow import StringColumn, int_column
from raydl.util.memory import populated_empty
from raydl.util.process import process_name

__all__ = ["BatchResult", "BatchTask", "LoaderWorker", "WorkerSpec"]

MAX_SUBSTITUTES = 8  # tries per failed sample under on_error="replace" before the batch fails
IO_TASKS_PER_THREAD = 4  # a batch's blocks go to this many IO tasks per IO thread (fewer when there are few)
# Samples a decode thread takes at once (one native call); fewer as the batch's queue drains.
DECODE_CHUNK = 16


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs besides the catalog (which comes through the object store)."""

    program: SampleProgram
    threads: int | None = None
    on_error: str = "skip"
    io_concurrency: int | None = None  # None: the storage's default

    @property
    def policy(self) -> ErrorPolicy:
        """What becomes of a failed sample under `on_error`."""
        return ErrorPolicy(self.on_error)


class LoaderWorker:
    """Runs batch tasks for any rank; between tasks it keeps only its decode pool and per-thread batch arrays."""

    def __init__(
        self,
        spec: WorkerSpec,
        catalog: Catalog,
        threads: int | None = None,
        *,
        reuse_buffers: bool = True,
        handoff: bool = False,
    ) -> None:
        self._spec = spec
        # reuse_buffers: a buffer is reused once Ray has copied the BatchResult out (it drops the result).
        # handoff: the batch is handed to the caller as it is (made in the driver, not through Ray); its
        # buffer is reused once every array viewing the images is gone. Neither: a fresh buffer per batch.
        self._handoff = handoff
        self._reuse = reuse_buffers and not handoff
        self._source, self._storage = catalog.source, catalog.storage
        t = catalog.table
        self._where = np.stack(
            [int_column(t.column(c)) for c in ("shard", "offset", "length", "row")], axis=1
        )
        self._keys = StringColumn(t.column("key"))  # read through numpy: Arrow's take would import pandas
        self._labels = int_column(t.column("label"))
        self._shard_uris = StringColumn(catalog.shards.column("uri"))
        self._shard_etags = StringColumn(catalog.shards.column("etag"))
        self._shard_sizes = int_column(catalog.shards.column("size"))
        threads = threads or spec.threads or len(os.sched_getaffinity(0))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raydl-decode")
        self._io = IOPool(spec.io_concurrency or catalog.storage.default_io_concurrency)
        self._name = process_name()
        self._free_lock = threading.Lock()
        self._free: list[np.ndarray] = []  # batch buffers not in use
        self._dropped = False  # drop_buffers() was called
        self._buffers: list[np.ndarray] = []  # every batch buffer made, for memory()
        self._membership = 0

    def set_membership(self, version: int) -> None:
        """The coordinator's worker list changed (a worker joined, died or was replaced)."""
        self._membership = max(self._membership, version)

    def ready(self) -> dict:
        """Where this worker runs; the loader calls it to know the worker is up."""
        import ray

        return {
            "name": self._name,
            "node_id": ray.get_runtime_context().get_node_id(),
            "threads": self._pool._max_workers,
            "io_concurrency": self._io.concurrency,
            "torch_imported": "torch" in sys.modules,
            "pandas_imported": "pandas" in sys.modules,
        }

    def memory(self) -> dict:
        """Bytes this worker holds between batches: its reused batch buffers (one per batch call in flight)
        and the catalog columns it keeps (the table itself is a view of the object store)."""
        return {
            "batch_arrays": sum(b.nbytes for b in self._buffers),
            "batch_arrays_count": len(self._buffers),
            "catalog_columns": self._labels.nbytes + self._where.nbytes,
        }

    def thread_ids(self) -> list[int]:
        """Native ids of the decode and IO threads started so far (to set their priority)."""
        pools = (self._pool, self._io._pool)
        return [t.native_id for pool in pools for t in list(pool._threads) if t.native_id is not None]

    def run_batch(self, task: BatchTask) -> BatchResult:
        n = len(task.ids)
        dtype = self._spec.program.dtype
        shape = (n, *self._spec.program.slot_shape(task.bucket))  # aspect buckets: the shape varies per batch
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self._lease(nbytes)
        flat = buf[:nbytes]
        if self._handoff:
            # The images' own base, made per batch: views of them (the caller's, torch's) keep it alive, and
            # its buffer goes back to the free list when the last one is gone, never while one can read it.
            lease = (ctypes.c_ubyte * nbytes).from_buffer(buf)
            weakref.finalize(lease, self._release, buf)
            flat = np.frombuffer(lease, np.uint8)
            del lease
        try:
            result = self._run(task, flat.view(dtype).reshape(shape))
        except BaseException:
            if self._reuse:
                self._release(buf)
            raise
        if self._reuse:  # back to the free list once Ray has copied the result out
            weakref.finalize(result, self._release, buf)
        return result

    def _run(self, task: BatchTask, images: np.ndarray) -> BatchResult:
        n = len(task.ids)
        ids = task.ids.astype(np.int64, copy=True)  # substitutes are written into it
        keys = self._keys.take(ids)
        where = self._where[ids]
        shard_ids = np.unique(where[:, 0])
        shards = dict(zip(shard_ids.tolist(), self._shard_infos(shard_ids)))
        failed: list[Failure | None] = [None] * n
        replaced: list[Replaced] = []
        policy = self._spec.policy
        submitted: list[
            Future
        ] = []  # every decode-pool task of this batch (a failed batch waits for them all)

        def submit(fn, *args) -> None:
            future = self._pool.submit(fn, *args)
            submitted.append(future)

        def finish(i: int, failure: Failure | None) -> None:
            if failure is not None and policy.action(failure) == "replace":
                sid, seed = int(task.ids[i]), int(task.seeds[i])
                ids[i] = self._substitute(failure, seed, images[i])
                keys[i] = self._keys[int(ids[i])]
                replaced.append(Replaced(sid, failure.uri, failure.reason, int(ids[i])))
            else:
                failed[i] = failure

        def uri(i: int) -> str:
            return self._source.sample_uri(shards[int(where[i, 0])].uri, keys[i])

        # Samples whose bytes are in, waiting for a decode thread. A drain task takes them a chunk at a time
        # and decodes a chunk in one native call; at most `threads` drains of this batch run or wait at once.
        ready: deque[tuple[int, bytes]] = deque()
        lock = threading.Lock()
        drains = [0]  # drain tasks of this batch submitted and not yet finished
        stop = threading.Event()  # a drain failed, so the batch fails: no more reading or decoding for it
        threads = self._pool._max_workers

        def drain() -> None:
            try:
                while True:
                    with lock:
                        if not ready:
                            drains[0] -= 1
                            return
                        take = min(len(ready), DECODE_CHUNK, -(-len(ready) // threads))
                        chunk = [ready.popleft() for _ in range(take)]
                    for (i, _), err in zip(
                        chunk,
                        self._spec.program.run_many(
                            [(data, int(task.seeds[i]), images[i]) for i, data in chunk]
                        ),
                    ):
                        sid = int(task.ids[i])
                        finish(
                            i,
                            None
                            if err is None
                            else Failure.decode_failed(sid, uri(i), err, worker=self._name),
                        )
            except BaseException:
                with lock:
                    drains[0] -= 1
                    stop.set()
                    ready.clear()
                raise

        def decode(samples: list[tuple[int, bytes]]) -> None:
            """Queue the samples for the decode threads; start a drain task if fewer than `threads` are on it."""
            with lock:
                if stop.is_set():
                    return
                ready.extend(samples)
                if drains[0] >= threads:
                    return
                drains[0] += 1
            submit(drain)

        def fetch(block: Block) -> None:
            """Read one block (on an IO thread), then queue its samples for the decode threads."""
            shard = shards[block.shard]
            uri = shard.uri
            try:
                data = self._source.read_block(self._storage, shard, block.offset, block.length)
            except DataSourceError as exc:
                for i in block.members:
                    submit(finish, i, Failure.read_failed(int(task.ids[i]), uri, exc))
                return
            samples = []
            for i in block.members:
                shard, offset, length, row = (int(v) for v in where[i])
                start = offset - block.offset
                piece = data if (start == 0 and length == len(data)) else data[start : start + length]
                try:
                    samples.append((i, self._source.cut(shard, offset, length, row, piece)))
                except DataSourceError as exc:
                    submit(finish, i, Failure.read_failed(int(task.ids[i]), uri, exc))
            decode(samples)

        def fetch_all(blocks: list[Block]) -> None:
            for block in blocks:
                if stop.is_set():
                    return
                fetch(block)

        # Several blocks per IO task, each handed to the decode threads as it lands: an image folder has one
        # block per file, and a task (and a thread wake-up) per file cost more CPU than reading it. There are
        # still IO_TASKS_PER_THREAD tasks per IO thread to spread the requests over.
        blocks = coalesce(where[:, :3].tolist())
        per = max(1, len(blocks) // (IO_TASKS_PER_THREAD * self._io.concurrency))
        io: list[Future] = []
        try:
            for k in range(0, len(blocks), per):
                io.append(self._io.submit(fetch_all, blocks[k : k + per]))
            for done in as_completed(io):
                done.result()
            for f in submitted:  # complete: only the IO tasks, all done now, submit decode tasks
                f.result()  # a LoaderError (not the sample's fault) fails the batch here
        except BaseException:
            # The batch fails and its buffer goes back to the pool: none of its tasks may still be writing there.
            futures_wait(io)
            futures_wait(list(submitted))
            raise
        ok = np.array([f is None for f in failed], dtype=bool)
        bad = [f for f in failed if f is not None]
        if bad:  # the batch gets shorter by the failed rows (maybe to 0) and keeps its place in the plan
            images, ids = images[ok], ids[ok]
            keys = [k for k, good in zip(keys, ok) if good]
        batch = {"image": images, "label": self._labels[ids], "id": ids, "key": keys}
        if task.bucket is not None:
            batch["bucket"] = tuple(task.bucket)
        return BatchResult(
            batch=batch,
            skipped=[f for f in bad if not f.unreadable],
            unreadable=[f for f in bad if f.unreadable],
            replaced=sorted(replaced, key=lambda r: r.sample_id),
            membership=self._membership,
        )

    def _shard_infos(self, shard_ids: np.ndarray) -> list[ObjectInfo]:
        return [
            ObjectInfo(self._shard_uris[i], int(self._shard_sizes[i]), self._shard_etags[i])
            for i in shard_ids.tolist()
        ]

    def _read(self, sid: int) -> tuple[str, bytes]:
        """One sample's URI (as errors name it) and image bytes, read on its own (substitutes)."""
        shard, offset, length, row = (int(v) for v in self._where[sid])
        (info,) = self._shard_infos(np.array([shard]))
        data = self._source.read_block(self._storage, info, offset, length)
        return self._source.sample_uri(info.uri, self._keys[sid]), self._source.cut(
            shard, offset, length, row, data
        )

    def _sample(self, sid: int, seed: int, out: np.ndarray) -> Failure | None:
        """Read and decode one sample into `out`; a Failure when its bytes are at fault, else None."""
        try:
            uri, data = self._read(sid)
        except DataSourceError as exc:
            return Failure.read_failed(sid, self._shard_infos(self._where[sid : sid + 1, 0])[0].uri, exc)
        return self._decode(sid, uri, data, seed, out)

    def _decode(self, sid: int, uri: str, data: bytes, seed: int, out: np.ndarray) -> Failure | None:
        """Decode one sample into `out`; a Failure when its bytes are at fault, else None.

        Any other failure is not the sample's fault: it fails the batch, naming the sample and this worker.
        """
        try:
            self._spec.program.run(data, seed, out)
        except Exception as exc:  # noqa: BLE001 - Failure.decode_failed lets only a DecodeError through
            return Failure.decode_failed(sid, uri, exc, worker=self._name)
        return None

    def _substitute(self, failure: Failure, seed: int, out: np.ndarray) -> int:
        """on_error="replace": the first of the slot's substitutes (a pure function of its seed) that decodes."""
        n = len(self._keys)
        tried = []
        for attempt in range(MAX_SUBSTITUTES):
            sub = substitute_id(seed, attempt, n)
            if sub == failure.sample_id:
                continue
            tried.append(sub)
            if self._sample(sub, seed, out) is None:
                return sub
        raise self._spec.policy.no_substitute(failure, tried)

    def _lease(self, nbytes: int) -> np.ndarray:
        """A flat batch buffer of at least `nbytes` from the free list, or a new one.

        Fresh memory costs a page fault per 4 KiB on first touch - as much as
        the decode itself here, and serialized across threads - so buffers are
        reused; flat, they serve every batch shape (aspect buckets change it
        from batch to batch). A buffer goes back to the free list when the
        BatchResult that holds it is dropped, which Ray does once it has copied
        the result into the object store; so there are as many buffers as batch
        calls in flight at once, not one per Ray call thread.
        """
        with self._free_lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        buf = populated_empty((nbytes,), np.uint8)
        if self._reuse:
            with self._free_lock:
                self._buffers.append(buf)
        return buf

    def _release(self, buf: np.ndarray) -> None:
        with self._free_lock:
            # Handed-off buffers: at most one waits for the next batch (the caller's and the batches in
            # flight hold the rest), so the pool adds at most one batch of memory, and none after drop_buffers().
            if self._handoff and self._dropped:
                return
            if self._handoff and self._free:
                if buf.nbytes > self._free[0].nbytes:  # keep the larger: bucket batches vary in size
                    self._free[0] = buf
                return
            self._free.append(buf)

    def drop_buffers(self) -> None:
        """Free the buffers kept for reuse now, and keep none from here on (the Loader's bootstrap, done)."""
        with self._free_lock:
            self._dropped = True
            self._free.clear()
