"""`raydl bench control-plane`: what planning and dispatching one batch costs, from 8 to 1,024 ranks
and 1 to 256 nodes, without real data.

    raydl bench control-plane --ranks 8,64,256,1024 --nodes 1,16,64,256 --json cp.json

For each (ranks, nodes) it runs one rank's real `DataIterator` scheduling loop
(plan the batch, choose a worker among nodes x workers-per-node, keep
`prefetch_batches` in flight, account the result) against stub workers that
answer at once, and counts the calls that reach the loader's coordinator. Every
rank runs the same loop in its own process, so one rank's cost per batch is the
cost at that world size; coordinator calls are summed over all ranks.
Alongside, in the same run:

* Ray's own cost of one batch call (`actor.run_batch.remote(task)` and the
  `ray.get` of a small result) on a real actor on this node: the CPU time of
  the calling process (its round trip is latency, hidden by prefetching);
Coordinator calls per second assume each rank takes `--step-s` per batch.

* a batch's decode time: raydl's "train" sample program on a generated
  500x375 JPEG, times the batch size (CPU time of one core).

The goal: plan + loop + Ray call <= 1 % of a batch's decode time at 1,024 ranks x
256 nodes, and coordinator calls per batch that do not grow with ranks.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["add_parser", "main", "measure"]

IMAGENET = 1_281_167


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "control-plane",
        help="plan + dispatch cost per batch at 8..1,024 ranks, 1..256 nodes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", default="8,64,256,1024", help="world sizes (default: %(default)s)")
    p.add_argument("--nodes", default="1,16,64,256", help="node counts (default: %(default)s)")
    p.add_argument("--workers-per-node", type=int, default=1)
    p.add_argument("--samples", type=int, default=IMAGENET, help="dataset size (default: ImageNet-1k's)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=200, help="batches timed per configuration")
    p.add_argument(
        "--step-s",
        type=float,
        default=0.1,
        help="seconds a trainer rank spends per batch (default %(default)s: 2,560 img/s per rank)",
    )
    p.add_argument("--json", help="write the rows here")
    p.set_defaults(func=main)
    return p


# -- stubs: the worker pool and its workers, minus Ray and data ------------------------------
@dataclass(frozen=True)
class _StubCall:
    result: dict  # extra BatchResult fields, shared by every stub worker (the membership version)

    def remote(self, task):
        from raydl.plan.tasks import BatchResult

        ids = task.ids.astype(np.int64, copy=False)
        return BatchResult(
            batch={"image": ids, "label": ids, "id": ids, "key": []}, skipped=[], unreadable=[], **self.result
        )


class _StubHandle:
    def __init__(self, extra: dict) -> None:
        self.run_batch = _StubCall(extra)


def _dry_iterator_class():
    from raydl.consume.iterator import DataIterator

    class DryIterator(DataIterator):
        """The real loop; a stub result is its own ref, so `_get` hands it back without Ray. The rank sits on
        `node`, beside its workers."""

        def __init__(self, plan, pool, rank: int, node: str) -> None:
            super().__init__(plan, pool, rank)
            self._node = node

        def _get(self, k, timeout):
            task = self._pending[k]
            return [task.ref], task

    return DryIterator


class _DryPool:
    """The WorkerPool protocol over stub workers: its calls to the coordinator are counted, not sent."""

    object_store_budget = 1 << 40

    def __init__(self, workers: list, coordinator_calls: list[str]) -> None:
        self._workers, self._calls, self._version = list(workers), coordinator_calls, 1

    def runners(self) -> list:
        return self._workers

    def sync(self, version: int) -> None:
        if version > self._version:  # the Loader asks the coordinator for the list once per change
            self._calls.append("workers")
            self._version = version

    def replace(self, dead) -> list:
        self._calls.append("report_dead")
        return self._workers


def _dry_plan(config, num_samples: int):
    """The plan of `num_samples` samples, all shuffled together (as of an image folder)."""
    from raydl.plan.failures import ErrorPolicy
    from raydl.plan.loader_plan import LoaderPlan
    from raydl.plan.orders import SampleOrder

    order = SampleOrder(num_samples, "0" * 32)
    return LoaderPlan(config, order, num_samples, "0" * 32, ErrorPolicy(config.on_error))


_MEMBERSHIP: dict = {}  # the stub coordinator's worker-list version, as the stub workers report it


def _workers(nodes: int, per_node: int):
    from raydl.plan.scheduling import WorkerInfo
    from raydl.plan.tasks import BatchResult

    _MEMBERSHIP.clear()
    if "membership" in BatchResult.__dataclass_fields__:
        _MEMBERSHIP["membership"] = 1
    return [
        WorkerInfo(_StubHandle(_MEMBERSHIP), f"node{n:04d}", f"host{n}:{1000 + w}")
        for n in range(nodes)
        for w in range(per_node)
    ]


def measure_loop(
    ranks: int,
    nodes: int,
    *,
    per_node: int,
    samples: int,
    batch_size: int,
    batches: int,
    seconds_per_batch: float,
) -> dict:
    """One rank's loop (the last rank: it gets the pad rows) for `batches` batches; coordinator calls counted.

    Half-way the worker list changes once (a node joins): the calls that change
    costs are counted apart from the steady state's.

    `seconds_per_batch` is how long a trainer takes per batch: the calls per second of all ranks are
    reported at that pace (the calls themselves follow the list's changes, not a clock).
    """
    from raydl.options import LoaderConfig

    config = LoaderConfig(batch_size=batch_size, world_size=ranks, seed=0, prefetch_batches=2)
    calls: list[str] = []
    workers = _workers(nodes, per_node)
    plan = _dry_plan(config, samples)
    it = _dry_iterator_class()(plan, _DryPool(workers, calls), ranks - 1, workers[-1].node_id)
    done, loop_s, steady = 0, 0.0, 0
    while done < batches:
        # CPU time of this thread: what the loop costs, whatever the machine's load
        t0 = time.thread_time()
        for _batch in it.iter_batches():
            done += 1
            if done == batches // 2:
                steady = len(calls)
                if "membership" in _MEMBERSHIP:
                    _MEMBERSHIP["membership"] += 1
            if done >= batches:
                break
        loop_s += time.thread_time() - t0
    per_rank = plan.batches_per_rank()
    fresh = _dry_plan(config, samples)  # no epoch order computed yet, as a rank's first batch finds it
    t0 = time.thread_time()
    for k in range(batches):
        fresh.task(ranks - 1, k // per_rank, k % per_rank)
    plan_s = time.thread_time() - t0
    return {
        "ranks": ranks,
        "nodes": nodes,
        "workers": len(workers),
        "plan_us": 1e6 * plan_s / batches,
        "loop_us": 1e6 * loop_s / done,
        "coordinator_calls_per_batch": steady / (batches // 2),
        "coordinator_calls_per_change": len(calls) - steady - steady * (done - batches // 2) / (batches // 2),
    }


def measure_ray_call(batch_size: int, calls: int = 200) -> tuple[float, float]:
    """(CPU seconds the calling process spends, wall seconds) per `run_batch.remote(task)` + `ray.get` of a
    tiny result, on a real actor. The CPU time (all the caller's threads) is the cost a rank pays; the wall
    time is latency, which prefetching hides, and which a loaded machine inflates."""
    import ray

    from raydl.plan.tasks import BatchTask

    @ray.remote(num_cpus=0)
    class Echo:
        def run_batch(self, task):
            return len(task.ids)

    actor = Echo.remote()
    ids = np.arange(batch_size, dtype=np.int64)
    task = BatchTask(rank=0, epoch=0, index=0, ids=ids, seeds=ids.astype(np.uint64))
    for _ in range(10):
        ray.get(actor.run_batch.remote(task))
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        ray.get(actor.run_batch.remote(task))
    cpu, wall = (time.process_time() - c0) / calls, (time.perf_counter() - t0) / calls
    ray.kill(actor)
    return cpu, wall


def measure_decode(batch_size: int, images: int = 20) -> float:
    """CPU seconds of one batch of the "train" program (decode, RandomResizedCrop 224, flip, normalize)."""
    from PIL import Image

    from raydl.describe.transforms import Decode, Normalize, RandomHFlip, RandomResizedCrop, compile_stages

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:375, 0:500].astype(np.float32)
    program = compile_stages(
        (
            Decode(),
            RandomResizedCrop(224, (0.08, 1.0), (3 / 4, 4 / 3)),
            RandomHFlip(0.5),
            Normalize.make("imagenet", None),
        )
    )
    blobs = []
    for i in range(images):
        img = np.stack([127 + 100 * np.sin(0.02 * (c + 1) * (xx + i * yy) / 3) for c in range(3)], -1)
        img += rng.normal(0, 8, size=img.shape)
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        blobs.append(buf.getvalue())
    out = np.empty(program.slot_shape(), program.dtype)
    for b in blobs[:3]:
        program.run(b, 1, out)
    t0 = time.thread_time()
    for i, b in enumerate(blobs):
        program.run(b, i, out)
    return (time.thread_time() - t0) / len(blobs) * batch_size


def measure(
    ranks: list[int],
    nodes: list[int],
    *,
    per_node: int = 1,
    samples: int = IMAGENET,
    batch_size: int = 256,
    batches: int = 200,
    step_s: float = 0.1,
    progress=None,
) -> dict:
    """Every (ranks, nodes) row, plus the Ray call and the decode time they are compared with."""
    import ray

    from raydl.env import local_ray_config

    started_ray = not ray.is_initialized()
    if started_ray:  # also what the iterators ask for their node id: never someone else's cluster
        ray.init(
            address="local",
            num_cpus=1,
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
            _system_config=local_ray_config(),  # as raydl's own local Ray (raydl.env)
        )
    try:
        return _measure(
            ranks,
            nodes,
            per_node=per_node,
            samples=samples,
            batch_size=batch_size,
            batches=batches,
            step_s=step_s,
            progress=progress,
        )
    finally:
        if started_ray:
            ray.shutdown()


def _measure(ranks, nodes, *, per_node, samples, batch_size, batches, step_s, progress) -> dict:
    ray_call, ray_wall = measure_ray_call(batch_size)
    decode = measure_decode(batch_size)
    rows = []
    grid = [(r, n) for r in ranks for n in nodes]
    for i, (r, n) in enumerate(grid):
        row = measure_loop(
            r,
            n,
            per_node=per_node,
            samples=samples,
            batch_size=batch_size,
            batches=batches,
            seconds_per_batch=step_s,
        )
        row["coordinator_calls_per_s"] = row["coordinator_calls_per_batch"] * r / step_s  # all ranks together
        row["ray_call_us"] = 1e6 * ray_call
        row["total_us"] = row["loop_us"] + row["ray_call_us"]  # the loop includes planning the batch
        row["decode_ms"] = 1e3 * decode
        row["share_of_decode"] = row["total_us"] / 1e3 / row["decode_ms"]
        rows.append(row)
        if progress:
            progress(i + 1, len(grid))
    return {
        "samples": samples,
        "batch_size": batch_size,
        "batches": batches,
        "step_s": step_s,
        "ray_call_us": 1e6 * ray_call,
        "ray_round_trip_us": 1e6 * ray_wall,
        "decode_ms_per_batch": 1e3 * decode,
        "rows": rows,
    }


def format_rows(result: dict) -> str:
    head = (
        "ranks",
        "nodes",
        "plan us",
        "loop us",
        "Ray CPU us",
        "total us",
        "% of decode",
        "coord/batch",
        "coord calls/s",
        "calls/change",
    )
    lines = [
        f"control plane per batch (n={result['samples']:,}, batch {result['batch_size']}, "
        f"decode {result['decode_ms_per_batch']:.0f} ms/batch on one core; a Ray call costs the caller "
        f"{result['ray_call_us']:.0f} us of CPU, {result['ray_round_trip_us']:.0f} us round trip)",
        "  ".join(f"{h:>12}" for h in head),
    ]
    for r in result["rows"]:
        lines.append(
            "  ".join(
                f"{v:>12}"
                for v in (
                    r["ranks"],
                    r["nodes"],
                    f"{r['plan_us']:.0f}",
                    f"{r['loop_us']:.0f}",
                    f"{r['ray_call_us']:.0f}",
                    f"{r['total_us']:.0f}",
                    f"{100 * r['share_of_decode']:.2f}",
                    f"{r['coordinator_calls_per_batch']:.4f}",
                    f"{r['coordinator_calls_per_s']:.1f}",
                    f"{r['coordinator_calls_per_change'] * r['ranks']:.0f}",
                )
            )
        )
    return "\n".join(lines)


def main(args) -> int:
    from raydl.bench.progress import Progress

    ranks = [int(x) for x in args.ranks.split(",")]
    nodes = [int(x) for x in args.nodes.split(",")]
    with Progress(len(ranks) * len(nodes), "control plane") as bar:
        result = measure(
            ranks,
            nodes,
            per_node=args.workers_per_node,
            samples=args.samples,
            batch_size=args.batch_size,
            batches=args.batches,
            step_s=args.step_s,
            progress=lambda i, n: bar.update(i),
        )
    print(format_rows(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
