"""The node cache against the moto server on a local Ray: later epochs and later loaders make no request to the
store (requests counted at an HTTP front), corrupt entries are fetched again, a rewritten object is read anew."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import raydl
from raydl.bench.shards import write_parquet, write_webdataset

from s3_util import FaultFront, upload_folder

pytestmark = pytest.mark.timeout(180)


def _pipeline(ds):
    return ds.decode().random_resized_crop(24).random_hflip().normalize("imagenet")


def _epochs(ds, n, cache, **kw):
    """n epochs of rank 0 through one loader, and the iterator's stats."""
    with _pipeline(ds).loader(batch_size=16, seed=3, cache=cache, **kw) as loader:
        it = loader.iterator(0)
        return [list(it.iter_batches()) for _ in range(n)], it.stats()


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["id"], y["id"])
        np.testing.assert_array_equal(x["image"], y["image"])


@pytest.fixture(scope="module")
def three_layouts(tmp_path_factory):
    """32 images as an image folder, as WebDataset shards of 8 and as a Parquet file of row groups of 8."""
    from raydl.demo import make_images

    root = tmp_path_factory.mktemp("cache-data")
    make_images(str(root / "src"), 32, classes=2, seed=4, corrupt=0)
    write_webdataset(str(root / "src"), str(root / "wds"), per_shard=8)
    write_parquet(str(root / "src"), str(root / "pq"), row_group=8)
    return root


def _upload(bucket, root):
    for name in ("src", "wds", "pq"):
        upload_folder(bucket, root / name, name)


def _forget_in_process():
    """Drop this process's own caches of footers, decoded row groups and index blocks."""
    from raydl.sources import parquet, webdataset

    parquet.clear_caches()
    webdataset.clear_blocks()


def _read(kind, bucket, s3):
    if kind == "images":
        return raydl.read_images(f"s3://{bucket}/src", s3=s3)
    if kind == "webdataset":
        return raydl.read_webdataset(f"s3://{bucket}/wds/shard-{{000000..000003}}.tar", s3=s3)
    return raydl.read_parquet(f"s3://{bucket}/pq/data.parquet", image_column="image", label_column="label", s3=s3)


@pytest.mark.parametrize("kind", ["images", "webdataset", "parquet"])
def test_a_warm_cache_makes_no_request_to_the_store(ray_s3, moto_server, bucket, three_layouts, tmp_path, kind):
    """Epoch 1 fills the cache; epoch 2, and a new loader's epoch (new worker processes, as a job submitted
    again), make no GET and no HEAD at the store, and give the pixels epoch 1 gave from the store."""
    _upload(bucket, three_layouts)
    with FaultFront(moto_server, lambda *_: None) as front:
        s3 = raydl.S3Options(endpoint_url=front.url, max_concurrency=4)
        ds = _read(kind, bucket, s3)
        cache = raydl.Cache(str(tmp_path / "cache"), max_bytes=64 << 20)
        listed = len(front.requests)
        (first, _second), stats = _epochs(ds, 2, cache)
        warm = len(front.requests)
        assert warm > listed and stats.cache_misses > 0 and stats.bytes_from_store > 0
        _forget_in_process()  # the driver makes the first batches itself: as a new process, it has only the disk
        (again,), again_stats = _epochs(ds, 1, cache)
        assert len(front.requests) == warm, front.requests[warm:]
        assert again_stats.cache_misses == 0 and again_stats.cache_hits > 0 and again_stats.bytes_from_store == 0
        assert "node cache" in str(again_stats)
    _same(again, first)  # the same seed and epoch: the disk's bytes give the pixels the store's gave


def test_a_corrupt_entry_is_fetched_again_and_never_delivered(ray_s3, moto_server, bucket, three_layouts, tmp_path):
    """Flipped bytes in cache entries are caught by the digest: those entries are counted corrupt, read again
    from the store (one GET each), and the pixels are the store's."""
    _upload(bucket, three_layouts)
    root = tmp_path / "cache"
    cache = raydl.Cache(str(root), max_bytes=64 << 20)
    with FaultFront(moto_server, lambda *_: None) as front:
        ds = _read("images", bucket, raydl.S3Options(endpoint_url=front.url, max_concurrency=4))
        (want,), _ = _epochs(ds, 1, cache)
        entries = sorted(p for p in (root / "entries").rglob("*") if p.is_file())
        assert len(entries) == 32
        for p in entries[:5]:
            raw = bytearray(p.read_bytes())
            raw[len(raw) // 2] ^= 0x55
            p.write_bytes(bytes(raw))
        before = len(front.requests)
        (got,), stats = _epochs(ds, 1, cache)
        assert len(front.requests) - before == 5 and all(m == "GET" for m, _, _ in front.requests[before:])
    assert stats.cache_corrupt == 5 and stats.cache_misses == 5 and stats.cache_hits == 27
    _same(got, want)


def test_a_rewritten_object_is_read_anew_not_from_the_cache(ray_s3, moto_server, s3_client, bucket, three_layouts,
                                                            tmp_path):
    """An object overwritten in the store (a new etag at the next listing) is fetched again with its new bytes:
    its old entry is not served, and is removed."""
    _upload(bucket, three_layouts)
    cache = raydl.Cache(str(tmp_path / "cache"), max_bytes=64 << 20)
    s3 = raydl.S3Options(endpoint_url=moto_server, max_concurrency=4)
    _epochs(_read("images", bucket, s3), 1, cache)
    keys = sorted(str(p.relative_to(three_layouts)) for p in Path(three_layouts, "src").rglob("*.*"))
    victim, donor = keys[0], keys[-1]
    s3_client.put_object(Bucket=bucket, Key=victim, Body=(three_layouts / donor).read_bytes())
    relisted = _read("images", bucket, s3)
    (got,), stats = _epochs(relisted, 1, cache, shuffle=False)
    assert stats.cache_misses == 1 and stats.cache_hits == 31 and stats.cache_evictions == 1
    (plain,), _ = _epochs(relisted, 1, None, shuffle=False)
    _same(got, plain)
    entries = [p for p in (tmp_path / "cache" / "entries").rglob("*") if p.is_file()]
    assert len(entries) == 32
