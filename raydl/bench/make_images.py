"""`raydl make-images DIR --n 4000 [--profile in1k|hires]`: an image-folder dataset for benchmarks.

Each image is a random crop of a real photograph, rescaled and re-encoded as
JPEG, so its decode cost is that of a real photo, not of noise or flat colour:

  in1k   ImageNet-1k-like: short side 333-500 px, JPEG quality 75-95 (~50-150 KB)
  hires  PD12M-like: 1-4 megapixels, JPEG quality 85-95

Layout: DIR/<class>/<index>.jpg (class folders c000..c{K-1}), like ImageNet's
train folder, plus DIR/labels.csv (path,label). Same arguments and sources, same bytes.

The photos come from --photos (every *.jpg in it), by default the project's
../shared/data/photos beside the checkout. Without any, the sources are
generated scenes (smooth gradients, shapes, texture and noise) and the command
says so: the images then decode somewhat faster than real photos.
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["DEFAULT_PHOTOS", "add_parser", "generated_sources", "main", "make_dataset"]

# ../shared/data/photos beside the repository checkout (the project's real test photographs).
DEFAULT_PHOTOS = Path(__file__).resolve().parents[3] / "shared" / "data" / "photos"


def _size(rng: random.Random, profile: str) -> tuple[int, int]:
    if profile == "in1k":
        short = rng.randint(333, 500)
        ratio = rng.choice([4 / 3, 4 / 3, 4 / 3, 3 / 2, 1.0, 16 / 9])
    else:
        short = rng.randint(800, 1600)
        ratio = rng.choice([4 / 3, 3 / 2, 1.0, 16 / 9, 2.0])
    long = int(short * ratio)
    return (long, short) if rng.random() < 0.7 else (short, long)


def make_one(rng: random.Random, sources: list[Image.Image], profile: str) -> bytes:
    """One JPEG: a window of a random source with the target aspect, 35-100% of its extent, resized."""
    src = rng.choice(sources)
    w, h = _size(rng, profile)
    sw, sh = src.size
    scale = rng.uniform(0.35, 1.0)
    cw = min(sw, int(sw * scale))
    ch = min(sh, int(cw * h / w))
    if ch > sh:
        ch = sh
        cw = int(ch * w / h)
    x = rng.randint(0, sw - cw)
    y = rng.randint(0, sh - ch)
    img = src.resize((w, h), Image.BICUBIC, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    if rng.random() < 0.03:
        img = img.convert("L")
    buf = io.BytesIO()
    q = rng.randint(75, 95) if profile == "in1k" else rng.randint(85, 95)
    img.save(buf, "JPEG", quality=q)
    return buf.getvalue()


def generated_sources(
    count: int = 7, *, seed: int = 0, size: tuple[int, int] = (1600, 1200)
) -> list[Image.Image]:
    """Stand-in "photos" when none are available: gradients, discs and bars, texture and sensor-like noise."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    out = []
    for _ in range(count):
        phase, freq = rng.uniform(0, 2 * np.pi, 3), rng.uniform(0.002, 0.02, 3)
        img = np.stack([120 + 90 * np.sin(freq[c] * (xx + yy * (c + 1)) + phase[c]) for c in range(3)], -1)
        for _ in range(12):
            cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(20, 300)
            img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.integers(0, 255, size=3)
            x0, y0 = rng.integers(0, w), rng.integers(0, h)
            img[y0 : y0 + rng.integers(5, 60), x0 : x0 + rng.integers(50, 600)] = rng.integers(0, 255, size=3)
        img += (
            25 * np.sin(xx * rng.uniform(0.2, 0.6))[..., None] * np.sin(yy * rng.uniform(0.2, 0.6))[..., None]
        )
        img += rng.normal(0, 10, size=img.shape)
        out.append(Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)))
    return out


def load_sources(photos: Path) -> list[Image.Image]:
    """Every *.jpg in `photos` as RGB, sorted by name; empty when the folder is missing or holds none."""
    if not photos.is_dir():
        return []
    return [Image.open(p).convert("RGB") for p in sorted(photos.glob("*.jpg"))]


def make_dataset(
    out: Path, n: int, *, profile: str, classes: int, seed: int, sources: list[Image.Image]
) -> tuple[int, int]:
    """Write `n` images into out/cNNN/ and out/labels.csv; returns (images, total bytes)."""
    rng = random.Random(seed)
    rows = []
    total = 0
    for i in range(n):
        label = i % classes
        rel = f"c{label:03d}/{i:07d}.jpg"
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = make_one(rng, sources, profile)
        path.write_bytes(data)
        total += len(data)
        rows.append(f"{rel},{label}")
    (out / "labels.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return n, total


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "make-images",
        help="write an image-folder dataset from real photos (for benchmarks)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", type=Path, metavar="DIR")
    p.add_argument("--n", type=int, default=2000, help="images to write (default %(default)s)")
    p.add_argument("--profile", choices=["in1k", "hires"], default="in1k")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--photos",
        type=Path,
        default=DEFAULT_PHOTOS,
        help="folder of source photographs, *.jpg (default: %(default)s)",
    )
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    if args.n < 1 or args.classes < 1:
        raise SystemExit("raydl make-images: --n and --classes must be positive")
    sources = load_sources(args.photos)
    if sources:
        what = f"{len(sources)} photos from {args.photos}"
    else:
        print(
            f"raydl make-images: no photos (*.jpg) in {args.photos}; using generated scenes as sources "
            "instead (they decode somewhat faster than real photos). Pass --photos DIR to use your own.",
            flush=True,
        )
        sources = generated_sources(seed=args.seed)
        what = "generated scenes"
    n, total = make_dataset(
        args.out, args.n, profile=args.profile, classes=args.classes, seed=args.seed, sources=sources
    )
    print(f"{n} images, {total / 1e6:.1f} MB, {total / n / 1e3:.0f} KB mean, from {what} -> {args.out}")
    return 0


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="python -m raydl.bench.make_images")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    sys.exit(main(parser.parse_args(["make-images", *sys.argv[1:]])))
