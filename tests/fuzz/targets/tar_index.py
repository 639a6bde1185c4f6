"""The tar indexer and WebDataset listing (raydl.sources._tar.index_tar, list_webdataset) on mutated tars
and .tar.gz shards, as webdataset's TarWriter and Python's tarfile (ustar, GNU long names, pax) write them."""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import raydl.errors
from raydl.sources.webdataset import list_webdataset
from raydl.storage import ObjectInfo

ALLOWED = (raydl.errors.RaydlError,)
# The floor of a run (harness.py); measured in 20 s runs on a loaded 2-core machine: 2,660-4,230 inputs, 235-355 accepted
MIN_INPUTS, MIN_ACCEPTED = 800, 40
logging.getLogger("raydl").setLevel(logging.ERROR)  # "samples left out" for most inputs
URI_TAR, URI_TAR_GZ = "mem://bucket/fuzz.tar", "mem://bucket/fuzz.tar.gz"
CACHE = tempfile.mkdtemp(prefix="raydl-fuzz-cache-")
os.environ["RAYDL_CACHE_DIR"] = CACHE  # the listing caches each input's index: here, emptied after each
SHARED = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "webdataset"


class MemoryStorage:
    """One object in memory, under any URI: the storage the listing reads the fuzzed shard through."""

    default_io_concurrency = 1

    def __init__(self, data: bytes) -> None:
        self.data = data

    def list(self, prefix):
        yield self.stat(URI_TAR_GZ if self.data[:1] == b"\x1f" else URI_TAR)  # the LIST page of the shard's folder

    def stat(self, uri: str) -> ObjectInfo:
        return ObjectInfo(uri, len(self.data), hashlib.sha256(self.data).hexdigest())  # a new shard, a new etag

    def read_range(self, uri: str, offset: int, length: int, *, etag=None) -> bytes:
        out = self.data[offset : offset + length]
        if len(out) != length or offset < 0 or length < 0:
            raise raydl.errors.ObjectChangedError(f"{uri}: {length} bytes at {offset} asked", uri=uri)
        return out

    def read(self, uri: str) -> bytes:
        return self.data


def _tarfile(fmt: int, members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _tarwriter(samples) -> bytes:
    import webdataset as wds

    buf = io.BytesIO()
    with wds.TarWriter(buf) as sink:
        for sample in samples:
            sink.write(sample)
    return buf.getvalue()


def seeds() -> list[bytes]:
    members = [("a.jpg", b"\xff\xd8jpeg"), ("a.cls", b"3"), ("b.png", b"png" * 10), ("b.cls", b"7")]
    long_names = [("d/" + "x" * 120 + ".jpg", b"long"), ("d/" + "x" * 120 + ".cls", b"1"), ("ü/é.jpg", b"u")]
    out = [
        _tarfile(tarfile.USTAR_FORMAT, members),
        _tarfile(tarfile.GNU_FORMAT, members + long_names),
        _tarfile(tarfile.PAX_FORMAT, long_names + members),
        _tarwriter([{"__key__": f"s{i:03d}", "jpg": bytes([i]) * (100 + i), "cls": str(i)} for i in range(4)]),
    ]
    out.append(gzip.compress(out[1]))
    out.append(gzip.compress(out[3][:2048]) + gzip.compress(out[3][2048:]))
    if SHARED.is_dir():
        out += [p.read_bytes() for p in sorted(SHARED.iterdir()) if p.is_file() and p.stat().st_size < 1 << 20]
    return out


def run_one(data: bytes) -> None:
    name = URI_TAR_GZ if data[:1] == b"\x1f" else URI_TAR
    storage = MemoryStorage(data)
    try:
        list_webdataset(name, storage_of=lambda _u: storage, image_fields=("jpg", "png", "ppm"), label_field="cls")
    finally:
        from raydl.sources import _inflate

        _inflate.clear_cache()  # every input is a new shard under the same name
        shutil.rmtree(os.path.join(CACHE, "wds-index"), ignore_errors=True)


if __name__ == "__main__":  # a quick look: every seed lists
    for s in seeds():
        try:
            run_one(s)
            print("ok", len(s))
        except raydl.errors.RaydlError as exc:
            print("refused", len(s), exc)
    os._exit(0)
