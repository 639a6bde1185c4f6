"""The plan as pure functions, checked over simulated worlds with no processes.

Every world (world size x dataset size x batch size x drop_last) is dealt in
full through EpochPlan's public methods and the resulting multiset of
positions is checked against what plan.py's module docstring promises.
"""
from __future__ import annotations

import inspect
import time

import numpy as np
import pytest

from raydl.plan.order import EpochOrder, EpochPlan, augmentation_seeds, epoch_order, substitute_id

pytestmark = pytest.mark.timeout(60)

WORLD_SIZES = (1, 2, 3, 4, 5, 7, 8, 16, 31, 64)
NUM_SAMPLES = (1, 2, 7, 100, 257, 1000, 4099)
BATCH_SIZES = (1, 3, 32, 256)
FP = "0123456789abcdef0123456789abcdef"


def _worlds():
    """(n, B) pairs; B=1 with n=4099 is skipped to keep the tier fast (B=3 covers it)."""
    for n in NUM_SAMPLES:
        for b in BATCH_SIZES:
            if not (b == 1 and n > 1000):
                yield n, b


def deal(plan: EpochPlan) -> list[list[np.ndarray]]:
    """positions[rank][k] for every rank and batch of the plan."""
    return [[plan.positions(r, k) for k in range(plan.batches_per_rank)] for r in range(plan.world_size)]


def delivered(plan: EpochPlan) -> np.ndarray:
    """All positions the plan hands out, over every rank and batch (pad rows included)."""
    parts = [p for rank in deal(plan) for p in rank]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def round_robin(plan: EpochPlan) -> np.ndarray:
    """Positions in the order they are dealt: round k, then rank r within the round."""
    parts = [plan.positions(r, k) for k in range(plan.batches_per_rank) for r in range(plan.world_size)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


# ---------------------------------------------------------------- dealing ----


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_drop_last_delivers_each_sample_at_most_once(world_size):
    """drop_last=True: full batches only, no repeats, and fewer than B*W samples left out (the dropped tail)."""
    W = world_size
    for n, B in _worlds():
        plan = EpochPlan(n, W, B, drop_last=True)
        ctx = f"n={n} W={W} B={B}"
        assert plan.batches_per_rank == n // (B * W), ctx
        assert plan.samples_per_rank == plan.batches_per_rank * B, ctx
        for rank in deal(plan):
            assert len(rank) == plan.batches_per_rank, ctx
            assert all(len(p) == B for p in rank), ctx
        pos = delivered(plan)
        assert len(np.unique(pos)) == len(pos), ctx
        assert 0 <= n - len(pos) < B * W, ctx
        # What is dropped is the incomplete last round, i.e. the tail of the order.
        np.testing.assert_array_equal(np.sort(pos), np.arange(len(pos)), err_msg=ctx)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_drop_last_delivers_every_sample_and_only_pad_rows_repeat(world_size):
    """drop_last=False: every sample at least once; the samples_per_rank*W - n (< W) pad rows wrap to the start."""
    W = world_size
    for n, B in _worlds():
        plan = EpochPlan(n, W, B, drop_last=False)
        ctx = f"n={n} W={W} B={B}"
        pos = delivered(plan)
        pad = plan.samples_per_rank * W - n
        assert 0 <= pad < W, ctx
        assert len(pos) == n + pad, ctx
        # The multiset of positions is the whole order plus `pad` rows wrapped to its start.
        expected = np.sort(np.concatenate([np.arange(n), np.arange(pad) % n]))
        np.testing.assert_array_equal(np.sort(pos), expected, err_msg=ctx)
        # Dealt in round-robin order, the positions are the order itself, then the pad.
        np.testing.assert_array_equal(round_robin(plan), np.arange(n + pad) % n, err_msg=ctx)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_gets_the_same_batches(world_size, drop_last):
    """Every rank has batches_per_rank batches, batch k has the same length on every rank, batch bpr is out of range."""
    W = world_size
    for n, B in _worlds():
        plan = EpochPlan(n, W, B, drop_last=drop_last)
        ctx = f"n={n} W={W} B={B} drop_last={drop_last}"
        lengths = np.array([[len(p) for p in rank] for rank in deal(plan)]).reshape(W, plan.batches_per_rank)
        assert (lengths == lengths[0]).all(), ctx
        assert lengths.sum(axis=1).tolist() == [plan.samples_per_rank] * W, ctx
        # All batches but the last are full.
        assert (lengths[:, :-1] == B).all(), ctx
        for r in range(W):
            with pytest.raises(IndexError):
                plan.positions(r, plan.batches_per_rank)


@pytest.mark.parametrize("n,B", [(1, 1), (7, 3), (100, 32), (257, 256), (1000, 3), (4099, 256), (4096, 256)])
def test_single_rank_gets_every_sample_once_with_a_short_last_batch(n, B):
    """W=1, drop_last=False: nothing is padded; each sample exactly once, the last batch holds the remainder."""
    plan = EpochPlan(n, 1, B, drop_last=False)
    batches = deal(plan)[0]
    assert plan.batches_per_rank == -(-n // B)
    np.testing.assert_array_equal(np.concatenate(batches), np.arange(n))
    assert [len(b) for b in batches[:-1]] == [B] * (len(batches) - 1)
    assert len(batches[-1]) == n - (len(batches) - 1) * B


def test_batch_ids_map_positions_through_the_order():
    """batch_ids is the order indexed by positions: with a shuffled order every id still comes out (drop_last=False)."""
    n, W, B = 1000, 7, 32
    order = epoch_order(n, seed=3, epoch=1, shuffle=True, fingerprint=FP)
    plan = EpochPlan(n, W, B, drop_last=False)
    ids = np.concatenate([plan.batch_ids(order, r, k) for r in range(W) for k in range(plan.batches_per_rank)])
    assert set(ids.tolist()) == set(range(n))
    np.testing.assert_array_equal(plan.batch_ids(order, 2, 1), order[plan.positions(2, 1)])


def test_plan_rejects_bad_arguments():
    """Non-positive sizes, a start outside [0, n], a bad rank or batch index and a bad consumed() count are refused."""
    for kwargs in ({"num_samples": 0}, {"world_size": 0}, {"batch_size": -1}):
        args = {"num_samples": 10, "world_size": 2, "batch_size": 3, "drop_last": False, **kwargs}
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            EpochPlan(**args)
    with pytest.raises(ValueError, match="start"):
        EpochPlan(10, 2, 3, drop_last=False, start=11)
    with pytest.raises(ValueError, match="start"):
        EpochPlan(10, 2, 3, drop_last=False, start=-1)
    plan = EpochPlan(10, 2, 3, drop_last=False)
    with pytest.raises(ValueError, match="rank"):
        plan.positions(2, 0)
    with pytest.raises(IndexError):
        plan.positions(0, -1)
    with pytest.raises(ValueError, match="batches_done"):
        plan.consumed(plan.batches_per_rank + 1)


def test_plan_from_the_end_is_empty():
    """A plan starting at num_samples (epoch fully consumed) has no batches, whatever drop_last."""
    for drop_last in (True, False):
        plan = EpochPlan(100, 3, 8, drop_last=drop_last, start=100)
        assert plan.batches_per_rank == 0
        assert plan.samples_per_rank == 0
        assert plan.consumed(0) == 100


# ------------------------------------------------------------------ order ----


@pytest.mark.parametrize("n", NUM_SAMPLES)
def test_epoch_order_is_a_permutation(n):
    """The shuffled order holds every id 0..n-1 exactly once, as int64."""
    order = epoch_order(n, seed=1, epoch=2, shuffle=True, fingerprint=FP)
    assert order.dtype == np.int64
    np.testing.assert_array_equal(np.sort(order), np.arange(n))


def test_epoch_order_does_not_depend_on_world_size():
    """The order takes no world size, and dealing it at any world size walks through the same global order."""
    assert "world_size" not in inspect.signature(epoch_order).parameters
    n, B = 1000, 8
    order = epoch_order(n, seed=5, epoch=0, shuffle=True, fingerprint=FP)
    for W in (1, 3, 8, 64):
        plan = EpochPlan(n, W, B, drop_last=True)
        walked = np.concatenate([plan.batch_ids(order, r, k)
                                 for k in range(plan.batches_per_rank) for r in range(W)])
        np.testing.assert_array_equal(walked, order[: len(walked)], err_msg=f"W={W}")


def test_epoch_order_is_determined_by_seed_epoch_and_fingerprint():
    """Same (seed, epoch, fingerprint) gives the same order; another seed, epoch or fingerprint another order."""
    def order(**kw):
        args = {"seed": 7, "epoch": 3, "fingerprint": FP, **kw}
        return epoch_order(5000, shuffle=True, **args)

    base = order()
    np.testing.assert_array_equal(base, order())
    for other in (order(seed=8), order(epoch=4), order(epoch=2), order(fingerprint="f" * 32)):
        assert not np.array_equal(base, other)


def test_unshuffled_order_is_arange():
    """shuffle=False gives 0..n-1 whatever the seed and epoch."""
    for seed, epoch in ((0, 0), (9, 4)):
        np.testing.assert_array_equal(
            epoch_order(257, seed=seed, epoch=epoch, shuffle=False, fingerprint=FP), np.arange(257)
        )


def test_lazy_order_matches_the_whole_order_at_any_positions():
    """EpochOrder[positions] equals the materialized order at those positions, for any n (cycle walking)."""
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        lazy = EpochOrder(n, seed=4, epoch=1, shuffle=True, fingerprint=FP)
        whole = np.asarray(lazy)
        assert sorted(whole.tolist()) == list(range(n))
        pos = np.random.default_rng(n).integers(0, n, size=min(n, 50))
        np.testing.assert_array_equal(lazy[pos], whole[pos])
    with pytest.raises(IndexError):
        EpochOrder(10, seed=0, epoch=0, shuffle=True, fingerprint=FP)[np.array([10])]


def test_epoch_order_rejects_an_empty_dataset():
    """num_samples <= 0 is a ValueError."""
    with pytest.raises(ValueError, match="num_samples"):
        epoch_order(0, seed=0, epoch=0, shuffle=True, fingerprint=FP)


# ------------------------------------------------------ augmentation seeds ----


def test_augmentation_seeds_are_a_pure_function_of_seed_epoch_and_id():
    """Seeds are uint64, repeatable, the same for an id wherever it sits in a batch, and distinct across ids."""
    ids = np.arange(100_000, dtype=np.int64)
    s = augmentation_seeds(ids, seed=11, epoch=2)
    assert s.dtype == np.uint64
    np.testing.assert_array_equal(s, augmentation_seeds(ids, seed=11, epoch=2))
    perm = np.random.default_rng(0).permutation(ids)
    np.testing.assert_array_equal(augmentation_seeds(perm, seed=11, epoch=2), s[perm])
    assert len(np.unique(s)) == len(ids)


def test_augmentation_seeds_change_with_seed_and_epoch():
    """Another epoch or seed gives a sample another augmentation seed."""
    ids = np.arange(10_000)
    base = augmentation_seeds(ids, seed=11, epoch=2)
    for other in (augmentation_seeds(ids, seed=11, epoch=3), augmentation_seeds(ids, seed=12, epoch=2),
                  augmentation_seeds(ids, seed=0, epoch=0)):
        assert (other != base).all()
        # Not a shifted copy either: the sets barely overlap.
        assert len(np.intersect1d(base, other)) == 0


# ------------------------------------------------------------ re-dealing ----


@pytest.mark.parametrize("w_before,w_after", [(2, 3), (4, 1), (3, 2), (1, 64)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_at_another_world_size_covers_the_epoch(w_before, w_after, drop_last):
    """k batches per rank at W, then EpochPlan(start=consumed(k)) at W': together they obey the drop_last rules."""
    for n, B in [(1, 1), (7, 3), (100, 3), (257, 32), (1000, 32), (4099, 256), (4099, 3)]:
        first = EpochPlan(n, w_before, B, drop_last=drop_last)
        bpr = first.batches_per_rank
        for k in sorted({0, 1 if bpr >= 1 else 0, bpr // 2, max(bpr - 1, 0), bpr}):
            ctx = f"n={n} B={B} W={w_before}->{w_after} k={k} drop_last={drop_last}"
            seen = [first.positions(r, j) for j in range(k) for r in range(w_before)]
            second = EpochPlan(n, w_after, B, drop_last=drop_last, start=first.consumed(k))
            pos = np.concatenate(seen + [delivered(second)]).astype(np.int64)
            counts = np.bincount(pos, minlength=n)
            if drop_last:
                assert counts.max(initial=0) <= 1, ctx
                # Samples left out: at most the tail each plan dropped.
                assert n - len(pos) < B * w_before + B * w_after, ctx
                assert n - len(pos) < B * w_after or k == bpr, ctx
            else:
                assert counts.min() >= 1, ctx
                # The only repeats are pad rows: the first plan's, if its padded last round was
                # taken, and the second plan's.
                pad_before = sum(len(p) for p in seen) - first.consumed(k)
                pad_after = second.samples_per_rank * w_after - (n - second.start)
                assert 0 <= pad_before < w_before, ctx
                assert 0 <= pad_after < w_after, ctx
                assert len(pos) - n == pad_before + pad_after, ctx


def test_consumed_counts_whole_rounds():
    """consumed(k) is start + k*B*W inside the full rounds, and num_samples once the padded last round is taken."""
    plan = EpochPlan(1000, 3, 32, drop_last=False, start=10)
    assert plan.consumed(0) == 10
    assert plan.consumed(2) == 10 + 2 * 32 * 3
    assert plan.consumed(plan.batches_per_rank) == 1000
    dropped = EpochPlan(1000, 3, 32, drop_last=True)
    assert dropped.consumed(dropped.batches_per_rank) == 10 * 32 * 3


# ------------------------------------------------------- scheduling cost ----


class _CountingOrder(EpochOrder):
    """An EpochOrder that counts the positions asked of it and the values its Feistel network permutes
    (cycle walking sends some through again): the work of a batch, which a clock on a shared machine
    measures only within a factor of 3 or so."""

    asked = permuted = 0

    def __getitem__(self, positions):
        out = super().__getitem__(positions)
        self.asked += len(out)
        return out

    def _permute(self, x):
        self.permuted += len(x)
        return super()._permute(x)


@pytest.mark.parametrize("world_size", [1, 64, 1024])
def test_scheduling_cost_imagenet_epoch(world_size):
    """A rank's batch ids for an ImageNet-1k epoch (n=1,281,167, B=256) are distinct, in range and cost the same
    at any world size (the order is lazy: only the rank's own positions are evaluated, each permuted under
    twice on average); `-s` prints the time."""
    n, B = 1_281_167, 256
    order = _CountingOrder(n, seed=0, epoch=0, shuffle=True, fingerprint=FP)
    plan = EpochPlan(n, world_size, B, drop_last=False)
    ks = range(min(50, plan.batches_per_rank))
    t0 = time.perf_counter()
    batches = [plan.batch_ids(order, world_size - 1, k) for k in ks]
    seeds = [augmentation_seeds(ids, seed=0, epoch=0) for ids in batches]
    t1 = time.perf_counter()
    ids = np.concatenate(batches)
    assert len(np.unique(ids)) == len(ids) == sum(len(plan.positions(world_size - 1, k)) for k in ks)
    assert ids.min() >= 0 and ids.max() < n
    assert len(seeds) == len(ks)
    # The cost, at any world size: the rank's own positions and no other; measured 1.63 permutations a
    # position at every world size (2**21 / n, the cycle walk's expected length)
    assert order.asked == len(ids) and order.permuted <= 2 * len(ids), (order.asked, order.permuted)
    print(f"\nscheduling cost W={world_size}: {1e6 * (t1 - t0) / len(ks):.1f} us/batch (ids + aug seeds)")


@pytest.mark.timeout(30)
def test_substitutes_are_a_pure_function_of_the_slot_seed():
    """substitute_id: same (seed, attempt) same id, in range; attempts and seeds spread over the samples."""
    first = [substitute_id(s, 0, 61) for s in range(200)]
    assert first == [substitute_id(s, 0, 61) for s in range(200)]
    assert all(0 <= i < 61 for i in first) and len(set(first)) > 40
    assert len({substitute_id(12345, a, 1000) for a in range(8)}) == 8
    with pytest.raises(ValueError, match="num_samples"):
        substitute_id(1, 0, 0)


def test_a_windowed_order_is_a_permutation_that_reads_a_few_parts_a_batch():
    """WindowedOrder (Parquet's default shuffle): a bijection of [0, n), the same for the same seed and epoch
    and another in another epoch; a batch of 256 draws from about one window of parts, not from all of
    them, and over an epoch every part's samples are spread (not left in catalog order)."""
    from raydl.plan.order import WindowedOrder

    counts = np.random.default_rng(1).integers(1, 400, size=300)
    n = int(counts.sum())
    a = np.asarray(WindowedOrder(counts, 8, seed=3, epoch=0, fingerprint=FP))
    assert np.array_equal(np.sort(a), np.arange(n))
    assert np.array_equal(a, np.asarray(WindowedOrder(counts, 8, seed=3, epoch=0, fingerprint=FP)))
    assert not np.array_equal(a, np.asarray(WindowedOrder(counts, 8, seed=3, epoch=1, fingerprint=FP)))
    starts = np.concatenate([[0], np.cumsum(counts)])
    part = np.searchsorted(starts, a, side="right") - 1
    touched = [len(set(part[i : i + 256].tolist())) for i in range(0, n, 256)]
    assert max(touched) <= 2 * 8 + 2, max(touched)
    assert np.mean(np.abs(np.diff(a)) == 1) < 0.05  # shuffled within windows, not runs of the catalog
    o = WindowedOrder(counts, 8, seed=3, epoch=0, fingerprint=FP)
    pos = np.array([5, n - 1, 17, 1000])
    assert np.array_equal(o[pos], a[pos])  # evaluated at the positions asked for
