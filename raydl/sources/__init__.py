"""How samples sit in a store's bytes: image folders, WebDataset tar shards, Parquet files.

Each source lists its input once into a Catalog (raydl/describe/catalog.py) of
shards and parts, and in the loader worker says where a batch's samples are
(`locate`), how to read a block of a shard and how to cut a sample's fields
out of a fetched range (the `Source` contract, raydl/describe/catalog.py).
"""

from raydl.sources.base import ImageFiles, Located, Source
from raydl.sources.images import IMAGE_EXTENSIONS, list_image_folder

__all__ = ["IMAGE_EXTENSIONS", "ImageFiles", "Located", "Source", "list_image_folder"]
