"""Declarative transform stages and the per-sample program they compile to.

Stages are frozen, printable dataclasses recorded by `Dataset`. `compile_stages`
turns them into a `SampleProgram`: for one sample it reads the image size from
the header, draws the augmentation from the sample's seed, folds every
geometric stage into one source box, decodes (downscaled in the DCT domain when
the box is much larger than the output) and calls the native kernel once to
crop, resize, flip, normalize and write the batch slot.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from raydl import decode, native
from raydl._splitmix import GAMMA, MASK64, mix64
from raydl.config import is_positive_int, positive_int

__all__ = [
    "CenterCrop",
    "Decode",
    "Normalize",
    "RandomHFlip",
    "RandomResizedCrop",
    "Resize",
    "SampleProgram",
    "Stage",
    "compile_stages",
]

NORMALIZE_PRESETS = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def _size2(name: str, size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) from an int or a pair; positive ints only."""
    if isinstance(size, int) and not isinstance(size, bool):
        hw = (size, size)
    elif isinstance(size, (tuple, list)):
        hw = tuple(size)
    else:
        raise ValueError(f"{name} must be a positive int or (height, width), got {size!r}")
    if len(hw) != 2 or not all(is_positive_int(v) for v in hw):
        raise ValueError(f"{name} must be a positive int or (height, width), got {size!r}")
    return hw  # type: ignore[return-value]


class Stage:
    """Base of all stages: frozen dataclasses whose repr reads like the call that made them."""


@dataclass(frozen=True)
class Decode(Stage):
    """Bytes to RGB uint8 (JPEG via libjpeg-turbo, the rest via Pillow)."""


@dataclass(frozen=True)
class RandomResizedCrop(Stage):
    """torchvision's RandomResizedCrop: a random area/aspect box, resized to `size`."""

    size: tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2("size", self.size))
        if not (0 < self.scale[0] <= self.scale[1] <= 1):
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale!r}")
        if not (0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {self.ratio!r}")


@dataclass(frozen=True)
class Resize(Stage):
    """Resize so the short side is `size` (aspect kept), or to exactly (h, w)."""

    size: int | tuple[int, int]

    def __post_init__(self) -> None:
        if isinstance(self.size, int) and not isinstance(self.size, bool):
            positive_int("size", self.size)
        else:
            object.__setattr__(self, "size", _size2("size", self.size))


@dataclass(frozen=True)
class CenterCrop(Stage):
    """The central (h, w) window; an image smaller than it is stretched to cover it."""

    size: tuple[int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2("size", self.size))


@dataclass(frozen=True)
class RandomHFlip(Stage):
    """Mirror left-right with probability p."""

    p: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {self.p!r}")


@dataclass(frozen=True)
class Normalize(Stage):
    """(pixel / 255 - mean) / std per channel; output becomes float32 NCHW."""

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
        return cls(tuple(float(v) for v in mean), tuple(float(v) for v in std))  # type: ignore[arg-type]


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


@dataclass(frozen=True)
class SampleProgram:
    """What one sample goes through, compiled from the stages."""

    stages: tuple[Stage, ...]
    out_size: tuple[int, int] | None
    normalize: Normalize | None
    dct_scaling: bool = True

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32) if self.normalize else np.dtype(np.uint8)

    def slot_shape(self) -> tuple[int, ...]:
        """Shape of one sample in the batch: (3, H, W) float32 or (H, W, 3) uint8."""
        if self.out_size is None:
            raise ValueError(
                "batches need one image shape: end the geometric stages with random_resized_crop, "
                "center_crop or resize((h, w))"
            )
        h, w = self.out_size
        return (3, h, w) if self.normalize else (h, w, 3)

    def geometry(self, h: int, w: int, seed: int) -> tuple[tuple[float, float, float, float], bool]:
        """Source box (x0, y0, x1, y1) and flip flag of a (h, w) image under this sample's seed."""
        rng = SampleRng(seed)
        x0, y0, bw, bh = 0.0, 0.0, float(w), float(h)  # box in source pixels
        lh, lw = h, w  # logical size after the stages so far
        flip = False
        for st in self.stages:
            if isinstance(st, RandomResizedCrop):
                top, left, ch, cw = rrc_box(lh, lw, st, rng)
                sx, sy = bw / lw, bh / lh
                x0, y0, bw, bh = x0 + left * sx, y0 + top * sy, cw * sx, ch * sy
                lh, lw = st.size
            elif isinstance(st, Resize):
                lh, lw = _resized((lh, lw), st.size)  # type: ignore[misc]
            elif isinstance(st, CenterCrop):
                ch, cw = min(st.size[0], lh), min(st.size[1], lw)
                top, left = int(round((lh - ch) / 2.0)), int(round((lw - cw) / 2.0))
                sx, sy = bw / lw, bh / lh
                x0, y0, bw, bh = x0 + left * sx, y0 + top * sy, cw * sx, ch * sy
                lh, lw = st.size
            elif isinstance(st, RandomHFlip):
                if rng.random() < st.p:
                    flip = not flip
        return (x0, y0, x0 + bw, y0 + bh), flip

    def run(self, data: bytes, seed: int, out: np.ndarray) -> None:
        """Decode `data` and write the transformed sample into `out` (its batch slot)."""
        h, w = decode.image_size(data)
        box, flip = self.geometry(h, w, seed)
        scale, bias = self._affine
        jpeg = decode.is_jpeg(data)
        if jpeg and native.jpeg_crop_resize_into(data, box, out, flip=flip, scale=scale, bias=bias,
                                                 dct_scaling=self.dct_scaling):
            return  # decoded only the region the box needs
        factor = 1
        if self.dct_scaling and jpeg:
            oh, ow = self.out_size  # type: ignore[misc]
            factor = decode.dct_factor(h, w, box[3] - box[1], box[2] - box[0], oh, ow)
        img = decode.decode_rgb(data, factor=factor)
        if img.shape[0] != h or img.shape[1] != w:  # downscaled decode: map the box onto it
            sy, sx = img.shape[0] / h, img.shape[1] / w
            box = (box[0] * sx, box[1] * sy, min(box[2] * sx, img.shape[1]), min(box[3] * sy, img.shape[0]))
        native.crop_resize_into(img, box, out, flip=flip, scale=scale, bias=bias)

    @functools.cached_property
    def _affine(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Per-channel scale and bias of the normalize stage (None, None without one)."""
        if self.normalize is None:
            return None, None
        mean = np.asarray(self.normalize.mean, np.float32)
        std = np.asarray(self.normalize.std, np.float32)
        return (1.0 / (255.0 * std)).astype(np.float32), (-mean / std).astype(np.float32)


def _resized(size: tuple[int, int] | None, target: int | tuple[int, int]) -> tuple[int, int] | None:
    """Output size after Resize(target) of an image of `size` (None: varies per image)."""
    if isinstance(target, tuple):
        return target
    if size is None:
        return None
    h, w = size
    return (target, int(target * w / h)) if h <= w else (int(target * h / w), target)


def compile_stages(stages: tuple[Stage, ...], *, dct_scaling: bool = True) -> SampleProgram:
    """Check the order of the stages and compile them into a SampleProgram."""
    if not stages or not isinstance(stages[0], Decode):
        raise ValueError("the first stage must be .decode()")
    out_size: tuple[int, int] | None = None
    normalize = None
    for st in stages[1:]:
        if isinstance(st, Decode):
            raise ValueError(".decode() can appear only once")
        if normalize is not None:
            raise ValueError(f".normalize() must be the last stage, but {st!r} follows it")
        if isinstance(st, (RandomResizedCrop, CenterCrop)):
            out_size = st.size
        elif isinstance(st, Resize):
            out_size = _resized(out_size, st.size)
        elif isinstance(st, Normalize):
            normalize = st
    return SampleProgram(stages=tuple(stages[1:]), out_size=out_size, normalize=normalize,
                         dct_scaling=dct_scaling)
