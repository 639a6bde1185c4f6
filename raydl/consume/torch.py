"""numpy batches to torch tensors (`DataIterator.iter_torch_batches`). torch is an optional extra."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from raydl.util.optional import import_torch

__all__ = ["torch_batches"]


def torch_batches(
    batches: Iterator[dict[str, Any]], *, device: str, dtypes: Any, pin_memory: bool
) -> Iterator[dict[str, Any]]:
    torch = import_torch("iter_torch_batches")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was asked for, but torch sees no CUDA device")
    if pin_memory and not torch.cuda.is_available():
        raise RuntimeError("pin_memory=True needs a CUDA device, and torch sees none")
    if dtypes is None:
        dtype_of: dict[str, Any] = {}
    elif isinstance(dtypes, dict):
        dtype_of = dict(dtypes)
    else:
        dtype_of = {"image": dtypes}
    for batch in batches:
        out: dict[str, Any] = {}
        for name, value in batch.items():
            if not isinstance(value, np.ndarray):
                out[name] = value
                continue
            with warnings.catch_warnings():
                # Object-store arrays are read-only; the tensor shares their memory (no copy).
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                t = torch.from_numpy(value)
            if pin_memory:
                t = t.pin_memory()
            if name in dtype_of or dev.type != "cpu":
                t = t.to(device=dev, dtype=dtype_of.get(name), non_blocking=pin_memory)
            out[name] = t
        yield out
