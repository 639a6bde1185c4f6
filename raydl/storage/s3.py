"""S3 and S3-compatible stores through boto3.

The storage value holds only its S3Options; each process builds its boto3
client lazily, once, and shares it between threads (boto3 clients are thread
safe). The client is never pickled. Its connection pool holds
`max_concurrency` connections, matched to the worker's IO pool, and is reused
across batches. Requests are retried by raydl's own policy
(raydl/storage/fetch.py): botocore's retries are switched off so that the
bounds in S3Options are the only ones.

Deadlines: botocore's read timeout bounds one socket read, so a store that
drips a byte at a time never trips it. Each try therefore runs under a total
deadline of `timeout_s` (raydl/storage/deadline.py): the client's connection
classes register the connection a try runs on, and when the deadline passes
the watchdog shuts its socket down, which ends a recv blocked on it at once,
in the connect, the headers or the body alike. urllib3 then discards that
connection (the pool never hands it out again), and the next try opens a new
one. Setting urllib3's timeouts to the time left before each read was not
enough: http.client reads the headers, and a body of one `read(n)`, in many
recvs under the one timeout. The tries together stay within
`timeout_s * retries`.

botocore errors become raydl.errors types here, naming s3://bucket/key; no
message ever carries credentials.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from raydl.errors import AccessDeniedError, DataSourceError, ObjectChangedError
from raydl.options import S3Options
from raydl.storage import deadline
from raydl.storage.base import MAX_LIST_PAGES, STREAM_CHUNK, BaseStorage, ObjectInfo
from raydl.storage.fetch import RetryPolicy, call_with_retries

__all__ = ["S3Storage", "StalledError", "is_retryable", "split_s3"]

logger = logging.getLogger(__name__)

_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
    }
)
_DENIED_CODES = frozenset(
    {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
)
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_CHANGED_CODES = frozenset({"PreconditionFailed", "412", "InvalidRange", "416"})

_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def _resumes_at(response: dict, at: int, total: int | None) -> bool:
    """Whether a ranged GET from byte `at` was answered with that range (Content-Range "bytes at-...") of
    the object of `total` bytes, not with the whole object from its start (a store may ignore Range)."""
    rng = str(response.get("ContentRange") or "")
    if not rng.startswith(f"bytes {at}-"):
        return False
    length = response.get("ContentLength")
    return total is None or length is None or at + int(length) == total


def split_s3(uri: str) -> tuple[str, str]:
    """("bucket", "key/prefix") of "s3://bucket/key/prefix"; a bad URI is a ValueError naming it."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket (expected s3://bucket/key)")
    return bucket, key


class StalledError(TimeoutError):
    """A try ran past its deadline (S3Options.timeout_s) and its connection was shut down; retried."""


def _watched(base: type) -> type:
    """`base` (a botocore connection class) registering each request, and each connect, with the try
    that runs it (raydl.storage.deadline), so that the try's deadline can shut the connection down."""

    class Watched(base):
        def connect(self):
            super().connect()
            deadline.bind_current(self)  # a deadline that passed during the connect shuts it down now

        def request(self, *args, **kwargs):
            deadline.bind_current(self)
            return super().request(*args, **kwargs)

    Watched.__name__ = Watched.__qualname__ = f"Watched{base.__name__}"
    return Watched


@functools.cache
def _watched_pool(pool_cls: type) -> type:
    return type(
        f"Watched{pool_cls.__name__}", (pool_cls,), {"ConnectionCls": _watched(pool_cls.ConnectionCls)}
    )


def _watch_connections(client) -> bool:
    """Make the client's connection pools use watched connections. This reaches into botocore's
    URLLib3Session (`_pool_classes_by_scheme`, the dict its urllib3 PoolManagers build pools from, as of
    botocore 1.44); tests/s3/test_deadlines.py fails if that changes. False when it cannot."""
    try:
        session = client._endpoint.http_session
        pools = session._pool_classes_by_scheme
        for scheme in ("http", "https"):
            pools[scheme] = _watched_pool(pools[scheme])
        session._manager.pool_classes_by_scheme = pools
    except (AttributeError, KeyError, TypeError):
        return False
    return True


def _error_code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_retryable(exc: BaseException) -> bool:
    """Throttling (503 SlowDown), 5xx and connection-level failures are worth another try; 4xx never."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from botocore.exceptions import (
        ConnectionError as BotoConnectionError,
    )

    if isinstance(exc, ClientError):
        code, status = _error_code(exc)
        return code in _RETRY_CODES or status >= 500
    transient = (
        BotoConnectionError,
        EndpointConnectionError,
        ConnectionClosedError,
        ReadTimeoutError,
        IncompleteReadError,
        ResponseStreamingError,
        ConnectionError,
        TimeoutError,
    )
    if isinstance(exc, transient):  # StalledError is a TimeoutError
        return True
    try:
        from urllib3.exceptions import HTTPError as Urllib3Error

        return isinstance(exc, Urllib3Error)
    except ImportError:  # pragma: no cover - botocore depends on urllib3
        return False


@dataclass(frozen=True)
class S3Storage(BaseStorage):
    """Objects in S3 (or an S3-compatible store), addressed as s3://bucket/key."""

    options: S3Options = field(default_factory=S3Options)

    def __post_init__(self) -> None:
        if self.options is None:
            object.__setattr__(self, "options", S3Options())
        if not isinstance(self.options, S3Options):
            raise ValueError(f"s3 must be a raydl.S3Options or None, got {type(self.options).__name__}")

    @property
    def default_io_concurrency(self) -> int:
        return self.options.max_concurrency

    @property
    def identity(self) -> str:
        """The endpoint URL the client talks to (the options' `endpoint_url`, else the one boto3 resolves
        for the region), lower-cased up to the path: a bucket's name means other objects at another one."""
        url = self.options.endpoint_url or self.client().meta.endpoint_url
        scheme, sep, rest = url.partition("://")
        host, slash, path = rest.partition("/")
        return f"{scheme.lower()}{sep}{host.lower()}{slash}{path}".rstrip("/")

    @property
    def retry_policy(self) -> RetryPolicy:
        """`retries` tries of at most `timeout_s` each, all of them within `timeout_s * retries`."""
        o = self.options
        return RetryPolicy(
            attempts=o.retries,
            base_delay_s=0.05,
            max_delay_s=2.0,
            deadline_s=o.timeout_s * o.retries,
            attempt_timeout_s=o.timeout_s,
        )

    # -- the client (per process, lazily) -----------------------------------------------------------
    def client(self):
        """This process's boto3 client for these options (built on first use; shared by threads)."""
        key = (self.options, os.getpid())
        client = _clients.get(key)
        if client is None:
            with _clients_lock:
                client = _clients.get(key)
                if client is None:
                    client = _clients[key] = self._make_client()
        return client

    def _make_client(self):
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError

        o = self.options
        config = Config(
            max_pool_connections=o.max_concurrency,
            connect_timeout=o.timeout_s,
            read_timeout=o.timeout_s,
            retries={"total_max_attempts": 1, "mode": "standard"},  # raydl's RetryPolicy retries
            **({"region_name": o.region} if o.region else {}),
        )
        try:
            session = boto3.session.Session(profile_name=o.profile) if o.profile else boto3.session.Session()
            client = session.client("s3", endpoint_url=o.endpoint_url, config=config)
        except BotoCoreError as exc:  # an unknown profile, a bad region ...
            raise DataSourceError(f"cannot set up the S3 client: {type(exc).__name__}: {exc}") from exc
        if not _watch_connections(client):
            logger.warning(
                "raydl: this botocore's connection pool cannot be watched, so S3Options.timeout_s bounds "
                "each socket read of a request, not the whole request"
            )
        return client

    # -- errors ------------------------------------------------------------------------------------
    def _translate(
        self,
        exc: BaseException,
        uri: str,
        what: str,
        *,
        tries: int = 1,
        waited_s: float = 0.0,
        offset: int | None = None,
        length: int | None = None,
    ) -> DataSourceError:
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        bucket, _ = split_s3(uri)
        at = f" at offset {offset}" if offset is not None else ""
        if length is not None:
            at += f" ({length} bytes)"
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return AccessDeniedError(
                f"cannot {what} {uri}: no usable AWS credentials were found (set a profile, "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or an instance role)",
                uri=uri,
            )
        if isinstance(exc, ClientError):
            code, status = _error_code(exc)
            if code in _DENIED_CODES or status == 403:
                return AccessDeniedError(
                    f"permission error: access to bucket {bucket!r} was denied ({code or status}) when "
                    f"trying to {what} {uri}; the credentials in use lack the permission (e.g. "
                    "s3:GetObject, s3:ListBucket)",
                    uri=uri,
                )
            if code == "NoSuchBucket":
                return DataSourceError(f"cannot {what} {uri}: bucket {bucket!r} does not exist", uri=uri)
            if code in _MISSING_CODES or status == 404:
                return DataSourceError(
                    f"cannot {what} {uri}{at}: the object does not exist (any more)", uri=uri
                )
            if code in _CHANGED_CODES or status in (412, 416):
                return ObjectChangedError(
                    f"{uri} changed after it was listed ({code or status}{at}); list the data again", uri=uri
                )
            detail = f"{code or status}: {exc.response.get('Error', {}).get('Message', '')}".rstrip(": ")
        elif isinstance(exc, StalledError):
            detail = str(exc)
        else:
            detail = f"{type(exc).__name__}: {exc}"
        tried = ""
        if isinstance(exc, StalledError) or tries > 1:
            tried = f" after {tries} {'try' if tries == 1 else 'tries'} in {waited_s:.1f} s"
        return DataSourceError(f"cannot {what} {uri}{at}{tried}: {detail}", uri=uri)

    def _call(
        self,
        fn: Callable[[], object],
        uri: str,
        what: str,
        *,
        offset: int | None = None,
        length: int | None = None,
    ):
        """fn() under the retry policy, each try within its deadline; failures become raydl errors."""
        tries = [0]

        def attempt(time_left_s: float):
            tries[0] += 1
            started = time.monotonic()
            with deadline.deadline(time_left_s) as watch:
                try:
                    return fn()
                except Exception as exc:
                    # whatever the shut-down connection raised: the deadline did it; or botocore's own read
                    # timeout (also timeout_s) fired first, on a store that sent nothing in that time
                    timed_out = type(exc).__name__ in ("ReadTimeoutError", "ConnectTimeoutError")
                    if watch.expired or (timed_out and time.monotonic() - started >= 0.9 * time_left_s):
                        raise StalledError(
                            f"the store stalled: no complete response within {time_left_s:.3g} s "
                            f"(S3Options.timeout_s={self.options.timeout_s:g}); the connection was closed"
                        ) from exc
                    raise

        start = time.monotonic()
        try:
            return call_with_retries(
                attempt,
                self.retry_policy,
                is_retryable=is_retryable,
                clock=time.monotonic,
                sleep=time.sleep,
                rng=random.Random(),
            )
        except DataSourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - every botocore/urllib3 failure is translated here
            waited = time.monotonic() - start
            raise self._translate(
                exc, uri, what, tries=tries[0], waited_s=waited, offset=offset, length=length
            ) from exc

    # -- the interface -----------------------------------------------------------------------------
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with the prefix (any number of keys: pages of 1000)."""
        bucket, key_prefix = split_s3(prefix)
        client = self.client()
        token, seen = None, set()
        for n in range(MAX_LIST_PAGES):
            kwargs = {"Bucket": bucket, "Prefix": key_prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(lambda kw=kwargs: client.list_objects_v2(**kw), prefix, "list")
            for obj in page.get("Contents", ()):
                if obj["Key"].endswith("/"):
                    continue  # a folder marker, not data
                yield ObjectInfo(
                    f"s3://{bucket}/{obj['Key']}", int(obj["Size"]), obj.get("ETag", "").strip('"')
                )
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")
            # a store that says more follow must say where; one that sends a token again would list forever
            if not token or token in seen:
                why = "gives no continuation token" if not token else "repeats an earlier continuation token"
                raise DataSourceError(
                    f"listing {prefix}: page {n + 1} of the store's answer says more keys follow but {why}",
                    uri=prefix,
                )
            seen.add(token)
        raise DataSourceError(
            f"listing {prefix}: more than {MAX_LIST_PAGES:,} pages (of up to 1,000 keys each); list a "
            "narrower prefix",
            uri=prefix,
        )

    def stat(self, uri: str) -> ObjectInfo:
        bucket, key = split_s3(uri)
        client = self.client()
        head = self._call(lambda: client.head_object(Bucket=bucket, Key=key), uri, "stat")
        return ObjectInfo(uri, int(head["ContentLength"]), head.get("ETag", "").strip('"'))

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        bucket, key = split_s3(uri)
        if length == 0:
            return b""
        client = self.client()
        kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={offset}-{offset + length - 1}"}
        if etag:
            kwargs["IfMatch"] = f'"{etag}"'

        def get() -> tuple[bytes, str]:
            response = client.get_object(**kwargs)
            body = response["Body"]
            try:  # up to a byte more than asked: a store that ignores the range is found out, not read whole
                parts, got = [], 0
                while got <= length:
                    piece = body.read(length + 1 - got)  # may return less than asked: the bytes that came
                    if not piece:
                        break
                    parts.append(piece)
                    got += len(piece)
                return b"".join(parts), response.get("ETag", "").strip('"')
            finally:
                body.close()

        data, got = self._call(get, uri, "read", offset=offset, length=length)
        if etag and got and got != etag:
            raise ObjectChangedError(
                f"{uri} changed after it was listed: etag {got!r}, listed {etag!r}", uri=uri
            )
        if len(data) != length:
            raise ObjectChangedError(
                f"{uri} changed after it was listed: {length} bytes at offset {offset} asked, "
                f"{len(data)} there",
                uri=uri,
            )
        return data

    def read(self, uri: str) -> bytes:
        bucket, key = split_s3(uri)
        client = self.client()

        def get() -> bytes:
            body = client.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                return body.read()
            finally:
                body.close()

        return self._call(get, uri, "read")

    def stream(self, uri: str, *, etag: str | None = None, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        """The whole object from ONE GET, its body read `chunk` bytes at a time, each read within
        `timeout_s` (the watchdog shuts a stalled connection down). A read that fails resumes with a
        ranged GET from where it stopped, of the same etag, within the same `retries`."""
        bucket, key = split_s3(uri)
        client = self.client()
        at, total, want, failures = 0, None, etag, 0
        while total is None or at < total:
            kwargs = {"Bucket": bucket, "Key": key}
            if at:
                kwargs["Range"] = f"bytes={at}-"
            if want:
                kwargs["IfMatch"] = f'"{want}"'
            response = self._call(lambda kw=kwargs: client.get_object(**kw), uri, "read", offset=at)
            got = response.get("ETag", "").strip('"')
            if want and got and got != want:
                response["Body"].close()
                raise ObjectChangedError(
                    f"{uri} changed after it was listed: etag {got!r}, listed {want!r}", uri=uri
                )
            want = want or got  # a resumed read reads the same object
            if at and not _resumes_at(response, at, total):
                response["Body"].close()
                raise ObjectChangedError(
                    f"{uri}: a read resumed at offset {at} got other bytes from the store (Content-Range "
                    f"{response.get('ContentRange')!r}, {response.get('ContentLength')} bytes), not the rest "
                    "of the object",
                    uri=uri,
                )
            if total is None:
                total = at + int(response.get("ContentLength", 0))
            body = response["Body"]
            try:
                while at < total:
                    started = time.monotonic()
                    try:
                        piece = self._read_piece(body, chunk)
                    except Exception as exc:  # noqa: BLE001 - retried from `at`, or translated
                        failures += 1
                        if failures >= self.options.retries or not is_retryable(exc):
                            raise self._translate(
                                exc,
                                uri,
                                "read",
                                tries=failures,
                                waited_s=time.monotonic() - started,
                                offset=at,
                            ) from exc
                        time.sleep(min(2.0, 0.05 * 2**failures))
                        break  # a new GET from `at`
                    if not piece:
                        raise ObjectChangedError(
                            f"{uri} changed after it was listed: its body ends at offset {at}, "
                            f"{total} bytes announced",
                            uri=uri,
                        )
                    at += len(piece)
                    yield piece
            finally:
                body.close()

    def _read_piece(self, body, chunk: int) -> bytes:
        """One read of a streamed body, within `timeout_s`: the connection it reads from is watched."""
        with deadline.deadline(self.options.timeout_s) as watch:
            conn = getattr(getattr(body, "_raw_stream", None), "connection", None)
            if conn is not None:
                watch.bind(conn)
            try:
                return body.read(chunk)
            except Exception as exc:
                if watch.expired:
                    raise StalledError(
                        f"the store stalled: no {chunk}-byte piece of the body within "
                        f"{self.options.timeout_s:g} s (S3Options.timeout_s); the connection was closed"
                    ) from exc
                raise
