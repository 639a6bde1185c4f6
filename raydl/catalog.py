"""Listing a source into the catalog: an Arrow table with one row per sample.

The sample id is the row number, 0..N-1, in sorted key order. The fingerprint
identifies the catalog's content (keys, sizes, labels) so that plans and resume
states can tell two catalogs apart.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pyarrow as pa

from raydl.errors import DataSourceError
from raydl.storage import LocalStorage

__all__ = ["IMAGE_EXTENSIONS", "Catalog", "list_image_folder"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


@dataclass(frozen=True)
class Catalog:
    """The samples of a source. `table` columns: key (str), label (int64), size (int64)."""

    storage: LocalStorage
    table: pa.Table
    classes: tuple[str, ...]
    fingerprint: str

    def __len__(self) -> int:
        return self.table.num_rows


def _fingerprint(table: pa.Table) -> str:
    h = hashlib.sha256()
    for name in table.column_names:
        h.update(name.encode())
        for chunk in table.column(name).chunks:
            for buf in chunk.buffers():
                if buf is not None:
                    h.update(buf)
    return h.hexdigest()[:32]


def list_image_folder(root: str, *, labels: str | None = "folder") -> Catalog:
    """List every image under `root` (recursively) into a Catalog.

    labels="folder": the label is the index of the sample's top-level folder
    under root among all such folders in sorted order (torchvision's
    ImageFolder); images directly in root are an error then, since they have
    no class. labels=None: every label is -1.
    """
    if labels not in ("folder", None):
        raise ValueError(f"labels must be 'folder' or None, got {labels!r}")
    storage = LocalStorage(root)
    entries = sorted((k, s) for k, s in storage.walk() if k.lower().endswith(IMAGE_EXTENSIONS))
    if not entries:
        raise DataSourceError(
            f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {root!r}", uri=root
        )
    keys = [k for k, _ in entries]
    sizes = [s for _, s in entries]
    if labels == "folder":
        loose = [k for k in keys if "/" not in k]
        if loose:
            raise DataSourceError(
                f"{storage.uri(loose[0])!r} (and {len(loose) - 1} more) lie directly in the root, "
                "so they have no class folder; move them into a class folder or pass labels=None",
                uri=storage.uri(loose[0]),
            )
        classes = tuple(sorted({k.split("/", 1)[0] for k in keys}))
        index = {c: i for i, c in enumerate(classes)}
        label_values = [index[k.split("/", 1)[0]] for k in keys]
    else:
        classes = ()
        label_values = [-1] * len(keys)
    table = pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "label": pa.array(label_values, pa.int64()),
            "size": pa.array(sizes, pa.int64()),
        }
    )
    return Catalog(storage=storage, table=table, classes=classes, fingerprint=_fingerprint(table))
