"""Receive buffers: anonymous memory faulted in ahead of the reads, reused when free.

A fetch into fresh memory would spend most of its transfer faulting pages in.
On a 2-core KVM guest with free page reporting, a fresh 512 MiB cost 0.14 s
of kernel time with 4 KiB pages but 0.07-1.3 s with transparent huge pages
(1.2 s typical in a fresh process), and pages faulted by the provider's own
recv cost far more than either (a fetch with nothing faulted ahead: 1.3 s of
transfer). So a receive buffer is plain 4 KiB pages (fresh(huge=True) asks
for huge pages where they win), and a fetch into fresh memory starts a
Toucher at once: threads that fault it in 4 MiB slices just ahead of the
reads, which then land on pages already there. Faulting uses
madvise(MADV_POPULATE_WRITE), which runs without the GIL (ctypes) and leaves
bytes already written alone. prepare(buffer_bytes=n) faults one in on
background threads before the first fetch; and when the tensors built on a
buffer are all gone, the buffer goes back to the pool (at most `max_free`
free buffers are kept, the largest) and the next fetch reads into memory
already faulted in.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import threading
import weakref

import numpy as np

from raydl.util.threads import usable_cores

__all__ = ["BufferPool", "Toucher", "fresh", "populate", "populate_in_slices", "populate_on_threads"]

logger = logging.getLogger(__name__)

_HUGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = None
TOUCH_SLICE = 4 << 20  # one toucher step: short enough that the reads' frontier is seen often
EXIT_WAIT_S = 1.0  # at exit, how long a toucher may take to finish its slice


def touch_threads() -> int:
    """Threads that fault a fresh buffer in: two where there are two cores or more."""
    return max(1, min(2, usable_cores()))


def fresh(n: int, huge: bool = False) -> mmap.mmap:
    """n bytes of fresh anonymous memory (page-aligned); huge=True asks for transparent huge pages."""
    mm = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and n >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
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
    MADV_POPULATE_WRITE it stops, and the reads fault the pages. from_end: last slice first
    (RAYDL_CHECKPOINT_FAULTS=end-huge: the reads fault the front, this the back)."""
    starts = range(0, len(mm), slice_bytes)
    for start in reversed(starts) if from_end else starts:
        if not populate(mm, start, min(slice_bytes, len(mm) - start), touch=touch) and not touch:
            return


def populate_on_threads(mm: mmap.mmap, threads: int | None = None, *, touch: bool = True) -> None:
    """populate() all of mm on `threads` threads at once (default touch_threads()), in slices; returns
    when every slice is done. Nothing else may write to mm meanwhile when touch=True."""
    toucher = Toucher(mm, threads=threads or touch_threads(), touch=touch).start()
    toucher.join()


class Toucher:
    """Faults a fresh buffer in front to back, TOUCH_SLICE at a time, on `threads` threads, just ahead
    of reads that fill it from its start: landed(end) says how far they got, and a thread skips what
    they passed (they faulted it themselves). Pages faulted this way cost a fraction of what a fault
    inside the provider's recv costs. stop() ends it after the slices under way (a few ms); the
    process's exit stops every toucher first (atexit, bounded by EXIT_WAIT_S)."""

    def __init__(
        self, mm: mmap.mmap, *, threads: int = 1, slice_bytes: int = TOUCH_SLICE, touch: bool = False
    ) -> None:
        self._mm = mm
        self._slice = max(mmap.PAGESIZE, slice_bytes)
        self._touch = touch
        self._next = 0  # where the next slice handed out starts
        self._landed = 0  # how far the reads have got
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._refused = False
        self._threads = [
            threading.Thread(target=self._run, name=f"raydl-toucher-{i}", daemon=True)
            for i in range(max(1, threads))
        ]

    def start(self) -> Toucher:
        with _LIVE_LOCK:
            if _EXITING:
                return self  # the process is exiting: the reads fault the pages
            _LIVE.add(self)
        for t in self._threads:
            t.start()
        return self

    def landed(self, end: int) -> None:
        """The reads have filled the buffer up to about `end` (reads complete out of order: a hint)."""
        if end > self._landed:
            self._landed = end

    @property
    def faulted_to(self) -> int:
        """Where the next slice would start: every slice before it is faulted in or handed out."""
        return self._next

    def _take(self) -> int | None:
        with self._lock:
            start = max(self._next, self._landed // self._slice * self._slice)
            if start >= len(self._mm) or self._stop.is_set():
                return None
            self._next = start + self._slice
            return start

    @property
    def finished(self) -> bool:
        """Every slice was faulted in (not stopped part way, nor refused by the kernel)."""
        return self._next >= len(self._mm) and not self._stop.is_set() and not self._refused

    def _run(self) -> None:
        try:
            while (start := self._take()) is not None:
                length = min(self._slice, len(self._mm) - start)
                if not populate(self._mm, start, length, touch=self._touch) and not self._touch:
                    self._refused = True
                    return  # no MADV_POPULATE_WRITE here: the reads fault the pages
        except Exception as exc:  # noqa: BLE001 - faulting ahead is an optimisation: the reads fault what is left
            logger.debug("raydl: receive buffer toucher stopped: %s", exc)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the threads to finish (every slice faulted, or stopped)."""
        for t in self._threads:
            if t.ident is not None and t is not threading.current_thread():
                t.join(timeout)
        if not self.alive:
            with _LIVE_LOCK:
                _LIVE.discard(self)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def stop(self, timeout: float | None = None) -> None:
        """No slice is handed out any more; wait for those under way."""
        self._stop.set()
        self.join(timeout)


_LIVE: set[Toucher] = set()
_LIVE_LOCK = threading.Lock()
_EXITING = False


def _stop_touchers() -> None:
    # atexit: no toucher is still faulting while the interpreter (and the mmaps it owns) goes away
    global _EXITING
    with _LIVE_LOCK:
        _EXITING = True
        live = list(_LIVE)
    for toucher in live:
        toucher.stop(EXIT_WAIT_S)


atexit.register(_stop_touchers)


class BufferPool:
    """Receive buffers for one process. take(n) -> a uint8 array of n bytes; free buffers are reused."""

    def __init__(self, max_free: int = 1, *, huge: bool = False) -> None:
        self._max_free = max_free
        self._huge = huge
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._refs: dict[int, weakref.ref] = {}  # keeps the callbacks alive
        self._pending: list[tuple[int, threading.Event]] = []  # prefaults under way: (bytes, done)
        self._started: list[tuple[mmap.mmap, Toucher]] = []  # prefault_ahead() buffers still faulting
        self._expire = threading.Event()  # set at exit and by cancel_started(): the ttl waits end
        self._unused: set[int] = set()  # id()s of prefault_ahead() buffers in _free that no fetch took yet
        self._declined = False  # take() ran, or decline_ahead(): prefault_ahead() does nothing

    def take(self, n: int, *, huge: bool | None = None) -> tuple[np.ndarray, mmap.mmap | None]:
        """(array of n bytes, None) from a free buffer already faulted in when one is large enough
        (waiting for a prefault of one under way), else (array on fresh memory, its mmap: the caller
        may fault it in ahead of use, with a Toucher). huge: ask fresh memory for huge pages
        (default: the pool's choice)."""
        with self._lock:
            pending = [done for size, done in self._pending if size >= n]
        if pending:
            pending[0].wait()
        with self._lock:
            self._declined = True  # a fetch under way: no background prefault of a second buffer
            fits = [mm for mm in self._free if len(mm) >= n]
            mm = min(fits, key=len) if fits else None
            if mm is not None:
                self._free.remove(mm)
                self._unused.discard(id(mm))
        new = mm is None
        if new:
            mm = fresh(n, self._huge if huge is None else huge)
        view = np.frombuffer(mm, np.uint8)[:n]
        ref = weakref.ref(view, lambda r, mm=mm: self._give_back(r, mm))
        with self._lock:
            self._refs[id(ref)] = ref
        return view, (mm if new else None)

    def claim_started(self, n: int) -> tuple[np.ndarray, Toucher] | None:
        """(array of n bytes, its Toucher still faulting it ahead) from a prefault_ahead() buffer under
        way that is large enough, or None. The caller feeds the toucher its reads' progress."""
        with self._lock:
            fits = [entry for entry in self._started if len(entry[0]) >= n]
            if not fits:
                return None
            entry = min(fits, key=lambda e: len(e[0]))
            self._started.remove(entry)
        mm, toucher = entry
        view = np.frombuffer(mm, np.uint8)[:n]
        ref = weakref.ref(view, lambda r, mm=mm: self._give_back(r, mm))
        with self._lock:
            self._refs[id(ref)] = ref
        return view, toucher

    def prefault_ahead(self, n: int, *, ttl_s: float, huge: bool = False) -> bool:
        """Start faulting a buffer of at least n bytes in on Toucher threads and return at once: a
        fetch that starts meanwhile takes it over, toucher and all (claim_started), instead of
        waiting; once faulted it is a free buffer. Unclaimed after ttl_s seconds, it is dropped (a
        process that never fetches does not keep it). False when one that fits is free or under way,
        or once take() has run or decline_ahead() was called."""
        n = -(-(n + (1 << 20)) // _HUGE) * _HUGE
        with self._lock:
            if (
                self._declined
                or any(len(mm) >= n for mm in self._free)
                or any(size >= n for size, _ in self._pending)
                or any(len(mm) >= n for mm, _ in self._started)
            ):
                return False
            mm = fresh(n, huge)
            toucher = Toucher(mm, threads=touch_threads())
            entry = (mm, toucher)
            self._started.append(entry)
        toucher.start()
        threading.Thread(
            target=self._settle, args=(entry, ttl_s), name="raydl-prefault-ahead", daemon=True
        ).start()
        return True

    def _settle(self, entry: tuple[mmap.mmap, Toucher], ttl_s: float) -> None:
        mm, toucher = entry
        toucher.join()
        with self._lock:
            if entry not in self._started:
                return  # a fetch took it over (or it was cancelled)
            self._started.remove(entry)
            if not toucher.finished:
                return  # stopped part way (exit, cancel): not a faulted-in buffer
            self._free.append(mm)
            self._free.sort(key=len, reverse=True)
            del self._free[self._max_free :]
            self._unused.add(id(mm))
        self._expire.wait(ttl_s)
        with self._lock:
            if id(mm) in self._unused:  # no fetch took it: its munmap comes now
                self._unused.discard(id(mm))
                self._free = [m for m in self._free if m is not mm]

    def decline_ahead(self) -> None:
        """This process fetches into other memory (a broadcast peer) or publishes: no prefault_ahead()
        from now on, and any under way is dropped."""
        with self._lock:
            self._declined = True
        self.cancel_started()

    def cancel_started(self) -> None:
        """Stop and drop every prefault_ahead() buffer no fetch has taken, and any it left free
        (a publishing process does not keep memory sized for fetches)."""
        with self._lock:
            started, self._started = self._started, []
        for _mm, toucher in started:
            toucher.stop()
        self._expire.set()

    def _give_back(self, ref, mm: mmap.mmap) -> None:
        # the array and every tensor built on it are gone: its memory is free again
        with self._lock:
            self._refs.pop(id(ref), None)
            self._free.append(mm)
            self._free.sort(key=len, reverse=True)
            del self._free[self._max_free :]  # the smallest go: their munmap comes with the last reference

    def prefault(self, n: int, *, huge: bool | None = None) -> None:
        """Have a buffer of at least n bytes faulted in and free (reuses a free one, or one that
        prefault_ahead() is faulting in, when it fits), on touch_threads() threads. It is made a
        little larger (up to 3 MiB): a checkpoint is its tensors' bytes plus a header."""
        n = -(-(n + (1 << 20)) // _HUGE) * _HUGE
        done = threading.Event()
        with self._lock:
            if (
                any(len(mm) >= n for mm in self._free)
                or any(size >= n for size, _ in self._pending)
                or any(len(mm) >= n for mm, _ in self._started)  # the import's, from the size hint
            ):
                return
            self._pending.append((n, done))
        try:
            mm = fresh(n, self._huge if huge is None else huge)
            populate_on_threads(mm, touch=True)
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
