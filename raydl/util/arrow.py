"""Arrow arrays built and read without `pa.array`, which imports pandas.

`pa.array(...)` (and `pa.table` of Python lists, `Array.take` of numpy
indices) asks pyarrow's pandas shim whether the input is a pandas object, and
the shim imports pandas to answer: about 0.5-1 s of CPU and 50+ MiB in every
process that lists a catalog or makes a batch, none of which uses pandas. The
catalog's columns are int64 and strings, so they are built from their buffers
here, and the worker reads keys and shard rows through numpy views.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

__all__ = ["StringColumn", "int_array", "int_column", "numbers", "one_array", "string_array", "valid_mask"]


def int_array(values, dtype=np.int64) -> pa.Array:
    """An int64 (or int32: `dtype`) Arrow array holding `values`, without a null bitmap."""
    a = np.ascontiguousarray(np.asarray(values, dtype=dtype))
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), len(a), [None, pa.py_buffer(a)])


def int_column(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of an integer column without nulls as numpy (a view of a single chunk; `to_numpy` would
    import pandas)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    dtype = column.type.to_pandas_dtype()
    parts = []
    for chunk in chunks:
        if chunk.null_count:
            raise ValueError("an integer column with nulls")
        parts.append(np.frombuffer(chunk.buffers()[1], dtype)[chunk.offset : chunk.offset + len(chunk)])
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def numbers(arr: pa.Array, *, fill=None) -> tuple[np.ndarray, bool]:
    """(an array of numbers as numpy, whether it was copied): a read-only view of its values buffer where it
    can be (integers and floats without nulls), a copy with `fill` in the null slots where that is given, else
    pyarrow's copy (booleans are bits; nulls become NaN), which imports pandas."""
    t = arr.type
    if (arr.null_count == 0 or fill is not None) and (pa.types.is_integer(t) or pa.types.is_floating(t)):
        dtype = np.dtype(t.to_pandas_dtype())
        buffer = arr.buffers()[1]
        if buffer is None:  # an empty array may have no buffer
            return np.zeros(0, dtype), False
        values = np.frombuffer(buffer, dtype)[arr.offset : arr.offset + len(arr)]
        if arr.null_count == 0:
            values.flags.writeable = False  # a view of Arrow's memory, as pyarrow's own views are
            return values, False
        values = values.copy()
        values[~valid_mask(arr)] = fill
        return values, True
    return arr.to_numpy(zero_copy_only=False), True


def valid_mask(arr: pa.Array) -> np.ndarray:
    """Which of the array's slots hold a value, from its validity bitmap (all, where it has none)."""
    bitmap = arr.buffers()[0]
    if bitmap is None or arr.null_count == 0:
        return np.ones(len(arr), bool)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


def string_array(values: Sequence[str]) -> pa.Array:
    """A string Arrow array of `values` (no nulls; int64 offsets when the text passes 2 GiB)."""
    data = [v.encode() for v in values]
    ends = np.cumsum([len(b) for b in data], dtype=np.int64)
    large = len(ends) > 0 and ends[-1] >= 2**31
    offsets = np.zeros(len(data) + 1, np.int64 if large else np.int32)
    offsets[1:] = ends
    return pa.Array.from_buffers(
        pa.large_string() if large else pa.string(),
        len(data),
        [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))],
    )


def one_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column as one array: its only chunk as it is (combine_chunks copies even one chunk), else its
    chunks concatenated."""
    if not isinstance(column, pa.ChunkedArray):
        return column
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


class StringColumn:
    """A string column's values by row number, read through numpy views of its buffers."""

    def __init__(self, column: pa.Array | pa.ChunkedArray) -> None:
        column = one_array(column)
        if column.null_count:
            raise ValueError("a string column with nulls")
        _validity, offsets, data = column.buffers()
        wide = pa.types.is_large_string(column.type)
        self._offsets = np.frombuffer(offsets, np.int64 if wide else np.int32)[
            column.offset : column.offset + len(column) + 1
        ]
        self._data = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        self._len = len(column)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> str:
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._data[start:end].tobytes().decode()

    def take(self, rows) -> list[str]:
        return [self[int(i)] for i in rows]
