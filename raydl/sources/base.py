"""What every source shares: the Source contract and Located (defined beside the catalog in
raydl/describe/catalog.py, re-exported here), ImageFiles (an image folder's source) and read_whole_range."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from raydl.describe.catalog import Catalog, Located, Source
from raydl.describe.fields import FIELD_KINDS, IMAGE_AND_LABEL, Field
from raydl.storage.base import ObjectInfo, Storage
from raydl.util.arrow import StringColumn, int_column

__all__ = ["FIELD_KINDS", "IMAGE_AND_LABEL", "Field", "ImageFiles", "Located", "Source", "read_whole_range"]


def read_whole_range(storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
    """`length` bytes of `shard` at `offset`, checked against its listed etag."""
    return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)


@dataclass(frozen=True)
class ImageFiles(Source):
    """An image folder: a part is one file, labelled (the parts' "label"), and a sample is the whole file.
    Its key is its path under `prefix`."""

    prefix: str
    name: str = "images"
    range_is_sample: bool = True
    fields: tuple[Field, ...] = IMAGE_AND_LABEL
    reads_labels: ClassVar[bool] = True  # the folder's class, held by the driver (-1 with labels=None)

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
