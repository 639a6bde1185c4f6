"""`raydl bench storage` end to end on all three stores' local servers: every row present, every measured
rate positive."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.bench import storage

pytestmark = pytest.mark.timeout(170)

ROOT = Path(__file__).resolve().parents[2]


def test_bench_storage_all_three_stores(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "raydl.bench.storage", "--stores", "s3,gcs,azure", "--objects", "16", "--size",
           "4096", "--shards", "1", "--shard-size", "131072", "--range-size", "65536", "--delays", "0,50",
           "--rounds", "1", "--compare", "native", "--timeout", "120", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=160, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["not_measured"] == {}
    skipped = {(s["store"], s["peer"]) for s in report["skipped"]}
    rows = {(r["store"], r["workload"], r["peer"], r["target"]): r for r in report["summary"]}
    for store in storage.STORES:
        for workload in storage.WORKLOADS:
            for peer in ("raydl", storage.NATIVE[store]):
                if (store, peer) in skipped:
                    assert peer != "raydl"
                    continue
                for target in ("direct", "0 ms", "50 ms"):
                    row = rows[(store, workload, peer, target)]
                    assert row.get("rate", 0) > 0 and row["mb_s"] > 0, (store, workload, peer, target, row)
                    assert row["server_busy"] is not None and row["server_busy"] >= 0
            assert f"{store:<6}{workload:<9}raydl" in proc.stdout
    assert "share of all CPU" in proc.stdout


def test_bench_storage_missing_server_is_a_row(tmp_path, monkeypatch):
    """No azurite: the azure rows say why; the other stores are still measured."""
    from raydl.bench import emulators

    monkeypatch.setattr(emulators, "azurite_binary", lambda: None)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    parser = __import__("argparse").ArgumentParser()
    storage.add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["storage", "--stores", "s3,azure", "--objects", "4", "--size", "1024", "--shards",
                              "0", "--delays", "0", "--rounds", "1", "--compare", "native",
                              "--json", str(tmp_path / "b.json")])
    assert storage.main(args) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert "azurite-blob is not installed" in report["not_measured"]["azure"]
    assert any(r["store"] == "s3" and r.get("rate", 0) > 0 for r in report["summary"])
