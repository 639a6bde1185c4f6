"""Image sizes from the first bytes of every file (no pixel decode), when a stage needs them.

Aspect buckets need each image's width and height before anything is decoded
(`Catalog.with_sizes`, called by `Dataset.aspect_buckets`); nothing else does,
so listing does not read them. `header_sizes` reads the first HEADER_BYTES of each file (a ranged GET on S3),
parses the JPEG SOF / PNG IHDR (or lets Pillow read any other header), and
reads the whole file only when the header lies further in (large EXIF or ICC
blocks). Files are read in parallel on a thread pool. A file whose header
cannot be read gets width = height = -1 and a reason, so that the loader can
route it through on_error like any other bad sample; so does one whose header
gives a side that the int32 size columns cannot hold (a PNG may declare up to
2**31 - 1): one hostile header never fails the listing of the whole dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np

from raydl.errors import DataSourceError

__all__ = ["HeaderSizes", "header_sizes"]

_CHUNK = 64  # keys per pool task

# How far into a file its header is looked for: EXIF and ICC blocks may put a JPEG's frame header past the
# first read, but not past this (the whole of a crafted multi-GB file is never read for its size)
MAX_HEADER_SEARCH = 16 << 20

# read(item, length) -> the first `length` bytes of the object (all of it when it is shorter, or for None)
ReadPrefix = Callable[[Any, "int | None"], bytes]


class HeaderSizes:
    """Widths and heights (int32, -1 where unknown) and the reason for each unknown one, by row."""

    def __init__(self, widths: np.ndarray, heights: np.ndarray, errors: dict[int, str]) -> None:
        self.widths, self.heights, self.errors = widths, heights, errors


def _one(read: ReadPrefix, key: Any, decode: ModuleType) -> tuple[int, int] | str:
    try:
        head = read(key, decode.HEADER_BYTES)
        try:
            h, w = decode.header_size(head, complete=len(head) < decode.HEADER_BYTES)
        except decode.NeedMoreBytes:  # a header past the first read (large EXIF or ICC blocks): look further
            more = read(key, MAX_HEADER_SEARCH)
            try:
                h, w = decode.header_size(more, complete=len(more) < MAX_HEADER_SEARCH)
            except decode.NeedMoreBytes:
                return f"no image size in the first {MAX_HEADER_SEARCH:,} bytes of the file"
    except (ValueError, DataSourceError) as exc:
        return f"cannot read the image size from the header: {exc}"
    if w > decode.MAX_SIDE or h > decode.MAX_SIDE:
        return (
            f"the header gives a size {w}x{h}, past the {decode.MAX_SIDE} pixels a side that image sizes hold"
        )
    return w, h


def header_sizes(read: ReadPrefix, keys: Sequence[Any], *, threads: int = 16) -> HeaderSizes:
    """Sizes of every key's image from its header, read on `threads` threads (IO-bound: S3's ranged GETs)."""
    from raydl.native import decode  # the header parsers (Pillow): imported only when sizes are read

    widths = np.full(len(keys), -1, np.int32)
    heights = np.full(len(keys), -1, np.int32)
    errors: dict[int, str] = {}
    if not keys:
        return HeaderSizes(widths, heights, errors)
    # One task per run of keys: a task (future, lock, queue entry) per file cost more than the
    # read itself for files in the page cache (ThreadPoolExecutor.map ignores chunksize).
    chunk = max(1, min(_CHUNK, -(-len(keys) // threads)))
    runs = [keys[i : i + chunk] for i in range(0, len(keys), chunk)]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(runs)))) as pool:
        results = pool.map(lambda run: [_one(read, k, decode) for k in run], runs)
        for i, got in enumerate(got for run in results for got in run):
            if isinstance(got, str):
                errors[i] = got
            else:
                widths[i], heights[i] = got
    return HeaderSizes(widths, heights, errors)
