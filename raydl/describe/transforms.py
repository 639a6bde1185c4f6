"""Declarative transform stages and the per-sample program they compile to, under one name.

The stages (frozen, printable dataclasses that `Dataset` records, and their order rules) are
raydl/describe/stages.py; `compile_stages` and the `SampleProgram` it makes (one geometry per sample,
decoded and written into its batch slot by the native kernels) are raydl/describe/program.py. Both are
re-exported here, where the Dataset, the loader and the tests import them from.
"""

from __future__ import annotations

from raydl.describe.program import SampleProgram, compile_stages
from raydl.describe.program import _resized as _resized  # the tests' Pillow reference sizes a Resize with it
from raydl.describe.stages import (
    NORMALIZE_PRESETS,
    AspectBuckets,
    CenterCrop,
    Decode,
    Normalize,
    RandomHFlip,
    RandomResizedCrop,
    Resize,
    SampleRng,
    Stage,
    check_stage_order,
    rrc_box,
)

__all__ = [
    "NORMALIZE_PRESETS",
    "AspectBuckets",
    "CenterCrop",
    "Decode",
    "Normalize",
    "RandomHFlip",
    "RandomResizedCrop",
    "Resize",
    "SampleProgram",
    "SampleRng",
    "Stage",
    "check_stage_order",
    "compile_stages",
    "rrc_box",
]
