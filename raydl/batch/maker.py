"""BatchMaker: a batch task in, a batch out, in any process (a loader worker, or the Loader's own process
while its workers start). No Ray: the actor face is raydl/actors/worker.py.

A maker holds the members of one dataset (raydl/batch/member.py; one, or a mix's several), the threads
they share (raydl/batch/pools.py) and its batch buffers. Each batch is made into one flat buffer that holds
every decoded image field (aspect buckets: the shapes vary per batch), each field's array a 64-byte
aligned view of it; a mix's members make their rows into their rows of that buffer at once.

Buffers are reused, because fresh memory costs a page fault per 4 KiB on first touch, as much as the decode
itself, and serialized across threads; flat, one serves every batch shape. In a worker a buffer goes back to
the free list when the BatchResult that holds it is dropped, which Ray does once it has copied the result
into the object store, so there are as many buffers as batch calls in flight at once. Handed off (the
Loader's own process, whose caller gets the arrays as they are), a buffer goes back once every array viewing
its images is gone, never while one can read it.
"""

from __future__ import annotations

import ctypes
import math
import os
import queue
import threading
import weakref

import numpy as np

from raydl.batch.member import MemberReader
from raydl.batch.mixing import Mixing
from raydl.batch.pools import Pools
from raydl.batch.run import run_together
from raydl.batch.spec import MixtureSpec, WorkerSpec
from raydl.describe.catalog import Catalog
from raydl.plan.tasks import BatchResult, BatchTask
from raydl.util.memory import populated_empty
from raydl.util.process import process_name

__all__ = ["BatchMaker"]


class BatchMaker:
    """Makes the batch of any task of one dataset (`spec` with its catalogs: a MixtureSpec and a catalog per
    member, or one WorkerSpec and its catalog).

    reuse_buffers: a buffer is reused once its BatchResult is dropped (Ray has copied it out).
    handoff: the batch is handed to the caller as it is; its buffer is reused once every array viewing the
    images is gone, and at most one waits for the next batch. Neither: a fresh buffer per batch.
    """

    def __init__(
        self,
        spec: MixtureSpec | WorkerSpec,
        catalog: Catalog | tuple[Catalog, ...],
        threads: int | None = None,
        *,
        reuse_buffers: bool = True,
        handoff: bool = False,
    ) -> None:
        self._catalogs = (catalog,) if isinstance(spec, WorkerSpec) else tuple(catalog)
        first = spec if isinstance(spec, WorkerSpec) else spec.members[0]
        self._handoff = handoff
        self._reuse = reuse_buffers and not handoff
        self.name = process_name()
        threads = threads or first.threads or len(os.sched_getaffinity(0))
        io = first.io_concurrency or self._catalogs[0].storage.default_io_concurrency
        self.pools = Pools(threads, io)
        self._spec = spec
        self._free_lock = threading.Lock()
        self._free: list[np.ndarray] = []  # batch buffers not in use
        self._returned: queue.SimpleQueue = queue.SimpleQueue()  # given back while _free_lock was held
        self._dropped = False  # drop_buffers() was called
        self._buffers: list[np.ndarray] = []  # every batch buffer made, for memory()

    @property
    def _spec(self) -> MixtureSpec | WorkerSpec:
        """The spec as given; setting another (between batches) makes the members again from it."""
        return self._given_spec

    @_spec.setter
    def _spec(self, spec: MixtureSpec | WorkerSpec) -> None:
        self._given_spec = spec
        if isinstance(spec, WorkerSpec):  # one dataset, read as it is
            spec = MixtureSpec.one(spec, len(self._catalogs[0]))
        self.members = [
            MemberReader(s, c, self.pools, self.name)
            for s, c in zip(spec.members, self._catalogs, strict=True)
        ]
        self._mixing = None if spec.single else Mixing(spec)

    def memory(self) -> dict:
        """Bytes this maker holds between batches: its reused batch buffers (one per batch call in flight)
        and the catalog columns it keeps (the table itself is a view of the object store)."""
        return {
            "batch_arrays": sum(b.nbytes for b in self._buffers),
            "batch_arrays_count": len(self._buffers),
            "catalog_columns": sum(m.catalog.nbytes for m in self.members),
        }

    def thread_ids(self) -> list[int]:
        """Native ids of the decode and IO threads started so far (to set their priority)."""
        return self.pools.thread_ids()

    def run_batch(self, task: BatchTask) -> BatchResult:
        """Make the batch `task` names."""
        layout, nbytes = self._layout(task)
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

    def _layout(self, task: BatchTask) -> tuple[list, int]:
        """(name, dtype, shape, offset, size) of each decoded image field in the batch's flat buffer, and the
        buffer's size."""
        n = len(task.ids)
        member = 0
        if self._mixing is not None:
            member = self._mixing.layout_member(task, lambda s, bucket: self.members[s].outputs(bucket))
        layout, nbytes = [], 0
        for name, _mask, dtype, slot in self.members[member].outputs(task.bucket):
            size = math.prod((n, *slot)) * dtype.itemsize
            layout.append((name, dtype, (n, *slot), nbytes, size))
            nbytes += -(-size // 64) * 64
        return layout, nbytes

    def _run_into(self, task: BatchTask, flat: np.ndarray, layout: list) -> BatchResult:
        """The batch of `task` made with its image fields in `flat` (at the places `layout` gives)."""
        images = {
            name: flat[at : at + size].view(dtype).reshape(shape) for name, dtype, shape, at, size in layout
        }
        if self._mixing is not None:
            return self._mixing.run(task, images, self.members, run_together)
        (result,) = run_together([(self.members[0], task, images)])
        return result

    # -- batch buffers --------------------------------------------------------------------
    def _lease(self, nbytes: int) -> np.ndarray:
        """A flat batch buffer of at least `nbytes` from the free list, or a new one (see the module)."""
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
        # Handed-off buffers: at most one waits for the next batch (the caller's and the batches in flight
        # hold the rest), so the pool adds at most one batch of memory, and none after drop_buffers().
        if self._handoff and self._dropped:
            return
        if self._handoff and self._free:
            if buf.nbytes > self._free[0].nbytes:  # keep the larger: bucket batches vary in size
                self._free[0] = buf
            return
        self._free.append(buf)

    def drop_buffers(self) -> None:
        """Free the buffers kept for reuse now, and keep none from here on (the Loader's own process, once
        its workers are up)."""
        with self._free_lock:
            self._dropped = True
            self._collect_returned()
            self._free.clear()
