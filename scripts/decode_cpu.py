"""CPU per image of raydl's per-sample program against a bare libjpeg-turbo decode, in one process.

    python scripts/decode_cpu.py /work/data/hires --n 200 --workload buckets
    python scripts/decode_cpu.py /work/data/in1k4k --n 2000 --workload train --rows raydl@1,raydl@2

Rows (interleaved, --rounds times; the best round is shown):
  ceiling   simplejpeg full decode into a fresh array per image (what `raydl bench loader`'s ceiling does)
  ceilbuf   the same into one reused buffer: the decode alone, no page faults of fresh arrays
  raydl@L   SampleProgram.run_many, the LoaderWorker's native call (chunks of 16 samples of one bucket),
            resampler at simd level L (0 portable, 1 AVX2: the default, 2 the opt-in AVX-512 vertical pass;
            raydl.native.simd_level)
  fast@L    the same with decode(fast=True)
The bytes are read before the clock starts; threads (--threads) share the work as the worker's decode
threads do. CPU is this process's (time.process_time), so other load on the machine hardly moves it: run
with OPENBLAS_NUM_THREADS=1, or numpy's idle BLAS threads add their spinning to every row.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import simplejpeg

from raydl import native
from raydl.bench._transform import BUCKET_CONFIG, list_images
from raydl.describe.transforms import (
    AspectBuckets,
    Decode,
    Normalize,
    RandomHFlip,
    RandomResizedCrop,
    compile_stages,
)

CHUNK = 16  # the worker's DECODE_CHUNK


def _program(workload: str, fast: bool):
    if workload == "buckets":
        return compile_stages((Decode(fast=fast), AspectBuckets(**BUCKET_CONFIG)))
    return compile_stages(
        (
            Decode(fast=fast),
            RandomResizedCrop(size=(224, 224)),
            RandomHFlip(),
            Normalize.make("imagenet", None),
        )
    )


def _chunks(program, blobs: list[bytes]) -> list[list[tuple[int, bytes, tuple]]]:
    """Chunks of up to CHUNK samples of one slot shape (a bucket), as the worker hands them to run_many."""

    def shape(data: bytes) -> tuple:
        if program.buckets is None:
            return program.slot_shape()
        h, w = program.image_size(data)
        return program.slot_shape(program.buckets.buckets[int(program.buckets.assign([w], [h])[0])])

    by_shape: dict[tuple, list] = {}
    for k, data in enumerate(blobs):
        by_shape.setdefault(shape(data), []).append((k, data))
    return [
        [(k, d, s) for k, d in items[i : i + CHUNK]]
        for s, items in sorted(by_shape.items())
        for i in range(0, len(items), CHUNK)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--workload", choices=["buckets", "train"], default="buckets")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", default="ceiling,ceilbuf,raydl@1,raydl@2,fast@1,fast@2")
    args = p.parse_args()
    default = native.simd_level()
    files = list_images(args.data)
    random.Random(0).shuffle(files)
    blobs = []
    for path in files[: args.n]:
        with open(path, "rb") as f:
            blobs.append(f.read())
    local = threading.local()

    def slot(shape: tuple, dtype, j: int) -> np.ndarray:  # reused, as the worker's batch arrays are
        slots = local.__dict__.setdefault("slots", {})
        return slots.setdefault((shape, np.dtype(dtype).str, j), np.zeros(shape, dtype))

    def decode_reused(data: bytes):
        if not hasattr(local, "buf"):
            local.buf = np.empty(64 << 20, np.uint8)
        return simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=local.buf)

    def program_row(level: int, fast: bool):
        program = _program(args.workload, fast)
        chunks = _chunks(program, blobs)

        def one(chunk):
            errors = program.run_many(
                [(d, k, slot(s, program.dtype, j)) for j, (k, d, s) in enumerate(chunk)]
            )
            if any(errors):
                raise RuntimeError(f"samples failed: {[e for e in errors if e]}")

        def run(pool):
            native.simd_level(level)
            list(pool.map(one, chunks))

        return run

    rows = {
        "ceiling": lambda pool: list(pool.map(lambda d: simplejpeg.decode_jpeg(d, colorspace="RGB"), blobs)),
        "ceilbuf": lambda pool: list(pool.map(decode_reused, blobs)),
    }
    for name in args.rows.split(","):
        if "@" in name:
            kind, level = name.split("@")
            rows[name] = program_row(int(level), kind == "fast")
    best: dict[str, tuple[float, float]] = {}
    with ThreadPoolExecutor(args.threads) as pool:
        for _ in range(args.rounds):
            for name in args.rows.split(","):
                c0, t0 = time.process_time(), time.perf_counter()
                rows[name](pool)
                cpu, wall = (time.process_time() - c0) / len(blobs) * 1e3, time.perf_counter() - t0
                if name not in best or cpu < best[name][0]:
                    best[name] = (cpu, len(blobs) / wall)
    native.simd_level(default)
    base = best.get("ceilbuf", best.get("ceiling", (None,)))[0]
    print(
        f"{len(blobs)} images from {args.data}, workload {args.workload}, {args.threads} thread(s), "
        f"best of {args.rounds} rounds; {native.kernel_status()}"
    )
    for name, (cpu, rate) in best.items():
        ratio = f"  ceilbuf CPU / this {base / cpu:.3f}" if base else ""
        print(f"  {name:8s} {cpu:6.2f} CPU ms/img  {rate:6.0f} img/s{ratio}")


if __name__ == "__main__":
    main()
