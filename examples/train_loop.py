"""A training loop fed by raydl: two ranks (threads here, processes in real jobs) on a local Ray.

    python examples/train_loop.py [--images 256] [--epochs 2]

Each rank holds its own iterator; a tiny torch model trains on the batches.
"""

from __future__ import annotations

import argparse
import tempfile
import threading

import ray
import torch

import raydl
from raydl.demo import make_images


def train_rank(loader, rank: int, epochs: int, losses: dict) -> None:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(8), torch.nn.Flatten(), torch.nn.Linear(3 * 64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    it = loader.iterator(rank)
    for _ in range(epochs):
        for batch in it.iter_torch_batches():
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    losses[rank] = (loss.item(), it.stats())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        make_images(root, args.images, classes=4)
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False
        )
        ds = raydl.read_images(root).decode().random_resized_crop(64).random_hflip().normalize("imagenet")
        losses: dict = {}
        with ds.loader(batch_size=32, world_size=2, seed=0) as loader:
            threads = [
                threading.Thread(target=train_rank, args=(loader, r, args.epochs, losses)) for r in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for rank, (loss, stats) in sorted(losses.items()):
            print(
                f"rank {rank}: last loss {loss:.3f}, {stats.samples_delivered} samples, "
                f"{stats.samples_skipped} skipped, waited {stats.wait_s:.2f} s"
            )
        ray.shutdown()


if __name__ == "__main__":
    main()
