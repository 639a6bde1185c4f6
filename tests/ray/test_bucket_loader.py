"""Aspect-ratio buckets end to end on a local Ray: bucket-pure batches, equal ranks, determinism, resume."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from PIL import Image

import raydl
from raydl.errors import SampleDecodeError

from loader_util import first_batch_ids

pytestmark = pytest.mark.timeout(180)

BUCKETS = {(80, 48), (64, 64), (48, 80)}  # size 64, multiple 16, ratios 0.5-2


def _pipeline(root, **kw):
    return raydl.read_images(str(root)).decode().aspect_buckets(64, multiple=16, **kw).random_hflip()


def _epoch(it):
    return list(it.iter_batches())


def test_batches_are_bucket_pure_with_equal_counts_per_rank(ray_local, image_folder):
    """Each batch holds one bucket (image shape == batch['bucket']), every sample goes to its nearest bucket,
    every sample is delivered, and both ranks get the same number of batches (a pad is a whole batch again)."""
    ds = _pipeline(image_folder).normalize("imagenet")
    counts = ds.bucket_counts()
    assert set(counts) == BUCKETS and sum(counts.values()) == 61 and min(counts.values()) > 0
    widths, heights = ds.catalog.column("width"), ds.catalog.column("height")
    stage = ds.stages[1]
    expected = {i: stage.buckets[b] for i, b in enumerate(stage.assign(widths, heights))}
    with ds.loader(batch_size=4, world_size=2, seed=5) as loader:
        its = [loader.iterator(r) for r in range(2)]
        per_rank = [_epoch(it) for it in its]
    assert len(per_rank[0]) == len(per_rank[1]) == len(its[0]) > 0
    seen = collections.Counter()
    for batches in per_rank:
        for b in batches:
            h, w = b["bucket"]
            assert b["image"].shape[1:] == (3, h, w) and b["image"].dtype == np.float32
            assert 0 < len(b["id"]) == b["image"].shape[0] <= 4
            assert all(expected[int(i)] == (h, w) for i in b["id"])
            seen.update(b["id"].tolist())
    assert set(seen) == set(range(61))


def test_determinism_and_exact_and_elastic_resume(ray_local, image_folder):
    """Same seed, same batches (ids, buckets, pixels) with other actor counts; the next epoch is another order;
    a mid-epoch state resumes the same batches exactly; at 3 ranks instead of 2 the rest is re-dealt once."""
    with _pipeline(image_folder, crop="random").loader(batch_size=4, seed=9) as a:
        ita = a.iterator(0)
        e0a, e1a = _epoch(ita), _epoch(ita)
        it = a.iterator(0)
        first_batch_ids([it], 3)
        state = json.loads(json.dumps(it.state_dict()))
    with _pipeline(image_folder, crop="random").loader(batch_size=4, seed=9, num_workers=2,
                                                       threads_per_worker=1) as b:
        e0b = _epoch(b.iterator(0))
        resumed = b.iterator(0)
        resumed.load_state_dict(state)
        rest = _epoch(resumed)
    assert len(e0a) == len(e0b) and len(rest) == len(e0a) - 3
    for x, y in zip(e0a, e0b, strict=True):
        assert x["bucket"] == y["bucket"]
        np.testing.assert_array_equal(x["id"], y["id"])
        np.testing.assert_array_equal(x["image"], y["image"])
    assert [x["id"].tolist() for x in e0a] != [x["id"].tolist() for x in e1a]
    for x, y in zip(rest, e0a[3:], strict=True):
        assert x["bucket"] == y["bucket"]
        np.testing.assert_array_equal(x["id"], y["id"])
        np.testing.assert_array_equal(x["image"], y["image"])

    with _pipeline(image_folder).loader(batch_size=4, world_size=2, seed=2, drop_last=True) as loader:
        its = [loader.iterator(r) for r in range(2)]
        seen = first_batch_ids(its, 2)
        state = its[0].state_dict()
        total = 2 * len(its[0])
    with _pipeline(image_folder).loader(batch_size=4, world_size=3, seed=2, drop_last=True) as loader3:
        its3 = [loader3.iterator(r) for r in range(3)]
        for it in its3:
            it.load_state_dict(state)
            seen += [b["id"] for b in _epoch(it)]
        assert len({len(it) for it in its3}) == 1
    ids = np.concatenate(seen)
    assert len(ids) == len(set(ids.tolist()))  # drop_last: no sample twice
    assert total - len(seen) < 3  # only the last incomplete round of batches is dropped


def test_torch_batches_keep_the_bucket(ray_local, image_folder):
    """iter_torch_batches gives tensors of the bucket's shape and passes batch['bucket'] through."""
    torch = pytest.importorskip("torch")
    with _pipeline(image_folder).loader(batch_size=8, seed=1) as loader:
        it = loader.iterator(0)
        rows = batches = 0
        for b in it.iter_torch_batches():
            assert isinstance(b["image"], torch.Tensor) and tuple(b["image"].shape[1:3]) == b["bucket"]
            rows, batches = rows + len(b["id"]), batches + 1
    assert batches == len(it) > 0 and rows == 61  # every sample, in the plan's number of batches


def test_unreadable_header_goes_through_on_error(ray_local, tmp_path):
    """A file whose header gives no size is skipped and counted (never bucketed), or raises naming it."""
    for i, (w, h) in enumerate([(100, 60), (60, 100), (80, 80), (90, 50)]):
        Image.new("RGB", (w, h), (i * 40, 90, 200)).save(tmp_path / f"{i}.jpg")
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    ds = raydl.read_images(str(tmp_path), labels=None).decode().aspect_buckets(64, multiple=16)
    assert sum(ds.bucket_counts().values()) == 4
    with ds.loader(batch_size=2, seed=0) as loader:
        it = loader.iterator(0)
        ids = np.concatenate([b["id"] for b in _epoch(it)])
        stats = it.stats()
    assert 4 not in ids.tolist() and set(ids.tolist()) == {0, 1, 2, 3}
    assert stats.samples_skipped == 1 and stats.skipped_uris[0].endswith("broken.jpg")
    with pytest.raises(SampleDecodeError, match="broken.jpg"):
        ds.loader(batch_size=2, on_error="raise")


def test_bad_bucket_arguments_are_value_errors_naming_them(image_folder):
    """size not a multiple of multiple, or min_ratio > max_ratio, is a ValueError before any actor starts."""
    ds = raydl.read_images(str(image_folder)).decode()
    with pytest.raises(ValueError, match="size"):
        ds.aspect_buckets(500)
    with pytest.raises(ValueError, match="min_ratio"):
        ds.aspect_buckets(512, min_ratio=2.0, max_ratio=1.0)


def test_bucketed_datasets_mix_per_source_a_bucket_a_batch(ray_local, image_folder, tmp_path):
    """Two bucketed folders mixed per_source: every batch is one bucket of one dataset (shape == its bucket, every
    id of that bucket), each dataset gets its weight's share, the same run twice gives the same batches, and a
    mid-epoch state resumes them exactly."""
    from raydl.demo import make_images

    make_images(str(tmp_path), 24, classes=2, seed=6, corrupt=0)
    parts = {"big": _pipeline(image_folder).normalize(), "small": _pipeline(tmp_path).normalize()}
    expected = {}
    for name, ds in parts.items():
        stage = ds.stages[1]
        of = stage.assign(ds.catalog.column("width"), ds.catalog.column("height"))
        expected[name] = {i: stage.buckets[b] for i, b in enumerate(of)}
    mixed = raydl.mix(parts, weights={"big": 0.25, "small": 0.75}, batching="per_source", epoch_size=96)
    with mixed.loader(batch_size=4, seed=2) as one, mixed.loader(batch_size=4, seed=2) as two:
        ref, again = _epoch(one.iterator(0)), _epoch(two.iterator(0))
        it = one.iterator(0)
        first_batch_ids([it], 3)
        resumed = two.iterator(0)
        resumed.load_state_dict(json.loads(json.dumps(it.state_dict())))
        rest = _epoch(resumed)
    rows = collections.Counter()
    for b in ref:
        (source,) = set(b["source"].tolist())
        h, w = b["bucket"]
        assert b["image"].shape[1:] == (3, h, w)
        assert all(expected[source][int(i)] == (h, w) for i in b["id"])
        rows[source] += len(b["id"])
    assert rows["small"] + rows["big"] == 96 and abs(rows["small"] - 72) <= 3  # shares, within a bucket's rounding
    for x, y in zip(ref, again, strict=True):
        np.testing.assert_array_equal(x["image"], y["image"])
    assert len(rest) == len(ref) - 3
    for x, y in zip(rest, ref[3:], strict=True):
        np.testing.assert_array_equal(x["id"], y["id"])
        assert x["bucket"] == y["bucket"] and x["source"].tolist() == y["source"].tolist()
