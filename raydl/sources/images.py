"""Image folders: every image file under a root is a sample, labelled by its top-level folder.

A listing of 1.28 M files (ImageNet) is kept compactly as it streams in: each
URI and etag as UTF-8 bytes appended to one buffer with its end offset, sizes
and class numbers in typed arrays, so the driver holds about 100 bytes per
file while listing (the catalog's own columns and little else) where a Python
list of (key, ObjectInfo) held about 700 (docs/benchmarks.md, listing).
"""

from __future__ import annotations

from array import array

import numpy as np
import pyarrow as pa

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import DataSourceError
from raydl.sources.base import ImageFiles
from raydl.storage.base import ObjectInfo, Storage, split_scheme
from raydl.util.arrow import int_array, int_column

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
    scan = _Scan(prefix, local=scheme == "file")
    for obj in storage.list(prefix):
        scan.add(obj)
    n = len(scan.sizes)
    if not n:
        raise DataSourceError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {root!r}", uri=root)
    if labels == "folder" and scan.loose:
        raise DataSourceError(
            f"{scan.first_loose!r} (and {scan.loose - 1} more) lie directly in the root, "
            "so they have no class folder; move them into a class folder or pass labels=None",
            uri=scan.first_loose,
        )
    shards, klass, found = scan.finish()
    if labels == "folder":
        classes = tuple(sorted(found))
        number = np.empty(len(found), np.int64)  # first-seen class number -> its place in sorted order
        number[[found[c] for c in classes]] = np.arange(len(classes))
        label_values = number[klass]
    else:
        classes = ()
        label_values = np.full(n, -1, np.int64)
    del klass
    return make_catalog(
        root=root,
        storage=storage,
        source=ImageFiles(prefix),
        shards=shards,
        parts={"shard": np.arange(n, dtype=np.int64), "count": np.ones(n, np.int64), "label": label_values},
        classes=classes,
    )


class _Scan:
    """The image files of a listing as it streams in: URIs and etags appended to byte buffers (with their
    end offsets), sizes and first-seen class numbers to typed arrays; whether the keys came in sorted order
    (S3 lists in key order; os.walk does not)."""

    def __init__(self, prefix: str, *, local: bool) -> None:
        self.prefix, self.local = prefix, local
        self.uris, self.etags = _Text(), _Text()
        self.sizes, self.klass = array("q"), array("i")
        self.classes: dict[str, int] = {}  # top-level folder -> first-seen number
        self.loose, self.first_loose = 0, ""
        self.ordered, self.last = True, ""
        self.head: str | None = None  # what precedes the key in every URI (the prefix, and any '/' after it)
        self.plain = True  # every URI is head + key: sorting the URIs sorts the keys

    def add(self, obj: ObjectInfo) -> None:
        uri = obj.uri
        key = uri[len(self.prefix) :].lstrip("/") if uri.startswith(self.prefix) else uri
        if self.local:
            key = key.replace("\\", "/")
        if not key.lower().endswith(IMAGE_EXTENSIONS):
            return
        head = uri[: len(uri) - len(key)] if uri.endswith(key) else None
        if self.head is None:
            self.head = head
        self.plain = self.plain and head is not None and head == self.head
        if key < self.last:
            self.ordered = False
        self.last = key
        top, sep, _ = key.partition("/")
        if sep:
            self.klass.append(self.classes.setdefault(top, len(self.classes)))
        else:
            self.klass.append(0)
            self.loose += 1
            self.first_loose = self.first_loose or uri
        self.uris.append(uri)
        self.etags.append(obj.etag)
        self.sizes.append(obj.size)

    def finish(self) -> tuple[pa.Table, np.ndarray, dict[str, int]]:
        """The shards table (uri, size, etag) in key order, each file's first-seen class number, the
        classes. The buffers move into the table: the scan is spent."""
        uris, etags = self.uris.array(), self.etags.array()
        self.uris = self.etags = None  # type: ignore[assignment]
        sizes = np.frombuffer(self.sizes, np.int64)
        klass = np.frombuffer(self.klass, np.int32)
        if not self.ordered:
            order = self._order(uris)
            uris = uris.take(int_array(order))  # one column at a time: the unsorted one goes at once
            etags = etags.take(int_array(order))
            sizes, klass = sizes[order], klass[order]
        table = pa.table({"uri": uris, "size": int_array(sizes), "etag": etags})
        return table, klass, self.classes

    def _order(self, uris: pa.Array) -> np.ndarray:
        """The positions of the files in key order (stable)."""
        if self.plain:  # one head before every key: the URIs sort as the keys do
            import pyarrow.compute as pc

            return int_column(pc.sort_indices(uris)).astype(np.int64)
        prefix, local = self.prefix, self.local
        keys = []
        for uri in uris.to_pylist():
            key = uri[len(prefix) :].lstrip("/") if uri.startswith(prefix) else uri
            keys.append(key.replace("\\", "/") if local else key)
        return np.array(sorted(range(len(keys)), key=keys.__getitem__), np.int64)


class _Text:
    """Strings appended as UTF-8 to one buffer, with their end offsets: int32 while the text is under
    2 GiB (as string_array), int64 past it."""

    def __init__(self) -> None:
        self.data, self.ends = bytearray(), array("i", [0])

    def append(self, text: str) -> None:
        self.data += text.encode()
        try:
            self.ends.append(len(self.data))
        except OverflowError:
            self.ends = array("q", self.ends)
            self.ends.append(len(self.data))

    def array(self) -> pa.Array:
        """The strings as an Arrow array over the buffers (no copy)."""
        wide = self.ends.typecode == "q"
        return pa.Array.from_buffers(
            pa.large_string() if wide else pa.string(),
            len(self.ends) - 1,
            [None, pa.py_buffer(self.ends), pa.py_buffer(self.data)],
        )
