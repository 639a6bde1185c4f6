"""A real S3-compatible HTTP server on 127.0.0.1 (moto's server mode) for the S3 tests."""
from __future__ import annotations

import os

import pytest

_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def moto_server():
    """moto's ThreadedMotoServer on a free port; yields its endpoint URL. Dummy credentials go in the
    environment (before any Ray starts, so loader actors inherit them)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    saved = {k: os.environ.get(k) for k in _CREDS}
    os.environ.update(_CREDS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_client(moto_server):
    import boto3

    return boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")


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
