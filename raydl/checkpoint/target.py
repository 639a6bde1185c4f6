"""Where a fetch's bytes land: a receive buffer from the pool, or (fetch(into=path)) a temporary file
beside `path`, renamed into place once every chunk is verified.

The file is allocated for real before it is mapped (posix_fallocate, else written with zeros): a
sparse file written through a mapping turns a full disk into SIGBUS in the middle of the copy (the
object-store path) or a bare EFAULT from the provider's recv (fabric). Allocated first, a full disk
is a CheckpointError naming the path, the bytes needed and the bytes free, before any transfer.
Every failure removes the temporary file; a commit fsyncs the file, renames it and fsyncs the
directory, so the name and the bytes survive a crash together.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import tempfile
import threading

import numpy as np

from raydl.checkpoint.buffers import (
    BufferPool,
    Toucher,
    populate_in_slices,
    populate_on_threads,
    touch_threads,
)
from raydl.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["FetchTarget", "allocate"]

_ZEROS = 1 << 20  # the block the fallback writes


def allocate(fd: int, size: int) -> None:
    """Give the open file `fd` `size` bytes of real blocks: posix_fallocate, or writing zeros where the
    filesystem cannot (glibc emulates it for most; some return EOPNOTSUPP or EINVAL). OSError on failure."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    zeros = bytes(_ZEROS)
    pos = 0
    while pos < size:
        pos += os.pwrite(fd, zeros[: min(_ZEROS, size - pos)], pos)


def _free_bytes(directory: str) -> str:
    try:
        return str(shutil.disk_usage(directory).free)
    except OSError:
        return "an unknown number of"


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FetchTarget:
    """Where fetched bytes land: memory, or a temporary file renamed into place on success.
    `name` (the key's first characters) names the checkpoint in errors."""

    def __init__(self, size: int, into: str | os.PathLike | None, pool: BufferPool, *, name: str) -> None:
        self.path = None if into is None else os.fspath(into)
        self._tmp: str | None = None
        self._fd: int | None = None  # the temporary file, open until commit or abort: never reopened by name
        self._name = name
        self.toucher: Toucher | None = None
        if self.path is None:
            from raydl.env import checkpoint_faults

            try:
                self._faults = checkpoint_faults()
            except ValueError as exc:
                logger.warning("raydl: %s; faulting receive buffers in the default way", exc)
                self._faults = "hint"
            started = pool.claim_started(size)  # a background prefault under way: its toucher goes on
            if started is not None:
                self.buffer, self.toucher = started
                self._fresh = None
                return
            try:
                self.buffer, self._fresh = pool.take(size, huge=self._faults.endswith("-huge"))
            except (OSError, MemoryError, OverflowError) as exc:
                raise CheckpointError(
                    f"cannot fetch checkpoint {name}: no {size} bytes of memory to receive it into "
                    f"({type(exc).__name__}: {exc}); fetch it into a file (into=path)"
                ) from exc
            return
        self._fresh = None
        self._dir = os.path.dirname(os.path.abspath(self.path))
        try:
            fd, self._tmp = tempfile.mkstemp(prefix=".raydl-", suffix=".part", dir=self._dir)
        except OSError as exc:
            raise CheckpointError(
                f"cannot fetch checkpoint {name} into {self.path!r}: {exc.strerror}"
            ) from exc
        try:
            try:
                allocate(fd, size)
            except OSError as exc:
                raise CheckpointError(
                    f"cannot fetch checkpoint {name} into {self.path!r}: it needs {size} bytes and its "
                    f"filesystem has {_free_bytes(self._dir)} bytes free ({exc.strerror})"
                ) from exc
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        except BaseException:
            os.close(fd)
            self.abort()
            raise
        self._fd = fd
        self.buffer = np.frombuffer(self._mm, np.uint8)

    def fault_ahead(self) -> None:
        """Start faulting fresh memory in (a buffer from the pool is faulted in already): toucher
        threads just ahead of the reads, which fill the buffer from its start and tell it how far
        they got (landed). RAYDL_CHECKPOINT_FAULTS picks another way, for benchmarks: "end-huge"
        one thread from the end (the reads fault the front), "reads" nothing, "first" all of it
        on every core before returning."""
        mm, self._fresh = self._fresh, None
        if mm is None or self._faults == "reads":
            return
        if self._faults == "first":
            populate_on_threads(mm, touch=False)
        elif self._faults == "end-huge":
            threading.Thread(
                target=populate_in_slices,
                args=(mm,),
                kwargs={"from_end": True},
                name="raydl-prefault",
                daemon=True,
            ).start()
        else:
            self.toucher = Toucher(mm, threads=touch_threads()).start()

    def landed(self, end: int) -> None:
        """The reads have filled the buffer up to about `end`."""
        if self.toucher is not None:
            self.toucher.landed(end)

    def done(self) -> None:
        """The reads are over (or failed): stop faulting ahead of them."""
        toucher, self.toucher = self.toucher, None
        if toucher is not None:
            toucher.stop()

    def commit(self) -> None:
        """Make the file durable and give it its name: fsync it, rename it, fsync the directory."""
        if self._tmp is None:
            return
        try:
            self._mm.flush()
            os.fsync(self._fd)
            os.replace(self._tmp, self.path)
            self._tmp = None
            self._close_fd()
            _fsync_dir(self._dir)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write checkpoint {self._name} to {self.path!r}: {exc.strerror}"
            ) from exc

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def abort(self) -> None:
        """Remove the temporary file (idempotent)."""
        self._close_fd()
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def final_buffer(self) -> np.ndarray:
        """The bytes to build tensors on: the receive buffer, or (into=path, before commit) a private
        copy-on-write mapping of the temporary file through its own descriptor, so the tensors are on the
        bytes that were verified whatever is put at its name later (writable tensors, no copy)."""
        if self.path is None:
            return self.buffer
        if self._fd is None:
            raise CheckpointError(f"checkpoint {self._name}: its file {self.path!r} is committed or aborted")
        mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        return np.frombuffer(mm, np.uint8)
