"""Parquet rows of list and number columns from S3, gathered a batch at a time (ParquetSource.read_batch): the
same rows as pyarrow reads, ordered and shuffled, and an object overwritten after listing settled row by row
as an ObjectChangedError. A LoaderWorker in this process, against the moto server on 127.0.0.1."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydl
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.errors import ObjectChangedError
from raydl.plan.order import WindowedOrder, augmentation_seeds
from raydl.sources._parquet_source import clear_caches, decodes

pytestmark = pytest.mark.timeout(60)


def _put(s3_client, bucket, key, start, n):
    ids = np.arange(start, start + n)
    offsets = pa.array(np.arange(0, (n + 1) * 8, 8, dtype=np.int32))
    tokens = pa.ListArray.from_arrays(offsets, pa.array(np.repeat(ids, 8).astype(np.int32)))
    buf = io.BytesIO()
    pq.write_table(pa.table({"tokens": tokens, "n": ids}), buf, row_group_size=20)
    s3_client.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


def _epoch(ds, order, batch=16):
    worker = LoaderWorker(WorkerSpec(program=None, threads=2, on_error="skip"), ds.catalog, reuse_buffers=False)
    out = []
    for k in range(0, len(order), batch):
        ids = np.asarray(order[k : k + batch], np.int64)
        seeds = augmentation_seeds(ids, seed=0, epoch=0)
        out.append(worker.run_batch(BatchTask(rank=0, epoch=0, index=k // batch, ids=ids, seeds=seeds)))
    return out


def test_parquet_batches_from_s3_hold_each_row_once(moto_server, s3_client, bucket):
    """Ordered and shuffled, each row arrives once with its own tokens, each row group decoded once; an object
    rewritten after listing gives its rows ObjectChangedErrors and the other rows still arrive."""
    _put(s3_client, bucket, "t/a.parquet", 0, 50)
    _put(s3_client, bucket, "t/b.parquet", 50, 30)
    ds = raydl.read_parquet(f"s3://{bucket}/t/", s3=raydl.S3Options(endpoint_url=moto_server))
    assert ds.catalog.source.reads_plain_batches
    cat = ds.catalog
    shuffled = np.asarray(WindowedOrder(cat.column("count"), cat.source.shuffle_window, seed=1, epoch=0,
                                        fingerprint=cat.fingerprint))
    for order in (np.arange(80), shuffled):
        clear_caches()
        results = _epoch(ds, order)
        ids = np.concatenate([r.batch["id"] for r in results])
        assert ids.tolist() == order.tolist() and sorted(ids.tolist()) == list(range(80))
        for r in results:
            assert r.batch["tokens"].shape == (len(r.batch["id"]), 8)
            assert (r.batch["tokens"] == r.batch["id"][:, None]).all() and (r.batch["n"] == r.batch["id"]).all()
        assert len(decodes()) == cat.num_parts and max(decodes().values()) == 1

    _put(s3_client, bucket, "t/b.parquet", 500, 30)  # other tokens: another etag
    clear_caches()
    (result,) = _epoch(ds, np.arange(40, 60), batch=20)
    assert result.batch["id"].tolist() == list(range(40, 50))
    assert len(result.unreadable) == 10 and all(f.error is ObjectChangedError for f in result.unreadable)
