"""Catalogs at the sizes users train on, from counts alone (no data), and what they cost the driver.

- `webdataset_catalog`: N samples in S tar shards, one part per shard with the
  WebDataset listing's locator columns (where the shard's index block is);
- `parquet_catalog`: F files of G row groups of R rows, one part per row group (the Parquet source's
  own `catalog_from_row_counts`);
- `ImageNetListing`: a Storage whose `list()` yields 1.28 M ImageNet-like
  objects (`train/n01440764/n01440764_10026.JPEG`) without holding them, for the
  image-folder listing's memory; `make_empty_folder` the same names as empty files on local disk, and
  `watch_opens` the files a listing of them opens (none);
- `measure_memory` and `plan_cost`: tracemalloc's peak (plus Arrow's own pool,
  which tracemalloc does not see), the RSS growth, and the time to plan one
  batch (EpochOrder positions -> ids -> `Catalog.locate`).

Everything is vectorized numpy over the parts; the only Python loops are over
shards (100,000), never over samples.
"""

from __future__ import annotations

import gc
import hashlib
import os
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pyarrow as pa

from raydl.describe.catalog import Catalog, Source, make_catalog
from raydl.storage.base import ObjectInfo
from raydl.util.arrow import int_array

__all__ = [
    "ImageNetListing",
    "Memory",
    "imagenet_keys",
    "make_empty_folder",
    "measure_memory",
    "parquet_catalog",
    "plan_cost",
    "token_catalog",
    "watch_opens",
    "webdataset_catalog",
]


@dataclass(frozen=True)
class CountsOnly(Source):
    """The source of a catalog made from counts: it has a name (the plan reads nothing else) and no data."""

    name: str
    range_is_sample: bool = True
    reads_labels: ClassVar[bool] = True  # as the labelled listing it stands in for ("cls", the default)

    def locate(self, catalog, ids):
        raise NotImplementedError(f"a synthetic {self.name} catalog has no data to locate")

    def read_block(self, storage, shard, offset, length):
        raise NotImplementedError(f"a synthetic {self.name} catalog has no data to read")

    def cut(self, located, i, data):
        raise NotImplementedError(f"a synthetic {self.name} catalog has no data to cut")

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#{key}"


def _numbered(prefix: str, numbers: np.ndarray, width: int, suffix: str) -> pa.Array:
    """The strings prefix + number (zero-padded to `width` digits) + suffix, built as one byte matrix:
    no Python string per row."""
    head, tail = np.frombuffer(prefix.encode(), np.uint8), np.frombuffer(suffix.encode(), np.uint8)
    n, size = len(numbers), len(head) + width + len(tail)
    rows = np.empty((n, size), np.uint8)
    rows[:, : len(head)] = head
    rows[:, len(head) + width :] = tail
    for k in range(width):  # the digits, most significant first
        rows[:, len(head) + k] = ord("0") + (numbers // 10 ** (width - 1 - k)) % 10
    return _fixed_width(rows)


def _etags(n: int, seed: int) -> pa.Array:
    """S3-like etags (32 hex digits), distinct per object, built as one byte matrix."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, 16), dtype=np.uint8)
    digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    rows = np.empty((n, 32), np.uint8)
    rows[:, 0::2], rows[:, 1::2] = digits[raw >> 4], digits[raw & 15]
    return _fixed_width(rows)


def _objects(table: pa.Table) -> list[ObjectInfo]:
    """The shards as the ObjectInfos a listing makes (one Python object, URI and etag each)."""
    d = table.to_pydict()
    return [ObjectInfo(u, s, e) for u, s, e in zip(d["uri"], d["size"], d["etag"], strict=True)]


def _fixed_width(rows: np.ndarray) -> pa.Array:
    n, size = rows.shape
    offsets = np.arange(n + 1, dtype=np.int32) * size
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(rows.reshape(-1))]
    return pa.Array.from_buffers(pa.string(), n, buffers)


def _counts(samples: int, parts: int, rng: np.random.Generator, jitter: float = 0.1) -> np.ndarray:
    """`parts` counts summing to `samples`, each within `jitter` of the mean (pairs of +d, -d)."""
    base = samples // parts
    d = int(base * jitter)
    half = rng.integers(-d, d + 1, size=parts // 2) if d else np.zeros(parts // 2, np.int64)
    counts = np.full(parts, base, np.int64)
    counts[: 2 * half.size] += np.concatenate([half, -half])
    counts[: samples - base * parts] += 1  # the remainder, one each
    return rng.permutation(counts)


def webdataset_catalog(
    samples: int = 100_000_000,
    shards: int = 100_000,
    *,
    objects: bool = True,
    seed: int = 0,
    root: str = "s3://laion/shards",
) -> Catalog:
    """`samples` samples in `shards` tar shards, one part per shard, with the locators the WebDataset
    listing keeps (a DALI .idx beside each shard: the longest of them, a URI per shard). objects=True:
    the shards go to make_catalog as ObjectInfos, as a listing hands them over; False: as a table."""
    rng = np.random.default_rng(seed)
    counts = _counts(samples, shards, rng)
    sizes = counts * 40_000  # ~40 KB per sample (a LAION-like JPEG, its caption and its tar headers)
    numbers = np.arange(shards, dtype=np.int64)
    width = max(6, len(str(shards - 1)))
    table = pa.table(
        {
            "uri": _numbered(f"{root}/", numbers, width, ".tar"),
            "size": int_array(sizes),
            "etag": _etags(shards, seed),
        }
    )
    parts = {
        "shard": numbers,
        "count": counts,
        "every": np.zeros(shards, np.int64),
        "index_kind": np.ones(shards, np.int64),
        "index_uri": _numbered(f"{root}/", numbers, width, ".idx"),  # a DALI .idx beside each shard
        "index_offset": np.zeros(shards, np.int64),
        "index_length": counts * 64,
    }
    return make_catalog(
        root=root,
        storage=None,  # type: ignore[arg-type]  # nothing is read
        source=CountsOnly("webdataset"),
        shards=_objects(table) if objects else table,
        parts=parts,
        locators=("index_kind", "index_uri", "index_offset", "index_length"),
    )


def parquet_catalog(
    files: int = 10_000,
    row_groups: int = 10,
    rows: int = 1_000,
    *,
    seed: int = 0,
    root: str = "s3://tokens/train",
) -> Catalog:
    """`files` Parquet files of `row_groups` row groups of `rows` rows: the catalog `read_parquet` makes (a
    part per row group), built by the Parquet source from the row counts (`catalog_from_row_counts`)."""
    from raydl.sources.parquet import catalog_from_row_counts

    sizes = np.full(files, row_groups * 5_000_000 + 65_536, np.int64)  # ~5 MB a row group, and the footer
    width = max(5, len(str(files - 1)))
    table = pa.table(
        {
            "uri": _numbered(f"{root}/part-", np.arange(files, dtype=np.int64), width, ".parquet"),
            "size": int_array(sizes),
            "etag": _etags(files, seed),
        }
    )
    counts = [[rows] * row_groups for _ in range(files)]
    return catalog_from_row_counts(_objects(table), counts, storage=None, label_column="label")  # type: ignore[arg-type]


def token_catalog(
    tokens: int = 10**12, seq_len: int = 4096, *, root: str = "s3://tokens/megatron"
) -> Catalog:
    """The catalog read_tokens makes of one Megatron corpus of `tokens` tokens (a part per CHUNK_TOKENS of its
    stream, its windows counted as the listing counts them), from the count alone."""
    from raydl.sources.tokens import CHUNK_TOKENS

    firsts = np.arange(0, tokens, CHUNK_TOKENS, dtype=np.int64)
    part_tokens = np.minimum(CHUNK_TOKENS, tokens - firsts)
    windows = (tokens - 1) // seq_len
    starts = np.concatenate([firsts, [tokens]])
    first_window = np.minimum(-(-starts // seq_len), windows)
    n = len(firsts)
    shards = [ObjectInfo(f"{root}/corpus.bin", 2 * tokens, "b"), ObjectInfo(f"{root}/corpus.idx", 1, "i")]
    parts = {
        "shard": np.zeros(n, np.int64),
        "count": np.diff(first_window),
        "tokens": part_tokens,
        "first": firsts,
        "index": np.ones(n, np.int64),
        "rg": np.full(n, -1, np.int64),
    }
    return make_catalog(
        root=f"{root}/",
        storage=None,  # type: ignore[arg-type]  # nothing is read
        source=CountsOnly("tokens"),
        shards=shards,
        parts=parts,
    )


def imagenet_keys(classes: int = 1000, per_class: int = 1280, *, shuffled: bool = False) -> Iterator[str]:
    """ImageNet-like training keys, class by class: train/n01440764/n01440764_10026.JPEG. In key order
    (S3's), or shuffled=True: classes and the files in each in a fixed random order (os.walk's)."""
    rng = np.random.default_rng(0)
    for c in rng.permutation(classes) if shuffled else range(classes):
        wnid = f"n{1440764 + int(c) * 7919:08d}"
        for i in rng.permutation(per_class) if shuffled else range(per_class):
            yield f"train/{wnid}/{wnid}_{10026 + int(i) * 13}.JPEG"


class ImageNetListing:
    """A Storage that lists `classes` x `per_class` ImageNet-like images without holding them (only `list`
    works): on S3 (s3://`bucket`/train, in key order, with etags, as S3 lists) or, local=True, on local
    disk (/`bucket`/train, in os.walk's order, no etags, as LocalStorage lists)."""

    default_io_concurrency = 32

    def __init__(
        self, classes: int = 1000, per_class: int = 1280, *, local: bool = False, bucket: str = "imagenet"
    ):
        self.classes, self.per_class, self.local, self.bucket = classes, per_class, local, bucket

    def __len__(self) -> int:
        return self.classes * self.per_class

    @property
    def root(self) -> str:
        return f"/{self.bucket}/train" if self.local else f"s3://{self.bucket}/train"

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = f"/{self.bucket}/" if self.local else f"s3://{self.bucket}/"
        for key in imagenet_keys(self.classes, self.per_class, shuffled=self.local):
            uri = base + key
            if uri.startswith(prefix):
                digest = hashlib.md5(key.encode(), usedforsecurity=False).hexdigest()
                yield ObjectInfo(uri, 80_000 + int(digest[:4], 16) % 60_000, "" if self.local else digest)

    def stat(self, uri: str) -> ObjectInfo:
        raise NotImplementedError("a synthetic listing: no object can be read")

    def read_range(self, uri: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        raise NotImplementedError("a synthetic listing: no object can be read")

    def read(self, uri: str) -> bytes:
        raise NotImplementedError("a synthetic listing: no object can be read")


def make_empty_folder(root: str, classes: int, per_class: int) -> str:
    """`classes` x `per_class` empty files under root/train, named as `imagenet_keys` names them (a real
    folder on local disk for the listing to walk and stat); returns root/train."""
    made: set[str] = set()
    for key in imagenet_keys(classes, per_class):
        path = os.path.join(root, key)
        folder = os.path.dirname(path)
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    return os.path.join(root, "train")


def watch_opens(root: str) -> list[str]:
    """From now on, every file under `root` this process opens (Python's open and os.open; folders
    left out) is appended to the list returned. An audit hook: it stays for the process's life."""
    opened: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(root):
            if not os.path.isdir(args[0]):
                opened.append(args[0])

    sys.addaudithook(hook)
    return opened


@dataclass(frozen=True)
class Memory:
    """What building something cost the driver: the peak of what it allocated (tracemalloc's, plus what
    Arrow's pool holds at the end, which tracemalloc does not see), the growth of the process's peak RSS,
    what the result still holds, and the time."""

    peak_bytes: int
    rss_bytes: int | None  # None: not measured (rss=False), or not measurable here
    held_bytes: int
    seconds: float


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_mark() -> tuple[int, int]:
    """(this process's RSS now, its peak RSS), with the peak reset to now where Linux lets us
    (/proc/self/clear_refs), so a later `rss_growth` sees this build's peak, not an earlier one.
    ru_maxrss would not do: a child inherits its parent's, and it never comes down."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    now = _status_kb("VmRSS")
    if now is None:  # not Linux: the lifetime peak, in kilobytes on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak
    return now, _status_kb("VmHWM") or now


def rss_growth(mark: tuple[int, int]) -> int | None:
    """How far the peak RSS rose over the RSS at `mark`; None where the peak was not reset (an earlier,
    higher peak hides this one)."""
    now, peak_then = mark
    peak = _status_kb("VmHWM")
    if peak is None or peak_then > now:
        return None
    return max(peak - now, 0)


def measure_memory(build: Callable[[], object], *, rss: bool = True) -> tuple[object, Memory]:
    """build() twice: once bare, for the time and the rise of the process's peak RSS (`rss_mark`), once
    under tracemalloc, whose bookkeeping would swell the RSS and the time, for the peak of what it
    allocated. rss=False: only the traced build."""
    seconds, grew = 0.0, None
    if rss:
        gc.collect()
        mark = rss_mark()
        t0 = time.perf_counter()
        out = build()
        seconds = time.perf_counter() - t0
        grew = rss_growth(mark)
        del out
    gc.collect()
    arrow0 = pa.total_allocated_bytes()
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = build()
        traced_s = time.perf_counter() - t0
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    arrow = max(pa.total_allocated_bytes() - arrow0, 0)
    return out, Memory(peak + arrow, grew, held + arrow, seconds if rss else traced_s)


def plan_cost(catalog: Catalog, *, batch_size: int = 256, batches: int = 100, world_size: int = 8) -> float:
    """Seconds to plan one batch, averaged over `batches` batches of rank 0: the epoch order at the batch's
    positions, the ids, their augmentation seeds and `catalog.locate` (what the iterator and the worker's
    first step do per batch)."""
    from raydl.plan.order import EpochOrder, EpochPlan, augmentation_seeds

    n = len(catalog)
    order = EpochOrder(n, seed=0, epoch=0, shuffle=True, fingerprint=catalog.samples_fingerprint)
    plan = EpochPlan(n, world_size, batch_size, drop_last=True)
    batches = min(batches, plan.batches_per_rank)
    catalog.locate(plan.batch_ids(order, 0, 0))  # warm: first-call costs are not per batch
    t0 = time.perf_counter()
    for k in range(batches):
        ids = plan.batch_ids(order, 0, k)
        augmentation_seeds(ids, seed=0, epoch=0)
        part, pos = catalog.locate(ids)
    took = (time.perf_counter() - t0) / batches
    if not (part.size == batch_size and (pos >= 0).all()):
        raise AssertionError("locate gave positions outside their parts")
    return took
