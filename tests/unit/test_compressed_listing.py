"""Listing a compressed (.tar.gz) shard needs only its tar headers: its inflated bytes stream past the header
reader a window at a time, so the memory listing takes is bounded by a constant, not by the inflated shard
(64x the compressed one at most); and the streamed reader finds what the random-access one finds, members or
the same error, on well-formed and on hostile tars."""
from __future__ import annotations

import gzip
import io
import os
import random
import subprocess
import sys
import tarfile
import zlib

import pytest

from raydl.errors import DataSourceError
from raydl.sources._tar import index_tar
from raydl.sources._wds_index import _Forward

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20

_PEAK = """
import sys
import raydl
from raydl.errors import DataSourceError


def hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


small, big, bomb = sys.argv[1:4]
raydl.read_webdataset(small)  # raydl's imports and first allocations, before the peak is read
base = hwm()
n = len(raydl.read_webdataset(big))
listed = hwm()
try:
    raydl.read_webdataset(bomb)
    refused = ""
except DataSourceError as exc:
    refused = str(exc)
print(n, base, listed, hwm(), refused[:200], sep="\\n")
"""


def _tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _gz_of_zeros(members: int, member_bytes: int) -> bytes:
    """A .tar.gz of `members` jpg members of zeros, compressed as it is written (never whole in memory)."""
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    out = []
    zeros = bytes(member_bytes)
    for i in range(members):
        info = tarfile.TarInfo(f"s{i:04d}.jpg")
        info.size = member_bytes
        out.append(c.compress(info.tobuf(tarfile.USTAR_FORMAT)))
        out.append(c.compress(zeros))
        out.append(c.compress(bytes(-member_bytes % 512)))
    out.append(c.compress(bytes(1024)))
    out.append(c.flush())
    return b"".join(out)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status (VmHWM)")
def test_listing_a_compressed_shard_takes_memory_bounded_by_a_constant(tmp_path):
    """In a fresh process: listing a 60 MB-inflated .tar.gz (a 60 KB file) and being refused a gzip bomb at its
    64 MiB limit raise the peak RSS by far less than either inflates to (it grew by the whole inflated shard,
    and once more by its copy)."""
    small, big, bomb = tmp_path / "small.tar.gz", tmp_path / "big.tar.gz", tmp_path / "bomb.tar.gz"
    small.write_bytes(gzip.compress(_tar([("a.jpg", b"x")])))
    big.write_bytes(_gz_of_zeros(60, MIB))
    bomb.write_bytes(_gz_of_zeros(4, 50 * MIB))  # 200 MiB inflated, refused at 64 MiB
    assert big.stat().st_size < MIB and bomb.stat().st_size < MIB
    env = dict(os.environ, RAYDL_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(small), str(big), str(bomb)], capture_output=True,
                          text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n, base, listed, end, refused = proc.stdout.splitlines()
    assert int(n) == 60
    assert "inflates to more than 67108864 bytes" in refused and str(bomb) in refused
    grown = int(end) - int(base)
    assert grown < 24 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB (listed: {(int(listed) - int(base)) / MIB:.0f})"


def _streamed(blob: bytes, piece: int):
    """index_tar over `blob` handed on in pieces of `piece` bytes, its length unknown until its end."""
    reader = _Forward(iter([blob[i:i + piece] for i in range(0, len(blob), piece)]), "s.tar")
    index = index_tar(reader.read, None, "s.tar", window=1024, small_limit=0, length=reader.length)
    reader.drain()
    return index


def _outcome(fn):
    try:
        return [(m.name, m.offset, m.size) for m in fn().members]
    except DataSourceError as exc:
        return str(exc)


def _hostile_blobs():
    """Well-formed tars, tars cut anywhere, with stray bytes, with pax and long-name headers cut inside,
    and random header bytes (as tests/unit/test_tar_hostile.py makes them)."""
    rng = random.Random(5)
    good = _tar([(f"k{i}.{e}", bytes([i]) * rng.randint(0, 3000)) for i in range(6) for e in ("jpg", "cls")])
    yield good
    for cut in sorted(rng.sample(range(1, len(good)), 40)):
        yield good[:cut]
    yield good + b"x" * 100  # stray bytes after the end blocks
    yield good[:-1024] + b"y" * 300  # stray bytes where the end blocks were
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("ü/" + "long" * 80 + ".jpg")
        info.size = 700
        tar.addfile(info, io.BytesIO(b"z" * 700))
    pax = buf.getvalue()
    yield pax
    for cut in (600, 1000, 1100, 1600):
        yield pax[:cut]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("d/" + "n" * 300 + ".jpg")
        info.size = 10
        tar.addfile(info, io.BytesIO(b"q" * 10))
    gnu = buf.getvalue()
    yield gnu
    for cut in (700, 1030, 1600):
        yield gnu[:cut]
    for _ in range(150):
        blocks = []
        for _ in range(rng.randint(1, 5)):
            h = bytearray(tarfile.TarInfo("r.jpg").tobuf(tarfile.USTAR_FORMAT))
            h[124:136] = b"%011o\0" % rng.randint(0, 3000)
            for _ in range(rng.randint(0, 6)):
                h[rng.randrange(124, 160 if rng.random() < 0.5 else 512)] = rng.randrange(256)
            h[148:156] = b" " * 8
            h[148:156] = b"%06o\0 " % sum(h)
            blocks.append(bytes(h) + bytes(rng.randint(0, 4) * 512))
        blob = b"".join(blocks) + bytes(rng.choice([0, 1024, 100]))
        yield blob[: rng.randint(1, len(blob))] if rng.random() < 0.3 else blob


def test_the_streamed_reader_finds_what_the_random_access_one_finds():
    """On every blob, indexing it as a stream (pieces of 1, 511, 512 or 4096 bytes) gives the same members, or
    the same DataSourceError text, as indexing it with its size known."""
    for blob in _hostile_blobs():
        sized = _outcome(lambda b=blob: index_tar(lambda o, n, b=b: b[o:o + n], len(b), "s.tar", small_limit=0))
        for piece in (1, 511, 512, 4096):
            assert _outcome(lambda b=blob, p=piece: _streamed(b, p)) == sized, (len(blob), piece)


def test_a_compressed_shard_lists_and_reads_as_its_tar_does(tmp_path):
    """The same samples, keys and bytes from a .tar.gz (listed streaming, cut from the worker's inflated copy)
    as from the .tar it compresses; a damaged or cut one is the gzip error it was."""
    import numpy as np

    import raydl
    from raydl.sources import _inflate

    raw = _tar([(f"k{i:02d}.{e}", b"%s-%d" % (e.encode(), i) * (i + 1)) for i in range(20) for e in ("jpg", "txt")
                if not (e == "txt" and i % 3)])
    (tmp_path / "s.tar").write_bytes(raw)
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress(raw))

    def samples(path):
        cat = raydl.read_webdataset(str(path), fields="all").catalog
        loc = cat.source.locate(cat, np.arange(len(cat)))
        out = {}
        for i in range(len(cat)):
            info = cat.shard_info(int(loc.shard[i]))
            data = cat.source.read_block(cat.storage, info, int(loc.offset[i]), int(loc.length[i]))
            rec = loc.errors.get(i) or cat.source.cut(loc, i, data)
            out[loc.key[i]] = rec if isinstance(rec, dict) else str(rec).replace(".tar.gz", ".tar")
        return out

    _inflate.clear_cache()
    assert samples(tmp_path / "s.tar.gz") == samples(tmp_path / "s.tar")
    gz = (tmp_path / "s.tar.gz").read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(gz[: len(gz) // 2])
    with pytest.raises(DataSourceError, match="truncated gzip stream"):
        raydl.read_webdataset(str(tmp_path / "cut.tar.gz"))
    (tmp_path / "bad.tar.gz").write_bytes(gz[:30] + bytes(200) + gz[230:])
    with pytest.raises(DataSourceError, match="corrupt gzip stream"):
        raydl.read_webdataset(str(tmp_path / "bad.tar.gz"))
