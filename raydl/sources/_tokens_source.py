"""The token source as a loader worker runs it: a batch of windows cut out of the token stream at once.

The stream is the catalog's *units* in order (a Megatron `.bin`, a Parquet row group), each the documents
it holds, with the end-of-document token after each where `eod` is set. Window i is the stream's tokens
[i·L, i·L + L + 1). A batch's tokens are found in a few numpy calls: each token's part (a binary search
over the parts' token starts), its unit and its offset in the unit's stream; then, per unit, its document
(a binary search over the unit's document starts), its offset in the document (its position) and its
value, gathered from the unit's tokens: a memory-mapped local `.bin`, ranged reads of a remote one (one
per window, neighbours merged), or a decoded Parquet row group.

What a unit needs is loaded once per process and kept: a Megatron index is memory-mapped (local) or
fetched once (remote, through the node cache where the loader has one) and checked again as at listing;
its document starts (one int64 per document) are made once. Parquet row groups are decoded by pyarrow and
kept by an LRU bounded by bytes (the default shuffle window is sized to fit in it).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raydl.describe.catalog import Catalog, Located, Source
from raydl.describe.fields import Field
from raydl.errors import DataSourceError, LoaderError, ObjectChangedError
from raydl.native import token_windows_into
from raydl.sources._megatron import map_file, parse_index, read_index
from raydl.sources._parquet_file import footer_of, parse_footer, read_row_group
from raydl.sources._parquet_source import BoundedLRU
from raydl.sources._version import mtime_ns
from raydl.sources.parquet import read_footer
from raydl.storage import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import StringColumn, int_column, numbers, one_array
from raydl.util.threads import SharedPool

__all__ = ["ROW_GROUP_CACHE_BYTES", "TOKEN_PARTS", "TokenSource", "clear_token_caches", "parquet_token_leaf"]

TOKEN_PARTS = ("shard", "count", "tokens", "first", "index", "rg")
ROW_GROUP_CACHE_BYTES = 512 << 20  # decoded Parquet row groups a process keeps
_READ_THREADS = 16  # ranged reads of remote .bin files at once

_units = BoundedLRU(1 << 12, 1 << 40, size=lambda u: u.nbytes)  # Megatron units: their document starts
_row_groups = BoundedLRU(1 << 12, ROW_GROUP_CACHE_BYTES, size=lambda u: u.nbytes)
# an entry holds pyarrow's parsed metadata and raydl's Footer: about 3x the footer's bytes, counted so
_footers = BoundedLRU(1 << 12, 64 << 20, size=lambda f: 3 * f[2])
_reads = SharedPool(_READ_THREADS, "raydl-tokens")


def clear_token_caches() -> None:
    """Forget every index, footer and row group this process keeps (tests rewrite files)."""
    for cache in (_units, _row_groups, _footers):
        cache.clear()
    with _layouts_lock:
        _layouts.clear()


def parquet_token_leaf(md, column: str, uri: str) -> int:
    """The leaf column of `column` in a Parquet file's metadata, which must be a list (large, fixed-size)
    of integers: a ValueError naming the file otherwise."""
    schema = md.schema.to_arrow_schema()
    if column not in schema.names:
        raise ValueError(f"{uri} has no column {column!r}; its columns are {schema.names}")
    kind = schema.field(column).type
    listy = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not (listy and pa.types.is_integer(kind.value_type)):
        raise ValueError(f"{uri}: column {column!r} is {kind}, not a list of integers (one document a row)")
    leaves = [i for i in range(md.num_columns) if md.schema.column(i).path.split(".")[0] == column]
    if len(leaves) != 1:
        raise ValueError(f"{uri}: column {column!r} has {len(leaves)} leaf columns, not one")
    return leaves[0]


def _positions(starts: np.ndarray, local: np.ndarray, width: int, all_positions: bool):
    """Each row's token positions in their documents, for rows of `width` stream tokens from each offset in
    `local` of a unit whose documents start at `starts` (of all but the last token, unless
    `all_positions`); with each row's first document `d0` and its document starts inside it (`row`, `rel`:
    relative to the row, in [1, width]; `count` a row). Two binary searches a row, not one a token."""
    rows = len(local)
    d0 = np.searchsorted(starts, local, side="right") - 1  # the document of each row's first token
    d1 = np.searchsorted(starts, local + width, side="right") - 1  # ... of the token after its last
    count = d1 - d0  # document starts in (local, local + width]: each row's boundaries
    row = np.repeat(np.arange(rows), count)
    nth = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    rel = starts[d0[row] + 1 + nth] - local[row]  # in [1, width]
    # a token's position: its offset from the latest document start at or before it
    span = width if all_positions else width - 1
    inside = rel < span
    begin = np.full((rows, span), np.iinfo(np.int64).min, np.int64)
    begin[:, 0] = starts[d0] - local
    begin[row[inside], rel[inside]] = rel[inside]
    np.maximum.accumulate(begin, axis=1, out=begin)
    np.subtract(np.arange(span, dtype=np.int64), begin, out=begin)
    return begin, d0, row, rel, count


@dataclass(frozen=True)
class _Unit:
    """One unit's tokens as a window reads them: document starts in its stream (`starts`, D + 1 of them),
    lengths, and its values (an array, or None where they are read in ranges from `uri`)."""

    uri: str
    starts: np.ndarray
    lengths: np.ndarray
    values: np.ndarray | None
    itemsize: int
    dtype: np.dtype
    etag: str
    nbytes: int = field(default=0)


@dataclass(frozen=True, eq=False)
class TokenSource(Source):
    """A sample is a window of `seq_len` + 1 tokens of the stream (see the module docstring)."""

    seq_len: int
    eod: int | None
    dtype: str
    column: str
    shuffle_window: int | None = 0
    name: str = "tokens"
    range_is_sample: bool = False
    reads_batches: bool = True

    @property
    def fields(self) -> tuple[Field, ...]:
        return (Field("input_ids", "array"), Field("labels", "array"), Field("position_ids", "array"))

    @property
    def sample_bytes(self) -> int:
        """A window's three rows in the batch (the object-store budget counts them)."""
        return 3 * self.seq_len * np.dtype(self.dtype).itemsize

    # -- the batch -------------------------------------------------------------------------------
    def read_batch(self, catalog: Catalog, storage: Storage, ids: np.ndarray) -> dict[str, np.ndarray]:
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(catalog)):
            raise LoaderError(f"window ids must be in [0, {len(catalog)})")
        layout = _layout(catalog)
        n, width = len(ids), self.seq_len + 1
        start = ids * self.seq_len  # each window's first stream token
        first = np.searchsorted(layout.starts, start, side="right") - 1
        last = np.searchsorted(layout.starts, start + width - 1, side="right") - 1
        unit = layout.unit[first]
        local = start - layout.starts[first] + layout.first[first]  # offset in its unit's stream
        out = np.dtype(self.dtype)
        batch = {k: np.empty((n, self.seq_len), out) for k in ("input_ids", "labels", "position_ids")}
        whole = unit == layout.unit[last]  # most windows lie in one unit
        for u in sorted(set(unit[whole].tolist())):  # a few units a batch (np.unique costs ms here)
            rows = np.flatnonzero(whole & (unit == u))
            into = slice(None) if len(rows) == n else rows
            held = self._unit(catalog, storage, layout, u)
            if self.eod is None and held.values is not None:  # a mapped .bin or a decoded row group
                at = local[rows]
                inputs, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
                if token_windows_into(held.values, held.starts, at, rows, inputs, labels, positions):
                    continue  # one C pass straight into the batch; else the same in numpy
                positions[into] = _positions(held.starts, at, width, False)[0]
                values, seq = held.values, self.seq_len
                for r, a in zip(rows.tolist(), at.tolist(), strict=True):
                    inputs[r] = values[a : a + seq]
                    labels[r] = values[a + 1 : a + 1 + seq]
                continue
            tokens, pos = self._read(catalog, storage, layout, u, local[rows], width, unit=held)
            batch["input_ids"][into] = tokens[:, :-1]
            batch["labels"][into] = tokens[:, 1:]
            batch["position_ids"][into] = pos
        for r in np.flatnonzero(~whole).tolist():  # across units: a piece of the row from each
            t = start[r] + np.arange(width, dtype=np.int64)
            part = np.searchsorted(layout.starts, t, side="right") - 1
            units = layout.unit[part]
            cuts = np.flatnonzero(np.diff(units)) + 1
            row_tokens, row_pos = np.empty(width, np.int64), np.empty(width, np.int64)
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), width], strict=True):
                p = part[a]
                at = np.array([t[a] - layout.starts[p] + layout.first[p]])
                piece = (catalog, storage, layout, int(units[a]), at, b - a)
                got, where = self._read(*piece, all_positions=True)
                row_tokens[a:b], row_pos[a:b] = got[0], where[0]
            batch["input_ids"][r], batch["labels"][r] = row_tokens[:-1], row_tokens[1:]
            batch["position_ids"][r] = row_pos[:-1]
        batch["key"] = [str(i) for i in ids.tolist()]
        return batch

    def _read(
        self,
        catalog,
        storage,
        layout,
        u: int,
        local: np.ndarray,
        width: int,
        *,
        all_positions: bool = False,
        unit: _Unit | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of `width` stream tokens of unit u from each offset in `local`, and their positions (of all
        but the last, unless `all_positions`). The documents a row crosses are found from its two ends (two
        binary searches a row), not token by token."""
        unit = unit or self._unit(catalog, storage, layout, u)
        eod, rows = self.eod, len(local)
        begin, d0, row, rel, count = _positions(unit.starts, local, width, all_positions)
        if eod is None and unit.values is not None:  # each row is one slice of the values: copy it
            tokens = np.empty((rows, width), unit.values.dtype)
            for r, a in enumerate(local.tolist()):
                tokens[r] = unit.values[a : a + width]
            return tokens, begin
        if unit.values is not None and len(rel) <= 8 * rows + 64:  # few documents: copy the runs between eods
            return self._runs_with_eod(unit.values, local - d0, rel, count, width), begin
        at = local[:, None] + np.arange(width, dtype=np.int64)
        if eod is not None:  # the eod tokens are not stored: a token's value index skips the eods before it
            inside = rel < width
            seen = np.zeros((rows, width), np.int64)
            seen[row[inside], rel[inside]] = 1
            np.cumsum(seen, axis=1, out=seen)
            seen += d0[:, None]
            at -= seen
            stored = int(unit.starts[-1]) - len(unit.lengths)
            np.minimum(at, max(stored - 1, 0), out=at)  # an eod's place: clipped to a stored one, then set
        tokens = unit.values[at] if unit.values is not None else self._remote(storage, unit, at)
        if eod is not None:
            info = np.iinfo(tokens.dtype)
            if not info.min <= eod <= info.max:
                tokens = tokens.astype(np.int64)
            tokens[row, rel - 1] = eod  # each document's last stream token is its eod
        return tokens, begin

    def _runs_with_eod(self, values, first, rel, count, width: int) -> np.ndarray:
        """Rows of `width` stream tokens, row r's stored tokens starting at value `first[r]`, with an eod
        before each of its document starts `rel` (relative to the row): a slice copy per run between eods."""
        eod = self.eod
        info = np.iinfo(values.dtype)
        tokens = np.empty((len(first), width), values.dtype if info.min <= eod <= info.max else np.int64)
        rel, at = rel.tolist(), (np.cumsum(count) - count).tolist()
        for r, (v, n) in enumerate(zip(first.tolist(), count.tolist(), strict=True)):
            s = 0
            for e in rel[at[r] : at[r] + n]:  # the eod of the document before this start is at e - 1
                if e - 1 > s:
                    tokens[r, s : e - 1] = values[v : v + e - 1 - s]
                    v += e - 1 - s
                tokens[r, e - 1] = eod
                s = e
            if s < width:
                tokens[r, s:] = values[v : v + width - s]
        return tokens

    def _remote(self, storage: Storage, unit: _Unit, at: np.ndarray) -> np.ndarray:
        """The tokens at indices `at` (rows of ascending indices) of a remote .bin: one ranged read per run
        of overlapping or adjacent rows."""
        lo, hi = at.min(axis=1), at.max(axis=1) + 1
        order = np.argsort(lo, kind="stable")
        runs: list[list[int]] = []
        for r in order.tolist():
            if runs and lo[r] <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], int(hi[r]))
                runs[-1][2].append(r)
            else:
                runs.append([int(lo[r]), int(hi[r]), [r]])
        isz, etag = unit.itemsize, unit.etag or None

        def fetch(run):
            a, b, _rows = run
            data = storage.read_range(unit.uri, a * isz, (b - a) * isz, etag=etag)
            if len(data) != (b - a) * isz:
                raise DataSourceError(
                    f"{unit.uri}: read {len(data)} bytes at {a * isz}, not {(b - a) * isz}", uri=unit.uri
                )
            return np.frombuffer(data, unit.dtype)

        pieces = list(_reads().map(fetch, runs)) if len(runs) > 1 else [fetch(runs[0])]
        out = np.empty(at.shape, unit.dtype)
        for (a, _b, rows), piece in zip(runs, pieces, strict=True):
            out[rows] = piece[at[rows] - a]
        return out

    def _unit(self, catalog: Catalog, storage: Storage, layout: _Layout, u: int) -> _Unit:
        p = int(layout.unit_part[u])
        shard, index, rg = int(layout.shard[p]), int(layout.index[p]), int(layout.rg[p])
        info = layout.info(catalog, shard)
        stamp = mtime_ns(info)
        if index >= 0:
            idx = layout.info(catalog, index)
            key = (info.uri, info.etag, info.size, stamp, idx.uri, idx.etag, idx.size, self.eod is not None)
            unit = _units.get(key, lambda: self._megatron(storage, info, idx))
        else:
            key = (info.uri, info.etag, info.size, stamp, rg, self.column, self.eod is not None)
            unit = _row_groups.get(key, lambda: self._row_group(storage, info, rg))
        if int(unit.starts[-1]) != int(layout.unit_tokens[u]):
            where = info.uri if index >= 0 else f"{info.uri} row group {rg}"
            raise ObjectChangedError(
                f"{where} holds {int(unit.starts[-1])} tokens, not the {int(layout.unit_tokens[u])} it held "
                "when it was listed (it changed, holds null tokens, or its footer's counts are wrong)",
                uri=info.uri,
            )
        return unit

    def _megatron(self, storage: Storage, bin_info: ObjectInfo, idx_info: ObjectInfo) -> _Unit:
        local = split_scheme(idx_info.uri)[0] == "file"
        try:
            if local:
                for info in (bin_info, idx_info):
                    now = os.path.getsize(info.uri)
                    if now != info.size:
                        raise ObjectChangedError(
                            f"{info.uri} changed after it was listed: it is {now} bytes, not {info.size}",
                            uri=info.uri,
                        )
        except OSError as exc:
            raise DataSourceError(f"cannot read {idx_info.uri}: {exc}", uri=idx_info.uri) from exc
        data = read_index(storage, idx_info)
        index = parse_index(idx_info.uri, data, bin_info.uri, bin_info.size)
        e = 1 if self.eod is not None else 0
        starts = np.zeros(index.sequences + 1, np.int64)
        starts[1:] = index.lengths  # int32 in the index: the sums, and a length + 1, need int64
        if e:
            starts[1:] += e
        np.cumsum(starts[1:], out=starts[1:])
        values = None
        if local and index.tokens:
            # a plain array over the mapping: np.memmap's slices cost microseconds each in Python
            values = np.frombuffer(map_file(bin_info.uri), index.dtype, index.tokens)
        return _Unit(
            bin_info.uri,
            starts,
            index.lengths,
            values,
            index.dtype.itemsize,
            index.dtype,
            bin_info.etag,
            nbytes=starts.nbytes + (0 if local else len(data)),
        )

    def _row_group(self, storage: Storage, info: ObjectInfo, rg: int) -> _Unit:
        md, footer, _n = _footers.get(
            (info.uri, info.etag, info.size, mtime_ns(info)), lambda: _footer(storage, info)
        )
        if rg >= md.num_row_groups:
            raise ObjectChangedError(f"{info.uri} has no row group {rg} now", uri=info.uri)
        try:
            leaf = parquet_token_leaf(md, self.column, info.uri)
        except ValueError as exc:
            raise ObjectChangedError(f"{info.uri} changed after it was listed: {exc}", uri=info.uri) from None
        start, stored = footer.row_groups[rg].chunks[leaf]  # raydl's reading: see _footer
        data = storage.read_range(info.uri, start, stored, etag=info.etag or None)
        try:
            table = read_row_group(info.uri, info.size, md, {start: data}, rg, (leaf,))
            column = one_array(table.column(self.column))
            lengths = numbers(pc.list_value_length(column), fill=0)[0].astype(np.int64)
            values = column.flatten()
        except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
            raise DataSourceError(
                f"{info.uri}: cannot decode column {self.column!r} of row group {rg}: {exc}", uri=info.uri
            ) from exc
        if values.null_count or len(values) != int(lengths.sum()):
            raise DataSourceError(
                f"{info.uri}: row group {rg} of column {self.column!r} holds null tokens", uri=info.uri
            )
        e = 1 if self.eod is not None else 0
        starts = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths + e, out=starts[1:])
        array = numbers(values)[0]
        return _Unit(
            info.uri,
            starts,
            lengths,
            array,
            array.itemsize,
            array.dtype,
            info.etag,
            nbytes=starts.nbytes + lengths.nbytes + array.nbytes,
        )

    # -- the per-sample contract: for tools (where a window starts); a worker reads whole batches --------
    def locate(self, catalog: Catalog, ids: np.ndarray) -> Located:
        ids = np.asarray(ids, np.int64)
        part, _ = catalog.locate(ids)
        shard = catalog.column("shard")[part].astype(np.int64)
        zeros = np.zeros(len(ids), np.int64)
        return Located(
            shard=shard,
            offset=zeros,
            length=zeros.copy(),
            row=ids * self.seq_len,
            key=[str(i) for i in ids.tolist()],
            label=np.full(len(ids), -1, np.int64),
        )

    def read_block(self, storage: Storage, shard: ObjectInfo, offset: int, length: int) -> bytes:
        return storage.read_range(shard.uri, offset, length, etag=shard.etag or None) if length else b""

    def cut(self, located: Located, i: int, data: bytes) -> dict[str, object]:
        raise LoaderError("token windows are read a batch at a time (TokenSource.read_batch), not cut")

    def sample_uri(self, shard_uri: str, key: str) -> str:
        return f"{shard_uri}#window{key}"


def _footer(storage: Storage, info: ObjectInfo):
    """(pyarrow's FileMetaData, raydl's Footer, bytes) of a file's footer. The chunks' ranges come from
    raydl's reading, checked against the file: pyarrow's RowGroupMetaData.column() aborts the process on
    some corrupt footers (raydl/sources/_footer.py)."""
    tail = read_footer(storage, info)
    footer = footer_of(info.uri, info.size, tail)
    try:
        return parse_footer(tail), footer, len(tail)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DataSourceError(f"{info.uri}: corrupt Parquet footer ({exc})", uri=info.uri) from exc


@dataclass
class _Layout:
    """A catalog's parts as a batch maps tokens to them: each part's first stream token, its unit (a .bin or
    a row group: parts of one unit are neighbours), the unit's tokens; made once per catalog and process."""

    starts: np.ndarray
    first: np.ndarray
    unit: np.ndarray
    unit_part: np.ndarray
    unit_tokens: np.ndarray
    shard: np.ndarray
    index: np.ndarray
    rg: np.ndarray
    uris: StringColumn
    etags: StringColumn
    sizes: np.ndarray

    def info(self, catalog: Catalog, shard: int) -> ObjectInfo:
        return ObjectInfo(self.uris[shard], int(self.sizes[shard]), self.etags[shard])


_layouts: dict[tuple[str, str], _Layout] = {}
_layouts_lock = threading.Lock()


def _layout(catalog: Catalog) -> _Layout:
    key = (catalog.fingerprint, catalog.root)  # the same files elsewhere have the fingerprint, not the root
    with _layouts_lock:
        got = _layouts.get(key)
        if got is not None:
            return got
    tokens = catalog.column("tokens")
    starts = np.zeros(len(tokens) + 1, np.int64)
    np.cumsum(tokens, out=starts[1:])
    shard, rg, first = catalog.column("shard"), catalog.column("rg"), catalog.column("first")
    new = np.ones(len(tokens), bool)
    new[1:] = (shard[1:] != shard[:-1]) | (rg[1:] != rg[:-1]) | (first[1:] == 0)
    unit = np.cumsum(new) - 1
    unit_part = np.flatnonzero(new)
    unit_tokens = np.add.reduceat(tokens, unit_part) if len(tokens) else np.zeros(0, np.int64)
    layout = _Layout(
        starts=starts,
        first=first,
        unit=unit,
        unit_part=unit_part,
        unit_tokens=unit_tokens,
        shard=shard,
        index=catalog.column("index"),
        rg=rg,
        uris=StringColumn(catalog.shards.column("uri")),
        etags=StringColumn(catalog.shards.column("etag")),
        sizes=int_column(catalog.shards.column("size")),
    )
    with _layouts_lock:
        if len(_layouts) > 64:
            _layouts.clear()
        _layouts[key] = layout
    return layout
