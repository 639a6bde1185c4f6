"""gs:// and az:// reads have a total deadline and bounded retries, against fake-gcs-server and azurite behind a
proxy on 127.0.0.1 that stops sending (StallProxy) or answers with errors (FaultFront): a stalled try ends after
timeout_s, is retried on a new connection, and all tries end within timeout_s × retries."""
from __future__ import annotations

import time

import pytest

import raydl
from raydl.errors import AccessDeniedError, DataSourceError
from raydl.storage.azure import AzureStorage
from raydl.storage.gcs import GCSStorage

from s3_util import FaultFront
from stall_proxy import StallProxy

pytestmark = pytest.mark.timeout(60)

SLACK_S = 2.5  # client set-up, backoff waits, thread wake-ups, a busy 2-core machine
DATA = bytes(range(256)) * 40


def _storage(cloud, url: str, **kw):
    """The cloud's storage with its endpoint at `url` (a proxy in front of the server)."""
    if cloud.scheme == "gs":
        return GCSStorage(raydl.GCSOptions(endpoint_url=url, **kw))
    return AzureStorage(raydl.AzureOptions(connection_string=cloud.options.connection_string.replace(
        cloud.server.url, url), **kw))


def _timed(fn):
    t0 = time.monotonic()
    try:
        return fn(), time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - returned for the test to check
        return exc, time.monotonic() - t0


@pytest.mark.parametrize("after_bytes", [0, 40])
def test_a_stalled_store_fails_within_timeout_times_tries(cloud, after_bytes):
    """A proxy that passes no byte (or the first 40 of the answer) and then stops sending fails a read with
    timeout_s=1.0 and 3 tries in about 3 s, each try on a new connection, with a DataSourceError naming the
    object, the range, the tries and the time."""
    cloud.put("x/blob.bin", DATA)
    uri = f"{cloud.root}x/blob.bin"
    with StallProxy(cloud.server.port, after_bytes=after_bytes) as proxy:
        storage = _storage(cloud, proxy.url, timeout_s=1.0, retries=3)
        err, took = _timed(lambda: storage.read_range(uri, 0, 12))
        assert isinstance(err, DataSourceError), err
        assert 3 * 1.0 - 0.2 < took < 3 * 1.0 + SLACK_S
        assert proxy.connections == 3
    msg = str(err)
    assert err.uri == uri
    assert f"cannot read {uri} at offset 0 (12 bytes) after 3 tries in " in msg
    assert "the store stalled: no complete response within 1 s" in msg and "timeout_s=1" in msg


def test_a_stall_on_the_first_connection_is_retried_on_a_healthy_one(cloud):
    """The first connection stalls; its try ends after timeout_s and the retry, on a new connection, reads the
    right bytes."""
    cloud.put("x/blob.bin", DATA)
    uri = f"{cloud.root}x/blob.bin"
    with StallProxy(cloud.server.port, stall=lambda n: n == 0) as proxy:
        storage = _storage(cloud, proxy.url, timeout_s=1.0, retries=3)
        data, took = _timed(lambda: storage.read_range(uri, 10, 12))
        assert data == DATA[10:22]
        assert took < 1.0 + SLACK_S
        assert proxy.connections == 2


def test_stat_and_list_have_the_deadline_too(cloud):
    """HEAD and LIST requests run under the same deadline."""
    cloud.put("x/blob.bin", DATA)
    uri = f"{cloud.root}x/blob.bin"
    with StallProxy(cloud.server.port) as proxy:
        storage = _storage(cloud, proxy.url, timeout_s=0.5, retries=1)
        err, took = _timed(lambda: storage.stat(uri))
        assert isinstance(err, DataSourceError) and f"cannot stat {uri}" in str(err) and "stalled" in str(err), err
        assert took < 0.5 + SLACK_S
        err, took = _timed(lambda: list(storage.list(f"{cloud.root}x/")))
        assert isinstance(err, DataSourceError) and "stalled" in str(err), err
        assert took < 0.5 + SLACK_S


def _gets(front):
    return [r for r in front.requests if r[0] == "GET"]


def test_throttling_and_5xx_are_retried(cloud):
    """503 and 500 answers are retried with backoff; the third try reads the bytes."""
    cloud.put("x/blob.bin", DATA)
    uri = f"{cloud.root}x/blob.bin"
    faults = {0: (503, "SlowDown"), 1: (500, "InternalError")}
    with FaultFront(cloud.server.url, lambda m, p, n: faults.get(n), upstream_host=True) as front:
        storage = _storage(cloud, front.url, retries=5)
        assert storage.read_range(uri, 5, 7) == DATA[5:12]
        assert [s for _, _, s in front.requests] == [503, 500, 206]


def test_retries_are_bounded_in_count(cloud):
    """A store that always answers 503 is tried `retries` times, then named in a DataSourceError."""
    uri = f"{cloud.root}x/blob.bin"
    with FaultFront(cloud.server.url, lambda *_: (503, "SlowDown"), upstream_host=True) as front:
        storage = _storage(cloud, front.url, retries=3)
        with pytest.raises(DataSourceError, match="after 3 tries") as info:
            storage.read_range(uri, 0, 4)
        assert len(front.requests) == 3 and info.value.uri == uri


def test_missing_object_is_not_retried_and_denied_access_names_the_bucket(cloud):
    """A 404 is one request and a DataSourceError naming the URI; a 403 is an AccessDeniedError (a
    PermissionError) naming the bucket or container and the URI, not retried."""
    uri = f"{cloud.root}x/nope.bin"
    with FaultFront(cloud.server.url, lambda *_: None, upstream_host=True) as front:
        with pytest.raises(DataSourceError, match="does not exist") as info:
            _storage(cloud, front.url, retries=5).read_range(uri, 0, 4)
        assert info.value.uri == uri and uri in str(info.value) and len(front.requests) == 1
    with FaultFront(cloud.server.url, lambda *_: (403, "AccessDenied"), upstream_host=True) as front:
        with pytest.raises(AccessDeniedError) as info:
            _storage(cloud, front.url, retries=5).read_range(uri, 0, 4)
        assert isinstance(info.value, PermissionError) and info.value.uri == uri
        assert uri in str(info.value) and repr(cloud.bucket) in str(info.value)
        assert len(front.requests) == 1
