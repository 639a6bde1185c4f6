"""The node cache (raydl/storage/cache.py) on real files, without Ray: hits, digests, crashes, sharing, LRU, faults."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

import pytest

from raydl.options import Cache, LoaderConfig
from raydl.storage.cache import CachedStorage, NodeCache, check_cache_folder

from counting_storage import CountingStorage

pytestmark = pytest.mark.timeout(60)

_FORK = multiprocessing.get_context("fork")


@pytest.fixture
def objects(tmp_path):
    """Eight 'remote objects' (real files) of 10 KB, distinct bytes each."""
    folder = tmp_path / "store"
    folder.mkdir()
    paths = []
    for i in range(8):
        p = folder / f"obj{i}"
        p.write_bytes(bytes((i * 7 + j) % 251 for j in range(10_000)))
        paths.append(str(p))
    return paths


def _cached(tmp_path, max_bytes=1 << 20):
    inner = CountingStorage()
    return inner, CachedStorage(inner, NodeCache(str(tmp_path / "cache"), max_bytes))


def _entries(root) -> list[str]:
    return sorted(str(p) for p in (root / "entries").rglob("*") if p.is_file())


def test_a_miss_is_kept_and_the_next_read_is_a_hit(tmp_path, objects):
    """The first read goes to the store and is kept; the same range again is served from disk, counted."""
    inner, storage = _cached(tmp_path)
    first = storage.read_range(objects[0], 100, 5000, etag="e1")
    again = storage.read_range(objects[0], 100, 5000, etag="e1")
    assert first == again == open(objects[0], "rb").read()[100:5100]
    assert inner.reads == [(objects[0], 100, 5000)]
    counts = storage.counts.take()
    assert counts == {"hits": 1, "misses": 1, "bytes_from_store": 5000, "bytes_from_cache": 5000,
                      "evictions": 0, "corrupt": 0}
    assert len(_entries(tmp_path / "cache")) == 1 and not os.listdir(tmp_path / "cache" / "tmp")
    fresh = CachedStorage(inner, NodeCache(str(tmp_path / "cache"), 1 << 20))  # another process, same folder
    assert fresh.read_range(objects[0], 100, 5000, etag="e1") == first and len(inner.reads) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "zeroed", "empty"])
def test_a_corrupt_entry_is_named_removed_and_fetched_again(tmp_path, objects, caplog, damage):
    """A flipped byte or a cut-off entry fails its digest: a warning names the file, the store's bytes are
    returned (never the damaged ones), and the entry is written anew. Entries are not fsync'ed, so a crash
    of the machine can leave a renamed entry whose bytes never reached the disk (zeros, or nothing): the
    same."""
    inner, storage = _cached(tmp_path)
    want = storage.read_range(objects[1], 0, 10_000, etag="e1")
    (entry,) = _entries(tmp_path / "cache")
    raw = bytearray(open(entry, "rb").read())
    if damage == "flip":
        raw[-100] ^= 0xFF
    elif damage == "truncate":
        del raw[-10:]
    elif damage == "zeroed":
        raw = bytearray(len(raw))
    else:
        raw = bytearray()
    open(entry, "wb").write(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="raydl.storage.cache"):
        got = storage.read_range(objects[1], 0, 10_000, etag="e1")
    assert got == want and len(inner.reads) == 2
    assert any(entry in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    assert storage.counts.take()["corrupt"] == 1
    assert storage.read_range(objects[1], 0, 10_000, etag="e1") == want and len(inner.reads) == 2  # whole again


def _killed_writer(root: str, uri: str, ready) -> None:
    """Stream an object into the cache, and stop (forever) after its first piece: the parent kills us."""
    storage = CachedStorage(CountingStorage(), NodeCache(root, 1 << 20))

    def pieces(chunk):
        it = storage.stream(uri, etag="e1", chunk=chunk)
        yield next(it)
        ready.set()
        time.sleep(60)
        yield from it

    for _ in pieces(1000):
        pass


def test_a_writer_killed_mid_write_leaves_no_entry_and_its_temp_file_is_cleaned(tmp_path, objects):
    """SIGKILL in the middle of an entry's write: no entry is visible (the next read is a miss and reads the
    store), and the next process that opens the cache removes the dead writer's temporary file."""
    root = str(tmp_path / "cache")
    ready = _FORK.Event()
    child = _FORK.Process(target=_killed_writer, args=(root, objects[2], ready))
    child.start()
    assert ready.wait(20)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    tmp = tmp_path / "cache" / "tmp"
    assert len(os.listdir(tmp)) == 1 and _entries(tmp_path / "cache") == []  # half-written, never published
    inner = CountingStorage()
    storage = CachedStorage(inner, NodeCache(root, 1 << 20))
    assert b"".join(storage.stream(objects[2], etag="e1")) == open(objects[2], "rb").read()
    assert len(inner.reads) == 1 and os.listdir(tmp) == []  # the dead writer's file is gone
    assert b"".join(storage.stream(objects[2], etag="e1")) == open(objects[2], "rb").read()
    assert len(inner.reads) == 1  # and the whole object is an entry now


def _fill(root: str, uris: list[str], seed: int) -> list[bool]:
    """Read every uri's halves through the cache, in an order of our own; whether each read was right."""
    import random

    storage = CachedStorage(CountingStorage(), NodeCache(root, 1 << 20))
    todo = [(u, off) for u in uris for off in (0, 5000)]
    random.Random(seed).shuffle(todo)
    ok = []
    for _ in range(3):
        for u, off in todo:
            ok.append(storage.read_range(u, off, 5000, etag="e1") == open(u, "rb").read()[off:off + 5000])
    return ok


def test_two_processes_filling_one_cache_at_once_agree(tmp_path, objects):
    """Two processes reading the same ranges through one cache folder at once: every read is right, each
    entry exists once and verifies, the recorded total is the folder's, and no temporary file is left."""
    root = str(tmp_path / "cache")
    with _FORK.Pool(2) as pool:
        results = pool.starmap(_fill, [(root, objects, 1), (root, objects, 2)])
    assert all(all(r) for r in results)
    cache = NodeCache(root, 1 << 20)
    entries = _entries(tmp_path / "cache")
    assert len(entries) == 2 * len(objects)
    assert all(cache.get(u, "e1", off, 5000) == open(u, "rb").read()[off:off + 5000]
               for u in objects for off in (0, 5000))
    info = cache.info()
    assert open(tmp_path / "cache" / "state").read().split()[0] == str(info["bytes"])
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_eviction_keeps_the_total_under_max_bytes_least_recently_used_first(tmp_path, objects):
    """With room for three entries, a fourth evicts the least recently used one (not the oldest written:
    a hit makes an entry recent), and the total never passes max_bytes."""
    probe = NodeCache(str(tmp_path / "probe"), 1 << 20)
    probe.put(objects[0], "e1", 0, 10_000, b"x" * 10_000)
    size = probe.info()["bytes"]  # one entry's bytes on disk, header included
    inner, storage = _cached(tmp_path, max_bytes=int(3.5 * size))
    for i in range(3):
        storage.read_range(objects[i], 0, 10_000, etag="e1")
        time.sleep(0.02)  # distinct mtimes on any file system
    storage.read_range(objects[0], 0, 10_000, etag="e1")  # a hit: object 0 is now the most recent
    time.sleep(0.02)
    storage.read_range(objects[3], 0, 10_000, etag="e1")
    assert storage.counts.take()["evictions"] == 1
    cache = storage.cache
    assert cache.get(objects[1], "e1", 0, 10_000) is None  # the least recently used went
    assert all(cache.get(objects[i], "e1", 0, 10_000) is not None for i in (0, 2, 3))
    assert cache.info()["bytes"] <= cache.max_bytes
    too_big = NodeCache(str(tmp_path / "small"), 1000)
    assert too_big.put(objects[0], "e1", 0, 10_000, b"x" * 10_000) is None and too_big.info()["entries"] == 0


def test_a_write_past_the_high_water_mark_returns_while_its_pass_runs_on_its_own_thread(
    tmp_path, objects, monkeypatch
):
    """The write that takes the total past HIGH_WATER is in and returns before the pass it starts ends (the
    pass reads the whole folder: a batch waiting for its cache writes would wait for it); the pass then
    frees down to LOW_WATER, and its evictions are counted by the next take."""
    from raydl.storage import cache_evict
    from raydl.storage.node_cache import HIGH_WATER, LOW_WATER

    probe = NodeCache(str(tmp_path / "probe"), 1 << 20)
    probe.put(objects[0], "e1", 0, 10_000, b"x" * 10_000)
    size = probe.info()["bytes"]
    inner, storage = _cached(tmp_path, max_bytes=int(size * 8 / (HIGH_WATER + 0.01)))  # the 8th passes it
    started, release = threading.Event(), threading.Event()
    real = cache_evict.evict

    def held(*args, **kwargs):
        started.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_evict, "evict", held)
    for i in range(7):
        storage.read_range(objects[i], 0, 10_000, etag="e1")
        time.sleep(0.02)  # distinct mtimes on any file system
    assert not started.is_set()
    storage.read_range(objects[7], 0, 10_000, etag="e1")  # returns with the pass held in evict()
    assert started.wait(30) and storage.cache.info()["entries"] == 8
    assert storage.cache.wait_for_eviction(timeout=0.01) is False  # the pass is still running
    release.set()
    assert storage.cache.wait_for_eviction(timeout=30)
    info = storage.cache.info()
    assert info["bytes"] <= LOW_WATER * storage.cache.max_bytes and info["entries"] < 8
    assert storage.take_cache_counts()["evictions"] == 8 - info["entries"]
    assert storage.cache.get(objects[7], "e1", 0, 10_000) is not None  # the newest stays
    assert storage.take_cache_counts()["evictions"] == 0  # counted once


def test_a_new_etag_never_gets_the_old_bytes_and_removes_them(tmp_path, objects):
    """An object read under a new etag (rewritten in the store) is a miss read from the store, and its old
    etag's entries are removed then."""
    inner, storage = _cached(tmp_path)
    storage.read_range(objects[4], 0, 1000, etag="old")
    storage.read_range(objects[4], 1000, 1000, etag="old")
    assert len(_entries(tmp_path / "cache")) == 2
    storage.read_range(objects[4], 0, 1000, etag="new")
    assert len(inner.reads) == 3 and storage.counts.take()["evictions"] == 2
    assert len(_entries(tmp_path / "cache")) == 1
    assert storage.cache.get(objects[4], "old", 0, 1000) is None


def _full_disk(root: str, uris: list[str]) -> tuple[list[bool], list[str]]:
    """Read through the cache with RLIMIT_FSIZE (EFBIG on any write past 4 KB, as a full disk's ENOSPC):
    whether each read was right, and the cache's warnings."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of failing the write
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("raydl.storage.cache").addHandler(Keep())
    storage = CachedStorage(CountingStorage(), NodeCache(root, 1 << 20))
    ok = [storage.read_range(u, 0, 10_000, etag="e1") == open(u, "rb").read() for u in uris for _ in range(2)]
    return ok, messages


def test_a_full_disk_mid_write_abandons_the_entry_reads_the_store_and_warns_once(tmp_path, objects):
    """Writes that fail (EFBIG under RLIMIT_FSIZE, which works as root too) leave no entry and no temp file;
    every read still returns the store's bytes, and the process warns once, naming the folder."""
    root = str(tmp_path / "cache")
    with _FORK.Pool(1) as pool:
        ok, messages = pool.apply(_full_disk, (root, objects[:4]))
    assert ok == [True] * 8
    assert len(messages) == 1 and root in messages[0] and "File too large" in messages[0]
    assert _entries(tmp_path / "cache") == [] and os.listdir(tmp_path / "cache" / "tmp") == []


def test_an_unusable_folder_fails_the_check_even_as_root(tmp_path):
    """A cache path under a regular file cannot be made by anyone, root included: the check raises OSError."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        check_cache_folder(str(tmp_path / "file" / "sub"))
    check_cache_folder(str(tmp_path / "ok"))
    assert os.listdir(tmp_path / "ok" / "tmp") == []


def test_info_and_clear(tmp_path, objects):
    """info() counts entries and bytes and knows max_bytes and the use times; clear() empties the folder."""
    _, storage = _cached(tmp_path, max_bytes=123_456)
    for u in objects[:3]:
        storage.read_range(u, 0, 100, etag="e1")
    info = storage.cache.info()
    assert info["entries"] == 3 and info["max_bytes"] == 123_456 and info["oldest"] <= info["newest"]
    assert storage.cache.clear() == 3
    assert storage.cache.info()["entries"] == 0 and _entries(tmp_path / "cache") == []


def test_cache_options_are_validated():
    """Cache needs a non-empty path and a positive int max_bytes; LoaderConfig.cache takes only a Cache."""
    assert LoaderConfig(batch_size=1, cache=Cache("/tmp/x", max_bytes=10)).cache.max_bytes == 10
    for bad in ({"path": "", "max_bytes": 1}, {"path": "/x", "max_bytes": 0}, {"path": "/x", "max_bytes": "1G"}):
        with pytest.raises(ValueError, match="Cache"):
            Cache(**bad)
    with pytest.raises(ValueError, match="raydl.Cache"):
        LoaderConfig(batch_size=1, cache={"path": "/x", "max_bytes": 1})
