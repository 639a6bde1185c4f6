"""The node-local cache: remote bytes kept on the node's disk, shared by its processes, verified on read.

`NodeCache(path, max_bytes)` is one folder on a node's local disk; `CachedStorage(inner, cache)` is a
`Storage` that serves `read_range` (tar ranges, Parquet footers and column chunks, image objects) and
`stream` (compressed shards, whole) from it, and fetches from `inner` on a miss. Only remote stores are
cached (`wants_cache`: S3, not local disk, whose reads would only be copied), and only reads that name an
etag: an entry's key is (object URI, etag, offset, length), so an object rewritten in the store (a new etag
at listing) never gets its old bytes, and its old entries are removed when the new etag is first read.

The folder:

    PATH/entries/abc/<uri hash>-<etag hash>-<offset>-<length>   one entry: a header, then the bytes
    PATH/tmp/<pid ns>-<pid>-<random>.tmp                           entries being written
    PATH/lock                                                      fcntl lock: eviction and accounting
    PATH/state                                                     "<bytes> <max_bytes>": the entries' total

An entry file holds a magic, its key (as JSON), the payload's length and an XXH3-128 digest of key and
payload, checked on every read: a torn, truncated or flipped entry is a miss (warned about, removed,
fetched again), never bytes handed on. XXH3 guards against disk faults and torn writes, not an
attacker who can write the cache folder (who could write a matching digest as well).

Writes: a temporary file in PATH/tmp, written, fsync'ed, then renamed into place under the lock and the
entry folder fsync'ed; a crash leaves a whole entry or none, and the temporary file of a dead writer is
removed by the next process that opens the cache. Two writers of one entry: the first rename wins, the
second finds it there and drops its copy, so the accounting counts it once.

Size: the entries' total stays <= max_bytes. A write that would pass it scans the folder under the lock,
recounts the total (so a writer killed between rename and accounting only delays the count) and removes
the least recently used entries until the total is at most LOW_WATER of max_bytes with the new entry in.
A hit touches its entry's mtime (os.utime), which is what "recently used" means across processes.

Faults: any OSError while writing (a full disk, a read-only folder) abandons the entry, the bytes read
from the store are returned as they are, and the first such failure in a process is warned about.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import xxhash

from raydl.storage.base import STREAM_CHUNK, ObjectInfo, Storage

__all__ = [
    "COUNTERS",
    "CachedStorage",
    "CacheCounts",
    "NodeCache",
    "check_cache_folder",
    "node_cache",
    "wants_cache",
]

logger = logging.getLogger(__name__)

MAGIC = b"RAYDLC1\n"
_HEAD = struct.Struct("<8sIQ16s")  # magic, key bytes, payload bytes, XXH3-128 of key + payload
ENTRIES, TMP, LOCK, STATE = "entries", "tmp", "lock", "state"
LOW_WATER = 0.9  # an eviction pass frees room down to this share of max_bytes (so it runs once per 10%)
STALE_TMP_S = 3600.0  # a temporary file untouched this long is a dead writer's, whoever wrote it
SEEN_MAX = 1 << 16  # (uri, etag) pairs a process remembers having cleaned of other etags
WHOLE = -1  # the length of a whole-object entry (a streamed read)
COUNTERS = ("hits", "misses", "bytes_from_store", "bytes_from_cache", "evictions", "corrupt")


def wants_cache(storage: Storage) -> bool:
    """Whether reads of `storage` are worth a node cache: a remote store's are; local disk's are not."""
    from raydl.storage.local import LocalStorage

    return not isinstance(getattr(storage, "inner", storage), LocalStorage)


def check_cache_folder(path: str) -> None:
    """Make `path` (and its entry folders) and write, fsync and remove a file there; the OSError if any step
    fails. What the loader checks on every node before its workers use the cache."""
    os.makedirs(os.path.join(path, ENTRIES), exist_ok=True)
    os.makedirs(os.path.join(path, TMP), exist_ok=True)
    probe = os.path.join(path, TMP, f"probe-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"raydl")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


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


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


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
        self._ns = _pid_namespace()

    # -- names ----------------------------------------------------------------------------------
    def entry_path(self, uri: str, etag: str, offset: int, length: int) -> str:
        uh = _hex(uri, 12)
        size = "all" if length == WHOLE else str(length)
        return os.path.join(self._entries, uh[:3], f"{uh}-{_hex(etag, 8)}-{offset}-{size}")

    @staticmethod
    def _key(uri: str, etag: str, offset: int, length: int) -> bytes:
        return json.dumps([uri, etag, offset, length], separators=(",", ":")).encode()

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
        removed = 0
        now = time.time()
        try:
            names = os.listdir(self._tmp)
        except OSError:
            return 0
        for name in names:
            p = os.path.join(self._tmp, name)
            ns, _, rest = name.partition("-")
            pid = rest.partition("-")[0]
            dead = ns == self._ns and pid.isdigit() and not _alive(int(pid))
            try:
                if dead or now - os.stat(p).st_mtime > STALE_TMP_S:
                    os.unlink(p)
                    removed += 1
            except OSError:
                pass
        return removed

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
        """A whole-object entry as a read-only mmap (payload from `_HEAD.size + len(key)`), verified."""
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
                        _write_all(tmp[0], piece)
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
            _write_all(fd, _HEAD.pack(MAGIC, len(key), 0, b"\0" * 16) + key)
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
                _write_all(tmp[0], piece)
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
            _fsync_dir(os.path.dirname(final))
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
        return _StateLock(self)

    def scan(self) -> list[tuple[int, int, str]]:
        """Every entry as (mtime_ns, size, path)."""
        out = []
        try:
            folders = os.listdir(self._entries)
        except FileNotFoundError:
            return out
        for d in folders:
            try:
                with os.scandir(os.path.join(self._entries, d)) as it:
                    for e in it:
                        try:
                            st = e.stat()
                        except OSError:
                            continue
                        out.append((st.st_mtime_ns, st.st_size, e.path))
            except OSError:
                continue
        return out

    def _evict(self, target: float) -> tuple[int, int]:
        """(the total after, entries removed): least recently used first, until the total is <= target.
        Called under the lock; recounts the total from the folder."""
        entries = sorted(self.scan())
        total = sum(s for _, s, _ in entries)
        removed = 0
        for _, size, path in entries:
            if total <= target:
                break
            try:
                os.unlink(path)
            except OSError:
                continue
            total -= size
            removed += 1
        self._clean_tmp()
        return total, removed

    # -- the CLI's view -------------------------------------------------------------------------
    def info(self) -> dict:
        """entries, bytes, max_bytes (as the last writer set it, None if unknown), oldest and newest use
        (seconds since the epoch, None when empty)."""
        entries = self.scan()
        recorded = _read_state(os.path.join(self.path, STATE))
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


class _StateLock:
    """The folder's fcntl lock held, with the recorded total as `state[0]`, written back on exit."""

    def __init__(self, cache: NodeCache) -> None:
        self._cache = cache
        self._fd = -1
        self.state = [0]
        self._max = 0

    def __enter__(self) -> list[int]:
        import fcntl

        c = self._cache
        c._lock.acquire()
        try:
            self._fd = os.open(os.path.join(c.path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            recorded = _read_state(os.path.join(c.path, STATE))
            if recorded is None:  # first use, or a torn state file: count the folder
                recorded = (sum(s for _, s, _ in c.scan()), 0)
            self.state = [recorded[0]]
            self._max = c.max_bytes or recorded[1]  # a tool's NodeCache (max_bytes=0) keeps the loaders' own
        except BaseException:
            self._release()
            raise
        return self.state

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                _write_state(os.path.join(self._cache.path, STATE), self.state[0], self._max)
        finally:
            self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1
        self._cache._lock.release()


def _read_state(path: str) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as f:
            parts = f.read(64).split()
        return int(parts[0]), int(parts[1])
    except (OSError, ValueError, IndexError):
        return None


def _write_state(path: str, total: int, max_bytes: int) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(f"{total} {max_bytes}\n".encode())
    os.replace(tmp, path)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:  # EPERM: alive, someone else's
        return exc.errno == errno.EPERM
    return True


_caches: dict[tuple[str, int], NodeCache] = {}
_caches_lock = threading.Lock()


WRITER_THREADS = 4  # a process's threads writing entries behind the reads (each mostly waits in fsync)
_writer_pool = None
_writer_lock = threading.Lock()


def _writer():
    """This process's pool of entry writers (made on first use)."""
    global _writer_pool
    if _writer_pool is None:
        from concurrent.futures import ThreadPoolExecutor

        with _writer_lock:
            if _writer_pool is None:
                _writer_pool = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="raydl-cache-write")
    return _writer_pool


def node_cache(path: str, max_bytes: int) -> NodeCache:
    """This process's NodeCache of (path, max_bytes): one per folder, shared by its threads and loaders."""
    key = (os.path.abspath(path), max_bytes)
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = NodeCache(path, max_bytes)
        return cache


@dataclass(frozen=True)
class CachedStorage:
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

    @property
    def default_io_concurrency(self) -> int:
        return self.inner.default_io_concurrency

    def scoped(self, *, behind: bool = False) -> CachedStorage:
        """The same storage and cache with counters of its own (a batch's); with `behind`, a miss's entries
        are written behind the read (the bytes go on at once; `flush()` waits for the writes)."""
        return CachedStorage(self.inner, self.cache, _behind=[] if behind else None)

    def flush(self) -> None:
        """Wait for the entries this scope is writing behind, and count what they evicted."""
        if not self._behind:
            return
        with self._plans_lock:
            pending, self._behind[:] = list(self._behind), []
        evicted = sum(f.result() or 0 for f in pending)  # _put never raises: a failed write is warned about
        if evicted:
            self.counts.add(evictions=evicted)

    def _put(self, uri: str, etag: str, offset: int, length: int, data) -> int | None:
        return self.cache.put(uri, etag, offset, length, data)

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
        data = self.inner.read(uri)
        self.counts.add(misses=1, bytes_from_store=len(data))
        return data

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        with self._plans_lock:
            pieces = self._plans.pop((uri, offset, length), None) if self._plans else None
        if not etag or length <= 0:
            data = self.inner.read_range(uri, offset, length, etag=etag)
            self.counts.add(misses=1, bytes_from_store=len(data))
            return data
        if not pieces or pieces == [(offset, length)]:
            pieces = [(offset, length)]
        got = [self.cache.get(uri, etag, o, n, self.counts) for o, n in pieces]
        if all(g is not None for g in got):
            self.counts.add(hits=1, bytes_from_cache=sum(map(len, got)))
            if len(got) == 1:
                return got[0]
            block = bytearray(length)  # the gaps between the pieces (tar headers) are never cut from
            for (o, n), g in zip(pieces, got):
                block[o - offset : o - offset + n] = g
            return bytes(block)
        evicted = self.cache.forget_other_etags(uri, etag)
        data = self.inner.read_range(uri, offset, length, etag=etag)
        for (o, n), g in zip(pieces, got):
            if g is None:
                piece = data if n == length else data[o - offset : o - offset + n]
                if self._behind is not None:  # fsyncs (about 1 ms an entry) off the batch's critical path
                    future = _writer().submit(self._put, uri, etag, o, n, piece)
                    with self._plans_lock:
                        self._behind.append(future)
                else:
                    evicted += self._put(uri, etag, o, n, piece) or 0
        self.counts.add(misses=1, bytes_from_store=len(data), evictions=evicted)
        return data

    def stream(self, uri: str, *, etag: str | None = None, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        if not etag:
            for piece in self.inner.stream(uri, etag=etag, chunk=chunk):
                self.counts.add(bytes_from_store=len(piece))
                yield piece
            self.counts.add(misses=1)
            return
        mm = self.cache.get_whole(uri, etag, self.counts)
        if mm is not None:
            try:
                start = _HEAD.size + len(NodeCache._key(uri, etag, 0, WHOLE))
                self.counts.add(hits=1, bytes_from_cache=len(mm) - start)
                for at in range(start, len(mm), chunk):
                    yield mm[at : at + chunk]
            finally:
                mm.close()
            return
        self.counts.add(misses=1, evictions=self.cache.forget_other_etags(uri, etag))
        pieces = self.inner.stream(uri, etag=etag, chunk=chunk)
        for piece in self.cache.put_stream(uri, etag, pieces, self.counts):
            self.counts.add(bytes_from_store=len(piece))
            yield piece
