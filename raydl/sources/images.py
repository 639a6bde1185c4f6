"""Image folders: every image file under a root is a sample, labelled by its top-level folder.

A listing of 1.28 M files (ImageNet) is kept compactly as it streams in: each
URI and etag as UTF-8 bytes appended to one buffer with its end offset, sizes
and class numbers in typed arrays, so the driver holds about 100 bytes per
file while listing (the catalog's own columns and little else), where a Python
list of (key, ObjectInfo) would hold about 700 (docs/benchmarks.md, "Listing at scale").
"""

from __future__ import annotations

import os
from array import array
from itertools import accumulate

import numpy as np
import pyarrow as pa

from raydl.describe.catalog import Catalog, make_catalog
from raydl.errors import AccessDeniedError, DataSourceError
from raydl.sources.base import ImageFiles
from raydl.storage.base import ObjectInfo, Storage, check_text_path, split_scheme
from raydl.util.arrow import int_array
from raydl.util.progress import Progress

__all__ = ["IMAGE_EXTENSIONS", "list_image_folder"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
_PROGRESS_AFTER_S = (
    2.0  # a listing that takes less shows no progress (an S3 prefix of 1 M objects takes more)
)
_PROGRESS_EVERY = 1000  # objects between two looks at the clock, listing object by object


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
    scan = _scan(root, prefix, storage, local=scheme == "file")
    n = len(scan.sizes)
    if not n and not scan.listed and scheme != "file" and not _is_object(storage, root):
        # an object store's folder is its objects: no object under it, no folder (as a local one would be)
        raise DataSourceError(
            f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {root!r}: {root!r} does not exist (no "
            "object under it)",
            uri=root,
        )
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


def _is_object(storage: Storage, uri: str) -> bool:
    """Whether `uri` is an object itself (a file, where a folder was meant): one stat, on the error path."""
    try:
        storage.stat(uri)
    except AccessDeniedError:
        raise
    except DataSourceError:
        return False
    return True


def _scan(root: str, prefix: str, storage: Storage, *, local: bool) -> _Scan:
    """Every image file under `prefix`: a local folder's a folder at a time, an object store's object by
    object; the count shown once it takes a while."""
    scan = _Scan(prefix, local=local)
    with Progress(None, f"listing {root}", unit="files", delay_s=_PROGRESS_AFTER_S) as bar:
        folders = getattr(storage, "list_folders", None)
        if folders is not None and local and os.path.isdir(prefix):
            for folder, names, sizes in folders(prefix):  # a local folder: no ObjectInfo per file
                scan.add_folder(folder, names, sizes)
                bar.update(len(scan.sizes))
        else:
            for i, obj in enumerate(storage.list(prefix)):
                scan.add(obj)
                if not i % _PROGRESS_EVERY:
                    bar.update(len(scan.sizes))
        bar.update(len(scan.sizes))
    return scan


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
        self.listed = 0  # objects listed one by one, images or not

    def add(self, obj: ObjectInfo) -> None:
        self.listed += 1
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

    def add_folder(self, folder: str, names: list[str], sizes: list[int]) -> None:
        """The files `names` (of `sizes` bytes) of one local folder: what `add` does for each of them, once
        per folder where it can (its key prefix, its class, its URIs encoded together)."""
        base = folder if folder.endswith(os.sep) else folder + os.sep  # os.path.join(folder, name)
        every = "\0".join(names) + "\0"  # no name holds a NUL: one string to look at them all in C
        if not base.startswith(self.prefix) or "\\" in base or "\\" in every:
            for name, size in zip(names, sizes, strict=True):  # keys made otherwise: the general path
                self.add(ObjectInfo(base + name, size))
            return
        rel = base[len(self.prefix) :].lstrip("/")
        every = every.lower()
        if sum(every.count(ext + "\0") for ext in IMAGE_EXTENSIONS) < len(names):  # not every one an image
            keep = [i for i, name in enumerate(names) if name.lower().endswith(IMAGE_EXTENSIONS)]
            if not keep:
                return
            names, sizes = [names[i] for i in keep], [sizes[i] for i in keep]
        head = base[: len(base) - len(rel)]
        if self.head is None:
            self.head = head
        self.plain = self.plain and head == self.head
        if self.ordered:
            first = rel + names[0]
            self.ordered = not first < self.last and all(
                a <= b for a, b in zip(names, names[1:], strict=False)
            )
        self.last = rel + names[-1]
        top, sep, _ = rel.partition("/")
        if sep:
            self.klass.extend([self.classes.setdefault(top, len(self.classes))] * len(names))
        else:  # files directly in the root
            self.klass.extend([0] * len(names))
            self.loose += len(names)
            self.first_loose = self.first_loose or base + names[0]
        try:
            self.uris.extend([(base + name).encode() for name in names])
        except UnicodeEncodeError:
            for name in names:
                check_text_path(base + name, "sample")  # raises for the name that is not UTF-8
            raise
        self.etags.extend_empty(len(names))
        self.sizes.extend(sizes)

    def finish(self) -> tuple[pa.Table, np.ndarray, dict[str, int]]:
        """The shards table (uri, size, etag) in key order, each file's first-seen class number, the
        classes. The buffers move into the table: the scan is spent."""
        sizes = np.frombuffer(self.sizes, np.int64)
        klass = np.frombuffer(self.klass, np.int32)
        if not self.ordered:
            order = self._order()
            self.uris.take(order)  # one column at a time: the unsorted copy goes at once
            self.etags.take(order)
            sizes, klass = sizes[order], klass[order]
        uris, etags = self.uris.array(), self.etags.array()
        self.uris = self.etags = None  # type: ignore[assignment]
        table = pa.table({"uri": uris, "size": int_array(sizes), "etag": etags})
        return table, klass, self.classes

    def _order(self) -> np.ndarray:
        """The positions of the files in key order (stable). Numpy, not pyarrow.compute: importing that
        costs every process that lists a folder (tests/unit/test_arrow.py)."""
        ends, data = self.uris.views()
        n = len(ends) - 1
        width = int(np.diff(ends).max()) if n else 0
        if self.plain and n * width <= 4 * len(data) + (1 << 20):
            # one head before every key: the URIs sort as the keys do, bytewise (UTF-8 keeps code point
            # order), as rows of a zero-padded matrix (no path holds a NUL)
            rows = np.zeros((n, width), np.uint8)
            cols = np.arange(width)
            for i in range(0, n, _PIECE):
                k = min(_PIECE, n - i)
                rows[i : i + k][cols < np.diff(ends[i : i + k + 1])[:, None]] = data[ends[i] : ends[i + k]]
            return np.argsort(rows.view(f"S{width}").reshape(-1), kind="stable") if width else np.arange(n)
        prefix, local = self.prefix, self.local
        keys = []
        for i in range(n):
            uri = data[ends[i] : ends[i + 1]].tobytes().decode()
            key = uri[len(prefix) :].lstrip("/") if uri.startswith(prefix) else uri
            keys.append(key.replace("\\", "/") if local else key)
        return np.array(sorted(range(n), key=keys.__getitem__), np.int64)


_PIECE = 1 << 13  # rows a sort or a permutation handles at a time (its scratch arrays stay small)


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

    def extend(self, encoded: list[bytes]) -> None:
        """Strings already encoded, appended together."""
        start = len(self.data)
        self.data += b"".join(encoded)
        ends = accumulate(map(len, encoded), initial=start)
        next(ends)
        if len(self.data) >= 2**31 and self.ends.typecode == "i":
            self.ends = array("q", self.ends)
        self.ends.extend(ends)

    def extend_empty(self, n: int) -> None:
        """`n` empty strings."""
        self.ends.extend([len(self.data)] * n)

    def views(self) -> tuple[np.ndarray, np.ndarray]:
        """The end offsets (len + 1) and the bytes, as numpy views."""
        wide = self.ends.typecode == "q"
        return np.frombuffer(self.ends, np.int64 if wide else np.int32), np.frombuffer(self.data, np.uint8)

    def take(self, order: np.ndarray) -> None:
        """Put the strings in `order`, gathering their bytes a piece of rows at a time."""
        ends, data = self.views()
        lengths = np.diff(ends)[order]
        new_ends = np.zeros(len(order) + 1, ends.dtype)
        np.cumsum(lengths, out=new_ends[1:])
        out = bytearray(int(new_ends[-1]))
        view = np.frombuffer(out, np.uint8)
        for i in range(0, len(order), _PIECE):
            src, first = order[i : i + _PIECE], int(new_ends[i])
            last = int(new_ends[i + len(src)])
            # output byte p of row r comes from ends[src[r]] + (p - new_ends[r])
            shift = np.repeat(
                ends[src].astype(np.int64) - new_ends[i : i + len(src)], lengths[i : i + len(src)]
            )
            view[first:last] = data[shift + np.arange(first, last)]
        del view, ends, data
        self.data, self.ends = out, array(self.ends.typecode, new_ends.tobytes())

    def array(self) -> pa.Array:
        """The strings as an Arrow array over the buffers (no copy)."""
        wide = self.ends.typecode == "q"
        return pa.Array.from_buffers(
            pa.large_string() if wide else pa.string(),
            len(self.ends) - 1,
            [None, pa.py_buffer(self.ends), pa.py_buffer(self.data)],
        )
