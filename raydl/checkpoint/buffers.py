"""Receive buffers: anonymous memory with huge pages, faulted in ahead of need, reused when free.

A cold fetch spent most of its transfer faulting in fresh pages (512 MiB:
1.4-2.2 s with 4 KiB pages here, 0.3-0.5 s with 2 MiB ones). So a receive
buffer asks for transparent huge pages; prepare(buffer_bytes=n) faults one in
on a background thread before the first fetch; and when the tensors built on
a buffer are all gone, the buffer goes back to the pool (at most `max_free`
free buffers are kept, the largest) and the next fetch reads into memory already
faulted in. Faulting uses madvise(MADV_POPULATE_WRITE), which runs without the
GIL (ctypes), so it can overlap a transfer; a fetch starts it on a fresh buffer
at once, in slices, so it also overlaps the fabric set-up.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import weakref

import numpy as np

__all__ = ["BufferPool", "fresh", "populate", "populate_in_slices"]

logger = logging.getLogger(__name__)

_HUGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = None


def fresh(n: int) -> mmap.mmap:
    """n bytes of fresh anonymous memory (page-aligned), asking for transparent huge pages."""
    mm = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if n >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP off in this kernel: 4 KiB pages
            pass
    return mm


def populate(mm: mmap.mmap, start: int = 0, length: int | None = None, *, touch: bool = True) -> bool:
    """Fault [start, start+length) of mm in for writing, without holding the GIL where the kernel can.
    A kernel without MADV_POPULATE_WRITE (< 5.14): touch=True writes a zero to every page (only
    while nothing else writes there); touch=False leaves it. False when the madvise failed."""
    global _libc
    length = len(mm) - start if length is None else length
    if length <= 0:
        return True
    view = np.frombuffer(mm, np.uint8)
    addr = view.ctypes.data + start
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc = libc
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0:
        return True
    if touch:
        view[start : start + length : mmap.PAGESIZE] = 0
    return False


def populate_in_slices(
    mm: mmap.mmap, slice_bytes: int = 8 << 20, *, touch: bool = False, from_end: bool = False
) -> None:
    """populate() all of mm, `slice_bytes` at a time: each slice holds the process's mmap lock only
    briefly, so another thread's mmap (a fetch's buffer, the fabric stack's set-up) is not held up
    for the whole buffer. touch as in populate(); touch=False (reads may be landing in mm): without
    MADV_POPULATE_WRITE it stops, and the reads fault the pages. from_end: last slice first, for a
    buffer being filled from its start (the reads fault the front, this the back, on two cores)."""
    starts = range(0, len(mm), slice_bytes)
    for start in reversed(starts) if from_end else starts:
        if not populate(mm, start, min(slice_bytes, len(mm) - start), touch=touch) and not touch:
            return


class BufferPool:
    """Receive buffers for one process. take(n) -> a uint8 array of n bytes; free buffers are reused."""

    def __init__(self, max_free: int = 1) -> None:
        self._max_free = max_free
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._refs: dict[int, weakref.ref] = {}  # keeps the callbacks alive
        self._pending: list[tuple[int, threading.Event]] = []  # prefaults under way: (bytes, done)

    def take(self, n: int) -> tuple[np.ndarray, mmap.mmap | None]:
        """(array of n bytes, None) from a free buffer already faulted in when one is large enough
        (waiting for a prefault of one under way), else (array on fresh memory, its mmap: the caller
        may populate() it ahead of use)."""
        with self._lock:
            pending = [done for size, done in self._pending if size >= n]
        if pending:
            pending[0].wait()
        with self._lock:
            fits = [mm for mm in self._free if len(mm) >= n]
            mm = min(fits, key=len) if fits else None
            if mm is not None:
                self._free.remove(mm)
        new = mm is None
        if new:
            mm = fresh(n)
        view = np.frombuffer(mm, np.uint8)[:n]
        ref = weakref.ref(view, lambda r, mm=mm: self._give_back(r, mm))
        with self._lock:
            self._refs[id(ref)] = ref
        return view, (mm if new else None)

    def _give_back(self, ref, mm: mmap.mmap) -> None:
        # the array and every tensor built on it are gone: its memory is free again
        with self._lock:
            self._refs.pop(id(ref), None)
            self._free.append(mm)
            self._free.sort(key=len, reverse=True)
            del self._free[self._max_free :]  # the smallest go: their munmap comes with the last reference

    def prefault(self, n: int) -> None:
        """Have a buffer of at least n bytes faulted in and free (reuses a free one when it fits).
        It is made a little larger (up to 3 MiB): a checkpoint is its tensors' bytes plus a header."""
        n = -(-(n + (1 << 20)) // _HUGE) * _HUGE
        done = threading.Event()
        with self._lock:
            if any(len(mm) >= n for mm in self._free) or any(size >= n for size, _ in self._pending):
                return
            self._pending.append((n, done))
        try:
            mm = fresh(n)
            populate_in_slices(mm, touch=True)
            with self._lock:
                self._free.append(mm)
                self._free.sort(key=len, reverse=True)
                del self._free[self._max_free :]
        finally:
            with self._lock:
                self._pending.remove((n, done))
            done.set()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._free)
