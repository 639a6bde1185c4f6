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


def test_take_waits_for_a_prefault_under_way_instead_of_faulting_a_second_buffer():
    """A fetch that starts while prepare()'s prefault runs gets that buffer, not fresh memory."""
    import threading

    pool = BufferPool(max_free=1)
    worker = threading.Thread(target=pool.prefault, args=(4 << 20,))
    worker.start()
    while worker.is_alive() and not pool._pending and not pool.free_bytes():
        pass  # the prefault has registered itself (or already finished)
    buf, fresh = pool.take(4 << 20)
    worker.join()
    assert fresh is None and buf.nbytes == 4 << 20


def test_populate_in_slices_faults_every_byte_without_changing_them():
    """Faulting in slices leaves bytes already written alone (reads may be landing meanwhile)."""
    from raydl.checkpoint.buffers import fresh, populate_in_slices

    mm = fresh(5 << 20)
    view = np.frombuffer(mm, np.uint8)
    view[:1 << 20] = 9
    populate_in_slices(mm, slice_bytes=2 << 20)
    assert (view[:1 << 20] == 9).all() and not view[1 << 20:].any()
