"""Large buffers that do not pay a page fault per 4 KiB on first touch.

Writing into fresh memory faults in one page at a time; on the machines we
measured, that cost 0.9 s per 512 MiB, more than decoding into it. An
anonymous mapping with MAP_POPULATE asks the kernel for all of it at once
(0.27 s for the same 512 MiB). The result is page-aligned.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

__all__ = ["arrow_pool_for_decoding", "populated_empty"]

_MIN_BYTES = 1 << 20  # below this, malloc's arenas are warm anyway


def populated_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Like np.empty, with the memory mapped in up front (Linux MAP_POPULATE; plain np.empty elsewhere)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    flags = getattr(mmap, "MAP_POPULATE", None)
    if nbytes < _MIN_BYTES or flags is None:
        return np.empty(shape, dtype)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return np.frombuffer(mm, dtype).reshape(shape)


def arrow_pool_for_decoding() -> str:
    """Make pyarrow allocate from jemalloc (the system allocator where pyarrow has no jemalloc) in this
    process, unless ARROW_DEFAULT_MEMORY_POOL names a pool; the pool's name. A loader worker calls it: it
    decodes Parquet row groups of tens of MiB one after another, and on the machines we measured, decoding a
    33 MiB row group of tokens into mimalloc (pyarrow's default) took 3-4x as long as into either of those
    (0.7-1.3 s against 0.2-0.3 s)."""
    import pyarrow as pa

    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return pa.default_memory_pool().backend_name
    for make in (pa.jemalloc_memory_pool, pa.system_memory_pool):
        try:
            pool = make()
        except NotImplementedError:  # pyarrow built without it
            continue
        pa.set_memory_pool(pool)
        return pool.backend_name
    return pa.default_memory_pool().backend_name
