"""Scheduling policies as pure functions: placement, locality, spill, prefetch under a budget."""
from __future__ import annotations

import pytest

from raydl.plan.scheduling import (
    LOCAL_DEPTH,
    MAX_BATCHES_PER_TASK,
    TASK_BYTES,
    NodeInfo,
    batches_per_task,
    bootstrap_threads,
    choose_worker,
    decode_threads,
    eligible_nodes,
    fit_to_room,
    placement_deficit,
    prefetch_depth,
    replacement_node,
)

pytestmark = pytest.mark.timeout(30)


def test_eligible_nodes_need_cpus_and_the_label():
    """Nodes without enough CPUs, or without the asked-for resource label, get no actors."""
    nodes = [NodeInfo("a", 4, {"CPU": 4}), NodeInfo("b", 0, {}), NodeInfo("c", 1, {"CPU": 1, "loader": 1}),
             NodeInfo("d", 0.5, {"CPU": 0.5})]
    assert eligible_nodes(nodes, cpus_per_worker=1, node_resource=None) == ["a", "c"]
    assert eligible_nodes(nodes, cpus_per_worker=0.5, node_resource=None) == ["a", "c", "d"]
    assert eligible_nodes(nodes, cpus_per_worker=1, node_resource="loader") == ["c"]


def test_decode_threads_follow_the_reservation():
    """Threads: as asked; else ceil of the CPUs reserved; else (no reservation) the node's CPUs."""
    assert decode_threads(3, cpus_per_worker=0, node_cpus=8) == 3
    assert decode_threads(None, cpus_per_worker=0.25, node_cpus=8) == 1
    assert decode_threads(None, cpus_per_worker=2.5, node_cpus=8) == 3
    assert decode_threads(None, cpus_per_worker=0, node_cpus=8) == 8
    assert decode_threads(None, cpus_per_worker=0, node_cpus=0.5) == 1


def test_bootstrap_threads_use_the_process_cores():
    """The driver's first batches: the threads asked for, else every core the process may use."""
    assert bootstrap_threads(3, usable_cores=8) == 3
    assert bootstrap_threads(None, usable_cores=8) == 8
    assert bootstrap_threads(None, usable_cores=0) == 1


def test_fit_to_room_trims_to_free_cpus():
    """A reservation fits only where CPUs are free; no reservation always fits."""
    deficit = {"a": 2, "b": 2, "c": 1}
    free = {"a": 1.0, "b": 0.4, "c": 0.5}
    assert fit_to_room(deficit, free, 0.5) == {"a": 2, "c": 1}
    assert fit_to_room(deficit, free, 1.0) == {"a": 1}
    assert fit_to_room(deficit, {}, 0) == deficit


def test_placement_fills_every_node_to_its_quota():
    """Each eligible node is brought up to num_workers actors; full nodes are left alone."""
    assert placement_deficit(["a", "b", "c"], {"a": 2, "b": 1}, 2) == {"b": 1, "c": 2}
    assert placement_deficit(["a"], {"a": 3}, 2) == {}


def test_replacement_goes_to_the_least_loaded_live_node():
    """A dead actor's replacement starts on the live node with the fewest actors (ties by id)."""
    assert replacement_node(["a", "b", "c"], {"a": 2, "b": 1, "c": 1}) == "b"
    assert replacement_node([], {}) is None


def test_local_workers_first_then_spill_to_the_least_loaded():
    """A rank uses its node's actors until each holds LOCAL_DEPTH of its batches, then the least loaded anywhere."""
    workers = [("w0", "n0"), ("w1", "n1"), ("w2", "n1")]
    assert choose_worker(workers, {}, "n1") == 1
    assert choose_worker(workers, {"w1": 1}, "n1") == 2
    busy = {"w1": LOCAL_DEPTH, "w2": LOCAL_DEPTH}
    assert choose_worker(workers, busy, "n1") == 0  # spill to the idle remote actor
    assert choose_worker(workers, {"w0": 5, **busy}, "n1") == 1  # all busy: least loaded, local wins ties
    assert choose_worker(workers, {}, "elsewhere") == 0
    with pytest.raises(ValueError):
        choose_worker([], {}, "n0")


def test_prefetch_depth_fits_the_budget():
    """In-flight batches plus the one being consumed fit each rank's share of the budget, never below 1."""
    mb = 1 << 20
    assert prefetch_depth(4, batch_bytes=10 * mb, budget_bytes=1000 * mb, world_size=1) == 4
    assert prefetch_depth(4, batch_bytes=10 * mb, budget_bytes=40 * mb, world_size=1) == 3
    assert prefetch_depth(4, batch_bytes=10 * mb, budget_bytes=40 * mb, world_size=2) == 1
    assert prefetch_depth(4, batch_bytes=100 * mb, budget_bytes=40 * mb, world_size=1) == 1
    for ws in (1, 2, 4, 8):
        for budget in (10, 50, 100, 400):
            d = prefetch_depth(8, batch_bytes=7 * mb, budget_bytes=budget * mb, world_size=ws)
            assert d == 1 or (d + 1) * 7 * ws <= budget


def test_small_batches_go_several_to_a_task_without_lowering_the_prefetch_depth():
    """A task makes as many batches as fit TASK_BYTES (at most MAX_BATCHES_PER_TASK), one when a batch is
    large, and never so many that the asked depth of such tasks, and one in hand, would overflow a rank's
    share of the budget."""
    mb, gb = 1 << 20, 1 << 30
    assert batches_per_task(1 * mb, depth=2, budget_bytes=gb, world_size=1) == TASK_BYTES // mb
    assert batches_per_task(1024, depth=2, budget_bytes=gb, world_size=1) == MAX_BATCHES_PER_TASK
    assert batches_per_task(150 * mb, depth=2, budget_bytes=gb, world_size=1) == 1
    assert batches_per_task(0, depth=2, budget_bytes=gb, world_size=1) == MAX_BATCHES_PER_TASK
    # 8 ranks share 64 MiB: 8 MiB each, so depth 3 + 1 in hand leaves 2 MiB a task, 2 batches of 1 MiB
    assert batches_per_task(1 * mb, depth=3, budget_bytes=64 * mb, world_size=8) == 2
    for depth in (1, 2, 4, 8):
        for world in (1, 4, 64):
            for batch in (4096, 300_000, 2 * mb, 9 * mb):
                n = batches_per_task(batch, depth=depth, budget_bytes=256 * mb, world_size=world)
                assert 1 <= n <= MAX_BATCHES_PER_TASK and (n == 1 or n * batch <= TASK_BYTES)
                kept = prefetch_depth(depth, batch_bytes=n * batch, budget_bytes=256 * mb, world_size=world)
                alone = prefetch_depth(depth, batch_bytes=batch, budget_bytes=256 * mb, world_size=world)
                assert kept == alone or n == 1
