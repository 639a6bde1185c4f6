"""The reference transforms in plain PIL + numpy, shared by the peers that have none.

"buckets" (`bucket_transform`): the image is cropped (centred) to the ratio of
the nearest of datago's buckets for size 512, multiple 32, ratios 0.5-2.0 and
resized there with PIL's antialiased bilinear filter: uint8 HWC.


torchvision cannot be installed beside every torch build, so the torch, Ray Data
and datago peers use this copy of torchvision's RandomResizedCrop.get_params
(scale 0.08-1, ratio 3/4-4/3, ten tries then a centre crop), PIL's bilinear
`resize(box=...)` (antialiased, as `F.resized_crop` on a PIL image is), a flip
with p=0.5 and ImageNet normalisation into a float32 CHW slot. One copy means
the peers differ only in how they schedule this work, not in the work itself.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
from PIL import Image

from raydl.describe.buckets import bucket_set, nearest_bucket
from raydl.sources.images import IMAGE_EXTENSIONS

__all__ = [
    "BUCKETS",
    "CROP",
    "bucket_box",
    "bucket_transform",
    "link_into",
    "list_images",
    "open_rgb",
    "rrc_params",
    "train_transform",
]

CROP = 224
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)

# The "buckets" workload: datago's crop_and_resize with this configuration.
BUCKET_CONFIG = {"size": 512, "multiple": 32, "min_ratio": 0.5, "max_ratio": 2.0}
BUCKETS = bucket_set(
    BUCKET_CONFIG["size"], BUCKET_CONFIG["multiple"], BUCKET_CONFIG["min_ratio"], BUCKET_CONFIG["max_ratio"]
)

_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
# (x / 255 - mean) / std folded into one multiply and one subtract per pixel.
_MUL = (1.0 / (255.0 * _STD)).reshape(3, 1, 1)
_SUB = (_MEAN / _STD).reshape(3, 1, 1)


def data_files(data: str, suffix: str) -> list[str]:
    """The files a --data names: a folder (its *<suffix> files, sorted) or one glob pattern; a ValueError
    when there are none."""
    import glob

    pattern = os.path.join(data, "*" + suffix) if os.path.isdir(data) else data
    files = sorted(glob.glob(pattern))
    if not files:
        raise ValueError(f"no {suffix} files at {data}")
    return files


def list_images(root: str) -> list[str]:
    """Every image file under `root` (image-folder layout), sorted, so all peers see one list."""
    found = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs.sort()
        found.extend(os.path.join(folder, name) for name in names if name.lower().endswith(IMAGE_EXTENSIONS))
    return sorted(found)


def link_into(files: list[str], root: str, into) -> str:
    """A folder `into` holding only `files` (of the folder `root`), each at its path under `root`, hard-linked
    (symlinked across filesystems: every peer here follows them), so that a subset is a directory too."""
    for src in files:
        dst = os.path.join(into, os.path.relpath(src, root))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            os.symlink(os.path.abspath(src), dst)
    return str(into)


def rrc_params(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a RandomResizedCrop window, as torchvision's get_params draws it."""
    area = width * height
    log_lo, log_hi = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(10):
        target_area = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    # torchvision's fallback: the largest centred window inside the ratio range.
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        h, w = height, int(round(height * RATIO[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def train_transform(img: Image.Image, rng: random.Random, out: np.ndarray) -> None:
    """Crop, resize, flip and normalise one RGB image into `out`, a float32 (3, 224, 224) slot."""
    top, left, h, w = rrc_params(img.width, img.height, rng)
    # Resizing from a box reads only the crop window: no intermediate cropped copy.
    small = img.resize((CROP, CROP), Image.BILINEAR, box=(left, top, left + w, top + h))
    hwc = np.asarray(small)
    if rng.random() < 0.5:
        hwc = hwc[:, ::-1]  # a view; the multiply below does the one copy
    np.multiply(hwc.transpose(2, 0, 1), _MUL, out=out)
    out -= _SUB


def open_rgb(path_or_file) -> Image.Image:
    """Decode with PIL as torchvision's default loader does (full-size decode, then RGB)."""
    with Image.open(path_or_file) as img:
        return img.convert("RGB")


def bucket_box(width: int, height: int) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """The nearest bucket (h, w) and the centred crop (left, top, right, bottom) with its ratio."""
    bh, bw = nearest_bucket(BUCKETS, width, height)
    if width * bh > height * bw:
        ch, cw = height, min(width, max(1, int(round(height * bw / bh))))
    else:
        cw, ch = width, min(height, max(1, int(round(width * bh / bw))))
    top, left = int(round((height - ch) / 2.0)), int(round((width - cw) / 2.0))
    return (bh, bw), (left, top, left + cw, top + ch)


def bucket_transform(img: Image.Image) -> np.ndarray:
    """Crop to the nearest bucket's ratio, resize there (antialiased bilinear): uint8 (h, w, 3)."""
    (bh, bw), box = bucket_box(img.width, img.height)
    return np.asarray(img.resize((bw, bh), Image.BILINEAR, box=box))
