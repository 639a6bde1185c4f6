"""`raydl bench cache --eviction N[,N...]`: what an eviction pass of the node cache costs the node's other
writers, and the evicting process, at N entries; this checkout and, with --eviction-before DIR, another
raydl checkout (main's, say) side by side, on the same disk, in one run.

    raydl bench cache --eviction 100000,1000000 --eviction-before /work/cache-before [--entry-bytes 64]
        [--eviction-dir DIR] [--json PATH]

For each N and each checkout, in fresh processes (raydl/bench/_eviction_child.py, run with that checkout on
PYTHONPATH; it reports the node_cache.py it imported):

1. fill: N entries of --entry-bytes bytes written through `NodeCache.put` (fsync off: set-up only), with a
   max_bytes far above them; the folder's recorded total is then its full size.
2. evict and write, at once, on that folder with max_bytes = the total: the evicting process makes one
   write, which does not fit and so starts a pass (down to 90%); 0.2 s after it starts, another process
   writes an entry every 5 ms until 0.5 s after the pass. Reported: the pass's seconds, the entries it
   removed, the evicting process's peak RSS over its RSS before the write (VmHWM after clear_refs), and the
   other writer's longest and 99th-percentile write (fsync included) and its writes left out.

The count matters, not the bytes: small entries (one disk block, or one tmpfs page, each) keep the folder
at about 4 KiB an entry; --eviction-dir /dev/shm fills a million in minutes where a disk that journals
every rename takes hours. The load average before and after is printed: the machine's other work shows
there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["add_arguments", "main", "render"]

CHILD = Path(__file__).with_name("_eviction_child.py")
THIS_CHECKOUT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    """The eviction measurement's flags, on `raydl bench cache`'s parser."""
    p.add_argument(
        "--eviction",
        metavar="N[,N...]",
        help="an eviction pass at N entries instead of the S3 epochs (raydl/bench/_cache_eviction.py)",
    )
    p.add_argument(
        "--eviction-before",
        metavar="DIR",
        help="another raydl checkout to measure side by side (its node cache, this venv's Python)",
    )
    p.add_argument("--entry-bytes", type=int, default=64, help="bytes per entry for --eviction (default 64)")
    p.add_argument("--eviction-dir", help="where the cache folders go (default: the temporary folder)")


def _child(code: Path, *argv: object, timeout_s: float = 3600.0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run(
        [sys.executable, str(CHILD), *map(str, argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{CHILD.name} {argv[0]} ({code}) failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(out["code"]).resolve().is_relative_to(code.resolve()):
        raise RuntimeError(f"{CHILD.name} imported {out['code']}, not the node cache of {code}")
    return out


def measure(code: Path, folder: Path, n: int, entry_bytes: int) -> dict:
    """Fill `folder` with n entries through `code`'s node cache, then one pass with another writer beside."""
    fill = _child(code, "fill", folder, n, entry_bytes)
    go, stop = folder.parent / f"{folder.name}.go", folder.parent / f"{folder.name}.stop"
    writer = subprocess.Popen(
        [sys.executable, str(CHILD), *map(str, ("write", folder, fill["total"], entry_bytes, go, stop))],
        env={**os.environ, "PYTHONPATH": str(code)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        evict = _child(code, "evict", folder, fill["total"], entry_bytes, go, stop)
        out, err = writer.communicate(timeout=600)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    if writer.returncode != 0:
        raise RuntimeError(f"{CHILD.name} write ({code}) failed: {err[-2000:]}")
    write = json.loads(out.strip().splitlines()[-1])
    for p in (go, stop):
        p.unlink(missing_ok=True)
    return {"entries": n, "fill_s": fill["seconds"], "total_bytes": fill["total"], **evict, "writer": write}


def main(args) -> int:
    try:
        counts = [int(c) for c in args.eviction.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or args.entry_bytes < 1:
        print(
            "error: --eviction takes entry counts >= 1 (100000,1000000) and --entry-bytes >= 1",
            file=sys.stderr,
        )
        return 2
    codes = [("after", THIS_CHECKOUT)]
    if args.eviction_before:
        before = Path(args.eviction_before).resolve()
        if not (before / "raydl" / "storage" / "node_cache.py").is_file():
            print(f"error: --eviction-before {before} is no raydl checkout", file=sys.stderr)
            return 2
        codes.insert(0, ("before", before))
    base = Path(tempfile.mkdtemp(prefix="raydl-bench-evict-", dir=args.eviction_dir))
    load = [os.getloadavg()]
    rows = []
    try:
        for n in counts:
            for label, code in codes:
                folder = base / f"{label}-{n}"
                t0 = time.perf_counter()
                row = {**measure(code, folder, n, args.entry_bytes), "code": label, "checkout": str(code)}
                rows.append(row)
                print(
                    f"{label:<6} {n:>9,} entries: {_cells(row)} ({time.perf_counter() - t0:.0f} s)",
                    file=sys.stderr,
                )
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load.append(os.getloadavg())
    print(render(rows, load, args.entry_bytes))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "loadavg": load}, indent=1))
    return 0


def _cells(row: dict) -> str:
    w = row["writer"]
    return (
        f"pass {row['pass_s']:.2f} s, {row['evicted']} evicted; other writer: longest "
        f"{w['longest_s']:.3f} s, p99 {w['p99_s']:.3f} s, {w['puts']} writes, {w['left_out']} left out; "
        f"evicting process +{(row['peak_rss'] - row['rss_before']) / 2**20:.1f} MiB"
    )


def render(rows: list[dict], load: list[tuple[float, float, float]], entry_bytes: int) -> str:
    """The Markdown table of the rows (pure)."""
    out = [
        f"raydl bench cache --eviction: entries of {entry_bytes} bytes; one write into a full cache starts a "
        "pass, another process writes every 5 ms beside it",
        "",
        "| entries | code | fill (s) | pass (s) | evicted | other writer: longest write (s) | p99 (s) "
        "| writes | left out | evicting process: peak RSS growth (MiB) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        w = r["writer"]
        out.append(
            f"| {r['entries']:,} | {r['code']} | {r['fill_s']:.0f} | {r['pass_s']:.2f} | {r['evicted']} "
            f"| {w['longest_s']:.3f} | {w['p99_s']:.3f} | {w['puts']} | {w['left_out']} "
            f"| {(r['peak_rss'] - r['rss_before']) / 2**20:.1f} |"
        )
    out += ["", f"load average (1, 5, 15 min): before {load[0]}, after {load[-1]}"]
    return "\n".join(out)
