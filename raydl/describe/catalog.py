"""The catalog: an Arrow table with one row per sample, and the table of shards (objects) they live in.

    table:   shard | offset | length | row | label | key  [| extra columns] [| width | height]
    shards:  uri | size | etag

Image sizes are read only when a stage needs them (aspect buckets):
`with_sizes()` reads each image's header (`catalog_sizes`, with the parser of
raydl/describe/sizes.py) into int32 width and height columns, -1 where the
header is unreadable, the reason in `size_errors` by sample id. Listing reads
no image bytes.

The sample id is the row number, 0..N-1. A sample is `length` bytes at
`offset` of shard `shard` (a row of `shards`): the whole file for an image
folder, a tar member for WebDataset, a row group's column chunk for Parquet
(there `row` is the row within the row group; elsewhere -1). Sources may add
columns after the core ones (`extra`).

Two fingerprints:
- `samples_fingerprint` covers every column of the sample table (keys, labels,
  where each sample sits) but the sizes, which follow from the bytes listed and
  may or may not have been read: a catalog gives the same fingerprints, the same
  order and the same resume states with and without them. The shuffle is seeded
  by it, so the same files give the same order wherever they are stored (a local
  copy and its S3 upload).
- `fingerprint` covers that and each shard's path relative to `root`, size and
  etag. Resume states carry it, so a state cannot be loaded against changed
  data (a copy of the same files elsewhere in the same store keeps it).
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
    from raydl.sources.base import Source

__all__ = ["CORE_COLUMNS", "SIZE_COLUMNS", "Catalog", "catalog_sizes", "make_catalog"]

CORE_COLUMNS = ("shard", "offset", "length", "row", "label", "key")
SIZE_COLUMNS = ("width", "height")  # derived from the samples' bytes: outside both fingerprints


@dataclass(frozen=True)
class Catalog:
    """The samples of a source, where their bytes are, and how to cut them out (`source`)."""

    root: str
    storage: Storage
    source: Source
    shards: pa.Table
    table: pa.Table
    classes: tuple[str, ...]
    fingerprint: str
    samples_fingerprint: str
    size_errors: Mapping[int, str] = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return self.table.num_rows

    def uri(self, sample_id: int) -> str:
        """The URI of the shard (file, object) sample `sample_id` lives in."""
        shard = self.table.column("shard")[sample_id].as_py()
        return self.shards.column("uri")[shard].as_py()

    def distinct_labels(self) -> int:
        """How many distinct labels the samples carry (-1, no label, is not one)."""
        labels = int_column(self.table.column("label"))
        return int(np.unique(labels[labels >= 0]).size)

    @property
    def has_sizes(self) -> bool:
        """Whether the width and height columns are there (see `with_sizes`)."""
        return all(c in self.table.column_names for c in SIZE_COLUMNS)

    def with_sizes(self) -> Catalog:
        """This catalog with each image's width and height, read from its header now (once: a catalog
        that has them returns itself). The fingerprints stay as they are.

        Only sources whose sample is its image file's bytes (image folders) have sizes;
        any other is a ValueError.
        """
        if self.has_sizes:
            return self
        dims = catalog_sizes(self)
        table = self.table.append_column("width", int_array(dims.widths, np.int32)).append_column(
            "height", int_array(dims.heights, np.int32)
        )
        return dataclasses.replace(self, table=table, size_errors=dict(dims.errors))


def catalog_sizes(catalog: Catalog) -> HeaderSizes:
    """The sizes of a catalog's images, by sample id, from the headers of their files.

    Only a source whose sample is a whole image file (an image folder) has them:
    elsewhere the bytes at a sample's range are not an image file on their own
    (a Parquet column chunk, a compressed tar stream), and this is a ValueError.
    """
    from raydl.describe.sizes import header_sizes  # the decoders' header parsers: only when sizes are read

    if catalog.source.name != "images":
        raise ValueError(
            f"image sizes (needed by aspect_buckets()) can be read for image folders only, "
            f"not for a {catalog.source.name} source ({catalog.root!r})"
        )
    storage, shards = catalog.storage, catalog.shards.to_pydict()
    objects = [ObjectInfo(u, s, e) for u, s, e in zip(shards["uri"], shards["size"], shards["etag"])]
    shard_of = int_column(catalog.table.column("shard"))

    def read(shard: int, length: int | None) -> bytes:
        obj = objects[shard]
        n = obj.size if length is None else min(length, obj.size)
        return storage.read_range(obj.uri, 0, n, etag=obj.etag or None) if n > 0 else b""

    return header_sizes(
        read, shard_of.tolist(), threads=max(8, getattr(storage, "default_io_concurrency", 8))
    )


def _relative(uri: str, root: str) -> str:
    return uri[len(root) :].lstrip("/") if uri.startswith(root) else uri


def _fingerprint(table: pa.Table, shards: pa.Table | None, root: str) -> str:
    h = hashlib.sha256()
    table = table.drop_columns([c for c in SIZE_COLUMNS if c in table.column_names])

    def add_table(t: pa.Table) -> None:
        for name in t.column_names:
            h.update(name.encode())
            for chunk in t.column(name).chunks:
                for buf in chunk.buffers():
                    if buf is not None:
                        h.update(buf)

    add_table(table)
    if shards is None:
        return h.hexdigest()[:32]
    rel = pa.table(
        {
            "path": string_array([_relative(u, root) for u in shards.column("uri").to_pylist()]),
            "size": shards.column("size"),
            "etag": shards.column("etag"),
        }
    )
    add_table(rel)
    return h.hexdigest()[:32]


def make_catalog(
    *,
    root: str,
    storage: Storage,
    source: Source,
    shards: Sequence[ObjectInfo],
    shard: Sequence[int] | np.ndarray,
    offset: Sequence[int] | np.ndarray,
    length: Sequence[int] | np.ndarray,
    label: Sequence[int] | np.ndarray,
    key: Sequence[str],
    row: Sequence[int] | np.ndarray | None = None,
    classes: tuple[str, ...] = (),
    extra: Mapping[str, pa.Array] | None = None,
    size_errors: Mapping[int, str] | None = None,
) -> Catalog:
    """Build the two tables and the fingerprint. `extra` columns come after the core ones, in the given order
    (width and height, when given, enter neither fingerprint)."""
    n = len(key)
    columns = {
        # Built from buffers: pa.array would import pandas (see raydl/_arrow.py), a second of start-up.
        "shard": int_array(shard),
        "offset": int_array(offset),
        "length": int_array(length),
        "row": int_array(np.full(n, -1, np.int64) if row is None else row),
        "label": int_array(label),
        "key": string_array(list(key)),
    }
    for name, values in (extra or {}).items():
        if name in columns:
            raise ValueError(f"extra catalog column {name!r} clashes with a core column")
        columns[name] = values
    bad = {name: len(col) for name, col in columns.items() if len(col) != n}
    if bad:
        raise ValueError(f"catalog columns must all have {n} rows; got {bad}")
    table = pa.table(columns)
    shard_table = pa.table(
        {
            "uri": string_array([s.uri for s in shards]),
            "size": int_array([s.size for s in shards]),
            "etag": string_array([s.etag for s in shards]),
        }
    )
    return Catalog(
        root=root,
        storage=storage,
        source=source,
        shards=shard_table,
        table=table,
        classes=tuple(classes),
        fingerprint=_fingerprint(table, shard_table, root),
        samples_fingerprint=_fingerprint(table, None, root),
        size_errors=dict(size_errors or {}),
    )
