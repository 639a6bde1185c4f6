"""The node-local cache: remote bytes kept on the node's disk, shared by its processes, verified on read.

`CachedStorage(inner, cache)` is a `Storage` that serves `read_range` (tar ranges, Parquet footers and column
chunks, image objects) and `stream` (compressed shards, whole) from a `NodeCache`, and fetches from `inner`
on a miss; `with_node_cache(storage, cache)` wraps a storage where caching applies. Only remote stores are
cached (`wants_cache`: S3, not local disk, whose reads would only be copied), and only reads that name an
etag: an entry's key is (store, object URI, etag, offset, length), the store being the storage's `identity`
(an S3 store's endpoint URL), so that a folder shared by jobs on two stores never serves one's bytes for
the other's bucket of the same name, and an object rewritten in the store (a new etag at listing) never
gets its old bytes; its old entries are removed when the new etag is first read.

The cache itself is three modules below this one: raydl/storage/node_cache.py (`NodeCache`: entries
written whole and published by rename, verified by digest on read), raydl/storage/cache_folder.py (the
folder's layout, who may use it, its lock and size ledger) and raydl/storage/cache_evict.py
(least-recently-used eviction in short steps under the lock). Their names are re-exported here.

Faults: a write that fails (a full disk, a read-only folder) abandons the entry, and the bytes read from the
store are returned as they are; the first such failure in a process is warned about.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from raydl.options import Cache
from raydl.storage.base import STREAM_CHUNK, BaseStorage, NotCached, ObjectInfo, Storage
from raydl.storage.cache_folder import ENTRIES, LOCK, STATE, TMP, check_cache_folder
from raydl.storage.node_cache import COUNTERS, WHOLE, CacheCounts, NodeCache, node_cache
from raydl.util.threads import SharedPool, usable_cores

__all__ = [
    "COUNTERS",
    "ENTRIES",
    "LOCK",
    "STATE",
    "TMP",
    "CachedStorage",
    "CacheCounts",
    "NodeCache",
    "check_cache_folder",
    "node_cache",
    "wants_cache",
    "with_node_cache",
]


def wants_cache(storage: Storage) -> bool:
    """Whether reads of `storage` are worth a node cache: a remote store's are; local disk's are not."""
    from raydl.storage.local import LocalStorage

    return not isinstance(getattr(storage, "inner", storage), LocalStorage)


def with_node_cache(storage: Storage, cache: Cache | None) -> Storage:
    """`storage` read through this process's NodeCache of `cache` (a CachedStorage) where caching applies:
    a cache is asked for and `wants_cache(storage)`. Else `storage` itself, unchanged."""
    if cache is None or not wants_cache(storage):
        return storage
    return CachedStorage(storage, node_cache(cache.path, cache.max_bytes, cache.group))


def _writer_threads() -> int:
    """A process's threads writing entries behind the reads: one per two cores it may run on, 1 to 4.

    A write is mostly system calls (creating a file, the ledger under its lock), each of which takes the
    GIL back from the decode threads beside it: on 2 cores, 4 writers cost more CPU per entry than 1, and
    cached epoch 1 ran at 0.80x an uncached one against 0.86x with 1 (docs/benchmarks.md, the node cache).
    More cores decode faster, and a batch waits for its entries: there the writers keep up in parallel."""
    return min(4, max(1, usable_cores() // 2))


WRITER_THREADS = _writer_threads()
# The IO tasks a batch reads the cache's hits on (`hits_only().default_io_concurrency`, local disk's default):
# a hit is a read of a local file, with no wait to hide behind more tasks. Spread over a remote store's many
# IO threads, a batch's hits would run on a dozen threads at once, each system call of each hit waiting for
# the GIL: 0.2 ms more worker CPU per image than local disk (docs/benchmarks.md, the node cache).
HIT_IO_CONCURRENCY = 4
_writer = SharedPool(WRITER_THREADS, "raydl-cache-write")  # this process's entry writers


@dataclass(frozen=True)
class CachedStorage(BaseStorage):
    """A Storage that reads through a NodeCache: ranged and streamed reads that name an etag are served
    from the node's disk when there, else fetched from `inner` and kept. Listing, stat and etag-less reads
    go to `inner` as they are. `counts` tallies what this value served (`scoped()` gives a fresh tally).

    A range is kept as the pieces its reader says it is made of (`plan`): the loader coalesces neighbouring
    samples into one read, differently every epoch (the shuffle changes the neighbours), so a block is kept
    as its samples' ranges, which every epoch asks for again; a miss still reads the whole block in one
    request. Without a plan a range is one entry (footers, index blocks, whole image objects)."""

    inner: Storage
    cache: NodeCache
    counts: CacheCounts = field(default_factory=CacheCounts, compare=False)
    _plans: dict = field(default_factory=dict, compare=False, repr=False)
    _plans_lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)
    # A batch's scope (`scoped(behind=True)`): its misses' entries are written on the process's writer
    # threads while the batch decodes, and `flush()` (at the batch's end) waits for them. Else, at once.
    _behind: list | None = field(default=None, compare=False, repr=False)
    # The scope's `hits_only()` view: a ranged read the cache does not hold raises NotCached
    _hits_only: bool = field(default=False, compare=False, repr=False)

    uses_plans: ClassVar[bool] = True  # a planned read is kept and looked up piece by piece

    @property
    def default_io_concurrency(self) -> int:
        return HIT_IO_CONCURRENCY if self._hits_only else self.inner.default_io_concurrency

    @property
    def identity(self) -> str:
        """The store's own: a cache in front changes where bytes come from, not which store's they are."""
        return self.inner.identity

    def scoped(self, *, behind: bool = False) -> CachedStorage:
        """The same storage and cache with counters of its own (a batch's); with `behind`, a miss's entries
        are written behind the read (the bytes go on at once; `flush()` waits for the writes)."""
        return CachedStorage(self.inner, self.cache, _behind=[] if behind else None)

    def hits_only(self) -> CachedStorage:
        """This scope's view of what the cache holds, counted in this scope's counters: a ranged read (a
        plan's pieces, all of them) the cache holds is served from it; one it does not hold, or that names
        no etag, raises NotCached, with nothing fetched or counted. A streamed read (a compressed shard,
        inflated whole once per process) is served as this scope serves it, from the store on a miss."""
        return CachedStorage(self.inner, self.cache, self.counts, _behind=self._behind, _hits_only=True)

    def flush(self) -> None:
        """Wait for the entries this scope is writing behind, and count what they evicted."""
        if not self._behind:
            return
        with self._plans_lock:
            pending, self._behind[:] = list(self._behind), []
        evicted = sum(f.result() or 0 for f in pending)  # _put never raises: a failed write is warned about
        if evicted:
            self.counts.add(evictions=evicted)

    def take_cache_counts(self) -> dict[str, int]:
        """This scope's counters (every name in COUNTERS) since the last take; they start again from 0.
        Evictions include those of passes that ran on their own thread since any scope last took them, and
        the counts include those of scopes handed on (hand_on) since."""
        counts = self.counts.take()
        for name, n in self.cache.take_handed_on().items():
            counts[name] += n
        counts["evictions"] += self.cache.take_evicted_behind()
        return counts

    def hand_on(self) -> None:
        self.cache.hand_on(self.counts.take())

    def _put(self, uri: str, etag: str, offset: int, length: int, data) -> int | None:
        return self.cache.put(uri, etag, offset, length, data, store=self.inner.identity)

    def plan(self, uri: str, offset: int, length: int, pieces: list[tuple[int, int]]) -> None:
        """The next read of exactly (uri, offset, length) is made of the (offset, length) `pieces` (sorted,
        inside it): keep and look it up piece by piece."""
        with self._plans_lock:
            self._plans[(uri, offset, length)] = pieces

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def stat(self, uri: str) -> ObjectInfo:
        return self.inner.stat(uri)

    def read(self, uri: str) -> bytes:
        if self._hits_only:  # no etag: never cached
            raise NotCached(uri)
        data = self.inner.read(uri)
        self.counts.add(misses=1, bytes_from_store=len(data))
        return data

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        pieces = None
        if self._plans:  # the lock only where a plan was made (a read of several samples' ranges)
            with self._plans_lock:
                pieces = self._plans.pop((uri, offset, length), None)
        if not etag or length <= 0:
            if self._hits_only:
                raise NotCached(uri)
            data = self.inner.read_range(uri, offset, length, etag=etag)
            self.counts.add(misses=1, bytes_from_store=len(data))
            return data
        if not pieces or pieces == [(offset, length)]:
            pieces = [(offset, length)]
        store = self.inner.identity
        got = [self.cache.get(uri, etag, o, n, self.counts, store=store) for o, n in pieces]
        if all(g is not None for g in got):
            self.counts.add(hits=len(got), bytes_from_cache=sum(map(len, got)))
            if len(got) == 1:
                return got[0]
            block = bytearray(length)  # the gaps between the pieces (tar headers) are never cut from
            for (o, n), g in zip(pieces, got, strict=True):
                block[o - offset : o - offset + n] = g
            return bytes(block)
        if self._hits_only:
            raise NotCached(uri)
        evicted = self.cache.forget_other_etags(uri, etag, store=store)
        data = self.inner.read_range(uri, offset, length, etag=etag)
        for (o, n), g in zip(pieces, got, strict=True):
            if g is None:
                piece = data if n == length else data[o - offset : o - offset + n]
                if self._behind is not None:  # the entry's write (0.3-1 ms) off the batch's critical path
                    future = _writer().submit(self._put, uri, etag, o, n, piece)
                    with self._plans_lock:
                        self._behind.append(future)
                else:
                    evicted += self._put(uri, etag, o, n, piece) or 0
        missed = sum(g is None for g in got)  # a piece it had counts as neither: the store's bytes go on
        self.counts.add(misses=missed, bytes_from_store=len(data), evictions=evicted)
        return data

    def stream(self, uri: str, *, etag: str | None = None, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        if not etag:
            for piece in self.inner.stream(uri, etag=etag, chunk=chunk):
                self.counts.add(bytes_from_store=len(piece))
                yield piece
            self.counts.add(misses=1)
            return
        store = self.inner.identity
        mm = self.cache.get_whole(uri, etag, self.counts, store=store)
        if mm is not None:
            try:
                start = NodeCache.payload_start(uri, etag, 0, WHOLE, store)
                self.counts.add(hits=1, bytes_from_cache=len(mm) - start)
                for at in range(start, len(mm), chunk):
                    yield mm[at : at + chunk]
            finally:
                mm.close()
            return
        self.counts.add(misses=1, evictions=self.cache.forget_other_etags(uri, etag, store=store))
        pieces = self.inner.stream(uri, etag=etag, chunk=chunk)
        for piece in self.cache.put_stream(uri, etag, pieces, self.counts, store=store):
            self.counts.add(bytes_from_store=len(piece))
            yield piece
