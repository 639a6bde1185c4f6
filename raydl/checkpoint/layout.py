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


def parse_header(buf) -> tuple[dict[str, Any], int]:
    """(header without __metadata__, offset of the first tensor byte)."""
    n = struct.unpack("<Q", bytes(buf[:8]))[0]
    header = json.loads(bytes(buf[8 : 8 + n]))
    header.pop("__metadata__", None)
    return header, 8 + n


def tensors(buf: np.ndarray, header: dict[str, Any], start: int) -> dict[str, Any]:
    """Tensors viewing `buf` (no copy)."""
    torch = torch_module()
    by_name = {v: getattr(torch, k) for k, v in DTYPES.items() if hasattr(torch, k)}
    out = {}
    for name, spec in header.items():
        b, e = spec["data_offsets"]
        dtype = by_name[spec["dtype"]]
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
