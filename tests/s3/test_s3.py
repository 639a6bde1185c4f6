"""S3Storage against the moto server: pagination, retries and their bounds, error mapping, changed objects."""
from __future__ import annotations

import logging
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import raydl
from raydl.errors import AccessDeniedError, DataSourceError, ObjectChangedError
from raydl.storage.s3 import S3Storage

from s3_util import FaultFront, put_many

pytestmark = pytest.mark.timeout(120)


def _storage(endpoint: str, **kw) -> S3Storage:
    return S3Storage(raydl.S3Options(endpoint_url=endpoint, **kw))


@pytest.fixture
def blob(s3_client, bucket):
    s3_client.put_object(Bucket=bucket, Key="x/blob.bin", Body=b"0123456789" * 100)
    return f"s3://{bucket}/x/blob.bin"


def test_listing_pages_past_1000_keys(moto_server, s3_client, bucket):
    """A prefix holding more than 1000 keys (one page) is listed completely, and nothing outside the prefix."""
    keys = [f"many/k{i:05d}" for i in range(1234)]
    put_many(bucket, {k: b"z" for k in keys} | {"many2/other": b"z"})
    got = sorted(o.uri for o in _storage(moto_server).list(f"s3://{bucket}/many/"))
    assert got == [f"s3://{bucket}/{k}" for k in keys]


@pytest.mark.parametrize("lie, why", [
    (b"<IsTruncated>true</IsTruncated><NextContinuationToken>t1</NextContinuationToken>",
     "page 2 of the store's answer says more keys follow but repeats an earlier continuation token"),
    (b"<IsTruncated>true</IsTruncated>", "page 1 of the store's answer says more keys follow but gives no continuation"),
])
def test_a_listing_that_would_never_end_is_an_error_naming_the_prefix(moto_server, blob, bucket, lie, why):
    """A store that says every page is truncated, with the same continuation token each time or with none
    (which would list the first page again): a DataSourceError naming the prefix after a page or two, not a
    listing that loops forever."""
    def edit(method, path, n, body):
        return body.replace(b"<IsTruncated>false</IsTruncated>", lie) if "list-type=2" in path else body

    def first_page(method, path, n):  # the store's own token for the lie's: it answers page 1 again
        return re.sub(r"&?continuation-token=[^&]*", "", path)

    with FaultFront(moto_server, lambda m, p, n: None, edit=edit, forward_path=first_page) as front:
        with pytest.raises(DataSourceError, match=why) as info:
            list(_storage(front.url).list(f"s3://{bucket}/x/"))
        assert len(front.requests) <= 2
    assert info.value.uri == f"s3://{bucket}/x/"


def test_a_store_that_ignores_range_is_not_read_whole(moto_server, blob):
    """A ranged read answered with the whole object (Range ignored): an ObjectChangedError after reading one byte
    more than asked, not the whole body."""
    with FaultFront(moto_server, lambda m, p, n: None, drop_range=lambda m, p, n: m == "GET") as front:
        with pytest.raises(ObjectChangedError, match="5 bytes at offset 10 asked, 6 there"):
            _storage(front.url, retries=1).read_range(blob, 10, 5)


def test_connections_are_pooled_and_reused_across_batches(moto_server, blob):
    """Many rounds of concurrent ranged GETs from one process use at most max_concurrency connections in all
    (moto itself closes every connection, so this front keeps them alive as S3 does)."""
    data = b"0123456789" * 100
    with FaultFront(moto_server, lambda m, p, n: None) as front:
        storage = _storage(front.url, max_concurrency=4)
        with ThreadPoolExecutor(4) as pool:  # the worker's IO pool is max_concurrency threads
            for _ in range(3):
                got = list(pool.map(lambda i: storage.read_range(blob, i, 3), range(16)))
                assert got == [data[i:i + 3] for i in range(16)]
        assert len(front.requests) == 48
        assert front.connections <= 4


def test_throttling_and_5xx_are_retried(moto_server, blob):
    """503 SlowDown and 500 InternalError are retried with backoff; the read then succeeds with the right bytes."""
    faults = {0: (503, "SlowDown"), 1: (500, "InternalError")}
    with FaultFront(moto_server, lambda m, p, n: faults.get(n)) as front:
        data = _storage(front.url, retries=3).read_range(blob, 10, 5)
        assert data == b"01234"
        assert [s for _, _, s in front.requests] == [503, 500, 206]


def test_retries_are_bounded_in_count(moto_server, blob):
    """A store that keeps throttling gets exactly `retries` tries, then an error naming the object and the tries."""
    with FaultFront(moto_server, lambda m, p, n: (503, "SlowDown")) as front:
        with pytest.raises(DataSourceError, match="after 3 tries") as info:
            _storage(front.url, retries=3).read_range(blob, 0, 10)
        assert len(front.requests) == 3
    assert info.value.uri == blob and blob in str(info.value) and "SlowDown" in str(info.value)


def test_retries_are_bounded_in_time(moto_server, blob):
    """Retrying stops once timeout_s * retries has passed since the first try (backoff waits included), however
    many tries are left: 20 tries of 0.1 s, against a store that keeps throttling, end within 2 s."""
    with FaultFront(moto_server, lambda m, p, n: (503, "SlowDown")) as front:
        storage = _storage(front.url, retries=20, timeout_s=0.1)
        storage.client()
        t0 = time.monotonic()
        with pytest.raises(DataSourceError, match="SlowDown"):
            storage.read_range(blob, 0, 10)
        took = time.monotonic() - t0
        assert 1 < len(front.requests) < 20
    assert took < 2.0 + 1.0


def test_access_denied_is_a_permission_error_naming_the_bucket(moto_server, blob, bucket, monkeypatch, caplog):
    """403 AccessDenied: no retry, an AccessDeniedError (a PermissionError) naming the bucket; no credentials shown."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sEcReT-never-shown-42")
    caplog.set_level(logging.DEBUG, logger="raydl")
    with FaultFront(moto_server, lambda m, p, n: (403, "AccessDenied")) as front:
        with pytest.raises(AccessDeniedError) as info:
            _storage(front.url).read_range(blob, 0, 10)
        assert len(front.requests) == 1
    msg = str(info.value)
    assert isinstance(info.value, PermissionError) and isinstance(info.value, DataSourceError)
    assert "permission" in msg and repr(bucket) in msg and blob in msg
    assert "sEcReT" not in msg and "sEcReT" not in caplog.text


def test_missing_key_is_not_retried_and_names_it(moto_server, bucket):
    """A 404 is final: one request, a DataSourceError naming s3://bucket/key."""
    uri = f"s3://{bucket}/gone/key.jpg"
    with FaultFront(moto_server, lambda m, p, n: None) as front:
        with pytest.raises(DataSourceError, match="does not exist") as info:
            _storage(front.url).read_range(uri, 0, 4)
        assert len(front.requests) == 1
    assert info.value.uri == uri and uri in str(info.value)


def test_changed_etag_is_an_error_naming_the_object(moto_server, s3_client, bucket, blob):
    """An object rewritten after listing (same size, new etag) is ObjectChangedError; the new bytes are not read."""
    storage = _storage(moto_server)
    listed = storage.stat(blob)
    s3_client.put_object(Bucket=bucket, Key="x/blob.bin", Body=b"9876543210" * 100)
    with pytest.raises(ObjectChangedError) as info:
        storage.read_range(blob, 0, 10, etag=listed.etag)
    assert info.value.uri == blob and blob in str(info.value)


def test_connection_errors_are_retried_then_named(blob):
    """A store that refuses connections is retried (bounded) and then named with the object."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(DataSourceError, match="after 2 tries") as info:
        _storage(f"http://127.0.0.1:{port}", retries=2, timeout_s=2).read_range(blob, 0, 10)
    assert blob in str(info.value)


def test_read_images_from_s3_and_bad_schemes(moto_server, s3_client, bucket):
    """read_images lists an s3:// prefix like a folder; an unknown scheme is a ValueError naming it."""
    for key in ("train/cat/1.jpg", "train/dog/2.png", "train/dog/3.txt", "train2/x/4.jpg"):
        s3_client.put_object(Bucket=bucket, Key=key, Body=b"not decoded here")
    ds = raydl.read_images(f"s3://{bucket}/train", s3=raydl.S3Options(endpoint_url=moto_server))
    assert ds.catalog.samples().key == ["cat/1.jpg", "dog/2.png"]
    assert ds.catalog.classes == ("cat", "dog")
    assert all(e for e in ds.catalog.shards.column("etag").to_pylist())
    with pytest.raises(DataSourceError, match="no images"):
        raydl.read_images(f"s3://{bucket}/nothing-here", s3=raydl.S3Options(endpoint_url=moto_server))
    with pytest.raises(ValueError, match="'hdfs'"):
        raydl.read_images("hdfs://bucket/train")
