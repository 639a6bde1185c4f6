"""The "tokens" workload's second table: packed windows of a Megatron `.bin`/`.idx` corpus.

    python -m raydl.bench.shards --tokens OUT_DIR [--megatron-tokens 200000000]  # OUT_DIR/megatron/corpus-N.*
    raydl bench loader --workload tokens --data OUT_DIR --compare torch,raydata,megatron

The corpus is one Megatron-LM indexed dataset (MMIDIDX version 1) of uint16 tokens (a 50,257-token
vocabulary, drawn with the same Zipf-like law as the Parquet rows), in documents of 1 to about 8,000
tokens (mean about 1,000), laid end to end as Megatron's builder writes them. A sample is window i of
the corpus's token stream: tokens [i·L, i·L + L + 1), the input ids its first L and the labels its
last L (L = --seq-len, default 4,096); there are (tokens - 1) // L windows, each delivered once per
shuffled epoch by every peer:

* raydl: `read_tokens(prefix, seq_len=L)` + `loader(shuffle=True)` + `iter_torch_batches()`;
* torch: a `DataLoader(shuffle=True, num_workers=cpus)` over a map-style `Dataset` whose
  `__getitem__` slices window i out of an `np.memmap` of the `.bin` (as most training scripts do);
* megatron: the same `DataLoader` over a `Dataset` reading window i with megatron-core's own
  `IndexedDataset.get(document, offset, length)`, piece by piece across documents (as its GPTDataset
  does);
* raydata: `ray.data.from_numpy` of the shuffled window numbers, the packing in `map_batches`
  (window i's tokens copied out of the memory-mapped `.bin`), `iter_torch_batches(batch_size=B)`;
* ceiling: one thread, no loader: each window of a shuffled order copied out of the memory-mapped
  `.bin` into the batch array (int64, as the loaders deliver);
* floor: what Ray's object store alone carries here: one Ray actor returns batches of the same three
  (B, L) int64 arrays as raydl's (made once; no reading, no plan), as many to an object as raydl puts
  in one, the same number of objects in flight, each turned into torch tensors in this process. A
  loader that hands such batches over through the object store, as many to an object, stays below this
  rate on the same cores.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from raydl.bench._clock import EpochClock, Measurement, PeerSpec
from raydl.bench._setup import first_batch_phases, ray_init, raydl_epochs, raydl_ray, torch_worker_init

__all__ = [
    "DEFAULT_SEQ_LEN",
    "DEFAULT_TOKENS",
    "DEFAULT_WINDOW_BATCH",
    "WINDOW_NOTES",
    "WINDOW_PEERS",
    "corpus_prefix",
    "corpus_windows",
    "write_megatron_corpus",
]

DEFAULT_TOKENS = 200_000_000  # 400 MB of uint16
DEFAULT_SEQ_LEN = 4096
DEFAULT_WINDOW_BATCH = 16
VOCAB = 50_257
MEAN_DOC = 1_000  # tokens per document, on average
_CHUNK = 1 << 24  # tokens drawn and written at once


def corpus_prefix(data: str, tokens: int) -> str:
    """Where the corpus of `tokens` tokens lives under a tokens --data folder: DATA/megatron/corpus-N."""
    return os.path.join(data, "megatron", f"corpus-{tokens}")


def write_megatron_corpus(
    prefix: str,
    *,
    tokens: int = DEFAULT_TOKENS,
    documents: int | None = None,
    seed: int = 0,
    sparse: bool = False,
) -> str:
    """PREFIX.bin and PREFIX.idx: `tokens` uint16 tokens in documents of geometric lengths (mean MEAN_DOC,
    or tokens / `documents`; at most 8 times the mean; at least 1), laid end to end. `sparse`: the .bin is a
    sparse file of zeros of the right size (for listing, which reads the .idx alone). The .idx is written
    last, so a half-written corpus has none."""
    from raydl.sources._megatron import write_index

    if tokens < 2:
        raise ValueError(f"a corpus needs at least 2 tokens, got {tokens}")
    mean = tokens / documents if documents else MEAN_DOC
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    rng = np.random.default_rng(seed)
    drawn, total = [], 0
    while total < tokens:
        got = rng.geometric(min(1.0, 1 / mean), size=int((tokens - total) / mean) + 16)
        got = np.minimum(got, max(1, int(8 * mean))).astype(np.int64)
        drawn.append(got)
        total += int(got.sum())
    lengths = np.concatenate(drawn)
    ends = np.cumsum(lengths)
    keep = int(np.searchsorted(ends, tokens)) + 1  # the first document reaching `tokens`, cut there
    lengths = lengths[:keep]
    lengths[-1] -= int(ends[keep - 1]) - tokens
    with open(prefix + ".bin", "wb") as f:
        if sparse:
            f.truncate(2 * tokens)
        else:
            for start in range(0, tokens, _CHUNK):
                n = min(_CHUNK, tokens - start)
                f.write(np.minimum(rng.zipf(1.2, size=n) - 1, VOCAB - 1).astype(np.uint16).tobytes())
    write_index(prefix + ".idx", lengths.astype(np.int32), np.uint16)
    return prefix


def _index(prefix: str):
    from raydl.sources._megatron import map_file, parse_index

    return parse_index(
        prefix + ".idx", map_file(prefix + ".idx"), prefix + ".bin", os.path.getsize(prefix + ".bin")
    )


def corpus_windows(prefix: str, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens in the corpus: (tokens - 1) // seq_len."""
    return max(0, (_index(prefix).tokens - 1) // seq_len)


def _order(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def _bin(prefix: str) -> np.ndarray:
    return np.memmap(prefix + ".bin", dtype=_index(prefix).dtype, mode="r")


def run_raydl_windows(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import time

    import torch  # noqa: F401 - a training script has it imported before its loader, as the torch peers do

    import raydl

    t_init = time.perf_counter()
    with raydl_ray(spec):
        clock.extra["ray_init_s"] = time.perf_counter() - t_init
        clock.start()
        t0 = time.perf_counter()
        ds = raydl.read_tokens(spec.data, seq_len=spec.seq_len)
        t1 = time.perf_counter()
        loader = ds.loader(
            batch_size=spec.batch_size,
            seed=spec.seed,
            num_workers=1,
            threads_per_worker=spec.cpus,
            shuffle=True,
        )
        t2 = time.perf_counter()

        def timed(batch):
            first_batch_phases(clock, loader, t0, t1, t2)
            return batch["input_ids"]

        return raydl_epochs(loader, spec, clock, timed, torch=True)


def run_ceiling_windows(spec: PeerSpec, clock: EpochClock) -> Measurement:
    """One thread: each window of a shuffled order copied out of the memory-mapped .bin into the batch."""
    L, B = spec.seq_len, spec.batch_size
    clock.start()
    tokens = _bin(spec.data)
    n = (len(tokens) - 1) // L
    out = np.empty((B, L + 1), np.int64)
    for _epoch in range(spec.epochs):
        order = _order(n, spec.seed + _epoch)
        for b in range(0, n, B):
            rows = order[b : b + B]
            for j, i in enumerate(rows):
                out[j] = tokens[i * L : i * L + L + 1]
            clock.batch(out[: len(rows), :-1])
    return clock.result()


class _MmapWindows:
    """Window i of the .bin, sliced out of an np.memmap (opened in each worker on first use)."""

    def __init__(self, prefix: str, seq_len: int):
        self.path, self.seq_len = prefix + ".bin", seq_len
        self.dtype = _index(prefix).dtype
        self.n = (os.path.getsize(self.path) // self.dtype.itemsize - 1) // seq_len
        self.tokens = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        if self.tokens is None:
            self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        L = self.seq_len
        window = torch.from_numpy(self.tokens[i * L : i * L + L + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


class _MegatronWindows:
    """Window i read with megatron-core's IndexedDataset.get(document, offset, length), one piece per
    document it crosses (as megatron-core's GPTDataset reads a sample)."""

    def __init__(self, prefix: str, seq_len: int):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.ds = IndexedDataset(prefix, mmap=True)
        lengths = np.asarray(self.ds.sequence_lengths, np.int64)
        self.starts = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=self.starts[1:])
        self.seq_len = seq_len
        self.n = (int(self.starts[-1]) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        L = self.seq_len
        start, need = i * L, L + 1
        doc = int(np.searchsorted(self.starts, start, "right")) - 1
        offset = start - int(self.starts[doc])
        pieces = []
        while need > 0:
            take = min(need, int(self.starts[doc + 1] - self.starts[doc]) - offset)
            if take > 0:
                pieces.append(self.ds.get(doc, offset=offset, length=take))
                need -= take
            doc, offset = doc + 1, 0
        window = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


def __getattr__(name: str):
    """MmapWindows, MegatronWindows: the classes above as torch Datasets, made on first use so that importing
    this module needs no torch; module attributes all the same, so that a worker can unpickle them."""
    bases = {"MmapWindows": _MmapWindows, "MegatronWindows": _MegatronWindows}
    if name not in bases:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    cls = type(name, (bases[name], torch.utils.data.Dataset), {"__module__": __name__})
    globals()[name] = cls
    return cls


def _torch_loader(spec: PeerSpec, clock: EpochClock, dataset_name: str) -> Measurement:
    import torch

    clock.start()
    dataset = getattr(sys.modules[__name__], dataset_name)(spec.data, spec.seq_len)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=spec.batch_size,
        shuffle=True,
        num_workers=spec.cpus,
        worker_init_fn=torch_worker_init,
        generator=torch.Generator().manual_seed(spec.seed),
    )
    for _epoch in range(spec.epochs):
        for batch in loader:
            clock.batch(batch["input_ids"])
    return clock.result()


def run_torch_windows(spec: PeerSpec, clock: EpochClock) -> Measurement:
    return _torch_loader(spec, clock, "MmapWindows")


def run_megatron_windows(spec: PeerSpec, clock: EpochClock) -> Measurement:
    return _torch_loader(spec, clock, "MegatronWindows")


class _Pack:
    """map_batches' function: the window numbers of a block to their tokens (input ids and labels), copied
    out of the memory-mapped .bin (opened once per Ray worker)."""

    def __init__(self, prefix: str, seq_len: int):
        self.prefix, self.seq_len, self.tokens = prefix, seq_len, None

    def __call__(self, batch: dict) -> dict:
        if self.tokens is None:
            self.tokens = _bin(self.prefix)
        L = self.seq_len
        ids = batch["data"]
        out = np.empty((len(ids), L + 1), np.int64)
        for j, i in enumerate(ids):
            out[j] = self.tokens[i * L : i * L + L + 1]
        return {"input_ids": out[:, :-1], "labels": out[:, 1:]}


def run_floor_windows(spec: PeerSpec, clock: EpochClock) -> Measurement:
    """The object store alone: batches of raydl's shape, made once in a Ray actor, returned `per_task` to
    an object (what raydl's plan puts in one) with as many objects in flight as raydl's default prefetch,
    each batch's three arrays turned into torch tensors here. No reading, no plan, no bookkeeping."""
    import ray
    import torch

    from raydl.options import LoaderConfig
    from raydl.plan.scheduling import batches_per_task

    L, B = spec.seq_len, spec.batch_size
    depth = LoaderConfig.prefetch_batches  # objects in flight while one is consumed
    # raydl's own rule, with a budget that binds nothing (as raydl's default does for batches this small)
    per_task = batches_per_task(3 * B * L * 8, depth=depth, budget_bytes=1 << 40, world_size=1)
    ray_init(spec.cpus)
    try:

        @ray.remote(num_cpus=1)
        class Batches:
            def __init__(self):
                tokens = _bin(spec.data)
                self.batch = {
                    "input_ids": np.array(tokens[: B * L], np.int64).reshape(B, L),
                    "labels": np.array(tokens[1 : B * L + 1], np.int64).reshape(B, L),
                    "position_ids": np.tile(np.arange(L, dtype=np.int64), (B, 1)),
                }

            def make(self, sizes: list[int]) -> list[dict]:
                # a view each (pickle would send one object once): Ray copies every batch into the store
                return [{k: v[:rows] for k, v in self.batch.items()} for rows in sizes]

        actor = Batches.remote()
        ray.get(actor.make.remote([1]))  # the actor's start is Ray's, not the hand-over's
        clock.start()
        n = corpus_windows(spec.data, spec.seq_len)
        sizes = [B] * (n // B) + ([n % B] if n % B else [])
        for _epoch in range(spec.epochs):
            tasks = [sizes[i : i + per_task] for i in range(0, len(sizes), per_task)]
            inflight = [actor.make.remote(t) for t in tasks[:depth]]
            for t in tasks[depth:] + [None] * min(depth, len(tasks)):
                ref = inflight.pop(0)
                if t is not None:
                    inflight.append(actor.make.remote(t))
                for batch in ray.get(ref):
                    out = {k: torch.as_tensor(v) for k, v in batch.items()}
                    clock.batch(out["input_ids"])
                del ref
        return clock.result()
    finally:
        ray.shutdown()


def run_raydata_windows(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import ray
    import ray.data

    ray_init(spec.cpus)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        clock.start()
        n = corpus_windows(spec.data, spec.seq_len)
        blocks = np.array_split(_order(n, spec.seed), max(1, min(n, 8 * spec.cpus)))
        pack = _Pack(spec.data, spec.seq_len)
        ds = ray.data.from_numpy(blocks).map_batches(pack, batch_size=spec.batch_size)
        for _epoch in range(spec.epochs):  # each epoch runs the pipeline again
            for batch in ds.iter_torch_batches(batch_size=spec.batch_size):
                clock.batch(batch["input_ids"])
        return clock.result()
    finally:
        ray.shutdown()


WINDOW_PEERS = {
    "raydl": run_raydl_windows,
    "torch": run_torch_windows,
    "megatron": run_megatron_windows,
    "raydata": run_raydata_windows,
    "ceiling": run_ceiling_windows,
    "floor": run_floor_windows,
}

WINDOW_NOTES = {
    "raydl": "raydl: read_tokens(prefix, seq_len=L).loader(shuffle=True, num_workers=1, "
    "threads_per_worker=cpus) + iter_torch_batches(): input_ids, labels, position_ids (B, L) int64.",
    "torch": "torch: DataLoader(shuffle=True, num_workers=cpus, batch_size=B) over a map-style Dataset "
    "slicing window i out of an np.memmap of the .bin: input_ids, labels (B, L) int64.",
    "megatron": "megatron: the same DataLoader over a Dataset reading window i with megatron-core's "
    "IndexedDataset.get(document, offset, length), one piece per document it crosses.",
    "raydata": "raydata: ray.data.from_numpy(the shuffled window numbers) + map_batches (the packing: each "
    "window's tokens copied out of the memory-mapped .bin) + iter_torch_batches(batch_size=B).",
    "ceiling": "ceiling: one thread, no loader: each window of a shuffled order copied out of the "
    "memory-mapped .bin into a (B, L + 1) int64 batch array.",
    "floor": "floor: the object store alone: a Ray actor returns batches of raydl's three (B, L) int64 "
    "arrays (made once; no reading, no plan) as many to an object as raydl puts in one, as many objects in "
    "flight, each turned into torch tensors here; a loader handing such batches over through the object "
    "store, as many to an object, runs no faster on these cores.",
}
