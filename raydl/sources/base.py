"""The source interface, as the loader worker uses it: where a batch's samples are, how to cut them out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from raydl.describe.fields import FIELD_KINDS, IMAGE_AND_LABEL, Field
from raydl.errors import DataSourceError
from raydl.storage.base import ObjectInfo, Storage
from raydl.util.arrow import StringColumn, int_column

if TYPE_CHECKING:
    from raydl.describe.catalog import Catalog

__all__ = ["FIELD_KINDS", "IMAGE_AND_LABEL", "Field", "ImageFiles", "Located", "Source", "read_whole_range"]


@dataclass
class Located:
    """Where a batch's samples are: row i is the i-th id asked.

    A sample's bytes are `length` bytes at `offset` of shard `shard` (a row of
    the catalog's shards); the worker coalesces neighbouring ranges into
    blocks and hands each sample its range's bytes to `Source.cut`. `row` and
    `extra` are the source's own (a Parquet row within its row group; where a
    WebDataset sample's members lie inside its range). `label` is -1 where the
    source reads it at `cut`. `size` is the sample's own size where the range
    is more than the sample (None: `length`). `errors` are the samples that
    could not be located (their shard's index block is unreadable, or the
    shard changed): the worker settles them as unreadable, under on_error.
    """

    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    row: np.ndarray
    key: list[str]
    label: np.ndarray
    extra: list | None = None
    size: np.ndarray | None = None
    errors: dict[int, DataSourceError] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.key)

    def to_pydict(self) -> dict[str, list]:
        """The rows as lists by column (shard, offset, length, row, label, key): for tools and tests."""
        cols = {c: getattr(self, c).tolist() for c in ("shard", "offset", "length", "row", "label")}
        return {**cols, "key": list(self.key)}


@runtime_checkable
class Source(Protocol):
    """A catalog's layout: where its samples are, how a fetched block is read and how a sample is cut from
    its range.

    Samples whose ranges are equal share one fetch (Parquet rows of one row
    group's column chunk); neighbouring ranges are coalesced into blocks by the
    worker.
    """

    name: str
    #: the fields of every sample, in batch order (besides "id" and "key", which every batch has)
    fields: tuple[Field, ...]
    #: a sample's range is exactly its bytes (or `Located.size` says them), so the sample's size is known
    #: before it is read (not so for a Parquet row, whose range is its row group's column chunk)
    range_is_sample: bool
    # A source may also set `cut_views = True`: its `cut` takes a memoryview of the block and copies out the
    # bytes it returns (a WebDataset sample's image inside its image-and-label range: one copy, not two).

    def locate(self, catalog: Catalog, ids: np.ndarray) -> Located:
        """Where the samples `ids` are (one row per id, in order)."""
        ...

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        """The bytes [offset, offset+length) of `shard` as listed (of its decompressed stream, where
        compressed)."""
        ...

    def cut(self, located: Located, i: int, data: bytes) -> dict[str, object]:
        """Sample i of `located` as a record, given its range's bytes `data`: a value for every one of
        `fields` (an image field's encoded bytes; the others decoded: str, int, dict, ndarray, bytes).

        A DataSourceError when the sample cannot be had (a selected field missing: it names the sample, the
        field and the shard); a DecodeError when a field's bytes are malformed (bad JSON, .npy or gzip).
        Both go through on_error."""
        ...

    def sample_uri(self, shard_uri: str, key: str) -> str:
        """How errors name one sample: the file itself, or its shard and key."""
        ...


def read_whole_range(storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
    """`length` bytes of `shard` at `offset`, checked against its listed etag."""
    return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)


@dataclass(frozen=True)
class ImageFiles:
    """An image folder: a part is one file, labelled (the parts' "label"), and a sample is the whole file.
    Its key is its path under `prefix`."""

    prefix: str
    name: str = "images"
    range_is_sample: bool = True
    fields: tuple[Field, ...] = IMAGE_AND_LABEL

    def locate(self, catalog: Catalog, ids: np.ndarray) -> Located:
        ids = np.asarray(ids, dtype=np.int64)
        shard = catalog.column("shard")[ids]  # one file a part: the part is the sample id
        uris = StringColumn(catalog.shards.column("uri"))
        p = len(self.prefix)
        keys = [u[p:].lstrip("/") if u.startswith(self.prefix) else u for u in uris.take(shard)]
        sizes = int_column(catalog.shards.column("size"))[shard]
        return Located(
            shard=shard,
            offset=np.zeros(len(ids), np.int64),
            length=sizes,
            row=np.full(len(ids), -1, np.int64),
            key=keys,
            label=catalog.column("label")[ids].astype(np.int64),
        )

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        return read_whole_range(storage, shard, offset, length)

    def cut(self, located: Located, i: int, data: bytes) -> dict[str, object]:
        return {"image": data, "label": int(located.label[i])}

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return shard_uri
