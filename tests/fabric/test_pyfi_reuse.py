"""pyfi reuse: one server endpoint for many regions (one AV entry and connection per client), and
the client's registration cache (a buffer registered once, dropped when the buffer goes)."""
from __future__ import annotations

import contextlib
import gc
import mmap
import re
import threading

import numpy as np
import pytest

from raydl.errors import FabricError
from raydl.native import pyfi

if not pyfi.available():
    pytest.skip(f"libfabric unavailable: {pyfi.unavailable_reason()}", allow_module_level=True)

pytestmark = pytest.mark.timeout(60)


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@contextlib.contextmanager
def _served(src: np.ndarray, provider: str):
    """src served on its own endpoint, and a Client's connection to it: (connection, the client's registration cache)."""
    with pyfi.serve(src, provider=provider) as server:
        client = pyfi.Client(server.address.provider, host="127.0.0.1", fabric_name=server.address.fabric)
        try:
            yield client.connect(server.address), client.registrations
        finally:
            client.close()


def test_one_endpoint_serves_many_regions_over_one_connection(provider):
    """Two regions on one ServerEndpoint share its address; a client reads both through one AV entry,
    and closing one region revokes it alone."""
    a, b = _bytes(1 << 18, 1), _bytes(3 << 16, 2)
    with pyfi.ServerEndpoint(provider, bind="127.0.0.1:0") as endpoint:
        sa, sb = endpoint.serve(a), endpoint.serve(b)
        assert sa.address.raw == sb.address.raw and sa.address.key != sb.address.key
        client = pyfi.Client(sa.address.provider, host="127.0.0.1", fabric_name=sa.address.fabric)
        try:
            ca, cb = client.connect(sa.address), client.connect(sb.address)
            got_a, got_b = np.zeros_like(a), np.zeros_like(b)
            ca.read_into(got_a, chunk_size=1 << 16)
            cb.read_into(got_b, chunk_size=1 << 16)
            assert np.array_equal(got_a, a) and np.array_equal(got_b, b)
            assert len(client._peers) == 1   # one fi_addr (and rxm connection) for both regions
            sb.close()
            with pytest.raises(FabricError):
                cb.read_into(got_b, timeout=5)
            # the failure closed the client endpoint (that cancels reads in flight); the endpoint
            # still serves region a to a new client
        finally:
            client.close()
        with pyfi.connect(sa.address) as conn:
            got_a[:] = 0
            conn.read_into(got_a)
            assert np.array_equal(got_a, a)
    assert sa.closed and endpoint.closed


def test_registration_cache_registers_a_buffer_once_and_drops_it_with_the_buffer(provider):
    """Reads into slices of one mmap (as a chain peer's windows, or fetches into a pooled buffer) reuse
    one registration of the whole mmap; it is closed when the mmap goes; a bytearray is not cached."""
    src = _bytes(1 << 20, 3)
    with _served(src, provider) as (conn, cache):
        mm = mmap.mmap(-1, 1 << 20)
        dst = np.frombuffer(mm, np.uint8)
        for lo in range(0, 1 << 20, 1 << 18):
            conn.read_into(dst[lo:lo + (1 << 18)], offset=lo, chunk_size=1 << 16)
        again = np.frombuffer(mm, np.uint8)      # another view of the same memory, later
        conn.read_into(again[:4096], offset=0)
        assert np.array_equal(dst, src)
        assert (cache.misses, cache.hits, len(cache)) == (1, 4, 1)
        del dst, again
        mm.close()
        del mm
        gc.collect()
        assert len(cache) == 0                   # the registration went with the memory
        plain = bytearray(4096)                  # no weakref: registered per read, as before
        conn.read_into(plain, offset=0)
        assert bytes(plain) == src[:4096].tobytes() and len(cache) == 0


def test_regions_come_and_go_beside_the_serving_thread_on_a_domain_that_is_not_thread_safe(provider, monkeypatch):
    """On a domain that is not FI_THREAD_SAFE (efa, verbs may be), registering and revoking regions takes
    turns with the serving thread's waits, and reads of every region still succeed."""
    from raydl.native.pyfi import _objects

    real = _objects.Domain.__init__

    def not_thread_safe(self, *a, **kw):
        real(self, *a, **kw)
        self.thread_safe = False
    monkeypatch.setattr(_objects.Domain, "__init__", not_thread_safe)
    with pyfi.ServerEndpoint(provider, bind="127.0.0.1:0") as endpoint:
        assert endpoint._domain_turn is not None
        monkeypatch.undo()
        from raydl.native.pyfi import _server

        turns = []   # the threads that took the turn: the serving thread's slices, and this one's (de)registrations
        enter = _server._Turn.__enter__

        def counted(self):
            turns.append(threading.current_thread() is threading.main_thread())
            return enter(self)
        monkeypatch.setattr(_server._Turn, "__enter__", counted)
        regions = [_bytes(1 << 16, seed) for seed in range(4)]
        servers = [endpoint.serve(r) for r in regions]      # each waits for a gap between serving slices
        with pyfi.connect(servers[0].address) as conn0:
            for server, want in zip(servers, regions, strict=True):
                with pyfi.connect(server.address) as conn:
                    got = np.zeros_like(want)
                    conn.read_into(got)
                    assert np.array_equal(got, want)
            servers[1].close()
            got = np.zeros_like(regions[0])
            conn0.read_into(got)
            assert np.array_equal(got, regions[0])
        assert sum(turns) >= 5 and not all(turns)   # 4 registrations + 1 revocation took turns with the thread


def test_registration_cache_evicts_the_least_recently_used_buffer(provider):
    """A full cache evicts the buffer used longest ago, not the one registered first: a buffer read
    into again and again keeps its registration."""
    src = _bytes(1 << 16, 4)
    with _served(src, provider) as (conn, cache):
        cache._max = 2
        a, b, c = (np.zeros(1 << 16, np.uint8) for _ in range(3))
        conn.read_into(a)
        conn.read_into(b)
        conn.read_into(a)                        # a used again: b is now the oldest use
        conn.read_into(c)                        # over the limit: b goes
        assert (cache.misses, cache.hits, len(cache)) == (3, 1, 2)
        conn.read_into(a)
        assert cache.hits == 2                   # a kept its registration
        conn.read_into(b)
        assert cache.misses == 4                 # b registered again
        assert all(np.array_equal(x, src) for x in (a, b, c))


def test_an_endpoint_whose_serving_thread_stopped_is_closed_and_refuses_regions(provider):
    """A ServerEndpoint whose serving thread has stopped (its completion queue failed) reports closed,
    so callers open a new one; serve() on it is a FabricError naming it, and close() still frees it."""
    endpoint = pyfi.ServerEndpoint(provider, bind="127.0.0.1:0")
    try:
        assert not endpoint.closed
        endpoint._stop.set()                     # the loop returns, as it does when its queue fails
        endpoint._thread.join(timeout=10)
        assert endpoint.closed
        with pytest.raises(FabricError, match=re.escape(f"server endpoint {endpoint.peer} is closed")):
            endpoint.serve(_bytes(4096, 5))
    finally:
        endpoint.close()
