"""Bytes to RGB uint8 pixels: libjpeg-turbo (simplejpeg) for JPEG, Pillow for the rest.

Every mode Pillow knows (grayscale, CMYK, palette, 16-bit, with or without
alpha) comes out as (H, W, 3) uint8. Bytes that cannot be decoded raise
raydl.errors.DecodeError (a ValueError) with the decoder's reason, never an
object's repr; the caller names the file. Nothing else here is a decode error.

One pixel limit for every format (`max_pixels`, default MAX_PIXELS: Pillow's
Image.MAX_IMAGE_PIXELS when raydl is imported, about 89.5 M pixels): the size
comes from the header (JPEG SOF, progressive or not; PNG IHDR; Pillow's header
reader for the rest) and is checked before any pixel is allocated, so a
decompression bomb is a DecodeError that names its size, never a MemoryError.
Pillow's own refusal past twice *its* limit still applies to the formats that
only Pillow decodes.

Masks (`decode_label`) are the other way round: a single-channel label map
comes out as (H, W) uint8 as it is stored (palette indices, grey values),
never converted to RGB, and a colour image is a DecodeError, not a guess.
"""

from __future__ import annotations

import io
import math
import re
import struct
import warnings

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from raydl.errors import DecodeError

__all__ = [
    "HEADER_BYTES",
    "MAX_PIXELS",
    "NeedMoreBytes",
    "check_pixels",
    "dct_factor",
    "decode_label",
    "decode_rgb",
    "header_size",
    "image_size",
    "is_jpeg",
]

# What listing reads of each file first; EXIF and ICC blocks can push JPEG's SOF further
HEADER_BYTES = 16 * 1024

_JPEG_MAGIC = b"\xff\xd8\xff"
_REPR = re.compile(r"<[^<>]*? object at 0x[0-9a-fA-F]+>")
# What Pillow raises on bad bytes (UnidentifiedImageError is an OSError). Its plugins parse crafted
# structures with plain Python, so a fuzzed file also gets TypeError, struct.error, IndexError, KeyError or
# ZeroDivisionError out of them (the kinds Pillow's own fuzzers accept): bad bytes too, not raydl's bug.
_PILLOW_DATA_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    TypeError,
    struct.error,
    IndexError,
    KeyError,
    ZeroDivisionError,
    Image.DecompressionBombError,
)

# The default pixel limit: Pillow's when raydl is imported (its own default where a user switched it off).
MAX_PIXELS: int = int(Image.MAX_IMAGE_PIXELS or 1024 * 1024 * 1024 // 4 // 3)
# The largest width or height a PNG may declare (its spec), and what the catalog's int32 size columns hold.
MAX_SIDE = 2**31 - 1


def check_pixels(height: int, width: int, max_pixels: int) -> None:
    """DecodeError naming the size and the limit when a height x width image has over max_pixels pixels."""
    if height * width > max_pixels:
        raise DecodeError(
            f"image is {width}x{height} ({height * width} pixels), over the pixel limit of {max_pixels} "
            "(decode(max_pixels=...) sets it)"
        )


def _reason(exc: BaseException) -> str:
    """The decoder's reason, without the reprs of our in-memory buffers (`<_io.BytesIO object at 0x…>`)."""
    if isinstance(exc, UnidentifiedImageError):
        return "UnidentifiedImageError: not an image format Pillow can identify"
    return f"{type(exc).__name__}: {_REPR.sub('the bytes', str(exc))}"


def is_jpeg(data: bytes) -> bool:
    return data[:3] == _JPEG_MAGIC


def image_size(data: bytes, *, max_pixels: int | None = None) -> tuple[int, int]:
    """(height, width) from the header alone, without decoding pixels; past max_pixels (when given) a
    DecodeError naming the size and the limit (check_pixels)."""
    if data[:8] == _PNG_MAGIC and max_pixels is not None:
        try:
            h, w = header_size(data, complete=True)  # IHDR: ours is checked before Pillow's own bomb check
        except DecodeError:
            pass  # a malformed header: Pillow gives its reason below
        else:
            check_pixels(h, w, max_pixels)
    h, w = _header_size(data)
    if max_pixels is not None:
        check_pixels(h, w, max_pixels)
    return h, w


def _header_size(data: bytes) -> tuple[int, int]:
    if is_jpeg(data):
        try:
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            return h, w
        except ValueError:
            pass  # Pillow may still read it (e.g. some CMYK or arithmetic-coded files)
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
    except _PILLOW_DATA_ERRORS as exc:
        raise DecodeError(_reason(exc)) from exc
    return h, w


class NeedMoreBytes(DecodeError):
    """The header did not fit in the bytes given: read more of the file."""


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _jpeg_sof(data: bytes) -> tuple[int, int] | None:
    """(height, width) from the first SOF marker, walking the segments from the start; None past the end."""
    i, n = 2, len(data)
    while True:
        while i < n and data[i] != 0xFF:  # stray bytes between segments: libjpeg skips them too
            i += 1
        while i < n and data[i] == 0xFF:  # fill bytes
            i += 1
        if i >= n:
            return None
        marker = data[i]
        i += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers
            continue
        if marker in (0xD9, 0xDA):
            raise DecodeError("JPEG has no frame header (SOF) before its scan")
        if i + 2 > n:
            return None
        length = (data[i] << 8) | data[i + 1]
        if length < 2:
            raise DecodeError(f"JPEG segment 0x{marker:02X} has a bad length {length}")
        if marker in _SOF:
            if i + 7 > n:
                return None
            h = (data[i + 3] << 8) | data[i + 4]
            w = (data[i + 5] << 8) | data[i + 6]
            if h == 0 or w == 0:
                raise DecodeError(f"JPEG frame header gives an empty size {w}x{h}")
            return h, w
        i += length


def header_size(prefix: bytes, *, complete: bool) -> tuple[int, int]:
    """(height, width) from the first bytes of an image file, without decoding pixels.

    JPEG: the SOF marker; PNG: the IHDR chunk; anything else: Pillow's header
    reader. `complete` says whether `prefix` is the whole file. Raises
    NeedMoreBytes when the header runs past an incomplete prefix, ValueError
    when it cannot be read.
    """
    if prefix[:3] == _JPEG_MAGIC:
        size = _jpeg_sof(prefix)
        if size is not None:
            return size
        if not complete:
            raise NeedMoreBytes("JPEG frame header lies past the bytes read")
        raise DecodeError("JPEG ends before its frame header (SOF)")
    if prefix[:8] == _PNG_MAGIC:
        if len(prefix) < 24:
            if not complete:
                raise NeedMoreBytes("PNG header lies past the bytes read")
            raise DecodeError("PNG ends before its IHDR chunk")
        if prefix[12:16] != b"IHDR":
            raise DecodeError("PNG does not start with an IHDR chunk")
        w, h = int.from_bytes(prefix[16:20], "big"), int.from_bytes(prefix[20:24], "big")
        if h == 0 or w == 0:
            raise DecodeError(f"PNG IHDR gives an empty size {w}x{h}")
        if h > MAX_SIDE or w > MAX_SIDE:
            raise DecodeError(f"PNG IHDR gives a size {w}x{h} past PNG's limit of {MAX_SIDE} pixels a side")
        return h, w
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(prefix)) as im:
                w, h = im.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        if not complete:
            raise NeedMoreBytes(f"{type(exc).__name__}: {exc}") from exc
        raise DecodeError(f"{type(exc).__name__}: {exc}") from exc
    if h <= 0 or w <= 0:
        raise DecodeError(f"image header gives an empty size {w}x{h}")
    return h, w


FIDELITY_MIN_RATIO = 12.0  # default mode: DCT-scale by 2 only while the box stays >= 12x the output


def dct_factor(
    height: int, width: int, box_h: float, box_w: float, out_h: int, out_w: int, *, fast: bool = False
) -> int:
    """The JPEG DCT downscale (1, 2, 4 or 8) to decode a box at, for an output of out_h x out_w.

    Default (fidelity): 2 while the box stays >= 12x the output on both axes,
    else 1; never 4 or 8. Measured on the 407 images of the shared photos and
    make_images.py --profile hires (mean |raydl - Pillow full decode|, whole
    image resized): a DCT-scaled pixel is not the average of the pixels it
    replaces, and on textured images that difference shrinks only as ~1/k
    with k = (scaled box) / output. Scaling by 2 reached 1.53 grey levels at
    k = 6, 1.16 at 8, 0.92 at 10 and 0.76 at 12; scaling by 4 still reached
    1.20 at k = 12. The 4x rule used before broke the bound (1.4-2.9) on some
    of these images once the output was small (256 buckets, 64-128 px
    resizes). So the default decodes at full scale unless the image is very
    large for its output, and only the crop's region.
    fast=True: the largest of 2, 4, 8 that keeps the box >= 1x the output
    (means of 1-4 grey levels). libjpeg-turbo's other M/8 scales measured
    slower than a full decode (3/8 to 7/8: 0.9-2.3x its time), so they are
    not used.
    """
    need, factors = (1.0, (2, 4, 8)) if fast else (FIDELITY_MIN_RATIO, (2,))
    factor = 1
    for f in factors:
        if box_w / f >= need * out_w and box_h / f >= need * out_h and height // f >= 1 and width // f >= 1:
            factor = f
    return factor


def decode_rgb(
    data: bytes, *, factor: int = 1, fast: bool = False, max_pixels: int = MAX_PIXELS
) -> np.ndarray:
    """Decode to (H, W, 3) uint8, JPEGs optionally downscaled by `factor` in the DCT domain.

    fast=True: libjpeg-turbo's IFAST IDCT without fancy upsampling (faster, different pixels).
    An image whose header gives more than max_pixels pixels is a DecodeError before anything is decoded.
    """
    h, w = image_size(data, max_pixels=max_pixels)
    try:
        return _decode(data, factor, fast)
    except MemoryError as exc:  # within the limit, yet the process has no room: this sample's failure
        raise DecodeError(f"out of memory decoding a {w}x{h} image") from exc


def _decode(data: bytes, factor: int, fast: bool) -> np.ndarray:
    if is_jpeg(data):
        try:
            if factor > 1:
                h, w, _, _ = simplejpeg.decode_jpeg_header(data)
                return simplejpeg.decode_jpeg(
                    data,
                    colorspace="RGB",
                    min_height=math.ceil(h / factor),
                    min_width=math.ceil(w / factor),
                    fastdct=fast,
                    fastupsample=fast,
                )
            return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=fast, fastupsample=fast)
        except ValueError:
            pass  # CMYK/YCCK and other variants libjpeg-turbo cannot convert: Pillow below
    return _decode_pillow(data, factor)


def _decode_pillow(data: bytes, factor: int) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            # palette-with-transparency notes etc., and Pillow's bomb warning: decode_rgb checked the size
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as im:
                if factor > 1 and im.format == "JPEG":
                    im.draft("RGB", (im.size[0] // factor, im.size[1] // factor))
                im.load()
                return _to_rgb(im)
    except _PILLOW_DATA_ERRORS as exc:
        raise DecodeError(_reason(exc)) from exc


def _to_rgb(im: Image.Image) -> np.ndarray:
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16/32-bit integer grey: keep the top 8 significant bits instead of clipping.
        arr = np.asarray(im)
        maxv = 65535 if im.mode.startswith("I;16") else max(int(arr.max()), 1)
        arr = np.clip(arr.astype(np.float64) * (255.0 / maxv) + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(arr[:, :, None], 3, axis=2)
    if im.mode == "F":
        arr = np.asarray(im, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        arr = np.clip((arr - lo) * (255.0 / (hi - lo or 1.0)) + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(arr[:, :, None], 3, axis=2)
    if im.mode != "RGB":
        im = im.convert("RGBA").convert("RGB") if "transparency" in im.info else im.convert("RGB")
    return np.asarray(im)


# Pillow modes that are one channel of integer labels as stored (LA/PA: the alpha beside it is dropped).
_LABEL_MODES = {"P": 0, "PA": 0, "L": 0, "LA": 0}
_WIDE_LABEL_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def decode_label(data: bytes, *, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode a mask to an (H, W) uint8 label map: each pixel's value as stored, never converted to RGB.

    Palette images (P, PA) give their palette indices, grey ones (L, LA; JPEG
    with one component) their grey values, bilevel ones (mode 1) 0 and 1; an
    alpha channel beside them is dropped. 16- and 32-bit integer grey (I;16,
    I) is taken while every value fits 0..255, else a DecodeError. Colour
    images (RGB, RGBA, CMYK, YCbCr, a colour JPEG) and float images are a
    DecodeError saying a mask must be single-channel. The header is checked
    against max_pixels before anything is decoded, as for images.
    """
    h, w = image_size(data, max_pixels=max_pixels)
    try:
        if is_jpeg(data):
            label = _decode_grey_jpeg(data)
            if label is not None:
                return label
        return _decode_label_pillow(data)
    except MemoryError as exc:
        raise DecodeError(f"out of memory decoding a {w}x{h} mask") from exc


def _decode_grey_jpeg(data: bytes) -> np.ndarray | None:
    """A one-component JPEG's grey values through libjpeg-turbo; None for any other JPEG (Pillow decides)."""
    try:
        if simplejpeg.decode_jpeg_header(data)[2] != "Gray":
            return None
        return simplejpeg.decode_jpeg(data, colorspace="GRAY")[:, :, 0]
    except ValueError:
        return None  # Pillow gives its reason, or reads what libjpeg-turbo could not


def _decode_label_pillow(data: bytes) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # decode_label checked the size against max_pixels
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                return _to_label(im)
    except _PILLOW_DATA_ERRORS as exc:
        if isinstance(exc, DecodeError):
            raise
        raise DecodeError(_reason(exc)) from exc


def _to_label(im: Image.Image) -> np.ndarray:
    mode = im.mode
    if mode == "1":
        return np.asarray(im).astype(np.uint8)  # bool: 0 and 1, the two labels of a bilevel mask
    if mode in _LABEL_MODES:
        arr = np.asarray(im)
        return np.ascontiguousarray(arr[:, :, 0]) if arr.ndim == 3 else arr
    if mode in _WIDE_LABEL_MODES:
        arr = np.asarray(im)
        lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
        if lo < 0 or hi > 255:
            raise DecodeError(
                f"mask ({mode}) holds label values from {lo} to {hi}; a mask's labels must fit 0..255 (uint8)"
            )
        return arr.astype(np.uint8)
    raise DecodeError(
        f"a mask must be single-channel (a palette, grey or bilevel image), got a {mode} image; "
        "masks are never converted from colour: save it as a palette (P) or grey (L) PNG"
    )
