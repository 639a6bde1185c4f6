"""`raydl bench checkpoint`'s report: which figures count as goals."""
from __future__ import annotations

from raydl.bench._ckpt_report import format_table, summarize

METHODS = ["raydl_fabric", "raydl_object_store", "ray_get", "pyfi_raw"]


def _runs() -> list[dict]:
    runs = [{"step": m, "ok": True, "gbps": g, "seconds": 0.064 / g}
            for m, g in zip(METHODS, [0.12, 0.34, 0.37, 2.19], strict=True)]
    return runs + [{"step": "broadcast", "ok": True, "peers": p, "seconds": 0.6 + 0.1 * p,
                    "slowest_peer_seconds": 0.5 + 0.1 * p, "peer_cpu_seconds": [0.1] * p,
                    "fill_seconds": 0.05 * p} for p in (1, 4, 8)]


def test_paced_links_leave_the_fetch_ratios_out_of_the_goals():
    """With --link-gbps the fabric fetch runs at the link's rate, so fetch/raw and fetch/ray.get are no goals
    (they read MISSED at 0.05 before); the broadcast ratios stay, and unpaced runs keep all four."""
    paced = summarize(METHODS, [1, 4, 8], _runs(), paced=True)
    assert [t["name"] for t in paced["targets"]] == ["broadcast to 4 peer(s) / single-peer fetch",
                                                     "broadcast to 8 peer(s) / single-peer fetch"]
    assert "fabric fetch / pyfi raw read" not in format_table(paced, header="h")
    plain = summarize(METHODS, [1, 4, 8], _runs())
    assert [t["name"] for t in plain["targets"]][:2] == ["fabric fetch / pyfi raw read",
                                                         "fabric fetch / cross-node ray.get"]
    assert plain["targets"][0]["met"] is False and len(plain["targets"]) == 4


def test_broadcast_rows_show_the_chain_fill():
    """Each width's row carries the median fill (call until the last peer's first verified chunk), in a column."""
    summary = summarize(METHODS, [1, 4, 8], _runs(), paced=True)
    assert [c["fill_seconds"] for c in summary["broadcast"]] == [0.05, 0.2, 0.4]
    table = format_table(summary, header="h")
    assert "fill s" in table and "0.400" in table
