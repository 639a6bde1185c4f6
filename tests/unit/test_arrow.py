"""Arrow columns built and read without pa.array / to_numpy, and listing that never imports pandas."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from raydl.util.arrow import StringColumn, int_array, int_column, string_array

pytestmark = pytest.mark.timeout(60)


def test_arrays_equal_what_pa_array_builds():
    """int_array and string_array equal pa.array's arrays (so fingerprints stay), and read back by row."""
    ints = [3, -1, 2**40, 0]
    assert int_array(ints).equals(pa.array(ints, pa.int64()))
    assert int_array(np.array([5, 6], np.int32), np.int32).equals(pa.array([5, 6], pa.int32()))
    words = ["a/b.jpg", "", "é/ü.png", "x" * 300]
    arr = string_array(words)
    assert arr.equals(pa.array(words, pa.string()))
    assert [b.size if b else None for b in arr.buffers()] == [b.size if b else None for b in pa.array(words).buffers()]
    col = StringColumn(pa.chunked_array([arr[:2], arr[2:]]))  # several chunks, one sliced
    assert len(col) == 4 and col.take(np.array([3, 0, 2])) == [words[3], words[0], words[2]]
    assert StringColumn(arr.slice(1, 2))[1] == words[2]
    chunked = pa.chunked_array([int_array([1, 2]), int_array([7])])
    assert int_column(chunked).tolist() == [1, 2, 7] and int_column(int_array(ints).slice(1, 2)).tolist() == ints[1:3]
    assert string_array([]).equals(pa.array([], pa.string())) and len(StringColumn(string_array([]))) == 0


def test_listing_and_a_batch_do_not_import_pandas(image_folder):
    """read_images and a batch made in-process leave pandas unimported (pyarrow's pa.array would cost a second)."""
    code = f"""
import sys, numpy as np, raydl
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.describe.transforms import compile_stages
ds = raydl.read_images({str(image_folder)!r}).decode().random_resized_crop(32).normalize("imagenet")
w = LoaderWorker(WorkerSpec(program=compile_stages(ds.stages)), ds.catalog, 1, reuse_buffers=False)
r = w.run_batch(BatchTask(0, 0, 0, np.arange(8), np.arange(8, dtype=np.uint64)))
assert r.batch["image"].shape == (8, 3, 32, 32) and len(r.batch["key"]) == 8, r.batch["key"]
print(sorted(m for m in ("pandas", "pyarrow.compute") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("dtype", [pa.int8(), pa.uint16(), pa.int32(), pa.int64(), pa.float16(), pa.float64()])
def test_numbers_are_views_without_nulls_and_filled_copies_with_them(dtype):
    """`numbers` gives pyarrow's values for every slice of an array of numbers: a view of the buffer without
    nulls, a copy with `fill` in the null slots with them; `valid_mask` says which slots hold a value."""
    from raydl.util.arrow import numbers, valid_mask

    plain = pa.array(np.arange(20) % 7, dtype)
    for a in (plain, plain.slice(3), plain.slice(5, 9), plain.slice(20)):
        got, copied = numbers(a)
        assert not copied and not got.flags.writeable and got.dtype == np.dtype(dtype.to_pandas_dtype())
        assert got.tolist() == a.to_pylist()
    holes = pa.array([None if k % 3 == 0 else k % 7 for k in range(20)], dtype)
    for a in (holes, holes.slice(1), holes.slice(4, 11)):
        got, copied = numbers(a, fill=0)
        assert copied and got.tolist() == [0 if v is None else v for v in a.to_pylist()]
        assert valid_mask(a).tolist() == [v is not None for v in a.to_pylist()]
    assert valid_mask(plain.slice(2, 5)).tolist() == [True] * 5


@pytest.mark.timeout(10)
def test_one_array_keeps_a_single_chunk_without_a_copy():
    """A one-chunk column is its chunk (combine_chunks would copy it); several chunks are concatenated."""
    from raydl.util.arrow import one_array

    chunk = pa.array(np.arange(1000, dtype=np.int32))
    got = one_array(pa.chunked_array([chunk]))
    assert got.buffers()[1].address == chunk.buffers()[1].address
    assert one_array(pa.chunked_array([chunk, chunk])).to_pylist() == chunk.to_pylist() * 2
    assert one_array(chunk) is chunk and len(one_array(pa.chunked_array([], pa.int32()))) == 0
