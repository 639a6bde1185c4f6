"""The loader worker class without Ray: batch arrays come back to the free list; replace stays deterministic."""
from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

import raydl
from raydl import native
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.describe.transforms import compile_stages
from raydl.plan.order import augmentation_seeds

pytestmark = pytest.mark.timeout(60)


def _worker(root, on_error="skip", reuse=True, handoff=False):
    ds = raydl.read_images(str(root)).decode().center_crop(16)
    spec = WorkerSpec(program=compile_stages(ds.stages), threads=2, on_error=on_error)
    return LoaderWorker(spec, ds.catalog, reuse_buffers=reuse, handoff=handoff), len(ds)


def _task(ids, k=0):
    ids = np.asarray(ids, dtype=np.int64)
    return BatchTask(rank=0, epoch=0, index=k, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0))


def test_batch_arrays_are_reused_once_a_result_is_dropped(image_folder):
    """One array serves batch after batch when each result is dropped; two held results need two arrays."""
    worker, _ = _worker(image_folder)
    for k in range(3):
        result = worker.run_batch(_task(range(8), k))
        assert result.batch["image"].shape == (8, 16, 16, 3)
        del result
        gc.collect()
    assert worker.memory()["batch_arrays_count"] == 1
    held = [worker.run_batch(_task(range(8), k)) for k in range(2)]
    assert worker.memory()["batch_arrays_count"] == 2
    assert not np.shares_memory(held[0].batch["image"], held[1].batch["image"])


def test_without_reuse_every_batch_owns_its_array(image_folder):
    """reuse_buffers=False (batches made in the driver): results never share memory and nothing is kept."""
    worker, _ = _worker(image_folder, reuse=False)
    a = worker.run_batch(_task(range(4)))
    del a
    gc.collect()
    b, c = worker.run_batch(_task(range(4))), worker.run_batch(_task(range(4)))
    assert not np.shares_memory(b.batch["image"], c.batch["image"])
    assert worker.memory()["batch_arrays_count"] == 0


def test_handed_off_batches_reuse_a_buffer_only_once_every_view_is_gone(image_folder):
    """handoff=True (batches made in the driver): a dropped batch's buffer serves the next; one still viewed never
    does; at most one idle buffer is kept, and none after drop_buffers()."""
    worker, _ = _worker(image_folder, handoff=True)

    def address(result):
        return result.batch["image"].__array_interface__["data"][0]

    a = worker.run_batch(_task(range(8), 0))
    first = address(a)
    del a
    gc.collect()
    b = worker.run_batch(_task(range(8), 1))
    assert address(b) == first  # the dropped batch's buffer came back and served this one
    view = b.batch["image"][2:5]  # a caller keeps only part of the images (or a torch tensor on them)
    expected = view.copy()
    del b
    gc.collect()
    c = worker.run_batch(_task(range(8), 2))
    assert not np.shares_memory(view, c.batch["image"])
    np.testing.assert_array_equal(view, expected)  # never written over while viewed
    del view, c
    gc.collect()
    assert len(worker._free) == 1  # two buffers came back; one is kept for the next batch
    worker.drop_buffers()
    assert worker._free == []
    d = worker.run_batch(_task(range(8), 3))
    del d
    gc.collect()
    assert worker._free == [] and worker.memory()["batch_arrays_count"] == 0


def test_the_handed_off_buffer_kept_is_the_larger(image_folder):
    """Of two handed-off buffers that come back, the one kept for the next batch is the larger (bucket
    batches vary in size; a small one kept would make every larger batch fault in fresh memory)."""
    worker, _ = _worker(image_folder, handoff=True)
    small, large = worker.run_batch(_task(range(2), 0)), worker.run_batch(_task(range(8), 1))
    need = large.batch["image"].nbytes
    del small
    gc.collect()
    del large
    gc.collect()
    assert len(worker._free) == 1 and worker._free[0].nbytes >= need


def test_replace_substitutes_a_file_corrupted_after_listing_deterministically(image_folder, tmp_path):
    """A file overwritten with junk after listing is replaced (on_error='replace') by the same substitute every time."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(image_folder, root)
    worker, n = _worker(root, on_error="replace")
    victim = sorted(p for p in root.rglob("*") if p.is_file())[3]
    victim.write_bytes(b"\xff\xd8\xff" + b"\x00" * (victim.stat().st_size - 3))  # same size, not a JPEG
    first = worker.run_batch(_task(range(8)))
    again = worker.run_batch(_task(range(8)))
    assert len(first.batch["id"]) == 8 and len(first.replaced) == 1 and first.replaced[0].sample_id == 3
    assert first.batch["id"][3] == first.replaced[0].substitute_id != 3
    np.testing.assert_array_equal(first.batch["image"], again.batch["image"])


def test_driver_threads_take_the_workers_niceness_and_never_raise_it(image_folder):
    """After its first batch the driver's loader threads run at Ray's worker niceness; a nicer thread stays so."""
    import os
    import threading

    from raydl.execute.bootstrap import renice as _renice

    niceness = 15  # Ray's worker niceness

    worker, _ = _worker(image_folder)
    worker.run_batch(_task(range(8)))
    tids = worker.thread_ids()
    assert tids and threading.get_native_id() not in tids  # the pools' threads, not the caller
    _renice(tids, niceness)
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {niceness}
    _renice(tids, 5)
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {niceness}


@pytest.mark.skipif(not native.jpeg_available(), reason="raydl.native._jpeg not built (no jpeglib.h)")
def test_a_corrupt_jpeg_in_a_decode_chunk_is_skipped_alone(image_folder, tmp_path):
    """Samples decoded a chunk per native call: one corrupt JPEG is skipped alone, the others get run's pixels."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(image_folder, root)
    worker, n = _worker(root)
    files = [Path(raydl.read_images(str(root)).catalog.uri(i)) for i in range(n)]  # sample id -> file
    victim = next(i for i, p in enumerate(files) if p.suffix == ".jpg" and i < 40)
    body = files[victim].read_bytes()
    keep = body.index(b"\xff\xda") + 20  # the headers and the start of the scan, then noise (same size)
    noise = np.random.default_rng(0).integers(0, 256, len(body) - keep, dtype=np.uint8).tobytes()
    files[victim].write_bytes(body[:keep] + noise)
    ids = list(range(min(n, 40)))
    result = worker.run_batch(_task(ids))
    assert [s.sample_id for s in result.skipped] == [victim] and "corrupt JPEG" in result.skipped[0].reason
    assert result.batch["id"].tolist() == [i for i in ids if i != victim]
    task = _task(ids)
    program = worker._spec.program
    for row, sid in enumerate(result.batch["id"].tolist()):
        want = np.empty(program.slot_shape(), program.dtype)
        program.run(files[sid].read_bytes(), int(task.seeds[sid]), want)
        np.testing.assert_array_equal(result.batch["image"][row], want)


def test_an_unreadable_file_fails_alone_in_its_io_task(image_folder, tmp_path):
    """Blocks are read several per IO task: a file gone since listing is unreadable alone, its task-mates decode."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(image_folder, root)
    worker, n = _worker(root)
    files = [Path(raydl.read_images(str(root)).catalog.uri(i)) for i in range(n)]
    files[5].unlink()
    ids = list(range(min(n, 40)))  # 40 one-file blocks over 4 IO threads: 2 blocks per IO task
    result = worker.run_batch(_task(ids))
    assert [s.sample_id for s in result.unreadable] == [5] and not result.skipped
    assert result.batch["id"].tolist() == [i for i in ids if i != 5]


class _FaultyProgram:
    """A sample program whose run_many fails one sample with a non-decode error and is slow on the others."""

    def __init__(self, program, bad_seed: int):
        import threading

        self._program, self._bad_seed = program, bad_seed
        self._lock = threading.Lock()
        self._slow_started = threading.Event()
        self.active = 0  # run_many calls under way

    def __getattr__(self, name):
        return getattr(self._program, name)

    def run_many(self, items):
        import time

        with self._lock:
            self.active += 1
        try:
            out = []
            if all(seed != self._bad_seed for _, seed, _ in items):
                self._slow_started.set()
            for data, seed, slot in items:
                if seed == self._bad_seed:  # fail only once another call is busy, as a real race would
                    self._slow_started.wait(5)
                    out.append(RuntimeError("a bug in a kernel"))
                    continue
                time.sleep(0.01)
                out.append(self._program.run_many([(data, seed, slot)])[0])
            return out
        finally:
            with self._lock:
                self.active -= 1


def test_a_failed_batch_returns_only_once_none_of_its_tasks_still_writes(image_folder):
    """A batch failed by a non-decode error raises only after every decode task of it has ended, since its buffer
    goes back to the pool for the next batch."""
    from raydl.errors import LoaderError

    worker, n = _worker(image_folder)
    ids = list(range(min(n, 40)))
    task = _task(ids)
    faulty = _FaultyProgram(worker._spec.program, int(task.seeds[0]))
    worker._spec = WorkerSpec(program=faulty, threads=2, on_error="skip")
    with pytest.raises(LoaderError, match="sample 0 .*a bug in a kernel"):
        worker.run_batch(task)
    assert faulty.active == 0
    assert len(worker._free) == 1  # its buffer is back in the pool, and nothing writes there any more


def test_a_buffer_given_back_while_its_lock_is_held_waits_for_the_next_lease(image_folder):
    """The garbage collector may run a batch's finalizer inside any allocation, also while the same thread holds
    the free list's lock (inside a lease): giving the buffer back then never waits on that lock, and the next
    batch still gets the buffer."""
    worker, _ = _worker(image_folder)
    result = worker.run_batch(_task(range(8), 0))
    first = result.batch["image"].__array_interface__["data"][0]
    with worker._free_lock:  # as inside _lease, when a collection runs the finalizer there
        del result
        gc.collect()
    again = worker.run_batch(_task(range(8), 1))
    assert again.batch["image"].__array_interface__["data"][0] == first
    assert worker.memory()["batch_arrays_count"] == 1
