"""The `raydl` command: `raydl demo`, `raydl make-images`, `raydl bench loader|storage|checkpoint|cluster|
control-plane|listing|cache|mix`, `raydl fabric-info`, `raydl index`, `raydl cache info|clear`."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="load a generated image folder with two ranks on a local Ray")
    p.add_argument("--images", type=int, default=512, help="images to generate (default 512)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="batch size of each rank without --config (default 64)"
    )
    p.add_argument(
        "--config",
        default=None,
        help="loader settings: the `loader:` section of a YAML config (e.g. configs/local-demo.yaml)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config value, e.g. --set loader.batch_size=32 (repeatable)",
    )
    p.add_argument("--dir", default=None, help="where to write the images (default: a temporary folder)")
    p.set_defaults(func=lambda args: _demo(p, args))


def _demo(p, args) -> int:
    """`raydl demo`, once its flags agree: --set changes a config, and a config sets the batch size."""
    if args.set and not args.config:
        p.error("--set changes values of a config file: give it with --config")
    if args.config and args.batch_size is not None:
        p.error("--batch-size is for a run without --config; with one, use --set loader.batch_size=N")
    from raydl.demo import main as demo_main

    return demo_main(args)


def _add_make_images(sub) -> None:
    from raydl.bench import make_images

    make_images.add_parser(sub)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for name, module_name in (
        ("loader", "loader"),
        ("storage", "storage"),
        ("checkpoint", "checkpoint"),
        ("cluster", "cluster"),
        ("control-plane", "control_plane"),
        ("listing", "listing"),
        ("cache", "cache"),
        ("mix", "mix"),
    ):
        try:
            module = importlib.import_module(f"raydl.bench.{module_name}")
        except ImportError as exc:  # an optional peer or plotting package is missing: say so when asked
            why = str(exc)
            bp = bench_sub.add_parser(name, help=f"unavailable: {why}")
            bp.set_defaults(
                func=lambda args, name=name, why=why: sys.exit(f"raydl bench {name} is unavailable: {why}")
            )
            continue
        module.add_parser(bench_sub)
        bench_sub.choices[name].set_defaults(func=module.main)


def _add_fabric_info(sub) -> None:
    p = sub.add_parser("fabric-info", help="libfabric providers: which fit raydl's RMA path, and why not")
    p.set_defaults(func=lambda args: __import__("raydl.native.pyfi", fromlist=["x"]).fabric_info_main(args))


def _add_index(sub) -> None:
    p = sub.add_parser(
        "index", help="build a WebDataset index file ahead of time (read_webdataset(index=PATH))"
    )
    p.add_argument(
        "urls", nargs="+", help="shards: brace patterns, globs or URLs, local or s3://, gs://, az://"
    )
    p.add_argument("--out", required=True, help="the index file to write (a local path)")
    p.add_argument("--s3-endpoint-url", default=None, help="an S3-compatible endpoint")
    p.add_argument("--gcs-endpoint-url", default=None, help="a GCS endpoint (default: STORAGE_EMULATOR_HOST)")
    p.add_argument("--gcs-anonymous", action="store_true", help="read gs:// without credentials")
    p.add_argument("--azure-endpoint-url", default=None, help="the Azure blob endpoint, with the account")
    p.add_argument(
        "--azure-account-name", default=None, help="the Azure storage account (credentials: Azure's defaults)"
    )
    p.set_defaults(func=_index_main)


def _index_main(args) -> int:
    from raydl.options import AzureOptions, GCSOptions, S3Options
    from raydl.sources.webdataset import index_webdataset
    from raydl.storage import storage_for

    s3 = S3Options(endpoint_url=args.s3_endpoint_url) if args.s3_endpoint_url else None
    gcs = None
    if args.gcs_endpoint_url or args.gcs_anonymous:
        gcs = GCSOptions(endpoint_url=args.gcs_endpoint_url, anonymous=args.gcs_anonymous)
    azure = None
    if args.azure_endpoint_url or args.azure_account_name:
        azure = AzureOptions(endpoint_url=args.azure_endpoint_url, account_name=args.azure_account_name)
    urls = [u[len("file://") :] if u.startswith("file://") else u for u in args.urls]
    shards, members = index_webdataset(
        urls, storage_of=lambda u: storage_for(u, s3, gcs=gcs, azure=azure), out=args.out
    )
    print(f"raydl index: wrote {args.out}: {shards} shards, {members} members")
    return 0


def _add_cache(sub) -> None:
    p = sub.add_parser(
        "cache", help="show or empty this node's cache folder (loader(cache=raydl.Cache(...)))"
    )
    cache_sub = p.add_subparsers(dest="cache_command", required=True)
    for name, what in (
        ("info", "entries, bytes, max_bytes, oldest and newest use"),
        ("clear", "remove every entry"),
    ):
        cp = cache_sub.add_parser(name, help=what)
        cp.add_argument("path", help="the cache folder (raydl.Cache's path)")
        cp.add_argument("--group", help="the group that shares the folder (raydl.Cache's group), if any")
        cp.set_defaults(func=_cache_main)


def _cache_main(args) -> int:
    import os
    import time

    from raydl.storage.cache import ENTRIES, NodeCache

    if not os.path.isdir(os.path.join(args.path, ENTRIES)):
        print(f"raydl cache: {args.path} is no raydl cache folder (it has no {ENTRIES}/)", file=sys.stderr)
        return 2
    cache = NodeCache(args.path, 0, args.group)  # 0: keep the max_bytes the loaders recorded
    try:
        if args.cache_command == "clear":
            print(f"raydl cache: removed {cache.clear()} entries from {cache.path}")
            return 0
        info = cache.info()
    except PermissionError as exc:  # a link, or a folder of another user's or group's: refused, untouched
        print(f"raydl cache: {exc}", file=sys.stderr)
        return 2

    def when(t):
        return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))

    limit = "unknown" if info["max_bytes"] is None else f"{info['max_bytes']:,}"
    print(f"path        {info['path']}")
    print(f"entries     {info['entries']:,}")
    print(f"bytes       {info['bytes']:,}")
    print(f"max_bytes   {limit}")
    print(f"oldest use  {when(info['oldest'])}")
    print(f"newest use  {when(info['newest'])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raydl", description="Ray-distributed data loader for training")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_make_images(sub)
    _add_bench(sub)
    _add_fabric_info(sub)
    _add_index(sub)
    _add_cache(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
