"""`raydl bench checkpoint --cold`: a first fetch in a fresh process, phase by phase, against a warm one
and ray.get.

Each round starts fresh actors on node 1 (torch and raydl.checkpoint imported
at start, as in a trainer) and times, in turn (the order of the first fetches
rotates from round to round): the headline, a first fetch by default (the
process only imported raydl.checkpoint, which started the fabric side in the
background: no prepare() call, no environment variable); a first fetch in a
process started with RAYDL_CHECKPOINT_PREPARE=0 (nothing prepared: libfabric
starts during the fetch); a first fetch in a process that called
prepare(buffer_bytes=size) at start (as a trainer that knows its model's size
does); with --approaches, a default first fetch in a process started with each
other RAYDL_CHECKPOINT_FAULTS way of faulting the fresh receive buffer in
(raydl.env.CHECKPOINT_FAULTS: each way of faulting a buffer in); then a second (warm)
fetch in the prepare()d process, the raw pyfi read loop right after it (same
process, same holder: one read_into of every byte into memory already faulted
in, no digest, no tensors; the warm fetch's goal is measured against it round
by round), and a first ray.get of the same bytes put by node 0.
Phases (seconds, medians): probe (libfabric's start-up and the provider
choice), setup (the client endpoint), connect (the first read to a holder),
register (the receive buffer), transfer (the reads, with page faults), verify
(digest checks, between the reads), build (tensors on the bytes); cpu is the
fetching process's CPU seconds (every thread, user + system) during the fetch.
"""

from __future__ import annotations

import statistics
import time

from raydl.env import CHECKPOINT_FAULTS

__all__ = ["PHASES", "columns", "format_cold", "run_cold", "summarize_cold"]

PHASES = ("probe", "setup", "connect", "register", "transfer", "verify", "build")
FIRSTS = ("cold", "cold_prepared", "cold_off")  # first fetches, each in its own fresh process
COLUMNS = (*FIRSTS, "warm")
LABELS = {
    "cold": "first, by default",
    "cold_prepared": "first, prepare()d",
    "cold_off": "first, PREPARE=0",
    "warm": "warm fetch",
}
APPROACHES = tuple(f"faults={way}" for way in CHECKPOINT_FAULTS if way != "hint")  # "hint": the default


def columns(runs: list[dict]) -> tuple[str, ...]:
    """COLUMNS, and the approaches' columns that some round has."""
    return (*COLUMNS, *(a for a in APPROACHES if any(a in r for r in runs)))


def label(col: str) -> str:
    return LABELS.get(col, col)


def run_cold(bench, rounds: int, log, approaches: bool = False) -> list[dict]:
    """Per round: {"cold": out, "cold_prepared": out, "cold_off": out, "warm": out, "raw": out,
    "ray_get": out, and with approaches "faults=<way>": out} (or an "error")."""
    import ray

    from raydl.bench._ckpt_actors import ColdFetcher

    def fetcher(env: dict | None = None):
        opts = dict(bench._affinity(bench.peer_nodes[0]))
        if env:
            opts["runtime_env"] = {"env_vars": env}
        return ray.remote(ColdFetcher).options(**opts)

    fresh = fetcher()
    starts = {
        "cold": lambda: fresh.remote(False),
        "cold_prepared": lambda: fresh.remote(True, bench.args.size),
        "cold_off": lambda: fetcher({"RAYDL_CHECKPOINT_PREPARE": "0"}).remote(False),
    }
    if approaches:
        for a in APPROACHES:
            starts[a] = lambda a=a: fetcher({"RAYDL_CHECKPOINT_FAULTS": a.split("=", 1)[1]}).remote(False)
    firsts = list(starts)
    runs = []
    for i in range(1, rounds + 1):
        row: dict = {"round": i}
        ref = ray.get(
            bench.source.publish.remote("full", ("fabric", "object_store"), bench.args.chunk_size),
            timeout=bench.timeout,
        )
        actors = {}
        try:
            actors = {col: start() for col, start in starts.items()}
            ray.get([a.ready.remote() for a in actors.values()], timeout=bench.timeout)
            time.sleep(1.0)  # a trainer's prepare() has its start-up to run before a checkpoint arrives
            link = bench.args.link_gbps
            shift = (i - 1) % len(firsts)
            for col in firsts[shift:] + firsts[:shift]:  # the order rotates: none is always first
                row[col] = ray.get(
                    actors[col].fetch.remote(ref, "fabric", bench.timeout, link), timeout=bench.timeout
                )
            prepared = actors["cold_prepared"]
            row["warm"] = ray.get(
                prepared.fetch.remote(ref, "fabric", bench.timeout, link), timeout=bench.timeout
            )
            row["raw"] = ray.get(prepared.raw.remote(ref, bench.timeout, link), timeout=bench.timeout)
        except Exception as exc:  # noqa: BLE001 - a failed round is a row, not the end of the run
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for a in actors.values():
                ray.kill(a)
            ray.get(bench.source.unpublish.remote(ref.key), timeout=bench.timeout)
        try:
            wrapped = ray.get(bench.source.put.remote("full"), timeout=bench.timeout)
            getter = fetcher({"RAYDL_CHECKPOINT_PREPARE": "0"}).remote(False)  # nothing of raydl's beside it
            try:
                ray.get(getter.ready.remote(), timeout=bench.timeout)
                row["ray_get"] = ray.get(getter.get.remote(wrapped, bench.timeout), timeout=bench.timeout)
            finally:
                ray.kill(getter)
                ray.get(bench.source.drop.remote(wrapped[0].hex()), timeout=bench.timeout)
                del wrapped
        except Exception as exc:  # noqa: BLE001
            row["error"] = row.get("error", "") + f" ray.get: {type(exc).__name__}: {exc}"
        log(
            f"[cold round {i}/{rounds}] "
            + "  ".join(
                f"{k} {row[k]['seconds']:.3f} s" for k in (*columns([row]), "raw", "ray_get") if k in row
            )
            + (f"  FAILED: {row['error']}" if "error" in row else "")
        )
        runs.append(row)
    return runs


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_cold(runs: list[dict], raw_seconds: float | None) -> dict:
    """Median phases and totals per column, ray.get, and the goals' ratios. Pure."""
    out: dict = {"phases": {}, "seconds": {}, "cpu_seconds": {}, "columns": list(columns(runs))}
    for col in out["columns"]:
        ok = [r[col] for r in runs if col in r]
        out["seconds"][col] = _median(o["seconds"] for o in ok)
        out["cpu_seconds"][col] = _median(o.get("cpu_seconds") for o in ok)
        out["phases"][col] = {p: _median(o["phases"].get(p, 0.0) for o in ok) for p in PHASES}
    out["seconds"]["ray_get"] = _median(r["ray_get"]["seconds"] for r in runs if "ray_get" in r)
    out["seconds"]["pyfi_raw"] = raw_seconds
    out["seconds"]["raw"] = _median(r["raw"]["seconds"] for r in runs if "raw" in r)
    s = out["seconds"]

    def ratio(a, b):
        return a / b if a is not None and b else None

    # each round's raw read runs right after its warm fetch, in the same process, from the same holder
    warm_vs_raw = _median(
        ratio(r["raw"]["seconds"], r["warm"]["seconds"]) for r in runs if "raw" in r and "warm" in r
    )

    out["goals"] = [
        {
            "name": "first fetch (by default, import only) speed / cross-node ray.get",
            "value": ratio(s["ray_get"], s["cold"]),
            "target": ">= 3",
        },
        {
            "name": "first fetch (prepared) speed / cross-node ray.get",
            "value": ratio(s["ray_get"], s["cold_prepared"]),
            "target": ">= 3",
        },
        {
            "name": "first fetch (PREPARE=0) speed / cross-node ray.get",
            "value": ratio(s["ray_get"], s["cold_off"]),
            "target": "(>= 3)",
        },
        {
            "name": "first fetch (prepared) - warm fetch, ms",
            "value": None
            if s["cold_prepared"] is None or s["warm"] is None
            else 1e3 * (s["cold_prepared"] - s["warm"]),
            "target": "<= 100",
        },
        {
            "name": "warm fetch speed / raw pyfi read (same process, per round)",
            "value": warm_vs_raw,
            "target": ">= 0.9",
        },
    ]
    out["goals"] += [
        {
            "name": f"first fetch ({col}) speed / cross-node ray.get",
            "value": ratio(s["ray_get"], s[col]),
            "target": "(compare)",
        }
        for col in out["columns"]
        if col in APPROACHES
    ]
    return out


def format_cold(summary: dict, header: str) -> str:
    def cell(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    cols = summary.get("columns", COLUMNS)
    lines = [header, "", f"{'phase (s, median)':<20}" + "".join(f"{label(c):>20}" for c in cols)]
    for p in PHASES:
        lines.append(f"{p:<20}" + "".join(f"{cell(summary['phases'][c][p]):>20}" for c in cols))
    lines.append(f"{'total':<20}" + "".join(f"{cell(summary['seconds'][c]):>20}" for c in cols))
    cpu = summary.get("cpu_seconds", {})
    lines.append(f"{'cpu (process)':<20}" + "".join(f"{cell(cpu.get(c)):>20}" for c in cols))
    got = summary["seconds"].get("ray_get")

    def times(c):
        return got / summary["seconds"][c] if got and summary["seconds"][c] else None

    lines.append(f"{'x ray.get':<20}" + "".join(f"{cell(times(c), '.2f'):>20}" for c in cols))
    lines += [
        "",
        f"cross-node ray.get, fresh process: {cell(summary['seconds']['ray_get'])} s;  "
        f"raw pyfi read in the fetching process: {cell(summary['seconds'].get('raw'))} s;  "
        f"in one process (ceiling): {cell(summary['seconds']['pyfi_raw'])} s",
        "",
        "goals (benchmark figures)",
    ]
    for g in summary["goals"]:
        lines.append(f"  {g['name']:<65} {cell(g['value'], '.2f'):>8}  {g['target']}")
    lines.append(
        "  (verify: digests checked on the reading thread between the reads; transfer includes page faults)"
    )
    return "\n".join(lines)
