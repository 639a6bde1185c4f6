"""Parquet: a catalog of row groups from one read of each footer; the worker reads footers and the selected
chunks (images and labels here; every kind of column in test_parquet_fields.py); bad columns."""
from __future__ import annotations

import dataclasses
import io
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import raydl
import raydl.sources.parquet as parquet
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.describe.transforms import compile_stages
from raydl.plan.order import augmentation_seeds
from raydl.sources.parquet import PARTS_COLUMNS, catalog_from_row_counts, clear_caches, list_parquet
from raydl.storage import LocalStorage, ObjectInfo
from raydl.storage.fetch import coalesce

from counting_storage import CountingStorage  # beside this file

pytestmark = pytest.mark.timeout(60)


def png(i: int) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.full((4 + i % 5, 6, 3), i, np.uint8)).save(b, "PNG")
    return b.getvalue()



@pytest.fixture
def files(tmp_path):
    images = [png(i) for i in range(60)]
    rng = np.random.default_rng(0)  # incompressible "other" column, wider than the coalescing gap per row group
    t = pa.table({"n": np.arange(60), "caption": [rng.bytes(10_000) for i in range(60)], "img": images,
                  "y": (np.arange(60) % 7).astype(np.int32)})
    pq.write_table(t.slice(0, 40), tmp_path / "a.parquet", row_group_size=16)
    pq.write_table(t.slice(40), tmp_path / "b.parquet", row_group_size=8, use_dictionary=False, compression="zstd")
    return tmp_path, images


def _rows(cat, storage):
    """Every sample's (image bytes, label), fetched as the worker fetches them: coalesced ranges, then cut."""
    loc = cat.samples()
    assert not loc.errors, loc.errors
    t = loc.to_pydict()
    sh = cat.shards.to_pydict()
    ranges = list(zip(t["shard"], t["offset"], t["length"], strict=True))
    out = [None] * len(ranges)
    for b in coalesce(ranges, max_gap=0):  # no merging across row groups: count chunk fetches
        info = ObjectInfo(sh["uri"][b.shard], sh["size"][b.shard], sh["etag"][b.shard])
        data = cat.source.read_block(storage, info, b.offset, b.length)
        for i in b.members:
            start = t["offset"][i] - b.offset
            rec = cat.source.cut(loc, i, data[start:start + t["length"][i]])
            out[i] = (rec["image"], rec["label"])
    return out


def _worker(ds, storage, ids):
    """One batch of `ids` made by a LoaderWorker in this process, reading through `storage`."""
    clear_caches()  # a fresh worker process: no footer or row group read yet
    spec = WorkerSpec(program=compile_stages(ds.decode().center_crop(4).stages), threads=2)
    worker = LoaderWorker(spec, dataclasses.replace(ds.catalog, storage=storage), reuse_buffers=False)
    ids = np.asarray(ids, np.int64)
    return worker.run_batch(BatchTask(rank=0, epoch=0, index=0, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0)))


def test_the_catalog_is_one_part_per_row_group(files):
    """One catalog part per row group (file, rows, row group, the selected chunks' span: 40 bytes): no per-row
    array on the driver; keys, rows and labels are made where the samples are located and read; the columns
    selected do not change the order of samples (the span is in neither fingerprint)."""
    root, images = files
    cat = raydl.read_parquet(str(root) + "/", image_column="img", label_column="y").catalog
    assert len(cat) == 60 and cat.num_parts == 6 and cat.parts.column_names == list(PARTS_COLUMNS)
    assert cat.column("count").tolist() == [16, 16, 8, 8, 8, 4] and cat.column("rg").tolist() == [0, 1, 2, 0, 1, 2]
    assert cat.parts.nbytes + cat.starts.nbytes <= 48 * 6 + 8  # 40 bytes a row group and its start, whatever the columns
    t = cat.samples().to_pydict()
    assert t["row"] == [r % 16 for r in range(40)] + [r % 8 for r in range(20)]
    assert t["shard"] == [0] * 40 + [1] * 20
    assert t["key"][17] == "a.parquet#1:1" and t["key"][45] == "b.parquet#0:5"
    assert _rows(cat, LocalStorage()) == [(im, i % 7) for i, im in enumerate(images)]
    narrow = raydl.read_parquet(str(root) + "/", columns=["n"]).catalog
    assert narrow.fingerprint == cat.fingerprint and narrow.column("length").tolist() != cat.column("length").tolist()
    copy = root / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("copy"))
    again = raydl.read_parquet(str(copy) + "/", image_column="img", label_column="y").catalog
    assert again.samples_fingerprint == cat.samples_fingerprint  # the same files: the same shuffle, resumable


def test_listing_reads_each_footer_once_in_parallel_and_no_column_chunk(files, monkeypatch):
    """Listing makes one request per file (its tail, footer included), several files at once; with a first
    guess smaller than the footer (then two reads), none of those reads touches an image or label chunk."""
    root, _ = files
    paths = [str(root / "a.parquet"), str(root / "b.parquet")] * 8

    class InFlight(CountingStorage):
        def read_range(self, uri, offset, length, *, etag=None):
            with self.lock:
                self.now = getattr(self, "now", 0) + 1
                object.__setattr__(self, "most", max(getattr(self, "most", 0), self.now))
            try:
                return super().read_range(uri, offset, length, etag=etag)
            finally:
                with self.lock:
                    self.now -= 1

    storage = InFlight(delay_s=0.05)
    cat = list_parquet(paths, storage=storage, image_column="img", label_column="y")
    assert len(storage.reads) == len(paths) and storage.most > 1
    monkeypatch.setattr(parquet, "_TAIL", 16)
    for path in paths[:2]:  # one at a time: listing's guess grows to the largest footer it has met
        storage = CountingStorage()
        cat = list_parquet(path, storage=storage, image_column="img", label_column="y")
        chunks = list(zip(cat.column("offset").tolist(), cat.column("length").tolist(), strict=True))  # the chunks' spans
        assert len(storage.reads) == 2  # 16 bytes, then the footer
        for _, off, n in storage.reads:
            assert not any(off < o + m and o < off + n for o, m in chunks), (path, off, n)


def test_row_group_reads_give_every_image_and_fetch_each_chunk_once(files):
    """A batch's rows fetch their row group's image chunk once (not the columns left out) and cut out the exact
    bytes."""
    root, images = files
    cat = raydl.read_parquet([str(root / "a.parquet"), str(root / "b.parquet")], columns=["img"],
                             image_column="img").catalog
    storage = CountingStorage()
    assert [im for im, _ in _rows(cat, storage)] == images
    assert len(storage.reads) == 6  # one per row group
    assert sum(n for _, _, n in storage.reads) < 60 * 10_000  # the caption column was never read


def test_labels_arrive_in_batches_read_by_the_worker(files):
    """The worker reads each file's footer once and each row group's image and label chunks in one request
    (adjacent chunks share a range); the batch's labels and keys are the rows'."""
    root, _ = files
    ds = raydl.read_parquet(str(root) + "/", columns=[], image_column="img", label_column="y")
    storage = CountingStorage()
    ids = np.random.default_rng(1).permutation(60)
    result = _worker(ds, storage, ids)
    assert result.batch["label"].tolist() == (ids % 7).tolist()
    assert result.batch["key"][0] == ds.catalog.samples(ids[:1]).key[0] and not result.skipped
    footers = [(u, o) for u, o, n in storage.reads if o + n == os.path.getsize(u)]
    assert len(footers) == 2 and len(storage.reads) <= 2 + 6  # row groups closer than 64 KiB coalesce
    uris = ds.catalog.shards.column("uri").to_pylist()
    for s, off, size in zip(*(ds.catalog.column(c).tolist() for c in ("shard", "offset", "length")), strict=True):
        assert any(u == uris[s] and o <= off and off + size <= o + n
                   for u, o, n in storage.reads), (s, off)  # image and label chunk: one request
    before = len(storage.reads)
    assert not dataclasses.replace(ds.catalog, storage=storage).samples().errors
    assert len(storage.reads) == before  # the footers are kept: locating again reads nothing


def test_the_worker_caches_are_bounded_by_bytes():
    """A process keeps footers and decoded labels up to a byte budget, the least recently used dropped first."""
    cache = parquet._LRU(100, 10, size=len)
    for key in "abcd":
        cache.get(key, lambda: b"xxxx")
    assert cache.peek("a") is None and cache.peek("b") is None and cache.peek("d") == b"xxxx"
    assert cache.get("c", lambda: 1 / 0) == b"xxxx"  # kept: not made again


def test_a_label_column_far_from_the_images_is_read_on_its_own(tmp_path):
    """A label chunk with more than CHUNK_GAP bytes of other columns between it and the image chunk is read by
    its own request when its row group is decoded, not with the bytes between."""
    rng = np.random.default_rng(0)
    images = [png(i) for i in range(12)]
    pq.write_table(pa.table({"y": np.arange(12) * 3, "caption": [rng.bytes(20_000) for _ in range(12)],
                             "img": images}), tmp_path / "far.parquet", row_group_size=6)
    ds = raydl.read_parquet(str(tmp_path / "far.parquet"), columns=[], image_column="img", label_column="y")
    cat = ds.catalog
    storage = CountingStorage()
    result = _worker(ds, storage, np.arange(12))
    assert result.batch["label"].tolist() == (np.arange(12) * 3).tolist()
    assert len(storage.reads) == 1 + 2 + 2  # the footer, then per row group its label and its image chunk
    assert sum(n for _, _, n in storage.reads) < 12 * 20_000  # never the captions between
    assert _rows(cat, LocalStorage()) == [(im, 3 * i) for i, im in enumerate(images)]


@pytest.mark.parametrize("kind,shown", [(pa.string(), "BYTE_ARRAY (STRING)"), (pa.float32(), "FLOAT"),
                                        (pa.timestamp("ms"), "INT64 (TIMESTAMP)"), (pa.bool_(), "BOOLEAN")])
def test_a_label_column_that_is_not_integer_is_refused_at_listing(tmp_path, kind, shown):
    """A label column whose footer schema says it is not a plain integer column is a ValueError at listing
    naming the file, the column and its type; no column chunk is read to find out."""
    values = pa.array([1, 0, 1], pa.int64()).cast(kind) if kind != pa.string() else pa.array(["a", "b", "c"])
    pq.write_table(pa.table({"img": [png(i) for i in range(3)], "y": values}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"label column 'y' is .* not an integer column") as info:
        raydl.read_parquet(str(tmp_path / "t.parquet"), image_column="img", label_column="y")
    assert str(tmp_path / "t.parquet") in str(info.value) and shown in str(info.value)


def test_a_file_rewritten_after_listing_is_an_object_changed_error_for_its_rows(files):
    """A file whose footer no longer says what was listed gives each of its rows an ObjectChangedError (which
    on_error does not hide) when located; other files' rows read."""
    root, _ = files
    cat = raydl.read_parquet(str(root) + "/", image_column="img", label_column="y").catalog
    t = pq.read_table(root / "b.parquet")
    pq.write_table(t, root / "b.parquet", row_group_size=5, use_dictionary=False, compression="zstd")
    clear_caches()
    loc = cat.samples()
    assert sorted(loc.errors) == list(range(40, 60))
    assert all(isinstance(e, raydl.errors.ObjectChangedError) and "b.parquet changed after it was listed" in str(e)
               for e in loc.errors.values())


def test_a_catalog_from_row_counts_alone(tmp_path):
    """catalog_from_row_counts builds the catalog of 10,000 files from their row groups' row counts without any
    file (for planning benchmarks): one part per row group, ids located by binary search."""
    files = [ObjectInfo(f"s3://b/t/{i:05d}.parquet", 1 << 20, f"e{i}") for i in range(10_000)]
    rows = [[100, 100, 37 + i % 5] for i in range(10_000)]
    cat = catalog_from_row_counts(files, rows, storage=LocalStorage())
    assert cat.num_parts == 30_000 and len(cat) == sum(map(sum, rows))
    part, pos = cat.locate([0, 236, 237, len(cat) - 1])
    assert part.tolist() == [0, 2, 3, 29_999] and pos.tolist() == [0, 36, 0, 37 + 9_999 % 5 - 1]
    assert cat.samples([236, 237]).key == ["00000.parquet#2:36", "00001.parquet#0:0"]
    assert cat.parts.nbytes + cat.starts.nbytes <= 48 * 30_000 + 8


def test_struct_image_column_as_hugging_face_stores_it(tmp_path):
    """An image column of struct<bytes, path> (Hugging Face datasets) reads its bytes."""
    images = [png(i) for i in range(5)]
    col = pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)])
    pq.write_table(pa.table({"image": col, "label": pa.array([1, 2, 3, 4, 5])}), tmp_path / "hf.parquet")
    cat = raydl.read_parquet(str(tmp_path / "hf.parquet"), image_column="image", label_column="label").catalog
    assert _rows(cat, LocalStorage()) == [(im, i + 1) for i, im in enumerate(images)]


@pytest.mark.parametrize("kw", [{"image_column": "nope"}, {"image_column": "img", "label_column": "missing"}])
def test_missing_column_names_the_column_and_the_file(files, kw):
    """A column the file lacks is a ValueError naming the column and the file."""
    root, _ = files
    col = kw.get("label_column") or kw["image_column"]
    with pytest.raises(ValueError, match=repr(col)) as info:
        raydl.read_parquet(str(root / "b.parquet"), **kw)
    assert str(root / "b.parquet") in str(info.value)


def test_paths_that_match_nothing_and_non_parquet_files(tmp_path):
    """An empty folder or pattern is a ValueError naming it; a file that is not Parquet is a DataSourceError."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="matches nothing"):
        raydl.read_parquet(str(tmp_path / "empty"), image_column="img")
    with pytest.raises(ValueError, match="matches nothing"):
        raydl.read_parquet(str(tmp_path / "x-{0..3}.parquet"), image_column="img")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all, just bytes")
    with pytest.raises(raydl.errors.DataSourceError, match="junk.parquet"):
        raydl.read_parquet(str(tmp_path / "junk.parquet"), image_column="img")


def test_null_images_fail_to_decode_and_null_labels_are_minus_one(tmp_path):
    """A null image cell fails to decode (on_error settles it, named by file and row); a null label is -1."""
    pq.write_table(pa.table({"img": [png(0), None, png(2)], "y": pa.array([None, 5, 2], pa.int64())}),
                   tmp_path / "n.parquet")
    ds = raydl.read_parquet(str(tmp_path / "n.parquet"), image_column="img", label_column="y")
    result = _worker(ds, LocalStorage(), np.arange(3))
    assert result.batch["label"].tolist() == [-1, 2] and result.batch["key"] == ["n.parquet#0:0", "n.parquet#0:2"]
    (failure,) = result.skipped
    assert failure.uri == f"{tmp_path / 'n.parquet'}#0:1"
