"""The Parquet source as a loader worker runs it: a batch's rows located in their row groups, the row
groups' selected column chunks read and decoded, each row cut out of them.

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

Where every selected column is numbers, a label, or an array or list of
numbers and nothing runs per sample, the worker makes a batch in one
`read_batch` call instead: its row groups are decoded side by side on a small
pool of decode threads (with the next ones of an ordered read, ahead of need)
and its rows gathered out of them per row group and column
(`_parquet_fields.gather_rows`). The default shuffle window is as many row
groups as the cache holds (`window_for`), by the footers' estimate of a row
group decoded, so a shuffled epoch decodes each row group once.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydl.describe.catalog import Catalog, Located, Source
from raydl.describe.fields import Field
from raydl.errors import DataSourceError, MissingFieldError, ObjectChangedError
from raydl.sources._footer import Footer
from raydl.sources._parquet_fields import BATCH_HOWS, MISSING, RowGroupValues, Selection, gather_rows
from raydl.sources._parquet_file import chunk_span, footer_of, needed_leaves, parse_footer, read_row_group
from raydl.sources._version import mtime_ns
from raydl.storage import ObjectInfo, Storage
from raydl.util.arrow import StringColumn, int_column, one_array
from raydl.util.threads import SharedPool

__all__ = [
    "CACHE_ROW_GROUP_BYTES",
    "CHUNK_GAP",
    "PARTS_COLUMNS",
    "PREFETCH_ROW_GROUPS",
    "BoundedLRU",
    "ParquetSource",
    "clear_caches",
    "decodes",
    "window_for",
]

CHUNK_GAP = 64 << 10  # neighbouring column chunks share a read when at most this many bytes lie between
_CACHE_ROW_GROUPS = 64  # decoded row groups kept per process, at most CACHE_ROW_GROUP_BYTES of buffers
CACHE_ROW_GROUP_BYTES = 512 << 20
MAX_WINDOW = 16  # the shuffle window's default, in row groups, where that many fit the cache
PREFETCH_ROW_GROUPS = 2  # row groups decoded ahead of an ordered read
# Row groups decoded at once by a process's batch reads (pyarrow releases the GIL while it decodes)
_DECODE_THREADS = max(2, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2))
_CACHE_FOOTER_BYTES = 32 << 20  # footers kept per process, by their size as stored (parsed, a few times more)
_FOOTER_THREADS = 16  # a worker's footer reads at once, when a batch reaches files it has not read yet

PARTS_COLUMNS = ("shard", "count", "rg", "offset", "length")


class BoundedLRU:
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


def _runs(chunks: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The chunks as (start, end) runs read whole: neighbours at most CHUNK_GAP bytes apart share one."""
    runs: list[list[int]] = []
    for start, n in sorted(chunks):
        if runs and start - runs[-1][1] <= CHUNK_GAP:
            runs[-1][1] = max(runs[-1][1], start + n)
        else:
            runs.append([start, start + n])
    return [(a, b) for a, b in runs]


@dataclass(frozen=True)
class _FileFooter:
    """A file's footer as a worker read it: pyarrow's FileMetaData, raydl's checked reading, its size, the
    leaf columns the source's selection reads, and a local file's mtime when it was read."""

    meta: pq.FileMetaData
    footer: Footer
    nbytes: int
    leaves: tuple[int, ...]
    mtime_ns: int = 0
    reads: dict = field(default_factory=dict, compare=False)  # part -> its checked _RowGroupRead


@dataclass(frozen=True)
class _RowGroupRead:
    """One row group as a batch reads it: the run of chunks that is the sample's range, and the other runs
    (read when the row group is decoded). Every located row of the row group shares one."""

    uri: str
    version: tuple  # (catalog fingerprint, uri, etag, size, mtime_ns): the file as listed
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


_footers = BoundedLRU(1 << 16, _CACHE_FOOTER_BYTES, size=lambda f: f.nbytes)
_row_groups = BoundedLRU(_CACHE_ROW_GROUPS, CACHE_ROW_GROUP_BYTES, size=lambda v: v.nbytes)
_pool = SharedPool(_FOOTER_THREADS, "raydl-parquet-footer")
_decoders = SharedPool(_DECODE_THREADS, "raydl-parquet-decode")
_decodes_lock = threading.Lock()
_decodes: collections.Counter = collections.Counter()  # row groups decoded by this process: (uri, row group)
# (catalog fingerprint, selection, part) -> the Future of its read ahead, queued or running (_decodes_lock)
_ahead: dict = {}


def clear_caches() -> None:
    """Forget every footer and decoded row group this process keeps (tests and fuzzing rewrite one file)."""
    for cache in (_footers, _row_groups):
        cache.clear()
    _decodes.clear()


def decodes() -> dict[tuple[str, int], int]:
    """How many times this process decoded each row group ((file, row group)) since `clear_caches`."""
    return dict(_decodes)


def held(row_group_bytes: int) -> int:
    """Row groups of `row_group_bytes` decoded (0: unknown) that the row-group cache holds."""
    if row_group_bytes <= 0:
        return _CACHE_ROW_GROUPS
    return max(1, min(_CACHE_ROW_GROUPS, CACHE_ROW_GROUP_BYTES // row_group_bytes))


def window_for(row_group_bytes: int) -> int:
    """The shuffle window's default, in row groups: half of what the row-group cache holds decoded, so that
    the next window's row groups, decoded ahead, fit beside the window's own; at most MAX_WINDOW, at least
    1 (`row_group_bytes`: the largest row group's selected columns decoded, as its footer says; 0:
    unknown, MAX_WINDOW)."""
    if row_group_bytes <= 0:
        return MAX_WINDOW
    return max(1, min(MAX_WINDOW, held(row_group_bytes) // 2))


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
    # the largest row group's selected columns decoded, as the footers say (0: unknown): sizes the window
    row_group_bytes: int = 0
    row_bytes: int = 0  # one row's selected columns decoded, as the footers say (0: unknown)

    @property
    def sample_bytes(self) -> int | None:
        """About what a row takes in a batch, decoded (the object-store budget counts it): the footers'
        estimate, where no image column is decoded (None: the plan sizes it, from the images' shapes or the
        stored bytes)."""
        return None if self.image_column is not None or self.row_bytes <= 0 else self.row_bytes

    @property
    def shuffle_window(self) -> int:
        """Row groups shuffled together by default: as many as a worker's row-group cache holds decoded
        (`window_for`)."""
        return window_for(self.row_group_bytes)

    @property
    def reads_plain_batches(self) -> bool:
        """Every selected field is numbers, a label, or an array or list of numbers: a batch's rows are
        gathered from the decoded row groups at once (`read_batch`)."""
        return None not in self.selection.columns and all(h in BATCH_HOWS for h in self.selection.how)

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
        keys = [
            f"{names[s]}#{g}:{r}"
            for s, g, r in zip(shard.tolist(), cols["rg"].tolist(), row.tolist(), strict=True)
        ]
        offset, length = cols["offset"].copy(), cols["length"].copy()
        reads: list = [None] * len(ids)
        errors: dict[int, DataSourceError] = {}
        footers = self._footers(catalog, files)
        parts = np.unique(part)
        for p, idx in zip(parts.tolist(), _members(part, parts), strict=True):
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
            out.update(
                zip(
                    missing,
                    _pool().map(lambda s: self._footer(catalog, files.infos[s], s), missing),
                    strict=True,
                )
            )
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
            footer = footer_of(info.uri, info.size, tail)
            try:
                leaves = needed_leaves(footer, self.selection, info.uri)
            except ValueError as exc:  # listing found the columns: the file is another one now
                raise ObjectChangedError(
                    f"{info.uri} changed after it was listed: {exc}", uri=info.uri
                ) from None
            try:
                meta = parse_footer(tail)
            except (OSError, pa.ArrowException, ValueError) as exc:
                raise DataSourceError(f"{info.uri}: corrupt Parquet footer ({exc})", uri=info.uri) from exc
            return _FileFooter(meta, footer, len(tail), leaves, stamp)

        # local files have no etag: the catalog's fingerprint (counts, sizes), the footer's length, the
        # selection and the file's mtime stand in for one (a file rewritten at the same size, with the same
        # row groups, is another file: its footer and values are read again)
        stamp = mtime_ns(info)
        key = (catalog.fingerprint, info.uri, info.etag, info.size, stamp, want, self.selection.key)
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
        if not (chunks and groups[rg].num_rows == count and chunk_span(chunks) == span):
            raise ObjectChangedError(
                f"{info.uri} changed after it was listed: row group {rg} is not as listed "
                f"({count} rows, the selected columns' chunks at bytes [{span[0]}, {span[0] + span[1]}))",
                uri=info.uri,
            )
        runs = _runs(chunks)
        main = max(runs, key=lambda r: r[1] - r[0])  # the most bytes: what the batch's IO pool fetches
        file.reads[p] = read = _RowGroupRead(
            uri=info.uri,
            version=(catalog.fingerprint, info.uri, info.etag, info.size, file.mtime_ns),
            size=info.size,
            file=file,
            rg=rg,
            start=main[0],
            end=main[1],
            far=tuple(r for r in runs if r != main),
            cache_key=repr(
                (catalog.fingerprint, info.uri, info.etag, info.size, file.mtime_ns, rg, self.selection.key)
            ),
        )
        return read

    # -- whole batches (reads_plain_batches) -----------------------------------------------------------
    @property
    def bootstraps(self) -> bool:
        """Not where batches are read whole: the workers would decode the driver's row groups again."""
        return not self.reads_plain_batches

    @property
    def reads_ahead(self) -> bool:
        """Where a batch is read whole, `ahead` names the next shuffle window's rows (see read_batch)."""
        return self.reads_plain_batches

    def read_batch(
        self, catalog: Catalog, storage: Storage, ids: np.ndarray, ahead: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """The rows `ids` gathered from their decoded row groups, a few numpy copies per row group and field.
        The batch's row groups are decoded at once on the decode threads; then, behind them, the row groups
        of `ahead` (the rows of a later batch: a shuffled read's next window) as far as the cache holds
        them beside the batch's own, and where the rows are consecutive (an ordered read) the next
        PREFETCH_ROW_GROUPS row groups after them. A DataSourceError (a file changed or unreadable, a null
        cell) sends the batch down the per-sample path, where on_error settles each of its rows."""
        ids = np.asarray(ids, dtype=np.int64)
        part, row = catalog.locate(ids)
        shard = catalog.column("shard")[part].astype(np.int64)
        files = _Files(catalog, np.unique(shard))
        footers = self._footers(catalog, files)
        parts = np.unique(part)
        pool = _decoders()
        reads = [self._row_group(catalog, files, footers, p) for p in parts.tolist()]
        pending = []
        for p, read in zip(parts.tolist(), reads, strict=True):
            # decoded already, or being read ahead (a job of its own would hold a decode thread waiting on
            # that one, and the row groups queued behind it would wait too), or a job of its own
            got = _row_groups.peek(read.cache_key)
            if got is None:
                with _decodes_lock:
                    got = _ahead.get((catalog.fingerprint, self.selection.key, p))
            pending.append(got or pool.submit(self._decoded, read, storage))
        if ahead is not None:
            self._read_ahead(catalog, storage, np.asarray(ahead, dtype=np.int64), parts)
        n = len(ids)
        if n and int(ids[-1]) - int(ids[0]) == n - 1 and bool(np.all(np.diff(ids) == 1)):
            last = int(parts[-1])
            for q in range(last + 1, min(catalog.num_parts, last + 1 + PREFETCH_ROW_GROUPS)):
                self._queue_ahead(catalog, storage, q)
        groups = []
        for read, future, idx in zip(reads, pending, _members(part, parts), strict=True):
            values = future if isinstance(future, RowGroupValues) else future.result()
            if values is None:  # its read ahead failed: this batch meets the error and settles it
                values = self._decoded(read, storage)
            rows = row[idx]
            if len(rows) and int(rows.max()) >= values.rows:
                raise DataSourceError(
                    f"{read.uri}: row group {read.rg} holds {values.rows} rows, not row {int(rows.max())}",
                    uri=read.uri,
                )
            groups.append((values, rows, idx))
        batch = gather_rows(self.selection, groups, n)
        if batch is None:
            raise DataSourceError(  # met by the per-sample path, which names the sample
                f"{reads[0].uri}: a selected cell of this batch is null, or its arrays differ in shape",
                uri=reads[0].uri,
            )
        names = {s: info.uri.rsplit("/", 1)[-1] for s, info in files.infos.items()}
        rgs = catalog.column("rg")[part]
        batch["key"] = [
            f"{names[s]}#{g}:{r}" for s, g, r in zip(shard.tolist(), rgs.tolist(), row.tolist(), strict=True)
        ]
        return batch

    def _decoded(self, read: _RowGroupRead, storage: Storage) -> RowGroupValues:
        """Row group `read` decoded, from the cache or its bytes (one request per run of chunks)."""
        # one pyarrow thread: the decode threads decode row groups side by side, and pyarrow's own threads
        # for one column of one row group only add start-up and contention
        return _row_groups.get(read.cache_key, lambda: self._decode(_Part(read, storage), b"", threads=False))

    def _read_ahead(self, catalog: Catalog, storage: Storage, ahead: np.ndarray, now: np.ndarray) -> None:
        """Queue the decode of the row groups of rows `ahead` that are not among `now` (the batch's own), as
        many as the cache holds beside those; one read ahead per row group at a time."""
        if len(ahead) == 0 or int(ahead.min()) < 0 or int(ahead.max()) >= len(catalog):
            return  # a hint is only a hint: rows outside the catalog are nobody's
        mine = set(now.tolist())
        later = [p for p in np.unique(catalog.locate(ahead)[0]).tolist() if p not in mine]
        room = held(self.row_group_bytes) - len(mine)
        for p in later[: max(0, room)]:
            self._queue_ahead(catalog, storage, p)

    def _queue_ahead(self, catalog: Catalog, storage: Storage, p: int) -> None:
        """Queue the decode of part p ahead of need, unless one is queued or running: a second would hold a
        decode thread waiting for the first (BoundedLRU makes a value once)."""
        # the selection too: tables of the same files that select other columns share the fingerprint
        key = (catalog.fingerprint, self.selection.key, p)
        with _decodes_lock:
            if key in _ahead:
                return
            # a scope of its own: the batch's ends before this read does (a node cache still keeps its bytes)
            _ahead[key] = _decoders().submit(self._ahead_of_need, catalog, storage.scoped(), p, key)

    def _ahead_of_need(self, catalog: Catalog, storage: Storage, p: int, key: tuple) -> RowGroupValues | None:
        """Decode part p into the cache ahead of need, its bytes read through `storage` (a node cache keeps
        them), and return it; whatever fails here (None) is met again, and settled, by the batch that needs
        it."""
        try:
            files = _Files(catalog, catalog.column("shard")[p : p + 1].astype(np.int64))
            read = self._row_group(catalog, files, self._footers(catalog, files), p)
            return self._decoded(read, storage)
        except (DataSourceError, OSError, ValueError):
            return None
        finally:
            storage.hand_on()  # its reads' cache counts go to the next batch's
            with _decodes_lock:
                _ahead.pop(key, None)

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
        record = dict(zip(self.selection.names, cells, strict=True))
        if any(c is MISSING for c in cells):
            self._missing(read, located.key[i], record)
        return record

    def _missing(self, read: _RowGroupRead, key: str, record: dict) -> None:
        """The MissingFieldError of a row whose array field is null: the sample's own defect, which on_error
        settles."""
        for f, column in zip(self.fields, self.selection.columns, strict=True):
            if record[f.name] is MISSING:
                raise MissingFieldError(
                    f"{self.sample_uri(read.uri, key)}: field {f.name!r} (column {column!r}) is "
                    "null; an array field needs a value",
                    uri=read.uri,
                )

    def _decode(self, part: _Part, data: bytes, *, threads: bool = True) -> RowGroupValues:
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
            table = read_row_group(
                read.uri, read.size, read.file.meta, pieces, read.rg, read.file.leaves, threads=threads
            )
            decoded = {c: one_array(table.column(c)) for c in columns}
            rows = read.file.footer.row_groups[read.rg].num_rows
            values = RowGroupValues(self.selection, decoded, rows)
            with _decodes_lock:
                _decodes[(read.uri, read.rg)] += 1
            return values
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
