"""A small `raydl bench cluster` run: 3 simulated nodes on this machine, its JSON and its PNG.

    python examples/bench_cluster.py [--out DIR]

The same as
    raydl bench cluster --simulate-nodes 3 --ranks 3 --images 96 --batch-size 16 --checkpoint-mib 8 \\
        --json DIR/cluster.json --plot DIR/cluster.png
at a size that runs in a minute; see docs/benchmarks.md for the full-size commands.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from raydl.cli import main as raydl


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--out", help="where to write cluster.json and cluster.png (default: a temporary folder)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="raydl-bench-cluster-") as tmp:
        out = args.out or tmp
        os.makedirs(out, exist_ok=True)
        raydl(
            [
                "bench",
                "cluster",
                "--simulate-nodes",
                "3",
                "--cpus-per-node",
                "1",
                "--ranks",
                "3",
                "--data",
                os.path.join(tmp, "images"),
                "--images",
                "96",
                "--batch-size",
                "16",
                "--checkpoint-mib",
                "8",
                "--json",
                os.path.join(out, "cluster.json"),
                "--plot",
                os.path.join(out, "cluster.png"),
            ]
        )
        with open(os.path.join(out, "cluster.json")) as f:
            result = json.load(f)
        assert [r["nodes"] for r in result["rows"]] == [1, 2, 3]
        assert all(r["images"] >= 96 for r in result["rows"])  # every point reads a whole epoch
        for r in result["rows"]:
            assert sorted(r["workers_by_node"]) == sorted(r["node_ids"])  # a loader worker on every node
            assert r["efficiency"] is None  # simulated nodes share cores: no scaling efficiency
        assert os.path.getsize(os.path.join(out, "cluster.png")) > 0
        print(f"wrote {out}/cluster.json and {out}/cluster.png")


if __name__ == "__main__":
    main()
