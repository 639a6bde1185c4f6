"""The node cache's trust boundary and its bounded eviction (raydl/storage/cache_folder.py, cache_evict.py),
on real files without Ray: only its own files, never through a link, private modes, a store's own entries,
and eviction's work under the lock."""
from __future__ import annotations

import fcntl
import grp
import json
import logging
import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import xxhash

from raydl.cli import main
from raydl.options import Cache
from raydl.storage.base import BaseStorage
from raydl.storage.cache import CachedStorage, NodeCache, check_cache_folder, node_cache, with_node_cache

pytestmark = pytest.mark.timeout(60)

OLD = time.time() - 7200  # two hours ago: past the hour after which a temporary file counts as abandoned


@pytest.fixture
def umask022():
    """The common umask (022), whatever the test runner's."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def no_fsync(monkeypatch):
    """fsync made a no-op in this process: tests that write thousands of entries do not wait for the disk."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def _old_file(path: Path, text: str = "mine") -> Path:
    path.write_text(text)
    os.utime(path, (OLD, OLD))
    return path


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "entries").rglob("*") if p.is_file() and not p.is_symlink())


def _uri_hash(uri: str) -> str:
    import hashlib

    return hashlib.blake2b(uri.encode(), digest_size=12).hexdigest()


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# -- part 3: only its own files, never through a link ------------------------------------------------------


def test_tmp_cleanup_removes_only_the_caches_own_abandoned_temporary_files(tmp_path):
    """Opening a cache removes an abandoned temporary file of its own naming, and leaves a file of any other
    name in PATH/tmp, however old."""
    root = tmp_path / "cache"
    (root / "tmp").mkdir(parents=True)
    notes = _old_file(root / "tmp" / "experiment-notes.txt")
    other = _old_file(root / "tmp" / "1-2-not-ours.tmp")
    abandoned = _old_file(root / "tmp" / f"1-{os.getpid()}-{'0' * 16}.tmp")
    NodeCache(str(root), 1 << 20).put("s3://b/k", "e", 0, 10, b"x" * 10)
    assert notes.read_text() == "mine" and other.exists()
    assert not abandoned.exists()


def test_a_linked_tmp_folder_is_refused_naming_it_and_nothing_behind_it_is_touched(tmp_path):
    """PATH/tmp a symbolic link: the folder check and every use of the cache refuse it with a PermissionError
    naming it, and the files behind the link, abandoned-looking or not, stay."""
    root, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    elsewhere.mkdir()
    behind = [_old_file(elsewhere / "experiment-notes.txt"), _old_file(elsewhere / f"1-1-{'a' * 16}.tmp")]
    root.mkdir()
    (root / "tmp").symlink_to(elsewhere)
    link = re.escape(repr(str(root / "tmp")))
    with pytest.raises(PermissionError, match=f"node cache folder {link} is a symbolic link"):
        check_cache_folder(str(root))
    with pytest.raises(PermissionError, match=link):
        NodeCache(str(root), 1 << 20).info()
    code = main(["cache", "clear", str(root)])
    assert all(p.exists() and p.read_text() == "mine" for p in behind) and code == 2


def test_a_linked_entry_folder_is_never_walked_by_eviction_or_clear(tmp_path, capsys, caplog):
    """PATH/entries/<x> a symbolic link to a folder of files named like entries: eviction and `raydl cache
    clear` refuse it, naming it, and delete nothing behind it; a read through it is a miss."""
    root, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache = NodeCache(str(root), 1 << 20)
    cache.put("s3://b/k", "e", 0, 10, b"x" * 10)
    shard = _uri_hash("s3://b/k0")[:3]  # entries/<x>: the first three hex digits of the URI's hash
    behind = [_old_file(elsewhere / "experiment-notes.txt")]
    behind += [_old_file(elsewhere / f"{shard}{'0' * 21}-{'1' * 16}-{'2' * 16}-0-{i}") for i in range(5)]
    for old in (root / "entries").iterdir():
        if old.name == shard:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    (root / "entries" / shard).symlink_to(elsewhere)
    code = main(["cache", "clear", str(root)])
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(p.name for p in behind)  # nothing deleted
    assert code == 2 and repr(str(root / "entries" / shard)) in capsys.readouterr().err
    small = NodeCache(str(root), 300)
    with caplog.at_level(logging.WARNING, logger="raydl.storage.cache"):
        for i in range(6):  # past max_bytes: eviction runs, and refuses the link
            small.put(f"s3://b/other{i}", "e", 0, 50, b"y" * 50)
        assert small.get("s3://b/k0", "e", 0, 10) is None
    assert any(str(root / "entries" / shard) in r.getMessage() for r in caplog.records)
    assert all(p.read_text() == "mine" for p in behind) and len(list(elsewhere.iterdir())) == 6


def test_an_entry_that_is_a_link_is_neither_followed_nor_removed(tmp_path):
    """An entry's name holding a symbolic link (to a file outside): a read is a miss that never opens the
    target, and clear and eviction leave the link and its target."""
    root = tmp_path / "cache"
    cache = NodeCache(str(root), 1 << 20)
    cache.put("s3://b/k", "e", 0, 5, b"right")
    (entry,) = _entries(root)
    target = _old_file(tmp_path / "secret.txt", "secret")
    entry.unlink()
    entry.symlink_to(target)
    assert cache.get("s3://b/k", "e", 0, 5) is None
    assert cache.clear() == 0
    assert entry.is_symlink() and target.read_text() == "secret"


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    """A cache folder owned by another user (here: this process pretending to be uid 4242) is refused with a
    PermissionError naming it, before anything in it is read or removed."""
    root = tmp_path / "cache"
    NodeCache(str(root), 1 << 20).put("s3://b/k", "e", 0, 5, b"bytes")
    notes = _old_file(root / "tmp" / f"1-1-{'b' * 16}.tmp")
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(PermissionError, match=f"node cache folder {re.escape(repr(str(root)))} belongs to uid"):
        check_cache_folder(str(root))
    with pytest.raises(PermissionError, match="not to this user"):
        NodeCache(str(root), 1 << 20).clear()
    assert notes.exists() and len(_entries(root)) == 1


# -- part 4: private unless shared on purpose --------------------------------------------------------------


def test_a_private_cache_is_0700_and_0600_under_umask_022(tmp_path, umask022):
    """Under umask 022 every folder of a cache is 0700 and every file 0600: no other user reads its bytes."""
    root = tmp_path / "cache"
    check_cache_folder(str(root))
    NodeCache(str(root), 1 << 20).put("s3://b/k", "e", 0, 5, b"bytes")
    (entry,) = _entries(root)
    folders = [root, root / "entries", root / "tmp", entry.parent]
    assert [oct(_mode(p)) for p in folders] == [oct(0o700)] * 4
    assert [oct(_mode(p)) for p in (entry, root / "lock", root / "state")] == [oct(0o600)] * 3


def test_a_cache_folder_left_readable_is_made_private_again(tmp_path, umask022):
    """A folder made 0755 (by hand, or by an older raydl) is made 0700 when the cache opens it."""
    root = tmp_path / "cache"
    for sub in ("", "entries", "tmp"):
        (root / sub).mkdir(exist_ok=True, mode=0o755)
        os.chmod(root / sub, 0o755)
    NodeCache(str(root), 1 << 20).info()
    assert [_mode(root / s) for s in ("", "entries", "tmp")] == [0o700] * 3


def _a_group() -> str:
    return grp.getgrgid(os.getegid()).gr_name


def test_a_shared_cache_is_its_groups_2770_and_0660(tmp_path, umask022):
    """Cache(..., group=G): folders 2770 and files 0660, all of group G, readable by the next member who
    opens it (here, a second NodeCache through with_node_cache)."""
    group = _a_group()
    root = tmp_path / "shared"
    cache = Cache(str(root), max_bytes=1 << 20, group=group)
    check_cache_folder(cache.path, group)
    NodeCache(cache.path, cache.max_bytes, group).put("s3://b/k", "e", 0, 5, b"bytes")
    (entry,) = _entries(root)
    gid = grp.getgrnam(group).gr_gid
    for folder in (root, root / "entries", root / "tmp", entry.parent):
        assert _mode(folder) == 0o2770 and os.lstat(folder).st_gid == gid
    for f in (entry, root / "lock", root / "state"):
        assert _mode(f) == 0o660 and os.lstat(f).st_gid == gid
    wrapped = with_node_cache(_Store("far", {}), cache)
    assert wrapped.cache is node_cache(cache.path, cache.max_bytes, group)
    assert wrapped.cache.get("s3://b/k", "e", 0, 5, store="") == b"bytes"


def test_a_shared_cache_refuses_a_folder_open_to_others_or_of_another_group(tmp_path, monkeypatch):
    """A shared cache opened on a folder that is another user's and open to everyone, or of another group,
    is refused with a PermissionError naming it; a private cache refuses a group's folder of another user."""
    group = _a_group()
    root = tmp_path / "shared"
    check_cache_folder(str(root), group)
    os.chmod(root, 0o2777)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # someone else made it
    with pytest.raises(PermissionError, match=f"{re.escape(repr(str(root)))} has mode 2777"):
        check_cache_folder(str(root), group)
    os.chmod(root, 0o2770)
    check_cache_folder(str(root), group)  # now fine: a member's folder, closed to others
    with pytest.raises(PermissionError, match="not to this user"):
        check_cache_folder(str(root))
    with pytest.raises(PermissionError, match="which this node does not have"):
        check_cache_folder(str(root), "no-such-group-raydl")
    if os.getuid() == 0:  # only root can give a folder to a group it is not in
        os.chown(root, -1, os.getegid() + 1)
        with pytest.raises(PermissionError, match="not to the cache's group"):
            check_cache_folder(str(root), group)


def test_cache_group_is_validated_and_the_config_takes_it(tmp_path):
    """Cache(group=) takes None or a group's name (anything else is a ValueError naming Cache.group), and a
    YAML config's `loader.cache: {group: ...}` builds it; Cache(path, max_bytes) is still private."""
    from raydl.config import load_config

    assert Cache("/c", max_bytes=1).group is None
    assert Cache("/c", 1, group="ml").group == "ml"
    for bad in ("", " ml", 5):
        with pytest.raises(ValueError, match="Cache.group must be None or a group's name"):
            Cache("/c", max_bytes=1, group=bad)
    path = tmp_path / "c.yaml"
    path.write_text("source: {kind: images, path: /x}\n"
                    "loader: {batch_size: 8, cache: {path: /c, max_bytes: 1024, group: ml}}\n")
    assert load_config(path).loader.cache == Cache("/c", max_bytes=1024, group="ml")


# -- part 5: a store's bytes for that store only -----------------------------------------------------------


@dataclass(frozen=True)
class _Store(BaseStorage):
    """An object store in memory at an endpoint of its own: {uri: bytes}, every read counted."""

    endpoint: str
    objects: dict = field(hash=False)
    reads: list = field(default_factory=list, hash=False, compare=False)
    default_io_concurrency: int = 1

    @property
    def identity(self) -> str:
        return f"http://{self.endpoint}"

    def read_range(self, uri, offset, length, *, etag=None):
        self.reads.append((uri, offset, length))
        return self.objects[uri][offset : offset + length]

    def stream(self, uri, *, etag=None, chunk=8 << 20):
        self.reads.append((uri, 0, len(self.objects[uri])))
        yield self.objects[uri]


def test_two_stores_with_one_bucket_name_never_get_each_others_bytes(tmp_path):
    """Two stores (two endpoints) hold s3://b/k under the same etag with other bytes: through one cache
    folder each is served its own, ranges and whole objects, and each store is read once."""
    root = str(tmp_path / "cache")
    a = _Store("store-a:9000", {"s3://b/k": b"A" * 100})
    b = _Store("store-b:9000", {"s3://b/k": b"B" * 100})
    ca, cb = CachedStorage(a, NodeCache(root, 1 << 20)), CachedStorage(b, NodeCache(root, 1 << 20))
    assert ca.read_range("s3://b/k", 0, 50, etag="same") == b"A" * 50
    assert cb.read_range("s3://b/k", 0, 50, etag="same") == b"B" * 50
    assert b"".join(ca.stream("s3://b/k", etag="same")) == b"A" * 100
    assert b"".join(cb.stream("s3://b/k", etag="same")) == b"B" * 100
    for _ in range(2):
        assert ca.read_range("s3://b/k", 0, 50, etag="same") == b"A" * 50
        assert cb.read_range("s3://b/k", 0, 50, etag="same") == b"B" * 50
        assert b"".join(cb.stream("s3://b/k", etag="same")) == b"B" * 100
    assert len(a.reads) == len(b.reads) == 2 and len(_entries(tmp_path / "cache")) == 4
    assert ca.identity == "http://store-a:9000"


def _old_scheme_entry(root: Path, uri: str, etag: str, offset: int, data: bytes) -> Path:
    """An entry as the key scheme without the store wrote it (magic RAYDLC1, key [uri, etag, offset, length])."""
    import hashlib

    def h(text, n):
        return hashlib.blake2b(text.encode(), digest_size=n).hexdigest()

    key = json.dumps([uri, etag, offset, len(data)], separators=(",", ":")).encode()
    digest = xxhash.xxh3_128(key + data).digest()
    uh = h(uri, 12)
    path = root / "entries" / uh[:3] / f"{uh}-{h(etag, 8)}-{offset}-{len(data)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<8sIQ16s", b"RAYDLC1\n", len(key), len(data), digest) + key + data)
    return path


def test_entries_of_the_key_scheme_without_the_store_miss_and_are_evicted_as_usual(tmp_path):
    """An entry the store-less key scheme wrote is never served (a read goes to the store), counts in the
    folder's total, and goes first when room is needed (it is the least recently used)."""
    root = tmp_path / "cache"
    check_cache_folder(str(root))
    old = _old_scheme_entry(root, "s3://b/k", "e", 0, b"OLD" * 100)
    os.utime(old, (OLD, OLD))
    store = _Store("store", {"s3://b/k": b"NEW" * 100})
    probe = NodeCache(str(root), 1 << 20)
    assert probe.info()["entries"] == 1 and probe.get("s3://b/k", "e", 0, 300) is None
    cached = CachedStorage(store, NodeCache(str(root), 3 * old.stat().st_size))  # room for two of the three
    assert cached.read_range("s3://b/k", 0, 300, etag="e") == b"NEW" * 100 and len(store.reads) == 1
    assert old.exists()
    cached.read_range("s3://b/k", 0, 299, etag="e")  # past the high-water mark: a pass, the old entry goes
    assert cached.cache.wait_for_eviction(timeout=60)
    assert not old.exists() and cached.take_cache_counts()["evictions"] == 1
    assert cached.read_range("s3://b/k", 0, 300, etag="e") == b"NEW" * 100 and len(store.reads) == 2


# -- part 6: eviction's work under the lock is bounded -----------------------------------------------------


def _fill(root: Path, n: int, size: int = 50) -> NodeCache:
    """n entries of `size` bytes, the i-th used i seconds after the first (distinct, known recency)."""
    cache = NodeCache(str(root), 1 << 40)
    for i in range(n):
        cache.put(f"s3://b/k{i}", "e", 0, size, bytes([i % 251]) * size)
    t0 = time.time() - 10 * n
    for i in range(n):
        os.utime(cache.entry_path(f"s3://b/k{i}", "e", 0, size), (t0 + i, t0 + i))
    return cache


class _LockWatch:
    """Counts what this process does while it holds the cache's lock file (PATH/lock): removals, and
    listings of any folder (os.scandir, os.listdir)."""

    def __init__(self, monkeypatch, root: Path) -> None:
        self.lock_ino = None
        self.root = root
        self.held: int | None = None
        self.unlinks: list[int] = []
        self.listings = 0
        self.holds = 0
        real_flock, real_close, real_unlink = fcntl.flock, os.close, os.unlink
        real_scandir, real_listdir = os.scandir, os.listdir

        def flock(fd, op):
            real_flock(fd, op)
            if op == fcntl.LOCK_EX and self._is_lock(fd):
                self.held, self.holds = fd, self.holds + 1
                self.unlinks.append(0)

        def close(fd):
            if fd == self.held:
                self.held = None
            real_close(fd)

        def unlink(*a, **kw):
            real_unlink(*a, **kw)
            if self.held is not None:
                self.unlinks[-1] += 1

        def listing(real):
            def call(*a, **kw):
                if self.held is not None:
                    self.listings += 1
                return real(*a, **kw)

            return call

        monkeypatch.setattr(fcntl, "flock", flock)
        monkeypatch.setattr(os, "close", close)
        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "scandir", listing(real_scandir))
        monkeypatch.setattr(os, "listdir", listing(real_listdir))

    def _is_lock(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(self.root / "lock")
        except OSError:
            return False


def test_eviction_lists_no_folder_and_removes_a_bounded_number_of_entries_per_hold_of_the_lock(
    tmp_path, monkeypatch, no_fsync
):
    """A write into a full cache of 3,000 entries evicts about 300, least recently used first, without listing
    any folder while it holds the node-wide lock and removing at most 64 entries per hold: another writer
    never waits for work that grows with the cache."""
    root = tmp_path / "cache"
    _fill(root, 3000)
    total = NodeCache(str(root), 1 << 40).info()["bytes"]
    full = NodeCache(str(root), total)
    watch = _LockWatch(monkeypatch, root)
    evicted = full.put("s3://b/new", "e", 0, 50, b"n" * 50)
    monkeypatch.undo()
    assert evicted is not None and 250 <= evicted <= 400
    assert watch.listings == 0 and max(watch.unlinks) <= 64 and watch.holds > evicted // 64
    left = {p.name for p in _entries(root)}
    assert not any(full.entry_path(f"s3://b/k{i}", "e", 0, 50).rsplit("/", 1)[1] in left for i in range(250))
    assert all(full.entry_path(f"s3://b/k{i}", "e", 0, 50).rsplit("/", 1)[1] in left for i in range(400, 3000))
    info = full.info()
    assert info["bytes"] <= 0.9 * total and int((root / "state").read_text().split()[0]) == info["bytes"]


def test_a_large_cache_is_evicted_by_a_sampled_cutoff_close_to_least_recently_used(tmp_path, monkeypatch, no_fsync):
    """Past the sample's size (made 200 entries here), a pass removes the entries used before a cutoff estimated
    from whole shards: the total ends at the target, and every entry of the newest 80% is kept."""
    import random

    from raydl.storage import cache_evict

    monkeypatch.setattr(cache_evict, "SAMPLE", 200)
    monkeypatch.setattr(cache_evict.random, "shuffle", random.Random(7).shuffle)
    root = tmp_path / "cache"
    _fill(root, 2000)
    total = NodeCache(str(root), 1 << 40).info()["bytes"]
    full = NodeCache(str(root), total)
    assert full.put("s3://b/new", "e", 0, 50, b"n" * 50) > 0
    left = {p.name for p in _entries(root)}
    assert all(full.entry_path(f"s3://b/k{i}", "e", 0, 50).rsplit("/", 1)[1] in left for i in range(400, 2000))
    assert full.info()["bytes"] <= 0.9 * total + 200


def test_a_ledger_that_counts_too_much_is_set_right_by_a_walk_of_the_folder(tmp_path, no_fsync):
    """A ledger above the folder's bytes (a writer killed between its ledger write and its rename) is set
    from the folder by the next pass that walks it all, instead of evicting everything."""
    root = tmp_path / "cache"
    _fill(root, 50)
    true_total = NodeCache(str(root), 1 << 40).info()["bytes"]
    (root / "state").write_text(f"{10 * true_total} {2 * true_total} 0\n")
    cache = NodeCache(str(root), 2 * true_total)
    assert cache.put("s3://b/new", "e", 0, 50, b"n" * 50) == 0
    info = cache.info()
    assert info["entries"] == 51 and int((root / "state").read_text().split()[0]) == info["bytes"]


def test_a_write_that_does_not_fit_while_another_process_evicts_waits_then_is_left_out(tmp_path, monkeypatch):
    """While another process holds the eviction claim (PATH/evicting), a write that does not fit waits up to
    ROOM_WAIT_S for room, then is left out (None) with no temporary file left; once the claim is free the
    write evicts for itself and is kept."""
    from raydl.storage import node_cache as nc

    monkeypatch.setattr(nc, "ROOM_WAIT_S", 0.3)
    root = tmp_path / "cache"
    cache = NodeCache(str(root), 400)
    for i in range(3):
        cache.put(f"s3://b/k{i}", "e", 0, 50, b"x" * 50)
    full = NodeCache(str(root), cache.info()["bytes"])
    fd = os.open(root / "evicting", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: to flock, another process
    t0 = time.monotonic()
    assert full.put("s3://b/new", "e", 0, 50, b"n" * 50) is None
    assert 0.3 <= time.monotonic() - t0 < 5 and os.listdir(root / "tmp") == []
    os.close(fd)
    assert full.put("s3://b/new", "e", 0, 50, b"n" * 50) >= 1
    assert full.get("s3://b/new", "e", 0, 50, store="") == b"n" * 50


# -- the messages, as docs/errors.md quotes them -----------------------------------------------------------


def test_the_refusals_are_worded_as_docs_errors_md_says(tmp_path, monkeypatch):
    """Each refusal's text (a link, another user's folder, a shared folder open to others) matches a message
    docs/errors.md quotes, `…` standing for the path and numbers."""
    doc = (Path(__file__).parents[2] / "docs" / "errors.md").read_text()
    quoted = [m.group(1) for m in re.finditer(r"`(PermissionError: node cache folder [^`]+)`", doc)]

    def raised(call) -> str:
        with pytest.raises(PermissionError) as info:
            call()
        return f"PermissionError: {info.value}"

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    got = [raised(lambda: check_cache_folder(str(tmp_path / "link")))]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "tmp").write_text("x")
    got.append(raised(lambda: check_cache_folder(str(tmp_path / "c"))))
    got.append(raised(lambda: check_cache_folder(str(tmp_path / "s"), "no-such-group-raydl")))
    check_cache_folder(str(tmp_path / "o"))
    check_cache_folder(str(tmp_path / "g"), _a_group())
    os.chmod(tmp_path / "g", 0o2775)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    got.append(raised(lambda: check_cache_folder(str(tmp_path / "o"))))
    got.append(raised(lambda: check_cache_folder(str(tmp_path / "g"), _a_group())))
    for text in got:
        pattern = [q for q in quoted if re.fullmatch(".*?".join(map(re.escape, q.split("…"))), text, re.S)]
        assert pattern, f"docs/errors.md quotes no message like {text!r}"


def test_the_ledger_is_rewritten_in_place_as_one_record_that_covers_what_was_there(tmp_path):
    """Each put rewrites the ledger through the descriptor it was read from (same file, no temporary ledger):
    one 64-byte record, which replaces a longer ledger whole (nothing of it may follow the record), and which
    readers that split on whitespace read as before."""
    root = tmp_path / "cache"
    cache = NodeCache(str(root), 1 << 30)
    assert cache.put("s3://b/a", "e", 0, 50, b"a" * 50) == 0
    state = root / "state"
    inode = state.stat().st_ino
    state.write_bytes(state.read_bytes().rstrip() + b" " + b"9" * 200 + b"\n")  # longer, trailing junk
    assert cache.put("s3://b/b", "e", 0, 50, b"b" * 50) == 0
    raw = state.read_bytes()
    assert state.stat().st_ino == inode and len(raw) == 64 and raw.endswith(b"\n")
    total, max_bytes, added = (int(v) for v in raw.split())
    assert total == cache.info()["bytes"] == added and max_bytes == 1 << 30
    assert not any((root / "tmp").iterdir())


def test_a_ledger_whose_numbers_do_not_fit_the_record_is_replaced_by_a_new_file(tmp_path):
    """Numbers too long for the in-place record (a crafted ledger) are written as a new ledger renamed into
    place, never torn; and a ledger that is a link is replaced, not followed."""
    root = tmp_path / "cache"
    cache = NodeCache(str(root), 1 << 30)
    assert cache.put("s3://b/a", "e", 0, 50, b"a" * 50) == 0
    state = root / "state"
    state.write_text(f"1 {1 << 30} {10**70}\n")
    inode = state.stat().st_ino
    assert cache.put("s3://b/b", "e", 0, 50, b"b" * 50) == 0
    parts = state.read_text().split()
    assert state.stat().st_ino != inode and int(parts[2]) > 10**70 and int(parts[1]) == 1 << 30
    target = tmp_path / "elsewhere"
    target.write_text("5 5 5\n")
    state.unlink()
    state.symlink_to(target)
    assert cache.put("s3://b/c", "e", 0, 50, b"c" * 50) == 0
    assert target.read_text() == "5 5 5\n" and not state.is_symlink()
    # the link's numbers were not the folder's: the new ledger counts the folder's own bytes
    total, _max, _added = (int(v) for v in state.read_text().split())
    assert total == cache.info()["bytes"] and total >= 3 * 50


def test_a_hard_linked_or_missing_ledger_is_replaced_and_recounted(tmp_path):
    """A ledger with another name (a hard link, as `cp -al` of a warm cache leaves) is never written through:
    a new one is renamed over it and the other name keeps its bytes. A ledger removed while the cache runs
    is counted again from the folder under the lock, not restarted at 0 over a folder full of entries."""
    root = tmp_path / "cache"
    cache = NodeCache(str(root), 1 << 30)
    assert cache.put("s3://b/a", "e", 0, 50, b"a" * 50) == 0
    state = root / "state"
    other = tmp_path / "other-state"
    os.link(state, other)
    before = other.read_bytes()
    assert cache.put("s3://b/b", "e", 0, 50, b"b" * 50) == 0
    assert other.read_bytes() == before and state.stat().st_ino != other.stat().st_ino
    assert int(state.read_text().split()[0]) == cache.info()["bytes"]
    state.unlink()
    assert cache.put("s3://b/c", "e", 0, 50, b"c" * 50) == 0
    total = int(state.read_text().split()[0])
    assert total == cache.info()["bytes"] and cache.info()["entries"] == 3
    assert NodeCache(str(root), 1 << 30).info()["bytes"] == total  # another process's view agrees


def test_listings_of_one_folder_from_two_threads_at_once_each_see_every_shard(tmp_path):
    """A count of the folder (a lock holder replacing a lost ledger) while another thread lists its shards (an
    eviction pass): each listing goes through a descriptor of its own, so neither misses what the other
    read and the count is the folder's bytes every time."""
    import threading

    from raydl.storage.cache_folder import CacheFolder

    root = tmp_path / "cache"
    NodeCache(str(root), 1 << 30).put("s3://b/x", "e", 0, 1, b"x")  # makes the folder as a cache does
    for f in (root / "entries").iterdir():
        for e in f.iterdir():
            e.unlink()
        f.rmdir()
    shards = [f"{k:03x}" for k in range(1500)]
    for shard in shards:
        (root / "entries" / shard).mkdir(mode=0o700)
        name = f"{shard}{'0' * 21}-{'0' * 16}-{'0' * 16}-0-10"
        (root / "entries" / shard / name).write_bytes(b"0123456789")
        os.chmod(root / "entries" / shard / name, 0o600)
    folder = CacheFolder(str(root))
    try:
        stop = threading.Event()
        wrong = []

        def lister():
            while not stop.is_set():
                if len(folder.shards()) != len(shards):
                    wrong.append("shards")

        t = threading.Thread(target=lister)
        t.start()
        try:
            for _ in range(15):
                total = sum(size for _, size, _, _ in folder.scan())
                if total != 10 * len(shards):
                    wrong.append(total)
        finally:
            stop.set()
            t.join()
        assert not wrong, wrong[:5]
    finally:
        folder.close()
