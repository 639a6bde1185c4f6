"""The node cache's books under concurrency: an eviction pass never sets the size ledger below the folder's
bytes (an entry written into a new shard folder while the pass starts is counted), the entries a write's own
pass removed are counted also when the write is then left out, and an entry that cannot be opened for want of
descriptors is a miss, not a corrupt entry to remove. Two NodeCache objects on one folder stand for two
processes (their locks exclude each other as processes' do)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from raydl.storage import cache_evict, cache_folder
from raydl.storage.node_cache import NodeCache

pytestmark = pytest.mark.timeout(60)

MAX = 100_000


def _real(cache: NodeCache) -> int:
    return sum(size for _, size, _, _ in cache._open().scan())


def test_a_pass_counts_an_entry_written_into_a_new_shard_as_it_starts(tmp_path, monkeypatch):
    """Another process's entry renamed into a shard folder that did not exist, between the pass's listing of
    the shards and its reading of the bytes added: the ledger after the pass still covers the folder's bytes
    (it came out 8,066 bytes short, and writers then filled the folder past max_bytes)."""
    a, b = NodeCache(str(tmp_path), MAX), NodeCache(str(tmp_path), MAX)
    for i in range(18):  # about 90 KB: past the high-water mark
        a.put(f"s3://b/o{i}", "e", 0, 5000, os.urandom(5000), store="S")
    assert a.wait_for_eviction(10)
    folder = a._open()
    existing = set(folder.shards())
    uri = next(f"s3://b/new{i}" for i in range(10**6) if a._names("S", f"s3://b/new{i}", "e", 0, 0)[0] not in existing)
    listed = cache_folder.CacheFolder.shards
    fired = []

    def shards(self):
        out = listed(self)
        if not fired:  # the other process writes right after this listing
            fired.append(1)
            t = threading.Thread(target=b.put, args=(uri, "e", 0, 8000, os.urandom(8000)), kwargs={"store": "S"})
            t.start()
            t.join()
        return out

    monkeypatch.setattr(cache_folder.CacheFolder, "shards", shards)
    a._evict(0.9 * MAX)
    monkeypatch.setattr(cache_folder.CacheFolder, "shards", listed)
    assert fired and folder.read_state()[0] >= _real(a), (folder.read_state(), _real(a))


def test_a_write_left_out_still_counts_the_entries_its_pass_removed(tmp_path, monkeypatch):
    """A write that does not fit runs a pass of its own; when other processes' writes take the room before
    it can use it, its entry is left out, and the entries the pass removed are counted all the same (by the
    next take_handed_on, which a scope's counters include): they were counted nowhere."""
    w, other = NodeCache(str(tmp_path), MAX), NodeCache(str(tmp_path), MAX)
    j = 0
    while other._open().read_state() is None or other._open().read_state()[0] + 5100 <= MAX:
        other.put(f"s3://b/p{j}", "e", 0, 5000, os.urandom(5000), store="S")
        j += 1
    other.wait_for_eviction(10)
    w.take_evicted_behind()
    w.take_handed_on()
    real_evict = cache_evict.evict
    seen = []

    def evict(folder, locked, target, **kw):
        n = real_evict(folder, locked, target, **kw)
        seen.append(n)
        k = 0  # meanwhile other processes' writers, which fit, take the room the pass made
        while other._open().read_state()[0] + 1100 <= MAX:
            other.put(f"s3://b/q{k}", "e", 0, 1000, os.urandom(1000), store="S")
            k += 1
        return n

    monkeypatch.setattr(cache_evict, "evict", evict)
    assert w.put("s3://b/big", "e", 0, 20000, os.urandom(20000), store="S") is None  # left out
    assert seen and seen[0] > 0
    assert w.take_handed_on()["evictions"] == seen[0]


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
from raydl.storage.node_cache import CacheCounts, NodeCache
c = NodeCache(sys.argv[1], 10**7)
data = os.urandom(4000)
c.put("s3://b/x", "e", 0, 4000, data, store="S")
counts = CacheCounts()
assert c.get("s3://b/x", "e", 0, 4000, counts, store="S") == data  # its shard folder's descriptor kept
path = c.entry_path("s3://b/x", "e", 0, 4000, store="S")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
got = c.get("s3://b/x", "e", 0, 4000, counts, store="S")
for fd in held:
    os.close(fd)
print(got is None, counts.peek()["corrupt"], os.path.exists(path),
      c.get("s3://b/x", "e", 0, 4000, counts, store="S") == data)
"""


def test_an_entry_that_cannot_be_opened_for_want_of_descriptors_is_a_miss_and_stays(tmp_path):
    """A process out of file descriptors (EMFILE) misses, and the entry is neither counted corrupt nor
    removed: the next read, with descriptors again, hits (it was counted corrupt and could be removed)."""
    proc = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(tmp_path / "c")], capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "0", "True", "True"], (proc.stdout, proc.stderr[-2000:])


def test_a_scope_no_batch_takes_hands_its_counts_to_the_next_take(tmp_path):
    """Reads ahead of need (a Parquet row group decoded before its batch) run in a scope of their own: its
    hand_on() leaves its counters to the next take of any scope of the cache, so they land in a batch's
    counts (they were dropped)."""
    from raydl.storage.cache import CachedStorage
    from raydl.storage.local import LocalStorage

    path = tmp_path / "blob"
    path.write_bytes(os.urandom(10_000))
    storage = CachedStorage(LocalStorage(), NodeCache(str(tmp_path / "c"), 10**7))
    ahead = storage.scoped()
    assert ahead.read_range(str(path), 0, 4000, etag="e") == path.read_bytes()[:4000]
    ahead.hand_on()
    batch = storage.scoped()
    got = batch.take_cache_counts()
    assert got["misses"] == 1 and got["bytes_from_store"] == 4000, got
    assert batch.take_cache_counts()["misses"] == 0  # counted once
