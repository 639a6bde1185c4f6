"""Batch formats: the numpy batch a worker made, as `iter_batches(batch_format=...)` hands it out.

    numpy    (the default; "default" is the same) the batch as the worker made it: a dict of numpy arrays
             (numbers and equal-shape arrays stacked, dtype=object arrays of str / dicts / bytes / 1-D
             arrays of varying length), "key" a list of str, "bucket" an (H, W) tuple with aspect buckets
    pyarrow  a pyarrow.Table, one column per field; "bucket" in the schema's metadata (b"bucket": b"[H, W]")
    pandas   a pandas.DataFrame; "bucket" in `df.attrs["bucket"]`

Conversions run in the consumer's process, on the batch the worker put in the object store. The pyarrow
columns are built from the arrays' buffers: numbers and fixed-shape arrays (images, masks, .npy) are
zero-copy views of the batch where the array is C-contiguous (it is as the worker makes it), and no
column but a dict (struct) one calls `pa.array`, which imports pandas (raydl/util/arrow.py says why
that matters). pandas itself is imported only for batch_format="pandas".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["BATCH_FORMATS", "check_batch_format", "format_batches", "to_pandas", "to_pyarrow"]

BATCH_FORMATS = ("numpy", "pyarrow", "pandas")
_ALIASES = {"default": "numpy"}  # Ray Data's name for its default (numpy) format
_PER_BATCH = "bucket"  # the one batch entry that is a value per batch, not a column

Batch = dict[str, Any]


# What a batch_format of torch tensors is called elsewhere: those get the way to them in their error.
_TORCH_NAMES = ("torch", "pytorch", "tensor", "tensors", "pt")


def check_batch_format(batch_format: object, collate_fn: object = None) -> str:
    """The batch format's own name ("default" is "numpy"); an unknown one is a ValueError listing the known
    ones, a collate_fn that is not callable a TypeError."""
    name = _ALIASES.get(batch_format, batch_format) if isinstance(batch_format, str) else batch_format
    if name not in BATCH_FORMATS:
        known = ", ".join(repr(f) for f in BATCH_FORMATS)
        torch = isinstance(name, str) and name.lower() in _TORCH_NAMES
        raise ValueError(
            f"batch_format must be one of {known} (or 'default', which is 'numpy'), got {batch_format!r}"
            + (
                "; torch tensors come from iter_torch_batches() (with dtypes=, device=, pin_memory=)"
                if torch
                else ""
            )
        )
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be a callable that takes a batch, got {type(collate_fn).__name__}")
    return name  # type: ignore[return-value]


def format_batches(
    batches: Iterator[Batch], batch_format: str, collate_fn: Callable[[Any], Any] | None = None
) -> Iterator[Any]:
    """Each numpy batch in `batch_format` (checked by check_batch_format), then through `collate_fn`, whose
    return value is yielded as it is (as Ray Data's iterators apply it: to the batch in the asked format)."""
    convert = {"numpy": None, "pyarrow": to_pyarrow, "pandas": to_pandas}[batch_format]
    for batch in batches:
        out = batch if convert is None else convert(batch)
        yield out if collate_fn is None else collate_fn(out)


def _rows(batch: Batch) -> int:
    """The batch's row count ("id" has one per sample); a column of another length is a ValueError."""
    columns = {k: v for k, v in batch.items() if k != _PER_BATCH}
    rows = len(columns["id"]) if "id" in columns else len(next(iter(columns.values()), ()))
    for name, value in columns.items():
        if not isinstance(value, (np.ndarray, list, tuple)) or (
            isinstance(value, np.ndarray) and value.ndim == 0
        ):
            raise ValueError(f"batch column {name!r} is a {type(value).__name__}, not one value per row")
        if len(value) != rows:
            raise ValueError(f"batch column {name!r} has {len(value)} rows, the batch {rows}")
    return rows


# -- pyarrow ----------------------------------------------------------------------------------------


def to_pyarrow(batch: Batch) -> pa.Table:
    """The batch as a pyarrow.Table (see the module docstring for what each kind of column becomes)."""
    _rows(batch)
    names, arrays = [], []
    for name, value in batch.items():
        if name == _PER_BATCH:
            continue
        try:
            arrays.append(_arrow_column(value))
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise ValueError(
                f"batch_format='pyarrow': column {name!r} cannot be an Arrow column: {exc}"
            ) from exc
        names.append(name)
    metadata = None
    if batch.get(_PER_BATCH) is not None:
        metadata = {_PER_BATCH.encode(): json.dumps([int(x) for x in batch[_PER_BATCH]]).encode()}
    return pa.Table.from_arrays(arrays, names=names, metadata=metadata)


def _arrow_column(value: np.ndarray | list | tuple) -> pa.Array:
    if not isinstance(value, np.ndarray) or value.dtype == object:
        return _objects(list(value))
    if value.dtype.kind in "US":  # numpy's fixed-width text (a user's map_batches may make it)
        return _objects(value.tolist())
    if value.ndim == 1:
        return _numbers(value)
    return _tensor(value)


def _numbers(a: np.ndarray) -> pa.Array:
    """A 1-D numeric array as Arrow: a view of its buffer where it is contiguous (bools are bit-packed)."""
    if a.dtype.kind not in "biuf":
        return pa.array(a)  # datetimes and the like: pyarrow's own conversion (or its error)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "b":
        return pa.Array.from_buffers(
            pa.bool_(), len(a), [None, pa.py_buffer(np.packbits(a, bitorder="little"))]
        )
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), len(a), [None, pa.py_buffer(a)])


def _tensor(a: np.ndarray) -> pa.Array:
    """A (B, ...) array as an arrow.fixed_shape_tensor column of B rows (a view where C-contiguous)."""
    a = np.ascontiguousarray(a)
    flat = _numbers(a.reshape(-1))
    shape = a.shape[1:]
    storage = pa.Array.from_buffers(pa.list_(flat.type, int(np.prod(shape))), len(a), [None], children=[flat])
    return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(flat.type, shape), storage)


def _validity(values: list) -> tuple[pa.Buffer | None, int]:
    """The validity bitmap of `values` (None where a value is None) and the count of Nones."""
    missing = np.fromiter((v is None for v in values), bool, len(values))
    nulls = int(missing.sum())
    return (pa.py_buffer(np.packbits(~missing, bitorder="little")) if nulls else None), nulls


def _objects(values: list) -> pa.Array:
    """A column of Python values: str -> string, bytes -> binary, 1-D arrays -> list<...>, None -> null (in
    any of them); anything else (dicts -> struct, numbers) as pa.array infers it."""
    present = [v for v in values if v is not None]
    if not present:
        return pa.nulls(len(values))
    if all(isinstance(v, str) for v in present):
        return _offsets_column(values, pa.string(), pa.large_string(), str.encode)
    if all(isinstance(v, (bytes, bytearray, memoryview)) for v in present):
        return _offsets_column(values, pa.binary(), pa.large_binary(), bytes)
    if all(isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "biuf" for v in present):
        return _ragged(values, present)
    return pa.array([v.tolist() if isinstance(v, np.ndarray) else v for v in values])


def _offsets_column(values: list, small: pa.DataType, large: pa.DataType, to_bytes) -> pa.Array:
    """A string or binary column (int64 offsets once the data passes 2 GiB)."""
    data = [b"" if v is None else to_bytes(v) for v in values]
    ends = np.cumsum([len(b) for b in data], dtype=np.int64)
    wide = len(ends) > 0 and ends[-1] >= 2**31
    offsets = np.zeros(len(data) + 1, np.int64 if wide else np.int32)
    offsets[1:] = ends
    validity, nulls = _validity(values)
    return pa.Array.from_buffers(
        large if wide else small,
        len(data),
        [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))],
        null_count=nulls,
    )


def _ragged(values: list, present: list[np.ndarray]) -> pa.Array:
    """1-D numeric arrays of any lengths (tokens) as one list<T> column; the values are copied once."""
    flat = _numbers(np.concatenate(present))
    ends = np.cumsum([0 if v is None else len(v) for v in values], dtype=np.int64)
    wide = len(ends) > 0 and ends[-1] >= 2**31
    offsets = np.zeros(len(values) + 1, np.int64 if wide else np.int32)
    offsets[1:] = ends
    validity, nulls = _validity(values)
    kind = pa.large_list(flat.type) if wide else pa.list_(flat.type)
    return pa.Array.from_buffers(
        kind, len(values), [validity, pa.py_buffer(offsets)], null_count=nulls, children=[flat]
    )


# -- pandas -----------------------------------------------------------------------------------------


def to_pandas(batch: Batch):
    """The batch as a pandas.DataFrame: 1-D arrays as columns, (B, ...) arrays as a column of per-row arrays
    (views of the batch's), object columns ("key", text, dicts, bytes, token arrays) as they are (dtype
    object, the same Python values); "bucket" in `df.attrs["bucket"]`."""
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError("batch_format='pandas' needs pandas: `pip install pandas`") from exc
    rows = _rows(batch)
    columns: dict[str, Any] = {}
    for name, value in batch.items():
        if name == _PER_BATCH:
            continue
        if isinstance(value, np.ndarray) and value.dtype != object and value.ndim == 1:
            columns[name] = pd.Series(value, copy=False)
            continue
        cells = np.empty(rows, dtype=object)  # filled one by one: np.array would stack equal-shape rows
        for i in range(rows):
            cells[i] = value[i]
        columns[name] = pd.Series(cells, dtype=object, copy=False)
    df = pd.DataFrame(columns, copy=False)
    if batch.get(_PER_BATCH) is not None:
        df.attrs[_PER_BATCH] = tuple(int(x) for x in batch[_PER_BATCH])
    return df
