"""Parquet columns as raydl fields: which columns come through, under which names and kinds, and a decoded
row group's rows cut out as values.

`select` reads the first file's Arrow schema (its footer) once, at listing. A
worker decodes a row group's selected columns once (`RowGroupValues`) and cuts
each row out of the decoded Arrow buffers: numbers through one numpy view of
the column, list<number> as a slice of the values by the offsets, and
fixed_size_list<number> as a row of one reshaped view. None of those makes a
Python object per row beyond the numpy view; only strings, binary, structs,
maps and other nested values are made per row (as_py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa

from raydl.describe.fields import IMAGE_AND_LABEL, Field
from raydl.errors import DecodeError
from raydl.util.arrow import numbers, valid_mask

__all__ = [
    "BATCH_HOWS",
    "MISSING",
    "RowGroupValues",
    "Selection",
    "gather_rows",
    "image_and_label_selection",
    "select",
]

#: what a cutter gives for a null cell of a field that must have a value (an array): the sample lacks it
MISSING = object()
_OWN = ("id", "key")  # batch columns raydl itself fills


@dataclass(frozen=True)
class Selection:
    """The fields a Parquet source gives, and for each one its column in the files.

    `how` says how a field's values are cut: image (bytes; null -> b""), label
    (int, null -> -1; no column: always -1), array, list, number (null -> None),
    map (a dict), object (as_py). `paths` are what pyarrow reads per field
    ("img.bytes" of an image struct: its path is never read).
    """

    fields: tuple[Field, ...]
    columns: tuple[str | None, ...]
    paths: tuple[str | None, ...]
    how: tuple[str, ...]

    @property
    def key(self) -> tuple:
        """What the worker's caches tell selections apart by."""
        return (self.paths, self.how)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def read_paths(self) -> list[str]:
        return [p for p in self.paths if p is not None]


def image_and_label_selection(image_column: str, label_column: str | None) -> Selection:
    """The image-and-label record (IMAGE_AND_LABEL) of a binary image column: for catalogs with no file
    read (catalog_from_row_counts)."""
    return Selection(
        IMAGE_AND_LABEL, (image_column, label_column), (image_column, label_column), ("image", "label")
    )


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_image_struct(t: pa.DataType) -> bool:
    """A struct shaped as Hugging Face datasets store an image: {bytes: binary, path: string}."""
    if not pa.types.is_struct(t) or sorted(t.field(k).name for k in range(t.num_fields)) != ["bytes", "path"]:
        return False
    path = t.field("path").type
    return _is_binary(t.field("bytes").type) and (pa.types.is_string(path) or pa.types.is_large_string(path))


def _hf_types(schema: pa.Schema) -> dict[str, str]:
    """Each column's Hugging Face feature type ("Image", "Audio", ...) where the file says it (the
    "huggingface" schema metadata datasets writes), so an audio struct is not taken for an image."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:  # metadata of the file's, read as a hint: anything malformed in it is no hint
        features = json.loads(raw)["info"]["features"] if raw else {}
        if not isinstance(features, dict):
            return {}
        return {
            k: v["_type"]
            for k, v in features.items()
            if isinstance(v, dict) and isinstance(v.get("_type"), str)
        }
    except (ValueError, KeyError, TypeError, RecursionError):
        return {}


def _how(t: pa.DataType, hf_type: str | None) -> str:
    """How a column of Arrow type `t` that is neither role is cut (see Selection)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if _is_image_struct(t) and hf_type in (None, "Image"):
        return "image"
    if pa.types.is_fixed_size_list(t):
        inner = t
        while pa.types.is_fixed_size_list(inner):
            inner = inner.value_type
        return "array" if _is_number(inner) else "object"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_number(t.value_type):
        return "list"
    if _is_number(t):
        return "number"
    return "map" if pa.types.is_map(t) else "object"


#: the ways of cutting a field whose rows a batch gathers at once, with no Python object per row
BATCH_HOWS = frozenset({"array", "list", "number", "label"})

_KIND = {"image": "image", "label": "value", "array": "array", "list": "list"}


def _dtype(t: pa.DataType, how: str) -> str | None:
    """The numpy dtype of a number or label column's batch column (an empty batch has it too)."""
    if how == "label":
        return "int64"
    if how != "number":
        return None
    return np.dtype((t.value_type if pa.types.is_dictionary(t) else t).to_pandas_dtype()).name


def select(
    schema: pa.Schema,
    uri: str,
    columns: Sequence[str] | None,
    image_column: str | None,
    label_column: str | None,
) -> Selection:
    """The fields of files whose schema is `schema` (that of `uri`, the first file): `columns` (None: every
    column, in schema order), then the roles' columns where not among them; image_column's values are
    batch["image"], label_column's batch["label"]. A ValueError names the column and the file when a column
    is missing, collides with "id"/"key", or takes a role's name."""
    wanted = _wanted(list(schema.names), uri, columns, image_column, label_column)
    _check_names(wanted, uri, image_column, label_column)
    hf = _hf_types(schema)
    fields, paths, how = [], [], []
    for c in wanted:
        t = schema.field(c).type
        if c == image_column:
            way, path = "image", _image_path(t, c, uri)
        elif c == label_column:
            way, path = "label", c  # its type is checked from each file's footer (parquet._label_leaf)
        else:
            way = _how(t, hf.get(c))
            path = f"{c}.bytes" if way == "image" else c
        name = "image" if c == image_column else "label" if c == label_column else c
        fields.append(Field(name, _KIND.get(way, "value"), _dtype(t, way)))
        paths.append(path)
        how.append(way)
    if image_column is not None and set(wanted) <= {image_column, label_column}:  # the image-and-label record
        image = paths[wanted.index(image_column)]
        return Selection(
            IMAGE_AND_LABEL, (image_column, label_column), (image, label_column), ("image", "label")
        )
    return Selection(tuple(fields), tuple(wanted), tuple(paths), tuple(how))


def _wanted(
    names: list[str],
    uri: str,
    columns: Sequence[str] | None,
    image_column: str | None,
    label_column: str | None,
) -> list[str]:
    """The columns that come through, in order: `columns` (None: `names`), then the roles' not among them."""
    if columns is None:
        wanted = list(names)
    else:
        if isinstance(columns, str) or not all(isinstance(c, str) and c for c in columns):
            raise ValueError(f"columns must be a list of column names, got {columns!r}")
        wanted = list(columns)
        twice = sorted({c for c in wanted if wanted.count(c) > 1})
        if twice:
            raise ValueError(f"columns names {twice} more than once")
    if image_column is not None and image_column == label_column:
        raise ValueError(f"image_column and label_column are both {image_column!r}")
    wanted += [r for r in (image_column, label_column) if r is not None and r not in wanted]
    for c in wanted:
        if c not in names:
            raise ValueError(f"{uri} has no column {c!r}; its columns are {sorted(names)}")
    if not wanted:
        raise ValueError(f"no column of {uri} is selected (columns={columns!r}, no image or label column)")
    return wanted


def _check_names(wanted: list[str], uri: str, image_column: str | None, label_column: str | None) -> None:
    """No column may be batch["id"] or batch["key"] (raydl's own), nor take a role's name from its column."""
    for c in wanted:
        if c in _OWN:
            raise ValueError(
                f"{uri}: column {c!r} would be batch[{c!r}], which raydl fills itself (the sample's "
                f"{'id' if c == 'id' else 'key'}); leave it out with columns=[...]"
            )
        for role, name, pointed in (
            ("image_column", "image", image_column),
            ("label_column", "label", label_column),
        ):
            if c == name and pointed is not None and pointed != c:
                raise ValueError(
                    f"{uri}: column {c!r} and {role}={pointed!r} would both be batch[{name!r}]; leave "
                    f"{c!r} out with columns=[...], or make it the {role}"
                )


def _image_path(t: pa.DataType, column: str, uri: str) -> str:
    """What pyarrow reads of the image column: itself (binary), or a struct's "bytes" (never its path)."""
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0 and _is_binary(t.field("bytes").type):
        return f"{column}.bytes"
    if not _is_binary(t):
        raise ValueError(f"{uri}: image column {column!r} is {t}, not binary or a struct of bytes")
    return column


# -- a decoded row group's rows ---------------------------------------------------------------------------
class _Cells:
    """One decoded column, its rows cut out as `how` says; `nbytes` counts the buffers it holds."""

    def __init__(self, col: pa.Array, how: str) -> None:
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        self.how, self._col, self._valid, self.nbytes = how, col, None, col.nbytes
        if col.null_count:
            self._valid = valid_mask(col)
        self.get = getattr(self, f"_{how}")
        values = None
        if how == "image" and pa.types.is_struct(col.type):
            self._col = col.flatten()[col.type.get_field_index("bytes")]  # the struct's nulls included
        if how == "image" and not _is_binary(self._col.type):
            raise ValueError(f"holds {col.type} values, not image bytes")
        if how == "label":
            if not pa.types.is_integer(col.type):
                raise ValueError(f"is {col.type}, not an integer column")
            values = numbers(col.cast(pa.int64(), safe=False), fill=-1)
        elif how == "number":
            boolean_nulls = pa.types.is_boolean(col.type) and col.null_count
            values = numbers(col.fill_null(False)) if boolean_nulls else numbers(col, fill=0)
        elif how == "list":
            if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
                raise ValueError(f"is {col.type} in this file, not a list")
            self.offsets = numbers(col.offsets)[0].astype(np.int64)  # .offsets respects the array's slice
            self._offsets = self.offsets.tolist()  # Python ints index a row's slice fastest
            values = numbers(col.values)
        elif how == "array":
            if not pa.types.is_fixed_size_list(col.type):
                raise ValueError(f"is {col.type} in this file, not a fixed-size list")
            values = _fixed_size(col)
        if values is not None:
            self._values, copied = values
            self.nbytes += self._values.nbytes if copied else 0

    def any_null(self, rows: np.ndarray) -> bool:
        return self._valid is not None and not bool(self._valid[rows].all())

    def _null(self, row: int) -> bool:
        return self._valid is not None and not self._valid[row]

    def _image(self, row: int):
        value = self._col[row]
        return value.as_py() if value.is_valid else b""  # a null image fails to decode; on_error decides

    def _label(self, row: int) -> int:
        return int(self._values[row])

    def _number(self, row: int):
        return None if self._null(row) else self._values[row]

    def _list(self, row: int):
        if self._null(row):
            return None
        return self._values[self._offsets[row] : self._offsets[row + 1]]

    def _array(self, row: int):
        return MISSING if self._null(row) else self._values[row]

    def _map(self, row: int):
        value = self._col[row].as_py()
        return None if value is None else dict(value)

    def _object(self, row: int):
        return self._col[row].as_py()


def _fixed_size(col: pa.Array) -> tuple[np.ndarray, bool]:
    """A fixed_size_list<...<number>> column as one (rows, w1, w2, ...) view of its innermost values."""
    shape, arr = [], col
    while pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        shape.append(width)
        arr = arr.values.slice(arr.offset * width, len(arr) * width)  # .values ignores the array's slice
    values, copied = numbers(arr)
    return values.reshape(len(col), *shape), copied


class RowGroupValues:
    """A row group's selected columns, decoded once: `row(r)` is one value per field (MISSING for a field
    that must have one and is null). A ValueError names the column whose values do not fit its field."""

    def __init__(self, selection: Selection, columns: dict[str, pa.Array], rows: int) -> None:
        """`columns`: each selected column's decoded array, by its name in the file."""
        self.rows, self.nbytes, self._get = rows, 0, []
        self._columns = list(selection.columns)
        self.cells: list[_Cells | None] = []  # per field (None: the label of a record without a label column)
        for column, how in zip(selection.columns, selection.how, strict=True):
            if column is None:  # the image-and-label record's label, without a label column
                self._get.append(lambda _row: -1)
                self.cells.append(None)
                continue
            col = columns[column]
            if len(col) != rows:
                raise ValueError(f"the {column!r} column chunk holds {len(col)} values for {rows} rows")
            try:
                cells = _Cells(col, how)
            except ValueError as exc:
                raise ValueError(f"column {column!r} {exc}") from None
            self._get.append(cells.get)
            self.cells.append(cells)
            self.nbytes += cells.nbytes

    def row(self, r: int) -> list:
        try:
            return [get(r) for get in self._get]
        except UnicodeDecodeError:  # a string cell whose bytes are not UTF-8: this sample's defect
            bad = next(c for c, get in zip(self._columns, self._get, strict=True) if not _decodes(get, r))
            raise DecodeError(f"column {bad!r} holds text that is not UTF-8 in this row") from None


def _runs_of(rows: np.ndarray, slots: np.ndarray) -> bool:
    """Whether `rows` and `slots` both count up by one (an ordered read's rows: one slice each)."""
    return len(rows) > 0 and bool(np.all(np.diff(rows) == 1)) and bool(np.all(np.diff(slots) == 1))


def gather_rows(
    selection: Selection, groups: Sequence[tuple[RowGroupValues, np.ndarray, np.ndarray]], n: int
) -> dict[str, np.ndarray] | None:
    """A batch's column per field, for a selection whose fields are all cut as `BATCH_HOWS` say: `groups`
    gives each decoded row group, its rows in the batch and their slots (0 <= slot < n). The columns are
    what collating the rows one by one would make (raydl/batch/collate.py): lists of one length stacked,
    of several lengths an object array of views. None where a selected cell of these rows is null: its
    sample needs the per-sample path, where on_error settles it."""
    out: dict[str, np.ndarray] = {}
    for f, (field, how) in enumerate(zip(selection.fields, selection.how, strict=True)):
        cells = [(values.cells[f], rows, slots) for values, rows, slots in groups]
        if any(c is None for c, _r, _s in cells) or how not in BATCH_HOWS:
            return None
        if how != "label" and any(c.any_null(rows) for c, rows, _s in cells):
            return None
        if how == "list":
            column = _gather_lists(cells, n)
        else:
            first = cells[0][0]._values
            dtype = np.dtype(field.dtype) if field.dtype is not None else first.dtype
            column = np.empty((n, *first.shape[1:]), dtype)
            for c, rows, slots in cells:
                if c._values.shape[1:] != first.shape[1:]:
                    return None  # arrays of another shape: the per-sample path names both samples
                column[slots] = c._values[rows]
        out[field.name] = column
    return out


def _gather_lists(cells: list[tuple[_Cells, np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    starts = [c.offsets[rows] for c, rows, _s in cells]
    lengths = [c.offsets[rows + 1] - a for (c, rows, _s), a in zip(cells, starts, strict=True)]
    dtypes = {c._values.dtype for c, _r, _s in cells}
    every = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if len(dtypes) == 1 and len(every) and bool(np.all(every == every[0])):
        width = int(every[0])
        column = np.empty((n, width), dtypes.pop())
        for (c, rows, slots), first in zip(cells, starts, strict=True):
            if _runs_of(rows, slots):  # consecutive rows: their values are one slice
                a = int(first[0])
                column[int(slots[0]) : int(slots[0]) + len(rows)] = c._values[
                    a : a + len(rows) * width
                ].reshape(len(rows), width)
                continue
            for k, a in zip(slots.tolist(), first.tolist(), strict=True):
                column[k] = c._values[a : a + width]
        return column
    column = np.empty(n, dtype=object)
    for (c, _rows, slots), first, size in zip(cells, starts, lengths, strict=True):
        for k, a, m in zip(slots.tolist(), first.tolist(), size.tolist(), strict=True):
            column[k] = c._values[a : a + m]
    return column


def _decodes(get, row: int) -> bool:
    try:
        get(row)
    except UnicodeDecodeError:
        return False
    return True
