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

__all__ = ["arrow_pool_for_decoding", "decode_pool", "populated_empty"]

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


def decode_pool():
    """The pyarrow pool raydl decodes Parquet row groups into: jemalloc (the system allocator where pyarrow
    has no jemalloc), unless ARROW_DEFAULT_MEMORY_POOL names a pool, then the default. On the machines we
    measured, decoding a 33 MiB row group of tokens into mimalloc (pyarrow's default) took 3-4x as long as
    into either of those (0.7-1.3 s against 0.2-0.3 s): mimalloc hands a freed row group's pages back at
    once, and the next one faults them in again. Passed to each decode, so that a process that is not
    raydl's own (the driver, making the first batches) keeps its default pool."""
    import pyarrow as pa

    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return pa.default_memory_pool()
    for make in (pa.jemalloc_memory_pool, pa.system_memory_pool):
        try:
            return make()
        except NotImplementedError:  # pyarrow built without it
            continue
    return pa.default_memory_pool()


def arrow_pool_for_decoding() -> str:
    """Make `decode_pool()` this process's default pyarrow pool; the pool's name. A loader worker calls it:
    its process is raydl's, and the arrays made from decoded row groups come from the default pool."""
    import pyarrow as pa

    pool = decode_pool()
    pa.set_memory_pool(pool)
    return pool.backend_name
