"""stats() says what a sample is: windows for read_tokens, rows for Parquet without an image field, images
for a source with one, samples for a mix of kinds; the rate keeps its older name too."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import raydl
from raydl.consume.stats import IteratorStats
from raydl.plan.build import sample_unit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokens_util import random_docs, write_megatron  # noqa: E402


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("units")
    write_megatron(str(root / "corpus"), random_docs(20, "uint16", 0), "uint16")
    pq.write_table(pa.table({"x": np.arange(10), "y": np.arange(10) * 2}), root / "rows.parquet")
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG")
    pq.write_table(pa.table({"image": [buf.getvalue()] * 4, "label": [0, 1, 0, 1]}), root / "img.parquet")
    (root / "folder" / "a").mkdir(parents=True)
    (root / "folder" / "a" / "0.jpg").write_bytes(buf.getvalue())
    return {
        "tokens": raydl.read_tokens(str(root / "corpus"), seq_len=4).catalog.source,
        "rows": raydl.read_parquet(str(root / "rows.parquet")).catalog.source,
        "parquet images": raydl.read_parquet(str(root / "img.parquet"), image_column="image").catalog.source,
        "folder": raydl.read_images(str(root / "folder")).catalog.source,
    }


def test_each_source_names_its_unit(sources):
    assert sample_unit([sources["tokens"]]) == "windows"
    assert sample_unit([sources["rows"]]) == "rows"
    assert sample_unit([sources["parquet images"]]) == "images"
    assert sample_unit([sources["folder"]]) == "images"
    assert sample_unit([sources["folder"], sources["parquet images"]]) == "images"  # one kind: its unit
    assert sample_unit([sources["tokens"], sources["rows"]]) == "samples"  # a mix of kinds


def test_stats_print_the_rate_in_the_unit_and_keep_images_per_s():
    s = IteratorStats(rank=0, unit="windows", samples_delivered=300, elapsed_s=2.0)
    assert s.samples_per_s == s.images_per_s == 150.0
    assert "windows/s" in str(s) and "images/s" not in str(s)
    assert IteratorStats(rank=0).unit == "samples"
