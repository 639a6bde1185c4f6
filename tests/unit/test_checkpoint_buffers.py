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


def _resident(mm) -> int:
    """Bytes of mm resident now, page by page (mincore(2) over exactly its range: the smaps entry that
    holds it can be larger, since the kernel merges neighbouring anonymous mappings into one)."""
    import ctypes
    import mmap as mmap_mod

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap_mod.PAGESIZE
    addr = np.frombuffer(mm, np.uint8).ctypes.data
    vec = np.zeros((len(mm) + page - 1) // page, np.uint8)
    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)), vec.ctypes.data_as(ctypes.c_void_p)):
        raise OSError(ctypes.get_errno(), "mincore")
    return int(np.count_nonzero(vec & 1)) * page


def test_toucher_faults_ahead_of_the_reads_and_leaves_landed_bytes_alone():
    """A Toucher faults in every page the reads have not passed, without changing a byte, and skips
    what they passed (they faulted that themselves)."""
    from raydl.checkpoint.buffers import Toucher, fresh

    mm = fresh(12 << 20)
    view = np.frombuffer(mm, np.uint8)
    view[: 1 << 20] = 7  # landed already
    toucher = Toucher(mm, threads=2, slice_bytes=1 << 20)
    toucher.landed(4 << 20)  # the reads are at 4 MiB: it starts there
    toucher.start()
    toucher.join(10)
    assert not toucher.alive and toucher.finished
    resident = _resident(mm)  # before reading: a read maps the pages it passes
    assert 8 << 20 <= resident < 11 << 20  # 1 MiB written + 8 MiB faulted; 3 MiB skipped
    assert (view[: 1 << 20] == 7).all() and not view[1 << 20 :].any()


def test_a_stopped_toucher_hands_out_no_more_slices():
    """stop() ends it after the slice under way; a stopped toucher is not a faulted-in buffer."""
    from raydl.checkpoint.buffers import Toucher, fresh

    mm = fresh(256 << 20)
    toucher = Toucher(mm, threads=1, slice_bytes=1 << 20).start()
    toucher.stop(10)
    assert not toucher.alive and not toucher.finished
    assert _resident(mm) < 64 << 20


def test_a_background_prefault_is_taken_over_and_a_live_buffer_never_reused(monkeypatch):
    """prefault_ahead() returns at once; a fetch claims its buffer with the toucher still going; while
    the claimed array (or a tensor on it) lives, nothing hands that memory out again."""
    import threading

    from raydl.checkpoint import buffers

    torch = pytest.importorskip("torch")
    go = threading.Event()
    real = buffers.populate

    def slow_populate(*a, **kw):  # the toucher is still at work when the fetch comes
        go.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(buffers, "populate", slow_populate)
    pool = BufferPool(max_free=1)
    assert pool.prefault_ahead(8 << 20, ttl_s=30)
    assert not pool.prefault_ahead(8 << 20, ttl_s=30)  # one under way fits: not a second
    view, toucher = pool.claim_started(8 << 20)
    assert pool.claim_started(8 << 20) is None and toucher.alive
    toucher.landed(2 << 20)
    go.set()
    view[:] = 5
    toucher.stop(10)
    assert not toucher.alive
    tensor = torch.frombuffer(view, dtype=torch.uint8)  # fetch builds tensors on the bytes
    addr = view.ctypes.data
    del view
    gc.collect()
    other, fresh_mm = pool.take(4 << 20)
    assert fresh_mm is not None and other.ctypes.data != addr  # the tensor still holds it
    assert int(tensor.sum()) == 5 * (8 << 20)
    del tensor, other
    gc.collect()
    again, fresh_again = pool.take(8 << 20)
    assert fresh_again is None and again.ctypes.data == addr and (again == 5).all()


def test_an_unclaimed_background_prefault_is_dropped_after_its_ttl():
    """A process that never fetches does not keep the buffer: it is free once faulted, gone after ttl_s."""
    import threading
    import time

    pool = BufferPool()
    free, looked = threading.Event(), threading.Event()
    settles: list[threading.Thread] = []
    waits: list[tuple[float, bool]] = []

    class TtlWait(threading.Event):
        """The pool's ttl wait, which begins once the buffer is free: it says so, and starts the ttl only once
        the test has looked (a loaded machine could otherwise let the whole ttl pass between two looks)."""

        def wait(self, timeout=None):
            settles.append(threading.current_thread())
            free.set()
            looked.wait(30)
            t0 = time.monotonic()
            ended = super().wait(timeout)
            waits.append((time.monotonic() - t0, ended))
            return ended

    pool._expire = TtlWait()
    assert pool.prefault_ahead(4 << 20, ttl_s=0.5)
    assert free.wait(30)
    assert pool.free_bytes() >= 4 << 20
    looked.set()
    (settle,) = settles
    settle.join(30)  # the pool's thread: the ttl, then the drop
    assert not settle.is_alive()
    ((waited, ended),) = waits
    assert not ended and waited >= 0.49  # it waited out the ttl (0.5 s, less a clock tick); nothing cut it short
    assert pool.free_bytes() == 0


def test_no_background_prefault_once_a_fetch_took_memory_or_it_was_declined():
    """A fetch that started first faults its own buffer: the import's prefault must not fault a second."""
    pool = BufferPool()
    buf, _ = pool.take(1 << 20)
    assert not pool.prefault_ahead(4 << 20, ttl_s=30)
    declined = BufferPool()
    declined.decline_ahead()
    assert not declined.prefault_ahead(4 << 20, ttl_s=30)


def test_the_size_hint_is_bounded_like_any_input():
    """The hint comes from the cluster's KV store: only a positive decimal within a quarter of
    MemAvailable is a size."""
    from raydl.checkpoint.api import sane_size_hint

    gib = 1 << 30
    assert sane_size_hint(b"536870912", 8 * gib) == 512 << 20
    assert sane_size_hint(str(3 * gib).encode(), 8 * gib) is None  # more than a quarter
    for bad in (None, b"", b"-5", b"0", b"12abc", b"\xff", b"9" * 30):
        assert sane_size_hint(bad, 8 * gib) is None
    assert sane_size_hint(b"4096", None) is None


def test_touchers_are_stopped_before_the_interpreter_exits(tmp_path):
    """The exit's atexit handlers stop every toucher (no thread faults memory the interpreter is
    tearing down): checked from a handler that runs after raydl's."""
    import subprocess
    import sys

    code = """
import atexit, threading
def check():
    alive = [t.name for t in threading.enumerate() if t.name.startswith("raydl-toucher") and t.is_alive()]
    print("alive:", alive, flush=True)
atexit.register(check)  # registered first: runs after raydl's own handlers
from raydl.checkpoint.buffers import Toucher, fresh
Toucher(fresh(1 << 30), threads=2, slice_bytes=1 << 20).start()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert "alive: []" in out.stdout
