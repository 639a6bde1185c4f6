"""Synthetic image folders for the demo, the example configs and the tests: no download needed.

Smooth colour fields with a shape and noise, JPEG and PNG (some greyscale),
of varied sizes, in class folders, plus broken files on request, so that a
demo shows the skip accounting at work. Each class has its own tint, so a
small model learns the classes within a few steps (examples/train.py). `raydl make-images` builds folders
from real photographs instead (raydl/bench/make_images.py).
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

__all__ = ["class_colour", "make_images"]


def class_colour(label: int, classes: int) -> np.ndarray:
    """The RGB tint of class `label`: hues spread around the colour wheel, alternately bright and dark so
    that greyscale images keep a trace of it."""
    import colorsys

    value = 0.95 if label % 2 == 0 else 0.6
    return 255 * np.array(colorsys.hsv_to_rgb(label / max(1, classes), 0.85, value), np.float32)


def make_images(root: str, n: int, *, classes: int = 4, seed: int = 0, corrupt: int = 1) -> list[str]:
    """Write `n` procedurally generated images (and `corrupt` broken files) into root/cNN/: image i is
    of class i % classes, tinted with its class's colour (class_colour), so that a model can learn the
    classes; shapes, sizes, noise and formats vary at random whatever the class."""
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
        img = 0.5 * img + 0.5 * class_colour(i % classes, classes)  # what a model can learn the class by
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
