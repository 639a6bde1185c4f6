"""Medians, ratios, targets, the text table and the chart of `raydl bench checkpoint`. Pure functions.

The loader benchmark's report.py is built around images/s panels; this is the
same shape (per-round rows in, medians and ratios out) for GB/s and seconds.
"""

from __future__ import annotations

import statistics

__all__ = ["LABELS", "METHODS", "format_table", "summarize", "write_plot"]

METHODS = ("raydl_fabric", "raydl_object_store", "ray_get", "pyfi_raw", "fi_rma_bw")
LABELS = {
    "raydl_fabric": "raydl fetch, fabric",
    "raydl_object_store": "raydl fetch, object store",
    "ray_get": "ray.get of the bytes",
    "pyfi_raw": "pyfi raw read (ceiling)",
    "fi_rma_bw": "fabtests fi_rma_bw (ceiling)",
}
# (what, threshold) - benchmark figures to print beside the numbers, not asserts
TARGET_OF_RAW = 0.90
TARGET_OVER_RAY_GET = 5.0
TARGET_BROADCAST_X = 2.0
TARGET_PEERS = 4
BROADCAST_TARGETS = {4: 1.5, 8: 2.0}  # peers -> x single (with links capped: --link-gbps)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values):
    values = [v for v in values or () if v is not None]
    return sum(values) / len(values) if values else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(methods: list[str], peers: list[int], runs: list[dict], *, paced: bool = False) -> dict:
    """Medians per method (GB/s, seconds) and per broadcast width, ratios, and the targets."""
    rows = []
    for m in methods:
        mine = [r for r in runs if r["step"] == m]
        ok = [r for r in mine if r.get("ok")]
        row = {
            "method": m,
            "label": LABELS[m],
            "rounds": len(mine),
            "rounds_ok": len(ok),
            "gbps": _median(r.get("gbps") for r in ok),
            "seconds": _median(r.get("seconds") for r in ok),
        }
        errors = [r["error"].splitlines()[0] for r in mine if not r.get("ok") and r.get("error")]
        if errors:
            row["errors"] = errors
        rows.append(row)
    by = {r["method"]: r["gbps"] for r in rows}
    for row in rows:
        row["x_fabric"] = _ratio(row["gbps"], by.get("raydl_fabric"))
        row["x_ray_get"] = _ratio(row["gbps"], by.get("ray_get"))
    single = next((r["seconds"] for r in rows if r["method"] == "raydl_fabric"), None)
    casts = []
    for p in peers:
        mine = [r for r in runs if r["step"] == "broadcast" and r["peers"] == p]
        ok = [r for r in mine if r.get("ok")]
        row = {
            "peers": p,
            "rounds": len(mine),
            "rounds_ok": len(ok),
            "seconds": _median(r.get("seconds") for r in ok),
            "slowest_peer_seconds": _median(r.get("slowest_peer_seconds") for r in ok),
            "fill_seconds": _median(r.get("fill_seconds") for r in ok),
            "peer_cpu_seconds": _median(_mean(r.get("peer_cpu_seconds")) for r in ok),
        }
        row["x_single"] = _ratio(row["seconds"], single)
        errors = [r["error"].splitlines()[0] for r in mine if not r.get("ok") and r.get("error")]
        if errors:
            row["errors"] = errors
        casts.append(row)
    return {
        "methods": rows,
        "broadcast": casts,
        "single_fetch_seconds": single,
        "targets": _targets(by, casts, paced),
    }


def _targets(by: dict, casts: list[dict], paced: bool = False) -> list[dict]:
    """The issue's goals as figures. With paced links (--link-gbps) the fabric fetch runs at the link's
    rate while ray.get and the raw read do not, so only the broadcast ratios are goals then."""
    fabric = by.get("raydl_fabric")
    out = (
        []
        if paced
        else [
            {
                "name": "fabric fetch / pyfi raw read",
                "value": _ratio(fabric, by.get("pyfi_raw")),
                "target": f">= {TARGET_OF_RAW:.2f}",
                "min": TARGET_OF_RAW,
            },
            {
                "name": "fabric fetch / cross-node ray.get",
                "value": _ratio(fabric, by.get("ray_get")),
                "target": f">= {TARGET_OVER_RAY_GET:g}",
                "min": TARGET_OVER_RAY_GET,
            },
        ]
    )
    wide = [c for c in casts if c["peers"] in BROADCAST_TARGETS] or sorted(casts, key=lambda c: -c["peers"])[
        :1
    ]
    for c in wide:
        x = BROADCAST_TARGETS.get(c["peers"], TARGET_BROADCAST_X)
        out.append(
            {
                "name": f"broadcast to {c['peers']} peer(s) / single-peer fetch",
                "value": c["x_single"],
                "target": f"<= {x:g}",
                "max": x,
            }
        )
    for t in out:
        v = t["value"]
        t["met"] = None if v is None else (v >= t["min"] if "min" in t else v <= t["max"])
    return out


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _grid(cols: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]

    def fmt_row(cells):  # the first column left, the rest right
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return [fmt_row(cols), "  ".join("-" * w for w in widths), *(fmt_row(b) for b in body)]


def _verdict(t: dict) -> str:
    return "?" if t["met"] is None else ("met" if t["met"] else "MISSED")


def format_table(summary: dict, *, header: str) -> str:
    lines = [header, ""]
    body = [
        (
            r["label"],
            _cell(r["gbps"], ".2f"),
            _cell(r["seconds"], ".3f"),
            _cell(r["x_fabric"], ".2f"),
            _cell(r["x_ray_get"], ".2f"),
            f"{r['rounds_ok']}/{r['rounds']}",
        )
        for r in summary["methods"]
    ]
    lines += _grid(("method", "GB/s", "seconds", "x fabric", "x ray.get", "ok"), body)
    single = summary["single_fetch_seconds"]
    lines += ["", f"broadcast from the publisher (single-peer fabric fetch: {_cell(single, '.3f')} s)"]
    body = [
        (
            f"{c['peers']} peer{'s' if c['peers'] != 1 else ''}",
            _cell(c["seconds"], ".3f"),
            _cell(c["slowest_peer_seconds"], ".3f"),
            _cell(c.get("fill_seconds"), ".3f"),
            _cell(c.get("peer_cpu_seconds"), ".3f"),
            _cell(c["x_single"], ".2f"),
            f"{c['rounds_ok']}/{c['rounds']}",
        )
        for c in summary["broadcast"]
    ]
    lines += _grid(("peers", "seconds", "slowest pull s", "fill s", "CPU s per peer", "x single", "ok"), body)
    lines += ["", "targets (benchmark figures, not asserts)"]
    body = [(t["name"], _cell(t["value"], ".2f"), t["target"], _verdict(t)) for t in summary["targets"]]
    lines += _grid(("figure", "value", "target", ""), body)
    for r in summary["methods"]:
        lines.extend(f"  ! {r['label']} failed: {e}" for e in r.get("errors", []))
    for c in summary["broadcast"]:
        lines.extend(f"  ! broadcast to {c['peers']} failed: {e}" for e in c.get("errors", []))
    return "\n".join(lines)


def write_plot(summary: dict, path: str, *, title: str) -> None:
    """Two panels: GB/s per method; broadcast seconds per peer count against the single fetch and 2x it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'raydl-loader[bench]'") from exc
    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    rows = [r for r in summary["methods"] if r["gbps"] is not None]
    colors = {
        "raydl_fabric": "tab:blue",
        "raydl_object_store": "tab:cyan",
        "ray_get": "tab:orange",
        "pyfi_raw": "tab:gray",
        "fi_rma_bw": "tab:gray",
    }
    bars = left.bar(
        [r["label"].replace(" (ceiling)", "\n(ceiling)").replace(", ", ",\n") for r in rows],
        [r["gbps"] for r in rows],
        color=[colors[r["method"]] for r in rows],
    )
    left.bar_label(bars, fmt="%.2f", fontsize=8)
    left.set_title("fetch, GB/s (higher is better)", fontsize=10)
    left.tick_params(axis="x", labelsize=8)
    casts = [c for c in summary["broadcast"] if c["seconds"] is not None]
    bars = right.bar([str(c["peers"]) for c in casts], [c["seconds"] for c in casts], color="tab:blue")
    right.bar_label(bars, fmt="%.2f", fontsize=8)
    single = summary["single_fetch_seconds"]
    if single:
        right.axhline(single, color="tab:gray", linestyle="--", linewidth=1, label="single-peer fetch")
        right.axhline(
            TARGET_BROADCAST_X * single,
            color="tab:red",
            linestyle=":",
            linewidth=1,
            label=f"target: {TARGET_BROADCAST_X:g}x single",
        )
        right.legend(fontsize=8)
    right.set_xlabel("peers")
    right.set_title("broadcast, seconds (lower is better)", fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
