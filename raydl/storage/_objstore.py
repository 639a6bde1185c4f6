"""What GCS and Azure Blob storage share: reads through obstore (Rust's object_store), under raydl's
deadlines, retries and error names.

A storage value holds only its options; each process builds one obstore store per bucket (container)
lazily, and threads share it (its HTTP client pools `max_concurrency` connections). Stores are never
pickled. obstore's own retries are off: raydl's RetryPolicy (raydl/storage/fetch.py) retries, so that the
bounds in the options are the only ones.

Deadlines: the client's request timeout is `timeout_s` and covers the whole request, from the connect to
the last byte of the body, so a store that stalls or drips a byte at a time ends the try after
`timeout_s`; the dropped try's connection is closed and the next try opens a new one. A streamed read is a
run of ranged reads of at most `chunk` bytes, each a request under that deadline, every one after the
first conditional on the first one's etag.

Listing: object_store lists by path segment ("a/b" lists "a/b/..."), but a raydl prefix is a string
("shards/train-" lists "shards/train-000.tar"). A prefix that does not end in "/" is listed from its
folder, starting just before it (the stores list in key order), until the keys pass it. A failed page
resumes after the last key it gave.

obstore's errors become raydl.errors types here, naming gs://bucket/key or az://container/key. Their text
is cut to its first line with every URL's query string removed (a SAS token travels there), and a message
that still holds a secret of the options is not chained as the cause.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

from raydl.errors import AccessDeniedError, DataSourceError, ObjectChangedError
from raydl.storage.base import MAX_LIST_PAGES, STREAM_CHUNK, BaseStorage, ObjectInfo
from raydl.storage.fetch import RetryPolicy, call_with_retries

__all__ = ["ObjectStoreStorage", "StalledError", "is_retryable"]

_stores: dict[tuple, object] = {}
_stores_lock = threading.Lock()
_STATUS = re.compile(r"status code: (\d{3})|\b(\d{3}) [A-Z][a-z]+(?: [A-Z][a-z]+)*\b")
_QUERY = re.compile(r"(https?://[^\s?\"']*)\?[^\s\"']*")
_PAGE = 1000  # keys handed on per listing chunk


class StalledError(TimeoutError):
    """A try ran past its deadline (the options' timeout_s) and its connection was dropped; retried."""


def _status(exc: BaseException) -> int:
    m = _STATUS.search(str(exc).split("\n\nDebug source:", 1)[0])
    if not m:
        return 0
    return int(m.group(1) or m.group(2))


def is_retryable(exc: BaseException) -> bool:
    """Throttling (429), 5xx, timeouts and connection failures are worth another try; other 4xx never."""
    from obstore.exceptions import GenericError

    if isinstance(exc, StalledError):
        return True
    if isinstance(exc, GenericError):
        status = _status(exc)
        return status == 0 or status >= 500 or status in (408, 429)
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        return False
    return isinstance(exc, (ConnectionError, TimeoutError))


def _etag(value) -> str:
    return str(value or "").strip('"')


class ObjectStoreStorage(BaseStorage):
    """The reading half of a storage over obstore; a subclass says its scheme and builds its stores."""

    __slots__ = ()

    scheme: str = ""  # "gs", "az"
    bucket_word: str = "bucket"  # what the store calls the part before the first "/"
    options_name: str = ""  # "GCSOptions", for messages

    # -- what a subclass gives --------------------------------------------------------------------------
    def _make_store(self, bucket: str, client_options: dict, retry_config: dict):
        raise NotImplementedError

    def _secrets(self) -> tuple[str, ...]:
        """Strings of the options that must never reach a message."""
        return ()

    def _credentials_hint(self) -> str:
        return ""

    # -- the store (per process, per bucket, lazily) ---------------------------------------------------
    @property
    def default_io_concurrency(self) -> int:
        return self.options.max_concurrency

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

    def split(self, uri: str) -> tuple[str, str]:
        """("bucket", "key/prefix") of "SCHEME://bucket/key/prefix"; a bad URI is a ValueError naming it."""
        head = f"{self.scheme}://"
        if not uri.startswith(head):
            raise ValueError(f"not a {head} URI: {uri!r}")
        bucket, _, key = uri[len(head) :].partition("/")
        if not bucket:
            raise ValueError(f"{uri!r} names no {self.bucket_word} (expected {head}{self.bucket_word}/key)")
        return bucket, key

    def store(self, bucket: str):
        """This process's obstore store for `bucket` under these options (built on first use)."""
        key = (type(self), self.options, bucket, os.getpid())
        store = _stores.get(key)
        if store is None:
            with _stores_lock:
                store = _stores.get(key)
                if store is None:
                    o = self.options
                    timeout = timedelta(seconds=o.timeout_s)
                    client_options = {
                        "timeout": timeout,
                        "connect_timeout": timeout,
                        "pool_max_idle_per_host": str(o.max_concurrency),
                    }
                    retry_config = {"max_retries": 0, "retry_timeout": timeout}
                    try:
                        import obstore  # noqa: F401 - a missing one says what to install
                    except ImportError as exc:
                        raise DataSourceError(
                            f"reading {self.scheme}:// needs obstore: pip install "
                            f"'raydl-loader[{self.scheme.replace('gs', 'gcs').replace('az', 'azure')}]'"
                        ) from exc
                    try:
                        store = self._make_store(bucket, client_options, retry_config)
                    except Exception as exc:  # noqa: BLE001 - a bad configuration, named without secrets
                        raise DataSourceError(
                            f"cannot set up the {self.options_name[:-7]} client for "
                            f"{self.scheme}://{bucket}: {self._scrub(exc)}"
                        ) from self._cause(exc)
                    _stores[key] = store
        return store

    # -- errors ---------------------------------------------------------------------------------------
    def _scrub(self, exc: BaseException) -> str:
        text = str(exc).split("\n\nDebug source:", 1)[0].strip().splitlines()
        text = text[0] if text else type(exc).__name__
        text = _QUERY.sub(r"\1?<query removed>", text)
        for secret in self._secrets():
            if secret:
                text = text.replace(secret, "<secret>")
        return text

    def _cause(self, exc: BaseException) -> BaseException | None:
        """The error to chain: `exc`, unless its text holds a secret or a query string."""
        full = str(exc)
        if _QUERY.search(full) or any(s and s in full for s in self._secrets()):
            return None
        return exc

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
        from obstore.exceptions import PermissionDeniedError, PreconditionError, UnauthenticatedError

        bucket, _ = self.split(uri)
        at = f" at offset {offset}" if offset is not None else ""
        if length is not None:
            at += f" ({length} bytes)"
        status = _status(exc) if not isinstance(exc, StalledError) else 0
        detail = str(exc) if isinstance(exc, StalledError) else self._scrub(exc)
        if "token request" in detail or isinstance(exc, UnauthenticatedError) or status == 401:
            return AccessDeniedError(
                f"cannot {what} {uri}: the store did not accept the credentials, or none were found "
                f"({detail}){self._credentials_hint()}",
                uri=uri,
            )
        if isinstance(exc, PermissionDeniedError) or status == 403:
            return AccessDeniedError(
                f"permission error: access to {self.bucket_word} {bucket!r} was denied when trying to "
                f"{what} {uri}; the credentials in use lack the permission ({detail})",
                uri=uri,
            )
        if isinstance(exc, FileNotFoundError) or status == 404:
            if any(code in detail for code in ("ContainerNotFound", "NoSuchBucket", "bucket does not exist")):
                return DataSourceError(
                    f"cannot {what} {uri}: {self.bucket_word} {bucket!r} does not exist", uri=uri
                )
            return DataSourceError(f"cannot {what} {uri}{at}: the object does not exist (any more)", uri=uri)
        if isinstance(exc, PreconditionError) or status in (412, 416):
            return ObjectChangedError(f"{uri} changed after it was listed{at}; list the data again", uri=uri)
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
        """fn() under the retry policy, each try within the client's deadline; failures become raydl
        errors."""
        from obstore.exceptions import GenericError

        tries = [0]
        timeout_s = self.options.timeout_s

        def attempt(time_left_s: float):
            tries[0] += 1
            started = time.monotonic()
            try:
                return fn()
            except GenericError as exc:
                text = str(exc)
                if ("TimedOut" in text or "timed out" in text or "kind: Timeout" in text) or (
                    _status(exc) == 0 and time.monotonic() - started >= 0.9 * timeout_s
                ):
                    raise StalledError(
                        f"the store stalled: no complete response within {timeout_s:g} s "
                        f"({self.options_name}.timeout_s={timeout_s:g}); the connection was closed"
                    ) from None
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
        except Exception as exc:  # noqa: BLE001 - every obstore failure is translated here
            waited = time.monotonic() - start
            raise self._translate(
                exc, uri, what, tries=tries[0], waited_s=waited, offset=offset, length=length
            ) from self._cause(exc)

    # -- the interface --------------------------------------------------------------------------------
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with the prefix (any number: the store's pages, one request each)."""
        import obstore

        bucket, key_prefix = self.split(prefix)
        store = self.store(bucket)
        head = f"{self.scheme}://{bucket}/"
        if not key_prefix or key_prefix.endswith("/"):
            folder, after = key_prefix.rstrip("/") or None, None
        else:
            folder = key_prefix.rpartition("/")[0] or None
            after = key_prefix[:-1]  # the keys come in order: the prefix itself is the first that can match
        state: dict = {"pages": None, "after": after}

        def next_chunk():
            if state["pages"] is None:
                state["pages"] = iter(obstore.list(store, folder, offset=state["after"], chunk_size=_PAGE))
            try:
                return next(state["pages"], None)
            except Exception:
                state["pages"] = None  # the next try lists again, after the last key handed on
                raise

        last = None
        for _ in range(MAX_LIST_PAGES):
            chunk = self._call(next_chunk, prefix, "list")
            if chunk is None:
                return
            for meta in chunk:
                key = meta["path"]
                # keys come in order: a store that lists one again would list forever
                if last is not None and key <= last:
                    raise DataSourceError(
                        f"listing {prefix}: the store listed {head + key} after {head + last}, out of order "
                        "(a listing that repeats itself)",
                        uri=prefix,
                    )
                state["after"] = last = key
                if not key.startswith(key_prefix):
                    if key > key_prefix:
                        return  # past every key that starts with the prefix
                    continue
                if key.endswith("/"):
                    continue  # a folder marker, not data
                yield ObjectInfo(head + key, int(meta["size"]), _etag(meta.get("e_tag")))
        raise DataSourceError(
            f"listing {prefix}: more than {MAX_LIST_PAGES:,} pages of {_PAGE:,} keys; list a narrower prefix",
            uri=prefix,
        )

    def stat(self, uri: str) -> ObjectInfo:
        import obstore

        bucket, key = self.split(uri)
        store = self.store(bucket)
        meta = self._call(lambda: obstore.head(store, key), uri, "stat")
        return ObjectInfo(uri, int(meta["size"]), _etag(meta.get("e_tag")))

    def _get(self, uri: str, start: int, end: int | None, etag: str | None, **where) -> tuple[bytes, dict]:
        """Bytes [start, end) of `uri` (end None: to its end) and the object's metadata, in one try-bounded
        request, conditional on `etag`; an object of another etag is an ObjectChangedError."""
        import obstore

        bucket, key = self.split(uri)
        store = self.store(bucket)
        options: dict = {}
        if end is not None:
            options["range"] = (start, end)
        elif start:
            options["range"] = {"offset": start}
        if etag:
            options["if_match"] = f'"{etag}"'

        def get() -> tuple[bytes, dict]:
            result = obstore.get(store, key, options=options)
            return bytes(result.bytes()), result.meta

        data, meta = self._call(get, uri, "read", **where)
        got = _etag(meta.get("e_tag"))
        if etag and got and got != etag:  # a store that ignores If-Match says which object it read
            raise ObjectChangedError(
                f"{uri} changed after it was listed: etag {got!r}, listed {etag!r}", uri=uri
            )
        return data, meta

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        self.split(uri)
        if length == 0:
            return b""
        data, _ = self._get(uri, offset, offset + length, etag, offset=offset, length=length)
        if len(data) != length:
            raise ObjectChangedError(
                f"{uri} changed after it was listed: {length} bytes at offset {offset} asked, "
                f"{len(data)} there",
                uri=uri,
            )
        return data

    def read(self, uri: str) -> bytes:
        return self._get(uri, 0, None, None)[0]

    def stream(self, uri: str, *, etag: str | None = None, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
        """The whole object, `chunk` bytes per ranged request, each under the deadline and, after the first,
        conditional on the first one's etag (or `etag`)."""
        info = self.stat(uri)
        if etag and info.etag and info.etag != etag:
            raise ObjectChangedError(
                f"{uri} changed after it was listed: etag {info.etag!r}, listed {etag!r}", uri=uri
            )
        want = etag or info.etag or None
        for at in range(0, info.size, chunk):
            yield self.read_range(uri, at, min(chunk, info.size - at), etag=want)
