"""Region-only JPEG decoding gives the pixels a full decode would."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from raydl import native
from raydl.describe.transforms import Decode, Normalize, RandomHFlip, RandomResizedCrop, compile_stages
from raydl.errors import NativeKernelError
from raydl.native import decode

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not native.jpeg_available(), reason="raydl.native._jpeg not built (no jpeglib.h)"),
]


def _jpeg(h: int, w: int, seed: int, *, subsampling: int = 2, mode: str = "RGB", progressive=False) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([(xx * (c + 1) + yy * (3 - c)) % 256 for c in range(3)], -1).astype(np.float64)
    img += rng.normal(0, 20, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).convert(mode).save(
        buf, "JPEG", quality=90, subsampling=subsampling, progressive=progressive
    )
    return buf.getvalue()


def _program():
    return compile_stages((Decode(), RandomResizedCrop(64), RandomHFlip(), Normalize.make("imagenet", None)))


@pytest.mark.parametrize("subsampling,mode,progressive", [(2, "RGB", False), (0, "RGB", False),
                                                         (1, "RGB", True), (2, "L", False)])
def test_region_decode_matches_full_decode(subsampling, mode, progressive):
    """For many random crops, decoding only the region then resampling equals full decode then resampling."""
    prog = _program()
    scale, bias = prog._affine
    out = np.empty((3, 64, 64), np.float32)
    ref = np.empty_like(out)
    for seed in range(40):
        data = _jpeg(97 + 13 * seed, 131 + 7 * seed, seed, subsampling=subsampling, mode=mode,
                     progressive=progressive)
        h, w = decode.image_size(data)
        box, flip = prog.geometry(h, w, seed)
        assert native.jpeg_crop_resize_into(data, box, out, flip=flip, scale=scale, bias=bias)
        native.crop_resize_into(decode.decode_rgb(data), box, ref, flip=flip, scale=scale, bias=bias)
        np.testing.assert_allclose(out, ref, atol=1e-4)


def test_dct_scaled_region_is_close_to_full_decode():
    """With DCT scaling (1/2, 1/4) on a large image the result stays close to the full-resolution path."""
    prog = _program()
    scale, bias = prog._affine
    data = _jpeg(1200, 1600, 0)
    out = np.empty((3, 64, 64), np.float32)
    ref = np.empty_like(out)
    box = (100.0, 50.0, 1500.0, 1150.0)
    native.crop_resize_into(decode.decode_rgb(data), box, ref, flip=False, scale=scale, bias=bias)
    for denom in (2, 4):
        assert native.jpeg_crop_resize_into(data, box, out, flip=False, scale=scale, bias=bias, scale_denom=denom)
        diff = np.abs(out - ref)
        # Measured (normalized units; a grey level is about 0.017): mean 0.0031 at 1/2, 0.0039 at 1/4; the
        # worst row's or column's mean 0.0054; the largest difference 0.028. A zeroed edge row alone
        # makes the mean 0.016 and that row's mean 0.8.
        assert diff.mean() < 0.008, (denom, diff.mean())  # about half a grey level
        assert diff.mean(axis=(0, 2)).max() < 0.012 and diff.mean(axis=(0, 1)).max() < 0.012, denom
        assert diff.max() < 0.06, (denom, diff.max())


def test_bad_scale_denom_is_refused():
    """Only 1, 2, 4 and 8 are DCT scales this path takes."""
    data = _jpeg(64, 64, 3)
    out = np.empty((8, 8, 3), np.uint8)
    with pytest.raises(NativeKernelError):
        native.jpeg_crop_resize_into(data, (0, 0, 64, 64), out, flip=False, scale_denom=3)


def test_corrupt_and_cmyk_jpegs():
    """Truncated data raises ValueError; CMYK is declined (False) so the caller uses Pillow."""
    data = _jpeg(200, 300, 1)
    out = np.empty((64, 64, 3), np.uint8)
    with pytest.raises(ValueError, match="corrupt JPEG"):
        native.jpeg_crop_resize_into(data[: len(data) // 2], (0, 0, 300, 200), out, flip=False)
    with pytest.raises(ValueError, match="corrupt JPEG"):
        native.jpeg_crop_resize_into(b"\xff\xd8\xff\xe0garbage" * 3, (0, 0, 1, 1), out, flip=False)
    buf = io.BytesIO()
    Image.new("CMYK", (80, 60), (10, 20, 30, 40)).save(buf, "JPEG")
    assert native.jpeg_crop_resize_into(buf.getvalue(), (0, 0, 80, 60), out, flip=False) is False


def test_box_outside_the_image_is_refused():
    """A box beyond the image is an error, not an out-of-bounds read."""
    data = _jpeg(100, 100, 2)
    out = np.empty((64, 64, 3), np.uint8)
    with pytest.raises(NativeKernelError, match="failed"):
        native.jpeg_crop_resize_into(data, (0, 0, 101, 100), out, flip=False)


def _cmyk_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("CMYK", (80, 60), (10, 20, 30, 40)).save(buf, "JPEG")
    return buf.getvalue()


def test_many_decodes_each_slot_as_one_call_would_and_fails_per_slot():
    """jpeg_crop_resize_many: good slots get the single call's floats; a corrupt, CMYK or bad-box slot fails alone."""
    prog = _program()
    scale, bias = prog._affine
    good = [_jpeg(90 + 11 * s, 120 + 5 * s, s) for s in range(4)]
    data = [good[0], good[1][: len(good[1]) // 2], good[2], _cmyk_jpeg(), good[3], good[0]]
    boxes = [(0.0, 0.0, 120.0, 90.0), (0.0, 0.0, 125.0, 101.0), (3.5, 2.0, 100.0, 80.0), (0.0, 0.0, 80.0, 60.0),
             (10.0, 10.0, 135.0, 123.0), (0.0, 0.0, 121.0, 90.0)]  # the last is one column too wide
    flips = [False, True, True, False, True, False]
    outs = np.full((6, 3, 64, 64), -7.0, np.float32)
    got = native.jpeg_crop_resize_many(data, boxes, list(outs), flips=flips, scale=scale, bias=bias,
                                       scale_denoms=[1, 1, 2, 1, 1, 1])
    assert got[0] is True and got[2] is True and got[4] is True and got[3] is False
    assert isinstance(got[1], ValueError) and "corrupt JPEG" in str(got[1])
    assert isinstance(got[5], NativeKernelError)
    for k, denom in ((0, 1), (2, 2), (4, 1)):
        one = np.empty((3, 64, 64), np.float32)
        assert native.jpeg_crop_resize_into(data[k], boxes[k], one, flip=flips[k], scale=scale, bias=bias,
                                            scale_denom=denom)
        np.testing.assert_array_equal(outs[k], one)
    assert (outs[3] == -7.0).all()  # a declined slot is left as it was


@pytest.mark.parametrize("fast", [False, True], ids=["default", "fast"])
def test_run_many_gives_the_pixels_and_errors_of_run(fast):
    """SampleProgram.run_many: per sample the floats run writes, or the exception run raises (JPEG, PNG, CMYK, junk)."""
    prog = compile_stages((Decode(fast=fast), RandomResizedCrop(64), RandomHFlip(), Normalize.make("imagenet", None)))
    png = io.BytesIO()
    Image.fromarray(np.full((70, 90, 3), 100, np.uint8)).save(png, "PNG")
    jpg = _jpeg(120, 160, 9)
    items = [jpg, png.getvalue(), jpg[: len(jpg) // 2], _cmyk_jpeg(), b"junk" * 10, _jpeg(200, 150, 4)]
    want = np.zeros((len(items), 3, 64, 64), np.float32)
    errors = []
    for k, data in enumerate(items):
        try:
            prog.run(data, 1000 + k, want[k])
            errors.append(None)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    got = np.zeros_like(want)
    results = prog.run_many([(data, 1000 + k, got[k]) for k, data in enumerate(items)])
    assert [type(r) for r in results] == [type(e) for e in errors]
    assert [str(r) for r in results] == [str(e) for e in errors]
    assert errors[0] is None and errors[1] is None and errors[3] is None and errors[5] is None
    assert errors[2] is not None and errors[4] is not None
    np.testing.assert_array_equal(got, want)


def _real_jpeg() -> bytes:
    """A real photograph from ../shared/data when present, else a generated 640x480 one."""
    from pathlib import Path

    photo = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "photos" / "dog.jpg"
    return photo.read_bytes() if photo.exists() else _jpeg(480, 640, 9)


@pytest.mark.parametrize("cut", ["half", "no-eoi"])
def test_a_truncated_jpeg_is_corrupt_whatever_the_crop(cut):
    """A JPEG truncated at 50% (or missing only its end-of-image marker) fails for each of 40 crop seeds, one at a
    time and batched, as Pillow refuses it: truncation is decided from the bytes, never from the rows a crop reads
    (a crop that missed the damage used to decode "ok")."""
    whole = _real_jpeg()
    data = whole[: len(whole) // 2] if cut == "half" else whole[:-2]
    with pytest.raises(OSError, match="truncated"):
        Image.open(io.BytesIO(data)).load()
    prog = compile_stages((Decode(), RandomResizedCrop(64), RandomHFlip(), Normalize.make("imagenet", None)))
    outs = np.empty((40, *prog.slot_shape()), prog.dtype)
    for seed in range(40):
        with pytest.raises(ValueError, match="corrupt JPEG: truncated"):
            prog.run(data, seed, outs[seed])
    errors = prog.run_many([(data, seed, outs[seed]) for seed in range(40)])
    assert all(isinstance(e, ValueError) and "truncated" in str(e) for e in errors)


def test_bytes_after_the_end_of_image_are_not_truncation():
    """Padding or other data after EOI (cameras append some) decodes as the file without it; so does a
    progressive file."""
    prog = _program()
    for data in (_real_jpeg(), _jpeg(120, 160, 4, progressive=True)):
        want = np.empty(prog.slot_shape(), prog.dtype)
        got = np.empty_like(want)
        prog.run(data, 3, want)
        prog.run(data + bytes(300) + b"trailing \xff\xd8 bytes", 3, got)
        np.testing.assert_array_equal(got, want)


def test_a_truncated_progressive_jpeg_fails_before_any_row_is_decoded():
    """A progressive file's scans are all read at the start: its warnings fail it there, whatever the crop."""
    data = _jpeg(300, 400, 5, progressive=True)
    out = np.empty((16, 16, 3), np.uint8)
    for cut in (len(data) // 2, len(data) - 2):
        for box in ((0.0, 0.0, 20.0, 20.0), (0.0, 0.0, 400.0, 300.0)):
            with pytest.raises(ValueError, match="corrupt JPEG"):
                native.jpeg_crop_resize_into(data[:cut], box, out, flip=False)
