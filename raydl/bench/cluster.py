"""`raydl bench cluster`: the loader across a cluster's nodes, at 1, 2, ... N nodes, and a checkpoint to all.

    raydl bench cluster --address auto --data /shared/in1k --ranks 16 --json cluster.json --plot cluster.png
    # ray.cluster_utils on this machine
    raydl bench cluster --simulate-nodes 3 --data /tmp/imgs --images 1536 --ranks 6
    raydl bench cluster --config configs/bench-cluster.yaml --simulate-nodes 3

For each node count k it builds the loader on the first k nodes only, starts
`--ranks` consumer actors spread over those nodes (each a trainer rank that
reads `loader.iterator(rank)` and does nothing else), and reads `--epochs`
epochs. Before the first point, one epoch at all nodes warms every node
(Ray's worker processes, imports, the page cache) and is not reported.

Every point is measured the same way, in steady state: images/s counts the
batches delivered after every rank has its first batch, up to the last batch
(start-up is reported apart, as "start s"). CPU ms per image is the CPU of
raydl's processes over that window (loader workers, coordinator, ranks), per
image delivered in it; "control ms/batch" is the coordinator's CPU per batch.
Per node: the images/s of its ranks and the CPU its loader workers spent.

Simulated nodes (--simulate-nodes) share this machine's cores: each gets
--cpus-per-node CPUs, so the loader's budget per node is the same at every
point, but once the nodes' CPUs pass the machine's cores they compete for the
same cores and images/s cannot follow the node count. They show that every
node takes part, what each node does, what the control plane costs and what
an image costs in CPU; not how a real cluster scales, so no scaling efficiency
or linear line is drawn for them. With --address, the node counts are 1 and
all (a real cluster's nodes cannot be relabelled), 1 being the driver's node,
and efficiency is images/s at all nodes over (nodes x images/s at one node).

`--images N` reads the first N images of `--data` (sorted by path; linked into
a temporary folder), or generates N where `--data` does not exist.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time

from raydl.env import local_ray_config

__all__ = [
    "add_parser",
    "cpu_window",
    "efficiency",
    "format_summary",
    "main",
    "parse_store_stats",
    "scaling_points",
    "steady_window",
]

_LABEL = "raydl_bench_nodes_{}"  # node i of a simulated cluster carries the labels of every k > i
_KINDS = {"ray::LoaderWorker": "worker", "ray::LoaderCoordinator": "coordinator", "ray::_Rank": "rank"}
_MIN_WINDOW_S, _MIN_WINDOW_BATCHES = 1.0, 3  # a steady rate resting on less is shown in brackets


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cluster",
        help="the loader across the nodes of a cluster: steady images/s per node, CPU, waits, object store, "
        "checkpoint broadcast",
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
    p.add_argument(
        "--images",
        type=int,
        help="read the first N images of --data (sorted by path), or generate N when it does not exist",
    )
    p.add_argument("--ranks", type=int, help="consumer ranks (default: the config's bench.ranks)")
    p.add_argument("--epochs", type=int, help="epochs read at each node count")
    p.add_argument("--batch-size", type=int, help="override loader.batch_size")
    p.add_argument("--cpus-per-node", type=int, help="CPUs of each simulated node")
    p.add_argument("--checkpoint-mib", type=int, help="size of the broadcast state dict")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint broadcast")
    p.add_argument("--json", help="write every figure here")
    p.add_argument(
        "--plot", help="write a PNG: images/s and CPU per image against nodes, per node (needs matplotlib)"
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


def steady_window(per_rank: list[dict]) -> dict:
    """The steady state of one point from each rank's `times` ([wall time, images] per batch): from the
    moment every rank has its first batch (t0) to the last batch (t1), the images of the batches delivered
    in (t0, t1] and how many batches they are. `start_s` is t0 from the earliest rank's start."""
    firsts = [r["times"][0][0] for r in per_rank if r["times"]]
    if not firsts:
        return {"t0": 0.0, "t1": 0.0, "seconds": 0.0, "images": 0, "batches": 0, "start_s": 0.0}
    t0 = max(firsts)
    t1 = max(r["times"][-1][0] for r in per_rank if r["times"])
    inside = [(t, n) for r in per_rank for t, n in r["times"] if t0 < t <= t1]
    started = min(r["started"] for r in per_rank)
    return {
        "t0": t0,
        "t1": t1,
        "seconds": t1 - t0,
        "images": sum(n for _, n in inside),
        "batches": len(inside),
        "start_s": t0 - started,
    }


def cpu_window(
    samples: list[tuple[float, dict]], t0: float, t1: float, per_rank: list[dict], node_of_pid: dict[int, str]
) -> dict | None:
    """CPU per image over a point's steady window, from the sampler's `samples` ([wall time, {pid: [kind,
    cpu s]}], in time order): between the last sample at or before t0 and the first at or after t1, each
    process's CPU growth by kind, and the loader workers' by node (`node_of_pid`), with the images and
    batches delivered in between."""
    before = [s for s in samples if s[0] <= t0]
    after = [s for s in samples if s[0] >= t1]
    if not before or not after:
        return None
    (ta, a), (tb, b) = before[-1], after[0]
    by_kind: dict[str, float] = {}
    worker_by_node: dict[str, float] = {}
    for pid, (kind, cpu) in b.items():
        grown = max(0.0, cpu - (a[pid][1] if pid in a else 0.0))
        by_kind[kind] = by_kind.get(kind, 0.0) + grown
        node = node_of_pid.get(pid)
        if kind == "worker" and node:
            worker_by_node[node] = worker_by_node.get(node, 0.0) + grown
    inside = [n for r in per_rank for t, n in r["times"] if ta < t <= tb]
    images, batches = sum(inside), len(inside)
    return {
        "seconds": tb - ta,
        "images": images,
        "batches": batches,
        "cpu_s": by_kind,
        "worker_cpu_s_by_node": worker_by_node,
        "cpu_ms_per_image": 1000 * sum(by_kind.values()) / images if images else None,
        "worker_ms_per_image": 1000 * by_kind.get("worker", 0.0) / images if images else None,
        "control_ms_per_batch": 1000 * by_kind.get("coordinator", 0.0) / batches if batches else None,
        "rank_ms_per_batch": 1000 * by_kind.get("rank", 0.0) / batches if batches else None,
    }


_STORE = re.compile(r"Plasma memory usage (\d+) MiB")
_SPILLED = re.compile(r"Spilled (\d+) MiB")


def parse_store_stats(text: str) -> tuple[int, int]:
    """(plasma MiB in use, MiB spilled so far) from Ray's aggregate object store summary."""
    used = _STORE.search(text)
    spilled = _SPILLED.search(text)
    return (int(used.group(1)) if used else 0), (int(spilled.group(1)) if spilled else 0)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_summary(result: dict) -> str:
    """The one-screen summary."""
    c = result["cluster"]
    lines = [
        f"raydl bench cluster: {c['nodes']} {'simulated ' if c['simulated'] else ''}nodes "
        f"({c['cpus']:.0f} CPUs), {result['ranks']} ranks, {result['samples']} images, "
        f"batch {result['batch_size']}, {result['epochs']} epoch(s) per point",
    ]
    if c["simulated"]:
        lines.append(
            f"simulated nodes of {c['cpus_per_node']} CPU(s) each on {c['machine_cores']} cores of one "
            "machine: "
            + (
                "they share those cores, so images/s cannot follow the node count; read the per-node "
                "figures and CPU per image (no scaling efficiency)"
                if c["nodes"] * c["cpus_per_node"] > c["machine_cores"]
                else "each point has its nodes' CPUs, but Ray's services and the driver share the machine"
            )
        )
    lines.append("")
    head = (
        "nodes",
        "images/s",
        "per node",
        "efficiency",
        "start s",
        "CPU ms/img",
        "control ms/b",
        "nodes used",
        "max wait s",
        "store MiB",
        "spilled MiB",
    )
    lines.append("  ".join(f"{h:>12}" for h in head))
    for r in result["rows"]:
        eff = "-" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"
        rate = f"{r['images_per_s']:.1f}" if r["steady_ok"] else f"[{r['images_per_s']:.1f}]"
        cpu = r.get("cpu") or {}
        lines.append(
            "  ".join(
                f"{v:>12}"
                for v in (
                    r["nodes"],
                    rate,
                    f"{r['images_per_s'] / r['nodes']:.1f}",
                    eff,
                    f"{r['start_s']:.2f}",
                    _ms(cpu.get("cpu_ms_per_image")),
                    _ms(cpu.get("control_ms_per_batch")),
                    f"{r['nodes_used']}/{r['nodes']}",
                    f"{max(x['wait_s'] for x in r['per_rank']):.2f}",
                    r["store_peak_mib"],
                    r["spilled_mib"],
                )
            )
        )
    if any(not r["steady_ok"] for r in result["rows"]):
        lines.append(
            f"[bracketed]: the steady window is under {_MIN_WINDOW_S:.0f} s or {_MIN_WINDOW_BATCHES} "
            "batches; give more --images or --epochs"
        )
    last = result["rows"][-1]
    workers = (last.get("cpu") or {}).get("worker_cpu_s_by_node", {})
    lines += [
        "",
        f"at {last['nodes']} nodes, per node (ranks' images/s / loader workers / their CPU s in the window): "
        + ", ".join(
            f"{n[:8]} {v:.1f}/{last['workers_by_node'].get(n, 0)}/{workers.get(n, 0.0):.1f}"
            for n, v in sorted(last["per_node_images_per_s"].items())
        ),
        "per rank (wait s / images/s / local batches): "
        + ", ".join(
            f"r{x['rank']} {x['wait_s']:.2f}/{x['images_per_s']:.0f}/{x['local_batches']}of{x['batches']}"
            for x in last["per_rank"]
        ),
    ]
    if result.get("warmup_s") is not None:
        lines.append(f"warm-up (1 epoch at all nodes, not reported above): {result['warmup_s']:.1f} s")
    b = result.get("broadcast")
    if b:
        lines.append(
            f"checkpoint broadcast: {b['mib']} MiB to {b['peers']} nodes in {b['seconds']:.2f} s "
            f"({b['mib'] * b['peers'] / max(b['seconds'], 1e-9):.0f} MiB/s delivered; "
            f"transports {', '.join(sorted(set(b['transports'])))})"
        )
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> None:
    """Left: images/s against nodes (a linear line from one node only on a real cluster); right: each
    node's images/s at every point, and CPU ms per image."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib (pip install 'raydl-loader[bench]'): {exc}") from exc
    rows = result["rows"]
    simulated = result["cluster"]["simulated"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    nodes = [r["nodes"] for r in rows]
    ax1.plot(nodes, [r["images_per_s"] for r in rows], "o-", label="raydl, steady images/s")
    if not simulated:
        one = rows[0]["images_per_s"] / rows[0]["nodes"]
        ax1.plot(nodes, [one * n for n in nodes], "--", color="grey", label="linear from one node")
    ax1.set_xlabel("nodes")
    ax1.set_ylabel("images/s")
    ax1.set_xticks(nodes)
    ax1.set_ylim(bottom=0)
    cpu = [(r.get("cpu") or {}).get("cpu_ms_per_image") for r in rows]
    if any(v is not None for v in cpu):
        twin = ax1.twinx()
        twin.plot(nodes, [v if v is not None else float("nan") for v in cpu], "s:", color="tab:red")
        twin.set_ylabel("CPU ms per image (raydl's processes)", color="tab:red")
        twin.set_ylim(bottom=0)
    ax1.set_title(
        "simulated nodes share one machine's cores" if simulated else "throughput against nodes", fontsize=10
    )
    ax1.legend(loc="lower right")
    width = 0.8 / max(len(rows), 1)
    order: list[str] = []  # the order in which points add nodes
    for r in rows:
        order += [n for n in r["node_ids"] if n not in order]
    for i, r in enumerate(rows):
        per = r["per_node_images_per_s"]
        xs = [j + i * width for j, n in enumerate(order) if n in per]
        ax2.bar(xs, [per[n] for n in order if n in per], width, label=f"{r['nodes']} node(s)")
    ax2.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(order))], [n[:8] for n in order])
    ax2.set_xlabel("node")
    ax2.set_ylabel("images/s of the node's ranks")
    ax2.set_title("every node's share", fontsize=10)
    ax2.legend()
    fig.suptitle(
        f"raydl bench cluster ({'simulated ' if simulated else ''}"
        f"{result['cluster']['nodes']} nodes, {result['ranks']} ranks)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the measurement ---------------------------------------------------------------------------
class _Rank:
    """One consumer rank: reads whole epochs from its iterator, stamping each batch, and reports."""

    def __init__(self, loader, rank: int) -> None:
        self.it = loader.iterator(rank)

    def run(self, epochs: int) -> dict:
        import ray

        started, times = time.time(), []
        for _ in range(epochs):
            for batch in self.it.iter_batches():
                times.append((time.time(), len(batch["id"])))
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
            "started": started,
            "times": times,
        }


class _Probe:
    """On one machine: the CPU seconds of raydl's processes there (loader workers, coordinators, ranks)."""

    def cpu(self) -> dict[int, list]:
        import psutil

        from raydl.bench._runner import process_kind

        out = {}
        for proc in psutil.process_iter():
            try:
                kind = _KINDS.get(process_kind(proc.cmdline()))
                if kind is None:
                    continue
                t = proc.cpu_times()
            except psutil.Error:
                continue
            out[proc.pid] = [kind, t.user + t.system]
        return out


class _Sampler:
    """Polled in a thread while the ranks read: peak plasma use and spilled MiB, and the CPU of raydl's
    processes on every machine (`samples`, for `cpu_window`); one sample when it starts and one at the end."""

    def __init__(self, probes: list, period_s: float = 0.5) -> None:
        import threading

        self.period_s, self.peak, self.spilled = period_s, 0, 0
        self.probes = probes
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import ray
        from ray._private.internal_api import memory_summary

        try:  # this cluster's GCS, named: "auto" could pick another cluster on the machine
            used, spilled = parse_store_stats(
                memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
            )
            self.peak, self.spilled = max(self.peak, used), max(self.spilled, spilled)
        except Exception:  # noqa: BLE001 - a missed sample is not worth failing the run
            pass
        try:
            t = time.time()
            merged = {}
            for got in ray.get([p.cpu.remote() for p in self.probes], timeout=10):
                merged.update(got)
            self.samples.append((t, merged))
        except Exception:  # noqa: BLE001
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> _Sampler:
        self._sample()
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


def _probes() -> list:
    """One _Probe on each machine of the cluster (simulated nodes share one)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    hosts: dict[str, str] = {}
    for n in ray.nodes():
        if n["Alive"]:
            hosts.setdefault(n["NodeManagerAddress"], n["NodeID"])
    return [
        ray.remote(_Probe)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote()
        for node in hosts.values()
    ]


def _run_point(ds, loader_config, k: int, ranks: int, epochs: int, labels: bool, probes: list) -> dict:
    from dataclasses import replace

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = _node_ids(labels, k)
    resource = _LABEL.format(k) if labels else (None if k > 1 else f"node:{_node_ip(nodes[0])}")
    config = replace(loader_config, world_size=ranks, node_resource=resource)
    t0 = time.perf_counter()
    with ds.loader_from_config(config) as loader:
        actors = [
            ray.remote(_Rank)
            .options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[r % len(nodes)], soft=False),
            )
            .remote(loader, r)
            for r in range(ranks)
        ]
        with _Sampler(probes) as sampler:
            per_rank = ray.get([a.run.remote(epochs) for a in actors])
        wall = time.perf_counter() - t0
        for a in actors:
            ray.kill(a)
        loader.sync(1 << 62)  # the coordinator's worker list as it is now: every worker the epoch had
        ready = ray.get([w.handle.ready.remote() for w in loader.workers() if not w.in_process])
    node_of_pid = {i["pid"]: i["node_id"] for i in ready}
    workers_by_node: dict[str, int] = {}
    for i in ready:
        workers_by_node[i["node_id"]] = workers_by_node.get(i["node_id"], 0) + 1
    window = steady_window(per_rank)
    cpu = cpu_window(sampler.samples, window["t0"], window["t1"], per_rank, node_of_pid)
    seconds = max(window["seconds"], 1e-9)
    per_node: dict[str, float] = {}
    for x in per_rank:  # each node's ranks' images in the steady window
        inside = sum(n for t, n in x["times"] if window["t0"] < t <= window["t1"])
        per_node[x["node"]] = per_node.get(x["node"], 0.0) + inside / seconds
    used = set(workers_by_node)
    if cpu:  # a node whose workers spent no CPU in the window made no batches in it
        used = {n for n, s in cpu["worker_cpu_s_by_node"].items() if s > 0.01}
    for x in per_rank:
        del x["started"]
        x["times"] = [[round(t - window["t0"], 4), n] for t, n in x["times"]]  # relative to t0, for --json
    return {
        "nodes": k,
        "node_ids": nodes,
        "images": sum(x["images"] for x in per_rank),
        "images_per_s": window["images"] / seconds,
        "steady_images": window["images"],
        "steady_s": window["seconds"],
        "steady_ok": window["seconds"] >= _MIN_WINDOW_S and window["batches"] >= _MIN_WINDOW_BATCHES,
        "start_s": window["start_s"],
        "wall_s": wall,
        "first_batch_s": min(x["first_batch_s"] or 0.0 for x in per_rank),
        "store_peak_mib": sampler.peak,
        "spilled_mib": sampler.spilled,
        "cpu": cpu,
        "workers_by_node": workers_by_node,
        "nodes_used": len(used & set(nodes)),
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


def first_images(root: str, n: int, into: str) -> str:
    """A folder of the first `n` images of the local image folder `root` (sorted by path), linked into
    `into`; a ValueError when `root` holds fewer."""
    from raydl.bench._transform import link_into, list_images

    files = list_images(root)
    if len(files) < n:
        raise ValueError(f"--images {n}: {root} holds {len(files)} images")
    return link_into(files[:n], root, into)


def _settings(args, tmp: str):
    """Config defaults (configs/bench-cluster.yaml or built in), then the flags. `tmp`: a folder of this
    run, for the first --images images of an existing folder."""
    from dataclasses import replace

    from raydl.config import BenchConfig, Config, ImagesSource, PipelineConfig, StageSpec, load_config
    from raydl.options import LoaderConfig

    if args.set and not args.config:
        raise SystemExit("raydl bench cluster: --set overrides a value of --config; give --config")
    if args.cpus_per_node and args.address:
        raise SystemExit("raydl bench cluster: --cpus-per-node sizes simulated nodes, not a real cluster's")
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
    if args.images is not None and args.images < 1:
        raise SystemExit(f"raydl bench cluster: --images must be at least 1, got {args.images}")
    source = cfg.source
    if args.data:
        source = ImagesSource(path=args.data, generate=args.images or b.images)
    elif source is None:
        source = ImagesSource(
            path=os.path.join(tempfile.gettempdir(), "raydl-bench-cluster"), generate=args.images or b.images
        )
    elif args.images and isinstance(source, ImagesSource):
        source = replace(source, generate=args.images)
    if args.images and os.path.exists(source.path):  # an existing folder: its first --images images
        try:
            source = replace(source, path=first_images(source.path, args.images, os.path.join(tmp, "images")))
        except ValueError as exc:
            raise SystemExit(f"raydl bench cluster: {exc}") from None
    elif args.images and "://" in getattr(source, "path", ""):
        raise SystemExit("raydl bench cluster: --images applies to local image folders only")
    loader = cfg.loader
    if args.batch_size:
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
        "checkpoint_mib": 0 if args.no_checkpoint else (args.checkpoint_mib or b.checkpoint_mib),
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
            head = {"_system_config": local_ray_config()} if i == 0 else {}  # as raydl's own local Ray
            cluster.add_node(
                num_cpus=s["cpus_per_node"],
                resources=labels,
                object_store_memory=256 << 20,
                include_dashboard=False,
                **head,
            )
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    else:
        ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
    try:
        nodes = len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0])
        ds = s["pipeline"].apply(s["source"].read())
        points = scaling_points(nodes, relabel=cluster is not None)
        steps = len(points) + 1 + (1 if s["checkpoint_mib"] else 0)
        probes = _probes()
        labels = cluster is not None
        t = time.perf_counter()
        _run_point(ds, s["loader"], nodes, s["ranks"], 1, labels, probes)  # warm-up: not reported
        warmup_s = time.perf_counter() - t
        if progress:
            progress(1, steps, f"warm-up at {nodes} node(s): {warmup_s:.0f} s")
        rows = []
        for i, k in enumerate(points):
            rows.append(_run_point(ds, s["loader"], k, s["ranks"], s["epochs"], labels, probes))
            if progress:
                progress(i + 2, steps, f"{k} node(s): {rows[-1]['images_per_s']:.0f} images/s")
        if cluster is None:
            efficiency(rows)
        else:  # simulated nodes share cores: no scaling efficiency (docs/benchmarks.md)
            for r in rows:
                r["efficiency"] = None
        for p in probes:
            ray.kill(p)
        broadcast = _broadcast(s["checkpoint_mib"]) if s["checkpoint_mib"] else None
        if progress:
            progress(steps, steps, "done")
        return {
            "cluster": {
                "nodes": nodes,
                "simulated": cluster is not None,
                "cpus": ray.cluster_resources().get("CPU", 0),
                "cpus_per_node": s["cpus_per_node"] if cluster is not None else None,
                "machine_cores": os.cpu_count(),
            },
            "ranks": s["ranks"],
            "samples": len(ds),
            "batch_size": s["loader"].batch_size,
            "epochs": s["epochs"],
            "warmup_s": warmup_s,
            "rows": rows,
            "broadcast": broadcast,
        }
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def main(args) -> int:
    from raydl.bench.progress import Progress

    tmp = tempfile.mkdtemp(prefix="raydl-bench-cluster-")
    try:
        s = _settings(args, tmp)
        if not s["simulate_nodes"] and not args.address:
            raise SystemExit(
                "raydl bench cluster: give --address (an existing cluster) or --simulate-nodes N"
            )
        points = len(scaling_points(s["simulate_nodes"] or 2, relabel=bool(s["simulate_nodes"])))
        with Progress(points + 1 + (1 if s["checkpoint_mib"] else 0), "bench cluster") as bar:
            result = run(s, address=args.address, progress=lambda i, n, note: bar.update(i, note))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(format_summary(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
