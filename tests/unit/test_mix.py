"""Mixing and per-sample weights as pure functions (raydl/plan/mix.py), checked with no processes, and the
mix's description checks (raydl.mix, Dataset.with_weights) before any actor starts."""

from __future__ import annotations

import numpy as np
import pytest

import raydl
from raydl.describe.mixing import check_sample_weights
from raydl.plan.mix import (
    MixPlan,
    SourcePlan,
    mix_shares,
    per_source_batches,
    stratified_counts,
    weighted_draw,
)
from raydl.plan.order import EpochPlan
from raydl.plan.state import check_mix_state as _check_mix_state

pytestmark = pytest.mark.timeout(60)


def _fp(i: int) -> str:
    return f"{i:016x}" * 4


def _plan(sizes, weights, epoch_size, batching="stratified", batch_size=16, drop_last=False, src=None):
    src = src or {}
    sources = tuple(SourcePlan(n, _fp(i), **src.get(i, {})) for i, n in enumerate(sizes))
    shares = tuple(int(x) for x in mix_shares(weights, epoch_size))
    return MixPlan(sources, shares, batching, batch_size, drop_last)


def _decode(plan, ids):
    """(source, local id) of encoded ids."""
    off = plan.id_offsets
    s = np.searchsorted(off, ids, side="right") - 1
    return s, ids - off[s]


def _epoch_rows(plan, epoch, seed=7, shuffle=True):
    e = plan.epoch(seed=seed, epoch=epoch, shuffle=shuffle)
    if plan.per_source:
        parts = [e.batch(j) for j in range(len(e))]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return e.rows(np.arange(plan.epoch_size))


def test_shares_sum_to_the_epoch_and_round_by_largest_remainder():
    """Each share is weight x epoch_size rounded (floor, then +1 to the largest remainders), summing to the epoch."""
    assert mix_shares([0.7, 0.2, 0.1], 1000).tolist() == [700, 200, 100]
    assert mix_shares([1, 1, 1], 100).tolist() == [34, 33, 33]
    assert mix_shares([2, 1], 10).tolist() == [7, 3]
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = rng.random(rng.integers(1, 6)) + 1e-3
        n = int(rng.integers(1, 10_000))
        s = mix_shares(w, n)
        assert s.sum() == n and (np.abs(s - n * w / w.sum()) < 1).all()


@pytest.mark.parametrize("batch_size", [1, 3, 16, 64, 100, 999, 5000])
def test_stratified_batches_hold_each_share_within_one_sample(batch_size):
    """Every batch holds floor or ceil of its size x share/N of each source, and the columns sum to the shares."""
    rng = np.random.default_rng(batch_size)
    for _ in range(40):
        k = int(rng.integers(1, 6))
        shares = mix_shares(rng.random(k) + 0.01, int(rng.integers(1, 5000)))
        counts = stratified_counts(shares, batch_size)
        assert (counts.sum(0) == shares).all()
        sizes = counts.sum(1)
        assert (sizes[:-1] == batch_size).all() and 0 < sizes[-1] <= batch_size
        quota = sizes[:, None] * shares[None, :] / shares.sum()
        assert (np.abs(counts - quota) < 1).all()


def test_an_epoch_gives_each_source_its_share_and_repeats_or_subsamples_evenly():
    """A small source repeats floor/ceil(share/size) times; a large one is subsampled without replacement, another
    subset each epoch, every sample seen over ceil(size/share) epochs; proportions hold in every batch."""
    plan = _plan([10, 1000, 37], [0.5, 0.3, 0.2], 600, batch_size=32)
    assert plan.shares == (300, 180, 120)
    seen_large = []
    for epoch in range(6):
        ids, slots = _epoch_rows(plan, epoch)
        assert sorted(slots.tolist()) == list(range(600))  # every slot once: seeds differ per repeat
        s, local = _decode(plan, ids)
        assert np.bincount(s, minlength=3).tolist() == [300, 180, 120]
        assert set(np.bincount(local[s == 0], minlength=10).tolist()) == {30}
        assert set(np.bincount(local[s == 2], minlength=37).tolist()) <= {3, 4}
        large = local[s == 1]
        assert len(set(large.tolist())) == 180
        seen_large.append(set(large.tolist()))
        for j in range(0, 600, 32):  # each batch within one sample of its share
            c = np.bincount(s[j : j + 32], minlength=3)
            assert (np.abs(c - len(s[j : j + 32]) * np.array([0.5, 0.3, 0.2])) < 1).all()
    assert all(not (seen_large[e] & seen_large[e + 1]) for e in range(4))  # a different subset each epoch
    assert set().union(*seen_large) == set(range(1000))  # ceil(1000 / 180) = 6 epochs see them all


def test_an_epoch_is_a_pure_function_of_seed_and_epoch():
    """Same (sources, weights, seed, epoch): the same rows; another seed or epoch: others; unshuffled: in order."""
    plan = _plan([50, 80], [1, 3], 200)
    a, b = _epoch_rows(plan, 3), _epoch_rows(plan, 3)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], _epoch_rows(plan, 4)[0])
    assert not np.array_equal(a[0], _epoch_rows(plan, 3, seed=8)[0])
    ids, _ = _epoch_rows(plan, 0, shuffle=False)
    s, local = _decode(plan, ids)
    assert local[s == 1].tolist() == list(range(80)) + list(range(70))  # walks the source in order, wrapping


def test_a_plan_is_dealt_to_ranks_as_one_dataset_and_resumes_at_another_world_size():
    """Positions of a mix go through EpochPlan: all ranks together take every slot once; a re-deal at another world
    size from a mid-epoch point takes the rest exactly once."""
    plan = _plan([40, 400], [0.25, 0.75], 512, batch_size=8)
    e = plan.epoch(seed=1, epoch=0, shuffle=True)
    old = EpochPlan(plan.units, 4, 8, True)
    head = [e.rows(old.positions(r, k))[1] for k in range(5) for r in range(4)]
    new = EpochPlan(plan.units, 3, 8, True, start=old.consumed(5))
    tail = [e.rows(new.positions(r, k))[1] for r in range(3) for k in range(new.batches_per_rank)]
    slots = np.concatenate(head + tail)
    assert len(set(slots.tolist())) == len(slots) and 512 - len(slots) < 3 * 8


def test_per_source_batches_come_from_one_source_in_proportion():
    """per_source: each batch is one source's; ceil(share/B) batches each (floor with drop_last), interleaved
    evenly: after any number of batches each source's count is within one of its proportion."""
    source, index = per_source_batches(np.array([700, 200, 100]), 32, False)
    counts = np.bincount(source, minlength=3)
    assert counts.tolist() == [22, 7, 4]
    assert per_source_batches(np.array([700, 200, 100]), 32, True)[0].size == 21 + 6 + 3
    for t in range(1, len(source) + 1):
        seen = np.bincount(source[:t], minlength=3)
        assert (np.abs(seen - t * counts / counts.sum()) <= 1).all()
    for s in range(3):
        assert index[source == s].tolist() == list(range(counts[s]))
    plan = _plan([100, 30, 1000], [0.7, 0.2, 0.1], 1000, "per_source", batch_size=32)
    e = plan.epoch(seed=2, epoch=0, shuffle=True)
    rows = 0
    for j in range(len(e)):
        ids, _ = e.batch(j)
        s, _local = _decode(plan, ids)
        assert set(s.tolist()) == {e.source_of(j)}
        rows += len(ids)
    assert rows == 1000


def test_sample_weights_are_checked_and_name_the_first_bad_index():
    """Weights must be finite, >= 0, not all zero and one per sample: a ValueError names the first bad index."""
    assert check_sample_weights([1, 0, 2.5], 3, "ds").tolist() == [1.0, 0.0, 2.5]
    for bad, index in (([1, np.nan, 2, np.nan], 1), ([1, 2, -1, 3], 2), ([np.inf, 1, 1, 1], 0)):
        with pytest.raises(ValueError, match=f"weight {index} is"):
            check_sample_weights(bad, 4, "ds")
    with pytest.raises(ValueError, match="every weight is 0"):
        check_sample_weights([0, 0], 2, "ds")
    with pytest.raises(ValueError, match="3 weights for 4 samples"):
        check_sample_weights([1, 1, 1], 4, "ds")


def test_a_weighted_draw_matches_its_probabilities():
    """Chi-square at a fixed seed: 200,000 draws over 10 samples with weights 0..9 (sample 0 never drawn); the
    statistic over the 9 drawn samples (8 degrees of freedom) must be under 26.12, the 0.1% critical value."""
    w = np.arange(10, dtype=np.float64)
    plan = _plan([10], [1], 200_000, src={0: {"weights": w}})
    ids, _ = _epoch_rows(plan, 0)
    counts = np.bincount(ids, minlength=10)
    assert counts[0] == 0
    expected = 200_000 * w[1:] / w.sum()
    chi2 = float((((counts[1:] - expected) ** 2) / expected).sum())
    assert chi2 < 26.12, (chi2, counts.tolist())
    again, _ = _epoch_rows(plan, 0)
    np.testing.assert_array_equal(ids, again)  # deterministic
    assert not np.array_equal(ids, _epoch_rows(plan, 1)[0])  # another epoch, other draws
    cdf = np.cumsum(w)
    assert weighted_draw(cdf, np.arange(1000), key=5).max() <= 9


def test_windowed_sources_keep_their_locality_in_a_mix():
    """A source shuffled a window of parts at a time (Parquet row groups) gives a batch's rows from few parts."""
    counts = np.full(100, 50)  # 100 row groups of 50 rows
    plan = _plan([5000, 200], [0.5, 0.5], 2000, batch_size=64, src={0: {"window": 4, "part_counts": counts}})
    ids, _ = _epoch_rows(plan, 0)
    s, local = _decode(plan, ids)
    parts = local[s == 0] // 50
    per_batch = [len(set(parts[j : j + 32].tolist())) for j in range(0, len(parts), 32)]
    assert max(per_batch) <= 8  # at most two windows of 4 row groups, not 32 of 100


def test_a_mix_state_refuses_changed_weights_naming_them():
    """A state of one mix refuses another's weights (naming both), its sources' data, or one dataset."""
    mine = {
        "sources": ["a", "b"],
        "weights": [0.7, 0.3],
        "epoch_size": 10,
        "batching": "stratified",
        "sample_weights": [None, None],
        "fingerprints": ["x", "y"],
    }
    _check_mix_state(dict(mine), mine)
    with pytest.raises(ValueError, match=r"weights changed: the state has \{'a': 0.5, 'b': 0.5\}"):
        _check_mix_state({**mine, "weights": [0.5, 0.5]}, mine)
    with pytest.raises(ValueError, match=r"per-sample weights of source\(s\) \['b'\]"):
        _check_mix_state({**mine, "sample_weights": [None, "abc"]}, mine)
    with pytest.raises(ValueError, match=r"data of source\(s\) \['a'\]"):
        _check_mix_state({**mine, "fingerprints": ["z", "y"]}, mine)
    with pytest.raises(ValueError, match="epoch_size"):
        _check_mix_state({**mine, "epoch_size": 11}, mine)
    with pytest.raises(ValueError, match="state is of one dataset, this loader is of a mix"):
        _check_mix_state(None, mine)


# -- raydl.mix and with_weights: the description, no actors ---------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from raydl.demo import make_images

    out = []
    for i, n in enumerate((12, 30)):
        root = tmp_path_factory.mktemp(f"mix{i}")
        make_images(str(root), n, classes=2, seed=i, corrupt=0)
        out.append(str(root))
    return out


def _ds(root, size=32):
    return raydl.read_images(root).decode().random_resized_crop(size).normalize()


def test_mix_checks_fields_shapes_and_weights_before_any_actor(folders):
    """Mismatched shapes name the source and field; weights must name every dataset; bad batching, stages on a mix,
    nested mixes, and bucketed datasets other than all with the same buckets, per_source, are ValueErrors."""
    a, b = folders
    m = raydl.mix({"web": _ds(a), "curated": _ds(b)}, weights={"web": 2, "curated": 1})
    assert isinstance(m, raydl.Dataset) and len(m) == 12 + 30
    assert "'web' weight=0.6667" in repr(m)
    with pytest.raises(
        ValueError,
        match=r"source 'curated' decodes image float32 \(3, 48, 48\), source 'web' image float32 \(3, 32, 32\)",
    ):
        raydl.mix({"web": _ds(a), "curated": _ds(b, 48)}, weights={"web": 1, "curated": 1})
    raydl.mix({"web": _ds(a), "curated": _ds(b, 48)}, weights={"web": 1, "curated": 1}, batching="per_source")
    with pytest.raises(ValueError, match=r"missing \['curated'\], unknown \['x'\]"):
        raydl.mix({"web": _ds(a), "curated": _ds(b)}, weights={"web": 1, "x": 1})
    with pytest.raises(ValueError, match="batching must be one of"):
        raydl.mix({"web": _ds(a)}, weights={"web": 1}, batching="random")
    with pytest.raises(ValueError, match="the weight of 'web' is -1"):
        raydl.mix({"web": _ds(a), "c": _ds(b)}, weights={"web": -1, "c": 1})
    with pytest.raises(ValueError, match="give each dataset its stages before raydl.mix"):
        m.random_hflip()
    with pytest.raises(ValueError, match="is a mix itself"):
        raydl.mix({"m": m}, weights={"m": 1})
    bucketed = raydl.read_images(a).decode().aspect_buckets(64)
    with pytest.raises(ValueError, match="bucketed datasets mix with batching='per_source'"):
        raydl.mix({"b": bucketed, "c": bucketed}, weights={"b": 1, "c": 1})
    with pytest.raises(ValueError, match=r"'b' has aspect_buckets\(\) and 'c' has not"):
        raydl.mix({"b": bucketed, "c": _ds(b)}, weights={"b": 1, "c": 1}, batching="per_source")
    other = raydl.read_images(b).decode().aspect_buckets(128)
    with pytest.raises(ValueError, match="'c' and 'b' have different aspect buckets"):
        raydl.mix({"b": bucketed, "c": other}, weights={"b": 1, "c": 1}, batching="per_source")
    raydl.mix({"b": bucketed, "c": bucketed}, weights={"b": 1, "c": 1}, batching="per_source")


def test_with_weights_checks_its_weights(folders):
    """with_weights takes one weight per sample (ValueError naming the first bad index) and sets the epoch size."""
    a, _ = folders
    ds = _ds(a)
    w = ds.with_weights(np.ones(12), epoch_size=100)
    assert len(w) == 100 and w.weights.tolist() == [1.0] * 12
    with pytest.raises(ValueError, match="weight 3 is nan"):
        ds.with_weights([1, 1, 1, np.nan] + [1] * 8)
    with pytest.raises(ValueError, match="a column name"):
        ds.with_weights("w")


def test_a_weighted_source_in_a_mix_gets_its_share_drawn_by_its_weights():
    """A weighted source mixed with a plain one: the mix gives it its share, its weights pick the rows (zero-weight
    samples never), the plain one still walks its permutation."""
    w = np.zeros(50)
    w[[3, 7, 11]] = [1, 1, 2]
    plan = _plan([50, 20], [0.5, 0.5], 400, batch_size=20, src={0: {"weights": w}})
    ids, _ = _epoch_rows(plan, 0)
    s, local = _decode(plan, ids)
    assert np.bincount(s).tolist() == [200, 200]
    drawn = np.bincount(local[s == 0], minlength=50)
    assert set(np.flatnonzero(drawn).tolist()) == {3, 7, 11} and 70 < drawn[11] < 130  # about 100 of 200
    assert set(np.bincount(local[s == 1], minlength=20).tolist()) == {10}


def test_whole_orders_and_lazy_lookups_give_the_same_rows(monkeypatch):
    """Sources small enough to have their orders computed whole give exactly the rows the lazy, per-position
    lookups of larger ones give (EAGER_ORDER only changes the cost)."""
    import raydl.plan.mix as mix

    counts = np.full(10, 30)
    plan = _plan([300, 41], [0.6, 0.4], 500, batch_size=16, src={0: {"window": 2, "part_counts": counts}})
    eager = _epoch_rows(plan, 2)
    monkeypatch.setattr(mix, "EAGER_ORDER", 0)
    lazy = _epoch_rows(
        _plan([300, 41], [0.6, 0.4], 500, batch_size=16, src={0: {"window": 2, "part_counts": counts}}), 2
    )
    np.testing.assert_array_equal(eager[0], lazy[0])
    np.testing.assert_array_equal(eager[1], lazy[1])
