"""Listing a WebDataset on S3 never makes a request per sample: requests counted at an HTTP front of the moto
server on 127.0.0.1. Indexing costs at most one GET per shard plus the LIST pages, a cached index only the LIST
pages, DALI .idx files one GET each and no shard read, a wids JSON one GET; a rewritten shard is indexed again."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import raydl
from raydl.sources import webdataset as wds_source

from s3_util import FaultFront, put_many

pytestmark = pytest.mark.timeout(120)

SHARDS, PER_SHARD = 12, 20
WDS2IDX = Path(sys.executable).parent / "wds2idx"


def shard_bytes(s: int, n: int = PER_SHARD, tag: str = "") -> bytes:
    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for i in range(n):
            sink.write({"__key__": f"{tag}s{s:02d}-{i:03d}", "jpg": bytes([i]) * (50 + i), "cls": str(i % 5)})
    return buf.getvalue()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYDL_CACHE_DIR", str(tmp_path / "cache"))
    wds_source.clear_blocks()
    return tmp_path / "cache"


@pytest.fixture
def front(moto_server):
    with FaultFront(moto_server, lambda *_: None) as f:
        yield f


def kinds(front: FaultFront, since: int = 0) -> dict[str, int]:
    """Requests since `since` by kind: LIST pages, HEADs, GETs of .tar shards, GETs of anything else."""
    out = {"list": 0, "head": 0, "shard": 0, "other": 0}
    for method, path, _status in front.requests[since:]:
        if method == "HEAD":
            out["head"] += 1
        elif "list-type=2" in path:
            out["list"] += 1
        elif path.split("?")[0].endswith(".tar"):
            out["shard"] += 1
        else:
            out["other"] += 1
    return out


def keys_of(ds) -> list[str]:
    cat = ds.catalog
    return cat.source.locate(cat, np.arange(len(cat))).key


def test_indexing_costs_a_get_per_shard_and_a_cached_index_only_the_list(front, bucket, cache):
    """A brace pattern of 12 shards of 20 samples: first listing ≤ 12 shard GETs + the LIST pages and no HEAD (264
    requests); the second, from the node cache, only the LIST pages; a rewritten shard (new etag)
    is indexed again with one GET and its new samples are seen, never the stale index."""
    put_many(bucket, {f"d/shard-{s:04d}.tar": shard_bytes(s) for s in range(SHARDS)})
    s3 = raydl.S3Options(endpoint_url=front.url)
    url = f"s3://{bucket}/d/shard-{{0000..{SHARDS + 2:04d}}}.tar"  # two names past the end: skipped
    ds = raydl.read_webdataset(url, s3=s3)
    first = kinds(front)
    assert len(ds) == SHARDS * PER_SHARD
    assert first["head"] == 0 and first["other"] == 0 and first["list"] == 1
    assert first["shard"] <= SHARDS, first
    n = len(front.requests)
    again = raydl.read_webdataset(url, s3=s3)
    assert kinds(front, n) == {"list": 1, "head": 0, "shard": 0, "other": 0}
    assert again.catalog.fingerprint == ds.catalog.fingerprint
    assert keys_of(again) == [f"s{s:02d}-{i:03d}" for s in range(SHARDS) for i in range(PER_SHARD)]

    put_many(bucket, {"d/shard-0003.tar": shard_bytes(3, n=7, tag="new-")})  # other samples, another etag
    n = len(front.requests)
    changed = raydl.read_webdataset(url, s3=s3)
    assert kinds(front, n) == {"list": 1, "head": 0, "shard": 1, "other": 0}
    assert len(changed) == (SHARDS - 1) * PER_SHARD + 7
    assert changed.catalog.fingerprint != ds.catalog.fingerprint
    got = keys_of(changed)
    assert got[3 * PER_SHARD : 3 * PER_SHARD + 7] == [f"new-s03-{i:03d}" for i in range(7)]


@pytest.mark.skipif(not WDS2IDX.exists() or shutil.which("tar") is None, reason="DALI's wds2idx is not installed")
def test_dali_idx_files_beside_the_shards_mean_no_shard_is_read(front, bucket, cache, tmp_path):
    """With wds2idx's NAME.idx beside each shard, listing GETs only the .idx files (one each) plus the LIST page;
    a worker whose node cache is empty reads the .idx again, not the shard's headers."""
    objects = {}
    for s in range(4):
        local = tmp_path / f"shard-{s:04d}.tar"
        local.write_bytes(shard_bytes(s))
        subprocess.run([str(WDS2IDX), str(local)], check=True, capture_output=True)
        objects[f"d/shard-{s:04d}.tar"] = local.read_bytes()
        objects[f"d/shard-{s:04d}.idx"] = (tmp_path / f"shard-{s:04d}.idx").read_bytes()
    put_many(bucket, objects)
    s3 = raydl.S3Options(endpoint_url=front.url)
    ds = raydl.read_webdataset(f"s3://{bucket}/d/shard-{{0000..0003}}.tar", s3=s3)
    assert kinds(front) == {"list": 1, "head": 0, "shard": 0, "other": 4}
    shutil.rmtree(cache)  # another node: no cache
    wds_source.clear_blocks()
    n = len(front.requests)
    assert keys_of(ds) == [f"s{s:02d}-{i:03d}" for s in range(4) for i in range(PER_SHARD)]
    assert kinds(front, n) == {"list": 0, "head": 0, "shard": 0, "other": 4}


def test_a_wids_shard_list_lists_with_one_get_and_workers_index_on_first_read(front, bucket, cache):
    """read_webdataset("s3://.../shards.json"): one GET of the JSON and the LIST page, no shard read; a worker
    indexes a shard with one GET when it first reads it; a shard whose count disagrees with nsamples gives an
    error for its samples naming it."""
    put_many(bucket, {f"w/shard-{s}.tar": shard_bytes(s) for s in range(3)})
    doc = {"__kind__": "wids-shard-index-v1", "name": "t", "shardlist": [
        {"url": f"shard-{s}.tar", "nsamples": PER_SHARD if s < 2 else PER_SHARD + 1} for s in range(3)]}
    put_many(bucket, {"w/shards.json": json.dumps(doc).encode()})
    s3 = raydl.S3Options(endpoint_url=front.url)
    ds = raydl.read_webdataset(f"s3://{bucket}/w/shards.json", s3=s3)
    assert len(ds) == 3 * PER_SHARD + 1
    assert kinds(front) == {"list": 1, "head": 0, "shard": 0, "other": 1}
    n = len(front.requests)
    cat = ds.catalog
    located = cat.source.locate(cat, np.array([0, 1, PER_SHARD, 2 * PER_SHARD + 3]))
    assert located.key[:3] == ["s00-000", "s00-001", "s01-000"]
    assert kinds(front, n)["shard"] == 3  # one streamed GET per shard touched
    assert set(located.errors) == {3} and f"s3://{bucket}/w/shard-2.tar" in str(located.errors[3])
    assert cat.shards.column("uri")[int(located.shard[3])].as_py() == f"s3://{bucket}/w/shard-2.tar"  # as failures name it
