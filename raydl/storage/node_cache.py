"""The node cache's entries on disk: one folder on a node's local disk, shared by its processes, verified
on read. `NodeCache(path, max_bytes, group=None)` keeps and serves byte ranges and whole objects under
their key (store, object URI, etag, offset, length); `CachedStorage` (raydl/storage/cache.py) reads
through it, naming its storage's `identity` as the store (an S3 store's endpoint URL; "" for local disk),
so that one folder shared by jobs on two stores never serves one store's bytes for the other's.

An entry file holds a magic, its key (as JSON), the payload's length and an XXH3-128 digest of key and
payload, checked on every read: a torn, truncated or flipped entry is a miss (warned about, removed,
fetched again), never bytes handed on. XXH3 guards against disk faults and torn writes, not an
attacker who can write the cache folder (who could write a matching digest as well): who can is the
folder's business (raydl/storage/cache_folder.py: private to its user, or to a named group).

Entries of the key scheme before the store was part of it (magic RAYDLC1, names without the store's
hash) are never looked up: every lookup misses them, and they are evicted as usual, the least recently
used first, so an upgraded node's old entries go first.

Writes: a temporary file in PATH/tmp, written whole with its digest, then renamed into place under the
lock; never fsync'ed, as a cache of bytes the store still holds need not be. Another process never sees
a partial entry (the rename publishes it whole); after a crash of the machine an entry whose bytes did not
reach the disk fails its digest and is a miss, and the temporary file of a dead writer is removed by the
next process that opens the cache. Two writers of one entry: the first rename wins, the
second finds it there and drops its copy, so the accounting counts it once.

Size: the entries' total (the ledger, PATH/state) stays <= max_bytes. A write that takes it past
HIGH_WATER of max_bytes starts an eviction pass down to LOW_WATER (raydl/storage/cache_evict.py: the
least recently used entries, removed in short steps under the lock) on a thread of its own, once its
entry is in: the write returns at once, so a batch never waits for a pass it started (one pass reads
the whole folder, seconds at a million entries), and this process's and other processes' writers write
on meanwhile in the room between. What such a pass evicts is counted by the next `take_evicted_behind`.
A write that does not fit under max_bytes makes room first: it runs the pass itself, or, when another
process or thread runs one, waits up to ROOM_WAIT_S for room and is otherwise left out (its bytes are
handed on as they are). A hit touches its entry's mtime, which is what "recently used" means across
processes.

Faults: any OSError while writing (a full disk, a read-only folder, a link where a folder should be)
abandons the entry, and the first such failure in a process is warned about; the caller hands on the
bytes it read from the store as they are.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator

import xxhash

from raydl.storage import cache_evict
from raydl.storage.cache_folder import (
    ENTRIES,
    ENTRY,
    READ_FLAGS,
    CacheFolder,
    StateLock,
    pid_namespace,
    write_all,
)

__all__ = ["COUNTERS", "HIGH_WATER", "LOW_WATER", "WHOLE", "CacheCounts", "NodeCache", "node_cache"]

# The node cache's warnings go out under the name of its front module, raydl.storage.cache: one name to
# filter the whole cache on.
logger = logging.getLogger("raydl.storage.cache")

MAGIC = b"RAYDLC2\n"  # RAYDLC1: the key scheme without the store
_HEAD = struct.Struct("<8sIQ16s")  # magic, key bytes, payload bytes, XXH3-128 of key + payload
LOW_WATER = 0.9  # an eviction pass frees room down to this share of max_bytes
HIGH_WATER = 0.95  # a write past this share starts a pass, while the rest of max_bytes is room to write on
ROOM_WAIT_S = 2.0  # how long a write that does not fit waits for another process's pass to make room
SEEN_MAX = 1 << 16  # (store, uri, etag) a process remembers having cleaned of other etags
WHOLE = -1  # the length of a whole-object entry (a streamed read)
_SHORT_OF = (errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.EINTR)  # a read's own resources
COUNTERS = ("hits", "misses", "bytes_from_store", "bytes_from_cache", "evictions", "corrupt")
# Shard folders (entries/<shard>) whose descriptors a process keeps open for its reads, the first it reads:
# an object's entries share a shard, so a WebDataset or Parquet dataset's hits go through a few folders,
# each opened and checked once instead of at every hit (each system call lets the GIL go, which on a
# busy worker costs more than the call). Shard folders are never removed.
READ_DIRS = 64


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


@functools.lru_cache(maxsize=4096)  # a worker names the same objects, stores and etags over and over
def _hex(text: str, n: int) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=n).hexdigest()


class NodeCache:
    """One cache folder on this node. Made per process (`node_cache`); every method is thread safe, and any
    number of processes may use one folder at once. `group`: None for a cache private to this user, or the
    group whose members share it (raydl/storage/cache_folder.py)."""

    def __init__(self, path: str, max_bytes: int, group: str | None = None) -> None:
        self.path = os.path.abspath(path)
        self.max_bytes = max_bytes
        self.group = group
        self._folder: CacheFolder | None = None
        self._opening = threading.Lock()
        self._lock = (
            threading.Lock()
        )  # this process's threads at the ledger; the fcntl lock is between processes
        self._evicting = threading.Lock()  # this process's threads at the eviction claim
        self._behind: threading.Thread | None = None  # the pass a write past HIGH_WATER started
        self._behind_lock = threading.Lock()
        self._evicted_behind = 0  # entries that pass removed, not yet counted by take_evicted_behind
        self._handed_on = CacheCounts()  # counters of scopes no batch took (hand_on), for the next take
        self._seen: set[tuple[str, str, str]] = set()  # (store, uri, etag) whose other-etag entries are gone
        self._read_dirs: dict[str, int] = {}  # shard -> its folder's descriptor, kept open (READ_DIRS)
        self._read_dirs_lock = threading.Lock()
        self._warned = False
        self._warned_refused = False
        self._ns = pid_namespace()

    # -- names ----------------------------------------------------------------------------------
    @staticmethod
    def _names(store: str, uri: str, etag: str, offset: int, length: int) -> tuple[str, str]:
        uh = _hex(uri, 12)
        size = "all" if length == WHOLE else str(length)
        return uh[:3], f"{uh}-{_hex(store, 8)}-{_hex(etag, 8)}-{offset}-{size}"

    def entry_path(self, uri: str, etag: str, offset: int, length: int, store: str = "") -> str:
        shard, name = self._names(store, uri, etag, offset, length)
        return os.path.join(self.path, ENTRIES, shard, name)

    @staticmethod
    def _key(store: str, uri: str, etag: str, offset: int, length: int) -> bytes:
        return json.dumps([store, uri, etag, offset, length], separators=(",", ":")).encode()

    @classmethod
    def payload_start(cls, uri: str, etag: str, offset: int, length: int, store: str = "") -> int:
        """Where the entry's payload starts in its file (and in `get_whole`'s mmap): after header and key."""
        return _HEAD.size + len(cls._key(store, uri, etag, offset, length))

    def _open(self) -> CacheFolder:
        """The folder opened and checked, and what dead writers left in tmp/ removed (once per process); a
        folder with no ledger is counted (under the lock) and given one."""
        folder = self._folder
        if folder is not None:
            return folder
        with self._opening:
            if self._folder is None:
                folder = CacheFolder(self.path, self.group)
                folder.clean_tmp(self._ns)
                if folder.read_state() is None:
                    with StateLock(folder, self._lock, self.max_bytes, self._ns):
                        pass  # the lock counts a folder without a ledger and writes one
                self._folder = folder
            return self._folder

    # -- reads ----------------------------------------------------------------------------------
    def get(
        self, uri: str, etag: str, offset: int, length: int, counts: CacheCounts | None = None, *,
        store: str | None = None,
    ) -> bytes | None:  # fmt: skip
        """The entry's bytes, verified; None on a miss (a corrupt entry is warned about, removed, counted in
        `counts`, a miss). `store`: the storage's identity; None, a tool's view, finds any store's entry."""
        if store is None:
            return self._get_any(uri, etag, offset, length, counts, whole=False)
        return self._get(store, uri, etag, offset, length, counts, whole=False)

    def get_whole(
        self, uri: str, etag: str, counts: CacheCounts | None = None, *, store: str | None = None
    ) -> mmap.mmap | None:
        """A whole-object entry as a read-only mmap (payload from `payload_start(uri, etag, 0, WHOLE,
        store)`), verified."""
        if store is None:
            return self._get_any(uri, etag, 0, WHOLE, counts, whole=True)
        return self._get(store, uri, etag, 0, WHOLE, counts, whole=True)

    def _get(self, store, uri, etag, offset, length, counts, *, whole: bool):
        folder = self._open()
        shard, name = self._names(store, uri, etag, offset, length)
        key = self._key(store, uri, etag, offset, length)
        shard_fd = self._read_dirs.get(shard)
        if shard_fd is not None:
            return self._read(folder, shard_fd, name, key, counts, whole)
        try:
            shard_fd = folder.open_shard(shard)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._refused(exc)
            return None
        with self._read_dirs_lock:
            keep = len(self._read_dirs) < READ_DIRS and shard not in self._read_dirs
            if keep:
                self._read_dirs[shard] = shard_fd
        try:
            return self._read(folder, shard_fd, name, key, counts, whole)
        finally:
            if not keep:
                os.close(shard_fd)

    def _read(self, folder: CacheFolder, shard_fd: int, name: str, key: bytes, counts, whole: bool):
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=shard_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            path = os.path.join(folder.shard_path(name[:3]), name)
            if exc.errno == errno.ELOOP:
                self._refused(
                    PermissionError(f"node cache entry {path!r} is a symbolic link: never followed")
                )
            else:  # out of descriptors or memory, a mode changed: nothing says its bytes are bad
                self._refused(
                    OSError(exc.errno, f"node cache entry {path!r} cannot be opened: {exc.strerror}")
                )
            return None
        out = None
        st = None
        try:
            st = os.fstat(fd)
            if not folder.ours(st):
                path = os.path.join(folder.shard_path(name[:3]), name)
                self._refused(
                    PermissionError(f"node cache entry {path!r} is not a regular file of the cache's own")
                )
                return None
            out, why = (_read_whole if whole else _read_range)(fd, key, st.st_size)
            if why is not None:
                self._corrupt(folder, shard_fd, name, st.st_ino, why, counts)
                return None
            try:
                os.utime(fd)  # recently used, as every process on the node sees it
            except OSError:
                pass
            return out
        except OSError as exc:
            if isinstance(out, mmap.mmap):
                out.close()
            if exc.errno in _SHORT_OF or st is None:  # this process is short of memory: not the entry's fault
                self._refused(exc)
                return None
            self._corrupt(folder, shard_fd, name, st.st_ino, f"it cannot be read ({exc})", counts)
            return None
        finally:
            os.close(fd)

    def _get_any(self, uri, etag, offset, length, counts, *, whole: bool):
        """The entry of (uri, etag, offset, length) of whichever store has one (a tool's view)."""
        folder = self._open()
        shard, name = self._names("", uri, etag, offset, length)
        head, tail = name[:24] + "-", name[41:]
        try:
            with folder.shard(shard) as fd:
                names = sorted(n for n in os.listdir(fd) if n.startswith(head) and n.endswith(tail))
                stores = [s for n in names if ENTRY.fullmatch(n) and (s := _store_of(fd, n)) is not None]
        except OSError:
            return None
        for store in stores:
            got = self._get(store, uri, etag, offset, length, counts, whole=whole)
            if got is not None:
                return got
        return None

    def _corrupt(self, folder: CacheFolder, shard_fd: int, name: str, ino, why: str, counts) -> None:
        path = os.path.join(folder.shard_path(name[:3]), name)
        if counts is not None:
            counts.add(corrupt=1)
        logger.warning("raydl: node cache entry %s is corrupt (%s): removed, read from the store", path, why)
        try:
            with self._locked() as led:
                size = folder.remove(shard_fd, name, ino=ino)
                if size is not None:
                    led.total -= size
        except OSError:
            pass

    def _refused(self, exc: OSError) -> None:
        if not self._warned_refused:
            self._warned_refused = True
            logger.warning("raydl: node cache %s left alone: %s; read from the store instead (warned once "
                           "per process)", self.path, exc)  # fmt: skip

    def forget_other_etags(self, uri: str, etag: str, *, store: str = "") -> int:
        """Remove `uri`'s entries of `store` under any other etag (the object was rewritten): on a miss, once
        per (store, uri, etag) and process (a bounded memory of them). How many were removed."""
        if (store, uri, etag) in self._seen:
            return 0
        folder = self._open()
        shard, name = self._names(store, uri, etag, 0, 0)
        prefix, mine = name[:42], name[:59]  # "<uri hash>-<store hash>-", and then "<etag hash>-"
        removed = 0
        try:
            with folder.shard(shard) as fd:
                old = [n for n in os.listdir(fd) if n.startswith(prefix) and not n.startswith(mine)]
                old = [n for n in old if ENTRY.fullmatch(n)]
                if old:
                    with self._locked() as led:
                        for n in old:
                            size = folder.remove(fd, n)
                            if size is not None:
                                led.total -= size
                                removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._refused(exc)
        if len(self._seen) >= SEEN_MAX:
            self._seen.clear()
        self._seen.add((store, uri, etag))
        return removed

    # -- writes ---------------------------------------------------------------------------------
    def put(
        self, uri: str, etag: str, offset: int, length: int, data: bytes, *, store: str = ""
    ) -> int | None:
        """Keep `data` as the entry; the entries evicted to make room, or None when nothing was kept
        (too big for max_bytes, no room made in time, or a write failed: then a warning, once per process)."""
        key = self._key(store, uri, etag, offset, length)
        if _HEAD.size + len(key) + len(data) > self.max_bytes:
            return None
        try:
            tmp = self._temp(key)
        except OSError as exc:
            self._write_failed(uri, exc)
            return None
        h = xxhash.xxh3_128(key)
        try:
            h.update(data)
            write_all(tmp[0], data)
        except OSError as exc:
            self._abandon(tmp)
            self._write_failed(uri, exc)
            return None
        return self._finish(store, uri, etag, offset, length, key, tmp, len(data), h.digest())

    def put_stream(
        self, uri: str, etag: str, pieces: Iterator[bytes], out: CacheCounts, *, store: str = ""
    ) -> Iterator[bytes]:
        """`pieces` (a whole object) handed on as they come and written to a whole-object entry beside;
        committed when they end (a failed write only stops the writing)."""
        key = self._key(store, uri, etag, 0, WHOLE)
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
            evicted = self._finish(store, uri, etag, 0, WHOLE, key, tmp, total, h.digest())
            if evicted is not None:
                out.add(evictions=evicted)

    def _temp(self, key: bytes) -> tuple[int, str]:
        folder = self._open()
        fd, name = folder.temp(self._ns)
        try:
            write_all(fd, _HEAD.pack(MAGIC, len(key), 0, b"\0" * 16) + key)
        except BaseException:
            os.close(fd)
            os.unlink(name, dir_fd=folder.tmp)
            raise
        return fd, name

    def _finish(self, store, uri, etag, offset, length, key, tmp, n, digest) -> int | None:
        """Fill in the header, rename into place under the lock (making room first where it does not fit),
        and evict past HIGH_WATER: the entries evicted, or None when the entry was left out."""
        fd, tmp_name = tmp
        size = _HEAD.size + len(key) + n
        if size > self.max_bytes:
            self._abandon(tmp)
            return None
        folder = self._open()
        shard, name = self._names(store, uri, etag, offset, length)
        try:
            os.pwrite(fd, _HEAD.pack(MAGIC, len(key), n, digest), 0)
            os.close(fd)
            fd = -1
            with folder.shard(shard, create=True) as shard_fd:
                return self._publish(folder, shard_fd, tmp_name, name, size)
        except OSError as exc:
            self._abandon((fd, tmp_name))
            self._write_failed(uri, exc)
            return None

    def _publish(self, folder: CacheFolder, shard_fd: int, tmp_name: str, name: str, size: int) -> int | None:
        evicted, made_room, deadline = 0, False, None
        try:
            while True:
                lock = self._locked()
                with lock as led:
                    if _exists(shard_fd, name):  # another writer got there first: one copy, counted once
                        os.unlink(tmp_name, dir_fd=folder.tmp)
                        return evicted
                    if led.total + size <= self.max_bytes:
                        led.total += size
                        led.added += size
                        # the ledger before the rename: a crash between the two counts too much, never too
                        # little
                        lock.write()
                        os.rename(tmp_name, name, src_dir_fd=folder.tmp, dst_dir_fd=shard_fd)
                        high = led.total > HIGH_WATER * self.max_bytes
                        break
                got = None if made_room else self._evict(LOW_WATER * self.max_bytes - size)
                if got is not None:
                    evicted += got
                    made_room = True  # a pass of our own: if the entry does not fit after it, it never will
                    continue
                now = time.monotonic()
                deadline = deadline or now + ROOM_WAIT_S
                if made_room or now >= deadline:
                    self._abandon((-1, tmp_name))
                    self.hand_on({"evictions": evicted})  # its passes removed entries all the same
                    return None
                time.sleep(0.005)  # another process's pass frees room a step at a time
        except BaseException:  # the passes it ran removed entries all the same
            self.hand_on({"evictions": evicted})
            raise
        if high:
            self._evict_behind(LOW_WATER * self.max_bytes)
        return evicted

    def _abandon(self, tmp: tuple[int, str]) -> None:
        fd, name = tmp
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        if self._folder is not None:
            try:
                os.unlink(name, dir_fd=self._folder.tmp)
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
    def _locked(self) -> StateLock:
        return StateLock(self._open(), self._lock, self.max_bytes, self._ns)

    def _evict(self, target: float) -> int | None:
        """A pass down to `target` if no other process runs one (then None): the entries it removed."""
        folder = self._open()
        with cache_evict.claimed(folder, self._evicting, wait=False) as mine:
            if not mine:
                return None
            removed = cache_evict.evict(folder, self._locked, target)
        folder.clean_tmp(self._ns)
        return removed

    def _evict_behind(self, target: float) -> None:
        """A pass down to `target` on a thread of its own, unless this process runs one already."""
        with self._behind_lock:
            if self._behind is not None and self._behind.is_alive():
                return
            self._behind = threading.Thread(
                target=self._run_behind, args=(target,), name="raydl-cache-evict", daemon=True
            )
            self._behind.start()

    def _run_behind(self, target: float) -> None:
        try:
            removed = self._evict(target) or 0
        except OSError as exc:  # the folder went away or turned read-only: writes will say so too
            self._write_failed("(an eviction pass)", exc)
            return
        except Exception:
            logger.exception("raydl: an eviction pass of the node cache %s failed", self.path)
            return
        with self._behind_lock:
            self._evicted_behind += removed

    def hand_on(self, counts: dict[str, int]) -> None:
        """Counters no batch's scope took (a scope of reads ahead of need; the evictions of a write whose
        entry was left out), for the next take_handed_on."""
        self._handed_on.add(**counts)

    def take_handed_on(self) -> dict[str, int]:
        return self._handed_on.take()

    def take_evicted_behind(self) -> int:
        """The entries passes on their own thread removed since the last call."""
        with self._behind_lock:
            n, self._evicted_behind = self._evicted_behind, 0
        return n

    def wait_for_eviction(self, timeout: float | None = None) -> bool:
        """Wait for the pass a write started on its own thread (if any) to end: whether none runs now."""
        with self._behind_lock:
            thread = self._behind
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def scan(self) -> list[tuple[int, int, str]]:
        """Every entry as (mtime_ns, size, path) (a tool's view: the whole folder in memory)."""
        folder = self._open()
        return [
            (m, size, os.path.join(folder.shard_path(shard), name)) for m, size, shard, name in folder.scan()
        ]

    # -- the CLI's view -------------------------------------------------------------------------
    def info(self) -> dict:
        """entries, bytes, max_bytes (as the last writer set it, None if unknown), oldest and newest use
        (seconds since the epoch, None when empty)."""
        folder = self._open()
        n = total = 0
        oldest = newest = None
        for mtime, size, _, _ in folder.scan():
            n += 1
            total += size
            oldest = mtime if oldest is None else min(oldest, mtime)
            newest = mtime if newest is None else max(newest, mtime)
        recorded = folder.read_state()
        return {
            "path": self.path,
            "entries": n,
            "bytes": total,
            "max_bytes": recorded[1] if recorded and recorded[1] else None,
            "oldest": oldest / 1e9 if oldest is not None else None,
            "newest": newest / 1e9 if newest is not None else None,
        }

    def clear(self) -> int:
        """Remove every entry (and temporary files of dead writers); how many entries were removed. Files
        the cache did not name, links and other users' files are left."""
        folder = self._open()
        with cache_evict.claimed(folder, self._evicting, wait=True):
            removed = cache_evict.evict(folder, self._locked, -1, everything=True)
        folder.clean_tmp(self._ns)
        return removed


def _read_range(fd: int, key: bytes, size: int) -> tuple[bytes | None, str | None]:
    """(payload, None) of a verified entry file of `size` bytes, or (None, why not). Header and payload
    come in one read: each system call lets the GIL go."""
    start = _HEAD.size + len(key)
    if size < start:
        return None, "it is truncated"
    head, data = bytearray(start), bytearray(size - start)
    got = os.readv(fd, [head, data])
    if got < start:
        return None, "it is truncated"
    why = _bad_head(head, key, size)
    if why is not None:
        return None, why
    if got < size:  # a single read returns less only past 2 GiB, or for a file cut meanwhile
        rest = memoryview(data)[got - start :]
        while rest and (n := os.readv(fd, [rest])) > 0:
            rest, got = rest[n:], got + n
        if got < size:
            return None, "it is truncated"
    h = xxhash.xxh3_128(key)
    h.update(data)
    if h.digest() != _HEAD.unpack_from(head)[3]:
        return None, "its digest does not match its bytes"
    return bytes(data), None


def _read_whole(fd: int, key: bytes, size: int) -> tuple[mmap.mmap | None, str | None]:
    """(the file as a read-only mmap, None) of a verified entry file, or (None, why not)."""
    if size < _HEAD.size + len(key):
        return None, "it is truncated"
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    head = mm[: _HEAD.size + len(key)]
    why = _bad_head(head, key, size)
    if why is None:
        h = xxhash.xxh3_128(key)
        h.update(memoryview(mm)[len(head) :])
        if h.digest() != _HEAD.unpack_from(head)[3]:
            why = "its digest does not match its bytes"
    if why is not None:
        mm.close()
        return None, why
    return mm, None


def _bad_head(head: bytes, key: bytes, size: int) -> str | None:
    if len(head) < _HEAD.size + len(key):
        return "it is truncated"
    magic, klen, n, _ = _HEAD.unpack_from(head)
    if magic != MAGIC or klen != len(key) or head[_HEAD.size :] != key:
        return "its header is not this entry's"
    if size != _HEAD.size + klen + n:
        return f"it is {size} bytes, its header says {_HEAD.size + klen + n}"
    return None


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _store_of(shard_fd: int, name: str) -> str | None:
    """The store an entry file's key names (None when it has no readable key of this scheme)."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=shard_fd)
    except OSError:
        return None
    try:
        head = os.pread(fd, _HEAD.size, 0)
        if len(head) < _HEAD.size or head[:8] != MAGIC:
            return None
        klen = _HEAD.unpack_from(head)[1]
        key = json.loads(os.pread(fd, min(klen, 1 << 16), _HEAD.size))
        return key[0] if isinstance(key, list) and len(key) == 5 and isinstance(key[0], str) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


_caches: dict[tuple[str, int, str | None], NodeCache] = {}
_caches_lock = threading.Lock()


def node_cache(path: str, max_bytes: int, group: str | None = None) -> NodeCache:
    """This process's NodeCache of (path, max_bytes, group): one per folder, shared by its threads and
    loaders."""
    key = (os.path.abspath(path), max_bytes, group)
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = NodeCache(path, max_bytes, group)
        return cache
