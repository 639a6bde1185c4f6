"""Parquet files: listing them into a catalog, on the driver; one sample per row, a field per selected
column.

Listing reads each file's footer (one ranged read of its tail for ordinary
files, 16 files at a time) and nothing else; the first file's Arrow schema
says which columns come through and as what kind of field
(`_parquet_fields.select`), and every other file must store those columns
alike. The catalog has one part per row group: its file, rows, index in the
file, and the span of the selected columns' chunks (first byte, length: 40
bytes a row group, whatever the columns). The span is a locator: it enters
neither fingerprint, so the order of samples does not depend on the columns
selected. Per file the source keeps only the footer's length
(`ParquetSource.footer_lengths`). No per-row array exists on the driver: a
row's key (`NAME#RG:ROW`) is made when a worker locates it. The worker's side,
`ParquetSource`, is raydl/sources/_parquet_source.py.

Catalogs without files behind them (planning benchmarks) come from per-file
row counts: `row_group_parts` and `catalog_from_row_counts`. `read_column`
reads one numeric column whole, at the driver (per-sample weights).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import DataSourceError
from raydl.sources._expand import expand_urls
from raydl.sources._footer import Footer
from raydl.sources._parquet_fields import Selection, image_and_label_selection, select
from raydl.sources._parquet_file import (
    chunk_span,
    footer_of,
    label_leaf,
    leaves_of,
    needed_leaves,
    open_pieces,
    parse_footer,
)
from raydl.sources._parquet_source import CHUNK_GAP, PARTS_COLUMNS, BoundedLRU, ParquetSource, clear_caches
from raydl.storage import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import StringColumn, int_column, numbers, one_array

# The worker's side is re-exported: callers and tests name ParquetSource, clear_caches and PARTS_COLUMNS
# from here.
__all__ = [
    "CHUNK_GAP",
    "PARTS_COLUMNS",
    "ParquetSource",
    "catalog_from_row_counts",
    "clear_caches",
    "list_parquet",
    "read_column",
    "row_group_parts",
]
_LRU = BoundedLRU  # the worker's caches' class, under the name its tests build one by

_TAIL = 64 << 10  # first guess at footer + 8 bytes; listing raises it to the largest footer it has seen
MAX_FOOTER = 64 << 20  # a footer is read whole, at listing and by a worker
_LISTING_THREADS = 16
_LOCATORS = ("offset", "length")  # the selected chunks' span: which columns are read is not which samples


class _TailGuess:
    """How many bytes of a file's end to read first: `_TAIL`, or the largest footer listing has met so far,
    so the files of a dataset whose footers are all large still cost one read each."""

    def __init__(self) -> None:
        self.value, self._lock = _TAIL, threading.Lock()

    def saw(self, need: int) -> None:
        with self._lock:
            self.value = max(self.value, min(need + need // 4, MAX_FOOTER + 8))


def read_footer(storage: Storage, info: ObjectInfo, guess: int | None = None) -> bytes:
    """The file's tail that holds its footer: the metadata, its length and the magic (one read when the
    footer fits in `guess` bytes, else two)."""
    etag = info.etag or None
    if info.size < 12:
        raise DataSourceError(f"{info.uri} is not a Parquet file ({info.size} bytes)", uri=info.uri)
    start = max(0, info.size - (guess or _TAIL))
    tail = storage.read_range(info.uri, start, info.size - start, etag=etag)
    if tail[-4:] != b"PAR1":
        raise DataSourceError(f"{info.uri} is not a Parquet file (no PAR1 magic at its end)", uri=info.uri)
    (meta_len,) = struct.unpack("<I", tail[-8:-4])
    need = meta_len + 8
    if need > info.size - 4 or meta_len > MAX_FOOTER:
        raise DataSourceError(
            f"{info.uri}: corrupt Parquet footer (metadata length {meta_len})", uri=info.uri
        )
    if need > len(tail):
        return storage.read_range(info.uri, info.size - need, need, etag=etag)
    return tail[-need:]


def _stored_as(footer: Footer, leaves: tuple[int, ...]) -> tuple:
    """How a file stores the selected columns: their leaves' paths and types, to compare files by."""
    return tuple((footer.leaves[k], footer.types[k] if footer.types else None) for k in leaves)


def _arrow_schema(uri: str, tail: bytes) -> pa.Schema:
    """The Arrow schema of a footer raydl's reader has checked (pyarrow restores fixed-size lists, large
    types and dictionaries from the file's ARROW:schema)."""
    try:
        return parse_footer(tail).schema.to_arrow_schema()
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DataSourceError(f"{uri}: corrupt Parquet footer ({exc})", uri=uri) from exc


@dataclass(frozen=True)
class _FileIndex:
    footer_length: int
    rows: np.ndarray  # per row group
    span: np.ndarray  # (row groups, 2): offset, length of the selected columns' chunks from first to last
    stored_as: tuple  # the selected leaves' paths and types (_stored_as)
    decoded: int  # about the bytes of its largest row group's selected columns, decoded
    row_bytes: int = 0  # about the bytes of one row's selected columns, decoded (its widest row group's)


def _index_file(
    storage: Storage, info: ObjectInfo, guess: _TailGuess, plan: Callable[[str, bytes, Footer], Selection]
) -> _FileIndex:
    tail = read_footer(storage, info, guess.value)
    guess.saw(len(tail))
    meta = footer_of(info.uri, info.size, tail)
    leaves = needed_leaves(meta, plan(info.uri, tail, meta), info.uri)
    spans = [chunk_span([g.chunks[k] for k in leaves]) for g in meta.row_groups]
    return _FileIndex(
        footer_length=len(tail),
        rows=np.array([g.num_rows for g in meta.row_groups], np.int64),
        span=np.array(spans, np.int64).reshape(-1, 2),
        stored_as=_stored_as(meta, leaves),
        decoded=max((sum(g.decoded[k] for k in leaves) for g in meta.row_groups if g.decoded), default=0),
        row_bytes=max(
            (
                -(-sum(g.decoded[k] for k in leaves) // g.num_rows)
                for g in meta.row_groups
                if g.decoded and g.num_rows > 0
            ),
            default=0,
        ),
    )


def row_group_parts(
    rows: Sequence[Sequence[int]], *, span: Sequence[np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """The parts columns of a Parquet catalog (`PARTS_COLUMNS`): one part per row group, from each file's
    rows per row group (`rows[f][g]`) and, where known, the span of its selected column chunks ((row groups,
    2) arrays of offset, length per file; without them, 1-byte placeholders, as for a catalog built from
    counts alone)."""
    counts = [np.asarray(r, np.int64).reshape(-1) for r in rows]
    sizes = np.array([len(c) for c in counts], np.int64)
    n = int(sizes.sum())
    if span is None:
        spans = np.tile(np.array((4, 1), np.int64), (n, 1))
    else:
        spans = (
            np.concatenate([np.asarray(g, np.int64).reshape(-1, 2) for g in span]) if n else np.zeros((0, 2))
        )
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return {
        "shard": np.repeat(np.arange(len(counts), dtype=np.int64), sizes),
        "count": np.concatenate(counts) if n else np.zeros(0, np.int64),
        "rg": np.arange(n, dtype=np.int64) - starts,
        "offset": spans[:, 0],
        "length": spans[:, 1],
    }


def _root(uris: Sequence[str]) -> str:
    root = os.path.commonprefix(list(uris))
    return root[: root.rfind("/") + 1] if "/" in root else ""


def catalog_from_row_counts(
    files: Sequence[ObjectInfo],
    rows: Sequence[Sequence[int]],
    *,
    storage: Storage,
    image_column: str = "image",
    label_column: str | None = None,
) -> Catalog:
    """A Parquet catalog of `files` whose row group g of file f has `rows[f][g]` rows, built without reading
    anything: the catalog `list_parquet` would make but for the column chunks' ranges. For planning and
    memory benchmarks (`raydl bench listing`): its samples can be planned, not read."""
    if len(files) != len(rows):
        raise ValueError(f"rows must give the row groups of each of the {len(files)} files, got {len(rows)}")
    source = ParquetSource(
        image_column,
        label_column,
        np.zeros(len(files), np.int64),
        image_and_label_selection(image_column, label_column),
    )
    return make_catalog(
        root=_root([f.uri for f in files]),
        storage=storage,
        source=source,
        shards=files,
        parts=row_group_parts(rows),
        locators=_LOCATORS,
    )


def expand_paths(paths, storage: Storage) -> list[ObjectInfo]:
    """Files, folders/prefixes (every *.parquet below), brace patterns and globs, in order."""
    out: list[ObjectInfo] = []
    for p in [paths] if isinstance(paths, str) else list(paths):
        scheme, _ = split_scheme(p)
        is_dir = os.path.isdir(p) if scheme == "file" else p.endswith("/")
        if is_dir:
            found, listed = [], 0
            for o in storage.list(p):
                listed += 1
                if o.uri.endswith(".parquet"):
                    found.append(o)
            if not listed and scheme != "file":  # an object store's folder is its objects: none, no folder
                raise DataSourceError(f"{p!r} does not exist", uri=p)
            found.sort(key=lambda o: o.uri)
            if not found:
                raise ValueError(f"the Parquet path {p!r} matches nothing (no *.parquet files below it)")
            out += found
        else:
            out += expand_urls(p, lambda _u: storage)
    return out


def list_parquet(
    paths,
    *,
    storage: Storage,
    columns: Sequence[str] | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
) -> Catalog:
    """Index the files' footers into a Catalog of row groups; see the module docstring."""
    for what, name in (("image_column", image_column), ("label_column", label_column)):
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"{what} must be a column name or None, got {name!r}")
    files = expand_paths(paths, storage)
    guess = _TailGuess()
    chosen: list[Selection] = []

    def first(uri: str, tail: bytes, footer: Footer) -> Selection:
        for role in (image_column, label_column):  # the footer's own view first: no pyarrow for a typo
            if role is not None:
                leaves_of(footer, role, uri)
        if label_column is not None:
            label_leaf(footer, label_column, uri)
        chosen.append(select(_arrow_schema(uri, tail), uri, columns, image_column, label_column))
        return chosen[0]

    # the first file's schema says what the others must hold: it is read first, then the rest at once
    head = _index_file(storage, files[0], guess, first)
    with ThreadPoolExecutor(max(1, min(_LISTING_THREADS, len(files) - 1))) as pool:
        rest = list(pool.map(lambda f: _index_file(storage, f, guess, lambda *_: chosen[0]), files[1:]))
    indexed = [head, *rest]
    for info, fi in zip(files[1:], rest, strict=True):
        if fi.stored_as != head.stored_as:
            raise ValueError(
                f"{info.uri} stores the selected columns as {_describe(fi.stored_as)}, but {files[0].uri} "
                f"as {_describe(head.stored_as)}; list such files apart, or select the columns they share"
            )
    if not sum(int(fi.rows.sum()) for fi in indexed):
        raise DataSourceError(f"no rows in {len(files)} Parquet file(s) of {paths!r}", uri=files[0].uri)
    parts = row_group_parts([fi.rows for fi in indexed], span=[fi.span for fi in indexed])
    source = ParquetSource(
        image_column,
        label_column,
        np.array([fi.footer_length for fi in indexed], np.int64),
        chosen[0],
        row_group_bytes=max(fi.decoded for fi in indexed),
        row_bytes=max(fi.row_bytes for fi in indexed),
    )
    return make_catalog(
        root=_root([f.uri for f in files]),
        storage=storage,
        source=source,
        shards=files,
        parts=parts,
        locators=_LOCATORS,
    )


def _describe(stored_as: tuple) -> str:
    return "[" + ", ".join(f"{path} {kind}" for path, kind in stored_as) + "]"


def read_column(catalog: Catalog, name: str) -> np.ndarray:
    """Every sample's value of the numeric column `name`, in sample-id order (float64): the column's chunks
    of every file, read once, at the driver (per-sample weights). A column that is missing, not numeric, or
    null somewhere is a ValueError naming the column and the file."""
    storage, out = catalog.storage, []
    for uri, size, etag in zip(
        StringColumn(catalog.shards.column("uri")),
        int_column(catalog.shards.column("size")),
        StringColumn(catalog.shards.column("etag")),
        strict=True,
    ):
        info = ObjectInfo(uri, int(size), etag)
        tail = read_footer(storage, info)
        # the chunks' ranges from raydl's reading of the footer, checked against the file: pyarrow's
        # RowGroupMetaData.column() aborts the process on some corrupt footers
        footer = footer_of(uri, info.size, tail)
        try:
            md = parse_footer(tail)
        except (OSError, pa.ArrowException, ValueError) as exc:
            raise DataSourceError(f"{uri}: corrupt Parquet footer ({exc})", uri=uri) from exc
        leaves = [i for i, leaf in enumerate(footer.leaves) if leaf == name]
        if not leaves:
            raise ValueError(f"{uri} has no column {name!r} (its columns: {md.schema.names})")
        pieces = {}
        for rg in footer.row_groups:
            start, stored = rg.chunks[leaves[0]]
            pieces[start] = storage.read_range(uri, start, stored, etag=etag or None)
        try:
            column = open_pieces(uri, info.size, md, pieces).read(columns=[name]).column(name)
        except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
            raise DataSourceError(f"{uri}: cannot decode column {name!r}: {exc}", uri=uri) from exc
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
            raise ValueError(f"column {name!r} of {uri} is {column.type}, not numbers")
        if column.null_count:
            raise ValueError(
                f"column {name!r} of {uri} has {column.null_count} nulls; every sample needs one"
            )
        out.append(numbers(one_array(column))[0].astype(np.float64))
    values = np.concatenate(out) if out else np.zeros(0)
    if len(values) != len(catalog):
        raise ValueError(
            f"column {name!r} has {len(values)} values in all and the dataset {len(catalog)} samples; "
            "read_parquet with the same files and no row filter"
        )
    return values
