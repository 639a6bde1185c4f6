"""The "clip" workload: LAION-style WebDataset shards (.jpg, .txt caption, .json metadata) and its peers.

    python -m raydl.bench.shards IMAGE_DIR OUT_DIR --clip [--per-shard 256]   # OUT_DIR/clip/shard-*.tar
    raydl bench loader --workload clip --data OUT_DIR/clip --compare torch,raydata,dataio

The shards are written by the `webdataset` library's own `TarWriter`, as a
LAION-style dataset is: per sample a `.jpg` (the folder's image, in sorted
order), a `.txt` caption of 50-200 characters and a `.json` of about 300 bytes,
both drawn from the seed and the sample's index (the same every time).

Every peer runs the "train" image pipeline (decode, RandomResizedCrop 224, flip,
ImageNet normalize, float32 NCHW) and hands over the captions as a list of `str`
beside each batch; the metadata is parsed into dicts. "raydl-image" is raydl on
the same shards with the image alone, so that what the caption and metadata
cost raydl shows as a ratio of one run.
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

import numpy as np

from raydl.bench._clock import EpochClock, Measurement, PeerSpec
from raydl.bench._setup import ray_init, raydl_epochs, raydl_ray, torch_worker_init
from raydl.bench._transform import CROP, data_files, open_rgb, train_transform

__all__ = [
    "CLIP_FIELDS",
    "CLIP_NOTES",
    "CLIP_PEERS",
    "caption",
    "clip_shards",
    "metadata",
    "write_clip_shards",
]

#: raydl's field selection for the clip shards (the image-only row keeps "image" alone).
CLIP_FIELDS = {"image": "jpg", "caption": "txt", "meta": "json"}

_WORDS = (
    "a photo of the small red dog sitting on a wooden bench in the park near old city wall with "
    "green trees blue sky under bright morning light two people walking along river bank beside "
    "tall building at sunset close view painting portrait of young woman wearing hat vintage car "
    "parked street market fresh fruit table kitchen cat sleeping sofa mountain lake snow forest"
).split()


def caption(seed: int, index: int) -> str:
    """A caption of 50-200 characters, the same for the same (seed, index)."""
    rng = random.Random(seed * 1_000_003 + index)
    target = rng.randint(50, 200)
    words: list[str] = []
    while len(" ".join(words)) < target:
        words.append(rng.choice(_WORDS))
    return " ".join(words)[:target].rstrip() or "a photo"


def metadata(seed: int, index: int, key: str, width: int, height: int) -> dict:
    """About 300 bytes of LAION-like metadata (url, size, similarity, hash...) for one sample."""
    rng = random.Random(seed * 2_000_003 + index)
    digest = "%064x" % rng.getrandbits(256)
    return {
        "key": key,
        "url": f"https://images.example.com/{digest[:2]}/{digest[2:18]}.jpg",
        "width": width,
        "height": height,
        "original_width": width * rng.randint(1, 4),
        "original_height": height * rng.randint(1, 4),
        "similarity": round(rng.uniform(0.28, 0.42), 6),
        "punsafe": round(rng.uniform(0.0, 0.1), 6),
        "pwatermark": round(rng.uniform(0.0, 0.9), 6),
        "aesthetic": round(rng.uniform(4.0, 7.5), 6),
        "license": rng.choice(["?", "cc-by", "cc-by-sa", "cc0"]),
        "language": "en",
        "sha256": digest,
    }


def write_clip_shards(folder: str, out: str, *, per_shard: int = 256, seed: int = 0) -> list[str]:
    """The image folder's JPEGs as clip shards written with webdataset.TarWriter; returns their paths.

    Sample i (in the folder's sorted order) has key "%08d" % i and members jpg, txt, json."""
    import webdataset as wds
    from PIL import Image

    from raydl.bench._transform import list_images

    images = list_images(folder)
    if not images:
        raise ValueError(f"no images under {folder}")
    if per_shard < 1:
        raise ValueError(f"per_shard must be positive, got {per_shard}")
    Path(out).mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, len(images), per_shard):
        path = os.path.join(out, f"shard-{s // per_shard:06d}.tar")
        with wds.TarWriter(path, mtime=0) as sink:  # a fixed mtime: the same bytes on every write
            for i in range(s, min(s + per_shard, len(images))):
                data = Path(images[i]).read_bytes()
                with Image.open(io.BytesIO(data)) as img:  # the header only
                    width, height = img.size
                key = f"{i:08d}"
                sink.write(
                    {
                        "__key__": key,
                        "jpg": data,
                        "txt": caption(seed, i),
                        "json": metadata(seed, i, key, width, height),
                    }
                )
        paths.append(path)
    return paths


def clip_shards(data: str) -> list[str]:
    """The shards a clip --data names: a folder (its *.tar, sorted) or one glob pattern."""
    return data_files(data, ".tar")


def clip_count(data: str) -> int:
    """Samples in the clip shards (one .jpg each), read from the tar headers."""
    import tarfile

    n = 0
    for path in clip_shards(data):
        with tarfile.open(path) as tar:
            n += sum(1 for m in tar if m.name.endswith(".jpg"))
    return n


def _check_captions(captions, n: int) -> None:
    if len(captions) != n or not all(isinstance(c, str) for c in captions):
        raise RuntimeError(f"captions are not {n} str: {type(captions).__name__} of {len(captions)}")


def run_raydl_clip(spec: PeerSpec, clock: EpochClock, *, image_only: bool = False) -> Measurement:
    import raydl

    fields = {"image": CLIP_FIELDS["image"]} if image_only else CLIP_FIELDS
    with raydl_ray(spec):
        clock.start()
        ds = (
            raydl.read_webdataset(clip_shards(spec.data), fields=fields)
            .decode()
            .random_resized_crop(CROP)
            .random_hflip()
            .normalize("imagenet")
        )
        loader = ds.loader(
            batch_size=spec.batch_size, seed=spec.seed, num_workers=1, threads_per_worker=spec.cpus
        )

        def timed(batch):
            if not image_only:
                _check_captions(batch["caption"], batch["image"].shape[0])
            return batch["image"]

        return raydl_epochs(loader, spec, clock, timed)


def run_raydl_clip_image(spec: PeerSpec, clock: EpochClock) -> Measurement:
    return run_raydl_clip(spec, clock, image_only=True)


class _WdsTransform:
    """webdataset sample -> (image tensor, caption, metadata); one RNG per DataLoader worker."""

    def __init__(self) -> None:
        self._rng: random.Random | None = None

    def __call__(self, sample: dict):
        import torch

        if self._rng is None:
            info = torch.utils.data.get_worker_info()
            self._rng = random.Random(info.seed if info else 0)
        out = np.empty((3, CROP, CROP), dtype=np.float32)
        train_transform(open_rgb(io.BytesIO(sample["jpg"])), self._rng, out)
        return torch.from_numpy(out), sample["txt"].decode("utf-8"), json.loads(sample["json"])


def _collate(samples: list) -> tuple:
    import torch

    images, captions, metas = zip(*samples, strict=True)
    return torch.stack(images), list(captions), list(metas)


def run_wds_torch(spec: PeerSpec, clock: EpochClock) -> Measurement:
    """webdataset.WebDataset (shards split over the workers, shuffled) + DataLoader(num_workers=cpus)."""
    import torch
    import webdataset as wds

    shards = clip_shards(spec.data)
    clock.start()
    ds = (
        wds.WebDataset(shards, shardshuffle=len(shards), seed=spec.seed, empty_check=False)
        .shuffle(1000)
        .map(_WdsTransform())
        .batched(spec.batch_size, collation_fn=_collate, partial=True)
    )
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=spec.cpus, worker_init_fn=torch_worker_init
    )
    for _epoch in range(spec.epochs):
        for images, captions, _metas in loader:
            _check_captions(captions, images.shape[0])
            clock.batch(images)
    return clock.result()


def _raydata_decoder(sample: dict) -> dict:
    """Ray's read_webdataset decoder: caption and metadata parsed, the image left as bytes for map_batches."""
    return {**sample, "txt": sample["txt"].decode("utf-8"), "json": json.loads(sample["json"])}


def _raydata_clip_transform(batch: dict) -> dict:
    rng = random.Random()
    out = np.empty((len(batch["jpg"]), 3, CROP, CROP), dtype=np.float32)
    for i, data in enumerate(batch["jpg"]):
        train_transform(open_rgb(io.BytesIO(data)), rng, out[i])
    return {"image": out, "caption": batch["txt"], "meta": batch["json"]}


def run_raydata_clip(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import ray
    import ray.data

    ray_init(spec.cpus)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        clock.start()
        ds = ray.data.read_webdataset(
            clip_shards(spec.data), decoder=_raydata_decoder, shuffle="files"
        ).map_batches(_raydata_clip_transform, batch_format="numpy")
        for _epoch in range(spec.epochs):  # each epoch runs the pipeline again
            for batch in ds.iter_batches(batch_size=spec.batch_size, batch_format="numpy"):
                _check_captions(list(batch["caption"]), batch["image"].shape[0])
                clock.batch(batch["image"])
        return clock.result()
    finally:
        ray.shutdown()


def run_dataio_clip(spec: PeerSpec, clock: EpochClock) -> Measurement:
    """dataio.webdataset: its native image ops on the jpg slot, its text and JSON decoders on the rest."""
    import dataio

    from raydl.options import LoaderConfig

    clock.start()
    pipe = dataio.pipeline(
        dataio.slot("jpg")
        .decode_image(mode="rgb")
        .random_resized_crop(h=CROP, w=CROP, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interp="bilinear")
        .hflip(prob=0.5)
        .normalize("imagenet"),
        dataio.slot("txt").decode_text(),
        dataio.slot("json").decode_json(),
        dataio.batch(spec.batch_size, drop_last=False, prefetch=LoaderConfig.prefetch_batches),
    )
    bound = pipe.bind(dataio.webdataset(clip_shards(spec.data)).shuffle(seed=spec.seed))
    for epoch in range(spec.epochs):
        with bound.run("numpy", seed=spec.seed + epoch) as loader:
            for batch in loader:
                captions = batch["txt"]
                if not isinstance(captions, list) or not all(isinstance(c, str) for c in captions):
                    captions = [bytes(c).decode("utf-8") for c in captions]
                _check_captions(captions, batch["jpg"].shape[0])
                clock.batch(batch["jpg"])
    return clock.result()


CLIP_PEERS = {
    "raydl": run_raydl_clip,
    "raydl-image": run_raydl_clip_image,
    "torch": run_wds_torch,
    "raydata": run_raydata_clip,
    "dataio": run_dataio_clip,
}

CLIP_NOTES = {
    "raydl": "raydl: read_webdataset(fields={'image': 'jpg', 'caption': 'txt', 'meta': 'json'}).decode()"
    ".random_resized_crop(224).random_hflip().normalize(): captions as str, metadata as dicts.",
    "raydl-image": "raydl-image: the same on the same shards with fields={'image': 'jpg'} (no caption, no "
    "metadata): what carrying them costs is raydl's images/s against this row's.",
    "torch": "torch: webdataset.WebDataset(shardshuffle, shuffle(1000)) + map(PIL decode, the PIL+numpy "
    "crop/flip/normalize, caption str, json.loads) + batched() in DataLoader(num_workers=cpus, "
    "batch_size=None); shards are split over the workers.",
    "raydata": "raydata: ray.data.read_webdataset(decoder: txt -> str, json -> dict, jpg kept as bytes, "
    "shuffle='files') + map_batches (PIL decode, the same PIL+numpy transform) + iter_batches.",
    "dataio": "dataio: dataio.webdataset(shards).shuffle(seed) with its native decode + "
    "random_resized_crop(bilinear) + hflip + normalize('imagenet') on the jpg slot, decode_text on txt, "
    "decode_json on json; DATAIO_CPU_WORKERS=cpus.",
}
