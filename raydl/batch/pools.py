"""The threads one batch maker runs on: decode threads and an IO pool, shared by its members' runs."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from raydl.storage.fetch import IOPool

__all__ = ["Pools"]


class Pools:
    """`threads` decode threads, an IO pool of `io_concurrency` and, through a node cache, a small pool for
    its hits; each thread's native id is noted as it starts (to lower the priority of a process's loader
    threads)."""

    def __init__(self, threads: int, io_concurrency: int) -> None:
        self.threads = threads
        self._ids: list[int] = []
        self._lock = threading.Lock()
        self._decode = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="raydl-decode", initializer=self._started
        )
        self.io = IOPool(io_concurrency, initializer=self._started)
        self._hits: IOPool | None = None

    def hits_io(self, concurrency: int) -> IOPool:
        """The IO pool for reads of the node cache's hits (local files): `concurrency` threads, made on first
        use and shared by every batch this maker runs at once, as local disk's IO pool is."""
        with self._lock:
            if self._hits is None:
                self._hits = IOPool(concurrency, initializer=self._started)
            return self._hits

    def _started(self) -> None:
        with self._lock:
            self._ids.append(threading.get_native_id())

    def decode(self, fn, *args) -> Future:
        """Run fn(*args) on a decode thread."""
        return self._decode.submit(fn, *args)

    def thread_ids(self) -> list[int]:
        """Native ids of the decode and IO threads started so far."""
        with self._lock:
            return list(self._ids)
