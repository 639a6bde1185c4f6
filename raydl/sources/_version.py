"""Which version of a shard a process's caches hold (index blocks, inflated shards).

An object in a store has an etag, which changes when it is rewritten. A local
file has none, and one rewritten in place at the same size keeps its size:
only its mtime tells the two apart (as in the node cache's key,
raydl/sources/_wds_index.py), so a cache of local shards is keyed by it too.
"""

from __future__ import annotations

import os

from raydl.storage import ObjectInfo

__all__ = ["mtime_ns"]


def mtime_ns(info: ObjectInfo) -> int:
    """A local file's mtime in nanoseconds; 0 for an object with an etag, or a file that is not there (its
    read will say so)."""
    if info.etag:
        return 0
    try:
        return os.stat(info.uri).st_mtime_ns
    except OSError:
        return 0
