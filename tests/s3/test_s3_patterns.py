"""Shard patterns mean the same on S3 as on local disk: `*` stays within a folder, `**` crosses folders, a
key that exists as written is itself, against the moto server on 127.0.0.1."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from raydl.options import S3Options
from raydl.sources.webdataset import expand_urls
from raydl.storage import LocalStorage
from raydl.storage.s3 import S3Storage

_spec = importlib.util.spec_from_file_location("local_patterns", Path(__file__).parents[1] / "unit" / "test_patterns.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)  # the same files and patterns as the local test

pytestmark = pytest.mark.timeout(60)


def test_s3_patterns_name_what_local_patterns_name(tmp_path, moto_server, s3_client, bucket):
    """Every pattern names the same shards under an S3 prefix as under a local folder holding the same files
    (S3 let `*` cross '/' and read `shard[1].tar` as a class before)."""
    cases.make_tree(tmp_path)
    for name in cases.NAMES:
        s3_client.put_object(Bucket=bucket, Key=f"d/{name}", Body=cases.tiny_tar(name))
    s3_client.put_object(Bucket=bucket, Key="d2/a-1.tar", Body=cases.tiny_tar("a-1.tar"))  # outside the prefix
    s3 = S3Storage(S3Options(endpoint_url=moto_server))
    for pattern, want in cases.PATTERNS.items():
        assert cases.named(f"s3://{bucket}/d/", pattern, s3) == want, pattern
        assert cases.named(f"{tmp_path}/", pattern, LocalStorage()) == want, pattern
    with pytest.raises(ValueError, match="matches nothing"):
        expand_urls(f"s3://{bucket}/d/*/*/*/*.tar", lambda _u: s3)
