"""Catalog bytes per sample for 1 M samples (synthetic catalogs as the listings build them), and a real
LAION-style listing with fields=None, a dict, and "all" (catalog bytes must be equal)."""

import io
import tempfile

import numpy as np
import webdataset as wds
from PIL import Image

import raydl
from raydl.bench._listing_synthetic import parquet_catalog, webdataset_catalog

for name, cat in (
    ("webdataset 1,000 shards x 1,000", webdataset_catalog(1_000_000, 1_000)),
    ("parquet 100 files x 10 row groups x 1,000 rows", parquet_catalog(100, 10, 1_000)),
):
    print(f"{name}: {cat.nbytes} B, {cat.nbytes / len(cat):.3f} B/sample, samples={len(cat)}")
tmp = tempfile.mkdtemp()
b = io.BytesIO()
Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(b, "JPEG")
jpg = b.getvalue()
for s in range(8):
    with wds.TarWriter(f"{tmp}/s-{s}.tar") as sink:
        for i in range(1000):
            sink.write(
                {
                    "__key__": f"{s}-{i:04d}",
                    "jpg": jpg,
                    "txt": "x" * (50 + i % 150),
                    "json": {"k": "v" * 280},
                    "cls": str(i % 10),
                }
            )
url = f"{tmp}/s-{{0..7}}.tar"
for fields in (None, {"image": "jpg", "caption": "txt", "meta": "json", "label": "cls"}, "all"):
    cat = raydl.read_webdataset(url, fields=fields).catalog
    print(
        f"real listing, fields={fields!r}: {cat.nbytes} B for {len(cat)} samples, "
        f"{cat.nbytes / len(cat):.3f} B/sample"
    )
