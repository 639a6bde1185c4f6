"""Parquet columns as fields: every kind of column a Hugging Face-style table holds, a table with no image
(tokens), columns= selection and order, and the bad columns (missing, id/key, a role's name, a null array)."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import raydl
import raydl.sources._parquet_source as parquet
from raydl.describe.fields import IMAGE_AND_LABEL, Field
from raydl.errors import DataSourceError
from raydl.sources.parquet import clear_caches
from raydl.storage import LocalStorage, ObjectInfo
from raydl.storage.fetch import coalesce

from counting_storage import CountingStorage  # beside this file

pytestmark = pytest.mark.timeout(60)
N = 8


def png(i: int) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.full((4, 5, 3), i, np.uint8)).save(b, "PNG")
    return b.getvalue()


def hf_table() -> pa.Table:
    """A table as Hugging Face datasets writes one: an image struct beside text, numbers, token lists,
    embeddings, structs and maps, with nulls."""
    images = [{"bytes": png(i), "path": f"{i}.png"} if i != 5 else None for i in range(N)]
    grid = pa.list_(pa.list_(pa.int16(), 3), 2)
    return pa.table({
        "image": pa.array(images, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "text": pa.array([f"caption {i}" if i != 3 else None for i in range(N)]),
        "n": pa.array([i * 10 if i != 2 else None for i in range(N)], pa.int64()),
        "score": pa.array(np.arange(N, dtype=np.float32) / 4),
        "flag": pa.array([i % 3 == 0 for i in range(N)]),
        "tokens": pa.array([list(range(i % 4 + 1)) if i != 6 else None for i in range(N)], pa.list_(pa.int32())),
        "emb": pa.array([[i, i + 0.5, -i, 1.0] for i in range(N)], pa.list_(pa.float32(), 4)),
        "grid": pa.array([[[i, 1, 2], [3, 4, i]] for i in range(N)], grid),
        "meta": pa.array([{"w": i, "src": "web"} for i in range(N)]),
        "attrs": pa.array([[("a", i), ("b", -i)] if i % 2 else [] for i in range(N)],
                          pa.map_(pa.string(), pa.int64())),
        "tags": pa.array([["x"] * (i % 3) for i in range(N)], pa.list_(pa.string())),
        "blob": pa.array([bytes([i]) * i for i in range(N)], pa.binary()),
        "lang": pa.array(["en", "de"] * (N // 2)).dictionary_encode(),
    })


def expected(i: int) -> dict:
    return {
        "image": png(i) if i != 5 else b"", "text": f"caption {i}" if i != 3 else None,
        "n": i * 10 if i != 2 else None, "score": i / 4, "flag": i % 3 == 0,
        "tokens": np.arange(i % 4 + 1, dtype=np.int32) if i != 6 else None,
        "emb": np.array([i, i + 0.5, -i, 1.0], np.float32), "grid": np.array([[i, 1, 2], [3, 4, i]], np.int16),
        "meta": {"w": i, "src": "web"}, "attrs": {"a": i, "b": -i} if i % 2 else {},
        "tags": ["x"] * (i % 3), "blob": bytes([i]) * i, "lang": "en" if i % 2 == 0 else "de",
    }


def records(cat, storage=None) -> list[dict]:
    """Every sample's record, fetched as the worker fetches them (coalesced ranges), then cut."""
    clear_caches()
    storage = storage or LocalStorage()
    loc = cat.samples()
    assert not loc.errors, loc.errors
    t, sh = loc.to_pydict(), cat.shards.to_pydict()
    out = [None] * len(loc)
    for b in coalesce(list(zip(t["shard"], t["offset"], t["length"], strict=True)), max_gap=0):
        data = cat.source.read_block(storage, ObjectInfo(sh["uri"][b.shard], sh["size"][b.shard],
                                                        sh["etag"][b.shard]), b.offset, b.length)
        for i in b.members:
            start = t["offset"][i] - b.offset
            out[i] = cat.source.cut(loc, i, data[start:start + t["length"][i]])
    return out


def assert_record(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        if isinstance(value, np.ndarray):
            assert isinstance(got[name], np.ndarray) and got[name].dtype == value.dtype, (name, got[name])
            np.testing.assert_array_equal(got[name], value)
        else:
            assert got[name] == value and type(got[name]) is not np.ndarray, (name, got[name], value)


def test_every_kind_of_column_of_a_hugging_face_table(tmp_path):
    """Without roles, every column is batch[<its name>]: the image struct an image field (its bytes; a null
    image b""), numbers as numbers of the column's dtype (null None), strings, list<int32> 1-D int32 views, fixed_size_list arrays
    (nested: 2-D), structs and maps dicts, binary bytes, dictionary-encoded strings str."""
    pq.write_table(hf_table(), tmp_path / "hf.parquet", row_group_size=3)
    cat = raydl.read_parquet(str(tmp_path / "hf.parquet")).catalog
    kinds = {"image": "image", "tokens": "list", "emb": "array", "grid": "array"}
    dtypes = {"n": "int64", "score": "float32", "flag": "bool"}  # a number column's batch dtype, empty or not
    assert cat.source.fields == tuple(Field(c, kinds.get(c, "value"), dtypes.get(c))
                                      for c in hf_table().column_names)
    assert cat.num_parts == 3
    got = records(cat)
    for i, rec in enumerate(got):
        assert_record(rec, expected(i))
    assert got[1]["tokens"].base is not None and not got[1]["tokens"].flags.writeable  # a view of Arrow's buffer


def test_a_table_of_tokens_with_no_image(tmp_path):
    """A table with only an input_ids list<int32> column (2,048 a row) reads with no image and no label: each
    row a 2,048-long int32 view; the row groups, back to back, are fetched by one request, each decoded once."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, (12, 2048), dtype=np.int32)
    pq.write_table(pa.table({"input_ids": pa.array(list(tokens), pa.list_(pa.int32()))}), tmp_path / "t.parquet",
                   row_group_size=4)
    cat = raydl.read_parquet(str(tmp_path / "t.parquet")).catalog
    assert cat.source.fields == (Field("input_ids", "list"),)
    storage, decodes = CountingStorage(), []
    real = parquet.RowGroupValues
    parquet.RowGroupValues = lambda *a: decodes.append(1) or real(*a)
    try:
        got = records(cat, storage)
    finally:
        parquet.RowGroupValues = real
    np.testing.assert_array_equal(np.stack([r["input_ids"] for r in got]), tokens)
    assert all(r["input_ids"].dtype == np.int32 for r in got)
    assert len(storage.reads) == 1 and len(decodes) == 3


def test_columns_select_and_order_the_fields_and_only_their_chunks_are_read(tmp_path):
    """columns= gives the fields in its order, then the roles' columns where not listed (image_column's as
    "image", label_column's as "label", integers with null -1); the columns left out are never fetched; the
    roles alone are the legacy image-and-label record, in whatever order listed."""
    rng = np.random.default_rng(0)
    t = pa.table({"img": [png(i) for i in range(6)], "caption": [rng.bytes(100_000) for _ in range(6)],
                  "text": [f"t{i}" for i in range(6)], "y": pa.array([1, None, 3, 4, 5, 6], pa.int32()),
                  "n": np.arange(6)})
    pq.write_table(t, tmp_path / "c.parquet", row_group_size=3)
    cat = raydl.read_parquet(str(tmp_path / "c.parquet"), columns=["n", "text"], image_column="img",
                             label_column="y").catalog
    assert [f.name for f in cat.source.fields] == ["n", "text", "image", "label"]
    storage = CountingStorage()
    got = records(cat, storage)
    assert [list(r.values()) for r in got] == [[i, f"t{i}", png(i), -1 if i == 1 else i + 1] for i in range(6)]
    assert sum(n for _, _, n in storage.reads) < 100_000  # the incompressible captions: never read
    only = raydl.read_parquet(str(tmp_path / "c.parquet"), columns=["text"]).catalog
    assert [r["text"] for r in records(only)] == [f"t{i}" for i in range(6)] and list(got[0])[0] == "n"
    assert only.samples_fingerprint == cat.samples_fingerprint  # the columns do not change the order
    legacy = raydl.read_parquet(str(tmp_path / "c.parquet"), columns=["y", "img"], image_column="img",
                                label_column="y").catalog  # only the roles: today's image-and-label record
    assert legacy.source.fields == IMAGE_AND_LABEL
    assert [(r["image"], r["label"]) for r in records(legacy)] == [(png(i), -1 if i == 1 else i + 1) for i in range(6)]


def test_an_audio_struct_is_a_dict_where_hugging_face_says_audio(tmp_path):
    """A {bytes, path} struct is an image field unless the file's Hugging Face features call it something
    else (Audio): then it is a dict, like any struct."""
    col = pa.array([{"bytes": b"RIFF", "path": "a.wav"}])
    meta = {b"huggingface": b'{"info": {"features": {"audio": {"_type": "Audio"}}}}'}
    pq.write_table(pa.table({"audio": col}).replace_schema_metadata(meta), tmp_path / "a.parquet")
    cat = raydl.read_parquet(str(tmp_path / "a.parquet")).catalog
    assert cat.source.fields == (Field("audio", "value"),)
    assert records(cat) == [{"audio": {"bytes": b"RIFF", "path": "a.wav"}}]
    # the metadata is the file's: malformed (features a list, nested past the parser, a _type that is no
    # string) it is no hint, and the struct is an image field again
    for bad in (b'{"info": {"features": [1]}}', b'{"info": {"features": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
                b'{"info": {"features": {"audio": {"_type": [1]}}}}'):
        pq.write_table(pa.table({"audio": col}).replace_schema_metadata({b"huggingface": bad}), tmp_path / "b.parquet")
        assert raydl.read_parquet(str(tmp_path / "b.parquet")).catalog.source.fields[0].kind == "image"


@pytest.mark.parametrize("kw,match", [
    ({"columns": ["text", "nope"]}, r"has no column 'nope'"),
    ({"image_column": "nope"}, r"has no column 'nope'"),
    ({}, r"column 'id' would be batch\['id'\], which raydl fills itself .* columns="),
    ({"columns": ["key"]}, r"column 'key' would be batch\['key'\]"),
    ({"columns": ["text"], "image_column": "img"}, r"has no column 'img'"),
    ({"columns": ["image"], "image_column": "pic"}, r"column 'image' and image_column='pic' would both be"),
    ({"columns": ["text", "label"], "label_column": "n"}, r"column 'label' and label_column='n' would both be"),
    ({"columns": ["text"], "image_column": "text"}, r"image column 'text' is string, not binary"),
    ({"columns": ["text", "text"]}, r"more than once"),
])
def test_bad_columns_are_value_errors_naming_the_column_and_the_file(tmp_path, kw, match):
    """A missing column, one named id/key, one named image/label while the role is another column, a
    non-binary image column or a column twice: a ValueError at listing naming the column and the file."""
    t = pa.table({"id": [1], "key": ["k"], "text": ["a"], "image": [b"x"], "pic": [b"y"], "label": [1],
                  "n": [2]})
    pq.write_table(t, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=match) as info:
        raydl.read_parquet(str(tmp_path / "bad.parquet"), **kw)
    assert "columns names" in str(info.value) or str(tmp_path / "bad.parquet") in str(info.value)
    ok = raydl.read_parquet(str(tmp_path / "bad.parquet"), columns=["text", "n"], image_column="pic")
    assert [f.name for f in ok.catalog.source.fields] == ["text", "n", "image"]


def test_files_storing_a_column_differently_and_a_null_array_cell(tmp_path):
    """A second file storing a selected column as another type is a ValueError naming both files; a null
    fixed-size-list cell is a DataSourceError naming the sample, the field and the file (under on_error)."""
    vec = pa.list_(pa.float32(), 2)
    pq.write_table(pa.table({"v": pa.array([[1, 2], None, [5, 6]], vec)}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"v": pa.array([[1, 2]], pa.list_(pa.float64(), 2))}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet stores the selected columns as .* but .*a.parquet"):
        raydl.read_parquet([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    cat = raydl.read_parquet(str(tmp_path / "a.parquet")).catalog
    loc = cat.samples([1])
    data = cat.source.read_block(LocalStorage(), ObjectInfo(str(tmp_path / "a.parquet"), cat.shards["size"][0].as_py(),
                                                           ""), int(loc.offset[0]), int(loc.length[0]))
    with pytest.raises(DataSourceError, match=r"a.parquet#0:1: field 'v' \(column 'v'\) is null") as info:
        cat.source.cut(loc, 0, data)
    assert info.value.uri == str(tmp_path / "a.parquet")


def _batch(ds, ids):
    """One batch of `ids` made by a LoaderWorker in this process (no Ray), with a fresh process's caches."""
    from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
    from raydl.describe.records import compile_pipeline
    from raydl.plan.order import augmentation_seeds

    clear_caches()
    pipe = compile_pipeline(ds.stages)
    spec = WorkerSpec(program=pipe.program, threads=2, sample_stages=pipe.sample_stages)
    ids = np.asarray(ids, np.int64)
    task = BatchTask(rank=0, epoch=0, index=0, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0))
    return LoaderWorker(spec, ds.catalog, reuse_buffers=False).run_batch(task)


def test_a_loader_worker_batches_tokens_and_a_hugging_face_table(tmp_path):
    """Through a LoaderWorker: a tokens table with no image and no .decode() gives batch["input_ids"] as one
    (B, 2048) int32 array; the HF table with .decode() gives decoded images beside its other fields (the null
    image skipped under on_error), embeddings stacked (B, 4) float32, text and dicts as object arrays."""
    tokens = np.random.default_rng(1).integers(0, 50_000, (12, 2048), dtype=np.int32)
    pq.write_table(pa.table({"input_ids": pa.array(list(tokens), pa.list_(pa.int32()))}), tmp_path / "t.parquet",
                   row_group_size=4)
    ids = np.array([11, 0, 5, 6, 2])
    batch = _batch(raydl.read_parquet(str(tmp_path / "t.parquet")), ids).batch
    assert batch["input_ids"].shape == (5, 2048) and batch["input_ids"].dtype == np.int32
    np.testing.assert_array_equal(batch["input_ids"], tokens[ids])
    assert batch["id"].tolist() == ids.tolist() and batch["key"][0] == "t.parquet#2:3"

    pq.write_table(hf_table(), tmp_path / "hf.parquet", row_group_size=3)
    ds = raydl.read_parquet(str(tmp_path / "hf.parquet"), columns=["image", "text", "emb", "meta"]).decode().resize((4, 5))
    result = _batch(ds, np.arange(N))
    batch, kept = result.batch, [i for i in range(N) if i != 5]
    assert [f.uri.rsplit("#", 1)[-1] for f in result.skipped] == ["1:2"]  # row 5: the null image
    assert batch["image"].shape == (N - 1, 4, 5, 3) and batch["image"][:, 0, 0, 0].tolist() == kept
    assert batch["emb"].shape == (N - 1, 4) and batch["emb"].dtype == np.float32
    assert batch["text"].dtype == object and batch["text"].tolist() == [expected(i)["text"] for i in kept]
    assert batch["meta"].tolist() == [expected(i)["meta"] for i in kept]


def test_row_groups_held_decoded_are_not_fetched_again(tmp_path):
    """A worker that holds a row group decoded locates its rows as an empty range: a second batch over the same
    row groups makes no request; were the row group dropped between locate and cut, cut reads it itself."""
    import dataclasses

    tokens = np.arange(12 * 16, dtype=np.int32).reshape(12, 16)
    pq.write_table(pa.table({"input_ids": pa.array(list(tokens), pa.list_(pa.int32()))}), tmp_path / "t.parquet",
                   row_group_size=4)
    ds = raydl.read_parquet(str(tmp_path / "t.parquet"))
    storage = CountingStorage()
    ds = dataclasses.replace(ds, catalog=dataclasses.replace(ds.catalog, storage=storage))
    first = _batch(ds, [0, 4, 8]).batch
    before = len(storage.reads)
    from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
    from raydl.describe.records import compile_pipeline

    worker = LoaderWorker(WorkerSpec(program=compile_pipeline(ds.stages).program, threads=2), ds.catalog,
                          reuse_buffers=False)
    ids = np.array([9, 1, 5])
    again = worker.run_batch(BatchTask(rank=0, epoch=0, index=1, ids=ids, seeds=ids)).batch
    assert len(storage.reads) == before  # footers and row groups all held: no request
    np.testing.assert_array_equal(again["input_ids"], tokens[ids])
    np.testing.assert_array_equal(first["input_ids"], tokens[[0, 4, 8]])
    loc = ds.catalog.samples([2])
    assert loc.length[0] == 0
    parquet._row_groups.clear()
    np.testing.assert_array_equal(ds.catalog.source.cut(loc, 0, b"")["input_ids"], tokens[2])
    assert len(storage.reads) == before + 1


def test_a_string_cell_that_is_not_utf8_is_that_samples_decode_error(tmp_path):
    """A string column whose bytes in one row are not UTF-8 (a writer that skipped validation; found by the
    parquet_listing fuzz target): cutting that row is a DecodeError naming the column, which on_error settles;
    the other rows cut."""
    from raydl.errors import DecodeError

    text = pa.array([b"ok", b"\x89bad", b"fine"], pa.binary()).view(pa.string())  # no UTF-8 check
    pq.write_table(pa.table({"t": text, "n": [1, 2, 3]}), tmp_path / "a.parquet")
    cat = raydl.read_parquet(str(tmp_path / "a.parquet")).catalog
    clear_caches()
    loc = cat.samples()
    sh = cat.shards.to_pydict()
    info = ObjectInfo(sh["uri"][0], sh["size"][0], sh["etag"][0])
    t = loc.to_pydict()
    got = []
    for i in range(len(loc)):
        data = cat.source.read_block(LocalStorage(), info, t["offset"][i], t["length"][i])
        try:
            got.append(cat.source.cut(loc, i, data))
        except DecodeError as exc:
            got.append(str(exc))
    assert got[0] == {"t": "ok", "n": 1} and got[2] == {"t": "fine", "n": 3}
    assert got[1] == "column 't' holds text that is not UTF-8 in this row"
