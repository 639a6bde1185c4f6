"""decode_rgb turns every image mode into (H, W, 3) uint8, and anything undecodable into ValueError."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raydl.native import decode

pytestmark = pytest.mark.timeout(60)

PILLOW_IMAGES = Path(__file__).resolve().parents[3] / "shared" / "data" / "pillow"
H, W = 37, 53  # odd sizes catch off-by-one in downscaled decodes


def encode(im: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.fixture(scope="module")
def rgb() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)


def _palette_with_transparency(img: Image.Image) -> bytes:
    return encode(img.convert("P"), "PNG", transparency=0)


MODES = {
    "RGB-png": lambda img: encode(img, "PNG"),
    "RGB-jpeg": lambda img: encode(img, "JPEG", quality=95),
    "L-png": lambda img: encode(img.convert("L"), "PNG"),
    "L-jpeg": lambda img: encode(img.convert("L"), "JPEG"),
    "LA-png": lambda img: encode(img.convert("LA"), "PNG"),
    "P-png": lambda img: encode(img.convert("P"), "PNG"),
    "P-transparency-png": _palette_with_transparency,
    "RGBA-png": lambda img: encode(img.convert("RGBA"), "PNG"),
    "CMYK-jpeg": lambda img: encode(img.convert("CMYK"), "JPEG", quality=95),
    "I16-png": lambda img: encode(Image.fromarray(np.asarray(img)[:, :, 0].astype(np.uint16) * 257), "PNG"),
    "1bit-png": lambda img: encode(img.convert("1"), "PNG"),
    "RGB-bmp": lambda img: encode(img, "BMP"),
    "RGB-webp": lambda img: encode(img, "WEBP", lossless=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_decodes_to_hw3_uint8(rgb, mode):
    """Grey, grey+alpha, palette (with transparency), RGBA, CMYK JPEG, 16-bit, 1-bit: all come out (H, W, 3) uint8."""
    data = MODES[mode](Image.fromarray(rgb))
    out = decode.decode_rgb(data)
    assert out.shape == (H, W, 3) and out.dtype == np.uint8
    assert decode.image_size(data) == (H, W)


@pytest.mark.parametrize("mode", ["RGB-png", "RGB-bmp", "RGB-webp", "RGBA-png"])
def test_lossless_rgb_pixels_are_kept(rgb, mode):
    """Lossless RGB (and RGBA, whose alpha is dropped) decodes to exactly the pixels that were saved."""
    np.testing.assert_array_equal(decode.decode_rgb(MODES[mode](Image.fromarray(rgb))), rgb)


def test_grey_and_special_modes_map_to_the_expected_values(rgb):
    """Grey repeats into 3 equal channels, 1-bit gives 0/255, 16-bit keeps its top 8 bits, palettes expand."""
    img = Image.fromarray(rgb)
    grey = np.asarray(img.convert("L"))
    for mode in ("L-png", "LA-png"):
        out = decode.decode_rgb(MODES[mode](img))
        np.testing.assert_array_equal(out, np.repeat(grey[:, :, None], 3, axis=2))
    one = decode.decode_rgb(MODES["1bit-png"](img))
    assert set(np.unique(one).tolist()) <= {0, 255}
    sixteen = decode.decode_rgb(MODES["I16-png"](img))
    np.testing.assert_array_equal(sixteen[:, :, 0], rgb[:, :, 0])  # v*257 scaled back by 255/65535
    np.testing.assert_array_equal(decode.decode_rgb(MODES["P-png"](img)), np.asarray(img.convert("P").convert("RGB")))


def test_cmyk_jpeg_keeps_its_colours():
    """A CMYK JPEG of flat colours decodes to those colours (within JPEG loss)."""
    flat = np.zeros((32, 48, 3), np.uint8)
    flat[:, :16] = (200, 30, 90)
    flat[:, 16:32] = (10, 220, 40)
    flat[:, 32:] = (90, 90, 250)
    out = decode.decode_rgb(encode(Image.fromarray(flat).convert("CMYK"), "JPEG", quality=95))
    assert np.abs(out.astype(int) - flat)[4:-4, [4, 24, 40]].max() <= 4


@pytest.mark.parametrize("factor", [2, 4, 8])
def test_jpeg_factor_decodes_downscaled(factor):
    """factor=f decodes a JPEG at ceil(size/f) in the DCT domain (CMYK through Pillow's draft: smaller too)."""
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (301, 403, 3), dtype=np.uint8))
    out = decode.decode_rgb(encode(img, "JPEG"), factor=factor)
    assert out.shape == (-(-301 // factor), -(-403 // factor), 3) and out.dtype == np.uint8
    cmyk = decode.decode_rgb(encode(img.convert("CMYK"), "JPEG"), factor=factor)
    assert cmyk.dtype == np.uint8 and cmyk.shape[2] == 3 and cmyk.shape[0] < 301 and cmyk.shape[1] < 403
    png = decode.decode_rgb(encode(img, "PNG"), factor=factor)
    assert png.shape == (301, 403, 3)  # no DCT for other formats: full size


def test_dct_factor_scales_by_two_only_for_boxes_twelve_times_the_output():
    """By default dct_factor gives 2 only while the box stays >= 12x the output, never 4 or 8; fast: >= 1x."""
    assert decode.dct_factor(1500, 2000, 1500, 2000, 224, 224) == 1
    assert decode.dct_factor(1500, 2000, 1500, 2000, 224, 224, fast=True) == 4
    assert decode.dct_factor(1500, 2000, 1800 / 8, 1800 / 8, 224, 224, fast=True) == 1
    assert decode.dct_factor(3000, 4000, 3000, 4000, 224, 224) == 1  # 6.7x after scaling: full scale
    assert decode.dct_factor(6000, 8000, 5376, 5376, 224, 224) == 2  # exactly 12x
    assert decode.dct_factor(6000, 8000, 5375, 5376, 224, 224) == 1
    assert decode.dct_factor(12000, 12000, 12000, 12000, 224, 224) == 2  # 26x: still only 2
    assert decode.dct_factor(4000, 4000, 4000, 4000, 64, 64) == 2
    assert decode.dct_factor(500, 500, 500, 500, 224, 224) == 1
    assert decode.dct_factor(500, 500, 500, 500, 224, 224, fast=True) == 2
    assert decode.dct_factor(300, 300, 300, 300, 224, 224, fast=True) == 1


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_truncated_jpeg_is_a_value_error(rgb, cut):
    """A JPEG cut short (header intact) raises ValueError, and its header still gives the size."""
    data = MODES["RGB-jpeg"](Image.fromarray(rgb))
    short = data[: int(len(data) * cut)]
    with pytest.raises(ValueError):
        decode.decode_rgb(short)
    assert decode.image_size(short) == (H, W)


@pytest.mark.parametrize("junk", [b"", b"not an image at all" * 10, b"\xff\xd8\xff" + bytes(200),
                                  b"\x89PNG\r\n\x1a\n" + bytes(50), np.random.default_rng(2).bytes(4000)],
                         ids=["empty", "text", "jpeg-magic-zeros", "png-magic-zeros", "random"])
def test_junk_bytes_are_a_value_error(junk):
    """Empty, text, random bytes and bare magic numbers raise ValueError with the decoder's reason."""
    with pytest.raises(ValueError, match=r"\w+: "):
        decode.decode_rgb(junk)


def test_image_size_reads_the_header_only(rgb):
    """image_size gives (height, width) for JPEG and PNG from the bytes before their pixel data."""
    img = Image.fromarray(rgb)
    jpeg = encode(img, "JPEG")
    sos = jpeg.index(b"\xff\xda")
    assert decode.image_size(jpeg[: sos + 14]) == (H, W)  # markers and tables up to the scan header, no scan data
    png = encode(img, "PNG")
    assert decode.image_size(png[: png.index(b"IDAT") + 8]) == (H, W)  # chunks up to the start of the pixels
    assert decode.is_jpeg(jpeg) and not decode.is_jpeg(png)


@pytest.mark.parametrize("junk", [b"not an image at all", b"\xff\xd8\xff" + bytes(100)], ids=["text", "jpeg-magic"])
def test_image_size_of_junk_is_a_value_error(junk):
    """Unreadable headers are a ValueError from image_size too, like decode_rgb."""
    with pytest.raises(ValueError):
        decode.image_size(junk)


@pytest.mark.shared_data
@pytest.mark.timeout(120)
def test_pillow_test_images_decode_or_raise_value_error():
    """Over Pillow's own test images (broken, truncated, CMYK, 16-bit, palette...) nothing but ValueError escapes."""
    if not PILLOW_IMAGES.is_dir():
        pytest.skip(f"Pillow test images not found at {PILLOW_IMAGES} (the shared/ folder beside the checkout)")
    paths = sorted(p for p in PILLOW_IMAGES.iterdir() if p.is_file())
    decoded = refused = 0
    for path in paths:
        try:
            out = decode.decode_rgb(path.read_bytes())
        except ValueError:
            refused += 1
            continue
        assert isinstance(out, np.ndarray) and out.dtype == np.uint8, path.name
        assert out.ndim == 3 and out.shape[2] == 3 and out.shape[0] > 0 and out.shape[1] > 0, path.name
        decoded += 1
    assert decoded > 0.5 * len(paths)  # most of them are valid images
    assert refused > 0  # and some are broken on purpose


def test_undecodable_bytes_raise_decode_error_without_object_reprs():
    """Bytes Pillow cannot identify raise DecodeError (a ValueError) whose reason shows no `<... object at 0x...>`."""
    from raydl.errors import DecodeError

    for data in (b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40):
        with pytest.raises(DecodeError) as info:
            decode.decode_rgb(data)
        assert isinstance(info.value, ValueError) and " object at 0x" not in str(info.value)
        with pytest.raises(DecodeError):
            decode.image_size(data)


# A 275-byte TIFF found by fuzzing: Pillow's TIFF plugin raises TypeError on it (a bytes value where it
# expects an int), which is bad bytes like any other
_FUZZED_TIFF = (
    "SUkqAAgAAAAJAAABBAABAAAAEQAAAAEBBAABAAAACQAAAAIBAwABgAAACAAAAAMBAwABAAAAAQAAAAYBAwABAAAAAQAAABEBBwABAAAAegAA"
    "ABYBBAABAAAACQAAABcBBAABAAAAmQAAABwBAwABAAAAAQAAAAAAAAADAwMDAwMDAwMD/wMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMD"
    "AwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMD"
    "AwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwM="
)


def test_an_image_pillow_fails_on_with_a_type_error_is_a_decode_error():
    """Pillow's plugins raise TypeError, struct.error, IndexError ... on crafted files: a DecodeError (which
    on_error settles), not an error that fails the batch."""
    import base64
    import warnings

    from raydl.errors import DecodeError

    data = base64.b64decode(_FUZZED_TIFF)
    assert len(data) == 275
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DecodeError, match="TypeError"):
            decode.decode_rgb(data)
