"""S3 reads have a total deadline: a store that drips bytes, or stalls in its headers, or says nothing, is cut off
after timeout_s per try, retried on a new connection, and named in the final error."""
from __future__ import annotations

import time

import pytest
from slow_drip import SlowDrip

import raydl
from raydl.errors import DataSourceError
from raydl.storage.s3 import S3Storage

pytestmark = pytest.mark.timeout(60)

URI = "s3://bucket/x/blob.bin"
DATA = b"0123456789" * 100
SLACK_S = 2.5  # client set-up, thread wake-ups, a busy 2-core machine


def _storage(url: str, **kw) -> S3Storage:
    storage = S3Storage(raydl.S3Options(endpoint_url=url, **kw))
    storage.client()  # built before the clock starts (boto3's first client takes ~0.5 s)
    return storage


def _timed(fn):
    t0 = time.monotonic()
    try:
        return fn(), time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - returned for the test to check
        return exc, time.monotonic() - t0


@pytest.fixture(autouse=True)
def _credentials(monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)


def test_the_clients_connections_are_watched():
    """The boto3 client's connection pools make connections that the deadline watchdog can shut down (this reaches
    into botocore's URLLib3Session: if botocore changes it, this fails before any deadline silently stops working)."""
    client = _storage("http://127.0.0.1:9").client()
    pools = client._endpoint.http_session._pool_classes_by_scheme
    assert all(cls.__name__.startswith("Watched") for cls in pools.values())
    assert all(cls.ConnectionCls.__name__.startswith("Watched") for cls in pools.values())


def test_a_store_that_drips_one_byte_per_half_second_fails_within_timeout_times_tries():
    """A 12-byte read from a store that sends a byte every 0.5 s on every connection fails with timeout_s=1.0 and
    3 tries in about 3 s (it took 6.4 s and succeeded before: each recv was within the per-read timeout), each try on
    a new connection, with a DataSourceError naming the object, the range, the tries and the time."""
    with SlowDrip(DATA, interval_s=0.5) as server:
        storage = _storage(server.url, timeout_s=1.0, retries=3)
        err, took = _timed(lambda: storage.read_range(URI, 0, 12))
        assert isinstance(err, DataSourceError), err
        assert took < 3 * 1.0 + SLACK_S
        assert server.connections == 3 and len(server.requests) == 3  # a new connection for every try
    msg = str(err)
    assert err.uri == URI
    assert f"cannot read {URI} at offset 0 (12 bytes) after 3 tries in " in msg
    assert "the store stalled: no complete response within" in msg and "timeout_s=1" in msg


def test_a_stall_on_the_first_connection_is_retried_on_a_healthy_one():
    """The first connection drips; the try is cut off after timeout_s and the retry, on a new connection, reads the
    right bytes; the stalled connection is never used again (a later read reuses the healthy one)."""
    with SlowDrip(DATA, stall=lambda n: n == 0, interval_s=0.5) as server:
        storage = _storage(server.url, timeout_s=1.0, retries=3)
        data, took = _timed(lambda: storage.read_range(URI, 10, 12))
        assert data == DATA[10:22]
        assert took < 1.0 + SLACK_S
        assert server.connections == 2
        assert storage.read_range(URI, 0, 5) == DATA[:5]
        assert server.connections == 2 and [n for n, _, _ in server.requests] == [0, 1, 1]


@pytest.mark.parametrize("phase", ["headers", "silent"])
def test_a_stall_before_the_body_is_cut_off_too(phase):
    """The deadline covers the status line and headers (dripped a byte at a time) and a store that sends nothing."""
    with SlowDrip(DATA, phase=phase, interval_s=0.2) as server:
        storage = _storage(server.url, timeout_s=1.0, retries=2)
        err, took = _timed(lambda: storage.read_range(URI, 0, 12))
        assert isinstance(err, DataSourceError) and "stalled" in str(err), err
        assert took < 2 * 1.0 + SLACK_S
        assert server.connections == 2


def test_a_16_mib_block_from_a_slow_store_ends_at_the_deadline():
    """A 16 MiB block dripped 4 KiB per 0.5 s (over an hour) fails after timeout_s, not when the last byte comes."""
    with SlowDrip(bytes(16 << 20), interval_s=0.5, drip_bytes=4096) as server:
        storage = _storage(server.url, timeout_s=1.0, retries=1)
        err, took = _timed(lambda: storage.read_range(URI, 0, 16 << 20))
        assert isinstance(err, DataSourceError) and "(16777216 bytes) after 1 try in" in str(err), err
        assert took < 1.0 + SLACK_S


def test_stat_and_list_have_the_deadline_too():
    """HEAD and LIST requests run under the same deadline: headers dripped forever end in a DataSourceError."""
    with SlowDrip(DATA, phase="headers", interval_s=0.2) as server:
        storage = _storage(server.url, timeout_s=0.5, retries=1)
        err, took = _timed(lambda: storage.stat(URI))
        assert isinstance(err, DataSourceError) and f"cannot stat {URI}" in str(err), err
        assert took < 0.5 + SLACK_S
        err, took = _timed(lambda: list(storage.list("s3://bucket/x/")))
        assert isinstance(err, DataSourceError) and "stalled" in str(err), err
        assert took < 0.5 + SLACK_S


def test_a_healthy_store_is_not_cut_off():
    """Reads that take a while but finish inside timeout_s (a byte every 50 ms, 12 bytes) succeed on one connection."""
    with SlowDrip(DATA, interval_s=0.05) as server:
        storage = _storage(server.url, timeout_s=5.0, retries=1)
        assert storage.read_range(URI, 0, 12) == DATA[:12]
        assert storage.read_range(URI, 12, 12) == DATA[12:24]
        assert server.connections == 1


def test_a_resumed_stream_answered_from_the_start_is_an_error_not_other_bytes():
    """A stream whose first connection stalls after 100 bytes resumes with a GET from byte 100; a store that
    answers it with the whole object (200, no Content-Range: it ignored the open-ended Range) must not have its
    first bytes taken for bytes 100 onwards: an ObjectChangedError naming the object and the offset."""
    from raydl.errors import ObjectChangedError

    with SlowDrip(DATA, stall=lambda n: n == 0, interval_s=3.0, drip_bytes=100) as server:
        storage = _storage(server.url, timeout_s=1.0, retries=3)
        got = []
        with pytest.raises(ObjectChangedError, match=f"{URI}: a read resumed at offset 100 got other bytes"):
            for piece in storage.stream(URI, chunk=50):
                got.append(piece)
        assert b"".join(got) == DATA[:100]  # only the bytes the first connection really sent
        assert [rng for _, _, rng in server.requests] == ["", "bytes=100-"]
