"""`raydl demo`: two ranks read one epoch of a generated image folder on a local Ray.

The images are made here (smooth colour fields with shapes and noise, JPEG and
PNG, varied sizes and modes, plus one corrupt file), so the demo needs no
download and shows the skip accounting at work.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import numpy as np
from PIL import Image

__all__ = ["make_images", "main"]


def make_images(root: str, n: int, *, classes: int = 4, seed: int = 0, corrupt: int = 1) -> list[str]:
    """Write `n` procedurally generated images (and `corrupt` broken files) into root/cNN/."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        h, w = int(rng.integers(160, 480)), int(rng.integers(160, 480))
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        phase = rng.uniform(0, 2 * np.pi, size=3)
        freq = rng.uniform(0.005, 0.05, size=3)
        img = np.stack([127 + 100 * np.sin(freq[c] * (xx + yy * (c + 1)) + phase[c]) for c in range(3)], -1)
        cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(10, 80)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.integers(0, 255, size=3)
        img += rng.normal(0, 8, size=img.shape)
        arr = np.clip(img, 0, 255).astype(np.uint8)
        folder = os.path.join(root, f"c{i % classes:02d}")
        os.makedirs(folder, exist_ok=True)
        if i % 10 == 9:
            path = os.path.join(folder, f"{i:06d}.png")
            Image.fromarray(arr).convert("L" if i % 20 == 19 else "RGB").save(path)
        else:
            path = os.path.join(folder, f"{i:06d}.jpg")
            Image.fromarray(arr).save(path, quality=int(rng.integers(75, 95)))
        paths.append(path)
    for j in range(corrupt):
        path = os.path.join(root, "c00", f"corrupt{j}.jpg")
        with open(path, "wb") as f:
            f.write(b"\xff\xd8\xff\xe0 this is not really a JPEG")
        paths.append(path)
    return paths


def _run_rank(it, out: dict, rank: int) -> None:
    try:
        out[rank] = sum(len(b["id"]) for b in it.iter_batches())
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        out[rank] = exc


def main(args) -> int:
    import ray

    import raydl
    from raydl.config import LoaderConfig, load_config

    tmp = None
    root = args.dir
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="raydl-demo-")
        root = tmp.name
    try:
        print(f"raydl demo: writing {args.images} generated images (+1 corrupt) to {root}", flush=True)
        make_images(root, args.images)
        t0 = time.perf_counter()
        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        print(
            f"raydl demo: local Ray up in {time.perf_counter() - t0:.1f} s "
            f"({int(ray.cluster_resources().get('CPU', 0))} CPUs)",
            flush=True,
        )
        ds = raydl.read_images(root).decode().random_resized_crop(224).random_hflip().normalize("imagenet")
        print(ds)
        if args.config:
            config = load_config(args.config, args.set).loader
        else:
            config = LoaderConfig(batch_size=args.batch_size, world_size=2, seed=0)
        world_size = config.world_size
        with ds.loader_from_config(config) as loader:
            its = [loader.iterator(r) for r in range(world_size)]
            results: dict = {}
            threads = [
                threading.Thread(target=_run_rank, args=(its[r], results, r)) for r in range(world_size)
            ]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            for r in range(world_size):
                if isinstance(results[r], BaseException):
                    raise results[r]
            stats = [it.stats() for it in its]
        total = sum(s.samples_delivered for s in stats)
        print()
        print(
            f"{'rank':>4}  {'batches':>7}  {'samples':>7}  {'skipped':>7}  {'first batch':>11}  {'images/s':>8}"
        )
        for s in stats:
            print(
                f"{s.rank:>4}  {s.batches:>7}  {s.samples_delivered:>7}  {s.samples_skipped:>7}  "
                f"{s.time_to_first_batch_s:>9.2f} s  {s.images_per_s:>8.1f}"
            )
        print(
            f"{'all':>4}  {sum(s.batches for s in stats):>7}  {total:>7}  "
            f"{sum(s.samples_skipped for s in stats):>7}  {min(s.time_to_first_batch_s for s in stats):>9.2f} s  "
            f"{total / wall:>8.1f}"
        )
        ranks = f"{world_size} rank" + ("" if world_size == 1 else "s")
        print(
            f"\nraydl demo: one epoch of {len(ds)} files on {ranks} in {wall:.2f} s; "
            f"kernels: {raydl.native.kernel_status()}"
        )
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()
