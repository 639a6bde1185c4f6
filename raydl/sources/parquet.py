"""Parquet files: one sample per row, a field per selected column.

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
row's key (`NAME#RG:ROW`) is made when a worker locates it.

A loader worker fetches a file's footer the first time it reads that file,
checks it against the catalog (a file changed since listing is an
ObjectChangedError) and keeps the footers it read last, per process and
bounded by bytes. The selected columns' chunks of a row group are grouped
into runs where at most `CHUNK_GAP` bytes lie between neighbours (the usual
layout puts a row's columns side by side, so one run); a sample's range is
the largest run, which every row of the row group shares, so equal ranges
coalesce and a batch fetches it once, and a row group this process holds
decoded already is located as an empty range (nothing fetched). The other
runs are read, one request each, when the row group is decoded. pyarrow decodes the selected columns
over just those bytes and the footer, once per process: the decoded row
groups are kept by an LRU bounded by bytes, and each row is cut out of them
as numpy views (`_parquet_fields.RowGroupValues`).

Catalogs without files behind them (planning benchmarks) come from per-file
row counts: `row_group_parts` and `catalog_from_row_counts`.
"""

from __future__ import annotations

import collections
import io
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydl.describe.catalog import Catalog, make_catalog
from raydl.describe.fields import Field
from raydl.errors import DataSourceError, ObjectChangedError
from raydl.sources._footer import Footer, read_footer_meta
from raydl.sources._parquet_fields import MISSING, RowGroupValues, Selection, legacy_selection, select
from raydl.sources.base import Located, Source
from raydl.storage import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import StringColumn, int_column

__all__ = ["ParquetSource", "catalog_from_row_counts", "list_parquet", "row_group_parts"]

_TAIL = 64 << 10  # first guess at footer + 8 bytes; listing raises it to the largest footer it has seen
MAX_FOOTER = 64 << 20  # a footer is read whole, at listing and by a worker
CHUNK_GAP = 64 << 10  # neighbouring column chunks share a read when at most this many bytes lie between
_CACHE_ROW_GROUPS = 64  # decoded row groups kept per process, at most _CACHE_ROW_GROUP_BYTES of buffers
_CACHE_ROW_GROUP_BYTES = 256 << 20
_CACHE_FOOTER_BYTES = 32 << 20  # footers kept per process, by their size as stored (parsed, a few times more)
_LISTING_THREADS = 16
_FOOTER_THREADS = 16  # a worker's footer reads at once, when a batch reaches files it has not read yet

PARTS_COLUMNS = ("shard", "count", "rg", "offset", "length")
_LOCATORS = ("offset", "length")  # the selected chunks' span: which columns are read is not which samples


class _SparseFile(io.RawIOBase):
    """A read-only file of `size` bytes of which only some ranges are present; reading elsewhere is an
    error."""

    def __init__(self, uri: str, size: int, pieces: dict[int, bytes]) -> None:
        self._uri, self._size, self._pieces, self._pos = uri, size, pieces, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: offset, 1: self._pos + offset, 2: self._size + offset}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self._size - self._pos
        n = min(n, self._size - self._pos)
        for start, data in self._pieces.items():
            if start <= self._pos and self._pos + n <= start + len(data):
                out = data[self._pos - start : self._pos - start + n]
                self._pos += n
                return out
        raise OSError(f"{self._uri}: bytes [{self._pos}, {self._pos + n}) were not fetched")

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class _LRU:
    """Values by key, at most `max_items` of them and `max_bytes` by `size(value)`, the least recently used
    dropped first; a value is made once however many threads ask for it at once."""

    def __init__(self, max_items: int, max_bytes: int | None = None, size=None) -> None:
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._max_items, self._max_bytes, self._size = max_items, max_bytes, size or (lambda _v: 0)
        self._bytes = 0
        self._lock = threading.Lock()
        self._making: dict = {}

    def get(self, key, make: Callable[[], object]):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            lock = self._making.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                if key in self._items:
                    return self._items[key]
            try:
                value = make()
            finally:
                with self._lock:
                    self._making.pop(key, None)
            with self._lock:
                self._items[key] = value
                self._bytes += self._size(value)
                while len(self._items) > self._max_items or (
                    self._max_bytes is not None and self._bytes > self._max_bytes and len(self._items) > 1
                ):
                    self._bytes -= self._size(self._items.popitem(last=False)[1])
            return value

    def peek(self, key):
        """The value of `key` if it is kept (None if not), made more recent."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            return None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


def parse_footer(tail: bytes) -> pq.FileMetaData:
    """The FileMetaData in a file's tail (its last bytes: metadata, length, magic), without the rest of the
    file."""
    (meta_len,) = struct.unpack("<I", tail[-8:-4])
    return pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-(meta_len + 8) :]))


def _open(uri: str, size: int, md: pq.FileMetaData, pieces: dict[int, bytes]) -> pq.ParquetFile:
    """A ParquetFile over the fetched `pieces` only; the metadata is given, so its footer is not read
    again."""
    return pq.ParquetFile(
        pa.PythonFile(_SparseFile(uri, size, pieces), mode="r"), metadata=md, pre_buffer=False
    )


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


def _footer_of(uri: str, size: int, tail: bytes) -> Footer:
    """raydl's own reading of the footer in `tail` (raydl/sources/_footer.py), checked against the file."""
    return read_footer_meta(tail[:-8], uri=uri, file_size=size)


def _leaves_of(footer: Footer, path: str, uri: str) -> tuple[int, ...]:
    """The leaf columns under `path` (a top-level column, or an image struct's "bytes" child)."""
    found = tuple(k for k, leaf in enumerate(footer.leaves) if leaf == path or leaf.startswith(path + "."))
    if not found:
        top = sorted({p.split(".")[0] for p in footer.leaves})
        raise ValueError(f"{uri} has no column {path.split('.')[0]!r}; its columns are {top}")
    return found


def _label_leaf(footer: Footer, column: str, uri: str) -> int:
    """The label column's leaf, which the footer's schema must say holds plain integers."""
    leaves = _leaves_of(footer, column, uri)
    kind = footer.types[leaves[0]] if footer.types and len(leaves) == 1 else None
    if kind is None or not kind.is_integer:
        raise ValueError(f"{uri}: label column {column!r} is {kind}, not an integer column")
    return leaves[0]


def _needed(footer: Footer, selection: Selection, uri: str) -> tuple[int, ...]:
    """The leaf columns the selection reads, in the file's order; its label column checked to be integers."""
    leaves: set[int] = set()
    for path, how in zip(selection.paths, selection.how):
        if path is not None:
            leaves.update(
                (_label_leaf(footer, path, uri),) if how == "label" else _leaves_of(footer, path, uri)
            )
    return tuple(sorted(leaves))


def _stored_as(footer: Footer, leaves: tuple[int, ...]) -> tuple:
    """How a file stores the selected columns: their leaves' paths and types, to compare files by."""
    return tuple((footer.leaves[k], footer.types[k] if footer.types else None) for k in leaves)


def _span(chunks: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(first byte, length) of the bytes from the first chunk's start to the last one's end."""
    start = min(c[0] for c in chunks)
    return start, max(c[0] + c[1] for c in chunks) - start


def _runs(chunks: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The chunks as (start, end) runs read whole: neighbours at most CHUNK_GAP bytes apart share one."""
    runs: list[list[int]] = []
    for start, n in sorted(chunks):
        if runs and start - runs[-1][1] <= CHUNK_GAP:
            runs[-1][1] = max(runs[-1][1], start + n)
        else:
            runs.append([start, start + n])
    return [(a, b) for a, b in runs]


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


def _index_file(
    storage: Storage, info: ObjectInfo, guess: _TailGuess, plan: Callable[[str, bytes, Footer], Selection]
) -> _FileIndex:
    tail = read_footer(storage, info, guess.value)
    guess.saw(len(tail))
    meta = _footer_of(info.uri, info.size, tail)
    leaves = _needed(meta, plan(info.uri, tail, meta), info.uri)
    return _FileIndex(
        footer_length=len(tail),
        rows=np.array([g.num_rows for g in meta.row_groups], np.int64),
        span=np.array([_span([g.chunks[k] for k in leaves]) for g in meta.row_groups], np.int64).reshape(
            -1, 2
        ),
        stored_as=_stored_as(meta, leaves),
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
        legacy_selection(image_column, label_column),
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
    from raydl.sources.webdataset import expand_urls

    out: list[ObjectInfo] = []
    for p in [paths] if isinstance(paths, str) else list(paths):
        scheme, _ = split_scheme(p)
        is_dir = os.path.isdir(p) if scheme == "file" else p.endswith("/")
        if is_dir:
            found = sorted((o for o in storage.list(p) if o.uri.endswith(".parquet")), key=lambda o: o.uri)
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
                _leaves_of(footer, role, uri)
        if label_column is not None:
            _label_leaf(footer, label_column, uri)
        chosen.append(select(_arrow_schema(uri, tail), uri, columns, image_column, label_column))
        return chosen[0]

    # the first file's schema says what the others must hold: it is read first, then the rest at once
    head = _index_file(storage, files[0], guess, first)
    with ThreadPoolExecutor(max(1, min(_LISTING_THREADS, len(files) - 1))) as pool:
        rest = list(pool.map(lambda f: _index_file(storage, f, guess, lambda *_: chosen[0]), files[1:]))
    indexed = [head, *rest]
    for info, fi in zip(files[1:], rest):
        if fi.stored_as != head.stored_as:
            raise ValueError(
                f"{info.uri} stores the selected columns as {_describe(fi.stored_as)}, but {files[0].uri} "
                f"as {_describe(head.stored_as)}; list such files apart, or select the columns they share"
            )
    if not sum(int(fi.rows.sum()) for fi in indexed):
        raise DataSourceError(f"no rows in {len(files)} Parquet file(s) of {paths!r}", uri=files[0].uri)
    parts = row_group_parts([fi.rows for fi in indexed], span=[fi.span for fi in indexed])
    source = ParquetSource(
        image_column, label_column, np.array([fi.footer_length for fi in indexed], np.int64), chosen[0]
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


@dataclass(frozen=True)
class _FileFooter:
    """A file's footer as a worker read it: pyarrow's FileMetaData, raydl's checked reading, its size, and
    the leaf columns the source's selection reads."""

    meta: pq.FileMetaData
    footer: Footer
    nbytes: int
    leaves: tuple[int, ...]
    reads: dict = field(default_factory=dict, compare=False)  # part -> its checked _RowGroupRead


@dataclass(frozen=True)
class _RowGroupRead:
    """One row group as a batch reads it: the run of chunks that is the sample's range, and the other runs
    (read when the row group is decoded). Every located row of the row group shares one."""

    uri: str
    version: tuple  # (catalog fingerprint, uri, etag, size): the file as listed
    size: int
    file: _FileFooter
    rg: int
    start: int  # the range's first byte in the file
    end: int
    far: tuple[tuple[int, int], ...]  # (start, end) of each other run
    cache_key: str  # its decoded values' key: the file as listed, the row group, the selection (a str, whose
    # hash is computed once, not once per row cut)


@dataclass(frozen=True)
class _Part:
    """What `cut` needs of a located row: its row group's read, and the storage to read its far runs from."""

    read: _RowGroupRead
    storage: Storage


class _Files:
    """The catalog's parts columns and the batch's files (`infos`: ObjectInfo by shard), read once per
    locate."""

    def __init__(self, catalog: Catalog, shards: np.ndarray) -> None:
        for c in PARTS_COLUMNS:
            setattr(self, c, catalog.column(c))
        uris, etags = StringColumn(catalog.shards.column("uri")), StringColumn(catalog.shards.column("etag"))
        sizes = int_column(catalog.shards.column("size"))
        self.infos = {s: ObjectInfo(uris[s], int(sizes[s]), etags[s]) for s in shards.tolist()}


_footers = _LRU(1 << 16, _CACHE_FOOTER_BYTES, size=lambda f: f.nbytes)
_row_groups = _LRU(_CACHE_ROW_GROUPS, _CACHE_ROW_GROUP_BYTES, size=lambda v: v.nbytes)
_footer_pool: ThreadPoolExecutor | None = None
_footer_pool_lock = threading.Lock()


def clear_caches() -> None:
    """Forget every footer and decoded row group this process keeps (tests and fuzzing rewrite one file)."""
    for cache in (_footers, _row_groups):
        cache.clear()


def _pool() -> ThreadPoolExecutor:
    global _footer_pool
    with _footer_pool_lock:
        if _footer_pool is None:
            _footer_pool = ThreadPoolExecutor(_FOOTER_THREADS, thread_name_prefix="raydl-parquet-footer")
        return _footer_pool


@dataclass(frozen=True, eq=False)
class ParquetSource(Source):
    """A sample is row `row` of a row group, a value per selected column (`selection`); see the module
    docstring."""

    image_column: str | None
    label_column: str | None
    footer_lengths: np.ndarray = field(repr=False)  # per file: bytes of its tail that hold the footer
    selection: Selection = field(repr=False)
    name: str = "parquet"
    range_is_sample: bool = False

    @property
    def fields(self) -> tuple[Field, ...]:
        return self.selection.fields

    @property
    def reads_labels(self) -> bool:
        """Whether a `label_column` is named."""
        return self.label_column is not None

    # -- locate: ids to row groups and rows, footers checked ------------------------------------
    def locate(self, catalog: Catalog, ids: np.ndarray) -> Located:
        ids = np.asarray(ids, dtype=np.int64)
        part, row = catalog.locate(ids)
        cols = {c: catalog.column(c)[part] for c in ("shard", "rg", "offset", "length")}
        shard = cols["shard"].astype(np.int64)
        files = _Files(catalog, np.unique(shard))
        names = {s: info.uri.rsplit("/", 1)[-1] for s, info in files.infos.items()}
        keys = [f"{names[s]}#{g}:{r}" for s, g, r in zip(shard.tolist(), cols["rg"].tolist(), row.tolist())]
        offset, length = cols["offset"].copy(), cols["length"].copy()
        reads: list = [None] * len(ids)
        errors: dict[int, DataSourceError] = {}
        footers = self._footers(catalog, files)
        parts = np.unique(part)
        for p, idx in zip(parts.tolist(), _members(part, parts)):
            try:
                read = _Part(self._row_group(catalog, files, footers, p), catalog.storage)
            except DataSourceError as exc:
                errors.update((i, exc) for i in idx.tolist())
                continue
            offset[idx], length[idx] = read.read.start, read.read.end - read.read.start
            if _row_groups.peek(read.read.cache_key) is not None:  # decoded already: nothing to fetch
                offset[idx], length[idx] = 0, 0  # all at one place, so they coalesce into one empty block
            for i in idx.tolist():
                reads[i] = read
        return Located(
            shard=shard,
            offset=offset,
            length=length,
            row=row,
            key=keys,
            label=np.full(len(ids), -1, np.int64),
            cut_info=reads,
            errors=errors,
        )

    def _footers(self, catalog: Catalog, files: _Files) -> dict[int, _FileFooter | DataSourceError]:
        """The footers of `files`: those this process has not read yet are fetched in parallel."""
        out = {s: self._footer(catalog, files.infos[s], s, cached_only=True) for s in files.infos}
        missing = [s for s, f in out.items() if f is None]
        if len(missing) > 1:
            out.update(zip(missing, _pool().map(lambda s: self._footer(catalog, files.infos[s], s), missing)))
        elif missing:
            out[missing[0]] = self._footer(catalog, files.infos[missing[0]], missing[0])
        return out

    def _footer(self, catalog: Catalog, info: ObjectInfo, shard: int, *, cached_only: bool = False):
        """File `shard`'s footer, read once per process (bounded LRU) and checked to be the one listed (a
        DataSourceError where it cannot be had; None where `cached_only` and it is not cached)."""
        want = int(self.footer_lengths[shard])

        def make() -> _FileFooter:
            if not 12 <= want <= info.size:
                raise DataSourceError(f"{info.uri}: the catalog has no footer for this file", uri=info.uri)
            tail = catalog.storage.read_range(info.uri, info.size - want, want, etag=info.etag or None)
            if len(tail) != want or tail[-4:] != b"PAR1" or int.from_bytes(tail[-8:-4], "little") != want - 8:
                raise ObjectChangedError(
                    f"{info.uri} changed after it was listed: its last {want} bytes are no footer",
                    uri=info.uri,
                )
            footer = _footer_of(info.uri, info.size, tail)
            try:
                leaves = _needed(footer, self.selection, info.uri)
            except ValueError as exc:  # listing found the columns: the file is another one now
                raise ObjectChangedError(
                    f"{info.uri} changed after it was listed: {exc}", uri=info.uri
                ) from None
            try:
                meta = parse_footer(tail)
            except (OSError, pa.ArrowException, ValueError) as exc:
                raise DataSourceError(f"{info.uri}: corrupt Parquet footer ({exc})", uri=info.uri) from exc
            return _FileFooter(meta, footer, len(tail), leaves)

        # local files have no etag: the catalog's fingerprint (counts, sizes), the footer's length and the
        # selection stand in for one
        key = (catalog.fingerprint, info.uri, info.etag, info.size, want, self.selection.key)
        if cached_only:
            return _footers.peek(key)
        try:
            return _footers.get(key, make)
        except DataSourceError as exc:
            return exc

    def _row_group(self, catalog: Catalog, files: _Files, footers: dict, p: int) -> _RowGroupRead:
        """Part p as a _RowGroupRead, its row group as the footer says it (which must be as listed)."""
        s = int(files.shard[p])
        file, info = footers[s], files.infos[s]
        if isinstance(file, DataSourceError):
            raise file
        hit = file.reads.get(p)  # the footer is this catalog's (its key holds the fingerprint)
        if hit is not None:
            return hit
        rg, count = int(files.rg[p]), int(files.count[p])
        span = (int(files.offset[p]), int(files.length[p]))
        groups = file.footer.row_groups
        chunks = [groups[rg].chunks[k] for k in file.leaves] if rg < len(groups) else []
        if not (chunks and groups[rg].num_rows == count and _span(chunks) == span):
            raise ObjectChangedError(
                f"{info.uri} changed after it was listed: row group {rg} is not as listed "
                f"({count} rows, the selected columns' chunks at bytes [{span[0]}, {span[0] + span[1]}))",
                uri=info.uri,
            )
        runs = _runs(chunks)
        main = max(runs, key=lambda r: r[1] - r[0])  # the most bytes: what the batch's IO pool fetches
        file.reads[p] = read = _RowGroupRead(
            uri=info.uri,
            version=(catalog.fingerprint, info.uri, info.etag, info.size),
            size=info.size,
            file=file,
            rg=rg,
            start=main[0],
            end=main[1],
            far=tuple(r for r in runs if r != main),
            cache_key=repr((catalog.fingerprint, info.uri, info.etag, info.size, rg, self.selection.key)),
        )
        return read

    # -- read and cut -----------------------------------------------------------------------------------
    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        if length == 0:  # rows of row groups this process holds decoded (locate says so): no request
            return b""
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)

    def cut(self, located: Located, i: int, data: bytes) -> dict[str, object]:
        part: _Part = located.cut_info[i]
        read, row = part.read, int(located.row[i])
        values = _row_groups.get(read.cache_key, lambda: self._decode(part, data))
        if row >= values.rows:  # the footer said more rows than the chunks hold
            raise DataSourceError(
                f"{read.uri}: row group {read.rg} holds {values.rows} rows, not row {row}", uri=read.uri
            )
        cells = values.row(row)
        record = dict(zip(self.selection.names, cells))
        if any(c is MISSING for c in cells):
            self._missing(read, located.key[i], record)
        return record

    def _missing(self, read: _RowGroupRead, key: str, record: dict) -> None:
        """The DataSourceError of a row whose array field is null."""
        for f, column in zip(self.fields, self.selection.columns):
            if record[f.name] is MISSING:
                raise DataSourceError(
                    f"{self.sample_uri(read.uri, key)}: field {f.name!r} (column {column!r}) is "
                    "null; an array field needs a value",
                    uri=read.uri,
                )

    def _decode(self, part: _Part, data: bytes) -> RowGroupValues:
        """The row group's selected columns, decoded by pyarrow in one call over the sample's range `data`
        and the far runs (read here, one request each)."""
        read = part.read
        if len(data) != read.end - read.start:  # located as decoded, and dropped since: read it after all
            data = part.storage.read_range(
                read.uri, read.start, read.end - read.start, etag=read.version[2] or None
            )
        pieces = {read.start: data}
        for start, end in read.far:
            pieces[start] = part.storage.read_range(
                read.uri, start, end - start, etag=read.version[2] or None
            )
        columns = [c for c in self.selection.columns if c is not None]
        try:
            table = _open(read.uri, read.size, read.file.meta, pieces).read_row_group(
                read.rg, columns=self.selection.read_paths
            )
            decoded = {c: table.column(c).combine_chunks() for c in columns}
            rows = read.file.footer.row_groups[read.rg].num_rows
            return RowGroupValues(self.selection, decoded, rows)
        except (OSError, pa.ArrowException, ValueError, KeyError) as exc:  # ArrowInvalid is a ValueError
            what = ", ".join(map(repr, columns))
            raise DataSourceError(
                f"{read.uri}: cannot decode the {what} column chunks of row group {read.rg}: {exc}",
                uri=read.uri,
            ) from exc

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#{key.split('#', 1)[-1]}"


def _members(part: np.ndarray, parts: np.ndarray) -> list[np.ndarray]:
    """For each of the sorted distinct `parts`, the indices of `part` that hold it."""
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], parts, side="left").tolist() + [len(part)]
    return [order[bounds[k] : bounds[k + 1]] for k in range(len(parts))]


def read_column(catalog: Catalog, name: str) -> np.ndarray:
    """Every sample's value of the numeric column `name`, in sample-id order (float64): the column's chunks
    of every file, read once, at the driver (per-sample weights). A column that is missing, not numeric, or
    null somewhere is a ValueError naming the column and the file."""
    storage, out = catalog.storage, []
    for uri, size, etag in zip(
        StringColumn(catalog.shards.column("uri")),
        int_column(catalog.shards.column("size")),
        StringColumn(catalog.shards.column("etag")),
    ):
        info = ObjectInfo(uri, int(size), etag)
        md = parse_footer(read_footer(storage, info))
        leaves = [i for i in range(md.num_columns) if md.schema.column(i).path == name]
        if not leaves:
            raise ValueError(f"{uri} has no column {name!r} (its columns: {md.schema.names})")
        pieces = {}
        for g in range(md.num_row_groups):
            col = md.row_group(g).column(leaves[0])
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset is not None:
                start = min(start, col.dictionary_page_offset)
            pieces[start] = storage.read_range(uri, start, col.total_compressed_size, etag=etag or None)
        column = _open(uri, info.size, md, pieces).read(columns=[name]).column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
            raise ValueError(f"column {name!r} of {uri} is {column.type}, not numbers")
        if column.null_count:
            raise ValueError(
                f"column {name!r} of {uri} has {column.null_count} nulls; every sample needs one"
            )
        out.append(column.to_numpy().astype(np.float64))
    values = np.concatenate(out) if out else np.zeros(0)
    if len(values) != len(catalog):
        raise ValueError(
            f"column {name!r} has {len(values)} values in all and the dataset {len(catalog)} samples; "
            "read_parquet with the same files and no row filter"
        )
    return values
