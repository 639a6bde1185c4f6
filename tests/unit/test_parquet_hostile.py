"""Parquet listing on corrupt footers, each made by rewriting a few Thrift bytes of a real footer: a
DataSourceError naming the file, never a raw pyarrow error or an aborted process."""
from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydl
from raydl.errors import DataSourceError

pytestmark = pytest.mark.timeout(60)


def parquet_bytes() -> bytes:
    t = pa.table({"img": [b"x" * 50] * 10, "y": list(range(10))})
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=4)
    return buf.getvalue()


def varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)  # zigzag, as Thrift's compact protocol writes i32/i64
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def rewrite(blob: bytes, old: bytes, new: bytes) -> bytes:
    """The file with the first `old` in its footer's metadata (row group 0's, where row groups are alike)
    replaced by `new`, its length fixed up."""
    meta_len = int.from_bytes(blob[-8:-4], "little")
    body, meta = blob[:-8 - meta_len], blob[-8 - meta_len:-8]
    assert old in meta, (old, meta)
    meta = meta.replace(old, new, 1)
    return body + meta + len(meta).to_bytes(4, "little") + b"PAR1"


def test_one_corrupt_footer_among_300_files_names_that_file(tmp_path):
    """300 files, one whose footer puts a column's dictionary page after its data page: listing raises a
    DataSourceError naming that file (pyarrow's raw OSError escaped before)."""
    blob = parquet_bytes()
    y = pq.read_metadata(io.BytesIO(blob)).row_group(0).column(1)
    dictionary, data = y.dictionary_page_offset, y.data_page_offset
    assert len(varint(dictionary)) == len(varint(data + 1))
    bad = rewrite(blob, b"\x26" + varint(dictionary), b"\x26" + varint(data + 1))  # field 11 after field 9
    for i in range(300):
        (tmp_path / f"f{i:03d}.parquet").write_bytes(bad if i == 173 else blob)
    with pytest.raises(DataSourceError) as info:
        raydl.read_parquet(str(tmp_path), image_column="img", label_column="y")
    assert str(tmp_path / "f173.parquet") in str(info.value)
    assert info.value.uri == str(tmp_path / "f173.parquet")


def test_a_footer_that_aborts_pyarrow_is_listed_or_refused_in_process(tmp_path):
    """A schema saying REQUIRED where the column chunks carry OPTIONAL's level histograms made pyarrow 26
    abort the whole process (an uncaught C++ exception in RowGroupMetaData.column); listing now survives it,
    and reading the row group is a DataSourceError."""
    path = tmp_path / "required.parquet"
    path.write_bytes(parquet_bytes().replace(b"\x25\x02\x18\x03img", b"\x25\x00\x18\x03img"))  # repetition 1 -> 0
    code = f"""
import raydl
from raydl.errors import DataSourceError
from raydl.storage import ObjectInfo
ds = raydl.read_parquet({str(path)!r}, image_column="img", label_column=None)
cat = ds.catalog
loc = cat.samples([0])
t = loc.to_pydict()
info = ObjectInfo(*[cat.shards.column(c)[0].as_py() for c in ("uri", "size", "etag")])
data = cat.source.read_block(cat.storage, info, t["offset"][0], t["length"][0])
try:
    cat.source.cut(loc, 0, data)
except DataSourceError as exc:
    print("refused:", exc)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout


def _rows(rg, value):  # RowGroup: total_byte_size (field 2), then num_rows (field 3)
    return b"\x16" + varint(rg.total_byte_size) + b"\x16" + varint(value)


@pytest.mark.parametrize("old,new,match", [
    (lambda rg, c: _rows(rg, 4), lambda rg, c: _rows(rg, 10 ** 12), "row group 0 says 1000000000000 rows"),
    (lambda rg, c: _rows(rg, 4), lambda rg, c: _rows(rg, -4), "row group 0 says -4 rows"),
    # ColumnMetaData: total_compressed_size (field 7), then data_page_offset (field 9)
    (lambda rg, c: b"\x16" + varint(c.total_compressed_size) + b"\x26",
     lambda rg, c: b"\x16" + varint(10 ** 9) + b"\x26", "outside the file's data"),
    (lambda rg, c: b"\x26" + varint(c.data_page_offset) + b"\x26",
     lambda rg, c: b"\x26" + varint(-5) + b"\x26", "outside the file's data"),
])
def test_out_of_range_numbers_in_a_footer_are_refused_at_listing(tmp_path, old, new, match):
    """Rows per row group, chunk sizes and offsets are checked against the file at listing: a footer saying
    10**12 rows (a catalog of 10**12 rows before), negative rows, or a chunk outside the file is a
    DataSourceError naming the file."""
    blob = parquet_bytes()
    rg = pq.read_metadata(io.BytesIO(blob)).row_group(0)
    col = rg.column(0)
    path = tmp_path / "f.parquet"
    path.write_bytes(rewrite(blob, old(rg, col), new(rg, col)))
    with pytest.raises(DataSourceError, match=match) as info:
        raydl.read_parquet(str(path), image_column="img")
    assert str(path) in str(info.value) and "corrupt Parquet footer" in str(info.value)


def test_a_valid_file_with_far_more_rows_than_bytes_lists(tmp_path):
    """RLE and dictionaries store many equal values in a few bytes, so a footer's row count is bounded by
    8 rows per byte of the file or 4 Mi rows, whichever is more (regression: 8 per byte alone refused this
    valid file of 300,000 rows in about 10 KB)."""
    blob = parquet_bytes()
    img = pq.read_table(io.BytesIO(blob)).column("img")[0].as_py()
    n = 300_000
    path = tmp_path / "many.parquet"
    pq.write_table(pa.table({"img": pa.array([img] * n, pa.binary()), "label": pa.array([3] * n, pa.int64())}),
                   path)
    assert n > 8 * path.stat().st_size
    assert len(raydl.read_parquet(str(path), image_column="img", label_column="label")) == n


def _token_file_with(tmp_path, old: bytes, new: bytes):
    """A token table (input_ids: list<int32>) whose footer has `old` rewritten to `new`."""
    path = tmp_path / "tok.parquet"
    path.write_bytes(rewrite(_raw_tokens(), old, new))
    return path


def test_token_and_weight_columns_of_a_footer_that_aborts_pyarrow_are_read_in_process(tmp_path):
    """The REQUIRED-for-OPTIONAL footer on a token list's leaf and on a weight column: read_tokens lists it and
    its window's read is a DataSourceError; with_weights on that column is a DataSourceError naming the file.
    No process aborts (pyarrow's RowGroupMetaData.column() is never called on it)."""
    path = _token_file_with(tmp_path, b"\x25\x02\x18\x07element", b"\x25\x00\x18\x07element")
    weights = tmp_path / "w.parquet"
    buf = io.BytesIO()
    pq.write_table(pa.table({"img": [b"x"] * 3, "w": [1.0, 2.0, 3.0]}), buf)
    weights.write_bytes(rewrite(buf.getvalue(), b"\x25\x02\x18\x01w", b"\x25\x00\x18\x01w"))
    code = f"""
import numpy as np
import raydl
from raydl.errors import DataSourceError
ds = raydl.read_tokens({str(path)!r}, seq_len=4)
cat = ds.catalog
try:
    cat.source.read_batch(cat, cat.storage, np.arange(1))
    print("read")
except DataSourceError as exc:
    print("refused tokens:", exc)
try:
    raydl.read_parquet({str(weights)!r}, image_column="img").with_weights("w")
    print("weighted")
except DataSourceError as exc:
    print("refused weights:", exc)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"refused tokens: {path}" in proc.stdout and f"refused weights: {weights}" in proc.stdout, proc.stdout


def test_a_token_count_the_data_does_not_bear_out_fails_the_read_naming_the_file(tmp_path):
    """A row group's num_values rewritten to 2**40 - 1 (the chunk is a few hundred bytes): listing believes the
    footer (no per-byte bound is sound: a run-length page holds millions of one token in a few bytes), and
    the first read fails naming the file and row group, rather than giving other tokens."""
    md = pq.read_metadata(io.BytesIO(_raw_tokens()))
    n = md.row_group(0).column(0).num_values
    # ColumnMetaData: num_values (field 5, i64) follows path_in_schema (field 3, list<binary>)
    path = _token_file_with(tmp_path, b"\x16" + varint(n), b"\x16" + varint((1 << 40) - 1))
    ds = raydl.read_tokens(str(path), seq_len=4)
    cat = ds.catalog
    with pytest.raises(DataSourceError, match=r"row group 0 holds \d+ tokens, not the 10995116\d+ .* footer's counts"):
        cat.source.read_batch(cat, cat.storage, np.arange(1))


def _raw_tokens() -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"input_ids": pa.array([list(range(10)), list(range(5)), [1, 2]], pa.list_(pa.int32())),
                             "w": [1.0, 2.0, 3.0]}), buf)
    return buf.getvalue()
