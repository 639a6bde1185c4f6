"""raydl: a Ray-distributed data loader for deep-learning training.

    ds = raydl.read_images("/data/train").decode().random_resized_crop(224).random_hflip().normalize()
    with ds.loader(batch_size=256, world_size=2) as loader:
        for batch in loader.iterator(rank).iter_torch_batches():
            ...

The public names are imported on first use (PEP 562): a process that only
needs one module (the loader's coordinator actor, which imports
raydl.actors.coordinator) does not pay for numpy, pyarrow, Pillow and the
rest at start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raydl import errors
    from raydl.consume.iterator import DataIterator, IteratorStats
    from raydl.dataset import Dataset, mix, read_images, read_parquet, read_tokens, read_webdataset
    from raydl.execute.loader import Loader
    from raydl.options import AzureOptions, Cache, GCSOptions, S3Options

__version__ = "0.1.0"

__all__ = [
    "AzureOptions",
    "Cache",
    "DataIterator",
    "Dataset",
    "GCSOptions",
    "IteratorStats",
    "Loader",
    "S3Options",
    "errors",
    "mix",
    "read_images",
    "read_parquet",
    "read_tokens",
    "read_webdataset",
]

# Public name -> the module that defines it.
_HOME = {
    "AzureOptions": "raydl.options",
    "Cache": "raydl.options",
    "DataIterator": "raydl.consume.iterator",
    "Dataset": "raydl.dataset",
    "GCSOptions": "raydl.options",
    "IteratorStats": "raydl.consume.iterator",
    "Loader": "raydl.execute.loader",
    "S3Options": "raydl.options",
    "mix": "raydl.dataset",
    "read_images": "raydl.dataset",
    "read_parquet": "raydl.dataset",
    "read_tokens": "raydl.dataset",
    "read_webdataset": "raydl.dataset",
}


def __getattr__(name: str):
    """A public name, or a submodule (`raydl.config`, `raydl.native`, ...), imported on first use."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
