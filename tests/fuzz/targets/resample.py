"""The C resampler (crop + resize + flip + normalize, kernels.c) on decoded arrays of tiny and extreme shapes, and
the masks' label decode and nearest-neighbour resample on the same inputs."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from raydl import native
from raydl.errors import DecodeError
from raydl.native import decode

# A resize over the work bound or an image over the pixel limit is a DecodeError; a NativeKernelError would
# mean a shape or box that raydl's checks let through and the kernel refuses (a bug)
ALLOWED = (DecodeError,)
# The floor of a run (harness.py); measured in 20 s runs on a loaded 2-core machine: 3,040-4,840 inputs, 790-1,230 accepted
MIN_INPUTS, MIN_ACCEPTED = 800, 100
MAX_PIXELS = 2_000_000
SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data"
_SCALE = np.array([1 / 58.4, 1 / 57.1, 1 / 57.4], np.float32)
_BIAS = np.array([-2.1, -2.0, -1.8], np.float32)
_MAGIC = b"RSMP"  # a shape spec: source, box and output drawn from the bytes after it
warnings.filterwarnings("ignore", category=UserWarning, module="PIL")  # APNG/EXIF notes on mutated files


def _png(w: int, h: int, *, mode: str = "L") -> bytes:
    """A PNG of w x h built by hand (zero rows, one zlib stream): extreme shapes cost a few bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    colour, channels = (0, 1) if mode == "L" else (2, 3)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, 0)
    idat = zlib.compress(bytes((1 + w * channels) * h), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def seeds() -> list[bytes]:
    rng = np.random.default_rng(5)
    photo = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (37, 61, 3), dtype=np.uint8)).save(photo, "PNG")
    out = [
        _png(1, 1),
        _png(1, 3000),
        _png(3000, 1),
        _png(2, 3, mode="RGB"),
        _png(1400, 1400),  # just under MAX_PIXELS
        photo.getvalue(),
        _MAGIC + struct.pack("<HHHHHHHHB", 1, 50000, 7, 3, 0, 0, 65535, 65535, 0),
        _MAGIC + struct.pack("<HHHHHHHHB", 40000, 1, 1, 224, 100, 0, 900, 65535, 3),
        _MAGIC + struct.pack("<HHHHHHHHB", 3, 5, 256, 256, 30000, 30000, 30001, 30001, 1),
    ]
    if SHARED.is_dir():
        small = sorted(p for p in (SHARED / "pillow").glob("*.png") if p.stat().st_size < 32_000)
        out += [p.read_bytes() for p in small[::6][:10]]
    return out


def _spec(data: bytes):
    """(src, box, out shape, flip, float output) from a shape spec: sizes and box fractions from the bytes."""
    body = data[len(_MAGIC) :].ljust(17, b"\0")
    sh, sw, oh, ow, fx0, fy0, fx1, fy1, flags = struct.unpack("<HHHHHHHHB", body[:17])
    sh, sw = max(1, sh), max(1, sw)
    if sh * sw > MAX_PIXELS:  # an array that large would not have got past the decoders' pixel limit
        sh = max(1, MAX_PIXELS // sw)
    oh, ow = 1 + oh % 300, 1 + ow % 300
    src = np.frombuffer((body * (1 + sh * sw * 3 // len(body)))[: sh * sw * 3], np.uint8).reshape(sh, sw, 3)
    x0, y0 = fx0 / 65536 * sw, fy0 / 65536 * sh
    x1 = x0 + max(1e-3, (sw - x0) * fx1 / 65535)
    y1 = y0 + max(1e-3, (sh - y0) * fy1 / 65535)
    return src, (x0, y0, min(x1, float(sw)), min(y1, float(sh))), (oh, ow), bool(flags & 1), bool(flags & 2)


def _resize(src, box, shape, flip: bool, as_float: bool) -> None:
    out = np.empty((3, *shape), np.float32) if as_float else np.empty((*shape, 3), np.uint8)
    kw = {"scale": _SCALE, "bias": _BIAS} if as_float else {}
    native.crop_resize_into(src, box, out, flip=flip, max_pixels=MAX_PIXELS, **kw)


def run_one(data: bytes) -> None:
    if data.startswith(_MAGIC):
        src, box, shape, flip, as_float = _spec(data)
        if not (0 <= box[0] < box[2] <= src.shape[1] and 0 <= box[1] < box[3] <= src.shape[0]):
            return  # float rounding made an empty box: the kernel's own refusal, tested elsewhere
        _resize(src, box, shape, flip, as_float)
        native.crop_resize_nearest_into(np.ascontiguousarray(src[:, :, 0]), box, np.empty(shape, np.uint8), flip=flip)
        return
    try:  # the same bytes as a mask: a label map, or a DecodeError (colour, labels past 255, corrupt)
        label = decode.decode_label(data, max_pixels=MAX_PIXELS)
    except DecodeError:
        label = None
    img = decode.decode_rgb(data, max_pixels=MAX_PIXELS)
    h, w = img.shape[:2]
    k = zlib.crc32(data)
    for i, shape in enumerate(((1, 1), (16, 16), (224, 224), (3, 250), (250, 3))):
        box = (0.0, 0.0, float(w), float(h)) if i % 2 == 0 else (w / 4, h / 4, w / 4 + max(w / 2, 0.5), h)
        _resize(img, box, shape, flip=bool((k >> i) & 1), as_float=bool((k >> (i + 8)) & 1))
        if label is not None and label.shape == (h, w):
            native.crop_resize_nearest_into(label, box, np.empty(shape, np.uint8), flip=bool((k >> i) & 1))
