"""Parquet rows of number, label, array and list columns, gathered a batch at a time from decoded row groups
(ParquetSource.read_batch): the same rows as pyarrow reads and as the per-sample path makes, each row group
decoded once an epoch in the shuffled order, the shuffle window sized to the row-group cache, and the next
row groups of an ordered read decoded ahead. No Ray."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydl
import raydl.sources._parquet_source as ps
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.describe.records import compile_pipeline
from raydl.errors import ObjectChangedError
from raydl.plan.order import WindowedOrder, augmentation_seeds
from raydl.sources._parquet_source import BoundedLRU, clear_caches, decodes, window_for

pytestmark = pytest.mark.timeout(60)

WIDTH = 16


def _table(start: int, n: int, *, ragged: bool = False) -> pa.Table:
    ids = np.arange(start, start + n)
    widths = (ids % 5 + 1) if ragged else np.full(n, WIDTH)
    offsets = np.concatenate([[0], np.cumsum(widths)]).astype(np.int32)
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32) + start))
    emb = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.float32) / 2), 4)
    return pa.table({"tokens": tokens, "emb": emb, "n": ids.astype(np.int64), "y": (ids % 7).astype(np.int32)})


@pytest.fixture
def data(tmp_path):
    """Three files of 130, 70 and 100 rows in row groups of 32 rows (the last of each file shorter)."""
    start = 0
    for k, n in enumerate((130, 70, 100)):
        pq.write_table(_table(start, n), tmp_path / f"part-{k}.parquet", row_group_size=32)
        start += n
    clear_caches()
    yield tmp_path
    clear_caches()


def _run(ds, order, *, batch=25, per_sample=False, on_error="skip"):
    """Every batch of `order` made by one LoaderWorker in this process, one after the other."""
    stages = ds.map(lambda r: r).stages if per_sample else ds.stages  # a per-sample stage: the per-sample path
    pipe = compile_pipeline(stages)
    spec = WorkerSpec(program=None, threads=2, on_error=on_error, sample_stages=pipe.sample_stages)
    worker = LoaderWorker(spec, ds.catalog, reuse_buffers=False)
    out = []
    for k in range(0, len(order), batch):
        ids = np.asarray(order[k : k + batch], np.int64)
        task = BatchTask(rank=0, epoch=0, index=k // batch, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0))
        out.append(worker.run_batch(task))
    return out


def _shuffled(cat, window=None):
    return np.asarray(
        WindowedOrder(cat.column("count"), window or cat.source.shuffle_window, seed=3, epoch=0,
                      fingerprint=cat.fingerprint)
    )


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_hold_pyarrows_rows_each_once(data, shuffle):
    """Ordered and shuffled, every row of the table arrives exactly once an epoch, each field equal to
    pyarrow's read of that row, and each batch equal to the one the per-sample path makes."""
    ds = raydl.read_parquet(str(data) + "/", columns=["tokens", "emb", "n"], label_column="y")
    assert ds.catalog.source.reads_plain_batches
    table = pa.concat_tables([pq.read_table(data / f"part-{k}.parquet") for k in range(3)])
    want = {c: table.column(c).to_pylist() for c in table.column_names}
    order = _shuffled(ds.catalog) if shuffle else np.arange(len(ds.catalog))
    results = _run(ds, order)
    seen = np.concatenate([r.batch["id"] for r in results])
    assert sorted(seen.tolist()) == list(range(300)) and seen.tolist() == order.tolist()
    for r in results:
        b = r.batch
        assert b["tokens"].shape == (len(b["id"]), WIDTH) and b["tokens"].dtype == np.int32
        assert b["emb"].shape == (len(b["id"]), 4) and b["emb"].dtype == np.float32
        assert b["n"].dtype == np.int64 and b["label"].dtype == np.int64
        for k, i in enumerate(b["id"].tolist()):
            assert b["tokens"][k].tolist() == want["tokens"][i] and b["emb"][k].tolist() == want["emb"][i]
            assert b["n"][k] == want["n"][i] == i and b["label"][k] == want["y"][i]
    clear_caches()
    for fast, slow in zip(results, _run(ds, order, per_sample=True), strict=True):
        assert fast.batch.keys() == slow.batch.keys() and fast.batch["key"] == slow.batch["key"]
        for name in ("id", "tokens", "emb", "n", "label"):
            assert fast.batch[name].dtype == slow.batch[name].dtype
            np.testing.assert_array_equal(fast.batch[name], slow.batch[name])


def test_lists_of_several_lengths_are_views_as_the_per_sample_path_makes_them(tmp_path):
    """A list column whose rows differ in length is an object array of each row's values."""
    pq.write_table(_table(0, 40, ragged=True), tmp_path / "r.parquet", row_group_size=16)
    ds = raydl.read_parquet(str(tmp_path / "r.parquet"), columns=["tokens"])
    clear_caches()
    (fast,) = _run(ds, np.arange(40)[::-1], batch=40)
    (slow,) = _run(ds, np.arange(40)[::-1], batch=40, per_sample=True)
    want = pq.read_table(tmp_path / "r.parquet").column("tokens").to_pylist()
    assert fast.batch["tokens"].dtype == object == slow.batch["tokens"].dtype
    assert [a.tolist() for a in fast.batch["tokens"]] == [want[i] for i in range(40)[::-1]]
    assert [a.tolist() for a in slow.batch["tokens"]] == [a.tolist() for a in fast.batch["tokens"]]


def test_the_shuffle_window_fits_the_row_group_cache(data, monkeypatch):
    """The default window, in row groups, is half of what the cache holds, so that the next window's row
    groups fit beside it, by the footers' estimate of a row group decoded, which is at least what a decoded
    row group holds."""
    cat = raydl.read_parquet(str(data) + "/").catalog
    source = cat.source
    assert len(source.read_batch(cat, cat.storage, np.arange(32))["n"]) == 32
    held = max(v.nbytes for v in ps._row_groups._items.values())
    assert 0 < held <= source.row_group_bytes
    for cache in (source.row_group_bytes * k + k for k in (1, 3, 4, 7, 40, 10_000)):
        monkeypatch.setattr(ps, "CACHE_ROW_GROUP_BYTES", cache)
        window = window_for(source.row_group_bytes)
        assert window >= 1 and window <= ps.MAX_WINDOW
        if window > 1:
            assert 2 * window * source.row_group_bytes <= cache
            assert window == min(ps.MAX_WINDOW, ps.held(source.row_group_bytes) // 2)
    assert window_for(0) == ps.MAX_WINDOW
    assert window_for(ps.CACHE_ROW_GROUP_BYTES) == 1  # a row group as large as the cache: one at a time


def test_a_shuffled_epoch_decodes_each_row_group_once(data, monkeypatch):
    """With a cache that holds 4 row groups, the default window (2) decodes each row group once an epoch in
    the shuffled order; the 16-row-group window that does not fit decodes some again and again."""
    ds = raydl.read_parquet(str(data) + "/")
    rg = ds.catalog.source.row_group_bytes
    monkeypatch.setattr(ps, "CACHE_ROW_GROUP_BYTES", 4 * rg + 1)
    monkeypatch.setattr(ps, "_row_groups", BoundedLRU(64, 4 * rg + 1, size=lambda v: v.nbytes))
    assert ds.catalog.source.shuffle_window == 2
    clear_caches()
    _run(ds, _shuffled(ds.catalog))
    counts = decodes()
    assert len(counts) == ds.catalog.num_parts and max(counts.values()) == 1
    clear_caches()
    _run(ds, _shuffled(ds.catalog, window=16))
    assert max(decodes().values()) > 1


def test_an_ordered_read_decodes_the_next_row_groups_ahead(data):
    """A batch of consecutive rows in row group 0 starts the decode of row groups 1 and 2, which no batch
    has asked for yet."""
    cat = raydl.read_parquet(str(data) + "/").catalog
    cat.source.read_batch(cat, cat.storage, np.arange(10))
    deadline = time.monotonic() + 20
    while len(decodes()) < 1 + ps.PREFETCH_ROW_GROUPS and time.monotonic() < deadline:
        time.sleep(0.01)
    first = str(data / "part-0.parquet")
    assert decodes() == {(first, 0): 1, (first, 1): 1, (first, 2): 1}  # 1 and 2 ahead of need
    cat.source.read_batch(cat, cat.storage, np.arange(32, 64))  # row group 1: decoded already
    assert decodes()[(first, 1)] == 1


def test_a_shuffled_read_decodes_the_next_windows_row_groups_ahead_once(data, monkeypatch):
    """Rows `ahead` (a later batch's, BatchTask.ahead) start the decode of their row groups behind the batch's
    own, as many as the cache holds beside those, each once however often it is named; the epoch still
    decodes every row group once, and its batches are the same as without the hints."""
    ds = raydl.read_parquet(str(data) + "/")
    cat = ds.catalog
    rg = cat.source.row_group_bytes
    monkeypatch.setattr(ps, "CACHE_ROW_GROUP_BYTES", 4 * rg + 1)
    monkeypatch.setattr(ps, "_row_groups", BoundedLRU(64, 4 * rg + 1, size=lambda v: v.nbytes))
    assert cat.source.reads_ahead and cat.source.shuffle_window == 2
    order = _shuffled(cat)
    parts = cat.locate(order)[0]
    first = np.unique(parts[:10]).tolist()  # the batch's own row groups
    later = [p for p in dict.fromkeys(parts[64:].tolist()) if p not in first][:3]
    ahead = np.concatenate([np.flatnonzero(np.isin(cat.locate(np.arange(len(cat)))[0], p))[:1] for p in later])
    clear_caches()
    for _ in range(3):  # named again and again: read ahead once
        cat.source.read_batch(cat, cat.storage, order[:10], ahead)
    deadline = time.monotonic() + 20
    while len(decodes()) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    got = decodes()

    def key(p):
        return cat.shards.column("uri")[int(cat.column("shard")[p])].as_py(), int(cat.column("rg")[p])

    room = 4 - len(first)  # the cache holds 4: the batch's own, then as many of the 3 ahead as fit
    assert max(got.values()) == 1 and len(got) == len(first) + min(3, room) == 4
    assert {key(p) for p in first} <= got.keys()
    assert len({key(p) for p in later} & got.keys()) == min(3, room)
    clear_caches()
    worker_order = [order[k : k + 25] for k in range(0, len(order), 25)]
    plain = [cat.source.read_batch(cat, cat.storage, ids) for ids in worker_order]
    clear_caches()
    hinted = [
        cat.source.read_batch(cat, cat.storage, ids, worker_order[min(i + 2, len(worker_order) - 1)])
        for i, ids in enumerate(worker_order)
    ]
    assert max(decodes().values()) == 1
    for a, b in zip(plain, hinted, strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a if k != "key")


def test_row_groups_read_ahead_are_read_through_the_batchs_storage(data):
    """The reads ahead go through the storage the batch reads through (in a scope of their own), not the
    catalog's: with a node cache, their row groups' bytes are kept there as the batch's own are, and a
    later loader's epoch makes no request to the store."""
    from counting_storage import CountingStorage

    cat = raydl.read_parquet(str(data) + "/").catalog
    storage = CountingStorage()
    order = _shuffled(cat, window=2)
    parts = cat.locate(order)[0]
    own = np.unique(parts[:10]).tolist()
    later = [p for p in dict.fromkeys(parts[64:].tolist()) if p not in own][:2]
    ahead = np.concatenate([np.flatnonzero(cat.locate(np.arange(len(cat)))[0] == p)[:1] for p in later])
    clear_caches()
    cat.source.read_batch(cat, storage, order[:10], ahead)
    deadline = time.monotonic() + 20
    while len(decodes()) < len(own) + len(later) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(decodes()) == len(storage.reads) == len(own) + len(later)  # one read a row group, all here


def test_a_batch_waits_for_its_row_groups_read_ahead_instead_of_queueing_another(data, monkeypatch):
    """A batch whose row group is being read ahead waits for that read: a second decode job of its own would
    hold a decode thread waiting on the first, and the row groups queued behind it would wait too."""
    from counting_storage import CountingStorage

    cat = raydl.read_parquet(str(data) + "/").catalog
    parts = cat.locate(np.arange(len(cat)))[0]
    rows = np.flatnonzero(parts == 1)[:5]
    calls = []
    decoded = ps.ParquetSource._decoded

    def counted(self, read, storage):
        calls.append((read.uri.rsplit("/", 1)[-1], read.rg))
        return decoded(self, read, storage)

    monkeypatch.setattr(ps.ParquetSource, "_decoded", counted)
    clear_caches()
    cat.source._queue_ahead(cat, CountingStorage(delay_s=1.0), 1)  # in flight for a second
    batch = cat.source.read_batch(cat, cat.storage, rows)
    # part 1 is part-0.parquet's row group 1: the read ahead's decode, not a second job for it (the parts
    # after it are an ordered read's prefetch)
    assert calls.count(("part-0.parquet", 1)) == 1, calls
    assert max(decodes().values()) == 1
    clear_caches()
    again = cat.source.read_batch(cat, cat.storage, rows)
    assert np.array_equal(batch["tokens"], again["tokens"]) and batch["key"] == again["key"]


def test_a_read_ahead_of_other_columns_of_the_same_files_is_not_taken_for_a_batchs(data):
    """Tables of the same files that select other columns share a fingerprint: a batch never takes another
    selection's read ahead of its row group, whose values lack its columns."""
    from counting_storage import CountingStorage

    wide = raydl.read_parquet(str(data) + "/").catalog
    narrow = raydl.read_parquet(str(data) + "/", columns=["n"]).catalog
    assert wide.fingerprint == narrow.fingerprint and wide.source.selection.key != narrow.source.selection.key
    rows = np.flatnonzero(wide.locate(np.arange(len(wide)))[0] == 1)[:5]
    clear_caches()
    narrow.source._queue_ahead(narrow, CountingStorage(delay_s=1.0), 1)  # in flight for a second
    batch = wide.source.read_batch(wide, wide.storage, rows)
    assert batch["tokens"].shape == (5, WIDTH) and batch["n"].tolist() == rows.tolist()


def test_a_batch_with_a_changed_file_or_a_null_cell_is_settled_sample_by_sample(data, tmp_path):
    """read_batch fails on a file rewritten after listing and on a null cell; the worker then makes the batch
    sample by sample, where on_error settles just the rows at fault."""
    ds = raydl.read_parquet(str(data) + "/")
    pq.write_table(_table(200, 100), data / "part-2.parquet", row_group_size=10)
    clear_caches()
    (result,) = _run(ds, np.arange(180, 220), batch=40)
    assert result.batch["id"].tolist() == list(range(180, 200))
    assert len(result.unreadable) == 20 and all(f.error is ObjectChangedError for f in result.unreadable)

    t = _table(0, 8)
    emb = pa.array([[1.0] * 4 if i != 5 else None for i in range(8)], pa.list_(pa.float32(), 4))
    pq.write_table(t.set_column(1, "emb", emb), tmp_path / "null.parquet")
    nulls = raydl.read_parquet(str(tmp_path / "null.parquet"))
    (result,) = _run(nulls, np.arange(8), batch=8)
    assert result.batch["id"].tolist() == [0, 1, 2, 3, 4, 6, 7] and result.batch["tokens"].shape == (7, WIDTH)
    assert [f.sample_id for f in result.unreadable] == [5]


def test_image_columns_and_objects_are_read_sample_by_sample(tmp_path):
    """A selection with a string (or image) column is not gathered whole."""
    pq.write_table(pa.table({"n": [1, 2], "s": ["a", "b"]}), tmp_path / "s.parquet")
    assert not raydl.read_parquet(str(tmp_path / "s.parquet")).catalog.source.reads_plain_batches
    assert raydl.read_parquet(str(tmp_path / "s.parquet"), columns=["n"]).catalog.source.reads_plain_batches


def test_a_loader_worker_decodes_into_jemalloc_or_the_system_allocator(monkeypatch):
    """arrow_pool_for_decoding moves pyarrow off mimalloc, and leaves a pool named by
    ARROW_DEFAULT_MEMORY_POOL alone."""
    from raydl.util.memory import arrow_pool_for_decoding

    before = pa.default_memory_pool()
    try:
        assert arrow_pool_for_decoding() in ("jemalloc", "system")
        assert pa.default_memory_pool().backend_name in ("jemalloc", "system")
        pa.set_memory_pool(pa.mimalloc_memory_pool())
        monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "mimalloc")
        assert arrow_pool_for_decoding() == "mimalloc" == pa.default_memory_pool().backend_name
    finally:
        pa.set_memory_pool(before)


def test_a_batch_is_sized_by_its_rows_decoded_not_stored(tmp_path):
    """The object-store budget and the batches a task makes count a Parquet row at its decoded size, as
    the footers say (compressed, the same tokens take a fraction of it), and an image column leaves it to
    the images' decoded shapes."""
    from raydl.plan.build import _sample_bytes

    rows, width = 512, 1024
    tokens = np.zeros((rows, width), np.int32)  # compresses to almost nothing
    table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(tokens.ravel()), width)})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=128, compression="zstd")
    ds = raydl.read_parquet(str(tmp_path / "t.parquet"), columns=["input_ids"])
    got = _sample_bytes(ds.catalog, None)
    assert width * 4 <= got <= width * 4 * 1.1, got
    assert ds.catalog.source.sample_bytes == got


def test_decoding_row_groups_into_batches_leaves_pandas_unimported(data):
    """A process that lists and reads batches of list, fixed-size list and number columns, and a token
    corpus in Parquet, never imports pandas (pyarrow's `to_numpy` does: about half a second and 50 MiB in
    every worker and in the driver's first batches)."""
    code = f"""
import sys, numpy as np, raydl
cat = raydl.read_parquet({str(data)!r} + "/").catalog
batch = cat.source.read_batch(cat, cat.storage, np.arange(0, 300, 7))
assert len(batch["tokens"]) == len(batch["emb"]) == len(batch["n"]) == 43
ds = raydl.read_tokens({str(data)!r} + "/part-0.parquet", seq_len=8, column="tokens")
rows = ds.catalog.source.read_batch(ds.catalog, ds.catalog.storage, np.arange(4))
assert rows["input_ids"].shape == (4, 8)
print("pandas" in sys.modules)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
