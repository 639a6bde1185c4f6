"""The copies a process serves: HeldCopy (the bytes, and the servers that hand them out) and
HeldCopies (the set one owner keeps: the publishing process for publish(), each CheckpointPeer for its own).

The bytes live in a memfd (or, for a published file, that file), mapped shared:
the fabric server registers that mapping, and another process on the node can
map the same pages through /proc/<pid>/fd/<fd> - which is how the object-store
path serves any held copy on demand, with no copy at rest (see object_store.py).
Closing a copy closes its descriptor, so a fetcher can tell "unpublished".
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from raydl.checkpoint.ref import HolderLocation
from raydl.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["HeldCopies", "HeldCopy", "SharedBuffer"]


class SharedBuffer:
    """Page-aligned bytes behind a file descriptor: a memfd (writable) or a regular file (read-only)."""

    def __init__(self, fd: int, size: int, *, writable: bool) -> None:
        self.fd = fd
        self.size = size
        mm = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        )
        self.array = np.frombuffer(mm, np.uint8)
        self.location = HolderLocation.here(fd)

    @classmethod
    def anonymous(cls, size: int, name: str) -> SharedBuffer:
        """`size` bytes of fresh memory (not faulted in) that other processes here can map."""
        fd = os.memfd_create(f"raydl-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(size, 1))
            return cls(fd, size, writable=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def file(cls, path: str) -> SharedBuffer:
        """A regular file, mapped read-only (served without a copy)."""
        if not os.path.isfile(path):
            raise CheckpointError(f"cannot publish checkpoint path {path!r}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return cls(fd, os.fstat(fd).st_size, writable=False)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Close the descriptor (others can no longer map it); the mapping goes with the last array using
        it."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


@dataclass
class HeldCopy:
    """One copy of a checkpoint held and served by this process."""

    key: str
    memory: SharedBuffer
    server: Any = None  # pyfi.Server of the bytes, or None
    progress: np.ndarray | None = None  # chunks held so far (a receiving peer), served with the bytes

    @property
    def buffer(self) -> np.ndarray:
        return self.memory.array

    def close(self) -> None:
        """Stop serving (fabric threads end, regions revoked) and close the descriptor."""
        if self.server is not None:
            try:
                self.server.close()
            except Exception as exc:  # noqa: BLE001 - go on closing the memory, say what failed
                logger.warning("raydl: closing the server of checkpoint %s: %s", self.key[:8], exc)
        self.memory.close()


class HeldCopies:
    """The copies one owner serves, by checkpoint key. Thread-safe; close_all() is idempotent."""

    def __init__(self) -> None:
        self._copies: dict[str, HeldCopy] = {}
        self._lock = threading.Lock()

    def add(self, copy: HeldCopy) -> None:
        with self._lock:
            if copy.key in self._copies:
                raise CheckpointError(f"checkpoint {copy.key[:8]} is already held here")
            self._copies[copy.key] = copy

    def get(self, key: str) -> HeldCopy | None:
        with self._lock:
            return self._copies.get(key)

    def close(self, key: str) -> bool:
        """Stop serving and drop the copy of `key`; False when none was held."""
        with self._lock:
            copy = self._copies.pop(key, None)
        if copy is None:
            return False
        copy.close()
        return True

    def close_all(self) -> None:
        with self._lock:
            copies, self._copies = list(self._copies.values()), {}
        for copy in copies:
            copy.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._copies)
