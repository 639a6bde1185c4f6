"""Image sizes from the first bytes of each file (listing time), against the decoded sizes."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from raydl.describe.sizes import header_sizes
from raydl.native import decode

pytestmark = pytest.mark.timeout(120)


def _read_from(files: dict[str, bytes]):
    def read(key, length):
        data = files[key]
        return data if length is None else data[:length]
    return read


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def test_formats_and_a_header_past_the_first_read():
    """JPEG (SOF after a 40 KiB APP segment, progressive, grey), PNG, WebP, BMP: sizes from headers only."""
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (37, 53, 3), dtype=np.uint8))
    big_icc = bytes(40_000)  # pushes the SOF past decode.HEADER_BYTES
    files = {
        "plain.jpg": _encode(rgb, "JPEG"),
        "icc.jpg": _encode(rgb, "JPEG", icc_profile=big_icc),
        "prog.jpg": _encode(rgb, "JPEG", progressive=True),
        "grey.jpg": _encode(rgb.convert("L"), "JPEG"),
        "a.png": _encode(rgb, "PNG"),
        "a.webp": _encode(rgb, "WEBP"),
        "a.bmp": _encode(rgb, "BMP"),
        "junk.jpg": b"\xff\xd8\xff\xe0 not a JPEG at all",
        "empty.png": b"",
    }
    assert decode._jpeg_sof(files["icc.jpg"][: decode.HEADER_BYTES]) is None
    keys = list(files)
    sizes = header_sizes(_read_from(files), keys, threads=3)
    for i, key in enumerate(keys[:-2]):
        assert (sizes.widths[i], sizes.heights[i]) == (53, 37), key
    assert sizes.widths[-1] == sizes.heights[-1] == sizes.widths[-2] == -1
    assert set(sizes.errors) == {len(keys) - 2, len(keys) - 1}
    assert "header" in sizes.errors[len(keys) - 2]


def test_a_file_with_no_header_in_its_first_16_mib_is_read_no_further(monkeypatch):
    """A JPEG whose frame header never comes (a 1 GiB file of a JPEG start and zeros, read lazily here): its
    row's error says so after reading MAX_HEADER_SEARCH bytes, never the whole file."""
    from raydl.describe import sizes as sizes_module

    asked = []

    def read(key, length):
        asked.append(length)
        if length is None:
            raise AssertionError("the whole file was asked for")
        return (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(length))[:length]

    got = header_sizes(read, ["big.jpg"], threads=1)
    assert got.widths[0] == -1 and "no image size in the first 16,777,216 bytes" in got.errors[0]
    assert max(asked) == sizes_module.MAX_HEADER_SEARCH


def test_sizes_keep_their_rows_across_many_reads_per_task():
    """Hundreds of files, read many per pool task: each size and each error lands on its own row."""
    files, expect = {}, {}
    for i in range(300):
        w, h = 8 + i % 17, 8 + i % 11
        files[f"{i}.png"] = b"broken" if i % 37 == 5 else _encode(Image.new("RGB", (w, h)), "PNG")
        expect[i] = (-1, -1) if i % 37 == 5 else (w, h)
    sizes = header_sizes(_read_from(files), list(files), threads=4)
    assert [(int(w), int(h)) for w, h in zip(sizes.widths, sizes.heights, strict=True)] == [expect[i] for i in range(300)]
    assert set(sizes.errors) == {i for i in range(300) if i % 37 == 5}


@pytest.mark.shared_data
def test_header_sizes_match_decoded_sizes_on_pillow_images(shared_data):
    """On Pillow's test images, every file that decodes has the header size its decode has."""
    paths = sorted((shared_data / "pillow").iterdir())
    files = {p.name: p.read_bytes() for p in paths if p.is_file()}
    keys = list(files)
    sizes = header_sizes(_read_from(files), keys)
    compared = 0
    for i, key in enumerate(keys):
        try:
            h, w = decode.decode_rgb(files[key]).shape[:2]
        except ValueError:
            continue  # undecodable: on_error's business at decode time
        assert (int(sizes.heights[i]), int(sizes.widths[i])) == (h, w), (key, sizes.errors.get(i))
        compared += 1
    assert compared > 300


def _png_header(w: int, h: int) -> bytes:
    """A PNG signature and IHDR chunk declaring w x h (and nothing after): all listing reads."""
    import struct
    import zlib

    body = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + body + struct.pack(">I", zlib.crc32(b"IHDR" + body))


def test_a_header_past_the_int32_size_columns_is_that_rows_error():
    """A PNG header declaring width 3,000,000,000 gets -1 and a reason naming its size; the other rows keep theirs
    (it used to raise OverflowError for the whole listing)."""
    files = {"a.png": _png_header(40, 30), "huge.png": _png_header(3_000_000_000, 1), "b.png": _png_header(7, 9)}
    sizes = header_sizes(_read_from(files), list(files), threads=2)
    assert sizes.widths.tolist() == [40, -1, 7] and sizes.heights.tolist() == [30, -1, 9]
    assert set(sizes.errors) == {1} and "3000000000x1" in sizes.errors[1]
