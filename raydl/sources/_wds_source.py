"""The WebDataset source as a loader worker runs it: a batch's samples located in their shards' index
blocks, a block read (inflated, for a compressed shard), each sample cut out of its range.

A shard's index block comes from the node cache, else from where listing
found it (a raydl index file, DALI's .idx), else from one streamed read of the
shard (raydl/sources/_wds_index.py); its samples (`SampleBlock`,
raydl/sources/_wds_blocks.py) are kept per process, bounded by bytes, and a
shard that changed since listing (another count of samples) is an
ObjectChangedError. A sample's range spans the members of its fields (its
image and label by default; what `fields=` selects otherwise,
raydl/sources/_wds_fields.py), which lie next to each other in the tar, so one
ranged read covers them; `cut` splits them (`MemberSpans` says where each
lies) and decodes each by its extension (raydl/sources/_values.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from raydl.describe.catalog import Catalog, Located, Source
from raydl.describe.fields import IMAGE_AND_LABEL, Field
from raydl.errors import (
    DataSourceError,
    DecodeError,
    MissingFieldError,
    ObjectChangedError,
    SampleDecodeError,
)
from raydl.sources import _wds_index
from raydl.sources._inflate import inflated
from raydl.sources._values import decode_value
from raydl.sources._version import mtime_ns
from raydl.sources._wds_blocks import (
    BlockLRU,
    MemberBlock,
    SampleBlock,
    check_count,
    decode_block,
    is_compressed,
    samples_of,
    select_samples,
)
from raydl.sources._wds_fields import Select, lacks
from raydl.storage import ObjectInfo, Storage

__all__ = [
    "BUILD",
    "DALI",
    "EXPLICIT",
    "LOCATORS",
    "MAX_LABEL_BYTES",
    "MemberSpans",
    "WebDatasetSource",
    "clear_blocks",
]

logger = logging.getLogger("raydl.sources.webdataset")  # one logger for the WebDataset source's messages

MAX_LABEL_BYTES = 4096  # a label member is an integer in text

# where a shard's index block comes from on a worker whose node cache lacks it (a parts column)
BUILD, DALI, EXPLICIT = 0, 1, 2
# the parts columns that say where a shard's index block is: locators, outside the fingerprints
LOCATORS = ("index_kind", "index_uri", "index_offset", "index_length")

_BLOCKS = BlockLRU()
_flight_lock = threading.Lock()
_flights: dict[tuple, threading.Lock] = {}


def clear_blocks() -> None:
    """Forget the index blocks this process loaded (tests)."""
    _BLOCKS.clear()


class MemberSpans(NamedTuple):
    """Where a WebDataset sample's selected fields lie inside its range (its `Located.cut_info`): one entry
    per selected field, in order (the image-and-label record: the image, then the label)."""

    shard_uri: str
    offsets: list[int]  # each field's member's offset in the range; -1: the sample has none of its extensions
    sizes: list[int]  # each member's size (0 where there is none)
    choices: list[int]  # which of the field's extensions the member is; -1: none


@dataclass(frozen=True)
class WebDatasetSource(Source):
    """Samples of tar shards: `locate` finds a sample's range (the members of its fields) in its shard's
    index block, `cut` splits it and decodes each field by its extension.

    `select` None is the image-and-label record: the first of `image_fields` a sample has, and the integer
    in its `label_field` member (samples without an image are not counted, but where a wids list counts
    them). Otherwise it is fields='s selection, every sample counted, and `fields` its kinds."""

    image_fields: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
    label_field: str | None = "cls"
    name: str = "webdataset"
    range_is_sample: bool = True
    fields: tuple[Field, ...] = IMAGE_AND_LABEL
    cut_views: bool = True  # cut gets a memoryview of the block and copies out each value once
    select: Select | None = None
    allow_pickle: bool = False

    @property
    def reads_labels(self) -> bool:
        """Whether a `label_field` is named (the default "cls" stays named under fields=)."""
        return self.label_field is not None

    # -- locate: ids to their shards' sample blocks ------------------------------------------------
    def locate(self, catalog: Catalog, ids: np.ndarray) -> Located:
        ids = np.asarray(ids, np.int64)
        part, pos = catalog.locate(ids)
        n = len(ids)
        shard = np.zeros(n, np.int64)
        offset = np.zeros(n, np.int64)
        length = np.zeros(n, np.int64)
        size = np.zeros(n, np.int64)
        keys = [""] * n
        members: list = [None] * n
        errors: dict[int, DataSourceError] = {}
        for p in np.unique(part).tolist():
            rows = np.flatnonzero(part == p)
            shard[rows] = catalog.parts.column("shard")[p].as_py()  # also for errors: they name the shard
            try:
                info, blk = self._samples(catalog, p)
            except DataSourceError as exc:
                for i in rows.tolist():
                    errors[i] = exc
                continue
            at = pos[rows]
            offset[rows] = blk.start[at]
            length[rows] = blk.length[at]
            # a sample's own bytes (for max_sample_bytes): its image (image and label), or its fields' members
            size[rows] = blk.image_len[at] if self.select is None else blk.size[at].sum(axis=1)
            spans = zip(blk.at[at].tolist(), blk.size[at].tolist(), blk.choice[at].tolist(), strict=True)
            for i, j, (where, sizes, choice) in zip(rows.tolist(), at.tolist(), spans, strict=True):
                keys[i] = blk.keys[j]
                members[i] = MemberSpans(info.uri, where, sizes, choice)
                error = self._unfit(info.uri, blk.keys[j], int(blk.start[j]), where, sizes)
                if error is not None:
                    errors[i] = error
        return Located(
            shard=shard,
            offset=offset,
            length=length,
            row=np.full(n, -1, np.int64),
            key=keys,
            label=np.full(n, -1, np.int64),
            cut_info=members,
            size=size,
            errors=errors,
        )

    def _samples(self, catalog: Catalog, part: int) -> tuple[ObjectInfo, SampleBlock]:
        """Part `part`'s shard and its samples, loaded once per process (the threads of a batch that ask at
        once wait for the first)."""
        row = {c: catalog.parts.column(c)[part].as_py() for c in ("shard", "count", "every", *LOCATORS)}
        info = catalog.shard_info(row["shard"])
        every = bool(row["every"])
        version = (info.uri, info.etag, info.size, mtime_ns(info))  # a local file rewritten since: another
        key = (*version, self.image_fields, self.label_field, every, self.select)
        hit = _BLOCKS.get(key)
        if hit is not None:
            return info, hit
        with _flight_lock:
            lock = _flights.setdefault(key, threading.Lock())
        with lock:
            hit = _BLOCKS.get(key)
            if hit is None:
                block = self._block(catalog.storage, info, row)
                if self.select is None:
                    hit = samples_of(block, info.uri, self.image_fields, self.label_field, every=every)
                else:
                    hit = select_samples(block, info.uri, [exts for _, exts in self.select])
                check_count(hit, row["count"], info, f"index from {row['index_uri'] or 'the shard'}")
                _BLOCKS.put(key, hit)
        with _flight_lock:
            _flights.pop(key, None)
        return info, hit

    def _block(self, storage: Storage, info: ObjectInfo, row: dict) -> MemberBlock:
        """The shard's members: the node cache, else its index source, else one streamed read (cached under
        the shard's key as it was before the read)."""
        key = _wds_index.cache_key(info)
        hit = _wds_index.cache_get(info)
        if hit is not None:
            return hit[1]
        block = None
        where = row["index_uri"]
        try:
            if row["index_kind"] == DALI:
                data = _wds_index.read_index_file(storage, where, _wds_index.dali_limit(info))
                block = _wds_index.parse_dali(data, where, info)
            elif row["index_kind"] == EXPLICIT:
                data = storage.read_range(where, row["index_offset"], row["index_length"])
                block = decode_block(data, info, where)
        except DataSourceError as exc:
            logger.warning("raydl: %s; indexing %s itself", exc, info.uri)
        if block is None:  # its samples are cut next: a compressed shard is inflated whole once, and kept
            block = _wds_index.build_block(storage, info, keep_inflated=True)
        _wds_index.cache_put(info, block, key=key)
        return block

    def _unfit(self, uri: str, key: str, start: int, where: list, sizes: list) -> DataSourceError | None:
        """Why a sample cannot be had, known before it is read: a selected field missing, no image, a
        label member too large to be one."""
        if self.select is not None:
            for (name, exts), at in zip(self.select, where, strict=True):
                if at < 0:
                    return lacks(uri, key, name, exts)
            return None
        if len(sizes) > 1 and sizes[1] > MAX_LABEL_BYTES:  # the sample's own defect, as a label that does
            return SampleDecodeError(  # not decode is: on_error settles it
                f"{uri}: sample {key!r} has a {sizes[1]}-byte {self.label_field!r} member at offset "
                f"{start + where[1]}, not an integer label (at most {MAX_LABEL_BYTES} bytes)",
                uri=uri,
            )
        if where[0] < 0:  # a wids list counts every sample, and this one has no image: a missing field
            return MissingFieldError(
                f"{uri}: sample {key!r} has none of the image fields {list(self.image_fields)}", uri=uri
            )
        return None

    # -- read and cut -------------------------------------------------------------------------------
    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        if is_compressed(shard.uri):
            stream = inflated(storage, shard)
            if offset + length > len(stream):
                raise ObjectChangedError(
                    f"{shard.uri} changed after it was listed: its stream ends before offset "
                    f"{offset + length}",
                    uri=shard.uri,
                )
            return stream[offset : offset + length]
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)

    def cut(self, located: Located, i: int, data: bytes) -> dict[str, object]:
        spans: MemberSpans = located.cut_info[i]
        if self.select is None:
            return self._cut_image_and_label(located.key[i], spans, data)
        uri = spans.shard_uri
        record: dict[str, object] = {}
        for (name, exts), at, size, k in zip(
            self.select, spans.offsets, spans.sizes, spans.choices, strict=True
        ):
            if at < 0:
                raise lacks(uri, located.key[i], name, exts)
            try:
                record[name] = decode_value(exts[k], data[at : at + size], allow_pickle=self.allow_pickle)
            except DecodeError as exc:
                raise DecodeError(
                    f"{uri}: sample {located.key[i]!r}: field {name!r} (its .{exts[k]} member at offset "
                    f"{int(located.offset[i]) + at}): {exc}"
                ) from exc
        return record

    def _cut_image_and_label(self, key: str, spans: MemberSpans, data) -> dict[str, object]:
        where, sizes, uri = spans.offsets, spans.sizes, spans.shard_uri
        image = bytes(data[where[0] : where[0] + sizes[0]])
        if len(where) < 2 or where[1] < 0:
            return {"image": image, "label": -1}
        payload = bytes(data[where[1] : where[1] + sizes[1]])
        try:
            return {"image": image, "label": int(payload.decode("utf-8").strip())}
        except (UnicodeDecodeError, ValueError) as exc:  # a field that does not decode: the sample's defect
            raise DecodeError(
                f"{uri}: sample {key!r} has a {self.label_field!r} member {payload[:40]!r} that "
                "is not an integer label"
            ) from exc

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#{key}"
