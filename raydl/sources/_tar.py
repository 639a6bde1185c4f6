"""Indexing a tar shard from its headers: where each member's bytes are, without reading them.

`index_tar` hops from header to header (a 512-byte block, then the member's
data rounded up to 512), reading through a small window so that small
members and the headers after them cost no extra read. GNU long names and
pax `path`/`size` records are honoured, as Python's tarfile (and so the
webdataset library) reads them. A header that does not parse or a member that
runs past the end is a DataSourceError naming the shard and the offset.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from dataclasses import dataclass

from raydl.errors import DataSourceError

__all__ = ["Member", "TarIndex", "index_tar"]

BLOCK = 512
_ZERO = bytes(BLOCK)


@dataclass(frozen=True)
class Member:
    """A regular file in the shard: its name, and its data's offset and size."""

    name: str
    offset: int
    size: int


@dataclass
class TarIndex:
    members: list[Member]
    small: dict[
        int, bytes
    ]  # member index -> payload, for members that came with the headers (<= small_limit)


def _round_up(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _pax_records(data: bytes, uri: str, offset: int) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] not in (b"\0", b""):
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError as exc:
            raise DataSourceError(f"{uri}: corrupt pax header at offset {offset}", uri=uri) from exc
        if length <= 0:
            raise DataSourceError(f"{uri}: corrupt pax header at offset {offset}", uri=uri)
        record = data[space + 1 : pos + length - 1]
        key, _, value = record.partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def index_tar(
    read: Callable[[int, int], bytes], size: int, uri: str, *, window: int = 16 << 10, small_limit: int = 4096
) -> TarIndex:
    """Members of the uncompressed tar `uri` of `size` bytes; `read(offset, length)` fetches bytes."""
    buf_start, buf = 0, b""

    def get(off: int, n: int) -> bytes:
        nonlocal buf_start, buf
        if not (buf_start <= off and off + n <= buf_start + len(buf)):
            buf_start, buf = off, read(off, min(max(n, window), size - off))
        return buf[off - buf_start : off - buf_start + n]

    def cached(off: int, n: int) -> bytes | None:
        return (
            buf[off - buf_start : off - buf_start + n]
            if buf_start <= off and off + n <= buf_start + len(buf)
            else None
        )

    members: list[Member] = []
    small: dict[int, bytes] = {}
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    while pos + BLOCK <= size:
        header = get(pos, BLOCK)
        if header == _ZERO:
            break  # end-of-archive marker
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise DataSourceError(
                f"{uri}: corrupt tar header at offset {pos} ({exc}); the shard is damaged", uri=uri
            ) from exc
        data_at = pos + BLOCK
        n = (
            int(pax.get("size", info.size))
            if info.type not in (tarfile.XHDTYPE, tarfile.XGLTYPE)
            else info.size
        )
        if data_at + n > size:
            raise DataSourceError(
                f"{uri}: truncated tar shard: the member at offset {pos} needs {n} bytes from "
                f"offset {data_at}, but the shard ends at {size}",
                uri=uri,
            )
        if info.type == tarfile.GNUTYPE_LONGNAME:
            long_name = get(data_at, n).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif info.type == tarfile.XHDTYPE:
            pax = _pax_records(get(data_at, n), uri, pos)
        elif info.type in (tarfile.XGLTYPE, tarfile.GNUTYPE_LONGLINK):
            pass
        else:
            name = pax.get("path") or long_name or info.name
            if info.isreg():
                members.append(Member(name, data_at, n))
                if n <= small_limit:
                    payload = cached(data_at, n)
                    if payload is not None:
                        small[len(members) - 1] = payload
            long_name, pax = None, {}
        pos = data_at + _round_up(n)
    else:
        if pos < size and size - pos < BLOCK:  # not a whole header left
            raise DataSourceError(
                f"{uri}: truncated tar shard: {size - pos} stray bytes at offset {pos}", uri=uri
            )
    return TarIndex(members, small)
