"""A Parquet file's bytes as both sides read them: its footer's tail parsed (raydl's checked reading,
then pyarrow's FileMetaData), the leaf columns a selection reads and the span of their chunks, and pyarrow
over only the pieces of the file that were fetched.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow._parquet import ParquetReader

from raydl.sources._footer import Footer, read_footer_meta
from raydl.sources._parquet_fields import Selection
from raydl.util.memory import decode_pool

__all__ = [
    "chunk_span",
    "footer_of",
    "label_leaf",
    "leaves_of",
    "needed_leaves",
    "open_pieces",
    "parse_footer",
    "read_row_group",
]


class _SparseFile(io.RawIOBase):
    """A read-only file of `size` bytes of which only some ranges are present; reading elsewhere is an
    error."""

    def __init__(self, uri: str, size: int, pieces: dict[int, bytes]) -> None:
        self._uri, self._size, self._pieces, self._pos = uri, size, pieces, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: offset, 1: self._pos + offset, 2: self._size + offset}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self._size - self._pos
        n = min(n, self._size - self._pos)
        for start, data in self._pieces.items():
            if start <= self._pos and self._pos + n <= start + len(data):
                out = data[self._pos - start : self._pos - start + n]
                self._pos += n
                return out
        raise OSError(f"{self._uri}: bytes [{self._pos}, {self._pos + n}) were not fetched")

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def parse_footer(tail: bytes) -> pq.FileMetaData:
    """The FileMetaData in a file's tail (its last bytes: metadata, length, magic), without the rest of the
    file."""
    (meta_len,) = struct.unpack("<I", tail[-8:-4])
    return pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-(meta_len + 8) :]))


def open_pieces(uri: str, size: int, md: pq.FileMetaData, pieces: dict[int, bytes]) -> pq.ParquetFile:
    """A ParquetFile over the fetched `pieces` only; the metadata is given, so its footer is not read
    again."""
    return pq.ParquetFile(
        pa.PythonFile(_SparseFile(uri, size, pieces), mode="r"), metadata=md, pre_buffer=False
    )


def read_row_group(
    uri: str,
    size: int,
    md: pq.FileMetaData,
    pieces: dict[int, bytes],
    rg: int,
    leaves: Sequence[int],
    *,
    threads: bool = True,
) -> pa.Table:
    """Row group `rg`'s leaf columns `leaves` (their indices in the file's schema, as `needed_leaves` gives
    them), decoded from the fetched `pieces` into raydl's decode pool (raydl.util.memory.decode_pool)."""
    reader = ParquetReader(memory_pool=decode_pool())
    reader.open(pa.PythonFile(_SparseFile(uri, size, pieces), mode="r"), metadata=md, pre_buffer=False)
    return reader.read_row_group(rg, column_indices=list(leaves), use_threads=threads)


def footer_of(uri: str, size: int, tail: bytes) -> Footer:
    """raydl's own reading of the footer in `tail` (raydl/sources/_footer.py), checked against the file."""
    return read_footer_meta(tail[:-8], uri=uri, file_size=size)


def leaves_of(footer: Footer, path: str, uri: str) -> tuple[int, ...]:
    """The leaf columns under `path` (a top-level column, or an image struct's "bytes" child)."""
    found = tuple(k for k, leaf in enumerate(footer.leaves) if leaf == path or leaf.startswith(path + "."))
    if not found:
        top = sorted({p.split(".")[0] for p in footer.leaves})
        raise ValueError(f"{uri} has no column {path.split('.')[0]!r}; its columns are {top}")
    return found


def label_leaf(footer: Footer, column: str, uri: str) -> int:
    """The label column's leaf, which the footer's schema must say holds plain integers."""
    leaves = leaves_of(footer, column, uri)
    kind = footer.types[leaves[0]] if footer.types and len(leaves) == 1 else None
    if kind is None or not kind.is_integer:
        raise ValueError(f"{uri}: label column {column!r} is {kind}, not an integer column")
    return leaves[0]


def needed_leaves(footer: Footer, selection: Selection, uri: str) -> tuple[int, ...]:
    """The leaf columns the selection reads, in the file's order; its label column checked to be integers."""
    leaves: set[int] = set()
    for path, how in zip(selection.paths, selection.how, strict=True):
        if path is not None:
            leaves.update(
                (label_leaf(footer, path, uri),) if how == "label" else leaves_of(footer, path, uri)
            )
    return tuple(sorted(leaves))


def chunk_span(chunks: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(first byte, length) of the bytes from the first chunk's start to the last one's end."""
    start = min(c[0] for c in chunks)
    return start, max(c[0] + c[1] for c in chunks) - start
