"""A client endpoint's registration cache: register a buffer once, reuse it for every read into it.

Every read registers its destination (FI_MR_LOCAL providers need the
descriptor; pyfi registers on all of them). A registration costs ~0.3 ms on
tcp;ofi_rxm here, and on efa/verbs it pins the pages (it grows with the size),
so a chain peer that reads its copy in many small pieces, or a process that
fetches into the same pooled buffer again and again, would pay it over and over.

The cache keys a registration by the Python object that owns the memory (an
mmap, a numpy array owning its data, found under views and memoryviews) and
registers the whole of it, so any later read into any part of it reuses the
same region. It holds no reference to that object: a weakref finalizer closes
the registration when the object goes, and a new object never matches an old
entry (an entry is found by identity and checked alive), so reused virtual
addresses cannot hit a stale registration. Objects that cannot be watched
(bytes-likes without weakrefs, torch tensors, whose storage views share) are
registered per read.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import numpy as np

from raydl.errors import FabricError
from raydl.native.pyfi._buffers import Span
from raydl.native.pyfi._lib import loaded
from raydl.native.pyfi._objects import Domain, MemoryRegion

__all__ = ["RegistrationCache", "memory_owner"]


def memory_owner(obj: Any) -> Any | None:
    """The object that owns obj's memory, when it can be watched with a weakref: the mmap or
    data-owning numpy array under numpy views and memoryviews; None otherwise."""
    seen = 0
    while seen < 32:
        seen += 1
        if isinstance(obj, np.ndarray):
            if obj.base is None:
                return obj if obj.flags.owndata else None
            obj = obj.base
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            break
    try:
        weakref.ref(obj)
    except TypeError:
        return None
    return obj


def _extent(owner: Any) -> tuple[int, int] | None:
    """(address, nbytes) of all of owner's memory."""
    try:
        whole = owner if isinstance(owner, np.ndarray) else np.frombuffer(owner, np.uint8)
    except (TypeError, ValueError):
        return None
    if not whole.flags.c_contiguous or whole.nbytes == 0:
        return None
    return int(whole.ctypes.data), int(whole.nbytes)


class _Entry:
    __slots__ = ("owner", "mr", "address", "nbytes", "finalizer")


class RegistrationCache:
    """Registrations of whole buffers on one domain, by owner; close() drops them all."""

    def __init__(self, domain: Domain, max_entries: int = 64, domain_lock: Any = None) -> None:
        self._domain = domain
        # a finalizer runs on whichever thread drops the buffer: on a domain that is not
        # FI_THREAD_SAFE it closes the region under the lock the client's transfers hold
        self._domain_lock = None if domain.thread_safe else domain_lock
        self._max = max_entries
        self._entries: dict[tuple[int, int], _Entry] = {}  # (id(owner), access) -> entry, oldest use first
        self._lock = threading.RLock()
        # A forked child inherits the finalizers, not the right to close the parent's regions
        self._pid = os.getpid()
        self.hits = self.misses = 0

    def region(self, span: Span, obj: Any, access: int) -> tuple[MemoryRegion, int, bool]:
        """(region, offset of span in it, owned): a cached registration covering span when obj's
        owner can be watched (owned False: the cache keeps it), else a new one for span alone
        (owned True: the caller closes it)."""
        owner = memory_owner(obj)
        if owner is not None:
            key = (id(owner), access)
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.owner() is owner and not entry.mr.closed:
                    offset = span.address - entry.address
                    if 0 <= offset and offset + span.nbytes <= entry.nbytes:
                        self.hits += 1
                        self._entries[key] = self._entries.pop(key)  # most recently used: evicted last
                        return entry.mr, offset, False
            try:
                made = self._register(owner, key, access)
            except (
                FabricError
            ):  # the whole buffer could not be registered (size, pinning limits): the span alone
                made = None
            if made is not None:
                offset = span.address - made.address
                if 0 <= offset and offset + span.nbytes <= made.nbytes:
                    return made.mr, offset, False
        return self._domain.register(span, access=access), 0, True

    def _register(self, owner: Any, key: tuple[int, int], access: int) -> _Entry | None:
        extent = _extent(owner)
        if extent is None:
            return None
        ffi, _ = loaded()
        address, nbytes = extent
        # A span with no owner: the cache must not keep the memory alive (the finalizer watches it).
        mr = self._domain.register(Span(ffi.cast("char *", address), nbytes, None), access=access)
        entry = _Entry()
        entry.owner, entry.mr, entry.address, entry.nbytes = weakref.ref(owner), mr, address, nbytes
        entry.finalizer = weakref.finalize(owner, self._drop, key, mr)
        entry.finalizer.atexit = False  # exit leaves libfabric's own teardown to free it
        with self._lock:
            self.misses += 1
            old = self._entries.pop(key, None)
            self._entries[key] = entry
            extra = []
            while len(self._entries) > self._max:
                extra.append(self._entries.pop(next(iter(self._entries))))
        for e in [old, *extra]:
            if e is not None:
                e.finalizer.detach()
                e.mr.close()
        return entry

    def _drop(self, key: tuple[int, int], mr: MemoryRegion) -> None:
        # the owner is gone: nothing can read into that memory any more. Close only what this call
        # took out of the cache (an eviction or close() that took it first closes it itself).
        if os.getpid() != self._pid:
            return
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.mr is not mr:
                return
            del self._entries[key]
        if self._domain_lock is None:
            mr.close()
        else:
            with self._domain_lock:
                mr.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        """Close every cached registration (the domain's close would too; this forgets them)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        if os.getpid() != self._pid:
            return  # a forked child: the regions are the parent's
        for e in entries:
            e.finalizer.detach()
            e.mr.close()
