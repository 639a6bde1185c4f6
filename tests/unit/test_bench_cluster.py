"""raydl bench cluster's pure parts: which node counts it measures, scaling efficiency, Ray's store summary, the summary."""
from __future__ import annotations

import argparse
import os

import pytest

from raydl.bench.cluster import (
    _settings,
    add_parser,
    cpu_window,
    efficiency,
    first_images,
    format_summary,
    parse_store_stats,
    scaling_points,
    steady_window,
)


@pytest.mark.timeout(10)
def test_scaling_points():
    """Simulated clusters are measured at 1, 2, 4, ... and N nodes; a real one at 1 and N."""
    assert scaling_points(1, relabel=True) == [1]
    assert scaling_points(3, relabel=True) == [1, 2, 3]
    assert scaling_points(8, relabel=True) == [1, 2, 4, 8]
    assert scaling_points(6, relabel=True) == [1, 2, 4, 6]
    assert scaling_points(6, relabel=False) == [1, 6]


@pytest.mark.timeout(10)
def test_efficiency_is_against_one_node():
    """Efficiency = images/s at k nodes / (k x images/s at one node)."""
    rows = [{"nodes": 1, "images_per_s": 100.0}, {"nodes": 2, "images_per_s": 150.0}, {"nodes": 4, "images_per_s": 400.0}]
    efficiency(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 0.75, 1.0]


@pytest.mark.timeout(10)
def test_parse_store_stats():
    """Plasma use and spilled MiB are read from Ray's aggregate store summary."""
    text = ("--- Aggregate object store stats across all nodes ---\n"
            "Plasma memory usage 12 MiB, 3 objects, 1.2% full, 0.5% needed\n"
            "Spilled 40 MiB, 7 objects, avg write throughput 100 MiB/s\n")
    assert parse_store_stats(text) == (12, 40)
    assert parse_store_stats("Plasma memory usage 0 MiB, 0 objects, 0.0% full\n") == (0, 0)


@pytest.mark.timeout(10)
def test_summary_fits_one_screen():
    """The summary names every node count, every rank's wait, each node's workers and the broadcast, in under
    25 lines; on simulated nodes sharing fewer cores than their CPUs it says images/s cannot follow the nodes,
    and a rate resting on too short a window is bracketed."""
    rank = {"rank": 0, "wait_s": 0.5, "images_per_s": 50.0, "local_batches": 3, "batches": 4}
    cpu = {"cpu_ms_per_image": 4.25, "control_ms_per_batch": 0.5, "worker_cpu_s_by_node": {"abcdef0123": 2.0}}
    rows = [{"nodes": k, "images_per_s": 100.0 * k, "efficiency": None, "first_batch_s": 0.3, "store_peak_mib": 10,
             "spilled_mib": 0, "per_rank": [rank, dict(rank, rank=1)], "per_node_images_per_s": {"abcdef0123": 100.0},
             "steady_ok": k > 1, "start_s": 1.5, "cpu": cpu, "nodes_used": k, "workers_by_node": {"abcdef0123": 2}}
            for k in (1, 2, 3)]
    result = {"cluster": {"nodes": 3, "simulated": True, "cpus": 3, "cpus_per_node": 1, "machine_cores": 2},
              "ranks": 2, "samples": 96, "batch_size": 16, "epochs": 1, "warmup_s": 3.0, "rows": rows,
              "broadcast": {"mib": 8, "peers": 3, "seconds": 0.5, "transports": ["fabric"]}}
    text = format_summary(result)
    assert len(text.splitlines()) < 25
    assert "r1 0.50" in text and "8 MiB to 3 nodes" in text and "abcdef01 100.0/2/2.0" in text
    assert "cannot follow the node count" in text and "[100.0]" in text and "4.25" in text and "3/3" in text


def _rank(started, times):
    return {"started": started, "times": times}


@pytest.mark.timeout(10)
def test_the_steady_window_starts_when_every_rank_has_its_first_batch():
    """Images/s counts the batches after the last rank's first batch: start-up, however long, stays out."""
    ranks = [_rank(0.0, [(5.0, 10), (6.0, 10), (7.0, 10)]),  # a slow start: first batch at 5 s
             _rank(0.0, [(1.0, 10), (2.0, 10), (6.5, 10), (9.0, 10)])]
    w = steady_window(ranks)
    assert (w["t0"], w["t1"], w["seconds"], w["start_s"]) == (5.0, 9.0, 4.0, 5.0)
    assert (w["images"], w["batches"]) == (40, 4)  # 6.0, 7.0, 6.5, 9.0
    assert steady_window([_rank(0.0, [])])["images"] == 0


@pytest.mark.timeout(10)
def test_cpu_per_image_is_taken_between_samples_around_the_window():
    """CPU is the growth of each process between the last sample at or before t0 and the first at or after t1,
    over the images delivered between those samples; a process that starts in between counts from zero."""
    samples = [
        (0.0, {1: ["worker", 1.0]}),
        (4.0, {1: ["worker", 2.0], 2: ["coordinator", 0.5]}),
        (8.0, {1: ["worker", 5.0], 2: ["coordinator", 0.7], 3: ["worker", 1.0]}),
        (10.0, {1: ["worker", 6.0], 2: ["coordinator", 0.8], 3: ["worker", 2.0]}),
    ]
    ranks = [_rank(0.0, [(3.0, 8), (5.0, 8), (7.0, 8), (9.0, 8)])]
    got = cpu_window(samples, 5.0, 9.0, ranks, {1: "n1", 3: "n2"})
    assert got["seconds"] == 6.0 and got["images"] == 24 and got["batches"] == 3  # batches in (4, 10]
    assert got["cpu_s"] == pytest.approx({"worker": 6.0, "coordinator": 0.3})
    assert got["worker_cpu_s_by_node"] == pytest.approx({"n1": 4.0, "n2": 2.0})
    assert got["cpu_ms_per_image"] == pytest.approx(1000 * 6.3 / 24)
    assert got["control_ms_per_batch"] == pytest.approx(100.0)
    assert cpu_window(samples, -1.0, 9.0, ranks, {}) is None  # no sample before the window


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["cluster", *argv])


def _folder(root, n):
    for i in range(n):
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(b"x")
    return str(root)


@pytest.mark.timeout(10)
def test_images_reads_the_first_n_of_an_existing_folder(tmp_path):
    """--images N with an existing --data reads its first N images (sorted by path), not all of them; more
    than the folder holds is refused, naming it."""
    data = _folder(tmp_path / "data", 10)
    s = _settings(_args("--simulate-nodes", "2", "--data", data, "--images", "4"), str(tmp_path / "run"))
    chosen = sorted(os.path.relpath(os.path.join(d, f), s["source"].path)
                    for d, _, fs in os.walk(s["source"].path) for f in fs)
    assert chosen == ["c0/000.jpg", "c0/002.jpg", "c0/004.jpg", "c0/006.jpg"]
    assert s["source"].path != data
    with pytest.raises(SystemExit, match="holds 10 images"):
        _settings(_args("--simulate-nodes", "2", "--data", data, "--images", "11"), str(tmp_path / "run2"))
    with pytest.raises(SystemExit, match="at least 1"):
        _settings(_args("--simulate-nodes", "2", "--data", data, "--images", "0"), str(tmp_path / "run3"))


@pytest.mark.timeout(10)
def test_images_generates_n_where_data_is_missing_and_flags_win(tmp_path):
    """Without an existing folder --images is how many to generate; --no-checkpoint skips the broadcast."""
    s = _settings(_args("--simulate-nodes", "2", "--data", str(tmp_path / "new"), "--images", "7", "--ranks", "3",
                        "--epochs", "2", "--no-checkpoint"), str(tmp_path / "run"))
    assert s["source"].generate == 7 and s["source"].path == str(tmp_path / "new")
    assert (s["ranks"], s["epochs"], s["checkpoint_mib"], s["simulate_nodes"]) == (3, 2, 0, 2)
    assert first_images(_folder(tmp_path / "d", 3), 3, str(tmp_path / "o")) == str(tmp_path / "o")


@pytest.mark.timeout(10)
def test_flags_that_would_do_nothing_are_refused(tmp_path):
    """--set without --config, and --cpus-per-node on a real cluster, would be ignored: they are refused."""
    with pytest.raises(SystemExit, match="--set overrides"):
        _settings(_args("--simulate-nodes", "2", "--set", "loader.batch_size=8"), str(tmp_path))
    with pytest.raises(SystemExit, match="--cpus-per-node sizes simulated nodes"):
        _settings(_args("--address", "auto", "--cpus-per-node", "2"), str(tmp_path))
