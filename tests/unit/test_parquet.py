"""Parquet: the catalog from footers (and the label column), row-group reads of only the image column, bad columns."""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import raydl
from raydl.sources.parquet import list_parquet
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
    t = pa.table({"id": np.arange(60), "caption": [rng.bytes(10_000) for i in range(60)], "img": images,
                  "y": (np.arange(60) % 7).astype(np.int32)})
    pq.write_table(t.slice(0, 40), tmp_path / "a.parquet", row_group_size=16)
    pq.write_table(t.slice(40), tmp_path / "b.parquet", row_group_size=8, use_dictionary=False, compression="zstd")
    return tmp_path, images


def _rows(cat, storage):
    """Every sample's bytes, fetched as the worker fetches them: coalesced ranges, then cut."""
    loc = cat.samples()
    t = loc.to_pydict()
    sh = cat.shards.to_pydict()
    ranges = list(zip(t["shard"], t["offset"], t["length"]))
    out = [None] * len(ranges)
    for b in coalesce(ranges, max_gap=0):  # no merging across row groups: count chunk fetches
        info = ObjectInfo(sh["uri"][b.shard], sh["size"][b.shard], sh["etag"][b.shard])
        data = cat.source.read_block(storage, info, b.offset, b.length)
        for i in b.members:
            start = t["offset"][i] - b.offset
            out[i], _ = cat.source.cut(loc, i, data[start:start + t["length"][i]])
    return out


def test_catalog_rows_are_file_row_group_row(files):
    """One row per Parquet row, (file, row group chunk, row in group), labels from the label column, in file order."""
    root, _ = files
    ds = raydl.read_parquet(str(root) + "/", image_column="img", label_column="y")
    t = ds.catalog.samples().to_pydict()
    assert len(ds) == 60
    assert t["label"] == (np.arange(60) % 7).tolist()
    assert t["row"] == [r % 16 for r in range(40)] + [r % 8 for r in range(20)]
    assert t["shard"] == [0] * 40 + [1] * 20
    assert len(set(zip(t["shard"], t["offset"]))) == 3 + 3  # one image chunk per row group
    assert t["key"][17] == "a.parquet#1:1"


def test_listing_reads_footers_and_labels_never_images(files, monkeypatch):
    """Listing touches only each file's footer and the label column chunks, none of the image column's bytes."""
    import raydl.sources.parquet as parquet

    monkeypatch.setattr(parquet, "_TAIL", 16)  # these files are smaller than the usual 64 KiB first guess
    root, _ = files
    storage = CountingStorage()
    cat = list_parquet([str(root / "a.parquet"), str(root / "b.parquet")], storage=storage, image_column="img",
                       label_column="y")
    t = cat.samples().to_pydict()
    image_chunks = {(cat.shards.column("uri")[s].as_py(), o, n) for s, o, n in zip(t["shard"], t["offset"], t["length"])}
    for uri, off, n in storage.reads:
        assert not any(u == uri and off < o + m and o < off + n for u, o, m in image_chunks), (uri, off, n)


def test_row_group_reads_give_every_image_and_fetch_each_chunk_once(files):
    """A batch's rows fetch their row group's image chunk once (not the other columns) and cut out the exact bytes."""
    root, images = files
    cat = raydl.read_parquet([str(root / "a.parquet"), str(root / "b.parquet")], image_column="img").catalog
    storage = CountingStorage()
    assert _rows(cat, storage) == images
    assert len(storage.reads) == 6  # one per row group
    assert sum(n for _, _, n in storage.reads) < 60 * 10_000  # the caption column was never read


def test_struct_image_column_as_hugging_face_stores_it(tmp_path):
    """An image column of struct<bytes, path> (Hugging Face datasets) reads its bytes."""
    images = [png(i) for i in range(5)]
    col = pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)])
    pq.write_table(pa.table({"image": col, "label": pa.array([1, 2, 3, 4, 5])}), tmp_path / "hf.parquet")
    cat = raydl.read_parquet(str(tmp_path / "hf.parquet"), image_column="image", label_column="label").catalog
    assert _rows(cat, LocalStorage()) == images
    assert cat.samples().label.tolist() == [1, 2, 3, 4, 5]


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
