"""How samples sit in a store's bytes: image folders, WebDataset tar shards, Parquet files.

Each source lists its input once into a Catalog (raydl/catalog.py), and in the
loader worker says how to read a block of a shard and how to cut a sample's
image bytes out of a fetched range.
"""

from raydl.sources.base import Source, WholeRanges
from raydl.sources.images import IMAGE_EXTENSIONS, list_image_folder

__all__ = ["IMAGE_EXTENSIONS", "Source", "WholeRanges", "list_image_folder"]
