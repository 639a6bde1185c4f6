"""Latency hiding: one loader worker keeps max_concurrency GETs in flight, so latency per request costs little."""
from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

import raydl
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.bench.latency_proxy import LatencyProxy
from raydl.describe.transforms import compile_stages

from s3_util import put_many

pytestmark = pytest.mark.timeout(180)

N = 96
CONCURRENCY = 16
DELAY_S = 1.0  # long beside a loaded machine's scheduling delays (every thread of the worker, the proxy and the
# server shares one GIL here), so the IO threads' requests all arrive while the first still waits


def _rate(endpoint: str, bucket: str, concurrency: int, n: int = N) -> float:
    """Requests/s of one worker reading n one-object samples (one GET each) in one batch."""
    s3 = raydl.S3Options(endpoint_url=endpoint, max_concurrency=concurrency)
    ds = raydl.read_images(f"s3://{bucket}/tiny", s3=s3).decode().center_crop(8)
    worker = LoaderWorker(WorkerSpec(program=compile_stages(ds.stages), threads=2), ds.catalog)
    ids = np.arange(n)
    worker.run_batch(BatchTask(0, 0, 0, ids[:concurrency], ids[:concurrency]))  # connections and client warm
    t0 = time.perf_counter()
    result = worker.run_batch(BatchTask(0, 0, 1, ids, ids))
    took = time.perf_counter() - t0
    assert len(result.batch["id"]) == n and not result.skipped and not result.unreadable
    return n / took


def test_one_worker_hides_per_request_latency(moto_server, bucket):
    """With 1 s added to every request, one worker keeps up to max_concurrency GETs waiting out their
    latency at once (seen at the proxy: more than half of them), and one at a time when max_concurrency is 1,
    so the latency costs about 1/max_concurrency of it per request. How fast that reads is a timing claim,
    measured by `raydl bench storage` against min(concurrency / delay, the server's ceiling); a shared
    machine's clock only prints it here."""
    blobs = {}
    for i in range(N):
        b = io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(b, "PNG")
        blobs[f"tiny/c{i % 2}/{i:03d}.png"] = b.getvalue()
    put_many(bucket, blobs)
    host, port = moto_server.removeprefix("http://").split(":")
    with LatencyProxy(host, int(port), delay_s=DELAY_S) as slow:
        serial = _rate(slow.url, bucket, 1, n=4)
        serial_peak = slow.peak_waiting
        slow.reset_peak()
        delayed = _rate(slow.url, bucket, CONCURRENCY)
        peak = slow.peak_waiting
    print(f"with {DELAY_S * 1000:.0f} ms: {delayed:.0f} req/s at most {peak} in flight, one at a time "
          f"{serial:.1f} req/s")
    assert serial <= 1 / DELAY_S  # the proxy does add the latency (a lower bound on time: no clock flakes it)
    assert serial_peak == 1  # max_concurrency=1: one request at a time
    # the IO threads' requests wait out their latency side by side, never more than max_concurrency at once;
    # on a loaded machine a thread may still be handing its last sample on when the others' requests end
    # (12 of 16 seen on 2 busy cores at 250 ms), so the floor is half: serial reads give 1, a concurrency
    # capped at a quarter gives 4
    assert CONCURRENCY // 2 < peak <= CONCURRENCY, (peak, CONCURRENCY)
