"""The reference "train" transform in plain PIL + numpy, shared by the peers that have none.

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

from raydl.sources.images import IMAGE_EXTENSIONS

__all__ = ["CROP", "list_images", "open_rgb", "rrc_params", "train_transform"]

CROP = 224
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)

_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
# (x / 255 - mean) / std folded into one multiply and one subtract per pixel.
_MUL = (1.0 / (255.0 * _STD)).reshape(3, 1, 1)
_SUB = (_MEAN / _STD).reshape(3, 1, 1)


def list_images(root: str) -> list[str]:
    """Every image file under `root` (image-folder layout), sorted, so all peers see one list."""
    found = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs.sort()
        found.extend(
            os.path.join(folder, name)
            for name in names
            if name.lower().endswith(IMAGE_EXTENSIONS)
        )
    return sorted(found)


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
