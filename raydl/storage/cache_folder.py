"""The node cache's folder as files: its layout, the lock and recorded total its writers share, the scan and
least-recently-used eviction of its entries, and the temporary files dead writers left.

    PATH/entries/abc/<uri hash>-<etag hash>-<offset>-<length>   one entry: a header, then the bytes
    PATH/tmp/<pid ns>-<pid>-<random>.tmp                           entries being written
    PATH/lock                                                      fcntl lock: eviction and accounting
    PATH/state                                                     "<bytes> <max_bytes>": the entries' total

What an entry file holds, and how one is read and written, is raydl/storage/node_cache.py's; this module
knows entries only as files with a size and a last use (their mtime, which a hit touches).
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
import time

__all__ = [
    "ENTRIES",
    "LOCK",
    "STALE_TMP_S",
    "STATE",
    "TMP",
    "StateLock",
    "check_cache_folder",
    "clean_tmp",
    "evict",
    "fsync_dir",
    "pid_namespace",
    "read_state",
    "scan",
    "write_all",
]

ENTRIES, TMP, LOCK, STATE = "entries", "tmp", "lock", "state"
STALE_TMP_S = 3600.0  # a temporary file untouched this long is a dead writer's, whoever wrote it


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


def pid_namespace() -> str:
    """This process's pid namespace: a temporary file's pid means a process only within its namespace."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def clean_tmp(tmp: str, ns: str) -> int:
    """Remove the temporary files in `tmp` of dead writers of pid namespace `ns`, and any left untouched for
    STALE_TMP_S (a writer in another namespace cannot be asked whether it lives); how many were removed."""
    removed = 0
    now = time.time()
    try:
        names = os.listdir(tmp)
    except OSError:
        return 0
    for name in names:
        p = os.path.join(tmp, name)
        name_ns, _, rest = name.partition("-")
        pid = rest.partition("-")[0]
        dead = name_ns == ns and pid.isdigit() and not _alive(int(pid))
        try:
            if dead or now - os.stat(p).st_mtime > STALE_TMP_S:
                os.unlink(p)
                removed += 1
        except OSError:
            pass
    return removed


def scan(entries: str) -> list[tuple[int, int, str]]:
    """Every entry under the folder `entries` as (mtime_ns, size, path)."""
    out = []
    try:
        folders = os.listdir(entries)
    except FileNotFoundError:
        return out
    for d in folders:
        try:
            with os.scandir(os.path.join(entries, d)) as it:
                for e in it:
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    out.append((st.st_mtime_ns, st.st_size, e.path))
        except OSError:
            continue
    return out


def evict(entries: str, target: float) -> tuple[int, int]:
    """(the total after, entries removed): least recently used first, until the total is <= target.
    Called under the lock; recounts the total from the folder, so a writer killed between its rename and
    its accounting only delays the count."""
    found = sorted(scan(entries))
    total = sum(s for _, s, _ in found)
    removed = 0
    for _, size, path in found:
        if total <= target:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        total -= size
        removed += 1
    return total, removed


class StateLock:
    """The folder's fcntl lock held, with the recorded total as `state[0]`, written back on exit.

    `thread_lock` is the cache's lock between this process's threads (a flock is per open file, so it does
    not keep two threads of one process apart); `max_bytes` of 0 keeps the max_bytes recorded by the last
    writer (a tool's view of the folder, such as `raydl cache`)."""

    def __init__(self, path: str, thread_lock: threading.Lock, max_bytes: int) -> None:
        self._path = path
        self._thread_lock = thread_lock
        self._max_bytes = max_bytes
        self._fd = -1
        self.state = [0]
        self._max = 0

    def __enter__(self) -> list[int]:
        import fcntl

        self._thread_lock.acquire()
        try:
            self._fd = os.open(os.path.join(self._path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            recorded = read_state(os.path.join(self._path, STATE))
            if recorded is None:  # first use, or a torn state file: count the folder
                recorded = (sum(s for _, s, _ in scan(os.path.join(self._path, ENTRIES))), 0)
            self.state = [recorded[0]]
            self._max = (
                self._max_bytes or recorded[1]
            )  # a tool's NodeCache (max_bytes=0) keeps the loaders' own
        except BaseException:
            self._release()
            raise
        return self.state

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                _write_state(os.path.join(self._path, STATE), self.state[0], self._max)
        finally:
            self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1
        self._thread_lock.release()


def read_state(path: str) -> tuple[int, int] | None:
    """The recorded (total, max_bytes) of a state file; None when it is missing or torn."""
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


def write_all(fd: int, data) -> None:
    """All of `data` written to `fd` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: str) -> None:
    """The folder's entries (a rename into it) made durable."""
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
