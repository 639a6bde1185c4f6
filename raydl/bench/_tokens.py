"""The "tokens" workload: Parquet files of token sequences, delivered as (B, 2048) int tensors.

    python -m raydl.bench.shards --tokens OUT_DIR [--rows 102400] [--files 8]   # OUT_DIR/tokens/*.parquet
    raydl bench loader --workload tokens --data OUT_DIR --compare torch,raydata   # and the windows table

Each row holds one `input_ids` column: a list<int32> of SEQ_LEN = 2,048 tokens
(what a Hugging Face `Sequence(Value("int32"))` column is), drawn from the seed
with a Zipf-like law over a 50,257-token vocabulary, so the files compress as
real tokens do. The default 102,400 rows make 800 MiB of tokens.

Peers: raydl (`read_parquet` with no image column, `iter_torch_batches`; and
"raydl-ordered", the same without its per-row shuffle), Ray
Data (`read_parquet` + `iter_torch_batches`), a torch DataLoader whose workers
read the row groups with pyarrow, and the ceiling: pyarrow's own
`ParquetFile.iter_batches` to numpy on the same CPU budget, with no loader at all.
The table's rate is rows/s; tokens/s is SEQ_LEN times it (the notes give it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from raydl.bench._clock import EpochClock, Measurement, PeerSpec
from raydl.bench._setup import ray_init, raydl_epochs, raydl_ray, torch_worker_init
from raydl.bench._transform import data_files

__all__ = ["SEQ_LEN", "TOKEN_NOTES", "TOKEN_PEERS", "token_files", "write_token_parquet"]

SEQ_LEN = 2048
VOCAB = 50_257
DEFAULT_ROWS = 102_400  # 800 MiB of int32 tokens
COLUMN = "input_ids"


def write_token_parquet(
    out: str, *, rows: int = DEFAULT_ROWS, files: int = 8, row_group: int = 512, seed: int = 0
) -> list[str]:
    """`rows` rows of SEQ_LEN int32 tokens in `files` Parquet files (row groups of `row_group` rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if min(rows, files, row_group) < 1:
        raise ValueError(f"rows, files and row_group must be positive, got {rows}, {files}, {row_group}")
    files = min(files, rows)
    Path(out).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    paths = []
    for f in range(files):
        path = os.path.join(out, f"part-{f:05d}.parquet")
        with pq.ParquetWriter(path, pa.schema([(COLUMN, pa.list_(pa.int32()))])) as writer:
            for start in range(bounds[f], bounds[f + 1], row_group):
                n = min(row_group, bounds[f + 1] - start)
                # Zipf-like ids: frequent tokens small, as a BPE vocabulary's are.
                tokens = np.minimum(rng.zipf(1.2, size=n * SEQ_LEN) - 1, VOCAB - 1).astype(np.int32)
                offsets = np.arange(0, (n + 1) * SEQ_LEN, SEQ_LEN, dtype=np.int32)
                column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
                writer.write_table(pa.table({COLUMN: column}))
        paths.append(path)
    return paths


def token_files(data: str) -> list[str]:
    """The Parquet files a tokens --data names: a folder (its *.parquet, sorted) or one glob pattern."""
    return data_files(data, ".parquet")


def token_rows(data: str) -> int:
    """Rows in the files, from their footers."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in token_files(data))


def _to_numpy(column) -> np.ndarray:
    """A list<int32> column of SEQ_LEN-long rows as one (rows, SEQ_LEN) array (a view where one chunk)."""
    from raydl.util.arrow import one_array

    column = one_array(column)  # combine_chunks would copy even a single chunk
    values = column.flatten()  # respects a slice, unlike .values
    if len(values) != len(column) * SEQ_LEN:
        raise ValueError(f"{len(column)} rows hold {len(values)} tokens, not {SEQ_LEN} each")
    return values.to_numpy(zero_copy_only=False).reshape(len(column), SEQ_LEN)


def run_raydl_tokens(spec: PeerSpec, clock: EpochClock, *, shuffle: bool = True) -> Measurement:
    import torch  # noqa: F401 - a training script has it imported before its loader, as the torch peers do

    import raydl

    with raydl_ray(spec):
        clock.start()
        loader = raydl.read_parquet(token_files(spec.data)).loader(
            batch_size=spec.batch_size,
            seed=spec.seed,
            num_workers=1,
            threads_per_worker=spec.cpus,
            shuffle=shuffle,
        )
        return raydl_epochs(loader, spec, clock, lambda batch: batch[COLUMN], torch=True)


def run_raydl_tokens_ordered(spec: PeerSpec, clock: EpochClock) -> Measurement:
    return run_raydl_tokens(spec, clock, shuffle=False)


def run_raydata_tokens(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import ray
    import ray.data

    ray_init(spec.cpus)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        clock.start()
        ds = ray.data.read_parquet(token_files(spec.data), columns=[COLUMN], shuffle="files")
        for _epoch in range(spec.epochs):  # each epoch runs the pipeline again
            for batch in ds.iter_torch_batches(batch_size=spec.batch_size):
                clock.batch(batch[COLUMN])
        return clock.result()
    finally:
        ray.shutdown()


class _RowGroups:
    """Each torch worker reads its share of the (file, row group) pairs, in batches (`RowGroups` below)."""

    def __init__(self, files: list[str], batch_size: int, seed: int):
        import pyarrow.parquet as pq

        self.parts = [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
        self.batch_size, self.seed = batch_size, seed

    def __iter__(self):
        import pyarrow.parquet as pq
        import torch

        info = torch.utils.data.get_worker_info()
        wid, workers = (info.id, info.num_workers) if info else (0, 1)
        order = np.random.default_rng(self.seed).permutation(len(self.parts))
        files: dict[str, pq.ParquetFile] = {}
        carry = None
        for k in order[wid::workers]:
            path, group = self.parts[k]
            pf = files.get(path) or files.setdefault(path, pq.ParquetFile(path))
            rows = _to_numpy(pf.read_row_group(group, columns=[COLUMN], use_threads=False)[COLUMN])
            if carry is not None:
                rows = np.concatenate([carry, rows])
            full = len(rows) - len(rows) % self.batch_size
            for i in range(0, full, self.batch_size):
                yield torch.from_numpy(rows[i : i + self.batch_size])
            carry = rows[full:] if full < len(rows) else None
        if carry is not None:
            yield torch.from_numpy(carry)


def __getattr__(name: str):
    """`RowGroups`: _RowGroups as a torch IterableDataset, made on first use so that importing this module
    needs no torch; a module attribute all the same, so that a spawned worker can unpickle it."""
    if name != "RowGroups":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    cls = type("RowGroups", (_RowGroups, torch.utils.data.IterableDataset), {"__module__": __name__})
    globals()["RowGroups"] = cls
    return cls


def run_torch_tokens(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import torch

    clock.start()
    loader = torch.utils.data.DataLoader(
        sys.modules[__name__].RowGroups(token_files(spec.data), spec.batch_size, spec.seed),
        batch_size=None,
        num_workers=spec.cpus,
        worker_init_fn=torch_worker_init,
    )
    for _epoch in range(spec.epochs):
        for tokens in loader:
            clock.batch(tokens)
    return clock.result()


def run_pyarrow_ceiling(spec: PeerSpec, clock: EpochClock) -> Measurement:
    """pyarrow alone: ParquetFile.iter_batches to (B, SEQ_LEN) numpy, cpus threads, file after file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pa.set_cpu_count(spec.cpus)
    pa.set_io_thread_count(spec.cpus)
    files = token_files(spec.data)
    clock.start()
    for _epoch in range(spec.epochs):
        for path in files:
            pf = pq.ParquetFile(path)
            for rb in pf.iter_batches(batch_size=spec.batch_size, columns=[COLUMN], use_threads=True):
                clock.batch(_to_numpy(rb.column(0)))
    return clock.result()


TOKEN_PEERS = {
    "raydl": run_raydl_tokens,
    "raydl-ordered": run_raydl_tokens_ordered,
    "torch": run_torch_tokens,
    "raydata": run_raydata_tokens,
    "ceiling": run_pyarrow_ceiling,
}

TOKEN_NOTES = {
    "raydl": "raydl: read_parquet(files) (no image column) .loader(num_workers=1, threads_per_worker=cpus) "
    "+ iter_torch_batches(): input_ids as a (B, 2048) tensor.",
    "raydl-ordered": "raydl-ordered: the same with loader(shuffle=False): rows in file order (raydl's "
    "shuffle permutes the row groups, then the rows within a window of row groups that fits the worker's "
    "cache).",
    "torch": "torch: DataLoader(num_workers=cpus, batch_size=None) over an IterableDataset whose workers "
    "read their share of the row groups (shuffled) with pyarrow into (B, 2048) tensors.",
    "raydata": "raydata: ray.data.read_parquet(columns=['input_ids'], shuffle='files') + "
    "iter_torch_batches(batch_size=B).",
    "ceiling": "ceiling: pyarrow alone, ParquetFile.iter_batches(use_threads, cpus threads) to (B, 2048) "
    "numpy, file after file; no loader, no shuffle.",
}
