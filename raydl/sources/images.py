"""Image folders: every image file under a root is a sample, labelled by its top-level folder."""

from __future__ import annotations

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import DataSourceError
from raydl.sources.base import ImageFiles
from raydl.storage.base import Storage, split_scheme

__all__ = ["IMAGE_EXTENSIONS", "list_image_folder"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def list_image_folder(root: str, *, labels: str | None = "folder", storage: Storage | None = None) -> Catalog:
    """List every image under `root` (recursively; a local folder or an s3://bucket/prefix) into a Catalog.

    labels="folder": the label is the index of the sample's top-level folder
    under root among all such folders in sorted order (torchvision's
    ImageFolder); images directly in root are an error then, since they have
    no class. labels=None: every label is -1. Keys are paths under root with
    '/' separators, in sorted order. No image is read: sizes come later, from
    the headers, when a stage needs them (`Catalog.with_sizes`). A part is one
    file; its key is its URI past the root (not stored twice).
    """
    if labels not in ("folder", None):
        raise ValueError(f"labels must be 'folder' or None, got {labels!r}")
    if storage is None:
        from raydl.storage import LocalStorage

        storage = LocalStorage()
    scheme, _ = split_scheme(root)
    # An object-store prefix is a folder: "s3://b/train" must not also list "s3://b/train2/...".
    prefix = root if scheme == "file" or root.endswith("/") else root + "/"
    entries = []
    for obj in storage.list(prefix):
        key = obj.uri[len(prefix) :].lstrip("/") if obj.uri.startswith(prefix) else obj.uri
        if scheme == "file":
            key = key.replace("\\", "/")
        if key.lower().endswith(IMAGE_EXTENSIONS):
            entries.append((key, obj))
    entries.sort(key=lambda e: e[0])
    if not entries:
        raise DataSourceError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {root!r}", uri=root)
    if labels == "folder":
        loose = [obj.uri for k, obj in entries if "/" not in k]
        if loose:
            raise DataSourceError(
                f"{loose[0]!r} (and {len(loose) - 1} more) lie directly in the root, "
                "so they have no class folder; move them into a class folder or pass labels=None",
                uri=loose[0],
            )
        classes = tuple(sorted({k.split("/", 1)[0] for k, _ in entries}))
        index = {c: i for i, c in enumerate(classes)}
        label_values = [index[k.split("/", 1)[0]] for k, _ in entries]
    else:
        classes = ()
        label_values = [-1] * len(entries)
    n = len(entries)
    objects = [obj for _, obj in entries]
    del entries
    return make_catalog(
        root=root,
        storage=storage,
        source=ImageFiles(prefix),
        shards=objects,
        parts={"shard": range(n), "count": [1] * n, "label": label_values},
        classes=classes,
    )
