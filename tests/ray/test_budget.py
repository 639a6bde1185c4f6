"""The loader's batches stay under the object-store budget: no spilling with a small store."""
from __future__ import annotations

import re

import pytest
import ray

import raydl
from raydl.demo import make_images

pytestmark = pytest.mark.timeout(240)

STORE = 80 * 1024 * 1024  # bytes: Ray's small end


@pytest.fixture(scope="module")
def small_store():
    """A local Ray whose object store holds 80 MiB."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, object_store_memory=STORE, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    yield
    ray.shutdown()


def _spilled_bytes() -> int:
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)  # this instance, not any on the machine
    m = re.search(r"Spilled (\d+) MiB", text)
    return int(m.group(1)) if m else 0


def test_a_dataset_larger_than_the_store_streams_without_spilling(small_store, tmp_path):
    """An epoch whose batches total over twice the object store passes through it with nothing spilled."""
    make_images(str(tmp_path), 160, classes=2, seed=3, corrupt=0)
    ds = raydl.read_images(str(tmp_path)).decode().random_resized_crop(320).normalize("imagenet")
    batch_bytes = 8 * 3 * 320 * 320 * 4  # 9.8 MB
    with ds.loader(batch_size=8, prefetch_batches=8) as loader:
        assert loader.object_store_budget <= STORE // 4 + 1
        it = loader.iterator(0)
        total = 0
        for batch in it.iter_batches():
            total += batch["image"].nbytes
            del batch
        assert it.stats().samples_delivered == 160
    assert total == 160 * batch_bytes // 8 and total > 2 * STORE
    assert _spilled_bytes() == 0
    # The budget, not prefetch_batches=8, set the depth: (depth + 1) batches fit in a quarter of the store.
    from raydl.plan.scheduling import prefetch_depth

    depth = prefetch_depth(8, batch_bytes=batch_bytes, budget_bytes=loader.object_store_budget, world_size=1)
    assert depth == 1  # a 9.8 MB batch and a 20 MiB budget: one in flight, one in hand
