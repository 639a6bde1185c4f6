"""A thread pool a process makes the first time it is asked for and keeps for its life (one per purpose:
the Parquet footers and decodes, token ranges, the node cache's writers)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["SharedPool", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's count, at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class SharedPool:
    """Call it for the pool: made on first use, under a lock, with `threads` threads named `name`-N."""

    def __init__(self, threads: int, name: str) -> None:
        self._threads, self._name = threads, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
                pool = self._pool
        return pool
