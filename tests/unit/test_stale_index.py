"""An index that describes a shard as it was before it was rewritten is never used to cut its samples: a local
shard rewritten in place at the same size (its records reordered) would otherwise give every sample another
sample's bytes under its own key, silently. raydl index files compare size, etag and, for a local file, mtime;
a DALI .idx older than its local shard is not used; the node cache is keyed by the shard's identity taken
before it was read."""
from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

import raydl
from raydl.sources import _wds_index as wi
from raydl.storage import LocalStorage

pytestmark = pytest.mark.timeout(60)

WDS2IDX = Path(sys.executable).parent / "wds2idx"
N = 10


def _shard(path: Path, order) -> str:
    """N samples of jpg + cls, written in `order`: sample k's payload names k and its label is k, each member the
    same size, so any order gives a shard of the same size."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for k in order:
            for ext, data in (("jpg", b"payload-of-%02d" % k), ("cls", b"%02d" % k)):
                info = tarfile.TarInfo(f"k{k:02d}.{ext}")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def _rewrite_in_place(path: str) -> None:
    """The shard rewritten with its records reversed: same size, a later mtime (set, so that a coarse clock
    cannot hide the write)."""
    before = os.stat(path)
    data = Path(_shard(Path(path + ".new"), reversed(range(N)))).read_bytes()
    os.unlink(path + ".new")
    with open(path, "r+b") as f:  # in place: same inode
        f.write(data)
    assert os.path.getsize(path) == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))


def _samples(ds) -> dict[str, tuple[bytes, int]]:
    """key -> (image bytes, label) of every sample, as a worker locates and cuts it."""
    cat = ds.catalog
    loc = cat.source.locate(cat, np.arange(len(cat)))
    assert not loc.errors, loc.errors
    out = {}
    for i in range(len(cat)):
        info = cat.shard_info(int(loc.shard[i]))
        rec = cat.source.cut(loc, i, cat.source.read_block(cat.storage, info, int(loc.offset[i]), int(loc.length[i])))
        out[loc.key[i]] = (bytes(rec["image"]), rec["label"])
    return out


def _right(samples) -> bool:
    return len(samples) == N and all(img == b"payload-of-%s" % key[1:].encode() and label == int(key[1:])
                                      for key, (img, label) in samples.items())


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty node cache of index blocks, and no blocks kept in this process."""
    from raydl.sources import webdataset

    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    webdataset.clear_blocks()
    yield tmp_path / "cache"
    webdataset.clear_blocks()


def test_an_index_file_of_a_shard_rewritten_at_the_same_size_is_not_used(tmp_path, fresh_cache, caplog):
    """index=PATH recorded the shard's mtime; after an in-place rewrite at the same size listing warns, naming
    the index and the shard, indexes the shard again, and every sample comes with its own payload and label
    (the old offsets gave each key another sample's bytes)."""
    path = _shard(tmp_path / "s.tar", range(N))
    index = str(tmp_path / "s.rwi")
    assert _right(_samples(raydl.read_webdataset(path, index=index)))
    assert os.path.exists(index)
    _rewrite_in_place(path)
    shutil.rmtree(fresh_cache, ignore_errors=True)
    raydl.sources.webdataset.clear_blocks()
    with caplog.at_level(logging.WARNING, logger="raydl"):
        ds = raydl.read_webdataset(path, index=index)
    got = _samples(ds)
    assert _right(got), got
    assert ds.catalog.parts.column("index_kind").to_pylist() == [0]  # the shard's own index, not the file's
    (warning,) = [r.getMessage() for r in caplog.records if "indexing it again" in r.getMessage()]
    assert warning.startswith(f"raydl: {index}: {path} was modified after it was indexed (mtime_ns ")


def test_an_index_file_is_still_used_while_the_shard_is_unchanged(tmp_path, fresh_cache):
    """The same shard, untouched: its entry matches (size and mtime) and listing reads no shard byte."""
    path = _shard(tmp_path / "s.tar", range(N))
    index = str(tmp_path / "s.rwi")
    raydl.read_webdataset(path, index=index)
    shutil.rmtree(fresh_cache, ignore_errors=True)
    ds = raydl.read_webdataset(path, index=index)
    assert ds.catalog.parts.column("index_kind").to_pylist() == [2] and _right(_samples(ds))


@pytest.mark.skipif(not WDS2IDX.exists(), reason="DALI's wds2idx is not installed (scripts/setup.sh test)")
def test_a_dali_index_older_than_its_local_shard_is_not_used(tmp_path, fresh_cache, caplog):
    """A DALI .idx records nothing of its shard: where the local shard was modified after the .idx was written,
    it is warned about (naming both) and the shard is indexed from its own bytes."""
    path = _shard(tmp_path / "s.tar", range(N))
    subprocess.run([str(WDS2IDX), path, str(tmp_path / "s.idx")], check=True, capture_output=True)
    ds = raydl.read_webdataset(path)
    assert ds.catalog.parts.column("index_kind").to_pylist() == [1] and _right(_samples(ds))
    _rewrite_in_place(path)
    shutil.rmtree(fresh_cache, ignore_errors=True)
    raydl.sources.webdataset.clear_blocks()
    with caplog.at_level(logging.WARNING, logger="raydl"):
        ds = raydl.read_webdataset(path)
    got = _samples(ds)
    assert _right(got), got
    assert ds.catalog.parts.column("index_kind").to_pylist() == [0]
    (warning,) = [r.getMessage() for r in caplog.records if "DALI index" in r.getMessage()]
    assert warning.startswith(f"raydl: {tmp_path / 's.idx'} is older than {path}: the shard was modified after")


def test_the_node_cache_keys_a_block_by_the_shard_as_it_was_before_the_read(tmp_path, fresh_cache, monkeypatch):
    """A shard rewritten while it is indexed: the block read from its old bytes is cached under the old mtime,
    so a later lookup of the new file misses (it is never served the old members)."""
    path = _shard(tmp_path / "s.tar", range(N))
    info = LocalStorage().stat(path)
    real = wi.build_block

    def build_then_rewrite(storage, shard):
        block = real(storage, shard)
        _rewrite_in_place(path)  # lands between the read and the cache write
        return block

    monkeypatch.setattr(wi, "build_block", build_then_rewrite)
    wi.build_cached(LocalStorage(), info)
    assert wi.cache_get(info) is None


def test_a_process_that_read_a_shard_before_its_rewrite_reads_it_anew(tmp_path, fresh_cache):
    """The blocks (and inflated shards) a process keeps are keyed by a local file's mtime too: listing again after
    an in-place rewrite at the same size, the same process (a driver that also makes the first batches) cuts the
    new bytes under their own keys, not the old block's; a .tar.gz too."""
    import gzip

    path = _shard(tmp_path / "s.tar", range(N))
    assert _right(_samples(raydl.read_webdataset(path)))
    _rewrite_in_place(path)
    got = _samples(raydl.read_webdataset(path))
    assert _right(got) and list(got) == [f"k{i:02d}" for i in reversed(range(N))]  # the new bytes, in their order

    gz = tmp_path / "s.tar.gz"
    gz.write_bytes(gzip.compress(Path(path).read_bytes(), compresslevel=0, mtime=0))  # stored: its size is the tar's
    assert _right(_samples(raydl.read_webdataset(str(gz))))
    before = os.stat(gz)
    flipped = gzip.compress(Path(_shard(tmp_path / "t.tar", range(N))).read_bytes(), compresslevel=0, mtime=0)
    assert len(flipped) == before.st_size
    gz.write_bytes(flipped)
    os.utime(gz, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    got = _samples(raydl.read_webdataset(str(gz)))
    assert _right(got) and list(got) == [f"k{i:02d}" for i in range(N)]


def test_a_process_that_read_a_parquet_file_before_its_rewrite_reads_it_anew(tmp_path):
    """A local Parquet file rewritten at the same size with the same row groups (its values reordered): listed
    again, the same process reads the new values, not the footer and row groups it decoded before."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    plain = dict(row_group_size=5, compression="none", use_dictionary=False, write_statistics=False)

    def rows(ds):
        cat = ds.catalog
        loc = cat.source.locate(cat, np.arange(len(cat)))
        out = []
        for i in range(len(cat)):
            info = cat.shard_info(int(loc.shard[i]))
            data = cat.source.read_block(cat.storage, info, int(loc.offset[i]), int(loc.length[i]))
            out.append(int(cat.source.cut(loc, i, data)["n"]))
        return out

    pq.write_table(pa.table({"n": list(range(10))}), path, **plain)
    assert rows(raydl.read_parquet(str(path))) == list(range(10))
    before = os.stat(path)
    pq.write_table(pa.table({"n": [4, 3, 2, 1, 0, 9, 8, 7, 6, 5]}), path, **plain)
    assert os.path.getsize(path) == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    assert rows(raydl.read_parquet(str(path))) == [4, 3, 2, 1, 0, 9, 8, 7, 6, 5]
