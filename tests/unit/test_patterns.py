"""Shard patterns on local disk: a name that exists is itself before it is a glob; `*` stays within a folder,
`**` crosses folders (tests/s3/test_s3_patterns.py checks S3 means the same)."""
from __future__ import annotations

import io
import tarfile

import pytest

import raydl
from raydl.sources._patterns import path_regex
from raydl.sources.webdataset import expand_urls
from raydl.storage import LocalStorage

pytestmark = pytest.mark.timeout(30)

NAMES = ["a-1.tar", "a-2.tar", "sub/a-3.tar", "sub/deep/a-4.tar", "shard[1].tar", "shard1.tar", ".hidden.tar",
         "b?.tar", "bx.tar"]
PATTERNS = {  # pattern -> what it names, under the root
    "*.tar": [".hidden.tar", "a-1.tar", "a-2.tar", "b?.tar", "bx.tar", "shard1.tar", "shard[1].tar"],
    "a-*.tar": ["a-1.tar", "a-2.tar"],
    "*/a-*.tar": ["sub/a-3.tar"],
    "**/a-*.tar": ["a-1.tar", "a-2.tar", "sub/a-3.tar", "sub/deep/a-4.tar"],
    "sub/**": ["sub/a-3.tar", "sub/deep/a-4.tar"],
    "a-[12].tar": ["a-1.tar", "a-2.tar"],
    "a-[!1].tar": ["a-2.tar"],
    "shard[1].tar": ["shard[1].tar"],  # exists as written: itself, not shard1.tar
    "shard[0-9].tar": ["shard1.tar"],
    "b?.tar": ["b?.tar"],  # exists as written
    "b[x].tar": ["bx.tar"],
    "?-1.tar": ["a-1.tar"],
}


def tiny_tar(name: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name.replace("/", "_").removesuffix(".tar") + ".jpg")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    return buf.getvalue()


def make_tree(root) -> None:
    for name in NAMES:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(tiny_tar(name))


def named(root: str, pattern: str, storage) -> list[str]:
    return [o.uri[len(root):] for o in expand_urls(root + pattern, lambda _u: storage)]


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_local_patterns(tmp_path, pattern):
    """Each pattern names exactly its files on local disk."""
    make_tree(tmp_path)
    assert named(f"{tmp_path}/", pattern, LocalStorage()) == PATTERNS[pattern]


def test_a_shard_named_with_brackets_reads(tmp_path):
    """read_webdataset("…/shard[1].tar") reads that shard ("matches nothing" before)."""
    make_tree(tmp_path)
    ds = raydl.read_webdataset(str(tmp_path / "shard[1].tar"), label_field=None)
    assert ds.catalog.samples().key == ["shard[1]"]


def test_the_regex_never_crosses_a_folder_but_double_star_does():
    """The S3 matcher: `*`, `?` and classes stay within one segment; `**` spans any number of them."""
    assert path_regex("s3://b/d/*.tar").fullmatch("s3://b/d/x.tar")
    assert not path_regex("s3://b/d/*.tar").fullmatch("s3://b/d/sub/x.tar")
    assert not path_regex("s3://b/d/?.tar").fullmatch("s3://b/d//.tar")
    assert not path_regex("s3://b/d/x[/a].tar").fullmatch("s3://b/d/x/.tar")
    assert path_regex("s3://b/d/**/x.tar").fullmatch("s3://b/d/x.tar")
    assert path_regex("s3://b/d/**/x.tar").fullmatch("s3://b/d/1/2/x.tar")
