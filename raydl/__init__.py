"""raydl: a Ray-distributed data loader for deep-learning training.

    ds = raydl.read_images("/data/train").decode().random_resized_crop(224).random_hflip().normalize("imagenet")
    with ds.loader(batch_size=256, world_size=2) as loader:
        for batch in loader.iterator(rank).iter_torch_batches():
            ...
"""
from raydl import errors
from raydl.config import S3Options
from raydl.dataset import Dataset, read_images, read_parquet, read_webdataset
from raydl.iterator import DataIterator, IteratorStats
from raydl.loader import Loader

__version__ = "0.1.0"

__all__ = [
    "DataIterator",
    "Dataset",
    "IteratorStats",
    "Loader",
    "S3Options",
    "errors",
    "read_images",
    "read_parquet",
    "read_webdataset",
]
