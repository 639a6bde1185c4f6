"""read_tokens from the moto server: the same windows, labels and positions as from disk, for a Megatron
corpus (the .idx fetched once, the .bin read in ranges) and a Parquet one; a pattern of .bin files."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import raydl

from s3_util import upload_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tokens_util import naive_windows, random_docs, write_megatron, write_parquet  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_windows_from_s3_equal_those_from_disk(moto_server, bucket, tmp_path):
    """A Megatron corpus of two datasets and a Parquet file, uploaded: listed from s3:// they are the same
    catalog counts, every window read there equals the local one and the naive definition; remote .bin files
    get a shuffle window, local ones a global shuffle."""
    a, b = random_docs(30, "int32", 1), random_docs(20, "int32", 2)
    write_megatron(str(tmp_path / "a"), a, "int32")
    write_megatron(str(tmp_path / "b"), b, "int32")
    p = [np.arange(n) for n in range(1, 12)]
    write_parquet(str(tmp_path / "p.parquet"), p)
    upload_folder(bucket, tmp_path, "tok")
    s3 = raydl.S3Options(endpoint_url=moto_server)
    remote = raydl.read_tokens([f"s3://{bucket}/tok/*.bin", f"s3://{bucket}/tok/p.parquet"], seq_len=6, eod=5,
                               s3=s3)
    local = raydl.read_tokens([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "p.parquet")], seq_len=6,
                              eod=5)
    assert len(remote) == len(local)
    np.testing.assert_array_equal(remote.catalog.column("count"), local.catalog.column("count"))
    assert remote.catalog.samples_fingerprint == local.catalog.samples_fingerprint
    assert local.catalog.source.shuffle_window >= 1 and remote.catalog.source.shuffle_window >= 1  # Parquet
    ids = np.random.default_rng(0).permutation(len(local))
    windows, pos = naive_windows(a + b + p, 6, 5)
    for ds in (remote, local):
        c = ds.catalog
        got = c.source.read_batch(c, c.storage, ids)
        np.testing.assert_array_equal(got["input_ids"], windows[ids, :-1])
        np.testing.assert_array_equal(got["labels"], windows[ids, 1:])
        np.testing.assert_array_equal(got["position_ids"], pos[ids, :-1])
    only_bins = raydl.read_tokens(f"s3://{bucket}/tok/*.bin", seq_len=6, s3=s3)
    assert only_bins.catalog.source.shuffle_window is None  # the loader's window of parts
    assert raydl.read_tokens(str(tmp_path / "*.bin"), seq_len=6).catalog.source.shuffle_window == 0
