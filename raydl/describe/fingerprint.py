"""A catalog's two fingerprints, hashed from its Arrow tables' buffers (no Python object per row).

`fingerprints(parts, shards, root)` feeds SHA-256 the parts columns, each
shard's path relative to `root` and its size (`samples_fingerprint`: the same
files give the same order wherever they are stored), then each shard's etag
(`fingerprint`: a resume state cannot be loaded against changed data). Columns
are fed as `string_array` / `int_array` lay them out, whatever their buffers'
slicing or padding, so a table read back or built another way hashes the same.
The relative paths are made a piece of rows at a time, as numpy over the URI
column's own buffers: a listing of millions of files never holds a second
column of them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from raydl.util.arrow import int_column

__all__ = ["fingerprints"]

_PIECE = 1 << 12  # URIs made relative at a time when fingerprinting (never a whole column of them)


def _hash_array(h, chunk: pa.Array) -> None:
    """Feed an array's values to `h` as string_array / int_array lay them out (offsets from 0, then the
    bytes; or the integers), whatever its buffers' slicing, padding or all-valid bitmap."""
    kind = chunk.type
    if chunk.null_count == 0 and pa.types.is_integer(kind):
        h.update(np.ascontiguousarray(int_column(chunk)).data)
        return
    if chunk.null_count == 0 and _is_text(kind):
        ends, data = _text_buffers(chunk)
        h.update((ends - ends[0]).data)
        h.update(data[int(ends[0]) : int(ends[-1])].data)
        return
    for buf in chunk.buffers():  # nulls, or another type: as they lie
        if buf is not None:
            h.update(buf)


def _is_text(kind: pa.DataType) -> bool:
    return any(
        f(kind)
        for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    )


def _text_buffers(chunk: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A string (or binary) array's end offsets (len + 1, a view) and its bytes (a uint8 view)."""
    _validity, offsets, data = chunk.buffers()
    wide = pa.types.is_large_string(chunk.type) or pa.types.is_large_binary(chunk.type)
    ends = np.frombuffer(offsets, np.int64 if wide else np.int32)[
        chunk.offset : chunk.offset + len(chunk) + 1
    ]
    return ends, (np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8))


def _hash_table(h, t: pa.Table) -> None:
    for name in t.column_names:
        h.update(name.encode())
        for chunk in t.column(name).chunks:
            _hash_array(h, chunk)


def _relative_pieces(uris: pa.ChunkedArray, root: str):
    """(bytes, first, end) of each URI's path relative to `root` (past it and any '/' after it; a URI
    outside it whole), a piece of rows at a time, as numpy over the column's own buffers: no Python
    string per URI, no second column."""
    rb = np.frombuffer(root.encode(), np.uint8)
    for chunk in uris.chunks:
        ends, data = _text_buffers(chunk)
        for i in range(0, len(chunk), _PIECE):
            k = min(_PIECE, len(chunk) - i)
            start, end = ends[i : i + k].astype(np.int64), ends[i + 1 : i + 1 + k].astype(np.int64)
            inside = (end - start) >= len(rb)
            for j, byte in enumerate(rb):  # starts with the root's bytes (a str prefix is a UTF-8 prefix)
                inside &= data[np.minimum(start + j, max(len(data) - 1, 0))] == byte
            first = start + inside * len(rb)
            more = np.flatnonzero(inside)
            while more.size:  # lstrip("/"): only the rows still at a '/' go round again
                at = first[more]
                slash = (at < end[more]) & (data[np.minimum(at, max(len(data) - 1, 0))] == ord("/"))
                more = more[slash]
                first[more] += 1
            yield data, first, end


def _hash_relative_paths(h, uris: pa.ChunkedArray, root: str) -> None:
    """Feed `h` a column "path" of the URIs relative to root exactly as `_hash_table` would feed a
    string_array of them (its name, offsets, bytes), a piece at a time."""
    total = sum(int((end - first).sum()) for _, first, end in _relative_pieces(uris, root))
    width = np.int64 if total >= 2**31 else np.int32  # string_array's choice
    h.update(b"path")
    h.update(np.zeros(1, width).data)
    done = 0
    for _, first, end in _relative_pieces(uris, root):
        ends = done + np.cumsum(end - first)
        h.update(ends.astype(width).data)
        done = int(ends[-1]) if ends.size else done
    for data, first, end in _relative_pieces(uris, root):
        if not first.size:
            continue
        lo, hi = (
            int(first[0]),
            int(end[-1]),
        )  # rows are back to back: drop what lies between a row's end and the next's first
        keep = np.zeros(hi - lo + 1, np.int32)
        np.add.at(keep, first - lo, 1)
        np.add.at(keep, end - lo, -1)
        h.update(data[lo:hi][np.cumsum(keep[:-1], dtype=np.int32) > 0].data)


def fingerprints(parts: pa.Table, shards: pa.Table, root: str) -> tuple[str, str]:
    """(fingerprint, samples_fingerprint): the parts columns and each shard's relative path and size, then
    (the first only) each shard's etag."""
    h = hashlib.sha256()
    _hash_table(h, parts)
    _hash_relative_paths(h, shards.column("uri"), root)
    _hash_table(h, shards.select(["size"]))
    samples = h.copy()
    _hash_table(h, shards.select(["etag"]))
    return h.hexdigest()[:32], samples.hexdigest()[:32]
