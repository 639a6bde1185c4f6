"""The `raydl` command: `raydl demo`, `raydl bench loader`."""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="load a generated image folder with two ranks on a local Ray")
    p.add_argument("--images", type=int, default=512, help="images to generate (default 512)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--config", default=None, help="loader settings from a YAML file (e.g. configs/demo.yaml)")
    p.add_argument("--dir", default=None, help="where to write the images (default: a temporary folder)")
    p.set_defaults(func=lambda args: __import__("raydl.demo", fromlist=["main"]).main(args))


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmarks")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    try:
        from raydl.bench import loader as bench_loader
    except ImportError as exc:  # the bench package is optional at import time only
        lp = bench_sub.add_parser("loader", help=f"unavailable: {exc}")
        lp.set_defaults(func=lambda args: sys.exit(f"raydl bench loader is unavailable: {exc}"))
        return
    bench_loader.add_parser(bench_sub)
    bench_sub.choices["loader"].set_defaults(func=bench_loader.main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raydl", description="Ray-distributed data loader for training")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_bench(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
