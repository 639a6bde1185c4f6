"""A path that does not exist is a DataSourceError saying so, naming it, from every read_* on local disk (the S3
side is tests/s3/test_s3_missing_paths.py): `except DataSourceError` catches it. A real pattern (braces, a
glob) that matches nothing stays a ValueError, the argument's fault."""
from __future__ import annotations

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydl
from raydl.errors import DataSourceError

pytestmark = pytest.mark.timeout(30)


def _missing(call, path: str) -> None:
    with pytest.raises(DataSourceError) as info:
        call()
    assert type(info.value) is DataSourceError and not isinstance(info.value, ValueError)
    assert str(info.value) == f"{path!r} does not exist" and info.value.uri == path


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A shard and a Parquet file that exist, beside the paths that do not."""
    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, payload in (("a.jpg", b"x"), ("a.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "ok.tar").write_bytes(buf.getvalue())
    pq.write_table(pa.table({"n": [1, 2]}), tmp_path / "ok.parquet")
    return tmp_path


def test_every_read_of_a_local_path_that_does_not_exist_says_so(data):
    """read_webdataset of a missing shard (alone, or in a list beside one that exists), read_parquet of a missing
    file or folder, read_images of a missing folder, and a missing wids shard list: DataSourceError "'…' does not
    exist" (a ValueError that the shard pattern matches nothing before, for a path with no pattern in it)."""
    gone = str(data / "gone.tar")
    _missing(lambda: raydl.read_webdataset(gone), gone)
    _missing(lambda: raydl.read_webdataset([str(data / "ok.tar"), gone]), gone)
    _missing(lambda: raydl.read_parquet(str(data / "gone.parquet")), str(data / "gone.parquet"))
    _missing(lambda: raydl.read_parquet(str(data / "no-folder")), str(data / "no-folder"))
    _missing(lambda: raydl.read_parquet(str(data / "no-folder") + "/"), str(data / "no-folder") + "/")
    _missing(lambda: raydl.read_images(str(data / "no-folder")), str(data / "no-folder"))
    _missing(lambda: raydl.read_webdataset(str(data / "shards.json")), str(data / "shards.json"))
    _missing(lambda: raydl.read_webdataset(str(data / "ok.tar"), index=str(data / "shards.json")),
             str(data / "shards.json"))


def test_a_wids_list_naming_a_shard_that_does_not_exist_names_the_list(data):
    """A wids shard list whose entry is not there: a DataSourceError naming the list and the shard."""
    doc = {"__kind__": "wids-shard-index-v1", "shardlist": [{"url": "ok.tar", "nsamples": 1},
                                                             {"url": "gone.tar", "nsamples": 1}]}
    (data / "shards.json").write_text(json.dumps(doc))
    with pytest.raises(DataSourceError) as info:
        raydl.read_webdataset(str(data / "shards.json"))
    assert str(info.value) == (f"{data / 'shards.json'}: a shard it lists is not there "
                               f"({str(data / 'gone.tar')!r} does not exist)")


def test_a_pattern_that_matches_nothing_is_still_a_value_error(data):
    """Braces, globs and a malformed brace pattern that match nothing: ValueError, as docs/errors.md says; an
    existing folder without Parquet files too."""
    for pattern in (str(data / "gone-{0..3}.tar"), str(data / "*.tgz"), str(data / "x-{000..}.tar"),
                    str(data / "gone[12].tar")):
        with pytest.raises(ValueError, match="matches nothing") as info:
            raydl.read_webdataset(pattern)
        assert not isinstance(info.value, DataSourceError) and pattern in str(info.value)
    with pytest.raises(ValueError, match="matches nothing"):
        raydl.read_parquet(str(data / "gone-*.parquet"))
    (data / "empty").mkdir()
    with pytest.raises(ValueError, match=r"matches nothing \(no \*.parquet files below it\)"):
        raydl.read_parquet(str(data / "empty"))


def test_a_folder_named_as_a_shard_says_it_is_a_folder(data):
    """read_webdataset of a folder (alone or in a list): a DataSourceError naming it as a folder and showing a
    pattern that names its shards, before anything is read (it was an 'Is a directory' read error)."""
    folder = str(data)
    for urls in (folder, [str(data / "ok.tar"), folder]):
        with pytest.raises(DataSourceError) as info:
            raydl.read_webdataset(urls)
        assert info.value.uri == folder and "is a folder, not a shard" in str(info.value)
        assert repr(str(data / "*.tar")) in str(info.value)
