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
    for x, y in zip(a, b, strict=True):
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


# -- the cache's own protocol against the server: a killed writer, two writers at once, eviction ------------------

def _fork():
    import multiprocessing

    return multiprocessing.get_context("fork")


def _objects(s3_client, bucket, n=6, size=20_000):
    """n objects of `size` distinct bytes in the bucket: {uri: (etag, bytes)}."""
    from raydl.storage.s3 import S3Storage

    listing = S3Storage(raydl.S3Options(endpoint_url=s3_client.meta.endpoint_url))
    out = {}
    for i in range(n):
        body = bytes((i * 13 + j) % 251 for j in range(size))
        s3_client.put_object(Bucket=bucket, Key=f"obj{i}", Body=body)
        uri = f"s3://{bucket}/obj{i}"
        out[uri] = (listing.stat(uri).etag, body)  # the etag as listing gives it
    return out


def _s3_cached(url, root, max_bytes=1 << 20):
    from raydl.storage.cache import CachedStorage, NodeCache
    from raydl.storage.s3 import S3Storage

    return CachedStorage(S3Storage(raydl.S3Options(endpoint_url=url, max_concurrency=4)), NodeCache(root, max_bytes))


def _killed_writer(url, root, uri, etag, ready):
    """Stream an object from the store into the cache and stop (forever) after its first piece: the parent kills
    this process there, mid-write."""
    import time

    it = _s3_cached(url, root).stream(uri, etag=etag, chunk=1000)
    next(it)
    ready.set()
    time.sleep(60)


def _fill(url, root, objects, seed):
    """Read every object's halves through the cache in an order of our own, three times: is each read right?"""
    import random

    storage = _s3_cached(url, root)
    todo = [(u, off) for u in objects for off in (0, 10_000)]
    random.Random(seed).shuffle(todo)
    return [storage.read_range(u, off, 10_000, etag=objects[u][0]) == objects[u][1][off : off + 10_000]
            for _ in range(3) for u, off in todo]


def test_killed_racing_and_evicting_writers_on_the_server(moto_server, s3_client, bucket, tmp_path):
    """Against the S3 server: a writer SIGKILLed mid-entry leaves nothing visible (the next read GETs the object,
    and then it is whole in the cache); two processes filling one folder at once read right and leave each entry
    once; with room for three entries a fourth evicts the least recently used, and the total stays in bounds."""
    import os
    import signal
    import time

    objects = _objects(s3_client, bucket)
    uris = list(objects)
    with FaultFront(moto_server, lambda *_: None) as front:
        root = str(tmp_path / "killed")
        ready = _fork().Event()
        child = _fork().Process(target=_killed_writer, args=(front.url, root, uris[0], objects[uris[0]][0], ready))
        child.start()
        assert ready.wait(30)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert len(os.listdir(Path(root, "tmp"))) == 1 and not list(Path(root, "entries").rglob("*-*"))
        storage, before = _s3_cached(front.url, root), len(front.requests)
        assert b"".join(storage.stream(uris[0], etag=objects[uris[0]][0])) == objects[uris[0]][1]
        assert [m for m, _, _ in front.requests[before:]] == ["GET"] and os.listdir(Path(root, "tmp")) == []
        assert b"".join(storage.stream(uris[0], etag=objects[uris[0]][0])) == objects[uris[0]][1]
        assert len(front.requests) == before + 1  # whole in the cache now

        root = str(tmp_path / "shared")
        before = len(front.requests)
        with _fork().Pool(2) as pool:
            results = pool.starmap(_fill, [(front.url, root, objects, 1), (front.url, root, objects, 2)])
        assert all(all(r) for r in results)
        assert len(front.requests) - before <= 2 * 2 * len(uris)  # each range fetched by at most both processes
        entries = [p for p in Path(root, "entries").rglob("*") if p.is_file()]
        assert len(entries) == 2 * len(uris) and os.listdir(Path(root, "tmp")) == []

        probe = _s3_cached(front.url, str(tmp_path / "probe"))
        probe.read_range(uris[0], 0, 20_000, etag=objects[uris[0]][0])
        size = probe.cache.info()["bytes"]  # one entry on disk, its header included
        storage = _s3_cached(front.url, str(tmp_path / "lru"), max_bytes=int(3.5 * size))
        for u in uris[:3] + uris[:1] + uris[3:4]:  # 0, 1, 2, then 0 again (a hit: recent), then 3
            storage.read_range(u, 0, 20_000, etag=objects[u][0])
            time.sleep(0.02)
        assert storage.counts.take()["evictions"] == 1
        cache = storage.cache
        assert cache.get(uris[1], objects[uris[1]][0], 0, 20_000) is None  # the least recently used went
        assert all(cache.get(u, objects[u][0], 0, 20_000) is not None for u in (uris[0], uris[2], uris[3]))
        assert cache.info()["bytes"] <= cache.max_bytes


def test_entries_are_keyed_by_the_stores_endpoint(moto_server, s3_client, bucket, tmp_path):
    """One object (same bucket, key and etag) read through two endpoints into one cache folder: each endpoint
    gets an entry of its own and its own GET (the cache never answers one endpoint from the other's bytes),
    and S3Storage.identity is the endpoint URL."""
    from raydl.storage.cache import CachedStorage, NodeCache
    from raydl.storage.s3 import S3Storage

    objects = _objects(s3_client, bucket, n=1)
    (uri, (etag, body)), = objects.items()
    root = str(tmp_path / "cache")
    with FaultFront(moto_server, lambda *_: None) as a, FaultFront(moto_server, lambda *_: None) as b:
        stores = [S3Storage(raydl.S3Options(endpoint_url=f.url + "/")) for f in (a, b)]
        for _ in range(2):
            for store in stores:
                assert CachedStorage(store, NodeCache(root, 1 << 20)).read_range(uri, 0, 100, etag=etag) == body[:100]
        assert [m for m, _, _ in a.requests] == ["GET"] and [m for m, _, _ in b.requests] == ["GET"]
    assert len([p for p in Path(root, "entries").rglob("*") if p.is_file()]) == 2
    assert [s.identity for s in stores] == [a.url, b.url]
