"""raydl bench cluster's pure parts: which node counts it measures, scaling efficiency, Ray's store summary, the summary."""
from __future__ import annotations

import pytest

from raydl.bench.cluster import efficiency, format_summary, parse_store_stats, scaling_points


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
    """The summary names every node count, every rank's wait and the broadcast, in under 25 lines."""
    rank = {"rank": 0, "wait_s": 0.5, "images_per_s": 50.0, "local_batches": 3, "batches": 4}
    rows = [{"nodes": k, "images_per_s": 100.0 * k, "efficiency": 1.0, "first_batch_s": 0.3, "store_peak_mib": 10,
             "spilled_mib": 0, "per_rank": [rank, dict(rank, rank=1)], "per_node_images_per_s": {"abcdef0123": 100.0}}
            for k in (1, 2, 3)]
    result = {"cluster": {"nodes": 3, "simulated": True, "cpus": 3}, "ranks": 2, "samples": 96, "batch_size": 16,
              "epochs": 1, "rows": rows, "broadcast": {"mib": 8, "peers": 3, "seconds": 0.5, "transports": ["fabric"]}}
    text = format_summary(result)
    assert len(text.splitlines()) < 25
    assert "r1 0.50" in text and "8 MiB to 3 nodes" in text and "abcdef01" in text
