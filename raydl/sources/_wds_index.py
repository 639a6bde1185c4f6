"""WebDataset shard indexes: where each member of a shard is, without a request per member.

A shard's *index block* is its regular tar members in order: (name, data
offset, size; raydl/sources/_wds_blocks.py, which groups them into samples).
It comes from one of:

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
  forward only; a compressed shard's inflated bytes stream past it the same
  way, so indexing holds a window of the shard, never the whole of it.

Every index is untrusted: what it makes us allocate is bounded by the shard's
size (a member takes at least one 512-byte header), offsets and sizes are
checked against the shard, and anything malformed is a DataSourceError naming
the index file (and the line or shard at fault). Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from raydl.errors import DataSourceError
from raydl.sources import _inflate
from raydl.sources._tar import BLOCK, index_tar
from raydl.sources._wds_blocks import (  # its names are re-exported: the index's callers find them here too
    MemberBlock,
    SampleBlock,
    WdsSample,
    base_plus_ext,
    check_block,
    decode_block,
    encode_block,
    group_samples,
    is_compressed,
    member_limit,
    samples_of,
    select_samples,
    signatures,
)
from raydl.storage.base import ObjectInfo, Storage, split_scheme, stream_object
from raydl.storage.cache_folder import DIR_FLAGS, READ_FLAGS

__all__ = [
    "MAX_INDEX_BYTES",
    "IndexEntry",
    "MemberBlock",
    "SampleBlock",
    "WdsSample",
    "WidsShard",
    "base_plus_ext",
    "build_block",
    "build_cached",
    "cache_get",
    "cache_key",
    "cache_put",
    "dali_limit",
    "decode_block",
    "encode_block",
    "group_samples",
    "is_compressed",
    "parse_dali",
    "parse_wids",
    "read_header",
    "read_index_file",
    "samples_of",
    "select_samples",
    "signatures",
    "write_index",
]

logger = logging.getLogger("raydl.sources.webdataset")

MAGIC = b"RAYDL-WDS-INDEX 1 "
MAX_INDEX_BYTES = 1 << 30  # one .idx, JSON shard list or index header is read whole: never past this
MAX_SIGNATURES = 256  # distinct field sets per shard kept in an index header (more: counted from the block)
_INT = re.compile(r"[0-9]{1,18}")  # below 2**63: an int64


# -- index files read whole ---------------------------------------------------------------------------


def read_index_file(storage: Storage, uri: str, limit: int = MAX_INDEX_BYTES) -> bytes:
    """The whole index file `uri` (a DALI .idx, a wids JSON), never more than `limit` bytes of it in memory:
    a local file's size is checked first, an object's as its one streamed GET goes."""
    if split_scheme(uri)[0] == "file" or getattr(storage, "stream", None) is None:
        size = storage.stat(uri).size if split_scheme(uri)[0] == "file" else None
        if size is not None and size > limit:
            raise DataSourceError(f"{uri}: a {size}-byte index, over the {limit}-byte limit", uri=uri)
        data = storage.read(uri)
    else:
        data = bytearray()
        for piece in storage.stream(uri):
            data += piece
            if len(data) > limit:
                break
    if len(data) > limit:
        raise DataSourceError(f"{uri}: a {len(data)}-byte index, over the {limit}-byte limit", uri=uri)
    return bytes(data)


def dali_limit(shard: ObjectInfo) -> int:
    """The most a DALI .idx of `shard` may hold: a line of tens of bytes per member, each member at least two
    512-byte tar blocks, so never the shard's own size (1 MiB at least)."""
    return min(MAX_INDEX_BYTES, max(1 << 20, shard.size))


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

    def length(self) -> int:
        """The stream's length in bytes: the rest of it is read (and dropped) to learn it."""
        end = self._at + len(self._buf)
        for piece in self._pieces:
            end += len(piece)
        return end


def build_block(storage: Storage, info: ObjectInfo, *, keep_inflated: bool = False) -> MemberBlock:
    """The members of shard `info` from ONE streamed read of it. A compressed shard's inflated bytes stream
    past the header reader, a window at a time (its whole inflated bytes where this process keeps them);
    `keep_inflated`: inflate it whole, kept for the reads that cut samples out of it next (a worker's)."""
    held = _inflate.held(info) if is_compressed(info.uri) else None
    if held is None and keep_inflated and is_compressed(info.uri):
        held = _inflate.inflated(storage, info)
    if held is not None:
        index = index_tar(lambda off, n: held[off : off + n], len(held), info.uri, small_limit=0)
    elif is_compressed(info.uri):
        reader = _Forward(_inflate.inflate_stream(storage, info), info.uri)
        index = index_tar(reader.read, None, info.uri, window=64 << 10, small_limit=0, length=reader.length)
        reader.drain()
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


def build_cached(storage: Storage, info: ObjectInfo) -> MemberBlock:
    """`build_block`, kept in the node cache under the shard's key as it was before the read: a local file
    rewritten while it is read is never cached under its new mtime with its old members."""
    key = cache_key(info)
    block = build_block(storage, info)
    cache_put(info, block, key=key)
    return block


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
    most, _ = member_limit(shard)
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
                    "'ext offset size name' with offset and size below 2**63 (a name with a space?)",
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
            # a sample is one member at least
            if e.sigs is not None and sum(e.sigs.values()) > member_limit(ObjectInfo(e.path, e.size))[0]:
                raise ValueError(
                    f"shard {i} ({e.path}): its signatures count {sum(e.sigs.values())} samples, more than "
                    f"its {e.size} bytes can hold"
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


def _our_folder(folder: str, *, create: bool) -> bool:
    """Whether `folder` is a real folder of this user's (made when missing, when `create`), made private:
    the index cache is used only there, never through a link or in a folder someone else controls (a
    warning, once, says it is off)."""
    for _ in range(3):  # a folder another process makes meanwhile is looked at again
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            if not create:
                return False
            try:
                os.makedirs(os.path.dirname(folder), exist_ok=True)
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
            except OSError:
                return False
            continue
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            if folder not in _WARNED:
                _WARNED.add(folder)
                logger.warning(
                    "raydl: %s is not a folder of this user's (a link, a file, or another user's): the "
                    "WebDataset index cache is off, so listing indexes shards again",
                    folder,
                )
            return False
        if stat.S_IMODE(st.st_mode) & 0o077:  # made by hand, or under a permissive umask: made private
            try:
                fd = os.open(folder, DIR_FLAGS)
                try:
                    os.fchmod(fd, 0o700)
                finally:
                    os.close(fd)
            except OSError:
                pass
        return True
    return False


_WARNED: set[str] = set()


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
    that does not parse or names another shard is a miss (and is removed), never an error. Only a regular
    file of this user's, in a real folder of this user's, is read (opened without following a link or
    waiting on a FIFO); anything else there is a miss, and left alone."""
    key = cache_key(info)
    if key is None:
        return None
    folder = _cache_folder()
    if not _our_folder(folder, create=False):
        return None
    path = os.path.join(folder, key[0])
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:  # missing, a link (ELOOP), unreadable
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            return None
    except OSError:
        os.close(fd)
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            size = st.st_size

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


def cache_put(info: ObjectInfo, block: MemberBlock, *, key: tuple[str, int] | None = None) -> None:
    """Keep `block` for shard `info` in the node cache (best effort: a read-only cache is only slower), under
    `key`: its `cache_key` taken before the shard was read (else now)."""
    key = key or cache_key(info)
    if key is None:
        return
    folder = _cache_folder()
    if not _our_folder(folder, create=True):
        return
    try:
        write_index(os.path.join(folder, key[0]), [(info.uri, info, key[1], block)], durable=False)
    except OSError:
        pass
