"""WebDataset tar shards: listing them into a catalog, on the driver.

Samples are runs of consecutive members sharing a key. Grouping follows the
webdataset library exactly (raydl/sources/_wds_blocks.py): a member's key is
its path up to the first dot of its basename and its field the rest,
lowercased; consecutive members with one key form a sample; non-regular
members, names without a dot and `__...__` names are skipped; a field twice in
one sample is an error. Samples never span shards.

Listing never makes a request per sample: the shards' sizes and etags come
from LIST pages (a brace pattern or a list of URLs lists each folder's
common prefix once: raydl/sources/_expand.py), and each shard's sample count
from its index (raydl/sources/_wds_index.py): the node cache (no request), an
explicit `index=` file, DALI's `NAME.idx` / `NAME.tar.idx` beside the shard
(one GET), a wids JSON shard list (its counts: no read at all), else the shard
itself read once in one streamed GET (then cached); which one a shard's comes
from is settled in raydl/sources/_wds_shards.py. Shards to index are read on a
thread pool, or as Ray tasks across the cluster where Ray is up and they are
many. The catalog holds one part per shard (its count); the per-sample
offsets and keys stay in the shards' index blocks, which the source
(`WebDatasetSource`, raydl/sources/_wds_source.py) loads on the worker.

Compressed shards (.tar.gz, .tgz) cannot be read by range: listing streams
their inflated bytes past the header reader (one GET, a window held at a
time), and a worker inflates each whole, in bounded steps and to a bounded
size, once per process (raydl/sources/_inflate.py); prefer uncompressed
shards for shuffled reads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import DataSourceError
from raydl.sources import _wds_index
from raydl.sources._expand import Listing, expand, expand_urls
from raydl.sources._wds_blocks import MemberBlock, WdsSample, base_plus_ext, group_samples, signatures
from raydl.sources._wds_fields import fields_of, parse_fields, resolve_fields
from raydl.sources._wds_index import WidsShard
from raydl.sources._wds_shards import (
    Shard,
    count_samples,
    explicit_index,
    find_dali,
    from_cache,
    from_explicit,
    from_wids,
    mtime_ns,
    write_explicit,
)
from raydl.sources._wds_source import BUILD, DALI, LOCATORS, MemberSpans, WebDatasetSource, clear_blocks
from raydl.storage import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import string_array

logger = logging.getLogger(__name__)

# The worker's side (WebDatasetSource, clear_blocks, MemberSpans) and the grouping rules are re-exported:
# callers and tests name them from here.
__all__ = [
    "MemberSpans",
    "WdsSample",
    "WebDatasetSource",
    "base_plus_ext",
    "clear_blocks",
    "expand_urls",
    "group_samples",
    "index_webdataset",
    "list_webdataset",
]

_LISTING_THREADS = 16
_RAY_MIN_SHARDS = 64  # fewer shards than this to index: a thread pool here beats starting Ray tasks
_RAY_SHARDS_PER_TASK = 8
_PROGRESS_AFTER_S = 2.0  # indexing that takes less shows no progress bar


# -- listing ----------------------------------------------------------------------------------------


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
    listing = Listing(storage_of)
    if isinstance(urls, (list, tuple)) and len(urls) == 1:
        urls = urls[0]
    infos, wids = _named_shards(urls, index, listing)
    storage = storage_of(infos[0].uri)
    if wids is not None and split_scheme(infos[0].uri)[0] == "file":
        wids = {os.path.abspath(k): v for k, v in wids.items()}
        infos = [ObjectInfo(os.path.abspath(o.uri), o.size, o.etag) for o in infos]
    shards = [Shard(o) for o in infos]
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
    return _catalog(infos, storage, source, shards, counts, every=wids is not None)


def _named_shards(urls, index: str, listing: Listing) -> tuple[list[ObjectInfo], dict[str, WidsShard] | None]:
    """The shards `urls` name, and a wids shard list's entries by URL where there is one (`urls` itself, or
    `index`, whose shards the urls choose among)."""
    urls_json = isinstance(urls, str) and urls.lower().endswith(".json")
    json_uri = urls if urls_json else index if index.lower().endswith(".json") else None
    if json_uri is None:
        return expand(urls, listing), None
    if split_scheme(json_uri)[0] == "file":
        json_uri = os.path.abspath(json_uri)
    infos, wids = _wids_shards(json_uri, listing.storage_of(json_uri), listing)
    if not urls_json:  # index="shards.json": the urls choose among its shards
        chosen = {o.uri for o in expand(urls, listing)}
        infos = [o for o in infos if o.uri in chosen]
    return infos, wids


def _wids_shards(json_uri: str, storage: Storage, listing: Listing) -> tuple[list[ObjectInfo], dict]:
    try:
        data = _wds_index.read_index_file(storage, json_uri)
    except DataSourceError as exc:
        # as for a shard: a list that is not there says so (one stat, on this path only), a store that
        # failed or refused says what it said
        if type(exc) is DataSourceError and not _exists(storage, json_uri):
            raise DataSourceError(f"{json_uri!r} does not exist", uri=json_uri) from exc
        raise
    entries = _wds_index.parse_wids(data, json_uri)
    urls = [e.url for e in entries]
    try:
        shards = expand(urls, listing)
    except (ValueError, DataSourceError) as exc:
        # a shard that does not exist (named by its url), not a store that failed (denied, unreachable)
        if isinstance(exc, DataSourceError) and (type(exc) is not DataSourceError or exc.uri not in urls):
            raise
        raise DataSourceError(f"{json_uri}: a shard it lists is not there ({exc})", uri=json_uri) from exc
    return shards, {e.url: e for e in entries}


def _exists(storage: Storage, uri: str) -> bool:
    if split_scheme(uri)[0] == "file":
        return os.path.exists(uri)
    try:
        storage.stat(uri)
    except DataSourceError:
        return False
    return True


def _resolve(
    storage: Storage,
    shards: list[Shard],
    listing: Listing,
    index: str,
    fields: tuple[str, ...],
    label_field: str | None,
    *,
    wids: dict[str, WidsShard] | None,
    every_sample: bool = False,
) -> None:
    """Fill in each shard's count and index source (see the module docstring for the order): the samples
    with one of the image `fields`, or every sample where `every_sample` (fields= given) or a wids list
    counts them all."""
    explicit_path, explicit = explicit_index(storage, listing, index)
    every = wids is not None or every_sample
    to_build, to_dali = [], []
    older: list[tuple[str, str]] = []  # (DALI index, shard) where the shard was modified after its index
    for s in shards:
        s.mtime_ns = mtime_ns(s.info)
        if from_explicit(s, storage, explicit_path, explicit.get(s.info.uri), fields, every):
            continue
        if wids is not None and from_wids(s, wids[s.info.uri]):
            continue
        if index == "auto" and (stale := find_dali(s, listing)) is not None:
            older.append((stale, s.info.uri))
        if from_cache(s, fields, every):
            continue
        (to_dali if s.kind == DALI else to_build).append(s)
    if older:
        logger.warning(
            "raydl: %s is older than %s%s: the shard was modified after its DALI index was written, so the "
            "index may not describe it; indexing %s from %s own bytes (run wds2idx again, or copy shards "
            "and .idx files keeping their mtimes)",
            older[0][0],
            older[0][1],
            f" (and {len(older) - 1} more .idx files older than their shards)" if len(older) > 1 else "",
            "it" if len(older) == 1 else "those shards",
            "its" if len(older) == 1 else "their",
        )
    if to_dali:
        to_build += _read_dali_all(storage, to_dali, explicit=False)
    if to_build:
        _build_all(storage, to_build)
    for s in shards:
        if s.count is None:
            s.count = count_samples(s, fields, label_field, every)
    if explicit_path is not None and not explicit:
        write_explicit(storage, explicit_path, shards)


def _learn_signatures(storage: Storage, shards: list[Shard]) -> None:
    """Each shard's field sets where its block is known; where no shard's are (a wids list's counts), the
    first shard is indexed (one streamed read, then cached) to learn them."""
    for s in shards:
        if s.sigs is None and s.block is not None:
            s.sigs = signatures(s.block, s.info.uri)
    if shards and all(s.sigs is None for s in shards):
        first = shards[0]
        first.block = _wds_index.build_cached(storage, first.info)
        first.sigs = signatures(first.block, first.info.uri)


def _catalog(
    infos: list[ObjectInfo],
    storage: Storage,
    source: WebDatasetSource,
    shards: list[Shard],
    counts: np.ndarray,
    *,
    every: bool,
) -> Catalog:
    """The catalog of the shards that hold samples (a shard with none is no part: parts hold samples)."""
    keep = counts > 0
    kept = [s for s, k in zip(shards, keep, strict=True) if k]
    return make_catalog(
        root=_root(infos),
        storage=storage,
        source=source,
        shards=[s.info for s in kept],
        parts={
            "shard": np.arange(len(kept), dtype=np.int64),
            "count": counts[keep],
            "every": np.full(len(kept), int(every), np.int64),
            "index_kind": np.array([s.kind for s in kept], np.int64),
            "index_uri": string_array([s.index_uri for s in kept]),
            "index_offset": np.array([s.index_offset for s in kept], np.int64),
            "index_length": np.array([s.index_length for s in kept], np.int64),
        },
        locators=LOCATORS,
    )


def _root(shards: list[ObjectInfo]) -> str:
    root = os.path.commonprefix([s.uri for s in shards])
    return root[: root.rfind("/") + 1] if "/" in root else ""


def index_webdataset(urls, *, storage_of, out: str) -> tuple[int, int]:
    """`raydl index URLS --out PATH`: write the raydl index file `out` for the shards; (shards, members)."""
    listing = Listing(storage_of)
    infos = expand(urls, listing)
    storage = storage_of(infos[0].uri)
    shards = [Shard(o, mtime_ns=mtime_ns(o)) for o in infos]
    todo = []
    for s in shards:
        hit = _wds_index.cache_get(s.info)
        if hit is not None:
            s.block = hit[1]
        else:
            todo.append(s)
    _build_all(storage, todo)
    write_explicit(storage, out, shards)
    return len(shards), sum(len(s.block) for s in shards)


# -- indexing many shards: on threads, or as Ray tasks ---------------------------------------------


def _build_all(storage: Storage, todo: list[Shard]) -> None:
    """Index `todo`'s shards (one streamed read each), cache them, and fill in their blocks."""
    infos = [s.info for s in todo]
    keys = [_wds_index.cache_key(info) for info in infos]  # before the reads (see build_cached)

    results = _run(
        lambda info: _wds_index.build_cached(storage, info),
        infos,
        f"raydl: indexing {len(infos)} shards",
        ray_fn=lambda items, bar: _build_on_ray(storage, items, bar),
    )
    for s, key, got in zip(todo, keys, results, strict=True):
        if isinstance(got, Exception):
            raise got
        if _wds_index.cache_get(s.info, header_only=True) is None:
            _wds_index.cache_put(s.info, got, key=key)  # built on another node: this node's workers find it
        s.block = got


def _read_dali_all(storage: Storage, todo: list[Shard], explicit: bool) -> list[Shard]:
    """Parse each shard's DALI index (one GET each); those that fail are returned to be indexed (a warning
    naming the index), or raised with an explicit index."""

    def read(s: Shard) -> MemberBlock:
        key = _wds_index.cache_key(s.info)
        data = _wds_index.read_index_file(storage, s.index_uri, _wds_index.dali_limit(s.info))
        block = _wds_index.parse_dali(data, s.index_uri, s.info)
        _wds_index.cache_put(s.info, block, key=key)
        return block

    failed = []
    for s, got in zip(todo, _run(read, todo, f"raydl: reading {len(todo)} shard indexes"), strict=True):
        if isinstance(got, DataSourceError) and not explicit:
            logger.warning("raydl: %s; indexing %s itself", got, s.info.uri)
            s.kind, s.index_uri = BUILD, ""
            failed.append(s)
        elif isinstance(got, Exception):
            raise got
        else:
            s.block = got
    return failed


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
            out.append(_wds_index.encode_block(_wds_index.build_cached(storage, info)))
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
    for r, chunk in zip(refs, chunks, strict=True):
        for info, got in zip(chunk, results[r], strict=True):
            out.append(got if isinstance(got, Exception) else _wds_index.decode_block(got, info, info.uri))
    return out
