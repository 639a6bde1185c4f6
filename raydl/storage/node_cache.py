"""The node cache's entries on disk: one folder on a node's local disk, shared by its processes, verified
on read. `NodeCache(path, max_bytes)` keeps and serves byte ranges and whole objects under their key
(object URI, etag, offset, length); `CachedStorage` (raydl/storage/cache.py) reads through it.

An entry file holds a magic, its key (as JSON), the payload's length and an XXH3-128 digest of key and
payload, checked on every read: a torn, truncated or flipped entry is a miss (warned about, removed,
fetched again), never bytes handed on. XXH3 guards against disk faults and torn writes, not an
attacker who can write the cache folder (who could write a matching digest as well).

Writes: a temporary file in PATH/tmp, written, fsync'ed, then renamed into place under the lock and the
entry folder fsync'ed; a crash leaves a whole entry or none, and the temporary file of a dead writer is
removed by the next process that opens the cache. Two writers of one entry: the first rename wins, the
second finds it there and drops its copy, so the accounting counts it once.

Size: the entries' total stays <= max_bytes. A write that would pass it evicts, under the folder's lock,
the least recently used entries until the total is at most LOW_WATER of max_bytes with the new entry in
(raydl/storage/cache_folder.py: the folder's layout, lock, recorded total and eviction). A hit touches its
entry's mtime (os.utime), which is what "recently used" means across processes.

Faults: any OSError while writing (a full disk, a read-only folder) abandons the entry, and the first such
failure in a process is warned about; the caller hands on the bytes it read from the store as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Iterator

import xxhash

from raydl.storage import cache_folder
from raydl.storage.cache_folder import ENTRIES, STATE, TMP, StateLock, fsync_dir, read_state, write_all

__all__ = ["COUNTERS", "LOW_WATER", "WHOLE", "CacheCounts", "NodeCache", "node_cache"]

# The node cache's warnings go out under the name of its front module, raydl.storage.cache: one name to
# filter the whole cache on.
logger = logging.getLogger("raydl.storage.cache")

MAGIC = b"RAYDLC1\n"
_HEAD = struct.Struct("<8sIQ16s")  # magic, key bytes, payload bytes, XXH3-128 of key + payload
LOW_WATER = 0.9  # an eviction pass frees room down to this share of max_bytes (so it runs once per 10%)
SEEN_MAX = 1 << 16  # (uri, etag) pairs a process remembers having cleaned of other etags
WHOLE = -1  # the length of a whole-object entry (a streamed read)
COUNTERS = ("hits", "misses", "bytes_from_store", "bytes_from_cache", "evictions", "corrupt")


class CacheCounts:
    """Counters of one scope (a batch, a worker), thread safe; `take()` hands them on and starts from 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(COUNTERS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._c[k] += v

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self._c = self._c, dict.fromkeys(COUNTERS, 0)
        return out

    def peek(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


def _hex(text: str, n: int) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=n).hexdigest()


class NodeCache:
    """One cache folder on this node. Made per process (`node_cache`); every method is thread safe, and any
    number of processes may use one folder at once."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = os.path.abspath(path)
        self.max_bytes = max_bytes
        self._entries = os.path.join(self.path, ENTRIES)
        self._tmp = os.path.join(self.path, TMP)
        self._opened = False
        self._lock = threading.Lock()  # this process's threads; the fcntl lock is between processes
        self._seen: set[tuple[str, str]] = set()  # (uri, etag) whose other-etag entries are gone
        self._warned = False
        self._ns = cache_folder.pid_namespace()

    # -- names ----------------------------------------------------------------------------------
    def entry_path(self, uri: str, etag: str, offset: int, length: int) -> str:
        uh = _hex(uri, 12)
        size = "all" if length == WHOLE else str(length)
        return os.path.join(self._entries, uh[:3], f"{uh}-{_hex(etag, 8)}-{offset}-{size}")

    @staticmethod
    def _key(uri: str, etag: str, offset: int, length: int) -> bytes:
        return json.dumps([uri, etag, offset, length], separators=(",", ":")).encode()

    @classmethod
    def payload_start(cls, uri: str, etag: str, offset: int, length: int) -> int:
        """Where the entry's payload starts in its file (and in `get_whole`'s mmap): after header and key."""
        return _HEAD.size + len(cls._key(uri, etag, offset, length))

    def _open(self) -> None:
        """Make the folders, and remove what dead writers left in tmp/ (once per process)."""
        if self._opened:
            return
        with self._lock:
            if self._opened:
                return
            os.makedirs(self._entries, exist_ok=True)
            os.makedirs(self._tmp, exist_ok=True)
            self._clean_tmp()
            self._opened = True

    def _clean_tmp(self) -> int:
        return cache_folder.clean_tmp(self._tmp, self._ns)

    # -- reads ----------------------------------------------------------------------------------
    def get(
        self, uri: str, etag: str, offset: int, length: int, counts: CacheCounts | None = None
    ) -> bytes | None:
        """The entry's bytes, verified; None on a miss (a corrupt entry is warned about, removed, counted in
        `counts`, a miss)."""
        self._open()
        path = self.entry_path(uri, etag, offset, length)
        key = self._key(uri, etag, offset, length)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(_HEAD.size + len(key))
                why = self._bad_head(head, key, size)
                if why is None:
                    n = _HEAD.unpack_from(head)[2]
                    data = f.read(n)
                    h = xxhash.xxh3_128(key)
                    h.update(data)
                    if len(data) != n or h.digest() != _HEAD.unpack_from(head)[3]:
                        why = "its digest does not match its bytes"
        except FileNotFoundError:
            return None
        except OSError as exc:
            why = f"it cannot be read ({exc})"
        if why is not None:
            self._corrupt(path, why, counts)
            return None
        try:
            os.utime(path)  # recently used, as every process on the node sees it
        except OSError:
            pass
        return data

    def get_whole(self, uri: str, etag: str, counts: CacheCounts | None = None) -> mmap.mmap | None:
        """A whole-object entry as a read-only mmap (payload from `payload_start(uri, etag, 0, WHOLE)`),
        verified."""
        self._open()
        path = self.entry_path(uri, etag, 0, WHOLE)
        key = self._key(uri, etag, 0, WHOLE)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < _HEAD.size + len(key):
                    self._corrupt(path, "it is truncated", counts)
                    return None
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._corrupt(path, f"it cannot be read ({exc})", counts)
            return None
        head = mm[: _HEAD.size + len(key)]
        why = self._bad_head(head, key, size)
        if why is None:
            h = xxhash.xxh3_128(key)
            h.update(memoryview(mm)[len(head) :])
            if h.digest() != _HEAD.unpack_from(head)[3]:
                why = "its digest does not match its bytes"
        if why is not None:
            mm.close()
            self._corrupt(path, why, counts)
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        return mm

    @staticmethod
    def _bad_head(head: bytes, key: bytes, size: int) -> str | None:
        if len(head) < _HEAD.size + len(key):
            return "it is truncated"
        magic, klen, n, _ = _HEAD.unpack_from(head)
        if magic != MAGIC or klen != len(key) or head[_HEAD.size :] != key:
            return "its header is not this entry's"
        if size != _HEAD.size + klen + n:
            return f"it is {size} bytes, its header says {_HEAD.size + klen + n}"
        return None

    def _corrupt(self, path: str, why: str, counts: CacheCounts | None) -> None:
        if counts is not None:
            counts.add(corrupt=1)
        logger.warning("raydl: node cache entry %s is corrupt (%s): removed, read from the store", path, why)
        try:
            os.unlink(path)
        except OSError:
            pass

    def forget_other_etags(self, uri: str, etag: str) -> int:
        """Remove `uri`'s entries of any other etag (the object was rewritten): on a miss, once per (uri,
        etag) and process (a bounded memory of them). How many were removed."""
        if (uri, etag) in self._seen:
            return 0
        self._open()
        uh = _hex(uri, 12)
        mine = f"{uh}-{_hex(etag, 8)}-"
        folder = os.path.join(self._entries, uh[:3])
        removed = 0
        try:
            with os.scandir(folder) as it:
                old = [e.path for e in it if e.name.startswith(uh + "-") and not e.name.startswith(mine)]
        except OSError:
            old = []
        if old:
            with self._locked() as state:
                for p in old:
                    try:
                        size = os.stat(p).st_size
                        os.unlink(p)
                    except OSError:
                        continue
                    state[0] = max(0, state[0] - size)
                    removed += 1
        if len(self._seen) >= SEEN_MAX:
            self._seen.clear()
        self._seen.add((uri, etag))
        return removed

    # -- writes ---------------------------------------------------------------------------------
    def put(self, uri: str, etag: str, offset: int, length: int, data: bytes) -> int | None:
        """Keep `data` as the entry; the entries evicted to make room, or None when nothing was kept
        (too big for max_bytes, or a write failed: then a warning, once per process)."""
        key = self._key(uri, etag, offset, length)
        return self._commit(uri, etag, offset, length, key, [data], len(data))

    def put_stream(self, uri: str, etag: str, pieces: Iterator[bytes], out: CacheCounts) -> Iterator[bytes]:
        """`pieces` (a whole object) handed on as they come and written to a whole-object entry beside;
        committed when they end (a failed write only stops the writing)."""
        key = self._key(uri, etag, 0, WHOLE)
        tmp = None
        h = xxhash.xxh3_128(key)
        total = 0
        try:
            tmp = self._temp(key)
        except OSError as exc:
            self._write_failed(uri, exc)
        try:
            for piece in pieces:
                total += len(piece)
                if tmp is not None:
                    try:
                        h.update(piece)
                        write_all(tmp[0], piece)
                    except OSError as exc:
                        self._abandon(tmp)
                        tmp = None
                        self._write_failed(uri, exc)
                yield piece
        except BaseException:  # the read failed, or its reader stopped early: no entry
            if tmp is not None:
                self._abandon(tmp)
            raise
        if tmp is not None:
            evicted = self._finish(uri, etag, 0, WHOLE, key, tmp, total, h.digest())
            if evicted is not None:
                out.add(evictions=evicted)

    def _temp(self, key: bytes) -> tuple[int, str]:
        self._open()
        name = f"{self._ns}-{os.getpid()}-{secrets.token_hex(8)}.tmp"
        path = os.path.join(self._tmp, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, _HEAD.pack(MAGIC, len(key), 0, b"\0" * 16) + key)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return fd, path

    def _commit(self, uri, etag, offset, length, key: bytes, pieces, n: int) -> int | None:
        if _HEAD.size + len(key) + n > self.max_bytes:
            return None
        try:
            tmp = self._temp(key)
        except OSError as exc:
            self._write_failed(uri, exc)
            return None
        h = xxhash.xxh3_128(key)
        try:
            for piece in pieces:
                h.update(piece)
                write_all(tmp[0], piece)
        except OSError as exc:
            self._abandon(tmp)
            self._write_failed(uri, exc)
            return None
        return self._finish(uri, etag, offset, length, key, tmp, n, h.digest())

    def _finish(self, uri, etag, offset, length, key, tmp, n, digest) -> int | None:
        """Fill in the header, fsync, rename into place under the lock (making room first), fsync the
        folder: the entries evicted, or None when it was abandoned."""
        fd, tmp_path = tmp
        size = _HEAD.size + len(key) + n
        if size > self.max_bytes:
            self._abandon(tmp)
            return None
        final = self.entry_path(uri, etag, offset, length)
        try:
            os.pwrite(fd, _HEAD.pack(MAGIC, len(key), n, digest), 0)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.makedirs(os.path.dirname(final), exist_ok=True)
            with self._locked() as state:
                evicted = 0
                if os.path.exists(final):  # another writer got there first: one copy, counted once
                    os.unlink(tmp_path)
                    return 0
                if state[0] + size > self.max_bytes:
                    state[0], evicted = self._evict(self.max_bytes * LOW_WATER - size)
                os.rename(tmp_path, final)
                state[0] += size
            fsync_dir(os.path.dirname(final))
            return evicted
        except OSError as exc:
            self._abandon((fd, tmp_path))
            self._write_failed(uri, exc)
            return None

    def _abandon(self, tmp: tuple[int, str]) -> None:
        fd, path = tmp
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(path)
        except OSError:
            pass

    def _write_failed(self, uri: str, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "raydl: cannot write to the node cache %s (%s: %s) while keeping %s; entries that fail "
                "to write are left out and read from the store (warned once per process)",
                self.path,
                type(exc).__name__,
                exc,
                uri,
            )

    # -- size and eviction ----------------------------------------------------------------------
    def _locked(self):
        return StateLock(self.path, self._lock, self.max_bytes)

    def scan(self) -> list[tuple[int, int, str]]:
        """Every entry as (mtime_ns, size, path)."""
        return cache_folder.scan(self._entries)

    def _evict(self, target: float) -> tuple[int, int]:
        """(the total after, entries removed): least recently used first, until the total is <= target.
        Called under the lock; recounts the total from the folder."""
        total, removed = cache_folder.evict(self._entries, target)
        self._clean_tmp()
        return total, removed

    # -- the CLI's view -------------------------------------------------------------------------
    def info(self) -> dict:
        """entries, bytes, max_bytes (as the last writer set it, None if unknown), oldest and newest use
        (seconds since the epoch, None when empty)."""
        entries = self.scan()
        recorded = read_state(os.path.join(self.path, STATE))
        times = [t for t, _, _ in entries]
        return {
            "path": self.path,
            "entries": len(entries),
            "bytes": sum(s for _, s, _ in entries),
            "max_bytes": recorded[1] if recorded and recorded[1] else None,
            "oldest": min(times) / 1e9 if times else None,
            "newest": max(times) / 1e9 if times else None,
        }

    def clear(self) -> int:
        """Remove every entry (and temporary files of dead writers); how many entries were removed."""
        self._open()
        with self._locked() as state:
            total, removed = self._evict(-1)
            state[0] = total
        return removed


_caches: dict[tuple[str, int], NodeCache] = {}
_caches_lock = threading.Lock()


def node_cache(path: str, max_bytes: int) -> NodeCache:
    """This process's NodeCache of (path, max_bytes): one per folder, shared by its threads and loaders."""
    key = (os.path.abspath(path), max_bytes)
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = NodeCache(path, max_bytes)
        return cache
