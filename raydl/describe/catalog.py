"""The catalog: the shards (objects) a source's samples live in, and its parts, in sample-id order.

    shards:  uri | size | etag                 one row per object (image file, tar shard, Parquet file)
    parts:   shard | count [| source columns]   one row per unit of samples (an image file, a tar shard,
                                                a Parquet row group)

The driver holds this and nothing per sample (but for image folders, where a
part is one file): a source with many samples per part keeps where each
sample's bytes are in per-part blocks that a worker loads when it reads that
part (a WebDataset shard's index), or derives it from the part (a Parquet row
group's rows). Part p holds the sample ids [starts[p], starts[p+1]), `starts`
the prefix sum of `count`; `locate` maps ids to (part, position) by binary
search, so a batch costs O(batch log parts) whatever the dataset's size.

Image sizes are read only when a stage needs them (aspect buckets):
`with_sizes()` reads each image's header (`catalog_sizes`, with the parser of
raydl/describe/sizes.py) into int32 width and height parts columns, -1 where
the header is unreadable, the reason in `size_errors` by sample id. Listing
reads no image bytes.

Two fingerprints:
- `samples_fingerprint` covers every parts column but the sizes and the
  source's `locators` (where a part's index block is, which does not change
  what the samples are), and each shard's path relative to `root` and size. The
  shuffle is seeded by it, so the same files give the same order wherever they
  are stored (a local copy and its S3 upload).
- `fingerprint` covers that and each shard's etag. Resume states carry it, so
  a state cannot be loaded against changed data (a copy of the same files
  elsewhere in the same store keeps it).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from raydl.storage.base import ObjectInfo, Storage
from raydl.util.arrow import int_array, int_column, string_array

if TYPE_CHECKING:
    from raydl.describe.sizes import HeaderSizes
    from raydl.sources.base import Located, Source

__all__ = ["SIZE_COLUMNS", "Catalog", "catalog_sizes", "make_catalog"]

SIZE_COLUMNS = ("width", "height")  # derived from the samples' bytes: outside both fingerprints


@dataclass(frozen=True)
class Catalog:
    """The samples of a source: its shards, its parts and how to cut samples out of them (`source`)."""

    root: str
    storage: Storage
    source: Source
    shards: pa.Table
    parts: pa.Table
    classes: tuple[str, ...]
    fingerprint: str
    samples_fingerprint: str
    starts: np.ndarray = field(compare=False, repr=False)
    size_errors: Mapping[int, str] = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_parts(self) -> int:
        return self.parts.num_rows

    def column(self, name: str) -> np.ndarray:
        """A parts integer column as numpy (a view: no copy)."""
        return int_column(self.parts.column(name))

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(part, position within the part) of each sample id: a binary search over the parts' starts."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids must be in [0, {len(self)})")
        part = np.searchsorted(self.starts, ids, side="right") - 1
        return part, ids - self.starts[part]

    def samples(self, ids=None) -> Located:
        """Where samples `ids` (default: all) are, as a worker sees them (`Source.locate`). For tools and
        tests: a source that keeps per-shard index blocks loads them here."""
        ids = np.arange(len(self), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        return self.source.locate(self, ids)

    def shard_info(self, shard: int) -> ObjectInfo:
        """Shard (object) `shard`: its URI, size and etag."""
        s = self.shards
        return ObjectInfo(
            s.column("uri")[shard].as_py(),
            int(s.column("size")[shard].as_py()),
            s.column("etag")[shard].as_py(),
        )

    def uri(self, sample_id: int) -> str:
        """The URI of the shard (file, object) sample `sample_id` lives in."""
        part, _ = self.locate([sample_id])
        shard = int(self.column("shard")[part[0]])
        return self.shards.column("uri")[shard].as_py()

    def labels(self) -> np.ndarray | None:
        """Every sample's label, where the driver knows them (image folders: a part is one labelled file);
        None where they are read with the samples (WebDataset, Parquet)."""
        if "label" not in self.parts.column_names or self.num_parts != len(self):
            return None
        return self.column("label")

    def distinct_labels(self) -> int | None:
        """How many distinct labels the samples carry (-1, no label, is not one); None where unknown."""
        labels = self.labels()
        return None if labels is None else int(np.unique(labels[labels >= 0]).size)

    @property
    def nbytes(self) -> int:
        """Bytes the catalog's tables hold."""
        return self.parts.nbytes + self.shards.nbytes + self.starts.nbytes

    @property
    def has_sizes(self) -> bool:
        """Whether the width and height columns are there (see `with_sizes`)."""
        return all(c in self.parts.column_names for c in SIZE_COLUMNS)

    def with_sizes(self) -> Catalog:
        """This catalog with each image's width and height, read from its header now (once: a catalog
        that has them returns itself). The fingerprints stay as they are.

        Only sources whose sample is its image file's bytes (image folders) have sizes;
        any other is a ValueError.
        """
        if self.has_sizes:
            return self
        dims = catalog_sizes(self)
        parts = self.parts.append_column("width", int_array(dims.widths, np.int32)).append_column(
            "height", int_array(dims.heights, np.int32)
        )
        return dataclasses.replace(self, parts=parts, size_errors=dict(dims.errors))


def catalog_sizes(catalog: Catalog) -> HeaderSizes:
    """The sizes of a catalog's images, by sample id, from the headers of their files.

    Only a source whose sample is a whole image file (an image folder: one
    file a part) has them: elsewhere the bytes at a sample's range are not an
    image file on their own (a Parquet column chunk, a compressed tar stream),
    and this is a ValueError.
    """
    from raydl.describe.sizes import header_sizes  # the decoders' header parsers: only when sizes are read

    if catalog.source.name != "images":
        raise ValueError(
            f"image sizes (needed by aspect_buckets()) can be read for image folders only, "
            f"not for a {catalog.source.name} source ({catalog.root!r})"
        )
    storage, shards = catalog.storage, catalog.shards.to_pydict()
    objects = [ObjectInfo(u, s, e) for u, s, e in zip(shards["uri"], shards["size"], shards["etag"])]
    shard_of = catalog.column("shard")

    def read(shard: int, length: int | None) -> bytes:
        obj = objects[shard]
        n = obj.size if length is None else min(length, obj.size)
        return storage.read_range(obj.uri, 0, n, etag=obj.etag or None) if n > 0 else b""

    return header_sizes(
        read, shard_of.tolist(), threads=max(8, getattr(storage, "default_io_concurrency", 8))
    )


_PIECE = 1 << 12  # URIs made relative at a time when fingerprinting (never a whole column of them)


def _hash_array(h, chunk: pa.Array) -> None:
    """Feed an array's values to `h` as string_array / int_array lay them out (offsets from 0, then the
    bytes; or the integers), whatever its buffers' slicing, padding or all-valid bitmap."""
    kind = chunk.type
    if chunk.null_count == 0 and pa.types.is_integer(kind):
        h.update(np.ascontiguousarray(int_column(chunk)).data)
        return
    if chunk.null_count == 0 and _is_text(kind):
        ends, data = _text_buffers(chunk)
        h.update((ends - ends[0]).data)
        h.update(data[int(ends[0]) : int(ends[-1])].data)
        return
    for buf in chunk.buffers():  # nulls, or another type: as they lie
        if buf is not None:
            h.update(buf)


def _is_text(kind: pa.DataType) -> bool:
    return any(
        f(kind)
        for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    )


def _text_buffers(chunk: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A string (or binary) array's end offsets (len + 1, a view) and its bytes (a uint8 view)."""
    _validity, offsets, data = chunk.buffers()
    wide = pa.types.is_large_string(chunk.type) or pa.types.is_large_binary(chunk.type)
    ends = np.frombuffer(offsets, np.int64 if wide else np.int32)[
        chunk.offset : chunk.offset + len(chunk) + 1
    ]
    return ends, (np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8))


def _hash_table(h, t: pa.Table) -> None:
    for name in t.column_names:
        h.update(name.encode())
        for chunk in t.column(name).chunks:
            _hash_array(h, chunk)


def _relative_pieces(uris: pa.ChunkedArray, root: str):
    """(bytes, first, end) of each URI's path relative to `root` (past it and any '/' after it; a URI
    outside it whole), a piece of rows at a time, as numpy over the column's own buffers: no Python
    string per URI, no second column."""
    rb = np.frombuffer(root.encode(), np.uint8)
    for chunk in uris.chunks:
        ends, data = _text_buffers(chunk)
        for i in range(0, len(chunk), _PIECE):
            k = min(_PIECE, len(chunk) - i)
            start, end = ends[i : i + k].astype(np.int64), ends[i + 1 : i + 1 + k].astype(np.int64)
            inside = (end - start) >= len(rb)
            for j, byte in enumerate(rb):  # starts with the root's bytes (a str prefix is a UTF-8 prefix)
                inside &= data[np.minimum(start + j, max(len(data) - 1, 0))] == byte
            first = start + inside * len(rb)
            more = np.flatnonzero(inside)
            while more.size:  # lstrip("/"): only the rows still at a '/' go round again
                at = first[more]
                slash = (at < end[more]) & (data[np.minimum(at, max(len(data) - 1, 0))] == ord("/"))
                more = more[slash]
                first[more] += 1
            yield data, first, end


def _hash_relative_paths(h, uris: pa.ChunkedArray, root: str) -> None:
    """Feed `h` a column "path" of the URIs relative to root exactly as `_hash_table` would feed a
    string_array of them (its name, offsets, bytes), a piece at a time."""
    total = sum(int((end - first).sum()) for _, first, end in _relative_pieces(uris, root))
    width = np.int64 if total >= 2**31 else np.int32  # string_array's choice
    h.update(b"path")
    h.update(np.zeros(1, width).data)
    done = 0
    for _, first, end in _relative_pieces(uris, root):
        ends = done + np.cumsum(end - first)
        h.update(ends.astype(width).data)
        done = int(ends[-1]) if ends.size else done
    for data, first, end in _relative_pieces(uris, root):
        if not first.size:
            continue
        lo, hi = (
            int(first[0]),
            int(end[-1]),
        )  # rows are back to back: drop what lies between a row's end and the next's first
        keep = np.zeros(hi - lo + 1, np.int32)
        np.add.at(keep, first - lo, 1)
        np.add.at(keep, end - lo, -1)
        h.update(data[lo:hi][np.cumsum(keep[:-1], dtype=np.int32) > 0].data)


def _fingerprints(parts: pa.Table, shards: pa.Table, root: str) -> tuple[str, str]:
    """(fingerprint, samples_fingerprint): the parts columns and each shard's relative path and size, then
    (the first only) each shard's etag."""
    h = hashlib.sha256()
    _hash_table(h, parts)
    _hash_relative_paths(h, shards.column("uri"), root)
    _hash_table(h, shards.select(["size"]))
    samples = h.copy()
    _hash_table(h, shards.select(["etag"]))
    return h.hexdigest()[:32], samples.hexdigest()[:32]


def make_catalog(
    *,
    root: str,
    storage: Storage,
    source: Source,
    shards: Sequence[ObjectInfo] | pa.Table,
    parts: Mapping[str, Sequence[int] | np.ndarray | pa.Array],
    classes: tuple[str, ...] = (),
    locators: Sequence[str] = (),
    size_errors: Mapping[int, str] | None = None,
) -> Catalog:
    """Build the two tables, the parts' starts and the fingerprints.

    `parts` must hold "shard" (a row of `shards`) and "count" (samples in the
    part, >= 0), then any columns of the source's, in the given order: numpy
    or sequences of ints become int64 columns, Arrow arrays stay as they are.
    Columns named in `locators`, and width and height, enter neither fingerprint.
    `shards` may be a table with string "uri" and "etag" and integer "size"
    columns already (a listing of a million files: no ObjectInfo each).
    """
    if "shard" not in parts or "count" not in parts:
        raise ValueError(f"catalog parts need 'shard' and 'count' columns, got {list(parts)}")
    # Built from buffers: pa.array would import pandas (see raydl/util/arrow.py), a second of start-up.
    columns = {name: v if isinstance(v, pa.Array) else int_array(v) for name, v in parts.items()}
    n = len(columns["count"])
    bad = {name: len(col) for name, col in columns.items() if len(col) != n}
    if bad:
        raise ValueError(f"catalog parts columns must all have {n} rows; got {bad}")
    table = pa.table(columns)
    counts = int_column(table.column("count"))
    shard_of = int_column(table.column("shard"))
    if n and (counts.min() < 0 or shard_of.min() < 0 or shard_of.max() >= len(shards)):
        raise ValueError("catalog parts need counts >= 0 and shards that are rows of the shards table")
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    if isinstance(shards, pa.Table):
        missing = {"uri", "size", "etag"} - set(shards.column_names)
        if missing:
            raise ValueError(
                f"a catalog's shards table needs uri, size and etag columns; no {sorted(missing)}"
            )
        shard_table = shards.select(["uri", "size", "etag"])
    else:
        shard_table = pa.table(
            {
                "uri": string_array([s.uri for s in shards]),
                "size": int_array([s.size for s in shards]),
                "etag": string_array([s.etag for s in shards]),
            }
        )
    planned = table.drop_columns([c for c in (*SIZE_COLUMNS, *locators) if c in table.column_names])
    fingerprint, samples_fingerprint = _fingerprints(planned, shard_table, root)
    return Catalog(
        root=root,
        storage=storage,
        source=source,
        shards=shard_table,
        parts=table,
        classes=tuple(classes),
        fingerprint=fingerprint,
        samples_fingerprint=samples_fingerprint,
        starts=starts,
        size_errors=dict(size_errors or {}),
    )
