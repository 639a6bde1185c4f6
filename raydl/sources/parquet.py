"""Parquet files: one sample per row, the image bytes in a column.

Listing reads each file's footer (one or two ranged reads of its tail) and
the label column, which is small; never the image column. The catalog row of
a sample is the byte range of its row group's image column chunk (shared by
every row of that row group) and its row within the row group. A loader
worker fetches each needed column chunk once per batch (equal ranges
coalesce), decodes it with pyarrow over just those bytes and the footer, and
keeps the last few decoded row groups, so neighbouring rows cost nothing more.
"""

from __future__ import annotations

import collections
import io
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import DataSourceError
from raydl.sources._footer import Footer, read_footer_meta
from raydl.sources.base import Located, PerSampleParts
from raydl.storage import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import string_array

__all__ = ["ParquetSource", "list_parquet"]

_TAIL = 64 << 10  # first guess at footer + 8 bytes
MAX_FOOTER = 64 << 20  # a footer is read whole at listing, and kept in the catalog
_CACHE_ROW_GROUPS = 8
_LISTING_THREADS = 16


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


def read_footer(storage: Storage, info: ObjectInfo) -> tuple[int, bytes]:
    """(offset, bytes) of the file's tail that holds its footer: the metadata, its length and the magic."""
    etag = info.etag or None
    if info.size < 12:
        raise DataSourceError(f"{info.uri} is not a Parquet file ({info.size} bytes)", uri=info.uri)
    start = max(0, info.size - _TAIL)
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
        start = info.size - need
        tail = storage.read_range(info.uri, start, need, etag=etag)
    return start, tail


def _footer_of(uri: str, size: int, tail: bytes) -> Footer:
    """raydl's own reading of the footer in `tail` (raydl/sources/_footer.py), checked against the file."""
    (meta_len,) = struct.unpack("<I", tail[-8:-4])
    return read_footer_meta(tail[-(meta_len + 8) : -8], uri=uri, file_size=size)


def _leaf(footer: Footer, column: str, uri: str) -> int:
    """Index of the leaf column holding `column`'s bytes (a struct's "bytes" child, as HF datasets store
    images)."""
    for want in (column, f"{column}.bytes"):
        if want in footer.leaves:
            return footer.leaves.index(want)
    top = sorted({p.split(".")[0] for p in footer.leaves})
    raise ValueError(f"{uri} has no column {column!r}; its columns are {top}")


@dataclass(frozen=True)
class _FileIndex:
    footer: tuple[int, bytes]
    meta: Footer
    image_leaf: int


def _index_file(storage: Storage, info: ObjectInfo, image_column: str, label_column: str | None):
    footer = read_footer(storage, info)
    meta = _footer_of(info.uri, info.size, footer[1])
    leaf = _leaf(meta, image_column, info.uri)
    labels: list[np.ndarray] = []
    if label_column is not None:
        label_leaf = _leaf(meta, label_column, info.uri)
        ranges = [rg.chunks[label_leaf] for rg in meta.row_groups]
        pieces = {off: storage.read_range(info.uri, off, n, etag=info.etag or None) for off, n in ranges}
        try:
            pf = _open(info.uri, info.size, parse_footer(footer[1]), pieces)
            columns = [pf.read_row_group(g, columns=[label_column]).column(0) for g in range(len(ranges))]
        except (OSError, pa.ArrowException, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataSourceError(
                f"{info.uri}: cannot read the label column {label_column!r}: {exc}", uri=info.uri
            ) from exc
        for g, col in enumerate(columns):
            if not pa.types.is_integer(col.type):
                raise ValueError(
                    f"{info.uri}: label column {label_column!r} is {col.type}, not an integer column"
                )
            if len(col) != meta.row_groups[g].num_rows:
                raise DataSourceError(
                    f"{info.uri}: corrupt Parquet file: row group {g} has {len(col)} labels for "
                    f"{meta.row_groups[g].num_rows} rows",
                    uri=info.uri,
                )
            labels.append(col.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64))
    return _FileIndex(footer, meta, leaf), labels


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
    """Index the files' footers (and label column) into a Catalog; see the module docstring."""
    if not isinstance(image_column, str) or not image_column:
        raise ValueError(f"image_column must be a column name, got {image_column!r}")
    files = expand_paths(paths, storage)
    with ThreadPoolExecutor(min(_LISTING_THREADS, len(files))) as pool:
        indexed = list(pool.map(lambda f: _index_file(storage, f, image_column, label_column), files))
    shard, offset, length, row, label, key = [], [], [], [], [], []
    for s, (info, (fi, labels)) in enumerate(zip(files, indexed)):
        name = info.uri.rsplit("/", 1)[-1]
        for rg, group in enumerate(fi.meta.row_groups):
            n = group.num_rows
            off, size = group.chunks[fi.image_leaf]
            shard += [s] * n
            offset += [off] * n
            length += [size] * n
            row += range(n)
            label.append(labels[rg] if labels else np.full(n, -1, np.int64))
            key += [f"{name}#{rg}:{r}" for r in range(n)]
    if not key:
        raise DataSourceError(f"no rows in {len(files)} Parquet file(s) of {paths!r}", uri=files[0].uri)
    root = os.path.commonprefix([f.uri for f in files])
    root = root[: root.rfind("/") + 1] if "/" in root else ""
    source = ParquetSource(
        image_column=image_column,
        footers=tuple(fi.footer for fi, _ in indexed),
        image_leaves=tuple(fi.image_leaf for fi, _ in indexed),
    )
    return make_catalog(
        root=root,
        storage=storage,
        source=source,
        shards=files,
        parts={
            "shard": shard,
            "count": np.ones(len(key), np.int64),
            "offset": offset,
            "length": length,
            "row": row,
            "label": np.concatenate(label),
            "key": string_array(key),
        },
    )


_cache: collections.OrderedDict = collections.OrderedDict()
_cache_lock = threading.Lock()
_key_locks: dict = {}


@dataclass(frozen=True)
class ParquetSource(PerSampleParts):
    """A sample is row `row` of the image column of the row group whose column chunk is its range."""

    image_column: str
    footers: tuple[tuple[int, bytes], ...]  # per file: (offset, tail bytes holding the footer)
    image_leaves: tuple[int, ...]
    name: str = "parquet"
    range_is_sample: bool = False

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)

    def _decoded(self, shard: int, offset: int, data: bytes) -> pa.Array:
        footer = self.footers[shard]
        key = (self.image_column, footer[1], offset)  # the footer's bytes name the file's version
        with _cache_lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
            lock = _key_locks.setdefault(key, threading.Lock())
        with lock:  # one decode per row group, however many rows of it a batch has
            with _cache_lock:
                hit = _cache.get(key)
            if hit is not None:
                return hit
            size = footer[0] + len(footer[1])
            meta = _footer_of(f"Parquet file {shard}", size, footer[1])
            leaf = self.image_leaves[shard]
            rg = next((g for g, group in enumerate(meta.row_groups) if group.chunks[leaf][0] == offset), None)
            if rg is None:
                raise DataSourceError(f"no row group's {self.image_column!r} chunk starts at offset {offset}")
            try:
                pf = _open(f"Parquet file {shard}", size, parse_footer(footer[1]), {offset: data})
                path = meta.leaves[leaf]  # "image", or "image.bytes" of a struct column
                col = pf.read_row_group(rg, columns=[path]).column(0).combine_chunks()
            except (OSError, pa.ArrowException, ValueError) as exc:
                raise DataSourceError(
                    f"cannot decode the {self.image_column!r} column chunk at offset {offset}: {exc}"
                ) from exc
            while pa.types.is_struct(col.type):
                col = col.field(0)
            with _cache_lock:
                _cache[key] = col
                _key_locks.pop(key, None)
                while len(_cache) > _CACHE_ROW_GROUPS:
                    _cache.popitem(last=False)
            return col

    def cut(self, located: Located, i: int, data: bytes) -> tuple[bytes, int]:
        return self._cell(int(located.shard[i]), int(located.offset[i]), int(located.row[i]), data), int(
            located.label[i]
        )

    def _cell(self, shard: int, offset: int, row: int, data: bytes) -> bytes:
        col = self._decoded(shard, offset, data)
        if row >= len(col):  # the footer said more rows than the chunk holds
            raise DataSourceError(
                f"the {self.image_column!r} column chunk at offset {offset} holds {len(col)} rows, "
                f"not row {row}"
            )
        value = col[row]
        if not value.is_valid:
            return b""  # a null image: fails to decode, and on_error decides
        image = value.as_py()
        if not isinstance(image, bytes):
            raise DataSourceError(
                f"the {self.image_column!r} column holds {col.type} values, not image bytes"
            )
        return image

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#{key.split('#', 1)[-1]}"
