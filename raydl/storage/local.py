"""Local disk: os.pread through a per-process cache of open files."""

from __future__ import annotations

import collections
import logging
import operator
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from raydl.errors import DataSourceError, ObjectChangedError
from raydl.storage.base import STREAM_CHUNK, BaseStorage, ObjectInfo

__all__ = ["LocalStorage"]

logger = logging.getLogger(__name__)

_NAME = operator.attrgetter("name")
MAX_DEPTH = 256  # folders below a listed one: deeper is a crafted tree (or a loop the links hide)

_MAX_OPEN = 128  # per process; an image folder opens each file once an epoch, tar shards stay open


class _FileCache:
    """An LRU of read-only file descriptors shared by the threads of one process (rebuilt after a fork).

    A descriptor in use is never closed under its reader: eviction closes it
    when its last user releases it, so a reused descriptor number can never
    hand a reader another file's bytes.
    """

    def __init__(self, capacity: int = _MAX_OPEN) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._users: dict[int, int] = {}
        self._evicted: set[int] = set()
        self._pid = os.getpid()

    def acquire(self, path: str) -> int:
        with self._lock:
            if self._pid != os.getpid():  # a forked child must not share (or close) its parent's descriptors
                self._fds, self._users, self._evicted = collections.OrderedDict(), {}, set()
                self._pid = os.getpid()
            fd = self._fds.get(path)
            if fd is not None:
                self._fds.move_to_end(path)
                self._users[fd] += 1
                return fd
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        with self._lock:
            old = self._fds.get(path)
            if old is not None:  # another thread opened it meanwhile
                os.close(fd)
                self._users[old] += 1
                return old
            self._fds[path] = fd
            self._users[fd] = 1
            while len(self._fds) > self._capacity:
                _, victim = self._fds.popitem(last=False)
                self._evicted.add(victim)
                self._close_if_unused(victim)
            return fd

    def release(self, fd: int, *, forget: str | None = None) -> None:
        """Done with `fd`; `forget` drops the path from the cache (it failed or changed)."""
        with self._lock:
            if forget is not None and self._fds.get(forget) == fd:
                del self._fds[forget]
                self._evicted.add(fd)
            self._users[fd] -= 1
            self._close_if_unused(fd)

    def _close_if_unused(self, fd: int) -> None:
        if fd in self._evicted and self._users.get(fd, 0) == 0:
            self._evicted.discard(fd)
            self._users.pop(fd, None)
            os.close(fd)


_FILES = _FileCache()


@dataclass(frozen=True)
class LocalStorage(BaseStorage):
    """Files on a local (or network-mounted) file system, addressed by path."""

    default_io_concurrency: int = 4

    @property
    def identity(self) -> str:
        """ "": a path names the same file for every process of a node, where a node cache lives."""
        return ""

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every regular file under the directory `prefix` (following links), or `prefix` itself if a file."""
        if os.path.isfile(prefix):
            yield self.stat(prefix)
            return
        for folder, names, sizes in self.list_folders(prefix):
            for name, size in zip(names, sizes, strict=True):
                yield ObjectInfo(os.path.join(folder, name), size)

    def list_folders(self, prefix: str) -> Iterator[tuple[str, list[str], list[int]]]:
        """(folder, its regular files' names, their sizes) for every folder under the directory `prefix`, top
        down, each folder's files and subfolders in name order: a million files listed with no object kept
        per file.

        Links are followed (to files and to folders), but a folder already listed is not listed again (a
        link loop, or two links to one folder: a warning names it), nor are folders more than MAX_DEPTH deep
        (a DataSourceError). FIFOs, sockets and devices are not files to read: they are left out, and a
        warning counts them. Each size comes from one stat of the entry; no file is opened or read.
        """
        if not os.path.isdir(prefix):
            what = "is not a directory" if os.path.exists(prefix) else "does not exist"
            raise DataSourceError(f"{prefix!r} {what}", uri=prefix)
        seen: set[tuple[int, int]] = set()
        special = 0
        stack: list[tuple[str, int]] = [(prefix, 0)]
        while stack:
            folder, depth = stack.pop()
            try:
                st = os.stat(folder)
            except OSError as exc:
                raise DataSourceError(f"cannot list {folder!r} under {prefix!r}: {exc}", uri=folder) from exc
            if (st.st_dev, st.st_ino) in seen:
                logger.warning(
                    "raydl: %s is a folder already listed under %s (a link to it, or a link loop): not "
                    "listed again",
                    folder,
                    prefix,
                )
                continue
            seen.add((st.st_dev, st.st_ino))
            if depth > MAX_DEPTH:
                raise DataSourceError(
                    f"cannot list {prefix!r}: {folder!r} is more than {MAX_DEPTH} folders deep", uri=folder
                )
            names, sizes, subfolders = [], [], []
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise DataSourceError(f"cannot list {folder!r} under {prefix!r}: {exc}", uri=folder) from exc
            try:
                entries = sorted(os.scandir(fd), key=_NAME)  # the names, with their types (no stat yet)
                for e in entries:
                    try:
                        if e.is_dir():
                            subfolders.append(os.path.join(folder, e.name))
                        elif e.is_file():
                            sizes.append(os.stat(e.name, dir_fd=fd).st_size)  # one stat, no path to resolve
                            names.append(e.name)
                        elif not e.is_symlink() or os.path.exists(os.path.join(folder, e.name)):
                            special += 1  # a FIFO, socket or device (a dangling link: as os.walk lists it)
                        else:
                            raise FileNotFoundError(2, "a link to nothing")
                    except OSError as exc:
                        path = os.path.join(folder, e.name)
                        raise DataSourceError(f"cannot stat {path!r}: {exc}", uri=path) from exc
            except DataSourceError:
                raise
            except OSError as exc:
                raise DataSourceError(f"cannot list {folder!r} under {prefix!r}: {exc}", uri=folder) from exc
            finally:
                os.close(fd)
            stack += [(sub, depth + 1) for sub in reversed(subfolders)]
            if names:
                yield folder, names, sizes
        if special:
            logger.warning(
                "raydl: %d entries under %s are neither files nor folders (FIFOs, sockets, devices): "
                "left out",
                special,
                prefix,
            )

    def stat(self, uri: str) -> ObjectInfo:
        try:
            st = os.stat(uri)
        except OSError as exc:
            raise DataSourceError(f"cannot stat {uri!r}: {exc}", uri=uri) from exc
        return ObjectInfo(uri, st.st_size)  # local files have no etag

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        try:
            fd = _FILES.acquire(uri)
        except OSError as exc:
            raise DataSourceError(f"cannot read {uri!r} at offset {offset}: {exc}", uri=uri) from exc
        try:
            data = os.pread(fd, length, offset)
        except OSError as exc:
            _FILES.release(fd, forget=uri)
            raise DataSourceError(f"cannot read {uri!r} at offset {offset}: {exc}", uri=uri) from exc
        if len(data) == length:
            _FILES.release(fd)
            return data
        _FILES.release(fd, forget=uri)  # it shrank: a later read must see the file as it is now
        raise ObjectChangedError(
            f"{uri!r} changed after it was listed: {length} bytes at offset {offset} asked, "
            f"{len(data)} there",
            uri=uri,
        )

    def read(self, uri: str) -> bytes:
        try:
            with open(uri, "rb") as f:
                return f.read()
        except OSError as exc:
            raise DataSourceError(f"cannot read {uri!r}: {exc}", uri=uri) from exc

    def stream(self, uri: str, *, etag: str | None = None, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        """The file's bytes in pieces of `chunk`, read sequentially through one open file."""
        at = 0
        try:
            with open(uri, "rb", buffering=0) as f:
                while True:
                    piece = f.read(chunk)
                    if not piece:
                        return
                    at += len(piece)
                    yield piece
        except OSError as exc:
            raise DataSourceError(f"cannot read {uri!r} at offset {at}: {exc}", uri=uri) from exc


def _size_at(fd: int, folder: str, name: str) -> int:
    try:
        return os.stat(name, dir_fd=fd).st_size
    except OSError as exc:
        uri = os.path.join(folder, name)
        raise DataSourceError(f"cannot stat {uri!r}: {exc}", uri=uri) from exc
