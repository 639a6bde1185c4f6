"""Batches made in a worker's shared memory for a reader on its node (raydl/util/shared.py)."""

from __future__ import annotations

import numpy as np
import pytest

import raydl

pytestmark = pytest.mark.timeout(180)


def _pipeline(root):
    return raydl.read_images(str(root)).decode().random_resized_crop(32).random_hflip().normalize("imagenet")


def _slots(loader) -> int:
    return sum(loader.memory()["worker_shared_slot_count"])


def test_a_held_batch_is_never_written_over(ray_local, image_folder):
    """The user keeps the first batch while two more epochs go by: its pixels do not change, the later
    batches come from the worker's shared memory, and they are the object store's pixels exactly."""
    with _pipeline(image_folder).loader(batch_size=8, seed=5) as loader:
        loader.refresh()  # every batch from the worker
        it = loader.iterator(0)
        batches = it.iter_batches()
        held = next(batches)
        kept = held["image"].copy()
        assert not held["image"].flags.writeable and not held["image"].flags.owndata
        rest = [b["image"].copy() for b in batches]
        for _ in range(2):
            assert sum(1 for _ in it.iter_batches()) == len(rest) + 1  # each dropped as the next comes
        np.testing.assert_array_equal(held["image"], kept)
        assert 1 <= _slots(loader) <= 4  # reused: prefetch depth + the held one, not one per batch
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYDL_SHARED_BATCHES", "0")  # through the object store, as before
        with _pipeline(image_folder).loader(batch_size=8, seed=5) as loader:
            loader.refresh()
            plain = [b["image"].copy() for b in loader.iterator(0).iter_batches()]
            assert _slots(loader) == 0
    for x, y in zip([kept, *rest], plain, strict=True):
        np.testing.assert_array_equal(x, y)


def test_batches_dropped_unread_give_their_slots_back(ray_local, image_folder):
    """load_state_dict drops the batches in flight; their workers free the slots, so resuming again and
    again does not pile slots up."""
    with _pipeline(image_folder).loader(batch_size=8, seed=5) as loader:
        loader.refresh()
        it = loader.iterator(0)
        for _ in range(5):
            batches = it.iter_batches()
            next(batches)  # two more are in flight now
            state = it.state_dict()
            it.load_state_dict(state)
            del batches
        again = [b["id"] for b in it.iter_batches()]
        assert again and _slots(loader) <= 4


def test_a_rank_that_cannot_map_the_workers_memory_reads_the_object_store(ray_local, image_folder, monkeypatch, caplog):
    """Where the probe does not map (another PID namespace, no /proc access) the rank says so once and its
    batches come through the object store, whole; the worker makes no slot for it."""
    from raydl.util import shared

    monkeypatch.setattr(shared, "probe", lambda desc: False)
    with _pipeline(image_folder).loader(batch_size=8, seed=5) as loader:
        loader.refresh()
        ids = [b["id"] for b in loader.iterator(0).iter_batches()]
        assert _slots(loader) == 0
    assert sorted(int(i) for b in ids for i in b) == list(range(61))
    warned = [r for r in caplog.records if "cannot map the shared memory of loader worker" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
