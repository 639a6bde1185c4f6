"""The storage contract: every backend (local disk; S3, GCS and Azure Blob through moto, fake-gcs-server and azurite
on 127.0.0.1) lists, stats and reads alike."""
from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from raydl.config import S3Options
from raydl.errors import DataSourceError, ObjectChangedError
from raydl.storage import LocalStorage, Storage
from raydl.storage.s3 import S3Storage

from cloud_util import make_cloud

pytestmark = pytest.mark.timeout(120)


@dataclass
class Backend:
    storage: Storage
    root: str  # a prefix ending in "/"
    put: object  # put(relative key, bytes)
    delete: object  # delete(relative key)


_buckets = iter(range(10**6))


@pytest.fixture(params=["local", "s3", "gs", "az"])
def backend(request, tmp_path):
    if request.param == "local":
        def put(key: str, data: bytes) -> None:
            p = tmp_path / key
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)

        yield Backend(LocalStorage(), str(tmp_path) + "/", put, lambda key: (tmp_path / key).unlink())
    elif request.param == "s3":
        endpoint = request.getfixturevalue("moto_server")
        client = request.getfixturevalue("s3_client")
        bucket = f"contract-{next(_buckets)}"
        client.create_bucket(Bucket=bucket)
        yield Backend(S3Storage(S3Options(endpoint_url=endpoint)), f"s3://{bucket}/data/",
                      lambda key, data: client.put_object(Bucket=bucket, Key=f"data/{key}", Body=data),
                      lambda key: client.delete_object(Bucket=bucket, Key=f"data/{key}"))
    else:
        cloud = make_cloud(request, request.param)
        yield Backend(cloud.storage(), f"{cloud.root}data/",
                      lambda key, data: cloud.put(f"data/{key}", data),
                      lambda key: cloud.server.delete(cloud.bucket, f"data/{key}"))


def test_list_is_recursive_with_sizes(backend):
    """list(prefix) yields every object below it, nested ones too, with full URIs, sizes and a str etag."""
    files = {"a.bin": b"x" * 10, "sub/b.bin": b"", "sub/deeper/c.bin": b"yz"}
    for k, v in files.items():
        backend.put(k, v)
    got = {o.uri: o for o in backend.storage.list(backend.root)}
    assert sorted(got) == sorted(backend.root + k for k in files)
    for k, v in files.items():
        info = got[backend.root + k]
        assert info.size == len(v) and isinstance(info.etag, str)
        assert backend.storage.stat(info.uri) == info


def test_read_range_returns_exact_bytes(backend):
    """read_range gives exactly `length` bytes from `offset`, at the start, middle and end; read gives all."""
    data = bytes(range(256)) * 40
    backend.put("blob", data)
    uri = backend.root + "blob"
    etag = backend.storage.stat(uri).etag
    for off, n in [(0, 1), (0, len(data)), (1000, 512), (len(data) - 7, 7), (5, 0)]:
        assert backend.storage.read_range(uri, off, n, etag=etag or None) == data[off:off + n]
    assert backend.storage.read(uri) == data


def test_missing_object_names_uri_and_offset(backend):
    """Reading an object that is not there is a DataSourceError naming its URI and the offset."""
    uri = backend.root + "nope.bin"
    with pytest.raises(DataSourceError) as info:
        backend.storage.read_range(uri, 1234, 10)
    assert info.value.uri == uri and uri in str(info.value) and "1234" in str(info.value)
    with pytest.raises(DataSourceError, match="nope.bin"):
        backend.storage.stat(uri)


def test_object_that_shrank_is_a_changed_object_error(backend):
    """Fewer bytes than listed (the object was rewritten shorter) is ObjectChangedError naming it, never short data."""
    backend.put("shrinks", b"0123456789")
    uri = backend.root + "shrinks"
    backend.storage.read_range(uri, 0, 10)
    backend.put("shrinks", b"0123")
    with pytest.raises(ObjectChangedError) as info:
        backend.storage.read_range(uri, 2, 8)
    assert info.value.uri == uri


def test_concurrent_reads_from_many_threads(backend):
    """Many threads reading ranges of several objects at once each get their own exact bytes."""
    blobs = {f"o{i}": bytes([i]) * (1000 + i) for i in range(8)}
    for k, v in blobs.items():
        backend.put(k, v)
    jobs = [(k, off, 100) for k in blobs for off in range(0, 900, 150)]
    with ThreadPoolExecutor(16) as pool:
        out = list(pool.map(lambda j: backend.storage.read_range(backend.root + j[0], j[1], j[2]), jobs))
    assert out == [blobs[k][off:off + n] for k, off, n in jobs]


def test_storage_pickles_small_after_use(backend):
    """A storage is a small value: after use it still pickles without any client or open file, and the copy reads."""
    backend.put("p", b"pickled")
    uri = backend.root + "p"
    backend.storage.read_range(uri, 0, 3)
    blob = pickle.dumps(backend.storage)
    assert len(blob) < 1024
    assert pickle.loads(blob).read_range(uri, 1, 3) == b"ick"


def test_node_cache_hooks_of_a_storage_without_a_cache(backend):
    """Every backend answers a reader's node-cache questions alike: scoped() is itself, it uses no plans and
    plan() leaves the next read as it is, flush() waits for nothing, take_cache_counts() is {}."""
    backend.put("h", b"hooks")
    uri = backend.root + "h"
    storage = backend.storage
    assert storage.scoped() is storage and storage.scoped(behind=True) is storage
    assert storage.uses_plans is False
    storage.plan(uri, 0, 5, [(0, 2), (3, 2)])
    assert storage.read_range(uri, 0, 5) == b"hooks"
    storage.flush()
    assert storage.take_cache_counts() == {}


def test_listing_of_a_missing_local_root_names_it(tmp_path):
    """A local prefix that does not exist is a DataSourceError naming it (not an empty listing)."""
    root = str(Path(tmp_path) / "missing")
    with pytest.raises(DataSourceError, match="does not exist") as info:
        list(LocalStorage().list(root))
    assert info.value.uri == root
