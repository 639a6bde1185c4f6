"""Declarative transform stages: frozen, printable dataclasses that `Dataset` records, each checked on
construction, and the rules of their order (`check_stage_order`, checked as each stage is added).

A stage that draws (RandomResizedCrop, RandomHFlip, AspectBuckets(crop="random")) draws from the sample's
own splitmix64 stream (`SampleRng`, seeded by the plan), so a sample's augmentation is the same on every
worker and platform: `rrc_box` is torchvision's RandomResizedCrop.get_params on that stream, and
`AspectBuckets.bucket_crop` its bucket's box. What the stages compile to is raydl/describe/program.py's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from raydl.describe.buckets import assign_buckets, bucket_set, check_bucket_args
from raydl.native import decode
from raydl.options import check_number, is_positive_int
from raydl.util.splitmix import GAMMA, MASK64, mix64

__all__ = [
    "NORMALIZE_PRESETS",
    "AspectBuckets",
    "CenterCrop",
    "Decode",
    "Normalize",
    "RandomHFlip",
    "RandomResizedCrop",
    "Resize",
    "SampleRng",
    "Stage",
    "check_stage_order",
    "rrc_box",
]

# Stage arguments may be numpy scalars too (sizes and probabilities read from arrays).
_NUMBER_TYPES = (int, float, np.integer, np.floating)

NORMALIZE_PRESETS = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def _size2(name: str, size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) from an int or a pair; positive ints only."""
    hw = (size, size) if is_positive_int(size) else tuple(size) if isinstance(size, (tuple, list)) else ()
    if len(hw) != 2 or not all(is_positive_int(v) for v in hw):
        raise ValueError(f"{name} must be a positive int or (height, width), got {size!r}")
    return hw  # type: ignore[return-value]


def _numbers(name: str, value: object, count: int, what: str) -> tuple[float, ...]:
    """`count` real numbers as floats from a tuple or list; anything else is a ValueError naming `name`."""
    if not (isinstance(value, (tuple, list)) and len(value) == count):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        return tuple(float(check_number(name, v, types=_NUMBER_TYPES)) for v in value)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None


class Stage:
    """Base of all stages: frozen dataclasses whose repr reads like the call that made them."""

    method: ClassVar[str] = ""  # the Dataset method that adds the stage, named in errors


def _names(name: str, value: object) -> tuple[str, ...]:
    """A tuple of distinct non-empty field names from a tuple or list; anything else is a ValueError."""
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name} must be a tuple of field names (non-empty strings), got {value!r}")
    seen = [v for i, v in enumerate(value) if v in value[:i]]
    if seen:
        raise ValueError(f"{name} names {seen[0]!r} twice")
    return tuple(value)


@dataclass(frozen=True)
class Decode(Stage):
    """Bytes to RGB uint8 (JPEG via libjpeg-turbo, the rest via Pillow); masks to uint8 label maps.

    fast=True: coarser DCT scaling, IFAST IDCT, no fancy upsampling (faster, changes pixels).
    max_pixels: the pixel limit of every sample, whatever its format, checked from its header before
    anything is allocated (a DecodeError past it); the default is Pillow's Image.MAX_IMAGE_PIXELS when
    raydl was imported. A field of the stage, so it travels with the stages to every worker.
    fields: the image fields decoded (None: every field of kind image); the others stay bytes.
    masks: image fields decoded as single-channel label maps (decode.decode_label), resampled
    nearest-neighbour, never normalized, out uint8 (H, W); decoded whether or not `fields` names them.
    """

    method: ClassVar[str] = "decode"

    fast: bool = False
    max_pixels: int = decode.MAX_PIXELS
    fields: tuple[str, ...] | None = None
    masks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.fast, bool):
            raise ValueError(f"fast must be True or False, got {self.fast!r}")
        if not is_positive_int(self.max_pixels):
            raise ValueError(f"max_pixels must be a positive int, got {self.max_pixels!r}")
        object.__setattr__(self, "max_pixels", int(self.max_pixels))
        if self.fields is not None:
            object.__setattr__(self, "fields", _names("fields", self.fields))
        object.__setattr__(self, "masks", _names("masks", self.masks))


@dataclass(frozen=True)
class RandomResizedCrop(Stage):
    """torchvision's RandomResizedCrop: a random area/aspect box, resized to `size`."""

    method: ClassVar[str] = "random_resized_crop"

    size: tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2("size", self.size))
        object.__setattr__(self, "scale", _numbers("scale", self.scale, 2, "a pair of numbers (min, max)"))
        object.__setattr__(self, "ratio", _numbers("ratio", self.ratio, 2, "a pair of numbers (min, max)"))
        if not (0 < self.scale[0] <= self.scale[1] <= 1):
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale!r}")
        if not (0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {self.ratio!r}")


@dataclass(frozen=True)
class Resize(Stage):
    """Resize so the short side is `size` (aspect kept), or to exactly (h, w)."""

    method: ClassVar[str] = "resize"

    size: int | tuple[int, int]

    def __post_init__(self) -> None:
        if not is_positive_int(self.size):
            object.__setattr__(self, "size", _size2("size", self.size))


@dataclass(frozen=True)
class CenterCrop(Stage):
    """The central (h, w) window; an image smaller than it is stretched to cover it."""

    method: ClassVar[str] = "center_crop"

    size: tuple[int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2("size", self.size))


@dataclass(frozen=True)
class RandomHFlip(Stage):
    """Mirror left-right with probability p."""

    method: ClassVar[str] = "random_hflip"

    p: float = 0.5

    def __post_init__(self) -> None:
        check_number("p", self.p, at_least=0, at_most=1, types=_NUMBER_TYPES)


@dataclass(frozen=True)
class Normalize(Stage):
    """(pixel / 255 - mean) / std per channel; output becomes float32 NCHW."""

    method: ClassVar[str] = "normalize"

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    preset: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean and std need 3 values (RGB), got {self.mean!r}, {self.std!r}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be positive, got {self.std!r}")

    @classmethod
    def make(cls, mean: str | tuple[float, ...], std: tuple[float, ...] | None) -> Normalize:
        if isinstance(mean, str):
            if mean not in NORMALIZE_PRESETS:
                raise ValueError(f"unknown normalize preset {mean!r}; known: {sorted(NORMALIZE_PRESETS)}")
            if std is not None:
                raise ValueError("std must not be given with a normalize preset")
            m, s = NORMALIZE_PRESETS[mean]
            return cls(m, s, preset=mean)
        if std is None:
            raise ValueError("std is required when mean is given as numbers")
        what = "3 numbers (one per RGB channel)"
        return cls(_numbers("mean", mean, 3, what), _numbers("std", std, 3, what))  # type: ignore[arg-type]


@dataclass(frozen=True)
class AspectBuckets(Stage):
    """Crop each image to the ratio of the bucket nearest its own and resize it there (datago's buckets)."""

    method: ClassVar[str] = "aspect_buckets"

    size: int = 512
    multiple: int = 32
    min_ratio: float = 0.5
    max_ratio: float = 2.0
    crop: str = "center"

    def __post_init__(self) -> None:
        check_bucket_args(self.size, self.multiple, self.min_ratio, self.max_ratio)
        if self.crop not in ("center", "random"):
            raise ValueError(f"crop must be 'center' or 'random', got {self.crop!r}")

    @functools.cached_property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        """The bucket set, (height, width) sorted by aspect ratio."""
        return bucket_set(self.size, self.multiple, self.min_ratio, self.max_ratio)

    def assign(self, widths, heights) -> np.ndarray:
        """Bucket index of each image (-1 where its size is unknown)."""
        return assign_buckets(self.buckets, widths, heights)

    def bucket_crop(
        self, h: int, w: int, rng: SampleRng, bucket: tuple[int, int] | None = None
    ) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
        """The bucket (height, width) and the crop box (left, top, width, height) of an h x w image.

        The box is the largest with the bucket's aspect ratio (rounded to whole
        pixels), centred as torchvision's center_crop or at a random offset.
        """
        if bucket is None:
            bucket = self.buckets[int(self.assign([w], [h])[0])]
        bh, bw = bucket
        if w * bh > h * bw:  # wider than the bucket: full height
            ch, cw = h, min(w, max(1, int(round(h * bw / bh))))
        else:
            cw, ch = w, min(h, max(1, int(round(w * bh / bw))))
        if self.crop == "random":
            top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
        else:
            top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        return (bh, bw), (left, top, cw, ch)


class SampleRng:
    """splitmix64 stream from one sample's seed: a few draws per sample, same on every platform."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = int(seed) & MASK64

    def random(self) -> float:
        self._state = (self._state + GAMMA) & MASK64
        return (mix64(self._state) >> 11) * (1.0 / (1 << 53))

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self.random()

    def randint(self, lo: int, hi: int) -> int:
        """Integer in [lo, hi] inclusive."""
        return lo + min(int(self.random() * (hi - lo + 1)), hi - lo)


def rrc_box(h: int, w: int, stage: RandomResizedCrop, rng: SampleRng) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (top, left, height, width)."""
    area = h * w
    log_lo, log_hi = math.log(stage.ratio[0]), math.log(stage.ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*stage.scale)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, h - ch), rng.randint(0, w - cw), ch, cw
    in_ratio = w / h
    if in_ratio < stage.ratio[0]:
        cw, ch = w, int(round(w / stage.ratio[0]))
    elif in_ratio > stage.ratio[1]:
        ch, cw = h, int(round(h * stage.ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


_GEOMETRY = (RandomResizedCrop, Resize, CenterCrop)  # what aspect_buckets replaces


def check_stage_order(stages: Sequence[Stage]) -> None:
    """Raise a ValueError naming the first stage that breaks the order rules, and what it needs.

    The rules hold for every prefix of a valid pipeline, so `Dataset` checks them
    as each stage is added (the call that makes the mistake fails) and
    `compile_stages` checks the whole pipeline again: .decode() first and once,
    .normalize() last, .aspect_buckets() at most once and without the crop and
    resize stages it replaces.
    """
    for i, st in enumerate(stages):
        call = f".{st.method}()"
        if i == 0 and not isinstance(st, Decode):
            raise ValueError(f"{call} needs .decode() before it: the first stage must be .decode()")
        if i > 0 and isinstance(st, Decode):
            raise ValueError(".decode() can appear only once")
        if i > 0 and isinstance(stages[i - 1], Normalize):
            raise ValueError(f".normalize() must be the last stage, but {call} follows it ({st!r})")
        if isinstance(st, (AspectBuckets, *_GEOMETRY)):
            before = {type(x) for x in stages[:i]}
            if AspectBuckets in before or (isinstance(st, AspectBuckets) and before & set(_GEOMETRY)):
                raise ValueError(
                    f"{call} cannot join this pipeline: .aspect_buckets() replaces the crop/resize stages: "
                    "use it once, without random_resized_crop, resize or center_crop"
                )
