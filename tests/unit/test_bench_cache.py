"""`raydl bench cache` and `raydl bench mix`: their flags and defaults, the per-epoch table, the goals'
figures and the mix's cost, from hand-made rows (no S3, no Ray)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from raydl.bench import cache, mix
from raydl.bench._epochs import method_counts
from raydl.bench._epochs_report import epoch_table, later_rate, median_epochs, process_split

pytestmark = pytest.mark.timeout(30)


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="raydl bench")
    module.add_parser(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args([module.__name__.rsplit(".", 1)[-1], *argv])


def _epoch(epoch: int, images_per_s: float, get: int = 0, head: int = 0, images: int = 100) -> dict:
    return {
        "epoch": epoch,
        "images": images,
        "seconds": images / images_per_s,
        "images_per_s": images_per_s,
        "requests": {"GET": get, "HEAD": head, "LIST": 0},
        "loader_cpu_s": 0.2,
        "store_cpu_s": 0.05,
    }


def test_cache_defaults_are_the_issues_and_bad_flags_are_refused(capsys):
    """Defaults: 2,000 images, 50 ms per request, 3 epochs, batch 64, both formats, every row; an unknown
    format or row, or a size under 1, is exit 2 naming the flag, before anything is made."""
    a = _parse(cache, [])
    assert (a.images, a.delay_ms, a.epochs, a.batch_size, a.rounds) == (2000, 50.0, 3, 64, 1)
    assert cache.check_args(a) == (list(cache.FORMATS), list(cache.ROWS))
    assert cache.check_args(_parse(cache, ["--rows", "cached,local", "--formats", "webdataset"])) == (
        ["webdataset"],
        ["cached", "local"],
    )
    for argv, flag in (
        (["--formats", "images,zip"], "--formats"),
        (["--rows", "nfs"], "--rows"),
        (["--epochs", "0"], "--epochs"),
        (["--images", "100"], "--images"),
        (["--cache-dir", "/nonexistent/raydl-bench"], "--cache-dir"),
    ):
        assert cache.main(_parse(cache, argv)) == 2
        assert flag in capsys.readouterr().err


def test_cache_dir_names_where_the_cache_goes_and_its_file_cost_is_measured_there(tmp_path):
    """--cache-dir is taken when it is a folder; create_cost_us makes and renames files of the given size in
    a fresh subfolder of it, returns their mean cost, and leaves the folder as it found it."""
    (tmp_path / "keep").write_text("theirs")
    assert cache.check_args(_parse(cache, ["--cache-dir", str(tmp_path)]))[1] == list(cache.ROWS)
    cost = cache.create_cost_us(tmp_path, 4096, n=20)
    assert cost > 0
    assert [p.name for p in tmp_path.iterdir()] == ["keep"] and (tmp_path / "keep").read_text() == "theirs"


def test_mix_defaults_and_bad_flags(capsys):
    """raydl bench mix: 3 stratified sources, 3 epochs, 3 rounds by default; one source is no mix (exit 2)."""
    a = _parse(mix, [])
    assert (a.sources, a.batching, a.epochs, a.rounds, a.batch_size) == (3, "stratified", 3, 3, 64)
    assert mix.main(_parse(mix, ["--sources", "1"])) == 2
    assert "--sources" in capsys.readouterr().err


def test_the_proxy_kinds_become_get_head_and_list():
    """Shard, .idx and other object GETs are GETs; HEADs and LIST pages are counted apart."""
    snap = {"list": 2, "head": 3, "shard": 5, "idx": 1, "other": 7, "connections": 9}
    assert method_counts(snap) == {"GET": 13, "HEAD": 3, "LIST": 2}


def test_epochs_take_medians_over_rounds_and_the_later_rate_spans_epochs_2_on():
    """Each epoch's figure is the median of the rounds'; epochs 2-N's rate is their images over their time."""
    runs = [
        {"ok": True, "epochs": [_epoch(1, 100, get=10), _epoch(2, 200)]},
        {"ok": True, "epochs": [_epoch(1, 300, get=30), _epoch(2, 400)]},
        {"ok": True, "epochs": [_epoch(1, 200, get=20), _epoch(2, 300)]},
        {"ok": False, "error": "x"},
    ]
    med = median_epochs(runs)
    assert [e["images_per_s"] for e in med] == [200, 300] and med[0]["requests"]["GET"] == 20
    assert later_rate([_epoch(1, 1), _epoch(2, 100), _epoch(3, 300)]) == pytest.approx(150)
    assert later_rate(med[:1]) is None and median_epochs([{"ok": False}]) == []


def test_the_cache_goals_read_met_and_missed_from_the_rows():
    """0 requests and >= 0.95x local disk in epochs 2-3, >= 0.95x uncached in epoch 1: met or missed."""
    rows = {
        "local": [_epoch(1, 500), _epoch(2, 800), _epoch(3, 800)],
        "s3": [_epoch(1, 200, get=100), _epoch(2, 250, get=100), _epoch(3, 250, get=100)],
        "cached": [_epoch(1, 196, get=100), _epoch(2, 776), _epoch(3, 776, head=1)],
        "raydata": [_epoch(1, 20, get=100, head=100), _epoch(2, 26, get=100, head=100)],
    }
    goals = cache.goal_figures(rows)
    assert goals["cached_later_requests"] == 1
    assert goals["cached_later_over_local"] == pytest.approx(0.97)
    assert goals["cached_epoch1_over_uncached"] == pytest.approx(0.98)
    assert goals["raydl_later_over_raydata"] == pytest.approx(776 / 26)
    assert goals["cached_later_cpu_over_local"] == pytest.approx(1.0)  # 0.2 s per 100 images in both
    lines = cache.goal_lines(goals)
    assert lines[0] == "cached epochs 2-N: 1 GET+HEAD requests (goal 0: missed)"
    assert "0.97x (goal >= 0.95: met)" in lines[1] and "0.98x (goal >= 0.95: met)" in lines[2]
    assert cache.goal_figures({"local": rows["local"]}) == {}  # nothing to compare: no figure


def test_the_epoch_table_is_markdown_with_one_line_per_epoch():
    """A row's label on its first epoch only; requests and the store's CPU per image; a failed row says so."""
    text = epoch_table([("raydl, S3", [_epoch(1, 123.45, get=7, head=1), _epoch(2, 200)]), ("Ray Data", [])])
    lines = text.splitlines()
    assert (
        lines[0]
        == "| row | epoch | images/s | s | loader CPU ms/img | GET | HEAD | LIST | store CPU ms/img |"
    )
    assert lines[2] == "| raydl, S3 | 1 | 123.5 | 0.81 | 2.00 | 7 | 1 | 0 | 0.50 |"
    assert lines[3].startswith("|  | 2 | 200.0 |") and lines[4].startswith("| Ray Data | failed |")
    assert "GET" not in epoch_table([("one", [_epoch(1, 10)])], requests=False)


def test_the_mix_cost_is_the_median_of_the_rounds_ratios():
    """Per round 1 - mix/one, for epoch 1 and epochs 2-N, and their medians; a round missing a row is left
    out; the output says met or missed against 3%."""
    runs = []
    for r, (one, mixed) in enumerate(((100, 98), (100, 90), (100, 99)), 1):
        runs.append({"round": r, "name": "one", "ok": True, "epochs": [_epoch(1, 50), _epoch(2, one)]})
        runs.append({"round": r, "name": "mix", "ok": True, "epochs": [_epoch(1, 50), _epoch(2, mixed)]})
    runs.append({"round": 4, "name": "one", "ok": True, "epochs": [_epoch(1, 50), _epoch(2, 100)]})
    got = mix.costs(runs)
    assert [p["round"] for p in got["per_round"]] == [1, 2, 3]
    assert got["later"] == pytest.approx(0.02) and got["epoch1"] == 0 and got["later_cpu"] == 0
    table = {row: median_epochs([r for r in runs if r["name"] == row]) for row in mix.ROWS}
    text = mix.render(table, got, _parse(mix, ["--epochs", "2"]))
    assert "+2.0% of images/s in epochs 2-2" in text
    assert "+0.0% loader CPU per image in epochs 2-2" in text and "goal <= 3%: met" in text
    for run in runs:  # the goal is on CPU per image: 10% more of it in the mix is a miss at any rate
        if run["name"] == "mix":
            run["epochs"][1]["loader_cpu_s"] *= 1.1
    text = mix.render(table, mix.costs(runs), _parse(mix, ["--epochs", "2"]))
    assert "+10.0% loader CPU per image" in text and "goal <= 3%: missed" in text
    assert "r2 +0.0% / +10.0%" in text
    runs[0]["epochs"][1]["loader_cpu_s_by_process"] = {"ray::LoaderWorker": 0.15, "driver": 0.05}
    split = {row: process_split(runs, row) for row in mix.ROWS}  # a mean over the row's 4 later epochs
    assert split["one"] == {"LoaderWorker": 0.375, "driver": 0.125} and split["mix"] == {}
    text = mix.render(table, got, _parse(mix, ["--epochs", "2"]), split)
    assert "one source: loader CPU by process, epochs 2-2, ms/img: LoaderWorker 0.38, driver 0.12" in text


def test_split_folder_deals_files_round_robin_keeping_class_folders(tmp_path):
    """File i of the sorted listing goes to part i mod N under its own class folder, linked, not copied."""
    for i in range(7):
        f = tmp_path / "src" / f"c{i % 2}" / f"{i}.jpg"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x")
    parts = mix.split_folder(str(tmp_path / "src"), 3, tmp_path / "parts")
    found = [sorted(p.relative_to(part).as_posix() for p in Path(part).rglob("*.jpg")) for part in parts]
    assert [len(f) for f in found] == [3, 2, 2]
    assert sum(found, []) and all(name.startswith(("c0/", "c1/")) for name in sum(found, []))
    assert (tmp_path / "parts" / "part-0" / "c0" / "0.jpg").stat().st_nlink == 2


def test_the_cache_counters_line_reads_per_epoch():
    """The cached row's own counters print epoch by epoch; evictions and corrupt entries only when any."""
    line = cache.counter_line(
        [
            {"cache_hits": 0, "cache_misses": 20, "bytes_from_store": 2_000_000, "bytes_from_cache": 0},
            {"cache_hits": 20, "cache_misses": 0, "bytes_from_cache": 2_000_000, "cache_corrupt": 1},
        ]
    )
    assert "epoch 1: 0 hits, 20 misses, 2.0 MB from the store, 0.0 MB from the cache;" in line
    assert line.endswith(
        "epoch 2: 20 hits, 0 misses, 0.0 MB from the store, 2.0 MB from the cache, 1 corrupt"
    )
