"""WebDataset tar shards: samples are runs of consecutive members sharing a key.

Grouping follows the webdataset library exactly: a member's key is its path
up to the first dot of its basename and its field the rest, lowercased;
consecutive members with one key form a sample; non-regular members, names
without a dot and `__...__` names are skipped; a field twice in one sample is
an error. Samples never span shards.

Uncompressed shards are indexed once, from their headers (raydl/sources/_tar.py):
the catalog row of a sample is its image member's offset and size, so a
loader reads each image with one ranged read (neighbours coalesce) and can
shuffle globally. The label member (small) is read while indexing.
Compressed shards (.tar.gz, .tgz) cannot be read by range: they are read
whole, decompressed, indexed in memory, and in the loader read whole again
(a few are cached per process); prefer uncompressed shards for shuffled reads.
"""

from __future__ import annotations

import collections
import fnmatch
import glob
import gzip
import logging
import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import DataSourceError, ObjectChangedError
from raydl.sources._braces import expand_braces
from raydl.sources._tar import Member, TarIndex, index_tar
from raydl.storage import ObjectInfo, Storage, split_scheme

logger = logging.getLogger(__name__)

__all__ = ["WebDatasetSource", "base_plus_ext", "expand_urls", "group_samples", "list_webdataset"]

_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_COMPRESSED = (".tar.gz", ".tgz")
_LISTING_THREADS = 16


def base_plus_ext(path: str) -> tuple[str | None, str | None]:
    """(key, field) of a member name, as webdataset splits it; (None, None) when the name has no dot."""
    m = _KEY_EXT.match(path)
    return (m.group(1), m.group(2)) if m else (None, None)


@dataclass(frozen=True)
class WdsSample:
    key: str
    fields: dict[str, int]  # field -> member index in the shard


def group_samples(names: list[str], uri: str) -> list[WdsSample]:
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


def _is_compressed(uri: str) -> bool:
    return uri.lower().endswith(_COMPRESSED)


def expand_urls(urls: str | list[str] | tuple[str, ...], storage_of) -> list[ObjectInfo]:
    """Brace patterns, globs (* ? [) and lists, local or s3://, to the shards they name, in order.

    A pattern that matches nothing is a ValueError naming it; so is a
    malformed brace pattern. `storage_of(uri)` gives the storage of a URL.
    """
    patterns = [urls] if isinstance(urls, str) else list(urls)
    if not patterns or not all(isinstance(u, str) and u for u in patterns):
        raise ValueError(f"urls must be a non-empty str or a non-empty list of str, got {urls!r}")
    out: list[ObjectInfo] = []
    for pattern in patterns:
        found: list[ObjectInfo] = []
        for url in expand_braces(pattern):
            storage = storage_of(url)
            scheme, _ = split_scheme(url)
            if any(c in url for c in "*?["):
                if scheme == "file":
                    found += [storage.stat(p) for p in sorted(glob.glob(url)) if os.path.isfile(p)]
                else:
                    head = re.split(r"[*?\[]", url, maxsplit=1)[0]
                    found += sorted(
                        (o for o in storage.list(head) if fnmatch.fnmatchcase(o.uri, url)),
                        key=lambda o: o.uri,
                    )
                continue
            try:
                found.append(storage.stat(url))
            except DataSourceError:
                if scheme == "file" and not os.path.exists(url) or scheme != "file":
                    continue  # counted below: a pattern whose every shard is missing matches nothing
                raise
        if not found:
            raise ValueError(f"the shard pattern {pattern!r} matches nothing")
        out += found
    return out


# -- indexing ---------------------------------------------------------------------------------------


def _index_shard(storage: Storage, info: ObjectInfo) -> TarIndex:
    if _is_compressed(info.uri):
        stream = _decompressed(storage, info.uri, info.etag, info.size)
        return index_tar(lambda off, n: stream[off : off + n], len(stream), info.uri, small_limit=1 << 20)
    return index_tar(
        lambda off, n: storage.read_range(info.uri, off, n, etag=info.etag or None), info.size, info.uri
    )


def _label(payload: bytes, uri: str, key: str, field: str) -> int:
    try:
        return int(payload.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError) as exc:
        raise DataSourceError(
            f"{uri}: sample {key!r} has a {field!r} member {payload[:40]!r} that is not an integer label",
            uri=uri,
        ) from exc


def list_webdataset(urls, *, storage_of, image_fields: tuple[str, ...], label_field: str | None) -> Catalog:
    """Index every shard once into a Catalog (see the module docstring)."""
    shards = expand_urls(urls, storage_of)
    storages = [storage_of(s.uri) for s in shards]
    fields = tuple(f.lower().lstrip(".") for f in image_fields)
    with ThreadPoolExecutor(min(_LISTING_THREADS, len(shards))) as pool:
        indexes = list(pool.map(_index_shard, storages, shards))
    shard_col, offset, length, label, key = [], [], [], [], []
    no_image = 0
    for s, (info, storage, index) in enumerate(zip(shards, storages, indexes)):
        members = index.members
        for sample in group_samples([m.name for m in members], info.uri):
            image = next((sample.fields[f] for f in fields if f in sample.fields), None)
            if image is None:
                no_image += 1
                continue
            value = -1
            if label_field is not None and label_field in sample.fields:
                i = sample.fields[label_field]
                payload = index.small.get(i)
                if payload is None:
                    m = members[i]
                    payload = _member_bytes(storage, info, m)
                value = _label(payload, info.uri, sample.key, label_field)
            m = members[image]
            shard_col.append(s)
            offset.append(m.offset)
            length.append(m.size)
            label.append(value)
            key.append(sample.key)
    if no_image:
        logger.warning(
            "raydl: %d webdataset samples have none of the image fields %s and are left out",
            no_image,
            list(fields),
        )
    if not key:
        raise DataSourceError(
            f"no samples with an image field {list(fields)} in {len(shards)} shard(s) of {urls!r}",
            uri=shards[0].uri,
        )
    root = os.path.commonprefix([s.uri for s in shards])
    root = root[: root.rfind("/") + 1] if "/" in root else ""
    return make_catalog(
        root=root,
        storage=storages[0],
        source=WebDatasetSource(),
        shards=shards,
        shard=shard_col,
        offset=offset,
        length=length,
        label=label,
        key=key,
    )


def _member_bytes(storage: Storage, info: ObjectInfo, m: Member) -> bytes:
    if _is_compressed(info.uri):
        return _decompressed(storage, info.uri, info.etag, info.size)[m.offset : m.offset + m.size]
    return storage.read_range(info.uri, m.offset, m.size, etag=info.etag or None)


# -- compressed shards: whole, decompressed, a few cached per process ----------------------------------

_CACHE_SHARDS = 4
_cache: collections.OrderedDict[tuple[str, str], bytes] = collections.OrderedDict()
_cache_lock = threading.Lock()


def _decompressed(storage: Storage, uri: str, etag: str, size: int) -> bytes:
    with _cache_lock:
        hit = _cache.get((uri, etag))
        if hit is not None:
            _cache.move_to_end((uri, etag))
            return hit
    raw = storage.read_range(uri, 0, size, etag=etag or None)
    try:
        data = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataSourceError(f"{uri}: corrupt or truncated gzip stream ({exc})", uri=uri) from exc
    with _cache_lock:
        _cache[(uri, etag)] = data
        while len(_cache) > _CACHE_SHARDS:
            _cache.popitem(last=False)
    return data


@dataclass(frozen=True)
class WebDatasetSource:
    """A sample is its image member's bytes: a range of an uncompressed shard, or of a compressed one's
    stream."""

    name: str = "webdataset"

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        if _is_compressed(shard.uri):
            stream = _decompressed(storage, shard.uri, shard.etag, shard.size)
            if offset + length > len(stream):
                raise ObjectChangedError(
                    f"{shard.uri} changed after it was listed: its stream ends before offset "
                    f"{offset + length}",
                    uri=shard.uri,
                )
            return stream[offset : offset + length]
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)

    def cut(self, shard: int, offset: int, length: int, row: int, data: bytes) -> bytes:
        return data

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#{key}"
