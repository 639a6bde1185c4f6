"""A small CNN trained by Ray Train on raydl batches, as a Ray job, configured by one YAML file.

    python examples/train.py --config configs/local-demo.yaml                # a local Ray
    RAY_AUTH_MODE=token ray job submit --working-dir . -- \\
        python examples/train.py --config configs/local-demo.yaml            # an existing cluster
    python examples/train.py --config configs/local-demo.yaml --set job.epochs=3 --set loader.batch_size=16

- A `ray.train.torch.TorchTrainer` runs `job.workers` ranks; rank r consumes
  `loader.iterator(r)` of the training loader, `job.steps_per_epoch` steps per epoch.
- The `val:` data has its own loader beside the training one. An evaluation
  actor, on another node when there is one, fetches each epoch's weights peer
  to peer (`raydl.checkpoint`: rank 0 publishes, the evaluator pulls) and
  scores them on the validation loader while training goes on.
- After every epoch rank 0 writes the model and every rank's iterator
  `state_dict()` to `job.state_dir`; a job stopped and submitted again resumes
  from the last finished epoch, on the exact next batch. configs/local-demo.yaml
  keeps it in a folder of your own (~/.cache/raydl/local-demo/state, or under
  $XDG_CACHE_HOME or $RAYDL_DEMO_DIR); the script says where, and `--fresh`
  starts afresh.
- Rank 0 prints one line per epoch (throughput, consumer wait, skipped samples,
  the epoch's mean training loss, checkpoint transfer time) and one per
  evaluation. On the generated demo data (each class has its own tint) the
  loss falls from ln 4 = 1.39 and the accuracy climbs well above chance
  within the two epochs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydl import checkpoint
from raydl.config import load_config
from raydl.env import local_ray_config, ray_address
from raydl.errors import DataSourceError

PREFIX = "raydl-train"


def say(line: str) -> None:
    """One line to the job's log (Ray Train's print patch would otherwise log a worker's print twice)."""
    print(line, file=sys.__stdout__, flush=True)


def make_model(num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, num_classes),
    )


# -- state that survives a stopped job ---------------------------------------------------
def forget_state(state_dir: str) -> None:
    """--fresh: remove what save_state wrote there (state.json, model-*.pt), nothing else."""
    if not os.path.isdir(state_dir):
        return
    for name in os.listdir(state_dir):
        if name == "state.json" or (name.startswith("model-") and name.endswith(".pt")):
            os.remove(os.path.join(state_dir, name))


def load_state(state_dir: str | None) -> dict | None:
    path = state_dir and os.path.join(state_dir, "state.json")
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def save_state(state_dir: str, epoch: int, model: torch.nn.Module, iterators: list[dict]) -> None:
    """Model and iterator states of a finished epoch, each file renamed into place (a crash leaves the
    old)."""
    os.makedirs(state_dir, exist_ok=True)
    weights = os.path.join(state_dir, f"model-{epoch}.pt")
    torch.save(model.state_dict(), weights + ".tmp")
    os.replace(weights + ".tmp", weights)
    state = {"epoch": epoch + 1, "model": os.path.basename(weights), "iterators": iterators}
    path = os.path.join(state_dir, "state.json")
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


# -- the evaluation actor ---------------------------------------------------------------
class Evaluator:
    """Fetches published weights peer to peer and scores them on the validation loader."""

    def __init__(self, val_loader, num_classes: int) -> None:
        self.it = val_loader.iterator(0)
        self.model = make_model(num_classes)
        self.node = ray.get_runtime_context().get_node_id()

    def fetch(self, ref) -> dict:
        got = checkpoint.fetch(ref)
        self.model.load_state_dict(got)
        return {"seconds": got.seconds, "transport": got.transport, "bytes": ref.size, "node": self.node}

    def evaluate(self, epoch: int) -> dict:
        correct = total = 0
        self.model.eval()
        with torch.no_grad():
            for batch in self.it.iter_torch_batches():
                correct += int((self.model(batch["image"]).argmax(1) == batch["label"]).sum())
                total += len(batch["label"])
        return {"epoch": epoch, "accuracy": correct / max(1, total), "samples": total}


def start_evaluator(val_loader, num_classes: int):
    """The evaluator on a node other than this one when the cluster has one (a peer-to-peer fetch across
    nodes)."""
    here = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    options = {"num_cpus": 0}
    if others:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(others[0], soft=True)
    return ray.remote(Evaluator).options(**options).remote(val_loader, num_classes)


# -- one training rank -------------------------------------------------------------------
def train_loop_per_worker(cfg: dict) -> None:
    job = cfg["job"]
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    it = cfg["loader"].iterator(rank)
    torch.manual_seed(0)
    model = make_model(cfg["num_classes"])
    state = load_state(job.state_dir)
    first_epoch = 0
    if state is not None:
        model.load_state_dict(torch.load(os.path.join(job.state_dir, state["model"])))
        iters = state["iterators"]
        it.load_state_dict(iters[rank] if len(iters) == world else iters[0])  # another world size: re-dealt
        first_epoch = state["epoch"]
        if rank == 0:
            say(
                f"{PREFIX} resumed from {job.state_dir}: epoch {first_epoch}, next batch "
                f"{iters[0]['batches_done']} of loader epoch {iters[0]['epoch']} (--fresh starts afresh)"
            )
    model = prepare_model(model)
    opt = torch.optim.Adam(model.parameters(), lr=job.lr)
    evaluator = (
        start_evaluator(cfg["val_loader"], cfg["num_classes"]) if rank == 0 and cfg["val_loader"] else None
    )
    evals, published_box = [], []  # the ref rank 0 serves now (unpublished when the next replaces it)
    steps = job.steps_per_epoch or len(it)
    for epoch in range(first_epoch, job.epochs):
        before, t0, losses = it.stats(), time.perf_counter(), []
        for step, batch in enumerate(it.iter_torch_batches()):
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step + 1 >= steps:
                break  # the loader's epoch continues where this one stopped
        after, wall = it.stats(), time.perf_counter() - t0
        mine = {
            "samples": after.samples_delivered - before.samples_delivered,
            "wall": wall,
            "wait": after.wait_s - before.wait_s,
            "skipped": after.samples_skipped - before.samples_skipped,
            "loss": sum(losses) / len(losses) if losses else float("nan"),  # this rank's mean over the epoch
            "state": it.state_dict(),
        }
        ranks: list = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            report_epoch(epoch, job, ranks, evaluator, evals, published_box, model)
        ray.train.report({"epoch": epoch + 1, "loss": mine["loss"]})  # every rank reports (a collective)
    for e in ray.get(evals):
        say(
            f"{PREFIX} eval epoch {e['epoch']}: accuracy {e['accuracy']:.3f} on {e['samples']} "
            "validation samples"
        )
    if published_box:
        checkpoint.unpublish(published_box[0])


def report_epoch(
    epoch: int, job, ranks: list[dict], evaluator, evals: list, published_box: list, model
) -> None:
    """Rank 0 at an epoch's end: publish the weights to the evaluator, persist the state, print the line."""
    world, samples = len(ranks), sum(r["samples"] for r in ranks)
    line = (
        f"{PREFIX} epoch {epoch + 1}/{job.epochs}: {samples} samples on {world} ranks, "
        f"{samples / max(r['wall'] for r in ranks):.1f} images/s, "
        f"wait {max(r['wait'] for r in ranks):.2f} s, skipped {sum(r['skipped'] for r in ranks)}, "
        f"loss {sum(r['loss'] for r in ranks) / world:.3f}"
    )
    plain = model.module if hasattr(model, "module") else model  # DDP's wrapper adds a "module." prefix
    if evaluator is not None:
        if published_box:
            checkpoint.unpublish(published_box.pop())
        published_box.append(checkpoint.publish(plain.state_dict()))
        got = ray.get(evaluator.fetch.remote(published_box[0]))
        where = "another node" if got["node"] != ray.get_runtime_context().get_node_id() else "this node"
        moved = f"{got['bytes'] / 1e6:.2f} MB over {got['transport']} to {where}"
        line += f", checkpoint {got['seconds']:.3f} s ({moved})"
        evals.append(evaluator.evaluate.remote(epoch + 1))
    if job.state_dir:
        save_state(job.state_dir, epoch, plain, [r["state"] for r in ranks])
    say(line)


def start_local_ray() -> None:
    """A local Ray of 2 CPUs for this run, set up so that Ray Train logs no false alarms.

    Ray Train's PlacementGroupCleaner asks the State API, which the dashboard
    serves, whether the run's controller still lives: without a dashboard it
    logs "State API may be temporarily unavailable" every few seconds. So the
    dashboard runs, on a port of its own that RAY_API_SERVER_ADDRESS names to
    the worker processes (inherited from here), so that they ask this Ray and
    not another one on the same machine. No node of a local Ray is ever
    preempted, so Ray Train's PreemptionWatcher, whose start logs a
    "max_restarts > 0" error line, stays off.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("RAY_API_SERVER_ADDRESS", f"http://127.0.0.1:{port}")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        _system_config=local_ray_config(),  # the store frees dropped batches within 10 ms
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", default="configs/local-demo.yaml", help="a YAML config (see docs/configs.md)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one value, e.g. --set loader.batch_size=16 (repeatable)",
    )
    parser.add_argument(
        "--address", default=None, help="Ray address (default: the job's RAY_ADDRESS, else a new local Ray)"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start afresh: forget the state job.state_dir holds from a run before",
    )
    args = parser.parse_args(argv)
    try:
        return run(args, parser)
    except ConfigMistake as exc:  # the message says what to change: no traceback around it
        print(f"{PREFIX}: error: {exc}", file=sys.stderr, flush=True)
        return 2


class ConfigMistake(Exception):
    """The config (or a --set) asks for something raydl refuses before training starts."""


@contextlib.contextmanager
def config_checks(where: str = ""):
    """ValueErrors (and data that cannot be listed) of reading the config, listing its data and building
    its loaders are the config's mistakes; errors while training are not, and keep their traceback."""
    try:
        yield
    except (ValueError, DataSourceError) as exc:
        raise ConfigMistake(f"{where}: {exc}" if where else str(exc)) from exc


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with config_checks():
        cfg = load_config(args.config, args.set)
    job = cfg.job
    if cfg.loader.world_size != job.workers:
        parser.error(f"loader.world_size ({cfg.loader.world_size}) must equal job.workers ({job.workers})")
    if job.state_dir and args.fresh:
        forget_state(job.state_dir)
    state = load_state(job.state_dir)
    if state is not None and state["epoch"] >= job.epochs:
        print(
            f"{PREFIX}: all {job.epochs} epochs in {job.state_dir} are done; nothing to do "
            f"(--fresh starts afresh, --set job.epochs=N trains on)",
            flush=True,
        )
        return 0
    if job.state_dir:
        print(
            f"{PREFIX}: state in {job.state_dir} (a later run resumes from it; --fresh starts afresh)",
            flush=True,
        )
    address = args.address or ray_address() or "local"
    if address == "local":
        start_local_ray()
    else:
        ray.init(address=address)
    with config_checks():
        ds, val = cfg.dataset(), (cfg.val_dataset() if cfg.val and job.evaluate else None)
    print(
        f"{PREFIX}: {args.config} on {len(ray.nodes())} node(s), {job.workers} ranks, {len(ds)} samples",
        ds,
        sep="\n",
        flush=True,
    )
    storage = job.storage_path or os.path.join(job.state_dir or tempfile.gettempdir(), "ray-train")
    with config_checks("the training loader (`loader:`)"):
        loader = ds.loader_from_config(cfg.loader)
    with loader:
        with config_checks(
            "the validation loader (`val.loader:`, which takes `loader:`'s values it does not set)"
        ):
            val_loader = val.loader_from_config(cfg.val.loader) if val is not None else None
        try:
            trainer = TorchTrainer(
                train_loop_per_worker,
                train_loop_config={
                    "loader": loader,
                    "val_loader": val_loader,
                    "job": job,
                    "num_classes": max(1, len(ds.catalog.classes)),
                },
                scaling_config=ScalingConfig(
                    num_workers=job.workers, use_gpu=False, resources_per_worker={"CPU": job.cpus_per_worker}
                ),
                run_config=RunConfig(storage_path=storage, name=f"raydl-train-{os.getpid()}"),
            )
            result = trainer.fit()
        finally:
            if val_loader is not None:
                val_loader.shutdown()
    if result.error:
        raise result.error
    print(f"{PREFIX}: done", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
