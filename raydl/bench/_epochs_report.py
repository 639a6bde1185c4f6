"""What `raydl bench cache` and `raydl bench mix` share on the driver's side: the image folder, one
measurement in a child process (`raydl.bench._epochs`), and the per-epoch figures turned into medians,
a table and ratios. The table and ratio functions are pure."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

__all__ = [
    "epoch_table",
    "image_folder",
    "kill_tree",
    "later_rate",
    "median_epochs",
    "process_split",
    "run_measurement",
]


def image_folder(data: str | None, images: int, out: Path, *, seed: int = 0, classes: int = 10) -> str:
    """`data` when given (an existing DIR/class/*.jpg folder), else `images` in1k-like images written
    into `out` by make_images (random crops of the shared photos, or generated scenes without them)."""
    if data:
        if not Path(data).is_dir():
            raise ValueError(f"--data {data}: no such folder")
        return data
    from raydl.bench.make_images import DEFAULT_PHOTOS, generated_sources, load_sources, make_dataset

    sources = load_sources(DEFAULT_PHOTOS) or generated_sources(seed=seed)
    make_dataset(out, images, profile="in1k", classes=classes, seed=seed, sources=sources)
    return str(out)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a measurement: this checkout first on PYTHONPATH, no inherited RAY_ADDRESS (each
    run starts its own local Ray), Ray's workers at the niceness of every other process."""
    env = {**os.environ, **(extra or {})}
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_worker_niceness", "0")
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    return env


def run_measurement(spec: dict, env: dict, *, timeout_s: float, log: Path) -> dict:
    """`raydl.bench._epochs` on `spec` in a fresh process (its stderr to `log`); its row, or a failed row
    with the end of the log."""
    cmd = [sys.executable, "-m", "raydl.bench._epochs", json.dumps(spec)]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.communicate()
            return {"row": spec["row"], "ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"row": spec["row"], "ok": False, "error": "no result"}
    if not row.get("ok"):
        row["log_tail"] = "".join(log.read_text().splitlines(True)[-12:])
    return row


def kill_tree(pid: int) -> None:
    """Kill a measurement's process and all its children (a stuck run)."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def median_epochs(runs: list[dict]) -> list[dict]:
    """One row's epochs, each figure the median over its successful rounds (`runs`: that row's results)."""
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return []
    out = []
    for i in range(min(len(r["epochs"]) for r in ok)):
        epochs = [r["epochs"][i] for r in ok]
        row: dict = {"epoch": i + 1}
        for key in ("images", "seconds", "images_per_s", "loader_cpu_s", "store_cpu_s", "first_batch_s"):
            values = [e[key] for e in epochs if e.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["requests"] = {
            k: statistics.median(e["requests"][k] for e in epochs) for k in epochs[0]["requests"]
        }
        out.append(row)
    return out


def later_rate(epochs: list[dict]) -> float | None:
    """Images/s of epochs 2..N together (their images over their seconds), None with one epoch."""
    later = epochs[1:]
    seconds = sum(e["seconds"] for e in later)
    return sum(e["images"] for e in later) / seconds if later and seconds > 0 else None


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def epoch_table(rows: list[tuple[str, list[dict]]], *, requests: bool = True) -> str:
    """A Markdown table, one line per (row, epoch): images/s, seconds, the store's requests (GET, HEAD,
    LIST) and the CPU seconds of the loader and of the store. `rows`: (label, median_epochs(...))."""
    cols = ["row", "epoch", "images/s", "s", "loader CPU ms/img"]
    if requests:
        cols += ["GET", "HEAD", "LIST", "store CPU ms/img"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for label, epochs in rows:
        if not epochs:
            lines.append(f"| {label} | failed |" + " |" * (len(cols) - 2))
            continue
        for e in epochs:
            n = e["images"] or 1
            cells = [
                label if e["epoch"] == 1 else "",
                str(e["epoch"]),
                _num(e["images_per_s"], ".1f"),
                _num(e["seconds"], ".2f"),
                _num(None if e["loader_cpu_s"] is None else 1000 * e["loader_cpu_s"] / n, ".2f"),
            ]
            if requests:
                r = e["requests"]
                cells += [f"{r['GET']:.0f}", f"{r['HEAD']:.0f}", f"{r['LIST']:.0f}"]
                cells.append(_num(None if e["store_cpu_s"] is None else 1000 * e["store_cpu_s"] / n, ".2f"))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def process_split(runs: list[dict], name: str) -> dict[str, float]:
    """Row `name`'s loader CPU in epochs 2-N by kind of process, ms per image, averaged over its rounds'
    epochs and largest first (pure); kinds under 0.01 ms are left out."""
    per: dict[str, float] = {}
    epochs = [e for r in runs if r.get("name") == name and r.get("ok") for e in r["epochs"][1:]]
    for e in epochs:
        for kind, cpu in e.get("loader_cpu_s_by_process", {}).items():
            key = kind.removeprefix("ray::")
            per[key] = per.get(key, 0.0) + 1000 * cpu / e["images"] / len(epochs)
    return {k: round(v, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.01}
