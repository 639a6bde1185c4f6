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
Compressed shards (.tar.gz, .tgz) cannot be read by range: they are
inflated whole, in bounded steps and to a bounded size, once per process
however many threads ask, and indexed and cut in memory
(raydl/sources/_inflate.py); prefer uncompressed shards for shuffled reads.

Shard patterns: brace patterns (raydl/sources/_braces.py), then globs with
one meaning on local disk and S3 (raydl/sources/_patterns.py).
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import AccessDeniedError, DataSourceError, ObjectChangedError
from raydl.sources._braces import expand_braces
from raydl.sources._inflate import inflated
from raydl.sources._patterns import has_magic, local_glob, path_regex, static_prefix
from raydl.sources._tar import Member, TarIndex, index_tar
from raydl.sources.base import Located, PerSampleParts
from raydl.storage import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import string_array

logger = logging.getLogger(__name__)

__all__ = ["WebDatasetSource", "base_plus_ext", "expand_urls", "group_samples", "list_webdataset"]

_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_COMPRESSED = (".tar.gz", ".tgz")
_LISTING_THREADS = 16
MAX_LABEL_BYTES = 4096  # a label member is an integer in text; read at listing, so bounded


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
    """Brace patterns, globs (* ? [ **) and lists, local or s3://, to the shards they name, in order.

    Globs mean the same on local disk and S3 (raydl/sources/_patterns.py); a
    name that exists as written is itself, before it is read as a glob. A
    pattern that matches nothing is a ValueError naming it; so is a malformed
    brace pattern. `storage_of(url)` gives the storage of a URL.
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
            literal = _existing(storage, url, scheme)
            if literal is not None:
                found.append(literal)
            elif has_magic(url):
                found += _glob(storage, url, scheme)
            elif scheme == "file" and os.path.exists(url):
                found.append(storage.stat(url))  # not a file: its error says what it is
        if not found:
            raise ValueError(f"the shard pattern {pattern!r} matches nothing")
        out += found
    return out


def _existing(storage: Storage, url: str, scheme: str) -> ObjectInfo | None:
    """The file or object named exactly `url`, or None where there is none (a missing shard of a brace
    pattern is counted with the rest: a pattern whose every shard is missing matches nothing)."""
    if scheme == "file":
        return storage.stat(url) if os.path.isfile(url) else None
    try:
        return storage.stat(url)
    except AccessDeniedError:
        raise
    except DataSourceError:
        return None


def _glob(storage: Storage, url: str, scheme: str) -> list[ObjectInfo]:
    if scheme == "file":
        return [storage.stat(p) for p in local_glob(url)]
    rx = path_regex(url)
    return sorted((o for o in storage.list(static_prefix(url)) if rx.fullmatch(o.uri)), key=lambda o: o.uri)


# -- indexing ---------------------------------------------------------------------------------------


def _index_shard(storage: Storage, info: ObjectInfo) -> TarIndex:
    if _is_compressed(info.uri):
        stream = inflated(storage, info)
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
                    payload = _label_bytes(storage, info, members[i], sample.key, label_field)
                value = _label(payload, info.uri, sample.key, label_field)
            m = members[image]
            shard_col.append(s)
            offset.append(m.offset)
            length.append(m.size)
            label.append(value)
            # a name that is not UTF-8 (kept as tarfile keeps it, in surrogates) is shown with \x escapes
            key.append(sample.key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))
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
        parts={
            "shard": shard_col,
            "count": np.ones(len(key), np.int64),
            "offset": offset,
            "length": length,
            "row": np.full(len(key), -1, np.int64),
            "label": label,
            "key": string_array(key),
        },
    )


def _label_bytes(storage: Storage, info: ObjectInfo, m: Member, key: str, field: str) -> bytes:
    if m.size > MAX_LABEL_BYTES:  # read at listing: never a member's worth of bytes
        raise DataSourceError(
            f"{info.uri}: sample {key!r} has a {m.size}-byte {field!r} member at offset {m.offset}, "
            f"not an integer label (at most {MAX_LABEL_BYTES} bytes)",
            uri=info.uri,
        )
    if _is_compressed(info.uri):
        return inflated(storage, info)[m.offset : m.offset + m.size]
    return storage.read_range(info.uri, m.offset, m.size, etag=info.etag or None)


@dataclass(frozen=True)
class WebDatasetSource(PerSampleParts):
    """A sample is its image member's bytes: a range of an uncompressed shard, or of a compressed one's
    stream."""

    name: str = "webdataset"
    range_is_sample: bool = True

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        if _is_compressed(shard.uri):
            stream = inflated(storage, shard)
            if offset + length > len(stream):
                raise ObjectChangedError(
                    f"{shard.uri} changed after it was listed: its stream ends before offset "
                    f"{offset + length}",
                    uri=shard.uri,
                )
            return stream[offset : offset + length]
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)

    def cut(self, located: Located, i: int, data: bytes) -> tuple[bytes, int]:
        return data, int(located.label[i])

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#{key}"
