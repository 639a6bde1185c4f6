"""What a rank's iterator does when a batch fails: a read that failed is tried again on another worker; a
worker that died is replaced and its batch goes to a worker of another node (a lost node takes every worker
on it); a batch whose error the policy raises is raised again by the next call, not lost; and shutdown()
kills every worker raydl started, whatever became of its coordinator. Real Ray actors; the pool the
iterator asks for workers is a few lines here (the WorkerPool seam)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

import raydl
from raydl.actors.launch import actor_alive
from raydl.consume.iterator import DataIterator
from raydl.errors import AccessDeniedError, DataSourceError, LoaderError, SampleDecodeError
from raydl.plan.failures import Failure
from raydl.plan.scheduling import WorkerInfo
from raydl.plan.tasks import BatchResult

pytestmark = pytest.mark.timeout(120)


@ray.remote(num_cpus=0)
class _Worker:
    """Makes a rank's batch as the plan names it (its ids), or raises `error`, or reports `failed` samples."""

    def __init__(self, error: Exception | None = None, failed: bool = False) -> None:
        self.error, self.failed, self.asked = error, failed, 0

    def run_batch(self, task):
        self.asked += 1
        if self.error is not None:
            raise self.error
        skipped = [Failure(int(task.ids[0]), "x.jpg", "not a JPEG")] if self.failed else []
        return BatchResult(batch={"id": np.asarray(task.ids)}, skipped=skipped, unreadable=[])

    def run_batches(self, tasks):
        return [self.run_batch(t) for t in tasks]

    def count(self) -> int:
        return self.asked


class _Pool:
    """Workers as a coordinator hands them out: one reported dead leaves the list, the rest stay."""

    object_store_budget = 1 << 30

    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers, self.reported = list(workers), []

    def runners(self) -> list[WorkerInfo]:
        return self.workers

    def sync(self, version: int) -> None:
        pass

    def replace(self, dead: WorkerInfo) -> list[WorkerInfo]:
        self.reported.append(dead.name)
        self.workers = [w for w in self.workers if w.name != dead.name]
        return self.workers


@pytest.fixture(scope="module")
def plan(ray_local, image_folder):
    """61 samples in batches of 8, one rank, in order; on_error="raise"."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(8)
    with ds.loader(batch_size=8, shuffle=False, on_error="raise") as loader:
        return loader.plan


def _iterator(plan, workers) -> tuple[DataIterator, _Pool]:
    pool = _Pool(workers)
    return DataIterator(plan, pool, 0), pool


def _info(handle, node: str, name: str) -> WorkerInfo:
    return WorkerInfo(handle, node, name)


def test_a_read_that_failed_is_tried_again_on_another_worker(plan):
    """A worker whose read failed (a DataSourceError past the store's own retries) has its batch made by
    another worker; a refusal of access is not tried again; a read that fails everywhere is raised after
    3 tries, naming the rank, the batch and the tries."""
    stalled = _Worker.remote(DataSourceError("cannot read s3://b/x.bin: the store stalled"))
    good = _Worker.remote()
    it, _pool = _iterator(plan, [_info(stalled, "n1", "stalled"), _info(good, "n2", "good")])
    batch = next(it.iter_batches(prefetch_batches=1))
    np.testing.assert_array_equal(batch["id"], np.arange(8))
    assert it.stats().retries == 1 and ray.get(stalled.count.remote()) == 1

    denied = _Worker.remote(AccessDeniedError("s3://b: access denied", uri="s3://b"))
    it, _pool = _iterator(plan, [_info(denied, "n1", "denied"), _info(good, "n2", "good")])
    with pytest.raises(LoaderError, match="rank 0: batch 0 of epoch 0 failed on actor denied: AccessDeniedError"):
        next(it.iter_batches(prefetch_batches=1))
    assert it.stats().retries == 0

    other = _Worker.remote(DataSourceError("cannot read s3://b/x.bin: the store stalled"))
    it, _pool = _iterator(plan, [_info(stalled, "n1", "stalled"), _info(other, "n2", "other")])
    with pytest.raises(LoaderError, match=r"batch 0 of epoch 0 \(tried 3 times\) failed on actor .*the store stalled"):
        next(it.iter_batches(prefetch_batches=1))


def test_after_a_worker_died_its_batch_goes_to_a_worker_of_another_node(plan):
    """A lost node takes all its workers, and the pool still lists the ones not reported yet: the retry
    goes to a worker elsewhere, not to the dead one's neighbours (three of them used up the 3 tries)."""
    lost = [_Worker.remote() for _ in range(3)]
    live = _Worker.remote()
    ray.get([w.count.remote() for w in [*lost, live]])
    for w in lost:
        ray.kill(w, no_restart=True)
    end = time.monotonic() + 30
    while any(actor_alive(w) for w in lost):  # a kill is asynchronous
        assert time.monotonic() < end, "killed workers still answer"
        time.sleep(0.05)
    workers = [_info(w, "lost-node", f"lost{i}") for i, w in enumerate(lost)] + [_info(live, "live-node", "live")]
    it, pool = _iterator(plan, workers)
    batch = next(it.iter_batches(prefetch_batches=1))
    np.testing.assert_array_equal(batch["id"], np.arange(8))
    assert pool.reported == ["lost0"] and it.stats().retries == 1


def test_a_batch_whose_error_is_raised_is_raised_again_by_the_next_call(plan):
    """on_error="raise": the batch whose sample failed raises; calling again raises it again (the batch was
    taken from the tasks in flight before the policy raised, and was lost: a bare KeyError)."""
    bad = _Worker.remote(failed=True)
    it, _pool = _iterator(plan, [_info(bad, "n1", "bad")])
    for _ in range(2):
        with pytest.raises(SampleDecodeError, match="x.jpg"):
            next(it.iter_batches(prefetch_batches=4))
    assert it.state_dict()["batches_done"] == 0


def test_shutdown_kills_the_workers_it_started_when_the_coordinator_is_gone(ray_local, image_folder):
    """The workers a Loader started are killed by its shutdown() even when its coordinator died first (they
    are the driver's, so they outlive it), and a worker reported dead while it still lives is killed: no
    worker is left holding its CPU."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(8)
    loader = ds.loader(batch_size=8, num_workers=2, cpus_per_worker=0.5)
    try:
        it = loader.iterator(0)
        next(it.iter_batches())
        loader.refresh()
        workers = list(loader._launched)
        assert len(workers) == 2 and all(actor_alive(h) for h in workers)
        live = next(w for w in loader.runners() if not w.in_process)
        loader.replace(live)  # reported dead (an actor unreachable for a while), though it lives
        end = time.monotonic() + 30
        while actor_alive(live.handle):
            assert time.monotonic() < end, "a worker reported dead still lives"
            time.sleep(0.1)
        ray.kill(loader._coordinator, no_restart=True)
    finally:
        loader.shutdown()
    left = [h for h in workers if actor_alive(h)]
    assert left == []
