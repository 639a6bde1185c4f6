"""On S3 as on local disk, a path that does not exist is a DataSourceError "'…' does not exist", naming it, from
every read_*: a key, a prefix with no object under it, a wids shard list; a pattern that matches nothing stays a
ValueError. Against the moto server on 127.0.0.1."""
from __future__ import annotations

import io
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydl
from raydl.errors import DataSourceError

pytestmark = pytest.mark.timeout(60)


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, payload in (("a.jpg", b"x"), ("a.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def _missing(call, uri: str) -> None:
    with pytest.raises(DataSourceError) as info:
        call()
    assert type(info.value) is DataSourceError and not isinstance(info.value, ValueError)
    assert str(info.value) == f"{uri!r} does not exist" and info.value.uri == uri


def test_every_read_of_an_s3_path_that_does_not_exist_says_so(moto_server, s3_client, bucket, monkeypatch, tmp_path):
    """Missing keys (a shard, alone or in a list; a Parquet file; a wids list) and a Parquet folder with no
    object under it: DataSourceError "'s3://…' does not exist"; an image folder with no object under it says
    so after "no images found"; an object read as an image folder is still "no images found"; a glob that
    matches nothing is still a ValueError."""
    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    s3 = raydl.S3Options(endpoint_url=moto_server)
    s3_client.put_object(Bucket=bucket, Key="d/ok.tar", Body=_tar())
    buf = io.BytesIO()
    pq.write_table(pa.table({"n": [1, 2]}), buf)
    s3_client.put_object(Bucket=bucket, Key="p/ok.parquet", Body=buf.getvalue())
    base = f"s3://{bucket}"
    assert len(raydl.read_webdataset(f"{base}/d/ok.tar", s3=s3)) == 1 and len(raydl.read_parquet(f"{base}/p/", s3=s3))

    _missing(lambda: raydl.read_webdataset(f"{base}/d/gone.tar", s3=s3), f"{base}/d/gone.tar")
    _missing(lambda: raydl.read_webdataset([f"{base}/d/ok.tar", f"{base}/e/gone.tar"], s3=s3), f"{base}/e/gone.tar")
    _missing(lambda: raydl.read_parquet(f"{base}/p/gone.parquet", s3=s3), f"{base}/p/gone.parquet")
    _missing(lambda: raydl.read_parquet(f"{base}/none/", s3=s3), f"{base}/none/")
    with pytest.raises(DataSourceError) as info:  # "no images" first, as it was: a test holds it
        raydl.read_images(f"{base}/none", s3=s3)
    assert type(info.value) is DataSourceError and info.value.uri == f"{base}/none"
    assert str(info.value) == (f"no images (.jpg, .jpeg, .png, .webp, .bmp) found under '{base}/none': '{base}/none' "
                               "does not exist (no object under it)")
    _missing(lambda: raydl.read_webdataset(f"{base}/d/shards.json", s3=s3), f"{base}/d/shards.json")

    with pytest.raises(DataSourceError, match="no images .* found under"):
        raydl.read_images(f"{base}/d/ok.tar", s3=s3)  # an object, not a folder: as a local file is
    with pytest.raises(ValueError, match="matches nothing") as info:
        raydl.read_webdataset(f"{base}/d/gone-*.tar", s3=s3)
    assert not isinstance(info.value, DataSourceError)
