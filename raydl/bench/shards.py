"""Copies of an image folder as WebDataset shards and as Parquet, for benchmarks and examples.

    python -m raydl.bench.shards IMAGE_DIR OUT_DIR [--per-shard 256] [--row-group 64]
        [--upload s3://bucket/prefix --endpoint-url URL]
    python -m raydl.bench.shards IMAGE_DIR OUT_DIR --clip [--per-shard 256] [--seed 0]
    python -m raydl.bench.shards --tokens OUT_DIR [--rows 102400] [--files 8] [--row-group 512] [--seed 0]
        [--megatron-tokens 200000000]

OUT_DIR/wds/shard-000000.tar ... hold the images in sorted key order, each as
<class>/<name>.<ext> with a <class>/<name>.cls member (the folder's label);
OUT_DIR/parquet/data.parquet holds columns image (bytes) and label (int64).
With --upload both trees are copied to the S3 prefix.

--clip writes OUT_DIR/clip/shard-000000.tar ... instead: LAION-style samples
(.jpg, a .txt caption, a .json of metadata) written with webdataset's TarWriter,
for `raydl bench loader --workload clip` (raydl/bench/_clip.py). --tokens needs
no image folder and writes OUT_DIR/tokens/part-00000.parquet ...: rows of 2,048
int32 tokens, and OUT_DIR/megatron/corpus-N.bin/.idx: a Megatron-LM corpus of N
uint16 tokens (--megatron-tokens; 0 writes none), for `--workload tokens`
(raydl/bench/_tokens.py, raydl/bench/_windows.py).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
from pathlib import Path

__all__ = ["write_parquet", "write_webdataset"]


def _samples(folder: str):
    import raydl

    cat = raydl.read_images(folder).catalog
    loc = cat.source.locate(cat, range(len(cat)))
    return loc.key, loc.label.tolist()


def write_webdataset(folder: str, out: str, *, per_shard: int = 256) -> list[str]:
    """The folder's images as uncompressed tar shards; returns their paths."""
    keys, labels = _samples(folder)
    Path(out).mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, len(keys), per_shard):
        path = os.path.join(out, f"shard-{s // per_shard:06d}.tar")
        with tarfile.open(path, "w") as tar:
            for key, label in zip(keys[s : s + per_shard], labels[s : s + per_shard], strict=True):
                stem = key.rsplit(".", 1)[0]
                for name, data in (
                    (key, Path(folder, key).read_bytes()),
                    (stem + ".cls", str(label).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def write_parquet(folder: str, out: str, *, row_group: int = 64) -> str:
    """The folder's images as one Parquet file (image, label); returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys, labels = _samples(folder)
    Path(out).mkdir(parents=True, exist_ok=True)
    table = pa.table({"image": [Path(folder, k).read_bytes() for k in keys], "label": labels})
    path = os.path.join(out, "data.parquet")
    pq.write_table(table, path, row_group_size=row_group)
    return path


def _upload(root: str, prefix: str, endpoint_url: str | None) -> int:
    import boto3

    from raydl.storage.s3 import split_s3

    bucket, key_prefix = split_s3(prefix)
    client = boto3.client("s3", endpoint_url=endpoint_url)
    try:
        client.create_bucket(Bucket=bucket)
    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        pass
    n = 0
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            client.upload_file(
                str(path), bucket, f"{key_prefix.rstrip('/')}/{path.relative_to(root).as_posix()}"
            )
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m raydl.bench.shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="IMAGE_DIR OUT_DIR",
        help="the image folder and the output folder (--tokens: the output folder alone)",
    )
    p.add_argument("--per-shard", type=int, default=256)
    p.add_argument("--row-group", type=int, help="rows per row group (default: 64; --tokens: 512)")
    p.add_argument(
        "--clip", action="store_true", help="write the clip workload's shards (jpg, txt, json) only"
    )
    p.add_argument("--tokens", action="store_true", help="write the tokens workload's files only")
    p.add_argument("--rows", type=int, help="--tokens: rows of 2,048 tokens (default: 102,400, 800 MiB)")
    p.add_argument("--files", type=int, default=8, help="--tokens: Parquet files (default: %(default)s)")
    p.add_argument(
        "--megatron-tokens",
        type=int,
        default=200_000_000,
        help="--tokens: tokens of the Megatron corpus OUT_DIR/megatron/corpus-N (default %(default)s; "
        "0: none)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="--clip, --tokens: what the captions/tokens are drawn from"
    )
    p.add_argument("--upload", help="s3://bucket/prefix to copy OUT_DIR's wds/ and parquet/ to")
    p.add_argument("--endpoint-url")
    args = p.parse_args(argv)
    if args.tokens:
        from raydl.bench._tokens import DEFAULT_ROWS, write_token_parquet

        if len(args.paths) != 1 or args.clip:
            p.error("--tokens takes one folder, OUT_DIR, and no --clip")
        out = os.path.join(args.paths[0], "tokens")
        files = write_token_parquet(
            out,
            rows=args.rows or DEFAULT_ROWS,
            files=args.files,
            row_group=args.row_group or 512,
            seed=args.seed,
        )
        print(f"{len(files)} Parquet files in {out}", file=sys.stderr)
        if args.megatron_tokens:
            from raydl.bench._windows import corpus_prefix, write_megatron_corpus

            prefix = corpus_prefix(args.paths[0], args.megatron_tokens)
            write_megatron_corpus(prefix, tokens=args.megatron_tokens, seed=args.seed)
            print(f"a Megatron corpus of {args.megatron_tokens} tokens in {prefix}.bin/.idx", file=sys.stderr)
        return 0
    if len(args.paths) != 2:
        p.error("give IMAGE_DIR and OUT_DIR")
    folder, out = args.paths
    if args.clip:
        from raydl.bench._clip import write_clip_shards

        shards = write_clip_shards(
            folder, os.path.join(out, "clip"), per_shard=args.per_shard, seed=args.seed
        )
        print(f"{len(shards)} clip shards in {out}/clip", file=sys.stderr)
        return 0
    shards = write_webdataset(folder, os.path.join(out, "wds"), per_shard=args.per_shard)
    table = write_parquet(folder, os.path.join(out, "parquet"), row_group=args.row_group or 64)
    print(f"{len(shards)} shards in {out}/wds, {table}", file=sys.stderr)
    if args.upload:
        n = _upload(out, args.upload, args.endpoint_url)
        print(f"uploaded {n} files to {args.upload}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
