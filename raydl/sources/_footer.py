"""The parts of a Parquet footer that listing needs, read and checked by raydl before pyarrow sees them.

A footer is a Thrift (compact protocol) FileMetaData. pyarrow parses it too,
but some of its accessors abort the whole process on a corrupt footer
(pyarrow 26: `RowGroupMetaData.column(i)` on a bad level histogram throws a
C++ exception that nothing catches), and listing must survive any file. So
the row groups' sizes, the column chunk ranges and the leaf columns' types come
from this small reader,
which ends on every input (every read moves forward; depth and counts are
bounded by the bytes left) and checks every number it returns: a file's rows
within `MAX_ROWS_PER_BYTE` times its size or `ROWS_FLOOR`, whichever is more, chunks inside the
file's data (after the leading magic, before the footer), one chunk per leaf
column. Anything else is a DataSourceError naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass

from raydl.errors import DataSourceError

__all__ = ["Footer", "LeafType", "RowGroup", "read_footer_meta"]

# How many rows a footer may claim: the plan draws a permutation of every sample id, so a crafted footer must
# not claim 10**12. No per-byte bound is sound (RLE stores a million equal values in a few bytes: a 20 KB file
# of two constant int columns holds 1,000,000 rows), so a file may claim MAX_ROWS_PER_BYTE rows per byte of
# itself or ROWS_FLOOR rows, whichever is more: a lie costs at most ROWS_FLOOR sample ids (32 MiB of plan).
MAX_ROWS_PER_BYTE = 8
ROWS_FLOOR = 1 << 22
_MAX_DEPTH = 24
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)


class _Corrupt(Exception):
    pass


class _Reader:
    """A Thrift compact protocol reader over `data` that raises _Corrupt rather than run past it."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Corrupt(f"the metadata ends at byte {self.pos} inside a value")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        out = shift = 0
        for _ in range(10):
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
        raise _Corrupt(f"a varint longer than 10 bytes at byte {self.pos}")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise _Corrupt(f"a {n}-byte value at byte {self.pos} runs past the metadata's end")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def count(self, n: int) -> int:
        if n > len(self.data) - self.pos:  # every element takes at least a byte
            raise _Corrupt(
                f"a collection of {n} elements at byte {self.pos} in {len(self.data) - self.pos} bytes"
            )
        return n

    def value(self, kind: int, depth: int):
        if depth > _MAX_DEPTH:
            raise _Corrupt(f"values nested more than {_MAX_DEPTH} deep")
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            return self.take(8)
        if kind == _BINARY:
            return self.take(self.varint())
        if kind in (_LIST, _SET):
            head = self.byte()
            n, elem = head >> 4, head & 0x0F
            if n == 15:
                n = self.varint()
            n = self.count(n)
            if elem in (_TRUE, _FALSE):  # in a list, a bool is a byte of its own
                return [self.byte() == 1 for _ in range(n)]
            return [self.value(elem, depth + 1) for _ in range(n)]
        if kind == _MAP:
            n = self.count(self.varint())
            if n == 0:
                return []
            types = self.byte()
            return [
                (self.value(types >> 4, depth + 1), self.value(types & 0x0F, depth + 1)) for _ in range(n)
            ]
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise _Corrupt(f"unknown Thrift type {kind} at byte {self.pos}")

    def struct(self, depth: int = 0) -> dict[int, object]:
        out: dict[int, object] = {}
        fid = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == _STOP:
                return out
            delta = head >> 4
            fid = fid + delta if delta else self.zigzag()
            out[fid] = self.value(kind, depth)


@dataclass(frozen=True)
class RowGroup:
    num_rows: int
    chunks: tuple[tuple[int, int], ...]  # per leaf column: (offset, length) of its column chunk
    decoded: tuple[int, ...] = ()  # per leaf column: about the bytes of its values decoded (`decoded_bytes`)
    # per leaf column: the chunk's num_values (values and nulls, at the leaf: a list column's elements), and
    # its statistics' null_count; -1 where the footer leaves them out
    values: tuple[int, ...] = ()
    nulls: tuple[int, ...] = ()


_PHYSICAL = ("BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY")
_CONVERTED = ("UTF8", "MAP", "MAP_KEY_VALUE", "LIST", "ENUM", "DECIMAL", "DATE", "TIME_MILLIS",
              "TIME_MICROS", "TIMESTAMP_MILLIS", "TIMESTAMP_MICROS", "UINT_8", "UINT_16", "UINT_32",
              "UINT_64", "INT_8", "INT_16", "INT_32", "INT_64", "JSON", "BSON", "INTERVAL")  # fmt: skip
_INTEGER_CONVERTED = frozenset(range(11, 19))  # UINT_8 .. INT_64
_LOGICAL = {1: "STRING", 2: "MAP", 3: "LIST", 4: "ENUM", 5: "DECIMAL", 6: "DATE", 7: "TIME", 8: "TIMESTAMP",
            10: "INTEGER", 11: "UNKNOWN", 12: "JSON", 13: "BSON", 14: "UUID", 15: "FLOAT16", 16: "VARIANT",
            17: "GEOMETRY", 18: "GEOGRAPHY"}  # fmt: skip
_INTEGER_LOGICAL = frozenset({10})


@dataclass(frozen=True)
class LeafType:
    """A leaf column's type as its schema element says it: the physical type, and the converted (legacy) and
    logical type ids, -1 where absent."""

    physical: int
    converted: int = -1
    logical: int = -1

    @property
    def is_integer(self) -> bool:
        """Whether the values are plain integers (INT32/INT64, signed or not; no dates, times, decimals)."""
        return (
            self.physical in (1, 2)
            and (self.converted == -1 or self.converted in _INTEGER_CONVERTED)
            and (self.logical == -1 or self.logical in _INTEGER_LOGICAL)
        )

    def __str__(self) -> str:
        name = _PHYSICAL[self.physical] if 0 <= self.physical < len(_PHYSICAL) else f"type {self.physical}"
        if self.logical != -1:
            return f"{name} ({_LOGICAL.get(self.logical, f'logical type {self.logical}')})"
        if self.converted != -1:
            conv = self.converted
            return f"{name} ({_CONVERTED[conv] if 0 <= conv < len(_CONVERTED) else f'converted type {conv}'})"
        return name


@dataclass(frozen=True)
class Footer:
    leaves: tuple[str, ...]  # leaf column paths, "a.b" for a struct's child
    row_groups: tuple[RowGroup, ...]
    types: tuple[LeafType, ...] = ()  # per leaf, as `leaves`


def _field(d: object, fid: int, kind: type, what: str, default=None):
    value = d.get(fid, default) if isinstance(d, dict) else None
    if value is None and default is not None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise _Corrupt(f"{what} is missing or not a {kind.__name__}")
    return value


def _count(value: object) -> int:
    """A count the footer may leave out: the int if it is one (>= 0), else -1."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1


def _leaf_type(element: object) -> LeafType:
    physical = _field(element, 1, int, "a leaf's type", -1)
    converted = _field(element, 6, int, "a leaf's converted_type", -1)
    logical = element.get(10) if isinstance(element, dict) else None
    # LogicalType is a union: one field set, its id naming the type
    kind = next(iter(logical)) if isinstance(logical, dict) and len(logical) == 1 else -1
    return LeafType(physical, converted, kind)


def _leaves(schema: list) -> tuple[tuple[str, ...], tuple[LeafType, ...]]:
    """Leaf paths and types of a flattened schema tree (each element's num_children say how many follow under
    it)."""
    if not schema:
        raise _Corrupt("the schema is empty")
    leaves: list[str] = []
    types: list[LeafType] = []
    # (path of the group, children still to come); the root's name is not part of a path
    stack: list[tuple[str, int]] = [("", _field(schema[0], 5, int, "the root's num_children", 0))]
    for element in schema[1:]:
        while stack and stack[-1][1] == 0:
            stack.pop()
        if not stack:
            raise _Corrupt("the schema has elements after its root's last child")
        path, left = stack[-1]
        stack[-1] = (path, left - 1)
        name = _field(element, 4, bytes, "a schema element's name").decode("utf-8", "replace")
        full = f"{path}.{name}" if path else name
        children = _field(element, 5, int, "num_children", 0)
        if children < 0:
            raise _Corrupt(f"schema element {full!r} has {children} children")
        if children:
            stack.append((full, children))
        else:
            leaves.append(full)
            types.append(_leaf_type(element))
    if any(left for _, left in stack):
        raise _Corrupt("the schema ends before its groups' last children")
    return tuple(leaves), tuple(types)


_WIDTH = (1, 4, 8, 12, 4, 8, 4, 0)  # bytes a value of each physical type takes decoded (BYTE_ARRAY: offsets)


def decoded_bytes(md: dict, kind: LeafType | None, rows: int) -> int:
    """About the bytes a column chunk's values take decoded, from its metadata alone: the larger of its
    pages' uncompressed size and its values at their physical width (dictionary and run-length encoded
    pages decode to far more than they store), with 8 bytes a row of offsets and validity. The footer's
    own claims, unverified: what the shuffle window and the row-group cache are sized by."""
    values, uncompressed = md.get(5), md.get(6)
    values = values if isinstance(values, int) and values > 0 else 0
    uncompressed = uncompressed if isinstance(uncompressed, int) and uncompressed > 0 else 0
    width = _WIDTH[kind.physical] if kind is not None and 0 <= kind.physical < len(_WIDTH) else 0
    return max(uncompressed, values * width) + 8 * max(0, rows)


def read_footer_meta(meta: bytes, *, uri: str, file_size: int) -> Footer:
    """The row groups and leaf columns of the FileMetaData `meta`, the footer of the `file_size`-byte file
    `uri`; a DataSourceError naming the file when anything in it is malformed or out of range."""
    meta_start = file_size - 8 - len(meta)
    try:
        fmd = _Reader(meta).struct()
        leaves, types = _leaves(_field(fmd, 2, list, "the schema"))
        groups = []
        most_rows, total_rows = max(MAX_ROWS_PER_BYTE * file_size, ROWS_FLOOR), 0
        for g, rg in enumerate(_field(fmd, 4, list, "the row groups", [])):
            rows = _field(rg, 3, int, f"row group {g}'s num_rows")
            total_rows += rows
            if rows < 0 or total_rows > most_rows:
                raise _Corrupt(
                    f"row group {g} says {rows} rows, in a {file_size}-byte file that can hold at most "
                    f"{most_rows}"
                )
            columns = _field(rg, 1, list, f"row group {g}'s columns")
            if len(columns) != len(leaves):
                raise _Corrupt(
                    f"row group {g} has {len(columns)} column chunks for {len(leaves)} leaf columns"
                )
            chunks, decoded, values, nulls = [], [], [], []
            for c, column in enumerate(columns):
                md = _field(column, 3, dict, f"row group {g} column {c}'s metadata")
                start = _field(md, 9, int, "data_page_offset")
                dictionary = md.get(11)
                data_page = start
                has_dictionary = (
                    isinstance(dictionary, int) and not isinstance(dictionary, bool) and dictionary > 0
                )
                if has_dictionary:
                    start = min(start, dictionary)
                size = _field(md, 7, int, "total_compressed_size")
                if not (4 <= start and 0 < size and start + size <= meta_start):
                    raise _Corrupt(
                        f"row group {g} column {leaves[c]!r} says bytes [{start}, {start + size}), "
                        f"outside the file's data [4, {meta_start})"
                    )
                if has_dictionary and dictionary > data_page:  # a chunk starts with its dictionary page
                    raise _Corrupt(
                        f"row group {g} column {leaves[c]!r} puts its dictionary page (at {dictionary}) "
                        f"after its first data page (at {data_page})"
                    )
                chunks.append((start, size))
                decoded.append(decoded_bytes(md, types[c] if c < len(types) else None, rows))
                values.append(_count(md.get(5)))
                stats = md.get(12)
                nulls.append(_count(stats.get(3)) if isinstance(stats, dict) else -1)
            groups.append(RowGroup(rows, tuple(chunks), tuple(decoded), tuple(values), tuple(nulls)))
    except _Corrupt as exc:
        raise DataSourceError(f"{uri}: corrupt Parquet footer ({exc})", uri=uri) from None
    return Footer(leaves, tuple(groups), types)
