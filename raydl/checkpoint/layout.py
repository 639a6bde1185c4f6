"""The checkpoint's bytes: a safetensors file (8-byte header length, JSON header, raw tensor bytes)
and one XXH3-64 digest per chunk (plus, with publish(verify="sha256"), one SHA-256 per chunk).

Pure functions over numpy buffers; nothing here moves bytes between processes.
XXH3-64 runs at 7.7 GB/s on one core here (zlib's CRC-32: 2.1), so checking
every chunk costs little next to the transfer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import struct
from typing import Any

import numpy as np
import xxhash

from raydl.util.optional import import_torch

__all__ = [
    "DTYPES",
    "aligned_empty",
    "checksums",
    "digest",
    "first_corrupt",
    "first_tampered",
    "pack",
    "pack_into",
    "packed_size",
    "parse_header",
    "sha256s",
    "tensors",
    "torch_module",
]

# torch dtype name -> safetensors dtype string
DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def torch_module():
    """torch, or an ImportError saying how to get it."""
    return import_torch("raydl.checkpoint")


class _Plan:
    """Where each tensor of a state dict goes in the safetensors layout."""

    def __init__(self, state: dict[str, Any]) -> None:
        torch = torch_module()
        if not isinstance(state, dict) or not state:
            raise ValueError("state must be a non-empty dict[str, torch.Tensor]")
        entries = []
        for name, t in state.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise ValueError(f"state must map str to torch.Tensor; {name!r} maps to {type(t).__name__}")
            if t.device.type != "cpu":
                t = t.cpu()
            dtype = DTYPES.get(str(t.dtype).removeprefix("torch."))
            if dtype is None:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
            entries.append((name, t.contiguous(), dtype))
        # Larger items first keeps every tensor aligned to its item size (safetensors allows no gaps).
        entries.sort(key=lambda e: (-e[1].element_size(), e[0]))
        self.header: dict[str, Any] = {}
        offset = 0
        for name, t, dtype in entries:
            n = t.numel() * t.element_size()
            self.header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(self.header, separators=(",", ":")).encode()
        self.raw_header = raw + b" " * (-len(raw) % 8)
        self.start = 8 + len(self.raw_header)
        self.size = self.start + offset
        self.entries = entries


def packed_size(state: dict[str, Any]) -> int:
    """Bytes of the safetensors file of `state`."""
    return _Plan(state).size


def pack_into(state: dict[str, Any], alloc) -> np.ndarray:
    """Lay `state` out as a safetensors file in `alloc(size)` (a writable uint8 array); return it."""
    torch = torch_module()
    plan = _Plan(state)
    buf = alloc(plan.size)
    buf[:8] = np.frombuffer(struct.pack("<Q", len(plan.raw_header)), np.uint8)
    buf[8 : plan.start] = np.frombuffer(plan.raw_header, np.uint8)
    for name, t, _ in plan.entries:
        b, e = plan.header[name]["data_offsets"]
        if e > b:
            buf[plan.start + b : plan.start + e] = t.reshape(-1).view(torch.uint8).numpy()
    return buf


def pack(state: dict[str, Any]) -> np.ndarray:
    """The safetensors file of `state` in one page-aligned uint8 buffer."""
    return pack_into(state, aligned_empty)


def aligned_empty(n: int) -> np.ndarray:
    """n bytes of fresh page-aligned memory (registration and DMA like page alignment), not faulted in."""
    raw = np.empty(n + mmap.PAGESIZE, np.uint8)
    off = -raw.ctypes.data % mmap.PAGESIZE
    return raw[off : off + n]


MAX_HEADER = 100_000_000  # bytes of a safetensors header: the format's own readers refuse more
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def parse_header(buf, where: str = "checkpoint") -> tuple[dict[str, Any], int]:
    """(header without __metadata__, offset of the first tensor byte) of the safetensors bytes `buf`,
    checked as the format's own reader checks them: every tensor of a known dtype, its bytes exactly
    its shape's, the tensors laid end to end from the first byte after the header to the last of
    `buf`. Anything else is a CheckpointError naming `where` (and the tensor)."""
    from raydl.errors import CheckpointError

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where} is not a usable safetensors file: {why}")

    size = len(buf)
    if size < 8:
        raise bad(f"{size} bytes, fewer than the 8 of its header's length")
    n = struct.unpack("<Q", bytes(buf[:8]))[0]
    if n > min(MAX_HEADER, size - 8):
        raise bad(f"a header of {n} bytes in {size} (at most {MAX_HEADER:,})")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (ValueError, RecursionError) as exc:
        raise bad(f"its header is not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + n
    spans = []
    for name, spec in header.items():
        spans.append((_tensor_span(name, spec, bad), name))
    at = 0
    for (b, e), name in sorted(spans):
        if b != at:
            raise bad(
                f"tensor {name[:200]!r} starts at byte {b} of the data, not at {at} where the one before ends"
            )
        at = e
    if at != size - start:
        raise bad(f"its tensors end at byte {at} of the data, which holds {size - start}")
    return header, start


def _tensor_span(name: str, spec, bad) -> tuple[int, int]:
    """(begin, end) of one header entry's bytes, once its dtype, shape and offsets agree."""
    if not isinstance(spec, dict):
        raise bad(f"tensor {name[:200]!r} is described by a {type(spec).__name__}, not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise bad(f"tensor {name[:200]!r} has dtype {str(dtype)[:40]!r}, not one of {sorted(_ITEMSIZE)}")
    if (
        not isinstance(shape, list)
        or len(shape) > 64
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in shape)
    ):
        raise bad(f"tensor {name[:200]!r} has shape {str(shape)[:80]}, not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and 0 <= o < 1 << 62 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"tensor {name[:200]!r} has data_offsets {str(offsets)[:80]}, not [begin, end]")
    count = 1
    for d in shape:
        count *= d
    b, e = offsets
    if count * _ITEMSIZE[dtype] != e - b:
        raise bad(
            f"tensor {name[:200]!r} of shape {shape} and dtype {dtype} needs {count * _ITEMSIZE[dtype]} "
            f"bytes; its data_offsets give {e - b}"
        )
    return b, e


def tensors(buf: np.ndarray, header: dict[str, Any], start: int) -> dict[str, Any]:
    """Tensors viewing `buf` (no copy), for a header parse_header checked."""
    from raydl.errors import CheckpointError

    torch = torch_module()
    by_name = {v: getattr(torch, k) for k, v in DTYPES.items() if hasattr(torch, k)}
    out = {}
    for name, spec in header.items():
        b, e = spec["data_offsets"]
        dtype = by_name.get(spec["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name[:200]!r}: this torch has no dtype {spec['dtype']}")
        if e == b:
            out[name] = torch.empty(spec["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=dtype, offset=start + b, count=(e - b) // dtype.itemsize)
        out[name] = flat.view(spec["shape"])
    return out


def digest(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def checksums(buf: np.ndarray, chunk: int) -> tuple[int, ...]:
    """One XXH3-64 digest per `chunk` bytes of buf (the last chunk may be short)."""
    return tuple(digest(buf[i : i + chunk]) for i in range(0, len(buf), chunk))


def sha256s(buf: np.ndarray, chunk: int) -> tuple[bytes, ...]:
    """One SHA-256 digest per `chunk` bytes of buf: publish(verify="sha256"). hashlib (OpenSSL, SHA-NI
    where the CPU has it) releases the GIL on large inputs; BLAKE3 is not a dependency."""
    return tuple(hashlib.sha256(buf[i : i + chunk]).digest() for i in range(0, len(buf), chunk))


def first_corrupt(
    buf: np.ndarray, sums: tuple[int, ...], chunk: int, first: int, last: int
) -> tuple[int, int] | None:
    """(chunk index, digest found) of the first chunk in [first, last) whose bytes do not match, or None."""
    for i in range(first, last):
        got = digest(buf[i * chunk : (i + 1) * chunk])
        if got != sums[i]:
            return i, got
    return None


def first_tampered(buf: np.ndarray, sums: tuple[bytes, ...], chunk: int, first: int, last: int) -> int | None:
    """The index of the first chunk in [first, last) whose SHA-256 does not match, or None."""
    for i in range(first, last):
        if not hmac.compare_digest(hashlib.sha256(buf[i * chunk : (i + 1) * chunk]).digest(), sums[i]):
            return i
    return None
