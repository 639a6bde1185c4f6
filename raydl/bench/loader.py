"""`raydl bench loader`: raydl against other loaders, side by side, on the same files.

    raydl bench loader --data /data/in1k --compare torch,raydata,dataio,datago \\
        --cpus 8 --rounds 3 --json bench.json --plot bench.png
    raydl bench loader --data /data/hires --workload buckets --compare raydl-fast,datago,dali,spdl
    raydl bench loader --data /data/in1k --compare dataio --nodes 3    # raydl on a local 3-node Cluster
    raydl bench loader --data /data/in1k --compare dataio --running-cluster  # raydl joins a running head
    raydl bench loader --source webdataset --data 's3://bucket/in1k/shard-{000..009}.tar' \\
        --endpoint-url http://127.0.0.1:9000 --baseline-data '/data/in1k-wds/shard-{000..009}.tar'
    python -m raydl.bench.shards /data/in1k /data/bench --clip       # LAION-style jpg + txt + json shards
    raydl bench loader --workload clip --data /data/bench/clip --compare torch,raydata,dataio
    python -m raydl.bench.shards --tokens /data/bench   # 102,400 rows of 2,048 tokens; 200 M Megatron tokens
    raydl bench loader --workload tokens --data /data/bench --compare torch,raydata,megatron

Object stores and sharded formats (`--source webdataset|parquet`, `--data s3://...`)
are read by raydl only (the other peers read local image folders); `--baseline-data`
adds a second raydl row ("raydl-base") reading other data of the same source in the
same interleaved rounds, e.g. the same shards on local disk.

Workloads: "train" (decode, RandomResizedCrop 224, flip, ImageNet normalize,
float32 NCHW) and "buckets" (decode, crop and resize into the nearest of
datago's aspect-ratio buckets for size 512, multiple 32, ratios 0.5-2.0, uint8
NHWC, bucket-pure batches), and two that read other data: "clip" (WebDataset shards
with a caption and metadata per image, the train pipeline, captions as str;
raydl/bench/_clip.py) and "tokens", two tables: Parquet rows of 2,048 int32 tokens as
(B, 2048) int tensors (raydl/bench/_tokens.py), and shuffled windows of --seq-len
tokens from a Megatron .bin/.idx corpus (raydl/bench/_windows.py), rates in rows/s or
windows/s and tokens/s, after the first batch and over the whole epoch from the
run's process start. Every run is one
epoch of the workload in a fresh subprocess
(`python -m raydl.bench._runner`), and the peers take turns, in another order each round
(a balanced Latin square: over n rounds, 2n for an odd n of peers, each peer runs once
in every place and right after every other peer equally often), so that a noisy
neighbour, a warming page cache or the previous run's exit hits them all alike (Ray's workers
run at niceness 0 here, as every other peer's threads, not Ray's default 15). Each figure
in the table is the median over the rounds:

* images/s: images after the first batch / time from the first batch to the last,
  in brackets and without a ratio when that window is under 1 s or 3 batches;
* first batch: seconds from listing the data and building the loader (after `ray.init`) to batch one
  (a note splits raydl's into listing, `loader()`, until the driver starts its first task, the task
  and the hand-over to the caller, with each process's CPU meanwhile: Ray's own start-up shows there);
* from start: seconds from the run's process start (imports, `ray.init`, loader) to batch one (a note
  splits raydl's into imports, `ray.init` and the first batch, against each peer's in the same round).
  With `--running-cluster` the bench starts `ray start --head` on 127.0.0.1 first (same CPUs, token
  authentication off) and stops it by PID at the end; each raydl run is a fresh process that connects
  to it, so "from start" compares whole start-ups on a cluster that is already up. The cluster's
  processes are sampled with the run's (memory and CPU columns);
* peak PSS: the process tree's largest summed PSS while the epoch ran (Ray's own processes
  included; a note splits raydl's by process); own PSS and Ray PSS: the peak of the peer's own
  processes alone (raydl's driver, LoaderWorker(s) and LoaderCoordinator) and of Ray's services
  alone (GCS, raylet, agents, idle workers);
* CPU ms/img: user+system CPU of the whole tree during the epoch, per image;
* steady CPU ms/img: the same from the first batch on (start-up left out), per image after it:
  on a loaded machine the fairest measure of work per image;
* x raydl: the peer's images/s over raydl's.

With `--epochs N` (N > 1) each run goes on for N epochs of the same loader (for the
peers that can: raydl, torch, raydata (its pipeline again each epoch), dataio, megatron,
ceiling, floor) and two more columns show the epochs after the first: "later img/s"
(their images / the time from the first epoch's last batch, or from raydl's refresh()
after it, to the last one) and "later CPU ms/img" (the tree's CPU over that time, per
image). They leave out the one-off start-up (Ray, actor processes, the first batches),
which a long run pays once: between epochs 1 and 2 raydl's loader is `refresh()`ed,
untimed, which starts its coordinator if it has not started yet. Every other column
keeps its meaning: it is the first epoch's, as without --epochs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raydl.bench._epochs_report import kill_tree as _kill_tree
from raydl.bench._tokens import SEQ_LEN
from raydl.bench._transform import link_into, list_images
from raydl.bench._windows import DEFAULT_SEQ_LEN, DEFAULT_TOKENS, DEFAULT_WINDOW_BATCH
from raydl.bench.peers import (
    BUCKET_NOTES,
    MULTI_EPOCH,
    NOTES,
    PEERS,
    REQUIRES,
    WHY_NOT,
    WORKLOAD_NOTES,
    WORKLOAD_REQUIRES,
    WORKLOADS,
)
from raydl.bench.report import (
    format_table,
    peer_versions,
    per_sample,
    ray_service,
    short_rate,
    summarize,
    write_plot,
)

__all__ = ["add_parser", "main"]

# raydl-image/-ordered: their workloads' own; megatron: megatron-core's reader in the tokens windows table
_COMPARABLE = [p for p in PEERS if p not in ("raydl", "raydl-base", "ceiling")] + ["megatron"]
_OWN_DATA = ("clip", "tokens")  # workloads whose --data is their own (shards, Parquet), not an image folder
_UNITS = {"tokens": "rows", "windows": "windows"}  # what a sample is, where not an image
DEFAULT_BATCH = 256
MIN_BATCHES = 8  # images/s counts from the first batch to the last: a few batches give a noisy figure


def batch_size_for(requested: int | None, images: int) -> int:
    """--batch-size, or else DEFAULT_BATCH made smaller so that `images` fill MIN_BATCHES batches.

    With fewer than 2 batches there is no rate to measure (the window starts at
    the first batch): a ValueError that says how many images the bench needs.
    """
    batch = requested or min(DEFAULT_BATCH, max(1, images // MIN_BATCHES))
    if images < 2 * batch:
        smaller = f", or --batch-size {images // 2} or less" if images >= 2 else ""
        raise ValueError(
            f"{images} image(s) make 1 batch of {batch}, and images/s is counted from the first batch to "
            f"the last: the bench needs at least {2 * batch} images at batch {batch} "
            f"({MIN_BATCHES * batch} for a steady figure){smaller}"
        )
    return batch


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add `loader` to a `raydl bench` subparser group."""
    p = subparsers.add_parser(
        "loader",
        help="compare raydl with other loaders on one image folder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data",
        required=True,
        help="image folder (DIR/class/*.jpg), or with --source the shards/files; local or s3://",
    )
    p.add_argument(
        "--source",
        default="images",
        choices=["images", "webdataset", "parquet"],
        help="how --data is laid out (default: %(default)s)",
    )
    p.add_argument("--endpoint-url", help="S3 endpoint for s3:// data (default: boto3's configuration)")
    p.add_argument("--image-column", default="image", help="parquet: the image column")
    p.add_argument("--label-column", default="label", help="parquet: the label column")
    p.add_argument("--baseline-data", help="a second raydl row (raydl-base) reading this data, same --source")
    p.add_argument(
        "--workload",
        default="train",
        choices=["train", "buckets", *_OWN_DATA],
        help="train: decode, RandomResizedCrop(224), flip, normalize, float32 NCHW; "
        "buckets: decode, crop+resize into datago's 512 aspect buckets, uint8 NHWC; "
        "clip: train on WebDataset shards with captions and metadata (python -m raydl.bench.shards --clip); "
        "tokens: Parquet rows of 2,048 int32 tokens (python -m raydl.bench.shards --tokens)",
    )
    p.add_argument(
        "--compare",
        default="torch,raydata",
        help=f"comma-separated peers from {','.join(_COMPARABLE)} (default: %(default)s)",
    )
    p.add_argument(
        "--cpus",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="CPU budget of every peer (default: all usable cores)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="run the raydl rows on a local ray.cluster_utils.Cluster of N nodes sharing --cpus "
        "(each max(1, cpus // N) CPUs, default threads); the other peers are unaffected",
    )
    p.add_argument(
        "--running-cluster",
        action="store_true",
        help="start a Ray head (ray start --head on 127.0.0.1, --cpus CPUs) before the rounds and run "
        "raydl as a fresh process that connects to it; 'from start' then compares whole start-ups "
        "(stopped by PID at the end)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="epochs of the same loader per run; > 1 adds the later epochs' img/s and CPU (default: 1)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"images per batch (default: {DEFAULT_BATCH}, or less where the data would make under "
        f"{MIN_BATCHES} batches of {DEFAULT_BATCH})",
    )
    p.add_argument("--limit", type=int, help="use only the first N images (sorted by path)")
    p.add_argument(
        "--part",
        default="both",
        choices=["rows", "windows", "both"],
        help="tokens: the Parquet rows table, the Megatron windows table, or both (default: %(default)s)",
    )
    p.add_argument(
        "--megatron-tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help="tokens windows: the Megatron corpus's size, DATA/megatron/corpus-N.bin/.idx, written first "
        "where missing (default: %(default)s)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=DEFAULT_SEQ_LEN,
        help="tokens windows: tokens of a window's input ids (default: %(default)s)",
    )
    p.add_argument(
        "--window-batch-size",
        type=int,
        default=DEFAULT_WINDOW_BATCH,
        help="tokens windows: windows per batch (default: %(default)s)",
    )
    p.add_argument(
        "--checksum",
        action="store_true",
        help="each run reports a digest of the rows it delivered, the same for every peer that delivers the "
        "same rows (costs time in every batch: for checks, not for figures)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every round and the medians here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the decode-only ceiling line")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin each run to --cpus cores (pinning keeps native pools in budget)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed")
    p.add_argument("-v", "--verbose", action="store_true", help="show each run's own stderr")
    p.set_defaults(func=main)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _missing(peer: str, workload: str = "train") -> str | None:
    """Why a peer cannot run here, with the install line, or None."""
    modules, hint = WORKLOAD_REQUIRES.get(workload, {}).get(peer, REQUIRES[peer])
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{peer} skipped: {', '.join(absent)} not installed ({hint})" if absent else None


def _run_once(peer: str, args, data: str, expected: int, logdir: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "raydl.bench._runner",
        "--peer",
        peer,
        "--data",
        data,
        "--cpus",
        str(args.cpus),
        "--expected",
        str(expected),
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
        "--workload",
        args.workload,
        "--source",
        args.source,
        "--image-column",
        args.image_column,
        "--label-column",
        args.label_column,
    ]
    if args.endpoint_url:
        cmd += ["--endpoint-url", args.endpoint_url]
    if args.nodes > 1 and peer.startswith("raydl"):
        cmd += ["--nodes", str(args.nodes)]
    if getattr(args, "ray_address", None) and peer.startswith("raydl"):
        cmd += ["--ray-address", args.ray_address, "--cluster-pid", str(args.cluster_pid)]
    if args.epochs > 1 and peer in MULTI_EPOCH:
        cmd += ["--epochs", str(args.epochs)]
    if args.workload == "windows":
        cmd += ["--seq-len", str(args.seq_len)]
    if getattr(args, "checksum", False):
        cmd.append("--checksum")
    if args.no_pin:
        cmd.append("--no-pin")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # every Ray peer must start its own local instance, as a child
    # Ray starts its workers at niceness 15; every other peer's threads run at 0. On a shared
    # machine, other load would then take CPU from the Ray peers' budget alone.
    env.setdefault("RAY_worker_niceness", "0")
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    log = logdir / f"{peer}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=None if args.verbose else err,
            env=env,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.communicate()
            return {"peer": peer, "ok": False, "error": f"timed out after {args.timeout:.0f} s"}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        tail = "" if args.verbose else "".join(log.read_text().splitlines(True)[-15:])
        return {
            "peer": peer,
            "ok": False,
            "error": f"runner exited {proc.returncode} without a result\n{tail}",
        }
    row = json.loads(lines[-1])
    if not row.get("ok") and not args.verbose:
        row["stderr_tail"] = "".join(log.read_text().splitlines(True)[-15:])
    return row


def _count(args, data: str) -> int:
    """Samples in `data` as raydl lists them (for sources other than a local image folder)."""
    from raydl.bench._clock import PeerSpec
    from raydl.bench.peers import raydl_source

    spec = PeerSpec(
        data=data,
        cpus=1,
        batch_size=1,
        seed=0,
        expected=0,
        source=args.source,
        endpoint_url=args.endpoint_url,
        image_column=args.image_column,
        label_column=args.label_column,
    )
    return len(raydl_source(spec))


def _own_count(workload: str, data: str, seq_len: int = 0) -> int:
    """Samples (clip), rows (tokens) or windows (windows) in the data of a workload with its own data."""
    if workload == "windows":
        from raydl.bench._windows import corpus_windows

        return corpus_windows(data, seq_len)
    if workload == "clip":
        from raydl.bench._clip import clip_count

        return clip_count(data)
    from raydl.bench._tokens import token_rows

    return token_rows(data)


def _progress(i: int, rounds: int, row: dict, took: float, unit: str = "images") -> None:
    head = f"[round {i}/{rounds}] {row['peer']:<8}"
    one = per_sample(unit)
    if row.get("ok"):
        _log(
            f"{head} {row['images_per_s']:8.1f} {short_rate(unit)}  first batch "
            f"{row['first_batch_s']:6.2f} s  peak {row['peak_pss_mib']:7.0f} MiB  "
            f"{1000 * row['cpu_s_per_image']:6.2f} CPU ms/{one}"
            f"  ({took:.0f} s)" + (f"  WARNING {row['warning']}" if "warning" in row else "")
        )
    else:
        _log(f"{head} FAILED: {row.get('error', '?')}")
        if row.get("stderr_tail"):
            _log("    " + row["stderr_tail"].replace("\n", "\n    "))


def _by_process(ms: dict[str, float]) -> str:
    return ", ".join(f"{kind.removeprefix('ray::')} {v:.2f}" for kind, v in ms.items())


def _memory_note(mem: dict) -> str:
    """Where raydl's memory went in its first round (Loader.memory())."""
    mib = 1 << 20
    arrays = mem["worker_batch_arrays"]
    counts = mem["worker_batch_array_count"]
    return (
        f"raydl memory: batch {mem['batch_bytes'] / mib:.0f} MiB; reused batch arrays "
        f"{sum(arrays) / mib:.0f} MiB in {len(arrays)} worker(s) ({sum(counts)} arrays, one per batch in "
        f"flight in a worker); object store at most {mem['object_store_batches_max'] / mib:.0f} MiB of "
        f"batches (prefetch depth + 1 tasks per rank, {mem.get('batches_per_task', 1)} batch(es) a task); "
        f"catalog {mem['catalog'] / mib:.2f} MiB (one shared copy)"
    )


def _process_note(run: dict) -> str:
    """raydl's peak PSS split by process (the runner's kinds: this process is the driver)."""
    shmem = run.get("peak_shmem_by_process_mib", {})
    parts = ", ".join(
        f"{kind.removeprefix('ray::')} {mib:.0f}" + (f" ({shmem[kind]:.0f} shared)" if kind in shmem else "")
        for kind, mib in run["peak_pss_by_process_mib"].items()
    )
    by = run["peak_pss_by_process_mib"]
    ours = sum(mib for kind, mib in by.items() if not ray_service(kind))
    return (
        f"raydl peak PSS by process, round {run['round']} (MiB; 'this process' is the driver; "
        f"'shared': its share of shared-memory pages, i.e. the object store's batches): "
        f"{parts}; raydl's processes {ours:.0f}, Ray's own {sum(by.values()) - ours:.0f}"
    )


def _own_memory_note(summary: list[dict], epochs: int) -> str | None:
    """own PSS and Ray PSS, said in words, and raydl's own against each peer's (medians, epoch 1; with
    --epochs, also over the whole run in the JSON as later_own_pss_mib)."""
    own = {r["peer"]: r.get("own_pss_mib") for r in summary if r.get("own_pss_mib")}
    if "raydl" not in own:
        return None
    ratios = ", ".join(f"{own['raydl'] / mib:.2f}x {peer}" for peer, mib in own.items() if peer != "raydl")
    return (
        "own PSS MiB: the peak of the peer's own processes alone (raydl: the driver, its LoaderWorker(s) "
        "and LoaderCoordinator; torch: the process and its workers); Ray PSS MiB: the peak of Ray's services "
        "alone (GCS, raylet, dashboard and runtime-env agents, monitors, idle workers); each its own peak, "
        "epoch 1"
        + (f" (the JSON's later_own_pss_mib: all {epochs} epochs)" if epochs > 1 else "")
        + (f"; raydl's own PSS is {ratios}" if ratios else "")
    )


def main(args: argparse.Namespace) -> int:
    """Run the rounds, print the table (two for tokens), write --json/--plot. 0 when every peer ran at least
    once."""
    if args.workload == "tokens":
        return _tokens_main(args)
    try:
        peers, skipped = _peers(args)
        files = _inputs(args, peers, skipped)
    except _Refused as exc:
        _log(f"error: {exc}")
        return 2
    code, report = _table(args, peers, skipped, files, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _log(f"wrote {args.json}")
    return code


def _tokens_main(args: argparse.Namespace) -> int:
    """The tokens workload: the rows of DATA/tokens/*.parquet (or of DATA's own *.parquet), then the windows
    of the Megatron corpus DATA/megatron/corpus-N (written first where missing), each its own table. The
    JSON holds the rows part's report, and the windows part's under "windows"."""
    parts = []
    try:
        rows_data, root = _token_folders(args.data)
        if args.part in ("rows", "both"):
            rows = argparse.Namespace(**vars(args))
            rows.data = rows_data
            peers, skipped = _peers(rows)
            parts.append(("rows", rows, peers, skipped, _inputs(rows, peers, skipped)))
        if args.part in ("windows", "both"):
            windows = argparse.Namespace(**vars(args))
            windows.workload, windows.batch_size = "windows", args.window_batch_size
            if min(args.seq_len, args.window_batch_size, args.megatron_tokens) < 1:
                raise _Refused("--seq-len, --window-batch-size and --megatron-tokens must be positive")
            peers, skipped = _peers(windows)
            windows.data = _megatron_corpus(root, args.megatron_tokens, args.seed)
            parts.append(("windows", windows, peers, skipped, _inputs(windows, peers, skipped)))
    except _Refused as exc:
        _log(f"error: {exc}")
        return 2
    code, report = 0, {"workload": "tokens"}
    for i, (name, part, peers, skipped, files) in enumerate(parts):
        if i:
            print()
        plot = args.plot
        if plot and name == "windows" and args.part == "both":
            plot = str(Path(plot).with_name(Path(plot).stem + "-windows" + Path(plot).suffix))
        part_code, part_report = _table(part, peers, skipped, files, plot)
        code = max(code, part_code)
        if name == "rows":
            report.update(part_report)
        else:
            report["windows"] = part_report
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _log(f"wrote {args.json}")
    return code


def _token_folders(data: str) -> tuple[str, str]:
    """(the Parquet rows' folder or pattern, the folder the Megatron corpus goes under) of a tokens --data:
    DATA/tokens and DATA where DATA holds a tokens folder (what `shards --tokens DATA` writes), else DATA
    and the folder above it (DATA is the Parquet folder itself)."""
    if os.path.isdir(os.path.join(data, "tokens")):
        return os.path.join(data, "tokens"), data
    folder = data if os.path.isdir(data) else os.path.dirname(data)  # a folder, or a glob pattern's folder
    return data, os.path.dirname(os.path.abspath(folder))


def _megatron_corpus(root: str, tokens: int, seed: int) -> str:
    """The prefix of the corpus of `tokens` tokens under `root`, written first where its .idx is missing."""
    from raydl.bench._windows import corpus_prefix, write_megatron_corpus

    prefix = corpus_prefix(root, tokens)
    if not os.path.exists(prefix + ".idx"):
        need = 2 * tokens + 20 * (tokens // 1000)  # the uint16 .bin, and the .idx's 20 bytes a document
        os.makedirs(root, exist_ok=True)
        free = shutil.disk_usage(root).free
        if need > free:
            raise _Refused(
                f"a {tokens}-token corpus needs {need / 1e9:.1f} GB, {root} has {free / 1e9:.1f} GB free"
            )
        t0 = time.perf_counter()
        _log(f"writing the Megatron corpus {prefix}.bin/.idx ({tokens} tokens) ...")
        write_megatron_corpus(prefix, tokens=tokens, seed=seed)
        _log(f"wrote it in {time.perf_counter() - t0:.0f} s")
    return prefix


def _table(
    args, peers: list[str], skipped: dict[str, str], files: list, plot: str | None
) -> tuple[int, dict]:
    """Run one table's rounds, print it and its notes, write the plot; (the exit code, the JSON report)."""
    runs = _rounds(args, peers, files)
    summary = summarize(peers, runs)
    notes = _notes(args, peers, skipped, runs, len(files))
    unit = _UNITS.get(args.workload, "images")
    what = {
        "tokens": f"tokens, rows of {SEQ_LEN} tokens from Parquet",
        "windows": f"tokens, windows of {args.seq_len} tokens from a Megatron corpus, shuffled",
    }.get(args.workload, args.workload)
    print(
        format_table(
            summary,
            header=(
                f"raydl bench loader: workload {what}, {len(files)} {unit} from {args.data}, "
                f"batch {args.batch_size}, {args.cpus} CPUs, median of {args.rounds} round(s)"
            ),
            rate=f"{unit}/s",
            tokens_per_sample=_tokens_per_sample(args),
        )
    )
    print()
    for note in notes:
        print(f"  * {note}")
    report = {
        "workload": args.workload,
        "data": args.data,
        "images": len(files),
        "unit": unit,
        "batch_size": args.batch_size,
        "cpus": args.cpus,
        "rounds": args.rounds,
        "epochs": args.epochs,
        "pinned": not args.no_pin,
        "peers": peers,
        "versions": peer_versions(),
        "summary": summary,
        "runs": runs,
        "skipped": skipped,
        "notes": notes,
    }
    if args.workload == "windows":
        report["seq_len"] = args.seq_len
    if plot:
        write_plot(summary, plot, title=f"{args.workload}: {len(files)} {unit}, {args.cpus} CPUs")
        _log(f"wrote {plot}")
    return (0 if all(s["rounds_ok"] > 0 for s in summary) else 1), report


def _tokens_per_sample(args) -> int | None:
    return {"tokens": SEQ_LEN, "windows": getattr(args, "seq_len", 0)}.get(args.workload)


class _Refused(Exception):
    """The run cannot go ahead; the message says why (main prints it and returns 2)."""


def _peers(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(the peers to run, in order; why each left out was skipped), after the flags are checked."""
    if importlib.util.find_spec("psutil") is None:  # the runner samples memory and CPU with it
        raise _Refused("raydl bench loader needs psutil: pip install 'raydl-loader[bench]'")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise _Refused("--plot needs matplotlib: pip install 'raydl-loader[bench]'")
    batch = 1 if args.batch_size is None else args.batch_size  # None: chosen once the images are counted
    if min(args.cpus, args.rounds, args.nodes, args.epochs, batch) < 1:
        raise _Refused("--cpus, --rounds, --batch-size, --nodes and --epochs must be positive")
    if getattr(args, "running_cluster", False) and args.nodes > 1:
        raise _Refused("--running-cluster runs raydl on one running head node; leave --nodes out")
    wanted = [p.strip() for p in args.compare.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in _COMPARABLE]
    if unknown:
        raise _Refused(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(_COMPARABLE)}")
    # clip: raydl on the same shards with the image alone, to show what the caption and metadata cost
    # tokens: raydl without its per-row shuffle, which reads each row group once, as the peers do
    ours = {"clip": ["raydl", "raydl-image"], "tokens": ["raydl", "raydl-ordered"], "windows": ["raydl"]}.get(
        args.workload, ["raydl"]
    )
    skipped = {p: why for p in [*ours, *wanted] if (why := _missing(p, args.workload))}
    skipped.update(
        {
            p: f"{p} skipped: " + WHY_NOT.get((p, args.workload), f"it has no {args.workload} workload")
            for p in wanted
            if p not in skipped and args.workload not in WORKLOADS[p]
        }
    )
    for why in skipped.values():
        _log(why)
    peers = [p for p in dict.fromkeys([*ours, *wanted]) if p not in skipped]
    ceiling = args.workload in WORKLOADS["ceiling"] and not _missing("ceiling", args.workload)
    if not args.no_ceiling and ceiling:
        peers.append("ceiling")
    return peers, skipped


def _inputs(args: argparse.Namespace, peers: list[str], skipped: dict[str, str]) -> list:
    """The samples to read (image paths, or sample numbers of a remote or sharded source), with
    args.batch_size settled; `peers` loses those that cannot read this source (said in `skipped`)."""
    folder = args.source == "images" and "://" not in args.data
    if args.workload in (*_OWN_DATA, "windows"):
        if args.limit or args.baseline_data or args.source != "images":
            raise _Refused(
                f"--limit, --baseline-data and --source do not apply to --workload {args.workload}"
            )
        try:
            files = list(range(_own_count(args.workload, args.data, args.seq_len)))
        except ValueError as exc:
            raise _Refused(str(exc)) from None
    elif not folder:
        others = [p for p in peers if p not in ("raydl", "raydl-base")]
        for p in others:
            skipped[p] = (
                f"{p} skipped: it reads local image folders only (--source {args.source}, --data {args.data})"
            )
            _log(skipped[p])
        peers[:] = [p for p in peers if p not in others]
        if args.limit:
            raise _Refused("--limit works on local image folders only")
        files = list(range(_count(args, args.data)))
    else:
        files = list_images(args.data)[: args.limit]
    if args.baseline_data and args.workload not in _OWN_DATA:
        base_n = _count(args, args.baseline_data)
        if base_n != len(files):
            raise _Refused(f"--baseline-data has {base_n} samples, --data {len(files)}")
        peers.insert(1, "raydl-base")
    if not files:
        raise _Refused(f"no images under {args.data}")
    requested = args.batch_size
    try:
        args.batch_size = batch_size_for(requested, len(files))
    except ValueError as exc:
        raise _Refused(str(exc)) from None
    if requested is None and args.batch_size < DEFAULT_BATCH:
        batches = -(-len(files) // args.batch_size)
        _log(
            f"batch {args.batch_size}: {len(files)} images make {batches} batches of it (--batch-size "
            f"sets it; the default {DEFAULT_BATCH} needs >= {MIN_BATCHES * DEFAULT_BATCH} images)"
        )
    return files


def _rounds(args: argparse.Namespace, peers: list[str], files: list) -> list[dict]:
    """Every peer once per round, in turn, each in a fresh process: one row per run (with
    --running-cluster, the raydl rows connect to a head started here first and stopped at the end)."""
    tmp = Path(tempfile.mkdtemp(prefix="raydl-bench-"))
    try:
        data = link_into(files, args.data, tmp / "data") if args.limit else args.data
        _log(
            f"{len(files)} {_UNITS.get(args.workload, 'images')}, batch {args.batch_size}, "
            f"{args.cpus} CPUs, "
            f"{args.rounds} round(s) of: {' '.join(peers)}"
        )
        with contextlib.ExitStack() as stack:
            args.ray_address = None
            if getattr(args, "running_cluster", False):
                from raydl.bench._running_cluster import RunningCluster

                cluster = RunningCluster(args.cpus, tmp, pin=not args.no_pin)
                args.ray_address = stack.enter_context(cluster)
                args.cluster_pid = cluster.proc.pid
                _log(
                    f"running cluster: ray start --head on {args.ray_address} (a fresh process's first "
                    f"connection took {cluster.connect_s:.2f} s)"
                )
            runs = []
            for i in range(1, args.rounds + 1):
                for peer in round_order(peers, i):
                    t0 = time.perf_counter()
                    row = _run_once(
                        peer, args, args.baseline_data if peer == "raydl-base" else data, len(files), tmp
                    )
                    _progress(
                        i, args.rounds, row, time.perf_counter() - t0, _UNITS.get(args.workload, "images")
                    )
                    runs.append({"round": i, **row})
            args.ray_address = None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return runs


def round_order(peers: list[str], round_no: int) -> list[str]:
    """The peers' order in round `round_no` (from 1), a balanced Latin square (Williams' design): over n
    rounds (2n for an odd number n of peers, each order then also reversed) every peer runs once in each
    place and right after every other peer equally often, so that neither a place (first after the
    bench's own set-up) nor a neighbour (whose exit, a Ray shutting down or pages written back, lands on
    the next run) favours anyone. Later rounds repeat the cycle."""
    n = len(peers)
    if n < 3:
        return peers[(round_no - 1) % n :] + peers[: (round_no - 1) % n] if n else []
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:  # 0, 1, n-1, 2, n-2, ...
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    r = (round_no - 1) % (n if n % 2 == 0 else 2 * n)
    order = [peers[(b + r) % n] for b in base]
    return order[::-1] if r >= n else order


def _startup_notes(args: argparse.Namespace, runs: list[dict]) -> list[str]:
    """raydl's whole start-up per round (process start to batch one: imports, ray.init or the connection,
    listing to the batch) beside each other peer's from-start in the same round, as a ratio."""
    ours = [r for r in runs if r["peer"] == "raydl" and r.get("ok") and "ray_init_s" in r]
    if not ours:
        return []
    how = "connecting to the running cluster" if getattr(args, "running_cluster", False) else "a local Ray"
    parts = []
    for r in ours:
        whole, first, init = r["first_batch_from_start_s"], r["first_batch_s"], r["ray_init_s"]
        peers = [
            f"{p['peer']} {(theirs := p['first_batch_from_start_s']):.2f} s ({whole / theirs:.2f} x)"
            for p in runs
            if p["round"] == r["round"]
            and p["peer"] != "raydl"
            and p.get("ok")
            and p.get("first_batch_from_start_s")
        ]
        parts.append(
            f"round {r['round']}: {whole:.2f} s = imports {whole - first - init:.2f} + ray.init {init:.2f} + "
            f"first batch {first:.2f}" + (f"; against {', '.join(peers)}" if peers else "")
        )
    return [f"raydl start-up from process start ({how}; raydl / peer in brackets): " + "; ".join(parts)]


def _notes(args: argparse.Namespace, peers: list[str], skipped: dict[str, str], runs: list[dict], n: int):
    """The notes under the table: what each peer does, why some were skipped, and raydl's breakdowns."""
    notes_of = {**NOTES, **BUCKET_NOTES} if args.workload == "buckets" else NOTES
    notes_of = WORKLOAD_NOTES.get(args.workload, notes_of)
    notes = [notes_of[p] for p in peers if p in notes_of] + list(skipped.values())
    summary = summarize(peers, runs)
    notes += _workload_notes(args.workload, summary, seq_len=getattr(args, "seq_len", 0))
    notes += [f"{r['peer']} round {r['round']}: {r['warning']}" for r in runs if "warning" in r]
    own = _own_memory_note(summary, args.epochs)
    if own:
        notes.append(own)
    mem = next((r["memory"] for r in runs if r["peer"] == "raydl" and r.get("memory")), None)
    if mem:
        notes.append(_memory_note(mem))
    by_process = next((r for r in runs if r["peer"] == "raydl" and r.get("peak_pss_by_process_mib")), None)
    if by_process:
        notes.append(_process_note(by_process))
    phased = [r for r in runs if r["peer"] == "raydl" and r.get("first_batch_phases_s")]
    if phased:
        notes.append(
            "raydl first batch, per round: "
            + "; ".join(
                ", ".join(f"{name} {s:.2f} s" for name, s in r["first_batch_phases_s"].items())
                + " (CPU meanwhile: "
                + ", ".join(
                    f"{kind.removeprefix('ray::')} {s:.2f} s"
                    for kind, s in r.get("first_batch_cpu_s_by_process", {}).items()
                )
                + ")"
                for r in phased
            )
        )
    notes += _startup_notes(args, runs)
    one = per_sample(_UNITS.get(args.workload, "images"))
    steady = [r for r in runs if r["peer"] == "raydl" and r.get("steady_cpu_ms_per_image_by_process")]
    if steady:
        notes.append(
            f"raydl steady CPU by process, ms/{one} (epoch 1 after its first batch; the sampler's own CPU "
            "is in 'this process'), per round: "
            + "; ".join(_by_process(r["steady_cpu_ms_per_image_by_process"]) for r in steady)
        )
    later = [r for r in runs if r["peer"] == "raydl" and r.get("later_cpu_ms_per_image_by_process")]
    if later:
        notes.append(
            f"raydl later CPU by process, ms/{one} (epochs 2-{args.epochs}), per round: "
            + "; ".join(_by_process(r["later_cpu_ms_per_image_by_process"]) for r in later)
        )
    driver = [
        (r["driver_batches"], r["steady_batches"] + 1)
        for r in runs
        if r["peer"] == "raydl" and r.get("ok") and "driver_batches" in r
    ]
    if driver:
        notes.append(
            "raydl batches made in the driver while its workers started, per round: "
            + ", ".join(f"{d} of {n}" for d, n in driver)
        )
    if args.nodes > 1:
        notes.append(
            f"raydl rows ran on a local {args.nodes}-node ray.cluster_utils.Cluster sharing the "
            f"{args.cpus} CPUs ({max(1, args.cpus // args.nodes)} per node); the other peers on one"
        )
    if args.epochs > 1:
        notes.append(
            f"later {short_rate(_UNITS.get(args.workload, 'images'))}, later CPU ms/{one}: epochs "
            f"2-{args.epochs} of the same loader, after its "
            "start-up (the other columns are epoch 1's)"
            + "".join(f"; {p} runs one epoch only" for p in peers if p not in MULTI_EPOCH)
        )
    if n < MIN_BATCHES * args.batch_size:
        # Loaders prefetch while the first batch is awaited, so a few batches flatter images/s.
        notes.append(
            f"only {-(-n // args.batch_size)} batches per epoch: images/s is "
            f"noisy and flattered by prefetch; use >= {MIN_BATCHES * args.batch_size} images"
        )
    return notes


def _workload_notes(workload: str, summary: list[dict], *, seq_len: int = 0) -> list[str]:
    """clip: what the caption and metadata cost raydl; tokens: every row's tokens/s, and raydl's ratios;
    windows: what a window is, raydl's first batch and its ratios against the goals; tokens and windows:
    raydl's ratio against every peer, after the first batch and over the whole epoch from process start."""
    rate = {r["peer"]: r["images_per_s"] for r in summary if r["images_per_s"] and not r["short_window"]}
    raydl = rate.get("raydl")
    notes = []
    if workload == "clip" and raydl:
        if rate.get("raydl-image"):
            cost = 100 * (1 - raydl / rate["raydl-image"])
            cpu = {r["peer"]: r.get("steady_cpu_s_per_image") for r in summary}
            more = ""
            if cpu.get("raydl") and cpu.get("raydl-image"):  # on a busy machine the steadier figure
                more = (
                    f"; steady CPU {1000 * cpu['raydl']:.2f} against {1000 * cpu['raydl-image']:.2f} ms/img, "
                    f"{100 * (cpu['raydl'] / cpu['raydl-image'] - 1):+.1f}%"
                )
            notes.append(
                f"carrying caption + metadata costs raydl {cost:.1f}% of its image-only images/s "
                f"({raydl:.1f} against {rate['raydl-image']:.1f}; goal <= 5%; negative: faster{more})"
            )
        for peer, what, goal in (("torch", "webdataset + DataLoader", 2), ("raydata", "Ray Data", 5)):
            if rate.get(peer):
                notes.append(f"raydl / {what}: {raydl / rate[peer]:.2f} (goal >= {goal})")
    if workload == "windows":
        notes.append(
            f"windows/s: windows of {seq_len} tokens (input ids; each reads {seq_len + 1} tokens, the "
            f"labels its last {seq_len}); M tokens/s is {seq_len} x windows/s; "
            "epoch .. from start: the epoch's windows over the time from the run's process start to its "
            "last batch"
        )
        first = next((r["first_batch_s"] for r in summary if r["peer"] == "raydl"), None)
        if first is not None:
            notes.append(f"raydl first batch after ray.init: {first:.2f} s (goal <= 1 s)")
        raw = {r["peer"]: r for r in summary if r["images_per_s"]}  # short windows too, said so
        short = " (the peer's epoch took under 1 s after its first batch: indicative)"
        for peer, what, goal in (
            ("torch", "memory-mapped torch DataLoader", 1.0),
            ("ceiling", "one-thread ceiling", 0.3),
        ):
            if raydl and peer in raw:
                notes.append(
                    f"raydl / {what}, after the first batch: {raydl / raw[peer]['images_per_s']:.3f} "
                    f"(goal >= {goal})" + (short if raw[peer]["short_window"] else "")
                )
        for top, bottom, what in (
            ("raydl", "floor", "raydl / the object-store floor"),
            ("floor", "ceiling", "the object-store floor / one-thread ceiling (the most a loader handing its "
             "batches over through the object store can reach here)"),
        ):  # fmt: skip
            if top in raw and bottom in raw:
                brief = short.replace("the peer's epoch", "an epoch")
                notes.append(
                    f"{what}, after the first batch: "
                    f"{raw[top]['images_per_s'] / raw[bottom]['images_per_s']:.3f}"
                    + (brief if raw[top]["short_window"] or raw[bottom]["short_window"] else "")
                )
        return notes + _ratio_notes(summary)
    if workload != "tokens":
        return notes
    tokens = [  # in brackets where the window is too short to compare, as in the table
        f"{r['peer']} "
        + (f"({SEQ_LEN * ips / 1e6:.1f} M)" if r["short_window"] else f"{SEQ_LEN * ips / 1e6:.1f} M")
        for r in summary
        if (ips := r["images_per_s"])
    ]
    notes.append(f"rows/s is {SEQ_LEN}-token rows per second. tokens/s: {', '.join(tokens)}")
    later = {r["peer"]: r.get("later_images_per_s") for r in summary}
    for ours in ("raydl", "raydl-ordered"):
        for peer, what, goal in (("ceiling", "pyarrow ceiling", 0.7), ("raydata", "Ray Data", 1.0)):
            if rate.get(ours) and rate.get(peer):
                notes.append(f"{ours} / {what}: {rate[ours] / rate[peer]:.2f} (goal >= {goal})")
            if later.get(ours) and later.get(peer):  # --epochs N: the epochs after each start
                notes.append(f"{ours} / {what} in the later epochs: {later[ours] / later[peer]:.2f}")
    whole = {r["peer"]: r.get("epoch_from_start_per_s") for r in summary}
    for ours in ("raydl", "raydl-ordered"):
        if whole.get(ours) and whole.get("torch"):
            notes.append(
                f"{ours} / torch DataLoader over the whole epoch from process start: "
                f"{whole[ours] / whole['torch']:.2f} (goal >= 1.0)"
            )
    if rate.get("raydl") and rate.get("raydl-ordered"):
        notes.append(f"raydl shuffled / ordered: {rate['raydl'] / rate['raydl-ordered']:.2f} (goal >= 0.8)")
    return notes + _ratio_notes(summary)


def _ratio_notes(summary: list[dict]) -> list[str]:
    """raydl's rate over each other peer's: after the first batch, and over the whole epoch from the run's
    process start (imports, Ray, the loader and every batch)."""
    by = {r["peer"]: r for r in summary}
    ours = by.get("raydl")
    if not ours:
        return []
    parts = []
    for peer, row in by.items():
        if peer == "raydl":
            continue
        after = (
            f"{ours['images_per_s'] / row['images_per_s']:.2f}"
            if ours["images_per_s"]
            and row["images_per_s"]
            and not (ours["short_window"] or row["short_window"])
            else "-"
        )
        whole = ours.get("epoch_from_start_per_s"), row.get("epoch_from_start_per_s")
        parts.append(f"{peer} {after} ({whole[0] / whole[1]:.2f})" if all(whole) else f"{peer} {after} (-)")
    if not parts:
        return []
    return ["raydl / peer, after the first batch (whole epoch from process start): " + ", ".join(parts)]


def _cli(argv: list[str] | None = None) -> int:
    """`python -m raydl.bench.loader ...`, for use before the `raydl` CLI wires it in."""
    parser = argparse.ArgumentParser(prog="raydl bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_cli())
