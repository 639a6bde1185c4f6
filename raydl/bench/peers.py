"""One function per peer: run one epoch of a workload ("train" or "buckets") and time it.

Each `run_<peer>(spec, clock)` builds its loader from the same image folder, with
the same CPU budget, calls `clock.start()` just before the loader (or dataset)
is constructed, after `ray.init` for the Ray-based peers, so that Ray start-up is
not charged to the first batch, and `clock.batch(images)` for every batch in
hand. The function returns the clock's `Measurement`. Memory and CPU are the
runner's business (`_runner.py`); this module only says what each peer does.
"""

from __future__ import annotations

import io
import json
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from raydl.bench._clip import CLIP_NOTES, CLIP_PEERS
from raydl.bench._clock import EpochClock, Measurement, PeerSpec
from raydl.bench._native_peers import run_dali, run_floor, run_spdl
from raydl.bench._setup import first_batch_phases, ray_init, raydl_epochs, raydl_ray, torch_worker_init
from raydl.bench._tokens import TOKEN_NOTES, TOKEN_PEERS
from raydl.bench._transform import (
    BUCKET_CONFIG,
    CROP,
    bucket_transform,
    list_images,
    open_rgb,
    train_transform,
)
from raydl.bench._windows import WINDOW_NOTES, WINDOW_PEERS
from raydl.options import LoaderConfig

__all__ = [
    "BUCKET_NOTES",
    "MULTI_EPOCH",
    "NOTES",
    "PEERS",
    "REQUIRES",
    "WORKLOADS",
    "WORKLOAD_NOTES",
    "WORKLOAD_REQUIRES",
    "WHY_NOT",
    "peer_function",
]


def raydl_source(spec: PeerSpec):
    """The raydl Dataset the spec names: an image folder, WebDataset shards or Parquet, local or s3://."""
    import raydl

    s3 = raydl.S3Options(endpoint_url=spec.endpoint_url) if spec.data.startswith("s3://") else None
    if spec.source == "webdataset":
        return raydl.read_webdataset(spec.data, s3=s3)
    if spec.source == "parquet":
        return raydl.read_parquet(
            spec.data, image_column=spec.image_column, label_column=spec.label_column, s3=s3
        )
    return raydl.read_images(spec.data, s3=s3)


def run_raydl(spec: PeerSpec, clock: EpochClock, *, fast: bool = False) -> Measurement:
    t_init = time.perf_counter()
    with raydl_ray(spec):
        clock.extra["ray_init_s"] = time.perf_counter() - t_init  # ray.init: a local Ray, or a connection
        clock.start()
        t0 = time.perf_counter()
        ds = raydl_source(spec).decode(fast=fast)
        if spec.workload == "buckets":
            ds = ds.aspect_buckets(**BUCKET_CONFIG)  # reads the image sizes
        else:
            ds = ds.random_resized_crop(CROP).random_hflip().normalize("imagenet")
        t1 = time.perf_counter()
        # On simulated nodes, the default threads: one per CPU of a node, all cores for the first batches.
        loader = ds.loader(
            batch_size=spec.batch_size,
            seed=spec.seed,
            num_workers=1,
            threads_per_worker=spec.cpus if spec.nodes <= 1 else None,
        )
        t2 = time.perf_counter()

        def timed(batch):
            if len(batch["id"]) != batch["image"].shape[0]:
                raise RuntimeError("raydl batch: len(id) != len(image)")
            first_batch_phases(clock, loader, t0, t1, t2)
            return batch["image"]

        return raydl_epochs(loader, spec, clock, timed)


def run_raydl_fast(spec: PeerSpec, clock: EpochClock) -> Measurement:
    return run_raydl(spec, clock, fast=True)


class _FolderDataset:
    """A map-style torch Dataset over the sorted files, decoding with PIL like ImageFolder."""

    def __init__(self, root: str, workload: str = "train"):
        self.paths = list_images(root)
        self.workload = workload
        self._rng: random.Random | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        import torch

        if self.workload == "buckets":
            return bucket_transform(open_rgb(self.paths[index]))
        if self._rng is None:  # one stream per worker, seeded from the worker's torch seed
            info = torch.utils.data.get_worker_info()
            self._rng = random.Random(info.seed if info else 0)
        out = np.empty((3, CROP, CROP), dtype=np.float32)
        train_transform(open_rgb(self.paths[index]), self._rng, out)
        return torch.from_numpy(out)


def run_torch(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import torch

    clock.start()
    buckets = spec.workload == "buckets"
    loader = torch.utils.data.DataLoader(
        _FolderDataset(spec.data, spec.workload),
        batch_size=spec.batch_size,
        shuffle=True,
        num_workers=spec.cpus,
        worker_init_fn=torch_worker_init,
        generator=torch.Generator().manual_seed(spec.seed),
        collate_fn=_bucket_collate if buckets else None,
    )
    for _epoch in range(spec.epochs):  # each epoch starts its worker processes again (torch's default)
        for images in loader:
            if buckets:
                for batch in images:
                    clock.batch(batch)
            else:
                clock.batch(images)
    return clock.result()


def _bucket_collate(samples: list[np.ndarray]) -> list[np.ndarray]:
    """Images of different buckets cannot stack: one stacked array per bucket present."""
    by_shape: dict[tuple, list[np.ndarray]] = {}
    for s in samples:
        by_shape.setdefault(s.shape, []).append(s)
    return [np.stack(group) for group in by_shape.values()]


def _raydata_transform(batch: dict) -> dict:
    rng = random.Random()
    out = np.empty((len(batch["bytes"]), 3, CROP, CROP), dtype=np.float32)
    for i, data in enumerate(batch["bytes"]):
        train_transform(open_rgb(io.BytesIO(data)), rng, out[i])
    return {"image": out}


def run_raydata(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import ray
    import ray.data

    ray_init(spec.cpus)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        clock.start()
        ds = ray.data.read_binary_files(
            spec.data,
            include_paths=True,
            shuffle="files",
            file_extensions=["jpg", "jpeg", "png", "webp", "bmp"],  # not labels.csv
        ).map_batches(_raydata_transform, batch_format="numpy")
        for _epoch in range(spec.epochs):  # each epoch runs the pipeline again
            for batch in ds.iter_batches(batch_size=spec.batch_size, batch_format="numpy"):
                clock.batch(batch["image"])
        return clock.result()
    finally:
        ray.shutdown()


def run_dataio(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import dataio  # pool sizes come from DATAIO_CPU_WORKERS, set by the runner before import

    clock.start()
    records = [{"key": path, "image": path} for path in list_images(spec.data)]
    pipe = dataio.pipeline(
        dataio.slot("image")
        .decode_image(mode="rgb")
        .random_resized_crop(h=CROP, w=CROP, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interp="bilinear")
        .hflip(prob=0.5)
        .normalize("imagenet"),
        # raydl's prefetch depth (LoaderConfig.prefetch_batches): dataio's own default (4) holds
        # twice the batches, which its peak memory would show rather than the loader's design.
        dataio.batch(spec.batch_size, drop_last=False, prefetch=LoaderConfig.prefetch_batches),
    )
    bound = pipe.bind(dataio.records(records).shuffle(seed=spec.seed))
    for epoch in range(spec.epochs):
        with bound.run("numpy", seed=spec.seed + epoch) as loader:
            for batch in loader:
                clock.batch(batch["image"])
    return clock.result()


def _datago_transform(sample, rng: random.Random, out: np.ndarray) -> None:
    img = sample.image.to_pil_image()
    if img.mode != "RGB":  # datago keeps greyscale JPEGs as "L"
        img = img.convert("RGB")
    train_transform(img, rng, out)


def _datago_buckets(client, spec: PeerSpec, clock: EpochClock) -> Measurement:
    """datago crops and resizes into its buckets itself; we group its samples into bucket-pure batches."""
    pending: dict[tuple, list[np.ndarray]] = {}
    try:
        while (s := client.get_sample()) is not None:
            img = s.image.to_numpy_array()
            group = pending.setdefault(img.shape, [])
            group.append(img)
            if len(group) == spec.batch_size:
                clock.batch(np.stack(group))
                group.clear()
        for group in pending.values():
            if group:
                clock.batch(np.stack(group))
        return clock.result()
    finally:
        client.stop()


def run_datago(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import datago  # decode threads come from DATAGO_MAX_TASKS, set by the runner

    clock.start()
    config = {
        "source_type": "file",
        "source_config": {"root_path": spec.data, "random_sampling": True, "rank": 0, "world_size": 1},
        "limit": spec.expected,
        "samples_buffer_size": 2 * spec.batch_size,
    }
    if spec.workload == "buckets":
        config["image_config"] = {
            "crop_and_resize": True,
            "default_image_size": BUCKET_CONFIG["size"],
            "downsampling_ratio": BUCKET_CONFIG["multiple"],
            "min_aspect_ratio": BUCKET_CONFIG["min_ratio"],
            "max_aspect_ratio": BUCKET_CONFIG["max_ratio"],
        }
        return _datago_buckets(datago.DatagoClient(json.dumps(config)), spec, clock)
    client = datago.DatagoClient(json.dumps(config))
    rng = random.Random(spec.seed)
    # datago decodes in Rust threads but has no random-resized-crop, so the crop,
    # flip and normalise run on a thread pool (PIL's resize releases the GIL).
    # Each sample is submitted as it arrives and a batch is handed over as soon as
    # its last sample is done, so decode, transform and hand-over overlap.
    pool = ThreadPoolExecutor(spec.cpus)
    pending: deque[tuple[np.ndarray, list]] = deque()

    def hand_over() -> None:
        out, futures = pending.popleft()
        for future in futures:
            future.result()
        clock.batch(out)

    try:
        while True:
            out = np.empty((spec.batch_size, 3, CROP, CROP), dtype=np.float32)
            futures: list = []
            while len(futures) < spec.batch_size and (s := client.get_sample()) is not None:
                futures.append(pool.submit(_datago_transform, s, rng, out[len(futures)]))
                if pending and pending[0][1][-1].done():
                    hand_over()
            if not futures:
                break
            pending.append((out[: len(futures)], futures))
        while pending:
            hand_over()
        return clock.result()
    finally:
        pool.shutdown(cancel_futures=True)
        client.stop()


def run_ceiling(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import simplejpeg

    def decode(data: bytes):
        if data[:2] == b"\xff\xd8":
            return simplejpeg.decode_jpeg(data, colorspace="RGB")
        return np.asarray(open_rgb(io.BytesIO(data)))

    # Bytes are read before the clock starts: the ceiling is decode alone.
    blobs = []
    for path in list_images(spec.data):
        with open(path, "rb") as f:
            blobs.append(f.read())
    clock.start()
    with ThreadPoolExecutor(spec.cpus) as pool:  # simplejpeg releases the GIL
        for _epoch in range(spec.epochs):
            for i in range(0, len(blobs), spec.batch_size):
                decoded = list(pool.map(decode, blobs[i : i + spec.batch_size]))
                clock.batch(np.empty((len(decoded), 0), dtype=np.uint8))  # only the count matters
    return clock.result()


PEERS: dict[str, Callable[[PeerSpec, EpochClock], Measurement]] = {
    "raydl": run_raydl,
    "raydl-base": run_raydl,
    "raydl-fast": run_raydl_fast,
    "torch": run_torch,
    "raydata": run_raydata,
    "dataio": run_dataio,
    "datago": run_datago,
    "dali": run_dali,
    "spdl": run_spdl,
    "ceiling": run_ceiling,
    "floor": run_floor,
}

# The workloads whose data is not an image folder, and whose peers are their own functions
# (_clip.py: WebDataset shards with captions; _tokens.py: Parquet token sequences).
_WORKLOAD_PEERS: dict[str, dict[str, Callable[[PeerSpec, EpochClock], Measurement]]] = {
    "clip": CLIP_PEERS,
    "tokens": TOKEN_PEERS,
    "windows": WINDOW_PEERS,  # the tokens workload's second table: windows of a Megatron corpus
}


def peer_function(peer: str, workload: str) -> Callable[[PeerSpec, EpochClock], Measurement]:
    """The function that runs `peer` on `workload` (a KeyError when it has none)."""
    return _WORKLOAD_PEERS.get(workload, PEERS)[peer]


# The peers that run `--epochs N` epochs of one loader; the others run one and have no later-epoch figures.
MULTI_EPOCH = frozenset(
    {
        "raydl",
        "raydl-base",
        "raydl-fast",
        "raydl-image",
        "raydl-ordered",
        "torch",
        "raydata",
        "dataio",
        "ceiling",
        "floor",
        "megatron",
    }
)

# The workloads each peer can run (the others are skipped with a note).
WORKLOADS: dict[str, tuple[str, ...]] = {
    "raydl": ("train", "buckets", "clip", "tokens", "windows"),
    "raydl-base": ("train", "buckets"),
    "raydl-fast": ("train", "buckets"),
    "raydl-image": ("clip",),
    "raydl-ordered": ("tokens",),
    "torch": ("train", "buckets", "clip", "tokens", "windows"),
    "raydata": ("train", "clip", "tokens", "windows"),
    "megatron": ("windows",),
    "dataio": ("train", "clip"),
    "datago": ("train", "buckets"),
    "dali": ("train", "buckets"),
    "spdl": ("train", "buckets"),
    "ceiling": ("train", "buckets", "tokens", "windows"),
    "floor": ("train", "windows"),
}

# Why a peer cannot run a workload, where there is more to say than that it has none.
WHY_NOT: dict[tuple[str, str], str] = {
    (
        "datago",
        "clip",
    ): "datago's webdataset source fetches http(s) URLs only (a local shard or a file:// URL "
    "fails with 'builder error for url'), and its file source reads image folders, not tar shards",
    ("datago", "tokens"): "datago reads images only",
    ("dataio", "tokens"): "not written yet (dataio.scan_parquet could read the files)",
    ("dataio", "windows"): "dataio reads no Megatron corpus",
    ("datago", "windows"): "datago reads images only",
    ("megatron", "tokens"): "megatron-core's IndexedDataset reads Megatron corpora, not Parquet (it is in "
    "the windows table)",
}

# Modules a peer needs, and what to install when one is missing.
REQUIRES: dict[str, tuple[tuple[str, ...], str]] = {
    "raydl": (("ray",), "pip install raydl-loader"),
    "raydl-base": (("ray",), "pip install raydl-loader"),
    "raydl-fast": (("ray",), "pip install raydl-loader"),
    "raydl-image": (("ray",), "pip install raydl-loader"),
    "raydl-ordered": (("ray",), "pip install raydl-loader"),
    "dali": (("nvidia.dali",), "pip install 'raydl-loader[bench]'  (or: pip install nvidia-dali-cuda120)"),
    "spdl": (
        ("spdl.io",),
        "pip install 'raydl-loader[bench]'  (or: pip install spdl), and FFmpeg 5's shared "
        "libraries (Debian 12: apt-get install libavutil57 libavcodec59 libavformat59 "
        "libavfilter8 libavdevice59 libswscale6 libswresample4)",
    ),
    "floor": (("simplejpeg",), "pip install simplejpeg"),
    "torch": (("torch",), "pip install torch"),
    "raydata": (("ray", "pandas"), "pip install 'ray[data]'"),
    "dataio": (("dataio",), "pip install 'raydl-loader[bench]'  (or: pip install dataio-rs)"),
    "datago": (("datago",), "pip install 'raydl-loader[bench]'  (or: pip install datago)"),
    "ceiling": (("simplejpeg",), "pip install simplejpeg"),
    "megatron": (("megatron.core", "torch"), "pip install megatron-core torch"),
}

# Where a workload's peer needs other modules than REQUIRES says.
WORKLOAD_REQUIRES: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "clip": {"torch": (("torch", "webdataset"), "pip install torch webdataset")},
    "tokens": {"ceiling": (("pyarrow",), "pip install pyarrow")},
    "windows": {
        "ceiling": (("numpy",), "pip install numpy"),
        "floor": (("ray", "torch"), "pip install ray torch"),
    },
}

# What each peer does differently from the workload; printed under the table.
NOTES: dict[str, str] = {
    "torch": "torch: DataLoader(shuffle=True, num_workers=cpus) + PIL full decode; crop/flip/"
    "normalize in PIL+numpy (torchvision's RandomResizedCrop params); the main "
    "process is one more process on top of the cpus workers.",
    "raydata": "raydata: read_binary_files(shuffle='files') + map_batches (PIL decode, same "
    "PIL+numpy transform, one block per task) + iter_batches re-batching to B.",
    "dataio": "dataio: native decode + random_resized_crop(interp='bilinear') + hflip + "
    "normalize('imagenet'), its own RNG; DATAIO_CPU_WORKERS=cpus; prefetch 2 batches "
    "(raydl's prefetch_batches; dataio's default is 4).",
    "datago": "datago: decodes in Rust (DATAGO_MAX_TASKS=cpus) but has no random-resized-crop "
    "(only aspect-bucket crop+resize), so crop/flip/normalize run in a Python "
    "thread pool of cpus threads with the PIL+numpy transform; shuffle is datago's "
    "random_sampling (unseeded).",
    "ceiling": "ceiling: libjpeg-turbo (simplejpeg) decode alone of bytes already in memory, "
    "one thread per CPU; no crop, no batch; its memory includes all file bytes.",
    "raydl-fast": "raydl-fast: raydl with decode(fast=True): DCT scale down to 1x the output, IFAST IDCT, "
    "no fancy upsampling (changes pixels; see the README).",
    "dali": "dali: NVIDIA DALI's CPU pipeline (device_id=None, num_threads=cpus): readers.file shuffled, "
    "decoders.image_random_crop + resize(antialias) + crop_mirror_normalize; buckets: "
    "decoders.image_slice to the bucket crop + resize, sizes from PIL headers.",
    "spdl": "spdl: spdl.io.load_image (FFmpeg) with a crop+scale(bilinear) filter per sample on a thread "
    "pool of cpus threads; flip and normalize in numpy.",
    "floor": "floor: the entropy-decoding floor of the train crops: raydl's region decoder at DCT scale 1/8 "
    "(IFAST) on raydl's own boxes, into an 8x8 slot, bytes in memory; no batch.",
}

# The notes of the workloads with their own peers (what each does there), printed instead of NOTES.
WORKLOAD_NOTES: dict[str, dict[str, str]] = {
    "clip": CLIP_NOTES,
    "tokens": TOKEN_NOTES,
    "windows": WINDOW_NOTES,
}

# The same for the "buckets" workload, where it differs.
BUCKET_NOTES: dict[str, str] = {
    "raydl": "raydl: read_images().decode().aspect_buckets(512, multiple=32, min_ratio=0.5, max_ratio=2.0): "
    "bucket-pure uint8 NHWC batches (a bucket's last batch is shorter).",
    "torch": "torch: DataLoader(shuffle=True, num_workers=cpus), PIL full decode, centred crop to the "
    "nearest bucket's ratio + bilinear resize; each batch is split by bucket.",
    "datago": "datago: its own crop_and_resize image config (default_image_size 512, downsampling_ratio 32, "
    "aspect ratios 0.5-2.0: the same bucket set), Lanczos3 resize in Rust; samples grouped into "
    "bucket-pure batches in Python; shuffle is datago's random_sampling (unseeded).",
    "spdl": "spdl: spdl.io.load_image (FFmpeg) with a crop to the bucket's ratio + scale(bilinear) filter "
    "per sample on a thread pool of cpus threads; each batch split by bucket.",
    "ceiling": "ceiling: libjpeg-turbo (simplejpeg) full decode alone of bytes already in memory, one thread "
    "per CPU; no crop, no resize, no batch.",
}
