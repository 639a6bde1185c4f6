"""An epoch that would deliver nothing is a ValueError at loader(), saying why and what to change, before Ray is
started or asked for anything."""

from __future__ import annotations

import pytest

import raydl

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_ray(monkeypatch):
    """loader() must refuse before it starts or joins Ray."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("loader() went on to start Ray")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def test_drop_last_with_fewer_samples_than_a_round_is_refused(image_folder, no_ray):
    """61 samples, drop_last=True: batch 128 on one rank, or batch 16 on 4 ranks, make no batch; the message gives
    the numbers and the largest batch_size that makes one."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    with pytest.raises(
        ValueError,
        match=r"an epoch of this loader would deliver no batch: with drop_last=True a round of batches needs "
        r"batch_size 128 x world_size 1 = 128, and the data has 61 samples; lower batch_size to at most 61, or set "
        r"drop_last=False",
    ):
        ds.loader(batch_size=128, drop_last=True)
    with pytest.raises(ValueError, match=r"= 64, and the data has 61 samples; lower batch_size to at most 15"):
        ds.loader(batch_size=16, world_size=4, drop_last=True)
    with pytest.raises(ValueError, match=r"61 samples; use at most 61 ranks, or set drop_last=False"):
        ds.loader(batch_size=1, world_size=64, drop_last=True)


def test_bucketed_batches_fewer_than_the_ranks_are_refused(image_folder, no_ray):
    """With aspect buckets the ranks deal whole batches: fewer full batches than ranks is an empty epoch too."""
    ds = raydl.read_images(str(image_folder)).decode().aspect_buckets(64, multiple=16)
    with pytest.raises(
        ValueError,
        match=r"each of the world_size 3 ranks needs a full batch, and the data makes 2 full batches of batch_size 20 "
        r"\(aspect buckets\); lower batch_size or world_size, or set drop_last=False",
    ):
        ds.loader(batch_size=20, world_size=3, drop_last=True)  # buckets of 23, 25 and 13 images
