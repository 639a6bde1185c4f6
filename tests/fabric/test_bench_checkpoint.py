"""`raydl bench checkpoint` end to end on two simulated nodes, with a small checkpoint."""
from __future__ import annotations

import argparse
import json

import pytest

from raydl.native import pyfi

pytest.importorskip("torch")


@pytest.mark.timeout(240)
@pytest.mark.skipif(not pyfi.available(), reason=f"libfabric unavailable: {pyfi.unavailable_reason()}")
def test_bench_checkpoint_writes_every_figure(tmp_path):
    """An 8 MiB run writes JSON with positive GB/s for every method and a broadcast time per peer count."""
    import ray

    from raydl.bench import checkpoint as bench

    if ray.is_initialized():  # the bench starts its own simulated cluster
        ray.shutdown()
    parser = argparse.ArgumentParser(prog="raydl bench")
    bench.add_parser(parser.add_subparsers(dest="bench", required=True))
    out = tmp_path / "ckpt.json"
    args = parser.parse_args(["checkpoint", "--size", "8MiB", "--peers", "1,2", "--nodes", "2",
                              "--rounds", "1", "--json", str(out)])
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    methods = {m["method"]: m for m in report["summary"]["methods"]}
    assert {"raydl_fabric", "raydl_object_store", "ray_get", "pyfi_raw"} <= set(methods)
    for name, m in methods.items():
        assert m["gbps"] is not None and m["gbps"] > 0, (name, m)
    casts = {c["peers"]: c for c in report["summary"]["broadcast"]}
    assert sorted(casts) == [1, 2]
    for n, c in casts.items():
        assert c["seconds"] is not None and c["seconds"] > 0, (n, c)
    assert not ray.is_initialized()
