"""Receive buffers: a buffer whose tensors are gone is reused, already faulted in; the pool keeps one."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from raydl.checkpoint.buffers import BufferPool, populate

pytestmark = pytest.mark.timeout(30)


def test_a_freed_buffer_is_reused_and_a_live_one_never():
    """take() after the last view died returns the same memory; while a view lives it is not handed out."""
    pool = BufferPool(max_free=1)
    a, fresh = pool.take(3 << 20)
    assert fresh is not None and a.nbytes == 3 << 20 and a.ctypes.data % 4096 == 0
    populate(fresh)
    addr = a.ctypes.data
    b, _ = pool.take(1 << 20)  # a is alive: b is other memory
    assert b.ctypes.data != addr
    del a
    gc.collect()
    c, fresh_c = pool.take(2 << 20)  # fits in a's freed 3 MiB
    assert fresh_c is None and c.ctypes.data == addr
    c[:] = 1
    del b, c
    gc.collect()
    assert pool.free_bytes() == 3 << 20  # one kept: the largest


def test_prefault_makes_a_free_buffer_of_at_least_that_size():
    """prefault(n) leaves a free, faulted-in buffer that the next take(n) uses."""
    pool = BufferPool()
    pool.prefault(4 << 20)
    assert 4 << 20 < pool.free_bytes() <= 7 << 20  # room for the safetensors header
    buf, fresh = pool.take(4 << 20)
    assert fresh is None and np.all(buf[::4096] == 0)
