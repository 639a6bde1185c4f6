"""Every stage's output against the Pillow reference (torchvision semantics), default and fast modes.

The default must stay within a mean of 1.0 grey level of the reference on every
image and 0.5 averaged over the set; decode(fast=True) trades that for speed
and is held only to a loose bound (and must really change something).
"""
from __future__ import annotations

import functools
import importlib.util
import io
import random

import numpy as np
import pytest
from PIL import Image
from test_transforms import PHOTOS, smooth_image

from raydl.describe.transforms import (
    AspectBuckets,
    CenterCrop,
    Decode,
    RandomHFlip,
    RandomResizedCrop,
    Resize,
    compile_stages,
)

from pillow_reference import reference

pytestmark = pytest.mark.timeout(120)

PIPELINES = {
    "resize-center_crop": (Resize(256), CenterCrop(224)),
    "random_resized_crop-hflip": (RandomResizedCrop(224), RandomHFlip()),
    "resize_hw": (Resize((224, 320)),),
    "center_crop": (CenterCrop(300),),
    "aspect_buckets": (AspectBuckets(512),),
    "aspect_buckets-random-hflip": (AspectBuckets(256, crop="random"), RandomHFlip()),
    "resize_small": (Resize((64, 64)),),  # a box >= 12x the output on the larger images: DCT-scaled by 2
}
# Images of make_images.py's hires set (seed 0) on which the old 4x rule broke the bound once the
# output was small (1.3-2.9 grey levels in aspect_buckets(256) or resize_small), and on which the
# 12x rule scales (332: 0.33, 313: 0.69 in resize_small).
HIRES_HARD = (313, 332, 386)
SEEDS = (0, 1)  # for the stages that draw; the others are the same for every seed


def _jpeg(img: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _hires() -> dict[str, bytes]:
    """Generated high-resolution JPEGs (2-12 MP: landscape, portrait, square; the largest get DCT-scaled)."""
    sizes = ((1600, 2400), (2304, 1536), (2400, 3200))
    return {f"gen-{h}x{w}": _jpeg(smooth_image(h, w, seed=h)) for h, w in sizes}


@functools.lru_cache(maxsize=1)
def _shared_images() -> dict[str, bytes] | None:
    if not PHOTOS.is_dir() or not sorted(PHOTOS.glob("*.jpg")):
        return None
    return _make_shared_images()


def _photos() -> dict[str, bytes]:
    images = _shared_images()
    if images is None:
        pytest.skip(f"real photos not found at {PHOTOS} (the shared/ folder beside the checkout)")
    return images


class _Proxy:
    """Stands in for a source photo in make_one: the same random draws, no pixels touched."""

    def __init__(self, size):
        self.size = size

    def resize(self, *args, **kwargs):
        return self

    transpose = convert = resize

    def save(self, *args, **kwargs):
        pass


def _make_shared_images() -> dict[str, bytes]:
    """The shared photos, and images of make_images.py's 1-4 MP "hires" set (seed 0), made from them:
    the first six and HIRES_HARD (the draws before those are replayed without making the images)."""
    images = {p.name: p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))}
    tool = PHOTOS.parents[1] / "tools" / "make_images.py"
    if tool.is_file():  # the same bytes as `make_images.py DIR --profile hires`: a few defeat a 2x or 4x DCT rule
        spec = importlib.util.spec_from_file_location("make_images", tool)
        make = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(make)
        rng = random.Random(0)
        sources = [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg"))]
        proxies = [_Proxy(im.size) for im in sources]
        for i in range(max(HIRES_HARD) + 1):
            if i < 6 or i in HIRES_HARD:
                images[f"hires-{i:07d}.jpg"] = make.make_one(rng, sources, "hires")
            else:
                make.make_one(rng, proxies, "hires")
    return images


def _mean_diffs(images: dict[str, bytes], stages, fast: bool) -> dict[str, float]:
    """Mean |raydl - reference| in grey levels per image (averaged over SEEDS)."""
    program = compile_stages((Decode(fast=fast), *stages))
    diffs = {}
    for name, data in images.items():
        per_seed = []
        for seed in SEEDS if any(isinstance(st, (RandomResizedCrop, RandomHFlip)) for st in stages) else SEEDS[:1]:
            ref = reference(data, stages, seed)
            out = np.empty(program.slot_shape(ref.shape[:2]), program.dtype)
            program.run(data, seed, out)
            per_seed.append(np.abs(out.astype(np.float64) - ref).mean())
        diffs[name] = float(np.mean(per_seed))
    return diffs


@pytest.fixture(scope="module")
def hires() -> dict[str, bytes]:
    return _hires()


@pytest.mark.parametrize("pipeline", PIPELINES, ids=str)
def test_default_is_within_a_grey_level_on_generated_hires(hires, pipeline):
    """Default mode: mean difference <= 1.0 on every generated 2-4 MP image, <= 0.5 over the set."""
    diffs = _mean_diffs(hires, PIPELINES[pipeline], fast=False)
    assert max(diffs.values()) <= 1.0, diffs
    assert np.mean(list(diffs.values())) <= 0.5, diffs


@pytest.mark.shared_data
@pytest.mark.parametrize("pipeline", PIPELINES, ids=str)
def test_default_is_within_a_grey_level_on_real_photos(pipeline):
    """Default mode: mean difference <= 1.0 on every shared photo, <= 0.5 over the set."""
    diffs = _mean_diffs(_photos(), PIPELINES[pipeline], fast=False)
    assert max(diffs.values()) <= 1.0, diffs
    assert np.mean(list(diffs.values())) <= 0.5, diffs


@pytest.mark.parametrize("pipeline", ["resize-center_crop", "random_resized_crop-hflip", "aspect_buckets"])
def test_fast_mode_is_close_but_not_the_same(hires, pipeline):
    """decode(fast=True) stays within a loose bound (mean <= 12, set <= 3) and differs from the default."""
    stages = PIPELINES[pipeline]
    fast = _mean_diffs(hires, stages, fast=True)
    assert max(fast.values()) <= 12.0 and np.mean(list(fast.values())) <= 3.0, fast
    assert fast != _mean_diffs(hires, stages, fast=False)


@pytest.mark.shared_data
def test_fast_mode_on_real_photos():
    """decode(fast=True) on the shared photos: mean <= 12 per photo and <= 3 over the set, for every pipeline
    (measured: up to 8.5 on one photo, 2.1 over the set)."""
    photos = _photos()
    for stages in (PIPELINES["resize-center_crop"], PIPELINES["random_resized_crop-hflip"],
                   PIPELINES["aspect_buckets"]):
        fast = _mean_diffs(photos, stages, fast=True)
        assert max(fast.values()) <= 12.0 and np.mean(list(fast.values())) <= 3.0, (stages, fast)
