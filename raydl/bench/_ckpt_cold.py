"""`raydl bench checkpoint --cold`: a first fetch in a fresh process, phase by phase, against a warm one
and ray.get.

Each round starts fresh actors on node 1 (torch and raydl.checkpoint imported
at start, as in a trainer) and times, in turn: a first fetch in a process
started with RAYDL_CHECKPOINT_PREPARE=0 (nothing prepared: libfabric starts
during the fetch), a first fetch without checkpoint.prepare() (the import
started the fabric side in the background), a
first fetch in a process that called prepare(buffer_bytes=size) at start (as a
trainer that knows its model's size does), a second (warm) fetch
in that same process, the raw pyfi read loop right after it (same process, same
holder: one read_into of every byte into memory already faulted in, no digest,
no tensors; the warm fetch's goal is measured against it round by round), and
a first ray.get of the same bytes put by node 0.
Phases (seconds, medians): probe (libfabric's start-up and the provider
choice), setup (the client endpoint), connect (the first read to a holder),
register (the receive buffer), transfer (the reads, with page faults), verify
(digest checks, between the reads), build (tensors on the bytes).
"""

from __future__ import annotations

import statistics
import time

__all__ = ["PHASES", "format_cold", "run_cold", "summarize_cold"]

PHASES = ("probe", "setup", "connect", "register", "transfer", "verify", "build")
COLUMNS = ("cold_off", "cold", "cold_prepared", "warm")
LABELS = {
    "cold_off": "first, PREPARE=0",
    "cold": "first fetch",
    "cold_prepared": "first, prepare()d",
    "warm": "warm fetch",
}


def run_cold(bench, rounds: int, log) -> list[dict]:
    """Per round: {"cold": out, "cold_prepared": out, "warm": out, "ray_get": out} (or an "error")."""
    import ray

    from raydl.bench._ckpt_actors import ColdFetcher

    runs = []
    fresh = ray.remote(ColdFetcher).options(**bench._affinity(bench.peer_nodes[0]))
    fresh_off = ray.remote(ColdFetcher).options(
        **bench._affinity(bench.peer_nodes[0]), runtime_env={"env_vars": {"RAYDL_CHECKPOINT_PREPARE": "0"}}
    )
    for i in range(1, rounds + 1):
        row: dict = {"round": i}
        ref = ray.get(
            bench.source.publish.remote("full", ("fabric", "object_store"), bench.args.chunk_size),
            timeout=bench.timeout,
        )
        actors = []
        try:
            off = fresh_off.remote(False)
            plain, prepared = fresh.remote(False), fresh.remote(True, bench.args.size)
            actors += [off, plain, prepared]
            ray.get(
                [off.ready.remote(), plain.ready.remote(), prepared.ready.remote()], timeout=bench.timeout
            )
            time.sleep(1.0)  # a trainer's prepare() has its start-up to run before a checkpoint arrives
            link = bench.args.link_gbps
            row["cold_off"] = ray.get(
                off.fetch.remote(ref, "fabric", bench.timeout, link), timeout=bench.timeout
            )
            row["cold"] = ray.get(
                plain.fetch.remote(ref, "fabric", bench.timeout, link), timeout=bench.timeout
            )
            row["cold_prepared"] = ray.get(
                prepared.fetch.remote(ref, "fabric", bench.timeout, link), timeout=bench.timeout
            )
            row["warm"] = ray.get(
                prepared.fetch.remote(ref, "fabric", bench.timeout, link), timeout=bench.timeout
            )
            row["raw"] = ray.get(prepared.raw.remote(ref, bench.timeout, link), timeout=bench.timeout)
        except Exception as exc:  # noqa: BLE001 - a failed round is a row, not the end of the run
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for a in actors:
                ray.kill(a)
            ray.get(bench.source.unpublish.remote(ref.key), timeout=bench.timeout)
        try:
            wrapped = ray.get(bench.source.put.remote("full"), timeout=bench.timeout)
            getter = fresh.remote(False)
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
            + "  ".join(f"{k} {row[k]['seconds']:.3f} s" for k in (*COLUMNS, "raw", "ray_get") if k in row)
            + (f"  FAILED: {row['error']}" if "error" in row else "")
        )
        runs.append(row)
    return runs


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_cold(runs: list[dict], raw_seconds: float | None) -> dict:
    """Median phases and totals per column, ray.get, and the goals' ratios. Pure."""
    out: dict = {"phases": {}, "seconds": {}}
    for col in COLUMNS:
        ok = [r[col] for r in runs if col in r]
        out["seconds"][col] = _median(o["seconds"] for o in ok)
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
            "name": "first fetch (prepared) speed / cross-node ray.get",
            "value": ratio(s["ray_get"], s["cold_prepared"]),
            "target": ">= 3",
        },
        {
            "name": "first fetch (import only) speed / cross-node ray.get",
            "value": ratio(s["ray_get"], s["cold"]),
            "target": "(>= 3)",
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
    return out


def format_cold(summary: dict, header: str) -> str:
    def cell(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    lines = [header, "", f"{'phase (s, median)':<20}" + "".join(f"{LABELS[c]:>20}" for c in COLUMNS)]
    for p in PHASES:
        lines.append(f"{p:<20}" + "".join(f"{cell(summary['phases'][c][p]):>20}" for c in COLUMNS))
    lines.append(f"{'total':<20}" + "".join(f"{cell(summary['seconds'][c]):>20}" for c in COLUMNS))
    lines += [
        "",
        f"cross-node ray.get, fresh process: {cell(summary['seconds']['ray_get'])} s;  "
        f"raw pyfi read in the fetching process: {cell(summary['seconds'].get('raw'))} s;  "
        f"in one process (ceiling): {cell(summary['seconds']['pyfi_raw'])} s",
        "",
        "goals (benchmark figures)",
    ]
    for g in summary["goals"]:
        lines.append(f"  {g['name']:<55} {cell(g['value'], '.2f'):>8}  {g['target']}")
    lines.append(
        "  (verify: digests checked on the reading thread between the reads; transfer includes page faults)"
    )
    return "\n".join(lines)
