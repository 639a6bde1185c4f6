"""raydl feeding a Ray Train job: the loader is built on the driver and passed to the workers.

    python examples/ray_train.py [--images 128] [--workers 2] [--epochs 2]

Each TorchTrainer worker calls `loader.iterator(world_rank)`; the batches of
every rank come from the same loader actors, and each rank gets the same
number of batches, so DDP's collective calls never wait on a missing batch.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import ray
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model

import raydl
from raydl.demo import make_images


def train_loop_per_worker(config: dict) -> None:
    loader = config["loader"]
    ctx = ray.train.get_context()
    it = loader.iterator(ctx.get_world_rank())
    model = prepare_model(
        torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(8), torch.nn.Flatten(), torch.nn.Linear(3 * 64, 4))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(config["epochs"]):
        ids = []
        for batch in it.iter_torch_batches():
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            ids += batch["id"].tolist()
        summary = {
            "epoch": epoch,
            "rank": ctx.get_world_rank(),
            "batches": len(it),
            "ids": ids,
            "loss": loss.item(),
        }
        ray.train.report({k: v for k, v in summary.items() if k != "ids"})
        # Ray Train keeps metrics only with checkpoints; the driver reads this file instead.
        with open(os.path.join(config["report_dir"], f"rank{summary['rank']}-epoch{epoch}.json"), "w") as f:
            json.dump(summary, f)


def run(root: str, *, workers: int = 2, epochs: int = 2, storage: str | None = None) -> list[dict]:
    """Train on the images under root with `workers` Ray Train workers; returns each rank's epoch
    summaries."""
    if storage is None:  # Ray Train's run folder and the reports, removed afterwards
        with tempfile.TemporaryDirectory(prefix="raydl-train-") as tmp:
            return run(root, workers=workers, epochs=epochs, storage=tmp)
    report_dir = os.path.join(storage, "raydl-reports")
    os.makedirs(report_dir, exist_ok=True)
    ds = raydl.read_images(root).decode().random_resized_crop(64).random_hflip().normalize("imagenet")
    with ds.loader(batch_size=16, world_size=workers, seed=0, cpus_per_worker=0.25) as loader:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"loader": loader, "epochs": epochs, "report_dir": report_dir},
            scaling_config=ScalingConfig(
                num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 0.5}
            ),
            run_config=RunConfig(storage_path=storage),
        )
        result = trainer.fit()
    if result.error:
        raise result.error
    summaries = []
    for name in sorted(os.listdir(report_dir)):
        with open(os.path.join(report_dir, name)) as f:
            summaries.append(json.load(f))
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        make_images(root, args.images, classes=4, corrupt=0)
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False
        )
        for s in run(root, workers=args.workers, epochs=args.epochs):
            print(
                f"rank {s['rank']} epoch {s['epoch']}: {s['batches']} batches, {len(s['ids'])} samples, "
                f"last loss {s['loss']:.3f}"
            )
        ray.shutdown()


if __name__ == "__main__":
    main()
