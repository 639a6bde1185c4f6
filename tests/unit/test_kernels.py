"""raydl.native.crop_resize_into against Pillow's BILINEAR resize with a box.

Pillow resamples in fixed point and rounds to uint8 between its horizontal and
vertical passes; the C kernel runs the vertical pass first and keeps 6 more
bits between the passes, so the two agree to within one grey level, not bit
for bit. Its AVX-512, AVX2 and portable C paths agree bit for bit.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter

from raydl import native
from raydl.errors import NativeKernelError

pytestmark = pytest.mark.timeout(60)

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
PHOTOS = SHARED_DATA / "photos"
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)

needs_native = pytest.mark.skipif(
    not native.native_available(), reason=f"C kernel not loaded: {native.kernel_status()}"
)


def pillow_ref(src: np.ndarray, box, oh: int, ow: int) -> np.ndarray:
    return np.asarray(Image.fromarray(src).resize((ow, oh), Image.Resampling.BILINEAR, box=box))


def normalized(hwc_u8: np.ndarray) -> np.ndarray:
    """The reference normalization: (x/255 - mean)/std, as float32 CHW."""
    x = hwc_u8.astype(np.float32).transpose(2, 0, 1) / 255
    return (x - MEAN[:, None, None]) / STD[:, None, None]


def kernel_u8(src: np.ndarray, box, oh: int, ow: int, *, flip: bool = False) -> np.ndarray:
    out = np.empty((oh, ow, 3), np.uint8)
    native.crop_resize_into(src, box, out, flip=flip)
    return out


def kernel_f32(src: np.ndarray, box, oh: int, ow: int, *, flip: bool = False) -> np.ndarray:
    out = np.empty((3, oh, ow), np.float32)
    native.crop_resize_into(src, box, out, flip=flip, scale=1.0 / (255.0 * STD), bias=-MEAN / STD)
    return out


def assert_within_grey_levels(got: np.ndarray, expected: np.ndarray, levels: float) -> None:
    """float32 CHW normalized images agree within `levels` grey levels, i.e. levels/255/std per channel."""
    err = np.abs(got - expected) * STD[:, None, None] * 255  # back in grey levels
    assert err.max() <= levels, f"max difference {err.max():.4f} grey levels > {levels}"


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max())


def synthetic(h: int, w: int, seed: int, *, smooth: bool) -> np.ndarray:
    """Random RGB noise, or noise blurred into something photo-like."""
    img = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    if smooth:
        img = np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(2)))
    return np.ascontiguousarray(img)


def random_box(rng: np.random.Generator, h: int, w: int, *, integer: bool):
    """A box (x0, y0, x1, y1) inside an (h, w) image, with positive width and height."""
    if integer:
        x0 = int(rng.integers(0, w))
        y0 = int(rng.integers(0, h))
        return x0, y0, int(rng.integers(x0 + 1, w + 1)), int(rng.integers(y0 + 1, h + 1))
    x0 = float(rng.uniform(0, w - 0.01))
    y0 = float(rng.uniform(0, h - 0.01))
    return x0, y0, float(rng.uniform(x0 + 0.01, w)), float(rng.uniform(y0 + 0.01, h))


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    if not PHOTOS.is_dir():
        pytest.skip(f"real photos not found at {PHOTOS} (the shared/ folder beside the checkout)")
    paths = sorted(PHOTOS.glob("*.jpg"))[:3]
    if not paths:
        pytest.skip(f"no .jpg files in {PHOTOS}")
    return [np.asarray(Image.open(p).convert("RGB")) for p in paths]


@pytest.fixture
def fallback(monkeypatch):
    """Force the numpy/Pillow fallback for one test and restore the kernel afterwards."""
    monkeypatch.setenv("RAYDL_DISABLE_NATIVE", "1")
    native._load.cache_clear()
    native._warn_fallback.cache_clear()
    yield
    monkeypatch.undo()
    native._load.cache_clear()
    native._warn_fallback.cache_clear()


# ------------------------------------------------------- against Pillow ----


@pytest.fixture
def portable():
    """Force the portable C resampler for one test and restore the AVX2 path afterwards."""
    before = native.simd()
    native.simd(False)
    yield
    native.simd(before)


@needs_native
def test_avx2_and_portable_paths_give_the_same_bytes():
    """The AVX2 resampler and the portable C one agree exactly (u8 and float, flips, odd widths, up/downscales)."""
    if not native.simd():
        pytest.skip(f"this CPU runs the portable path only ({native.kernel_status()})")
    rng = np.random.default_rng(7)
    cases = []
    for i in range(40):
        h, w = (int(v) for v in rng.integers(1, 400, 2))
        src = synthetic(h, w, i, smooth=bool(i % 2))
        cases.append((src, random_box(rng, h, w, integer=bool(i % 3 == 0)),
                      *(int(v) for v in rng.integers(1, 260, 2)), bool(i % 2)))
    results = []
    for force_portable in (False, True):
        assert native.simd(not force_portable) is (not force_portable)
        try:
            results.append([(kernel_u8(s, b, oh, ow, flip=f), kernel_f32(s, b, oh, ow, flip=f))
                            for s, b, oh, ow, f in cases])
        finally:
            native.simd(True)
    for (u8_a, f32_a), (u8_b, f32_b) in zip(*results, strict=True):
        np.testing.assert_array_equal(u8_a, u8_b)
        np.testing.assert_array_equal(f32_a, f32_b)


@needs_native
def test_every_simd_level_gives_the_same_bytes():
    """The AVX-512 vertical pass (64 bytes a step, masked tails), the AVX2 one and the portable C one agree
    exactly, on row lengths around every multiple of 64 and on the JPEG region decoder's path."""
    before = native.simd_level()
    if native.simd_level(native.SIMD_AVX512) < native.SIMD_AVX512:
        native.simd_level(before)
        pytest.skip(f"this CPU has no AVX-512 BW + VNNI path ({native.kernel_status()})")
    rng = np.random.default_rng(11)
    cases = []
    for i, w in enumerate((1, 2, 21, 22, 42, 43, 63, 64, 65, 85, 128, 130, 171, 300, 677)):
        h = int(rng.integers(1, 120))
        src = synthetic(h, w, i, smooth=bool(i % 2))
        cases.append((src, random_box(rng, h, w, integer=bool(i % 3 == 0)),
                      *(int(v) for v in rng.integers(1, 90, 2)), bool(i % 2)))
    photo = sorted(PHOTOS.glob("*.jp*g"))[:2] if PHOTOS.is_dir() else []
    jpegs = [p.read_bytes() for p in photo]
    results = []
    try:
        for level in (native.SIMD_AVX512, native.SIMD_AVX2, native.SIMD_PORTABLE):
            assert native.simd_level(level) == level
            got = [(kernel_u8(s, b, oh, ow, flip=f), kernel_f32(s, b, oh, ow, flip=f)) for s, b, oh, ow, f in cases]
            for data in jpegs:
                out = np.empty((97, 131, 3), np.uint8)
                h, w = native.decode.image_size(data)
                assert native.jpeg_crop_resize_into(data, (w * 0.1, h * 0.2, w * 0.9, h), out, flip=True)
                got.append((out, out))
            results.append(got)
    finally:
        native.simd_level(before)
    for other in results[1:]:
        for (u8_a, f32_a), (u8_b, f32_b) in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(u8_a, u8_b)
            np.testing.assert_array_equal(f32_a, f32_b)


@needs_native
def test_avx2_float_writer_agrees_with_portable_at_every_width():
    """float32 CHW rows (8 pixels per AVX2 step, then a tail) equal the portable path's, flipped or not."""
    if not native.simd():
        pytest.skip(f"this CPU runs the portable path only ({native.kernel_status()})")
    src = synthetic(120, 160, 3, smooth=False)
    for ow in (1, 7, 8, 9, 15, 16, 17, 224):
        for flip in (False, True):
            box = (3.5, 2.25, 150.0, 110.0)
            native.simd(False)
            try:
                want = kernel_f32(src, box, 11, ow, flip=flip)
            finally:
                native.simd(True)
            np.testing.assert_array_equal(kernel_f32(src, box, 11, ow, flip=flip), want, err_msg=f"{ow} {flip}")


@needs_native
def test_portable_path_matches_pillow(portable):
    """The portable C resampler (no AVX2) is within one grey level of Pillow too."""
    assert native.simd() is False
    rng = np.random.default_rng(8)
    for i in range(10):
        h, w = (int(v) for v in rng.integers(2, 300, 2))
        src = synthetic(h, w, i, smooth=True)
        box = random_box(rng, h, w, integer=False)
        oh, ow = (int(v) for v in rng.integers(1, 200, 2))
        assert max_diff(kernel_u8(src, box, oh, ow), pillow_ref(src, box, oh, ow)) <= 1, (h, w, box, oh, ow)


@needs_native
@pytest.mark.parametrize("integer", [True, False], ids=["int-box", "float-box"])
@pytest.mark.parametrize("smooth", [True, False], ids=["smooth", "noise"])
def test_matches_pillow_on_random_boxes(integer, smooth):
    """Random boxes, output sizes from 1 to 300 (down- and up-scaling, non-square): within 1 grey level of Pillow."""
    rng = np.random.default_rng(1000 + 2 * integer + smooth)
    for trial in range(60):
        h, w = (int(v) for v in rng.integers(1, 200, 2))
        src = synthetic(h, w, trial, smooth=smooth)
        box = random_box(rng, h, w, integer=integer)
        oh, ow = (int(v) for v in rng.integers(1, 300, 2))
        assert max_diff(kernel_u8(src, box, oh, ow), pillow_ref(src, box, oh, ow)) <= 1, (h, w, box, oh, ow)


@needs_native
@pytest.mark.parametrize(
    "shape,box,out",
    [
        ((40, 60), (0, 0, 60, 40), (40, 60)),  # the full image at its own size: a copy
        ((40, 60), (0, 0, 60, 40), (224, 224)),  # full image, upscaled, aspect changed
        ((40, 60), (0, 0, 60, 40), (3, 2)),  # full image, heavy downscale
        ((40, 60), (17, 0, 18, 40), (40, 9)),  # 1-pixel-wide box, stretched
        ((40, 60), (0, 21, 60, 22), (5, 60)),  # 1-pixel-high box
        ((40, 60), (30, 20, 31, 21), (7, 7)),  # a single pixel
        ((40, 60), (10.25, 3.5, 10.75, 4.0), (4, 4)),  # sub-pixel float box
        ((1, 1), (0, 0, 1, 1), (50, 30)),  # 1x1 source
        ((1, 200), (0, 0, 200, 1), (16, 16)),  # 1-row source
        ((300, 2), (0, 0, 2, 300), (10, 10)),  # 2-column source
    ],
)
def test_matches_pillow_on_edge_boxes(shape, box, out):
    """Full-image, 1-pixel-wide/high, single-pixel, sub-pixel and degenerate-source boxes agree with Pillow within 1."""
    src = synthetic(*shape, seed=7, smooth=False)
    assert max_diff(kernel_u8(src, box, *out), pillow_ref(src, box, *out)) <= 1


@needs_native
def test_full_image_at_same_size_is_exact():
    """The whole image resampled to its own size is returned unchanged."""
    src = synthetic(33, 47, seed=3, smooth=False)
    np.testing.assert_array_equal(kernel_u8(src, (0, 0, 47, 33), 33, 47), src)


@pytest.mark.shared_data
@needs_native
def test_matches_pillow_on_real_photos(photos):
    """Real photographs: random crops to 224x224 (mostly downscales) and whole-image resizes agree within 1."""
    rng = np.random.default_rng(5)
    for src in photos:
        h, w = src.shape[:2]
        for _ in range(6):
            box = random_box(rng, h, w, integer=False)
            assert max_diff(kernel_u8(src, box, 224, 224), pillow_ref(src, box, 224, 224)) <= 1, box
        assert max_diff(kernel_u8(src, (0, 0, w, h), 256, 341), pillow_ref(src, (0, 0, w, h), 256, 341)) <= 1


@needs_native
def test_accepts_a_non_contiguous_source():
    """A strided view as source gives the same result as its contiguous copy."""
    big = synthetic(80, 120, seed=4, smooth=True)
    view = big[::2, ::2]
    box = (3.5, 2.0, 50.0, 37.25)
    np.testing.assert_array_equal(kernel_u8(view, box, 20, 30), kernel_u8(np.ascontiguousarray(view), box, 20, 30))


# ------------------------------------------------------ flip, normalize ----


@needs_native
def test_flip_mirrors_the_output():
    """flip=True is the unflipped output mirrored left-right (exactly), and Pillow's ref[:, ::-1] within 1."""
    rng = np.random.default_rng(8)
    for trial in range(10):
        src = synthetic(64, 96, seed=trial, smooth=trial % 2 == 0)
        box = random_box(rng, 64, 96, integer=trial % 3 == 0)
        flipped = kernel_u8(src, box, 31, 45, flip=True)
        np.testing.assert_array_equal(flipped, kernel_u8(src, box, 31, 45)[:, ::-1])
        assert max_diff(flipped, pillow_ref(src, box, 31, 45)[:, ::-1]) <= 1


@needs_native
@pytest.mark.parametrize("flip", [False, True])
def test_float_output_is_normalized_chw(flip):
    """float32 CHW is (x/255 - mean)/std: within 0.5 grey level of the kernel's uint8 result, 1.5 of Pillow's."""
    rng = np.random.default_rng(9)
    for trial in range(12):
        h, w = (int(v) for v in rng.integers(2, 150, 2))
        src = synthetic(h, w, trial, smooth=trial % 2 == 0)
        box = random_box(rng, h, w, integer=False)
        oh, ow = (int(v) for v in rng.integers(1, 120, 2))
        out = kernel_f32(src, box, oh, ow, flip=flip)
        assert out.dtype == np.float32 and out.shape == (3, oh, ow)
        own = kernel_u8(src, box, oh, ow, flip=flip)
        assert_within_grey_levels(out, normalized(own), 0.5 + 1e-3)
        ref = pillow_ref(src, box, oh, ow)
        assert_within_grey_levels(out, normalized(ref[:, ::-1] if flip else ref), 1.5)


# ------------------------------------------------------ invalid input ----


@needs_native
@pytest.mark.parametrize(
    "box",
    [
        (-1, 0, 5, 5),  # left of the image
        (0, -0.5, 5, 5),  # above it
        (0, 0, 10.5, 5),  # past the right edge
        (0, 0, 5, 11),  # past the bottom
        (0, 0, 5, float("inf")),
        (5, 0, 5, 5),  # zero width
        (0, 5, 5, 5),  # zero height
        (6, 0, 5, 5),  # x1 < x0
        (0, 0, 0, 0),
    ],
)
def test_invalid_box_raises_native_kernel_error(box):
    """A box outside the image or empty is a NativeKernelError naming the box."""
    src = synthetic(10, 10, seed=0, smooth=False)
    with pytest.raises(NativeKernelError, match="box"):
        kernel_u8(src, box, 4, 4)


@needs_native
@pytest.mark.parametrize("box", [(0, float("nan"), 5, 5), (0, 0, 5, float("nan")), (float("nan"), 0, 5, 5)])
def test_nan_box_raises_native_kernel_error_as_invalid(box):
    """A NaN coordinate is an invalid box: NativeKernelError, never a black image or ENOMEM."""
    src = synthetic(10, 10, seed=0, smooth=False)
    with pytest.raises(NativeKernelError, match="box"):
        kernel_u8(src, box, 4, 4)


@pytest.mark.parametrize(
    "src,out",
    [
        (np.zeros((8, 8, 3), np.float32), np.empty((4, 4, 3), np.uint8)),  # float source
        (np.zeros((8, 8), np.uint8), np.empty((4, 4, 3), np.uint8)),  # grey source
        (np.zeros((8, 8, 4), np.uint8), np.empty((4, 4, 3), np.uint8)),  # RGBA source
        (np.zeros((8, 8, 3), np.uint8), np.empty((4, 4, 3), np.float32)),  # float HWC output
        (np.zeros((8, 8, 3), np.uint8), np.empty((3, 4, 4), np.uint8)),  # uint8 CHW output
        (np.zeros((8, 8, 3), np.uint8), np.empty((4, 4, 3), np.float64)),  # float64 output
        (np.zeros((8, 8, 3), np.uint8), np.empty((4, 8, 3), np.uint8)[:, ::2]),  # non-contiguous output
    ],
)
def test_wrong_dtype_or_shape_raises_value_error(src, out):
    """Source not uint8 (H, W, 3), output not uint8 HWC / float32 CHW, or not C-contiguous: ValueError."""
    with pytest.raises(ValueError):
        native.crop_resize_into(src, (0, 0, 8, 8), out, flip=False)


def test_float_output_needs_scale_and_bias():
    """float32 output without scale/bias is a ValueError."""
    src = np.zeros((8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match="needs (scale|bias)"):
        native.crop_resize_into(src, (0, 0, 8, 8), np.empty((3, 4, 4), np.float32), flip=False)


@needs_native
def test_scale_and_bias_must_hold_three_values():
    """scale or bias with other than 3 values is a ValueError, not an out-of-bounds read."""
    backing = np.array([1.0, 1000.0, 1000.0], np.float32)  # memory the kernel reads past scale[0]
    src = synthetic(8, 8, seed=0, smooth=False)
    out = np.zeros((3, 4, 4), np.float32)
    with pytest.raises(ValueError):
        native.crop_resize_into(src, (0, 0, 8, 8), out, flip=False, scale=backing[:1], bias=np.zeros(3, np.float32))


# ---------------------------------------------------------- fallback ----


def test_fallback_returns_pillow_resize_and_warns_once(fallback):
    """RAYDL_DISABLE_NATIVE=1: the fallback warns once (a RuntimeWarning saying why) and returns Pillow's resize."""
    rng = np.random.default_rng(12)
    cases = []
    for trial in range(8):
        h, w = (int(v) for v in rng.integers(2, 120, 2))
        cases.append((synthetic(h, w, trial, smooth=True), random_box(rng, h, w, integer=trial % 2 == 0),
                      *(int(v) for v in rng.integers(1, 100, 2)), trial % 3 == 0))
    assert not native.native_available()
    assert "RAYDL_DISABLE_NATIVE" in native.kernel_status()
    with pytest.warns(RuntimeWarning, match="RAYDL_DISABLE_NATIVE") as record:
        fb_u8 = [kernel_u8(src, box, oh, ow, flip=flip) for src, box, oh, ow, flip in cases]
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        fb_f32 = [kernel_f32(src, box, oh, ow, flip=flip) for src, box, oh, ow, flip in cases]
    for (src, box, oh, ow, flip), got_u8, got_f32 in zip(cases, fb_u8, fb_f32, strict=True):
        ref = pillow_ref(src, box, oh, ow)
        ref = ref[:, ::-1] if flip else ref
        np.testing.assert_array_equal(got_u8, ref)
        np.testing.assert_allclose(got_f32, normalized(ref), atol=1e-5)


@needs_native
def test_fallback_agrees_with_kernel(monkeypatch):
    """The fallback and the C kernel give the same uint8 (within 1) and float32 (within 1.5/255/std) outputs."""
    rng = np.random.default_rng(13)
    cases = []
    for trial in range(8):
        h, w = (int(v) for v in rng.integers(2, 120, 2))
        cases.append((synthetic(h, w, trial, smooth=trial % 2 == 0), random_box(rng, h, w, integer=False),
                      *(int(v) for v in rng.integers(1, 100, 2)), trial % 2 == 1))
    fast = [(kernel_u8(s, b, oh, ow, flip=f), kernel_f32(s, b, oh, ow, flip=f)) for s, b, oh, ow, f in cases]
    monkeypatch.setenv("RAYDL_DISABLE_NATIVE", "1")
    native._load.cache_clear()
    native._warn_fallback.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            slow = [(kernel_u8(s, b, oh, ow, flip=f), kernel_f32(s, b, oh, ow, flip=f)) for s, b, oh, ow, f in cases]
    finally:
        monkeypatch.undo()
        native._load.cache_clear()
        native._warn_fallback.cache_clear()
    assert native.native_available()
    for (fu8, ff32), (su8, sf32) in zip(fast, slow, strict=True):
        assert max_diff(fu8, su8) <= 1
        assert_within_grey_levels(ff32, sf32, 1.5)


@pytest.mark.parametrize("box", [(-1, 0, 5, 5), (0, 0, 11, 5), (5, 0, 5, 5), (0, 5, 5, 5), (0, 0, 0, 0)])
def test_fallback_rejects_invalid_boxes_like_the_kernel(fallback, box):
    """With the fallback, a box outside the image or empty is a NativeKernelError, as with the C kernel."""
    src = synthetic(10, 10, seed=0, smooth=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(NativeKernelError):
            kernel_u8(src, box, 4, 4)


@needs_native
def test_c_kernel_itself_refuses_nan_boxes():
    """The C entry point refuses NaN coordinates with RAYDL_EINVAL, whatever Python checked before it."""
    from raydl.native import _load

    ffi, lib, _ = _load()
    src = np.zeros((10, 10, 3), np.uint8)
    out = np.zeros((4, 4, 3), np.uint8)
    for box in [(0, float("nan"), 5, 5), (float("nan"), 0, 5, 5), (0, 0, float("nan"), 5)]:
        rc = lib.raydl_crop_resize(ffi.from_buffer("uint8_t[]", src), 10, 10, 30, *box, 4, 4, 0, 0,
                                   ffi.NULL, ffi.NULL, ffi.from_buffer(out, require_writable=True), 1 << 30)
        assert rc == -1


def test_raydl_simd_caps_the_path(monkeypatch):
    """RAYDL_SIMD names the most the resampler may use (for A/B benchmarks); anything else is refused by name."""
    from raydl import env

    monkeypatch.setenv("RAYDL_SIMD", "AVX2")
    assert env.simd_cap() == native.SIMD_AVX2
    monkeypatch.setenv("RAYDL_SIMD", "")
    assert env.simd_cap() is None
    monkeypatch.setenv("RAYDL_SIMD", "sse9")
    with pytest.raises(ValueError, match="RAYDL_SIMD must be one of portable, avx2, avx512"):
        env.simd_cap()
