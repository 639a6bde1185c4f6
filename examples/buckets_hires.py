"""High-resolution photos in aspect-ratio buckets, read with configs/buckets-hires.yaml.

    python examples/buckets_hires.py [--images 32] [--size 256]

It writes a few generated 1-2 MP JPEGs of every shape (portrait, square,
panorama), reads them with the config's pipeline (decode, aspect_buckets,
flip, normalize) and checks that every batch holds one bucket:
`batch["image"]` is (B, 3, H_b, W_b) and `batch["bucket"]` is (H_b, W_b).
Only the crop's region of each JPEG is decoded, at 1/2 or 1/4 scale in the
DCT domain where the output allows it.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import ray
from PIL import Image

from raydl.config import load_config


def write_photos(root: str, n: int) -> None:
    rng = np.random.default_rng(0)
    shapes = [(1600, 900), (1200, 1200), (900, 1600), (2000, 1000), (1000, 1500)]  # (width, height)
    for i in range(n):
        w, h = shapes[i % len(shapes)]
        yy, xx = np.mgrid[0:h:4, 0:w:4].astype(np.float32)
        img = np.stack([127 + 100 * np.sin(0.01 * (c + 1) * (xx + yy) + i) for c in range(3)], -1)
        small = Image.fromarray(np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8))
        folder = os.path.join(root, f"c{i % 2}")
        os.makedirs(folder, exist_ok=True)
        small.resize((w, h), Image.BILINEAR).save(os.path.join(folder, f"{i:04d}.jpg"), quality=90)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--size", type=int, default=256, help="bucket size (the config says 512)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="raydl-hires-") as root:
        write_photos(root, args.images)
        cfg = load_config(
            "configs/buckets-hires.yaml",
            [f"source.path={root}", "loader.batch_size=4", f"pipeline.aspect_buckets.size={args.size}"],
        )
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False
        )
        ds = cfg.dataset()
        print(ds)
        print("bucket histogram:", ds.bucket_counts())
        seen = {}
        with ds.loader_from_config(cfg.loader) as loader:
            for batch in loader.iterator(0).iter_batches():
                h, w = batch["bucket"]
                assert batch["image"].shape[1:] == (3, h, w), batch["image"].shape
                seen[(h, w)] = seen.get((h, w), 0) + len(batch["id"])
        print("images read per bucket (H, W):", dict(sorted(seen.items())))
        ray.shutdown()


if __name__ == "__main__":
    main()
