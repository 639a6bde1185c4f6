"""The storage interface: where sample bytes live.

A storage lists objects under a prefix and reads byte ranges of one object.
It is not bound to a root: every call names a full URI (a local path, or
s3://bucket/key). Storages are small picklable values; whatever they hold per
process (open files, a boto3 client) is built lazily in that process and
never pickled. Every failure is a DataSourceError naming the URI, and the
offset when there is one, raised `from` the lower-level error.

Beside reading, every storage says which store it reads (`identity`: two storages of one identity
read the same bytes at the same URI, so a node cache keys its entries by it) and answers what a reader
asks of a node cache (`uses_plans`, `scoped`, `hits_only`, `plan`, `flush`, `take_cache_counts`):
`BaseStorage` gives the answers of a storage with no cache, and the cache's wrapper
(raydl/storage/cache.py, `CachedStorage`) overrides them. A caller asks any
storage alike and never tests which one it holds. Listing and cutting samples
(raydl/sources/) use only the reading half, so a stand-in that only lists or
reads (a test's, a benchmark's) needs only that half.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

__all__ = [
    "MAX_LIST_PAGES",
    "STREAM_CHUNK",
    "BaseStorage",
    "NotCached",
    "ObjectInfo",
    "Storage",
    "check_text_path",
    "split_scheme",
    "stream_object",
]

STREAM_CHUNK = 8 << 20  # one streamed read hands its bytes on in pieces of this size


class NotCached(Exception):  # noqa: N818 - a signal between a cache's view and its reader, not an error
    """A read of a node cache's `hits_only` view that the cache does not hold: nothing was fetched or counted,
    and the reader reads it through the storage itself."""


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its full URI, its size in bytes, and its etag ("" where the store has none)."""

    uri: str
    size: int
    etag: str = ""


@runtime_checkable
class Storage(Protocol):
    """What a source needs from a store, and what a reader asks of a node cache. Implementations:
    LocalStorage, S3Storage (the cache hooks from BaseStorage), and CachedStorage around either."""

    #: how many concurrent reads this store wants per process (the loader's `io_concurrency` default)
    default_io_concurrency: int

    #: which store this is: equal for two storages only when a URI names the same bytes in both (S3: the
    #: endpoint URL; local disk: ""). The node cache keys its entries by it.
    identity: str

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under `prefix` (recursively; a prefix naming one object lists it). Any order."""
        ...

    def stat(self, uri: str) -> ObjectInfo:
        """One object's size and etag."""
        ...

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        """Exactly `length` bytes of `uri` from `offset`.

        With `etag`, an object whose etag is not that one any more is a
        DataSourceError saying it changed; fewer bytes than asked is too
        (raydl never silently reads other bytes).
        """
        ...

    def read(self, uri: str) -> bytes:
        """The whole object."""
        ...

    def stream(self, uri: str, *, etag: str | None = None, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        """The whole object, in order, in pieces of at most `chunk` bytes, from ONE read (one GET on S3;
        a failed try resumes where it stopped). With `etag`, a changed object is an ObjectChangedError."""
        ...

    # -- what a reader asks of a node cache (BaseStorage: a storage without one) ----------------------
    #: whether `plan` changes anything: a reader may skip working out a read's pieces where it does not
    uses_plans: bool

    def scoped(self, *, behind: bool = False) -> Storage:
        """This storage for one scope of reads (a batch's): with a cache, the same store and cache with
        counters of their own, and with `behind` a miss's entries written after its bytes are handed on."""
        ...

    def hits_only(self) -> Storage | None:
        """This scope's view of what its node cache holds, or None without a cache. Its ranged reads are
        served from the cache or raise NotCached (nothing fetched, nothing counted); its
        `default_io_concurrency` is local disk's, since that is where its reads go."""
        ...

    def plan(self, uri: str, offset: int, length: int, pieces: list[tuple[int, int]]) -> None:
        """The next read of exactly (uri, offset, length) is made of the (offset, length) `pieces` (sorted,
        inside it): a cache keeps and looks it up piece by piece."""
        ...

    def flush(self) -> None:
        """Wait for whatever this scope still writes behind its reads."""
        ...

    def take_cache_counts(self) -> dict[str, int]:
        """The cache counters of this scope's reads since the last take, started again from 0; {} without
        a cache."""
        ...

    def hand_on(self) -> None:
        """Leave this scope's counters to the next take of any scope of the same cache: a scope whose reads
        belong to no batch (reads ahead of need) has them counted all the same."""
        ...


class BaseStorage:
    """The node-cache hooks of `Storage` as a storage without a cache answers them. LocalStorage and
    S3Storage inherit them; CachedStorage overrides them."""

    __slots__ = ()

    uses_plans: ClassVar[bool] = False  # plan() is ignored: no need to work the pieces out

    @property
    def identity(self) -> str:
        """The storage's class, by module and name: a storage whose URIs mean other bytes at another endpoint
        or account names that too (S3Storage: its endpoint URL)."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def scoped(self, *, behind: bool = False) -> Storage:
        """This storage itself: with no cache, a scope has nothing of its own."""
        return self

    def hits_only(self) -> Storage | None:
        """None: no cache, nothing to serve apart from the store."""
        return None

    def plan(self, uri: str, offset: int, length: int, pieces: list[tuple[int, int]]) -> None:
        """Nothing: without a cache, a read is one read whatever it is made of."""

    def flush(self) -> None:
        """Nothing: no write runs behind a read."""

    def take_cache_counts(self) -> dict[str, int]:
        """{}: no cache, no counters."""
        return {}

    def hand_on(self) -> None:
        """Nothing: no cache, no counters."""


def split_scheme(uri: str) -> tuple[str, str]:
    """("s3", "bucket/key") for "s3://bucket/key", ("file", path) for a local path or file:// URI."""
    head, sep, rest = uri.partition("://")
    if not sep:
        return "file", uri
    if not head or not head.replace("+", "").replace("-", "").replace(".", "").isalnum():
        return "file", uri  # not a scheme: a local path that happens to hold "://"
    return head.lower(), rest


MAX_LIST_PAGES = 1 << 20  # pages of one listing, in any store: a store answering forever is stopped


def check_text_path(path: str, what: str) -> None:
    """A DataSourceError naming `path` when it is not UTF-8 text (a name with bytes the file system allows
    but UTF-8 does not, read as \\udcXX surrogates): raydl names each `what` (sample, shard) by its path,
    in a catalog's text columns."""
    if path.isascii():
        return
    try:
        path.encode()
    except UnicodeEncodeError:
        from raydl.errors import DataSourceError

        raise DataSourceError(
            f"{path!r}: its name is not UTF-8 (the bytes shown as \\udcXX); raydl names each {what} by its "
            "path: rename it",
            uri=path,
        ) from None


def stream_object(storage: Storage, info: ObjectInfo, *, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
    """`info`'s bytes through `storage.stream`, or through ranged reads of `chunk` bytes where a storage
    has no `stream` (a test's stand-in); exactly `info.size` bytes, or an ObjectChangedError."""
    from raydl.errors import ObjectChangedError

    etag = info.etag or None
    stream = getattr(storage, "stream", None)
    if stream is None:
        for at in range(0, info.size, chunk):
            yield storage.read_range(info.uri, at, min(chunk, info.size - at), etag=etag)
        return
    got = 0
    for piece in stream(info.uri, etag=etag, chunk=chunk):
        got += len(piece)
        if got > info.size:
            break
        yield piece
    if got != info.size:
        raise ObjectChangedError(
            f"{info.uri} changed after it was listed: {got} bytes or more read, {info.size} listed",
            uri=info.uri,
        )
