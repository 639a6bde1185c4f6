"""A tiny CLIP-style model trained on captions and images read with raydl from WebDataset shards.

    python examples/clip_webdataset.py [--samples 64] [--steps 2] [--batch-size 16]

It writes LAION-style shards with the `webdataset` library's own `TarWriter`
into a temporary folder: per sample a `.jpg` (a coloured disc on noise), a
`.txt` caption that names the colour and the size, and a `.json` of metadata.
raydl reads the image and the caption as fields of one record
(`read_webdataset(fields=...)`); the image goes through the native stages and
a toy tokenizer (words hashed to ids, padded to a length) runs in
`.map_batches(...)`, inside the loader's workers, so the trainer gets
`batch["tokens"]` as a (B, L) tensor beside `batch["image"]`. The model is a
small conv image tower and an embedding-bag text tower trained with the
symmetric InfoNCE loss for a few steps.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
import zlib

import numpy as np
import ray
import torch
import webdataset as wds
from PIL import Image

import raydl

VOCAB = 1024  # token 0 pads
LENGTH = 16
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}


def write_shards(folder: str, samples: int, per_shard: int) -> list[str]:
    """LAION-style shards: key.jpg, key.txt (the caption), key.json (metadata), written by TarWriter."""
    rng = np.random.default_rng(0)
    names = list(COLOURS)
    paths = []
    for s in range(0, samples, per_shard):
        path = os.path.join(folder, f"clip-{s // per_shard:06d}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(s, min(s + per_shard, samples)):
                colour = names[int(rng.integers(len(names)))]
                big = bool(rng.integers(2))
                h, w = int(rng.integers(96, 160)), int(rng.integers(96, 160))
                pixels = rng.normal(128, 30, size=(h, w, 3))
                yy, xx = np.mgrid[0:h, 0:w]
                r = (0.4 if big else 0.2) * min(h, w)
                pixels[(yy - h / 2) ** 2 + (xx - w / 2) ** 2 < r * r] = COLOURS[colour]
                buf = io.BytesIO()
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
                caption = f"a {'large' if big else 'small'} {colour} disc on a grey noisy background"
                sink.write(
                    {
                        "__key__": f"{i:06d}",
                        "jpg": buf.getvalue(),
                        "txt": caption,
                        "json": {"width": w, "height": h, "colour": colour},
                    }
                )
        paths.append(path)
    return paths


def tokenize(batch: dict) -> dict:
    """The toy tokenizer, run in the loader's workers: each word hashed to an id in 1..VOCAB-1, padded
    with 0 (or cut) to LENGTH. batch["caption"] is an object array of str."""
    tokens = np.zeros((len(batch["caption"]), LENGTH), dtype=np.int64)
    for row, caption in enumerate(batch["caption"]):
        ids = [1 + zlib.crc32(word.encode()) % (VOCAB - 1) for word in caption.lower().split()][:LENGTH]
        tokens[row, : len(ids)] = ids
    return {**batch, "tokens": tokens}


class TinyClip(torch.nn.Module):
    """A small conv image tower and a mean-of-embeddings text tower, into one embedding space."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.image = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(32, dim),
        )
        self.text = torch.nn.EmbeddingBag(VOCAB, dim, mode="mean", padding_idx=0)
        self.logit_scale = torch.nn.Parameter(torch.tensor(np.log(1 / 0.07), dtype=torch.float32))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        img = torch.nn.functional.normalize(self.image(images), dim=-1)
        txt = torch.nn.functional.normalize(self.text(tokens), dim=-1)
        return self.logit_scale.exp() * img @ txt.T


def info_nce(logits: torch.Tensor) -> torch.Tensor:
    """The symmetric contrastive loss: sample i's image matches caption i, in both directions."""
    target = torch.arange(len(logits))
    return (
        torch.nn.functional.cross_entropy(logits, target)
        + torch.nn.functional.cross_entropy(logits.T, target)
    ) / 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--per-shard", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, default=64, help="the crop's side")
    args = parser.parse_args()
    torch.manual_seed(0)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory(prefix="raydl-clip-") as tmp:
            shards = write_shards(tmp, args.samples, args.per_shard)
            ds = (
                raydl.read_webdataset(shards, fields={"image": "jpg", "caption": "txt"})
                .decode()
                .random_resized_crop(args.size, scale=(0.5, 1.0))
                .random_hflip()
                .normalize("imagenet")
                .map_batches(tokenize)
            )
            print(ds)
            model = TinyClip()
            opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
            loader = ds.loader(batch_size=args.batch_size, num_workers=1, seed=0)
            try:
                it = loader.iterator(0)
                step, t0 = 0, time.perf_counter()
                while step < args.steps:
                    for batch in it.iter_torch_batches():
                        images, tokens = batch["image"], batch["tokens"]
                        assert images.shape == (len(tokens), 3, args.size, args.size), images.shape
                        assert tokens.shape[1] == LENGTH and len(batch["caption"]) == len(tokens)
                        loss = info_nce(model(images, tokens))
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        step += 1
                        print(
                            f"step {step}: InfoNCE {loss.item():.3f} over {len(tokens)} pairs "
                            f"(chance {np.log(len(tokens)):.3f}), first caption {batch['caption'][0]!r}"
                        )
                        if step == args.steps:
                            break
                print(f"{step} steps in {time.perf_counter() - t0:.1f} s")
            finally:
                loader.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
