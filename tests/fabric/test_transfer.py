"""The transfer engine over loopback: serve, connect, read_into, write, bounds, revocation, failures."""
from __future__ import annotations

import errno
import os
import pickle
import time

import numpy as np
import pytest

from raydl.errors import CheckpointError, FabricError
from raydl.native import pyfi

if not pyfi.available():
    pytest.skip(f"libfabric unavailable: {pyfi.unavailable_reason()}", allow_module_level=True)

pytestmark = pytest.mark.timeout(60)

SIZE = 3 * (1 << 20) + 12345  # not a multiple of any chunk size used below


@pytest.fixture(scope="module")
def payload() -> bytes:
    return np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def test_read_into_bytearray(provider, payload):
    """A bytearray pulled with read_into holds exactly the served bytes."""
    with pyfi.serve(bytearray(payload), provider=provider) as server, pyfi.connect(server.address) as conn:
        dst = bytearray(SIZE)
        assert conn.read_into(dst, chunk_size=1 << 20, max_inflight=3) == SIZE
        assert dst == payload


def test_read_into_numpy_array(provider, payload):
    """A numpy array (any dtype) is filled in place from a served numpy array."""
    src = np.frombuffer(payload[: SIZE // 4 * 4], dtype=np.float32).copy()
    with pyfi.serve(src, provider=provider) as server, pyfi.connect(server.address) as conn:
        dst = np.zeros_like(src)
        conn.read_into(dst, chunk_size=256 << 10)
    assert np.array_equal(dst.view(np.uint32), src.view(np.uint32))


def test_read_into_torch_tensor(provider, payload):
    """A CPU torch tensor is filled in place (through its data_ptr), and can be served too."""
    torch = pytest.importorskip("torch")
    src = torch.frombuffer(bytearray(payload[: SIZE // 2 * 2]), dtype=torch.int16)
    with pyfi.serve(src, provider=provider) as server, pyfi.connect(server.address) as conn:
        dst = torch.zeros_like(src)
        conn.read_into(dst, chunk_size=1 << 20)
    assert torch.equal(dst, src)


def test_serve_connect_read_cycles_leak_no_fds_or_threads(provider):
    """20 serve/connect/read/close cycles leave the fd count and the thread count no higher than they were (a
    leak of one per cycle is 20; another part of this process may close fds of its own meanwhile)."""
    import threading

    def cycle() -> None:
        with pyfi.serve(bytearray(1 << 16), provider=provider) as server, pyfi.connect(server.address) as conn:
            conn.read_into(bytearray(1 << 16))

    cycle()  # first use loads the provider
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(20):
        cycle()
    after = (len(os.listdir("/proc/self/fd")), threading.active_count())
    assert after[0] <= fds and after[1] <= threads, (after, (fds, threads))


def test_non_contiguous_destination_is_refused(provider):
    """A strided numpy view cannot be a destination (ValueError before anything is sent)."""
    with pyfi.serve(bytearray(4096), provider=provider) as server, pyfi.connect(server.address) as conn:
        with pytest.raises(ValueError, match="contiguous"):
            conn.read_into(np.zeros(4096, dtype=np.uint8)[::2], size=16)


@pytest.mark.parametrize("offset,size,chunk,inflight", [
    (0, SIZE, 1 << 20, 8),            # last chunk short
    (1, SIZE - 1, 1 << 20, 2),        # odd offset
    (12345, 1_000_001, 65_536, 4),    # many chunks, odd size
    (SIZE - 7, 7, 4 << 20, 8),        # tail smaller than a chunk
    (777, 333_333, 100_000, 1),       # one at a time
    (5, 0, 4096, 8),                  # nothing
])
def test_reads_at_offsets_and_sizes(provider, payload, offset, size, chunk, inflight):
    """read_into(offset, size) returns payload[offset:offset+size] for sizes that are not multiples of the chunk."""
    with pyfi.serve(bytearray(payload), provider=provider) as server, pyfi.connect(server.address) as conn:
        dst = bytearray(size)
        assert conn.read_into(dst, offset, size, chunk_size=chunk, max_inflight=inflight) == size
        assert dst == payload[offset:offset + size]


def test_file_is_served_read_only_with_mmap(provider, payload, tmp_path):
    """A regular file is mapped read-only and served; reads return its bytes and writes are refused."""
    path = tmp_path / "ckpt.bin"
    path.write_bytes(payload)
    with pyfi.serve(path, provider=provider) as server, pyfi.connect(server.address) as conn:
        assert server.address.size == SIZE and not server.address.writable
        dst = np.empty(SIZE, dtype=np.uint8)
        conn.read_into(dst)
        assert dst.tobytes() == payload
        with pytest.raises(FabricError, match="read-only"):
            conn.write(b"x", 0)
    assert path.read_bytes() == payload


def test_serving_a_directory_or_missing_path_is_refused(tmp_path):
    """serve() on a directory or a missing path raises CheckpointError naming it (as publish() does)."""
    with pytest.raises(CheckpointError, match="not a regular file") as info:
        pyfi.serve(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(CheckpointError, match="missing.*No such file"):
        pyfi.serve(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="empty"):
        pyfi.serve(bytearray(0))


def test_read_past_the_region_is_refused_by_client_and_server(provider):
    """read_into past the end fails on the client; a forged fi_read past the region fails at the server's MR."""
    with pyfi.serve(bytearray(1 << 16), provider=provider) as server:
        with pyfi.connect(server.address) as conn:
            with pytest.raises(FabricError, match="outside") as info:
                conn.read_into(bytearray(100), (1 << 16) - 50)
            assert info.value.code == errno.EINVAL
            with pytest.raises(FabricError) as info:
                conn.read_raw(bytearray(100), (1 << 16) - 50, 100)  # no client-side check
            assert info.value.call == "fi_read" and server.address.peer in str(info.value)
        with pyfi.connect(server.address) as conn:  # the server still serves honest reads
            dst = bytearray(16)
            assert conn.read_into(dst, 100) == 16


def test_write_refused_on_read_only_region(provider):
    """write() to a read-only region is refused by the client, and a forged fi_write by the server's MR."""
    src = bytearray(b"a" * 4096)
    with pyfi.serve(src, provider=provider) as server:
        with pyfi.connect(server.address) as conn:
            with pytest.raises(FabricError, match="read-only") as info:
                conn.write(b"zzzz", 0)
            assert info.value.code == errno.EACCES
            with pytest.raises(FabricError) as info:
                conn.write_raw(b"zzzz", 0)
            assert info.value.call == "fi_write"
    assert src == b"a" * 4096


def test_write_allowed_on_writable_region(provider):
    """On a region served writable=True, write() lands in the server's buffer (delivery complete) and reads see it."""
    target = bytearray(3 << 20)
    data = os.urandom((1 << 20) + 3)
    with pyfi.serve(target, provider=provider, writable=True) as server, pyfi.connect(server.address) as conn:
        assert conn.write(data, 1000, chunk_size=256 << 10) == len(data)
        assert target[1000:1000 + len(data)] == data
        back = bytearray(len(data))
        conn.read_into(back, 1000)
        assert back == data


def test_writable_file_is_written_through(provider, tmp_path):
    """A file served writable=True is mapped shared: a client's write reaches the file."""
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(8192))
    with pyfi.serve(path, provider=provider, writable=True) as server, pyfi.connect(server.address) as conn:
        conn.write(b"hello", 4000)
    assert path.read_bytes()[4000:4005] == b"hello"


def test_server_closed_mid_read_fails_in_bounded_time_naming_the_peer(provider):
    """Closing the server during a read makes read_into raise FabricError naming the peer within the timeout."""
    server = pyfi.serve(bytearray(32 << 20), provider=provider)
    peer = server.address.peer
    conn = pyfi.connect(server.address)
    start = time.monotonic()

    def close_after_first_chunk(done: int) -> None:
        if not server.closed:
            server.close()

    with pytest.raises(FabricError) as info:
        conn.read_into(bytearray(32 << 20), chunk_size=1 << 20, max_inflight=2, timeout=5.0,
                       progress=close_after_first_chunk)
    assert time.monotonic() - start < 15
    assert peer in str(info.value)
    assert conn.closed  # in-flight reads were cancelled by closing the endpoint
    with pytest.raises(FabricError, match="closed"):
        conn.read_into(bytearray(16))


def test_connecting_to_a_closed_server_times_out_naming_the_peer(provider):
    """A read from a server that is gone raises FabricError naming it within the timeout, never hangs."""
    with pyfi.serve(bytearray(4096), provider=provider) as server:
        address = server.address
    start = time.monotonic()
    with pyfi.connect(address) as conn, pytest.raises(FabricError) as info:
        conn.read_into(bytearray(4096), timeout=2.0)
    assert time.monotonic() - start < 10
    assert address.peer in str(info.value)


def test_address_pickles_and_server_does_not(provider):
    """The address survives pickling (Ray carries it); a Server or Connection refuses to be pickled."""
    with pyfi.serve(bytearray(b"x" * 100), provider=provider) as server:
        address = pickle.loads(pickle.dumps(server.address))
        assert address == server.address
        with pyfi.connect(address) as conn:
            dst = bytearray(100)
            conn.read_into(dst)
            assert dst == b"x" * 100
            with pytest.raises(TypeError):
                pickle.dumps(conn)
        with pytest.raises(TypeError):
            pickle.dumps(server)


def test_connect_rejects_a_provider_mismatch(provider):
    """connect(address, provider=other) refuses instead of talking the wrong protocol."""
    with pyfi.serve(bytearray(64), provider=provider) as server:
        with pytest.raises(FabricError, match="not efa"):
            pyfi.connect(server.address, provider="efa")


def test_progress_callback_and_many_readers(provider, payload):
    """Several connections read the same region; progress reports cumulative bytes ending at the size."""
    with pyfi.serve(bytearray(payload), provider=provider) as server:
        for _ in range(3):
            seen: list[int] = []
            with pyfi.connect(server.address) as conn:
                dst = bytearray(SIZE)
                conn.read_into(dst, chunk_size=1 << 20, progress=seen.append)
            assert dst == payload and seen == sorted(seen) and seen[-1] == SIZE


def test_on_chunk_hears_each_landed_chunk_once_and_can_end_the_transfer(provider, payload):
    """on_chunk(pos, length) covers dst exactly once, each chunk's bytes already there; what it raises ends the read."""
    src = np.frombuffer(payload, np.uint8)
    with pyfi.serve(bytearray(payload), provider=provider) as server:
        with pyfi.connect(server.address) as conn:
            dst = np.zeros(SIZE, np.uint8)
            heard = []

            def check(pos: int, length: int) -> None:
                assert (dst[pos:pos + length] == src[pos:pos + length]).all()
                heard.append((pos, length))
            conn.read_into(dst, chunk_size=1 << 20, max_inflight=2, on_chunk=check)
            assert sorted(heard) == [(p, min(1 << 20, SIZE - p)) for p in range(0, SIZE, 1 << 20)]

            def refuse(pos: int, length: int) -> None:
                raise ValueError(f"chunk at {pos} refused")
            with pytest.raises(ValueError, match="refused"):
                conn.read_into(np.zeros(SIZE, np.uint8), chunk_size=1 << 20, on_chunk=refuse)


def test_serve_close_releases_the_file_mapping(provider, tmp_path):
    """After close() the served file's mapping is gone (the file can be replaced and no fd stays open)."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"q" * 10000)
    before = len(os.listdir("/proc/self/fd"))
    server = pyfi.serve(path, provider=provider)
    server.close()
    server.close()
    assert len(os.listdir("/proc/self/fd")) == before
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()


def test_a_forged_key_is_refused(provider):
    """A read presenting any key but the region's is refused by the server."""
    import dataclasses

    with pyfi.serve(bytearray(4096), provider=provider) as server:
        forged = dataclasses.replace(server.address, key=server.address.key ^ 1)
        with pyfi.connect(forged) as conn, pytest.raises(FabricError) as info:
            conn.read_into(bytearray(100), timeout=5.0)
    assert info.value.call == "fi_read"


def test_a_server_nobody_closed_is_closed_when_collected(provider):
    """Dropping the last reference to a Server stops its serving thread and revokes the region."""
    import gc
    import threading

    server = pyfi.serve(bytearray(4096), provider=provider)
    name = f"pyfi-serve {server.address.peer}"
    assert any(t.name == name for t in threading.enumerate())
    del server
    gc.collect()
    assert not any(t.name == name for t in threading.enumerate())


def test_close_from_another_thread_waits_for_the_read(provider, payload):
    """conn.close() during a read in another thread waits for it; the read completes intact."""
    import threading

    with pyfi.serve(bytearray(payload), provider=provider) as server:
        conn = pyfi.connect(server.address)
        dst = bytearray(SIZE)
        started = threading.Event()
        result: list = []

        def read() -> None:
            try:
                result.append(conn.read_into(dst, chunk_size=64 << 10, max_inflight=2,
                                             progress=lambda done: started.set()))
            except FabricError as exc:  # pragma: no cover - reported below
                result.append(exc)

        thread = threading.Thread(target=read)
        thread.start()
        assert started.wait(10)
        conn.close()
        thread.join(30)
        assert result == [SIZE] and dst == payload and conn.closed


def test_raw_read_rate_measures_a_verified_read(provider):
    """_bench.raw_read_rate reads a region end to end and returns a positive GB/s figure."""
    from raydl.native.pyfi._bench import raw_read_rate

    assert raw_read_rate(8 << 20, 1 << 20, 4, provider, repeats=1) > 0
