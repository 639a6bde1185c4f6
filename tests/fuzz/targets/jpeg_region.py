"""The JPEG region and DCT-scaled decoder (libjpeg-turbo, jpeg.c) through raydl's public decode entry points."""

from __future__ import annotations

import io
import warnings
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from raydl import native
from raydl.describe.transforms import (
    CenterCrop,
    Decode,
    Normalize,
    RandomHFlip,
    RandomResizedCrop,
    Resize,
    compile_stages,
)
from raydl.errors import DecodeError
from raydl.native import decode

# Corrupt data is a DecodeError; a NativeKernelError would mean raydl handed the kernel inputs it refuses (a bug)
ALLOWED = (DecodeError,)
# The floor of a run (harness.py); measured in 20 s runs on a loaded 2-core machine: 1,270-3,710 inputs, 200-590 of them accepted
MIN_INPUTS, MIN_ACCEPTED = 500, 50
MAX_PIXELS = 16_000_000  # keeps one input's decode well inside the harness's 5 s
SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data"
warnings.filterwarnings("ignore", category=UserWarning, module="PIL")  # EXIF notes on mutated files, not findings

_LIMIT = Decode(max_pixels=MAX_PIXELS)
_PROGRAMS = [
    compile_stages((_LIMIT, RandomResizedCrop(32), RandomHFlip(), Normalize.make("imagenet", None))),
    compile_stages((_LIMIT, Resize(24), CenterCrop(16))),  # a large box for a small output: DCT-scaled
    compile_stages((Decode(fast=True, max_pixels=MAX_PIXELS), RandomResizedCrop((8, 40)))),
]


def _encode(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def seeds() -> list[bytes]:
    rng = np.random.default_rng(17)
    yy, xx = np.mgrid[0:45, 0:67]
    rgb = np.stack([(xx * 5 + yy * (c + 1) * 3) % 256 for c in range(3)], -1) + rng.normal(0, 12, (45, 67, 3))
    img = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
    out = [
        _encode(img, quality=85, subsampling=2),  # baseline 4:2:0
        _encode(img, quality=95, subsampling=0),  # 4:4:4
        _encode(img, quality=80, progressive=True),
        _encode(img.convert("L"), quality=90),
        _encode(img, quality=90, restart_marker_blocks=3),  # DRI + RST markers
        _encode(img, quality=70, optimize=True, subsampling=1),  # 4:2:2, optimized Huffman tables
        _encode(img.convert("CMYK"), quality=90),  # not the region decoder's: the whole-decode fallback
        _encode(img.resize((9, 7)), quality=50),
    ]
    if SHARED.is_dir():  # a few real files: small photos and Pillow's test JPEGs (broken ones included)
        small = sorted(p for p in (SHARED / "pillow").glob("*.jpg") if p.stat().st_size < 48_000)
        out += [p.read_bytes() for p in small[::4][:10]]
    return out


def _boxes(h: int, w: int, data: bytes) -> list[tuple[float, float, float, float]]:
    """A few crop boxes inside an h x w image: the whole, a corner, a thin strip, one from the input's bytes."""
    k = zlib.crc32(data)
    fx, fy = (k & 0xFFFF) / 0x10000, (k >> 16) / 0x10000
    x0, y0 = fx * (w - 1), fy * (h - 1)
    return [
        (0.0, 0.0, float(w), float(h)),
        (0.0, 0.0, max(1.0, w / 3), max(1.0, h / 3)),
        (x0, 0.0, min(float(w), x0 + 1.0), float(h)),
        (x0, y0, x0 + (w - x0) * 0.7 + 0.01, y0 + (h - y0) * 0.5 + 0.01),
    ]


def run_one(data: bytes) -> None:
    seed = zlib.crc32(data)
    for program in _PROGRAMS:  # the loader's path: header, pixel limit, region decode or whole decode
        out = np.empty(program.slot_shape(), program.dtype)
        try:
            program.run(data, seed, out)
        except DecodeError:
            pass
    program = _PROGRAMS[0]  # the batched call: two slots of one batch, the second a truncated copy
    slots = np.empty((2, *program.slot_shape()), program.dtype)
    for err in program.run_many([(data, seed, slots[0]), (data[: len(data) // 2], seed + 1, slots[1])]):
        if err is not None and not isinstance(err, DecodeError):
            raise err
    # The region decoder itself, at every DCT scale, on boxes of the header's size
    h, w = decode.image_size(data, max_pixels=MAX_PIXELS)
    out = np.empty((7, 5, 3), np.uint8)
    for i, box in enumerate(_boxes(h, w, data)):
        native.jpeg_crop_resize_into(
            data, box, out, flip=bool(i & 1), scale_denom=(1, 2, 4, 8)[(seed >> i) & 3], max_pixels=MAX_PIXELS
        )
