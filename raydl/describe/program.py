"""The per-sample program the stages compile to (`compile_stages` -> `SampleProgram`).

For one sample a program reads the image size from the header, draws the augmentation from the sample's
seed, folds every geometric stage into one source box, decodes (downscaled in the DCT domain when the box
is at least twice the output, or just as large with decode(fast=True)) and calls the native kernel once
to crop, resize, flip, normalize and write the batch slot.

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raydl import native
from raydl.describe.fields import Field
from raydl.describe.stages import (
    AspectBuckets,
    CenterCrop,
    Normalize,
    RandomHFlip,
    RandomResizedCrop,
    Resize,
    SampleRng,
    Stage,
    check_stage_order,
    rrc_box,
)
from raydl.native import decode

__all__ = ["SampleProgram", "compile_stages"]


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
