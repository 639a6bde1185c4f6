"""WebDataset shards read from an S3-compatible store, with configs/webdataset-s3.yaml.

    python examples/s3_webdataset.py [--shards 4] [--per-shard 24]

To run anywhere, it starts its own S3 server on 127.0.0.1 (moto's server mode,
`pip install 'moto[server]'`), writes a few WebDataset shards of generated
images into a bucket, and reads them with the config, pointed at that server
by `--set`: each loader actor fetches the samples with ranged GETs, straight
from the shards. Against real S3, leave `source.s3.endpoint_url` unset and
boto3 finds the credentials and region as usual.
"""

from __future__ import annotations

import argparse
import io
import os
import tarfile
import tempfile

import ray

from raydl.config import load_config
from raydl.demo import make_images


def write_shards(s3, bucket: str, shards: int, per_shard: int, tmp: str) -> None:
    """Shards of `per_shard` samples: key.jpg (or .png) and key.cls, the webdataset way."""
    paths = make_images(tmp, shards * per_shard, classes=4, corrupt=0)
    for s in range(shards):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i, path in enumerate(paths[s * per_shard : (s + 1) * per_shard]):
                key = f"sample{s:03d}{i:04d}"
                label = str(int(os.path.basename(os.path.dirname(path))[1:])).encode()
                for name, data in (
                    (f"{key}{os.path.splitext(path)[1]}", open(path, "rb").read()),
                    (f"{key}.cls", label),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        s3.put_object(Bucket=bucket, Key=f"imagenet/train-{s:06d}.tar", Body=buf.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--per-shard", type=int, default=24)
    args = parser.parse_args()
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the server logs every request otherwise
    for k, v in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        # Moto takes any credentials; set before Ray starts, so actors inherit them
        os.environ.setdefault(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="raydl-example")
        with tempfile.TemporaryDirectory(prefix="raydl-wds-") as tmp:
            write_shards(s3, "raydl-example", args.shards, args.per_shard, tmp)
        cfg = load_config(
            "configs/webdataset-s3.yaml",
            [
                f"source.urls=s3://raydl-example/imagenet/train-{{000000..{args.shards - 1:06d}}}.tar",
                f"source.s3.endpoint_url={endpoint}",
                "loader.batch_size=16",
                "loader.world_size=1",
                "pipeline.random_resized_crop.size=64",
            ],
        )
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False
        )
        ds = cfg.dataset()
        print(ds)
        seen = 0
        with ds.loader_from_config(cfg.loader) as loader:
            it = loader.iterator(0)
            for batch in it.iter_batches():
                assert batch["image"].shape[1:] == (3, 64, 64)
                assert all(k.startswith("sample") for k in batch["key"])  # the webdataset keys
                seen += len(batch["id"])
            stats = it.stats()
        assert seen == len(ds) - len(ds) % 16  # drop_last: whole batches only
        print(
            f"read {seen} of {len(ds)} samples from {args.shards} shards in s3://raydl-example over "
            f"{endpoint} ({stats.images_per_s:.0f} images/s, {stats.samples_skipped} skipped)"
        )
        ray.shutdown()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
