"""A Megatron-LM indexed dataset's index (PREFIX.idx, the `MMIDIDX` format, version 1), read and checked.

    magic      9 bytes   b"MMIDIDX\\x00\\x00"
    version    u64       1
    dtype      u8        the .bin's token type: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
                         (6 float64 and 7 float32 are not tokens)
    sequences  u64       S
    documents  u64       D
    lengths    i32[S]    tokens per sequence
    pointers   i64[S]    byte offset of each sequence in the .bin
    doc index  i64[D]    (Megatron's grouping of sequences; raydl reads each sequence as a document)

The counts are bounded by the file's size before any array is made, and the arrays are views of the
index's bytes (a memory map for a local file). raydl reads sequences laid end to end from the .bin's first
byte, as Megatron's builder writes them: a pointer anywhere else, or past the end of the .bin, is an error
naming the file, and so is a .bin shorter than the lengths add up to.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

from raydl.errors import DataSourceError
from raydl.storage import ObjectInfo, Storage, split_scheme

__all__ = ["MAGIC", "TOKEN_DTYPES", "MegatronIndex", "map_file", "parse_index", "read_index", "write_index"]

MAGIC = b"MMIDIDX\x00\x00"
_CHECK_CHUNK = 1 << 20  # sequences checked at a time
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents: 34 bytes
TOKEN_DTYPES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}


@dataclass(frozen=True)
class MegatronIndex:
    """A checked index: the .bin's token dtype, each sequence's length (i32) and the tokens in all."""

    dtype: np.dtype
    lengths: np.ndarray  # a view of the index's bytes
    tokens: int

    @property
    def sequences(self) -> int:
        return len(self.lengths)


def map_file(path: str, *, index: bool = False) -> memoryview | bytes:
    """A local file's bytes, memory-mapped read-only (b"" for an empty file, which mmap refuses). With
    `index`, the kernel is told to read ahead the header, lengths and pointers of the Megatron index it
    holds, which are read through once next (a cold 200 MB index faulted in page by page reads several times
    slower)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return b""
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if index and size >= _HEADER.size and hasattr(m, "madvise"):
        seqs = _HEADER.unpack_from(m, 0)[3]
        m.madvise(mmap.MADV_WILLNEED, 0, min(size, _HEADER.size + 12 * seqs))
    return memoryview(m)


def read_index(storage: Storage, idx_info: ObjectInfo) -> memoryview | bytes:
    """A .idx's bytes: memory-mapped where local, else fetched whole (it was listed at this size and etag);
    a DataSourceError naming it when it cannot be read."""
    try:
        if split_scheme(idx_info.uri)[0] == "file":
            return map_file(idx_info.uri, index=True)
        return storage.read_range(idx_info.uri, 0, idx_info.size, etag=idx_info.etag or None)
    except OSError as exc:
        raise DataSourceError(f"cannot read {idx_info.uri}: {exc}", uri=idx_info.uri) from exc


def parse_index(idx_uri: str, data, bin_uri: str, bin_size: int) -> MegatronIndex:
    """The index in `data` (the .idx's bytes), checked against itself and the .bin's size: a DataSourceError
    naming the file for another magic or version, a dtype that is not tokens, counts past the end of the
    .idx, a negative length, a pointer past the end of the .bin or not where the sequence before it ends, or
    a .bin shorter than the lengths say."""
    size = len(data)
    if size < _HEADER.size or bytes(data[:9]) != MAGIC:
        raise DataSourceError(
            f"{idx_uri} is not a Megatron-LM index: no MMIDIDX magic at its start", uri=idx_uri
        )
    _magic, version, code, seqs, docs = _HEADER.unpack_from(data, 0)
    if version != 1:
        raise DataSourceError(
            f"{idx_uri}: Megatron-LM index version {version}; raydl reads version 1", uri=idx_uri
        )
    dtype = TOKEN_DTYPES.get(code)
    if dtype is None:
        raise DataSourceError(
            f"{idx_uri}: token dtype code {code} is not an integer token type "
            f"(1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)",
            uri=idx_uri,
        )
    need = _HEADER.size + seqs * 12 + docs * 8  # Python ints: a crafted count cannot overflow here
    if need > size:
        raise DataSourceError(
            f"{idx_uri}: the index says {seqs} sequences and {docs} documents, which need {need} bytes, "
            f"but it has {size}",
            uri=idx_uri,
        )
    lengths = np.frombuffer(data, "<i4", seqs, _HEADER.size)
    pointers = np.frombuffer(data, "<i8", seqs, _HEADER.size + 4 * seqs)
    isz = dtype.itemsize
    end = 0  # where the sequences checked so far end, in bytes
    for lo in range(0, seqs, _CHECK_CHUNK):  # in chunks: a few MB of temporaries whatever the index's size
        _check_chunk(idx_uri, bin_uri, bin_size, lengths[lo : lo + _CHECK_CHUNK], pointers, lo, end, isz)
        end += int(lengths[lo : lo + _CHECK_CHUNK].sum(dtype=np.int64)) * isz
        # past the .bin, the next chunk's first pointer (at most the .bin's size) is not at `end`: so `end`
        # stays below the .bin's size plus one chunk's bytes (2^54), within int64
    total = end
    if total > bin_size:
        raise DataSourceError(
            f"{bin_uri} is {bin_size} bytes, shorter than the {total} bytes its index {idx_uri} gives its "
            f"{seqs} sequences",
            uri=bin_uri,
        )
    return MegatronIndex(dtype, lengths, total // isz)


def _check_chunk(idx_uri, bin_uri, bin_size, lengths, pointers, lo, end, isz) -> None:
    """Sequences lo, lo + 1, ... (`lengths`): no negative length, no pointer past the .bin, each pointer
    where the sequence before it ends (`end`: where sequence lo - 1 ends)."""
    if lengths.min() < 0:
        k = int(np.argmax(lengths < 0))
        raise DataSourceError(f"{idx_uri}: sequence {lo + k} has length {int(lengths[k])}", uri=idx_uri)
    ptr = pointers[lo : lo + len(lengths)]
    past = (ptr < 0) | (ptr > bin_size)
    if past.any():
        k = int(np.argmax(past))
        raise DataSourceError(
            f"{idx_uri}: sequence {lo + k}'s pointer {int(ptr[k])} is past the end of {bin_uri} "
            f"({bin_size} bytes)",
            uri=idx_uri,
        )
    starts = np.empty(len(lengths), np.int64)  # where each sequence starts if laid end to end
    starts[0] = end
    np.cumsum(lengths[:-1], dtype=np.int64, out=starts[1:])
    starts[1:] *= isz  # at most 2^31 * 2^20 * 8 per chunk, plus `end`: no overflow for any file
    starts[1:] += end
    wrong = ptr != starts
    if wrong.any():
        k = int(np.argmax(wrong))
        raise DataSourceError(
            f"{idx_uri}: sequence {lo + k} starts at byte {int(ptr[k])} of {bin_uri}, not at "
            f"{int(starts[k])} where the one before it ends; raydl reads sequences laid end to end (as "
            "Megatron writes)",
            uri=idx_uri,
        )


def write_index(path: str, lengths, dtype, *, version: int = 1, magic: bytes = MAGIC) -> None:
    """Write a Megatron-LM index for sequences of `lengths` tokens of `dtype` laid end to end, each its own
    document (tests and benchmarks: Megatron's builder writes the same bytes)."""
    lengths = np.asarray(lengths, np.int32)
    dtype = np.dtype(dtype)
    code = next(c for c, d in TOKEN_DTYPES.items() if d == dtype)
    pointers = np.zeros(len(lengths), np.int64)
    pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * dtype.itemsize
    docs = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(struct.pack("<9sQBQQ", magic, version, code, len(lengths), len(docs)))
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())
