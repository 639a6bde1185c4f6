"""`raydl bench cache --eviction`: its flags, its table, and a small run of it on this checkout (no S3, no Ray)."""
from __future__ import annotations

import argparse
import json

import pytest

from raydl.bench import _cache_eviction, cache

pytestmark = pytest.mark.timeout(120)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="raydl bench")
    cache.add_parser(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(["cache", *argv])


def test_eviction_flags_are_checked_before_anything_runs(capsys, tmp_path):
    """--eviction takes entry counts >= 1; --eviction-before must be a raydl checkout: else exit 2, naming it."""
    assert _parse([]).eviction is None
    for argv, said in ((["--eviction", "lots"], "--eviction"), (["--eviction", "0"], "--eviction"),
                       (["--eviction", "10", "--eviction-before", str(tmp_path)], "no raydl checkout")):
        assert cache.main(_parse(argv)) == 2
        assert said in capsys.readouterr().err


def test_a_small_eviction_run_reports_the_pass_the_other_writer_and_the_memory(tmp_path, capsys):
    """A run at 300 entries fills a folder, evicts about a tenth with another writer beside, prints one table
    row, writes the JSON, and leaves no folder behind."""
    out = tmp_path / "r.json"
    args = _parse(["--eviction", "300", "--eviction-dir", str(tmp_path), "--json", str(out)])
    assert cache.main(args) == 0
    table = capsys.readouterr().out
    assert "| 300 | after |" in table and "load average" in table
    (row,) = json.loads(out.read_text())["rows"]
    assert row["code"] == "after" and 25 <= row["evicted"] <= 40 and row["writer"]["puts"] >= 1
    assert row["peak_rss"] >= row["rss_before"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_the_table_has_a_row_per_run():
    """render() (pure): one Markdown row per (entries, code), with the writer's waits and the memory."""
    row = {"entries": 1000, "code": "before", "fill_s": 3.2, "pass_s": 0.5, "evicted": 101,
           "rss_before": 50 << 20, "peak_rss": 60 << 20,
           "writer": {"longest_s": 0.45, "p99_s": 0.01, "puts": 90, "left_out": 0}}
    text = _cache_eviction.render([row], [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0)], 64)
    assert "| 1,000 | before | 3 | 0.50 | 101 | 0.450 | 0.010 | 90 | 0 | 10.0 |" in text
