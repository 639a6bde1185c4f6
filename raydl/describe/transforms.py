"""Declarative transform stages and the per-sample program they compile to.

Stages are frozen, printable dataclasses recorded by `Dataset`. `compile_stages`
turns them into a `SampleProgram`: for one sample it reads the image size from
the header, draws the augmentation from the sample's seed, folds every
geometric stage into one source box, decodes (downscaled in the DCT domain when
the box is at least twice the output, or just as large with decode(fast=True))
and calls the native kernel once to crop, resize, flip, normalize and write
the batch slot.

Fidelity is the default: the reference is Pillow stage by stage with
torchvision's semantics (full decode, box crop, antialiased bilinear resize),
and a program's output stays within about a grey level of it.
`decode(fast=True)` opts into the shortcuts that change pixels: the coarser
DCT scale, libjpeg's IFAST IDCT and no fancy upsampling.

A sample may have several image fields (`decode(fields=..., masks=...)`). The
geometry is drawn once per sample, on the size of its first decoded image
field (the reference), and scaled onto each field's own size, so every field
gets the same relative box and the same flip: an image and a mask of the same
size get the same box to the pixel. Masks are label maps: decoded as stored
(`decode.decode_label`), resampled nearest-neighbour, never normalized, out
uint8 (H, W).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from raydl import native
from raydl.describe.buckets import assign_buckets, bucket_set, check_bucket_args
from raydl.native import decode
from raydl.options import check_number, is_positive_int
from raydl.util.splitmix import GAMMA, MASK64, mix64

if TYPE_CHECKING:
    from raydl.describe.fields import Field

__all__ = [
    "AspectBuckets",
    "CenterCrop",
    "Decode",
    "Normalize",
    "RandomHFlip",
    "RandomResizedCrop",
    "Resize",
    "SampleProgram",
    "Stage",
    "check_stage_order",
    "compile_stages",
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


@dataclass(frozen=True)
class SampleProgram:
    """What one sample goes through, compiled from the stages (fields, masks: the decode stage's)."""

    stages: tuple[Stage, ...]
    out_size: tuple[int, int] | None
    normalize: Normalize | None
    dct_scaling: bool = True
    fast: bool = False
    buckets: AspectBuckets | None = None
    max_pixels: int = decode.MAX_PIXELS
    fields: tuple[str, ...] | None = None
    masks: tuple[str, ...] = ()

    @property
    def dtype(self) -> np.dtype:
        """The dtype of an image field's slots (masks: mask_dtype)."""
        return np.dtype(np.float32) if self.normalize else np.dtype(np.uint8)

    @property
    def mask_dtype(self) -> np.dtype:
        """The dtype of a mask's slots: uint8 labels, whatever normalize does to the images."""
        return np.dtype(np.uint8)

    def decoded(self, source_fields: Sequence[Field]) -> list[tuple[str, bool]]:
        """(name, is_mask) of each image field of the source this program decodes, in the source's order.

        The first is the sample's reference: its size is the `ref` of the others' geometry. A name in
        fields or masks that is not an image field of the source is a ValueError naming it and the
        source's image fields (a source without image fields gives [], which the loader refuses).
        """
        images = [f.name for f in source_fields if f.kind == "image"]
        for what, names in (("fields", self.fields or ()), ("masks", self.masks)):
            for name in names:
                if name not in images:
                    raise ValueError(
                        f"decode({what}=...) names {name!r}, which is not an image field of the source; "
                        f"its image fields are {images}"
                    )
        chosen = set(images if self.fields is None else self.fields) | set(self.masks)
        return [(name, name in self.masks) for name in images if name in chosen]

    def slot_shape(self, size: tuple[int, int] | None = None, *, mask: bool = False) -> tuple[int, ...]:
        """Shape of one sample in the batch: (3, H, W) float32 or (H, W, 3) uint8; a mask's (H, W).

        `size` gives (H, W) for a bucketed program, whose batches each have their bucket's size.
        """
        size = size or self.out_size
        if size is None:
            if self.buckets is not None:
                raise ValueError("a bucketed program's slot shape depends on the bucket: pass size=(H, W)")
            raise ValueError(
                "batches need one image shape: end the geometric stages with random_resized_crop, "
                "center_crop or resize((h, w)), or use aspect_buckets()"
            )
        h, w = size
        if mask:
            return (h, w)
        return (3, h, w) if self.normalize else (h, w, 3)

    def slot_shapes(self) -> list[tuple[int, ...]]:
        """Every image slot shape a batch of this program can have (one per bucket, or the one)."""
        if self.buckets is not None:
            return [self.slot_shape(b) for b in self.buckets.buckets]
        return [self.slot_shape()]

    def geometry(
        self, h: int, w: int, seed: int, out_size: tuple[int, int] | None = None
    ) -> tuple[tuple[float, float, float, float], bool]:
        """Source box (x0, y0, x1, y1) and flip flag of a (h, w) image under this sample's seed.

        out_size: the bucket (H, W) of a bucketed program (default: the one nearest the image's ratio).
        """
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
            elif isinstance(st, AspectBuckets):
                (lh, lw), (left, top, cw, ch) = st.bucket_crop(lh, lw, rng, out_size)
                x0, y0, bw, bh = float(left), float(top), float(cw), float(ch)
            elif isinstance(st, RandomHFlip):
                if rng.random() < st.p:
                    flip = not flip
        return (x0, y0, x0 + bw, y0 + bh), flip

    def image_size(self, data: bytes) -> tuple[int, int]:
        """(height, width) of an image field from its header; past max_pixels a DecodeError."""
        return decode.image_size(data, max_pixels=self.max_pixels)

    def field_geometry(
        self,
        h: int,
        w: int,
        seed: int,
        out_size: tuple[int, int] | None = None,
        ref: tuple[int, int] | None = None,
    ) -> tuple[tuple[float, float, float, float], bool]:
        """geometry() drawn on the reference size `ref` (default: this field's own) and scaled onto h x w.

        The box keeps its relative place (x * w / w_ref, y * h / h_ref) and the flip is the same, so
        every image field of a sample is cropped alike; where the sizes agree the box is the same.
        """
        if ref is None:
            return self.geometry(h, w, seed, out_size)
        rh, rw = ref
        box, flip = self.geometry(rh, rw, seed, out_size)
        if (rh, rw) != (h, w):
            sx, sy = w / rw, h / rh
            box = (box[0] * sx, box[1] * sy, min(box[2] * sx, float(w)), min(box[3] * sy, float(h)))
        return box, flip

    def run(self, data: bytes, seed: int, out: np.ndarray, ref: tuple[int, int] | None = None) -> None:
        """Decode `data` and write the transformed sample into `out` (its batch slot).

        ref: the (height, width) of the sample's first decoded image field, whose geometry this one
        shares (field_geometry); None: this image's own size.
        """
        h, w, box, flip, factor = self._plan(data, seed, out, ref)
        scale, bias = self._affine
        if decode.is_jpeg(data) and native.jpeg_crop_resize_into(
            data,
            box,
            out,
            flip=flip,
            scale=scale,
            bias=bias,
            scale_denom=factor,
            fast=self.fast,
            max_pixels=self.max_pixels,
        ):
            return  # decoded only the region the box needs
        self._run_whole(data, h, w, box, flip, factor, out)

    def run_mask(self, data: bytes, seed: int, out: np.ndarray, ref: tuple[int, int] | None = None) -> None:
        """Decode `data` as a label map (decode.decode_label) and write it, under this sample's geometry
        (field_geometry with `ref`), nearest-neighbour into uint8 (H, W) `out`; never normalized.

        A mask that is not single-channel, or over max_pixels, is a DecodeError, as a bad image is.
        """
        if out.dtype != np.uint8 or out.ndim != 2:
            raise ValueError(f"a mask's slot must be uint8 (H, W), got {out.dtype} {out.shape}")
        label = decode.decode_label(data, max_pixels=self.max_pixels)  # the header checked first
        h, w = label.shape
        box, flip = self.field_geometry(h, w, seed, out.shape if self.buckets is not None else None, ref)
        native.crop_resize_nearest_into(label, box, out, flip=flip)

    def run_many(
        self,
        items: Sequence[
            tuple[bytes, int, np.ndarray] | tuple[bytes, int, np.ndarray, tuple[int, int] | None]
        ],
    ) -> list[Exception | None]:
        """`run` for many (data, seed, out) or (data, seed, out, ref) samples of one batch; per sample None
        or the exception `run` raised.

        The JPEGs go through one native call (the GIL released once, not once
        per sample); the pixels, and each sample's error, are those of `run`.
        """
        results: list[Exception | None] = [None] * len(items)
        jpegs: list[tuple[int, int, int, tuple[float, float, float, float], bool, int]] = []
        for k, (data, seed, out, *ref) in enumerate(items):
            try:
                if not decode.is_jpeg(data):
                    self.run(data, seed, out, *ref)
                    continue
                jpegs.append((k, *self._plan(data, seed, out, *ref)))
            except Exception as exc:  # noqa: BLE001 - handed back per sample, as run would have raised it
                results[k] = exc
        if not jpegs:
            return results
        scale, bias = self._affine
        try:
            done: list | None = native.jpeg_crop_resize_many(
                [items[j[0]][0] for j in jpegs],
                [j[3] for j in jpegs],
                [items[j[0]][2] for j in jpegs],
                flips=[j[4] for j in jpegs],
                scale=scale,
                bias=bias,
                scale_denoms=[j[5] for j in jpegs],
                fast=self.fast,
                max_pixels=self.max_pixels,
            )
        except Exception as exc:  # noqa: BLE001 - a bad slot layout: every sample of the call fails with it
            done = [exc] * len(jpegs)
        for i, (k, h, w, box, flip, factor) in enumerate(jpegs):
            status = False if done is None else done[i]
            if isinstance(status, Exception):
                results[k] = status
            elif status is False:  # not the region decoder's (module not built, CMYK): decode it whole
                data, out = items[k][0], items[k][2]
                try:
                    self._run_whole(data, h, w, box, flip, factor, out)
                except Exception as exc:  # noqa: BLE001
                    results[k] = exc
        return results

    def _plan(
        self, data: bytes, seed: int, out: np.ndarray, ref: tuple[int, int] | None = None
    ) -> tuple[int, int, tuple[float, float, float, float], bool, int]:
        """(h, w, box, flip, DCT factor) of one sample, from its header, seed and reference size.

        A DecodeError when the header's size is over the pixel limit, before anything is decoded or allocated
        (the kernels refuse a resize that would read more than the limit allows, before they allocate).
        """
        h, w = decode.image_size(data, max_pixels=self.max_pixels)
        oh, ow = (out.shape[1], out.shape[2]) if self.normalize else (out.shape[0], out.shape[1])
        box, flip = self.field_geometry(h, w, seed, (oh, ow) if self.buckets is not None else None, ref)
        factor = 1
        if self.dct_scaling and decode.is_jpeg(data):
            factor = decode.dct_factor(h, w, box[3] - box[1], box[2] - box[0], oh, ow, fast=self.fast)
        return h, w, box, flip, factor

    def _run_whole(
        self,
        data: bytes,
        h: int,
        w: int,
        box: tuple[float, float, float, float],
        flip: bool,
        factor: int,
        out: np.ndarray,
    ) -> None:
        """Decode the whole image (not a JPEG, or one the region decoder cannot take), then crop and
        resize."""
        scale, bias = self._affine
        img = decode.decode_rgb(data, factor=factor, fast=self.fast, max_pixels=self.max_pixels)
        if img.shape[0] != h or img.shape[1] != w:  # downscaled decode: map the box onto it
            sy, sx = img.shape[0] / h, img.shape[1] / w
            box = (box[0] * sx, box[1] * sy, min(box[2] * sx, img.shape[1]), min(box[3] * sy, img.shape[0]))
        native.crop_resize_into(img, box, out, flip=flip, scale=scale, bias=bias, max_pixels=self.max_pixels)

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


def compile_stages(stages: tuple[Stage, ...], *, dct_scaling: bool = True) -> SampleProgram:
    """Check the order of the stages (`check_stage_order`) and compile them into a SampleProgram."""
    if not stages:
        raise ValueError("the first stage must be .decode()")
    check_stage_order(stages)
    out_size: tuple[int, int] | None = None
    normalize = None
    buckets: AspectBuckets | None = None
    for st in stages[1:]:
        if isinstance(st, AspectBuckets):
            buckets = st
        elif isinstance(st, (RandomResizedCrop, CenterCrop)):
            out_size = st.size
        elif isinstance(st, Resize):
            out_size = _resized(out_size, st.size)
        elif isinstance(st, Normalize):
            normalize = st
    return SampleProgram(
        stages=tuple(stages[1:]),
        out_size=out_size,
        normalize=normalize,
        dct_scaling=dct_scaling,
        fast=stages[0].fast,
        buckets=buckets,
        max_pixels=stages[0].max_pixels,
        fields=stages[0].fields,
        masks=stages[0].masks,
    )
