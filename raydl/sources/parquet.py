"""Parquet files: one sample per row, the image bytes in a column.

Listing reads each file's footer (one ranged read of its tail for ordinary
files, 16 files at a time) and nothing else. The catalog has one part per row
group: its file, rows, index in the file, and the byte ranges of its image and
label column chunks; per file it keeps only the footer's length
(`ParquetSource.footer_lengths`). No per-row array exists on the driver: a
row's key (`NAME#RG:ROW`) is made when a worker locates it.

A loader worker fetches a file's footer the first time it reads that file,
checks it against the catalog (a file changed since listing is an
ObjectChangedError) and keeps the footers it read last, per process and
bounded by bytes. A sample's range is its row group's image column chunk, and
with it the label column chunk when at most `LABEL_GAP` bytes lie between the
two (the usual layout, so one request fetches both); a label chunk further away
is read on its own when the batch is located. Equal ranges coalesce, so a
batch fetches a row group's chunks once; pyarrow decodes them over just those
bytes and the footer, and the last few decoded row groups are kept, so
neighbouring rows cost nothing more.

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
from raydl.errors import DataSourceError, ObjectChangedError
from raydl.sources._footer import Footer, read_footer_meta
from raydl.sources.base import IMAGE_AND_LABEL, Field, Located
from raydl.storage import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import StringColumn, int_column

__all__ = ["ParquetSource", "catalog_from_row_counts", "list_parquet", "row_group_parts"]

_TAIL = 64 << 10  # first guess at footer + 8 bytes; listing raises it to the largest footer it has seen
MAX_FOOTER = 64 << 20  # a footer is read whole, at listing and by a worker
LABEL_GAP = 64 << 10  # the label chunk rides with the image chunk when at most this many bytes lie between
_CACHE_ROW_GROUPS = 8  # decoded image columns kept per process
_CACHE_LABELS = 1024  # decoded label columns kept per process, at most _CACHE_LABEL_BYTES (8 bytes a row)
_CACHE_LABEL_BYTES = 64 << 20
_CACHE_FOOTER_BYTES = 32 << 20  # footers kept per process, by their size as stored (parsed, a few times more)
_LISTING_THREADS = 16
_FOOTER_THREADS = 16  # a worker's footer reads at once, when a batch reaches files it has not read yet

PARTS_COLUMNS = ("shard", "count", "rg", "offset", "length", "label_offset", "label_length")


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


def _leaf(footer: Footer, column: str, uri: str, *, struct_bytes: bool = True) -> int:
    """Index of the leaf column holding `column`'s values (for an image, a struct's "bytes" child too, as HF
    datasets store images)."""
    for want in (column, f"{column}.bytes") if struct_bytes else (column,):
        if want in footer.leaves:
            return footer.leaves.index(want)
    top = sorted({p.split(".")[0] for p in footer.leaves})
    raise ValueError(f"{uri} has no column {column!r}; its columns are {top}")


def _label_leaf(footer: Footer, column: str, uri: str) -> int:
    """The label column's leaf, which the footer's schema must say holds plain integers."""
    leaf = _leaf(footer, column, uri, struct_bytes=False)
    kind = footer.types[leaf] if footer.types else None
    if kind is None or not kind.is_integer:
        raise ValueError(f"{uri}: label column {column!r} is {kind}, not an integer column")
    return leaf


@dataclass(frozen=True)
class _FileIndex:
    footer_length: int
    rows: np.ndarray  # per row group
    image: np.ndarray  # (row groups, 2): offset, length of the image column chunk
    label: np.ndarray  # (row groups, 2), -1 without a label column


def _index_file(
    storage: Storage, info: ObjectInfo, image_column: str, label_column: str | None, guess: _TailGuess
) -> _FileIndex:
    tail = read_footer(storage, info, guess.value)
    guess.saw(len(tail))
    meta = _footer_of(info.uri, info.size, tail)
    image = _leaf(meta, image_column, info.uri)
    label = _label_leaf(meta, label_column, info.uri) if label_column is not None else None
    groups = meta.row_groups
    return _FileIndex(
        footer_length=len(tail),
        rows=np.array([g.num_rows for g in groups], np.int64),
        image=np.array([g.chunks[image] for g in groups], np.int64).reshape(-1, 2),
        label=np.array(
            [g.chunks[label] if label is not None else (-1, -1) for g in groups], np.int64
        ).reshape(-1, 2),
    )


def row_group_parts(
    rows: Sequence[Sequence[int]],
    *,
    image: Sequence[np.ndarray] | None = None,
    label: Sequence[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The parts columns of a Parquet catalog (`PARTS_COLUMNS`): one part per row group, from each file's
    rows per row group (`rows[f][g]`) and, where known, its image and label column chunks ((row groups, 2)
    arrays of offset, length per file; without them, 1-byte placeholders for the image and -1 for the label,
    as for a catalog built from counts alone)."""
    counts = [np.asarray(r, np.int64).reshape(-1) for r in rows]
    sizes = np.array([len(c) for c in counts], np.int64)
    n = int(sizes.sum())

    def chunks(given: Sequence[np.ndarray] | None, fill: tuple[int, int]) -> np.ndarray:
        if given is None:
            return np.tile(np.array(fill, np.int64), (n, 1))
        return (
            np.concatenate([np.asarray(g, np.int64).reshape(-1, 2) for g in given]) if n else np.zeros((0, 2))
        )

    img, lbl = chunks(image, (4, 1)), chunks(label, (-1, -1))
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return {
        "shard": np.repeat(np.arange(len(counts), dtype=np.int64), sizes),
        "count": np.concatenate(counts) if n else np.zeros(0, np.int64),
        "rg": np.arange(n, dtype=np.int64) - starts,
        "offset": img[:, 0],
        "length": img[:, 1],
        "label_offset": lbl[:, 0],
        "label_length": lbl[:, 1],
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
    source = ParquetSource(image_column, label_column, np.zeros(len(files), np.int64))
    return make_catalog(
        root=_root([f.uri for f in files]),
        storage=storage,
        source=source,
        shards=files,
        parts=row_group_parts(rows),
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


def list_parquet(paths, *, storage: Storage, image_column: str, label_column: str | None) -> Catalog:
    """Index the files' footers into a Catalog of row groups; see the module docstring."""
    if not isinstance(image_column, str) or not image_column:
        raise ValueError(f"image_column must be a column name, got {image_column!r}")
    files = expand_paths(paths, storage)
    guess = _TailGuess()
    with ThreadPoolExecutor(min(_LISTING_THREADS, len(files))) as pool:
        indexed = list(pool.map(lambda f: _index_file(storage, f, image_column, label_column, guess), files))
    if not sum(int(fi.rows.sum()) for fi in indexed):
        raise DataSourceError(f"no rows in {len(files)} Parquet file(s) of {paths!r}", uri=files[0].uri)
    parts = row_group_parts(
        [fi.rows for fi in indexed], image=[fi.image for fi in indexed], label=[fi.label for fi in indexed]
    )
    source = ParquetSource(
        image_column, label_column, np.array([fi.footer_length for fi in indexed], np.int64)
    )
    return make_catalog(
        root=_root([f.uri for f in files]), storage=storage, source=source, shards=files, parts=parts
    )


@dataclass(frozen=True)
class _FileFooter:
    """A file's footer as a worker read it: pyarrow's FileMetaData, raydl's checked reading, its size, and
    the leaf columns of the image and the label (-1: none)."""

    meta: pq.FileMetaData
    footer: Footer
    nbytes: int
    image_leaf: int
    label_leaf: int
    reads: dict = field(default_factory=dict, compare=False)  # part -> its checked _RowGroupRead


@dataclass(frozen=True)
class _RowGroupRead:
    """One row group as a batch reads it: where its chunks are in the sample's range, and how to decode
    them. Every located row of the row group shares one."""

    uri: str
    version: tuple  # (catalog fingerprint, uri, etag, size): the file as listed
    size: int
    file: _FileFooter
    rg: int
    start: int  # the range's first byte in the file
    image: tuple[int, int]
    label: tuple[int, int] | None  # inside the range; None: no label column, or read on its own
    far_label: tuple[int, int] | None  # a label chunk read on its own, when the batch is located

    @property
    def end(self) -> int:
        """The range's end in the file."""
        end = self.image[0] + self.image[1]
        return max(end, self.label[0] + self.label[1]) if self.label is not None else end


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
_images = _LRU(_CACHE_ROW_GROUPS)
_labels = _LRU(_CACHE_LABELS, _CACHE_LABEL_BYTES, size=lambda a: a.nbytes)
_footer_pool: ThreadPoolExecutor | None = None
_footer_pool_lock = threading.Lock()


def clear_caches() -> None:
    """Forget every footer and decoded row group this process keeps (tests and fuzzing rewrite one file)."""
    for cache in (_footers, _images, _labels):
        cache.clear()


def _pool() -> ThreadPoolExecutor:
    global _footer_pool
    with _footer_pool_lock:
        if _footer_pool is None:
            _footer_pool = ThreadPoolExecutor(_FOOTER_THREADS, thread_name_prefix="raydl-parquet-footer")
        return _footer_pool


@dataclass(frozen=True, eq=False)
class ParquetSource:
    """A sample is row `row` of the image column of a row group; see the module docstring."""

    image_column: str
    label_column: str | None
    footer_lengths: np.ndarray = field(repr=False)  # per file: bytes of its tail that hold the footer
    name: str = "parquet"
    range_is_sample: bool = False
    fields: tuple[Field, ...] = IMAGE_AND_LABEL

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
        labels = np.full(len(ids), -1, np.int64)
        extra: list = [None] * len(ids)
        errors: dict[int, DataSourceError] = {}
        footers = self._footers(catalog, files)
        parts = np.unique(part)
        for p, idx in zip(parts.tolist(), _members(part, parts)):
            try:
                read = self._row_group(catalog, files, footers, p)
                far = None
                if self.label_column is not None and read.label is None:
                    far = self._far_labels(catalog, read)
            except DataSourceError as exc:
                errors.update((i, exc) for i in idx.tolist())
                continue
            offset[idx], length[idx] = read.start, read.end - read.start
            for i in idx.tolist():
                extra[i] = read
            if far is not None:
                labels[idx] = far[row[idx]]
        return Located(
            shard=shard,
            offset=offset,
            length=length,
            row=row,
            key=keys,
            label=labels,
            extra=extra,
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
                image = _leaf(footer, self.image_column, info.uri)
                label = _label_leaf(footer, self.label_column, info.uri) if self.label_column else -1
            except ValueError as exc:  # listing found the columns: the file is another one now
                raise ObjectChangedError(
                    f"{info.uri} changed after it was listed: {exc}", uri=info.uri
                ) from None
            try:
                meta = parse_footer(tail)
            except (OSError, pa.ArrowException, ValueError) as exc:
                raise DataSourceError(f"{info.uri}: corrupt Parquet footer ({exc})", uri=info.uri) from exc
            return _FileFooter(meta, footer, len(tail), image, label)

        # local files have no etag: the catalog's fingerprint (offsets, counts, sizes) stands in for one
        key = (catalog.fingerprint, info.uri, info.etag, info.size, want)
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
        image = (int(files.offset[p]), int(files.length[p]))
        label = (int(files.label_offset[p]), int(files.label_length[p]))
        groups = file.footer.row_groups
        if not (
            rg < len(groups)
            and groups[rg].num_rows == count
            and groups[rg].chunks[file.image_leaf] == image
            and (file.label_leaf < 0 or groups[rg].chunks[file.label_leaf] == label)
        ):
            raise ObjectChangedError(
                f"{info.uri} changed after it was listed: row group {rg} is not as listed "
                f"({count} rows, the {self.image_column!r} chunk at offset {image[0]})",
                uri=info.uri,
            )
        near = file.label_leaf >= 0 and _gap(image, label) <= LABEL_GAP
        file.reads[p] = read = _RowGroupRead(
            uri=info.uri,
            version=(catalog.fingerprint, info.uri, info.etag, info.size),
            size=info.size,
            file=file,
            rg=rg,
            start=min(image[0], label[0]) if near else image[0],
            image=image,
            label=label if near else None,
            far_label=None if near or file.label_leaf < 0 else label,
        )
        return read

    def _far_labels(self, catalog: Catalog, read: _RowGroupRead) -> np.ndarray:
        """The labels of a row group whose label chunk lies too far from its image chunk to share a read."""
        off, n = read.far_label

        def make() -> np.ndarray:
            data = catalog.storage.read_range(read.uri, off, n, etag=read.version[2] or None)
            return self._labels_of(read, self._decode(read, data, [read.far_label], start=off)[0])

        return _labels.get((read.version, read.rg), make)

    # -- read and cut -----------------------------------------------------------------------------------
    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)

    def cut(self, located: Located, i: int, data: bytes) -> dict[str, object]:
        read: _RowGroupRead = located.extra[i]
        row = int(located.row[i])
        if read.label is None:  # no label column, or its labels were read when the batch was located
            return {"image": self._cell(read, row, data), "label": int(located.label[i])}
        key = (read.version, read.rg)
        labels = _labels.peek(key)
        image = self._cell(read, row, data, with_labels=labels is None)
        if labels is None:  # the row group's image column was decoded already, its labels since dropped
            labels = _labels.get(
                key, lambda: self._labels_of(read, self._decode(read, data, [read.label])[0])
            )
        return {"image": image, "label": int(labels[row])}

    def _decode(
        self, read: _RowGroupRead, data: bytes, chunks: list[tuple[int, int]], start: int | None = None
    ) -> list[pa.Array]:
        """The columns whose chunks (the image's, the label's) are `chunks`, decoded by pyarrow in one call
        over `data` only: the file's bytes from `start` (default: the sample range's start) on."""
        images = [c == read.image for c in chunks]
        leaves = [read.file.image_leaf if im else read.file.label_leaf for im in images]
        paths = [read.file.footer.leaves[leaf] for leaf in leaves]  # "image", or "image.bytes" of a struct
        at = read.start if start is None else start
        pieces = {c[0]: _piece(c, data, at) for c in chunks}
        try:
            table = _open(read.uri, read.size, read.file.meta, pieces).read_row_group(read.rg, columns=paths)
            columns = [table.column(k).combine_chunks() for k in range(len(paths))]
        except (OSError, pa.ArrowException, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            what = " and ".join(repr(self.image_column if im else self.label_column) for im in images)
            raise DataSourceError(
                f"{read.uri}: cannot decode the {what} column chunk of row group {read.rg}: {exc}",
                uri=read.uri,
            ) from exc
        out = []
        for col in columns:
            while pa.types.is_struct(col.type):
                col = col.field(0)
            out.append(col)
        return out

    def _labels_of(self, read: _RowGroupRead, col: pa.Array) -> np.ndarray:
        """The row group's decoded label column as int64, null labels -1; checked to be integers, a label a
        row."""
        column = self.label_column
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        if not pa.types.is_integer(col.type):
            raise DataSourceError(
                f"{read.uri}: label column {column!r} is {col.type}, not an integer column", uri=read.uri
            )
        rows = read.file.footer.row_groups[read.rg].num_rows
        if len(col) != rows:
            raise DataSourceError(
                f"{read.uri}: corrupt Parquet file: row group {read.rg} has {len(col)} labels for "
                f"{rows} rows",
                uri=read.uri,
            )
        if not len(col):
            return np.zeros(0, np.int64)
        return int_column(col.cast(pa.int64(), safe=False).fill_null(-1))

    def _cell(self, read: _RowGroupRead, row: int, data: bytes, *, with_labels: bool = False) -> bytes:
        def make() -> pa.Array:
            if not with_labels:
                return self._decode(read, data, [read.image])[0]
            image, labels = self._decode(read, data, [read.image, read.label])  # one pyarrow call for both
            _labels.get((read.version, read.rg), lambda: self._labels_of(read, labels))
            return image

        col = _images.get((read.version, read.rg, self.image_column), make)
        if row >= len(col):  # the footer said more rows than the chunk holds
            raise DataSourceError(
                f"{read.uri}: the {self.image_column!r} column chunk of row group {read.rg} holds "
                f"{len(col)} rows, not row {row}",
                uri=read.uri,
            )
        value = col[row]
        if not value.is_valid:
            return b""  # a null image: fails to decode, and on_error decides
        image = value.as_py()
        if not isinstance(image, bytes):
            raise DataSourceError(
                f"{read.uri}: the {self.image_column!r} column holds {col.type} values, not image bytes",
                uri=read.uri,
            )
        return image

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#{key.split('#', 1)[-1]}"


def _gap(a: tuple[int, int], b: tuple[int, int]) -> int:
    """Bytes between two ranges (0 when they touch or overlap)."""
    return max(0, max(a[0], b[0]) - min(a[0] + a[1], b[0] + b[1]))


def _piece(chunk: tuple[int, int], data: bytes, start: int) -> bytes:
    """The chunk's bytes out of `data`, which are the file's bytes from `start` on."""
    at = chunk[0] - start
    return data if at == 0 and chunk[1] == len(data) else data[at : at + chunk[1]]


def _members(part: np.ndarray, parts: np.ndarray) -> list[np.ndarray]:
    """For each of the sorted distinct `parts`, the indices of `part` that hold it."""
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], parts, side="left").tolist() + [len(part)]
    return [order[bounds[k] : bounds[k + 1]] for k in range(len(parts))]
