"""Buckets on the moto server (tests/conftest.py starts it) and a Ray cluster for the S3 tests."""
from __future__ import annotations

import pytest

_made: set[str] = set()


@pytest.fixture
def bucket(s3_client, request):
    """A fresh, empty bucket named after the test (the server lives for the session; buckets are not reused)."""
    base = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    name, i = base, 0
    while name in _made:
        i += 1
        name = f"{base[:48]}-{i}"
    _made.add(name)
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def ray_s3(moto_server):
    """A local Ray (2 CPUs) started after the S3 server, so its workers inherit the dummy credentials."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
