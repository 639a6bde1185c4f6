"""Indexing a tar shard from its headers: where each member's bytes are, without reading them.

`index_tar` hops from header to header (a 512-byte block, then the member's
data rounded up to 512), reading through a small window so that small
members and the headers after them cost no extra read. It reads forward only,
so it also indexes a stream whose length is learned at its end (an inflating
.tar.gz: `size=None`), never holding more of it than a window. GNU long names
and pax `path`/`size` records are honoured, as Python's tarfile (and so the
webdataset library) reads them. The headers shards are made of (files, pax
headers, long names, with the numbers tarfile writes) are read here, a few
times faster than tarfile.TarInfo.frombuf, which reads any other.

The shard is untrusted, so the indexer always ends: every step moves at least
one 512-byte block forward, so a shard of n bytes takes at most n / 512 steps.
Anything malformed is a DataSourceError naming the shard and the byte offset
of the header at fault: a header that does not parse or whose checksum is
wrong, a negative or non-decimal size (base-256 or pax), a malformed pax
record, a GNU long name or pax header longer than `MAX_EXTENDED_HEADER`, a
GNU sparse member (its offsets would not be the file's bytes), and a member
whose data runs past the end of the shard.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass

from raydl.errors import DataSourceError

__all__ = ["MAX_EXTENDED_HEADER", "Member", "TarIndex", "index_tar"]

BLOCK = 512
_ZERO = bytes(BLOCK)
# A pax header or GNU long name is read whole into memory: names and a few numbers, never near this.
MAX_EXTENDED_HEADER = 1 << 20
_DECIMAL = re.compile(rb"[0-9]{1,20}")  # a pax length or size: ASCII digits only, no sign


@dataclass(frozen=True)
class Member:
    """A regular file in the shard: its name, and its data's offset and size."""

    name: str
    offset: int
    size: int


@dataclass
class TarIndex:
    members: list[Member]
    # member index -> payload, for members that came with the headers (<= small_limit)
    small: dict[int, bytes]


def _round_up(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _corrupt(uri: str, offset: int, why: str) -> DataSourceError:
    return DataSourceError(
        f"{uri}: corrupt tar header at offset {offset} ({why}); the shard is damaged", uri=uri
    )


def _pax_records(data: bytes, uri: str, offset: int) -> dict[str, str]:
    """The records "<length> <key>=<value>\\n" of the pax header at `offset`; NUL padding ends them."""
    out, pos = {}, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos, pos + 21)
        digits = data[pos:space] if space > pos else b""
        if not _DECIMAL.fullmatch(digits):
            raise DataSourceError(
                f"{uri}: corrupt pax header at offset {offset} (no record length at byte {pos})", uri=uri
            )
        end = pos + int(digits)
        # the shortest record is "<length> k=\n": the length counts itself, so every record moves pos on
        if end < space + 4 or end > len(data) or data[end - 1] != 0x0A:
            raise DataSourceError(
                f"{uri}: corrupt pax header at offset {offset} (record at byte {pos} of length "
                f"{int(digits)} does not end with a newline inside the header)",
                uri=uri,
            )
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not eq or not key:
            raise DataSourceError(
                f"{uri}: corrupt pax header at offset {offset} (record at byte {pos} has no key=value)",
                uri=uri,
            )
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


def _member_size(
    info: _Header | tarfile.TarInfo, pax: dict[str, str], pax_at: int, uri: str, pos: int
) -> int:
    """The size of the data after the header at `pos`: the `size` record's of the pax header at `pax_at`
    where there is one."""
    if "size" in pax and info.type not in (tarfile.XHDTYPE, tarfile.XGLTYPE):
        text = pax["size"].encode("utf-8", "surrogateescape")
        if not _DECIMAL.fullmatch(text):
            why = f"its pax header at offset {pax_at} gives size {pax['size'][:40]!r}, not a decimal number"
            raise _corrupt(uri, pos, why)
        return int(text)
    if info.size < 0:  # a base-256 size field can say any negative number
        raise _corrupt(uri, pos, f"negative size {info.size}")
    return info.size


@dataclass(frozen=True)
class _Header:
    """What index_tar needs of a header that `_plain_header` parsed (tarfile.TarInfo's names)."""

    name: str
    size: int
    type: bytes

    def isreg(self) -> bool:
        return self.type in tarfile.REGULAR_TYPES


# The headers _plain_header reads itself: a file, a pax header or a GNU long name, its numbers written as
# Python's tarfile (and so webdataset's TarWriter) and GNU tar write them (octal digits and a NUL; the
# checksum's six digits, a NUL and a space). Any other header goes to tarfile.TarInfo.frombuf.
_PLAIN_TYPES = (tarfile.REGTYPE, tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME)
_PLAIN_NUMBERS = re.compile(rb"[0-7]{7}\0[0-7]{7}\0[0-7]{7}\0([0-7]{11})\0[0-7]{11}\0([0-7]{6})\0 ")
_PLAIN_DEVICES = re.compile(rb"(?:[0-7]{7}\0|\0{8}){2}")  # device numbers, or none (NULs)


def _plain_header(header: bytes) -> _Header | None:
    """The header as tarfile.TarInfo.frombuf reads it, for the headers shards are made of (see
    _PLAIN_NUMBERS) with a right checksum, in a fraction of its time; None for any other header, which
    frombuf then reads (and refuses, where it is malformed)."""
    kind = header[156:157]
    if kind not in _PLAIN_TYPES:
        return None
    numbers = _PLAIN_NUMBERS.fullmatch(header, 100, 156)
    if numbers is None or _PLAIN_DEVICES.fullmatch(header, 329, 345) is None:
        return None
    if int(numbers[2], 8) != 256 + sum(header) - sum(header[148:156]):  # frombuf's unsigned checksum
        return None
    nul = header.find(b"\0", 0, 100)
    name = header[: 100 if nul < 0 else nul].decode("utf-8", "surrogateescape")
    nul = header.find(b"\0", 345, 500)
    prefix = header[345 : 500 if nul < 0 else nul].decode("utf-8", "surrogateescape")
    if prefix and kind not in tarfile.GNU_TYPES:
        name = prefix + "/" + name
    return _Header(name, int(numbers[1], 8), kind)


def _header_at(header: bytes, uri: str, pos: int) -> _Header | tarfile.TarInfo:
    """The header at offset `pos`: read here where it is one of the plain ones, else by tarfile (a
    DataSourceError where it does not parse)."""
    info = _plain_header(header)
    if info is None:
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except (tarfile.HeaderError, ValueError, OverflowError) as exc:
            raise _corrupt(uri, pos, str(exc) or type(exc).__name__) from exc
    return info


def _data_size(
    info: _Header | tarfile.TarInfo, pax: dict[str, str], pax_at: int, uri: str, pos: int, size: int | None
) -> int:
    """The size of the data after the header at `pos` (see `_member_size`), checked to end inside the
    shard of `size` bytes (None: not known yet, checked when it is), and to be at most MAX_EXTENDED_HEADER
    for a GNU long name or pax header."""
    n = _member_size(info, pax, pax_at, uri, pos)
    if size is not None:
        _check_inside(uri, pos, n, size)
    extended = info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE)
    if extended and n > MAX_EXTENDED_HEADER:
        raise _corrupt(uri, pos, f"a {n}-byte extended header, over the {MAX_EXTENDED_HEADER}-byte limit")
    return n


def _check_inside(uri: str, pos: int, n: int, size: int) -> None:
    """The member whose header is at `pos` needs `n` bytes after it: a DataSourceError if the shard of `size`
    bytes ends before them."""
    data_at = pos + BLOCK
    if data_at + n > size:
        raise DataSourceError(
            f"{uri}: truncated tar shard: the member at offset {pos} needs {n} bytes from "
            f"offset {data_at}, but the shard ends at {size}",
            uri=uri,
        )


def index_tar(
    read: Callable[[int, int], bytes],
    size: int | None,
    uri: str,
    *,
    window: int = 16 << 10,
    small_limit: int = 4096,
    length: Callable[[], int] | None = None,
) -> TarIndex:
    """Members of the uncompressed tar `uri` of `size` bytes; `read(offset, length)` fetches bytes, at offsets
    that only move forward. `size` None: a stream whose length is not known yet; `read` then gives fewer
    bytes than asked at its end, and `length()` gives its length (reading the rest of it)."""
    buf_start, buf = 0, b""

    def get(off: int, n: int) -> bytes:
        nonlocal buf_start, buf
        if not (buf_start <= off and off + n <= buf_start + len(buf)):
            want = max(n, window) if size is None else min(max(n, window), size - off)
            buf_start, buf = off, read(off, want)
        return buf[off - buf_start : off - buf_start + n]

    def ended(pos: int, n: int) -> int:
        """A streamed tar ended before the `n` bytes after the header at `pos`: its length, and the error
        where the member at `pos` needs more than it holds."""
        end = length()  # type: ignore[misc]
        if pos >= 0:
            _check_inside(uri, pos, n, end)
        return end

    def cached(off: int, n: int) -> bytes | None:
        return (
            buf[off - buf_start : off - buf_start + n]
            if buf_start <= off and off + n <= buf_start + len(buf)
            else None
        )

    if size is None and length is None:
        raise ValueError("index_tar of a stream (size=None) needs its length()")
    members: list[Member] = []
    small: dict[int, bytes] = {}
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    pax_at = 0
    last = (-1, 0)  # the header before `pos` and its data's size: a stream's end must not cut that data
    while size is None or pos + BLOCK <= size:
        header = get(pos, BLOCK)
        if len(header) < BLOCK:  # a stream that ended before this header
            size = ended(*last)
            break
        if header == _ZERO:
            break  # end-of-archive marker
        info = _header_at(header, uri, pos)
        data_at = pos + BLOCK
        n = _data_size(info, pax, pax_at, uri, pos, size)
        last = (pos, n)
        if info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE):
            extended = get(data_at, n)
            if len(extended) < n:  # a stream that ends inside it
                ended(pos, n)
        if info.type == tarfile.GNUTYPE_LONGNAME:
            long_name = extended.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif info.type == tarfile.XHDTYPE:
            pax, pax_at = _pax_records(extended, uri, pos), pos
        elif info.type in (tarfile.XGLTYPE, tarfile.GNUTYPE_LONGLINK):
            pass
        elif info.type == tarfile.GNUTYPE_SPARSE or any(k.startswith("GNU.sparse.") for k in pax):
            raise _corrupt(uri, pos, "a GNU sparse member, which a WebDataset shard cannot hold")
        else:
            name = pax.get("path") or long_name or info.name
            if info.isreg():
                members.append(Member(name, data_at, n))
                if n <= small_limit:
                    payload = cached(data_at, n)
                    if payload is not None:
                        small[len(members) - 1] = payload
            long_name, pax = None, {}
        pos = data_at + _round_up(n)  # n >= 0: at least one block forward
    if size is not None and pos < size and size - pos < BLOCK:  # not a whole header left
        raise DataSourceError(
            f"{uri}: truncated tar shard: {size - pos} stray bytes at offset {pos}", uri=uri
        )
    return TarIndex(members, small)
