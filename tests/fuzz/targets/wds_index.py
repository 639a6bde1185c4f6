"""The WebDataset index-file parsers (raydl.sources._wds_index: DALI's wds2idx v1.2 text, raydl's own index
file header and blocks, wids JSON shard lists) on mutated index files. The first byte picks the parser."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np

import raydl.errors
from raydl.sources import _wds_index as wi
from raydl.sources._tar import index_tar
from raydl.storage import ObjectInfo

ALLOWED = (raydl.errors.RaydlError,)
# The floor of a run (harness.py); measured in 20 s runs on a loaded 2-core machine: 5,300-6,070 inputs, 210-245 accepted
MIN_INPUTS, MIN_ACCEPTED = 1500, 40
SHARD = ObjectInfo("mem://bucket/fuzz.tar", 1 << 20, "etag")  # what every index claims to index


def _shard_block() -> wi.MemberBlock:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in [("a.jpg", b"j" * 700), ("a.cls", b"3"), ("d/" + "x" * 120 + ".png", b"p"), ("b.jpg", b"")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    ms = index_tar(lambda o, n: data[o : o + n], len(data), "seed.tar").members
    return wi.MemberBlock([m.name for m in ms], np.array([m.offset for m in ms]), np.array([m.size for m in ms]))


def seeds() -> list[bytes]:
    block = _shard_block()
    dali = "\n".join(
        f"{n[n.find('.', n.rfind('/') + 1) + 1 :]} {o} {s} {n}" for n, o, s in zip(block.names, block.offsets, block.sizes, strict=True)
    )
    dali = f"v1.2 {len(block)}\n{dali}\n".encode()
    path = "/tmp/raydl-fuzz-seed.rwi"
    wi.write_index(path, [("fuzz.tar", SHARD, 0, block), ("other.tar", SHARD, 0, block)])
    with open(path, "rb") as f:
        own = f.read()
    os.unlink(path)
    wids = json.dumps(
        {
            "__kind__": "wids-shard-index-v1",
            "name": "fuzz",
            "shardlist": [{"url": "a.tar", "nsamples": 3, "filesize": 10240}, {"url": "s3://b/c.tar", "nsamples": 1}],
        }
    ).encode()
    return [b"D" + dali, b"R" + own, b"W" + wids]


def run_one(data: bytes) -> None:
    kind, body = data[:1], data[1:]
    if kind == b"D":
        wi.parse_dali(body, "fuzz.idx", SHARD)
    elif kind == b"W":
        wi.parse_wids(body, "s3://b/d/shards.json")
    else:
        entries = wi.read_header(lambda o, n: body[o : o + n], len(body), "fuzz.rwi")
        for e in entries[:4]:
            block = wi.decode_block(body[e.offset : e.offset + e.length], SHARD, "fuzz.rwi")
            wi.samples_of(block, SHARD.uri, ("jpg", "png"), "cls")


if __name__ == "__main__":  # a quick look: every seed parses
    for s in seeds():
        run_one(s)
        print("ok", s[:1], len(s))
    os._exit(0)
