"""A batch read through the node cache: what the cache holds is read first on few IO tasks, what it lacks goes
to the store on the IO pool's many; the pixels are those of a read without a cache either way."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pyarrow as pa
import pytest

import raydl
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.batch import run as batch_run
from raydl.describe.transforms import compile_stages
from raydl.options import Cache
from raydl.plan.order import augmentation_seeds
from raydl.storage.base import BaseStorage, NotCached
from raydl.storage.cache import HIT_IO_CONCURRENCY, CachedStorage, NodeCache

from counting_storage import CountingStorage

pytestmark = pytest.mark.timeout(60)

STORE_IO = 64  # the far store's IO threads, as S3's


@dataclasses.dataclass(frozen=True)
class FarStorage(BaseStorage):
    """Local files read as a remote store would be (many IO threads, a node cache applies), every read
    counted."""

    local: CountingStorage = dataclasses.field(default_factory=CountingStorage)

    default_io_concurrency: int = STORE_IO

    @property
    def identity(self) -> str:
        return "far-store"

    def list(self, prefix):
        return self.local.list(prefix)

    def stat(self, uri):
        return self.local.stat(uri)

    def read(self, uri):
        return self.local.read(uri)

    def read_range(self, uri, offset, length, *, etag=None):
        return self.local.read_range(uri, offset, length, etag=etag)

    def stream(self, uri, *, etag=None, chunk=8 << 20):
        return self.local.stream(uri, etag=etag, chunk=chunk)


def _task(ids, k=0):
    ids = np.asarray(ids, dtype=np.int64)
    return BatchTask(rank=0, epoch=0, index=k, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0))


@pytest.fixture
def far(image_folder, tmp_path):
    """(worker reading the image folder through a far store and a node cache, the store, a worker reading it
    from local disk)."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    program = compile_stages(ds.stages)
    store = FarStorage()
    shards = ds.catalog.shards
    etags = pa.array([f"etag{i}" for i in range(shards.num_rows)])
    catalog = dataclasses.replace(
        ds.catalog, storage=store, shards=shards.set_column(shards.schema.get_field_index("etag"), "etag", etags)
    )
    cache = Cache(str(tmp_path / "cache"), max_bytes=64 << 20)
    cached = LoaderWorker(WorkerSpec(program=program, threads=2, cache=cache), catalog)
    plain = LoaderWorker(WorkerSpec(program=program, threads=2), ds.catalog)
    return cached, store, plain


@pytest.fixture
def io_tasks(monkeypatch):
    """The IO tasks the batches submit, by step name ("fetch", "fetch_hits")."""
    seen: list[str] = []
    lock = threading.Lock()
    submit = batch_run.BatchRun._submit_io

    def counted(self, fn, *args, **kw):
        with lock:
            seen.append(fn.__name__)
        return submit(self, fn, *args, **kw)

    monkeypatch.setattr(batch_run.BatchRun, "_submit_io", counted)
    return seen


def test_a_cached_batch_reads_its_hits_on_few_io_tasks_and_the_store_never(far, io_tasks):
    """Epoch 1 reads every image from the store, one IO task each (the store's many threads); the same batch
    again is all hits, read on as many tasks as local disk's reads take, with no request to the store, and
    the same pixels as a read without a cache."""
    cached, store, plain = far
    ids = list(range(32))
    want = plain.run_batch(_task(ids)).batch["image"]
    io_tasks.clear()
    first = cached.run_batch(_task(ids)).batch["image"]
    assert np.array_equal(first, want)
    assert len(store.local.reads) == 32
    assert io_tasks.count("fetch") == 32  # each miss on a task of its own: 32 blocks < 4 x 64 tasks
    io_tasks.clear()
    again = cached.run_batch(_task(ids, 1)).batch["image"]
    assert np.array_equal(again, want)
    assert len(store.local.reads) == 32  # no request to the store
    assert io_tasks == ["fetch_hits"] * HIT_IO_CONCURRENCY  # one task a thread: a hit has no wait to hide


def test_a_partly_cached_batch_reads_only_what_the_cache_lacks_from_the_store(far, io_tasks):
    """Half the batch cached: its other half goes to the store, each missing image once, and every slot
    holds the pixels a read without a cache gives."""
    cached, store, plain = far
    cached.run_batch(_task(range(0, 32, 2)))
    assert len(store.local.reads) == 16
    ids = list(range(32))
    want = plain.run_batch(_task(ids, 1)).batch["image"]
    io_tasks.clear()
    got = cached.run_batch(_task(ids, 1)).batch["image"]
    assert np.array_equal(got, want)
    read = sorted(uri for uri, _o, _n in store.local.reads[16:])
    uris = cached.members[0]._shard_uris.take(np.arange(32))
    assert read == sorted(uris[i] for i in range(1, 32, 2))
    assert io_tasks.count("fetch") == 16 and io_tasks.count("fetch_hits") == HIT_IO_CONCURRENCY


def test_a_batch_waits_for_the_store_reads_its_cache_lookups_submitted(image_folder, tmp_path, far):
    """The store's reads, submitted by the cache lookups that found their blocks missing, end after every
    lookup task has: the batch still returns only once they have all landed and been decoded."""
    _cached, _store, plain = far
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    slow = FarStorage(CountingStorage(delay_s=0.2))
    shards = ds.catalog.shards
    etags = pa.array([f"etag{i}" for i in range(shards.num_rows)])
    catalog = dataclasses.replace(
        ds.catalog, storage=slow, shards=shards.set_column(shards.schema.get_field_index("etag"), "etag", etags)
    )
    spec = WorkerSpec(program=compile_stages(ds.stages), threads=2, cache=Cache(str(tmp_path / "c2"), 64 << 20))
    ids = list(range(20))
    got = LoaderWorker(spec, catalog).run_batch(_task(ids))
    assert not got.skipped and not got.unreadable and np.array_equal(got.batch["image"], plain.run_batch(_task(ids)).batch["image"])
    assert len(slow.local.reads) == 20


def test_the_hits_only_view_serves_hits_and_refuses_the_rest_without_a_request(tmp_path):
    """hits_only(): a kept range is served and counted in its scope; a range not kept, or one without an etag,
    or a whole-object read raises NotCached with no request to the store and nothing counted; its reads are
    local disk's, so its concurrency is too. A storage without a cache has no such view."""
    blob = tmp_path / "blob"
    blob.write_bytes(bytes(i % 251 for i in range(10_000)))
    blob = str(blob)
    inner = CountingStorage()
    assert inner.hits_only() is None and FarStorage().hits_only() is None
    scope = CachedStorage(inner, NodeCache(str(tmp_path / "cache"), 1 << 20)).scoped()
    scope.read_range(blob, 0, 1000, etag="e1")
    scope.take_cache_counts()
    hits = scope.hits_only()
    assert hits.default_io_concurrency == HIT_IO_CONCURRENCY and hits.uses_plans
    assert hits.read_range(blob, 0, 1000, etag="e1") == open(blob, "rb").read()[:1000]
    for read in (
        lambda: hits.read_range(blob, 1000, 1000, etag="e1"),
        lambda: hits.read_range(blob, 0, 1000, etag="e2"),
        lambda: hits.read_range(blob, 0, 1000),
        lambda: hits.read(blob),
    ):
        with pytest.raises(NotCached):
            read()
    hits.plan(blob, 0, 3000, [(0, 1000), (2000, 1000)])  # one piece kept, one not: the whole block is a miss
    with pytest.raises(NotCached):
        hits.read_range(blob, 0, 3000, etag="e1")
    assert len(inner.reads) == 1
    counts = scope.take_cache_counts()
    assert (counts["hits"], counts["misses"], counts["bytes_from_store"]) == (1, 0, 0)


@pytest.fixture
def far_shard(image_folder, tmp_path):
    """(worker reading one WebDataset shard of 24 samples through a far store and a node cache, the store, a
    worker reading the shard from local disk, the cache folder)."""
    import io
    import tarfile

    files = sorted(p for p in image_folder.rglob("*.jpg"))[:24]
    shard = tmp_path / "shard-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for i, path in enumerate(files):
            for name, payload in ((f"s{i:03d}.jpg", path.read_bytes()), (f"s{i:03d}.cls", str(i % 4).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    ds = raydl.read_webdataset(str(shard)).decode().center_crop(16)
    program = compile_stages(ds.stages)
    store = FarStorage()
    shards = ds.catalog.shards
    catalog = dataclasses.replace(
        ds.catalog,
        storage=store,
        shards=shards.set_column(shards.schema.get_field_index("etag"), "etag", pa.array(["etag0"])),
    )
    cache = Cache(str(tmp_path / "cache"), max_bytes=64 << 20)
    cached = LoaderWorker(WorkerSpec(program=program, threads=2, cache=cache), catalog)
    plain = LoaderWorker(WorkerSpec(program=program, threads=2), ds.catalog)
    return cached, store, plain, tmp_path / "cache"


def test_a_block_of_neighbouring_samples_is_read_from_the_cache_sample_by_sample(far_shard):
    """24 neighbours of one shard are one block: one request to the store, kept as 24 entries; read again,
    each sample comes from its own entry with no request; with one entry gone the block is read from the
    store again in one request. Every time, the pixels of a read without a cache."""
    cached, store, plain, folder = far_shard
    ids = list(range(24))
    want = plain.run_batch(_task(ids)).batch["image"]
    assert np.array_equal(cached.run_batch(_task(ids)).batch["image"], want)
    # the worker's index of the shard (one streamed read of it whole), then the block, in one request
    assert len(store.local.reads) == 2 and store.local.reads[1][1] > 0
    block = store.local.reads[1]
    entries = sorted(p for p in (folder / "entries").rglob("*") if p.is_file())
    assert len(entries) == 24 + 1  # the samples' ranges, and the index's streamed read
    result = cached.run_batch(_task(ids, 1))
    assert np.array_equal(result.batch["image"], want) and len(store.local.reads) == 2
    assert result.cache["hits"] == 24 and result.cache["misses"] == 0
    next(p for p in entries if p.stat().st_size < 100_000).unlink()  # a sample's entry, not the shard's
    assert np.array_equal(cached.run_batch(_task(ids, 2)).batch["image"], want)
    assert store.local.reads[2:] == [block]
