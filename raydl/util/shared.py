"""Batch buffers in shared memory that a reader on the same node maps with no copy (Linux memfd).

Through Ray's object store a batch costs three times: a loader worker makes it
in a private buffer (reused, so that it is not faulted in per batch), Ray
copies it into the store (7 % of the worker's CPU), and the store's pages stay
resident. Measured on 4,000 in1k-like images (docs/benchmarks.md, 2026-12-02), 294 MiB of
the worker's 909 MiB were its two private buffers and 533 MiB the store's pages.

Here the worker makes the batch straight into a slot of its own shared memory
(`Slots`, one memfd per slot) and returns only where each array lies in it
(`SharedArray`); the reader opens the same memfd through /proc/PID/fd and maps
it (`attach`), and its arrays are views of the slot. A slot is reused only
once the reader has dropped every view of it: its header's state is set back
to 0 when the last view goes (the same ctypes lease and weakref.finalize as the
driver's own batches, raydl/execute/worker.py), so a batch the user still holds
is never written over. A slot's header (the first `HEADER` bytes): the state (0:
free; else the number of the batch in it) and a random token naming this
memfd, which the reader checks (a PID and fd number can be reused).

Where /proc/PID/fd cannot be opened (another node, another PID namespace, a
stricter ptrace policy), `probe` says so and the worker returns its arrays
through the object store as before. A free slot too small for a batch (aspect
buckets vary its size) is replaced by a bigger one, so a worker has as many
slots as batches held at once, and at most `MAX_SLOTS`: with all of them held
it falls back the same way, so a reader that drops results unread costs at
most that much. A dropped slot's state says so (`CLOSED`), and a reader's idle
mapping of it is closed with it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

__all__ = [
    "MAX_SLOTS",
    "SharedArray",
    "Slot",
    "Slots",
    "attach",
    "attach_batch",
    "close_idle",
    "described",
    "probe",
]

HEADER = 64  # state (8 bytes), token (16 bytes), unused; the data starts 64-byte aligned after it
MAX_SLOTS = 8  # slots per worker: batches in flight and held by readers (prefetch depth + 1 per rank)
CLOSED = (1 << 64) - 1  # a slot's state once its worker has dropped it
_IDLE_MAPS = 8  # mappings a reader keeps open while none of its arrays view them (reused next batch)


@dataclass(frozen=True)
class SharedArray:
    """Where one array of a batch lies in a worker's slot: what travels through Ray instead of its bytes."""

    pid: int
    fd: int
    token: bytes
    batch: int  # the slot's state while this batch is in it
    offset: int  # from the slot's data start
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    size: int  # the slot's data bytes


_byte_bounds = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or np.byte_bounds  # numpy 1


def _header(mm: mmap.mmap) -> np.ndarray:
    return np.frombuffer(mm, np.uint64, count=1)


class Slot:
    """One memfd of a worker, mapped; `data` is its flat uint8 buffer after the header."""

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.fd = os.memfd_create("raydl-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, HEADER + nbytes)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # no page fault per 4 KiB later
            self.mm = mmap.mmap(self.fd, HEADER + nbytes, flags=flags)
        except BaseException:
            os.close(self.fd)
            raise
        self.token = secrets.token_bytes(16)
        self.mm[8:24] = self.token
        self.state = _header(self.mm)
        self.data = np.frombuffer(self.mm, np.uint8, count=nbytes, offset=HEADER)

    def describe(self, arr: np.ndarray, batch: int) -> SharedArray | None:
        """Where `arr` lies in this slot, or None when it is not all inside it (a copy, another buffer)."""
        if arr.dtype.hasobject or arr.size == 0:
            return None
        base = self.data.ctypes.data
        low, high = _byte_bounds(arr)
        if not (base <= low and high <= base + self.size):
            return None
        start = arr.ctypes.data - base
        return SharedArray(
            os.getpid(), self.fd, self.token, batch, start, arr.shape, arr.strides, arr.dtype.str, self.size
        )

    def close(self) -> None:
        self.state[0] = CLOSED  # a reader's idle mapping of it lets it go (_close_idle)
        del self.state, self.data
        self.mm.close()
        os.close(self.fd)


class Slots:
    """A worker's slots: leased for a batch, free again once its reader has dropped it."""

    def __init__(self, max_slots: int = MAX_SLOTS) -> None:
        self._lock = threading.Lock()
        self._slots: list[Slot] = []
        self._max = max_slots
        self._batches = 0
        self._probe: Slot | None = None

    def lease(self, nbytes: int) -> tuple[Slot, int] | None:
        """(a free slot of at least `nbytes`, marked with a new batch number), or None when every slot is
        held and there are `max_slots` of them."""
        with self._lock:
            free = [s for s in self._slots if int(s.state[0]) == 0]
            fits = [s for s in free if s.size >= nbytes]
            if fits:
                slot = min(fits, key=lambda s: s.size)
            else:
                if free:  # aspect buckets: a bigger batch replaces a free slot too small, so that there are
                    small = min(free, key=lambda s: s.size)  # only as many slots as batches held at once
                    self._slots.remove(small)
                    small.close()
                elif len(self._slots) >= self._max:
                    return None
                slot = Slot(nbytes)
                self._slots.append(slot)
            self._batches += 1
            slot.state[0] = self._batches
            return slot, self._batches

    def free(self, slot: Slot, batch: int) -> None:
        """The batch in `slot` will not be read (it failed, or no array of it is in the slot)."""
        with self._lock:
            if int(slot.state[0]) == batch:
                slot.state[0] = 0

    def free_described(self, shared: list[SharedArray]) -> None:
        """Results that no reader will map (dropped unread): their slots are free again."""
        for desc in shared:
            for slot in list(self._slots):
                if slot.fd == desc.fd and slot.token == desc.token:
                    self.free(slot, desc.batch)

    def nbytes(self) -> tuple[int, int]:
        """(bytes of every slot, slots)."""
        with self._lock:
            return sum(s.size for s in self._slots), len(self._slots)

    def probe(self) -> SharedArray:
        """A descriptor a reader tests `probe` on: of a one-page memfd of its own, never leased."""
        with self._lock:
            if self._probe is None:
                self._probe = Slot(1)
            slot = self._probe
        return SharedArray(os.getpid(), slot.fd, slot.token, 0, 0, (0,), (1,), "|u1", slot.size)


# -- the reader's side ---------------------------------------------------------------------
_maps_lock = threading.Lock()
_maps: OrderedDict[tuple[int, int, bytes], mmap.mmap] = OrderedDict()  # mappings this process keeps
_leases: dict[tuple[int, int, bytes], int] = {}  # mapping -> its slot's leases alive (views of it)


def _map(desc: SharedArray) -> mmap.mmap:
    """This process's mapping of the descriptor's memfd (opened once, checked against its token)."""
    key = (desc.pid, desc.fd, desc.token)
    with _maps_lock:
        mm = _maps.get(key)
        if mm is not None:
            _maps.move_to_end(key)
            return mm
    fd = os.open(f"/proc/{desc.pid}/fd/{desc.fd}", os.O_RDWR)
    try:
        mm = mmap.mmap(fd, HEADER + desc.size, flags=mmap.MAP_SHARED)
    except ValueError as exc:  # shorter than described: not the memfd the worker meant
        raise OSError(f"shared batch memory of process {desc.pid} (fd {desc.fd}): {exc}") from exc
    finally:
        os.close(fd)
    if mm[8:24] != desc.token:
        mm.close()
        raise OSError(f"shared batch memory of process {desc.pid} (fd {desc.fd}) is not the one described")
    with _maps_lock:
        _maps[key] = mm
        _close_idle()
    return mm


def _close_idle(everything: bool = False) -> None:
    """Close the mappings no lease holds whose worker is gone, and the oldest beyond _IDLE_MAPS (all of
    them with `everything`); under _maps_lock. A mapping kept open saves the next batch of that slot its
    page faults (8 ms per 147 MiB batch read); one of a dead worker would keep its memory alive."""
    idle = [k for k in _maps if not _leases.get(k)]
    keep = [] if everything else [k for k in idle if _alive(k[0]) and int(_header(_maps[k])[0]) != CLOSED]
    for key in [k for k in idle if k not in keep] + keep[: max(0, len(keep) - _IDLE_MAPS)]:
        try:
            _maps[key].close()
        except BufferError:  # its last lease is being finalized right now: closed at a later pass
            continue
        del _maps[key]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        pass
    return True


def close_idle() -> None:
    """Close every mapping of this process that no array views (the Loader calls it once shut down)."""
    with _maps_lock:
        _close_idle(everything=True)


def _release(key: tuple[int, int, bytes], mm: mmap.mmap, batch: int) -> None:
    state = _header(mm)
    if int(state[0]) == batch:  # the slot is the worker's again
        state[0] = 0
    del state
    with _maps_lock:
        _leases[key] -= 1
        if not _leases[key]:
            del _leases[key]
            if not _alive(key[0]):
                _close_idle()


def attach(descs: list[SharedArray]) -> list[np.ndarray]:
    """Read-only arrays viewing one slot's batch (every desc of the same slot and batch); the slot is
    free again once the last of them, and every view of them, is gone. OSError when it cannot be mapped."""
    desc = descs[0]
    key = (desc.pid, desc.fd, desc.token)
    mm = _map(desc)
    if int(_header(mm)[0]) != desc.batch:
        raise OSError(f"shared batch {desc.batch} of process {desc.pid} is no longer in its slot")
    lease = (ctypes.c_ubyte * desc.size).from_buffer(mm, HEADER)
    with _maps_lock:
        _leases[key] = _leases.get(key, 0) + 1
    weakref.finalize(lease, _release, key, mm, desc.batch)
    flat = np.frombuffer(lease, np.uint8)
    del lease
    out = []
    for d in descs:
        arr = np.ndarray(d.shape, np.dtype(d.dtype), buffer=flat, offset=d.offset, strides=d.strides)
        arr.flags.writeable = False
        out.append(arr)
    return out


def attach_batch(batch: dict) -> dict:
    """`batch` with each SharedArray value replaced by its array, mapped (in place; returned)."""
    shared = {k: v for k, v in batch.items() if isinstance(v, SharedArray)}
    by_slot: dict[tuple, list[str]] = {}
    for name, d in shared.items():
        by_slot.setdefault((d.pid, d.fd, d.token, d.batch), []).append(name)
    for names in by_slot.values():
        for name, arr in zip(names, attach([shared[n] for n in names])):
            batch[name] = arr
    return batch


def described(batch: dict) -> list[SharedArray]:
    """The SharedArray values of a batch."""
    return [v for v in batch.values() if isinstance(v, SharedArray)]


def probe(desc: SharedArray) -> bool:
    """Whether this process can map the memory of the worker that sent `desc` (Slots.probe)."""
    try:
        _map(desc)
    except OSError:
        return False
    return True
