"""Native kernels behind a narrow, typed boundary.

`crop_resize_into` writes one transformed sample into its slot of a batch. It
calls the C kernel (cffi, GIL released) when it was built, and otherwise a
numpy/Pillow fallback that gives the same geometry, after one warning that says
why the kernel is missing and how to build it.

Every entry point takes the pipeline's pixel limit (`max_pixels`, default
decode.MAX_PIXELS: Pillow's). It bounds what one sample may cost: the JPEG
region decoder refuses a frame header over it before allocating anything, and
a resize whose filter would read more than `resample_bound(max_pixels, ...)`
taps is refused by the kernel before it allocates or reads anything, so a
20,000,000 x 1 image resized to 224 x 224 is a DecodeError, not 13 s of CPU.

`token_windows_into` fills a batch of language-model windows (input ids,
labels, document positions) out of a unit's token values in one pass.

Masks are resampled nearest-neighbour in numpy (`crop_resize_nearest_into`):
two index gathers over an already decoded uint8 label map, which read one
source pixel per output pixel, so they need neither a C kernel nor a bound.
"""

from __future__ import annotations

import functools
import importlib
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from raydl.env import native_disabled, simd_cap
from raydl.errors import DecodeError, NativeKernelError
from raydl.native import decode

logger = logging.getLogger(__name__)

__all__ = [
    "crop_resize_into",
    "crop_resize_nearest_into",
    "jpeg_available",
    "jpeg_crop_resize_into",
    "jpeg_crop_resize_many",
    "kernel_status",
    "native_available",
    "resample_bound",
    "resample_work",
    "simd",
    "simd_level",
    "token_windows_into",
]

_OK, _EINVAL, _ENOMEM, _EJPEG, _EUNSUPPORTED, _ETOOBIG, _EWORK = 0, -1, -2, -3, -4, -5, -6
_ERR_LEN = 200  # bytes for one native error message


def _import(module: str, missing: str) -> tuple[Any, Any, str]:
    """(ffi, lib, reason) of a compiled cffi module of raydl.native; lib is None when it cannot load."""
    if native_disabled():
        return None, None, "disabled by RAYDL_DISABLE_NATIVE=1"
    try:
        mod = importlib.import_module(f"raydl.native.{module}")
    except ImportError as exc:
        return None, None, f"raydl.native.{module} is missing ({exc}); {missing}"
    cap = simd_cap()
    if cap is not None:
        mod.lib.raydl_simd(cap)
    return mod.ffi, mod.lib, "loaded"


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Any, Any, str]:
    """The crop/resize kernels."""
    return _import(
        "_kernels",
        "reinstall raydl with a C compiler present (`pip install -e .`) or run "
        "`python -m raydl.native._build_kernels`",
    )


@functools.lru_cache(maxsize=1)
def _load_jpeg() -> tuple[Any, Any, str]:
    """The region-decoding JPEG module."""
    return _import("_jpeg", "it needs libjpeg-turbo's headers at install time (Debian: libjpeg62-turbo-dev)")


def jpeg_available() -> bool:
    """True when JPEGs can be decoded region-only (libjpeg-turbo bound at install time)."""
    return _load_jpeg()[1] is not None


def native_available() -> bool:
    """True when the C kernels are loaded."""
    return _load()[1] is not None


def kernel_status() -> str:
    """One line saying which kernel path is in use and why."""
    ffi, lib, reason = _load()
    if lib is None:
        return f"numpy/Pillow fallback: {reason}"
    jpeg = (
        "region JPEG decode (libjpeg-turbo)" if jpeg_available() else f"whole-JPEG decode ({_load_jpeg()[2]})"
    )
    path = _SIMD_NAMES.get(int(lib.raydl_simd(-1)), "portable C")
    return f"native C kernel (cffi, fixed-point resampler, {path}), {jpeg}"


def simd(enabled: bool | None = None) -> bool:
    """Whether the resampler uses its AVX2 path; `enabled=False` forces the portable C one, True AVX2
    (simd_level: the AVX-512 vertical pass is opt-in).

    Every path computes the same integer sums, so they give the same bytes: this
    switch exists to test that. It applies to this process's kernels (both the
    plain and the JPEG module). False when the kernels are not loaded.
    """
    return simd_level(None if enabled is None else (SIMD_AVX2 if enabled else SIMD_PORTABLE)) > 0


SIMD_PORTABLE, SIMD_AVX2, SIMD_AVX512 = 0, 1, 2
_SIMD_NAMES = {SIMD_PORTABLE: "portable C", SIMD_AVX2: "AVX2", SIMD_AVX512: "AVX2 + AVX-512 vertical pass"}


def simd_level(level: int | None = None) -> int:
    """The resampler's path: SIMD_PORTABLE (0), SIMD_AVX2 (1, the default where the CPU has it) or
    SIMD_AVX512 (2: the vertical pass 64 bytes at a time, where the CPU has AVX-512 BW and VNNI; opt-in,
    also by RAYDL_SIMD=avx512, as it measured no faster overall: docs/benchmarks.md, "The worker's CPU per
    image"); `level` asks for at most that one.

    All three give the same bytes (tests/unit/test_kernels.py); -1 without the kernels.
    """
    mode = -1 if level is None else int(level)
    now = -1
    for loader in (_load, _load_jpeg):
        lib = loader()[1]
        if lib is not None:
            now = int(lib.raydl_simd(mode))
    return now


@functools.lru_cache(maxsize=1)
def _warn_fallback() -> None:
    msg = f"raydl: native kernels unavailable, using the slower fallback: {_load()[2]}"
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    logger.warning(msg)


def resample_work(src_hw: tuple[int, int], box, out_h: int, out_w: int) -> float | None:
    """The filter taps the C resampler reads to resize `box` of an image of src_hw (height, width) to
    out_h x out_w, as it counts them against resample_bound; None without the kernels."""
    ffi, lib, _ = _load()
    if lib is None:
        return None
    x0, y0, x1, y1 = (float(v) for v in box)
    return float(
        lib.raydl_resize_work(int(src_hw[0]), int(src_hw[1]), x0, y0, x1, y1, int(out_h), int(out_w))
    )


def resample_bound(max_pixels: int, out_h: int, out_w: int) -> float:
    """The most filter taps one resize may read under `max_pixels`: 4 per pixel of the limit and 8 per
    output pixel (kernels.h, raydl_resize_bound, says why); the plan's own memory is bounded by 4 bytes a
    pixel of it. The kernel's own formula; without the kernels nothing is bounded (Pillow resizes)."""
    lib = _load()[1]
    return float(lib.raydl_resize_bound(int(max_pixels), int(out_h), int(out_w))) if lib else float("inf")


def _over_bound(box, out_h: int, out_w: int, max_pixels: int) -> DecodeError:
    """The error of a resize the kernel refused as over the bound (RAYDL_EWORK)."""
    bw, bh = float(box[2]) - float(box[0]), float(box[3]) - float(box[1])
    return DecodeError(
        f"resizing a {bw:.0f}x{bh:.0f} box to {out_w}x{out_h} would read more filter taps than the "
        f"{resample_bound(max_pixels, out_h, out_w):.3g} that max_pixels={max_pixels} allows "
        "(4 per pixel of the limit, 8 per output pixel)"
    )


def _slot_args(ffi, box, out: np.ndarray, out_h: int, out_w: int, fmt: int, flip: bool, scale, bias) -> tuple:
    """What both crop/resize kernels take after their source: the box, the slot's size and format, the
    flip, the per-channel affine and the slot itself."""
    scale_c, bias_c = _affine(ffi, fmt, scale, bias)
    box_c = (float(box[0]), float(box[1]), float(box[2]), float(box[3]))
    slot = ffi.from_buffer(out, require_writable=True)
    return (*box_c, out_h, out_w, int(bool(flip)), fmt, scale_c, bias_c, slot)


def crop_resize_into(
    src: np.ndarray,
    box: tuple[float, float, float, float],
    out: np.ndarray,
    *,
    flip: bool,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    max_pixels: int = decode.MAX_PIXELS,
) -> None:
    """Resample `box` (x0, y0, x1, y1) of RGB uint8 `src` into `out`.

    `out` is either uint8 (H, W, 3) or float32 (3, H, W); for float32 each
    channel c becomes value * scale[c] + bias[c]. `out` must be C-contiguous
    (a slot of a preallocated batch). A resize that would read more filter
    taps than max_pixels allows is a DecodeError (resample_bound).
    """
    if src.dtype != np.uint8 or src.ndim != 3 or src.shape[2] != 3:
        raise ValueError(f"src must be uint8 (H, W, 3), got {src.dtype} {src.shape}")
    if not src.flags.c_contiguous:
        src = np.ascontiguousarray(src)
    out_h, out_w, fmt = _out_format(out, scale, bias)
    _check_box(box, src.shape[0], src.shape[1])
    ffi, lib, _ = _load()
    if lib is None:
        _warn_fallback()
        _crop_resize_python(src, box, out, flip=flip, scale=scale, bias=bias)
        return
    rc = lib.raydl_crop_resize(
        ffi.from_buffer("uint8_t[]", src),
        src.shape[0],
        src.shape[1],
        src.strides[0],
        *_slot_args(ffi, box, out, out_h, out_w, fmt, flip, scale, bias),
        int(max_pixels),
    )
    if rc == _EWORK:
        raise _over_bound(box, out_h, out_w, max_pixels)
    if rc == _ENOMEM:
        raise DecodeError(f"out of memory resizing a {src.shape[1]}x{src.shape[0]} image (box {box})")
    if rc != _OK:
        raise NativeKernelError(
            f"raydl_crop_resize failed with code {rc} (src {src.shape}, box {box}, out {out.shape})"
        )


def crop_resize_nearest_into(
    src: np.ndarray, box: tuple[float, float, float, float], out: np.ndarray, *, flip: bool
) -> None:
    """Resample `box` (x0, y0, x1, y1) of a uint8 (H, W) label map into uint8 (h, w) `out`, nearest-neighbour.

    Each output pixel takes the source pixel whose centre is nearest its own
    centre: column floor((j + 0.5) * box_w / w + x0), clamped to the image
    (rows the same), so labels are never blended. flip mirrors the output
    left-right, as crop_resize_into does. The box is checked as crop_resize_into
    checks it.
    """
    if src.dtype != np.uint8 or src.ndim != 2:
        raise ValueError(f"src must be uint8 (H, W), got {src.dtype} {src.shape}")
    if out.dtype != np.uint8 or out.ndim != 2 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 (H, W) slot, got {out.dtype} {out.shape}")
    _check_box(box, src.shape[0], src.shape[1])
    x0, y0, x1, y1 = (float(v) for v in box)
    rows = _nearest(y0, y1, out.shape[0], src.shape[0])
    cols = _nearest(x0, x1, out.shape[1], src.shape[1])
    if flip:
        cols = cols[::-1]
    # two gathers (clip: the indices are clamped already), 3x faster than out[...] = src[rows[:, None], cols]
    np.take(src.take(rows, axis=0, mode="clip"), cols, axis=1, out=out, mode="clip")


def _nearest(lo: float, hi: float, n: int, size: int) -> np.ndarray:
    """The source index nearest each of n output pixel centres over [lo, hi), clamped to [0, size)."""
    idx = np.floor((np.arange(n) + 0.5) * (hi - lo) / n + lo).astype(np.intp)
    return np.clip(idx, 0, size - 1, out=idx)


def jpeg_crop_resize_into(
    data: bytes,
    box: tuple[float, float, float, float],
    out: np.ndarray,
    *,
    flip: bool,
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    scale_denom: int = 1,
    fast: bool = False,
    max_pixels: int = decode.MAX_PIXELS,
) -> bool:
    """As crop_resize_into, decoding from JPEG bytes only the region the box needs.

    scale_denom (1, 2, 4 or 8) downscales in the DCT domain (see
    raydl.native.decode.dct_factor); fast=True uses libjpeg's IFAST IDCT without fancy
    upsampling, which is faster and changes pixels.

    Returns False when this path cannot take the image (module not built, CMYK
    JPEG): decode it another way then. Raises DecodeError (a ValueError) for
    corrupt or truncated data, a frame header over max_pixels (refused before
    anything is allocated) and a resize over what max_pixels allows.
    """
    ffi, lib, _ = _load_jpeg()
    if lib is None:
        return False
    out_h, out_w, fmt = _out_format(out, scale, bias)
    err = ffi.new("char[]", _ERR_LEN)
    rc = lib.raydl_jpeg_crop_resize(
        ffi.from_buffer("uint8_t[]", data),
        len(data),
        *_slot_args(ffi, box, out, out_h, out_w, fmt, flip, scale, bias),
        int(scale_denom),
        int(bool(fast)),
        int(max_pixels),
        err,
        _ERR_LEN,
    )
    status = _jpeg_status(rc, ffi.string(err), data, box, out, max_pixels)
    if isinstance(status, Exception):
        raise status
    return status


def jpeg_crop_resize_many(
    data: Sequence[bytes],
    boxes: Sequence[tuple[float, float, float, float]],
    outs: Sequence[np.ndarray],
    *,
    flips: Sequence[bool],
    scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    scale_denoms: Sequence[int],
    fast: bool = False,
    max_pixels: int = decode.MAX_PIXELS,
) -> list[bool | Exception] | None:
    """jpeg_crop_resize_into for many samples in one native call (the GIL released once).

    Every `outs[i]` has the same shape and dtype (slots of one batch). Returns,
    per sample, what jpeg_crop_resize_into would have: True (done), False (this
    path cannot take it: decode it another way), or the exception it would have
    raised (DecodeError for corrupt data or past max_pixels, NativeKernelError
    otherwise); one sample's failure does not stop the others. None when the
    module is not built.
    """
    ffi, lib, _ = _load_jpeg()
    if lib is None:
        return None
    if not hasattr(lib, "raydl_jpeg_crop_resize_many"):  # a module built before it existed: one call each
        return [
            _try_one(d, b, o, flip=f, scale=scale, bias=bias, scale_denom=s, fast=fast, max_pixels=max_pixels)
            for d, b, o, f, s in zip(data, boxes, outs, flips, scale_denoms, strict=True)
        ]
    n = len(data)
    if not (len(boxes) == len(outs) == len(flips) == len(scale_denoms) == n):
        raise ValueError("data, boxes, outs, flips and scale_denoms must have one entry per sample")
    if n == 0:
        return []
    out_h, out_w, fmt = _out_format(outs[0], scale, bias)
    for out in outs:
        if out.shape != outs[0].shape or out.dtype != outs[0].dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"outs must be C-contiguous slots of one shape and dtype, got {out.dtype} {out.shape}"
            )
    scale_c, bias_c = _affine(ffi, fmt, scale, bias)
    keep = [ffi.from_buffer("uint8_t[]", d) for d in data]
    dsts = [ffi.from_buffer(out, require_writable=True) for out in outs]
    box_arr = np.ascontiguousarray(boxes, dtype=np.float64).reshape(n, 4)
    ints = np.empty((3, n), np.int32)  # flip, scale_denom, rc
    ints[0], ints[1] = [bool(f) for f in flips], scale_denoms
    err = ffi.new("char[]", _ERR_LEN * n)
    lib.raydl_jpeg_crop_resize_many(
        n,
        ffi.new("uint8_t *[]", keep),
        ffi.new("size_t[]", [len(d) for d in data]),
        ffi.from_buffer("double[]", box_arr),
        ffi.from_buffer("int[]", ints[0]),
        ffi.from_buffer("int[]", ints[1]),
        out_h,
        out_w,
        fmt,
        scale_c,
        bias_c,
        ffi.new("void *[]", dsts),
        int(bool(fast)),
        int(max_pixels),
        ffi.from_buffer("int[]", ints[2], require_writable=True),
        err,
        _ERR_LEN,
    )
    return [
        _jpeg_status(
            int(rc),
            ffi.string(err + i * _ERR_LEN) if rc != _OK else b"",
            data[i],
            boxes[i],
            outs[i],
            max_pixels,
        )
        for i, rc in enumerate(ints[2].tolist())
    ]


def _try_one(data: bytes, box, out: np.ndarray, **kwargs) -> bool | Exception:
    try:
        return jpeg_crop_resize_into(data, box, out, **kwargs)
    except (DecodeError, NativeKernelError) as exc:
        return exc


def _jpeg_status(rc: int, msg: bytes, data: bytes, box, out: np.ndarray, max_pixels: int) -> bool | Exception:
    """What raydl_jpeg_crop_resize's code means: True (done), False (not this path's), or the error."""
    shape = out.shape
    if rc == _OK:
        return True
    if rc == _EUNSUPPORTED:
        return False
    if rc == _EJPEG:
        return DecodeError(f"corrupt JPEG: {msg.decode(errors='replace')}")
    if rc == _ETOOBIG:
        try:  # the frame header over the limit: the same message as every other decode path
            decode.image_size(data, max_pixels=max_pixels)
        except DecodeError as exc:
            return exc
        return DecodeError(
            f"JPEG needs more memory than max_pixels={max_pixels} allows its decoder "
            f"({(8 * max_pixels + (64 << 20)) >> 20} MiB): {msg.decode(errors='replace')}"
        )
    if rc == _EWORK:
        out_h, out_w = (shape[1], shape[2]) if out.dtype == np.float32 else (shape[0], shape[1])
        return _over_bound(box, out_h, out_w, max_pixels)
    if rc == _ENOMEM:
        return DecodeError(f"out of memory decoding a JPEG region (box {box}, out {shape})")
    return NativeKernelError(f"raydl_jpeg_crop_resize failed with code {rc} (box {box}, out {shape})")


def _out_format(out: np.ndarray, scale, bias) -> tuple[int, int, int]:
    """(out_h, out_w, format code) of a batch slot, checking its layout."""
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3:
        return out.shape[0], out.shape[1], 0
    if out.dtype == np.float32 and out.ndim == 3 and out.shape[0] == 3:
        for name, v in (("scale", scale), ("bias", bias)):
            a = None if v is None else np.asarray(v, dtype=np.float32)
            if a is None or a.shape != (3,) or not np.isfinite(a).all():
                raise ValueError(
                    f"float32 output needs {name} of 3 finite values (one per channel), got {v!r}"
                )
        return out.shape[1], out.shape[2], 1
    raise ValueError(f"out must be uint8 (H, W, 3) or float32 (3, H, W), got {out.dtype} {out.shape}")


def _check_box(box, h: int, w: int) -> None:
    """The same rule the C kernel applies, so both paths refuse the same boxes (NaN included)."""
    x0, y0, x1, y1 = (float(v) for v in box)
    if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
        raise NativeKernelError(f"box {box} is empty or outside the {w}x{h} image")


def _affine(ffi, fmt: int, scale, bias):
    """C pointers to the per-channel scale and bias (checked by _out_format; NULL for uint8 output)."""
    if fmt == 0:
        return ffi.NULL, ffi.NULL
    return (
        ffi.from_buffer("float[]", np.ascontiguousarray(scale, dtype=np.float32)),
        ffi.from_buffer("float[]", np.ascontiguousarray(bias, dtype=np.float32)),
    )


def _crop_resize_python(src, box, out, *, flip, scale, bias) -> None:
    """Pillow-based fallback with the same geometry as the C kernel."""
    from PIL import Image

    if out.dtype == np.uint8:
        out_h, out_w = out.shape[0], out.shape[1]
    else:
        out_h, out_w = out.shape[1], out.shape[2]
    img = Image.fromarray(src, "RGB").resize((out_w, out_h), Image.Resampling.BILINEAR, box=box)
    arr = np.asarray(img)
    if flip:
        arr = arr[:, ::-1]
    if out.dtype == np.uint8:
        out[...] = arr
    else:
        out[...] = (
            arr.transpose(2, 0, 1) * np.asarray(scale, np.float32)[:, None, None]
            + np.asarray(bias, np.float32)[:, None, None]
        )


_TOKEN_TYPES = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64)  # RAYDL_TOK_* order
_TOKEN_IN = {np.dtype(t): k for k, t in enumerate(_TOKEN_TYPES)}
_TOKEN_OUT = {np.dtype(np.int32): 4, np.dtype(np.int64): 6}


def token_windows_into(
    values: np.ndarray,
    starts: np.ndarray,
    offsets: np.ndarray,
    rows: np.ndarray,
    inputs: np.ndarray,
    labels: np.ndarray,
    positions: np.ndarray,
) -> bool:
    """Windows of seq + 1 tokens of `values`, window i starting at offsets[i], into row rows[i] of the
    (n, seq) outputs: its first seq tokens into `inputs`, its last seq into `labels`, and each of its
    first seq tokens' offset from the latest of the document `starts` (ascending, from 0) at or before
    it into `positions`. Values are cast as numpy's unsafe cast does. One C pass with the GIL released;
    False, with nothing written, where the kernels are not built or a type is not one it takes (the
    caller then copies in numpy). A window or row out of bounds is a ValueError."""
    ffi, lib, _ = _load()
    kind = _TOKEN_IN.get(values.dtype)
    out = _TOKEN_OUT.get(inputs.dtype)
    if lib is None or kind is None or out is None or values.ndim != 1 or not values.flags.c_contiguous:
        return False
    if inputs.ndim != 2:
        return False
    seq = inputs.shape[1]
    for a in (labels, positions):
        if a.dtype != inputs.dtype or a.shape != inputs.shape or not a.flags.c_contiguous:
            return False
    if not inputs.flags.c_contiguous:
        return False
    starts = np.ascontiguousarray(starts, np.int64)
    offsets = np.ascontiguousarray(offsets, np.int64)
    rows = np.ascontiguousarray(rows, np.int64)
    if len(offsets) != len(rows):
        raise ValueError(f"{len(offsets)} window offsets for {len(rows)} rows")
    if not len(rows):
        return True
    ll = "long long *"
    rc = lib.raydl_token_windows(
        ffi.cast("void *", values.ctypes.data),
        kind,
        len(values),
        ffi.cast(ll, starts.ctypes.data),
        len(starts),
        ffi.cast(ll, offsets.ctypes.data),
        ffi.cast(ll, rows.ctypes.data),
        len(rows),
        inputs.shape[0],
        seq,
        out,
        ffi.from_buffer(inputs, require_writable=True),
        ffi.from_buffer(labels, require_writable=True),
        ffi.from_buffer(positions, require_writable=True),
    )
    if rc != _OK:
        raise ValueError(
            f"token windows out of bounds: {len(values)} values, {len(starts)} document starts, offsets in "
            f"[{offsets.min(initial=0)}, {offsets.max(initial=0)}] of windows of {seq + 1}, rows of "
            f"{inputs.shape[0]}"
        )
    return True
