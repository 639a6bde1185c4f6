"""Parquet listing (raydl.read_parquet: the footer and its Arrow schema) and, as a worker does it, one row
group's footer check, chunk read and cut (the image and label roles, then every column as a field), on
mutated small Parquet files written by pyarrow, through a temporary file per input."""

from __future__ import annotations

import atexit
import io
import shutil
import tempfile
from pathlib import Path

import raydl
import raydl.errors
from raydl.sources.parquet import clear_caches
from raydl.storage import ObjectInfo

ALLOWED = (raydl.errors.RaydlError,)
# The floor of a run (harness.py); measured in 20 s runs on a loaded 2-core machine: 2,340-2,800 inputs, 130-145 accepted
MIN_INPUTS, MIN_ACCEPTED = 500, 20
_DIR = Path(tempfile.mkdtemp(prefix="raydl-fuzz-parquet-"))
atexit.register(shutil.rmtree, _DIR, True)
PATH = _DIR / "fuzz.parquet"
# documented ValueErrors about the arguments given (or the columns a file has), not the bytes: a column the file
# does not have, or one whose name or type cannot be the field asked for
_ARGUMENT_ERRORS = ("has no column", "not an integer column", "not binary or a struct", "would be batch[",
                    "would both be batch[", "is selected")


def seeds() -> list[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(table, **kw) -> bytes:
        buf = io.BytesIO()
        pq.write_table(table, buf, **kw)
        return buf.getvalue()

    images = [bytes([i]) * (20 + i) for i in range(10)]
    labels = pa.array(list(range(10)), pa.int32())
    plain = pa.table({"img": images, "y": labels})
    struct = pa.table({"img": pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(images)]),
                       "y": labels})
    nulls = pa.table({"img": images[:5] + [None] * 5, "y": pa.array([1, None] * 5, pa.int64())})
    kinds = pa.table({"img": images, "y": labels, "text": [f"t{i}" for i in range(10)],
                      "tok": pa.array([list(range(i)) for i in range(10)], pa.list_(pa.int32())),
                      "vec": pa.array([[i, 1.0] for i in range(10)], pa.list_(pa.float32(), 2)),
                      "meta": pa.array([{"a": i} for i in range(10)]),
                      "m": pa.array([[("k", i)] for i in range(10)], pa.map_(pa.string(), pa.int64()))})
    return [
        write(plain, row_group_size=4),
        write(plain, row_group_size=10, use_dictionary=False, compression="zstd"),
        write(plain, row_group_size=3, compression="snappy", data_page_version="2.0", write_statistics=False),
        write(struct, row_group_size=5),
        write(nulls, row_group_size=5, compression="gzip"),
        write(kinds, row_group_size=4),
    ]


def run_one(data: bytes) -> None:
    with open(PATH, "wb") as f:
        f.write(data)
    for kw in ({"image_column": "img", "label_column": "y"}, {}):  # the legacy roles, then every column
        record = _first_record(kw)
        assert record is None or isinstance(record, dict), record
        if record is not None and kw:
            assert isinstance(record["image"], bytes) and isinstance(record["label"], int), record


def _first_record(kw: dict) -> dict | None:
    """Row 0's record as a worker cuts it; None where listing refused the file or the worker's footer check
    did (each with an allowed error)."""
    try:
        ds = raydl.read_parquet(str(PATH), **kw)
    except ValueError as exc:
        if isinstance(exc, raydl.errors.RaydlError) or any(s in str(exc) for s in _ARGUMENT_ERRORS):
            return None
        raise
    cat = ds.catalog
    clear_caches()  # every input is written to the same path: a worker's caches would hold the last one's
    loc = cat.samples([0])
    if loc.errors:  # the footer a worker reads did not check out: settled under on_error
        assert isinstance(loc.errors[0], raydl.errors.DataSourceError), loc.errors
        return None
    t = loc.to_pydict()
    shards = cat.shards.to_pydict()
    s = t["shard"][0]
    info = ObjectInfo(shards["uri"][s], shards["size"][s], shards["etag"][s])
    block = cat.source.read_block(cat.storage, info, t["offset"][0], t["length"][0])
    return cat.source.cut(loc, 0, block)
