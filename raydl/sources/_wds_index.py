"""WebDataset shard indexes: where each member of a shard is, without a request per member.

A shard's *index block* is its regular tar members in order: (name, data
offset, size). Samples are always grouped from the names by `group_samples`
(the webdataset library's rules), whatever the block came from:

- DALI's `wds2idx` (`NAME.idx` or `NAME.tar.idx` beside the shard, v1.2 text:
  a line `v1.2 N`, then one line per DALI sample of `ext offset size name`
  quadruples): `parse_dali`;
- raydl's own index file (`RAYDL-WDS-INDEX 1 <header bytes>`, a JSON header
  line naming each shard's path, size, etag, sample signatures and where its
  block lies, then the binary blocks): `read_header` / `decode_block`. The
  node cache holds one such file per shard, keyed by (URI, etag), or (path,
  size, mtime_ns) for a local file, under `$RAYDL_CACHE_DIR/wds-index`;
- the shard itself, read once in ONE streamed read (`build_block`), its
  headers parsed by the hardened reader of raydl/sources/_tar.py going
  forward only.

Every index is untrusted: what it makes us allocate is bounded by the shard's
size (a member takes at least one 512-byte header), offsets and sizes are
checked against the shard, and anything malformed is a DataSourceError naming
the index file (and the line or shard at fault). Nothing is unpickled.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from raydl.errors import DataSourceError, ObjectChangedError
from raydl.sources._inflate import inflated, inflated_limit
from raydl.sources._tar import BLOCK, index_tar
from raydl.storage.base import ObjectInfo, Storage, stream_object

__all__ = [
    "MAX_INDEX_BYTES",
    "MemberBlock",
    "SampleBlock",
    "WdsSample",
    "base_plus_ext",
    "build_block",
    "cache_get",
    "cache_put",
    "decode_block",
    "encode_block",
    "group_samples",
    "is_compressed",
    "parse_dali",
    "parse_wids",
    "read_header",
    "samples_of",
    "select_samples",
    "signatures",
    "write_index",
]

MAGIC = b"RAYDL-WDS-INDEX 1 "
_BLOCK_MAGIC = b"RWB1"
MAX_INDEX_BYTES = 1 << 30  # one .idx, JSON shard list or index header is read whole: never past this
MAX_SIGNATURES = 256  # distinct field sets per shard kept in an index header (more: counted from the block)
_COMPRESSED = (".tar.gz", ".tgz")
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_INT = re.compile(r"[0-9]{1,19}")


def is_compressed(uri: str) -> bool:
    return uri.lower().endswith(_COMPRESSED)


# -- grouping (webdataset's rules) ------------------------------------------------------------------


def base_plus_ext(path: str) -> tuple[str | None, str | None]:
    """(key, field) of a member name, as webdataset splits it; (None, None) when the name has no dot."""
    m = _KEY_EXT.match(path)
    return (m.group(1), m.group(2)) if m else (None, None)


@dataclass(frozen=True)
class WdsSample:
    key: str
    fields: dict[str, int]  # field -> member index in the shard


def group_samples(names: Sequence[str], uri: str) -> list[WdsSample]:
    """The samples of one shard from its regular members' names, in order (webdataset's group_by_keys)."""
    out: list[WdsSample] = []
    cur: WdsSample | None = None
    for i, name in enumerate(names):
        if "/" not in name and name.startswith("__") and name.endswith("__"):
            continue
        if _SKIP_META.match(name):
            continue
        key, ext = base_plus_ext(name)
        if key is None:
            continue
        ext = ext.lower()
        if cur is None or key != cur.key:
            cur = WdsSample(key, {})
            out.append(cur)
        if ext in cur.fields:
            raise DataSourceError(
                f"{uri}: duplicate member {name!r} in sample {key!r} (field {ext!r} twice)", uri=uri
            )
        cur.fields[ext] = i
    return out


# -- blocks -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberBlock:
    """A shard's regular members in order: name, data offset, size."""

    names: list[str]
    offsets: np.ndarray  # int64
    sizes: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.names)


def _member_limit(shard: ObjectInfo) -> tuple[int, int]:
    """(most members, end of the bytes they may lie in) for `shard`: its size, or what it may inflate to."""
    end = inflated_limit(shard.size) if is_compressed(shard.uri) else shard.size
    return end // BLOCK, end


def check_block(block: MemberBlock, shard: ObjectInfo, where: str) -> None:
    """Offsets and sizes inside the shard, in order, apart; else a DataSourceError naming `where`."""
    most, end = _member_limit(shard)
    n = len(block)
    if n > most:
        raise DataSourceError(
            f"{where}: {n} members listed for {shard.uri}, more than its {shard.size} bytes can hold",
            uri=where,
        )
    off, size = block.offsets, block.sizes
    if n == 0:
        return
    bad = np.flatnonzero((off < BLOCK) | (size < 0) | (off + size > end))
    if bad.size:
        i = int(bad[0])
        raise DataSourceError(
            f"{where}: member {block.names[i]!r} at offset {int(off[i])} ({int(size[i])} bytes) lies outside "
            f"{shard.uri} ({shard.size} bytes)",
            uri=where,
        )
    over = np.flatnonzero(off[1:] < off[:-1] + size[:-1] + BLOCK)
    if over.size:
        i = int(over[0]) + 1
        raise DataSourceError(
            f"{where}: member {block.names[i]!r} at offset {int(off[i])} overlaps the member before it in "
            f"{shard.uri}",
            uri=where,
        )


def encode_block(block: MemberBlock) -> bytes:
    names = [n.encode("utf-8", "surrogateescape") for n in block.names]
    ends = np.cumsum([len(b) for b in names], dtype=np.int64) if names else np.zeros(0, np.int64)
    return b"".join(
        [
            _BLOCK_MAGIC,
            struct.pack("<Q", len(names)),
            np.asarray(block.offsets, "<i8").tobytes(),
            np.asarray(block.sizes, "<i8").tobytes(),
            ends.astype("<i8").tobytes(),
            b"".join(names),
        ]
    )


def decode_block(data: bytes, shard: ObjectInfo, where: str) -> MemberBlock:
    """A block written by `encode_block`, checked against `shard`; a DataSourceError naming `where`."""

    def bad(why: str) -> DataSourceError:
        return DataSourceError(f"{where}: corrupt index block for {shard.uri} ({why})", uri=where)

    if len(data) < 12 or data[:4] != _BLOCK_MAGIC:
        raise bad("no block header")
    (n,) = struct.unpack_from("<Q", data, 4)
    if n > (len(data) - 12) // 24:
        raise bad(f"{n} members claimed in {len(data)} bytes")
    arrays = np.frombuffer(data, "<i8", count=3 * n, offset=12).reshape(3, n).astype(np.int64)
    offsets, sizes, ends = arrays
    text = memoryview(data)[12 + 24 * n :]
    if n and (ends[-1] != len(text) or np.any(ends < 0) or np.any(np.diff(ends) < 0)):
        raise bad("name lengths do not add up")
    if not n and len(text):
        raise bad("trailing bytes")
    starts = np.concatenate([[0], ends[:-1]]) if n else ends
    raw = bytes(text)
    names = [raw[a:b].decode("utf-8", "surrogateescape") for a, b in zip(starts.tolist(), ends.tolist())]
    block = MemberBlock(names, offsets, sizes)
    check_block(block, shard, where)
    return block


# -- samples of a block -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleBlock:
    """The samples of one shard as a worker reads them: position p is the p-th counted sample.

    A sample's range [start, start + length) spans the members of its selected fields (they lie next to
    each other: a sample is a run of consecutive members). Column f of `at`, `size` and `choice` is
    selected field f: where its member lies inside the range (-1: the sample has none of the field's
    extensions), its size, and which of its extensions it is (-1: none). The legacy selection
    (`samples_of`) is the image (its alternatives) then the label."""

    keys: list[str]
    start: np.ndarray  # int64 (n,)
    length: np.ndarray  # int64 (n,)
    at: np.ndarray  # int64 (n, fields)
    size: np.ndarray  # int64 (n, fields)
    choice: np.ndarray  # int16 (n, fields)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """About what the block holds in memory: its arrays, and its keys as Python strings."""
        arrays = (self.start, self.length, self.at, self.size, self.choice)
        return sum(a.nbytes for a in arrays) + sum(len(k) + 56 for k in self.keys)

    # the legacy selection's columns: field 0 the image, field 1 the label (where there is a label_field)
    @property
    def image_at(self) -> np.ndarray:
        return self.at[:, 0]

    @property
    def image_len(self) -> np.ndarray:
        return self.size[:, 0]

    @property
    def label_at(self) -> np.ndarray:
        return self.at[:, 1] if self.at.shape[1] > 1 else np.full(len(self), -1, np.int64)

    @property
    def label_len(self) -> np.ndarray:
        return self.size[:, 1] if self.size.shape[1] > 1 else np.zeros(len(self), np.int64)

    @property
    def missing(self) -> np.ndarray:
        """The samples without the first field (no image, in the legacy selection)."""
        return self.at[:, 0] < 0


def _shown(key: str) -> str:
    # a name that is not UTF-8 (kept as tarfile keeps it, in surrogates) is shown with \x escapes
    return key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def select_samples(
    block: MemberBlock, uri: str, select: Sequence[Sequence[str]], *, needs_first: bool = False
) -> SampleBlock:
    """The samples of a shard's block with, for each selected field (its extensions, the first one present
    wins), where its member lies; every sample, or only those with the first field (`needs_first`)."""
    width = len(select)
    keys, rows, firsts = [], [], []
    for s in group_samples(block.names, uri):
        row = []
        for exts in select:
            found = next(((s.fields[e], k) for k, e in enumerate(exts) if e in s.fields), (-1, -1))
            row.append(found)
        if needs_first and row[0][0] < 0:
            continue
        keys.append(_shown(s.key))
        rows.append(row)
        firsts.append(min(s.fields.values()))
    idx = np.array(rows, np.int64).reshape(-1, width, 2)
    member, choice = idx[..., 0], idx[..., 1]
    present = member >= 0
    off = np.where(present, block.offsets[np.maximum(member, 0)], 0)
    size = np.where(present, block.sizes[np.maximum(member, 0)], 0)
    first = block.offsets[np.array(firsts, np.int64)]
    none = ~present.any(axis=1)  # no selected member: an empty range at the sample's first member
    far = np.iinfo(np.int64).max
    start = np.where(none, first, np.where(present, off, far).min(axis=1, initial=far))
    end = np.where(none, first, np.where(present, off + size, 0).max(axis=1, initial=0))
    return SampleBlock(
        keys=keys,
        start=start,
        length=end - start,
        at=np.where(present, off - start[:, None], -1),
        size=size,
        choice=choice.astype(np.int16),
    )


def samples_of(
    block: MemberBlock,
    uri: str,
    image_fields: tuple[str, ...],
    label_field: str | None,
    *,
    every: bool = False,
) -> SampleBlock:
    """The samples with one of `image_fields` (all samples with `every`) of a shard's block, in order: field
    0 the image, field 1 the label member (where `label_field` is given)."""
    select = (tuple(image_fields),) + (((label_field,),) if label_field is not None else ())
    return select_samples(block, uri, select, needs_first=not every)


def signatures(block: MemberBlock, uri: str) -> dict[str, int]:
    """How many samples have each set of fields ("cls,jpg": 90): a header then counts any image_fields."""
    out: collections.Counter[str] = collections.Counter()
    for s in group_samples(block.names, uri):
        out[",".join(sorted(s.fields))] += 1
    return dict(out)


def count_from_signatures(sigs: dict[str, int], image_fields: tuple[str, ...], every: bool) -> int:
    wanted = set(image_fields)
    return sum(n for sig, n in sigs.items() if every or wanted & set(sig.split(",")))


def fields_of_signatures(sigs: dict[str, int]) -> set[str]:
    """Every field some sample of the signatures has."""
    return {f for sig in sigs for f in sig.split(",") if f}


# -- building a block: one streamed read of the shard -----------------------------------------------


class _Forward:
    """`read(offset, n)` over a stream of pieces, for offsets that only move forward (index_tar's)."""

    def __init__(self, pieces: Iterator[bytes], uri: str) -> None:
        self._pieces, self._uri = pieces, uri
        self._buf = bytearray()
        self._at = 0  # stream offset of _buf[0]

    def read(self, offset: int, n: int) -> bytes:
        if offset < self._at:
            raise AssertionError(f"{self._uri}: the tar reader went back to offset {offset}")
        drop = min(offset - self._at, len(self._buf))
        del self._buf[:drop]
        self._at += drop
        while self._at + len(self._buf) < offset + n:
            piece = next(self._pieces, None)
            if piece is None:
                break
            skip = offset - self._at
            if skip >= len(piece):  # a member's data we only pass by
                self._at += len(piece)
                continue
            if skip > 0:
                piece = piece[skip:]
                self._at += skip
            self._buf += piece
        return bytes(self._buf[offset - self._at : offset - self._at + n])

    def drain(self) -> None:
        for _ in self._pieces:  # the rest of the stream (an archive's end blocks): one request all the same
            pass


def build_block(storage: Storage, info: ObjectInfo) -> MemberBlock:
    """The members of shard `info` from ONE streamed read of it (inflated first where compressed)."""
    if is_compressed(info.uri):
        stream = inflated(storage, info)
        index = index_tar(lambda off, n: stream[off : off + n], len(stream), info.uri, small_limit=0)
    else:
        reader = _Forward(stream_object(storage, info), info.uri)
        index = index_tar(reader.read, info.size, info.uri, window=64 << 10, small_limit=0)
        reader.drain()
    members = index.members
    return MemberBlock(
        [m.name for m in members],
        np.array([m.offset for m in members], np.int64),
        np.array([m.size for m in members], np.int64),
    )


# -- DALI's wds2idx v1.2 ----------------------------------------------------------------------------


def parse_dali(data: bytes, where: str, shard: ObjectInfo) -> MemberBlock:
    """The members that the DALI index `data` (file `where`) lists for `shard`, in shard order.

    Names with spaces cannot be told apart from the fields around them: a line whose quadruples do not
    parse, or whose `ext` is not its name's, is refused, as is anything outside the shard."""
    if len(data) > MAX_INDEX_BYTES:
        raise DataSourceError(f"{where}: a {len(data)}-byte index, over {MAX_INDEX_BYTES} bytes", uri=where)
    try:
        text = data.decode("utf-8", "surrogateescape")
    except UnicodeDecodeError as exc:  # pragma: no cover - surrogateescape decodes anything
        raise DataSourceError(f"{where}: not a text index ({exc})", uri=where) from exc
    lines = text.split("\n")
    head = lines[0].split(" ")
    if len(head) != 2 or head[0] != "v1.2" or not _INT.fullmatch(head[1]):
        raise DataSourceError(
            f"{where}: not a DALI v1.2 index (first line {lines[0][:60]!r}, expected 'v1.2 N')", uri=where
        )
    n = int(head[1])
    body = [line for line in lines[1:] if line.strip()]
    if n != len(body):
        raise DataSourceError(f"{where}: says {n} samples, has {len(body)} lines", uri=where)
    most, _ = _member_limit(shard)
    names, offsets, sizes = [], [], []
    for lineno, line in enumerate(body, start=2):
        parts = line.split(" ")
        if len(parts) % 4 or not parts:
            raise DataSourceError(
                f"{where}: line {lineno} is not 'ext offset size name' quadruples (a name with a space?)",
                uri=where,
            )
        for k in range(0, len(parts), 4):
            ext, off, size, name = parts[k : k + 4]
            dot = name.find(".", name.rfind("/") + 1)
            if not (_INT.fullmatch(off) and _INT.fullmatch(size)) or dot < 0 or name[dot + 1 :] != ext:
                raise DataSourceError(
                    f"{where}: line {lineno}: member {k // 4} ({' '.join(parts[k : k + 4])[:80]!r}) is not "
                    "'ext offset size name' (a name with a space?)",
                    uri=where,
                )
            names.append(name)
            offsets.append(int(off))
            sizes.append(int(size))
            if len(names) > most:
                raise DataSourceError(
                    f"{where}: more members than {shard.uri} ({shard.size} bytes) can hold", uri=where
                )
    block = MemberBlock(names, np.array(offsets, np.int64), np.array(sizes, np.int64))
    check_block(block, shard, where)
    return block


# -- wids shard lists -------------------------------------------------------------------------------


@dataclass(frozen=True)
class WidsShard:
    url: str  # resolved: absolute, or relative to the JSON's folder made whole
    nsamples: int
    filesize: int | None


def parse_wids(data: bytes, where: str) -> list[WidsShard]:
    """The shards of a wids-style JSON shard list (`"__kind__": "wids-shard-index-v1"`), urls resolved
    against the JSON's folder unless absolute or with a scheme."""
    if len(data) > MAX_INDEX_BYTES:
        raise DataSourceError(f"{where}: a {len(data)}-byte shard list, over {MAX_INDEX_BYTES}", uri=where)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise DataSourceError(f"{where}: not a JSON shard list ({exc})", uri=where) from exc
    if not isinstance(doc, dict) or doc.get("__kind__") != "wids-shard-index-v1":
        kind = doc.get("__kind__") if isinstance(doc, dict) else type(doc).__name__
        raise DataSourceError(
            f"{where}: not a wids shard list (__kind__ {kind!r}, expected 'wids-shard-index-v1')", uri=where
        )
    entries = doc.get("shardlist")
    if not isinstance(entries, list) or not entries:
        raise DataSourceError(f"{where}: 'shardlist' is not a non-empty list", uri=where)
    folder = where[: where.rfind("/") + 1] if "/" in where else ""
    out = []
    for i, e in enumerate(entries):
        url = e.get("url") if isinstance(e, dict) else None
        n = e.get("nsamples") if isinstance(e, dict) else None
        size = e.get("filesize") if isinstance(e, dict) else None
        ok_size = size is None or (type(size) is int and size >= 0)
        if not isinstance(url, str) or not url or type(n) is not int or n < 0 or not ok_size:
            raise DataSourceError(
                f"{where}: shardlist[{i}] needs a 'url' string, an 'nsamples' integer >= 0 and an optional "
                f"'filesize' integer >= 0; got {json.dumps(e)[:120]}",
                uri=where,
            )
        if size is not None and n > size // BLOCK:
            raise DataSourceError(
                f"{where}: shardlist[{i}] ({url}) claims {n} samples in {size} bytes", uri=where
            )
        if "://" not in url and not url.startswith("/"):
            url = folder + url
        out.append(WidsShard(url, n, size))
    return out


# -- raydl's own index files ------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexEntry:
    """One shard in a raydl index file: what it was when indexed, and where its block lies in the file."""

    path: str  # relative to the index file's folder, or a whole URI
    size: int
    etag: str
    mtime_ns: int  # local files (no etag); 0 elsewhere
    sigs: dict[str, int] | None
    offset: int  # absolute, in the index file
    length: int
    crc: int | None = None  # zlib.crc32 of the block's bytes (node cache entries, written without fsync)


def write_index(
    path: str, entries: Sequence[tuple[str, ObjectInfo, int, MemberBlock]], *, durable: bool = True
) -> None:
    """Write a raydl index file of (relative path, shard, mtime_ns, block) atomically (tmp, rename), and
    durably (fsync of the file and its folder) unless `durable` is False: a node cache entry, which a crash
    may leave torn but never read as good (its header must parse and each block's CRC-32 match)."""
    blobs, header = [], []
    at = 0
    for rel, info, mtime_ns, block in entries:
        blob = encode_block(block)
        header.append(
            {
                "path": rel,
                "size": info.size,
                "etag": info.etag,
                "mtime_ns": mtime_ns,
                "sigs": _sigs_or_none(block, info.uri),
                "offset": at,
                "length": len(blob),
                "crc": zlib.crc32(blob),
            }
        )
        blobs.append(blob)
        at += len(blob)
    head = json.dumps({"shards": header}, separators=(",", ":")).encode() + b"\n"
    first = MAGIC + str(len(head)).encode() + b"\n"
    _atomic_write(path, [first, head, *blobs], durable=durable)


def _sigs_or_none(block: MemberBlock, uri: str) -> dict[str, int] | None:
    sigs = signatures(block, uri)
    return sigs if len(sigs) <= MAX_SIGNATURES else None


def _atomic_write(path: str, pieces: Sequence[bytes], *, durable: bool = True) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            for p in pieces:
                f.write(p)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would make it (mkstemp's is 0600): an index ships with data
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if not durable:
        return
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


_HEAD_PROBE = 64 << 10


def read_header(read, size: int, where: str) -> list[IndexEntry]:
    """The entries of the raydl index file `where` of `size` bytes; `read(offset, n)` reads it."""
    first = read(0, min(size, _HEAD_PROBE))
    nl = first.find(b"\n")
    if not first.startswith(MAGIC) or nl < 0 or not _INT.fullmatch(first[len(MAGIC) : nl].decode("latin-1")):
        raise DataSourceError(f"{where}: not a raydl index file (no 'RAYDL-WDS-INDEX 1 N' line)", uri=where)
    head_len = int(first[len(MAGIC) : nl])
    data_at = nl + 1 + head_len
    if head_len > MAX_INDEX_BYTES or data_at > size:
        raise DataSourceError(f"{where}: its header claims {head_len} bytes, the file has {size}", uri=where)
    head = first[nl + 1 : data_at] if data_at <= len(first) else read(nl + 1, head_len)
    try:
        doc = json.loads(head)
        rows = doc["shards"]
        if not isinstance(rows, list):
            raise TypeError("shards is not a list")
        out = []
        for i, r in enumerate(rows):
            e = IndexEntry(
                path=_typed(r["path"], str),
                size=_typed(r["size"], int),
                etag=_typed(r["etag"], str),
                mtime_ns=_typed(r.get("mtime_ns", 0), int),
                sigs=_sigs(r.get("sigs")),
                offset=data_at + _typed(r["offset"], int),
                length=_typed(r["length"], int),
                crc=None if r.get("crc") is None else _typed(r["crc"], int),
            )
            if e.offset < data_at or e.length < 12 or e.offset + e.length > size or e.size < 0:
                raise ValueError(
                    f"shard {i} ({e.path}): its block at {e.offset}+{e.length} is outside the file"
                )
            out.append(e)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise DataSourceError(f"{where}: corrupt index header ({exc})", uri=where) from exc
    return out


def _typed(value, kind: type):
    if type(value) is not kind or (kind is int and value < 0):
        raise TypeError(f"{value!r} is not a {kind.__name__}" + (" >= 0" if kind is int else ""))
    return value


def _sigs(value) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_SIGNATURES:
        raise TypeError("sigs is not a small object")
    return {_typed(k, str): _typed(v, int) for k, v in value.items()}


# -- the node cache ---------------------------------------------------------------------------------


def _cache_folder() -> str:
    from raydl.env import cache_dir

    return os.path.join(cache_dir(), "wds-index")


def cache_key(info: ObjectInfo) -> tuple[str, int] | None:
    """(file name in the cache, mtime_ns) of shard `info`: by (URI, etag), or a local file's (path, size,
    mtime_ns); None for a local file that is not there (its read will say so)."""
    if info.etag:
        ident, mtime_ns = f"{info.uri}\0{info.size}\0{info.etag}", 0
    else:
        try:
            st = os.stat(info.uri)
        except OSError:
            return None
        ident, mtime_ns = f"{os.path.abspath(info.uri)}\0{st.st_size}\0{st.st_mtime_ns}", st.st_mtime_ns
    return hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:40] + ".rwi", mtime_ns


def _cache_match(e: IndexEntry, info: ObjectInfo, mtime_ns: int) -> bool:
    return e.path == info.uri and e.size == info.size and e.etag == info.etag and e.mtime_ns == mtime_ns


def cache_get(info: ObjectInfo, *, header_only: bool = False) -> tuple[IndexEntry, MemberBlock | None] | None:
    """The cached entry (and block, unless `header_only`) of shard `info`, or None on a miss. A cache file
    that does not parse or names another shard is a miss (and is removed), never an error."""
    key = cache_key(info)
    if key is None:
        return None
    path = os.path.join(_cache_folder(), key[0])
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size

            def read(off: int, n: int) -> bytes:
                f.seek(off)
                return f.read(n)

            entries = read_header(read, size, path)
            if len(entries) != 1 or not _cache_match(entries[0], info, key[1]):
                return None
            e = entries[0]
            if header_only and e.sigs is not None:
                return e, None
            data = read(e.offset, e.length)
            if e.crc is not None and zlib.crc32(data) != e.crc:
                raise DataSourceError(
                    f"{path}: a torn cache entry (its block's CRC-32 does not match)", uri=path
                )
            return e, decode_block(data, info, path)
    except FileNotFoundError:
        return None
    except (OSError, DataSourceError):
        try:
            os.unlink(path)
        except OSError:
            pass
        return None


def cache_put(info: ObjectInfo, block: MemberBlock) -> None:
    """Keep `block` for shard `info` in the node cache (best effort: a read-only cache is only slower)."""
    key = cache_key(info)
    if key is None:
        return
    try:
        write_index(os.path.join(_cache_folder(), key[0]), [(info.uri, info, key[1], block)], durable=False)
    except OSError:
        pass


# -- a bounded LRU of sample blocks per process ------------------------------------------------------

# A globally shuffled batch touches as many shards as it has samples, so a worker keeps the blocks of many
# shards, bounded by their bytes, not their number: 256 MiB holds about 2 M samples' offsets and keys
# (ImageNet as WebDataset, whole); past that, blocks are loaded again from the node cache as batches ask.
LRU_BYTES = 256 << 20


class BlockLRU:
    """The SampleBlocks this process loaded last, at most `max_bytes` of them (and always the newest), by
    (uri, etag, size, fields, label, every)."""

    def __init__(self, max_bytes: int = LRU_BYTES) -> None:
        self.max_bytes = max_bytes
        self._d: collections.OrderedDict[tuple, SampleBlock] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> SampleBlock | None:
        with self._lock:
            hit = self._d.get(key)
            if hit is not None:
                self._d.move_to_end(key)
            return hit

    def put(self, key: tuple, value: SampleBlock) -> None:
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._d[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes and len(self._d) > 1:
                _, dropped = self._d.popitem(last=False)
                self._bytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0


def check_count(blk: SampleBlock, count: int, info: ObjectInfo, what: str) -> None:
    if len(blk) != count:
        raise ObjectChangedError(
            f"{info.uri} changed after it was listed: {len(blk)} samples in it now, {count} listed ({what})",
            uri=info.uri,
        )
