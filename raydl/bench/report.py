"""Turn per-round rows into medians, a text table and a bar chart. Pure functions."""

from __future__ import annotations

import statistics
from importlib import metadata

__all__ = ["format_table", "peer_versions", "ray_service", "summarize", "write_plot"]

_FIGURES = (
    "images_per_s",
    "epoch_from_start_per_s",
    "first_batch_s",
    "first_batch_from_start_s",
    "peak_pss_mib",
    "own_pss_mib",
    "ray_pss_mib",
    "cpu_s_per_image",
    "steady_cpu_s_per_image",
    "later_images_per_s",
    "later_cpu_s_per_image",
)
# A steady-state window shorter than this (or with fewer batches after the first) says more about
# prefetch and timer resolution than about throughput: its images/s is shown greyed, with no ratio.
MIN_WINDOW_S = 1.0
MIN_STEADY_BATCHES = 3


# Ray's own services, by process_kind: what any program on Ray pays (the loader's actors and tasks are not).
_RAY_SERVICES = ("raylet", "gcs_server", "ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def ray_service(kind: str) -> bool:
    """Whether a process of the tree (its `process_kind`) is one of Ray's services (GCS, raylet, the
    dashboard and runtime-env agents, the log monitor, idle and spill workers) rather than the loader's own
    (the runner, its Ray actors and task workers, torch's worker processes)."""
    if kind == "this process":
        return False
    if kind.endswith(".py"):  # Ray's Python services: dashboard/agent.py, log_monitor.py, monitor.py
        return True
    return kind in _RAY_SERVICES or kind.startswith("ray::IDLE")


def short_window(run: dict) -> bool:
    """Whether one run's images/s rests on too short a measurement window to compare."""
    return (
        run.get("steady_s", MIN_WINDOW_S) < MIN_WINDOW_S
        or run.get("steady_batches", MIN_STEADY_BATCHES) < MIN_STEADY_BATCHES
    )


def summarize(peers: list[str], runs: list[dict]) -> list[dict]:
    """One row per peer: medians over its successful rounds, and images/s relative to raydl's.

    A peer whose rounds had too short a window (`short_window`) gets `short_window: True` and no
    ratio; when raydl's own window is too short, no peer gets one."""
    rows = []
    for peer in peers:
        ok = [r for r in runs if r["peer"] == peer and r.get("ok")]
        row = {"peer": peer, "rounds_ok": len(ok), "rounds": sum(1 for r in runs if r["peer"] == peer)}
        for key in _FIGURES:
            values = [r[key] for r in ok if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        row["short_window"] = any(short_window(r) for r in ok)
        errors = [r["error"].splitlines()[0] for r in runs if r["peer"] == peer and not r.get("ok")]
        if errors:
            row["errors"] = errors
        rows.append(row)
    base = next((r["images_per_s"] for r in rows if r["peer"] == "raydl" and not r["short_window"]), None)
    for row in rows:
        ips = row["images_per_s"]
        row["ratio_to_raydl"] = ips / base if ips is not None and base and not row["short_window"] else None
    return rows


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def per_sample(unit: str) -> str:
    """How a rate's unit reads per sample: images -> img, rows -> row, windows -> window."""
    return {"images": "img", "rows": "row", "windows": "window"}.get(unit, unit)


def short_rate(unit: str) -> str:
    """A rate in a short column or line: img/s for images, else rows/s or windows/s."""
    return "img/s" if unit == "images" else f"{unit}/s"


def format_table(
    summary: list[dict], *, header: str, rate: str = "images/s", tokens_per_sample: int | None = None
) -> str:
    """The summary as a text table; `rate` names the throughput column (the tokens workload's is rows/s or
    windows/s). With `tokens_per_sample`, tokens/s beside it, and both rates over the whole epoch from the
    run's process start."""
    later = any(row.get("later_images_per_s") is not None for row in summary)  # --epochs N
    tokens = tokens_per_sample is not None
    unit = rate.removesuffix("/s")
    one = per_sample(unit)
    cols = (
        "peer",
        rate,
        *(("M tokens/s",) if tokens else ()),
        "x raydl",
        *((f"epoch {unit}/s from start", "epoch M tokens/s from start") if tokens else ()),
        "first batch s",
        "from start s",
        "peak PSS MiB",
        "own PSS MiB",
        "Ray PSS MiB",
        f"CPU ms/{one}",
        f"steady CPU ms/{one}",
        *((f"later {short_rate(unit)}", f"later CPU ms/{one}") if later else ()),
        "ok",
    )
    lines = [header, ""]
    body = []
    for row in summary:
        ceiling = row["peer"] == "ceiling"  # no loader to build
        first = None if ceiling else row["first_batch_s"]
        from_start = None if ceiling else row.get("first_batch_from_start_s")
        cpu = row["cpu_s_per_image"]
        steady = row.get("steady_cpu_s_per_image")
        ips = _cell(row["images_per_s"], ".1f")
        if row.get("short_window") and row["images_per_s"] is not None:
            ips = f"({ips})"  # greyed: not comparable
        extra: tuple[str, ...] = ()
        if tokens:
            rate_tok = None if row["images_per_s"] is None else row["images_per_s"] * tokens_per_sample / 1e6
            tok = _cell(rate_tok, ".1f")
            if row.get("short_window") and rate_tok is not None:
                tok = f"({tok})"
            whole = row.get("epoch_from_start_per_s")
            extra = (
                _cell(whole, ".1f"),
                _cell(None if whole is None else whole * tokens_per_sample / 1e6, ".1f"),
            )
        body.append(
            (
                row["peer"],
                ips,
                *((tok,) if tokens else ()),
                _cell(row["ratio_to_raydl"], ".2f"),
                *extra,
                _cell(first, ".2f"),
                _cell(from_start, ".2f"),
                _cell(row["peak_pss_mib"], ".0f"),
                _cell(row.get("own_pss_mib"), ".0f"),
                _cell(row.get("ray_pss_mib"), ".0f"),
                _cell(None if cpu is None else 1000 * cpu, ".2f"),
                _cell(None if steady is None else 1000 * steady, ".2f"),
                *(
                    (
                        _cell(row.get("later_images_per_s"), ".1f"),
                        _cell(
                            None
                            if row.get("later_cpu_s_per_image") is None
                            else 1000 * row["later_cpu_s_per_image"],
                            ".2f",
                        ),
                    )
                    if later
                    else ()
                ),
                f"{row['rounds_ok']}/{row['rounds']}",
            )
        )
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    fmt_row = lambda cells: "  ".join(  # noqa: E731 - the first column left, numbers right
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    lines.append(fmt_row(cols))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt_row(b) for b in body)
    if any(r.get("short_window") for r in summary):
        lines.append(
            f"  (images/s) in brackets: measured over less than {MIN_WINDOW_S:g} s or "
            f"{MIN_STEADY_BATCHES} batches after the first, so not comparable and no ratio is given; "
            "use more images (--limit, raydl make-images --n)"
        )
    failed = [(r["peer"], e) for r in summary for e in r.get("errors", [])]
    lines.extend(f"  ! {peer} failed: {err}" for peer, err in failed)
    return "\n".join(lines)


def peer_versions() -> dict[str, str]:
    """Installed versions of the packages the peers run on, for the JSON record."""
    versions = {}
    names = {"raydl": "raydl-loader"}  # raydl's distribution name (the import name is raydl)
    for dist in ("raydl", "ray", "torch", "numpy", "pillow", "simplejpeg", "dataio-rs", "datago"):
        try:
            versions[dist] = metadata.version(names.get(dist, dist))
        except metadata.PackageNotFoundError:
            pass
    return versions


def write_plot(summary: list[dict], path: str, *, title: str) -> None:
    """Four bar charts side by side: one per figure, one bar per peer."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'raydl-loader[bench]'") from exc
    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    panels = (
        ("images_per_s", "images/s (higher is better)", 1.0),
        ("first_batch_s", "time to first batch, s", 1.0),
        ("first_batch_from_start_s", "first batch from process start, s", 1.0),
        ("peak_pss_mib", "peak memory (PSS), MiB", 1.0),
        ("cpu_s_per_image", "CPU ms per image", 1000.0),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        rows = [
            r
            for r in summary
            if r.get(key) is not None
            and not (key.startswith("first_batch") and r["peer"] == "ceiling")
            and not (key == "images_per_s" and r.get("short_window"))
        ]
        names = [r["peer"] for r in rows]
        values = [scale * r[key] for r in rows]
        colors = [
            "tab:blue" if n == "raydl" else "tab:gray" if n == "ceiling" else "tab:orange" for n in names
        ]
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
