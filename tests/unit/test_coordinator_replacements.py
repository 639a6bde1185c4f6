"""The coordinator's replacements, with Ray's node list and worker launches stood in for (no Ray): every
worker a lost node took gets a replacement, and replacements still starting count where the next ones go."""
from __future__ import annotations

import itertools
import threading
import time

import pytest

import raydl.actors.coordinator as co
from raydl.options import LoaderConfig
from raydl.plan.scheduling import NodeInfo, WorkerInfo

pytestmark = pytest.mark.timeout(60)


class _Handle:
    def __init__(self, node: str) -> None:
        self.node = node

    class set_membership:  # noqa: N801 - an actor method's shape: .remote()
        @staticmethod
        def remote(version: int) -> None:
            pass


@pytest.fixture
def cluster(monkeypatch):
    alive: list[str] = []
    seq = itertools.count()
    monkeypatch.setattr(co, "live_nodes", lambda: [NodeInfo(n, 4.0, {"CPU": 4.0}) for n in alive])
    monkeypatch.setattr(co, "launch_workers", lambda spec, cat, cfg, node_id, count, **kw: [
        _Handle(node_id) for _ in range(count)])

    def come_up(self, handles):
        time.sleep(0.2)  # a worker takes a while to start
        return [WorkerInfo(h, h.node, f"{h.node}-w{next(seq)}") for h in handles]

    monkeypatch.setattr(co.LoaderCoordinator, "_await", come_up)
    made = []

    def make(nodes: list[str], per_node: int) -> co.LoaderCoordinator:
        alive[:] = nodes
        started = [(_Handle(n), n) for n in nodes for _ in range(per_node)]
        c = co.LoaderCoordinator([None], [None], LoaderConfig(batch_size=4, num_workers=per_node), started)
        c._started.wait(5)
        made.append(c)
        return c

    yield make, alive
    for c in made:
        c.shutdown()


def _per_node(c: co.LoaderCoordinator) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in c.workers()[1]:
        out[w.node_id] = out.get(w.node_id, 0) + 1
    return dict(sorted(out.items()))


def test_every_worker_of_a_lost_node_is_replaced(cluster):
    """Node B and its 2 workers lost (Ray knows): the first report drops both and starts a replacement for
    each (it started one, and the second report found nothing to do: 5 workers of 6)."""
    make, alive = cluster
    c = make(["A", "B", "C"], 2)
    b1, b2 = [w for w in c.workers()[1] if w.node_id == "B"]
    alive[:] = ["A", "C"]
    c.report_dead(b1.name)
    c.refresh_now()
    c.report_dead(b2.name)
    c.refresh_now()
    assert _per_node(c) == {"A": 3, "C": 3}


def test_replacements_still_starting_count_where_the_next_go(cluster):
    """Two deaths reported together while Ray still lists their node: the replacements spread over the
    other nodes (both went to the same one: counts left out replacements still starting)."""
    make, _alive = cluster
    c = make(["A", "B", "C"], 2)
    b1, b2 = [w for w in c.workers()[1] if w.node_id == "B"]
    reports = [threading.Thread(target=c.report_dead, args=(n,)) for n in (b1.name, b2.name)]
    for t in reports:
        t.start()
    for t in reports:
        t.join()
    c.refresh_now()
    assert _per_node(c) == {"A": 3, "C": 3}
