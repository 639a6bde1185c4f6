"""`raydl bench cache`: the node-local cache on a far-away store, epoch by epoch, against local disk and
Ray Data.

    raydl bench cache [--images 2000 | --data DIR] [--per-shard 128] [--delay-ms 50] [--epochs 3]
        [--batch-size 64] [--formats images,webdataset] [--rows local,s3,cached,raydata] [--cache-dir DIR]
        [--json PATH]

An in1k-like image set (`raydl make-images`' crops of the shared photos, or --data) is put in a moto
S3 server started in a child process on 127.0.0.1, twice: as an image folder and as WebDataset shards
(`raydl.bench.shards.write_webdataset`). Every measurement runs in a fresh child process
(`raydl.bench._epochs`) that reads the store through its own latency proxy, which adds --delay-ms to
every request and counts the requests that reach the server, epoch by epoch. Rows, per format:

* local: raydl on the same images (or shards) from local disk: the speed the cache should reach;
* s3: raydl from the store, no cache;
* cached: raydl from the store with `loader(cache=raydl.Cache(fresh folder, max_bytes=...))`, the folder in
  --cache-dir (default: the bench's temporary folder); the notes give what creating a file costs there;
* raydata: Ray Data on the same objects (read_binary_files, or read_webdataset, with a pyarrow
  S3FileSystem pointed at the proxy) and the same transform in map_batches; each pass re-reads the store.

Each runs --epochs epochs of the train workload (decode, RandomResizedCrop 224, flip, ImageNet
normalize, float32 NCHW). Epoch 1's images/s runs from its first batch to its last (the actors' start
left out, as in `raydl bench loader`); a later epoch's from the previous epoch's last batch. The goals:
the cached epochs 2-N make no request to the store and reach >= 0.95x local disk's images/s,
and the cached epoch 1 >= 0.95x the uncached epoch 1.

`raydl bench cache --eviction 100000,1000000 [--eviction-before DIR]` measures something else, without S3
or Ray: what an eviction pass at that many entries costs the node's other writers and the evicting process
(raydl/bench/_cache_eviction.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from raydl.bench import _cache_eviction
from raydl.bench._epochs_report import (
    child_env,
    epoch_table,
    image_folder,
    later_rate,
    median_epochs,
    process_split,
    run_measurement,
)

__all__ = ["FORMATS", "ROWS", "add_parser", "goal_lines", "main"]

FORMATS = ("images", "webdataset")
ROWS = ("local", "s3", "cached", "raydata")
LABELS = {
    "local": "raydl, local disk",
    "s3": "raydl, S3, no cache",
    "cached": "raydl, S3, cache",
    "raydata": "Ray Data, S3",
}
_BUCKET = "raydl-bench-cache"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cache",
        help="the node cache: S3 behind latency, cached and not, against local disk and Ray Data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=2000, help="in1k-like images to generate (default 2000)")
    p.add_argument("--data", help="an existing image folder (DIR/class/*.jpg) instead of generated images")
    p.add_argument("--per-shard", type=int, default=128, help="samples per WebDataset shard (default 128)")
    p.add_argument("--delay-ms", type=float, default=50.0, help="added to every request (default 50)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--cpus", type=int, default=len(os.sched_getaffinity(0)), help="Ray's CPUs per run")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"from {','.join(FORMATS)}")
    p.add_argument("--rows", default=",".join(ROWS), help=f"from {','.join(ROWS)}")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every row, taking turns (medians)")
    p.add_argument(
        "--cache-max-bytes", type=int, help="the cache's max_bytes (default: twice the data's bytes)"
    )
    p.add_argument(
        "--cache-dir",
        help="where the cached row's cache is made: a fresh folder in DIR, removed after the run (default: "
        "the bench's temporary folder, under $TMPDIR); name the disk a node cache would use, as entry "
        "writes cost what creating a file costs there",
    )
    p.add_argument(
        "--raydata-read-cpus",
        type=float,
        default=1.0,
        help="Ray Data's num_cpus per read task (default 1, Ray Data's own; less runs more reads at once, "
        "but its read and map_batches then run as two operators)",
    )
    p.add_argument(
        "--raydata-images",
        type=int,
        default=400,
        help="Ray Data's image-folder row reads the first N of the same objects (default 400; 0: all): "
        "a HEAD and a GET per file, one file at a time per read task, make it ~15 images/s at 50 ms",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    p.add_argument("--json", help="write every measurement and the table here")
    _cache_eviction.add_arguments(p)
    p.set_defaults(func=main)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _choices(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in chosen if v not in allowed]
    if bad or not chosen:
        raise ValueError(
            f"{flag}: unknown {', '.join(bad) or '(none given)'}; choose from {','.join(allowed)}"
        )
    return chosen


def check_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(formats, rows) after every flag is checked; a ValueError naming the flag otherwise."""
    formats = _choices(args.formats, FORMATS, "--formats")
    rows = _choices(args.rows, ROWS, "--rows")
    for flag in ("images", "per_shard", "epochs", "batch_size", "cpus", "rounds"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.delay_ms < 0 or args.raydata_read_cpus <= 0 or args.raydata_images < 0:
        raise ValueError("--delay-ms and --raydata-images must be >= 0, --raydata-read-cpus > 0")
    if args.data is None and args.images < 2 * args.batch_size:
        raise ValueError(f"--images {args.images} make under 2 batches of {args.batch_size}")
    if getattr(args, "cache_dir", None) is not None and not os.path.isdir(args.cache_dir):
        raise ValueError(f"--cache-dir {args.cache_dir}: not a folder")
    return formats, rows


def create_cost_us(folder: Path, size: int, n: int = 200) -> float:
    """Microseconds to create, write (`size` bytes) and close a new file in `folder`, then rename it: what an
    entry's write costs the file system there, over n files made in a fresh subfolder (removed after)."""
    work = Path(tempfile.mkdtemp(prefix="create-cost-", dir=folder))
    try:
        data = b"\0" * size
        t0 = time.perf_counter()
        for i in range(n):
            fd = os.open(work / f"t{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(work / f"t{i}", work / f"e{i}")
        return 1e6 * (time.perf_counter() - t0) / n
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cache_available() -> bool:
    import raydl

    return hasattr(raydl, "Cache") and "cache" in _loader_options()


def _loader_options() -> set[str]:
    from dataclasses import fields

    from raydl.options import LoaderConfig

    return {f.name for f in fields(LoaderConfig)}


def main(args: argparse.Namespace) -> int:
    if args.eviction:
        return _cache_eviction.main(args)
    try:
        formats, rows = check_args(args)
    except ValueError as exc:
        _log(f"error: {exc}")
        return 2
    notes = []
    if "cached" in rows and not _cache_available():
        rows.remove("cached")
        notes.append("cached rows skipped: this build has no raydl.Cache / loader(cache=...)")
        _log(notes[-1])
    from raydl.bench import _listing_s3 as s3
    from raydl.bench.shards import write_webdataset
    from raydl.bench.storage import _CREDS, _start_moto

    tmp = Path(tempfile.mkdtemp(prefix="raydl-bench-cache-"))
    cache_root = tmp
    env = child_env(_CREDS)
    moto = None
    try:
        if args.cache_dir is not None:
            where = os.path.abspath(args.cache_dir)
            cache_root = Path(tempfile.mkdtemp(prefix="raydl-bench-cache-", dir=where))
        t0 = time.perf_counter()
        folder = image_folder(args.data, args.images, tmp / "images", seed=args.seed)
        shards = write_webdataset(folder, str(tmp / "wds"), per_shard=args.per_shard)
        images = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        objects = {f"images/{p.relative_to(folder).as_posix()}": p.read_bytes() for p in images}
        objects.update({f"wds/{Path(s).name}": Path(s).read_bytes() for s in shards})
        data_bytes = sum(len(b) for k, b in objects.items() if k.startswith("images/"))
        moto, endpoint = _start_moto(env)
        s3.upload(endpoint, _BUCKET, objects, env)
        _log(
            f"{len(images)} images ({data_bytes / 1e6:.1f} MB), {len(shards)} shards, in moto at {endpoint} "
            f"({time.perf_counter() - t0:.0f} s); {args.epochs} epochs per row, batch {args.batch_size}, "
            f"{args.cpus} CPUs, {args.delay_ms:g} ms per request"
        )
        if "cached" in rows:
            cost = create_cost_us(cache_root, data_bytes // max(1, len(images)))
            notes.append(
                f"the cache's folder: {cache_root}; creating, writing and renaming a file of an image's mean "
                f"size there took {cost:.0f} us (an entry's write makes one)"
            )
            _log(notes[-1])
        keys = [k for k in objects if k.startswith("images/")]
        data = {
            ("images", True): folder,
            ("images", False): f"s3://{_BUCKET}/images/",
            ("images", "raydata"): [f"s3://{_BUCKET}/{k}" for k in keys[: args.raydata_images or None]],
            ("webdataset", True): shards,
            ("webdataset", False): [f"s3://{_BUCKET}/wds/{Path(s).name}" for s in shards],
        }
        runs = []
        for r in range(1, args.rounds + 1):
            for fmt in formats:
                for row in rows:
                    spec = _spec(args, fmt, row, data, endpoint, moto.pid, tmp, data_bytes, cache_root)
                    t1 = time.perf_counter()
                    out = run_measurement(spec, env, timeout_s=args.timeout, log=tmp / "run.log")
                    out.update(round=r, format=fmt, name=row)
                    runs.append(out)
                    _progress(out, time.perf_counter() - t1)
                    shutil.rmtree(spec.get("cache", tmp / "none"), ignore_errors=True)
    finally:
        if moto is not None:
            moto.kill()
            moto.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if cache_root != tmp:
            shutil.rmtree(cache_root, ignore_errors=True)
    if "raydata" in rows and "images" in formats and 0 < args.raydata_images < len(images):
        notes.append(
            f"Ray Data's image-folder row read the first {args.raydata_images} of the {len(images)} objects "
            "(--raydata-images): its images/s is a rate, its requests per epoch are for those objects"
        )
    report = summarize(runs, formats, rows)
    for fmt in formats:
        for row in ("local", "cached"):
            split = process_split([r for r in runs if r["format"] == fmt], row)
            if split and row in rows:
                parts = ", ".join(f"{k} {v:.2f}" for k, v in split.items())
                notes.append(f"{fmt}, {LABELS[row]}: loader CPU by process, epochs 2-N, ms/img: {parts}")
    print(render(report, args, len(images), len(shards), notes))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args) | {"func": None}, **report, "runs": runs}))
        _log(f"wrote {args.json}")
    return 0 if all(r.get("ok") for r in runs) else 1


def _spec(
    args, fmt: str, row: str, data: dict, endpoint: str, moto_pid: int, tmp: Path, size: int, cache_root: Path
) -> dict:
    local = row == "local"
    spec = {
        "row": f"{fmt}/{row}",
        "peer": "raydata" if row == "raydata" else "raydl",
        "source": fmt,
        "data": data.get((fmt, row), data[(fmt, local)]),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "cpus": args.cpus,
        "seed": args.seed,
        "raydata_read_cpus": args.raydata_read_cpus,
    }
    if not local:
        spec.update(endpoint=endpoint, delay_ms=args.delay_ms, store_pids=[moto_pid])
    if row == "cached":
        spec.update(cache=str(cache_root / f"cache-{fmt}"), cache_max_bytes=args.cache_max_bytes or 2 * size)
    # A fresh RAYDL_CACHE_DIR per run: read_webdataset keeps its shard indexes there, so each listing
    # starts cold and no run inherits another's.
    spec["env"] = {"RAYDL_CACHE_DIR": str(tmp / f"index-{fmt}-{row}")}
    return spec


def _progress(out: dict, took: float) -> None:
    head = f"[round {out['round']}] {out['format']:<10} {out['name']:<8}"
    if not out.get("ok"):
        _log(f"{head} FAILED: {out.get('error')}\n{out.get('log_tail', '')}")
        return
    cells = [
        f"e{e['epoch']} {e['images_per_s'] or 0:6.1f} img/s {e['requests']['GET']}G/{e['requests']['HEAD']}H"
        for e in out["epochs"]
    ]
    _log(f"{head} " + "  ".join(cells) + f"  ({took:.0f} s)")


def summarize(runs: list[dict], formats: list[str], rows: list[str]) -> dict:
    """Medians per (format, row) and epoch, and the goals' figures per format."""
    table = {
        fmt: {
            row: median_epochs([r for r in runs if r["format"] == fmt and r["name"] == row]) for row in rows
        }
        for fmt in formats
    }
    counters = {}  # the cache's own counts per epoch, from the first round that ran
    for fmt in formats:
        first = next((r for r in runs if r["format"] == fmt and r["name"] == "cached" and r.get("ok")), None)
        if first:
            counters[fmt] = [e.get("counters", {}) for e in first["epochs"]]
    return {
        "epochs": table,
        "goals": {fmt: goal_figures(table[fmt]) for fmt in formats},
        "counters": counters,
    }


def counter_line(per_epoch: list[dict[str, int]]) -> str:
    """The cache's own counts, epoch by epoch (pure): hits, misses, MB from the store and from the cache."""
    cells = []
    for i, c in enumerate(per_epoch, 1):
        cells.append(
            f"epoch {i}: {c.get('cache_hits', 0)} hits, {c.get('cache_misses', 0)} misses, "
            f"{c.get('bytes_from_store', 0) / 1e6:.1f} MB from the store, "
            f"{c.get('bytes_from_cache', 0) / 1e6:.1f} MB from the cache"
            + (f", {c['cache_evictions']} evictions" if c.get("cache_evictions") else "")
            + (f", {c['cache_corrupt']} corrupt" if c.get("cache_corrupt") else "")
        )
    return "the cache's counters (rank 0's iterator): " + "; ".join(cells)


def goal_figures(by_row: dict[str, list[dict]]) -> dict:
    """The issue's figures from one format's rows (pure): requests of the cached epochs 2-N, their images/s
    over local disk's epochs 2-N, the cached epoch 1 over the uncached one, and Ray Data's for scale."""
    out: dict = {}
    local, s3, cached, raydata = (by_row.get(k) or [] for k in ROWS)
    if cached:
        out["cached_later_requests"] = sum(e["requests"]["GET"] + e["requests"]["HEAD"] for e in cached[1:])
    if cached and local and later_rate(cached) and later_rate(local):
        out["cached_later_over_local"] = later_rate(cached) / later_rate(local)
    if cached[1:] and local[1:]:  # the load-proof view: what an image costs, not how fast the run went
        out["cached_later_cpu_over_local"] = later_cpu(cached) / later_cpu(local)
    if cached and s3 and cached[0]["images_per_s"] and s3[0]["images_per_s"]:
        out["cached_epoch1_over_uncached"] = cached[0]["images_per_s"] / s3[0]["images_per_s"]
    if s3 and local and later_rate(s3) and later_rate(local):
        out["uncached_later_over_local"] = later_rate(s3) / later_rate(local)
    best = cached or s3
    if best and raydata and later_rate(best) and later_rate(raydata):
        out["raydl_later_over_raydata"] = later_rate(best) / later_rate(raydata)
    return out


def later_cpu(epochs: list[dict]) -> float:
    """The loader's CPU seconds per image over epochs 2..N."""
    return sum(e["loader_cpu_s"] for e in epochs[1:]) / max(1, sum(e["images"] for e in epochs[1:]))


def goal_lines(goals: dict) -> list[str]:
    """The goals' lines for one format, with met or missed (pure)."""
    lines = []
    if "cached_later_requests" in goals:
        n = goals["cached_later_requests"]
        lines.append(
            f"cached epochs 2-N: {n:.0f} GET+HEAD requests (goal 0: {'met' if n == 0 else 'missed'})"
        )
    for key, what, goal in (
        ("cached_later_over_local", "cached epochs 2-N / local disk epochs 2-N", 0.95),
        ("cached_epoch1_over_uncached", "cached epoch 1 / uncached epoch 1", 0.95),
    ):
        if key in goals:
            v = goals[key]
            lines.append(f"{what}: {v:.2f}x (goal >= {goal}: {'met' if v >= goal else 'missed'})")
    if "cached_later_cpu_over_local" in goals:
        cpu = goals["cached_later_cpu_over_local"]
        lines.append(
            f"loader CPU per image, cached epochs 2-N / local disk's: {cpu:.2f}x "
            "(on a loaded machine, steadier than images/s)"
        )
    if "uncached_later_over_local" in goals:
        lines.append(f"uncached epochs 2-N / local disk: {goals['uncached_later_over_local']:.2f}x")
    if "raydl_later_over_raydata" in goals:
        lines.append(f"raydl epochs 2-N / Ray Data epochs 2-N: {goals['raydl_later_over_raydata']:.2f}x")
    return lines


def render(report: dict, args: argparse.Namespace, images: int, shards: int, notes: list[str]) -> str:
    """The text the command prints: one Markdown table per format, then its goals, then the notes."""
    out = [
        f"raydl bench cache: {images} images ({shards} shards of {args.per_shard}), {args.epochs} epochs, "
        f"batch {args.batch_size}, {args.cpus} CPUs, {args.delay_ms:g} ms per request, "
        f"median of {args.rounds} round(s)",
    ]
    for fmt, by_row in report["epochs"].items():
        out += ["", f"{fmt}:", ""]
        out.append(epoch_table([(LABELS[row], epochs) for row, epochs in by_row.items()]))
        lines = goal_lines(report["goals"][fmt])
        if report.get("counters", {}).get(fmt):
            lines.append(counter_line(report["counters"][fmt]))
        out += [""] + [f"  * {line}" for line in lines]
    out += [""] + [f"  * {n}" for n in notes]
    out.append(
        "  * epoch 1 images/s from its first batch to its last; later epochs from the previous epoch's end. "
        "GET/HEAD/LIST: requests that reached the store in that epoch (listing before epoch 1 not counted); "
        "loader CPU: the run's process tree (driver, Ray, workers); store CPU: moto and the proxy"
    )
    return "\n".join(out)
