"""The loader worker: a plain class that turns a batch task into a batch.

Ray wiring (`ray.remote`, options, placement) is applied in raydl/execute/cluster.py.
A task names its samples and their augmentation seeds. The worker asks the
catalog's source where the samples are (`Source.locate`: byte ranges of
shards, loading a shard's index block where the source keeps one), coalesces
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

Each batch is one `_BatchRun`, whose steps are named: fetch (an IO task reads
blocks and cuts their samples out), enqueue (queue them, start a drain),
drain (a decode task: a chunk per native call), finish (settle each sample).

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
import dataclasses
import math
import os
import queue
import sys
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import numpy as np

from raydl.describe.catalog import Catalog
from raydl.describe.fields import Field
from raydl.describe.records import Pad, decoded_fields, pad_record, stage_rng, wants_rng
from raydl.describe.transforms import SampleProgram
from raydl.errors import DataSourceError, DecodeError, LoaderError
from raydl.execute.collate import collate, infer_field
from raydl.execute.mixer import Mixer, MixSpec
from raydl.options import Cache
from raydl.plan.failures import ErrorPolicy, Failure, Replaced
from raydl.plan.order import substitute_id
from raydl.plan.tasks import BatchResult, BatchTask, batch_rows
from raydl.storage.base import ObjectInfo
from raydl.storage.cache import CachedStorage, node_cache, wants_cache
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

    program: SampleProgram | None  # None: no .decode(); image fields come out as their bytes
    threads: int | None = None
    on_error: str = "skip"
    io_concurrency: int | None = None  # None: the storage's default
    max_sample_bytes: int = 256 << 20  # LoaderConfig.max_sample_bytes
    sample_stages: tuple = ()  # the user's per-sample Python stages (map, pad), after the native ones
    batch_stages: tuple = ()  # the user's map_batches stages, on the finished numpy batch
    cache: Cache | None = None  # LoaderConfig.cache: remote reads go through this node's cache

    @property
    def policy(self) -> ErrorPolicy:
        """What becomes of a failed sample under `on_error`."""
        return ErrorPolicy(self.on_error)


class LoaderWorker:
    """Runs batch tasks for any rank; between tasks it keeps only its decode pool and per-thread batch
    arrays."""

    def __init__(
        self,
        spec: WorkerSpec | MixSpec,
        catalog: Catalog | tuple[Catalog, ...],
        threads: int | None = None,
        *,
        reuse_buffers: bool = True,
        handoff: bool = False,
        pools: tuple | None = None,
    ) -> None:
        mix = None
        if isinstance(spec, MixSpec):  # a mix: this worker is its first source's part, and holds the others
            mix, catalogs = spec, tuple(catalog)
            spec, catalog = mix.parts[0], catalogs[0]
        self._spec = spec
        # reuse_buffers: a buffer is reused once Ray has copied the BatchResult out (it drops the result).
        # handoff: the batch is handed to the caller as it is (made in the driver, not through Ray); its
        # buffer is reused once every array viewing the images is gone. Neither: a fresh buffer per batch.
        self._handoff = handoff
        self._reuse = reuse_buffers and not handoff
        if spec.cache is not None and wants_cache(catalog.storage):
            # Every read of the catalog's store (the sources' footers and index blocks too) goes through the
            # node cache; a batch's own reads get counters of their own (_BatchRun).
            cached = CachedStorage(catalog.storage, node_cache(spec.cache.path, spec.cache.max_bytes))
            catalog = dataclasses.replace(catalog, storage=cached)
        self._catalog = catalog
        self._source, self._storage = catalog.source, catalog.storage
        self._num_samples = len(catalog)
        self._image_fields = [f for f in self._source.fields if f.kind == "image"]
        self._decoded = decoded_fields(spec.program, self._source.fields)  # (field, is_mask), decoded
        self._shard_uris = StringColumn(catalog.shards.column("uri"))
        self._shard_etags = StringColumn(catalog.shards.column("etag"))
        self._shard_sizes = int_column(catalog.shards.column("size"))
        threads = threads or spec.threads or len(os.sched_getaffinity(0))
        if pools is not None:  # another source's part of a mix: that worker's pools
            self._pool, self._io = pools
        else:
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raydl-decode")
            self._io = IOPool(spec.io_concurrency or catalog.storage.default_io_concurrency)
        self._name = process_name()
        self._free_lock = threading.Lock()
        self._free: list[np.ndarray] = []  # batch buffers not in use
        self._returned: queue.SimpleQueue = queue.SimpleQueue()  # given back while _free_lock was held
        self._dropped = False  # drop_buffers() was called
        self._buffers: list[np.ndarray] = []  # every batch buffer made, for memory()
        self._membership = 0
        self._mixer = None
        if mix is not None:
            others = [
                LoaderWorker(sp, cat, threads, reuse_buffers=False, pools=(self._pool, self._io))
                for sp, cat in zip(mix.parts[1:], catalogs[1:])
            ]
            self._mixer = Mixer(mix, [self, *others])

    def set_membership(self, version: int) -> None:
        """The coordinator's worker list changed (a worker joined, died or was replaced)."""
        self._membership = max(self._membership, version)
        for part in self._mixer.parts[1:] if self._mixer is not None else ():
            part.set_membership(version)

    def ready(self) -> dict:
        """Where this worker runs; the loader calls it to know the worker is up."""
        import ray

        return {
            "name": self._name,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
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
            "catalog_columns": self._catalog.nbytes,
        }

    def thread_ids(self) -> list[int]:
        """Native ids of the decode and IO threads started so far (to set their priority)."""
        pools = (self._pool, self._io._pool)
        return [t.native_id for pool in pools for t in list(pool._threads) if t.native_id is not None]

    def run_batch(self, task: BatchTask) -> BatchResult:
        """Make the batch `task` names; its arrays go into Ray's object store as they are."""
        n = len(task.ids)
        # One flat buffer holds every decoded image field of the batch (aspect buckets: the shapes vary per
        # batch); each field's array is a view of it, 64-byte aligned.
        layout, nbytes = [], 0
        maker = self if self._mixer is None else self._mixer.maker(task)  # per_source: the batch's source
        for name, _mask, dtype, slot in maker._outputs(task.bucket):
            size = math.prod((n, *slot)) * dtype.itemsize
            layout.append((name, dtype, (n, *slot), nbytes, size))
            nbytes += -(-size // 64) * 64
        buf = self._lease(max(nbytes, 1))
        flat = buf[: max(nbytes, 1)]
        if self._handoff:
            # The images' own base, made per batch: views of them (the caller's, torch's) keep it alive, and
            # its buffer goes back to the free list when the last one is gone, never while one can read it.
            lease = (ctypes.c_ubyte * len(flat)).from_buffer(buf)
            weakref.finalize(lease, self._release, buf)
            flat = np.frombuffer(lease, np.uint8)
            del lease
        try:
            result = self._run_into(task, flat, layout)
        except BaseException:
            if self._reuse:
                self._release(buf)
            raise
        if self._reuse:  # back to the free list once Ray has copied the result out
            weakref.finalize(result, self._release, buf)
        return result

    def _run_into(self, task: BatchTask, flat: np.ndarray, layout: list) -> BatchResult:
        """The batch of `task` made with its image fields in `flat` (at the places `layout` gives)."""
        images = {
            name: flat[at : at + size].view(dtype).reshape(shape) for name, dtype, shape, at, size in layout
        }
        if self._mixer is not None:
            return self._mixer.run(task, images, _run_together)
        (result,) = _run_together([(self, task, images)])
        return result

    def _outputs(self, bucket: tuple[int, int] | None) -> list[tuple[str, bool, np.dtype, tuple[int, ...]]]:
        """(field, is_mask, dtype, one sample's shape) of each image field the program decodes."""
        program = self._spec.program
        out = []
        for name, is_mask in self._decoded:
            dtype = np.dtype(np.uint8) if is_mask else program.dtype
            slot = program.slot_shape(bucket, mask=True) if is_mask else program.slot_shape(bucket)
            out.append((name, is_mask, dtype, tuple(slot)))
        return out

    def _shard_infos(self, shard_ids: np.ndarray) -> list[ObjectInfo]:
        return [
            ObjectInfo(self._shard_uris[i], int(self._shard_sizes[i]), self._shard_etags[i])
            for i in shard_ids.tolist()
        ]

    def _sample(self, sid: int, seed: int, slots: dict[str, np.ndarray]) -> tuple[Failure | None, str, dict]:
        """Locate, read and decode one sample on its own (a substitute) into `slots` (its decoded image
        fields' slots): (a Failure when its bytes are at fault, else None; its key; its other fields'
        values)."""
        loc = self._source.locate(self._catalog, np.array([sid], np.int64))
        (info,) = self._shard_infos(loc.shard[:1])
        key = loc.key[0]
        if 0 in loc.errors:
            return Failure.read_failed(sid, info.uri, loc.errors[0]), key, {}
        uri = self._source.sample_uri(info.uri, key)
        if self._source.range_is_sample:
            size = int((loc.size if loc.size is not None else loc.length)[0])
            big = self._too_big(sid, uri, size)
            if big is not None:
                return big, key, {}
        try:
            data = self._source.read_block(self._storage, info, int(loc.offset[0]), int(loc.length[0]))
            record = self._source.cut(loc, 0, data)
        except DataSourceError as exc:
            return Failure.read_failed(sid, info.uri, exc), key, {}
        except DecodeError as exc:
            return Failure.decode_failed(sid, uri, exc, worker=self._name), key, {}
        big = self._too_big(sid, uri, self.image_bytes(record))
        if big is not None:
            return big, key, {}
        ((failure, values),) = self.make_samples([(sid, uri, record, seed, slots)])
        return failure, key, values

    def image_bytes(self, record: dict) -> int:
        """The bytes of a record's encoded images (what max_sample_bytes bounds)."""
        return sum(len(record[f.name]) for f in self._image_fields if isinstance(record.get(f.name), bytes))

    def _too_big(self, sid: int, uri: str, size: int) -> Failure | None:
        """A Failure (under on_error, as a decode error) when the sample is over max_sample_bytes."""
        limit = self._spec.max_sample_bytes
        if size <= limit:
            return None
        error = DecodeError(f"{uri} is {size} bytes, more than max_sample_bytes ({limit}); it is not decoded")
        return Failure.decode_failed(sid, uri, error, worker=self._name)

    def make_samples(
        self, items: list[tuple[int, str, dict, int, dict[str, np.ndarray]]]
    ) -> list[tuple[Failure | None, dict]]:
        """Decode each (id, uri, record, seed, slots) sample's image fields into its slots, in one native call
        for the JPEGs, then run the per-sample Python stages: per sample (a Failure when its bytes are at
        fault, else None; its record without the decoded fields, or the whole record the Python stages
        returned).

        A Python stage that raises fails the whole batch (a LoaderError naming the sample and this worker,
        with the traceback): it is a bug, not bad data, so on_error never covers it. So does any error of
        the native stages that is not a DecodeError.
        """
        program, decoded = self._spec.program, self._decoded
        errors: list[Exception | None] = [None] * len(items)
        if decoded:
            runs, owners, masks = [], [], []
            for k, (_sid, _uri, record, seed, slots) in enumerate(items):
                try:
                    ref = program.image_size(record[decoded[0][0]]) if len(decoded) > 1 else None
                except Exception as exc:  # noqa: BLE001 - settled below as the sample's (a DecodeError) or not
                    errors[k] = exc
                    continue
                for name, is_mask in decoded:
                    if is_mask:
                        masks.append((k, record[name], seed, slots[name], ref))
                    else:
                        runs.append(
                            (record[name], seed, slots[name])
                            if ref is None
                            else (record[name], seed, slots[name], ref)
                        )
                        owners.append(k)
            for k, err in zip(owners, program.run_many(runs) if runs else []):
                if err is not None and errors[k] is None:
                    errors[k] = err
            for k, data, seed, out, ref in masks:
                if errors[k] is None:
                    try:
                        program.run_mask(data, seed, out, ref)
                    except Exception as exc:  # noqa: BLE001 - settled below
                        errors[k] = exc
        out: list[tuple[Failure | None, dict]] = []
        for k, (sid, uri, record, seed, slots) in enumerate(items):
            if errors[k] is not None:
                out.append((Failure.decode_failed(sid, uri, errors[k], worker=self._name), {}))
                continue
            values = {f: v for f, v in record.items() if f not in slots}
            if self._spec.sample_stages:
                values = self._python_stages({**values, **slots}, seed, sid, uri)
            out.append((None, values))
        return out

    def _python_stages(self, record: dict, seed: int, sid: int, uri: str) -> dict:
        """The user's map and pad stages on one sample's record (its decoded images are views of its
        slots)."""
        for index, st in enumerate(self._spec.sample_stages):
            try:
                if isinstance(st, Pad):
                    record = pad_record(st, record)
                    continue
                fn = st.fn
                got = fn(record, rng=stage_rng(index, [seed])) if wants_rng(fn) else fn(record)
            except Exception as exc:
                raise _user_error(
                    f"{_stage_call(st)} raised on sample {sid} ({uri})", self._name, exc
                ) from exc
            if not isinstance(got, dict):
                raise LoaderError(
                    f"loader worker {self._name}: {_stage_call(st)} returned {type(got).__name__} for sample "
                    f"{sid} ({uri}), not a dict of fields"
                )
            record = got
        return record

    def batch_stages(self, batch: dict, task: BatchTask) -> dict:
        """The user's map_batches stages on the finished numpy batch; id and key are kept where the function
        left them out and the batch kept its rows."""
        for index, st in enumerate(self._spec.batch_stages, start=len(self._spec.sample_stages)):
            where = f"batch {task.index} of rank {task.rank}, epoch {task.epoch}"
            try:
                got = st.fn(batch, rng=stage_rng(index, task.seeds)) if wants_rng(st.fn) else st.fn(batch)
            except Exception as exc:
                raise _user_error(f"{_stage_call(st)} raised on {where}", self._name, exc) from exc
            if not isinstance(got, dict):
                raise LoaderError(
                    f"loader worker {self._name}: {_stage_call(st)} returned {type(got).__name__} for "
                    f"{where}, not a dict of columns"
                )
            rows = batch_rows(batch)
            for own in ("id", "key"):
                if own not in got and all(len(v) == rows for v in got.values() if hasattr(v, "__len__")):
                    got[own] = batch[own]
            batch = got
        return batch

    def _substitute(self, failure: Failure, seed: int, slots: dict[str, np.ndarray]) -> tuple[int, str, dict]:
        """on_error="replace": the first of the slot's substitutes (a pure function of its seed) that
        decodes: (its id, key, values)."""
        tried = []
        for attempt in range(MAX_SUBSTITUTES):
            sub = substitute_id(seed, attempt, self._num_samples)
            if sub == failure.sample_id:
                continue
            tried.append(sub)
            bad, key, values = self._sample(sub, seed, slots)
            if bad is None:
                return sub, key, values
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
            self._collect_returned()
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        buf = populated_empty((nbytes,), np.uint8)
        if self._reuse:
            with self._free_lock:
                self._buffers.append(buf)
        return buf

    def _release(self, buf: np.ndarray) -> None:
        """Give a batch buffer back. A finalizer calls this, and the garbage collector may run one inside
        any allocation, also while this thread holds `_free_lock`: so it never waits for the lock; when
        the lock is held, the buffer waits in `_returned` (a SimpleQueue, safe to put into from there) for
        the next lease."""
        if not self._free_lock.acquire(blocking=False):
            self._returned.put(buf)
            return
        try:
            self._keep(buf)
        finally:
            self._free_lock.release()

    def _collect_returned(self) -> None:
        """Buffers given back while the lock was held, onto the free list (call with `_free_lock` held)."""
        while True:
            try:
                buf = self._returned.get_nowait()
            except queue.Empty:
                return
            self._keep(buf)

    def _keep(self, buf: np.ndarray) -> None:
        """Put a buffer given back on the free list (call with `_free_lock` held)."""
        # Handed-off buffers: at most one waits for the next batch (the caller's and the batches in
        # flight hold the rest), so the pool adds at most one batch of memory, and none after
        # drop_buffers().
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
            self._collect_returned()
            self._free.clear()


def _run_together(jobs: list[tuple[LoaderWorker, BatchTask, dict[str, np.ndarray]]]) -> list[BatchResult]:
    """Make a batch's runs at once (one, or a mix's sources' rows of one batch, each by its own worker part):
    every one's reads start before any is waited for. On a failure, raise once none of their tasks still
    runs."""
    rows = sum(len(task.ids) for _w, task, _i in jobs) or 1
    runs = [_BatchRun(worker, task, images, len(task.ids) / rows) for worker, task, images in jobs]
    try:
        for run in runs:
            run._start_fetches()
        for run in runs:
            run._wait()
    except BaseException:
        # The batch fails and its buffer goes back to the pool: none of its tasks may still be writing there.
        for run in runs:
            futures_wait(run._io_tasks)
            futures_wait(list(run._decode_tasks))
        raise
    return [run._result() for run in runs]


def _stage_call(stage) -> str:
    fn = getattr(stage, "fn", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f".{stage.method}({name})"


def _user_error(what: str, worker: str, exc: BaseException) -> LoaderError:
    """A LoaderError for an exception of the user's function, with its traceback (which crosses Ray as
    text: the exception itself may not pickle)."""
    import traceback

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return LoaderError(
        f"loader worker {worker}: {what}: {type(exc).__name__}: {exc} (a bug in the function, not bad data: "
        f"on_error does not cover it)\n{tb}"
    )


class _BatchRun:
    """One batch being made, from its task to its BatchResult (run_batch makes one per batch).

    Its steps: `fetch` (an IO task) reads blocks and cuts their samples out; `enqueue` queues the samples
    for the decode pool and starts a `drain` when fewer than `threads` are on them; a `drain` decodes the
    queue a chunk per native call; `finish` settles each sample as the error policy says. A failed drain
    stops the batch: nothing more of it is read or decoded.
    """

    def __init__(
        self, worker: LoaderWorker, task: BatchTask, images: dict[str, np.ndarray], share: float = 1.0
    ) -> None:
        self._worker, self._task, self._images = worker, task, images  # images: field -> (n, ...) slots
        self._program, self._policy = worker._spec.program, worker._spec.policy
        self._ids = task.ids.astype(np.int64, copy=True)  # substitutes are written into it
        self._located = worker._source.locate(worker._catalog, self._ids)
        loc = self._located
        self._keys = list(loc.key)
        # Each slot's fields besides the decoded images (all of them after the user's map/pad stages)
        self._values: list[dict] = [{} for _ in range(len(task.ids))]
        self._slot_cache: dict[tuple[str, int], np.ndarray] = {}
        self._where = np.stack([loc.shard, loc.offset, loc.length, loc.row], axis=1).astype(np.int64)
        self._sizes = loc.size if loc.size is not None else loc.length  # a sample's own bytes
        shard_ids = np.unique(self._where[:, 0])
        self._shards = dict(zip(shard_ids.tolist(), worker._shard_infos(shard_ids)))
        self._failed: list[Failure | None] = [None] * len(task.ids)
        self._replaced: list[Replaced] = []
        # Samples whose bytes are in, waiting for a decode thread. A drain task takes them a chunk at a time
        # and decodes a chunk in one native call; at most `threads` drains of this batch run or wait at once.
        self._ready: deque[tuple[int, dict]] = deque()
        self._lock = threading.Lock()
        self._drains = 0  # drain tasks of this batch submitted and not yet finished
        # Set when a drain failed, so the batch fails: no more reading or decoding for it.
        self._stop = threading.Event()
        # `share`: this run's part of a batch that several runs make at once (a mix's sources); its IO tasks
        # are that share of the pool's, so the runs together make as many as one batch would. Its decode
        # drains are not cut: the last run to finish would decode its tail on one thread.
        self._share = share
        self._threads = worker._pool._max_workers
        storage = worker._storage
        self._storage = storage.scoped(behind=True) if isinstance(storage, CachedStorage) else storage
        # Every IO task and every decode-pool task of this batch: a failed batch waits for them all.
        self._io_tasks: list[Future] = []
        self._decode_tasks: list[Future] = []

    def _start_fetches(self) -> None:
        # Several blocks per IO task, each handed to the decode threads as it lands: an image folder has one
        # block per file, and a task (and a thread wake-up) per file cost more CPU than reading it. There are
        # still IO_TASKS_PER_THREAD tasks per IO thread to spread the requests over.
        io = self._worker._io
        todo = np.arange(len(self._where))
        if self._located.errors:  # their shard's index block could not be had: nothing to read
            self._unlocated(self._located.errors)
            todo = np.setdiff1d(todo, np.fromiter(self._located.errors, np.int64))
        # Where the catalog knows each sample's size, never read one that is too big.
        if self._worker._source.range_is_sample:
            sizes = np.asarray(self._sizes)[todo]
            for i in todo[sizes > self._worker._spec.max_sample_bytes].tolist():
                self._submit(
                    self.finish,
                    i,
                    self._worker._too_big(int(self._task.ids[i]), self._uri(i), self._sizes[i]),
                )
            todo = todo[sizes <= self._worker._spec.max_sample_bytes]
        blocks = coalesce(self._where[todo, :3].tolist())
        if len(todo) < len(self._where):  # members index the rows read, not the batch's rows
            blocks = [
                Block(b.shard, b.offset, b.length, tuple(todo[list(b.members)].tolist())) for b in blocks
            ]
        per = max(1, len(blocks) // max(1, round(IO_TASKS_PER_THREAD * io.concurrency * self._share)))
        for k in range(0, len(blocks), per):
            self._io_tasks.append(io.submit(self.fetch, blocks[k : k + per]))

    def _wait(self) -> None:
        """Until every IO task, then every decode task, has ended; the first error of one is raised here."""
        for done in as_completed(self._io_tasks):
            done.result()
        for f in self._decode_tasks:  # complete: only the IO tasks, all done now, submit decode tasks
            f.result()  # a LoaderError (not the sample's fault) fails the batch here

    # -- the steps ------------------------------------------------------------------------
    def fetch(self, blocks: list[Block]) -> None:
        """One IO task: read `blocks` one after the other, each one's samples queued for decode as it
        lands."""
        for block in blocks:
            if self._stop.is_set():
                return
            data = self._read(block)
            if data is not None:
                self.enqueue(self._cut(block, data))

    def enqueue(self, samples: list[tuple[int, dict]]) -> None:
        """Queue the samples for the decode threads; start a drain task if fewer than `threads` are on it."""
        with self._lock:
            if self._stop.is_set():
                return
            self._ready.extend(samples)
            if self._drains >= self._threads:
                return
            self._drains += 1
        self._submit(self.drain)

    def drain(self) -> None:
        """One decode task: decode the queued samples a chunk at a time until the queue is empty."""
        try:
            while chunk := self._take():
                self._decode(chunk)
        except BaseException:
            with self._lock:
                self._drains -= 1
                self._stop.set()
                self._ready.clear()
            raise

    def finish(self, i: int, failure: Failure | None) -> None:
        """Settle slot i: decoded (no failure), substituted, or left failed for the iterator, as the policy
        says."""
        if failure is None:
            return
        if self._policy.action(failure) != "replace":
            self._failed[i] = failure
            return
        sid, seed = int(self._task.ids[i]), int(self._task.seeds[i])
        self._ids[i], self._keys[i], self._values[i] = self._worker._substitute(failure, seed, self._slots(i))
        self._replaced.append(Replaced(sid, failure.uri, failure.reason, int(self._ids[i])))

    # -- inside the steps -----------------------------------------------------------------
    def _read(self, block: Block) -> bytes | None:
        """The block's bytes; None when they cannot be read, its samples then settled as unreadable."""
        shard = self._shards[block.shard]
        if isinstance(self._storage, CachedStorage):  # kept as its samples' ranges, which every epoch reads
            where = self._where[list(block.members), 1:3]
            self._storage.plan(shard.uri, block.offset, block.length, sorted(set(map(tuple, where.tolist()))))
        try:
            return self._worker._source.read_block(self._storage, shard, block.offset, block.length)
        except DataSourceError as exc:
            self._unreadable(block.members, shard.uri, exc)
            return None

    def _cut(self, block: Block, data: bytes) -> list[tuple[int, dict]]:
        """Each sample's bytes cut out of its block's; a sample that cannot be cut is settled as
        unreadable."""
        uri = self._shards[block.shard].uri
        samples = []
        if getattr(self._worker._source, "cut_views", False):  # it copies out what it keeps: no copy here
            data = memoryview(data)
        for i in block.members:
            _, offset, length, _ = (int(v) for v in self._where[i])
            start = offset - block.offset
            piece = data if (start == 0 and length == len(data)) else data[start : start + length]
            try:
                record = self._worker._source.cut(self._located, i, piece)
            except DataSourceError as exc:
                self._unreadable([i], uri, exc)
                continue
            except DecodeError as exc:  # a field's bytes are malformed (JSON, .npy, gzip)
                failure = Failure.decode_failed(
                    int(self._task.ids[i]), self._uri(i), exc, worker=self._worker._name
                )
                self._submit(self.finish, i, failure)
                continue
            big = self._worker._too_big(
                int(self._task.ids[i]), self._uri(i), self._worker.image_bytes(record)
            )
            if big is not None:  # a Parquet cell, whose size only its decoded row group tells
                self._submit(self.finish, i, big)
                continue
            samples.append((i, record))
        return samples

    def _unlocated(self, errors: dict[int, DataSourceError]) -> None:
        for i, exc in errors.items():
            uri = self._shards[int(self._where[i, 0])].uri
            self._submit(self.finish, i, Failure.read_failed(int(self._task.ids[i]), uri, exc))

    def _unreadable(self, members: list[int], uri: str, exc: DataSourceError) -> None:
        # Settled on the decode pool: under "replace" a substitute is read and decoded there, not on an IO
        # thread.
        for i in members:
            self._submit(self.finish, i, Failure.read_failed(int(self._task.ids[i]), uri, exc))

    def _take(self) -> list[tuple[int, dict]]:
        """The next chunk of the queue (fewer samples as it drains, so every drain gets some); [] when it is
        empty, and the calling drain ends."""
        with self._lock:
            if not self._ready:
                self._drains -= 1
                return []
            take = min(len(self._ready), DECODE_CHUNK, -(-len(self._ready) // self._threads))
            return [self._ready.popleft() for _ in range(take)]

    def _decode(self, chunk: list[tuple[int, dict]]) -> None:
        """Decode a chunk (its JPEGs in one native call), each sample's images into its slots, then finish
        each sample."""
        seeds, ids = self._task.seeds, self._task.ids
        items = [(int(ids[i]), self._uri(i), rec, int(seeds[i]), self._slots(i)) for i, rec in chunk]
        for (i, _), (failure, values) in zip(chunk, self._worker.make_samples(items)):
            self._values[i] = values
            self.finish(i, failure)

    def _slots(self, i: int) -> dict[str, np.ndarray]:
        """Slot i of each decoded image field (the same view objects each time: `_result` tells by identity
        whether the user's stages kept them)."""
        out = {}
        for name, arr in self._images.items():
            view = self._slot_cache.get((name, i))
            if view is None:
                view = self._slot_cache[(name, i)] = arr[i]
            out[name] = view
        return out

    def _uri(self, i: int) -> str:
        """Slot i's sample as errors name it."""
        return self._worker._source.sample_uri(self._shards[int(self._where[i, 0])].uri, self._keys[i])

    def _submit(self, fn, *args) -> None:
        """Run fn(*args) on the decode pool, as a task of this batch."""
        self._decode_tasks.append(self._worker._pool.submit(fn, *args))

    def _result(self) -> BatchResult:
        """The batch without its failed rows, and what failed or was replaced in it."""
        worker = self._worker
        ok = np.array([f is None for f in self._failed], dtype=bool)
        bad = [f for f in self._failed if f is not None]
        rows = np.flatnonzero(ok).tolist()
        full = len(rows) == len(ok)  # the batch gets shorter by the failed rows (maybe to 0), keeps its place
        values = [self._values[i] for i in rows]

        def uri_of(row: int) -> str:
            return self._uri(rows[row])

        batch: dict = {}
        if worker._spec.sample_stages:  # the records the user's stages returned make the batch
            names = list(values[0]) if values else [f.name for f in worker._source.fields]
            kinds = {f.name: f for f in worker._source.fields}
            for row, v in enumerate(values):
                if list(v) != names:
                    raise LoaderError(
                        f"loader worker {worker._name}: the records of one batch have different fields: "
                        f"{names} in {uri_of(0)}, {list(v)} in {uri_of(row)}"
                    )
            for name in names:
                column = [v[name] for v in values]
                image = self._images.get(name)
                if image is not None and all(c is s for c, s in zip(column, self._slot_views(name, rows))):
                    batch[name] = image if full else image[ok]  # the user's stage kept the slot itself
                    continue
                field = kinds.get(name)
                if field is None or field.kind == "image":
                    field = infer_field(name, column[0]) if column else Field(name)
                batch[name] = collate(field, column, uri_of)
        else:
            for field in worker._source.fields:
                image = self._images.get(field.name)
                if image is not None:
                    batch[field.name] = image if full else image[ok]
                else:
                    batch[field.name] = collate(field, [v[field.name] for v in values], uri_of)
        batch["id"] = self._ids if full else self._ids[ok]
        batch["key"] = [self._keys[i] for i in rows]
        if self._task.bucket is not None:
            batch["bucket"] = tuple(self._task.bucket)
        if worker._spec.batch_stages:
            batch = worker.batch_stages(batch, self._task)
        return BatchResult(
            batch=batch,
            skipped=[f for f in bad if not f.unreadable],
            unreadable=[f for f in bad if f.unreadable],
            replaced=sorted(self._replaced, key=lambda r: r.sample_id),
            membership=self._worker._membership,
            cache=self._cache_counts(),
        )

    def _cache_counts(self) -> dict[str, int]:
        """The node cache's counters of this batch's reads, and of the worker's own since its last batch
        (footers, index blocks, substitutes: every count lands in exactly one batch); {} without a
        cache. The entries this batch's misses write behind are on disk once it returns."""
        if not isinstance(self._storage, CachedStorage):
            return {}
        self._storage.flush()
        mine, shared = self._storage.counts.take(), self._worker._storage.counts.take()
        return {k: mine[k] + shared[k] for k in mine}

    def _slot_views(self, name: str, rows: list[int]):
        """The slot views `_slots` handed to the user's stages (compared by identity: kept or replaced)."""
        return [self._slot_cache.get((name, i)) for i in rows]
