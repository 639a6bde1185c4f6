"""A WebDataset shard's index block, and the samples grouped from it.

A shard's *index block* (`MemberBlock`) is its regular tar members in order:
(name, data offset, size), checked against the shard (inside it, in order,
apart) and kept in a small binary encoding (`encode_block` / `decode_block`)
in index files and the node cache (raydl/sources/_wds_index.py says where a
block comes from). Samples are always grouped from the names by
`group_samples`, following the webdataset library's rules, whatever the block
came from. A worker reads a shard's samples as a `SampleBlock`: for each
sample, the range its selected fields' members span and where each lies in
it; `BlockLRU` keeps the ones a process loaded last, bounded by bytes.
"""

from __future__ import annotations

import collections
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raydl.errors import DataSourceError, ObjectChangedError
from raydl.sources._inflate import inflated_limit
from raydl.sources._tar import BLOCK
from raydl.storage.base import ObjectInfo

__all__ = [
    "LRU_BYTES",
    "BlockLRU",
    "MemberBlock",
    "SampleBlock",
    "WdsSample",
    "base_plus_ext",
    "check_block",
    "check_count",
    "count_from_signatures",
    "decode_block",
    "encode_block",
    "fields_of_signatures",
    "group_samples",
    "is_compressed",
    "member_limit",
    "samples_of",
    "select_samples",
    "signatures",
]

_BLOCK_MAGIC = b"RWB1"
_COMPRESSED = (".tar.gz", ".tgz")
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
_SKIP_META = re.compile(r"__[^/]*__($|/)")


def is_compressed(uri: str) -> bool:
    return uri.lower().endswith(_COMPRESSED)


# -- grouping (webdataset's rules) ------------------------------------------------------------------


def base_plus_ext(path: str) -> tuple[str | None, str | None]:
    """(key, field) of a member name, as webdataset splits it; (None, None) when the name has no dot."""
    m = _KEY_EXT.match(path)
    return (m.group(1), m.group(2)) if m else (None, None)


@dataclass(frozen=True)
class WdsSample:
    key: str
    fields: dict[str, int]  # field -> member index in the shard


def group_samples(names: Sequence[str], uri: str) -> list[WdsSample]:
    """The samples of one shard from its regular members' names, in order (webdataset's group_by_keys)."""
    out: list[WdsSample] = []
    cur: WdsSample | None = None
    for i, name in enumerate(names):
        if "/" not in name and name.startswith("__") and name.endswith("__"):
            continue
        if _SKIP_META.match(name):
            continue
        key, ext = base_plus_ext(name)
        if key is None:
            continue
        ext = ext.lower()
        if cur is None or key != cur.key:
            cur = WdsSample(key, {})
            out.append(cur)
        if ext in cur.fields:
            raise DataSourceError(
                f"{uri}: duplicate member {name!r} in sample {key!r} (field {ext!r} twice)", uri=uri
            )
        cur.fields[ext] = i
    return out


# -- blocks -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberBlock:
    """A shard's regular members in order: name, data offset, size."""

    names: list[str]
    offsets: np.ndarray  # int64
    sizes: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.names)


def member_limit(shard: ObjectInfo) -> tuple[int, int]:
    """(most members, end of the bytes they may lie in) for `shard`: its size, or what it may inflate to."""
    end = inflated_limit(shard.size) if is_compressed(shard.uri) else shard.size
    return end // BLOCK, end


def check_block(block: MemberBlock, shard: ObjectInfo, where: str) -> None:
    """Offsets and sizes inside the shard, in order, apart; else a DataSourceError naming `where`."""
    most, end = member_limit(shard)
    n = len(block)
    if n > most:
        raise DataSourceError(
            f"{where}: {n} members listed for {shard.uri}, more than its {shard.size} bytes can hold",
            uri=where,
        )
    off, size = block.offsets, block.sizes
    if n == 0:
        return
    bad = np.flatnonzero((off < BLOCK) | (size < 0) | (size > end - off))  # off + size could wrap int64
    if bad.size:
        i = int(bad[0])
        raise DataSourceError(
            f"{where}: member {block.names[i]!r} at offset {int(off[i])} ({int(size[i])} bytes) lies outside "
            f"{shard.uri} ({shard.size} bytes)",
            uri=where,
        )
    over = np.flatnonzero(off[1:] < off[:-1] + size[:-1] + BLOCK)
    if over.size:
        i = int(over[0]) + 1
        raise DataSourceError(
            f"{where}: member {block.names[i]!r} at offset {int(off[i])} overlaps the member before it in "
            f"{shard.uri}",
            uri=where,
        )


def encode_block(block: MemberBlock) -> bytes:
    names = [n.encode("utf-8", "surrogateescape") for n in block.names]
    ends = np.cumsum([len(b) for b in names], dtype=np.int64) if names else np.zeros(0, np.int64)
    return b"".join(
        [
            _BLOCK_MAGIC,
            struct.pack("<Q", len(names)),
            np.asarray(block.offsets, "<i8").tobytes(),
            np.asarray(block.sizes, "<i8").tobytes(),
            ends.astype("<i8").tobytes(),
            b"".join(names),
        ]
    )


def decode_block(data: bytes, shard: ObjectInfo, where: str) -> MemberBlock:
    """A block written by `encode_block`, checked against `shard`; a DataSourceError naming `where`."""

    def bad(why: str) -> DataSourceError:
        return DataSourceError(f"{where}: corrupt index block for {shard.uri} ({why})", uri=where)

    if len(data) < 12 or data[:4] != _BLOCK_MAGIC:
        raise bad("no block header")
    (n,) = struct.unpack_from("<Q", data, 4)
    if n > (len(data) - 12) // 24:
        raise bad(f"{n} members claimed in {len(data)} bytes")
    arrays = np.frombuffer(data, "<i8", count=3 * n, offset=12).reshape(3, n).astype(np.int64)
    offsets, sizes, ends = arrays
    text = memoryview(data)[12 + 24 * n :]
    if n and (ends[-1] != len(text) or np.any(ends < 0) or np.any(np.diff(ends) < 0)):
        raise bad("name lengths do not add up")
    if not n and len(text):
        raise bad("trailing bytes")
    starts = np.concatenate([[0], ends[:-1]]) if n else ends
    raw = bytes(text)
    names = [
        raw[a:b].decode("utf-8", "surrogateescape")
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
    block = MemberBlock(names, offsets, sizes)
    check_block(block, shard, where)
    return block


# -- samples of a block -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleBlock:
    """The samples of one shard as a worker reads them: position p is the p-th counted sample.

    A sample's range [start, start + length) spans the members of its selected fields (they lie next to
    each other: a sample is a run of consecutive members). Column f of `at`, `size` and `choice` is
    selected field f: where its member lies inside the range (-1: the sample has none of the field's
    extensions), its size, and which of its extensions it is (-1: none). The image-and-label selection
    (`samples_of`) is the image (its alternatives) then the label."""

    keys: list[str]
    start: np.ndarray  # int64 (n,)
    length: np.ndarray  # int64 (n,)
    at: np.ndarray  # int64 (n, fields)
    size: np.ndarray  # int64 (n, fields)
    choice: np.ndarray  # int16 (n, fields)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """About what the block holds in memory: its arrays, and its keys as Python strings."""
        arrays = (self.start, self.length, self.at, self.size, self.choice)
        return sum(a.nbytes for a in arrays) + sum(len(k) + 56 for k in self.keys)

    # the image-and-label selection's columns: field 0 the image, field 1 the label (with a label_field)
    @property
    def image_at(self) -> np.ndarray:
        return self.at[:, 0]

    @property
    def image_len(self) -> np.ndarray:
        return self.size[:, 0]

    @property
    def label_at(self) -> np.ndarray:
        return self.at[:, 1] if self.at.shape[1] > 1 else np.full(len(self), -1, np.int64)

    @property
    def label_len(self) -> np.ndarray:
        return self.size[:, 1] if self.size.shape[1] > 1 else np.zeros(len(self), np.int64)

    @property
    def missing(self) -> np.ndarray:
        """The samples without the first field (no image, in the image-and-label selection)."""
        return self.at[:, 0] < 0


def _shown(key: str) -> str:
    # a name that is not UTF-8 (kept as tarfile keeps it, in surrogates) is shown with \x escapes
    return key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def select_samples(
    block: MemberBlock, uri: str, select: Sequence[Sequence[str]], *, needs_first: bool = False
) -> SampleBlock:
    """The samples of a shard's block with, for each selected field (its extensions, the first one present
    wins), where its member lies; every sample, or only those with the first field (`needs_first`)."""
    width = len(select)
    keys, rows, firsts = [], [], []
    for s in group_samples(block.names, uri):
        row = []
        for exts in select:
            found = next(((s.fields[e], k) for k, e in enumerate(exts) if e in s.fields), (-1, -1))
            row.append(found)
        if needs_first and row[0][0] < 0:
            continue
        keys.append(_shown(s.key))
        rows.append(row)
        firsts.append(min(s.fields.values()))
    idx = np.array(rows, np.int64).reshape(-1, width, 2)
    member, choice = idx[..., 0], idx[..., 1]
    present = member >= 0
    off = np.where(present, block.offsets[np.maximum(member, 0)], 0)
    size = np.where(present, block.sizes[np.maximum(member, 0)], 0)
    first = block.offsets[np.array(firsts, np.int64)]
    none = ~present.any(axis=1)  # no selected member: an empty range at the sample's first member
    far = np.iinfo(np.int64).max
    start = np.where(none, first, np.where(present, off, far).min(axis=1, initial=far))
    end = np.where(none, first, np.where(present, off + size, 0).max(axis=1, initial=0))
    return SampleBlock(
        keys=keys,
        start=start,
        length=end - start,
        at=np.where(present, off - start[:, None], -1),
        size=size,
        choice=choice.astype(np.int16),
    )


def samples_of(
    block: MemberBlock,
    uri: str,
    image_fields: tuple[str, ...],
    label_field: str | None,
    *,
    every: bool = False,
) -> SampleBlock:
    """The samples with one of `image_fields` (all samples with `every`) of a shard's block, in order: field
    0 the image, field 1 the label member (where `label_field` is given)."""
    select = (tuple(image_fields),) + (((label_field,),) if label_field is not None else ())
    return select_samples(block, uri, select, needs_first=not every)


def signatures(block: MemberBlock, uri: str) -> dict[str, int]:
    """How many samples have each set of fields ("cls,jpg": 90): a header then counts any image_fields."""
    out: collections.Counter[str] = collections.Counter()
    for s in group_samples(block.names, uri):
        out[",".join(sorted(s.fields))] += 1
    return dict(out)


def count_from_signatures(sigs: dict[str, int], image_fields: tuple[str, ...], every: bool) -> int:
    wanted = set(image_fields)
    return sum(n for sig, n in sigs.items() if every or wanted & set(sig.split(",")))


def fields_of_signatures(sigs: dict[str, int]) -> set[str]:
    """Every field some sample of the signatures has."""
    return {f for sig in sigs for f in sig.split(",") if f}


# -- a bounded LRU of sample blocks per process -----------------------------------------------------

# A globally shuffled batch touches as many shards as it has samples, so a worker keeps the blocks of many
# shards, bounded by their bytes, not their number: 256 MiB holds about 2 M samples' offsets and keys
# (ImageNet as WebDataset, whole); past that, blocks are loaded again from the node cache as batches ask.
LRU_BYTES = 256 << 20


class BlockLRU:
    """The SampleBlocks this process loaded last, at most `max_bytes` of them (and always the newest), by
    (uri, etag, size, fields, label, every)."""

    def __init__(self, max_bytes: int = LRU_BYTES) -> None:
        self.max_bytes = max_bytes
        self._d: collections.OrderedDict[tuple, SampleBlock] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> SampleBlock | None:
        with self._lock:
            hit = self._d.get(key)
            if hit is not None:
                self._d.move_to_end(key)
            return hit

    def put(self, key: tuple, value: SampleBlock) -> None:
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._d[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes and len(self._d) > 1:
                _, dropped = self._d.popitem(last=False)
                self._bytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0


def check_count(blk: SampleBlock, count: int, info: ObjectInfo, what: str) -> None:
    if len(blk) != count:
        raise ObjectChangedError(
            f"{info.uri} changed after it was listed: {len(blk)} samples in it now, {count} listed ({what})",
            uri=info.uri,
        )
