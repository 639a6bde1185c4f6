"""Listing a local image folder of many files: no file opened or read, the same catalog as listing object by
object, and progress on stderr once the listing runs past its threshold."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raydl.sources import images
from raydl.sources.images import list_image_folder
from raydl.storage.local import LocalStorage

pytestmark = pytest.mark.timeout(120)

CLASSES, PER_CLASS = 20, 1000  # 20,000 empty files: a few seconds to make, under a second to list

# Run in a child: an audit hook cannot be removed, and it sees every open() and os.open() of the process.
_LIST_WATCHED = r"""
import json, os, sys

root = sys.argv[1]
opened = []

def hook(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(root) and not os.path.isdir(args[0]):
        opened.append(args[0])

sys.addaudithook(hook)
from raydl.sources.images import list_image_folder

cat = list_image_folder(root)
print(json.dumps({"n": len(cat), "fingerprint": cat.fingerprint, "opened": opened[:5], "opens": len(opened)}))
"""


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """CLASSES folders of PER_CLASS files (empty, unreadable, but for one of 7 bytes per folder), and a
    non-image file in each folder."""
    root = tmp_path_factory.mktemp("many")
    for c in range(CLASSES):
        folder = root / f"n{c:08d}"
        folder.mkdir()
        for i in range(PER_CLASS):
            path = folder / f"n{c:08d}_{i}.JPEG"
            path.touch(mode=0)  # a read would fail (for a user other than root: the audit hook checks anyway)
        (folder / f"n{c:08d}_0.JPEG").write_bytes(b"notjpeg")
        (folder / "README.txt").write_bytes(b"not an image")
    return str(root)


def test_a_folder_of_many_files_is_listed_without_opening_any(many_files):
    """20,000 files list into 20,000 samples, and no file under the root is opened (directories only)."""
    out = subprocess.run(
        [sys.executable, "-c", _LIST_WATCHED, many_files],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n"] == CLASSES * PER_CLASS
    assert got["opens"] == 0, got["opened"]


class _OneByOne:
    """The local disk listed object by object (as S3 lists): LocalStorage without list_folders."""

    default_io_concurrency = 4

    def __init__(self) -> None:
        self._local = LocalStorage()

    def list(self, prefix):
        return self._local.list(prefix)

    def __getattr__(self, name):
        if name == "list_folders":
            raise AttributeError(name)
        return getattr(self._local, name)


def test_the_folder_listing_makes_the_same_catalog_as_one_object_at_a_time(many_files):
    """Listing folder by folder gives the catalog listing object by object gives: same rows, sizes, labels
    and both fingerprints (resume states carry them)."""
    fast = list_image_folder(many_files)
    slow = list_image_folder(many_files, storage=_OneByOne())
    assert (fast.fingerprint, fast.samples_fingerprint) == (slow.fingerprint, slow.samples_fingerprint)
    assert fast.shards.equals(slow.shards) and fast.parts.equals(slow.parts)
    assert fast.classes == slow.classes
    sizes = fast.shards.column("size").to_pylist()
    assert sizes.count(7) == CLASSES and sizes.count(0) == CLASSES * (PER_CLASS - 1)
    uris = fast.shards.column("uri").to_pylist()
    assert uris == sorted(uris) and uris[0] == os.path.join(many_files, "n00000000", "n00000000_0.JPEG")


def test_odd_names_and_loose_files_list_as_one_object_at_a_time(tmp_path):
    """Names the fast path hands back to the per-object one (a backslash), names out of order across folders
    ("a.b" sorts before "a/"), non-ASCII names and upper-case extensions: the same catalog either way."""
    for rel in ["a/1.jpg", "a.b/2.PNG", "a/sub/3.jpeg", "ü/4.webp", "back\\slash/5.jpg", "c/6.bmp", "c/7.txt"]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * len(rel))
    fast = list_image_folder(str(tmp_path))
    slow = list_image_folder(str(tmp_path), storage=_OneByOne())
    assert len(fast) == 6
    assert (fast.fingerprint, fast.samples_fingerprint) == (slow.fingerprint, slow.samples_fingerprint)
    assert fast.shards.equals(slow.shards) and fast.parts.equals(slow.parts) and fast.classes == slow.classes
    (tmp_path / "loose.jpg").write_bytes(b"x")
    with pytest.raises(Exception, match="loose.jpg"):
        list_image_folder(str(tmp_path))
    assert len(list_image_folder(str(tmp_path), labels=None)) == 7


def test_a_listing_past_its_threshold_shows_progress(many_files, monkeypatch, capsys):
    """Under the threshold a listing prints nothing; past it (the threshold set to 0 here, 2 s by default)
    it prints the count of files so far and the count it ended at, for both listing paths."""
    list_image_folder(many_files)
    assert "listing" not in capsys.readouterr().err
    monkeypatch.setattr(images, "_PROGRESS_AFTER_S", 0.0)
    for storage in (None, _OneByOne()):
        list_image_folder(many_files, storage=storage)
        err = capsys.readouterr().err
        assert f"listing {many_files}: " in err
        assert f"{CLASSES * PER_CLASS:,} files" in err and "done" in err


def test_links_fifos_deep_trees_and_names_that_are_not_utf8(tmp_path, caplog):
    """A link loop and a second link to a listed folder are listed once (a warning names them); a FIFO is left
    out with a warning (a read of it would wait for a writer); a tree deeper than MAX_DEPTH and a file name
    that is not UTF-8 are DataSourceErrors naming the path."""
    import logging
    import time

    from raydl.errors import DataSourceError
    from raydl.storage import local

    root = tmp_path / "ds"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "a.jpg").write_bytes(b"x")
    (root / "cat" / "loop").symlink_to(root / "cat")  # cat/loop/loop/... forever through os.walk's links
    (root / "dog").symlink_to(root / "cat")  # the same folder under another name
    os.mkfifo(root / "cat" / "pipe.jpg")
    with caplog.at_level(logging.WARNING, logger="raydl"):
        t0 = time.monotonic()
        listed = list(LocalStorage().list_folders(str(root)))
        assert time.monotonic() - t0 < 5
    assert [(os.path.relpath(f, root), names) for f, names, _ in listed] == [("cat", ["a.jpg"])]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "already listed" in messages and "1 entries under" in messages and "FIFOs" in messages

    deep = tmp_path / "deep"
    path = deep / "cat"
    for _ in range(local.MAX_DEPTH + 2):
        path = path / "d"
    path.mkdir(parents=True)
    (path / "x.jpg").write_bytes(b"x")
    with pytest.raises(DataSourceError, match=f"more than {local.MAX_DEPTH} folders deep"):
        list_image_folder(str(deep))

    odd = tmp_path / "odd"
    (odd / "cat").mkdir(parents=True)
    with open(os.fsencode(odd / "cat") + b"/\xff.jpg", "wb") as f:
        f.write(b"x")
    with pytest.raises(DataSourceError, match="not UTF-8") as info:
        list_image_folder(str(odd))
    assert "\\udcff.jpg" in str(info.value)
