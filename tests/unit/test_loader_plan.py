"""The LoaderPlan without Ray: built once from a dataset's description, it answers every rank's tasks, states and
resumes, for plain, windowed, bucketed and mixed datasets alike."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

import raydl
from raydl.options import LoaderConfig
from raydl.plan.build import build_plan
from raydl.plan.loader_plan import Position
from raydl.plan.order import EpochOrder, EpochPlan, augmentation_seeds
from raydl.plan.orders import BucketOrder, MixOrder, SampleOrder

pytestmark = pytest.mark.timeout(60)


def _plan(ds, **options):
    return build_plan(ds.mixture(), LoaderConfig(**{"batch_size": 8, "seed": 3, **options}))


def _epoch(plan, rank, epoch, start=0):
    return [plan.task(rank, epoch, k, start=start) for k in range(plan.batches_per_rank(epoch, start=start))]


def test_a_plain_plan_gives_the_keyed_order_dealt_to_the_ranks(image_folder):
    """One dataset: batch k of rank r is the epoch's keyed order at the dealt positions, seeded by sample id."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    plan = _plan(ds, world_size=2)
    assert isinstance(plan.order, SampleOrder) and plan.num_samples == len(ds) == 61
    deal = EpochPlan(61, 2, 8, False)
    order = EpochOrder(61, seed=3, epoch=1, shuffle=True, fingerprint=ds.catalog.samples_fingerprint)
    for rank in range(2):
        tasks = _epoch(plan, rank, 1)
        assert len(tasks) == deal.batches_per_rank == plan.batches_per_rank(1)
        for k, task in enumerate(tasks):
            ids = order[deal.positions(rank, k)]
            np.testing.assert_array_equal(task.ids, ids)
            np.testing.assert_array_equal(task.seeds, augmentation_seeds(ids, seed=3, epoch=1))
            assert (task.rank, task.epoch, task.index, task.bucket) == (rank, 1, k, None)
    assert plan.image_fields == ("image",) and plan.batch_bytes == 8 * 16 * 16 * 3


def test_states_round_trip_and_re_deal_at_another_world_size(image_folder):
    """state() is JSON; check_state() gives the same position back, or at another world size the rest of the
    epoch re-dealt so that every sample is still delivered exactly once."""
    ds = raydl.read_images(str(image_folder)).decode().center_crop(16)
    two = _plan(ds, world_size=2, drop_last=True)
    state = json.loads(json.dumps(two.state(rank=0, position=Position(1, 0, 2))))
    assert state["batches_done"] == 2 and state["shuffle_window"] == 0 and state["mix"] is None
    assert two.check_state(state) == Position(1, 0, 2)
    three = _plan(ds, world_size=3, drop_last=True)
    position = three.check_state(state)
    assert position.epoch == 1 and position.next == 0 and position.start == 2 * 2 * 8
    seen = {int(i) for r in range(2) for t in _epoch(two, r, 1)[:2] for i in t.ids}
    rest = {int(i) for r in range(3) for t in _epoch(three, r, 1, start=position.start) for i in t.ids}
    assert (
        not seen & rest and len(seen | rest) == 3 * three.batches_per_rank(1, start=position.start) * 8 + 32
    )
    with pytest.raises(ValueError, match="the state's seed is 3, this loader's is 4"):
        _plan(ds, world_size=2, drop_last=True, seed=4).check_state(state)


def test_one_protocol_for_buckets_windows_and_mixes(image_folder, tmp_path):
    """Bucketed, windowed and mixed datasets get their own Order, and the plan asks each the same way."""
    from raydl.bench.shards import write_parquet

    images = raydl.read_images(str(image_folder)).decode()
    bucketed = _plan(images.aspect_buckets(64, multiple=16))
    assert isinstance(bucketed.order, BucketOrder) and bucketed.order.deals_batches
    for task in _epoch(bucketed, 0, 0):
        assert task.bucket in bucketed.order.buckets and 1 <= len(task.ids) <= 8
    table = raydl.read_parquet(write_parquet(str(image_folder), str(tmp_path / "pq"), row_group=4))
    windowed = _plan(table)
    assert (
        windowed.order.window == 16
        and windowed.state(rank=0, position=Position(0, 0, 0))["shuffle_window"] == 16
    )
    mixed = _plan(
        raydl.mix({"a": images.center_crop(16), "b": images.center_crop(16)}, weights={"a": 1, "b": 3})
    )
    assert isinstance(mixed.order, MixOrder) and mixed.order.id_offsets == (0, 61, 122)
    ids = np.concatenate([t.ids for t in _epoch(mixed, 0, 0)])
    assert len(ids) == 122 and 0.7 < np.mean(ids >= 61) < 0.8  # b's share: 3 of 4
    with pytest.raises(ValueError, match="with a mix the batches themselves depend on it"):
        mixed.check_state({**mixed.state(rank=0, position=Position(0, 0, 1)), "batch_size": 4})


def test_a_task_of_several_batches_gets_each_batch_as_the_plan_gives_it_alone(image_folder, tmp_path):
    """plan.tasks(rank, epoch, k, n) works out n batches at once (one order lookup where samples are dealt one
    by one): each equals plan.task(rank, epoch, j), for plain, windowed, bucketed and mixed datasets, at every
    rank, in a re-dealt epoch and across the padded last round."""
    from raydl.bench.shards import write_parquet

    images = raydl.read_images(str(image_folder)).decode()
    table = raydl.read_parquet(write_parquet(str(image_folder), str(tmp_path / "pq"), row_group=4))
    mixed = raydl.mix({"a": images.center_crop(16), "b": images.center_crop(16)}, weights={"a": 1, "b": 3})
    for ds in (images.center_crop(16), table, images.aspect_buckets(64, multiple=16), mixed):
        for options in ({"world_size": 3}, {"world_size": 2, "drop_last": True}, {"shuffle": False}):
            plan = _plan(ds, batch_size=5, **options)
            for start in (0, 7):
                nb = plan.batches_per_rank(2, start=start)
                for rank in range(plan.config.world_size):
                    for k, n in ((0, 1), (0, nb), (1, max(1, nb - 2)), (nb - 1, 1)):
                        got = plan.tasks(rank, 2, k, n, start=start)
                        assert [t.index for t in got] == list(range(k, k + n))
                        for t in got:
                            alone = plan.task(rank, 2, t.index, start=start)
                            np.testing.assert_array_equal(t.ids, alone.ids)
                            np.testing.assert_array_equal(t.seeds, alone.seeds)
                            assert (t.rank, t.epoch, t.bucket) == (alone.rank, alone.epoch, alone.bucket)
                            if not plan.order.deals_batches:  # a task carries its own rows, not all n's
                                assert t.ids.base is None or t.ids.base.size == t.ids.size


def test_a_shuffled_parquet_task_names_the_rows_of_a_batch_one_window_ahead(image_folder, tmp_path):
    """A shuffled Parquet plan reads ahead about one shuffle window of positions, dealt to every rank: the
    first task of each call carries the rows of the batch read_ahead after its last (the others, and a task
    with no such batch, none), and those rows are that batch's. Ordered reads, image folders and mixes name
    nothing ahead."""
    from raydl.bench.shards import write_parquet

    path = write_parquet(str(image_folder), str(tmp_path / "pq"), row_group=4)
    table = raydl.read_parquet(path, columns=["label"])  # numbers only: batches read whole
    assert table.catalog.source.reads_ahead
    for world_size in (1, 2):
        plan = _plan(table, batch_size=2, world_size=world_size, shuffle_window=3)
        largest = int(table.catalog.column("count").max())
        assert plan.read_ahead == -(-3 * largest // (2 * world_size)) >= 1
        nb = plan.batches_per_rank(0)
        for rank in range(world_size):
            for k, n in ((0, 1), (0, 3), (2, 2), (nb - plan.read_ahead, 1)):
                got = plan.tasks(rank, 0, k, n)
                j = k + n - 1 + plan.read_ahead
                if j < nb:
                    np.testing.assert_array_equal(got[0].ahead, plan.task(rank, 0, j).ids)
                else:
                    assert got[0].ahead is None
                assert all(t.ahead is None for t in got[1:])
    assert _plan(table, batch_size=2, shuffle=False).read_ahead == 0
    images = raydl.read_images(str(image_folder)).decode().center_crop(16)
    assert _plan(images, batch_size=2).read_ahead == 0
    assert _plan(raydl.mix({"a": table, "b": table}), batch_size=2).read_ahead == 0


def test_a_plan_pickles_without_its_computed_epochs(image_folder):
    """A Loader pickles into handles: its plan goes without the epoch orders this process computed, and the copy
    gives the same tasks."""
    plan = _plan(raydl.read_images(str(image_folder)).decode().center_crop(16))
    first = plan.task(0, 0, 1)
    assert plan._epochs
    copy = pickle.loads(pickle.dumps(plan))
    assert copy._epochs == {}
    np.testing.assert_array_equal(copy.task(0, 0, 1).ids, first.ids)


def test_a_mix_state_records_its_datasets_shuffle_windows_and_buckets(image_folder, tmp_path):
    """A state of a mix loads only with the shuffle windows and aspect buckets it was saved under, as a state
    of one dataset does: a mix of Parquet tables saved at shuffle_window=2 and loaded at 8, or of bucketed
    folders saved under aspect_buckets(64) and loaded under 128, is a ValueError naming what changed (both
    used to load, and the resumed epoch repeated some rows and never gave others)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for name, n in (("a", 40), ("b", 24)):
        pq.write_table(pa.table({"x": np.arange(n)}), tmp_path / f"{name}.parquet", row_group_size=2)
        paths.append(str(tmp_path / f"{name}.parquet"))
    tables = raydl.mix({"a": raydl.read_parquet(paths[0]), "b": raydl.read_parquet(paths[1])},
                       weights={"a": 0.5, "b": 0.5})
    saved = _plan(tables, shuffle_window=2)
    state = json.loads(json.dumps(saved.state(rank=0, position=Position(0, 0, 3))))
    assert state["mix"]["windows"] == [2, 2] and saved.check_state(state) == Position(0, 0, 3)
    with pytest.raises(ValueError, match=r"the mix's windows is \[2, 2\] in the state and \[8, 8\] here"):
        _plan(tables, shuffle_window=8).check_state(state)
    older = {**state, "mix": {k: v for k, v in state["mix"].items() if k != "windows"}}  # records none: all 0
    with pytest.raises(ValueError, match=r"windows is \[0, 0\] in the state and \[2, 2\] here"):
        saved.check_state(older)
    _plan(tables, shuffle_window=0).check_state(older)

    images = raydl.read_images(str(image_folder)).decode()

    def bucketed(size):
        one = images.aspect_buckets(size, multiple=16, min_ratio=0.25, max_ratio=4.0)
        return _plan(raydl.mix({"a": one, "b": one}, weights={"a": 1, "b": 1}, batching="per_source"))

    saved = bucketed(64)
    state = json.loads(json.dumps(saved.state(rank=0, position=Position(0, 0, 3))))
    assert state["buckets"] and all(len(b) == 2 for b in state["buckets"])
    assert saved.check_state(state) == Position(0, 0, 3)
    with pytest.raises(ValueError, match=r"the state's buckets is \[\[.*, this loader's is \[\["):
        bucketed(128).check_state(state)


def test_a_mix_goes_on_at_any_epoch_a_state_may_name():
    """A mix's order at an epoch near 2**63 (a state may name any epoch below it): a source's position in its
    permutation is reduced before it meets int64 (it overflowed), and stays the same function of the epoch."""
    from raydl.plan.mix import MixPlan, SourcePlan, mix_shares

    plan = MixPlan((SourcePlan(10, "a" * 64), SourcePlan(5, "b" * 64)), tuple(int(x) for x in mix_shares(
        [0.5, 0.5], 12)), "stratified", 4, False)
    for epoch in (3, 2**40, 2**62, 2**63 - 1):
        ids, _slots = plan.epoch(seed=1, epoch=epoch, shuffle=True).rows(np.arange(12))
        assert len(ids) == 12
    # unshuffled, a source's rows depend on the epoch only through the epoch modulo its size (10 and 5 here)
    e = 2**62
    a = plan.epoch(seed=1, epoch=e, shuffle=False).rows(np.arange(12))[0]
    b = plan.epoch(seed=1, epoch=e % 10, shuffle=False).rows(np.arange(12))[0]
    np.testing.assert_array_equal(a, b)


def test_a_per_source_mix_with_no_full_batch_says_so(image_folder):
    """A per_source mix whose datasets hold no full batch under drop_last=True is the ValueError saying so (it
    was an internal "num_samples must be a positive int, got 0")."""
    images = raydl.read_images(str(image_folder)).decode().center_crop(8)
    ds = raydl.mix({"a": images, "b": images}, weights={"a": 1, "b": 1}, epoch_size=12, batching="per_source")
    plan = _plan(ds, batch_size=8, drop_last=True)
    with pytest.raises(ValueError, match="an epoch of this loader would deliver no batch: .*0 full batches"):
        plan.check_epoch()
