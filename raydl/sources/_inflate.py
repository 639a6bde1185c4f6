"""Compressed (.tar.gz, .tgz) shards: inflated in bounded steps, to a bounded size.

A gzip stream cannot be read by range. Indexing a compressed shard needs only
its tar headers, so listing streams the inflated bytes past the header reader
(`inflate_stream`), holding a step at a time: its memory does not grow with
the shard. A worker cuts samples out of the whole inflated shard, which it
keeps (`inflated`). The shard is untrusted, so:

- the inflate is streamed: the compressed bytes come from ONE streamed read of
  the object (one GET on S3), handed on `READ_STEP` at a time, and are
  inflated `INFLATE_STEP` at a time (zlib's `max_length`), so no step holds more than that beyond the output;
- the output is bounded: `inflated_limit(size)` bytes at most, a ratio of the
  compressed size with a floor and a ceiling. A shard that inflates past it
  (a bomb: 611 KB of gzipped zeros is 600 MB) is a DataSourceError naming
  the shard and the limit, raised as soon as the output passes it;
- a worker's shard is read and inflated once per process however many threads ask
  for it at once (single flight, keyed by uri, etag, size and a local file's mtime), and the last few
  inflated shards are kept, at most `CACHE_BYTES` in all besides the one
  in use, so the samples of one shard in a batch cost one inflate.

Concatenated gzip members (as `cat a.gz b.gz` makes) are one stream, as for
gzip itself; zero padding after the last member is allowed, other trailing
bytes are not.
"""

from __future__ import annotations

import collections
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future

from raydl.errors import DataSourceError
from raydl.sources._version import mtime_ns
from raydl.storage import ObjectInfo, Storage
from raydl.storage.base import stream_object

__all__ = ["CACHE_BYTES", "INFLATE_RATIO", "held", "inflate_stream", "inflated", "inflated_limit"]

READ_STEP = 8 << 20
INFLATE_STEP = 1 << 20
INFLATE_RATIO = 64  # JPEG/PNG shards inflate ~1.05x, text-heavy ones ~10x; tar headers of tiny members ~50x
INFLATE_FLOOR = 64 << 20
INFLATE_CEILING = 16 << 30
CACHE_BYTES = 1 << 30
_CACHE_SHARDS = 4
_GZIP_MAGIC = b"\x1f\x8b"


def inflated_limit(compressed_size: int) -> int:
    """The most bytes a compressed shard of `compressed_size` bytes may inflate to."""
    return min(INFLATE_CEILING, max(INFLATE_FLOOR, INFLATE_RATIO * compressed_size))


def _inflate(storage: Storage, info: ObjectInfo) -> bytes:
    """The decompressed bytes of the gzip shard `info`, whole."""
    out = bytearray()
    for piece in inflate_stream(storage, info):
        out += piece
    return bytes(out)


def inflate_stream(storage: Storage, info: ObjectInfo) -> Iterator[bytes]:
    """The decompressed bytes of the gzip shard `info` as they come, at most INFLATE_STEP at a time, from ONE
    streamed read: at most `inflated_limit` of them (a DataSourceError as soon as the output passes it), the
    stream checked to its end (a damaged or cut one is a DataSourceError once its bytes run out)."""
    uri, limit = info.uri, inflated_limit(info.size)
    total = 0
    d: zlib._Decompress | None = None  # the gzip member being inflated; None between members
    members = 0
    member_at = 0  # compressed offset of the current gzip member
    at = 0  # compressed offset of `data`
    for data in stream_object(storage, info, chunk=READ_STEP):  # one GET, read in steps
        while True:
            if d is None:  # between members: zero padding (as gzip.GzipFile allows), then a member
                rest = data.lstrip(b"\0")
                at, data = at + len(data) - len(rest), rest
                if not data:
                    break
                if data[0] != _GZIP_MAGIC[0]:
                    raise DataSourceError(
                        f"{uri}: corrupt gzip stream: the bytes at offset {at} are not a gzip member", uri=uri
                    )
                d, member_at = zlib.decompressobj(wbits=31), at  # gzip header and trailer (CRC32, length)
            try:
                piece = d.decompress(data, INFLATE_STEP)
            except zlib.error as exc:
                raise DataSourceError(
                    f"{uri}: corrupt gzip stream in the member at offset {member_at} ({exc})", uri=uri
                ) from exc
            total += len(piece)
            if total > limit:
                raise DataSourceError(
                    f"{uri}: the compressed shard inflates to more than {limit} bytes, the limit for a "
                    f"{info.size}-byte shard ({INFLATE_RATIO}x its size, at least {INFLATE_FLOOR}, at most "
                    f"{INFLATE_CEILING}): a gzip bomb, or a shard to store uncompressed",
                    uri=uri,
                )
            rest = d.unused_data if d.eof else d.unconsumed_tail
            if not piece and not d.eof and len(rest) == len(data) > 0:  # no progress: never loop on it
                raise DataSourceError(f"{uri}: corrupt gzip stream at offset {at}", uri=uri)
            if piece:
                yield piece
            at, data = at + len(data) - len(rest), rest
            if d.eof:
                d, members = None, members + 1
            elif not data and len(piece) < INFLATE_STEP:
                break  # zlib has given all it can from this input: read on
    if d is not None or not members:
        raise DataSourceError(
            f"{uri}: truncated gzip stream: the member at offset {member_at} does not end before the shard "
            f"does ({info.size} bytes)",
            uri=uri,
        )


# -- one inflate per shard and process ---------------------------------------------------------------

_cache: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()
_flights: dict[tuple, Future] = {}
_lock = threading.Lock()


def inflated(storage: Storage, info: ObjectInfo) -> bytes:
    """The decompressed bytes of the compressed shard `info`: from the cache, from the inflate another
    thread is doing now, or inflated here (see the module docstring)."""
    key = _key(info)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
        flight = _flights.get(key)
        owner = flight is None
        if owner:
            flight = _flights[key] = Future()
    if not owner:
        return flight.result()  # the owner's bytes, or its error
    try:
        data = _inflate(storage, info)
    except BaseException as exc:
        with _lock:
            del _flights[key]
        flight.set_exception(exc)
        raise
    with _lock:
        del _flights[key]
        _cache[key] = data
        while len(_cache) > 1 and (len(_cache) > _CACHE_SHARDS or _cached_bytes() > CACHE_BYTES + len(data)):
            _cache.popitem(last=False)
    flight.set_result(data)
    return data


def held(info: ObjectInfo) -> bytes | None:
    """The inflated bytes of `info` if this process keeps them (no read, no inflate), else None."""
    key = _key(info)
    with _lock:
        return _cache.get(key)


def _key(info: ObjectInfo) -> tuple:
    """The shard's version: a local file rewritten at the same size is another one
    (raydl/sources/_version.py)."""
    return info.uri, info.etag, info.size, mtime_ns(info)


def _cached_bytes() -> int:
    return sum(len(v) for v in _cache.values())


def clear_cache() -> None:
    """Forget every inflated shard (tests; a process that is done with its compressed shards)."""
    with _lock:
        _cache.clear()
