"""Token corpora for the read_tokens tests: Megatron .bin/.idx written byte by byte here (no megatron-core
needed), Parquet token tables, and the naive definition of the windows (imported beside the tests)."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["CODES", "naive_windows", "random_docs", "write_megatron", "write_parquet"]

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def random_docs(n: int, dtype: str, seed: int, max_len: int = 30) -> list[np.ndarray]:
    """`n` documents of 0 to max_len tokens (some empty), values over the dtype's range."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    hi = min(int(info.max), 1 << 40)
    return [
        rng.integers(max(int(info.min), -hi), hi, rng.integers(0, max_len + 1), dtype=np.int64).astype(dtype)
        for _ in range(n)
    ]


def write_megatron(
    prefix: str,
    docs: list[np.ndarray],
    dtype: str,
    *,
    magic: bytes = b"MMIDIDX\x00\x00",
    version: int = 1,
    code: int | None = None,
    pointers=None,
    count: int | None = None,
    bin_cut: int = 0,
) -> None:
    """PREFIX.bin (the documents end to end) and PREFIX.idx (MMIDIDX version 1: header, lengths, pointers,
    document index); the keyword arguments write bad ones."""
    lengths = np.array([len(d) for d in docs], np.int32)
    data = b"".join(np.asarray(d, dtype).tobytes() for d in docs)
    with open(prefix + ".bin", "wb") as f:
        f.write(data[: len(data) - bin_cut])
    if pointers is None:
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * np.dtype(dtype).itemsize
    pointers = np.asarray(pointers, np.int64)[: len(lengths)]
    n = len(lengths) if count is None else count
    doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(
            struct.pack("<9sQBQQ", magic, version, CODES[dtype] if code is None else code, n, len(doc_index))
        )
        f.write(lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())


def write_parquet(
    path: str, docs: list, kind: str = "list", value=None, row_group_size: int = 4
) -> None:
    """A table whose "input_ids" column holds the documents (None: a null row) as `kind` lists."""
    value = pa.int32() if value is None else value
    if kind == "list":
        t = pa.list_(value)
    elif kind == "large_list":
        t = pa.large_list(value)
    else:
        t = pa.list_(value, len(docs[0]))
    col = pa.array([None if d is None else [int(x) for x in d] for d in docs], t)
    pq.write_table(
        pa.table({"input_ids": col, "n": np.arange(len(docs))}), path, row_group_size=row_group_size
    )


def naive_windows(docs: list, seq_len: int, eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(windows (n, seq_len + 1), positions (n, seq_len + 1)) by the definition: every document (and eod)
    concatenated, window i the tokens [i*seq_len, i*seq_len + seq_len + 1)."""
    stream, pos = [], []
    for d in docs:
        d = [] if d is None else [int(x) for x in d]
        if eod is not None:
            d = d + [eod]
        stream += d
        pos += list(range(len(d)))
    stream, pos = np.array(stream, np.int64), np.array(pos, np.int64)
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)
    return stream[idx], pos[idx]
