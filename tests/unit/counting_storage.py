"""A LocalStorage that records every range it reads, and every streamed read as one whole range (thread-safe), optionally slowed, for tests that count
how often the loader reads a shard, a row group or a sample."""

from __future__ import annotations

import threading
import time

from raydl.storage import LocalStorage


class CountingStorage(LocalStorage):
    """Local disk that records (uri, offset, length) of each read in `reads`, after sleeping `delay_s`."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        object.__setattr__(self, "reads", [])
        object.__setattr__(self, "delay_s", delay_s)
        object.__setattr__(self, "lock", threading.Lock())

    def read_range(self, uri, offset, length, *, etag=None):
        with self.lock:
            self.reads.append((uri, offset, length))
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().read_range(uri, offset, length, etag=etag)

    def stream(self, uri, *, etag=None, chunk=8 << 20):
        """A whole-object streamed read, recorded as one read of (uri, 0, its size)."""
        import os

        with self.lock:
            self.reads.append((uri, 0, os.path.getsize(uri)))
        if self.delay_s:
            time.sleep(self.delay_s)
        yield from super().stream(uri, etag=etag, chunk=chunk)
