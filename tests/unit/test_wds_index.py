"""WebDataset shard indexes (raydl/sources/_wds_index.py): DALI's wds2idx files, wids shard lists, raydl's own
index files and node cache, and the one-streamed-read indexer; crafted indexes are refused, naming the file."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from raydl.errors import DataSourceError
from raydl.sources import _wds_index as wi
from raydl.sources._tar import index_tar
from raydl.storage import LocalStorage, ObjectInfo

pytestmark = pytest.mark.timeout(60)

WDS2IDX = Path(sys.executable).parent / "wds2idx"
needs_dali = pytest.mark.skipif(
    not WDS2IDX.exists() or shutil.which("tar") is None,
    reason="DALI's wds2idx is not installed (scripts/setup.sh test installs nvidia-dali-cuda120 --no-deps) "
    "or GNU tar is missing",
)


def tarwriter_shard(path, n, *, start=0, extra=None):
    """A shard as the webdataset library's TarWriter writes it: n samples of jpg + cls (+ extra fields)."""
    import webdataset as wds

    with wds.TarWriter(str(path)) as sink:
        for i in range(start, start + n):
            sample = {"__key__": f"s{i:05d}", "jpg": bytes([i % 256]) * (100 + i), "cls": str(i % 7)}
            sample.update(extra or {})
            sink.write(sample)
    return str(path)


def info_of(path) -> ObjectInfo:
    return LocalStorage().stat(str(path))


def reference_block(path) -> wi.MemberBlock:
    data = Path(path).read_bytes()
    index = index_tar(lambda off, n: data[off:off + n], len(data), str(path))
    return wi.MemberBlock([m.name for m in index.members], np.array([m.offset for m in index.members]),
                          np.array([m.size for m in index.members]))


def same(a: wi.MemberBlock, b: wi.MemberBlock) -> bool:
    return a.names == b.names and np.array_equal(a.offsets, b.offsets) and np.array_equal(a.sizes, b.sizes)


class Counting(LocalStorage):
    """Local disk that counts streamed reads and ranged reads."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "calls", [])

    def read_range(self, uri, offset, length, *, etag=None):
        self.calls.append(("range", uri))
        return super().read_range(uri, offset, length, etag=etag)

    def stream(self, uri, *, etag=None, chunk=8 << 20):
        self.calls.append(("stream", uri))
        yield from super().stream(uri, etag=etag, chunk=4096)  # small pieces: many per member and header


def test_build_block_is_one_streamed_read_and_matches_the_header_reader(tmp_path):
    """A shard is indexed from ONE streamed read (never a ranged read per member), in small pieces, with the same
    members as the random-access header reader, GNU long names and pax included."""
    path = tarwriter_shard(tmp_path / "a.tar", 30)
    storage = Counting()
    assert same(wi.build_block(storage, info_of(path)), reference_block(path))
    assert storage.calls == [("stream", path)]
    long = tmp_path / "long.tar"
    with tarfile.open(long, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [("d/" + "x" * 150 + ".jpg", b"j" * 5000), ("ü/é.cls", b"1"), ("z.jpg", b"")]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    assert same(wi.build_block(Counting(), info_of(long)), reference_block(long))


def test_a_shard_shorter_than_listed_is_an_error_naming_it(tmp_path):
    """A shard that ends before its listed size (it changed) is a DataSourceError naming it."""
    path = tarwriter_shard(tmp_path / "a.tar", 5)
    info = info_of(path)
    with pytest.raises(DataSourceError) as exc:
        wi.build_block(LocalStorage(), ObjectInfo(info.uri, info.size + 10240))
    assert path in str(exc.value)


@needs_dali
def test_dali_wds2idx_files_give_the_shards_own_members(tmp_path):
    """DALI's own wds2idx (v1.2) on TarWriter shards, with several fields and a __meta__ member: parse_dali gives
    exactly the members the tar headers give."""
    path = tarwriter_shard(tmp_path / "a.tar", 25, extra={"json": b"{}", "txt": "caption"})
    subprocess.run([str(WDS2IDX), path, str(tmp_path / "a.idx")], check=True, capture_output=True)
    text = (tmp_path / "a.idx").read_bytes()
    assert text.startswith(b"v1.2 25\n")
    assert same(wi.parse_dali(text, str(tmp_path / "a.idx"), info_of(path)), reference_block(path))


def _dali_text(block: wi.MemberBlock) -> bytes:
    lines = [f"{n.split('.', 1)[1]} {o} {s} {n}" for n, o, s in zip(block.names, block.offsets, block.sizes, strict=True)]
    return (f"v1.2 {len(lines)}\n" + "\n".join(lines) + "\n").encode()


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda t: t.replace(b"v1.2", b"v1.1", 1), "not a DALI v1.2 index"),
        (lambda t: t.replace(b"v1.2 4", b"v1.2 5", 1), "says 5 samples, has 4 lines"),
        (lambda t: t.replace(b" s00001.jpg", b" s00 001.jpg", 1), "a name with a space"),
        (lambda t: t.replace(b"jpg 7680 101", b"jpg 7680 999999", 1), "lies outside"),
        (lambda t: t.replace(b"cls 5632", b"cls 3600", 1), "overlaps"),
        (lambda t: t.replace(b"jpg 3584 100", b"jpg x 100", 1), "is not 'ext offset size name'"),
        (lambda t: t.replace(b"jpg 3584 100", b"jpg 9999999999999999999 100", 1), "below 2\\*\\*63"),
    ],
)
def test_crafted_dali_indexes_are_refused_naming_the_file(tmp_path, mutate, why):
    """A .idx that does not parse, claims more lines, has names with spaces, or points outside the shard or into
    another member: a DataSourceError naming the .idx file."""
    path = tarwriter_shard(tmp_path / "a.tar", 2)
    text = _dali_text(reference_block(path))
    assert wi.parse_dali(text, "x.idx", info_of(path)).names[:2] == ["s00000.cls", "s00000.jpg"]
    where = str(tmp_path / "a.idx")
    with pytest.raises(DataSourceError, match=why) as exc:
        wi.parse_dali(mutate(text), where, info_of(path))
    assert where in str(exc.value)


def test_a_member_whose_offset_plus_size_wraps_int64_is_outside_the_shard(tmp_path):
    """offset 3 << 61 with size 1 << 62 sums past 2**63 and wraps negative in int64: still outside the shard."""
    path = tarwriter_shard(tmp_path / "a.tar", 1)
    block = wi.MemberBlock(["a.jpg"], np.array([3 << 61], np.int64), np.array([1 << 62], np.int64))
    with pytest.raises(DataSourceError, match="lies outside"):
        wi.check_block(block, info_of(path), "x.rwi")


def test_raydl_index_files_round_trip_and_crafted_ones_are_refused(tmp_path):
    """write_index / read_header / decode_block round-trip; a cut, retyped or lying header or block is a
    DataSourceError naming the index file."""
    paths = [tarwriter_shard(tmp_path / f"s{i}.tar", 10 + i, start=100 * i) for i in range(3)]
    blocks = [reference_block(p) for p in paths]
    out = str(tmp_path / "index.rwi")
    wi.write_index(out, [(Path(p).name, info_of(p), 0, b) for p, b in zip(paths, blocks, strict=True)])
    data = Path(out).read_bytes()
    entries = wi.read_header(lambda o, n: data[o:o + n], len(data), out)
    assert [e.path for e in entries] == ["s0.tar", "s1.tar", "s2.tar"]
    assert entries[1].sigs == {"cls,jpg": 11}
    for e, p, b in zip(entries, paths, blocks, strict=True):
        assert same(wi.decode_block(data[e.offset:e.offset + e.length], info_of(p), out), b)
    head_end = data.index(b"\n", data.index(b"\n") + 1) + 1
    bad_headers = [data[:30], b"NOT-AN-INDEX\n" + data, data.replace(b'"size":', b'"size":-', 1),
                   data.replace(b'"length":', b'"length":9', 1), data[:head_end - 5]]
    for bad in bad_headers:
        with pytest.raises(DataSourceError) as exc:
            wi.read_header(lambda o, n, b=bad: b[o:o + n], len(bad), out)
        assert out in str(exc.value)
    e = entries[0]
    block = data[e.offset:e.offset + e.length]
    lying = bytearray(block)
    lying[4:12] = (10**12).to_bytes(8, "little")  # a trillion members claimed
    shifted = bytearray(block)
    shifted[12:20] = (10**9).to_bytes(8, "little")  # the first member far past the shard's end
    for bad in (bytes(lying), bytes(shifted), block[:-3], b"RWB1" + block[4:10]):
        with pytest.raises(DataSourceError) as exc:
            wi.decode_block(bad, info_of(paths[0]), out)
        assert out in str(exc.value)


def test_wids_shard_lists_resolve_urls_and_refuse_crafted_ones(tmp_path):
    """A wids JSON: urls relative to its folder unless absolute or with a scheme; a wrong kind, a bad entry, or
    more samples than the file can hold is a DataSourceError naming the JSON (and the entry)."""
    doc = {"__kind__": "wids-shard-index-v1", "name": "t", "shardlist": [
        {"url": "a.tar", "nsamples": 3, "filesize": 10240}, {"url": "/abs/b.tar", "nsamples": 1},
        {"url": "s3://bkt/c.tar", "nsamples": 2, "filesize": 4096}]}
    got = wi.parse_wids(json.dumps(doc).encode(), "s3://bkt/d/shards.json")
    assert [w.url for w in got] == ["s3://bkt/d/a.tar", "/abs/b.tar", "s3://bkt/c.tar"]
    assert [w.nsamples for w in got] == [3, 1, 2]
    for bad, why in [
        (b"[1, 2", "not a JSON shard list"),
        (json.dumps({**doc, "__kind__": "other"}).encode(), "not a wids shard list"),
        (json.dumps({**doc, "shardlist": [{"url": "a.tar", "nsamples": -1}]}).encode(), r"shardlist\[0\]"),
        (json.dumps({**doc, "shardlist": [{"url": "a.tar", "nsamples": 10**9, "filesize": 1024}]}).encode(),
         "claims 1000000000 samples"),
        (b"[" * 100000 + b"]" * 100000, "not a JSON shard list"),
    ]:
        with pytest.raises(DataSourceError, match=why) as exc:
            wi.parse_wids(bad, "/data/shards.json")
        assert "/data/shards.json" in str(exc.value)


def test_sample_counts_past_what_a_shard_can_hold_are_not_believed(tmp_path, monkeypatch, caplog):
    """A wids list without filesizes claiming 10**12 and 10**30 samples: each shard is indexed (a warning
    naming it) and the dataset has its real samples; an index file whose signatures count more samples than
    the shard's bytes can hold is a DataSourceError naming it; a node-cache entry doing so is a miss."""
    import logging

    import raydl

    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    paths = [tarwriter_shard(tmp_path / f"{c}.tar", 3) for c in "ab"]
    doc = {"__kind__": "wids-shard-index-v1",
           "shardlist": [{"url": "a.tar", "nsamples": 10**12}, {"url": "b.tar", "nsamples": 10**30}]}
    (tmp_path / "list.json").write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="raydl"):
        assert len(raydl.read_webdataset(str(tmp_path / "list.json"))) == 6
    assert sum("holds 1000000000000 samples" in r.getMessage() and paths[0] in r.getMessage()
               for r in caplog.records) == 1
    info = info_of(paths[0])
    index = str(tmp_path / "lying.rwi")
    wi.write_index(index, [("a.tar", info, 0, reference_block(paths[0]))])
    data = _lying_sigs(Path(index).read_bytes())
    Path(index).write_bytes(data)
    with pytest.raises(DataSourceError, match="signatures count 1000000000000000 samples") as exc:
        wi.read_header(lambda o, n: data[o:o + n], len(data), index)
    assert index in str(exc.value)
    wi.cache_put(info, reference_block(paths[0]))
    key = tmp_path / "cache" / "wds-index" / wi.cache_key(info)[0]
    key.write_bytes(_lying_sigs(key.read_bytes()))
    assert wi.cache_get(info, header_only=True) is None


def _lying_sigs(data: bytes) -> bytes:
    """An index file whose first shard's signature counts 10**15 samples, its header length fixed up."""
    nl = data.index(b"\n")
    head_len = int(data[len(wi.MAGIC):nl])
    head, rest = data[nl + 1:nl + 1 + head_len], data[nl + 1 + head_len:]
    head = head.replace(b'"cls,jpg":3', b'"cls,jpg":1000000000000000', 1)
    return wi.MAGIC + str(len(head)).encode() + b"\n" + head + rest


def test_the_node_cache_is_keyed_by_path_size_and_mtime_and_ignores_junk(tmp_path, monkeypatch):
    """cache_put/cache_get under $RAYDL_CACHE_DIR: a hit gives the block; a rewritten file (new mtime) misses; a
    corrupt cache file is a miss (and removed), never an error."""
    import os

    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    path = tarwriter_shard(tmp_path / "a.tar", 4)
    info = info_of(path)
    assert wi.cache_get(info) is None
    wi.cache_put(info, reference_block(path))
    entry, block = wi.cache_get(info)
    assert same(block, reference_block(path)) and entry.sigs == {"cls,jpg": 4}
    (f,) = list((tmp_path / "cache" / "wds-index").iterdir())
    assert not [p for p in f.parent.iterdir() if p.name.startswith(".tmp")]  # written by rename
    os.utime(path, ns=(1, 1))
    assert wi.cache_get(info) is None  # same size, other mtime: another key
    os.utime(path, ns=(f.stat().st_mtime_ns, f.stat().st_mtime_ns))
    key = wi.cache_key(info)[0]
    (f.parent / key).write_bytes(b"RAYDL-WDS-INDEX 1 5\nxxxx")
    assert wi.cache_get(info) is None and not (f.parent / key).exists()


def test_the_index_cache_never_follows_a_link_waits_on_a_fifo_or_removes_what_it_did_not_make(
    tmp_path, monkeypatch
):
    """A FIFO at a shard's key is a miss at once (not a read that blocks forever); a link there is neither
    followed nor removed; a folder that is a link is not used at all (nothing read or written through it)."""
    import os
    import time

    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    path = tarwriter_shard(tmp_path / "a.tar", 4)
    info = info_of(path)
    wi.cache_put(info, reference_block(path))
    folder = tmp_path / "cache" / "wds-index"
    key = folder / wi.cache_key(info)[0]
    good = key.read_bytes()
    key.unlink()
    os.mkfifo(key)
    t0 = time.monotonic()
    assert wi.cache_get(info) is None and time.monotonic() - t0 < 5 and key.exists()
    key.unlink()
    elsewhere = tmp_path / "elsewhere.rwi"
    elsewhere.write_bytes(good)  # a valid entry: a followed link would be a hit
    key.symlink_to(elsewhere)
    assert wi.cache_get(info) is None and key.is_symlink() and elsewhere.read_bytes() == good
    key.unlink()
    os.rename(folder, tmp_path / "real")
    folder.symlink_to(tmp_path / "real")
    (tmp_path / "real" / key.name).write_bytes(good)
    assert wi.cache_get(info) is None
    wi.cache_put(info, reference_block(path))
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == [key.name]


def test_the_index_cache_folder_is_made_once_by_racing_writers_and_kept_private(tmp_path, monkeypatch, caplog):
    """8 threads putting entries into a cache folder that does not exist yet: every entry lands (a writer
    that lost the mkdir race used to drop its entry). A folder left 0755 is made 0700; a folder that is a
    link turns the cache off with one warning naming it."""
    import logging
    import os
    import threading

    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    paths = [tarwriter_shard(tmp_path / f"s{i}.tar", 2, start=10 * i) for i in range(8)]
    go = threading.Barrier(8)

    def put(p):
        go.wait()
        wi.cache_put(info_of(p), reference_block(p))

    threads = [threading.Thread(target=put, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(wi.cache_get(info_of(p)) is not None for p in paths)
    folder = tmp_path / "cache" / "wds-index"
    folder.chmod(0o755)
    assert wi.cache_get(info_of(paths[0])) is not None and folder.stat().st_mode & 0o777 == 0o700
    os.rename(folder, tmp_path / "moved")
    folder.symlink_to(tmp_path / "moved")
    with caplog.at_level(logging.WARNING, logger="raydl"):
        assert wi.cache_get(info_of(paths[0])) is None and wi.cache_get(info_of(paths[1])) is None
    warned = [r.getMessage() for r in caplog.records if str(folder) in r.getMessage()]
    assert len(warned) == 1 and "index cache is off" in warned[0]


def test_samples_of_spans_image_and_label_members(tmp_path):
    """A sample's range covers its image and its label member; image_at/label_at point at their bytes."""
    path = tarwriter_shard(tmp_path / "a.tar", 6)
    data = Path(path).read_bytes()
    blk = wi.samples_of(reference_block(path), path, ("jpg",), "cls")
    assert blk.keys == [f"s{i:05d}" for i in range(6)]
    for j in range(6):
        span = data[blk.start[j]:blk.start[j] + blk.length[j]]
        assert span[blk.image_at[j]:blk.image_at[j] + blk.image_len[j]] == bytes([j]) * (100 + j)
        assert span[blk.label_at[j]:blk.label_at[j] + blk.label_len[j]] == str(j % 7).encode()
    none = wi.samples_of(reference_block(path), path, ("png",), None, every=True)
    assert none.missing.all() and (none.label_at == -1).all()


# -- listing with indexes (read_webdataset / list_webdataset) ---------------------------------------


def _dataset(tmp_path, n_shards=3, per=12):
    paths = [tarwriter_shard(tmp_path / f"shard-{s:04d}.tar", per, start=100 * s,
                             extra={"json": b"{}"} if s == 1 else None) for s in range(n_shards)]
    return paths, str(tmp_path / f"shard-{{0000..{n_shards - 1:04d}}}.tar")


def library_keys(paths):
    import webdataset as wds

    return [s["__key__"] for p in paths for s in wds.WebDataset(p, shardshuffle=False)]


def worker_view(ds):
    """(key, image, label) of every sample, as a worker locates and cuts it."""
    cat = ds.catalog
    loc = cat.source.locate(cat, np.arange(len(cat)))
    assert not loc.errors, loc.errors
    out = []
    for i in range(len(cat)):
        data = cat.source.read_block(cat.storage, cat.shard_info(int(loc.shard[i])), int(loc.offset[i]),
                                     int(loc.length[i]))
        rec = cat.source.cut(loc, i, data)
        out.append((loc.key[i], rec["image"], rec["label"]))
    return out


def list_counting(url, **kw):
    """list_webdataset through a storage that counts its reads."""
    from raydl.sources.webdataset import list_webdataset

    storage = Counting()
    cat = list_webdataset(url, storage_of=lambda _u: storage, image_fields=("jpg",), label_field="cls", **kw)
    return cat, storage.calls


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from raydl.sources import webdataset

    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    webdataset.clear_blocks()
    return tmp_path / "cache"


def test_listing_is_cached_and_a_cached_listing_reads_no_shard(tmp_path, cache):
    """The first listing reads each shard once (one streamed read); the next reads nothing (node cache); the keys,
    images and labels the workers get equal the webdataset library's."""
    import raydl

    paths, url = _dataset(tmp_path)
    cat, calls = list_counting(url)
    assert sorted(calls) == sorted(("stream", p) for p in paths)
    again, calls = list_counting(url)
    assert calls == [] and again.fingerprint == cat.fingerprint
    view = worker_view(raydl.read_webdataset(url))
    assert [k for k, _, _ in view] == library_keys(paths)
    assert [lab for _, _, lab in view] == [i % 7 for s in range(3) for i in range(100 * s, 100 * s + 12)]


@needs_dali
def test_dali_idx_and_wids_json_give_the_library_keys_without_reading_a_shard(tmp_path, cache):
    """With wds2idx's NAME.idx beside each shard, or a wids JSON, listing reads no shard; the samples the workers
    cut are the library's, as without any index; a corrupt .idx is warned about and the shard indexed instead."""
    import raydl

    paths, url = _dataset(tmp_path)
    plain = worker_view(raydl.read_webdataset(url, index="none"))
    shutil.rmtree(cache, ignore_errors=True)
    for p in paths:
        subprocess.run([str(WDS2IDX), p], check=True, capture_output=True)
    cat, calls = list_counting(url)
    assert {u for _, u in calls} == set()  # the .idx files are read whole, by storage.read (not counted)
    assert cat.parts.column("index_kind").to_pylist() == [1, 1, 1]
    shutil.rmtree(cache)
    assert worker_view(raydl.read_webdataset(url)) == plain
    doc = {"__kind__": "wids-shard-index-v1", "name": "t",
           "shardlist": [{"url": Path(p).name, "nsamples": 12, "filesize": Path(p).stat().st_size} for p in paths]}
    (tmp_path / "shards.json").write_text(json.dumps(doc))
    shutil.rmtree(cache)
    cat, calls = list_counting(str(tmp_path / "shards.json"))
    assert calls == [] and len(cat) == 36
    assert worker_view(raydl.read_webdataset(str(tmp_path / "shards.json"))) == plain
    Path(paths[2][:-4] + ".idx").write_text("v1.2 1\njpg 0 1 bad.jpg\n")
    shutil.rmtree(cache)
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("raydl").addHandler(handler)
    try:
        cat, calls = list_counting(url)
    finally:
        logging.getLogger("raydl").removeHandler(handler)
    assert calls == [("stream", paths[2])]
    assert any(paths[2][:-4] + ".idx" in r.getMessage() for r in records)
    # An .idx larger than its shard could be (1 MiB at least) is never read into memory: refused, shard indexed.
    with open(paths[1][:-4] + ".idx", "wb") as f:
        f.write(b"v1.2 1\n" + b"jpg 512 1 x.jpg " * (80 << 10))
    shutil.rmtree(cache)
    records.clear()
    logging.getLogger("raydl").addHandler(handler)
    try:
        cat, calls = list_counting(url)
    finally:
        logging.getLogger("raydl").removeHandler(handler)
    assert sorted(calls) == sorted([("stream", paths[1]), ("stream", paths[2])])
    assert any("byte limit" in r.getMessage() and paths[1][:-4] + ".idx" in r.getMessage() for r in records)
    assert worker_view(raydl.read_webdataset(url)) == plain


def test_an_explicit_index_file_is_written_read_and_refreshed(tmp_path, cache):
    """index=PATH writes a raydl index file when there is none and reads it after (no shard read, even with an
    empty cache); `raydl index` writes the same; a shard rewritten since is indexed again; a corrupt file is a
    DataSourceError naming it."""
    import os

    from raydl.cli import main

    paths, url = _dataset(tmp_path)
    out = str(tmp_path / "train.rwi")
    shard_reads = lambda calls: [c for c in calls if c[1] != out]  # noqa: E731 - the index file itself is read
    cat, calls = list_counting(url, index=out)
    assert os.path.exists(out) and len(shard_reads(calls)) == 3
    shutil.rmtree(cache)
    again, calls = list_counting(url, index=out)
    assert shard_reads(calls) == [] and again.fingerprint == cat.fingerprint
    assert again.parts.column("index_kind").to_pylist() == [2, 2, 2]
    assert main(["index", url, "--out", str(tmp_path / "cli.rwi")]) == 0
    assert Path(tmp_path / "cli.rwi").read_bytes()[:30] == Path(out).read_bytes()[:30]
    tarwriter_shard(paths[1], 5, start=500)  # rewritten: other size
    shutil.rmtree(cache)
    changed, calls = list_counting(url, index=out)
    assert shard_reads(calls) == [("stream", paths[1])] and len(changed) == 12 + 5 + 12
    Path(out).write_bytes(Path(out).read_bytes()[:40])
    with pytest.raises(DataSourceError) as exc:
        list_counting(url, index=out)
    assert out in str(exc.value)
