"""What a reader asks of a node cache (uses_plans, scoped, plan, flush, take_cache_counts) and with_node_cache:
every storage answers alike, a storage without a cache with its defaults, CachedStorage with its own."""
from __future__ import annotations

import os

import pytest

from raydl.options import Cache, S3Options
from raydl.storage import LocalStorage
from raydl.storage.base import BaseStorage
from raydl.storage.cache import (
    COUNTERS,
    CachedStorage,
    NodeCache,
    check_cache_folder,
    node_cache,
    wants_cache,
    with_node_cache,
)
from raydl.storage.s3 import S3Storage

from counting_storage import CountingStorage

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def blob(tmp_path):
    """One 'remote object' (a real file) of 10 KB."""
    path = tmp_path / "blob"
    path.write_bytes(bytes(i % 251 for i in range(10_000)))
    return str(path)


def _entries(root) -> list[str]:
    return sorted(str(p) for p in (root / "entries").rglob("*") if p.is_file())


@pytest.mark.parametrize("storage", [LocalStorage(), S3Storage(S3Options()), CountingStorage()],
                         ids=["local", "s3", "stand-in"])
def test_a_storage_without_a_cache_answers_the_hooks_with_its_defaults(storage):
    """scoped() is the storage itself (behind or not), plan() and flush() do nothing, and there are no
    counters to take: {} every time."""
    assert isinstance(storage, BaseStorage) and storage.uses_plans is False
    assert storage.scoped() is storage and storage.scoped(behind=True) is storage
    assert storage.plan("s3://b/k", 0, 100, [(0, 10), (50, 50)]) is None
    assert storage.flush() is None
    assert storage.take_cache_counts() == {} and storage.take_cache_counts() == {}


def test_a_plan_on_a_storage_without_a_cache_leaves_its_reads_alone(blob):
    """A planned read of local disk reads the block as one range, as an unplanned one does."""
    storage = CountingStorage()
    storage.plan(blob, 0, 1000, [(0, 100), (500, 500)])
    assert storage.read_range(blob, 0, 1000, etag="e1") == open(blob, "rb").read()[:1000]
    assert storage.reads == [(blob, 0, 1000)]


def test_with_node_cache_wraps_only_where_caching_applies(tmp_path):
    """No Cache, or local disk: the storage itself. A remote store with a Cache: a CachedStorage around it
    on this process's NodeCache of that folder and size."""
    local, s3 = LocalStorage(), S3Storage(S3Options())
    cache = Cache(str(tmp_path / "cache"), max_bytes=1 << 20)
    assert with_node_cache(local, None) is local and with_node_cache(s3, None) is s3
    assert not wants_cache(local) and with_node_cache(local, cache) is local
    wrapped = with_node_cache(s3, cache)
    assert isinstance(wrapped, CachedStorage) and wrapped.inner is s3
    assert wrapped.cache is node_cache(cache.path, cache.max_bytes)
    assert wrapped.default_io_concurrency == s3.default_io_concurrency


def test_cached_scopes_count_apart_and_take_starts_again_from_zero(tmp_path, blob):
    """scoped() shares the store and the cache but not the counters; take_cache_counts() gives every
    counter of that scope once, then zeros."""
    inner = CountingStorage()
    storage = CachedStorage(inner, NodeCache(str(tmp_path / "cache"), 1 << 20))
    batch = storage.scoped()
    assert isinstance(batch, CachedStorage) and batch is not storage
    assert (batch.inner, batch.cache) == (inner, storage.cache)
    storage.read_range(blob, 0, 1000, etag="e1")  # the worker's own read (a footer, an index block)
    batch.read_range(blob, 0, 1000, etag="e1")
    mine, shared = batch.take_cache_counts(), storage.take_cache_counts()
    assert set(mine) == set(shared) == set(COUNTERS)
    assert (mine["hits"], mine["misses"], mine["bytes_from_cache"]) == (1, 0, 1000)
    assert (shared["hits"], shared["misses"], shared["bytes_from_store"]) == (0, 1, 1000)
    assert batch.take_cache_counts() == dict.fromkeys(COUNTERS, 0) == storage.take_cache_counts()


def test_a_cached_scope_behind_writes_its_misses_by_the_flush(tmp_path, blob):
    """scoped(behind=True) hands a miss's bytes on at once and writes its entry on the writer threads;
    after flush() the entry is on disk and the next read is a hit."""
    inner = CountingStorage()
    storage = CachedStorage(inner, NodeCache(str(tmp_path / "cache"), 1 << 20))
    batch = storage.scoped(behind=True)
    assert batch.read_range(blob, 0, 2000, etag="e1") == open(blob, "rb").read()[:2000]
    batch.flush()
    assert len(_entries(tmp_path / "cache")) == 1 and not os.listdir(tmp_path / "cache" / "tmp")
    assert batch.read_range(blob, 0, 2000, etag="e1") == open(blob, "rb").read()[:2000]
    counts = batch.take_cache_counts()
    assert (counts["misses"], counts["hits"]) == (1, 1) and len(inner.reads) == 1
    batch.flush()  # nothing pending: returns at once


def test_a_cached_plan_keeps_a_block_as_its_pieces(tmp_path, blob):
    """A planned read is one request to the store, kept as its pieces; each piece alone is a hit later."""
    inner = CountingStorage()
    storage = CachedStorage(inner, NodeCache(str(tmp_path / "cache"), 1 << 20))
    assert storage.uses_plans is True and storage.scoped(behind=True).uses_plans is True
    storage.plan(blob, 0, 3000, [(0, 1000), (2000, 1000)])
    assert storage.read_range(blob, 0, 3000, etag="e1") == open(blob, "rb").read()[:3000]
    assert inner.reads == [(blob, 0, 3000)] and len(_entries(tmp_path / "cache")) == 2
    assert storage.read_range(blob, 2000, 1000, etag="e1") == open(blob, "rb").read()[2000:3000]
    assert len(inner.reads) == 1 and storage.take_cache_counts()["hits"] == 1


def test_the_cache_folder_check_is_still_importable_from_the_cache_module(tmp_path):
    """check_cache_folder, re-exported by raydl.storage.cache, makes the folder and leaves no probe."""
    check_cache_folder(str(tmp_path / "c"))
    assert sorted(os.listdir(tmp_path / "c")) == ["entries", "tmp"] and os.listdir(tmp_path / "c" / "tmp") == []
