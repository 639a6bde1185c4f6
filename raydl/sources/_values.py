"""A WebDataset member's bytes to a value, by its field's extension, as webdataset's default decoder does.

The webdataset library decodes a sample with `gzfilter` then `basichandlers`
(webdataset/autodecode.py): a `.gz` field is decompressed once and loses
that suffix, then the extension, the field's last dot-part, chooses:

- txt, text, transcript: `str` (UTF-8);
- json, jsn: parsed JSON;
- cls, cls2, class, count, index, inx, id: `int`;
- npy: an ndarray; npz: a dict of them;
- pyd, pickle, pkl, pth: unpickled by the library; here `bytes`, unless the
  source was opened with allow_pickle=True, because unpickling runs code from
  the shard;
- image extensions: `bytes`, for the image stages to decode;
- anything else: `bytes` (msgpack, tenbin and cbor too, which the library
  decodes and raydl does not).

The bytes are untrusted, so every decoder is bounded: a gzip member inflates
to at most `inflate_limit(len(member))` bytes (a bomb is refused as soon as
it passes that), a .npy header must describe exactly the bytes that follow it
(nothing is allocated from what the header claims), an .npz holds at most
`MAX_NPZ_MEMBERS` arrays whose declared sizes are checked before any is read,
JSON nested too deep to parse is refused, and object arrays are never loaded
unless allow_pickle. Malformed bytes are a DecodeError saying what is wrong;
the caller (WebDatasetSource.cut) adds the shard, sample and field.
"""

from __future__ import annotations

import functools
import io
import json
import math
import re
import zlib

import numpy as np

from raydl.errors import DecodeError

__all__ = ["IMAGE_EXTENSIONS", "decode_value", "dtype_of", "extension_of", "inflate_limit", "kind_of"]

IMAGE_EXTENSIONS = frozenset("jpg jpeg png webp bmp ppm pgm pbm tif tiff gif".split())
TEXT = frozenset(("txt", "text", "transcript"))
JSON = frozenset(("json", "jsn"))
INTS = frozenset(("cls", "cls2", "class", "count", "index", "inx", "id"))
PICKLES = frozenset(("pyd", "pickle", "pkl"))
MAX_INT_BYTES = 4096  # an int member is a number in text (a label): never parse a longer one
INFLATE_RATIO = 64
INFLATE_FLOOR = 64 << 20
INFLATE_STEP = 1 << 20
MAX_NPZ_MEMBERS = 4096
MAX_NPY_DIMS = 32  # numpy's own limit is 64; more is a crafted header
_NPY_MAGIC = b"\x93NUMPY"
_EXT = re.compile(r".*[.]")


@functools.lru_cache(maxsize=4096)  # a handful of field names, asked once per value
def extension_of(field: str) -> tuple[bool, str]:
    """(gzipped, extension) of a field as webdataset decodes it: one ".gz" suffix is taken off first, then
    the extension is the last dot-part ("b.c.txt.gz" -> (True, "txt"))."""
    key = "." + field
    gz = key.endswith(".gz")
    if gz:
        key = key[:-3]
    return gz, _EXT.sub("", key)


def kind_of(field: str) -> str:
    """The base.Field kind of a field, from its extension (a .gz field takes the kind of what it holds)."""
    _, ext = extension_of(field)
    if ext in IMAGE_EXTENSIONS:
        return "image"
    return "array" if ext == "npy" else "value"


def dtype_of(field: str) -> str | None:
    """The numpy dtype of a field's batch column where its extension fixes it (int members: int64)."""
    return "int64" if extension_of(field)[1] in INTS else None


def inflate_limit(size: int) -> int:
    """The most bytes a `size`-byte gzip member may inflate to."""
    return max(INFLATE_FLOOR, INFLATE_RATIO * size)


def decode_value(field: str, data, *, allow_pickle: bool = False):
    """The value of a member of field `field` (its bytes, or a view of them); a DecodeError when they are
    malformed. Bytes come back as a copy of `data`, never a view of it."""
    gz, ext = extension_of(field)
    if gz:
        data = gunzip(data)
    if ext in TEXT:
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError(f"not UTF-8 text ({exc})") from exc
    if ext in JSON:
        return _json(data)
    if ext in INTS:
        return _int(data)
    if ext == "npy":
        return load_npy(data, allow_pickle=allow_pickle)
    if ext == "npz":
        return _npz(data, allow_pickle=allow_pickle)
    if allow_pickle and ext in PICKLES:
        import pickle

        return pickle.loads(data)
    if allow_pickle and ext == "pth":
        import torch

        return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")
    return bytes(data)


def gunzip(data) -> bytearray:
    """The inflated bytes of gzip member(s) `data` (concatenated members are one stream, as gzip reads
    them), at most `inflate_limit(len(data))` of them."""
    limit = inflate_limit(len(data))
    out = bytearray()
    rest = memoryview(data)
    if not len(rest):
        raise DecodeError("not gzip data (empty)")
    while len(rest):
        if rest[:2] != b"\x1f\x8b":
            if not out or bytes(rest).strip(b"\0"):  # zero padding after the last member is allowed
                raise DecodeError(
                    f"not gzip data (the bytes at offset {len(data) - len(rest)} are no member)"
                )
            break
        d = zlib.decompressobj(wbits=31)
        tail = rest
        while not d.eof:
            try:
                piece = d.decompress(tail, INFLATE_STEP)
            except zlib.error as exc:
                raise DecodeError(f"corrupt gzip data ({exc})") from exc
            out += piece
            if len(out) > limit:
                raise DecodeError(
                    f"gzip data of {len(data)} bytes inflates to more than {limit} bytes "
                    f"({INFLATE_RATIO}x, at least {INFLATE_FLOOR}): a gzip bomb"
                )
            left = d.unconsumed_tail
            if not piece and not d.eof and len(left) == len(tail):  # no progress: never loop on it
                raise DecodeError("truncated gzip data: a member does not end before the data does")
            tail = left
        rest = memoryview(d.unused_data)
    return out  # not copied again: decode_value makes bytes of it only where the value is bytes


def _json(data):
    try:
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)
    except RecursionError as exc:
        raise DecodeError("JSON nested too deep to parse") from exc
    except ValueError as exc:  # malformed, not UTF-8, or a number past Python's digit limit
        raise DecodeError(f"not valid JSON ({exc})") from exc


def _int(data) -> int:
    if len(data) > MAX_INT_BYTES:
        raise DecodeError(f"a {len(data)}-byte member is not an integer (at most {MAX_INT_BYTES} bytes)")
    text = bytes(data)
    try:
        value = int(text)
    except ValueError as exc:
        raise DecodeError(f"not an integer: {text[:40]!r}") from exc
    if not -(2**63) <= value < 2**63:  # a batch holds its integers as int64
        raise DecodeError(f"an integer outside int64: {text[:40]!r}{'...' if len(text) > 40 else ''}")
    return value


def load_npy(data, *, allow_pickle: bool = False) -> np.ndarray:
    """The array of .npy bytes `data`, whose header must describe exactly the bytes after it; a copy."""
    from numpy.lib import format as npformat

    view = memoryview(data)
    f = io.BytesIO(view[: 1 << 16])  # the header: numpy caps it well below this
    try:
        version = npformat.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npformat.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = npformat.read_array_header_2_0(f)
        elif version == (3, 0):  # 2.0's layout, a UTF-8 header: numpy reads it with its private reader only
            shape, fortran, dtype = _read_header_3_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except Exception as exc:  # noqa: BLE001 - numpy parses a header of at most 10,000 characters, and may
        # raise anything on a crafted one (tokenize.TokenError from its Python 2 filter): all malformed
        raise DecodeError(f"not a valid .npy ({type(exc).__name__}: {exc})") from exc
    if dtype.hasobject:
        if not allow_pickle:
            raise DecodeError(
                f"a .npy of dtype {dtype} holds Python objects, which load only with allow_pickle"
            )
        try:  # the user opted in to pickles: a bad one is still this sample's defect
            return npformat.read_array(io.BytesIO(view), allow_pickle=True)
        except Exception as exc:  # noqa: BLE001 - unpickling raises anything on crafted bytes
            raise DecodeError(f"not a valid .npy of objects ({type(exc).__name__}: {exc})") from exc
    if any(n < 0 for n in shape) or len(shape) > MAX_NPY_DIMS or dtype.shape:
        raise DecodeError(f"not a .npy raydl reads (shape {shape}, dtype {dtype})"[:300])
    count = math.prod(shape)
    body = len(view) - f.tell()
    if count * dtype.itemsize != body or (count and not dtype.itemsize):
        raise DecodeError(
            f"not a valid .npy: its header says {shape} of {dtype} ({count * dtype.itemsize} bytes), "
            f"{body} bytes follow it"[:300]
        )
    try:
        flat = np.frombuffer(view, dtype=dtype, count=count, offset=f.tell()).copy()
        return flat.reshape(shape[::-1]).transpose() if fortran else flat.reshape(shape)
    except (ValueError, TypeError, OverflowError) as exc:  # a shape numpy cannot make (too big, 0 x 2**62)
        raise DecodeError(f"not a valid .npy ({type(exc).__name__}: {exc})") from exc


def _read_header_3_0(f):
    from numpy.lib import format as npformat

    reader = getattr(npformat, "_read_array_header", None)
    if reader is None:
        from numpy.lib import _format_impl

        reader = _format_impl._read_array_header
    return reader(f, (3, 0))


def _member(z, info) -> bytes:
    """One .npz member's bytes, inflated a MiB at a time (never more than its declared size, which the caller
    has bounded), its CRC checked at its end. Only stored and deflated members: numpy writes nothing else,
    and zipfile inflates bzip2 and LZMA input without an output bound."""
    import zipfile

    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise DecodeError(
            f"an .npz member {info.filename[:80]!r} compressed with zip method {info.compress_type}: only "
            "stored and deflated members are read"
        )
    parts = []
    with z.open(info) as member:
        while piece := member.read(1 << 20):  # stops at the declared size; the read at the end checks the CRC
            parts.append(piece)
    return b"".join(parts)


def _npz(data, *, allow_pickle: bool) -> dict:
    """The arrays of .npz bytes, by name, as numpy.load gives them (a member that is no .npy: its bytes)."""
    import zipfile

    try:
        z = zipfile.ZipFile(io.BytesIO(bytes(data)))
        infos = z.infolist()
        if len(infos) > MAX_NPZ_MEMBERS:
            raise DecodeError(f"an .npz of {len(infos)} members, more than {MAX_NPZ_MEMBERS}")
        total, limit = sum(i.file_size for i in infos), inflate_limit(len(data))
        if total > limit:
            raise DecodeError(f"an .npz whose members inflate to {total} bytes, more than {limit}")
        out = {}
        for i in infos:
            blob = _member(z, i)
            name = i.filename[:-4] if i.filename.endswith(".npy") else i.filename
            out[name] = load_npy(blob, allow_pickle=allow_pickle) if blob.startswith(_NPY_MAGIC) else blob
        return out
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - zipfile raises many kinds on a crafted archive (BadZipFile,
        # zlib.error, RuntimeError for an encrypted member, struct.error): all malformed
        raise DecodeError(f"not a valid .npz ({type(exc).__name__}: {exc})") from exc
