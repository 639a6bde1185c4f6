"""Token corpora listed into a catalog of windows, on the driver: Megatron-LM indexed datasets (PREFIX.bin +
PREFIX.idx) and Parquet tables of token lists, one document a row.

The corpus is one token stream: every unit's documents in order (the units are each Megatron dataset, and
each row group of each Parquet file, in the order the paths name them), with the end-of-document token
after each document where `eod` is set. A sample is window i, the stream's tokens [i·L, i·L + L + 1), and
there are (tokens − 1) // L of them.

Listing reads each `.idx` whole (memory-mapped where local; checked: raydl/sources/_megatron.py) and each
Parquet file's footer (a row group's tokens are its token column's value count less its nulls). The
catalog's parts are row groups, and stretches of at most `CHUNK_TOKENS` tokens of a `.bin` (so a shuffle
window of parts stays small), each with: its data file (`shard`), the windows that start in it
(`count`), its stream tokens (`tokens`), where it starts in its unit's stream (`first`), its `.idx`
(`index`, a row of the shards, or -1) and its row group (`rg`, or -1). Nothing per document or per window.
The worker's side, `TokenSource`, is raydl/sources/_tokens_source.py.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import DataSourceError
from raydl.sources._expand import expand_urls, is_plain
from raydl.sources._megatron import parse_index, read_index
from raydl.sources._parquet_file import footer_of, parse_footer, read_row_group
from raydl.sources._tokens_source import ROW_GROUP_CACHE_BYTES, TokenSource, parquet_token_leaf
from raydl.sources.parquet import read_footer
from raydl.storage import ObjectInfo, Storage, split_scheme

__all__ = ["CHUNK_TOKENS", "MAX_UNIT_TOKENS", "list_tokens"]

CHUNK_TOKENS = 1 << 22  # a .bin's parts: stretches of its stream this long
MAX_UNIT_TOKENS = 1 << 40  # a row group's footer claiming more is crafted: sums of such counts could overflow
_MAX_WINDOW = 16  # Parquet row groups shuffled together, at most (fewer where they would not fit the cache)
_LISTING_THREADS = 16


def list_tokens(
    paths, *, storage: Storage, seq_len: int, column: str, eod: int | None, dtype: str
) -> Catalog:
    """The catalog of the windows of `paths` (see the module docstring)."""
    units = _expand([paths] if isinstance(paths, str) else [str(p) for p in paths], storage)
    e = 1 if eod is not None else 0
    with ThreadPoolExecutor(max(1, min(_LISTING_THREADS, len(units)))) as pool:
        listed = list(pool.map(lambda u: _list_unit(storage, u, column, e), units))
    shards: list[ObjectInfo] = []
    cols: dict[str, list[int]] = {"shard": [], "tokens": [], "first": [], "index": [], "rg": []}
    all_local, widest = True, 0
    for unit, pieces in zip(units, listed, strict=True):
        row = len(shards)
        shards.extend(unit[1:])
        for tokens, rg, width in pieces:
            starts = range(0, tokens, CHUNK_TOKENS) if rg < 0 and tokens else [0]
            for first in starts:
                cols["shard"].append(row)
                cols["tokens"].append(min(CHUNK_TOKENS, tokens - first) if rg < 0 else tokens)
                cols["first"].append(first)
                cols["index"].append(row + 1 if rg < 0 else -1)
                cols["rg"].append(rg)
            if rg >= 0:
                all_local = False
                widest = max(widest, tokens * width)
        if unit[0] == "megatron" and split_scheme(unit[1].uri)[0] != "file":
            all_local = False
    tokens = np.asarray(cols["tokens"], np.int64)
    total = int(tokens.sum())
    if total < seq_len + 1:
        raise DataSourceError(
            f"{paths!r} holds {total} tokens in all, fewer than a window of seq_len + 1 = {seq_len + 1}",
            uri=shards[0].uri,
        )
    windows = (total - 1) // seq_len
    starts = np.zeros(len(tokens) + 1, np.int64)
    np.cumsum(tokens, out=starts[1:])
    first_window = np.minimum(-(-starts // seq_len), windows)  # the first window starting at or after
    parts = {"shard": cols["shard"], "count": np.diff(first_window)}
    parts.update({c: cols[c] for c in ("tokens", "first", "index", "rg")})
    if all_local:
        window = 0  # a local .bin is memory-mapped: any window costs the same, so shuffle globally
    elif widest:
        window = max(1, min(_MAX_WINDOW, ROW_GROUP_CACHE_BYTES // widest))
    else:
        window = None  # remote .bin ranges: the loader's default window of parts
    source = TokenSource(seq_len, eod, dtype, column, shuffle_window=window)
    return make_catalog(
        root=_root([s.uri for s in shards]), storage=storage, source=source, shards=shards, parts=parts
    )


def _root(uris: list[str]) -> str:
    root = os.path.commonprefix(uris)
    return root[: root.rfind("/") + 1] if "/" in root else ""


def _exists(storage: Storage, uri: str) -> ObjectInfo | None:
    try:
        return storage.stat(uri)
    except DataSourceError:
        return None


def _expand(paths: list[str], storage: Storage) -> list[tuple]:
    """Each path as units in order: ("megatron", bin, idx) for a prefix whose .bin and .idx exist (or a
    .bin or .idx a pattern matched, its partner beside it), ("parquet", file) for a .parquet file."""
    if not paths:
        raise ValueError("paths must name at least one token corpus (a Megatron prefix or a .parquet file)")
    units: list[tuple] = []
    for p in paths:
        if p.startswith("file://"):
            p = p[len("file://") :]
        if is_plain(p):
            found = [o for o in (_exists(storage, p + ".bin"), _exists(storage, p + ".idx")) if o]
            if len(found) == 2:
                units.append(("megatron", *found))
                continue
            info = _exists(storage, p)
            if info is None:
                raise DataSourceError(
                    f"{p!r} does not exist (nor do both {p + '.bin'!r} and {p + '.idx'!r})", uri=p
                )
            objects = [info]
        else:
            objects = expand_urls(p, lambda _u: storage)
        names = {o.uri for o in objects}
        for o in objects:
            stem, ext = os.path.splitext(o.uri)
            if ext == ".parquet":
                units.append(("parquet", o))
            elif ext in (".bin", ".idx"):
                if ext == ".idx" and stem + ".bin" in names:
                    continue  # listed with its .bin
                partner = _exists(storage, stem + (".idx" if ext == ".bin" else ".bin"))
                if partner is None:
                    raise DataSourceError(
                        f"{o.uri} has no {'index' if ext == '.bin' else 'data file'} beside it "
                        f"({stem + ('.idx' if ext == '.bin' else '.bin')}); a Megatron dataset is PREFIX.bin "
                        "and PREFIX.idx",
                        uri=o.uri,
                    )
                units.append(("megatron", *((o, partner) if ext == ".bin" else (partner, o))))
            else:
                raise ValueError(
                    f"{o.uri} is neither a Megatron dataset (name it by its prefix: PREFIX.bin and "
                    "PREFIX.idx) nor a .parquet file"
                )
    return units


def _counted(storage: Storage, info: ObjectInfo, md, footer, g: int, leaf: int, column: str) -> int:
    """The tokens of row group `g`'s token column, decoded and counted: for a footer without null counts
    (a file written without statistics), where num_values also counts each empty or null row."""
    start, stored = footer.row_groups[g].chunks[leaf]
    data = storage.read_range(info.uri, start, stored, etag=info.etag or None)
    try:
        table = read_row_group(info.uri, info.size, md, {start: data}, g, (leaf,), threads=False)
        return int(pc.sum(pc.list_value_length(table.column(column))).as_py() or 0)
    except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
        raise DataSourceError(
            f"{info.uri}: cannot decode column {column!r} of row group {g}: {exc}", uri=info.uri
        ) from exc


def _list_unit(storage: Storage, unit: tuple, column: str, e: int) -> list[tuple[int, int, int]]:
    """(stream tokens, row group or -1, bytes a decoded token takes) of each of a unit's pieces: a Megatron
    dataset is one, a Parquet file one per row group."""
    if unit[0] == "megatron":
        _kind, bin_info, idx_info = unit
        index = parse_index(idx_info.uri, read_index(storage, idx_info), bin_info.uri, bin_info.size)
        return [(index.tokens + e * index.sequences, -1, index.dtype.itemsize)]
    info = unit[1]
    tail = read_footer(storage, info)
    # raydl's own reading of the footer, checked against the file, gives the counts: pyarrow's
    # RowGroupMetaData.column() aborts the process on some corrupt footers
    footer = footer_of(info.uri, info.size, tail)
    try:
        md = parse_footer(tail)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DataSourceError(f"{info.uri}: corrupt Parquet footer ({exc})", uri=info.uri) from exc
    leaf = parquet_token_leaf(md, column, info.uri)
    width = max(1, md.schema.to_arrow_schema().field(column).type.value_type.bit_width // 8)
    out = []
    for g, rg in enumerate(footer.row_groups):
        values, nulls = rg.values[leaf], rg.nulls[leaf]
        if values < 0:
            raise DataSourceError(
                f"{info.uri}: corrupt Parquet footer (row group {g} column {column!r} says no num_values)",
                uri=info.uri,
            )
        if nulls < 0:  # no null count: empty and null rows hide in num_values, so count the tokens themselves
            tokens = _counted(storage, info, md, footer, g, leaf, column) + e * rg.num_rows
        else:
            tokens = max(0, values - nulls) + e * rg.num_rows
        if tokens > MAX_UNIT_TOKENS:
            raise DataSourceError(
                f"{info.uri}: row group {g} says it holds {tokens} tokens, more than raydl reads in one "
                f"({MAX_UNIT_TOKENS})",
                uri=info.uri,
            )
        out.append((tokens, g, width))
    return out
