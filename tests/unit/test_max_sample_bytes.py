"""loader(max_sample_bytes=...): a sample larger than it (an image file, a tar member, a Parquet cell) is a
sample error under on_error naming it and its size, never read where the catalog gives its size."""
from __future__ import annotations

import dataclasses
import io
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import raydl
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.describe.transforms import compile_stages
from raydl.options import LoaderConfig
from raydl.plan.order import augmentation_seeds

from counting_storage import CountingStorage  # beside this file

pytestmark = pytest.mark.timeout(60)



def png(shape, seed=0) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*shape, 3), np.uint8)).save(b, "PNG")
    return b.getvalue()


def run(ds, limit, on_error="skip", ids=None):
    storage = CountingStorage()
    catalog = dataclasses.replace(ds.catalog, storage=storage)
    spec = WorkerSpec(program=compile_stages(ds.decode().center_crop(8).stages), threads=2, on_error=on_error,
                      max_sample_bytes=limit)
    worker = LoaderWorker(spec, catalog, reuse_buffers=False)
    ids = np.arange(len(ds), dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
    task = BatchTask(rank=0, epoch=0, index=0, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0))
    return worker.run_batch(task), storage.reads


def test_the_option_defaults_to_256_mib_and_is_checked():
    """LoaderConfig.max_sample_bytes: 256 MiB by default; a positive int, else a ValueError naming it."""
    assert LoaderConfig(batch_size=1).max_sample_bytes == 256 << 20
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="max_sample_bytes") as info:
            LoaderConfig(batch_size=1, max_sample_bytes=bad)
        assert repr(bad) in str(info.value)


def test_an_image_file_over_the_limit_is_skipped_unread(tmp_path):
    """An image file larger than max_sample_bytes is skipped (on_error="skip") with its path and size in the
    reason, and its bytes are never read; the others decode."""
    (tmp_path / "c").mkdir()
    small, big = png((8, 8)), png((64, 64), seed=1)
    (tmp_path / "c" / "a.png").write_bytes(small)
    (tmp_path / "c" / "b.png").write_bytes(big)
    ds = raydl.read_images(str(tmp_path))
    limit = (len(small) + len(big)) // 2
    result, reads = run(ds, limit)
    (failure,) = result.skipped
    big_uri = str(tmp_path / "c" / "b.png")
    assert failure.uri == big_uri and f"is {len(big)} bytes, more than max_sample_bytes ({limit})" in failure.reason
    assert result.batch["key"] == ["c/a.png"] and not result.unreadable
    assert all(uri != big_uri for uri, _, _ in reads)
    with pytest.raises(raydl.errors.SampleDecodeError, match="max_sample_bytes"):  # on_error="raise"
        raydl.plan.failures.ErrorPolicy("raise").settle(run(ds, limit, on_error="raise")[0].skipped)
    replaced, _ = run(ds, limit, on_error="replace")
    assert replaced.batch["key"] == ["c/a.png", "c/a.png"] and replaced.replaced[0].substitute_id == 0


def test_a_tar_member_over_the_limit_is_skipped_unread(tmp_path):
    """A WebDataset image member larger than max_sample_bytes is skipped, named by its shard and key with
    its size; its range is never read (it is wider than the coalescing gap, so no neighbour's read spans
    it)."""
    small, big = png((8, 8)), png((200, 200), seed=1)
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in [("a.png", small), ("b.png", big), ("c.png", small)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = raydl.read_webdataset(str(path), label_field=None)
    t = ds.catalog.samples().to_pydict()
    result, reads = run(ds, len(small) + 10)
    (failure,) = result.skipped
    assert failure.uri == f"{path}#b" and f"is {len(big)} bytes" in failure.reason
    assert result.batch["key"] == ["a", "c"]
    big_range = (t["offset"][1], t["offset"][1] + t["length"][1])
    assert all(off + n <= big_range[0] or off >= big_range[1] for _, off, n in reads), reads


def test_a_parquet_cell_over_the_limit_is_skipped(tmp_path):
    """A Parquet row whose image cell is larger than max_sample_bytes (known once its row group is decoded)
    is skipped, named by file and row, with its size."""
    small, big = png((8, 8)), png((64, 64), seed=1)
    pq.write_table(pa.table({"img": [small, big, small]}), tmp_path / "t.parquet")
    ds = raydl.read_parquet(str(tmp_path / "t.parquet"), image_column="img")
    result, _ = run(ds, len(small) + 10)
    (failure,) = result.skipped
    assert failure.uri.endswith("t.parquet#0:1") and f"is {len(big)} bytes" in failure.reason
    assert len(result.batch["key"]) == 2
