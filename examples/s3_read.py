"""Reading from S3: an image folder and its WebDataset copy, from a local S3-compatible server.

    python examples/s3_read.py [--images 64] [--endpoint-url URL]

Without --endpoint-url, moto's server (`pip install 'moto[server]'`) is started on
127.0.0.1 with dummy credentials; against a real store leave credentials to
boto3 (environment, profile, instance role). Both reads give the same labels
and pixels as the local files.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import ray

import raydl
from raydl.bench.shards import _upload, write_webdataset
from raydl.demo import make_images


def local_s3() -> str:
    """moto's S3 server on a free port of 127.0.0.1; its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    for k, v in {
        "AWS_ACCESS_KEY_ID": "demo",
        "AWS_SECRET_ACCESS_KEY": "demo",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--endpoint-url")
    p.add_argument("--bucket", default="raydl-example")
    args = p.parse_args()
    endpoint = args.endpoint_url or local_s3()  # before ray.init: actors inherit the environment

    work = tempfile.mkdtemp(prefix="raydl-s3-example-")
    make_images(os.path.join(work, "images"), args.images)
    write_webdataset(os.path.join(work, "images"), os.path.join(work, "wds"), per_shard=16)
    _upload(work, f"s3://{args.bucket}/example", endpoint)

    s3 = raydl.S3Options(endpoint_url=endpoint, max_concurrency=16)
    folder = raydl.read_images(f"s3://{args.bucket}/example/images", s3=s3)
    shards = raydl.read_webdataset(f"s3://{args.bucket}/example/wds/shard-*.tar", s3=s3)  # or a brace pattern
    local = raydl.read_images(os.path.join(work, "images"))
    print(folder, shards, sep="\n")

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        epochs = {}
        for name, ds in (("s3 folder", folder), ("s3 shards", shards), ("local folder", local)):
            with ds.decode().center_crop(32).loader(batch_size=16, shuffle=False) as loader:
                epochs[name] = list(loader.iterator(0).iter_batches())
            print(f"{name:>12}: {sum(len(b['id']) for b in epochs[name])} samples")
        assert len({len(e) for e in epochs.values()}) == 1
        for a, b, c in zip(*epochs.values(), strict=True):
            assert np.array_equal(a["image"], c["image"]) and np.array_equal(b["image"], c["image"])
            assert np.array_equal(a["label"], c["label"]) and np.array_equal(b["label"], c["label"])
        print("same labels and pixels from S3 (folder and shards) as from local disk")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
