"""Peers built on native pipelines: NVIDIA DALI's CPU pipeline, SPDL (FFmpeg), and the entropy floor.

Each follows peers.py's contract: build from the same folder with the same CPU
budget, `clock.start()` just before the pipeline is built, `clock.batch(...)`
for each batch in hand.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from raydl.bench._clock import EpochClock, Measurement, PeerSpec, stand_in
from raydl.bench._transform import CROP, RATIO, SCALE, bucket_box, list_images, rrc_params

__all__ = ["run_dali", "run_floor", "run_spdl"]

_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
_MUL = (1.0 / (255.0 * _STD)).reshape(3, 1, 1)
_SUB = (_MEAN / _STD).reshape(3, 1, 1)


def _sizes(paths: list[str]) -> list[tuple[int, int]]:
    """(width, height) of every file from its header (PIL reads no pixels for this)."""
    out = []
    for path in paths:
        with Image.open(path) as im:
            out.append(im.size)
    return out


# ----------------------------------------------------------------------------------------- DALI ----


def run_dali(spec: PeerSpec, clock: EpochClock) -> Measurement:
    from nvidia.dali import fn, pipeline_def, types

    paths = list_images(spec.data)
    clock.start()
    if spec.workload == "buckets":
        return _dali_buckets(spec, clock, paths)

    @pipeline_def(batch_size=spec.batch_size, num_threads=spec.cpus, device_id=None, seed=spec.seed + 1)
    def train():
        jpegs, _labels = fn.readers.file(files=paths, random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=list(SCALE),
            random_aspect_ratio=list(RATIO),
            num_attempts=10,
        )
        images = fn.resize(
            images, resize_x=CROP, resize_y=CROP, interp_type=types.INTERP_LINEAR, antialias=True
        )
        return fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=list(255 * _MEAN),
            std=list(255 * _STD),
            mirror=fn.random.coin_flip(probability=0.5),
        )

    pipe = train()
    pipe.build()
    left = len(paths)
    while left > 0:  # DALI's reader fills the last batch from the next epoch: count only this epoch's
        (images,) = pipe.run()
        n = min(left, spec.batch_size)
        clock.batch(images.as_array()[:n])
        left -= n
    return clock.result()


def _dali_buckets(spec: PeerSpec, clock: EpochClock, paths: list[str]) -> Measurement:
    from nvidia.dali import fn, pipeline_def, types

    sizes = _sizes(paths)
    order = list(range(len(paths)))
    random.Random(spec.seed).shuffle(order)
    batches = [order[i : i + spec.batch_size] for i in range(0, len(order), spec.batch_size)]

    def source(info):
        """Encoded bytes, crop anchor and shape (x, y), output size (h, w) of each sample of the batch."""
        if info.iteration >= len(batches):
            raise StopIteration
        data, anchor, shape, size = [], [], [], []
        for i in batches[info.iteration]:
            with open(paths[i], "rb") as f:
                data.append(np.frombuffer(f.read(), np.uint8))
            (bh, bw), (x0, y0, x1, y1) = bucket_box(*sizes[i])
            anchor.append(np.array([x0, y0], np.float32))
            shape.append(np.array([x1 - x0, y1 - y0], np.float32))
            size.append(np.array([bh, bw], np.float32))
        return data, anchor, shape, size

    @pipeline_def(batch_size=spec.batch_size, num_threads=spec.cpus, device_id=None, seed=spec.seed + 1)
    def buckets():
        jpegs, anchor, shape, size = fn.external_source(
            source=source, num_outputs=4, batch=True, batch_info=True
        )
        images = fn.decoders.image_slice(
            jpegs,
            anchor,
            shape,
            axis_names="WH",
            normalized_anchor=False,
            normalized_shape=False,
            device="cpu",
            output_type=types.RGB,
        )
        return fn.resize(images, size=size, interp_type=types.INTERP_LINEAR, antialias=True)

    pipe = buckets()
    pipe.build()
    for _ in batches:
        (images,) = pipe.run()
        shapes = [tuple(images[i].shape()) for i in range(len(images))]
        clock.batch(stand_in(len(shapes), shapes[0]))
    return clock.result()


# ----------------------------------------------------------------------------------------- SPDL ----


def _spdl_load(path: str, filter_desc: str) -> np.ndarray:
    import spdl.io

    return spdl.io.to_numpy(spdl.io.load_image(path, filter_desc=filter_desc))


def run_spdl(spec: PeerSpec, clock: EpochClock) -> Measurement:
    import spdl.io  # noqa: F401 - fail early (and in the row) when FFmpeg's libraries are missing

    paths = list_images(spec.data)
    clock.start()
    order = list(range(len(paths)))
    rng = random.Random(spec.seed)
    rng.shuffle(order)
    sizes = _sizes(paths)

    def train_one(i: int, seed: int, out: np.ndarray) -> None:
        r = random.Random(seed)
        top, left, h, w = rrc_params(*sizes[i], r)
        hwc = _spdl_load(
            paths[i],
            f"crop={w}:{h}:{left}:{top}:exact=1,scale={CROP}:{CROP}:flags=bilinear,format=pix_fmts=rgb24",
        )
        hwc = hwc.reshape(CROP, CROP, 3)
        if r.random() < 0.5:
            hwc = hwc[:, ::-1]
        np.multiply(hwc.transpose(2, 0, 1), _MUL, out=out)
        out -= _SUB

    def bucket_one(i: int) -> np.ndarray:
        (bh, bw), (x0, y0, x1, y1) = bucket_box(*sizes[i])
        hwc = _spdl_load(
            paths[i],
            f"crop={x1 - x0}:{y1 - y0}:{x0}:{y0}:exact=1,scale={bw}:{bh}:flags=bilinear,"
            "format=pix_fmts=rgb24",
        )
        return hwc.reshape(bh, bw, 3)

    with ThreadPoolExecutor(spec.cpus) as pool:  # SPDL's decode releases the GIL
        for start in range(0, len(order), spec.batch_size):
            chunk = order[start : start + spec.batch_size]
            if spec.workload == "buckets":
                images = list(pool.map(bucket_one, chunk))
                by_shape: dict[tuple, list[np.ndarray]] = {}
                for img in images:
                    by_shape.setdefault(img.shape, []).append(img)
                for group in by_shape.values():
                    clock.batch(np.stack(group))
            else:
                out = np.empty((len(chunk), 3, CROP, CROP), np.float32)
                seeds = [rng.getrandbits(64) for _ in chunk]
                list(pool.map(train_one, chunk, seeds, out))
                clock.batch(out)
    return clock.result()


# ---------------------------------------------------------------------------------------- floor ----


def run_floor(spec: PeerSpec, clock: EpochClock) -> Measurement:
    """Entropy decoding of the rows each train crop spans: the part no decoder can skip.

    raydl's region decoder at DCT scale 1/8 (an IDCT of the DC term only) with
    the IFAST path, on the boxes raydl's own train program draws, into an 8x8
    slot: what remains is Huffman decoding up to the crop's last row.
    """
    from raydl import native
    from raydl.describe.transforms import Decode, RandomHFlip, RandomResizedCrop, compile_stages
    from raydl.native import decode

    if not native.jpeg_available():
        raise RuntimeError("the floor needs raydl's region JPEG decoder (raydl.native._jpeg)")
    program = compile_stages((Decode(), RandomResizedCrop(CROP), RandomHFlip()))
    blobs = []
    for path in list_images(spec.data):
        with open(path, "rb") as f:
            blobs.append(f.read())
    clock.start()
    local = threading.local()

    def one(k: int) -> None:
        data = blobs[k]
        if not decode.is_jpeg(data):
            return
        out = getattr(local, "out", None)
        if out is None:
            out = local.out = np.empty((8, 8, 3), np.uint8)
        h, w = decode.image_size(data)
        box, _ = program.geometry(h, w, k)
        native.jpeg_crop_resize_into(data, box, out, flip=False, scale_denom=8, fast=True)

    with ThreadPoolExecutor(spec.cpus) as pool:
        for _epoch in range(spec.epochs):
            for start in range(0, len(blobs), spec.batch_size):
                n = len(list(pool.map(one, range(start, min(start + spec.batch_size, len(blobs))))))
                clock.batch(stand_in(n, (0,)))
    return clock.result()
