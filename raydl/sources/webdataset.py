"""WebDataset tar shards: samples are runs of consecutive members sharing a key.

Grouping follows the webdataset library exactly: a member's key is its path
up to the first dot of its basename and its field the rest, lowercased;
consecutive members with one key form a sample; non-regular members, names
without a dot and `__...__` names are skipped; a field twice in one sample is
an error. Samples never span shards.

Listing never makes a request per sample: the shards' sizes and etags come
from LIST pages (a brace pattern or a list of URLs lists each folder's
common prefix once), and each shard's sample count from its index
(raydl/sources/_wds_index.py), found in this order: the node cache (no
request), an explicit `index=` file, DALI's `NAME.idx` / `NAME.tar.idx`
beside the shard (one GET), a wids JSON shard list (its counts: no read at
all), else the shard itself read once in one streamed GET (then cached). The
catalog holds one part per shard (its count); the per-sample offsets and
keys stay in the shards' index blocks, which `WebDatasetSource.locate`
loads on the worker. A sample's range spans the members of its fields (its
image and label by default; what `fields=` selects otherwise,
raydl/sources/_wds_fields.py), which lie next to each other in the tar, so
one ranged read covers them; `cut` splits them and decodes each by its
extension (raydl/sources/_values.py).

Compressed shards (.tar.gz, .tgz) cannot be read by range: they are inflated
whole (one GET), in bounded steps and to a bounded size, once per process
(raydl/sources/_inflate.py); prefer uncompressed shards for shuffled reads.

Shard patterns: brace patterns (raydl/sources/_braces.py), then globs with
one meaning on local disk and S3 (raydl/sources/_patterns.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from raydl.describe.catalog import Catalog, make_catalog
from raydl.describe.fields import IMAGE_AND_LABEL, Field
from raydl.errors import DataSourceError, DecodeError
from raydl.sources import _wds_index as wi
from raydl.sources._braces import expand_braces
from raydl.sources._inflate import inflated
from raydl.sources._patterns import has_magic, local_glob, path_regex, static_prefix
from raydl.sources._values import decode_value
from raydl.sources._wds_fields import Select, fields_of, lacks, parse_fields, resolve_fields
from raydl.sources._wds_index import WdsSample, base_plus_ext, group_samples
from raydl.sources.base import Located, Source
from raydl.storage import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import string_array

logger = logging.getLogger(__name__)

__all__ = [
    "WdsSample",
    "WebDatasetSource",
    "base_plus_ext",
    "expand_urls",
    "group_samples",
    "index_webdataset",
    "list_webdataset",
]

_LISTING_THREADS = 16
_RAY_MIN_SHARDS = 64  # fewer shards than this to index: a thread pool here beats starting Ray tasks
_RAY_SHARDS_PER_TASK = 8
_PROGRESS_AFTER_S = 2.0  # indexing that takes less shows no progress bar
MAX_LABEL_BYTES = 4096  # a label member is an integer in text

# where a shard's index block comes from on a worker whose node cache lacks it (a parts column)
BUILD, DALI, EXPLICIT = 0, 1, 2
_LOCATORS = ("index_kind", "index_uri", "index_offset", "index_length")


# -- which shards: patterns to objects, from LIST pages ----------------------------------------------


def _stem(uri: str) -> str:
    """The URI without its extensions (shard-0001.tar.gz -> shard-0001): its DALI index is stem + .idx."""
    slash = uri.rfind("/") + 1
    dot = uri.find(".", slash)
    return uri if dot < 0 else uri[:dot]


class _Listing:
    """The objects LIST pages showed, by URI: each prefix listed once (S3), files stat'ed (local)."""

    def __init__(self, storage_of) -> None:
        self.storage_of = storage_of
        self.seen: dict[str, ObjectInfo] = {}
        self._listed: set[str] = set()

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        covered = any(prefix.startswith(p) for p in self._listed)
        if not covered:
            for o in self.storage_of(prefix).list(prefix):
                self.seen[o.uri] = o
            self._listed.add(prefix)
        return sorted((o for u, o in self.seen.items() if u.startswith(prefix)), key=lambda o: o.uri)

    def prefetch(self, urls: list[str]) -> None:
        """List the common prefix of `urls` (and of their stems, so NAME.idx shows), one LIST per folder."""
        by_folder: dict[str, list[str]] = {}
        for u in urls:
            by_folder.setdefault(u[: u.rfind("/") + 1], []).append(u)
        for folder, group in by_folder.items():
            prefix = os.path.commonprefix(group + [_stem(u) for u in group])
            if len(prefix) < len(folder):
                prefix = folder
            self.list_prefix(prefix)

    def get(self, uri: str) -> ObjectInfo | None:
        scheme, _ = split_scheme(uri)
        if scheme == "file":
            return self.storage_of(uri).stat(uri) if os.path.isfile(uri) else None
        return self.seen.get(uri)

    def exists(self, uri: str) -> bool:
        scheme, _ = split_scheme(uri)
        return os.path.isfile(uri) if scheme == "file" else uri in self.seen


def expand_urls(urls: str | list[str] | tuple[str, ...], storage_of) -> list[ObjectInfo]:
    """Brace patterns, globs (* ? [ **) and lists, local or s3://, to the shards they name, in order.

    Globs mean the same on local disk and S3 (raydl/sources/_patterns.py); a
    name that exists as written is itself, before it is read as a glob. A
    pattern that matches nothing is a ValueError naming it; so is a malformed
    brace pattern. `storage_of(url)` gives the storage of a URL. On S3 the
    sizes and etags come from LIST pages (never a HEAD per object).
    """
    return _expand(urls, _Listing(storage_of))


def _expand(urls, listing: _Listing) -> list[ObjectInfo]:
    patterns = [urls] if isinstance(urls, str) else list(urls)
    if not patterns or not all(isinstance(u, str) and u for u in patterns):
        raise ValueError(f"urls must be a non-empty str or a non-empty list of str, got {urls!r}")
    expanded = [(p, expand_braces(p)) for p in patterns]
    remote = [u for _, us in expanded for u in us if split_scheme(u)[0] != "file" and not has_magic(u)]
    for u in remote:
        listing.storage_of(u)  # a ValueError naming an unknown scheme, before anything is listed
    listing.prefetch(remote)
    out: list[ObjectInfo] = []
    for pattern, candidates in expanded:
        found: list[ObjectInfo] = []
        for url in candidates:
            storage = listing.storage_of(url)
            scheme, _ = split_scheme(url)
            literal = listing.get(url) if scheme == "file" or not has_magic(url) else None
            if literal is None and has_magic(url) and scheme != "file":
                listed = listing.list_prefix(static_prefix(url))
                literal = next((o for o in listed if o.uri == url), None)
                if literal is None:
                    rx = path_regex(url)
                    found += [o for o in listed if rx.fullmatch(o.uri)]
                    continue
            if literal is not None:
                found.append(literal)
            elif has_magic(url):
                found += [storage.stat(p) for p in local_glob(url)]
            elif scheme == "file" and os.path.exists(url):
                found.append(storage.stat(url))  # not a file: its error says what it is
        if not found:
            raise ValueError(f"the shard pattern {pattern!r} matches nothing")
        out += found
    return out


# -- listing ----------------------------------------------------------------------------------------


@dataclass
class _Shard:
    """One shard as listing resolves it: where its index comes from, and its count once known."""

    info: ObjectInfo
    kind: int = BUILD
    index_uri: str = ""
    index_offset: int = 0
    index_length: int = 0
    count: int | None = None
    block: wi.MemberBlock | None = None
    mtime_ns: int = 0
    sigs: dict[str, int] | None = None  # its samples' field sets, where its index header or block says them


def _mtime_ns(info: ObjectInfo) -> int:
    if info.etag:
        return 0
    try:
        return os.stat(info.uri).st_mtime_ns
    except OSError:
        return 0


def _root(shards: list[ObjectInfo]) -> str:
    root = os.path.commonprefix([s.uri for s in shards])
    return root[: root.rfind("/") + 1] if "/" in root else ""


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


def _read_whole(storage: Storage, uri: str, limit: int = wi.MAX_INDEX_BYTES) -> bytes:
    """The whole index file `uri` (a DALI .idx, a wids JSON), never more than `limit` bytes of it in memory:
    a local file's size is checked first, an object's as its one streamed GET goes."""
    if split_scheme(uri)[0] == "file" or getattr(storage, "stream", None) is None:
        size = storage.stat(uri).size if split_scheme(uri)[0] == "file" else None
        if size is not None and size > limit:
            raise DataSourceError(f"{uri}: a {size}-byte index, over the {limit}-byte limit", uri=uri)
        data = storage.read(uri)
    else:
        data = bytearray()
        for piece in storage.stream(uri):
            data += piece
            if len(data) > limit:
                break
    if len(data) > limit:
        raise DataSourceError(f"{uri}: a {len(data)}-byte index, over the {limit}-byte limit", uri=uri)
    return bytes(data)


def _dali_limit(shard: ObjectInfo) -> int:
    """The most a DALI .idx of `shard` may hold: a line of tens of bytes per member, each member at least two
    512-byte tar blocks, so never the shard's own size (1 MiB at least)."""
    return min(wi.MAX_INDEX_BYTES, max(1 << 20, shard.size))


def _explicit_entries(storage: Storage, path: str) -> dict[str, wi.IndexEntry]:
    """The entries of the raydl index file `path`, by the shard URI each names."""
    info = storage.stat(path)
    entries = wi.read_header(
        lambda off, n: storage.read_range(path, off, n, etag=info.etag or None), info.size, path
    )
    folder = _folder(path)
    return {_resolve_in(folder, e.path): e for e in entries}


def _run(fn: Callable, items: list, label: str, *, ray_fn: Callable | None = None) -> list:
    """fn(item) for each item, in parallel (Ray tasks across the cluster where one is up and the items are
    many, else threads); each result or its exception, in order; a progress bar when it takes a while."""
    from raydl.util.progress import Progress

    if not items:
        return []
    out: list = [None] * len(items)

    def safe(i: int):
        try:
            out[i] = fn(items[i])
        except Exception as exc:  # noqa: BLE001 - returned, and raised by the caller where it matters
            out[i] = exc

    with Progress(len(items), label, delay_s=_PROGRESS_AFTER_S) as bar:
        if ray_fn is not None and len(items) >= _RAY_MIN_SHARDS and _ray_up():
            return ray_fn(items, bar)
        done = 0
        with ThreadPoolExecutor(min(_LISTING_THREADS, len(items))) as pool:
            for _ in pool.map(safe, range(len(items))):
                done += 1
                bar.update(done)
    return out


def _ray_up() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:
        return False


def _build_many(storage: Storage, infos: list[ObjectInfo]) -> list:
    """Ray task body: index each shard (one streamed read), keep it in this node's cache, and return its
    encoded block (or the error)."""
    out = []
    for info in infos:
        try:
            block = wi.build_block(storage, info)
            wi.cache_put(info, block)
            out.append(wi.encode_block(block))
        except Exception as exc:  # noqa: BLE001 - handed back to the driver, which reports it
            out.append(exc)
    return out


def _build_on_ray(storage: Storage, infos: list[ObjectInfo], bar) -> list:
    import ray

    task = ray.remote(num_cpus=0.5, max_retries=2)(_build_many)
    chunks = [infos[i : i + _RAY_SHARDS_PER_TASK] for i in range(0, len(infos), _RAY_SHARDS_PER_TASK)]
    refs = [task.remote(storage, c) for c in chunks]
    results: dict = {}
    pending = list(refs)
    done = 0
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for r in ready:
            results[r] = ray.get(r)
            done += len(results[r])
            bar.update(done)
    out = []
    for r, chunk in zip(refs, chunks):
        for info, got in zip(chunk, results[r]):
            out.append(got if isinstance(got, Exception) else wi.decode_block(got, info, info.uri))
    return out


def _build_all(storage: Storage, todo: list[_Shard]) -> None:
    """Index `todo`'s shards (one streamed read each), cache them, and fill in their blocks."""
    infos = [s.info for s in todo]

    def build(info: ObjectInfo) -> wi.MemberBlock:
        block = wi.build_block(storage, info)
        wi.cache_put(info, block)
        return block

    results = _run(
        build,
        infos,
        f"raydl: indexing {len(infos)} shards",
        ray_fn=lambda items, bar: _build_on_ray(storage, items, bar),
    )
    for s, got in zip(todo, results):
        if isinstance(got, Exception):
            raise got
        if wi.cache_get(s.info, header_only=True) is None:
            wi.cache_put(s.info, got)  # built on another node: this node's workers find it here
        s.block = got


def _read_dali_all(storage: Storage, todo: list[_Shard], explicit: bool) -> list[_Shard]:
    """Parse each shard's DALI index (one GET each); those that fail are returned to be indexed (a warning
    naming the index), or raised with an explicit index."""

    def read(s: _Shard) -> wi.MemberBlock:
        return wi.parse_dali(_read_whole(storage, s.index_uri, _dali_limit(s.info)), s.index_uri, s.info)

    failed = []
    for s, got in zip(todo, _run(read, todo, f"raydl: reading {len(todo)} shard indexes")):
        if isinstance(got, DataSourceError) and not explicit:
            logger.warning("raydl: %s; indexing %s itself", got, s.info.uri)
            s.kind, s.index_uri = BUILD, ""
            failed.append(s)
        elif isinstance(got, Exception):
            raise got
        else:
            s.block = got
            wi.cache_put(s.info, got)
    return failed


def _count(s: _Shard, fields: tuple[str, ...], label_field: str | None, every: bool) -> int:
    return len(wi.samples_of(s.block, s.info.uri, fields, label_field, every=every))


def _resolve(
    storage: Storage,
    shards: list[_Shard],
    listing: _Listing,
    index: str,
    fields: tuple[str, ...],
    label_field: str | None,
    *,
    wids: dict[str, wi.WidsShard] | None,
    every_sample: bool = False,
) -> None:
    """Fill in each shard's count and index source (see the module docstring for the order): the samples
    with one of the image `fields`, or every sample where `every_sample` (fields= given) or a wids list
    counts them all."""
    explicit: dict[str, wi.IndexEntry] = {}
    explicit_path = None
    if index not in ("auto", "none") and not index.lower().endswith(".json"):
        explicit_path = index
        if listing.exists(index) or (split_scheme(index)[0] != "file" and _exists_remote(storage, index)):
            explicit = _explicit_entries(storage, index)
    every = wids is not None or every_sample
    to_build, to_dali = [], []
    for s in shards:
        info = s.info
        s.mtime_ns = _mtime_ns(info)
        e = explicit.get(info.uri)
        if e is not None and (e.size != info.size or e.etag != info.etag):
            logger.warning(
                "raydl: %s: %s is %d bytes (etag %r) now, %d bytes (etag %r) when indexed; indexing it again",
                explicit_path,
                info.uri,
                info.size,
                info.etag,
                e.size,
                e.etag,
            )
            e = None
        if e is not None:
            s.kind, s.index_uri, s.index_offset, s.index_length = EXPLICIT, explicit_path, e.offset, e.length
            if e.sigs is not None:
                s.count, s.sigs = wi.count_from_signatures(e.sigs, fields, every), e.sigs
            else:
                s.block = wi.decode_block(
                    storage.read_range(explicit_path, e.offset, e.length), info, explicit_path
                )
            continue
        if wids is not None:
            w = wids[info.uri]
            if w.filesize is None or w.filesize == info.size:
                s.count = w.nsamples
                continue
            logger.warning(
                "raydl: the shard list says %s is %d bytes, it is %d now; indexing it",
                info.uri,
                w.filesize,
                info.size,
            )
        if index == "auto":
            for idx in (_stem(info.uri) + ".idx", info.uri + ".idx"):
                if listing.exists(idx):
                    s.kind, s.index_uri = DALI, idx
                    break
        hit = wi.cache_get(info, header_only=True)
        if hit is not None:
            entry, block = hit
            if block is not None:
                s.block = block
            else:
                s.count, s.sigs = wi.count_from_signatures(entry.sigs, fields, every), entry.sigs
        elif s.kind == DALI:
            to_dali.append(s)
        else:
            to_build.append(s)
    if to_dali:
        to_build += _read_dali_all(storage, to_dali, explicit=False)
    if to_build:
        _build_all(storage, to_build)
    for s in shards:
        if s.count is None:
            s.count = _count(s, fields, label_field, every)
    if explicit_path is not None and not explicit:
        _write_explicit(storage, explicit_path, shards)


def _exists_remote(storage: Storage, uri: str) -> bool:
    try:
        storage.stat(uri)
    except DataSourceError:
        return False
    return True


def _write_explicit(storage: Storage, path: str, shards: list[_Shard]) -> None:
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
            hit = wi.cache_get(s.info)
            block = hit[1] if hit is not None else wi.build_block(storage, s.info)
        rows.append(
            (
                _relative(s.info.uri if s.info.etag else os.path.abspath(s.info.uri), folder),
                s.info,
                s.mtime_ns,
                block,
            )
        )
    wi.write_index(path, rows)
    # the file now holds every block: workers read a shard's from it when their node cache lacks it
    entries = _explicit_entries(storage, path)
    for s in shards:
        e = entries[s.info.uri if s.info.etag else os.path.abspath(s.info.uri)]
        s.kind, s.index_uri, s.index_offset, s.index_length = EXPLICIT, path, e.offset, e.length


def _wids_shards(json_uri: str, storage: Storage, listing: _Listing) -> tuple[list[ObjectInfo], dict]:
    entries = wi.parse_wids(_read_whole(storage, json_uri), json_uri)
    urls = [e.url for e in entries]
    try:
        shards = _expand(urls, listing)
    except ValueError as exc:
        raise DataSourceError(f"{json_uri}: a shard it lists is not there ({exc})", uri=json_uri) from exc
    return shards, {e.url: e for e in entries}


def _learn_signatures(storage: Storage, shards: list[_Shard]) -> None:
    """Each shard's field sets where its block is known; where no shard's are (a wids list's counts), the
    first shard is indexed (one streamed read, then cached) to learn them."""
    for s in shards:
        if s.sigs is None and s.block is not None:
            s.sigs = wi.signatures(s.block, s.info.uri)
    if shards and all(s.sigs is None for s in shards):
        first = shards[0]
        first.block = wi.build_block(storage, first.info)
        wi.cache_put(first.info, first.block)
        first.sigs = wi.signatures(first.block, first.info.uri)


def list_webdataset(
    urls,
    *,
    storage_of,
    image_fields: tuple[str, ...],
    label_field: str | None,
    index: str = "auto",
    fields=None,
    allow_pickle: bool = False,
) -> Catalog:
    """List the shards into a Catalog of one part per shard (see the module docstring). `fields` is
    read_webdataset's (None: the image and label; "all"; a dict or list: parse_fields)."""
    if not isinstance(index, str) or not index:
        raise ValueError(f"index must be 'auto', 'none' or a path, got {index!r}")
    wanted = parse_fields(fields)
    fields = tuple(f.lower().lstrip(".") for f in image_fields)
    listing = _Listing(storage_of)
    wids = None
    if isinstance(urls, (list, tuple)) and len(urls) == 1:
        urls = urls[0]
    urls_json = isinstance(urls, str) and urls.lower().endswith(".json")
    json_uri = urls if urls_json else index if index.lower().endswith(".json") else None
    if json_uri is not None:
        if split_scheme(json_uri)[0] == "file":
            json_uri = os.path.abspath(json_uri)
        infos, wids = _wids_shards(json_uri, storage_of(json_uri), listing)
        if not urls_json:  # index="shards.json": the urls choose among its shards
            chosen = {o.uri for o in _expand(urls, listing)}
            infos = [o for o in infos if o.uri in chosen]
    else:
        infos = _expand(urls, listing)
    storage = storage_of(infos[0].uri)
    if wids is not None and split_scheme(infos[0].uri)[0] == "file":
        wids = {os.path.abspath(k): v for k, v in wids.items()}
        infos = [ObjectInfo(os.path.abspath(o.uri), o.size, o.etag) for o in infos]
    shards = [_Shard(o) for o in infos]
    started = time.monotonic()
    _resolve(storage, shards, listing, index, fields, label_field, wids=wids, every_sample=wanted is not None)
    counts = np.array([s.count for s in shards], np.int64)
    if counts.sum() == 0:
        what = "" if wanted is not None else f" with an image field {list(fields)}"
        raise DataSourceError(f"no samples{what} in {len(shards)} shard(s) of {urls!r}", uri=infos[0].uri)
    if wanted is None:
        source = WebDatasetSource(fields, label_field, allow_pickle=allow_pickle)
    else:
        _learn_signatures(storage, shards)
        select = resolve_fields(wanted, [(s.info.uri, s.sigs) for s in shards], urls)
        source = WebDatasetSource(select=select, fields=fields_of(select), allow_pickle=allow_pickle)
    logger.debug("raydl: listed %d shards in %.2f s", len(shards), time.monotonic() - started)
    keep = counts > 0  # a shard with no sample is no part (parts hold samples)
    kept = [s for s, k in zip(shards, keep) if k]
    return make_catalog(
        root=_root(infos),
        storage=storage,
        source=source,
        shards=[s.info for s in kept],
        parts={
            "shard": np.arange(len(kept), dtype=np.int64),
            "count": counts[keep],
            "every": np.full(len(kept), int(wids is not None), np.int64),
            "index_kind": np.array([s.kind for s in kept], np.int64),
            "index_uri": string_array([s.index_uri for s in kept]),
            "index_offset": np.array([s.index_offset for s in kept], np.int64),
            "index_length": np.array([s.index_length for s in kept], np.int64),
        },
        locators=_LOCATORS,
    )


def index_webdataset(urls, *, storage_of, out: str) -> tuple[int, int]:
    """`raydl index URLS --out PATH`: write the raydl index file `out` for the shards; (shards, members)."""
    listing = _Listing(storage_of)
    infos = _expand(urls, listing)
    storage = storage_of(infos[0].uri)
    shards = [_Shard(o, mtime_ns=_mtime_ns(o)) for o in infos]
    todo = []
    for s in shards:
        hit = wi.cache_get(s.info)
        if hit is not None:
            s.block = hit[1]
        else:
            todo.append(s)
    _build_all(storage, todo)
    _write_explicit(storage, out, shards)
    return len(shards), sum(len(s.block) for s in shards)


# -- the worker's side ------------------------------------------------------------------------------

_BLOCKS = wi.BlockLRU()
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

    `select` None is the legacy record: the first of `image_fields` a sample has, and the integer in its
    `label_field` member (samples without an image are not counted, but where a wids list counts them).
    Otherwise it is fields='s selection, every sample counted, and `fields` its kinds."""

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

    def _samples(self, catalog: Catalog, part: int) -> tuple[ObjectInfo, wi.SampleBlock]:
        row = {c: catalog.parts.column(c)[part].as_py() for c in ("shard", "count", "every", *_LOCATORS)}
        info = catalog.shard_info(row["shard"])
        every = bool(row["every"])
        key = (info.uri, info.etag, info.size, self.image_fields, self.label_field, every, self.select)
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
                    hit = wi.samples_of(block, info.uri, self.image_fields, self.label_field, every=every)
                else:
                    hit = wi.select_samples(block, info.uri, [exts for _, exts in self.select])
                wi.check_count(hit, row["count"], info, f"index from {row['index_uri'] or 'the shard'}")
                _BLOCKS.put(key, hit)
        with _flight_lock:
            _flights.pop(key, None)
        return info, hit

    def _block(self, storage: Storage, info: ObjectInfo, row: dict) -> wi.MemberBlock:
        """The shard's members: the node cache, else its index source, else one streamed read (cached)."""
        hit = wi.cache_get(info)
        if hit is not None:
            return hit[1]
        block = None
        where = row["index_uri"]
        try:
            if row["index_kind"] == DALI:
                block = wi.parse_dali(_read_whole(storage, where, _dali_limit(info)), where, info)
            elif row["index_kind"] == EXPLICIT:
                data = storage.read_range(where, row["index_offset"], row["index_length"])
                block = wi.decode_block(data, info, where)
        except DataSourceError as exc:
            logger.warning("raydl: %s; indexing %s itself", exc, info.uri)
        if block is None:
            block = wi.build_block(storage, info)
        wi.cache_put(info, block)
        return block

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
            # a sample's own bytes (for max_sample_bytes): its image (legacy), or its fields' members
            size[rows] = blk.image_len[at] if self.select is None else blk.size[at].sum(axis=1)
            spans = zip(blk.at[at].tolist(), blk.size[at].tolist(), blk.choice[at].tolist())
            for i, j, (where, sizes, choice) in zip(rows.tolist(), at.tolist(), spans):
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

    def _unfit(self, uri: str, key: str, start: int, where: list, sizes: list) -> DataSourceError | None:
        """Why a sample cannot be had, known before it is read: a selected field missing, no image, a
        label member too large to be one."""
        if self.select is not None:
            for (name, exts), at in zip(self.select, where):
                if at < 0:
                    return lacks(uri, key, name, exts)
            return None
        if len(sizes) > 1 and sizes[1] > MAX_LABEL_BYTES:
            return DataSourceError(
                f"{uri}: sample {key!r} has a {sizes[1]}-byte {self.label_field!r} member at offset "
                f"{start + where[1]}, not an integer label (at most {MAX_LABEL_BYTES} bytes)",
                uri=uri,
            )
        if where[0] < 0:
            return DataSourceError(
                f"{uri}: sample {key!r} has none of the image fields {list(self.image_fields)}", uri=uri
            )
        return None

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        if wi.is_compressed(shard.uri):
            stream = inflated(storage, shard)
            if offset + length > len(stream):
                from raydl.errors import ObjectChangedError

                raise ObjectChangedError(
                    f"{shard.uri} changed after it was listed: its stream ends before offset "
                    f"{offset + length}",
                    uri=shard.uri,
                )
            return stream[offset : offset + length]
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None)

    def cut(self, located: Located, i: int, data: bytes) -> dict[str, object]:
        uri, where, sizes, choice = located.cut_info[i]
        if self.select is None:
            return self._cut_legacy(located.key[i], uri, where, sizes, data)
        record: dict[str, object] = {}
        for (name, exts), at, size, k in zip(self.select, where, sizes, choice):
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

    def _cut_legacy(self, key: str, uri: str, where: list, sizes: list, data) -> dict[str, object]:
        image = bytes(data[where[0] : where[0] + sizes[0]])
        if len(where) < 2 or where[1] < 0:
            return {"image": image, "label": -1}
        payload = bytes(data[where[1] : where[1] + sizes[1]])
        try:
            return {"image": image, "label": int(payload.decode("utf-8").strip())}
        except (UnicodeDecodeError, ValueError) as exc:
            raise DataSourceError(
                f"{uri}: sample {key!r} has a {self.label_field!r} member {payload[:40]!r} that "
                "is not an integer label",
                uri=uri,
            ) from exc

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#{key}"
