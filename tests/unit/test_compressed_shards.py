"""Compressed (.tar.gz) shards: inflated in bounded steps to a bounded size, once per process however many
threads read them."""
from __future__ import annotations

import gzip
import io
import tarfile
import threading
import tracemalloc
import zlib

import pytest

import raydl
from raydl.errors import DataSourceError
from raydl.sources import _inflate
from raydl.sources._tar import index_tar
from raydl.sources.webdataset import WebDatasetSource
from raydl.storage import LocalStorage, ObjectInfo

from counting_storage import CountingStorage  # beside this file

pytestmark = pytest.mark.timeout(60)


def tar_bytes(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def zero_bomb(inflated: int) -> bytes:
    """A gzipped tar of one member of `inflated` zero bytes, compressed as it streams (never whole)."""
    header = tar_bytes([("a.jpg", b"")])[:512]
    h = bytearray(header)
    h[124:136] = b"%011o\0" % inflated
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [c.compress(bytes(h))]
    chunk = bytes(1 << 20)
    for _ in range(inflated // len(chunk)):
        out.append(c.compress(chunk))
    out.append(c.compress(bytes(1024)))
    out.append(c.flush())
    return b"".join(out)



def test_a_gzip_bomb_is_a_data_source_error_with_bounded_memory(tmp_path):
    """A 100 KB .tar.gz that inflates to 100 MiB of zeros: listing stops at the shard's inflate limit (64 MiB
    here) with a DataSourceError naming the shard, never holding much more than the limit."""
    path = tmp_path / "bomb.tar.gz"
    path.write_bytes(zero_bomb(100 << 20))
    assert path.stat().st_size < 200_000
    limit = _inflate.inflated_limit(path.stat().st_size)
    assert limit == 64 << 20
    small = tmp_path / "small.tar.gz"
    small.write_bytes(gzip.compress(tar_bytes([("a.jpg", b"x")])))
    raydl.read_webdataset(str(small))  # raydl's own imports, before memory is counted
    tracemalloc.start()
    try:
        with pytest.raises(DataSourceError, match="inflates to more than") as info:
            raydl.read_webdataset(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(path) in str(info.value) and str(limit) in str(info.value)
    assert peak < limit * 1.25, peak  # the output buffer's growth headroom, and one inflate step


def test_eight_threads_read_and_inflate_one_shard_once(tmp_path):
    """Eight threads reading samples of one compressed shard at once: the shard is read and inflated once
    (the others wait for that inflate), and every thread gets its member's exact bytes."""
    members = [(f"s{i}.jpg", bytes([i]) * (1000 + i)) for i in range(8)]
    raw = tar_bytes(members)
    path = tmp_path / "s.tar.gz"
    path.write_bytes(gzip.compress(raw))
    index = index_tar(lambda off, n: raw[off:off + n], len(raw), "s.tar")  # not listed: no cache is warm
    t = {"offset": [m.offset for m in index.members], "length": [m.size for m in index.members]}
    storage = CountingStorage(delay_s=0.2)  # every read slow: all eight threads ask while the first reads
    info = ObjectInfo(str(path), path.stat().st_size, "")
    source = WebDatasetSource()
    _inflate.clear_cache()
    barrier = threading.Barrier(8)
    got: dict[int, bytes] = {}

    def read(i):
        barrier.wait()
        got[i] = source.read_block(storage, info, t["offset"][i], t["length"][i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert got == {i: data for i, (_, data) in enumerate(members)}
    assert storage.reads == [(str(path), 0, info.size)]


def test_an_error_in_flight_reaches_every_waiting_thread(tmp_path):
    """Threads waiting on an inflate that fails get its DataSourceError, and the shard was read once."""
    path = tmp_path / "bad.tar.gz"
    blob = bytearray(gzip.compress(tar_bytes([("a.jpg", bytes(range(256)) * 64)])))
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    storage = CountingStorage(delay_s=1.0)  # long beside a busy machine's wake-ups: all four wait on one read
    info = ObjectInfo(str(path), len(blob), "")
    errors = []
    barrier = threading.Barrier(4)

    def read():
        barrier.wait()
        try:
            _inflate.inflated(storage, info)
        except DataSourceError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(errors) == 4 and all(str(path) in e and "corrupt gzip stream" in e for e in errors)
    assert len(storage.reads) == 1


def test_streams_concatenated_members_and_zero_padding_like_gzip(tmp_path, monkeypatch):
    """Inflated in small steps (tiny READ_STEP and INFLATE_STEP), concatenated gzip members and zero padding
    give gzip's own bytes; other trailing bytes, truncation and damage are DataSourceErrors naming the
    shard."""
    monkeypatch.setattr(_inflate, "READ_STEP", 1000)
    monkeypatch.setattr(_inflate, "INFLATE_STEP", 777)
    raw = tar_bytes([("a.jpg", bytes(range(256)) * 100), ("a.cls", b"3"), ("b.jpg", b"\0" * 50_000)])
    half = len(raw) // 2
    cases = {
        "one.tgz": gzip.compress(raw),
        "two.tgz": gzip.compress(raw[:half]) + gzip.compress(raw[half:]),
        "padded.tgz": gzip.compress(raw) + bytes(3000),
        "zeros-between.tgz": gzip.compress(raw[:half]) + bytes(10) + gzip.compress(raw[half:]),
    }
    storage = LocalStorage()
    for name, blob in cases.items():
        path = tmp_path / name
        path.write_bytes(blob)
        assert _inflate._inflate(storage, ObjectInfo(str(path), len(blob))) == raw, name
    one = cases["one.tgz"]
    bad = {
        "garbage.tgz": (one + b"trailing garbage", "not a gzip member"),
        "cut.tgz": (one[: len(one) - 100], "truncated gzip stream"),
        "crc.tgz": (one[:-8] + bytes(8), "corrupt gzip stream"),
        "empty.tgz": (b"", "truncated gzip stream"),
        "zeros.tgz": (bytes(100), "truncated gzip stream"),
        "notgzip.tgz": (raw, "not a gzip member"),
    }
    for name, (blob, match) in bad.items():
        path = tmp_path / name
        path.write_bytes(blob)
        with pytest.raises(DataSourceError, match=match) as info:
            _inflate._inflate(storage, ObjectInfo(str(path), len(blob)))
        assert str(path) in str(info.value), name


def test_the_cache_is_bounded(tmp_path, monkeypatch):
    """Inflated shards kept per process: at most a few, and at most CACHE_BYTES besides the newest."""
    monkeypatch.setattr(_inflate, "CACHE_BYTES", 150_000)
    _inflate.clear_cache()
    storage = LocalStorage()
    for i in range(6):
        path = tmp_path / f"c{i}.tgz"
        path.write_bytes(gzip.compress(tar_bytes([("a.jpg", bytes([i]) * 60_000)])))
        _inflate.inflated(storage, ObjectInfo(str(path), path.stat().st_size))
        assert sum(len(v) for v in _inflate._cache.values()) <= 150_000 + 70_000
    assert len(_inflate._cache) <= 3
    _inflate.clear_cache()
