"""The source interface, as the loader worker uses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from raydl.storage.base import ObjectInfo, Storage

__all__ = ["Source", "WholeRanges"]


@runtime_checkable
class Source(Protocol):
    """A catalog's layout: how a fetched block is read and how a sample is cut from its range.

    A sample's range is its catalog row's (shard, offset, length). Samples
    whose ranges are equal share one fetch (Parquet rows of one row group's
    column chunk); neighbouring ranges are coalesced into blocks by the worker.
    """

    name: str
    #: a sample's range is exactly its bytes, so the catalog gives its size (not so for a Parquet row,
    #: whose range is its row group's column chunk)
    range_is_sample: bool

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        """The bytes [offset, offset+length) of `shard` as listed (of its decompressed stream, where
        compressed)."""
        ...

    def cut(self, shard: int, offset: int, length: int, row: int, data: bytes) -> bytes:
        """The image bytes of the sample at (shard, offset, length, row), given its range's bytes `data`."""
        ...

    def sample_uri(self, shard_uri: str, key: str) -> str:
        """How errors name one sample: the file itself, or its shard and key."""
        ...


@dataclass(frozen=True)
class WholeRanges:
    """A sample is exactly its range (image files; members of uncompressed tar shards)."""

    name: str = "images"
    range_is_sample: bool = True

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)

    def cut(self, shard: int, offset: int, length: int, row: int, data: bytes) -> bytes:
        return data

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return shard_uri if self.name == "images" else f"{shard_uri}#{key}"
