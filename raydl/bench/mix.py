"""`raydl bench mix`: what mixing costs. A mix of N image folders (a 1/N share each, by weight) against
one folder of the same images, on the same pipeline.

    raydl bench mix [--images 2000 | --data DIR] [--sources 3] [--batching stratified] [--epochs 3]
        [--batch-size 64] [--rounds 3] [--json PATH]

The image set (`raydl make-images`' in1k-like crops, or --data) is split, file i into folder i mod N
(hard links), keeping the class folders. Rows: "one source" reads the whole set with
`read_images(DIR)`; "mix" reads `raydl.mix({"s0": ds0, ...}, weights={each 1/N}, batching=...)`, each
source with its own copy of the train pipeline (decode, RandomResizedCrop 224, flip, ImageNet
normalize). The epoch is the same size (the sources' sizes summed) and every image is read once per
epoch in both. Each run is --epochs epochs in a fresh process (`raydl.bench._epochs`; between epochs 1
and 2 the loader is `refresh()`ed, untimed, so that its coordinator's start is in no epoch), the two rows
taking turns round by round (one, mix; then mix, one; ...). The cost is the mix's extra loader CPU per
image in epochs 2-N (mix/one - 1), per round and its median; the goal is <= 3%. Beside it, 1 - mix/one of
images/s, which on a shared machine swings more from round to round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from raydl.bench._epochs_report import (
    child_env,
    epoch_table,
    image_folder,
    later_rate,
    median_epochs,
    process_split,
    run_measurement,
)

__all__ = ["add_parser", "costs", "main", "render", "split_folder"]

ROWS = ("one", "mix")
LABELS = {"one": "one source", "mix": "mix"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "mix",
        help="what a weighted mix of image folders costs against one folder of the same images",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=2000, help="in1k-like images to generate (default 2000)")
    p.add_argument("--data", help="an existing image folder (DIR/class/*.jpg) instead of generated images")
    p.add_argument("--sources", type=int, default=3, help="folders to mix (default 3)")
    p.add_argument("--batching", default="stratified", choices=["stratified", "per_source"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus", type=int, default=len(os.sched_getaffinity(0)), help="Ray's CPUs per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    p.add_argument("--json", help="write every measurement and the table here")
    p.set_defaults(func=main)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_args(args: argparse.Namespace) -> None:
    """A ValueError naming the flag that cannot work."""
    for flag in ("images", "sources", "epochs", "batch_size", "rounds", "cpus"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.sources < 2:
        raise ValueError(f"--sources {args.sources}: a mix needs at least 2")
    if args.data is None and args.images < max(2 * args.batch_size, args.sources):
        raise ValueError(f"--images {args.images} make under 2 batches of {args.batch_size}")


def split_folder(folder: str, parts: int, out: Path) -> list[str]:
    """`folder`'s images, file i (in sorted order) into out/part-(i mod parts)/<same relative path>, hard
    linked (symlinked across filesystems); the part folders."""
    from raydl.bench._transform import link_into, list_images

    files = list_images(folder)
    roots = [out / f"part-{k}" for k in range(parts)]
    for k, root in enumerate(roots):
        link_into(files[k::parts], folder, root)
    return [str(r) for r in roots]


def main(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as exc:
        _log(f"error: {exc}")
        return 2
    import raydl

    if not hasattr(raydl, "mix"):
        _log("error: this build has no raydl.mix")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="raydl-bench-mix-"))
    env = child_env()
    runs = []
    try:
        folder = image_folder(args.data, args.images, tmp / "images", seed=args.seed)
        parts = split_folder(folder, args.sources, tmp / "parts")
        _log(f"{folder} split into {args.sources} folders; {args.rounds} round(s) of one, mix")
        for r in range(1, args.rounds + 1):
            for row in ROWS if r % 2 else ROWS[::-1]:
                spec = {
                    "row": row,
                    "peer": "raydl-mix" if row == "mix" else "raydl",
                    "source": "images",
                    "data": parts if row == "mix" else folder,
                    "batching": args.batching,
                    "epochs": args.epochs,
                    "batch_size": args.batch_size,
                    "cpus": args.cpus,
                    "seed": args.seed,
                }
                t0 = time.perf_counter()
                out = run_measurement(spec, env, timeout_s=args.timeout, log=tmp / "run.log")
                out.update(round=r, name=row)
                runs.append(out)
                _progress(out, time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = {row: median_epochs([r for r in runs if r["name"] == row]) for row in ROWS}
    cost = costs(runs)
    print(render(table, cost, args, {row: process_split(runs, row) for row in ROWS}))
    if args.json:
        record = {"args": vars(args) | {"func": None}, "epochs": table, "costs": cost, "runs": runs}
        Path(args.json).write_text(json.dumps(record))
        _log(f"wrote {args.json}")
    return 0 if all(r.get("ok") for r in runs) else 1


def _progress(out: dict, took: float) -> None:
    head = f"[round {out['round']}] {out['name']:<4}"
    if not out.get("ok"):
        _log(f"{head} FAILED: {out.get('error')}\n{out.get('log_tail', '')}")
        return
    cells = [f"e{e['epoch']} {e['images_per_s'] or 0:6.1f} img/s" for e in out["epochs"]]
    _log(f"{head} " + "  ".join(cells) + f"  ({took:.0f} s)")


def _cpu_ms(epochs: list[dict], later: bool) -> float | None:
    chosen = epochs[1:] if later else epochs[:1]
    images = sum(e["images"] for e in chosen)
    return 1000 * sum(e["loader_cpu_s"] for e in chosen) / images if images else None


def costs(runs: list[dict]) -> dict:
    """The mix's cost against one source (pure): per round, 1 - mix/one of epoch 1's images/s, of epochs
    2-N's, and the mix's extra CPU per image in epochs 2-N; with their medians over the rounds."""
    per_round = []
    for r in sorted({run["round"] for run in runs}):
        got = {run["name"]: run for run in runs if run["round"] == r and run.get("ok")}
        if set(got) != set(ROWS):
            continue
        one, mix = got["one"]["epochs"], got["mix"]["epochs"]
        row = {"round": r}
        if one[0]["images_per_s"] and mix[0]["images_per_s"]:
            row["epoch1"] = 1 - mix[0]["images_per_s"] / one[0]["images_per_s"]
        if later_rate(one) and later_rate(mix):
            row["later"] = 1 - later_rate(mix) / later_rate(one)
            cpu_one, cpu_mix = _cpu_ms(one, True), _cpu_ms(mix, True)
            if cpu_one and cpu_mix:
                row["later_cpu"] = cpu_mix / cpu_one - 1
        per_round.append(row)
    medians = {
        key: statistics.median(vals)
        for key in ("epoch1", "later", "later_cpu")
        if (vals := [p[key] for p in per_round if key in p])
    }
    return {"per_round": per_round, **medians}


def render(table: dict, cost: dict, args: argparse.Namespace, split: dict | None = None) -> str:
    """The command's output: the per-epoch table (medians) and the cost lines (pure)."""
    out = [
        f"raydl bench mix: {args.sources} sources ({args.batching}, weight 1/{args.sources} each) against "
        f"one source of the same images; {args.epochs} epochs, batch {args.batch_size}, {args.cpus} CPUs, "
        f"median of {args.rounds} round(s)",
        "",
        epoch_table([(LABELS[row], table[row]) for row in ROWS], requests=False),
        "",
    ]
    rounds = ", ".join(
        f"r{p['round']} " + " / ".join(f"{100 * p[k]:+.1f}%" for k in ("epoch1", "later") if k in p)
        for p in cost["per_round"]
    )
    if "later_cpu" in cost:
        met = "met" if cost["later_cpu"] <= 0.03 else "missed"
        out.append(
            f"  * the mix costs {100 * cost['later_cpu']:+.1f}% loader CPU per image in epochs "
            f"2-{args.epochs} (mix/one - 1, median of the rounds'; goal <= 3%: {met})"
        )
    if "later" in cost:
        out.append(
            f"  * and {100 * cost['later']:+.1f}% of images/s in epochs 2-{args.epochs} (1 - mix/one, "
            f"median of the rounds'); epoch 1: {100 * cost.get('epoch1', 0):+.1f}%"
        )
    if rounds:
        out.append(f"  * per round, epoch 1 / epochs 2-N (negative: the mix was faster): {rounds}")
    for row, kinds in (split or {}).items():
        if kinds:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items())
            out.append(f"  * {LABELS[row]}: loader CPU by process, epochs 2-{args.epochs}, ms/img: {parts}")
    return "\n".join(out)
