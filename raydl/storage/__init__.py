"""Where sample bytes come from: one small interface (base.py); local disk, S3, Google Cloud Storage and Azure
Blob storage behind it; and the node cache in front of a remote store (cache.py)."""

from __future__ import annotations

from raydl.storage.base import BaseStorage, ObjectInfo, Storage, split_scheme
from raydl.storage.local import LocalStorage

__all__ = ["BaseStorage", "LocalStorage", "ObjectInfo", "Storage", "resolve", "split_scheme", "storage_for"]

_SCHEMES = ("file", "s3", "gs", "az")


def storage_for(uri: str, s3=None, *, gcs=None, azure=None) -> Storage:
    """The storage that reads `uri`: local paths (and file://), s3:// (with `s3`, a raydl.S3Options), gs://
    (`gcs`, a raydl.GCSOptions) or az:// (`azure`, a raydl.AzureOptions). Another scheme is a ValueError
    naming it."""
    scheme, _ = split_scheme(uri)
    if scheme == "file":
        return LocalStorage()
    if scheme == "s3":
        from raydl.storage.s3 import S3Storage

        return S3Storage(s3)
    if scheme == "gs":
        from raydl.storage.gcs import GCSStorage

        return GCSStorage(gcs)
    if scheme == "az":
        from raydl.storage.azure import AzureStorage

        return AzureStorage(azure)
    raise ValueError(
        f"unsupported URL scheme {scheme!r} in {uri!r}; raydl reads {', '.join(_SCHEMES)} "
        "(local paths need no scheme)"
    )


def resolve(uri: str, s3=None, *, gcs=None, azure=None) -> tuple[Storage, str]:
    """(storage, uri as that storage names it): "file:///x" becomes "/x"."""
    storage = storage_for(uri, s3, gcs=gcs, azure=azure)
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return storage, uri
