"""read_tokens through the loader on a local Ray: every window once per shuffled epoch across ranks, equal to
the naive definition; exact and elastic resume; a weighted mix of two token corpora."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import raydl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tokens_util import naive_windows, random_docs, write_megatron, write_parquet  # noqa: E402

from loader_util import first_batch_ids  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SEQ = 8


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A Megatron corpus (two files, uint16) and a Parquet one, and their documents."""
    root = tmp_path_factory.mktemp("tokens")
    a, b = random_docs(40, "uint16", 1), random_docs(30, "uint16", 2)
    write_megatron(str(root / "a"), a, "uint16")
    write_megatron(str(root / "b"), b, "uint16")
    rng = np.random.default_rng(5)
    p = [rng.integers(0, 5000, rng.integers(1, 20)) for _ in range(60)]
    write_parquet(str(root / "p.parquet"), p, row_group_size=8)
    return root, a + b, p


def _epoch(it):
    return list(it.iter_batches())


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_window_once_per_shuffled_epoch(ray_local, corpora, world_size):
    """Over all ranks a shuffled epoch delivers every window once (but pad rows), each equal to the naive
    definition; ranks get equal batch counts; the order is shuffled and changes with the epoch."""
    root, docs, _p = corpora
    ds = raydl.read_tokens([str(root / "a"), str(root / "b")], seq_len=SEQ, eod=0)
    windows, pos = naive_windows(docs, SEQ, 0)
    with ds.loader(batch_size=8, world_size=world_size, seed=3, shuffle=True) as loader:
        its = [loader.iterator(r) for r in range(world_size)]
        per_rank = [_epoch(it) for it in its]
        second = _epoch(its[0])
    assert len({len(b) for b in per_rank}) == 1
    stats = its[0].stats()
    assert stats.unit == "windows" and "windows/s" in str(stats)  # stats() counts windows, not images
    ids = np.concatenate([b["id"] for batches in per_rank for b in batches])
    counts = collections.Counter(ids.tolist())
    assert set(counts) == set(range(len(windows)))
    assert sum(c - 1 for c in counts.values()) == len(ids) - len(windows) < world_size
    assert not np.array_equal(np.concatenate([b["id"] for b in per_rank[0]])[: len(second)], np.arange(len(second)))
    assert not np.array_equal(per_rank[0][0]["id"], second[0]["id"])
    for batches in per_rank:
        for b in batches:
            np.testing.assert_array_equal(b["input_ids"], windows[b["id"], :-1])
            np.testing.assert_array_equal(b["labels"], windows[b["id"], 1:])
            np.testing.assert_array_equal(b["position_ids"], pos[b["id"], :-1])
            assert b["input_ids"].dtype == np.int64 and b["input_ids"].shape[1] == SEQ


def test_parquet_epoch_resumes_exactly_and_at_another_world_size(ray_local, corpora):
    """A Parquet corpus (a shuffle window of row groups): a mid-epoch state resumes on the exact next windows;
    a state taken at 2 ranks and loaded at 3 covers the rest of the epoch with no window twice."""
    root, _docs, p = corpora
    ds = raydl.read_tokens(str(root / "p.parquet"), seq_len=SEQ, dtype="int32")
    windows, _pos = naive_windows(p, SEQ, None)
    with ds.loader(batch_size=4, seed=11) as loader:
        it = loader.iterator(0)
        _epoch(it)
        ref_it = loader.iterator(0)
        _epoch(ref_it)
        reference = _epoch(ref_it)  # epoch 1, uninterrupted
        first_batch_ids([it], 3)
        state = json.loads(json.dumps(it.state_dict()))
    with ds.loader(batch_size=4, seed=11) as loader2:
        resumed = loader2.iterator(0)
        resumed.load_state_dict(state)
        rest = _epoch(resumed)
    assert len(rest) == len(reference) - 3
    for a, b in zip(rest, reference[3:], strict=True):
        np.testing.assert_array_equal(a["id"], b["id"])
        np.testing.assert_array_equal(a["input_ids"], windows[a["id"], :-1].astype(np.int32))
    with ds.loader(batch_size=4, world_size=2, seed=2, drop_last=True) as loader:
        its = [loader.iterator(r) for r in range(2)]
        seen = first_batch_ids(its, 3)
        state = its[0].state_dict()
    with ds.loader(batch_size=4, world_size=3, seed=2, drop_last=True) as loader3:
        for r in range(3):
            it = loader3.iterator(r)
            it.load_state_dict(state)
            seen += [b["id"] for b in _epoch(it)]
    ids = np.concatenate(seen)
    assert len(ids) == len(set(ids.tolist()))
    assert len(windows) - len(ids) < 4 * 3


def test_a_weighted_mix_of_two_token_corpora(ray_local, corpora):
    """raydl.mix of a Megatron and a Parquet corpus: stratified batches name each row's source, and each row
    is its own corpus's window."""
    root, docs, p = corpora
    meg = raydl.read_tokens([str(root / "a"), str(root / "b")], seq_len=SEQ)
    par = raydl.read_tokens(str(root / "p.parquet"), seq_len=SEQ)
    ref = {"meg": naive_windows(docs, SEQ, None)[0], "par": naive_windows(p, SEQ, None)[0]}
    mixed = raydl.mix({"meg": meg, "par": par}, weights={"meg": 3, "par": 1}, epoch_size=64)
    with mixed.loader(batch_size=8, seed=4) as loader:
        batches = _epoch(loader.iterator(0))
    sources = collections.Counter()
    for b in batches:
        for row, (sid, src) in enumerate(zip(b["id"].tolist(), b["source"].tolist(), strict=True)):
            np.testing.assert_array_equal(b["input_ids"][row], ref[src][sid, :-1])
            sources[src] += 1
    assert sources["meg"] == 48 and sources["par"] == 16


def test_a_killed_worker_is_replaced_and_the_epoch_is_the_same(ray_local, corpora):
    """Killing the loader worker mid-epoch of a Megatron corpus: its batches run again on a replacement, and
    the epoch's windows are those of an undisturbed one (a worker keeps nothing but its caches)."""
    import ray

    root, docs, _p = corpora
    ds = raydl.read_tokens([str(root / "a"), str(root / "b")], seq_len=SEQ)
    windows, _pos = naive_windows(docs, SEQ, None)
    with ds.loader(batch_size=8, seed=5, num_workers=1) as loader:
        expected = np.concatenate([b["id"] for b in _epoch(loader.iterator(0))])
        loader.refresh()  # the worker is up
        it = loader.iterator(0)
        got = []
        for i, b in enumerate(it.iter_batches()):
            got.append(b["id"])
            np.testing.assert_array_equal(b["input_ids"], windows[b["id"], :-1])
            if i == 1:
                ray.kill(loader.workers()[0].handle, no_restart=True)
        assert it.stats().retries >= 1
    np.testing.assert_array_equal(np.concatenate(got), expected)
