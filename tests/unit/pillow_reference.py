"""The fidelity reference: Pillow, stage by stage, with torchvision's semantics.

Full decode (Pillow's libjpeg defaults: accurate integer DCT, fancy upsampling),
then each stage on the PIL image: random_resized_crop = box crop then
antialiased bilinear resize; resize = antialiased bilinear resize of the whole
image; center_crop = torchvision's centred box; hflip by the same draws as
raydl's SampleRng. Returns uint8 HWC (normalize is left to the caller).
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from raydl.describe.transforms import (
    AspectBuckets,
    CenterCrop,
    RandomHFlip,
    RandomResizedCrop,
    Resize,
    SampleRng,
    _resized,
    rrc_box,
)


def reference(data: bytes, stages, seed: int) -> np.ndarray:
    """The Pillow/torchvision reference output of `stages` (after Decode) for one sample."""
    with Image.open(io.BytesIO(data)) as im:
        img = im.convert("RGB")
    rng = SampleRng(seed)
    for st in stages:
        w, h = img.size
        if isinstance(st, RandomResizedCrop):
            top, left, ch, cw = rrc_box(h, w, st, rng)
            img = img.crop((left, top, left + cw, top + ch)).resize(st.size[::-1], Image.Resampling.BILINEAR)
        elif isinstance(st, Resize):
            lh, lw = _resized((h, w), st.size)
            img = img.resize((lw, lh), Image.Resampling.BILINEAR)
        elif isinstance(st, CenterCrop):
            ch, cw = st.size
            top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
            img = img.crop((left, top, left + cw, top + ch))
        elif isinstance(st, AspectBuckets):
            (bh, bw), (left, top, cw, ch) = st.bucket_crop(h, w, rng)
            img = img.crop((left, top, left + cw, top + ch)).resize((bw, bh), Image.Resampling.BILINEAR)
        elif isinstance(st, RandomHFlip):
            if rng.random() < st.p:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(img)
