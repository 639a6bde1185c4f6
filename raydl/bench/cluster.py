"""`raydl bench cluster`: the loader across a cluster's nodes, at 1, 2, ... N nodes, and a checkpoint to all.

    raydl bench cluster --address auto --data /shared/in1k --ranks 16 --json cluster.json --plot cluster.png
    # ray.cluster_utils on this machine
    raydl bench cluster --simulate-nodes 3 --data /tmp/imgs --ranks 6
    raydl bench cluster --config configs/bench-cluster.yaml --simulate-nodes 3

For each node count k it builds the loader on the first k nodes only, starts
`--ranks` consumer actors spread over those nodes (each a trainer rank that
reads `loader.iterator(rank)` and does nothing else), and reads `--epochs`
epochs. It reports per-node and total images/s, the scaling efficiency
against one node (images/s at k nodes / (k x images/s at 1 node)), the time to
first batch, peak object-store use and bytes spilled, and each rank's wait
time. Then it publishes a `--checkpoint-mib` state dict and broadcasts it to a
checkpoint peer on every node (`raydl.checkpoint.broadcast`).

Simulated nodes share this machine's cores: they show that the loader uses
every node and what the control plane costs, not how a real cluster scales.
With --address, the node counts are 1 and all (a real cluster's nodes cannot
be relabelled), 1 being the driver's node.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

__all__ = ["add_parser", "efficiency", "format_summary", "main", "parse_store_stats", "scaling_points"]

_LABEL = "raydl_bench_nodes_{}"  # node i of a simulated cluster carries the labels of every k > i


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cluster",
        help="the loader across the nodes of a cluster: scaling, waits, object store, checkpoint broadcast",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", help="an existing cluster: auto, host:port or ray://host:port")
    where.add_argument("--simulate-nodes", type=int, help="start N simulated nodes on this machine")
    p.add_argument(
        "--config",
        help="a YAML config: source, pipeline, loader and bench defaults (e.g. configs/bench-cluster.yaml)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument(
        "--data",
        help="image folder (DIR/class/*.jpg), visible from every node; generated when missing (--images)",
    )
    p.add_argument("--images", type=int, help="images to generate when --data is missing or absent")
    p.add_argument("--ranks", type=int, help="consumer ranks (default: the config's bench.ranks)")
    p.add_argument("--epochs", type=int, help="epochs read at each node count")
    p.add_argument("--batch-size", type=int, help="override loader.batch_size")
    p.add_argument("--cpus-per-node", type=int, help="CPUs of each simulated node")
    p.add_argument("--checkpoint-mib", type=int, help="size of the broadcast state dict")
    p.add_argument("--json", help="write every figure here")
    p.add_argument(
        "--plot", help="write a PNG: images/s against nodes, and each rank's wait (needs matplotlib)"
    )
    p.set_defaults(func=main)
    return p


# -- pure helpers ------------------------------------------------------------------------------
def scaling_points(nodes: int, *, relabel: bool) -> list[int]:
    """Node counts to measure: 1, 2, 4, ... and N when nodes can be relabelled; else 1 and N."""
    if not relabel:
        return sorted({1, nodes})
    points, k = [], 1
    while k < nodes:
        points.append(k)
        k *= 2
    return points + [nodes]


def efficiency(rows: list[dict]) -> None:
    """Add `efficiency` to each row: images/s over (nodes x the one-node images/s)."""
    one = next((r["images_per_s"] for r in rows if r["nodes"] == 1), None)
    for r in rows:
        r["efficiency"] = r["images_per_s"] / (r["nodes"] * one) if one else None


_STORE = re.compile(r"Plasma memory usage (\d+) MiB")
_SPILLED = re.compile(r"Spilled (\d+) MiB")


def parse_store_stats(text: str) -> tuple[int, int]:
    """(plasma MiB in use, MiB spilled so far) from Ray's aggregate object store summary."""
    used = _STORE.search(text)
    spilled = _SPILLED.search(text)
    return (int(used.group(1)) if used else 0), (int(spilled.group(1)) if spilled else 0)


def format_summary(result: dict) -> str:
    """The one-screen summary."""
    c = result["cluster"]
    lines = [
        f"raydl bench cluster: {c['nodes']} {'simulated ' if c['simulated'] else ''}nodes "
        f"({c['cpus']:.0f} CPUs), {result['ranks']} ranks, {result['samples']} images, "
        f"batch {result['batch_size']}, {result['epochs']} epoch(s) per point",
        "",
    ]
    head = (
        "nodes",
        "images/s",
        "per node",
        "efficiency",
        "first batch s",
        "max wait s",
        "store MiB",
        "spilled MiB",
    )
    lines.append("  ".join(f"{h:>13}" for h in head))
    for r in result["rows"]:
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(
            "  ".join(
                f"{v:>13}"
                for v in (
                    r["nodes"],
                    f"{r['images_per_s']:.1f}",
                    f"{r['images_per_s'] / r['nodes']:.1f}",
                    eff,
                    f"{r['first_batch_s']:.2f}",
                    f"{max(x['wait_s'] for x in r['per_rank']):.2f}",
                    r["store_peak_mib"],
                    r["spilled_mib"],
                )
            )
        )
    last = result["rows"][-1]
    lines += [
        "",
        f"at {last['nodes']} nodes, per node images/s: "
        + ", ".join(f"{n[:8]} {v:.1f}" for n, v in sorted(last["per_node_images_per_s"].items())),
        "per rank (wait s / images/s / local batches): "
        + ", ".join(
            f"r{x['rank']} {x['wait_s']:.2f}/{x['images_per_s']:.0f}/{x['local_batches']}of{x['batches']}"
            for x in last["per_rank"]
        ),
    ]
    b = result.get("broadcast")
    if b:
        lines.append(
            f"checkpoint broadcast: {b['mib']} MiB to {b['peers']} nodes in {b['seconds']:.2f} s "
            f"({b['mib'] * b['peers'] / max(b['seconds'], 1e-9):.0f} MiB/s delivered; "
            f"transports {', '.join(sorted(set(b['transports'])))})"
        )
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib (pip install 'raydl-loader[bench]'): {exc}") from exc
    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    nodes = [r["nodes"] for r in rows]
    ax1.plot(nodes, [r["images_per_s"] for r in rows], "o-", label="raydl")
    one = rows[0]["images_per_s"] / rows[0]["nodes"]
    ax1.plot(nodes, [one * n for n in nodes], "--", color="grey", label="linear")
    ax1.set_xlabel("nodes")
    ax1.set_ylabel("images/s")
    ax1.set_xticks(nodes)
    ax1.set_title("throughput against nodes")
    ax1.legend()
    last = rows[-1]["per_rank"]
    ax2.bar([f"r{x['rank']}" for x in last], [x["wait_s"] for x in last])
    ax2.set_ylabel("seconds waiting for batches")
    ax2.set_title(f"per-rank wait at {rows[-1]['nodes']} nodes")
    fig.suptitle(
        f"raydl bench cluster ({'simulated ' if result['cluster']['simulated'] else ''}"
        f"{result['cluster']['nodes']} nodes, {result['ranks']} ranks)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the measurement ---------------------------------------------------------------------------
class _Rank:
    """One consumer rank: reads whole epochs from its iterator and reports its stats."""

    def __init__(self, loader, rank: int) -> None:
        self.it = loader.iterator(rank)

    def run(self, epochs: int) -> dict:
        import ray

        for _ in range(epochs):
            for _batch in self.it.iter_batches():
                pass
        s = self.it.stats()
        return {
            "rank": s.rank,
            "node": ray.get_runtime_context().get_node_id(),
            "images": s.samples_delivered,
            "elapsed_s": s.elapsed_s,
            "wait_s": s.wait_s,
            "first_batch_s": s.time_to_first_batch_s,
            "images_per_s": s.images_per_s,
            "batches": s.batches,
            "local_batches": s.local_batches,
        }


class _StoreSampler:
    """Peak plasma use and spilled MiB, polled in a thread while the ranks read."""

    def __init__(self, period_s: float = 0.5) -> None:
        import threading

        self.period_s, self.peak, self.spilled = period_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import ray
        from ray._private.internal_api import memory_summary

        try:  # this cluster's GCS, named: "auto" could pick another cluster on the machine
            used, spilled = parse_store_stats(
                memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
            )
        except Exception:  # noqa: BLE001 - a missed sample is not worth failing the run
            return
        self.peak, self.spilled = max(self.peak, used), max(self.spilled, spilled)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> _StoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _node_ids(labels: bool, k: int) -> list[str]:
    import ray

    alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    if labels:
        alive = [n for n in alive if n["Resources"].get(_LABEL.format(k), 0) > 0]
    here = ray.get_runtime_context().get_node_id()
    alive.sort(key=lambda n: (n["NodeID"] != here, n["NodeID"]))
    return [n["NodeID"] for n in alive][:k]


def _run_point(ds, loader_config, k: int, ranks: int, epochs: int, labels: bool) -> dict:
    from dataclasses import replace

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = _node_ids(labels, k)
    resource = _LABEL.format(k) if labels else (None if k > 1 else f"node:{_node_ip(nodes[0])}")
    config = replace(loader_config, world_size=ranks, node_resource=resource)
    t0 = time.perf_counter()
    with ds.loader_from_config(config) as loader, _StoreSampler() as store:
        actors = [
            ray.remote(_Rank)
            .options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[r % len(nodes)], soft=False),
            )
            .remote(loader, r)
            for r in range(ranks)
        ]
        per_rank = ray.get([a.run.remote(epochs) for a in actors])
        wall = time.perf_counter() - t0
        for a in actors:
            ray.kill(a)
    images = sum(x["images"] for x in per_rank)
    span = max(x["elapsed_s"] for x in per_rank)
    per_node: dict[str, float] = {}
    for node in {x["node"] for x in per_rank}:  # its ranks' images over the longest of its ranks' reads
        mine = [x for x in per_rank if x["node"] == node]
        per_node[node] = sum(x["images"] for x in mine) / max(x["elapsed_s"] for x in mine)
    return {
        "nodes": k,
        "node_ids": nodes,
        "images": images,
        "images_per_s": images / span,
        "wall_s": wall,
        "first_batch_s": min(x["first_batch_s"] or 0.0 for x in per_rank),
        "store_peak_mib": store.peak,
        "spilled_mib": store.spilled,
        "per_rank": per_rank,
        "per_node_images_per_s": per_node,
    }


def _node_ip(node_id: str) -> str:
    import ray

    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def _broadcast(mib: int) -> dict:
    import ray
    import torch

    from raydl import checkpoint

    nodes = _node_ids(False, 1 << 30)
    state = {"w": torch.randn(mib * (1 << 20) // 4 // 1024, 1024)}
    ref = checkpoint.publish(state)
    peers = [checkpoint.peer_actor(n) for n in nodes]
    ray.get([p.__ray_ready__.remote() for p in peers])
    t0 = time.perf_counter()
    got = checkpoint.broadcast(ref, peers)
    seconds = time.perf_counter() - t0
    checkpoint.unpublish(ref)
    for p in peers:
        ray.kill(p)
    return {
        "mib": mib,
        "peers": len(peers),
        "seconds": seconds,
        "transports": [
            g.get("transport") or ("fabric" if g.get("ref") is not None else "object_store") for g in got
        ],
    }


def _settings(args):
    """Config defaults (configs/bench-cluster.yaml or built in), then the flags."""
    from raydl.config import BenchConfig, Config, ImagesSource, PipelineConfig, StageSpec, load_config
    from raydl.options import LoaderConfig

    if args.config:
        cfg = load_config(args.config, args.set)
    else:
        cfg = Config(
            source=ImagesSource(path=args.data or "", generate=0) if args.data else None,
            pipeline=PipelineConfig(
                (
                    StageSpec("decode"),
                    StageSpec("random_resized_crop", (("size", 64),)),
                    StageSpec("normalize", (("mean", "imagenet"),)),
                )
            ),
            loader=LoaderConfig(batch_size=32, cpus_per_worker=0.5),
            bench=BenchConfig(),
        )
    b = cfg.bench
    source = cfg.source
    if args.data:
        source = ImagesSource(path=args.data, generate=args.images or b.images)
    elif source is None:
        source = ImagesSource(
            path=os.path.join(tempfile.gettempdir(), "raydl-bench-cluster"), generate=args.images or b.images
        )
    elif args.images and isinstance(source, ImagesSource):
        from dataclasses import replace

        source = replace(source, generate=args.images)
    loader = cfg.loader
    if args.batch_size:
        from dataclasses import replace

        loader = replace(loader, batch_size=args.batch_size)
    return {
        "source": source,
        "pipeline": cfg.pipeline,
        "loader": loader,
        "simulate_nodes": args.simulate_nodes
        if args.simulate_nodes is not None
        else (None if args.address else b.simulate_nodes),
        "cpus_per_node": args.cpus_per_node or b.cpus_per_node,
        "ranks": args.ranks or b.ranks,
        "epochs": args.epochs or b.epochs,
        "checkpoint_mib": args.checkpoint_mib or b.checkpoint_mib,
    }


def run(s: dict, *, address: str | None, progress=None) -> dict:
    import ray

    cluster = None
    if s["simulate_nodes"]:
        from ray.cluster_utils import Cluster

        n = s["simulate_nodes"]
        cluster = Cluster()
        for i in range(n):
            labels = {_LABEL.format(k): 1 for k in range(i + 1, n + 1)}
            cluster.add_node(
                num_cpus=s["cpus_per_node"],
                resources=labels,
                object_store_memory=256 << 20,
                include_dashboard=False,
            )
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    else:
        ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
    try:
        nodes = len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0])
        ds = s["pipeline"].apply(s["source"].read())
        points = scaling_points(nodes, relabel=cluster is not None)
        steps = len(points) + (1 if s["checkpoint_mib"] else 0)
        rows = []
        for i, k in enumerate(points):
            rows.append(_run_point(ds, s["loader"], k, s["ranks"], s["epochs"], cluster is not None))
            if progress:
                progress(i + 1, steps, f"{k} node(s): {rows[-1]['images_per_s']:.0f} images/s")
        efficiency(rows)
        broadcast = _broadcast(s["checkpoint_mib"]) if s["checkpoint_mib"] else None
        if progress:
            progress(steps, steps, "done")
        return {
            "cluster": {
                "nodes": nodes,
                "simulated": cluster is not None,
                "cpus": ray.cluster_resources().get("CPU", 0),
            },
            "ranks": s["ranks"],
            "samples": len(ds),
            "batch_size": s["loader"].batch_size,
            "epochs": s["epochs"],
            "rows": rows,
            "broadcast": broadcast,
        }
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def main(args) -> int:
    from raydl.bench.progress import Progress

    s = _settings(args)
    if not s["simulate_nodes"] and not args.address:
        raise SystemExit("raydl bench cluster: give --address (an existing cluster) or --simulate-nodes N")
    with Progress(
        len(scaling_points(s["simulate_nodes"] or 2, relabel=bool(s["simulate_nodes"]))) + 1, "bench cluster"
    ) as bar:
        result = run(s, address=args.address, progress=lambda i, n, note: bar.update(i, note))
    print(format_summary(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
