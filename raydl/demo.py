"""`raydl demo`: two ranks read one epoch of a generated image folder on a local Ray.

The images are generated (raydl.util.synthetic.make_images, importable from
here too: smooth colour fields with shapes and noise, JPEG and PNG, varied
sizes and modes, plus one corrupt file), so the demo needs no download and
shows the skip accounting at work.
"""

from __future__ import annotations

import tempfile
import threading
import time

from raydl.env import local_ray_config
from raydl.util.synthetic import make_images

__all__ = ["make_images", "main"]


def _run_rank(it, out: dict, rank: int) -> None:
    try:
        out[rank] = sum(len(b["id"]) for b in it.iter_batches())
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        out[rank] = exc


def main(args) -> int:
    from raydl import native
    from raydl.dataset import read_images

    tmp = None
    root = args.dir
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="raydl-demo-")
        root = tmp.name
    try:
        print(f"raydl demo: writing {args.images} generated images (+1 corrupt) to {root}", flush=True)
        make_images(root, args.images)
        _start_ray()
        ds = read_images(root).decode().random_resized_crop(224).random_hflip().normalize("imagenet")
        print(ds)
        config = _loader_config(args)
        stats, wall = _read_one_epoch(ds, config)
        _print_stats(stats, wall)
        world_size = config.world_size
        ranks = f"{world_size} rank" + ("" if world_size == 1 else "s")
        print(
            f"\nraydl demo: one epoch of {len(ds)} files on {ranks} in {wall:.2f} s; "
            f"kernels: {native.kernel_status()}"
        )
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def _start_ray() -> None:
    """A local Ray for the demo, unless this process is connected to one already."""
    import ray

    t0 = time.perf_counter()
    if not ray.is_initialized():
        ray.init(
            address="local",
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
            _system_config=local_ray_config(),
        )
    print(
        f"raydl demo: local Ray up in {time.perf_counter() - t0:.1f} s "
        f"({int(ray.cluster_resources().get('CPU', 0))} CPUs)",
        flush=True,
    )


def _loader_config(args):
    """The loader's options: a config file's `loader:` section (with --set), else two ranks of the
    command line's batch size."""
    from raydl.config import load_config
    from raydl.options import LoaderConfig

    if args.config:
        return load_config(args.config, args.set).loader
    batch_size = 64 if getattr(args, "batch_size", None) is None else args.batch_size
    return LoaderConfig(batch_size=batch_size, world_size=2, seed=0)


def _read_one_epoch(ds, config) -> tuple[list, float]:
    """Every rank's iterator read to its end, one thread each: their stats, and the wall time it took.
    A rank that failed raises its error here."""
    world_size = config.world_size
    with ds.loader_from_config(config) as loader:
        its = [loader.iterator(r) for r in range(world_size)]
        results: dict = {}
        threads = [threading.Thread(target=_run_rank, args=(its[r], results, r)) for r in range(world_size)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        for r in range(world_size):
            if isinstance(results[r], BaseException):
                raise results[r]
        return [it.stats() for it in its], wall


def _print_stats(stats: list, wall: float) -> None:
    """One line per rank and one for all: batches, samples, skipped, time to first batch, samples/s in the
    data's unit (images/s for images)."""
    total = sum(s.samples_delivered for s in stats)
    print()
    head = (
        ("rank", 4),
        ("batches", 7),
        ("samples", 7),
        ("skipped", 7),
        ("first batch", 11),
        (f"{stats[0].unit}/s" if stats else "samples/s", 9),
    )
    print("  ".join(f"{name:>{width}}" for name, width in head))
    for s in stats:
        print(
            f"{s.rank:>4}  {s.batches:>7}  {s.samples_delivered:>7}  {s.samples_skipped:>7}  "
            f"{s.time_to_first_batch_s:>9.2f} s  {s.samples_per_s:>9.1f}"
        )
    print(
        f"{'all':>4}  {sum(s.batches for s in stats):>7}  {total:>7}  "
        f"{sum(s.samples_skipped for s in stats):>7}  "
        f"{min(s.time_to_first_batch_s for s in stats):>9.2f} s  {total / wall:>9.1f}"
    )
