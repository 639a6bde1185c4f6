"""Each shard of a WebDataset listing: where its index block comes from, and how many samples it holds.

read_webdataset's listing (raydl/sources/webdataset.py) settles each shard
from what it knows without reading the shard, in this order: its entry in the
raydl index file `index=PATH` names (its count from the entry's signatures, or
its block from one ranged read), a wids shard list's count (no read at all),
the node cache (no request), else it finds DALI's `NAME.idx` / `NAME.tar.idx`
beside the shard (read later, one GET each) or leaves the shard to be indexed
from its own bytes. Once every block is in, a shard without a count is counted
from its block. `write_explicit` writes the index file that `index=PATH` names
where it is not there yet; workers then read each shard's block from it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from raydl.errors import DataSourceError
from raydl.sources import _wds_index
from raydl.sources._expand import Listing, stem
from raydl.sources._version import mtime_ns  # an index file's entry of a local shard must match it
from raydl.sources._wds_blocks import (
    MemberBlock,
    count_from_signatures,
    decode_block,
    member_limit,
    samples_of,
)
from raydl.sources._wds_index import IndexEntry, WidsShard
from raydl.sources._wds_source import BUILD, DALI, EXPLICIT
from raydl.storage import ObjectInfo, Storage, split_scheme

__all__ = [
    "Shard",
    "count_samples",
    "explicit_index",
    "find_dali",
    "from_cache",
    "from_explicit",
    "from_wids",
    "mtime_ns",
    "write_explicit",
]

logger = logging.getLogger("raydl.sources.webdataset")  # one logger for the WebDataset source's messages


@dataclass
class Shard:
    """One shard as listing resolves it: where its index comes from, and its count once known."""

    info: ObjectInfo
    kind: int = BUILD
    index_uri: str = ""
    index_offset: int = 0
    index_length: int = 0
    count: int | None = None
    block: MemberBlock | None = None
    mtime_ns: int = 0
    sigs: dict[str, int] | None = None  # its samples' field sets, where its index header or block says them


def _relative(uri: str, folder: str) -> str:
    return uri[len(folder) :] if folder and uri.startswith(folder) else uri


def _folder(uri: str) -> str:
    if split_scheme(uri)[0] == "file":
        uri = os.path.abspath(uri)
    return uri[: uri.rfind("/") + 1]


def _resolve_in(folder: str, path: str) -> str:
    if "://" in path or path.startswith("/"):
        return path
    return folder + path


def _exists_remote(storage: Storage, uri: str) -> bool:
    try:
        storage.stat(uri)
    except DataSourceError:
        return False
    return True


def explicit_entries(storage: Storage, path: str) -> dict[str, IndexEntry]:
    """The entries of the raydl index file `path`, by the shard URI each names."""
    info = storage.stat(path)
    entries = _wds_index.read_header(
        lambda off, n: storage.read_range(path, off, n, etag=info.etag or None), info.size, path
    )
    folder = _folder(path)
    return {_resolve_in(folder, e.path): e for e in entries}


def explicit_index(
    storage: Storage, listing: Listing, index: str
) -> tuple[str | None, dict[str, IndexEntry]]:
    """(the path, its entries by shard URI) of the raydl index file `index` names: no entries where the file
    is not there (listing writes it); (None, {}) for index "auto", "none" or a wids JSON shard list."""
    if index in ("auto", "none") or index.lower().endswith(".json"):
        return None, {}
    if listing.exists(index) or (split_scheme(index)[0] != "file" and _exists_remote(storage, index)):
        return index, explicit_entries(storage, index)
    return index, {}


def from_explicit(
    s: Shard,
    storage: Storage,
    path: str | None,
    entry: IndexEntry | None,
    fields: tuple[str, ...],
    every: bool,
) -> bool:
    """Settle `s` from its `entry` in the index file `path`: its count from the entry's signatures, else its
    block (one ranged read of the file). False where there is no entry, or one for the shard as it was
    before it changed (a warning naming the index and the shard: it is indexed again)."""
    info = s.info
    if entry is not None and (entry.size != info.size or entry.etag != info.etag):
        logger.warning(
            "raydl: %s: %s is %d bytes (etag %r) now, %d bytes (etag %r) when indexed; indexing it again",
            path,
            info.uri,
            info.size,
            info.etag,
            entry.size,
            entry.etag,
        )
        entry = None
    elif entry is not None and not info.etag and entry.mtime_ns != s.mtime_ns:
        # A local file has no etag, and one rewritten in place at the same size (its records reordered) keeps
        # its size: the entry's offsets would cut other samples' bytes under the old keys. Its mtime tells, as
        # in the node cache's key.
        logger.warning(
            "raydl: %s: %s was modified after it was indexed (mtime_ns %d now, %d in the index); indexing it "
            "again",
            path,
            info.uri,
            s.mtime_ns,
            entry.mtime_ns,
        )
        entry = None
    if entry is None:
        return False
    s.kind, s.index_uri, s.index_offset, s.index_length = EXPLICIT, path, entry.offset, entry.length
    if entry.sigs is not None:
        s.count, s.sigs = count_from_signatures(entry.sigs, fields, every), entry.sigs
    else:
        s.block = decode_block(storage.read_range(path, entry.offset, entry.length), info, path)
    return True


def from_wids(s: Shard, listed: WidsShard) -> bool:
    """Settle `s` with the count a wids shard list gives it; False where the list gives another size, or
    more samples than the shard's bytes can hold (a warning: it is indexed)."""
    most = member_limit(s.info)[0]  # a sample is one tar member at least
    if listed.nsamples > most:
        logger.warning(
            "raydl: the shard list says %s holds %d samples; its %d bytes hold at most %d; indexing it",
            s.info.uri,
            listed.nsamples,
            s.info.size,
            most,
        )
        return False
    if listed.filesize is None or listed.filesize == s.info.size:
        s.count = listed.nsamples
        return True
    logger.warning(
        "raydl: the shard list says %s is %d bytes, it is %d now; indexing it",
        s.info.uri,
        listed.filesize,
        s.info.size,
    )
    return False


def find_dali(s: Shard, listing: Listing) -> str | None:
    """Note DALI's index of `s` (NAME.idx, else NAME.tar.idx) where the listing shows one. A DALI index
    records nothing of the shard it was made from, so a local shard modified after its .idx was written
    (a later mtime) may not be the one it describes: it is not used, and that .idx is returned (the caller
    warns; the shard is indexed from its own bytes). An object store's .idx is taken as it is."""
    for idx in (stem(s.info.uri) + ".idx", s.info.uri + ".idx"):
        if listing.exists(idx):
            if s.mtime_ns and s.mtime_ns > mtime_ns(ObjectInfo(idx, 0)):
                return idx
            s.kind, s.index_uri = DALI, idx
            return None
    return None


def from_cache(s: Shard, fields: tuple[str, ...], every: bool) -> bool:
    """Settle `s` from the node cache: its count from the cached header's signatures, else its block."""
    hit = _wds_index.cache_get(s.info, header_only=True)
    if hit is None:
        return False
    entry, block = hit
    if block is not None:
        s.block = block
    else:
        s.count, s.sigs = count_from_signatures(entry.sigs, fields, every), entry.sigs
    return True


def count_samples(s: Shard, fields: tuple[str, ...], label_field: str | None, every: bool) -> int:
    """The samples of `s`'s block: those with one of the image `fields`, or all of them with `every`."""
    return len(samples_of(s.block, s.info.uri, fields, label_field, every=every))


def write_explicit(storage: Storage, path: str, shards: list[Shard]) -> None:
    """Write the raydl index file `path` for `shards` (their blocks from the listing or the cache)."""
    if split_scheme(path)[0] != "file":
        raise DataSourceError(
            f"{path}: no such index file, and raydl writes index files to local paths only; build it with "
            "`raydl index URLS --out FILE` and upload it",
            uri=path,
        )
    folder = _folder(path)
    rows = []
    for s in shards:
        block = s.block
        if block is None:
            hit = _wds_index.cache_get(s.info)
            block = hit[1] if hit is not None else _wds_index.build_block(storage, s.info)
        rows.append(
            (
                _relative(s.info.uri if s.info.etag else os.path.abspath(s.info.uri), folder),
                s.info,
                s.mtime_ns,
                block,
            )
        )
    _wds_index.write_index(path, rows)
    # the file now holds every block: workers read a shard's from it when their node cache lacks it. It is a
    # local file whatever store the shards are in.
    from raydl.storage.local import LocalStorage

    entries = explicit_entries(LocalStorage(), path)
    for s in shards:
        e = entries[s.info.uri if s.info.etag else os.path.abspath(s.info.uri)]
        s.kind, s.index_uri, s.index_offset, s.index_length = EXPLICIT, path, e.offset, e.length
