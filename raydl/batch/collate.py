"""A batch's column of one field, from its samples' values, as the field's kind says (sources/base.py).

Numbers and arrays that share a shape are stacked (a reader on the node maps
them from the object store without a copy); text, dicts, bytes and arrays of
varying length are object arrays, as Ray Data's numpy batches hold them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import numpy as np

from raydl.describe.fields import Field
from raydl.errors import LoaderError

__all__ = ["collate", "infer_field", "object_array"]


def object_array(values: Sequence[object]) -> np.ndarray:
    """A 1-D object array holding `values` as they are (lists and arrays not broadcast into it)."""
    out = np.empty(len(values), dtype=object)
    for k, v in enumerate(values):
        out[k] = v
    return out


def _is_number(v: object) -> bool:
    return isinstance(v, (numbers.Number, np.number, np.bool_)) and not isinstance(v, complex)


def infer_field(name: str, value: object) -> Field:
    """The kind of a field a user's `map` made, from one of its values."""
    if isinstance(value, np.ndarray) and value.ndim > 0:
        return Field(name, "array")
    return Field(name, "value")


def collate(field: Field, values: Sequence[object], uri_of: Callable[[int], str]) -> np.ndarray:
    """The column of `field` for `values` (one a row); `uri_of(row)` names a row's sample in errors.

    An "array" field whose shape differs between two rows is a LoaderError naming the field, both shapes and
    both samples: a batch needs one shape (`.pad(field, length)` makes one).
    """
    kind = field.kind
    if not values:
        if kind == "value" and field.dtype is not None:
            return np.zeros(0, field.dtype)
        return np.empty(0, dtype=object)
    if kind == "array":
        arrays = [np.asarray(v) for v in values]
        first = arrays[0]
        for row, a in enumerate(arrays):
            if a.shape != first.shape:
                raise LoaderError(
                    f"field {field.name!r} has shape {first.shape} in {uri_of(0)} and {a.shape} in "
                    f"{uri_of(row)}, in one batch: a batch needs one shape per field; make one with "
                    f".pad({field.name!r}, length) or a map"
                )
        return np.stack(arrays)
    if kind == "list":
        arrays = [np.asarray(v) for v in values]
        first = arrays[0]
        if all(a.shape == first.shape and a.dtype == first.dtype for a in arrays):
            return np.stack(arrays)  # (B, L) where the lengths agree
        return object_array(arrays)
    if kind == "value" and all(_is_number(v) for v in values):
        if field.dtype is not None:
            return np.array(values, dtype=field.dtype)
        kinds = {v.dtype for v in values if isinstance(v, np.generic)}
        if len(kinds) == 1 and all(isinstance(v, np.generic) for v in values):
            return np.array(values, dtype=kinds.pop())  # a Parquet column's own dtype (int32 stays int32)
        if all(isinstance(v, (bool, np.bool_)) for v in values):
            return np.array(values, dtype=bool)
        if all(isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, bool) for v in values):
            return np.array(values, dtype=np.int64)
        return np.array(values, dtype=np.float64)
    return object_array(list(values))  # str, dict, bytes, None, image bytes not decoded
