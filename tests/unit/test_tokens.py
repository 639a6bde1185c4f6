"""read_tokens: windows, labels and positions equal the naive definition (concatenate the documents, with eod,
and slice) on Megatron .bin/.idx files of every token dtype and on Parquet token lists; the catalog is a few
numbers per file or row group; the batch path in one process; bad input named at listing."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokens_util import CODES, naive_windows, random_docs, write_megatron, write_parquet

import raydl
import raydl.sources._tokens_source as tokens_source
import raydl.sources.tokens as tokens_listing
from raydl.actors.worker import BatchTask, LoaderWorker, WorkerSpec
from raydl.errors import DataSourceError
from raydl.plan.order import augmentation_seeds
from raydl.sources._megatron import write_index

from counting_storage import CountingStorage  # beside this file

pytestmark = pytest.mark.timeout(120)


def _all(ds, order=None):
    """Every window of `ds` read as a worker reads a batch (in `order`, then put back in id order)."""
    cat = ds.catalog
    ids = np.arange(len(ds)) if order is None else np.asarray(order)
    got = cat.source.read_batch(cat, cat.storage, ids)
    back = np.argsort(ids)
    return {k: got[k][back] for k in ("input_ids", "labels", "position_ids")}


def _check(ds, docs, seq_len, eod, order=None):
    windows, pos = naive_windows(docs, seq_len, eod)
    assert (
        len(ds)
        == len(windows)
        == (sum(0 if d is None else len(d) for d in docs) + (len(docs) if eod is not None else 0) - 1)
        // seq_len
    )
    got = _all(ds, order)
    np.testing.assert_array_equal(got["input_ids"], windows[:, :-1])
    np.testing.assert_array_equal(got["labels"], windows[:, 1:])
    np.testing.assert_array_equal(got["position_ids"], pos[:, :-1])


@pytest.fixture(autouse=True)
def _fresh_caches():
    tokens_source.clear_token_caches()
    yield
    tokens_source.clear_token_caches()


@pytest.mark.parametrize("dtype", sorted(CODES))
@pytest.mark.parametrize("eod", [None, 7])
def test_megatron_windows_equal_the_naive_definition_for_every_dtype(tmp_path, monkeypatch, dtype, eod):
    """Two Megatron datasets of one dtype, listed in stretches of 16 tokens: every window, label and position,
    read in a shuffled order, equals the naive slice of the concatenated documents (+ eod)."""
    monkeypatch.setattr(tokens_listing, "CHUNK_TOKENS", 16)
    a, b = random_docs(20, dtype, 1), random_docs(9, dtype, 2)
    write_megatron(str(tmp_path / "a"), a, dtype)
    write_megatron(str(tmp_path / "b"), b, dtype)
    for seq_len in (1, 5, 64):
        ds = raydl.read_tokens([str(tmp_path / "a"), str(tmp_path / "b")], seq_len=seq_len, eod=eod)
        order = np.random.default_rng(seq_len).permutation(len(ds))
        _check(ds, a + b, seq_len, eod, order)
        assert ds.catalog.source.shuffle_window == 0  # local .bin: a global shuffle
        assert ds.catalog.num_parts >= 2


def test_int32_output_and_positions_continue_through_eod(tmp_path):
    """dtype="int32" gives int32 columns; an eod token belongs to the document it ends (its position follows
    that document's last token), and positions count on across a window's start."""
    write_megatron(str(tmp_path / "c"), [np.array([5, 6, 7], np.int32), np.array([8, 9], np.int32)], "int32")
    ds = raydl.read_tokens(str(tmp_path / "c"), seq_len=2, eod=0, dtype="int32")
    got = _all(ds)
    assert all(v.dtype == np.int32 for v in got.values())
    # stream 5 6 7 0 8 9 0 -> windows [5 6 7], [7 0 8], [8 9 0]
    np.testing.assert_array_equal(got["input_ids"], [[5, 6], [7, 0], [8, 9]])
    np.testing.assert_array_equal(got["labels"], [[6, 7], [0, 8], [9, 0]])
    np.testing.assert_array_equal(got["position_ids"], [[0, 1], [2, 3], [0, 1]])


def test_raydl_writes_the_index_megatron_writes_and_reads(tmp_path):
    """megatron-core's IndexedDatasetBuilder writes reference files of every dtype; raydl's index writer writes
    the same bytes, its IndexedDataset reads the same documents, and raydl's windows equal the naive ones."""
    torch = pytest.importorskip("torch")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    for k, dtype in enumerate(sorted(CODES)):
        docs = random_docs(15, dtype, 10 + k)
        prefix = str(tmp_path / f"m_{dtype}")
        builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.dtype(dtype).type)
        for d in docs:
            builder.add_item(torch.from_numpy(d.astype(np.int64)))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        write_index(str(tmp_path / "ours.idx"), [len(d) for d in docs], dtype)
        with open(prefix + ".idx", "rb") as f, open(tmp_path / "ours.idx", "rb") as g:
            assert f.read() == g.read()
        theirs = indexed.IndexedDataset(prefix)
        read = [np.asarray(theirs[i]) for i in range(len(theirs))]
        assert all(np.array_equal(x, y) for x, y in zip(read, docs, strict=True))
        for eod in (None, 1):
            _check(raydl.read_tokens(prefix, seq_len=6, eod=eod), read, 6, eod)


@pytest.mark.parametrize(
    "kind,value",
    [("list", pa.int32()), ("large_list", pa.int64()), ("list", pa.uint16()), ("fixed", pa.int16())],
)
@pytest.mark.parametrize("eod", [None, 3])
def test_parquet_windows_equal_the_naive_definition(tmp_path, kind, value, eod):
    """Two Parquet files of token lists (list, large list, fixed-size list; empty and null rows), several row
    groups each: every window equals the naive slice; the catalog is one part per row group."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 1000, 8 if kind == "fixed" else rng.integers(0, 12)) for _ in range(23)]
    if kind != "fixed":
        docs[4], docs[9] = None, []
    write_parquet(str(tmp_path / "a.parquet"), docs[:15], kind, value, row_group_size=4)
    write_parquet(str(tmp_path / "b.parquet"), docs[15:], kind, value, row_group_size=3)
    ds = raydl.read_tokens([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], seq_len=5, eod=eod)
    assert ds.catalog.num_parts == 4 + 3
    assert ds.catalog.source.shuffle_window >= 1  # row groups: a window of parts at a time
    _check(ds, docs, 5, eod, np.random.default_rng(0).permutation(len(ds)))


def test_megatron_and_parquet_in_one_stream_and_patterns(tmp_path):
    """A pattern of .bin files and a Parquet file in one list: the stream is their documents in that order
    (a window may span both)."""
    a, b = random_docs(5, "uint16", 4), random_docs(4, "uint16", 5)
    write_megatron(str(tmp_path / "x1"), a, "uint16")
    write_megatron(str(tmp_path / "x2"), b, "uint16")
    p = [np.arange(7), np.arange(3) + 100]
    write_parquet(str(tmp_path / "p.parquet"), p)
    ds = raydl.read_tokens([str(tmp_path / "x*.bin"), str(tmp_path / "p.parquet")], seq_len=4, eod=9)
    _check(ds, a + b + p, 4, 9)


def test_listing_reads_only_indexes_and_footers_and_a_remote_bin_in_ranges(tmp_path, monkeypatch):
    """Listing reads the .idx and each footer, never a .bin or a row group; a .bin read as remote (ranged reads
    through the storage, the index fetched once per process) gives the same windows, one read per run of
    neighbouring windows."""
    docs = random_docs(40, "int32", 6)
    write_megatron(str(tmp_path / "r"), docs, "int32")
    write_parquet(str(tmp_path / "p.parquet"), [np.arange(10)] * 5)
    storage = CountingStorage()
    ds = raydl.read_tokens([str(tmp_path / "r"), str(tmp_path / "p.parquet")], seq_len=8)
    cat = dataclasses.replace(ds.catalog, storage=storage)
    tokens_listing.list_tokens(
        [str(tmp_path / "p.parquet")], storage=storage, seq_len=8, column="input_ids", eod=None, dtype="int64"
    )
    size = os.path.getsize(tmp_path / "p.parquet")
    assert storage.reads and all(u.endswith(".parquet") and off + n == size for u, off, n in storage.reads)
    storage.reads.clear()
    monkeypatch.setattr(tokens_source, "split_scheme", lambda uri: ("s3", uri))
    n_bin = (sum(len(d) for d in docs)) // 8 - 1
    got = cat.source.read_batch(cat, storage, np.arange(n_bin))
    windows, _ = naive_windows(docs + [np.arange(10)] * 5, 8, None)
    np.testing.assert_array_equal(got["input_ids"], windows[:n_bin, :-1])
    bin_reads = [r for r in storage.reads if r[0].endswith(".bin")]
    assert len(bin_reads) == 1  # consecutive windows: one merged range
    assert storage.reads.count((str(tmp_path / "r.idx"), 0, os.path.getsize(tmp_path / "r.idx"))) <= 1


def test_a_batch_through_a_loader_worker(tmp_path):
    """A LoaderWorker (in this process) makes a token batch: the three fields, id and key, map_batches runs."""
    docs = random_docs(30, "int64", 7)
    write_megatron(str(tmp_path / "w"), docs, "int64")
    ds = raydl.read_tokens(str(tmp_path / "w"), seq_len=4).map_batches(_add_one)
    spec = WorkerSpec(program=None, threads=2, batch_stages=ds.mixture().members[0].pipeline.batch_stages)
    worker = LoaderWorker(spec, ds.catalog, reuse_buffers=False)
    ids = np.array([5, 0, 3], np.int64)
    result = worker.run_batch(
        BatchTask(rank=0, epoch=0, index=0, ids=ids, seeds=augmentation_seeds(ids, seed=0, epoch=0))
    )
    windows, pos = naive_windows(docs, 4, None)
    b = result.batch
    np.testing.assert_array_equal(b["id"], ids)
    np.testing.assert_array_equal(b["input_ids"], windows[ids, :-1] + 1)
    np.testing.assert_array_equal(b["position_ids"], pos[ids, :-1])
    assert b["key"] == ["5", "0", "3"]


def _add_one(batch):
    batch["input_ids"] = batch["input_ids"] + 1
    return batch


def test_per_sample_stages_are_refused(tmp_path):
    """.map on a token dataset is a ValueError before any actor starts (windows are made a batch at a time)."""
    from raydl.execute.checks import check_mixture

    write_megatron(str(tmp_path / "s"), random_docs(10, "int32", 8), "int32")
    ds = raydl.read_tokens(str(tmp_path / "s"), seq_len=2).map(lambda r: r)
    with pytest.raises(ValueError, match="per-sample stages"):
        check_mixture(ds.mixture())


# -- bad input ----------------------------------------------------------------------------------------------
def _bad_megatron(tmp_path, **kw) -> str:
    docs = [np.arange(10, dtype=np.int32), np.arange(6, dtype=np.int32)]
    write_megatron(str(tmp_path / "bad"), docs, "int32", **kw)
    return str(tmp_path / "bad")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"magic": b"NOTANIDX\x00"}, r"bad\.idx is not a Megatron-LM index: no MMIDIDX magic"),
        ({"version": 2}, r"bad\.idx: Megatron-LM index version 2; raydl reads version 1"),
        ({"code": 6}, r"bad\.idx: token dtype code 6 is not an integer token type"),
        ({"count": 1 << 60}, r"bad\.idx: the index says 1152921504606846976 sequences .* but it has \d+"),
        (
            {"pointers": [0, 1 << 40]},
            r"bad\.idx: sequence 1's pointer 1099511627776 is past the end of .*bad\.bin",
        ),
        ({"pointers": [0, 8]}, r"bad\.idx: sequence 1 starts at byte 8 of .*bad\.bin, not at 40"),
        ({"bin_cut": 4}, r"bad\.bin is 60 bytes, shorter than the 64 bytes its index"),
    ],
)
def test_bad_megatron_files_are_named_at_listing(tmp_path, kw, match):
    """Each malformed index or short .bin is a DataSourceError naming the file, raised while listing."""
    prefix = _bad_megatron(tmp_path, **kw)
    with pytest.raises(DataSourceError, match=match):
        raydl.read_tokens(prefix, seq_len=2)


@pytest.mark.parametrize(
    "defect,match",
    [
        ("negative", r"big\.idx: sequence 9 has length -3"),
        ("pointer", r"big\.idx: sequence 10 starts at byte 44 of .*big\.bin, not at 40"),
        ("short", r"big\.bin is 46 bytes, shorter than the 48 bytes its index"),
        ("long", r"big\.idx: sequence 8 starts at byte 32 of .*big\.bin, not at 68"),
    ],
)
def test_an_index_is_checked_in_chunks_with_the_same_errors(tmp_path, monkeypatch, defect, match):
    """The index is checked a chunk of sequences at a time (here 4): a defect in a later chunk names the
    right sequence and byte, and where the sequences before it end carries across chunks."""
    import raydl.sources._megatron as megatron

    monkeypatch.setattr(megatron, "_CHECK_CHUNK", 4)
    docs = [np.arange(1, dtype=np.int32) for _ in range(12)]  # 12 sequences of 1 int32 token: 48 bytes
    lengths = [1] * 12
    pointers = [4 * i for i in range(12)]
    if defect == "negative":
        lengths[9] = -3
    if defect == "pointer":
        pointers[10] = 44
    if defect == "long":  # sequence 7 says 10 tokens: its chunk ends past the .bin before the next is read
        lengths[7] = 10
    write_megatron(
        str(tmp_path / "big"), docs, "int32", pointers=pointers, bin_cut=2 if defect == "short" else 0
    )
    if defect in ("negative", "long"):  # lengths the documents written do not have
        idx = tmp_path / "big.idx"
        raw = bytearray(idx.read_bytes())
        raw[34 : 34 + 48] = np.asarray(lengths, np.int32).tobytes()
        idx.write_bytes(bytes(raw))
    with pytest.raises(DataSourceError, match=match):
        raydl.read_tokens(str(tmp_path / "big"), seq_len=2)
    monkeypatch.setattr(megatron, "_CHECK_CHUNK", 1 << 20)
    with pytest.raises(DataSourceError, match=match):  # the same error in one chunk
        raydl.read_tokens(str(tmp_path / "big"), seq_len=2)


def test_bad_arguments_columns_and_sizes(tmp_path):
    """seq_len < 1, a bad dtype, a column that is not a list of integers, a missing column, too few tokens and
    a path that is neither kind are clear errors naming the argument or the file."""
    write_megatron(str(tmp_path / "t"), [np.arange(5, dtype=np.int32)], "int32")
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1"):
        raydl.read_tokens(str(tmp_path / "t"), seq_len=0)
    with pytest.raises(ValueError, match="dtype must be 'int64' or 'int32'"):
        raydl.read_tokens(str(tmp_path / "t"), seq_len=2, dtype="float32")
    with pytest.raises(
        DataSourceError, match=r"holds 5 tokens in all, fewer than a window of seq_len \+ 1 = 6"
    ):
        raydl.read_tokens(str(tmp_path / "t"), seq_len=5)
    pq.write_table(pa.table({"input_ids": pa.array([["a"], ["b"]]), "n": [1, 2]}), tmp_path / "s.parquet")
    with pytest.raises(
        ValueError, match=r"s\.parquet: column 'input_ids' is list<element: string>, not a list of"
    ):
        raydl.read_tokens(str(tmp_path / "s.parquet"), seq_len=1)
    with pytest.raises(ValueError, match=r"s\.parquet: column 'n' is int64, not a list of integers"):
        raydl.read_tokens(str(tmp_path / "s.parquet"), seq_len=1, column="n")
    with pytest.raises(ValueError, match=r"s\.parquet has no column 'tokens'"):
        raydl.read_tokens(str(tmp_path / "s.parquet"), seq_len=1, column="tokens")
    with pytest.raises(DataSourceError, match="does not exist"):
        raydl.read_tokens(str(tmp_path / "nothing"), seq_len=1)
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="neither a Megatron dataset"):
        raydl.read_tokens(str(tmp_path / "x.txt"), seq_len=1)
    os.remove(tmp_path / "t.idx")
    with pytest.raises(DataSourceError, match=r"t\.bin has no index beside it"):
        raydl.read_tokens(str(tmp_path / "t*.bin"), seq_len=1)


def test_a_file_changed_after_listing_fails_the_batch_naming_it(tmp_path):
    """A .bin rewritten shorter after listing: the worker's read is an error naming it, not wrong tokens."""
    write_megatron(str(tmp_path / "ch"), [np.arange(40, dtype=np.int32)], "int32")
    ds = raydl.read_tokens(str(tmp_path / "ch"), seq_len=4)
    write_megatron(str(tmp_path / "ch"), [np.arange(40, dtype=np.int32)], "int32", bin_cut=8)
    cat = dataclasses.replace(ds.catalog, shards=ds.catalog.shards)  # as listed
    with pytest.raises(DataSourceError, match=r"ch\.bin"):
        cat.source.read_batch(cat, cat.storage, np.arange(3))


def test_the_plan_counts_a_windows_batch_bytes(tmp_path):
    """The plan's batch size in bytes (the object-store budget) is the three (B, seq_len) arrays of `dtype`."""
    from raydl.options import LoaderConfig
    from raydl.plan.build import build_plan

    write_megatron(str(tmp_path / "pb"), random_docs(50, "uint8", 9), "uint8")
    ds = raydl.read_tokens(str(tmp_path / "pb"), seq_len=16, dtype="int32")
    plan = build_plan(ds.mixture(), LoaderConfig(batch_size=4))
    assert plan.batch_bytes == 4 * 3 * 16 * 4


@pytest.mark.parametrize("remote", [False, True])
def test_many_short_documents_and_remote_reads_with_eod(tmp_path, monkeypatch, remote):
    """Documents of 0 to 2 tokens (dozens in a window: the vectorized path) and long ones (a few: runs copied
    between eods), local or read in ranges as a remote .bin, with eod: every window equals the naive one."""
    if remote:
        monkeypatch.setattr(tokens_source, "split_scheme", lambda uri: ("s3", uri))
    short, long = random_docs(400, "int16", 11, max_len=2), random_docs(20, "int16", 12, max_len=300)
    write_megatron(str(tmp_path / "short"), short, "int16")
    write_megatron(str(tmp_path / "long"), long, "int16")
    for seq_len in (3, 64):
        ds = raydl.read_tokens(
            [str(tmp_path / "short"), str(tmp_path / "long")], seq_len=seq_len, eod=-1 + 40000
        )
        _check(ds, short + long, seq_len, 39999, np.random.default_rng(seq_len).permutation(len(ds)))


@pytest.mark.parametrize("eod", [None, 7])
def test_a_sequence_of_the_longest_int32_length_reads_with_and_without_eod(tmp_path, eod):
    """A Megatron sequence of 2**31 - 1 tokens (the index's int32 maximum; a sparse 2 GiB .bin of zeros) and one
    of 1: its length + 1 (the eod) must not wrap int32, so the first and last windows read as the stream says."""
    prefix = str(tmp_path / "big")
    lengths = [2**31 - 1, 1]
    with open(prefix + ".bin", "wb") as f:
        f.truncate(sum(lengths))  # sparse: no disk used
    write_index(prefix + ".idx", lengths, np.uint8)
    ds = raydl.read_tokens(prefix, seq_len=8, eod=eod)
    cat = ds.catalog
    first, last = (cat.source.read_batch(cat, cat.storage, np.array([w]))["input_ids"][0] for w in (0, len(ds) - 1))
    assert not first.any()
    if eod is None:  # a stream of 2**31 zeros; a window's inputs are 8 tokens, its labels one further
        assert len(ds) == (2**31 - 1) // 8 and not last.any()
    else:  # 2**31 - 1 zeros, eod, a zero, eod: the last window's inputs end with the first eod
        assert len(ds) == (2**31 + 2 - 1) // 8 and list(last[-2:]) == [0, 7]


def test_parquet_written_without_statistics_lists_its_real_tokens(tmp_path):
    """A token file written without statistics (no null counts in its footer): num_values also counts each
    empty or null row, so listing counts the tokens themselves; every window equals the naive slice."""
    docs = [np.arange(6), [], None, np.arange(10, 14)] * 20
    path = str(tmp_path / "nostats.parquet")
    table = pa.table({"input_ids": pa.array([None if d is None else list(d) for d in docs], pa.list_(pa.int32()))})
    pq.write_table(table, path, write_statistics=False, row_group_size=30)
    assert pq.read_metadata(path).row_group(0).column(0).statistics is None
    for eod in (None, 5):
        ds = raydl.read_tokens(path, seq_len=4, eod=eod)
        _check(ds, docs, 4, eod)
