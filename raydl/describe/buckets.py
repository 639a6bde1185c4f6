"""Aspect-ratio buckets: the bucket set and which bucket each image goes to (pure functions).

The set is datago's (`crop_and_resize`): with p = size // multiple and s = p*p,
every pw from ceil(sqrt(s * min_ratio)) to floor(sqrt(s * max_ratio)) gives a
bucket pw*multiple wide and (s // pw)*multiple high; the transposed buckets are
added and duplicates removed. An image goes to the bucket whose width/height is
nearest its own (a tie goes to the wider bucket, as in datago); a ratio outside
[min_ratio, max_ratio] lands in the nearest end bucket.
"""

from __future__ import annotations

import math

import numpy as np

from raydl.options import check_number, positive_int

__all__ = ["assign_buckets", "bucket_set", "check_bucket_args", "nearest_bucket"]


def check_bucket_args(size: int, multiple: int, min_ratio: float, max_ratio: float) -> None:
    """ValueError naming the argument at fault."""
    positive_int("size", size)
    positive_int("multiple", multiple)
    if size % multiple:
        raise ValueError(f"size must be a multiple of multiple={multiple}, got size={size}")
    for name, v in (("min_ratio", min_ratio), ("max_ratio", max_ratio)):
        check_number(name, v, above=0, finite=True)
    if min_ratio > max_ratio:
        raise ValueError(
            f"min_ratio must not exceed max_ratio, got min_ratio={min_ratio} > max_ratio={max_ratio}"
        )


def bucket_set(
    size: int, multiple: int = 32, min_ratio: float = 0.5, max_ratio: float = 2.0
) -> tuple[tuple[int, int], ...]:
    """The buckets as (height, width), sorted by aspect ratio width / height (ascending)."""
    check_bucket_args(size, multiple, min_ratio, max_ratio)
    p = size // multiple
    s = p * p
    found: set[tuple[int, int]] = set()
    for pw in range(math.ceil(math.sqrt(s * min_ratio)), math.floor(math.sqrt(s * max_ratio)) + 1):
        w, h = pw * multiple, (s // pw) * multiple
        if h > 0:
            found.add((h, w))
            found.add((w, h))  # the transposed bucket
    if not found:
        raise ValueError(
            f"no bucket fits size={size}, multiple={multiple}, ratios [{min_ratio}, {max_ratio}]"
        )
    return tuple(sorted(found, key=lambda hw: (hw[1] / hw[0], hw[0])))


def _ratios(buckets) -> np.ndarray:
    return np.array([w / h for h, w in buckets], dtype=np.float64)


def assign_buckets(buckets, widths, heights) -> np.ndarray:
    """Index (int64) of the nearest bucket for each (width, height); -1 where a size is unknown (<= 0)."""
    ratios = _ratios(buckets)
    w = np.asarray(widths, dtype=np.float64)
    h = np.asarray(heights, dtype=np.float64)
    known = (w > 0) & (h > 0)
    r = np.where(known, w / np.where(known, h, 1.0), 1.0)
    right = np.clip(np.searchsorted(ratios, r, side="left"), 0, len(ratios) - 1)
    left = np.clip(right - 1, 0, len(ratios) - 1)
    take_left = (r - ratios[left]) < (ratios[right] - r)
    out = np.where(take_left, left, right).astype(np.int64)
    return np.where(known, out, -1)


def nearest_bucket(buckets, width: int, height: int) -> tuple[int, int]:
    """The (height, width) bucket nearest the aspect ratio of a width x height image."""
    idx = int(assign_buckets(buckets, [width], [height])[0])
    if idx < 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    return tuple(buckets[idx])  # type: ignore[return-value]
