"""GCS and Azure listings (obstore) against a store on 127.0.0.1 that repeats its first page forever: the
listing ends with an error naming the prefix, not a loop."""

from __future__ import annotations

import http.server
import threading

import pytest

from raydl.errors import DataSourceError
from raydl.options import GCSOptions
from raydl.storage import _objstore
from raydl.storage.gcs import GCSStorage

pytestmark = pytest.mark.timeout(60)

_PAGE = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
         "<Name>b</Name><Prefix>p/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
         "<IsTruncated>true</IsTruncated><NextContinuationToken>T</NextContinuationToken>"
         "<Contents><Key>p/k0.tar</Key><Size>10</Size><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
         '<ETag>"e"</ETag></Contents></ListBucketResult>').encode()


class _Repeating(http.server.BaseHTTPRequestHandler):
    """Every GET: the same one-key page, truncated, with the same continuation token."""

    protocol_version = "HTTP/1.1"
    requests = 0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        type(self).requests += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(_PAGE)))
        self.end_headers()
        self.wfile.write(_PAGE)


def test_a_gcs_listing_that_repeats_its_page_is_an_error_naming_the_prefix(monkeypatch):
    """Pages of 2 keys (obstore gathers that many before handing them on): the same key twice is refused as a
    listing that repeats itself, after a few requests."""
    monkeypatch.setattr(_objstore, "_PAGE", 2)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Repeating)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        storage = GCSStorage(GCSOptions(endpoint_url=f"http://127.0.0.1:{server.server_address[1]}", retries=1,
                                        timeout_s=5))
        with pytest.raises(DataSourceError, match=r"listing gs://b/p/: the store listed gs://b/p/k0.tar after "
                                                  r"gs://b/p/k0.tar, out of order") as info:
            list(storage.list("gs://b/p/"))
        assert info.value.uri == "gs://b/p/" and _Repeating.requests < 10
    finally:
        server.shutdown()
        server.server_close()
