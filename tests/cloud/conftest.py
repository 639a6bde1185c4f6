"""Real GCS and Azure Blob servers on 127.0.0.1 for the gs:// and az:// tests (tests/cloud/servers.py), a fresh
bucket or container per test, and one Ray cluster per module."""
from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

import raydl

from cloud_util import Cloud, make_cloud
from servers import Azurite, FakeGCS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "s3"))  # s3_util's FaultFront: any HTTP store

_names = itertools.count()


def _fresh(request) -> str:
    """A bucket or container name of the test's (lowercase, 3-63 chars, unique in the session)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    return f"t{next(_names):03d}-{base}".rstrip("-")


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory):
    """fake-gcs-server in memory; STORAGE_EMULATOR_HOST names it meanwhile (before any Ray starts, so loader
    actors inherit it), as Google's client reads it."""
    server = FakeGCS(tmp_path_factory.mktemp("fake-gcs"))
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = f"127.0.0.1:{server.port}"
    yield server
    server.stop()
    if saved is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = saved


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    server = Azurite(tmp_path_factory.mktemp("azurite"))
    yield server
    server.stop()


@pytest.fixture
def gcs_bucket(fake_gcs, request) -> str:
    name = _fresh(request)
    fake_gcs.create_bucket(name)
    return name


@pytest.fixture
def az_container(azurite, request) -> str:
    name = _fresh(request)
    azurite.create_container(name)
    return name


@pytest.fixture(scope="session")
def gcs_options(fake_gcs) -> raydl.GCSOptions:
    return raydl.GCSOptions(endpoint_url=fake_gcs.url)


@pytest.fixture(scope="session")
def azure_options(azurite) -> raydl.AzureOptions:
    return raydl.AzureOptions(connection_string=azurite.connection_string)


@pytest.fixture(params=["gs", "az"])
def cloud(request) -> Cloud:
    """The test once against fake-gcs-server (gs://) and once against azurite (az://)."""
    return make_cloud(request, request.param)


@pytest.fixture(scope="module")
def ray_cloud(fake_gcs, azurite):
    """A local Ray (2 CPUs) started after both servers, so its workers inherit STORAGE_EMULATOR_HOST."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
