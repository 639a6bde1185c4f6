"""Where sample bytes come from: one small interface (base.py), local disk and S3 behind it, and the
node cache in front of a remote store (cache.py)."""

from __future__ import annotations

from raydl.storage.base import BaseStorage, ObjectInfo, Storage, split_scheme
from raydl.storage.local import LocalStorage

__all__ = ["BaseStorage", "LocalStorage", "ObjectInfo", "Storage", "resolve", "split_scheme", "storage_for"]

_SCHEMES = ("file", "s3")


def storage_for(uri: str, s3=None) -> Storage:
    """The storage that reads `uri`: local paths (and file://) or s3://. Another scheme is a ValueError naming
    it."""
    scheme, _ = split_scheme(uri)
    if scheme == "file":
        return LocalStorage()
    if scheme == "s3":
        from raydl.storage.s3 import S3Storage

        return S3Storage(s3)
    raise ValueError(
        f"unsupported URL scheme {scheme!r} in {uri!r}; raydl reads {', '.join(_SCHEMES)} "
        "(local paths need no scheme)"
    )


def resolve(uri: str, s3=None) -> tuple[Storage, str]:
    """(storage, uri as that storage names it): "file:///x" becomes "/x"."""
    storage = storage_for(uri, s3)
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return storage, uri
